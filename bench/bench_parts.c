/*
 * vmmt bench, what S1 and S2 are made of: the cost of each stream operation
 * the hand-off adds to a 4 KiB copy, measured directly against the driver in
 * the same run as the copy floor. It explains the S1/S2 ratios: vmmt's own
 * CPU work is small next to one extra stream operation.
 */
#include <string.h>

#include "bench.h"
#include "cli.h"
#include "ctrl.h"
#include "status.h"

enum part { P_HOST_WRITE, P_DEV_WRITE, P_DEV_WRITE_NOBAR, P_EVENT, P_HOST_WAIT, P_COUNT };

static const char *const g_part_name[P_COUNT] = {
    "copy+flag(host table)+sync", "copy+flag(device)+sync",   "copy+flag(dev,no barrier)+sync",
    "copy+event record+sync",     "wait(host,set)+copy+sync",
};

struct parts {
    struct vmmt__ctrl host; /* one registered page, as the library's table */
    CUdeviceptr dev_word;
    CUevent ev;
    struct bench_series *total[P_COUNT], *op[P_COUNT], *floor;
    int refused[P_COUNT];
    char why[P_COUNT][160];
};

/* Enqueue the part's extra operation; *op_us is the CPU time of that call. */
static CUresult enqueue_op(struct bench_env *e, struct parts *x, int p, double *op_us)
{
    const struct vmmt_drv *d = e->d;
    double t0 = bench_now_us();
    CUresult r = CUDA_SUCCESS;

    switch (p) {
    case P_HOST_WRITE: r = d->cuStreamWriteValue32(e->ps, x->host.dev, 1, 0); break;
    case P_DEV_WRITE: r = d->cuStreamWriteValue32(e->ps, x->dev_word, 1, 0); break;
    case P_DEV_WRITE_NOBAR:
        r = d->cuStreamWriteValue32(e->ps, x->dev_word, 1, CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER);
        break;
    case P_EVENT: r = d->cuEventRecord(x->ev, e->ps); break;
    case P_HOST_WAIT:
        r = d->cuStreamWaitValue32(e->ps, x->host.dev, 0, CU_STREAM_WAIT_VALUE_GEQ);
        break;
    }
    *op_us = bench_now_us() - t0;
    return r;
}

static int part_sample(struct bench_env *e, struct parts *x, int p, int measured)
{
    const struct vmmt_drv *d = e->d;
    double t0 = bench_now_us(), op_us = 0;
    CUresult r = CUDA_SUCCESS;

    if (p == P_HOST_WAIT) r = enqueue_op(e, x, p, &op_us);
    if (r == CUDA_SUCCESS) r = d->cuMemcpyDtoDAsync(e->tmp, e->src, 4 * BENCH_KIB, e->ps);
    if (r == CUDA_SUCCESS && p != P_HOST_WAIT) r = enqueue_op(e, x, p, &op_us);
    if (r == CUDA_SUCCESS) r = d->cuStreamSynchronize(e->ps);
    if (r != CUDA_SUCCESS) {
        /* A refused operation is a finding, not a failure of the benchmark. */
        x->refused[p] = 1;
        snprintf(x->why[p], sizeof x->why[p], "refused by the driver: %s", vmmt__cu_name(r));
        d->cuStreamSynchronize(e->ps);
        return VMMT_OK;
    }
    if (measured &&
        (bench_series_add(x->total[p], bench_now_us() - t0) || bench_series_add(x->op[p], op_us)))
        return VMMT_ENOMEM;
    return VMMT_OK;
}

static int parts_run(struct bench_env *e, struct parts *x)
{
    int reps = bench_reps(e, 4 * BENCH_KIB), warm = bench_warmup(reps), st = VMMT_OK;
    double us;

    for (int i = 0; i < warm + reps && st == VMMT_OK; i++) {
        st = bench_copy_sample(e, e->ps, 4 * BENCH_KIB, &us);
        if (st == VMMT_OK && i >= warm && bench_series_add(x->floor, us)) st = VMMT_ENOMEM;
        for (int p = 0; p < P_COUNT && st == VMMT_OK; p++)
            if (!x->refused[p]) st = part_sample(e, x, p, i >= warm);
    }
    return st;
}

static void parts_rows(struct bench_env *e, const struct parts *x)
{
    struct bench_summary f, t, o;

    bench_summarize(x->floor, &f);
    for (int p = 0; p < P_COUNT; p++) {
        struct bench_row *row = bench_row_add(e->rep, "S1", "us", "part: %s", g_part_name[p]);
        if (x->refused[p]) {
            bench_row_note(row, "%s", x->why[p]);
            continue;
        }
        bench_summarize(x->total[p], &t);
        bench_summarize(x->op[p], &o);
        bench_row_values(row, t.p50, t.p99, f.p50, t.p50 / f.p50);
        bench_row_note(row, "4 KiB; the extra operation's call alone: p50 %.2f us", o.p50);
    }
}

int bench_s1_parts(struct bench_env *e)
{
    const struct vmmt_drv *d = e->d;
    struct parts x;
    int st;

    memset(&x, 0, sizeof x);
    x.host.fd = -1;
    x.floor = bench_series_new(e->rep, "us", "S1 parts floor DtoD+sync 4 KiB");
    for (int p = 0; p < P_COUNT; p++) {
        x.total[p] = bench_series_new(e->rep, "us", "S1 part %s", g_part_name[p]);
        x.op[p] = bench_series_new(e->rep, "us", "S1 part call %s", g_part_name[p]);
    }
    st = vmmt__ctrl_create_shared(4096, &x.host);
    if (st == VMMT_OK) st = VMMT_CU(d, cuMemAlloc(&x.dev_word, 4096));
    if (st == VMMT_OK) st = VMMT_CU(d, cuMemsetD8Async(x.dev_word, 0, 4096, e->ps));
    if (st == VMMT_OK) st = VMMT_CU(d, cuEventCreate(&x.ev, CU_EVENT_DISABLE_TIMING));
    if (st == VMMT_OK) st = parts_run(e, &x);
    if (st == VMMT_OK) parts_rows(e, &x);
    if (x.ev) d->cuEventDestroy(x.ev);
    if (x.dev_word) d->cuMemFree(x.dev_word);
    vmmt__ctrl_release(&x.host);
    return st == VMMT_OK ? CLI_OK : bench_fail(e, "S1", "parts", "measuring");
}
