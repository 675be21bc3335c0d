/*
 * One kernel per small publish. A publish from device memory enqueues a copy
 * and a stream write of the ready word: two submissions, most of what a
 * small publish costs its caller (BENCHMARKS.md, tests/gpu/launch_cost.c).
 * The kernel of kernel_ptx.h does both in one. It is used only where it
 * cannot fault: a copy engine refuses a bad address with an error, a kernel
 * that reads one takes the whole context down, the caller's with it. So both
 * ends of the source must be device memory of the pool's device that this
 * context may read (readable_here).
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
 * One end of the buffer: device memory of the pool's device that this
 * context may read; its range into *start and *size. One driver query.
 */
static int end_readable(const struct vmmt_pool *p, CUdeviceptr at, uint64_t *start, uint64_t *size)
{
    CUpointer_attribute what[VMMT__KERNEL_QUERY_COUNT] = VMMT__KERNEL_QUERY;
    uint64_t v[VMMT__KERNEL_QUERY_COUNT] = {0};
    void *slot[VMMT__KERNEL_QUERY_COUNT];

    for (int i = 0; i < VMMT__KERNEL_QUERY_COUNT; i++)
        slot[i] = &v[i];
    if (vmmt__drv()->cuPointerGetAttributes(VMMT__KERNEL_QUERY_COUNT, what, slot, at) !=
        CUDA_SUCCESS)
        return 0;
    *start = v[2];
    *size = v[3];
    return (uint32_t)v[0] == CU_MEMORYTYPE_DEVICE && (int32_t)(uint32_t)v[1] == p->device &&
           ((uint32_t)v[4] & CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READ) != 0 && at >= v[2] &&
           at - v[2] < v[3];
}

/*
 * Whether the kernel may read [ptr, ptr + n): both ends readable here, in
 * one range or two adjacent ones. Both ends, because what a driver calls
 * a VMM address's range is not one mapping: on an H100 (driver 580) a
 * buffer across two adjacent mappings showed one range, so a range alone
 * could cover an unmapped part (test_attack_kernel, across_two_mappings,
 * 2026-12-06). Nothing between the ends goes unasked: VMM memory is mapped
 * in whole granules of 2 MiB on these GPUs (../shared/design.md), far above
 * the kernel's 64 KiB, so the buffer meets at most two, and each end names
 * its own; the emulator, whose granules may be 4 KiB, gives each mapping
 * as its range, so two ranges that do not meet are refused there.
 */
static int readable_here(const struct vmmt_pool *p, CUdeviceptr ptr, uint64_t n)
{
    uint64_t s1, z1, s2, z2;

    return end_readable(p, ptr, &s1, &z1) && end_readable(p, ptr + n - 1, &s2, &z2) &&
           (s1 == s2 || s1 + z1 == s2);
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
