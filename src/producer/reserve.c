/*
 * Writing in place: vmmt_reserve hands the producer a free slice to fill
 * with its own kernel or memcpy, and vmmt_commit turns it into a descriptor,
 * which saves the copy of vmmt_publish. A reservation is a slot in state
 * SLOT_RESERVED, named by a token (an encoded descriptor of the whole slice)
 * that vmmt_commit and vmmt_cancel check against the slot's generation, so a
 * token can act once only.
 */
#include <inttypes.h>
#include <string.h>

#include "ctrl.h"
#include "desc.h"
#include "driver.h"
#include "pool_internal.h"
#include "status.h"

int vmmt_reserve(vmmt_pool *p, uint64_t nbytes, vmmt_reservation *out)
{
    vmmt_buffer whole;
    struct vmmt__desc tok;
    uint64_t rel = 0;
    uint32_t slot = 0;
    int st;

    if (p == NULL || out == NULL)
        return vmmt__fail(VMMT_EINVAL, "vmmt_reserve: pool and out must not be NULL");
    memset(out, 0, sizeof *out);
    if (nbytes == 0) return vmmt__fail(VMMT_EINVAL, "vmmt_reserve: nbytes must be positive");
    st = vmmt__pool_enter(p);
    if (st != VMMT_OK) return st;
    st = vmmt__publish_reserve(p, nbytes, &slot);
    if (st == VMMT_OK) {
        memset(&whole, 0, sizeof whole);
        whole.nbytes = nbytes;
        vmmt__publish_describe(p, &whole, 1, &rel, slot, &out->token);
        /* Marked, so that a token handed to a consumer by mistake is refused there
         * instead of being consumed ahead of (or instead of) the commit. */
        if (vmmt__desc_decode(out->token.bytes, &tok) == VMMT_OK) {
            tok.flags |= VMMT__DESC_TOKEN;
            vmmt__desc_encode(&tok, out->token.bytes);
            vmmt__desc_seal(out->token.bytes, p->seal_key);
        }
        pthread_mutex_lock(&p->lock);
        p->slot[slot].state = SLOT_RESERVED;
        pthread_mutex_unlock(&p->lock);
        out->ptr = p->map.base + p->data_offset + p->slot[slot].slice_offset;
        out->nbytes = nbytes;
        out->location = p->host_mem ? VMMT_LOC_HOST : VMMT_LOC_DEVICE;
    }
    vmmt__pool_leave(p);
    return st;
}

/* The reservation the token names, moved to SLOT_PUBLISHING; VMMT_ESTATE if it is none. */
static int take(struct vmmt_pool *p, const vmmt_reservation *res, uint32_t *slot)
{
    struct vmmt__desc d;
    int st;

    st = vmmt__desc_decode(res->token.bytes, &d);
    if (st == VMMT_OK) st = vmmt__desc_check_pool(&d, &p->tmpl);
    if (st != VMMT_OK) return vmmt__wrap(st, "the reservation is not from this pool");
    st = vmmt__desc_check_seal(res->token.bytes, p->seal_key);
    if (st != VMMT_OK) return vmmt__wrap(st, "the reservation's token");
    pthread_mutex_lock(&p->lock);
    if (p->slot[d.slot].generation != d.generation || p->slot[d.slot].state != SLOT_RESERVED) {
        pthread_mutex_unlock(&p->lock);
        return vmmt__fail(VMMT_ESTATE,
                          "reservation of slot %u (generation %u) was already committed or "
                          "cancelled",
                          d.slot, d.generation);
    }
    p->slot[d.slot].state = SLOT_PUBLISHING;
    pthread_mutex_unlock(&p->lock);
    *slot = d.slot;
    return VMMT_OK;
}

/* Device pool: the ready flag after the caller's writes on s; a synchronous hand-off waits. */
static int flag_on_stream(struct vmmt_pool *p, uint32_t slot, CUstream s)
{
    const struct vmmt_drv *d = vmmt__drv();
    CUresult r;
    int st;

    st = vmmt__ctx_enter(p->device);
    if (st != VMMT_OK) return st;
    st = vmmt__publish_clear_acks(p, slot, s);
    if (st == VMMT_OK) st = vmmt__publish_pending(p, slot);
    if (st != VMMT_OK) {
        vmmt__ctx_leave();
        return st;
    }
    r = d->cuStreamWriteValue32(s, vmmt__ctrl_ready(p->ctrl_dev, p->stride, slot),
                                p->slot[slot].generation, CU_STREAM_WRITE_VALUE_DEFAULT);
    if (r != CUDA_SUCCESS)
        st = vmmt__cu_fail(r, "cuStreamWriteValue32(ready flag)");
    else if (p->handoff == VMMT_HANDOFF_SYNC && (r = d->cuStreamSynchronize(s)) != CUDA_SUCCESS) {
        /* The flag write may or may not have run: nothing about the slot is certain. */
        vmmt__cu_fail(r, "cuStreamSynchronize after the ready flag of a commit");
        vmmt__pool_quarantine(p);
        st = vmmt__wrap(VMMT_EFAILED, "the pool is quarantined");
    }
    vmmt__ctx_leave();
    return st;
}

/* Host pool: the CPU wrote the bytes, or a stream did and is drained first. */
static int flag_by_cpu(struct vmmt_pool *p, uint32_t slot, CUstream s)
{
    int st = VMMT_OK;

    if (s != NULL) {
        st = vmmt__ctx_enter(p->device);
        if (st == VMMT_OK) {
            st = VMMT_CU(vmmt__drv(), cuStreamSynchronize(s));
            vmmt__ctx_leave();
        }
        if (st != VMMT_OK) return vmmt__wrap(st, "waiting for the writes into the reservation");
    }
    vmmt__host_pool_set_ready(p, slot, p->slot[slot].generation);
    return VMMT_OK;
}

int vmmt_commit(vmmt_pool *p, const vmmt_reservation *res, const vmmt_buffer *what, void *stream,
                vmmt_desc *out)
{
    vmmt_buffer b;
    uint64_t rel = 0;
    uint32_t slot = 0;
    int st;

    if (p == NULL || res == NULL || out == NULL)
        return vmmt__fail(VMMT_EINVAL, "vmmt_commit: pool, reservation and out must not be NULL");
    memset(&b, 0, sizeof b);
    if (what != NULL) b = *what;
    if (what == NULL) b.nbytes = res->nbytes;
    b.ptr = 1; /* no source: the bytes are in place */
    st = vmmt__publish_check_buffer(&b, 0);
    if (st == VMMT_OK && b.nbytes > res->nbytes)
        st = vmmt__fail(VMMT_EINVAL,
                        "commit of %" PRIu64 " bytes into a reservation of %" PRIu64 " bytes",
                        b.nbytes, res->nbytes);
    if (st != VMMT_OK) return vmmt__wrap(st, "vmmt_commit");
    st = vmmt__pool_enter(p);
    if (st != VMMT_OK) return st;
    /* vmmt_publish's own validator: a descriptor no reader accepts is never handed out,
     * and the reservation stays, to commit correctly or cancel. */
    st = vmmt__publish_check_records(p, &b, 1, &rel, res->nbytes);
    if (st == VMMT_OK) st = take(p, res, &slot);
    if (st == VMMT_OK) {
        if (p->slot[slot].slice_bytes != res->nbytes)
            st = vmmt__fail(VMMT_EINVAL, "the reservation's nbytes was changed after "
                                         "vmmt_reserve");
        else if (p->host_mem)
            st = flag_by_cpu(p, slot, (CUstream)stream);
        else
            st = flag_on_stream(p, slot, (CUstream)stream);
        if (st == VMMT_OK) vmmt__publish_describe(p, &b, 1, &rel, slot, out);
        /* A failed commit leaves the reservation as it was, to cancel or retry. */
        if (st != VMMT_OK && st != VMMT_EFAILED) {
            pthread_mutex_lock(&p->lock);
            p->slot[slot].state = SLOT_RESERVED;
            pthread_mutex_unlock(&p->lock);
        } else {
            vmmt__publish_finish(p, slot, st, 1);
        }
    }
    vmmt__pool_leave(p);
    return st;
}
