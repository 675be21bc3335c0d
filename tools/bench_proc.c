/*
 * vmmt bench, scenarios across processes: S3 end-to-end round trip, S5
 * pipelined throughput to 1, 2 and 4 consumer processes, S8 legacy CUDA IPC
 * against vmmt. The producer is this process; consumers are bench-peer
 * processes (bench_peer.c) on Unix SEQPACKET sockets.
 */
#include <math.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "bench.h"
#include "cli.h"
#include "status.h"

#define S3_GOAL   1.5
#define S5_GOAL   0.8
#define S8_GOAL   20.0
#define S5_PEERS  4
#define S5_WINDOW 32 /* messages a consumer may have outstanding: bounds socket queues */
#define DRAIN_MS  5000

static const uint64_t g_rt_sizes[] = {4 * BENCH_KIB, BENCH_MIB, 0};

/* ---------------------------------------------------------- round trips */

static void consume_msg(struct bench_msg *m, const vmmt_desc *desc, uint32_t rank, uint64_t n)
{
    memset(&m->h, 0, sizeof m->h);
    m->h.op = BOP_CONSUME;
    m->h.rank = rank;
    m->h.nbytes = n;
    memcpy(m->payload, desc->bytes, VMMT_DESC_SIZE);
}

/* Publish, send the descriptor, the peer consumes and synchronizes, its answer arrives. */
static int rt_vmmt(struct bench_env *e, vmmt_pool *pool, struct bench_peer *peer, uint64_t n,
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
        consume_msg(&m, &desc, 0, n);
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

static int peer_verify(struct bench_peer *peer, uint64_t n)
{
    struct bench_reply r;
    struct bench_msg m;

    memset(&m, 0, sizeof m);
    m.h.op = BOP_VERIFY;
    m.h.nbytes = n;
    return bench_peer_call(peer, &m, 0, &r);
}

static int peer_reset(struct bench_peer *peer)
{
    struct bench_reply r;
    struct bench_msg m;

    memset(&m, 0, sizeof m);
    m.h.op = BOP_RESET;
    return bench_peer_call(peer, &m, 0, &r);
}

/* ------------------------------------------------------------------- S3 */

struct s3_series {
    struct bench_series *rt, *ping, *copy;
};

static int s3_size(struct bench_env *e, vmmt_pool *pool, struct bench_peer *peer, uint64_t n,
                   struct s3_series *s)
{
    int reps = bench_reps(e, n), warm = bench_warmup(reps), st = VMMT_OK;
    double rt, ping, copy;

    for (int i = 0; i < warm + reps && st == VMMT_OK; i++) {
        st = rt_ping(peer, &ping);
        if (st == VMMT_OK) st = bench_copy_sample(e, e->ps, n, &copy);
        if (st == VMMT_OK) st = rt_vmmt(e, pool, peer, n, &rt);
        if (st != VMMT_OK || i < warm) continue;
        if (bench_series_add(s->rt, rt) || bench_series_add(s->ping, ping) ||
            bench_series_add(s->copy, copy))
            st = VMMT_ENOMEM;
    }
    return st == VMMT_OK ? peer_verify(peer, n) : st;
}

static void s3_row(struct bench_env *e, uint64_t n, const struct s3_series *s)
{
    struct bench_summary rt, ping, copy;
    struct bench_row *row;
    double floor;
    char sz[16];

    bench_summarize(s->rt, &rt);
    bench_summarize(s->ping, &ping);
    bench_summarize(s->copy, &copy);
    floor = ping.p50 + 2 * copy.p50;
    row = bench_row_add(e->rep, "S3", "us", "end to end, 2 processes %s",
                        bench_size_name(n, sz, sizeof sz));
    bench_row_values(row, rt.p50, rt.p99, floor, rt.p50 / floor);
    if (n == 4 * BENCH_KIB) bench_row_goal(row, BENCH_GOAL_RATIO_MAX, S3_GOAL, 0);
    bench_row_note(row, "floor = socket ping-pong p50 %.2f us + 2 x copy p50 %.2f us", ping.p50,
                   copy.p50);
}

int bench_s3(struct bench_env *e)
{
    struct bench_peer peer = {-1, -1};
    vmmt_pool *pool = NULL;
    int rc = CLI_OK;

    if (bench_pool_create(e, 64 * BENCH_MIB, 1, 64, &pool) != VMMT_OK ||
        bench_peer_spawn(e, &peer) != VMMT_OK) {
        rc = bench_fail(e, "S3", "end to end", "creating the pool and the peer");
        goto out;
    }
    for (const uint64_t *n = g_rt_sizes; *n; n++) {
        struct s3_series s;
        char sz[16];
        bench_size_name(*n, sz, sizeof sz);
        s.rt = bench_series_new(e->rep, "us", "S3 round trip %s", sz);
        s.ping = bench_series_new(e->rep, "us", "S3 floor socket ping-pong %s", sz);
        s.copy = bench_series_new(e->rep, "us", "S3 floor DtoD+sync %s", sz);
        if (!s.rt || !s.ping || !s.copy || s3_size(e, pool, &peer, *n, &s) != VMMT_OK) {
            rc = bench_fail(e, "S3", "end to end", sz);
            break;
        }
        s3_row(e, *n, &s);
    }
    if (peer.pid > 0) peer_reset(&peer);
out:
    bench_peer_stop(&peer);
    vmmt_pool_destroy(pool);
    return rc;
}

/* ------------------------------------------------------------------- S5 */

struct s5_run {
    struct bench_env *e;
    vmmt_pool *pool;
    struct bench_peer *peers;
    int k;
    uint64_t size;
    uint32_t count, sent;
    uint64_t done[S5_PEERS];
};

static uint64_t s5_min_done(const struct s5_run *r)
{
    uint64_t m = r->done[0];
    for (int k = 1; k < r->k; k++)
        if (r->done[k] < m) m = r->done[k];
    return m;
}

/* Take every reply that is there, waiting at most wait_ms for the first. */
static int s5_collect(struct s5_run *r, int wait_ms)
{
    struct pollfd pf[S5_PEERS];
    struct bench_reply rep;

    for (int k = 0; k < r->k; k++)
        pf[k] = (struct pollfd){r->peers[k].sock, POLLIN, 0};
    if (poll(pf, (nfds_t)r->k, wait_ms) < 0) return vmmt__sys_fail("poll on the peers");
    for (int k = 0; k < r->k; k++) {
        if (!(pf[k].revents & (POLLIN | POLLHUP))) continue;
        do {
            int st = bench_peer_recv(&r->peers[k], &rep, 0);
            if (st != VMMT_OK) return st;
            r->done[k] += rep.count;
            pf[k] = (struct pollfd){r->peers[k].sock, POLLIN, 0};
        } while (poll(&pf[k], 1, 0) > 0);
    }
    return VMMT_OK;
}

/* The pool full means consumers still hold every slice: wait for their replies, retry. */
static int s5_publish(struct s5_run *r, vmmt_desc *desc)
{
    vmmt_buffer b = bench_buffer(r->e->src, r->size);
    double give_up = bench_now_us() + BENCH_TIMEOUT_MS * 1e3;
    int st;

    while ((st = vmmt_publish(r->pool, &b, r->e->ps, desc)) == VMMT_EFULL &&
           bench_now_us() < give_up)
        if ((st = s5_collect(r, 1)) != VMMT_OK) return st;
    return st;
}

static int s5_send_all(struct s5_run *r, const vmmt_desc *desc)
{
    struct bench_msg m;
    int st = VMMT_OK;

    for (int k = 0; k < r->k && st == VMMT_OK; k++) {
        consume_msg(&m, desc, (uint32_t)k, r->size);
        st = bench_peer_send(&r->peers[k], &m, VMMT_DESC_SIZE);
    }
    return st;
}

static int s5_wait_all(struct s5_run *r, uint64_t until)
{
    double give_up = bench_now_us() + BENCH_TIMEOUT_MS * 1e3;
    int st = VMMT_OK;

    while (st == VMMT_OK && s5_min_done(r) < until)
        st = bench_now_us() < give_up
                 ? s5_collect(r, 100)
                 : vmmt__fail(VMMT_ETIMEDOUT, "consumers did not answer within %d ms",
                              BENCH_TIMEOUT_MS);
    return st;
}

/* One pipelined run: from the first publish until every consumer answered for every message. */
static int s5_once(struct s5_run *r, double *us)
{
    double t0 = bench_now_us();
    vmmt_desc desc;
    int st = VMMT_OK;

    r->sent = 0;
    memset(r->done, 0, sizeof r->done);
    for (uint32_t i = 0; i < r->count && st == VMMT_OK; i++) {
        if (r->sent >= S5_WINDOW) st = s5_wait_all(r, r->sent - S5_WINDOW + 1);
        if (st == VMMT_OK) st = s5_publish(r, &desc);
        if (st == VMMT_OK) st = s5_send_all(r, &desc);
        if (st == VMMT_OK) r->sent++;
        if (st == VMMT_OK) st = s5_collect(r, 0);
    }
    if (st == VMMT_OK) st = s5_wait_all(r, r->count);
    if (st == VMMT_OK) st = VMMT_CU(r->e->d, cuStreamSynchronize(r->e->ps));
    *us = bench_now_us() - t0;
    return st == VMMT_OK ? vmmt_pool_drain(r->pool, DRAIN_MS) : st;
}

/* The same bytes as every copy of a run, as DtoD copies of the message size on one stream. */
static int s5_floor(struct bench_env *e, uint64_t size, uint64_t copies, double *us)
{
    double t0 = bench_now_us();
    int st = VMMT_OK;

    for (uint64_t i = 0; i < copies && st == VMMT_OK; i++)
        st = VMMT_CU(e->d, cuMemcpyDtoDAsync(e->tmp, e->src, size, e->ps));
    if (st == VMMT_OK) st = VMMT_CU(e->d, cuStreamSynchronize(e->ps));
    *us = bench_now_us() - t0;
    return st;
}

static int s5_runs(struct s5_run *r, int runs, struct bench_series *s, struct bench_series *fl)
{
    uint64_t copies = (uint64_t)r->count * (uint64_t)(r->k + 1);
    int st = VMMT_OK;
    double v, f;

    /* One unmeasured run: imports, first-touch and the recycler's start. */
    for (int i = 0; i < runs + 1 && st == VMMT_OK; i++) {
        st = s5_floor(r->e, r->size, copies, &f);
        if (st == VMMT_OK) st = s5_once(r, &v);
        if (st == VMMT_OK && i > 0 && (bench_series_add(s, v) || bench_series_add(fl, f)))
            st = VMMT_ENOMEM;
    }
    for (int k = 0; k < r->k && st == VMMT_OK; k++)
        st = peer_verify(&r->peers[k], r->size);
    return st;
}

static void s5_rows(struct s5_run *r, const struct bench_series *s, const struct bench_series *fl,
                    int goal)
{
    struct bench_summary m, f;
    double copies = (double)r->count * (double)(r->k + 1);
    double bytes = copies * (double)r->size;
    struct bench_row *row;
    char sz[16];

    bench_summarize(s, &m);
    bench_summarize(fl, &f);
    bench_size_name(r->size, sz, sizeof sz);
    row = bench_row_add(r->e->rep, "S5", "GB/s", "%d consumer(s) x %s, all copies", r->k, sz);
    bench_row_values(row, bytes / m.p50 / 1e3, bytes / m.p99 / 1e3, bytes / f.p50 / 1e3,
                     f.p50 / m.p50);
    if (goal) bench_row_goal(row, BENCH_GOAL_RATIO_MIN, S5_GOAL, 0);
    bench_row_note(row,
                   "%u messages; bytes = (1 publish + %d consumes) x %s; delivered to "
                   "consumers %.2f GB/s",
                   r->count, r->k, sz,
                   (double)r->k * (double)r->count * (double)r->size / m.p50 / 1e3);
    row = bench_row_add(r->e->rep, "S5", "msg/s", "%d consumer(s) x %s, messages", r->k, sz);
    bench_row_values(row, r->count / m.p50 * 1e6, r->count / m.p99 * 1e6, NAN, NAN);
    bench_row_note(row, "a message counts once it is consumed by all %d consumer(s)", r->k);
}

/* Each run is a few thousand messages already: fewer repetitions than a single call gets. */
static int s5_run_count(const struct bench_env *e)
{
    if (e->opt.reps > 0) return e->opt.reps / 40 > 3 ? e->opt.reps / 40 : 3;
    return e->opt.quick ? 3 : 5;
}

static int s5_config(struct bench_env *e, struct bench_peer *peers, int k, uint64_t size,
                     uint32_t count, int goal)
{
    struct s5_run r = {e, NULL, peers, k, size, count, 0, {0}};
    uint64_t mem =
        (S5_WINDOW + 16) * size > 32 * BENCH_MIB ? (S5_WINDOW + 16) * size : 32 * BENCH_MIB;
    struct bench_series *s, *fl;
    char sz[16];
    int st;

    bench_size_name(size, sz, sizeof sz);
    s = bench_series_new(e->rep, "us", "S5 run of %u x %s to %d consumer(s)", count, sz, k);
    fl = bench_series_new(e->rep, "us", "S5 floor %llu DtoD of %s",
                          (unsigned long long)count * (k + 1), sz);
    if (!s || !fl) return bench_fail(e, "S5", "throughput", "too many series");
    st = bench_pool_create(e, mem, k, 4096, &r.pool);
    if (st == VMMT_OK) st = s5_runs(&r, s5_run_count(e), s, fl);
    /* Consumers unmap the pool before it goes away. */
    for (int i = 0; i < k && r.pool != NULL; i++)
        if (peer_reset(&peers[i]) != VMMT_OK && st == VMMT_OK) st = vmmt_last_status();
    vmmt_pool_destroy(r.pool);
    if (st != VMMT_OK) return bench_fail(e, "S5", "throughput", sz);
    s5_rows(&r, s, fl, goal);
    return CLI_OK;
}

int bench_s5(struct bench_env *e)
{
    static const int ks[] = {1, 2, 4};
    uint64_t small = 64 * BENCH_KIB, big = e->opt.quick ? BENCH_MIB : 4 * BENCH_MIB;
    uint32_t nsmall = e->opt.quick ? 64 : 2000, nbig = e->opt.quick ? 32 : 250;
    struct bench_peer peers[S5_PEERS];
    int rc = CLI_OK;

    for (int k = 0; k < S5_PEERS; k++)
        peers[k] = (struct bench_peer){-1, -1};
    for (int k = 0; k < S5_PEERS && rc == CLI_OK; k++)
        if (bench_peer_spawn(e, &peers[k]) != VMMT_OK)
            rc = bench_fail(e, "S5", "throughput", "starting the consumer processes");
    for (int i = 0; i < 3 && rc == CLI_OK; i++) {
        rc = s5_config(e, peers, ks[i], small, nsmall, 0);
        if (rc == CLI_OK) rc = s5_config(e, peers, ks[i], big, nbig, 1);
    }
    for (int k = 0; k < S5_PEERS; k++)
        bench_peer_stop(&peers[k]);
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
    vmmt_pool *pool;
};

static int s8_size(struct bench_env *e, struct s8_ctx *x, uint64_t n, struct bench_series *ipc,
                   struct bench_series *vm)
{
    int reps = bench_reps(e, n), warm = bench_warmup(reps), st = VMMT_OK;
    double a, b;

    for (int i = 0; i < warm + reps && st == VMMT_OK; i++) {
        st = rt_vmmt(e, x->pool, &x->peer, n, &b);
        if (st == VMMT_OK) st = rt_ipc(e, &x->ipc, &x->peer, n, &a);
        if (st == VMMT_OK && i >= warm && (bench_series_add(ipc, a) || bench_series_add(vm, b)))
            st = VMMT_ENOMEM;
    }
    return st == VMMT_OK ? peer_verify(&x->peer, n) : st;
}

static void s8_row(struct bench_env *e, uint64_t n, const struct bench_series *ipc,
                   const struct bench_series *vm)
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
    bench_row_note(row, "floor column: vmmt's S3 round trip in this run; ratio: how many times "
                        "faster vmmt is");
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
    if (strcmp(e->driver, "cuda") != 0) return s8_skip(e, "needs the real driver");
    if (bench_ipc_load(&x.ipc, why, sizeof why) != 0) return s8_skip(e, why);
    if (bench_pool_create(e, 64 * BENCH_MIB, 1, 64, &x.pool) != VMMT_OK ||
        bench_peer_spawn(e, &x.peer) != VMMT_OK) {
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
        s8_row(e, *n, ipc, vm);
    }
    if (x.peer.pid > 0) peer_reset(&x.peer);
out:
    bench_peer_stop(&x.peer);
    vmmt_pool_destroy(x.pool);
    bench_ipc_unload(&x.ipc);
    return rc;
}
