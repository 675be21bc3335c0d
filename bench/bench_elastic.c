/*
 * vmmt bench S11: elastic pools and writing in place, in one process (the
 * consumer is this process on the producer's device, so every row compares
 * pools, not processes). Rows: a publish that must grow the pool (a chunk
 * made and exported) against the same publish into a fixed pool; the
 * steady-state round trip of an elastic pool against a fixed one; the device
 * memory an idle elastic pool holds; and vmmt_reserve + vmmt_commit against
 * vmmt_publish of the same bytes.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"
#include "cli.h"
#include "status.h"

#define S11_STEADY_GOAL 1.05
#define S11_IDLE_MS     100
#define S11_MAX         (256 * BENCH_MIB)
#define DRAIN_MS        5000

struct s11 {
    struct bench_env *e;
    vmmt_consumer *c;
    vmmt_pool *fixed, *elastic;
};

static void pause_ms(long ms)
{
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

static int consume_sync(struct s11 *t, const vmmt_desc *d, uint64_t n)
{
    struct bench_env *e = t->e;
    int st = vmmt_consume(t->c, d, e->device, e->dst, n, e->cs, VMMT_ALL_RANKS, 0);

    if (st == VMMT_OK) st = VMMT_CU(e->d, cuStreamSynchronize(e->cs));
    return st;
}

/* Publish n bytes of src, consume them here and synchronize: one round trip. */
static int roundtrip(struct s11 *t, vmmt_pool *pool, uint64_t n, double *us)
{
    vmmt_buffer b = bench_buffer(t->e->src, n);
    vmmt_desc d;
    double t0 = bench_now_us();
    int st = vmmt_publish(pool, &b, t->e->ps, &d);

    if (st == VMMT_OK) st = consume_sync(t, &d, n);
    *us = bench_now_us() - t0;
    return st == VMMT_OK ? vmmt_pool_drain(pool, DRAIN_MS) : st;
}

/* Wait (bounded) until the elastic pool has given back every chunk. */
static int wait_empty(struct s11 *t)
{
    vmmt_pool_stats s;

    for (int i = 0; i < 1000; i++) {
        if (vmmt_pool_get_stats(t->elastic, &s) != VMMT_OK) return VMMT_EFAILED;
        if (s.resident_bytes == 0) return VMMT_OK;
        pause_ms(5);
    }
    return vmmt__fail(VMMT_ETIMEDOUT, "the elastic pool kept %llu bytes after 5 s idle",
                      (unsigned long long)s.resident_bytes);
}

/* Publish time alone: the elastic one finds no chunk and makes one. */
static int grow_sample(struct s11 *t, vmmt_pool *pool, uint64_t n, double *us)
{
    vmmt_buffer b = bench_buffer(t->e->src, n);
    vmmt_desc d;
    double t0;
    int st = pool == t->elastic ? wait_empty(t) : VMMT_OK;

    t0 = bench_now_us();
    if (st == VMMT_OK) st = vmmt_publish(pool, &b, t->e->ps, &d);
    *us = bench_now_us() - t0;
    if (st == VMMT_OK) st = consume_sync(t, &d, n);
    return st == VMMT_OK ? vmmt_pool_drain(pool, DRAIN_MS) : st;
}

static int s11_growth(struct s11 *t)
{
    struct bench_series *g = bench_series_new(t->e->rep, "us", "S11 publish that grows 1MiB");
    struct bench_series *f = bench_series_new(t->e->rep, "us", "S11 publish fixed pool 1MiB");
    int reps = t->e->opt.quick ? 5 : 30, st = VMMT_OK;
    struct bench_summary a, b;
    struct bench_row *row;
    double us;

    if (g == NULL || f == NULL) return VMMT_ENOMEM;
    for (int i = 0; i < reps + 1 && st == VMMT_OK; i++) {
        st = grow_sample(t, t->elastic, BENCH_MIB, &us);
        if (st == VMMT_OK && i > 0 && bench_series_add(g, us)) st = VMMT_ENOMEM;
        if (st == VMMT_OK) st = grow_sample(t, t->fixed, BENCH_MIB, &us);
        if (st == VMMT_OK && i > 0 && bench_series_add(f, us)) st = VMMT_ENOMEM;
    }
    if (st != VMMT_OK) return st;
    bench_summarize(g, &a);
    bench_summarize(f, &b);
    row = bench_row_add(t->e->rep, "S11", "us", "publish that grows the pool 1 MiB");
    bench_row_values(row, a.p50, a.p99, b.p50, a.p50 / b.p50);
    bench_row_note(row, "a chunk created, mapped and exported inside the publish; floor: the same "
                        "publish into a fixed pool");
    return VMMT_OK;
}

static int s11_steady(struct s11 *t)
{
    struct bench_series *el = bench_series_new(t->e->rep, "us", "S11 elastic steady 4KiB");
    struct bench_series *fx = bench_series_new(t->e->rep, "us", "S11 fixed steady 4KiB");
    int reps = bench_reps(t->e, 4 * BENCH_KIB), warm = bench_warmup(reps), st = VMMT_OK;
    struct bench_summary a, b;
    struct bench_row *row;
    double us;

    if (el == NULL || fx == NULL) return VMMT_ENOMEM;
    for (int i = 0; i < warm + reps && st == VMMT_OK; i++) {
        st = roundtrip(t, t->elastic, 4 * BENCH_KIB, &us);
        if (st == VMMT_OK && i >= warm && bench_series_add(el, us)) st = VMMT_ENOMEM;
        if (st == VMMT_OK) st = roundtrip(t, t->fixed, 4 * BENCH_KIB, &us);
        if (st == VMMT_OK && i >= warm && bench_series_add(fx, us)) st = VMMT_ENOMEM;
    }
    if (st == VMMT_OK) st = bench_verify(t->e, t->e->dst, 4 * BENCH_KIB);
    if (st != VMMT_OK) return st;
    bench_summarize(el, &a);
    bench_summarize(fx, &b);
    row = bench_row_add(t->e->rep, "S11", "us", "elastic steady state 4 KiB");
    bench_row_values(row, a.p50, a.p99, b.p50, a.p50 / b.p50);
    bench_row_goal(row, BENCH_GOAL_RATIO_MAX, S11_STEADY_GOAL, 0);
    bench_row_note(row, "publish + consume + sync in one process, its chunk resident; floor: the "
                        "same round trip through a fixed pool");
    return VMMT_OK;
}

/* Several chunks' worth in flight at once, then idle: what stays resident? */
static int s11_idle(struct s11 *t)
{
    vmmt_buffer b = bench_buffer(t->e->src, BENCH_MIB);
    vmmt_pool_stats s, f;
    struct bench_row *row;
    vmmt_desc d[16];
    int st = VMMT_OK, n = 0;

    for (; n < 16 && st == VMMT_OK; n++)
        st = vmmt_publish(t->elastic, &b, t->e->ps, &d[n]);
    for (int i = 0; i < n - (st != VMMT_OK) && i < 16; i++)
        if (vmmt_consumer_ack(t->c, &d[i], t->e->device, t->e->cs, VMMT_ALL_RANKS, 0) != VMMT_OK)
            st = VMMT_EFAILED;
    if (st == VMMT_OK) st = vmmt_pool_drain(t->elastic, DRAIN_MS);
    if (st == VMMT_OK) st = vmmt_pool_get_stats(t->fixed, &f);
    if (st != VMMT_OK) return st;
    pause_ms(S11_IDLE_MS * 3);
    st = vmmt_pool_get_stats(t->elastic, &s);
    if (st != VMMT_OK) return st;
    row = bench_row_add(t->e->rep, "S11", "MiB", "device memory held by an idle elastic pool");
    bench_row_values(row, (double)s.resident_bytes / BENCH_MIB, NAN, NAN, NAN);
    bench_row_goal(row, BENCH_GOAL_ABS_MAX, NAN, (double)s.chunk_bytes / BENCH_MIB);
    bench_row_note(row,
                   "%.0f ms after 16 MiB were in flight (peak %.0f MiB, chunks of %.0f MiB, max "
                   "%.0f MiB); a fixed pool of that size holds %.0f MiB",
                   (double)S11_IDLE_MS * 3, (double)s.peak_bytes / BENCH_MIB,
                   (double)s.chunk_bytes / BENCH_MIB, (double)s.max_bytes / BENCH_MIB,
                   (double)f.device_bytes / BENCH_MIB);
    return VMMT_OK;
}

/*
 * In place: the producer's "kernel" (a memset here) writes into the reserved
 * slice; against producing into its own buffer and publishing a copy.
 */
static int inplace_sample(struct s11 *t, uint64_t n, int in_place, double *us)
{
    const struct vmmt_drv *d = t->e->d;
    vmmt_reservation r;
    vmmt_buffer b = bench_buffer(t->e->tmp, n);
    vmmt_desc desc;
    double t0 = bench_now_us();
    int st;

    if (in_place) {
        st = vmmt_reserve(t->fixed, n, &r);
        if (st == VMMT_OK) st = VMMT_CU(d, cuMemsetD8Async(r.ptr, 0x5a, n, t->e->ps));
        if (st == VMMT_OK) st = vmmt_commit(t->fixed, &r, NULL, t->e->ps, &desc);
    } else {
        st = VMMT_CU(d, cuMemsetD8Async(t->e->tmp, 0x5a, n, t->e->ps));
        if (st == VMMT_OK) st = vmmt_publish(t->fixed, &b, t->e->ps, &desc);
    }
    if (st == VMMT_OK) st = consume_sync(t, &desc, n);
    *us = bench_now_us() - t0;
    return st == VMMT_OK ? vmmt_pool_drain(t->fixed, DRAIN_MS) : st;
}

static int s11_inplace(struct s11 *t, uint64_t n)
{
    struct bench_series *ip, *pb;
    int reps = bench_reps(t->e, n), warm = bench_warmup(reps), st = VMMT_OK;
    struct bench_summary a, b;
    struct bench_row *row;
    char sz[16];
    double us;

    bench_size_name(n, sz, sizeof sz);
    ip = bench_series_new(t->e->rep, "us", "S11 reserve+commit %s", sz);
    pb = bench_series_new(t->e->rep, "us", "S11 publish %s", sz);
    if (ip == NULL || pb == NULL) return VMMT_ENOMEM;
    for (int i = 0; i < warm + reps && st == VMMT_OK; i++) {
        st = inplace_sample(t, n, 1, &us);
        if (st == VMMT_OK && i >= warm && bench_series_add(ip, us)) st = VMMT_ENOMEM;
        if (st == VMMT_OK) st = inplace_sample(t, n, 0, &us);
        if (st == VMMT_OK && i >= warm && bench_series_add(pb, us)) st = VMMT_ENOMEM;
    }
    if (st != VMMT_OK) return st;
    bench_summarize(ip, &a);
    bench_summarize(pb, &b);
    row = bench_row_add(t->e->rep, "S11", "us", "in-place publish %s", sz);
    bench_row_values(row, a.p50, a.p99, b.p50, a.p50 / b.p50);
    bench_row_note(row, "reserve + producer's write into the slice + commit, consumed + synced; "
                        "floor: the write into its own buffer + vmmt_publish (one copy more)");
    return VMMT_OK;
}

static int setup(struct s11 *t)
{
    vmmt_pool_config c;
    int st = vmmt_consumer_create(NULL, &t->c);

    if (st == VMMT_OK) st = bench_pool_create(t->e, S11_MAX, 1, 64, &t->fixed);
    if (st != VMMT_OK) return st;
    vmmt_pool_config_init(&c);
    c.device = t->e->device;
    c.memory_size = S11_MAX;
    c.consumer_count = 1;
    c.max_slices = 64;
    c.elastic = 1;
    c.idle_release_ms = S11_IDLE_MS;
    return vmmt_pool_create(&c, &t->elastic);
}

int bench_s11(struct bench_env *e)
{
    struct s11 t;
    int rc = CLI_OK;

    memset(&t, 0, sizeof t);
    t.e = e;
    if (setup(&t) != VMMT_OK) {
        rc = bench_fail(e, "S11", "elastic pools", "creating the pools");
    } else {
        if (s11_growth(&t) != VMMT_OK) rc = bench_fail(e, "S11", "growth", "1 MiB");
        if (rc == CLI_OK && s11_steady(&t) != VMMT_OK)
            rc = bench_fail(e, "S11", "steady state", "4 KiB");
        if (rc == CLI_OK && s11_idle(&t) != VMMT_OK)
            rc = bench_fail(e, "S11", "idle elastic pool", "memory");
        if (rc == CLI_OK && s11_inplace(&t, 4 * BENCH_KIB) != VMMT_OK)
            rc = bench_fail(e, "S11", "in-place publish", "4 KiB");
        if (rc == CLI_OK && s11_inplace(&t, BENCH_MIB) != VMMT_OK)
            rc = bench_fail(e, "S11", "in-place publish", "1 MiB");
    }
    /* Unmap here before the pools go away. */
    vmmt_consumer_destroy(t.c);
    vmmt_pool_destroy(t.elastic);
    vmmt_pool_destroy(t.fixed);
    return rc;
}
