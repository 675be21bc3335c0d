/*
 * The emulated driver: settings, VMM semantics, sharing between processes,
 * injected failures, streams and events. Every test starts from the default
 * settings with device 0's primary context current, and ends with nothing
 * left: no fd, mapping, thread or emulator object.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "driver.h"
#include "emu.h"
#include "testutil.h"

#define MiB    ((size_t)1 << 20)
#define GRAN   (2 * MiB)
#define RW     CU_MEM_ACCESS_FLAGS_PROT_READWRITE
#define POSIX  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
#define FABRIC CU_MEM_HANDLE_TYPE_FABRIC

#define assert_cu(expr, want) assert_int_equal((expr), (want))
#define assert_cu_ok(expr)    assert_cu((expr), CUDA_SUCCESS)

static const char *const g_settings[] = {
    "VMMT_EMU_DEVICES",         "VMMT_EMU_GRANULARITY",   "VMMT_EMU_HANDLES",   "VMMT_EMU_FAIL",
    "VMMT_EMU_WAIT_TIMEOUT_MS", "VMMT_EMU_WAIT_IMPORTED", "VMMT_EMU_TOTAL_MEM",
};

static const struct vmmt_drv *d;
static CUcontext g_ctx;
static tu_resources g_before;

/* ---------------------------------------------------------------- helpers */

static void defaults(void)
{
    for (size_t i = 0; i < sizeof g_settings / sizeof g_settings[0]; i++)
        unsetenv(g_settings[i]);
    vmmt__emu_configure();
}

static void configure(const char *name, const char *value)
{
    setenv(name, value, 1);
    vmmt__emu_configure();
}

static CUmemAllocationProp prop_for(int device, unsigned types)
{
    CUmemAllocationProp p;

    memset(&p, 0, sizeof p);
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = device;
    p.requestedHandleTypes = (CUmemAllocationHandleType)types;
    return p;
}

static CUresult create(CUmemGenericAllocationHandle *h, size_t size, unsigned types)
{
    CUmemAllocationProp p = prop_for(0, types);
    return d->cuMemCreate(h, size, &p, 0);
}

static CUresult grant(CUdeviceptr p, size_t size, int device, CUmemAccess_flags flags)
{
    CUmemAccessDesc acc = {{CU_MEM_LOCATION_TYPE_DEVICE, device}, flags};
    return d->cuMemSetAccess(p, size, &acc, 1);
}

/* Reserve size bytes, map h over them and let device 0 read and write. */
static CUdeviceptr map_rw(CUmemGenericAllocationHandle h, size_t size)
{
    CUdeviceptr p;

    assert_cu_ok(d->cuMemAddressReserve(&p, size, 0, 0, 0));
    assert_cu_ok(d->cuMemMap(p, size, 0, h, 0));
    assert_cu_ok(grant(p, size, 0, RW));
    return p;
}

static void unmap_free(CUdeviceptr p, size_t size)
{
    assert_cu_ok(d->cuMemUnmap(p, size));
    assert_cu_ok(d->cuMemAddressFree(p, size));
}

static unsigned char pattern_a(size_t i)
{
    return (unsigned char)(i * 7 + 1);
}
static unsigned char pattern_b(size_t i)
{
    return (unsigned char)(i * 13 + 5);
}

static void fill(unsigned char *buf, size_t n, unsigned char (*pat)(size_t))
{
    for (size_t i = 0; i < n; i++)
        buf[i] = pat(i);
}

static int matches(const unsigned char *buf, size_t n, unsigned char (*pat)(size_t))
{
    for (size_t i = 0; i < n; i++)
        if (buf[i] != pat(i)) return 0;
    return 1;
}

/* A zeroed word of device memory (cuMemAlloc) to wait on. */
static CUdeviceptr new_word(void)
{
    CUdeviceptr w;

    assert_cu_ok(d->cuMemAlloc(&w, 4));
    assert_cu_ok(d->cuMemsetD8Async(w, 0, 4, NULL));
    return w;
}

static double ms_since(const struct timespec *t0)
{
    struct timespec t;

    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)(t.tv_sec - t0->tv_sec) * 1e3 + (double)(t.tv_nsec - t0->tv_nsec) / 1e6;
}

/* ------------------------------------------------------- setup, teardown */

static int setup(void **state)
{
    (void)state;
    defaults();
    d = vmmt__drv();
    if (d == NULL) return -1;
    if (d->cuDevicePrimaryCtxRetain(&g_ctx, 0) != CUDA_SUCCESS) return -1;
    if (d->cuCtxPushCurrent(g_ctx) != CUDA_SUCCESS) return -1;
    tu_resources_take(&g_before);
    return 0;
}

static int teardown(void **state)
{
    CUcontext popped;

    (void)state;
    assert_int_equal(vmmt__emu_live_allocations(), 0);
    assert_int_equal(vmmt__emu_live_reservations(), 0);
    assert_int_equal(vmmt__emu_live_mappings(), 0);
    assert_int_equal(vmmt__emu_live_streams(), 0);
    assert_int_equal(vmmt__emu_live_events(), 0);
    assert_int_equal(vmmt__emu_live_blocks(), 0);
    tu_resources_check(&g_before);
    while (d->cuCtxPopCurrent(&popped) == CUDA_SUCCESS) {
    }
    assert_cu_ok(d->cuDevicePrimaryCtxRelease(0));
    defaults();
    return 0;
}

/* ------------------------------------------------------------------ tests */

/* Runs first: nothing in this process has called cuInit yet. */
static void test_init_required(void **state)
{
    struct vmmt_drv t;
    int n = -1, version = 0;
    const char *name = NULL;

    (void)state;
    assert_int_equal(vmmt__drv_open("emu", &t, NULL), VMMT_OK);
    assert_string_equal(t.name, "emu");
    assert_cu(t.cuDeviceGetCount(&n), CUDA_ERROR_NOT_INITIALIZED);
    assert_cu(t.cuMemAddressFree(0, 0), CUDA_ERROR_NOT_INITIALIZED);
    /* These work before cuInit in the driver too. */
    assert_cu_ok(t.cuDriverGetVersion(&version));
    assert_int_equal(version, 13000);
    assert_cu_ok(t.cuGetErrorName(CUDA_ERROR_NOT_INITIALIZED, &name));
    assert_string_equal(name, "CUDA_ERROR_NOT_INITIALIZED");
    configure("VMMT_EMU_FAIL", "cuInit:1:CUDA_ERROR_UNKNOWN");
    assert_cu(t.cuInit(0), CUDA_ERROR_UNKNOWN);
    assert_cu(t.cuDeviceGetCount(&n), CUDA_ERROR_NOT_INITIALIZED);
    configure("VMMT_EMU_DEVICES", "0");
    unsetenv("VMMT_EMU_FAIL");
    vmmt__emu_configure();
    assert_cu(t.cuInit(0), CUDA_ERROR_NO_DEVICE);
    defaults();
    assert_cu_ok(t.cuInit(0));
    assert_cu_ok(t.cuDeviceGetCount(&n));
    assert_int_equal(n, 2);
}

static void test_devices(void **state)
{
    static const CUresult codes[] = {
        CUDA_SUCCESS,
        CUDA_ERROR_INVALID_VALUE,
        CUDA_ERROR_OUT_OF_MEMORY,
        CUDA_ERROR_NOT_INITIALIZED,
        CUDA_ERROR_DEINITIALIZED,
        CUDA_ERROR_NO_DEVICE,
        CUDA_ERROR_INVALID_DEVICE,
        CUDA_ERROR_INVALID_CONTEXT,
        CUDA_ERROR_ALREADY_MAPPED,
        CUDA_ERROR_NOT_MAPPED,
        CUDA_ERROR_OPERATING_SYSTEM,
        CUDA_ERROR_INVALID_HANDLE,
        CUDA_ERROR_NOT_FOUND,
        CUDA_ERROR_NOT_READY,
        CUDA_ERROR_ILLEGAL_ADDRESS,
        CUDA_ERROR_LAUNCH_FAILED,
        CUDA_ERROR_NOT_PERMITTED,
        CUDA_ERROR_NOT_SUPPORTED,
        CUDA_ERROR_TIMEOUT,
        CUDA_ERROR_UNKNOWN,
    };
    char name[64];
    const char *s;
    size_t total;
    int n, v;

    (void)state;
    assert_cu_ok(d->cuDeviceGetCount(&n));
    assert_int_equal(n, 2);
    configure("VMMT_EMU_DEVICES", "3");
    assert_cu_ok(d->cuDeviceGetCount(&n));
    assert_int_equal(n, 3);
    assert_cu_ok(d->cuDeviceGetName(name, sizeof name, 2));
    assert_string_equal(name, "vmmt emulated device 2");
    assert_cu(d->cuDeviceGetName(name, sizeof name, 3), CUDA_ERROR_INVALID_DEVICE);
    assert_cu(d->cuDeviceGet(&v, 3), CUDA_ERROR_INVALID_DEVICE);
    assert_cu_ok(d->cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, 2));
    assert_int_equal(v, 3);
    assert_cu_ok(
        d->cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 0));
    assert_int_equal(v, 1);
    assert_cu_ok(d->cuDeviceGetAttribute(
        &v, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, 0));
    assert_int_equal(v, 0);
    assert_cu_ok(d->cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, 0));
    assert_int_equal(v, 1);
    assert_cu_ok(d->cuDeviceTotalMem(&total, 0));
    assert_true(total == 17179869184ULL);
    configure("VMMT_EMU_TOTAL_MEM", "1073741824");
    assert_cu_ok(d->cuDeviceTotalMem(&total, 1));
    assert_true(total == 1073741824ULL);
    for (size_t i = 0; i < sizeof codes / sizeof codes[0]; i++) {
        assert_cu_ok(d->cuGetErrorName(codes[i], &s));
        assert_non_null(strstr(s, "CUDA_"));
        assert_cu_ok(d->cuGetErrorString(codes[i], &s));
        assert_true(strlen(s) > 0);
    }
    assert_cu(d->cuGetErrorName(12345, &s), CUDA_ERROR_INVALID_VALUE);
    assert_null(s);
}

static void test_contexts(void **state)
{
    CUcontext cur, ctx1, popped;
    CUdeviceptr p;
    CUstream s;
    CUevent e1;

    (void)state;
    assert_cu_ok(d->cuCtxGetCurrent(&cur));
    assert_ptr_equal(cur, g_ctx);
    assert_cu_ok(d->cuDevicePrimaryCtxRetain(&ctx1, 1));
    assert_ptr_not_equal(ctx1, g_ctx);
    assert_cu_ok(d->cuCtxPushCurrent(ctx1));
    assert_cu_ok(d->cuCtxGetCurrent(&cur));
    assert_ptr_equal(cur, ctx1);
    assert_cu_ok(d->cuEventCreate(&e1, 0));
    assert_cu_ok(d->cuCtxPopCurrent(&popped));
    assert_ptr_equal(popped, ctx1);
    /* An event of device 1 cannot record in device 0's context. */
    assert_cu(d->cuEventRecord(e1, NULL), CUDA_ERROR_INVALID_HANDLE);
    assert_cu_ok(d->cuEventDestroy(e1));
    assert_cu_ok(d->cuDevicePrimaryCtxRelease(1));
    assert_cu(d->cuDevicePrimaryCtxRelease(1), CUDA_ERROR_INVALID_CONTEXT);

    /* No current context: allocations and streams refuse, VMM calls do not. */
    assert_cu_ok(d->cuCtxPopCurrent(&popped));
    assert_cu_ok(d->cuCtxGetCurrent(&cur));
    assert_null(cur);
    assert_cu(d->cuCtxPopCurrent(&popped), CUDA_ERROR_INVALID_CONTEXT);
    assert_cu(d->cuMemAlloc(&p, 4096), CUDA_ERROR_INVALID_CONTEXT);
    assert_cu(d->cuStreamCreate(&s, 0), CUDA_ERROR_INVALID_CONTEXT);
    assert_cu(d->cuStreamSynchronize(NULL), CUDA_ERROR_INVALID_CONTEXT);
    assert_cu_ok(d->cuMemAddressReserve(&p, GRAN, 0, 0, 0));
    assert_cu_ok(d->cuMemAddressFree(p, GRAN));
    /* An inactive (released) primary context is current but unusable. */
    assert_cu_ok(d->cuCtxPushCurrent(ctx1));
    assert_cu(d->cuMemAlloc(&p, 4096), CUDA_ERROR_INVALID_CONTEXT);
    assert_cu_ok(d->cuCtxPopCurrent(NULL));
    assert_cu(d->cuCtxPushCurrent(NULL), CUDA_ERROR_INVALID_CONTEXT);
    assert_cu_ok(d->cuCtxPushCurrent(g_ctx));
}

static void test_granularity_from_env(void **state)
{
    CUmemAllocationProp p = prop_for(0, POSIX);
    size_t g = 0;

    (void)state;
    assert_cu_ok(d->cuMemGetAllocationGranularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    assert_int_equal(g, GRAN);
    configure("VMMT_EMU_GRANULARITY", "65536");
    assert_cu_ok(d->cuMemGetAllocationGranularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    assert_int_equal(g, 65536);
    configure("VMMT_EMU_GRANULARITY", "12345"); /* not a power of two: the default */
    assert_cu_ok(d->cuMemGetAllocationGranularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    assert_int_equal(g, GRAN);
    configure("VMMT_EMU_GRANULARITY", "2048"); /* below a page: the default */
    assert_cu_ok(d->cuMemGetAllocationGranularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    assert_int_equal(g, GRAN);
    p.location.id = 2;
    assert_cu(d->cuMemGetAllocationGranularity(&g, &p, 0), CUDA_ERROR_INVALID_DEVICE);
    p = prop_for(0, POSIX);
    p.location.type = CU_MEM_LOCATION_TYPE_INVALID;
    assert_cu(d->cuMemGetAllocationGranularity(&g, &p, 0), CUDA_ERROR_INVALID_VALUE);
    p = prop_for(0, POSIX);
    p.type = (CUmemAllocationType)0;
    assert_cu(d->cuMemGetAllocationGranularity(&g, &p, 0), CUDA_ERROR_INVALID_VALUE);
}

static void test_create_size_not_multiple(void **state)
{
    CUmemGenericAllocationHandle h;

    (void)state;
    assert_cu(create(&h, GRAN + 4096, POSIX), CUDA_ERROR_INVALID_VALUE);
    assert_cu(create(&h, 0, POSIX), CUDA_ERROR_INVALID_VALUE);
    configure("VMMT_EMU_GRANULARITY", "65536");
    assert_cu_ok(create(&h, 3 * 65536, POSIX));
    assert_int_equal(vmmt__emu_live_allocations(), 1);
    assert_cu_ok(d->cuMemRelease(h));
}

static void test_handle_types(void **state)
{
    CUmemGenericAllocationHandle h;
    CUmemFabricHandle fh;
    int v, fd;

    (void)state;
    /* Default: like the lent H200 without an IMEX channel. */
    assert_cu_ok(d->cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, 0));
    assert_int_equal(v, 1);
    assert_cu(create(&h, GRAN, FABRIC), CUDA_ERROR_NOT_PERMITTED);
    assert_cu(create(&h, GRAN, FABRIC | POSIX), CUDA_ERROR_NOT_PERMITTED);
    assert_cu_ok(d->cuDeviceGetAttribute(
        &v, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, 0));
    assert_int_equal(v, 1);

    configure("VMMT_EMU_HANDLES", "fabric,posix_fd");
    assert_cu_ok(create(&h, GRAN, FABRIC));
    assert_cu_ok(d->cuMemExportToShareableHandle(&fh, h, FABRIC, 0));
    assert_cu(d->cuMemExportToShareableHandle(&fd, h, POSIX, 0), CUDA_ERROR_INVALID_VALUE);
    assert_cu_ok(d->cuMemRelease(h));

    configure("VMMT_EMU_HANDLES", "none");
    assert_cu_ok(d->cuDeviceGetAttribute(
        &v, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, 0));
    assert_int_equal(v, 0);
    assert_cu(create(&h, GRAN, POSIX), CUDA_ERROR_NOT_SUPPORTED);
    assert_cu(create(&h, GRAN, FABRIC), CUDA_ERROR_NOT_PERMITTED);
    assert_cu_ok(create(&h, GRAN, CU_MEM_HANDLE_TYPE_NONE));
    assert_cu(d->cuMemExportToShareableHandle(&fd, h, POSIX, 0), CUDA_ERROR_INVALID_VALUE);
    assert_cu(d->cuMemExportToShareableHandle(&fh, h, FABRIC, 0), CUDA_ERROR_INVALID_VALUE);
    assert_cu_ok(d->cuMemRelease(h));
    assert_cu(d->cuMemRelease(h), CUDA_ERROR_INVALID_VALUE); /* stale */
    assert_cu(d->cuMemRelease(0), CUDA_ERROR_INVALID_VALUE);
}

static void test_posix_same_process(void **state)
{
    static unsigned char in[4096], out[4096];
    CUmemGenericAllocationHandle h, h2, bad;
    CUdeviceptr a, b;
    int fd, pipefd[2];

    (void)state;
    assert_cu_ok(create(&h, GRAN, POSIX));
    assert_cu_ok(d->cuMemExportToShareableHandle(&fd, h, POSIX, 0));
    assert_cu_ok(d->cuMemImportFromShareableHandle(&h2, (void *)(uintptr_t)fd, POSIX));
    close(fd); /* the emulator keeps its own */
    assert_true(h2 != h);
    a = map_rw(h, GRAN);
    b = map_rw(h2, GRAN);
    assert_true(a != b);
    fill(in, sizeof in, pattern_a);
    assert_cu_ok(d->cuMemcpyHtoDAsync(a + GRAN - sizeof in, in, sizeof in, NULL));
    assert_cu_ok(d->cuMemcpyDtoHAsync(out, b + GRAN - sizeof in, sizeof out, NULL));
    assert_memory_equal(in, out, sizeof in);
    assert_memory_equal((void *)(uintptr_t)b, (void *)(uintptr_t)a, GRAN);

    /* Not an emulator allocation, or no fd at all. */
    assert_int_equal(pipe(pipefd), 0);
    assert_cu(d->cuMemImportFromShareableHandle(&bad, (void *)(uintptr_t)pipefd[0], POSIX),
              CUDA_ERROR_INVALID_VALUE);
    close(pipefd[0]);
    close(pipefd[1]);
    assert_cu(d->cuMemImportFromShareableHandle(&bad, (void *)(uintptr_t)-1, POSIX),
              CUDA_ERROR_INVALID_VALUE);
    assert_cu(d->cuMemImportFromShareableHandle(&bad, (void *)(uintptr_t)9999, POSIX),
              CUDA_ERROR_INVALID_VALUE);

    unmap_free(a, GRAN);
    unmap_free(b, GRAN);
    assert_cu_ok(d->cuMemRelease(h2));
    assert_cu_ok(d->cuMemRelease(h));
}

static void test_fabric_child(void **state)
{
    /* Static: a large malloc would stay mapped in the sanitizer's quarantine. */
    static unsigned char buf[2 * GRAN];
    const size_t size = sizeof buf;
    CUmemGenericAllocationHandle h, bad;
    CUmemFabricHandle fh;
    char hex[2 * sizeof fh.data + 1], sz[32];
    CUdeviceptr p;
    pid_t pid;

    (void)state;
    configure("VMMT_EMU_HANDLES", "fabric,posix_fd"); /* the child inherits it */
    assert_cu_ok(create(&h, size, FABRIC | POSIX));
    p = map_rw(h, size);
    fill(buf, size, pattern_a);
    assert_cu_ok(d->cuMemcpyHtoDAsync(p, buf, size, NULL));
    assert_cu_ok(d->cuMemExportToShareableHandle(&fh, h, FABRIC, 0));
    for (size_t i = 0; i < sizeof fh.data; i++)
        sprintf(hex + 2 * i, "%02x", fh.data[i]);
    snprintf(sz, sizeof sz, "%zu", size);
    pid = tu_spawn("emu_child", (char *[]){"fabric", hex, sz, NULL}, -1);
    assert_true(pid > 0);
    assert_int_equal(tu_wait(pid, 10000), 0);
    assert_cu_ok(d->cuMemcpyDtoHAsync(buf, p, size, NULL));
    assert_true(matches(buf, size, pattern_b));

    /* A forged cookie, and an import once the exporter released everything. */
    fh.data[8] ^= 1;
    assert_cu(d->cuMemImportFromShareableHandle(&bad, &fh, FABRIC), CUDA_ERROR_INVALID_VALUE);
    fh.data[8] ^= 1;
    unmap_free(p, size);
    assert_cu_ok(d->cuMemRelease(h));
    assert_cu(d->cuMemImportFromShareableHandle(&bad, &fh, FABRIC), CUDA_ERROR_INVALID_VALUE);
    configure("VMMT_EMU_HANDLES", "posix_fd");
    assert_cu(d->cuMemImportFromShareableHandle(&bad, &fh, FABRIC), CUDA_ERROR_NOT_PERMITTED);
}

/* A stream here waits on a word that another process writes into shared memory. */
static void test_cross_process_wait(void **state)
{
    static unsigned char out[4096];
    CUmemGenericAllocationHandle h;
    CUdeviceptr p;
    CUstream s;
    pid_t pid;
    int fd;

    (void)state;
    assert_cu_ok(create(&h, GRAN, POSIX));
    p = map_rw(h, GRAN);
    assert_cu_ok(d->cuMemsetD8Async(p, 0, GRAN, NULL));
    assert_cu_ok(d->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    assert_cu_ok(d->cuStreamWaitValue32(s, p, 7, CU_STREAM_WAIT_VALUE_EQ));
    assert_cu_ok(d->cuMemcpyDtoHAsync(out, p + 4096, sizeof out, s));
    assert_cu(d->cuStreamQuery(s), CUDA_ERROR_NOT_READY);
    assert_cu_ok(d->cuMemExportToShareableHandle(&fd, h, POSIX, 0));
    pid = tu_spawn("emu_child", (char *[]){"signal", "2097152", "50", NULL}, fd);
    close(fd);
    assert_true(pid > 0);
    assert_cu_ok(d->cuStreamSynchronize(s));
    assert_true(matches(out, sizeof out, pattern_a));
    assert_int_equal(tu_wait(pid, 10000), 0);
    assert_cu_ok(d->cuStreamDestroy(s));
    unmap_free(p, GRAN);
    assert_cu_ok(d->cuMemRelease(h));
}

static void test_map_errors(void **state)
{
    CUmemGenericAllocationHandle h, stale;
    CUdeviceptr r1, r2;

    (void)state;
    assert_cu_ok(create(&h, 2 * GRAN, POSIX));
    assert_cu_ok(create(&stale, GRAN, POSIX));
    assert_cu_ok(d->cuMemRelease(stale));
    assert_cu_ok(d->cuMemAddressReserve(&r1, 2 * GRAN, 0, 0, 0));
    assert_cu_ok(d->cuMemAddressReserve(&r2, 4 * GRAN, 4 * GRAN, 0, 0));
    assert_int_equal(r1 % GRAN, 0);
    assert_int_equal(r2 % (4 * GRAN), 0);
    assert_cu(d->cuMemAddressReserve(&r2, GRAN + 1, 0, 0, 0), CUDA_ERROR_INVALID_VALUE);
    assert_cu(d->cuMemAddressReserve(&r2, GRAN, 3 * 4096, 0, 0), CUDA_ERROR_INVALID_VALUE);

    /* Outside any reservation, straddling its end, past the allocation, unaligned. */
    assert_cu(d->cuMemMap((CUdeviceptr)(uintptr_t)&h & ~(CUdeviceptr)(GRAN - 1), GRAN, 0, h, 0),
              CUDA_ERROR_INVALID_VALUE);
    assert_cu(d->cuMemMap(r1 + GRAN, 2 * GRAN, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
    assert_cu(d->cuMemMap(r1, 2 * GRAN, GRAN, h, 0), CUDA_ERROR_INVALID_VALUE);
    assert_cu(d->cuMemMap(r1 + 4096, GRAN, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
    assert_cu(d->cuMemMap(r1, GRAN, 0, stale, 0), CUDA_ERROR_INVALID_VALUE);
    assert_cu(d->cuMemMap(r1, GRAN, 0, h, 1), CUDA_ERROR_INVALID_VALUE);

    assert_cu_ok(d->cuMemMap(r1, GRAN, GRAN, h, 0));
    assert_cu(d->cuMemMap(r1, GRAN, 0, h, 0), CUDA_ERROR_ALREADY_MAPPED);
    assert_cu(d->cuMemMap(r1, 2 * GRAN, 0, h, 0), CUDA_ERROR_ALREADY_MAPPED);
    assert_cu_ok(d->cuMemMap(r1 + GRAN, GRAN, 0, h, 0));
    assert_int_equal(vmmt__emu_live_mappings(), 2);

    /* Access and unmap need whole mappings; a reservation in use stays. */
    assert_cu(grant(r1, GRAN / 2, 0, RW), CUDA_ERROR_INVALID_VALUE);
    assert_cu(grant(r1, 3 * GRAN, 0, RW), CUDA_ERROR_INVALID_VALUE);
    assert_cu(grant(r1, 2 * GRAN, 2, RW), CUDA_ERROR_INVALID_DEVICE);
    assert_cu_ok(grant(r1, 2 * GRAN, 0, RW));
    assert_cu(d->cuMemUnmap(r1, GRAN / 2), CUDA_ERROR_INVALID_VALUE);
    assert_cu(d->cuMemUnmap(r2, GRAN), CUDA_ERROR_INVALID_VALUE);
    assert_cu(d->cuMemAddressFree(r1, 2 * GRAN), CUDA_ERROR_INVALID_VALUE);
    assert_cu(d->cuMemAddressFree(r2, GRAN), CUDA_ERROR_INVALID_VALUE);
    assert_cu_ok(d->cuMemUnmap(r1, 2 * GRAN));
    assert_int_equal(vmmt__emu_live_mappings(), 0);
    assert_cu_ok(d->cuMemAddressFree(r1, 2 * GRAN));
    assert_cu(d->cuMemAddressFree(r1, 2 * GRAN), CUDA_ERROR_INVALID_VALUE);
    assert_cu_ok(d->cuMemAddressFree(r2, 4 * GRAN));
    assert_cu_ok(d->cuMemRelease(h));
}

static void test_release_mapped_keeps_memory(void **state)
{
    static unsigned char buf[4096];
    CUmemGenericAllocationHandle h;
    CUdeviceptr p;

    (void)state;
    assert_cu_ok(create(&h, GRAN, POSIX));
    p = map_rw(h, GRAN);
    fill(buf, sizeof buf, pattern_a);
    assert_cu_ok(d->cuMemcpyHtoDAsync(p, buf, sizeof buf, NULL));
    assert_cu_ok(d->cuMemRelease(h));
    assert_int_equal(vmmt__emu_live_allocations(), 1);
    assert_cu(d->cuMemRelease(h), CUDA_ERROR_INVALID_VALUE);
    assert_cu(d->cuMemMap(p, GRAN, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
    memset(buf, 0, sizeof buf);
    assert_cu_ok(d->cuMemcpyDtoHAsync(buf, p, sizeof buf, NULL));
    assert_true(matches(buf, sizeof buf, pattern_a));
    unmap_free(p, GRAN);
    assert_int_equal(vmmt__emu_live_allocations(), 0);
}

static void test_fault_injection(void **state)
{
    CUmemGenericAllocationHandle h[3];
    CUdeviceptr r;
    CUstream s;

    (void)state;
    configure("VMMT_EMU_FAIL", "cuMemCreate:2:CUDA_ERROR_OUT_OF_MEMORY,cuMemMap:*:999,cuBogus:1:2,"
                               "cuStreamCreate:1:2");
    assert_cu_ok(create(&h[0], GRAN, POSIX));
    assert_cu(create(&h[1], GRAN, POSIX), CUDA_ERROR_OUT_OF_MEMORY);
    assert_int_equal(vmmt__emu_live_allocations(), 1); /* failed without doing anything */
    assert_cu_ok(create(&h[2], GRAN, POSIX));
    assert_int_equal(vmmt__emu_calls("cuMemCreate"), 3);
    assert_int_equal(vmmt__emu_calls("cuBogus"), -1);
    assert_cu_ok(d->cuMemAddressReserve(&r, GRAN, 0, 0, 0));
    assert_cu(d->cuMemMap(r, GRAN, 0, h[0], 0), 999);
    assert_cu(d->cuMemMap(r, GRAN, 0, h[0], 0), 999);
    assert_int_equal(vmmt__emu_live_mappings(), 0);
    assert_cu(d->cuStreamCreate(&s, 0), CUDA_ERROR_OUT_OF_MEMORY);
    assert_cu_ok(d->cuStreamCreate(&s, 0));
    assert_cu_ok(d->cuStreamDestroy(s));

    /* configure resets the counters and the rules. */
    configure("VMMT_EMU_FAIL", "cuMemCreate:1:801");
    assert_int_equal(vmmt__emu_calls("cuMemCreate"), 0);
    assert_cu(create(&h[1], GRAN, POSIX), CUDA_ERROR_NOT_SUPPORTED);
    unsetenv("VMMT_EMU_FAIL");
    vmmt__emu_configure();
    assert_cu_ok(d->cuMemMap(r, GRAN, 0, h[0], 0));
    assert_cu_ok(d->cuMemUnmap(r, GRAN));
    assert_cu_ok(d->cuMemAddressFree(r, GRAN));
    assert_cu_ok(d->cuMemRelease(h[0]));
    assert_cu_ok(d->cuMemRelease(h[2]));
}

/* Copy, then signal on one stream; wait, then copy on another; a gate holds the first. */
static void test_stream_ordering(void **state)
{
    static unsigned char in[65536], out[65536];
    CUdeviceptr gate = new_word(), flag = new_word(), buf, buf2;
    CUstream a, b, c;

    (void)state;
    assert_cu_ok(d->cuMemAlloc(&buf, sizeof in));
    assert_cu_ok(d->cuMemAlloc(&buf2, sizeof in));
    assert_cu_ok(d->cuStreamCreate(&a, 0));
    assert_cu_ok(d->cuStreamCreate(&b, 0));
    assert_cu_ok(d->cuStreamCreate(&c, CU_STREAM_NON_BLOCKING));
    fill(in, sizeof in, pattern_a);
    assert_cu_ok(d->cuStreamWaitValue32(a, gate, 1, CU_STREAM_WAIT_VALUE_GEQ));
    assert_cu_ok(d->cuMemcpyHtoDAsync(buf, in, sizeof in, a));
    assert_cu_ok(d->cuStreamWriteValue32(a, flag, 1, 0));
    assert_cu_ok(d->cuStreamWaitValue32(b, flag, 1, CU_STREAM_WAIT_VALUE_GEQ));
    assert_cu_ok(d->cuMemcpyDtoDAsync(buf2, buf, sizeof in, b));
    assert_cu_ok(d->cuMemcpyDtoHAsync(out, buf2, sizeof out, b));
    usleep(20000);
    assert_cu(d->cuStreamQuery(a), CUDA_ERROR_NOT_READY);
    assert_cu(d->cuStreamQuery(b), CUDA_ERROR_NOT_READY);
    assert_cu(d->cuStreamQuery(NULL), CUDA_ERROR_NOT_READY); /* blocking streams pending */
    assert_cu_ok(d->cuStreamWriteValue32(c, gate, 1, 0));
    assert_cu_ok(d->cuStreamSynchronize(b));
    assert_memory_equal(in, out, sizeof in);
    assert_cu_ok(d->cuStreamSynchronize(NULL));
    assert_cu_ok(d->cuStreamQuery(a));
    assert_cu_ok(d->cuStreamDestroy(c));
    assert_cu_ok(d->cuStreamDestroy(b));
    assert_cu_ok(d->cuStreamDestroy(a));
    assert_cu(d->cuStreamDestroy(a), CUDA_ERROR_INVALID_HANDLE);
    assert_cu(d->cuStreamQuery(a), CUDA_ERROR_INVALID_HANDLE);
    assert_cu_ok(d->cuMemFree(buf2));
    assert_cu_ok(d->cuMemFree(buf));
    assert_cu_ok(d->cuMemFree(flag));
    assert_cu_ok(d->cuMemFree(gate));
}

static void test_events(void **state)
{
    static unsigned char out[4096];
    CUdeviceptr gate = new_word(), buf;
    CUevent start, end, untimed;
    CUstream a, b, c;
    float ms = -1;

    (void)state;
    assert_cu_ok(d->cuMemAlloc(&buf, sizeof out));
    assert_cu_ok(d->cuStreamCreate(&a, CU_STREAM_NON_BLOCKING));
    assert_cu_ok(d->cuStreamCreate(&b, CU_STREAM_NON_BLOCKING));
    assert_cu_ok(d->cuStreamCreate(&c, CU_STREAM_NON_BLOCKING));
    assert_cu_ok(d->cuEventCreate(&start, 0));
    assert_cu_ok(d->cuEventCreate(&end, 0));
    assert_cu_ok(d->cuEventCreate(&untimed, CU_EVENT_DISABLE_TIMING));
    assert_cu(d->cuEventElapsedTime(&ms, start, end), CUDA_ERROR_INVALID_HANDLE);
    assert_cu_ok(d->cuEventQuery(end)); /* never recorded: complete */

    assert_cu_ok(d->cuEventRecord(start, a));
    assert_cu_ok(d->cuStreamWaitValue32(a, gate, 1, CU_STREAM_WAIT_VALUE_EQ));
    assert_cu_ok(d->cuMemsetD8Async(buf, 0x77, sizeof out, a));
    assert_cu_ok(d->cuEventRecord(end, a));
    assert_cu_ok(d->cuEventRecord(untimed, a));
    assert_cu_ok(d->cuStreamWaitEvent(b, end, 0));
    assert_cu_ok(d->cuMemcpyDtoHAsync(out, buf, sizeof out, b));
    /* Destroying an event with queued uses is legal; they keep it alive. */
    assert_cu_ok(d->cuEventDestroy(untimed));
    usleep(20000);
    assert_cu(d->cuEventQuery(end), CUDA_ERROR_NOT_READY);
    assert_cu(d->cuStreamQuery(b), CUDA_ERROR_NOT_READY);
    assert_cu(d->cuEventElapsedTime(&ms, start, end), CUDA_ERROR_NOT_READY);
    assert_cu_ok(d->cuStreamWriteValue32(c, gate, 1, 0));
    assert_cu_ok(d->cuStreamSynchronize(b));
    for (size_t i = 0; i < sizeof out; i++)
        assert_int_equal(out[i], 0x77);
    assert_cu_ok(d->cuEventSynchronize(end));
    assert_cu_ok(d->cuEventElapsedTime(&ms, start, end));
    /* Only the order is certain: the start event is stamped when the stream's
     * worker thread reaches it, which on a loaded machine can be well after
     * the record call (CI saw 3 ms for a 20 ms gate). */
    assert_true(ms > 0.0f && ms < 5000.0f);

    assert_cu_ok(d->cuStreamDestroy(c));
    assert_cu_ok(d->cuStreamDestroy(b));
    assert_cu_ok(d->cuStreamDestroy(a));
    assert_cu_ok(d->cuEventDestroy(end));
    assert_cu_ok(d->cuEventDestroy(start));
    assert_cu(d->cuEventDestroy(start), CUDA_ERROR_INVALID_HANDLE);
    assert_cu_ok(d->cuMemFree(buf));
    assert_cu_ok(d->cuMemFree(gate));
}

static void test_wait_timeout(void **state)
{
    CUdeviceptr word;
    struct timespec t0;
    CUstream s;
    CUevent e;
    double ms;

    (void)state;
    configure("VMMT_EMU_WAIT_TIMEOUT_MS", "100");
    word = new_word();
    assert_cu_ok(d->cuStreamCreate(&s, 0));
    assert_cu_ok(d->cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
    clock_gettime(CLOCK_MONOTONIC, &t0);
    assert_cu_ok(d->cuStreamWaitValue32(s, word, 1, CU_STREAM_WAIT_VALUE_GEQ));
    assert_cu_ok(d->cuMemsetD8Async(word, 1, 4, s)); /* skipped after the failure */
    assert_cu_ok(d->cuEventRecord(e, s));
    assert_cu(d->cuStreamSynchronize(s), CUDA_ERROR_TIMEOUT);
    ms = ms_since(&t0);
    assert_true(ms >= 90.0 && ms < 2000.0);
    assert_cu(d->cuStreamQuery(s), CUDA_ERROR_TIMEOUT);
    assert_cu(d->cuMemsetD8Async(word, 1, 4, s), CUDA_ERROR_TIMEOUT);
    assert_cu(d->cuEventSynchronize(e), CUDA_ERROR_TIMEOUT);
    assert_int_equal(*(volatile uint32_t *)(uintptr_t)word, 0);
    assert_cu_ok(d->cuStreamDestroy(s));
    assert_cu_ok(d->cuEventDestroy(e));
    assert_cu_ok(d->cuMemFree(word));
}

static void test_wait_imported(void **state)
{
    CUmemGenericAllocationHandle h, imp;
    CUdeviceptr own, theirs;
    CUstream s;
    int fd;

    (void)state;
    assert_cu_ok(create(&h, GRAN, POSIX));
    assert_cu_ok(d->cuMemExportToShareableHandle(&fd, h, POSIX, 0));
    assert_cu_ok(d->cuMemImportFromShareableHandle(&imp, (void *)(uintptr_t)fd, POSIX));
    close(fd);
    own = map_rw(h, GRAN);
    theirs = map_rw(imp, GRAN);
    assert_cu_ok(d->cuStreamCreate(&s, 0));
    assert_cu_ok(d->cuStreamWaitValue32(s, theirs, 0, CU_STREAM_WAIT_VALUE_GEQ));
    assert_cu_ok(d->cuStreamSynchronize(s));
    configure("VMMT_EMU_WAIT_IMPORTED", "0");
    assert_cu(d->cuStreamWaitValue32(s, theirs, 0, CU_STREAM_WAIT_VALUE_GEQ),
              CUDA_ERROR_NOT_SUPPORTED);
    assert_cu_ok(d->cuStreamWaitValue32(s, own, 0, CU_STREAM_WAIT_VALUE_GEQ));
    assert_cu_ok(d->cuStreamWriteValue32(s, theirs, 5, 0)); /* writes stay allowed */
    assert_cu_ok(d->cuStreamSynchronize(s));
    assert_int_equal(*(volatile uint32_t *)(uintptr_t)own, 5);
    assert_cu(d->cuStreamWaitValue32(s, own + 2, 0, 0), CUDA_ERROR_INVALID_VALUE);
    assert_cu(d->cuStreamWaitValue32(s, own, 0, 7), CUDA_ERROR_INVALID_VALUE);
    assert_cu_ok(d->cuStreamDestroy(s));
    unmap_free(theirs, GRAN);
    unmap_free(own, GRAN);
    assert_cu_ok(d->cuMemRelease(imp));
    assert_cu_ok(d->cuMemRelease(h));
}

static void test_copy_inaccessible(void **state)
{
    static unsigned char buf[4096];
    CUmemGenericAllocationHandle h;
    CUdeviceptr r, blk;
    CUcontext ctx1;
    CUstream s;

    (void)state;
    fill(buf, sizeof buf, pattern_a);
    assert_cu_ok(create(&h, GRAN, POSIX));
    assert_cu_ok(d->cuMemAddressReserve(&r, 2 * GRAN, 0, 0, 0));
    assert_cu_ok(d->cuMemMap(r, GRAN, 0, h, 0));
    assert_cu_ok(d->cuStreamCreate(&s, 0));

    /* Mapped without access; access for another device only; read-only. */
    assert_cu(d->cuMemcpyHtoDAsync(r, buf, sizeof buf, s), CUDA_ERROR_INVALID_VALUE);
    assert_cu(d->cuMemcpyDtoHAsync(buf, r, sizeof buf, NULL), CUDA_ERROR_INVALID_VALUE);
    assert_cu_ok(grant(r, GRAN, 1, RW));
    assert_cu(d->cuMemcpyHtoDAsync(r, buf, sizeof buf, s), CUDA_ERROR_INVALID_VALUE);
    assert_cu_ok(d->cuDevicePrimaryCtxRetain(&ctx1, 1));
    assert_cu_ok(d->cuCtxPushCurrent(ctx1)); /* device 1 may read it */
    assert_cu_ok(d->cuMemcpyDtoHAsync(buf, r, 16, NULL));
    assert_cu_ok(d->cuCtxPopCurrent(NULL));
    assert_cu_ok(d->cuDevicePrimaryCtxRelease(1));
    assert_cu_ok(grant(r, GRAN, 0, CU_MEM_ACCESS_FLAGS_PROT_READ));
    assert_cu(d->cuMemcpyHtoDAsync(r, buf, sizeof buf, s), CUDA_ERROR_INVALID_VALUE);
    assert_cu(d->cuMemsetD8Async(r, 1, 1, s), CUDA_ERROR_INVALID_VALUE);
    assert_cu(d->cuStreamWriteValue32(s, r, 1, 0), CUDA_ERROR_INVALID_VALUE);
    assert_cu_ok(d->cuMemcpyDtoHAsync(buf, r, sizeof buf, s));
    assert_cu_ok(d->cuStreamSynchronize(s));
    assert_int_equal(buf[0], 0); /* nothing was written before */
    fill(buf, sizeof buf, pattern_a);
    assert_cu_ok(grant(r, GRAN, 0, RW));

    /* Into the reservation's unmapped half, past it, at random addresses. */
    assert_cu(d->cuMemcpyHtoDAsync(r + GRAN - 16, buf, 32, s), CUDA_ERROR_INVALID_VALUE);
    assert_cu(d->cuMemcpyHtoDAsync(r + GRAN, buf, 16, s), CUDA_ERROR_INVALID_VALUE);
    assert_cu(d->cuMemcpyHtoDAsync(0x1000, buf, 16, s), CUDA_ERROR_INVALID_VALUE);
    assert_cu(d->cuMemcpyHtoDAsync(0xdeadbeef000ULL, buf, 16, s), CUDA_ERROR_INVALID_VALUE);
    assert_cu(d->cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)buf, buf, 16, s),
              CUDA_ERROR_INVALID_VALUE);
    assert_cu(d->cuMemcpyDtoDAsync(r, ~(CUdeviceptr)0 - 8, 16, s), CUDA_ERROR_INVALID_VALUE);
    assert_cu(d->cuMemcpyHtoDAsync(r, NULL, 16, s), CUDA_ERROR_INVALID_VALUE);
    assert_cu_ok(d->cuMemAlloc(&blk, 100));
    assert_cu(d->cuMemcpyHtoDAsync(blk, buf, 101, s), CUDA_ERROR_INVALID_VALUE);
    assert_cu(d->cuMemcpyDtoDAsync(r, blk + 50, 51, s), CUDA_ERROR_INVALID_VALUE);
    assert_cu_ok(d->cuMemcpyDtoDAsync(r, blk, 100, s));
    assert_cu(d->cuMemFree(blk + 1), CUDA_ERROR_INVALID_VALUE);
    assert_cu_ok(d->cuStreamSynchronize(s));
    assert_cu_ok(d->cuMemFree(blk));
    assert_cu(d->cuMemFree(blk), CUDA_ERROR_INVALID_VALUE);

    assert_cu_ok(d->cuStreamDestroy(s));
    assert_cu_ok(d->cuMemUnmap(r, GRAN));
    assert_cu_ok(d->cuMemAddressFree(r, 2 * GRAN));
    assert_cu_ok(d->cuMemRelease(h));
}

/* Unmapping under queued work is a fault on the device; here it fails the stream. */
static void test_unmap_under_pending_copy(void **state)
{
    static unsigned char buf[4096];
    CUmemGenericAllocationHandle h;
    CUdeviceptr gate = new_word(), p;
    CUstream s, c;

    (void)state;
    assert_cu_ok(create(&h, GRAN, POSIX));
    p = map_rw(h, GRAN);
    assert_cu_ok(d->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    assert_cu_ok(d->cuStreamCreate(&c, CU_STREAM_NON_BLOCKING));
    assert_cu_ok(d->cuStreamWaitValue32(s, gate, 1, CU_STREAM_WAIT_VALUE_GEQ));
    assert_cu_ok(d->cuMemcpyHtoDAsync(p, buf, sizeof buf, s));
    unmap_free(p, GRAN);
    assert_cu_ok(d->cuStreamWriteValue32(c, gate, 1, 0));
    assert_cu(d->cuStreamSynchronize(s), CUDA_ERROR_ILLEGAL_ADDRESS);
    assert_cu_ok(d->cuStreamSynchronize(c));
    assert_cu_ok(d->cuStreamDestroy(s));
    assert_cu_ok(d->cuStreamDestroy(c));
    assert_cu_ok(d->cuMemRelease(h));
    assert_cu_ok(d->cuMemFree(gate));
}

static void test_total_mem(void **state)
{
    CUmemGenericAllocationHandle a, b, c;
    CUdeviceptr p;

    (void)state;
    configure("VMMT_EMU_TOTAL_MEM", "4194304");
    assert_cu_ok(create(&a, GRAN, POSIX));
    assert_cu_ok(create(&b, GRAN, POSIX));
    assert_cu(create(&c, GRAN, POSIX), CUDA_ERROR_OUT_OF_MEMORY);
    assert_cu(d->cuMemAlloc(&p, 1), CUDA_ERROR_OUT_OF_MEMORY);
    assert_cu_ok(d->cuMemRelease(b));
    assert_cu_ok(d->cuMemAlloc(&p, 4096));
    assert_cu(create(&c, GRAN, POSIX), CUDA_ERROR_OUT_OF_MEMORY);
    assert_cu_ok(d->cuMemFree(p));
    assert_cu_ok(create(&c, GRAN, POSIX));
    assert_cu_ok(d->cuMemRelease(c));
    assert_cu_ok(d->cuMemRelease(a));
}

static void test_host_memory(void **state)
{
    CUdeviceptr dev;
    unsigned char *host;
    CUstream s;

    (void)state;
    assert_cu_ok(d->cuMemAllocHost((void **)&host, 10000));
    assert_cu_ok(d->cuMemAlloc(&dev, 10000));
    assert_cu_ok(d->cuStreamCreate(&s, 0));
    assert_cu_ok(d->cuMemsetD8Async((CUdeviceptr)(uintptr_t)host, 0x11, 10000, s));
    assert_cu_ok(d->cuMemcpyDtoDAsync(dev, (CUdeviceptr)(uintptr_t)host, 10000, s));
    assert_cu_ok(d->cuMemsetD8Async(dev + 5000, 0x22, 5000, s));
    assert_cu_ok(d->cuMemcpyDtoHAsync(host, dev, 10000, s));
    assert_cu_ok(d->cuStreamSynchronize(s));
    assert_int_equal(host[4999], 0x11);
    assert_int_equal(host[5000], 0x22);
    assert_cu_ok(d->cuMemsetD8Async(dev, 0, 0, s)); /* empty: nothing to check */
    assert_cu_ok(d->cuStreamDestroy(s));
    assert_cu(d->cuMemFreeHost((void *)(uintptr_t)dev), CUDA_ERROR_INVALID_VALUE);
    assert_cu(d->cuMemFree((CUdeviceptr)(uintptr_t)host), CUDA_ERROR_INVALID_VALUE);
    assert_cu_ok(d->cuMemFreeHost(host));
    assert_cu_ok(d->cuMemFree(dev));
}

int main(void)
{
    const char *drv = getenv("VMMT_TEST_DRIVER");
    const struct CMUnitTest tests[] = {
#define T(fn) cmocka_unit_test_setup_teardown(fn, setup, teardown)
        cmocka_unit_test(test_init_required),
        T(test_devices),
        T(test_contexts),
        T(test_granularity_from_env),
        T(test_create_size_not_multiple),
        T(test_handle_types),
        T(test_posix_same_process),
        T(test_fabric_child),
        T(test_cross_process_wait),
        T(test_map_errors),
        T(test_release_mapped_keeps_memory),
        T(test_fault_injection),
        T(test_stream_ordering),
        T(test_events),
        T(test_wait_timeout),
        T(test_wait_imported),
        T(test_copy_inaccessible),
        T(test_unmap_under_pending_copy),
        T(test_total_mem),
        T(test_host_memory),
#undef T
    };

    /* These tests are about the emulator itself; on a GPU run there is nothing to do. */
    if (drv != NULL && *drv != '\0' && strcmp(drv, "emu") != 0) {
        printf("test_emu: skipped (VMMT_TEST_DRIVER=%s)\n", drv);
        return 0;
    }
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
