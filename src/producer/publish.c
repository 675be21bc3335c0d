/*
 * Publishing into the pool and cancelling. A publish reserves a slot and a
 * slice under the lock, then enqueues its copies and the ready flag on the
 * caller's stream without the lock, so publishers on different streams run
 * side by side.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "abi.h"
#include "ctrl.h"
#include "broker_wire.h"
#include "driver.h"
#include "elastic.h"
#include "pool_internal.h"
#include "publish_kernel.h"
#include "status.h"

/*
 * What only publish can check: a pointer to copy from and a shape array it
 * may read. Everything the descriptor records (dtype, shape, nbytes) is
 * checked by the descriptor's own validator in check_records.
 */
static int check_buffer(const vmmt_buffer *b, size_t i)
{
    if (b->nbytes == 0) return vmmt__fail(VMMT_EINVAL, "buffer %zu has nbytes=0", i);
    if (b->ptr == 0) return vmmt__fail(VMMT_EINVAL, "buffer %zu has a NULL device pointer", i);
    /* Before anything is reserved: a host pool's CPU copy would fault on it. */
    if (b->ptr > UINT64_MAX - b->nbytes)
        return vmmt__fail(VMMT_EINVAL,
                          "buffer %zu at 0x%" PRIx64 " with nbytes=%" PRIu64
                          " wraps the address space",
                          i, b->ptr, b->nbytes);
    if (b->location != VMMT_LOC_DEVICE && b->location != VMMT_LOC_HOST)
        return vmmt__fail(
            VMMT_EINVAL, "buffer %zu has location=%d; use VMMT_LOC_DEVICE (0) or VMMT_LOC_HOST (1)",
            i, b->location);
    if (b->ndim < 0 || b->ndim > VMMT_MAX_DIMS)
        return vmmt__fail(VMMT_EINVAL, "buffer %zu has ndim=%d; at most %d dimensions", i, b->ndim,
                          VMMT_MAX_DIMS);
    return VMMT_OK;
}

/* Offsets of each member inside one slice, and the slice's size. */
static int pack_layout(const vmmt_buffer *bufs, size_t n, uint64_t *rel, uint64_t *total)
{
    uint64_t at = 0;

    for (size_t i = 0; i < n; i++) {
        if (vmmt__align_up(at, vmmt__desc_elem_align(bufs[i].dtype.bits, bufs[i].dtype.lanes),
                           &at) != VMMT_OK ||
            at > UINT64_MAX - bufs[i].nbytes)
            return vmmt__fail(VMMT_ETOOBIG, "packed buffers overflow a 64-bit size");
        rel[i] = at;
        at += bufs[i].nbytes;
    }
    *total = at;
    return VMMT_OK;
}

/*
 * Take a slot and a slice, the slot's generation advanced (prev_generation
 * keeps the one before: pool_internal.h); lock held.
 */
static int reserve_locked(struct vmmt_pool *p, uint64_t bytes, uint32_t *slot)
{
    uint64_t off;
    int st;

    if (p->free_count == 0) return VMMT_EFULL;
    st = vmmt__slab_alloc(p->slab, bytes, VMMT__DATA_ALIGN, &off);
    if (st != VMMT_OK) return st;
    /* An elastic pool backs the slice's chunks before handing it out. */
    if (p->el != NULL && (st = vmmt__elastic_hold(p, off, bytes)) != VMMT_OK) {
        (void)vmmt__slab_free(p->slab, off);
        return st;
    }
    *slot = p->free_slots[--p->free_count];
    /* One counter for the pool: a generation names one occupant of the whole
     * pool, so a descriptor whose slot field was changed names nobody there. */
    p->last_generation = vmmt__next_generation(p->last_generation);
    p->slot[*slot].prev_generation = p->slot[*slot].generation;
    p->slot[*slot].generation = p->last_generation;
    /* Once the counter has wrapped since the slot's last occupant:
     * acknowledgement words left from before could hold this very generation;
     * zero (never a generation) them before the slice is handed out, so only
     * this occupant's count. A device table is zeroed on the publishing
     * stream (vmmt__publish_clear_acks). */
    if (vmmt__slot_wrapped(&p->slot[*slot]) && p->host_table) {
        uint32_t *ack = p->table_host + vmmt__ctrl_ack(0, p->stride, *slot, 0) / 4;
        for (int i = 0; i < p->cfg.consumer_count; i++)
            __atomic_store_n(&ack[i], 0, __ATOMIC_RELEASE);
    }
    p->slot[*slot].state = SLOT_PUBLISHING;
    p->slot[*slot].slice_offset = off;
    p->slot[*slot].slice_bytes = bytes;
    return VMMT_OK;
}

/* `why`: what stood in the way of a reclaim on demand, or "". */
static int fail_full(struct vmmt_pool *p, uint64_t bytes, const char *why)
{
    struct vmmt__slab_stats s;
    char id[9];
    int warn;

    vmmt__slab_stats(p->slab, &s);
    p->full++;
    warn = !p->warned_full;
    p->warned_full = 1;
    /* The pool named: a process with several pools (one per device) must tell which. */
    vmmt__fail(VMMT_EFULL,
               "pool %s is full: %" PRIu64 " bytes asked, largest free slice %" PRIu64
               " bytes, %u of %u slots in flight; fall back to another path or retry once "
               "consumers acknowledge%s",
               vmmt__short_id(p->tmpl.pool_id, id), bytes, s.largest_free, p->in_flight, p->slots,
               why);
    if (warn)
        vmmt__log(VMMT_LOG_WARN, "%s (warned once; vmmt_pool_get_stats counts them)",
                  vmmt_last_error());
    return VMMT_EFULL;
}

/* Reserve, reclaiming once when the pool looks full. The caller is active. */
static int reserve(struct vmmt_pool *p, uint64_t bytes, uint32_t *slot)
{
    char why[600] = "";
    int st;

    pthread_mutex_lock(&p->lock);
    st = reserve_locked(p, bytes, slot);
    if (st == VMMT_EFULL && p->in_flight > 0 && vmmt__pool_sweep_locked(p) > 0)
        st = reserve_locked(p, bytes, slot);
    if (st == VMMT_EFULL && p->in_flight > 0 && !p->host_table) {
        pthread_mutex_unlock(&p->lock);
        /* A reclaim that failed is named: a full pool is not the whole story then. */
        if (vmmt__pool_reclaim(p, NULL) != VMMT_OK)
            snprintf(why, sizeof why, " (reclaiming on demand failed: %s)", vmmt_last_error());
        pthread_mutex_lock(&p->lock);
        st = p->failed ? vmmt__pool_check_usable(p) : reserve_locked(p, bytes, slot);
    }
    if (st == VMMT_EFULL) st = fail_full(p, bytes, why);
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
 * A failed publish may have written its PENDING word, so its generation is
 * retired rather than given back: the word never moves backwards (ctrl.h).
 */
static void finish(struct vmmt_pool *p, uint32_t slot, int st, size_t n)
{
    if (st != VMMT_OK && st != VMMT_EFAILED) {
        struct vmmt__saved_error e;
        vmmt__error_save(&e);
        if (vmmt__pool_retire_now(p, slot) != VMMT_OK) {
            vmmt__pool_quarantine(p);
            st = VMMT_EFAILED; /* the slice stays reserved: its word is unknown */
        }
        vmmt__error_restore(&e);
    }
    pthread_mutex_lock(&p->lock);
    if (st == VMMT_OK) {
        p->slot[slot].state = SLOT_IN_FLIGHT;
        p->in_flight++;
        p->in_flight_bytes += p->slot[slot].slice_bytes;
        p->published += n;
        /* The recycler polls on its own while it is not idle: no wake-up to pay. */
        if (p->recycler_idle) pthread_cond_signal(&p->wake);
    } else if (st != VMMT_EFAILED) {
        /* Retired above, and no descriptor handed out. */
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
/*
 * A device table's acknowledgement words at a generation wrap (see
 * reserve_locked), zeroed on the stream ahead of the copy; the context is
 * current.
 */
int vmmt__publish_clear_acks(struct vmmt_pool *p, uint32_t slot, CUstream s)
{
    CUresult r;

    if (p->host_table || !vmmt__slot_wrapped(&p->slot[slot])) return VMMT_OK;
    r = vmmt__drv()->cuMemsetD8Async(vmmt__ctrl_ack(p->ctrl_dev, p->stride, slot, 0), 0,
                                     4 * (size_t)p->cfg.consumer_count, s);
    if (r != CUDA_SUCCESS)
        return vmmt__cu_fail(r, "cuMemsetD8Async(acknowledgements of slot %u at generation wrap)",
                             slot);
    return VMMT_OK;
}

/*
 * The slot's ready word goes to PENDING for its new occupant (generation.h)
 * before any copy and before the descriptor exists: a CPU store into a
 * shared table; a device table's word is written and synchronized on the
 * pool's own stream (about 10 us), not queued on s, where it could wait
 * behind the caller's kernels while a consumer already holds the
 * descriptor. So a consumer that finds another occupant's word knows the
 * descriptor was never handed out, and refuses it at once.
 */
int vmmt__publish_pending(struct vmmt_pool *p, uint32_t slot)
{
    if (!p->host_table) return vmmt__pool_pending_now(p, slot);
    __atomic_store_n(p->table_host + vmmt__ctrl_ready(0, p->stride, slot) / 4,
                     vmmt__gen_pending(p->slot[slot].generation), __ATOMIC_RELEASE);
    return VMMT_OK;
}

static int enqueue(struct vmmt_pool *p, const vmmt_buffer *bufs, size_t n, const uint64_t *rel,
                   uint32_t slot, CUstream s, int sync)
{
    const struct vmmt_drv *d = vmmt__drv();
    CUdeviceptr slice = p->map.base + p->data_offset + p->slot[slot].slice_offset;
    uint32_t gen = p->slot[slot].generation;
    struct vmmt__saved_error first;
    CUresult r = CUDA_SUCCESS, sr;
    size_t enqueued = 0;

    int st = vmmt__publish_clear_acks(p, slot, s), kernel;
    if (st == VMMT_OK) st = vmmt__publish_pending(p, slot);
    if (st != VMMT_OK) return st;
    /* One small device buffer: the copy and the ready word as one kernel, where it may run. */
    kernel = n == 1 && vmmt__kernel_publish(p, &bufs[0], slice + rel[0],
                                            vmmt__ctrl_ready(p->ctrl_dev, p->stride, slot), gen, s);
    for (; !kernel && enqueued < n; enqueued++) {
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
    if (r == CUDA_SUCCESS && !kernel) {
        /* The default flag keeps the memory barrier: consumers that see the
         * flag with a CPU load start their copies with no GPU-side wait, so
         * the copy's bytes must be visible before the flag is. */
        r = d->cuStreamWriteValue32(s, vmmt__ctrl_ready(p->ctrl_dev, p->stride, slot), gen,
                                    CU_STREAM_WRITE_VALUE_DEFAULT);
        if (r != CUDA_SUCCESS) vmmt__cu_fail(r, "cuStreamWriteValue32(ready flag)");
    }
    if (r == CUDA_SUCCESS && p->handoff == VMMT_HANDOFF_STREAM && !sync) return VMMT_OK;
    if (r != CUDA_SUCCESS && enqueued == 0) return vmmt_last_status();
    /* Synchronous hand-off, or writes queued before a failure: drain the stream. */
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

/*
 * The record of member i in a slice at slice_offset (from the data region)
 * under slot/gen; held: the slot is the caller's (vmmt__elastic_describe).
 */
static void build(const struct vmmt_pool *p, const vmmt_buffer *bufs, size_t n, const uint64_t *rel,
                  size_t i, uint32_t slot, uint32_t gen, uint64_t slice_offset,
                  uint64_t slice_bytes, int held, struct vmmt__desc *d)
{
    *d = p->tmpl;
    d->slot = slot;
    d->generation = gen;
    d->slice_offset = p->data_offset + slice_offset;
    d->slice_bytes = slice_bytes;
    d->pack_count = (uint16_t)n;
    if (n > 1) d->flags |= VMMT__DESC_PACKED;
    d->pack_index = (uint16_t)i;
    d->offset = d->slice_offset + rel[i];
    vmmt__elastic_describe(p, d, held);
    d->nbytes = bufs[i].nbytes;
    d->dtype_code = bufs[i].dtype.code;
    d->dtype_bits = bufs[i].dtype.bits;
    d->dtype_lanes = bufs[i].dtype.lanes;
    d->ndim = (uint32_t)bufs[i].ndim;
    memset(d->shape, 0, sizeof d->shape);
    memcpy(d->shape, bufs[i].shape, (size_t)bufs[i].ndim * sizeof d->shape[0]);
}

/*
 * Before anything is reserved, every member's record is built as it will be
 * sent (at the start of the data region, in slot 0, the first generation: the slice's
 * real place keeps every alignment) and put through the readers' validator.
 * A buffer whose descriptor a consumer would refuse is refused here, so no
 * slice is ever published that nobody can acknowledge.
 */
static int check_records(const struct vmmt_pool *p, const vmmt_buffer *bufs, size_t n,
                         const uint64_t *rel, uint64_t total)
{
    struct vmmt__desc d;

    if (total > p->map.size - p->data_offset)
        return vmmt__fail(VMMT_ETOOBIG,
                          "%" PRIu64 " bytes can never fit: the pool's data region holds %" PRIu64
                          " bytes; publish it another way or create a larger pool",
                          total, p->map.size - p->data_offset);
    for (size_t i = 0; i < n; i++) {
        /* No chunk is held yet: any incarnation stands for the one it will have. */
        build(p, bufs, n, rel, i, 0, VMMT__GEN_FIRST, 0, total, 0, &d);
        if (vmmt__desc_check(&d, VMMT_EINVAL,
                             "consumers would refuse this descriptor: fix the buffer's dtype "
                             "(lanes >= 1 when bits > 0; code and lanes 0 when bits is 0), "
                             "shape or nbytes (ceil(elements * bits * lanes / 8))") != VMMT_OK)
            return vmmt__wrap(VMMT_EINVAL, "vmmt_publish: buffer %zu", i);
    }
    return VMMT_OK;
}

static void describe(struct vmmt_pool *p, const vmmt_buffer *bufs, size_t n, const uint64_t *rel,
                     uint32_t slot, vmmt_desc *out)
{
    const struct vmmt__slot *s = &p->slot[slot];
    struct vmmt__desc d;

    for (size_t i = 0; i < n; i++) {
        build(p, bufs, n, rel, i, slot, s->generation, s->slice_offset, s->slice_bytes, 1, &d);
        vmmt__desc_encode(&d, out[i].bytes);
        vmmt__desc_seal(out[i].bytes, p->seal_key);
    }
}

#define BUFFER_V1 VMMT__SIZE_V1(vmmt_buffer, shape)

int vmmt_publish_packed_size(vmmt_pool *p, const vmmt_buffer *theirs, size_t n, size_t buf_size,
                             void *stream, vmmt_desc *out)
{
    uint64_t rel[VMMT__MAX_PACK], total = 0;
    vmmt_buffer bufs[VMMT__MAX_PACK];
    uint32_t slot = 0;
    int st;

    if (p == NULL || theirs == NULL || out == NULL || n == 0)
        return vmmt__fail(VMMT_EINVAL,
                          "vmmt_publish: pool, buffers and out must be given, count at least 1");
    if (n > VMMT__MAX_PACK)
        return vmmt__fail(VMMT_EINVAL, "a packed publish holds at most %d buffers, got %zu",
                          VMMT__MAX_PACK, n);
    /* The caller's array, element by element at its own stride, as this library's structs. */
    for (size_t i = 0; i < n; i++) {
        memset(&bufs[i], 0, sizeof bufs[i]);
        st = vmmt__struct_in(&bufs[i], sizeof bufs[i], (const char *)theirs + i * buf_size,
                             buf_size, BUFFER_V1, "vmmt_publish: buffer");
        if (st != VMMT_OK) return vmmt__wrap(st, "vmmt_publish: buffer %zu", i);
    }
    for (size_t i = 0; i < n; i++)
        if ((st = check_buffer(&bufs[i], i)) != VMMT_OK) return st;
    st = pack_layout(bufs, n, rel, &total);
    if (st == VMMT_OK) st = vmmt__pool_enter(p);
    if (st != VMMT_OK) return st;
    st = check_records(p, bufs, n, rel, total);
    if (st == VMMT_OK) st = reserve(p, total, &slot);
    if (st == VMMT_OK) {
        int pinned = 1;
        /* A host pool copies host memory with the CPU, in no context. */
        if (p->host_mem)
            st = vmmt__host_pool_copy(p, bufs, n, rel, slot, (CUstream)stream);
        else if ((st = vmmt__ctx_enter(p->device)) == VMMT_OK) {
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

int vmmt_cancel(vmmt_pool *p, const vmmt_desc *desc)
{
    struct vmmt__desc d;
    struct vmmt__slot *s;
    int st, reclaim_now = 0, device_acks = 0;

    if (p == NULL || desc == NULL)
        return vmmt__fail(VMMT_EINVAL, "vmmt_cancel: pool and desc must not be NULL");
    st = vmmt__desc_decode(desc->bytes, &d);
    if (st != VMMT_OK) return vmmt__wrap(st, "vmmt_cancel");
    /* The pool first: another pool's descriptor is no forgery, and is told so. */
    st = vmmt__desc_check_pool(&d, &p->tmpl);
    if (st != VMMT_OK) return vmmt__wrap(st, "vmmt_cancel: the descriptor is not from this pool");
    st = vmmt__desc_check_seal(desc->bytes, p->seal_key);
    if (st != VMMT_OK) return vmmt__wrap(st, "vmmt_cancel");
    st = vmmt__pool_enter(p);
    if (st != VMMT_OK) return st;
    pthread_mutex_lock(&p->lock);
    s = &p->slot[d.slot];
    if (s->generation == d.generation && s->state == SLOT_RESERVED) {
        /* Nothing of ours was enqueued: the caller stopped writing (vmmt.h).
         * The generation is retired, so the token, now stale, can never act
         * again and the word keeps moving forwards only. */
        s->state = SLOT_PUBLISHING;
        pthread_mutex_unlock(&p->lock);
        st = vmmt__pool_retire_now(p, d.slot);
        pthread_mutex_lock(&p->lock);
        if (st == VMMT_OK) {
            p->cancelled++;
            vmmt__slot_release(p, d.slot);
            pthread_cond_broadcast(&p->changed);
        } else {
            s->state = SLOT_RESERVED; /* still the caller's, to cancel again */
        }
    } else if (s->generation == d.generation && s->state == SLOT_IN_FLIGHT &&
               !(d.flags & VMMT__DESC_TOKEN)) {
        /* (A token names the reservation, which its commit ended: the published
         * descriptor, perhaps out with consumers already, is not the token's to take.) */
        p->cancelled++;
        /* Refused by consumers once this returns: every rank's acknowledgement
         * word holds the generation (recycle.c). The recycler retires it and
         * frees the slice once the ready word shows the copy finished (at once
         * for a synchronous hand-off). */
        s->state = SLOT_CANCELLED;
        if (p->host_table)
            vmmt__pool_cancel_acks_locked(p, d.slot);
        else
            device_acks = 1;
        if (p->handoff == VMMT_HANDOFF_SYNC) reclaim_now = 1;
    }
    pthread_mutex_unlock(&p->lock);
    if (device_acks) st = vmmt__pool_cancel_acks_now(p, d.slot, d.generation);
    /* A synchronous hand-off's copy landed: the slice is free when this returns. */
    if (reclaim_now && st == VMMT_OK) st = vmmt__pool_reclaim(p, NULL);
    vmmt__pool_leave(p);
    return st;
}

/* The steps above, for writing in place (reserve.c) and host pools (host_pool.c). */
int vmmt__publish_check_buffer(const vmmt_buffer *b, size_t i)
{
    return check_buffer(b, i);
}

int vmmt__publish_check_records(const struct vmmt_pool *p, const vmmt_buffer *bufs, size_t n,
                                const uint64_t *rel, uint64_t total)
{
    return check_records(p, bufs, n, rel, total);
}

int vmmt__publish_reserve(struct vmmt_pool *p, uint64_t bytes, uint32_t *slot)
{
    return reserve(p, bytes, slot);
}

void vmmt__publish_finish(struct vmmt_pool *p, uint32_t slot, int st, size_t n)
{
    finish(p, slot, st, n);
}

void vmmt__publish_describe(struct vmmt_pool *p, const vmmt_buffer *bufs, size_t n,
                            const uint64_t *rel, uint32_t slot, vmmt_desc *out)
{
    describe(p, bufs, n, rel, slot, out);
}

int vmmt__publish_enqueue(struct vmmt_pool *p, const vmmt_buffer *bufs, size_t n,
                          const uint64_t *rel, uint32_t slot, CUstream s)
{
    return enqueue(p, bufs, n, rel, slot, s, 0); /* device sources only (host_pool.c) */
}
