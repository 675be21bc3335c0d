/*
 * The local step of a registration: walk each buffer allocation by
 * allocation, retain and check the allocations not shared yet, export them,
 * and open the exchange socket. Everything it takes is recorded in the group
 * and the reg, so that group_reg.c can undo it.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "driver.h"
#include "group_reg.h"
#include "status.h"
#include "vmm.h"

static long find_local(const vmmt_group *g, CUdeviceptr base)
{
    for (size_t i = g->nlocals; i-- > 0;)
        if (g->locals[i].base == base) return (long)i;
    return -1;
}

/*
 * Whether the allocation mapped at locals[id].base is still the one shared
 * (1) or another one (0): an application may free an allocation and get a new
 * one at the same address. The driver hands out one handle per allocation.
 */
static int same_allocation(vmmt_group *g, long id, size_t bi)
{
    const struct vmmt_drv *d = vmmt__drv();
    CUmemGenericAllocationHandle h;
    CUresult r = d->cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)g->locals[id].base);

    if (r != CUDA_SUCCESS)
        return vmmt__cu_fail(r, "buffer %zu: cuMemRetainAllocationHandle(0x%llx)", bi,
                             (unsigned long long)g->locals[id].base);
    d->cuMemRelease(h);
    return h == g->locals[id].handle;
}

/* Retain and check the allocation mapped at base, then add it to the shared table. */
static int add_local(struct reg *R, CUdeviceptr base, uint64_t size, size_t bi)
{
    const struct vmmt_drv *d = vmmt__drv();
    vmmt_group *g = R->g;
    CUmemGenericAllocationHandle h;
    CUmemAllocationProp prop;
    CUresult r;
    int st;

    if (g->nlocals - R->local_mark >= g->max_allocs)
        return vmmt__fail(VMMT_ETOOBIG,
                          "the buffers cross more than %u new allocations; raise "
                          "max_allocations or register fewer buffers at once",
                          g->max_allocs);
    r = d->cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)base);
    if (r != CUDA_SUCCESS)
        return vmmt__cu_fail(r,
                             "buffer %zu: cuMemRetainAllocationHandle(0x%llx): not CUDA VMM "
                             "memory? allocate with cuMemCreate (PyTorch: "
                             "expandable_segments:True)",
                             bi, (unsigned long long)base);
    memset(&prop, 0, sizeof prop);
    r = d->cuMemGetAllocationPropertiesFromHandle(&prop, h);
    if (r != CUDA_SUCCESS) {
        st = vmmt__cu_fail(r, "buffer %zu: cuMemGetAllocationPropertiesFromHandle", bi);
        goto fail;
    }
    if ((prop.requestedHandleTypes & (unsigned)g->type) == 0) {
        st = vmmt__fail(VMMT_ENOTSUP,
                        "buffer %zu: the allocation at 0x%llx was created with handle types "
                        "0x%x, without %s, which this group exchanges; create it with "
                        "requestedHandleTypes including %s",
                        bi, (unsigned long long)base, (unsigned)prop.requestedHandleTypes,
                        vmmt__handle_type_upper(g->type), vmmt__handle_type_upper(g->type));
        goto fail;
    }
    if (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop.location.id != g->device) {
        st = vmmt__fail(VMMT_EINVAL,
                        "buffer %zu: the allocation at 0x%llx lives on device %d, not on the "
                        "group's device %d",
                        bi, (unsigned long long)base, prop.location.id, g->device);
        goto fail;
    }
    st = vmmt__group_grow((void **)&g->locals, &g->caplocals, g->nlocals + 1, sizeof *g->locals);
    if (st != VMMT_OK) goto fail;
    g->locals[g->nlocals++] = (struct vmmt__group_local){base, size, h};
    return VMMT_OK;
fail:
    d->cuMemRelease(h);
    return st;
}

static int push_chain(struct reg *R, uint32_t id)
{
    int st = vmmt__group_grow((void **)&R->chain, &R->capchain, R->nchain + 1, sizeof *R->chain);

    if (st == VMMT_OK) R->chain[R->nchain++] = id;
    return st;
}

/* The allocations buffer bi crosses, in address order, into the chain. */
static int walk_buffer(struct reg *R, size_t bi)
{
    const struct vmmt_drv *d = vmmt__drv();
    const vmmt_group_buffer *b = &R->bufs[bi];
    uint64_t cur = b->ptr, end = b->ptr + b->nbytes;
    struct r2_buf *rb = &R->mybufs[bi];
    int st;

    if (b->ptr == 0 || b->nbytes == 0 || end < b->ptr)
        return vmmt__fail(VMMT_EINVAL,
                          "buffer %zu: ptr=0x%" PRIx64 " nbytes=%" PRIu64
                          " is not a range of device memory",
                          bi, b->ptr, b->nbytes);
    rb->nbytes = b->nbytes;
    rb->chain_first = (uint32_t)R->nchain;
    /* Bounded: every step moves past one allocation, and their number is capped. */
    for (uint32_t steps = 0; cur < end; steps++) {
        CUdeviceptr base = 0;
        size_t size = 0;
        long id;
        CUresult r = d->cuMemGetAddressRange(&base, &size, cur);

        if (r != CUDA_SUCCESS || size == 0 || base > cur || cur - base >= size)
            return vmmt__cu_fail(r ? r : CUDA_ERROR_INVALID_VALUE,
                                 "buffer %zu: cuMemGetAddressRange(0x%" PRIx64 ") at byte %" PRIu64
                                 " of %" PRIu64 ": not mapped device memory",
                                 bi, cur, cur - b->ptr, b->nbytes);
        if (steps >= R->g->max_allocs)
            return vmmt__fail(VMMT_ETOOBIG, "buffer %zu crosses more than %u allocations", bi,
                              R->g->max_allocs);
        if (cur == b->ptr) rb->offset = cur - base;
        if ((id = find_local(R->g, base)) >= 0 && (st = same_allocation(R->g, id, bi)) != 1) {
            if (st < 0) return st;
            id = -1; /* another allocation now lives at that address: share it anew */
        }
        if (id >= 0 && R->g->locals[id].size != size)
            return vmmt__fail(VMMT_ESTATE,
                              "buffer %zu: the allocation at 0x%llx is now %zu bytes, was %" PRIu64
                              " when shared; keep registered allocations mapped while the "
                              "group lives",
                              bi, (unsigned long long)base, size, R->g->locals[id].size);
        if (id < 0) {
            if ((st = add_local(R, base, size, bi)) != VMMT_OK) return st;
            id = (long)R->g->nlocals - 1;
        }
        if ((st = push_chain(R, (uint32_t)id)) != VMMT_OK) return st;
        cur = base + size;
    }
    rb->chain_len = (uint32_t)R->nchain - rb->chain_first;
    return VMMT_OK;
}

static int export_new(struct reg *R)
{
    vmmt_group *g = R->g;
    int st;

    R->n_new = g->nlocals - R->local_mark;
    if (R->n_new == 0) return VMMT_OK;
    R->newallocs = calloc(R->n_new, sizeof *R->newallocs);
    R->fds = malloc(R->n_new * sizeof *R->fds);
    if (R->newallocs == NULL || R->fds == NULL)
        return vmmt__fail(VMMT_ENOMEM, "no memory for %zu allocations", R->n_new);
    for (size_t k = 0; k < R->n_new; k++)
        R->fds[k] = -1;
    for (size_t k = 0; k < R->n_new; k++) {
        const struct vmmt__group_local *l = &g->locals[R->local_mark + k];
        R->newallocs[k].size = l->size;
        if (g->type == VMMT_HANDLE_FABRIC)
            st = vmmt__export_fabric(l->handle, (CUmemFabricHandle *)R->newallocs[k].fabric);
        else
            st = vmmt__export_posix_fd(l->handle, &R->fds[k]);
        if (st != VMMT_OK)
            return vmmt__wrap(st, "exporting the allocation at 0x%llx",
                              (unsigned long long)l->base);
    }
    return VMMT_OK;
}

int vmmt__group_prepare(struct reg *R)
{
    int st;

    R->mybufs = calloc(R->nbuf ? R->nbuf : 1, sizeof *R->mybufs);
    if (R->mybufs == NULL) return vmmt__fail(VMMT_ENOMEM, "no memory for %zu buffers", R->nbuf);
    for (size_t i = 0; i < R->nbuf; i++)
        if ((st = walk_buffer(R, i)) != VMMT_OK) return st;
    if ((st = export_new(R)) != VMMT_OK) return st;
    if (R->g->type == VMMT_HANDLE_POSIX_FD && R->g->world > 1)
        return vmmt__gx_listen(R->g->socket_dir[0] ? R->g->socket_dir : NULL, &R->gx);
    return VMMT_OK;
}
