/*
 * What one submission costs on the caller's thread, for the question of
 * issue 18: would a publish that enqueues one kernel (copy + ready word)
 * instead of a copy and a stream write be cheaper? A probe, not part of
 * vmmt: it links libcuda directly and is built and run by tests/gpu/run.
 *
 * Times the CPU side of each call (p50 / p99 of 2,000, a synchronize every
 * 100 outside the timing), 4 KiB on one device:
 *   cuMemcpyDtoDAsync alone; cuStreamWriteValue32 alone (a word in
 *   registered host memory, as a shared control table's); the two back to
 *   back (what vmmt_publish enqueued before its kernel); one cuLaunchKernel
 *   of the library's publish kernel (src/driver/kernel_ptx.h), which copies
 *   the 4 KiB and then writes the word; the cuPointerGetAttributes query by
 *   which a publish decides for the kernel (src/producer/publish_kernel.c),
 *   alone and followed by the launch (what vmmt_publish enqueues now).
 * and checks that the kernel's copy and word landed, and what the query says.
 *
 *   cc -I/usr/local/cuda/include -Isrc/driver tests/gpu/launch_cost.c -lcuda -o launch_cost
 */
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernel_ptx.h" /* the library's own publish kernel */

#define N     2000
#define BYTES 4096

static double now_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void report(const char *what, double *xs)
{
    qsort(xs, N, sizeof *xs, cmp);
    printf("  %-52s p50 %6.2f us  p99 %6.2f us\n", what, xs[N / 2], xs[N * 99 / 100]);
}

#define CK(call)                                                                                   \
    do {                                                                                           \
        CUresult r_ = (call);                                                                      \
        if (r_ != CUDA_SUCCESS) {                                                                  \
            const char *s_ = "?";                                                                  \
            cuGetErrorString(r_, &s_);                                                             \
            fprintf(stderr, "launch_cost: %s: %s (%d)\n", #call, s_, (int)r_);                     \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

int main(void)
{
    static double xs[N];
    CUdevice dev;
    CUcontext ctx;
    CUstream s;
    CUdeviceptr src, dst, word_dev;
    CUmodule mod;
    CUfunction fn;
    char name[128] = "";
    uint32_t *word;
    uint8_t *host;

    CK(cuInit(0));
    CK(cuDeviceGet(&dev, 0));
    CK(cuDeviceGetName(name, sizeof name, dev));
    CK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(cuCtxSetCurrent(ctx));
    CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CK(cuMemAlloc(&src, BYTES));
    CK(cuMemAlloc(&dst, BYTES));
    CK(cuMemsetD8(src, 0x5a, BYTES));
    if (posix_memalign((void **)&word, 4096, 4096) != 0) return 1;
    memset(word, 0, 4096);
    CK(cuMemHostRegister(word, 4096, CU_MEMHOSTREGISTER_DEVICEMAP));
    CK(cuMemHostGetDevicePointer(&word_dev, word, 0));
    CK(cuModuleLoadData(&mod, VMMT__KERNEL_PTX));
    CK(cuModuleGetFunction(&fn, mod, VMMT__KERNEL_NAME));
    printf("launch_cost: %s, 4 KiB, CPU time of each call on the caller's thread\n", name);

    CUpointer_attribute what[VMMT__KERNEL_QUERY_COUNT] = VMMT__KERNEL_QUERY;
    uint64_t v[VMMT__KERNEL_QUERY_COUNT] = {0};
    void *at[VMMT__KERNEL_QUERY_COUNT];
    for (int i = 0; i < VMMT__KERNEL_QUERY_COUNT; i++)
        at[i] = &v[i];
    CK(cuPointerGetAttributes(VMMT__KERNEL_QUERY_COUNT, what, at, src));
    printf("  pointer query of a cuMemAlloc buffer: type %u, device %d, range %s, access %u\n",
           (unsigned)v[0], (int)(uint32_t)v[1], v[2] == src && v[3] >= BYTES ? "whole" : "OTHER",
           (unsigned)v[4]);
    for (int op = 0; op < 6; op++) {
        for (int warm = 1; warm >= 0; warm--)
            for (int i = 0; i < N; i++) {
                uint64_t words = BYTES / 16;
                uint32_t value = (uint32_t)(op * N + i + 1);
                void *args[] = {&dst, &src, &words, &word_dev, &value};
                double t0 = now_us();
                if (op == 0 || op == 2) CK(cuMemcpyDtoDAsync(dst, src, BYTES, s));
                if (op == 1 || op == 2)
                    CK(cuStreamWriteValue32(s, word_dev, value, CU_STREAM_WRITE_VALUE_DEFAULT));
                if (op == 4 || op == 5)
                    CK(cuPointerGetAttributes(VMMT__KERNEL_QUERY_COUNT, what, at, src));
                if (op == 3 || op == 5)
                    CK(cuLaunchKernel(fn, 1, 1, 1, VMMT__KERNEL_THREADS, 1, 1, 0, s, args, NULL));
                xs[i] = now_us() - t0;
                if (i % 100 == 99) CK(cuStreamSynchronize(s));
            }
        CK(cuStreamSynchronize(s));
        report(op == 0   ? "cuMemcpyDtoDAsync"
               : op == 1 ? "cuStreamWriteValue32 (registered host word)"
               : op == 2 ? "both, back to back (the two-submission publish)"
               : op == 3 ? "cuLaunchKernel: copy + word in one kernel"
               : op == 4 ? "cuPointerGetAttributes (5 attributes)"
                         : "query + kernel (what a small publish does now)",
               xs);
    }

    /* The kernel's copy and word landed. */
    host = malloc(BYTES);
    CK(cuMemsetD8(dst, 0, BYTES));
    {
        uint64_t words = BYTES / 16;
        uint32_t value = 0xC0FFEE;
        void *args[] = {&dst, &src, &words, &word_dev, &value};
        CK(cuLaunchKernel(fn, 1, 1, 1, VMMT__KERNEL_THREADS, 1, 1, 0, s, args, NULL));
        CK(cuStreamSynchronize(s));
        CK(cuMemcpyDtoH(host, dst, BYTES));
        int ok = *(volatile uint32_t *)word == 0xC0FFEE;
        for (int i = 0; i < BYTES; i++)
            ok = ok && host[i] == 0x5a;
        printf("  kernel's copy and word: %s\n", ok ? "landed" : "WRONG");
        free(host);
        cuModuleUnload(mod);
        cuMemHostUnregister(word);
        free(word);
        cuMemFree(src);
        cuMemFree(dst);
        cuStreamDestroy(s);
        cuDevicePrimaryCtxRelease(dev);
        return ok ? 0 : 1;
    }
}
