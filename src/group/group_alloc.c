/*
 * vmmt_group_alloc: buffers made of several VMM allocations mapped side by
 * side, the shape PyTorch's expandable segments give a tensor that crosses
 * segment boundaries. Tools and tests use it to exercise registration of
 * buffers that span allocations without depending on a framework.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "driver.h"
#include "group_internal.h"
#include "status.h"
#include "vmm.h"

/* Unmap, release and free what `o` got so far; driver context held. */
static void own_release(const struct vmmt_drv *d, struct vmmt__group_own *o, uint64_t chunk)
{
    for (int i = o->mapped; i-- > 0;)
        d->cuMemUnmap(o->base + (uint64_t)i * chunk, chunk);
    o->mapped = 0;
    for (int i = o->chunks; i-- > 0;)
        if (o->handles[i] != 0) d->cuMemRelease(o->handles[i]);
    if (o->base != 0) d->cuMemAddressFree(o->base, o->size);
    free(o->handles);
    o->handles = NULL;
}

static int own_setup(const struct vmmt_drv *d, vmmt_group *g, struct vmmt__group_own *o,
                     uint64_t chunk)
{
    CUmemAllocationProp prop;
    CUresult r;

    vmmt__prop_init(&prop, g->device, g->type, 0);
    for (int i = 0; i < o->chunks; i++) {
        r = d->cuMemCreate(&o->handles[i], chunk, &prop, 0);
        if (r != CUDA_SUCCESS) {
            o->handles[i] = 0;
            return vmmt__cu_fail(r, "cuMemCreate(size=%" PRIu64 ", %s) of chunk %d", chunk,
                                 vmmt__handle_type_upper(g->type), i);
        }
    }
    r = d->cuMemAddressReserve(&o->base, o->size, 0, 0, 0);
    if (r != CUDA_SUCCESS) {
        o->base = 0;
        return vmmt__cu_fail(r, "cuMemAddressReserve(size=%" PRIu64 ")", o->size);
    }
    for (; o->mapped < o->chunks; o->mapped++) {
        r = d->cuMemMap(o->base + (uint64_t)o->mapped * chunk, chunk, 0, o->handles[o->mapped], 0);
        if (r != CUDA_SUCCESS) return vmmt__cu_fail(r, "cuMemMap of chunk %d", o->mapped);
    }
    return vmmt__grant_rw(o->base, o->size, g->device);
}

int vmmt_group_alloc(vmmt_group *g, uint64_t nbytes, int chunks, uint64_t *ptr)
{
    const struct vmmt_drv *d;
    struct vmmt__group_own o;
    size_t gran, rec;
    uint64_t per, chunk;
    int st;

    if (g == NULL || ptr == NULL || nbytes == 0 || chunks < 1 || chunks > 1024)
        return vmmt__fail(VMMT_EINVAL,
                          "vmmt_group_alloc(nbytes=%" PRIu64 ", chunks=%d): group and ptr must "
                          "be set, nbytes > 0, chunks 1..1024",
                          nbytes, chunks);
    *ptr = 0;
    if ((st = vmmt__granularity(g->device, g->type, &gran, &rec)) != VMMT_OK) goto out;
    per = (nbytes + (uint64_t)chunks - 1) / (uint64_t)chunks;
    if ((st = vmmt__align_up(per, gran, &chunk)) != VMMT_OK) goto out;
    memset(&o, 0, sizeof o);
    o.chunks = chunks;
    o.size = chunk * (uint64_t)chunks;
    if ((o.handles = calloc((size_t)chunks, sizeof *o.handles)) == NULL) {
        st = vmmt__fail(VMMT_ENOMEM, "no memory for %d handles", chunks);
        goto out;
    }
    if ((st = vmmt__group_grow((void **)&g->owns, &g->capowns, g->nowns + 1, sizeof o)) !=
        VMMT_OK) {
        free(o.handles);
        goto out;
    }
    if ((st = vmmt__ctx_enter(g->device)) != VMMT_OK) {
        free(o.handles);
        goto out;
    }
    d = vmmt__drv();
    st = own_setup(d, g, &o, chunk);
    if (st != VMMT_OK) {
        struct vmmt__saved_error e;
        vmmt__error_save(&e);
        own_release(d, &o, chunk);
        vmmt__error_restore(&e);
    } else {
        g->owns[g->nowns++] = o;
        *ptr = o.base;
    }
    vmmt__ctx_leave();
out:
    if (st != VMMT_OK)
        vmmt__wrap(st, "vmmt_group_alloc(nbytes=%" PRIu64 ", chunks=%d, device=%d)", nbytes, chunks,
                   g->device);
    return st;
}

int vmmt_group_free(vmmt_group *g, uint64_t ptr)
{
    const struct vmmt_drv *d;
    size_t i;
    int st;

    if (g == NULL) return vmmt__fail(VMMT_EINVAL, "vmmt_group_free: group must not be NULL");
    for (i = 0; i < g->nowns && g->owns[i].base != ptr; i++)
        ;
    if (i == g->nowns)
        return vmmt__fail(VMMT_EINVAL,
                          "vmmt_group_free(0x%" PRIx64 "): not a buffer of vmmt_group_alloc", ptr);
    if ((st = vmmt__ctx_enter(g->device)) != VMMT_OK) return st;
    d = vmmt__drv();
    own_release(d, &g->owns[i], g->owns[i].size / (uint64_t)g->owns[i].chunks);
    vmmt__ctx_leave();
    g->owns[i] = g->owns[--g->nowns];
    return VMMT_OK;
}
