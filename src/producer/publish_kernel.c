/*
 * One kernel per small publish. A publish from device memory enqueues a copy
 * and a stream write of the ready word: two submissions, most of what a
 * small publish costs its caller (BENCHMARKS.md, tests/gpu/launch_cost.c).
 * The kernel of kernel_ptx.h does both in one. It is used only where it
 * cannot fault: a copy engine refuses a bad address with an error, a kernel
 * that reads one takes the whole context down, the caller's with it. So the
 * source must lie, whole, in one range the driver shows as device memory of
 * the pool's device that this context may read.
 */
#include "publish_kernel.h"

#include <inttypes.h>

#include "driver.h"
#include "kernel_ptx.h"
#include "pool_internal.h"
#include "status.h"

/* The attribute values are read back from 64-bit slots, whatever width the driver writes. */
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "attribute slots assume little-endian");

void vmmt__kernel_load(struct vmmt_pool *p)
{
    const struct vmmt_drv *d = vmmt__drv();
    struct vmmt__saved_error e;
    CUmodule mod = NULL;
    CUresult r;

    vmmt__error_save(&e);
    r = d->cuModuleLoadData(&mod, VMMT__KERNEL_PTX);
    if (r == CUDA_SUCCESS) {
        r = d->cuModuleGetFunction(&p->kfn, mod, VMMT__KERNEL_NAME);
        if (r != CUDA_SUCCESS) {
            (void)d->cuModuleUnload(mod);
            mod = NULL;
        }
    }
    if (r == CUDA_SUCCESS) {
        p->kmod = mod;
    } else {
        p->kfn = NULL;
        vmmt__log(VMMT_LOG_INFO,
                  "device %d: the driver refused the publish kernel (%s); publishes enqueue a "
                  "copy and a stream write instead",
                  p->device, vmmt__cu_name(r));
    }
    vmmt__error_restore(&e);
}

void vmmt__kernel_unload(struct vmmt_pool *p)
{
    CUresult r;

    if (p->kmod == NULL) return;
    r = vmmt__drv()->cuModuleUnload(p->kmod);
    if (r != CUDA_SUCCESS)
        vmmt__log(VMMT_LOG_ERROR, "unloading the publish kernel failed (%s); leaked",
                  vmmt__cu_name(r));
    p->kmod = NULL;
    p->kfn = NULL;
}

/*
 * Whether the kernel may read [ptr, ptr + n): one query of the driver, for
 * the memory's type, device, range and this context's access to it.
 */
static int readable_here(const struct vmmt_pool *p, CUdeviceptr ptr, uint64_t n)
{
    CUpointer_attribute what[VMMT__KERNEL_QUERY_COUNT] = VMMT__KERNEL_QUERY;
    uint64_t v[VMMT__KERNEL_QUERY_COUNT] = {0};
    void *at[VMMT__KERNEL_QUERY_COUNT];

    for (int i = 0; i < VMMT__KERNEL_QUERY_COUNT; i++)
        at[i] = &v[i];
    if (vmmt__drv()->cuPointerGetAttributes(VMMT__KERNEL_QUERY_COUNT, what, at, ptr) !=
        CUDA_SUCCESS)
        return 0;
    return (uint32_t)v[0] == CU_MEMORYTYPE_DEVICE && (int32_t)(uint32_t)v[1] == p->device &&
           ((uint32_t)v[4] & CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READ) != 0 && ptr >= v[2] &&
           ptr - v[2] <= v[3] && n <= v[3] - (ptr - v[2]);
}

int vmmt__kernel_publish(struct vmmt_pool *p, const vmmt_buffer *b, CUdeviceptr dst,
                         CUdeviceptr ready, uint32_t gen, CUstream s)
{
    uint64_t src = b->ptr, words = b->nbytes / 16;
    void *args[] = {&dst, &src, &words, &ready, &gen};
    CUresult r;

    if (p->kfn == NULL) return 0;
    if (b->location != VMMT_LOC_DEVICE || b->nbytes > VMMT__KERNEL_MAX_BYTES ||
        b->nbytes % 16 != 0 || src % 16 != 0 || dst % 16 != 0)
        return 0;
    if (!readable_here(p, src, b->nbytes)) return 0;
    r = vmmt__drv()->cuLaunchKernel(p->kfn, 1, 1, 1, VMMT__KERNEL_THREADS, 1, 1, 0, s, args, NULL);
    if (r != CUDA_SUCCESS) {
        /* Each refused launch falls back on its own: a stream of another context (which a
         * launch refuses and a copy takes) says nothing of the next publish's. */
        if (!__atomic_exchange_n(&p->kernel_warned, 1, __ATOMIC_RELAXED))
            vmmt__log(VMMT_LOG_WARN,
                      "cuLaunchKernel of the publish kernel failed (%s); that publish enqueued "
                      "a copy and a stream write instead, as will any other whose launch is "
                      "refused (said once for this pool)",
                      vmmt__cu_name(r));
        return 0;
    }
    __atomic_fetch_add(&p->kernel_publishes, 1, __ATOMIC_RELAXED);
    return 1;
}
