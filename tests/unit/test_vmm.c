/*
 * VMM primitives: sizing, the handle-type probe, mappings with rollback, and
 * import in a second process. Runs on the emulator by default and on the
 * real driver with VMMT_TEST_DRIVER=cuda (tests/gpu/run); cases that need the
 * emulator's settings or fault injection skip there.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "driver.h"
#include "emu.h"
#include "status.h"
#include "testutil.h"
#include "vmm.h"

#define MiB (1024ull * 1024)

static int on_emu(void)
{
    return strcmp(vmmt_driver_name(), "emu") == 0;
}

/* Put the emulator in a known configuration: env settings, then re-read. */
static void emu_env(const char *handles, const char *fail)
{
    if (handles)
        setenv("VMMT_EMU_HANDLES", handles, 1);
    else
        unsetenv("VMMT_EMU_HANDLES");
    if (fail)
        setenv("VMMT_EMU_FAIL", fail, 1);
    else
        unsetenv("VMMT_EMU_FAIL");
    unsetenv("VMMT_HANDLE_TYPE");
    vmmt__emu_configure();
    vmmt_probe_reset();
}

static int setup(void **state)
{
    (void)state;
    if (on_emu()) emu_env(NULL, NULL);
    vmmt_probe_reset();
    return 0;
}

static size_t granularity(void)
{
    size_t gmin = 0, grec = 0;
    assert_vmmt_ok(vmmt__granularity(0, VMMT_HANDLE_POSIX_FD, &gmin, &grec));
    return gmin;
}

/* -------------------------------------------------------------- sizing */

static void test_align(void **state)
{
    uint64_t v;
    (void)state;
    assert_vmmt_ok(vmmt__align_up(1, 4096, &v));
    assert_int_equal(v, 4096);
    assert_vmmt_ok(vmmt__align_up(8192, 4096, &v));
    assert_int_equal(v, 8192);
    assert_int_equal(vmmt__align_up(UINT64_MAX - 5, 4096, &v), VMMT_EINVAL);
    assert_error_contains("overflow");
    assert_int_equal(vmmt__align_up(10, 3, &v), VMMT_EINVAL);
    assert_int_equal(vmmt__align_down(8191, 4096), 4096);
}

static void test_size_policy(void **state)
{
    const uint64_t g = 2 * MiB;
    uint64_t out = 0;
    (void)state;

    assert_int_equal(vmmt__size_policy(4096, g, 0, &out), VMMT_EINVAL);
    assert_string_equal(vmmt_last_error(),
                        "memory_size=4096 is smaller than CUDA VMM granularity=2097152; use at "
                        "least 2097152 bytes (2 MiB) or enable round-up");
    assert_vmmt_ok(vmmt__size_policy(4096, g, 1, &out));
    assert_int_equal(out, g);
    assert_vmmt_ok(vmmt__size_policy(5 * MiB, g, 0, &out));
    assert_int_equal(out, 4 * MiB);
    assert_vmmt_ok(vmmt__size_policy(6 * MiB, g, 0, &out));
    assert_int_equal(out, 6 * MiB);
    assert_int_equal(vmmt__size_policy(0, g, 1, &out), VMMT_EINVAL);
    assert_string_equal(vmmt_last_error(), "memory_size must be positive");
}

static void test_granularity_from_driver(void **state)
{
    size_t gmin = 0, grec = 0;
    (void)state;
    assert_vmmt_ok(vmmt__granularity(0, VMMT_HANDLE_POSIX_FD, &gmin, &grec));
    assert_true(gmin >= 4096 && (gmin & (gmin - 1)) == 0);
    assert_true(grec >= gmin);
    if (!on_emu()) return;
    setenv("VMMT_EMU_GRANULARITY", "65536", 1);
    vmmt__emu_configure();
    assert_vmmt_ok(vmmt__granularity(0, VMMT_HANDLE_POSIX_FD, &gmin, &grec));
    assert_int_equal(gmin, 65536);
    unsetenv("VMMT_EMU_GRANULARITY");
    vmmt__emu_configure();
}

/* --------------------------------------------------------------- probe */

static void test_probe_default(void **state)
{
    vmmt_device_probe p;
    (void)state;
    if (!on_emu()) {
        int st = vmmt_probe_device(0, &p);
        assert_true(st == VMMT_OK || st == VMMT_ENOTSUP);
        print_message("real driver selects %s: %s\n", vmmt_handle_type_name(p.selected), p.reason);
        return;
    }
    assert_vmmt_ok(vmmt_probe_device(0, &p));
    assert_int_equal(p.selected, VMMT_HANDLE_POSIX_FD);
    assert_int_equal(p.candidates[0].type, VMMT_HANDLE_FABRIC);
    assert_int_equal(p.candidates[0].attribute, 1);
    assert_int_equal(p.candidates[0].create_result, CUDA_ERROR_NOT_PERMITTED);
    assert_non_null(strstr(p.candidates[0].cause, "CUDA_ERROR_NOT_PERMITTED"));
    assert_non_null(strstr(p.candidates[0].cause, "no IMEX channel"));
    assert_int_equal(p.candidates[1].type, VMMT_HANDLE_POSIX_FD);
    assert_true(p.candidates[1].works);
    assert_int_equal(p.candidates[1].export_result, 0);
    assert_int_equal(p.candidates[2].type, VMMT_HANDLE_NONE);
    assert_true(p.candidates[2].works);
}

static void test_probe_prefers_fabric(void **state)
{
    vmmt_device_probe p;
    (void)state;
    if (!on_emu()) skip();
    emu_env("fabric,posix_fd", NULL);
    assert_vmmt_ok(vmmt_probe_device(0, &p));
    assert_int_equal(p.selected, VMMT_HANDLE_FABRIC);
    assert_true(p.candidates[0].works);
    emu_env(NULL, NULL);
}

static void test_probe_none_only(void **state)
{
    vmmt_device_probe p;
    vmmt_handle_type t;
    (void)state;
    if (!on_emu()) skip();
    emu_env("none", NULL);
    assert_int_equal(vmmt_probe_device(0, &p), VMMT_ENOTSUP);
    assert_error_contains("no supported CUDA VMM allocation handle type");
    assert_error_contains("FABRIC: cuMemCreate -> CUDA_ERROR_NOT_PERMITTED (no IMEX channel");
    assert_error_contains("POSIX_FD: cuMemCreate -> CUDA_ERROR_NOT_SUPPORTED");
    assert_error_contains("NONE: allocations work but cannot be shared");
    assert_int_equal(p.selected, VMMT_HANDLE_NONE);
    assert_int_equal(vmmt_select_handle_type(0, &t), VMMT_ENOTSUP);
    emu_env(NULL, NULL);
}

static void test_probe_cached(void **state)
{
    vmmt_device_probe p;
    (void)state;
    if (!on_emu()) skip();
    assert_vmmt_ok(vmmt_probe_device(0, &p));
    /* Every allocation would now fail: a cached probe must not allocate again. */
    setenv("VMMT_EMU_FAIL", "cuMemCreate:*:CUDA_ERROR_OUT_OF_MEMORY", 1);
    vmmt__emu_configure();
    assert_vmmt_ok(vmmt_probe_device(0, &p));
    assert_int_equal(p.selected, VMMT_HANDLE_POSIX_FD);
    vmmt_probe_reset();
    assert_int_equal(vmmt_probe_device(0, &p), VMMT_ENOTSUP);
    emu_env(NULL, NULL);
}

static void test_probe_override(void **state)
{
    vmmt_handle_type t;
    (void)state;
    if (!on_emu()) skip();
    setenv("VMMT_HANDLE_TYPE", "none", 1);
    assert_vmmt_ok(vmmt_select_handle_type(0, &t));
    assert_int_equal(t, VMMT_HANDLE_NONE);
    setenv("VMMT_HANDLE_TYPE", "fabric", 1);
    assert_int_equal(vmmt_select_handle_type(0, &t), VMMT_ENOTSUP);
    assert_error_contains("VMMT_HANDLE_TYPE=fabric, but FABRIC does not work on device 0");
    setenv("VMMT_HANDLE_TYPE", "bogus", 1);
    assert_int_equal(vmmt_select_handle_type(0, &t), VMMT_EINVAL);
    assert_error_contains("unknown handle type 'bogus'");
    setenv("VMMT_HANDLE_TYPE", "auto", 1);
    assert_vmmt_ok(vmmt_select_handle_type(0, &t));
    assert_int_equal(t, VMMT_HANDLE_POSIX_FD);
    unsetenv("VMMT_HANDLE_TYPE");
}

/* ------------------------------------------------------------ mappings */

static void fill(CUdeviceptr dst, size_t n, unsigned mul, unsigned add)
{
    unsigned char *buf = malloc(n);
    for (size_t i = 0; i < n; i++)
        buf[i] = (unsigned char)(i * mul + add);
    assert_vmmt_ok(vmmt__ctx_enter(0));
    assert_int_equal(vmmt__drv()->cuMemcpyHtoDAsync(dst, buf, n, NULL), CUDA_SUCCESS);
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(NULL), CUDA_SUCCESS);
    vmmt__ctx_leave();
    free(buf);
}

static int matches(CUdeviceptr src, size_t n, unsigned mul, unsigned add)
{
    unsigned char *buf = malloc(n);
    int ok;
    assert_vmmt_ok(vmmt__ctx_enter(0));
    ok = vmmt__drv()->cuMemcpyDtoHAsync(buf, src, n, NULL) == CUDA_SUCCESS &&
         vmmt__drv()->cuStreamSynchronize(NULL) == CUDA_SUCCESS;
    vmmt__ctx_leave();
    for (size_t i = 0; ok && i < n; i++)
        ok = buf[i] == (unsigned char)(i * mul + add);
    free(buf);
    return ok;
}

static void test_mapping_roundtrip(void **state)
{
    struct vmmt__mapping m, m2;
    tu_resources before;
    int fd;
    (void)state;

    tu_resources_take(&before);
    assert_vmmt_ok(vmmt__mapping_create(0, granularity(), VMMT_HANDLE_POSIX_FD, 0, &m));
    fill(m.base, 4096, 7, 1);
    assert_vmmt_ok(vmmt__export_posix_fd(m.handle, &fd));
    assert_vmmt_ok(vmmt__mapping_import_posix_fd(0, fd, m.size, &m2));
    close(fd);
    assert_true(m2.base != m.base);
    assert_true(matches(m2.base, 4096, 7, 1));
    assert_vmmt_ok(vmmt__mapping_release(&m2));
    assert_vmmt_ok(vmmt__mapping_release(&m));
    assert_vmmt_ok(vmmt__mapping_release(&m)); /* a second release does nothing */
    tu_resources_check(&before);
}

static void spawn_import(const char *kind, uint64_t size, const char *hex, int fd)
{
    char sz[32];
    char *argv[4] = {(char *)kind, sz, (char *)hex, NULL};
    pid_t pid;

    snprintf(sz, sizeof sz, "%llu", (unsigned long long)size);
    pid = tu_spawn("child_import", argv, fd);
    assert_true(pid > 0);
    assert_int_equal(tu_wait(pid, 30000), 0);
}

static void test_import_in_second_process(void **state)
{
    struct vmmt__mapping m;
    tu_resources before;
    int fd;
    (void)state;

    tu_resources_take(&before);
    assert_vmmt_ok(vmmt__mapping_create(0, granularity(), VMMT_HANDLE_POSIX_FD, 0, &m));
    fill(m.base, 4096, 7, 1);
    assert_vmmt_ok(vmmt__export_posix_fd(m.handle, &fd));
    spawn_import("posix_fd", m.size, NULL, fd);
    close(fd);
    assert_true(matches(m.base, 4096, 3, 5));
    assert_vmmt_ok(vmmt__mapping_release(&m));
    tu_resources_check(&before);
}

static void test_fabric_in_second_process(void **state)
{
    struct vmmt__mapping m;
    CUmemFabricHandle f;
    char hex[2 * sizeof f.data + 1];
    (void)state;

    if (!on_emu()) skip(); /* FABRIC needs an IMEX channel; the probe reports it */
    emu_env("fabric,posix_fd", NULL);
    assert_vmmt_ok(vmmt__mapping_create(0, granularity(), VMMT_HANDLE_FABRIC, 0, &m));
    fill(m.base, 4096, 7, 1);
    assert_vmmt_ok(vmmt__export_fabric(m.handle, &f));
    for (size_t i = 0; i < sizeof f.data; i++)
        sprintf(hex + 2 * i, "%02x", f.data[i]);
    spawn_import("fabric", m.size, hex, -1);
    assert_true(matches(m.base, 4096, 3, 5));
    assert_vmmt_ok(vmmt__mapping_release(&m));
    emu_env(NULL, NULL);
}

/* Fail the first call of `entry` inside create or import; nothing may remain. */
static void check_rollback(const char *entry, int import)
{
    struct vmmt__mapping src, m;
    tu_resources before;
    char spec[128];
    size_t g = granularity();
    int fd = -1, st;

    if (import) {
        assert_vmmt_ok(vmmt__mapping_create(0, granularity(), VMMT_HANDLE_POSIX_FD, 0, &src));
        assert_vmmt_ok(vmmt__export_posix_fd(src.handle, &fd));
    }
    tu_resources_take(&before);
    snprintf(spec, sizeof spec, "%s:1:CUDA_ERROR_OUT_OF_MEMORY", entry);
    setenv("VMMT_EMU_FAIL", spec, 1);
    vmmt__emu_configure();
    if (import)
        st = vmmt__mapping_import_posix_fd(0, fd, src.size, &m);
    else
        st = vmmt__mapping_create(0, g, VMMT_HANDLE_POSIX_FD, 0, &m);
    unsetenv("VMMT_EMU_FAIL");
    vmmt__emu_configure();
    assert_int_equal(st, VMMT_ENOMEM);
    assert_error_contains(entry);
    assert_error_contains("CUDA_ERROR_OUT_OF_MEMORY");
    assert_int_equal(vmmt_last_cuda_error(), CUDA_ERROR_OUT_OF_MEMORY);
    tu_resources_check(&before);
    if (import) {
        close(fd);
        assert_vmmt_ok(vmmt__mapping_release(&src));
    }
    assert_int_equal(vmmt__emu_live_allocations(), 0);
    assert_int_equal(vmmt__emu_live_reservations(), 0);
    assert_int_equal(vmmt__emu_live_mappings(), 0);
}

static void test_create_rollback(void **state)
{
    static const char *const entries[] = {"cuMemCreate", "cuMemAddressReserve", "cuMemMap",
                                          "cuMemSetAccess"};
    (void)state;
    if (!on_emu()) skip();
    for (size_t i = 0; i < sizeof entries / sizeof entries[0]; i++)
        check_rollback(entries[i], 0);
}

static void test_import_rollback(void **state)
{
    static const char *const entries[] = {"cuMemImportFromShareableHandle", "cuMemAddressReserve",
                                          "cuMemMap", "cuMemSetAccess"};
    (void)state;
    if (!on_emu()) skip();
    for (size_t i = 0; i < sizeof entries / sizeof entries[0]; i++)
        check_rollback(entries[i], 1);
}

static void test_release_retry(void **state)
{
    static const char *const entries[] = {"cuMemUnmap", "cuMemRelease", "cuMemAddressFree"};
    tu_resources before;
    (void)state;
    if (!on_emu()) skip();
    tu_resources_take(&before);
    for (size_t i = 0; i < sizeof entries / sizeof entries[0]; i++) {
        struct vmmt__mapping m;
        char spec[128];
        assert_vmmt_ok(vmmt__mapping_create(0, granularity(), VMMT_HANDLE_POSIX_FD, 0, &m));
        snprintf(spec, sizeof spec, "%s:1:CUDA_ERROR_UNKNOWN", entries[i]);
        setenv("VMMT_EMU_FAIL", spec, 1);
        vmmt__emu_configure();
        assert_int_equal(vmmt__mapping_release(&m), VMMT_ECUDA);
        assert_error_contains(entries[i]);
        assert_vmmt_ok(vmmt__mapping_release(&m)); /* the retry finishes the job */
        unsetenv("VMMT_EMU_FAIL");
        vmmt__emu_configure();
    }
    tu_resources_check(&before);
}

/*
 * A failed cuMemRelease (at shutdown, nothing retries) leaks only the
 * allocation: the reservation, already unmapped, is freed all the same.
 * (Failed before: the release stopped at the first failure, and the
 * reservation leaked too; fault sweep, shutdown.)
 */
static void test_release_goes_on(void **state)
{
    int res;
    struct vmmt__mapping m;
    (void)state;
    if (!on_emu()) skip();
    res = vmmt__emu_live_reservations();
    assert_vmmt_ok(vmmt__mapping_create(0, granularity(), VMMT_HANDLE_POSIX_FD, 0, &m));
    setenv("VMMT_EMU_FAIL", "cuMemRelease:1:CUDA_ERROR_UNKNOWN", 1);
    vmmt__emu_configure();
    assert_int_equal(vmmt__mapping_release(&m), VMMT_ECUDA);
    assert_error_contains("cuMemRelease");
    unsetenv("VMMT_EMU_FAIL");
    vmmt__emu_configure();
    assert_int_equal(vmmt__emu_live_reservations(), res);
    assert_vmmt_ok(vmmt__mapping_release(&m)); /* what is left: the allocation */
}

static void test_bad_device(void **state)
{
    struct vmmt__mapping m;
    (void)state;
    assert_int_equal(vmmt__mapping_create(63, granularity(), VMMT_HANDLE_POSIX_FD, 0, &m),
                     VMMT_ENODEV);
    assert_error_contains("device 63 does not exist");
}

/* The library works in the device's primary context and gives the caller's back. */
static void test_caller_context_restored(void **state)
{
    const struct vmmt_drv *d = vmmt__drv();
    struct vmmt__mapping m;
    vmmt_device_probe p;
    CUcontext mine, now = NULL;
    CUdevice dev;
    int count = 0;
    (void)state;

    assert_vmmt_ok(vmmt_device_count(&count));
    assert_int_equal(d->cuDeviceGet(&dev, count - 1), CUDA_SUCCESS);
    assert_int_equal(d->cuDevicePrimaryCtxRetain(&mine, dev), CUDA_SUCCESS);
    assert_int_equal(d->cuCtxPushCurrent(mine), CUDA_SUCCESS);
    assert_vmmt_ok(vmmt__mapping_create(0, granularity(), VMMT_HANDLE_POSIX_FD, 0, &m));
    assert_vmmt_ok(vmmt__mapping_release(&m));
    vmmt_probe_reset();
    vmmt_probe_device(0, &p);
    assert_int_equal(d->cuCtxGetCurrent(&now), CUDA_SUCCESS);
    assert_ptr_equal(now, mine);
    assert_int_equal(d->cuCtxPopCurrent(&now), CUDA_SUCCESS);
    assert_int_equal(d->cuDevicePrimaryCtxRelease(dev), CUDA_SUCCESS);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_align),
        cmocka_unit_test(test_size_policy),
        cmocka_unit_test_setup(test_granularity_from_driver, setup),
        cmocka_unit_test_setup(test_probe_default, setup),
        cmocka_unit_test_setup(test_probe_prefers_fabric, setup),
        cmocka_unit_test_setup(test_probe_none_only, setup),
        cmocka_unit_test_setup(test_probe_cached, setup),
        cmocka_unit_test_setup(test_probe_override, setup),
        cmocka_unit_test_setup(test_mapping_roundtrip, setup),
        cmocka_unit_test_setup(test_import_in_second_process, setup),
        cmocka_unit_test_setup(test_fabric_in_second_process, setup),
        cmocka_unit_test_setup(test_create_rollback, setup),
        cmocka_unit_test_setup(test_import_rollback, setup),
        cmocka_unit_test_setup(test_release_retry, setup),
        cmocka_unit_test_setup(test_release_goes_on, setup),
        cmocka_unit_test_setup(test_bad_device, setup),
        cmocka_unit_test_setup(test_caller_context_restored, setup),
    };
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
