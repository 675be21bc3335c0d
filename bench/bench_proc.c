/*
 * vmmt bench, scenarios across processes: S3 end-to-end round trip and S8
 * legacy CUDA IPC against vmmt (S5, the pipelined throughput, is in
 * bench_pipe.c). The producer is this process; consumers are bench-peer
 * processes (bench_peer.c) on Unix SEQPACKET sockets, each on the device
 * bench_peer_device gives it.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "cli.h"
#include "status.h"

#define S3_GOAL  1.5
#define S8_GOAL  20.0
#define DRAIN_MS 5000

static const uint64_t g_rt_sizes[] = {4 * BENCH_KIB, BENCH_MIB, 0};

/* ---------------------------------------------------------- round trips */

void bench_consume_msg(struct bench_msg *m, const vmmt_desc *desc, uint32_t rank, uint64_t n)
{
    memset(&m->h, 0, sizeof m->h);
    m->h.op = BOP_CONSUME;
    m->h.rank = rank;
    m->h.nbytes = n;
    memcpy(m->payload, desc->bytes, VMMT_DESC_SIZE);
}

/* Publish, send the descriptor, the peer consumes and synchronizes, its answer arrives. */
int bench_rt_vmmt(struct bench_env *e, vmmt_pool *pool, struct bench_peer *peer, uint64_t n,
                  double *us)
{
    vmmt_buffer b = bench_buffer(e->src, n);
    struct bench_reply r;
    struct bench_msg m;
    vmmt_desc desc;
    double t0 = bench_now_us();
    int st;

    st = vmmt_publish(pool, &b, e->ps, &desc);
    if (st == VMMT_OK) {
        bench_consume_msg(&m, &desc, 0, n);
        st = bench_peer_call(peer, &m, VMMT_DESC_SIZE, &r);
    }
    *us = bench_now_us() - t0;
    /* The peer's acknowledgement is visible: recycle before the next sample. */
    if (st == VMMT_OK) st = VMMT_CU(e->d, cuStreamSynchronize(e->ps));
    return st == VMMT_OK ? vmmt_pool_drain(pool, DRAIN_MS) : st;
}

/* The same message sizes without the GPU: 16 + 512 bytes out, 16 back. */
static int rt_ping(struct bench_peer *peer, double *us)
{
    struct bench_reply r;
    struct bench_msg m;
    double t0;
    int st;

    memset(&m, 0, sizeof m);
    m.h.op = BOP_PING;
    t0 = bench_now_us();
    st = bench_peer_call(peer, &m, VMMT_DESC_SIZE, &r);
    *us = bench_now_us() - t0;
    return st;
}

/* ------------------------------------------------------------------- S3 */

/* One placement of the peer: on its own GPU (the main rows), or on the producer's. */
struct s3_cfg {
    const char *label, *tag; /* row label and series prefix */
    int device;              /* the peer's */
    const uint64_t *sizes;
    double goal; /* at 4 KiB; 0: reported only */
};

struct s3_series {
    struct bench_series *rt, *ping, *copy, *xcopy;
    struct bench_series *two; /* peer on the producer's GPU: the two-process floor */
};

/* What an S3 sample needs, for bench_alternate. */
struct s3_sample {
    struct bench_env *e;
    vmmt_pool *pool;
    struct bench_peer *peer;
};

static int s3_rt_sample(void *ctx, uint64_t n, double *us)
{
    struct s3_sample *x = ctx;
    return bench_rt_vmmt(x->e, x->pool, x->peer, n, us);
}

static int s3_twoproc_sample(void *ctx, uint64_t n, double *us)
{
    struct s3_sample *x = ctx;
    return bench_twoproc_sample(x->e, x->peer, n, us);
}

/*
 * Peer on its own GPU: the floor's parts alternate with each other, and all
 * come before the round trips, since the consume copy's part runs in this
 * process on the peer's GPU and alternating it with the peer's own work there
 * would make both pay a context switch each time.
 */
static int s3_floor_parts(struct bench_env *e, struct bench_peer *peer, struct bench_xpath *xp,
                          uint64_t n, struct s3_series *s)
{
    int reps = bench_reps(e, n), warm = bench_warmup(reps), st = VMMT_OK;
    double ping, copy, xcopy;

    for (int i = 0; i < warm + reps && st == VMMT_OK; i++) {
        st = rt_ping(peer, &ping);
        if (st == VMMT_OK) st = bench_copy_sample(e, e->ps, n, &copy);
        if (st == VMMT_OK) st = bench_xpath_sample(xp, n, &xcopy);
        if (st != VMMT_OK || i < warm) continue;
        if (bench_series_add(s->ping, ping) || bench_series_add(s->copy, copy) ||
            bench_series_add(s->xcopy, xcopy))
            st = VMMT_ENOMEM;
    }
    return st;
}

/*
 * Peer on the producer's GPU: the floor is the two-process floor, measured
 * as S10 measures it, alternating with the round trips. Parts timed in this
 * process would be wrong here twice over: a copy in one process pays no
 * switch between contexts, and a part that follows the peer's work pays the
 * switch another part then does not (the first H200 run put 147 us into the
 * "publish copy" part and left 172 us for a two-process floor that, measured
 * this way, is 329 us).
 */
static int s3_size(struct bench_env *e, vmmt_pool *pool, struct bench_peer *peer,
                   struct bench_xpath *xp, uint64_t n, struct s3_series *s)
{
    int reps = bench_reps(e, n), warm = bench_warmup(reps), st;
    struct s3_sample x = {e, pool, peer};
    double rt;

    if (s->two != NULL) {
        st = bench_alternate(e, n, s3_twoproc_sample, &x, s->two, s3_rt_sample, &x, s->rt);
        return st == VMMT_OK ? bench_peer_verify(peer, n) : st;
    }
    st = s3_floor_parts(e, peer, xp, n, s);
    for (int i = 0; i < warm + reps && st == VMMT_OK; i++) {
        st = bench_rt_vmmt(e, pool, peer, n, &rt);
        if (st == VMMT_OK && i >= warm && bench_series_add(s->rt, rt)) st = VMMT_ENOMEM;
    }
    return st == VMMT_OK ? bench_peer_verify(peer, n) : st;
}

static void s3_row(struct bench_env *e, const struct s3_cfg *c, uint64_t n,
                   const struct s3_series *s)
{
    struct bench_summary rt, ping, copy, xcopy, two;
    struct bench_row *row;
    char sz[16], own[16], path[24];
    double floor;

    bench_summarize(s->rt, &rt);
    row = bench_row_add(e->rep, "S3", "us", "%s %s", c->label, bench_size_name(n, sz, sizeof sz));
    if (s->two != NULL) {
        bench_summarize(s->two, &two);
        bench_row_values(row, rt.p50, rt.p99, two.p50, rt.p50 / two.p50);
        if (n == 4 * BENCH_KIB && c->goal > 0)
            bench_row_goal(row, BENCH_GOAL_RATIO_MAX, c->goal, 0);
        bench_row_note(row,
                       "peer on GPU %d, the producer's: floor = the two-process floor (producer "
                       "DtoD+sync, then the peer's DtoD+sync, no vmmt), alternating with the "
                       "round trips: both pay a context switch each way",
                       c->device);
        return;
    }
    bench_summarize(s->ping, &ping);
    bench_summarize(s->copy, &copy);
    bench_summarize(s->xcopy, &xcopy);
    floor = ping.p50 + copy.p50 + xcopy.p50;
    bench_row_values(row, rt.p50, rt.p99, floor, rt.p50 / floor);
    if (n == 4 * BENCH_KIB && c->goal > 0) bench_row_goal(row, BENCH_GOAL_RATIO_MAX, c->goal, 0);
    bench_path_name(e, e->device, own, sizeof own);
    bench_path_name(e, c->device, path, sizeof path);
    bench_row_note(row,
                   "peer on GPU %d; floor = socket ping-pong p50 %.2f + publish copy on %s "
                   "p50 %.2f + consume copy %s p50 %.2f us (one process)",
                   c->device, ping.p50, own, copy.p50, path, xcopy.p50);
}

static int s3_series_new(struct bench_env *e, const struct s3_cfg *c, const char *sz,
                         struct s3_series *s)
{
    memset(s, 0, sizeof *s);
    s->rt = bench_series_new(e->rep, "us", "S3 %sround trip %s", c->tag, sz);
    if (c->device == e->device) {
        s->two = bench_series_new(e->rep, "us", "S3 %sfloor two processes %s", c->tag, sz);
        return s->rt && s->two ? VMMT_OK : VMMT_ENOMEM;
    }
    s->ping = bench_series_new(e->rep, "us", "S3 %sfloor socket ping-pong %s", c->tag, sz);
    s->copy = bench_series_new(e->rep, "us", "S3 %sfloor publish DtoD+sync %s", c->tag, sz);
    s->xcopy = bench_series_new(e->rep, "us", "S3 %sfloor consume copy to GPU %d+sync %s", c->tag,
                                c->device, sz);
    return s->rt && s->ping && s->copy && s->xcopy ? VMMT_OK : VMMT_ENOMEM;
}

static int s3_config(struct bench_env *e, vmmt_pool *pool, const struct s3_cfg *c)
{
    struct bench_peer peer = {-1, -1};
    struct bench_xpath xp;
    int rc = CLI_OK;

    if (bench_xpath_open(e, c->device, BENCH_MIB, &xp) != VMMT_OK ||
        bench_peer_spawn(e, c->device, &peer) != VMMT_OK) {
        rc = bench_fail(e, "S3", c->label, "starting the peer and the floor's copy path");
        goto out;
    }
    for (const uint64_t *n = c->sizes; *n; n++) {
        struct s3_series s;
        char sz[16];
        bench_size_name(*n, sz, sizeof sz);
        if (s3_series_new(e, c, sz, &s) != VMMT_OK ||
            s3_size(e, pool, &peer, &xp, *n, &s) != VMMT_OK) {
            rc = bench_fail(e, "S3", c->label, sz);
            break;
        }
        s3_row(e, c, *n, &s);
    }
    /* The peer unmaps the pool before the pool goes away. */
    if (peer.pid > 0 && bench_peer_reset(&peer) != VMMT_OK && rc == CLI_OK)
        rc = bench_fail(e, "S3", c->label, "resetting the peer");
out:
    bench_peer_stop(&peer);
    bench_xpath_close(&xp);
    return rc;
}

int bench_s3(struct bench_env *e)
{
    static const uint64_t small[] = {4 * BENCH_KIB, 0};
    const struct s3_cfg cfg[2] = {
        {"end to end, 2 processes", "", bench_peer_device(e, 0), g_rt_sizes, S3_GOAL},
        /* Kept to show what time-slicing one GPU between two processes costs. */
        {"end to end, same GPU", "same GPU ", e->device, small, 0},
    };
    vmmt_pool *pool = NULL;
    int rc = CLI_OK;

    if (bench_pool_create(e, 64 * BENCH_MIB, 1, 64, &pool) != VMMT_OK)
        return bench_fail(e, "S3", "end to end", "creating the pool");
    for (int i = 0; i < 2 && rc == CLI_OK; i++)
        rc = s3_config(e, pool, &cfg[i]);
    vmmt_pool_destroy(pool);
    return rc;
}

/* ------------------------------------------------------------------- S8 */

/* A fresh buffer each time, as a new tensor would be; allocation and free are not timed. */
static int rt_ipc(struct bench_env *e, struct bench_ipc *ipc, struct bench_peer *peer, uint64_t n,
                  double *us)
{
    const struct vmmt_drv *d = e->d;
    CUdeviceptr buf = 0;
    bench_ipc_handle h;
    struct bench_reply r;
    struct bench_msg m;
    double t0;
    int st;

    *us = 0;
    st = VMMT_CU(d, cuMemAlloc(&buf, n));
    if (st == VMMT_OK) st = VMMT_CU(d, cuMemcpyDtoDAsync(buf, e->src, n, e->ps));
    if (st == VMMT_OK) st = VMMT_CU(d, cuStreamSynchronize(e->ps));
    if (st != VMMT_OK) goto out;
    memset(&m, 0, sizeof m);
    m.h.op = BOP_IPC;
    m.h.nbytes = n;
    t0 = bench_now_us();
    st = vmmt__cu_check(ipc->get(&h, buf), "cuIpcGetMemHandle");
    if (st == VMMT_OK) {
        memcpy(m.payload, &h, sizeof h);
        st = bench_peer_call(peer, &m, sizeof h, &r);
    }
    *us = bench_now_us() - t0;
out:
    if (buf != 0) d->cuMemFree(buf);
    return st;
}

struct s8_ctx {
    struct bench_ipc ipc;
    struct bench_peer peer;
    int device; /* the peer's */
    vmmt_pool *pool;
};

static int s8_size(struct bench_env *e, struct s8_ctx *x, uint64_t n, struct bench_series *ipc,
                   struct bench_series *vm)
{
    int reps = bench_reps(e, n), warm = bench_warmup(reps), st = VMMT_OK;
    double a, b;

    for (int i = 0; i < warm + reps && st == VMMT_OK; i++) {
        double fill;
        /*
         * The producer's own write of the tensor, not timed, as rt_ipc fills
         * its fresh buffer: on a GPU the peer shares, both round trips then
         * start in the producer's context and pay the one switch to the peer's.
         */
        st = bench_copy_sample(e, e->ps, n, &fill);
        if (st == VMMT_OK) st = bench_rt_vmmt(e, x->pool, &x->peer, n, &b);
        if (st == VMMT_OK) st = rt_ipc(e, &x->ipc, &x->peer, n, &a);
        if (st == VMMT_OK && i >= warm && (bench_series_add(ipc, a) || bench_series_add(vm, b)))
            st = VMMT_ENOMEM;
    }
    return st == VMMT_OK ? bench_peer_verify(&x->peer, n) : st;
}

static void s8_row(struct bench_env *e, const struct s8_ctx *x, uint64_t n,
                   const struct bench_series *ipc, const struct bench_series *vm)
{
    struct bench_summary a, b;
    struct bench_row *row;
    char sz[16];

    bench_summarize(ipc, &a);
    bench_summarize(vm, &b);
    row = bench_row_add(e->rep, "S8", "us", "legacy IPC end to end %s",
                        bench_size_name(n, sz, sizeof sz));
    bench_row_values(row, a.p50, a.p99, b.p50, a.p50 / b.p50);
    if (n == 4 * BENCH_KIB) bench_row_goal(row, BENCH_GOAL_RATIO_MIN, S8_GOAL, 0);
    bench_row_note(row,
                   "peer on GPU %d; floor column: vmmt's S3 round trip with the same peer, "
                   "alternating, each after the producer's untimed write of the buffer; ratio: "
                   "how many times faster vmmt is",
                   x->device);
}

static int s8_skip(struct bench_env *e, const char *why)
{
    for (const uint64_t *n = g_rt_sizes; *n; n++) {
        char sz[16];
        struct bench_row *row = bench_row_add(e->rep, "S8", "us", "legacy IPC end to end %s",
                                              bench_size_name(*n, sz, sizeof sz));
        if (row == NULL) continue;
        row->skipped = 1;
        bench_row_note(row, "skipped: %s", why);
    }
    printf(" skipped: %s", why);
    return CLI_OK;
}

int bench_s8(struct bench_env *e)
{
    struct s8_ctx x;
    char why[300];
    int rc = CLI_OK;

    memset(&x, 0, sizeof x);
    x.peer = (struct bench_peer){-1, -1};
    x.device = bench_peer_device(e, 0);
    if (strcmp(e->driver, "cuda") != 0) return s8_skip(e, "needs the real driver");
    if (bench_ipc_load(&x.ipc, why, sizeof why) != 0) return s8_skip(e, why);
    if (bench_pool_create(e, 64 * BENCH_MIB, 1, 64, &x.pool) != VMMT_OK ||
        bench_peer_spawn(e, x.device, &x.peer) != VMMT_OK) {
        rc = bench_fail(e, "S8", "legacy IPC", "creating the pool and the peer");
        goto out;
    }
    for (const uint64_t *n = g_rt_sizes; *n; n++) {
        char sz[16];
        struct bench_series *ipc, *vm;
        bench_size_name(*n, sz, sizeof sz);
        ipc = bench_series_new(e->rep, "us", "S8 legacy IPC round trip %s", sz);
        vm = bench_series_new(e->rep, "us", "S8 vmmt round trip %s", sz);
        if (!ipc || !vm || s8_size(e, &x, *n, ipc, vm) != VMMT_OK) {
            rc = bench_fail(e, "S8", "legacy IPC", sz);
            break;
        }
        s8_row(e, &x, *n, ipc, vm);
    }
    if (x.peer.pid > 0) bench_peer_reset(&x.peer);
out:
    bench_peer_stop(&x.peer);
    vmmt_pool_destroy(x.pool);
    bench_ipc_unload(&x.ipc);
    return rc;
}
