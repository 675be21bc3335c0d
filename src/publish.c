/*
 * Publishing into the pool and cancelling. A publish reserves a slot and a
 * slice under the lock, then enqueues its copies and the ready flag on the
 * caller's stream without the lock, so publishers on different streams run
 * side by side.
 */
#include <inttypes.h>
#include <string.h>

#include "ctrl.h"
#include "driver.h"
#include "pool_internal.h"
#include "status.h"

/* Element size rounded up to a power of two, at most the slice alignment. */
static uint64_t element_align(const vmmt_buffer *b)
{
    uint64_t bytes = ((uint64_t)b->dtype.bits * (b->dtype.lanes ? b->dtype.lanes : 1) + 7) / 8;
    uint64_t a = 1;

    while (a < bytes && a < VMMT__DATA_ALIGN)
        a <<= 1;
    return a;
}

static int check_buffer(const vmmt_buffer *b, size_t i)
{
    uint64_t elems = 1, bytes;

    if (b->nbytes == 0) return vmmt__fail(VMMT_EINVAL, "buffer %zu has nbytes=0", i);
    if (b->ptr == 0) return vmmt__fail(VMMT_EINVAL, "buffer %zu has a NULL device pointer", i);
    if (b->location != VMMT_LOC_DEVICE && b->location != VMMT_LOC_HOST)
        return vmmt__fail(
            VMMT_EINVAL, "buffer %zu has location=%d; use VMMT_LOC_DEVICE (0) or VMMT_LOC_HOST (1)",
            i, b->location);
    if (b->ndim < 0 || b->ndim > VMMT_MAX_DIMS)
        return vmmt__fail(VMMT_EINVAL, "buffer %zu has ndim=%d; at most %d dimensions", i, b->ndim,
                          VMMT_MAX_DIMS);
    if (b->dtype.bits == 0) return VMMT_OK;
    for (int k = 0; k < b->ndim; k++) {
        if (b->shape[k] < 0 || (b->shape[k] != 0 && elems > UINT64_MAX / (uint64_t)b->shape[k]))
            return vmmt__fail(VMMT_EINVAL, "buffer %zu has an invalid shape[%d]=%" PRId64, i, k,
                              b->shape[k]);
        elems *= (uint64_t)b->shape[k];
    }
    bytes = elems * b->dtype.bits * (b->dtype.lanes ? b->dtype.lanes : 1) / 8;
    if (bytes != b->nbytes)
        return vmmt__fail(VMMT_EINVAL,
                          "buffer %zu: shape and dtype give %" PRIu64 " bytes but nbytes=%" PRIu64,
                          i, bytes, b->nbytes);
    return VMMT_OK;
}

/* Offsets of each member inside one slice, and the slice's size. */
static int pack_layout(const vmmt_buffer *bufs, size_t n, uint64_t *rel, uint64_t *total)
{
    uint64_t at = 0;

    for (size_t i = 0; i < n; i++) {
        if (vmmt__align_up(at, element_align(&bufs[i]), &at) != VMMT_OK ||
            at > UINT64_MAX - bufs[i].nbytes)
            return vmmt__fail(VMMT_ETOOBIG, "packed buffers overflow a 64-bit size");
        rel[i] = at;
        at += bufs[i].nbytes;
    }
    *total = at;
    return VMMT_OK;
}

/* Take a slot and a slice; lock held. */
static int reserve_locked(struct vmmt_pool *p, uint64_t bytes, uint32_t *slot)
{
    uint64_t off;
    int st;

    if (p->free_count == 0) return VMMT_EFULL;
    st = vmmt__slab_alloc(p->slab, bytes, VMMT__DATA_ALIGN, &off);
    if (st != VMMT_OK) return st;
    *slot = p->free_slots[--p->free_count];
    p->slot[*slot].generation = vmmt__next_generation(p->slot[*slot].generation);
    p->slot[*slot].state = SLOT_PUBLISHING;
    p->slot[*slot].slice_offset = off;
    p->slot[*slot].slice_bytes = bytes;
    return VMMT_OK;
}

static int fail_full(struct vmmt_pool *p, uint64_t bytes)
{
    struct vmmt__slab_stats s;
    int warn;

    vmmt__slab_stats(p->slab, &s);
    p->full++;
    warn = !p->warned_full;
    p->warned_full = 1;
    vmmt__fail(VMMT_EFULL,
               "pool is full: %" PRIu64 " bytes asked, largest free slice %" PRIu64
               " bytes, %u of %u slots in flight; fall back to another path or retry once "
               "consumers acknowledge",
               bytes, s.largest_free, p->in_flight, p->slots);
    if (warn)
        vmmt__log(VMMT_LOG_WARN, "%s (warned once; vmmt_pool_get_stats counts them)",
                  vmmt_last_error());
    return VMMT_EFULL;
}

/* Reserve, reclaiming once when the pool looks full. The caller is active. */
static int reserve(struct vmmt_pool *p, uint64_t bytes, uint32_t *slot)
{
    int st;

    pthread_mutex_lock(&p->lock);
    st = reserve_locked(p, bytes, slot);
    if (st == VMMT_EFULL && p->in_flight > 0) {
        pthread_mutex_unlock(&p->lock);
        vmmt__pool_reclaim(p, NULL);
        pthread_mutex_lock(&p->lock);
        st = p->failed ? vmmt__pool_check_usable(p) : reserve_locked(p, bytes, slot);
    }
    if (st == VMMT_EFULL) st = fail_full(p, bytes);
    if (st == VMMT_ETOOBIG)
        vmmt__fail(VMMT_ETOOBIG,
                   "%" PRIu64 " bytes can never fit: the pool's data region holds %" PRIu64
                   " bytes; publish it another way or create a larger pool",
                   bytes, p->map.size - p->data_offset);
    pthread_mutex_unlock(&p->lock);
    return st;
}

/*
 * End of a publish: the slot goes in flight, or back to the free lists. A
 * quarantined pool keeps the slice reserved, since its copy may still run.
 */
static void finish(struct vmmt_pool *p, uint32_t slot, int st, size_t n)
{
    pthread_mutex_lock(&p->lock);
    if (st == VMMT_OK) {
        p->slot[slot].state = SLOT_IN_FLIGHT;
        p->in_flight++;
        p->in_flight_bytes += p->slot[slot].slice_bytes;
        p->published += n;
        /* The recycler polls on its own while it is not idle: no wake-up to pay. */
        if (p->recycler_idle) pthread_cond_signal(&p->wake);
    } else if (st != VMMT_EFAILED) {
        vmmt__slot_release(p, slot);
    }
    pthread_mutex_unlock(&p->lock);
}

/*
 * Whether every host source is page-locked, so the publish may stay
 * stream-ordered. A pageable source makes the publish synchronize instead:
 * the caller may reuse pageable memory as soon as the call returns, which
 * only a finished copy allows. A "host" pointer that the driver knows as
 * device memory is the caller's mistake, said as such. Context current.
 */
static int host_sources_pinned(const vmmt_buffer *bufs, size_t n, int *pinned)
{
    const struct vmmt_drv *d = vmmt__drv();

    *pinned = 1;
    for (size_t i = 0; i < n; i++) {
        unsigned type = 0;
        if (bufs[i].location != VMMT_LOC_HOST) continue;
        /* Pageable memory is unknown to the driver: INVALID_VALUE, not a failure. */
        if (d->cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, bufs[i].ptr) !=
                CUDA_SUCCESS ||
            type != CU_MEMORYTYPE_HOST)
            *pinned = 0;
        if (type == CU_MEMORYTYPE_DEVICE)
            return vmmt__fail(VMMT_EINVAL,
                              "buffer %zu has location=VMMT_LOC_HOST but %#" PRIx64
                              " is device memory; set location to VMMT_LOC_DEVICE",
                              i, bufs[i].ptr);
    }
    return VMMT_OK;
}

/*
 * Enqueue the copies and the ready flag. When a step fails after earlier
 * copies were enqueued, the stream must drain before the slice can be
 * reused; if even that fails, the pool's state is uncertain.
 */
static int enqueue(struct vmmt_pool *p, const vmmt_buffer *bufs, size_t n, const uint64_t *rel,
                   uint32_t slot, CUstream s, int sync)
{
    const struct vmmt_drv *d = vmmt__drv();
    CUdeviceptr slice = p->map.base + p->data_offset + p->slot[slot].slice_offset;
    uint32_t gen = p->slot[slot].generation;
    struct vmmt__saved_error first;
    CUresult r = CUDA_SUCCESS, sr;
    size_t enqueued = 0;

    for (; enqueued < n; enqueued++) {
        const vmmt_buffer *b = &bufs[enqueued];
        if (b->location == VMMT_LOC_HOST)
            r = d->cuMemcpyHtoDAsync(slice + rel[enqueued], (const void *)(uintptr_t)b->ptr,
                                     b->nbytes, s);
        else
            r = d->cuMemcpyDtoDAsync(slice + rel[enqueued], b->ptr, b->nbytes, s);
        if (r != CUDA_SUCCESS) {
            vmmt__cu_fail(r, "%s(%" PRIu64 " bytes of buffer %zu into the pool)",
                          b->location == VMMT_LOC_HOST ? "cuMemcpyHtoDAsync" : "cuMemcpyDtoDAsync",
                          b->nbytes, enqueued);
            break;
        }
    }
    if (r == CUDA_SUCCESS) {
        /* The default flag keeps the memory barrier: consumers that see the
         * flag with a CPU load start their copies with no GPU-side wait, so
         * the copy's bytes must be visible before the flag is. */
        r = d->cuStreamWriteValue32(s, vmmt__ctrl_ready(p->ctrl_dev, p->stride, slot), gen,
                                    CU_STREAM_WRITE_VALUE_DEFAULT);
        if (r != CUDA_SUCCESS) vmmt__cu_fail(r, "cuStreamWriteValue32(ready flag)");
    }
    if (r == CUDA_SUCCESS && p->handoff == VMMT_HANDOFF_STREAM && !sync) return VMMT_OK;
    if (r != CUDA_SUCCESS && enqueued == 0) return vmmt_last_status();
    /* Synchronous hand-off, or copies queued before a failure: drain the stream. */
    vmmt__error_save(&first);
    sr = d->cuStreamSynchronize(s);
    if (sr == CUDA_SUCCESS) return r == CUDA_SUCCESS ? VMMT_OK : vmmt__error_restore(&first);
    if (r != CUDA_SUCCESS)
        vmmt__cu_fail(sr, "%s; then cuStreamSynchronize draining the copies already queued",
                      first.msg);
    else
        vmmt__cu_fail(sr, "cuStreamSynchronize after enqueuing the publish copy");
    vmmt__pool_quarantine(p);
    return vmmt__wrap(VMMT_EFAILED, "the pool is quarantined");
}

static void describe(struct vmmt_pool *p, const vmmt_buffer *bufs, size_t n, const uint64_t *rel,
                     uint32_t slot, vmmt_desc *out)
{
    struct vmmt__desc d = p->tmpl;
    const struct vmmt__slot *s = &p->slot[slot];

    d.slot = slot;
    d.generation = s->generation;
    d.slice_offset = p->data_offset + s->slice_offset;
    d.slice_bytes = s->slice_bytes;
    d.pack_count = (uint16_t)n;
    if (n > 1) d.flags |= VMMT__DESC_PACKED;
    for (size_t i = 0; i < n; i++) {
        d.pack_index = (uint16_t)i;
        d.offset = d.slice_offset + rel[i];
        d.nbytes = bufs[i].nbytes;
        d.dtype_code = bufs[i].dtype.code;
        d.dtype_bits = bufs[i].dtype.bits;
        d.dtype_lanes = bufs[i].dtype.lanes;
        d.ndim = (uint32_t)bufs[i].ndim;
        memset(d.shape, 0, sizeof d.shape);
        memcpy(d.shape, bufs[i].shape, (size_t)bufs[i].ndim * sizeof d.shape[0]);
        vmmt__desc_encode(&d, out[i].bytes);
    }
}

int vmmt_publish_packed(vmmt_pool *p, const vmmt_buffer *bufs, size_t n, void *stream,
                        vmmt_desc *out)
{
    uint64_t rel[VMMT__MAX_PACK], total = 0;
    uint32_t slot = 0;
    int st;

    if (p == NULL || bufs == NULL || out == NULL || n == 0)
        return vmmt__fail(VMMT_EINVAL, "vmmt_publish: pool, buffers and out must be given");
    if (n > VMMT__MAX_PACK)
        return vmmt__fail(VMMT_EINVAL, "a packed publish holds at most %d buffers, got %zu",
                          VMMT__MAX_PACK, n);
    for (size_t i = 0; i < n; i++)
        if ((st = check_buffer(&bufs[i], i)) != VMMT_OK) return st;
    st = pack_layout(bufs, n, rel, &total);
    if (st == VMMT_OK) st = vmmt__pool_enter(p);
    if (st != VMMT_OK) return st;
    st = reserve(p, total, &slot);
    if (st == VMMT_OK) {
        int pinned = 1;
        st = vmmt__ctx_enter(p->device);
        if (st == VMMT_OK) {
            st = host_sources_pinned(bufs, n, &pinned);
            if (st == VMMT_OK) st = enqueue(p, bufs, n, rel, slot, (CUstream)stream, !pinned);
            vmmt__ctx_leave();
        }
        if (st == VMMT_OK) describe(p, bufs, n, rel, slot, out);
        finish(p, slot, st, n);
    }
    vmmt__pool_leave(p);
    return st;
}

int vmmt_publish(vmmt_pool *p, const vmmt_buffer *buf, void *stream, vmmt_desc *out)
{
    return vmmt_publish_packed(p, buf, 1, stream, out);
}

int vmmt_cancel(vmmt_pool *p, const vmmt_desc *desc)
{
    struct vmmt__desc d;
    struct vmmt__slot *s;
    int st;

    if (p == NULL || desc == NULL)
        return vmmt__fail(VMMT_EINVAL, "vmmt_cancel: pool and desc must not be NULL");
    st = vmmt__desc_decode(desc->bytes, &d);
    if (st != VMMT_OK) return vmmt__wrap(st, "vmmt_cancel");
    st = vmmt__desc_check_pool(&d, &p->tmpl);
    if (st != VMMT_OK) return vmmt__wrap(st, "vmmt_cancel: the descriptor is not from this pool");
    st = vmmt__pool_enter(p);
    if (st != VMMT_OK) return st;
    pthread_mutex_lock(&p->lock);
    s = &p->slot[d.slot];
    if (s->generation == d.generation && s->state == SLOT_IN_FLIGHT) {
        p->cancelled++;
        /* Stream-ordered: the copy may still be running; the recycler frees
         * the slice once the ready flag shows it finished. */
        if (p->handoff == VMMT_HANDOFF_SYNC) {
            p->in_flight--;
            p->in_flight_bytes -= s->slice_bytes;
            vmmt__slot_release(p, d.slot);
            pthread_cond_broadcast(&p->changed);
        } else {
            s->state = SLOT_CANCELLED;
        }
    }
    pthread_mutex_unlock(&p->lock);
    vmmt__pool_leave(p);
    return VMMT_OK;
}
