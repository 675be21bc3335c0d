#include "vmm.h"

#include <inttypes.h>
#include <string.h>
#include <unistd.h>

#include "driver.h"
#include "status.h"

const char *vmmt__handle_type_upper(vmmt_handle_type t)
{
    switch (t) {
    case VMMT_HANDLE_FABRIC: return "FABRIC";
    case VMMT_HANDLE_POSIX_FD: return "POSIX_FD";
    case VMMT_HANDLE_NONE: return "NONE";
    default: return "AUTO";
    }
}

void vmmt__prop_init(CUmemAllocationProp *prop, int device, vmmt_handle_type type, int rdma)
{
    memset(prop, 0, sizeof *prop);
    prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop->location.id = device;
    prop->requestedHandleTypes = (CUmemAllocationHandleType)type;
    prop->allocFlags.gpuDirectRDMACapable = rdma ? 1 : 0;
}

int vmmt__granularity(int device, vmmt_handle_type type, size_t *minimum, size_t *recommended)
{
    const struct vmmt_drv *d = vmmt__drv();
    CUmemAllocationProp prop;
    CUresult r;

    if (d == NULL) return vmmt_last_status();
    vmmt__prop_init(&prop, device, type, 0);
    r = d->cuMemGetAllocationGranularity(minimum, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (r == CUDA_SUCCESS)
        r = d->cuMemGetAllocationGranularity(recommended, &prop,
                                             CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
    if (r != CUDA_SUCCESS)
        return vmmt__cu_fail(r, "cuMemGetAllocationGranularity(device=%d, handle=%s)", device,
                             vmmt__handle_type_upper(type));
    return VMMT_OK;
}

static int is_pow2(uint64_t v)
{
    return v != 0 && (v & (v - 1)) == 0;
}

int vmmt__align_up(uint64_t value, uint64_t align, uint64_t *out)
{
    if (!is_pow2(align))
        return vmmt__fail(VMMT_EINVAL, "alignment %" PRIu64 " is not a power of two", align);
    if (value > UINT64_MAX - (align - 1))
        return vmmt__fail(VMMT_EINVAL,
                          "%" PRIu64 " cannot be rounded up to a multiple of %" PRIu64
                          " without overflow",
                          value, align);
    *out = (value + align - 1) & ~(align - 1);
    return VMMT_OK;
}

uint64_t vmmt__align_down(uint64_t value, uint64_t align)
{
    return value & ~(align - 1);
}

int vmmt__size_policy(uint64_t requested, uint64_t granularity, int round_up, uint64_t *out)
{
    uint64_t down;

    if (requested == 0) return vmmt__fail(VMMT_EINVAL, "memory_size must be positive");
    if (!is_pow2(granularity))
        return vmmt__fail(VMMT_EINVAL, "CUDA VMM granularity=%" PRIu64 " is not a power of two",
                          granularity);
    if (requested < granularity) {
        if (!round_up)
            return vmmt__fail(
                VMMT_EINVAL,
                "memory_size=%" PRIu64 " is smaller than CUDA VMM granularity=%" PRIu64
                "; use at least %" PRIu64 " bytes (%" PRIu64 " MiB) or enable round-up",
                requested, granularity, granularity, granularity >> 20);
        *out = granularity;
        vmmt__log(VMMT_LOG_INFO,
                  "memory_size=%" PRIu64 " rounded up to CUDA VMM granularity=%" PRIu64, requested,
                  granularity);
        return VMMT_OK;
    }
    down = vmmt__align_down(requested, granularity);
    if (down != requested)
        vmmt__log(VMMT_LOG_INFO,
                  "memory_size=%" PRIu64 " rounded down to %" PRIu64
                  " (a multiple of CUDA VMM granularity=%" PRIu64 "; %" PRIu64 " bytes unused)",
                  requested, down, granularity, requested - down);
    *out = down;
    return VMMT_OK;
}

/*
 * The alignment of reserved ranges, per device: asked of the driver once,
 * since every import maps at a fresh range and the answer never changes.
 */
static int reserve_alignment(int device, size_t *gmin, size_t *grec)
{
    static _Atomic size_t cache_min[64], cache_rec[64];
    int st;

    if (device >= 0 && device < 64 && (*gmin = cache_min[device]) != 0) {
        *grec = cache_rec[device];
        return VMMT_OK;
    }
    st = vmmt__granularity(device, VMMT_HANDLE_NONE, gmin, grec);
    if (st == VMMT_OK && device >= 0 && device < 64) {
        cache_rec[device] = *grec;
        cache_min[device] = *gmin;
    }
    return st;
}

int vmmt__grant_device(CUdeviceptr base, uint64_t size, int device)
{
    CUmemAccessDesc access;
    CUresult r;

    memset(&access, 0, sizeof access);
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = vmmt__drv()->cuMemSetAccess(base, size, &access, 1);
    if (r != CUDA_SUCCESS)
        return vmmt__cu_fail(r, "cuMemSetAccess(size=%" PRIu64 ", device=%d, read-write)", size,
                             device);
    return VMMT_OK;
}

/* Reserve, map and grant access for m->handle; m->size and m->device set. */
static int map_handle(const struct vmmt_drv *d, struct vmmt__mapping *m)
{
    size_t gmin = 0, grec = 0;
    CUresult r;
    int st;

    st = reserve_alignment(m->device, &gmin, &grec);
    if (st != VMMT_OK) return st;
    r = d->cuMemAddressReserve(&m->base, m->size, grec > gmin ? grec : gmin, 0, 0);
    if (r != CUDA_SUCCESS)
        return vmmt__cu_fail(r, "cuMemAddressReserve(size=%" PRIu64 ")", m->size);
    m->reserved = 1;
    r = d->cuMemMap(m->base, m->size, 0, m->handle, 0);
    if (r != CUDA_SUCCESS) return vmmt__cu_fail(r, "cuMemMap(size=%" PRIu64 ")", m->size);
    m->mapped = 1;
    return vmmt__grant_device(m->base, m->size, m->device);
}

/* Undo a failed setup without disturbing the message that explains the failure. */
static void rollback(struct vmmt__mapping *m)
{
    struct vmmt__saved_error e;

    vmmt__error_save(&e);
    if (vmmt__mapping_release(m) != VMMT_OK)
        vmmt__log(VMMT_LOG_WARN, "rollback after a failed mapping also failed: %s",
                  vmmt_last_error());
    vmmt__error_restore(&e);
}

int vmmt__mapping_create(int device, uint64_t size, vmmt_handle_type type, int rdma,
                         struct vmmt__mapping *m)
{
    const struct vmmt_drv *d;
    CUmemAllocationProp prop;
    CUresult r;
    int st;

    memset(m, 0, sizeof *m);
    st = vmmt__ctx_enter(device);
    if (st != VMMT_OK) return st;
    d = vmmt__drv();
    m->device = device;
    m->size = size;
    vmmt__prop_init(&prop, device, type, rdma);
    r = d->cuMemCreate(&m->handle, size, &prop, 0);
    if (r != CUDA_SUCCESS) {
        st = vmmt__cu_fail(r, "cuMemCreate(size=%" PRIu64 ", device=%d, handle=%s)", size, device,
                           vmmt__handle_type_upper(type));
        goto out;
    }
    m->have_handle = 1;
    st = map_handle(d, m);
    if (st != VMMT_OK) rollback(m);
out:
    vmmt__ctx_leave();
    return st;
}

int vmmt__mapping_adopt(int device, CUmemGenericAllocationHandle handle, uint64_t size,
                        struct vmmt__mapping *m)
{
    int st;

    memset(m, 0, sizeof *m);
    m->device = device;
    m->size = size;
    m->handle = handle;
    m->have_handle = 1;
    st = vmmt__ctx_enter(device);
    if (st != VMMT_OK) {
        rollback(m);
        return st;
    }
    st = map_handle(vmmt__drv(), m);
    if (st != VMMT_OK) rollback(m);
    vmmt__ctx_leave();
    return st;
}

int vmmt__mapping_release(struct vmmt__mapping *m)
{
    const struct vmmt_drv *d = vmmt__drv();
    CUresult r;
    int st = VMMT_OK;

    if (d == NULL) return vmmt_last_status();
    if (m->mapped) {
        r = d->cuMemUnmap(m->base, m->size);
        if (r != CUDA_SUCCESS) return vmmt__cu_fail(r, "cuMemUnmap(size=%" PRIu64 ")", m->size);
        m->mapped = 0;
    }
    /*
     * Unmapped, the allocation and the address range are independent: a
     * failed cuMemRelease must not keep the range too (at shutdown nothing
     * retries, so each failure leaks only what it names). The first failure
     * is returned; what stays held is logged, and a retry releases only that.
     */
    if (m->have_handle) {
        r = d->cuMemRelease(m->handle);
        if (r != CUDA_SUCCESS) {
            st = vmmt__cu_fail(r, "cuMemRelease");
            vmmt__log(VMMT_LOG_WARN,
                      "cuMemRelease failed (%s): the allocation of %" PRIu64
                      " bytes stays held; freeing its address range anyway",
                      vmmt__cu_name(r), m->size);
        } else {
            m->have_handle = 0;
        }
    }
    if (m->reserved) {
        r = d->cuMemAddressFree(m->base, m->size);
        if (r != CUDA_SUCCESS) {
            struct vmmt__saved_error e;
            if (st != VMMT_OK) vmmt__error_save(&e);
            int fst = vmmt__cu_fail(r, "cuMemAddressFree(size=%" PRIu64 ")", m->size);
            vmmt__log(VMMT_LOG_WARN,
                      "cuMemAddressFree failed (%s): %" PRIu64
                      " bytes of address range stay reserved",
                      vmmt__cu_name(r), m->size);
            if (st != VMMT_OK)
                vmmt__error_restore(&e);
            else
                st = fst;
        } else {
            m->reserved = 0;
        }
    }
    return st;
}

int vmmt__export_posix_fd(CUmemGenericAllocationHandle handle, int *fd)
{
    const struct vmmt_drv *d = vmmt__drv();
    CUresult r;

    if (d == NULL) return vmmt_last_status();
    *fd = -1;
    r = d->cuMemExportToShareableHandle(fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (r != CUDA_SUCCESS) return vmmt__cu_fail(r, "cuMemExportToShareableHandle(POSIX_FD)");
    return VMMT_OK;
}

int vmmt__export_fabric(CUmemGenericAllocationHandle handle, CUmemFabricHandle *out)
{
    const struct vmmt_drv *d = vmmt__drv();
    CUresult r;

    if (d == NULL) return vmmt_last_status();
    r = d->cuMemExportToShareableHandle(out, handle, CU_MEM_HANDLE_TYPE_FABRIC, 0);
    if (r != CUDA_SUCCESS) return vmmt__cu_fail(r, "cuMemExportToShareableHandle(FABRIC)");
    return VMMT_OK;
}

int vmmt__import_posix_fd(int fd, CUmemGenericAllocationHandle *handle)
{
    const struct vmmt_drv *d = vmmt__drv();
    CUresult r;

    if (d == NULL) return vmmt_last_status();
    r = d->cuMemImportFromShareableHandle(handle, (void *)(uintptr_t)fd,
                                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (r != CUDA_SUCCESS)
        return vmmt__cu_fail(r, "cuMemImportFromShareableHandle(POSIX_FD, fd=%d)", fd);
    return VMMT_OK;
}

int vmmt__import_fabric(const CUmemFabricHandle *fabric, CUmemGenericAllocationHandle *handle)
{
    const struct vmmt_drv *d = vmmt__drv();
    CUresult r;

    if (d == NULL) return vmmt_last_status();
    r = d->cuMemImportFromShareableHandle(handle, (void *)fabric, CU_MEM_HANDLE_TYPE_FABRIC);
    if (r != CUDA_SUCCESS)
        return vmmt__cu_fail(r, "cuMemImportFromShareableHandle(FABRIC)%s",
                             access(VMMT__IMEX_CHANNELS, F_OK) == 0
                                 ? ""
                                 : " (no IMEX channel at " VMMT__IMEX_CHANNELS ")");
    return VMMT_OK;
}

int vmmt__mapping_import_posix_fd(int device, int fd, uint64_t size, struct vmmt__mapping *m)
{
    CUmemGenericAllocationHandle h;
    int st;

    memset(m, 0, sizeof *m);
    st = vmmt__ctx_enter(device);
    if (st != VMMT_OK) return st;
    st = vmmt__import_posix_fd(fd, &h);
    if (st == VMMT_OK) st = vmmt__mapping_adopt(device, h, size, m);
    vmmt__ctx_leave();
    return st;
}

int vmmt__mapping_import_fabric(int device, const CUmemFabricHandle *fabric, uint64_t size,
                                struct vmmt__mapping *m)
{
    CUmemGenericAllocationHandle h;
    int st;

    memset(m, 0, sizeof *m);
    st = vmmt__ctx_enter(device);
    if (st != VMMT_OK) return st;
    st = vmmt__import_fabric(fabric, &h);
    if (st == VMMT_OK) st = vmmt__mapping_adopt(device, h, size, m);
    vmmt__ctx_leave();
    return st;
}

int vmmt__grant_rw(CUdeviceptr base, uint64_t size, int device)
{
    const struct vmmt_drv *d = vmmt__drv();
    CUmemAccessDesc access;
    CUresult r;

    if (d == NULL) return vmmt_last_status();
    memset(&access, 0, sizeof access);
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = d->cuMemSetAccess(base, size, &access, 1);
    if (r != CUDA_SUCCESS)
        return vmmt__cu_fail(r, "cuMemSetAccess(size=%" PRIu64 ", device=%d, read-write)", size,
                             device);
    return VMMT_OK;
}
