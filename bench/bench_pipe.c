/*
 * vmmt bench, S5: pipelined throughput from one producer to 1, 2 and 4
 * consumer processes, every message consumed by every consumer. Consumers
 * run on the devices bench_peer_device gives them; the floor is each path's
 * copies done directly: the producer's copies into the pool as local DtoD,
 * the consumers' copies out of it as copies from the producer's device to
 * theirs, one stream per consumer device, all devices at once. With every
 * consumer on the producer's GPU, where processes time-slice the device and
 * no copy done in one process shows that, the floor is the same pipeline run
 * by the same processes without vmmt (s5_once with plain set).
 */
#include <math.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>

#include "bench.h"
#include "cli.h"
#include "status.h"

#define S5_GOAL   0.8
#define S5_PEERS  4
#define S5_WINDOW 32 /* messages a consumer may have outstanding: bounds socket queues */
#define DRAIN_MS  5000

/* The consumers' side of the floor: one copy path per distinct consumer device. */
struct s5_paths {
    struct bench_xpath x[S5_PEERS];
    int n;
};

struct s5_run {
    struct bench_env *e;
    vmmt_pool *pool;
    struct bench_peer *peers;
    const int *dev; /* dev[k]: consumer k's device */
    struct s5_paths *paths;
    int k;
    uint64_t size;
    uint32_t count, sent;
    uint64_t done[S5_PEERS];
    int same;  /* every consumer on the producer's device */
    int plain; /* this run is the same-GPU floor: no vmmt */
};

struct s5_series {
    struct bench_series *run, *local, *cross;
    struct bench_series *plain; /* same GPU: the pipeline without vmmt */
};

/* ------------------------------------------------------------ one run */

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

/* The floor's message is as long as a descriptor's, so the sockets carry the same bytes. */
static int s5_send_all(struct s5_run *r, const vmmt_desc *desc)
{
    struct bench_msg m;
    int st = VMMT_OK;

    for (int k = 0; k < r->k && st == VMMT_OK; k++) {
        if (r->plain) {
            memset(&m, 0, sizeof m);
            m.h.op = BOP_COPY;
            m.h.nbytes = r->size;
        } else {
            bench_consume_msg(&m, desc, (uint32_t)k, r->size);
        }
        st = bench_peer_send(&r->peers[k], &m, VMMT_DESC_SIZE);
    }
    return st;
}

/*
 * The floor's publish: the producer's copy of the message on its stream, as
 * vmmt_publish enqueues it. Nothing orders the consumers' copies after it: a
 * floor may leave out what a user would need, never add to it.
 */
static int s5_put(struct s5_run *r, vmmt_desc *desc)
{
    if (r->plain)
        return VMMT_CU(r->e->d, cuMemcpyDtoDAsync(r->e->tmp, r->e->src, r->size, r->e->ps));
    return s5_publish(r, desc);
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
        if (st == VMMT_OK) st = s5_put(r, &desc);
        if (st == VMMT_OK) st = s5_send_all(r, &desc);
        if (st == VMMT_OK) r->sent++;
        if (st == VMMT_OK) st = s5_collect(r, 0);
    }
    if (st == VMMT_OK) st = s5_wait_all(r, r->count);
    if (st == VMMT_OK) st = VMMT_CU(r->e->d, cuStreamSynchronize(r->e->ps));
    *us = bench_now_us() - t0;
    return st == VMMT_OK && !r->plain ? vmmt_pool_drain(r->pool, DRAIN_MS) : st;
}

/* -------------------------------------------------------------- floor */

/* Consumers of this run on the device. */
static int s5_peers_on(const struct s5_run *r, int device)
{
    int n = 0;
    for (int k = 0; k < r->k; k++)
        n += r->dev[k] == device;
    return n;
}

/* The producer's copies of a run: one per message, DtoD on its stream. */
static int s5_floor_local(struct s5_run *r, double *us)
{
    struct bench_env *e = r->e;
    double t0 = bench_now_us();
    int st = VMMT_OK;

    for (uint32_t i = 0; i < r->count && st == VMMT_OK; i++)
        st = VMMT_CU(e->d, cuMemcpyDtoDAsync(e->tmp, e->src, r->size, e->ps));
    if (st == VMMT_OK) st = VMMT_CU(e->d, cuStreamSynchronize(e->ps));
    *us = bench_now_us() - t0;
    return st;
}

/*
 * The consumers' copies of a run: on each consumer device's stream the copies
 * of the consumers there, every device at once, since their copies overlap
 * in a run too. Consumers sharing a device share its link, hence one stream.
 */
static int s5_floor_cross(struct s5_run *r, double *us)
{
    struct s5_paths *p = r->paths;
    double t0 = bench_now_us();
    int st = VMMT_OK;

    for (int i = 0; i < p->n && st == VMMT_OK; i++) {
        int m = s5_peers_on(r, p->x[i].device);
        if (m > 0) st = bench_xpath_enqueue(&p->x[i], r->size, (uint64_t)m * r->count);
    }
    for (int i = 0; i < p->n && st == VMMT_OK; i++)
        if (s5_peers_on(r, p->x[i].device) > 0) st = bench_xpath_sync(&p->x[i]);
    *us = bench_now_us() - t0;
    return st;
}

/*
 * Floor runs first, then the runs, each block after one unmeasured run
 * (imports, first-touch, the recycler's start): the floor's copies to a
 * consumer's device come from this process's context there, and switching
 * between that and a consumer's context on every run would tax both.
 */
static int s5_runs_apart(struct s5_run *r, int runs, struct s5_series *s)
{
    int st = VMMT_OK;
    double a, b;

    for (int i = 0; i < runs + 1 && st == VMMT_OK; i++) {
        st = s5_floor_local(r, &a);
        if (st == VMMT_OK) st = s5_floor_cross(r, &b);
        if (st == VMMT_OK && i > 0 &&
            (bench_series_add(s->local, a) || bench_series_add(s->cross, b)))
            st = VMMT_ENOMEM;
    }
    for (int i = 0; i < runs + 1 && st == VMMT_OK; i++) {
        st = s5_once(r, &a);
        if (st == VMMT_OK && i > 0 && bench_series_add(s->run, a)) st = VMMT_ENOMEM;
    }
    return st;
}

/*
 * Every consumer on the producer's GPU: the floor is the same processes'
 * pipeline without vmmt, so the two alternate run by run, as the same-GPU
 * floors of S3 and S10 alternate sample by sample.
 */
static int s5_runs_same(struct s5_run *r, int runs, struct s5_series *s)
{
    int st = VMMT_OK;
    double a, b;

    for (int i = 0; i < runs + 1 && st == VMMT_OK; i++) {
        r->plain = 1;
        st = s5_once(r, &a);
        r->plain = 0;
        if (st == VMMT_OK) st = s5_once(r, &b);
        if (st == VMMT_OK && i > 0 &&
            (bench_series_add(s->plain, a) || bench_series_add(s->run, b)))
            st = VMMT_ENOMEM;
    }
    return st;
}

static int s5_runs(struct s5_run *r, int runs, struct s5_series *s)
{
    int st = r->same ? s5_runs_same(r, runs, s) : s5_runs_apart(r, runs, s);

    for (int k = 0; k < r->k && st == VMMT_OK; k++)
        st = bench_peer_verify(&r->peers[k], r->size);
    return st;
}

/* --------------------------------------------------------------- rows */

static const char *s5_devices(const struct s5_run *r, char *buf, size_t cap)
{
    size_t at = 0;

    buf[0] = '\0';
    for (int k = 0; k < r->k && at < cap; k++)
        at += (size_t)snprintf(buf + at, cap - at, "%s%d", k ? "," : "", r->dev[k]);
    return buf;
}

static int s5_streams(const struct s5_run *r)
{
    int n = 0;
    for (int i = 0; i < r->paths->n; i++)
        n += s5_peers_on(r, r->paths->x[i].device) > 0;
    return n;
}

/* The floor time is the sum over both paths of their bytes at that path's floor rate. */
static void s5_rows(struct s5_run *r, const struct s5_series *s, int goal)
{
    struct bench_summary m, fl, fx;
    double own = (double)r->count * (double)r->size, theirs = own * r->k, floor_us;
    struct bench_row *row;
    char sz[16], devs[32];

    bench_summarize(s->run, &m);
    bench_size_name(r->size, sz, sizeof sz);
    if (r->same) {
        bench_summarize(s->plain, &fl);
        floor_us = fl.p50;
    } else {
        bench_summarize(s->local, &fl);
        bench_summarize(s->cross, &fx);
        floor_us = fl.p50 + fx.p50;
    }
    row = bench_row_add(r->e->rep, "S5", "GB/s", "%d consumer(s) x %s, all copies", r->k, sz);
    bench_row_values(row, (own + theirs) / m.p50 / 1e3, (own + theirs) / m.p99 / 1e3,
                     (own + theirs) / floor_us / 1e3, floor_us / m.p50);
    if (goal) bench_row_goal(row, BENCH_GOAL_RATIO_MIN, S5_GOAL, 0);
    if (r->same)
        bench_row_note(row,
                       "%u messages, consumers on GPU %s, the producer's; floor = the same "
                       "pipeline without vmmt, run for run in turn: producer DtoD per message, "
                       "each consumer a DtoD in its own memory, same messages, window, batches; "
                       "delivered to consumers %.2f GB/s",
                       r->count, s5_devices(r, devs, sizeof devs), theirs / m.p50 / 1e3);
    else
        bench_row_note(row,
                       "%u messages, consumers on GPU %s; floor time = %u x %s on GPU %d at %.1f "
                       "GB/s + %u x %s to the consumers' GPUs at %.1f GB/s (%d stream(s)); "
                       "delivered to consumers %.2f GB/s",
                       r->count, s5_devices(r, devs, sizeof devs), r->count, sz, r->e->device,
                       own / fl.p50 / 1e3, r->count * (uint32_t)r->k, sz, theirs / fx.p50 / 1e3,
                       s5_streams(r), theirs / m.p50 / 1e3);
    row = bench_row_add(r->e->rep, "S5", "msg/s", "%d consumer(s) x %s, messages", r->k, sz);
    bench_row_values(row, r->count / m.p50 * 1e6, r->count / m.p99 * 1e6, NAN, NAN);
    bench_row_note(row, "a message counts once it is consumed by all %d consumer(s)", r->k);
}

/* ------------------------------------------------------------ driving */

/* Each run is a few thousand messages already: fewer repetitions than a single call gets. */
static int s5_run_count(const struct bench_env *e)
{
    if (e->opt.reps > 0) return e->opt.reps / 40 > 3 ? e->opt.reps / 40 : 3;
    return e->opt.quick ? 3 : 5;
}

static int s5_series_new(struct s5_run *r, struct s5_series *s)
{
    struct bench_report *rep = r->e->rep;
    char sz[16];

    memset(s, 0, sizeof *s);
    bench_size_name(r->size, sz, sizeof sz);
    s->run = bench_series_new(rep, "us", "S5 run of %u x %s to %d consumer(s)", r->count, sz, r->k);
    if (r->same) {
        s->plain = bench_series_new(rep, "us", "S5 floor run without vmmt, same GPU, %u x %s to %d",
                                    r->count, sz, r->k);
        return s->run && s->plain ? VMMT_OK : VMMT_ENOMEM;
    }
    s->local = bench_series_new(rep, "us", "S5 floor %u local DtoD of %s", r->count, sz);
    s->cross = bench_series_new(rep, "us", "S5 floor %u copies of %s to the consumers' GPUs",
                                r->count * (uint32_t)r->k, sz);
    return s->run && s->local && s->cross ? VMMT_OK : VMMT_ENOMEM;
}

static int s5_config(struct s5_run *r, int k, uint64_t size, uint32_t count, int goal)
{
    struct bench_env *e = r->e;
    uint64_t mem =
        (S5_WINDOW + 16) * size > 32 * BENCH_MIB ? (S5_WINDOW + 16) * size : 32 * BENCH_MIB;
    struct s5_series s;
    char sz[16];
    int st;

    r->k = k;
    r->size = size;
    r->count = count;
    r->pool = NULL;
    bench_size_name(size, sz, sizeof sz);
    if (s5_series_new(r, &s) != VMMT_OK)
        return bench_fail(e, "S5", "throughput", "too many series");
    st = bench_pool_create(e, mem, k, 4096, &r->pool);
    if (st == VMMT_OK) st = s5_runs(r, s5_run_count(e), &s);
    /* Consumers unmap the pool before it goes away. */
    for (int i = 0; i < k && r->pool != NULL; i++)
        if (bench_peer_reset(&r->peers[i]) != VMMT_OK && st == VMMT_OK) st = vmmt_last_status();
    vmmt_pool_destroy(r->pool);
    r->pool = NULL;
    if (st != VMMT_OK) return bench_fail(e, "S5", "throughput", sz);
    s5_rows(r, &s, goal);
    return CLI_OK;
}

/* Consumer k on its device; one floor path for each device that has consumers. */
static int s5_start(struct s5_run *r, int *dev, uint64_t big)
{
    struct s5_paths *p = r->paths;

    for (int k = 0; k < S5_PEERS; k++) {
        int known = 0;
        dev[k] = bench_peer_device(r->e, k);
        for (int i = 0; i < p->n; i++)
            known |= p->x[i].device == dev[k];
        if (!known && bench_xpath_open(r->e, dev[k], big, &p->x[p->n++]) != VMMT_OK)
            return vmmt_last_status();
        if (bench_peer_spawn(r->e, dev[k], &r->peers[k]) != VMMT_OK) return vmmt_last_status();
    }
    r->same = 1;
    for (int k = 0; k < S5_PEERS; k++)
        r->same &= dev[k] == r->e->device;
    return VMMT_OK;
}

int bench_s5(struct bench_env *e)
{
    static const int ks[] = {1, 2, 4};
    uint64_t small = 64 * BENCH_KIB, big = e->opt.quick ? BENCH_MIB : 4 * BENCH_MIB;
    uint32_t nsmall = e->opt.quick ? 64 : 2000, nbig = e->opt.quick ? 32 : 250;
    struct bench_peer peers[S5_PEERS];
    struct s5_paths paths;
    int dev[S5_PEERS];
    struct s5_run r;
    int rc = CLI_OK;

    memset(&paths, 0, sizeof paths);
    r = (struct s5_run){.e = e, .peers = peers, .dev = dev, .paths = &paths};
    for (int k = 0; k < S5_PEERS; k++)
        peers[k] = (struct bench_peer){-1, -1};
    if (s5_start(&r, dev, big) != VMMT_OK)
        rc = bench_fail(e, "S5", "throughput", "starting the consumers and the floor's paths");
    for (int i = 0; i < 3 && rc == CLI_OK; i++) {
        rc = s5_config(&r, ks[i], small, nsmall, 0);
        if (rc == CLI_OK) rc = s5_config(&r, ks[i], big, nbig, 1);
    }
    for (int k = 0; k < S5_PEERS; k++)
        bench_peer_stop(&peers[k]);
    for (int i = 0; i < paths.n; i++)
        bench_xpath_close(&paths.x[i]);
    return rc;
}
