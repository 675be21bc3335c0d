/*
 * A second process for tests/unit/test_emu.c: imports an allocation the test
 * exported, maps it and touches it through the emulated driver.
 *
 *   emu_child fabric HEX SIZE    import the 64-byte FABRIC handle (128 hex
 *                                digits), check pattern A, write pattern B
 *   emu_child signal SIZE DELAY  import the POSIX fd 3, wait DELAY ms, write
 *                                pattern A at offset 4096, then 7 to word 0
 *
 * Exit 0 on success; other codes name the step that failed.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "driver.h"
#include "vmmt.h"

#define CHECK(call, code)                                                                          \
    do {                                                                                           \
        CUresult r_ = (call);                                                                      \
        if (r_ != CUDA_SUCCESS) {                                                                  \
            fprintf(stderr, "emu_child: %s -> %d\n", #call, r_);                                   \
            exit(code);                                                                            \
        }                                                                                          \
    } while (0)

static const struct vmmt_drv *d;

static unsigned char pattern_a(size_t i)
{
    return (unsigned char)(i * 7 + 1);
}
static unsigned char pattern_b(size_t i)
{
    return (unsigned char)(i * 13 + 5);
}

static void start(void)
{
    CUcontext ctx;

    if (vmmt_driver_select("emu") != VMMT_OK || (d = vmmt__drv()) == NULL) exit(2);
    CHECK(d->cuDevicePrimaryCtxRetain(&ctx, 0), 3);
    CHECK(d->cuCtxPushCurrent(ctx), 4);
}

/* Reserve, map and grant device 0 read-write access to h. */
static CUdeviceptr map_rw(CUmemGenericAllocationHandle h, size_t size)
{
    CUmemAccessDesc acc = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CUdeviceptr p;

    CHECK(d->cuMemAddressReserve(&p, size, 0, 0, 0), 20);
    CHECK(d->cuMemMap(p, size, 0, h, 0), 21);
    CHECK(d->cuMemSetAccess(p, size, &acc, 1), 22);
    return p;
}

static void unmap_release(CUdeviceptr p, size_t size, CUmemGenericAllocationHandle h)
{
    CHECK(d->cuMemUnmap(p, size), 30);
    CHECK(d->cuMemAddressFree(p, size), 31);
    CHECK(d->cuMemRelease(h), 32);
}

static int parse_hex(const char *hex, unsigned char *out, size_t n)
{
    if (strlen(hex) != 2 * n) return -1;
    for (size_t i = 0; i < n; i++) {
        unsigned v;
        if (sscanf(hex + 2 * i, "%2x", &v) != 1) return -1;
        out[i] = (unsigned char)v;
    }
    return 0;
}

static int run_fabric(const char *hex, size_t size)
{
    CUmemFabricHandle fh;
    CUmemGenericAllocationHandle h;
    unsigned char *buf = malloc(size);
    CUdeviceptr p;

    if (buf == NULL || parse_hex(hex, fh.data, sizeof fh.data) != 0) return 5;
    CHECK(d->cuMemImportFromShareableHandle(&h, &fh, CU_MEM_HANDLE_TYPE_FABRIC), 6);
    p = map_rw(h, size);
    CHECK(d->cuMemcpyDtoHAsync(buf, p, size, NULL), 7);
    for (size_t i = 0; i < size; i++)
        if (buf[i] != pattern_a(i)) return 8;
    for (size_t i = 0; i < size; i++)
        buf[i] = pattern_b(i);
    CHECK(d->cuMemcpyHtoDAsync(p, buf, size, NULL), 9);
    unmap_release(p, size, h);
    free(buf);
    return 0;
}

static int run_signal(size_t size, int delay_ms)
{
    CUmemGenericAllocationHandle h;
    unsigned char buf[4096];
    CUdeviceptr p;

    CHECK(d->cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)3,
                                            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
          6);
    close(3);
    p = map_rw(h, size);
    usleep((useconds_t)delay_ms * 1000);
    for (size_t i = 0; i < sizeof buf; i++)
        buf[i] = pattern_a(i);
    CHECK(d->cuMemcpyHtoDAsync(p + 4096, buf, sizeof buf, NULL), 7);
    CHECK(d->cuStreamWriteValue32(NULL, p, 7, 0), 8);
    unmap_release(p, size, h);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 4 && strcmp(argv[1], "fabric") == 0) {
        start();
        return run_fabric(argv[2], strtoull(argv[3], NULL, 0));
    }
    if (argc == 4 && strcmp(argv[1], "signal") == 0) {
        start();
        return run_signal(strtoull(argv[2], NULL, 0), atoi(argv[3]));
    }
    fprintf(stderr, "usage: emu_child fabric HEX SIZE | signal SIZE DELAY_MS\n");
    return 1;
}
