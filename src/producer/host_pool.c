/*
 * Host pools: the pool's allocation is pinned host memory on a NUMA node,
 * created through the VMM API (CU_MEM_LOCATION_TYPE_HOST_NUMA) and exported
 * as a POSIX fd, so that consumers import, map and copy from it exactly as
 * from a device pool. The producer maps it with CPU access and publishes from
 * host memory with the CPU (cpu_copy.c): after cuInit alone, with no context made current
 * and no device memory held (measured on the H200, /work/shared/design.md).
 * Its control table is the shared host memfd, written by the CPU too.
 *
 * Only a publish from device memory needs the GPU: the first one makes the
 * device's primary context current, grants the device access to the pool and
 * registers the control table, and from then on the copy and the ready flag
 * go on the caller's stream like a device pool's.
 *
 * Why a host-NUMA VMM allocation and not a plain memfd that each consumer
 * registers (docs/design.md): both measured the same round trip, but the VMM
 * allocation keeps one import path for consumers (descriptor, broker, import
 * cache, stream-ordered copies, acknowledgements), and the consumer's import
 * pins nothing twice.
 */
#include <inttypes.h>
#include <string.h>

#include "cpu_copy.h"
#include "ctrl.h"
#include "driver.h"
#include "pool_internal.h"
#include "status.h"

static void host_prop(CUmemAllocationProp *prop, int numa)
{
    memset(prop, 0, sizeof *prop);
    prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop->location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    prop->location.id = numa;
    prop->requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
}

/* The configured NUMA node, or the device's (an attribute read needs no context). */
static int pick_numa(struct vmmt_pool *p, const struct vmmt_drv *d)
{
    int count = 0, node = -1;

    if (vmmt_device_count(&count) != VMMT_OK) return vmmt_last_status();
    if (p->device < 0 || p->device >= count)
        return vmmt__fail(VMMT_ENODEV,
                          "device %d does not exist: the %s driver reports %d device(s); use a "
                          "device from 0 to %d",
                          p->device, d->name, count, count - 1);
    if (p->cfg.host_numa_node >= 0) {
        p->numa = p->cfg.host_numa_node;
        return VMMT_OK;
    }
    if (d->cuDeviceGetAttribute(&node, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, p->device) !=
            CUDA_SUCCESS ||
        node < 0)
        node = 0; /* no NUMA information: a single-node machine */
    p->numa = node;
    return VMMT_OK;
}

/*
 * Grant the CPU read-write access. The HOST_NUMA location names the node; a
 * driver that wants the plain HOST location for access is asked that next.
 */
static int grant_host(const struct vmmt_drv *d, struct vmmt_pool *p)
{
    CUmemAccessDesc a;
    CUresult r;

    memset(&a, 0, sizeof a);
    a.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    a.location.id = p->numa;
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = d->cuMemSetAccess(p->map.base, p->map.size, &a, 1);
    if (r == CUDA_SUCCESS) return VMMT_OK;
    a.location.type = CU_MEM_LOCATION_TYPE_HOST;
    a.location.id = 0;
    if (d->cuMemSetAccess(p->map.base, p->map.size, &a, 1) == CUDA_SUCCESS) return VMMT_OK;
    return vmmt__cu_fail(r, "cuMemSetAccess(host NUMA node %d, read-write)", p->numa);
}

/* Create, reserve, map and grant the CPU access: no context current, none made. */
static int map_host(const struct vmmt_drv *d, struct vmmt_pool *p, uint64_t size, size_t align)
{
    CUmemAllocationProp prop;
    struct vmmt__mapping *m = &p->map;
    CUresult r;

    host_prop(&prop, p->numa);
    m->device = -1; /* the CPU's memory; consumers grant their own devices access */
    m->size = size;
    r = d->cuMemCreate(&m->handle, size, &prop, 0);
    if (r != CUDA_SUCCESS)
        return vmmt__cu_fail(r, "cuMemCreate(size=%" PRIu64 ", host NUMA node %d, POSIX_FD)", size,
                             p->numa);
    m->have_handle = 1;
    r = d->cuMemAddressReserve(&m->base, size, align, 0, 0);
    if (r != CUDA_SUCCESS) return vmmt__cu_fail(r, "cuMemAddressReserve(size=%" PRIu64 ")", size);
    m->reserved = 1;
    r = d->cuMemMap(m->base, size, 0, m->handle, 0);
    if (r != CUDA_SUCCESS) return vmmt__cu_fail(r, "cuMemMap(size=%" PRIu64 ")", size);
    m->mapped = 1;
    return grant_host(d, p);
}

int vmmt__host_pool_allocate(struct vmmt_pool *p)
{
    const struct vmmt_drv *d = vmmt__drv();
    CUmemAllocationProp prop;
    size_t gran = 0;
    uint64_t size;
    CUresult r;
    int st;

    if (d == NULL) return vmmt_last_status();
    st = pick_numa(p, d);
    if (st != VMMT_OK) return st;
    host_prop(&prop, p->numa);
    r = d->cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (r != CUDA_SUCCESS)
        return vmmt__cu_fail(r,
                             "cuMemGetAllocationGranularity(host NUMA node %d, POSIX_FD); "
                             "this driver may not support host-memory VMM allocations "
                             "(CUDA 12.2 or later); use a device pool",
                             p->numa);
    st = vmmt__size_policy(p->cfg.memory_size, gran, p->cfg.round_up, &size);
    if (st != VMMT_OK) return st;
    st = map_host(d, p, size, gran);
    if (st != VMMT_OK) {
        struct vmmt__saved_error e;
        vmmt__error_save(&e);
        vmmt__mapping_release(&p->map);
        vmmt__error_restore(&e);
    }
    return st;
}

int vmmt__host_pool_table(struct vmmt_pool *p)
{
    int st =
        vmmt__ctrl_create_shared_unregistered(p->table_bytes + VMMT__CTRL_RECORD_BYTES, &p->ctrl);

    if (st == VMMT_OK) st = vmmt__pool_put_record(p, p->ctrl.base);
    p->table_host = p->ctrl.host;
    p->ctrl_dev = 0; /* until a publish from device memory registers it */
    return st;
}

void *vmmt__host_pool_cpu(struct vmmt_pool *p, uint64_t off)
{
    return (void *)(uintptr_t)(p->map.base + p->data_offset + off);
}

void vmmt__host_pool_set_ready(struct vmmt_pool *p, uint32_t slot, uint32_t gen)
{
    /* A release store: consumers that load the flag with acquire see the bytes. */
    __atomic_store_n(p->ctrl.host + vmmt__ctrl_ready(0, p->stride, slot) / 4, gen,
                     __ATOMIC_RELEASE);
}

int vmmt__host_pool_device_setup(struct vmmt_pool *p)
{
    int st = VMMT_OK;

    if (__atomic_load_n(&p->device_ready, __ATOMIC_ACQUIRE)) return VMMT_OK;
    pthread_mutex_lock(&p->dev_lock);
    if (!p->device_ready) {
        st = vmmt__grant_device(p->map.base, p->map.size, p->device);
        if (st == VMMT_OK) st = vmmt__ctrl_register(&p->ctrl);
        if (st == VMMT_OK) {
            pthread_mutex_lock(&p->lock);
            p->ctrl_dev = p->ctrl.dev;
            __atomic_store_n(&p->device_ready, 1, __ATOMIC_RELEASE);
            pthread_mutex_unlock(&p->lock);
        }
    }
    pthread_mutex_unlock(&p->dev_lock);
    return st == VMMT_OK ? st
                         : vmmt__wrap(st,
                                      "preparing the host pool for a publish from device %d's "
                                      "memory",
                                      p->device);
}

/* Members from device memory, gathered for one enqueue. */
static int device_members(const vmmt_buffer *bufs, size_t n, const uint64_t *rel,
                          vmmt_buffer *dbufs, uint64_t *drel)
{
    int k = 0;

    for (size_t i = 0; i < n; i++)
        if (bufs[i].location != VMMT_LOC_HOST) {
            dbufs[k] = bufs[i];
            drel[k++] = rel[i];
        }
    return k;
}

int vmmt__host_pool_copy(struct vmmt_pool *p, const vmmt_buffer *bufs, size_t n,
                         const uint64_t *rel, uint32_t slot, CUstream s)
{
    vmmt_buffer dbufs[VMMT__MAX_PACK];
    uint64_t drel[VMMT__MAX_PACK];
    uint8_t *slice = vmmt__host_pool_cpu(p, p->slot[slot].slice_offset);
    int k, st;

    /* Host members first, by the CPU: the ready flag comes after all of them. */
    for (size_t i = 0; i < n; i++)
        if (bufs[i].location == VMMT_LOC_HOST)
            vmmt__cpu_copy(slice + rel[i], (const void *)(uintptr_t)bufs[i].ptr, bufs[i].nbytes);
    k = device_members(bufs, n, rel, dbufs, drel);
    if (k == 0) {
        vmmt__host_pool_set_ready(p, slot, p->slot[slot].generation);
        return VMMT_OK;
    }
    st = vmmt__ctx_enter(p->device);
    if (st != VMMT_OK) return st;
    st = vmmt__host_pool_device_setup(p);
    if (st == VMMT_OK) st = vmmt__publish_enqueue(p, dbufs, (size_t)k, drel, slot, s);
    vmmt__ctx_leave();
    return st;
}
