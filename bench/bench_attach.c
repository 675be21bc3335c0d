/*
 * vmmt bench: S6 attach (the first consume of a pool), S7 recycling (from
 * the last acknowledgement to the next publish that fits), and the pool's
 * fixed memory overhead.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"
#include "broker.h"
#include "ctrl.h"
#include "cli.h"
#include "desc.h"
#include "status.h"
#include "vmm.h"

#define S6_ABS_US 1000.0
#define S6_GOAL   1.5
#define S7_ABS_US 100.0
#define S6_SIZE   (4 * BENCH_KIB)
#define S7_SIZE   (4 * BENCH_KIB)
#define FULL_WAIT (5 * 1000 * 1000.0) /* us a publish may keep finding the pool full */

/* ------------------------------------------------------------------- S6 */

#define S6_PARTS 5

struct s6_ctx {
    vmmt_pool *pool;
    vmmt_consumer *c;
    vmmt_pool_stats stats;
    struct bench_series *broker; /* NULL: no broker (FABRIC handles travel in the descriptor) */
    struct bench_series *table;  /* mapping and registering the shared control table alone */
};

/*
 * The broker's part of an attach, alone: connect, ask, receive the fds (the
 * allocation, and the shared control table where the pool has one).
 */
static int s6_fetch(struct s6_ctx *x, const vmmt_desc *desc)
{
    struct vmmt__desc d;
    struct vmmt__broker_peer producer;
    double t0;
    int st, fds[2] = {-1, -1};

    if (x->broker == NULL) return VMMT_OK;
    st = vmmt__desc_decode(desc->bytes, &d);
    if (st != VMMT_OK) return st;
    vmmt__broker_expect(d.producer_uid, d.producer_pid, d.producer_pidns, &producer);
    t0 = bench_now_us();
    st = vmmt__broker_fetch_fds(&d.broker, d.pool_id, &producer, 0, fds,
                                (d.flags & VMMT__DESC_HOST_TABLE) ? 2 : 1, NULL);
    if (st == VMMT_OK && bench_series_add(x->broker, bench_now_us() - t0)) st = VMMT_ENOMEM;
    if (st == VMMT_OK && fds[1] >= 0 && x->table != NULL) {
        struct vmmt__ctrl t;
        t0 = bench_now_us();
        struct vmmt__ctrl_record rec;
        memset(&rec, 0, sizeof rec);
        rec.slots = d.table_slots;
        rec.stride = d.slot_stride;
        rec.consumers = d.consumer_count;
        memcpy(rec.pool_id, d.pool_id, sizeof rec.pool_id);
        rec.table_offset = d.table_offset;
        rec.data_offset = d.data_offset;
        st = vmmt__ctrl_attach_shared(fds[1], (size_t)d.table_slots * d.slot_stride, &rec, 0, &t);
        if (st == VMMT_OK && bench_series_add(x->table, bench_now_us() - t0)) st = VMMT_ENOMEM;
        if (st == VMMT_OK) vmmt__ctrl_release(&t);
    }
    for (int i = 0; i < 2; i++)
        if (fds[i] >= 0) close(fds[i]);
    return st;
}

/*
 * Evicted before the clock starts, so the consume must fetch, import, map and
 * grant access. The broker fetch is timed alone after it, so that it does not
 * find the broker's thread awake on the measured consume's behalf.
 */
static int s6_sample(struct bench_env *e, struct s6_ctx *x, double *us, int measured)
{
    vmmt_buffer b = bench_buffer(e->src, S6_SIZE);
    vmmt_desc_info info;
    vmmt_desc desc;
    double t0;
    int st;

    st = vmmt_publish(x->pool, &b, e->ps, &desc);
    if (st == VMMT_OK) st = VMMT_CU(e->d, cuStreamSynchronize(e->ps));
    if (st == VMMT_OK) st = vmmt_desc_inspect(&desc, &info);
    if (st == VMMT_OK) st = vmmt_consumer_evict(x->c, info.pool_id, e->device);
    if (st != VMMT_OK) return st;
    t0 = bench_now_us();
    st = vmmt_consume(x->c, &desc, e->device, e->dst, e->cap, e->cs, 0, 1);
    if (st == VMMT_OK) st = VMMT_CU(e->d, cuStreamSynchronize(e->cs));
    *us = bench_now_us() - t0;
    if (st == VMMT_OK) st = vmmt_pool_drain(x->pool, 5000);
    return st == VMMT_OK && measured ? s6_fetch(x, &desc) : st;
}

/* The floor's own allocation, of the pool's size and handle type, shared with itself. */
struct s6_floor {
    struct vmmt__mapping m;
    vmmt_handle_type type;
    int fd;
    CUmemFabricHandle fabric;
    size_t align;
    struct bench_series *total, *part[S6_PARTS];
};

static int s6_floor_open(struct bench_env *e, struct s6_floor *f, uint64_t size)
{
    size_t gmin = 0, grec = 0;
    int st;

    f->fd = -1;
    st = vmmt__granularity(e->device, VMMT_HANDLE_NONE, &gmin, &grec);
    if (st != VMMT_OK) return st;
    f->align = grec > gmin ? grec : gmin; /* as the library reserves */
    st = vmmt__mapping_create(e->device, size, f->type, 0, &f->m);
    if (st != VMMT_OK) return st;
    if (f->type == VMMT_HANDLE_FABRIC) return vmmt__export_fabric(f->m.handle, &f->fabric);
    return vmmt__export_posix_fd(f->m.handle, &f->fd);
}

static void s6_floor_close(struct s6_floor *f)
{
    if (f->fd >= 0) close(f->fd);
    vmmt__mapping_release(&f->m);
}

static CUresult s6_import(const struct vmmt_drv *d, struct s6_floor *f,
                          CUmemGenericAllocationHandle *h)
{
    if (f->type == VMMT_HANDLE_FABRIC)
        return d->cuMemImportFromShareableHandle(h, &f->fabric, CU_MEM_HANDLE_TYPE_FABRIC);
    return d->cuMemImportFromShareableHandle(h, (void *)(uintptr_t)f->fd,
                                             CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
}

/*
 * The driver's part of an attach and the first copy, back to back: import,
 * reserve, map, set access, a 4 KiB copy out of the mapping and synchronize.
 * The teardown is not timed.
 */
static int s6_floor_sample(struct bench_env *e, struct s6_floor *f, double t[S6_PARTS + 1])
{
    const struct vmmt_drv *d = e->d;
    CUmemGenericAllocationHandle h = 0;
    CUmemAccessDesc acc;
    CUdeviceptr va = 0;
    uint64_t size = f->m.size;
    int st, mapped = 0;

    memset(&acc, 0, sizeof acc);
    acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc.location.id = e->device;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    t[0] = bench_now_us();
    st = vmmt__cu_check(s6_import(d, f, &h), "cuMemImportFromShareableHandle");
    t[1] = bench_now_us();
    if (st == VMMT_OK) st = VMMT_CU(d, cuMemAddressReserve(&va, size, f->align, 0, 0));
    t[2] = bench_now_us();
    if (st == VMMT_OK) st = VMMT_CU(d, cuMemMap(va, size, 0, h, 0));
    mapped = st == VMMT_OK;
    t[3] = bench_now_us();
    if (st == VMMT_OK) st = VMMT_CU(d, cuMemSetAccess(va, size, &acc, 1));
    t[4] = bench_now_us();
    if (st == VMMT_OK) st = VMMT_CU(d, cuMemcpyDtoDAsync(e->tmp, va, S6_SIZE, e->cs));
    if (st == VMMT_OK) st = VMMT_CU(d, cuStreamSynchronize(e->cs));
    t[5] = bench_now_us();
    if (mapped) d->cuMemUnmap(va, size);
    if (h != 0) d->cuMemRelease(h);
    if (va != 0) d->cuMemAddressFree(va, size);
    return st;
}

static int s6_floor_run(struct bench_env *e, struct s6_floor *f, int reps)
{
    int warm = bench_warmup(reps), st = VMMT_OK;
    double t[S6_PARTS + 1];

    for (int i = 0; i < warm + reps && st == VMMT_OK; i++) {
        st = s6_floor_sample(e, f, t);
        if (st != VMMT_OK || i < warm) continue;
        if (bench_series_add(f->total, t[S6_PARTS] - t[0])) st = VMMT_ENOMEM;
        for (int k = 0; k < S6_PARTS && st == VMMT_OK; k++)
            if (bench_series_add(f->part[k], t[k + 1] - t[k])) st = VMMT_ENOMEM;
    }
    return st;
}

static int s6_measure(struct bench_env *e, struct s6_ctx *x, struct bench_series *s,
                      struct s6_floor *f)
{
    int reps = bench_reps(e, S6_SIZE), warm = bench_warmup(reps), st;
    double v;

    st = s6_floor_open(e, f, x->stats.allocation_size);
    if (st == VMMT_OK) st = s6_floor_run(e, f, reps);
    s6_floor_close(f);
    if (st == VMMT_OK) st = bench_clear(e, e->dst, S6_SIZE);
    for (int i = 0; i < warm + reps && st == VMMT_OK; i++) {
        st = s6_sample(e, x, &v, i >= warm);
        if (st == VMMT_OK && i >= warm && bench_series_add(s, v)) st = VMMT_ENOMEM;
    }
    return st == VMMT_OK ? bench_verify(e, e->dst, S6_SIZE) : st;
}

static void s6_row(struct bench_env *e, const struct s6_ctx *x, const struct bench_series *s,
                   const struct s6_floor *f)
{
    struct bench_summary m, fl, p[S6_PARTS], br = {0}, tb = {0};
    struct bench_row *row;
    char sz[16], fetch[96] = "no broker (FABRIC)";

    bench_summarize(s, &m);
    bench_summarize(f->total, &fl);
    for (int k = 0; k < S6_PARTS; k++)
        bench_summarize(f->part[k], &p[k]);
    if (x->broker != NULL) {
        bench_summarize(x->broker, &br);
        snprintf(fetch, sizeof fetch, "broker fetch alone %.1f", br.p50);
    }
    if (x->table != NULL && x->stats.host_control_table) {
        bench_summarize(x->table, &tb);
        snprintf(fetch + strlen(fetch), sizeof fetch - strlen(fetch),
                 " + control table map alone %.1f", tb.p50);
    }
    row = bench_row_add(e->rep, "S6", "us", "attach (first consume), %s pool",
                        bench_size_name(x->stats.allocation_size, sz, sizeof sz));
    bench_row_values(row, m.p50, m.p99, fl.p50, m.p50 / fl.p50);
    bench_row_goal(row, BENCH_GOAL_BOTH_MAX, S6_GOAL, S6_ABS_US);
    bench_row_note(row,
                   "p50s: measured = %s + import, reserve, map, access, 4 KiB copy, sync; "
                   "floor = import %.1f + reserve %.1f + map %.1f + set access %.1f + 4 KiB "
                   "copy+sync %.1f us",
                   fetch, p[0].p50, p[1].p50, p[2].p50, p[3].p50, p[4].p50);
}

int bench_s6(struct bench_env *e)
{
    static const char *parts[S6_PARTS] = {"import", "reserve", "map", "set access",
                                          "4 KiB copy+sync"};
    uint64_t size = e->opt.quick ? 64 * BENCH_MIB : 256 * BENCH_MIB;
    struct s6_ctx x = {0};
    struct s6_floor f;
    struct bench_series *s;
    int rc = CLI_OK;

    memset(&f, 0, sizeof f);
    s = bench_series_new(e->rep, "us", "S6 first consume+sync after evict");
    f.total = bench_series_new(e->rep, "us", "S6 floor import+reserve+map+access+copy+sync");
    for (int k = 0; k < S6_PARTS; k++)
        f.part[k] = bench_series_new(e->rep, "us", "S6 floor %s", parts[k]);
    if (!s || !f.total || !f.part[S6_PARTS - 1] ||
        bench_pool_create(e, size, 1, 64, &x.pool) != VMMT_OK ||
        vmmt_pool_get_stats(x.pool, &x.stats) != VMMT_OK ||
        vmmt_consumer_create(NULL, &x.c) != VMMT_OK) {
        rc = bench_fail(e, "S6", "attach", "creating the pool and consumer");
        goto out;
    }
    f.type = x.stats.handle_type;
    if (f.type == VMMT_HANDLE_POSIX_FD &&
        ((x.broker = bench_series_new(e->rep, "us", "S6 broker fetch alone")) == NULL ||
         (x.table = bench_series_new(e->rep, "us", "S6 control table attach alone")) == NULL)) {
        rc = bench_fail(e, "S6", "attach", "too many series");
        goto out;
    }
    if (s6_measure(e, &x, s, &f) != VMMT_OK)
        rc = bench_fail(e, "S6", "attach", "measuring");
    else
        s6_row(e, &x, s, &f);
out:
    vmmt_consumer_destroy(x.c);
    vmmt_pool_destroy(x.pool);
    return rc;
}

/* ------------------------------------------------------------------- S7 */

struct s7_ctx {
    vmmt_pool *pool;
    vmmt_consumer *c;
    vmmt_desc desc; /* the one slice the pool has room for */
};

/* Publish until the pool has room; *refused counts the VMMT_EFULL answers. */
static int s7_publish(struct bench_env *e, struct s7_ctx *x, double *refused)
{
    vmmt_buffer b = bench_buffer(e->src, S7_SIZE);
    double give_up = bench_now_us() + FULL_WAIT;
    int st;

    *refused = 0;
    while ((st = vmmt_publish(x->pool, &b, e->ps, &x->desc)) == VMMT_EFULL &&
           bench_now_us() < give_up)
        *refused += 1;
    return st;
}

static int s7_sample(struct bench_env *e, struct s7_ctx *x, double *us, double *refused)
{
    double t0;
    int st;

    st = vmmt_consumer_ack(x->c, &x->desc, e->device, e->cs, 0, 1);
    if (st == VMMT_OK) st = VMMT_CU(e->d, cuStreamSynchronize(e->cs));
    if (st != VMMT_OK) return st;
    /* The acknowledgement is in device memory now: the clock starts. */
    t0 = bench_now_us();
    st = s7_publish(e, x, refused);
    *us = bench_now_us() - t0;
    return st == VMMT_OK ? VMMT_CU(e->d, cuStreamSynchronize(e->ps)) : st;
}

static int s7_measure(struct bench_env *e, struct s7_ctx *x, struct bench_series *s,
                      struct bench_series *refused)
{
    int reps = bench_reps(e, S7_SIZE), warm = bench_warmup(reps), st;
    double v, n;

    st = s7_publish(e, x, &n);
    if (st == VMMT_OK) st = VMMT_CU(e->d, cuStreamSynchronize(e->ps));
    for (int i = 0; i < warm + reps && st == VMMT_OK; i++) {
        st = s7_sample(e, x, &v, &n);
        if (st == VMMT_OK && i >= warm && (bench_series_add(s, v) || bench_series_add(refused, n)))
            st = VMMT_ENOMEM;
    }
    if (st == VMMT_OK) st = vmmt_cancel(x->pool, &x->desc);
    return st == VMMT_OK ? vmmt_pool_drain(x->pool, 5000) : st;
}

int bench_s7(struct bench_env *e)
{
    struct s7_ctx x = {0};
    struct bench_series *s, *refused;
    struct bench_summary m, r;
    struct bench_row *row;
    int rc = CLI_OK;

    s = bench_series_new(e->rep, "us", "S7 ack visible to publish accepted");
    refused = bench_series_new(e->rep, "count", "S7 publishes refused full before that");
    if (!s || !refused || bench_pool_create(e, 2 * BENCH_MIB, 1, 1, &x.pool) != VMMT_OK ||
        vmmt_consumer_create(NULL, &x.c) != VMMT_OK) {
        rc = bench_fail(e, "S7", "recycling", "creating the pool and consumer");
        goto out;
    }
    if (s7_measure(e, &x, s, refused) != VMMT_OK) {
        rc = bench_fail(e, "S7", "recycling", "measuring");
        goto out;
    }
    bench_summarize(s, &m);
    bench_summarize(refused, &r);
    row = bench_row_add(e->rep, "S7", "us", "recycle: last ack to next publish");
    bench_row_values(row, m.p50, m.p99, NAN, NAN);
    bench_row_goal(row, BENCH_GOAL_ABS_MAX, 0, S7_ABS_US);
    bench_row_note(row,
                   "pool with one slot (max_slices=1); publishes refused full before "
                   "success: p50 %.0f, max %.0f",
                   r.p50, r.max);
out:
    vmmt_consumer_destroy(x.c);
    vmmt_pool_destroy(x.pool);
    return rc;
}

/* -------------------------------------------------------------- overhead */

static int overhead_one(struct bench_env *e, int consumers, uint32_t slices)
{
    vmmt_pool *pool = NULL;
    vmmt_pool_stats s;
    char key[64];
    int st;

    st = bench_pool_create(e, 64 * BENCH_MIB, consumers, slices, &pool);
    if (st == VMMT_OK) st = vmmt_pool_get_stats(pool, &s);
    vmmt_pool_destroy(pool);
    if (st != VMMT_OK) return st;
    snprintf(key, sizeof key, "control table, %d consumer(s), %u slices", consumers, slices);
    bench_info_add(e->rep, key, (double)s.table_bytes, "bytes");
    snprintf(key, sizeof key, "fixed overhead (table+align), %d consumer(s)", consumers);
    bench_info_add(e->rep, key, (double)(s.allocation_size - s.data_bytes), "bytes");
    if (consumers == 1)
        bench_info_add(e->rep, "consumer address space per imported pool (64 MiB)",
                       (double)s.allocation_size, "bytes");
    return VMMT_OK;
}

int bench_overhead(struct bench_env *e)
{
    if (overhead_one(e, 1, 4096) != VMMT_OK || overhead_one(e, 8, 4096) != VMMT_OK)
        return bench_fail(e, "--", "pool overhead", "creating a pool");
    return CLI_OK;
}
