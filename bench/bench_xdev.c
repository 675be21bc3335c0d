/*
 * vmmt bench: the consumer's copy done directly, for the floors of the
 * scenarios whose peers run on another device (S3, S5). A peer on another
 * GPU reads the pool over NVLink (or PCIe), so a floor measured as a copy
 * within the producer's device would flatter the library; this is the same
 * read, from memory of the producer's device that the peer's device was
 * granted, on a stream of the peer's device, without a second process.
 */
#include <stdio.h>
#include <string.h>

#include "bench.h"
#include "status.h"

/* Both devices read-write: the library grants the consumer's device the same on import. */
static int grant_peer(const struct bench_env *e, struct bench_xpath *x)
{
    CUmemAccessDesc acc[2];

    memset(acc, 0, sizeof acc);
    for (int i = 0; i < 2; i++) {
        acc[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        acc[i].location.id = i == 0 ? e->device : x->device;
        acc[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    }
    return VMMT_CU(e->d, cuMemSetAccess(x->src.base, x->src.size, acc, 2));
}

/* The source on the producer's device, holding the bench's pattern like the pool would. */
static int open_source(struct bench_env *e, struct bench_xpath *x)
{
    size_t gmin = 0, grec = 0;
    uint64_t size = 0;
    int st;

    st = vmmt__granularity(e->device, VMMT_HANDLE_NONE, &gmin, &grec);
    if (st == VMMT_OK) st = vmmt__align_up(x->bytes, gmin, &size);
    if (st == VMMT_OK) st = vmmt__mapping_create(e->device, size, VMMT_HANDLE_NONE, 0, &x->src);
    if (st == VMMT_OK && x->device != e->device) st = grant_peer(e, x);
    if (st == VMMT_OK) st = VMMT_CU(e->d, cuMemcpyDtoDAsync(x->src.base, e->src, x->bytes, e->ps));
    return st == VMMT_OK ? VMMT_CU(e->d, cuStreamSynchronize(e->ps)) : st;
}

int bench_xpath_open(struct bench_env *e, int device, uint64_t bytes, struct bench_xpath *x)
{
    const struct vmmt_drv *d = e->d;
    int st;

    memset(x, 0, sizeof *x);
    x->device = device;
    x->bytes = bytes;
    st = open_source(e, x);
    if (st != VMMT_OK) return st;
    /* Stream and buffer belong to the peer device's context, as in the consumer process. */
    st = vmmt__ctx_enter(device);
    if (st != VMMT_OK) return st;
    st = VMMT_CU(d, cuStreamCreate(&x->s, CU_STREAM_NON_BLOCKING));
    if (st == VMMT_OK) st = VMMT_CU(d, cuMemAlloc(&x->dst, bytes));
    vmmt__ctx_leave();
    return st;
}

void bench_xpath_close(struct bench_xpath *x)
{
    const struct vmmt_drv *d = vmmt__drv();

    if (d != NULL && (x->s || x->dst) && vmmt__ctx_enter(x->device) == VMMT_OK) {
        if (x->s) d->cuStreamSynchronize(x->s);
        if (x->dst) d->cuMemFree(x->dst);
        if (x->s) d->cuStreamDestroy(x->s);
        vmmt__ctx_leave();
    }
    vmmt__mapping_release(&x->src);
    memset(x, 0, sizeof *x);
    x->device = -1;
}

/*
 * The peer device's context is current while copies are enqueued: it is the
 * accessing device, as in the consumer, and the emulator checks that grant.
 */
int bench_xpath_enqueue(struct bench_xpath *x, uint64_t nbytes, uint64_t copies)
{
    const struct vmmt_drv *d = vmmt__drv();
    int st = vmmt__ctx_enter(x->device);

    if (st != VMMT_OK) return st;
    for (uint64_t i = 0; i < copies && st == VMMT_OK; i++)
        st = VMMT_CU(d, cuMemcpyDtoDAsync(x->dst, x->src.base, nbytes, x->s));
    vmmt__ctx_leave();
    return st;
}

int bench_xpath_sync(struct bench_xpath *x)
{
    const struct vmmt_drv *d = vmmt__drv();
    int st = vmmt__ctx_enter(x->device);

    if (st != VMMT_OK) return st;
    st = VMMT_CU(d, cuStreamSynchronize(x->s));
    vmmt__ctx_leave();
    return st;
}

/* One copy + synchronize; switching contexts is left out, a consumer stays in its own. */
int bench_xpath_sample(struct bench_xpath *x, uint64_t nbytes, double *us)
{
    const struct vmmt_drv *d = vmmt__drv();
    double t0;
    int st = vmmt__ctx_enter(x->device);

    if (st != VMMT_OK) return st;
    t0 = bench_now_us();
    st = VMMT_CU(d, cuMemcpyDtoDAsync(x->dst, x->src.base, nbytes, x->s));
    if (st == VMMT_OK) st = VMMT_CU(d, cuStreamSynchronize(x->s));
    *us = bench_now_us() - t0;
    vmmt__ctx_leave();
    return st;
}

const char *bench_path_name(const struct bench_env *e, int device, char *buf, size_t cap)
{
    if (device == e->device)
        snprintf(buf, cap, "GPU %d", device);
    else
        snprintf(buf, cap, "GPU %d->%d", e->device, device);
    return buf;
}
