/*
 * vmmt bench, scenarios in one process: S1 publish, S2 consume, S4
 * bandwidth, S9 publish with many slices in flight. A scenario sample and a
 * floor sample alternate where both are cheap, so that drift of the machine
 * (clocks, other tenants) weighs on both alike.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "cli.h"
#include "status.h"

#define S4_GOAL 0.9
#define S9_GOAL 1.2
#define LAT_1   1.3 /* S1, S2 at 4 KiB */

/* Give the slice back outside the timing: cancel (nothing consumed it), then recycle. */
static int release(vmmt_pool *pool, const vmmt_desc *desc)
{
    int st = vmmt_cancel(pool, desc);
    return st == VMMT_OK ? vmmt_pool_drain(pool, 5000) : st;
}

static void latency_row(struct bench_env *e, const char *id, const char *what, uint64_t n,
                        const struct bench_series *s, const struct bench_series *floor, double goal)
{
    struct bench_summary m, f;
    struct bench_row *row;
    char sz[16];

    bench_summarize(s, &m);
    bench_summarize(floor, &f);
    row = bench_row_add(e->rep, id, "us", "%s %s", what, bench_size_name(n, sz, sizeof sz));
    bench_row_values(row, m.p50, m.p99, floor ? f.p50 : NAN, floor ? m.p50 / f.p50 : NAN);
    if (goal > 0) bench_row_goal(row, BENCH_GOAL_RATIO_MAX, goal, 0);
}

/* ------------------------------------------------------------------- S1 */

struct s1_series {
    struct bench_series *total, *call, *floor;
};

static int s1_sample(struct bench_env *e, vmmt_pool *pool, uint64_t n, double out[2])
{
    vmmt_buffer b = bench_buffer(e->src, n);
    vmmt_desc desc;
    double t0, t1;
    int st;

    t0 = bench_now_us();
    st = vmmt_publish(pool, &b, e->ps, &desc);
    t1 = bench_now_us();
    if (st == VMMT_OK) st = VMMT_CU(e->d, cuStreamSynchronize(e->ps));
    out[0] = bench_now_us() - t0;
    out[1] = t1 - t0;
    return st == VMMT_OK ? release(pool, &desc) : st;
}

static int s1_size(struct bench_env *e, vmmt_pool *pool, uint64_t n, struct s1_series *s)
{
    int reps = bench_reps(e, n), warm = bench_warmup(reps), st = VMMT_OK;
    double v[2], fl;

    for (int i = 0; i < warm + reps && st == VMMT_OK; i++) {
        st = bench_copy_sample(e, e->ps, n, &fl);
        if (st == VMMT_OK) st = s1_sample(e, pool, n, v);
        if (st != VMMT_OK || i < warm) continue;
        if (bench_series_add(s->total, v[0]) || bench_series_add(s->call, v[1]) ||
            bench_series_add(s->floor, fl))
            st = VMMT_ENOMEM;
    }
    return st;
}

static const uint64_t *s12_sizes(const struct bench_env *e)
{
    static const uint64_t full[] = {4 * BENCH_KIB, BENCH_MIB, 64 * BENCH_MIB, 0};
    static const uint64_t quick[] = {4 * BENCH_KIB, BENCH_MIB, 8 * BENCH_MIB, 0};
    return e->opt.quick ? quick : full;
}

int bench_s1(struct bench_env *e)
{
    const uint64_t *sizes = s12_sizes(e);
    vmmt_pool *pool = NULL;
    int rc = CLI_OK;

    if (bench_pool_create(e, 72 * BENCH_MIB, 1, 64, &pool) != VMMT_OK)
        return bench_fail(e, "S1", "publish", "creating the pool");
    for (const uint64_t *n = sizes; *n && rc == CLI_OK; n++) {
        char sz[16];
        struct s1_series s;
        bench_size_name(*n, sz, sizeof sz);
        s.total = bench_series_new(e->rep, "us", "S1 publish+sync %s", sz);
        s.call = bench_series_new(e->rep, "us", "S1 publish call %s", sz);
        s.floor = bench_series_new(e->rep, "us", "S1 floor DtoD+sync %s", sz);
        if (!s.total || !s.call || !s.floor || s1_size(e, pool, *n, &s) != VMMT_OK) {
            rc = bench_fail(e, "S1", "publish", sz);
            break;
        }
        latency_row(e, "S1", "publish+sync", *n, s.total, s.floor, *n == 4 * BENCH_KIB ? LAT_1 : 0);
        latency_row(e, "S1", "publish call only", *n, s.call, NULL, 0);
    }
    vmmt_pool_destroy(pool);
    if (rc == CLI_OK) rc = bench_s1_parts(e);
    return rc;
}

/* ------------------------------------------------------------------- S2 */

struct s2_ctx {
    vmmt_pool *pool;
    vmmt_consumer *c;
};

static int s2_sample(struct bench_env *e, struct s2_ctx *x, uint64_t n, double *us)
{
    vmmt_buffer b = bench_buffer(e->src, n);
    vmmt_desc desc;
    double t0;
    int st;

    /* Published and in the pool before the clock starts. */
    st = vmmt_publish(x->pool, &b, e->ps, &desc);
    if (st == VMMT_OK) st = VMMT_CU(e->d, cuStreamSynchronize(e->ps));
    if (st != VMMT_OK) return st;
    t0 = bench_now_us();
    st = vmmt_consume(x->c, &desc, e->device, e->dst, e->cap, e->cs, 0, 1);
    if (st == VMMT_OK) st = VMMT_CU(e->d, cuStreamSynchronize(e->cs));
    *us = bench_now_us() - t0;
    return st == VMMT_OK ? vmmt_pool_drain(x->pool, 5000) : st;
}

static int s2_size(struct bench_env *e, struct s2_ctx *x, uint64_t n, struct bench_series *s,
                   struct bench_series *floor)
{
    int reps = bench_reps(e, n), warm = bench_warmup(reps);
    int st = bench_clear(e, e->dst, n);
    double v, fl;

    for (int i = 0; i < warm + reps && st == VMMT_OK; i++) {
        st = bench_copy_sample(e, e->cs, n, &fl);
        if (st == VMMT_OK) st = s2_sample(e, x, n, &v);
        if (st == VMMT_OK && i >= warm &&
            (bench_series_add(s, v) != 0 || bench_series_add(floor, fl) != 0))
            st = VMMT_ENOMEM;
    }
    return st == VMMT_OK ? bench_verify(e, e->dst, n) : st;
}

int bench_s2(struct bench_env *e)
{
    struct s2_ctx x = {0};
    int rc = CLI_OK;

    if (bench_pool_create(e, 72 * BENCH_MIB, 1, 64, &x.pool) != VMMT_OK ||
        vmmt_consumer_create(NULL, &x.c) != VMMT_OK) {
        rc = bench_fail(e, "S2", "consume", "creating the pool and consumer");
        goto out;
    }
    for (const uint64_t *n = s12_sizes(e); *n; n++) {
        char sz[16];
        struct bench_series *s, *floor;
        bench_size_name(*n, sz, sizeof sz);
        s = bench_series_new(e->rep, "us", "S2 consume+sync %s", sz);
        floor = bench_series_new(e->rep, "us", "S2 floor DtoD+sync %s", sz);
        if (!s || !floor || s2_size(e, &x, *n, s, floor) != VMMT_OK) {
            rc = bench_fail(e, "S2", "consume", sz);
            break;
        }
        latency_row(e, "S2", "consume+sync", *n, s, floor, *n == 4 * BENCH_KIB ? LAT_1 : 0);
    }
out:
    /* The consumer unmaps before the pool goes, as an importer in another process would. */
    vmmt_consumer_destroy(x.c);
    vmmt_pool_destroy(x.pool);
    return rc;
}

/* ------------------------------------------------------------------- S4 */

static int s4_floor(struct bench_env *e, uint64_t n, double *us)
{
    const struct vmmt_drv *d = e->d;
    double t0 = bench_now_us();
    int st = VMMT_CU(d, cuMemcpyDtoDAsync(e->tmp, e->src, n, e->ps));

    if (st == VMMT_OK) st = VMMT_CU(d, cuMemcpyDtoDAsync(e->dst, e->tmp, n, e->ps));
    if (st == VMMT_OK) st = VMMT_CU(d, cuStreamSynchronize(e->ps));
    *us = bench_now_us() - t0;
    return st;
}

/* Publish then consume in this process: two copies, measured until both are done. */
static int s4_sample(struct bench_env *e, struct s2_ctx *x, uint64_t n, double *us)
{
    vmmt_buffer b = bench_buffer(e->src, n);
    vmmt_desc desc;
    double t0 = bench_now_us();
    int st;

    st = vmmt_publish(x->pool, &b, e->ps, &desc);
    if (st == VMMT_OK) st = vmmt_consume(x->c, &desc, e->device, e->dst, e->cap, e->cs, 0, 1);
    if (st == VMMT_OK) st = VMMT_CU(e->d, cuStreamSynchronize(e->cs));
    if (st == VMMT_OK) st = VMMT_CU(e->d, cuStreamSynchronize(e->ps));
    *us = bench_now_us() - t0;
    return st == VMMT_OK ? vmmt_pool_drain(x->pool, 5000) : st;
}

static int s4_measure(struct bench_env *e, struct s2_ctx *x, uint64_t n, struct bench_series *s,
                      struct bench_series *floor)
{
    int reps = bench_reps(e, n), warm = bench_warmup(reps), st = VMMT_OK;
    double v;

    for (int i = 0; i < warm + reps && st == VMMT_OK; i++) {
        st = s4_floor(e, n, &v);
        if (st == VMMT_OK && i >= warm && bench_series_add(floor, v) != 0) st = VMMT_ENOMEM;
    }
    if (st == VMMT_OK) st = bench_clear(e, e->dst, n);
    for (int i = 0; i < warm + reps && st == VMMT_OK; i++) {
        st = s4_sample(e, x, n, &v);
        if (st == VMMT_OK && i >= warm && bench_series_add(s, v) != 0) st = VMMT_ENOMEM;
    }
    return st == VMMT_OK ? bench_verify(e, e->dst, n) : st;
}

static void s4_row(struct bench_env *e, uint64_t n, const struct bench_series *s,
                   const struct bench_series *floor)
{
    struct bench_summary m, f;
    double bytes = 2.0 * (double)n; /* two copies, each counted once */
    struct bench_row *row;
    char sz[16];

    bench_summarize(s, &m);
    bench_summarize(floor, &f);
    /* bytes per microsecond / 1e3 = GB/s */
    row = bench_row_add(e->rep, "S4", "GB/s", "publish+consume %s", bench_size_name(n, sz, 16));
    bench_row_values(row, bytes / m.p50 / 1e3, bytes / m.p99 / 1e3, bytes / f.p50 / 1e3,
                     f.p50 / m.p50);
    bench_row_goal(row, BENCH_GOAL_RATIO_MIN, S4_GOAL, 0);
    bench_row_note(row, "p99 column: rate at the p99 time; floor: two DtoD copies of %s", sz);
}

int bench_s4(struct bench_env *e)
{
    uint64_t n = e->cap;
    struct s2_ctx x = {0};
    struct bench_series *s, *floor;
    int rc = CLI_OK;

    s = bench_series_new(e->rep, "us", "S4 publish+consume+sync %llu B", (unsigned long long)n);
    floor = bench_series_new(e->rep, "us", "S4 floor 2x DtoD+sync %llu B", (unsigned long long)n);
    if (!s || !floor || bench_pool_create(e, n + 4 * BENCH_MIB, 1, 8, &x.pool) != VMMT_OK ||
        vmmt_consumer_create(NULL, &x.c) != VMMT_OK) {
        rc = bench_fail(e, "S4", "bandwidth", "creating the pool and consumer");
        goto out;
    }
    if (s4_measure(e, &x, n, s, floor) != VMMT_OK)
        rc = bench_fail(e, "S4", "bandwidth", "measuring");
    else
        s4_row(e, n, s, floor);
out:
    vmmt_consumer_destroy(x.c);
    vmmt_pool_destroy(x.pool);
    return rc;
}

/* ------------------------------------------------------------------- S9 */

#define S9_SIZE  (4 * BENCH_KIB)
#define S9_LEVEL 4096

struct s9_ctx {
    vmmt_pool *pool;
    vmmt_desc *held; /* published, never acknowledged */
    uint32_t nheld;
};

static int s9_hold(struct bench_env *e, struct s9_ctx *x, uint32_t want)
{
    vmmt_buffer b = bench_buffer(e->src, S9_SIZE);
    int st = VMMT_OK;

    while (x->nheld < want && st == VMMT_OK)
        if ((st = vmmt_publish(x->pool, &b, e->ps, &x->held[x->nheld])) == VMMT_OK) x->nheld++;
    return st == VMMT_OK ? VMMT_CU(e->d, cuStreamSynchronize(e->ps)) : st;
}

/* Back to exactly nheld in flight, outside the timing. */
static int s9_settle(struct s9_ctx *x)
{
    vmmt_pool_stats s;
    int st = VMMT_OK;

    for (int i = 0; i < 10000 && st == VMMT_OK; i++) {
        st = vmmt_pool_get_stats(x->pool, &s);
        if (st == VMMT_OK && s.in_flight <= x->nheld) return VMMT_OK;
        if (st == VMMT_OK) st = vmmt_pool_reclaim(x->pool, NULL);
    }
    return st == VMMT_OK ? vmmt__fail(VMMT_ETIMEDOUT, "a cancelled slice was not recycled") : st;
}

static int s9_sample(struct bench_env *e, struct s9_ctx *x, double out[2])
{
    vmmt_buffer b = bench_buffer(e->src, S9_SIZE);
    vmmt_desc desc;
    double t0, t1;
    int st;

    t0 = bench_now_us();
    st = vmmt_publish(x->pool, &b, e->ps, &desc);
    t1 = bench_now_us();
    if (st == VMMT_OK) st = VMMT_CU(e->d, cuStreamSynchronize(e->ps));
    out[0] = bench_now_us() - t0;
    out[1] = t1 - t0;
    if (st == VMMT_OK) st = vmmt_cancel(x->pool, &desc);
    return st == VMMT_OK ? s9_settle(x) : st;
}

static int s9_level(struct bench_env *e, struct s9_ctx *x, uint32_t level,
                    struct bench_series *total, struct bench_series *call)
{
    int reps = bench_reps(e, S9_SIZE), warm = bench_warmup(reps);
    int st = s9_hold(e, x, level - 1);
    double v[2];

    for (int i = 0; i < warm + reps && st == VMMT_OK; i++) {
        st = s9_sample(e, x, v);
        if (st == VMMT_OK && i >= warm &&
            (bench_series_add(total, v[0]) != 0 || bench_series_add(call, v[1]) != 0))
            st = VMMT_ENOMEM;
    }
    return st;
}

static void s9_rows(struct bench_env *e, const uint32_t *levels, struct bench_series **total,
                    struct bench_series **call, int n)
{
    struct bench_summary base, m, c;

    bench_summarize(total[0], &base);
    for (int i = 0; i < n; i++) {
        struct bench_row *row;
        bench_summarize(total[i], &m);
        bench_summarize(call[i], &c);
        row = bench_row_add(e->rep, "S9", "us", "publish+sync 4 KiB, %u in flight", levels[i]);
        bench_row_values(row, m.p50, m.p99, base.p50, m.p50 / base.p50);
        if (levels[i] == S9_LEVEL) bench_row_goal(row, BENCH_GOAL_RATIO_MAX, S9_GOAL, 0);
        bench_row_note(row, "publish call alone: p50 %.2f us, p99 %.2f us", c.p50, c.p99);
    }
}

int bench_s9(struct bench_env *e)
{
    static const uint32_t levels[] = {1, 64, S9_LEVEL};
    struct bench_series *total[3], *call[3];
    struct s9_ctx x = {0};
    int rc = CLI_OK;

    x.held = calloc(S9_LEVEL, sizeof *x.held);
    if (x.held == NULL ||
        bench_pool_create(e, 64 * BENCH_MIB, 1, S9_LEVEL + 64, &x.pool) != VMMT_OK) {
        rc = bench_fail(e, "S9", "scale", "creating the pool");
        goto out;
    }
    for (int i = 0; i < 3 && rc == CLI_OK; i++) {
        total[i] = bench_series_new(e->rep, "us", "S9 publish+sync 4KiB, %u in flight", levels[i]);
        call[i] = bench_series_new(e->rep, "us", "S9 publish call 4KiB, %u in flight", levels[i]);
        if (!total[i] || !call[i] || s9_level(e, &x, levels[i], total[i], call[i]) != VMMT_OK)
            rc = bench_fail(e, "S9", "scale", "publishing");
    }
    if (rc == CLI_OK) s9_rows(e, levels, total, call, 3);
    for (uint32_t i = 0; i < x.nheld; i++)
        vmmt_cancel(x.pool, &x.held[i]);
    if (x.pool != NULL && vmmt_pool_drain(x.pool, 5000) != VMMT_OK)
        rc = bench_fail(e, "S9", "scale", "draining");
out:
    vmmt_pool_destroy(x.pool);
    free(x.held);
    return rc;
}
