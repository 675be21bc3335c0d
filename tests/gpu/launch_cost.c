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
 *   back (what vmmt_publish enqueues); one cuLaunchKernel of a kernel that
 *   copies the 4 KiB and then writes the word (one block, its stores fenced
 *   system-wide before thread 0's store of the word).
 * and checks that the kernel's copy and word landed.
 *
 *   cc -I/usr/local/cuda/include tests/gpu/launch_cost.c -lcuda -o launch_cost
 */
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define N     2000
#define BYTES 4096

/* Hand-written PTX: each thread copies 16-byte words; all fence, then thread 0 writes the flag. */
static const char PTX[] =
    ".version 7.0\n"
    ".target sm_70\n"
    ".address_size 64\n"
    ".visible .entry copy_flag(.param .u64 dst, .param .u64 src, .param .u64 words,\n"
    "                          .param .u64 flag, .param .u32 value)\n"
    "{\n"
    "  .reg .pred %p<3>;\n"
    "  .reg .b32 %r<4>;\n"
    "  .reg .b32 %v<4>;\n"
    "  .reg .b64 %rd<10>;\n"
    "  ld.param.u64 %rd1, [dst];\n"
    "  ld.param.u64 %rd2, [src];\n"
    "  ld.param.u64 %rd3, [words];\n"
    "  ld.param.u64 %rd4, [flag];\n"
    "  ld.param.u32 %r1, [value];\n"
    "  mov.u32 %r2, %tid.x;\n"
    "  cvt.u64.u32 %rd5, %r2;\n"
    "  mov.u32 %r3, %ntid.x;\n"
    "  cvt.u64.u32 %rd6, %r3;\n"
    "LOOP:\n"
    "  setp.ge.u64 %p1, %rd5, %rd3;\n"
    "  @%p1 bra DONE;\n"
    "  shl.b64 %rd7, %rd5, 4;\n"
    "  add.s64 %rd8, %rd2, %rd7;\n"
    "  add.s64 %rd9, %rd1, %rd7;\n"
    "  ld.global.v4.u32 {%v0, %v1, %v2, %v3}, [%rd8];\n"
    "  st.global.v4.u32 [%rd9], {%v0, %v1, %v2, %v3};\n"
    "  add.s64 %rd5, %rd5, %rd6;\n"
    "  bra LOOP;\n"
    "DONE:\n"
    "  fence.sc.sys;\n"
    "  bar.sync 0;\n"
    "  setp.ne.u32 %p2, %r2, 0;\n"
    "  @%p2 bra END;\n"
    "  st.volatile.global.u32 [%rd4], %r1;\n"
    "END:\n"
    "  ret;\n"
    "}\n";

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
    CK(cuModuleLoadData(&mod, PTX));
    CK(cuModuleGetFunction(&fn, mod, "copy_flag"));
    printf("launch_cost: %s, 4 KiB, CPU time of each call on the caller's thread\n", name);

    for (int op = 0; op < 4; op++) {
        for (int warm = 1; warm >= 0; warm--)
            for (int i = 0; i < N; i++) {
                uint64_t words = BYTES / 16;
                uint32_t value = (uint32_t)(op * N + i + 1);
                void *args[] = {&dst, &src, &words, &word_dev, &value};
                double t0 = now_us();
                if (op == 0 || op == 2) CK(cuMemcpyDtoDAsync(dst, src, BYTES, s));
                if (op == 1 || op == 2)
                    CK(cuStreamWriteValue32(s, word_dev, value, CU_STREAM_WRITE_VALUE_DEFAULT));
                if (op == 3) CK(cuLaunchKernel(fn, 1, 1, 1, 256, 1, 1, 0, s, args, NULL));
                xs[i] = now_us() - t0;
                if (i % 100 == 99) CK(cuStreamSynchronize(s));
            }
        CK(cuStreamSynchronize(s));
        report(op == 0   ? "cuMemcpyDtoDAsync"
               : op == 1 ? "cuStreamWriteValue32 (registered host word)"
               : op == 2 ? "both, back to back (what a publish enqueues)"
                         : "cuLaunchKernel: copy + word in one kernel",
               xs);
    }

    /* The kernel's copy and word landed. */
    host = malloc(BYTES);
    CK(cuMemsetD8(dst, 0, BYTES));
    {
        uint64_t words = BYTES / 16;
        uint32_t value = 0xC0FFEE;
        void *args[] = {&dst, &src, &words, &word_dev, &value};
        CK(cuLaunchKernel(fn, 1, 1, 1, 256, 1, 1, 0, s, args, NULL));
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
