/*
 * Public device-memory helpers: allocate, free and copy, each in the
 * device's primary context. They exist so that callers without a CUDA
 * runtime of their own (the Python binding on NumPy, tests, tools) can hold
 * device memory to publish from and consume into.
 */
#include <inttypes.h>

#include "driver.h"
#include "status.h"

int vmmt_mem_alloc(int device, uint64_t nbytes, uint64_t *ptr)
{
    const struct vmmt_drv *d;
    CUdeviceptr p = 0;
    CUresult r;
    int st;

    if (ptr == NULL) return vmmt__fail(VMMT_EINVAL, "vmmt_mem_alloc: ptr is NULL");
    *ptr = 0;
    if (nbytes == 0)
        return vmmt__fail(VMMT_EINVAL, "vmmt_mem_alloc: nbytes=0; ask for at least one byte");
    if (nbytes > SIZE_MAX)
        return vmmt__fail(VMMT_ETOOBIG, "vmmt_mem_alloc: %" PRIu64 " bytes exceed size_t", nbytes);
    if ((st = vmmt__ctx_enter(device)) != VMMT_OK)
        return vmmt__wrap(st, "vmmt_mem_alloc(%" PRIu64 " bytes on device %d)", nbytes, device);
    d = vmmt__drv();
    r = d->cuMemAlloc(&p, (size_t)nbytes);
    vmmt__ctx_leave();
    if (r != CUDA_SUCCESS)
        return vmmt__cu_fail(r, "vmmt_mem_alloc: cuMemAlloc(%" PRIu64 " bytes on device %d)",
                             nbytes, device);
    *ptr = p;
    return VMMT_OK;
}

int vmmt_mem_free(int device, uint64_t ptr)
{
    CUresult r;
    int st;

    if (ptr == 0) return VMMT_OK;
    if ((st = vmmt__ctx_enter(device)) != VMMT_OK)
        return vmmt__wrap(st, "vmmt_mem_free(%#" PRIx64 " on device %d)", ptr, device);
    r = vmmt__drv()->cuMemFree(ptr);
    vmmt__ctx_leave();
    if (r != CUDA_SUCCESS)
        return vmmt__cu_fail(r,
                             "vmmt_mem_free: cuMemFree(%#" PRIx64 " on device %d); pass a pointer "
                             "vmmt_mem_alloc gave on that device, once",
                             ptr, device);
    return VMMT_OK;
}

int vmmt_mem_copy(int device, uint64_t dst, uint64_t src, uint64_t nbytes, void *stream)
{
    CUresult r;
    int st;

    if (nbytes == 0) return VMMT_OK;
    if (dst == 0 || src == 0)
        return vmmt__fail(VMMT_EINVAL, "vmmt_mem_copy: %s pointer is NULL",
                          dst == 0 ? "destination" : "source");
    if (dst > UINT64_MAX - nbytes || src > UINT64_MAX - nbytes)
        return vmmt__fail(VMMT_EINVAL,
                          "vmmt_mem_copy: %" PRIu64 " bytes at %#" PRIx64 " <- %#" PRIx64
                          ": the %s range wraps the address space",
                          nbytes, dst, src, dst > UINT64_MAX - nbytes ? "destination" : "source");
    /* The driver's copies leave overlapping ranges undefined: refused, not left to chance. */
    if (dst < src + nbytes && src < dst + nbytes)
        return vmmt__fail(VMMT_EINVAL,
                          "vmmt_mem_copy: %" PRIu64 " bytes at %#" PRIx64 " <- %#" PRIx64
                          ": the ranges overlap; copy through a separate buffer",
                          nbytes, dst, src);
    if (nbytes > SIZE_MAX)
        return vmmt__fail(VMMT_ETOOBIG, "vmmt_mem_copy: %" PRIu64 " bytes exceed size_t", nbytes);
    if ((st = vmmt__ctx_enter(device)) != VMMT_OK)
        return vmmt__wrap(st, "vmmt_mem_copy(%" PRIu64 " bytes on device %d)", nbytes, device);
    r = vmmt__drv()->cuMemcpyAsync(dst, src, (size_t)nbytes, (CUstream)stream);
    vmmt__ctx_leave();
    if (r != CUDA_SUCCESS)
        return vmmt__cu_fail(r,
                             "vmmt_mem_copy: cuMemcpyAsync(%" PRIu64 " bytes, %#" PRIx64
                             " <- %#" PRIx64 ", device %d)",
                             nbytes, dst, src, device);
    return VMMT_OK;
}
