/*
 * The vmmt tool as a user runs it: exit codes and what it prints, on the
 * emulated driver and with no driver at all.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"

#define OUT_CAP (64 * 1024)

static int run_tool(const char *const env[], const char *const args[], char *out)
{
    return tu_run_tool(env, args, out, OUT_CAP);
}

#define assert_contains(hay, needle)                                                               \
    do {                                                                                           \
        if (strstr((hay), (needle)) == NULL)                                                       \
            fail_msg("output lacks \"%s\":\n%s", (needle), (hay));                                 \
    } while (0)

static char g_out[OUT_CAP];

static void test_probe_emu_default(void **state)
{
    const char *env[] = {"VMMT_DRIVER=emu", NULL};
    const char *args[] = {"probe", "--json", NULL};
    (void)state;
    assert_int_equal(run_tool(env, args, g_out), 0);
    assert_contains(g_out, "\"driver\": \"emu\"");
    assert_contains(g_out, "\"selected\": \"posix_fd\"");
    assert_contains(g_out, "\"type\": \"fabric\", \"attribute\": 1");
    assert_contains(g_out, "\"create_result\": 800");
    assert_contains(g_out, "CUDA_ERROR_NOT_PERMITTED (no IMEX channel");
}

static void test_probe_emu_fabric(void **state)
{
    const char *env[] = {"VMMT_EMU_HANDLES=fabric,posix_fd", NULL};
    const char *args[] = {"probe", "--json", "--driver", "emu", NULL};
    (void)state;
    assert_int_equal(run_tool(env, args, g_out), 0);
    assert_contains(g_out, "\"selected\": \"fabric\"");
}

static void test_probe_emu_none(void **state)
{
    const char *env[] = {"VMMT_DRIVER=emu", "VMMT_EMU_HANDLES=none", NULL};
    const char *args[] = {"probe", NULL};
    (void)state;
    assert_int_equal(run_tool(env, args, g_out), 3);
    assert_contains(g_out, "no supported CUDA VMM allocation handle type");
    assert_contains(g_out, "FABRIC: cuMemCreate -> CUDA_ERROR_NOT_PERMITTED");
    assert_contains(g_out, "POSIX_FD: cuMemCreate -> CUDA_ERROR_NOT_SUPPORTED");
    assert_contains(g_out, "NONE: allocations work but cannot be shared");
}

static void test_probe_no_driver(void **state)
{
    const char *env[] = {"VMMT_LIBCUDA=/nonexistent/libcuda.so.1", NULL};
    const char *args[] = {"probe", NULL};
    (void)state;
    assert_int_equal(run_tool(env, args, g_out), 2);
    assert_true(strncmp(g_out,
                        "vmmt probe: no NVIDIA driver: /nonexistent/libcuda.so.1 could "
                        "not be loaded",
                        60) == 0);
}

/* The emulator is a driver library like libcuda: chosen by name or by path. */
static void test_driver_library_choice(void **state)
{
    static char by_path[4200], not_driver[4200];
    const char *env[] = {by_path, NULL};
    const char *env_bad[] = {not_driver, NULL};
    const char *env_nofile[] = {"VMMT_DRIVER=/nonexistent/libdriver.so", NULL};
    const char *env_missing[] = {"VMMT_DRIVER=emu", "VMMT_EMU_LIBRARY=/nonexistent/libvmmt_emu.so",
                                 NULL};
    const char *args[] = {"probe", "--json", NULL};
    char dir[4096], *slash;
    (void)state;
    snprintf(by_path, sizeof by_path, "VMMT_DRIVER=%s", VMMT_TEST_EMU_LIBRARY);
    assert_int_equal(run_tool(env, args, g_out), 0);
    assert_contains(g_out, "\"driver\": \"emu\"");
    /* A library without cuGetProcAddress is refused, in words. */
    snprintf(dir, sizeof dir, "%s", VMMT_TEST_EMU_LIBRARY);
    slash = strrchr(dir, '/');
    assert_non_null(slash);
    *slash = '\0';
    snprintf(not_driver, sizeof not_driver, "VMMT_DRIVER=%s/libvmmt.so", dir);
    assert_int_equal(run_tool(env_bad, args, g_out), 2);
    assert_contains(g_out, "has no cuGetProcAddress");
    assert_int_equal(run_tool(env_nofile, args, g_out), 2);
    assert_contains(g_out, "driver library could not be loaded: /nonexistent/libdriver.so (");
    /* An explicit emulator path that is wrong is an error, not a silent search elsewhere. */
    assert_int_equal(run_tool(env_missing, args, g_out), 2);
    assert_contains(g_out, "emulated driver not found: VMMT_EMU_LIBRARY names "
                           "/nonexistent/libvmmt_emu.so");
}

static void test_probe_bad_args(void **state)
{
    const char *args[] = {"probe", "--frobnicate", NULL};
    const char *args2[] = {"probe", "--driver", "opencl", NULL};
    (void)state;
    assert_int_equal(run_tool(NULL, args, g_out), 2);
    assert_contains(g_out, "unknown option '--frobnicate'");
    assert_int_equal(run_tool(NULL, args2, g_out), 2);
    assert_contains(g_out, "unknown driver 'opencl'");
}

static void test_demo_emu(void **state)
{
    const char *args[] = {"demo",    "--driver", "emu",    "--consumers", "3",
                          "--count", "40",       "--size", "96K",         NULL};
    (void)state;
    assert_int_equal(run_tool(NULL, args, g_out), 0);
    assert_contains(g_out, "verified: 120 of 120 byte for byte, 0 failed");
    assert_contains(g_out, "40 recycled, 0 in flight");
    assert_contains(g_out, "result: OK");
}

static void test_demo_falls_back_without_gpu(void **state)
{
    const char *env[] = {"VMMT_LIBCUDA=/nonexistent/libcuda.so.1", NULL};
    const char *args[] = {"demo", "--count", "8", "--size", "1M", NULL};
    (void)state;
    assert_int_equal(run_tool(env, args, g_out), 0);
    assert_true(strncmp(g_out, "vmmt demo: no GPU here (no NVIDIA driver", 40) == 0);
    assert_contains(g_out, "running on the emulated driver");
    assert_contains(g_out, "result: OK");
}

static void test_demo_pool_pressure(void **state)
{
    /* 64 MiB pool, 8 MiB buffers, 3 consumers: publishes must wait for recycling. */
    const char *args[] = {"demo",    "--driver", "emu",    "--consumers", "3",
                          "--count", "30",       "--size", "8M",          NULL};
    (void)state;
    assert_int_equal(run_tool(NULL, args, g_out), 0);
    assert_contains(g_out, "result: OK");
}

/*
 * Attack finding: --size went through strtoull unchecked, so "-1" and a
 * number past 2^64 became 18446744073709551615 bytes, and the pool size
 * (eight buffers) wrapped; "20000000000G" wrapped too. All are bad arguments.
 */
static void test_demo_size_out_of_range(void **state)
{
    const char *sizes[] = {"-1", "-4M", "99999999999999999999999", "20000000000G",
                           "18446744073709551615"};
    (void)state;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        const char *args[] = {"demo", "--driver", "emu", "--count", "1", "--size", sizes[i], NULL};
        assert_int_equal(run_tool(NULL, args, g_out), 2);
        assert_contains(g_out, "bad arguments");
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_probe_emu_default),
        cmocka_unit_test(test_probe_emu_fabric),
        cmocka_unit_test(test_probe_emu_none),
        cmocka_unit_test(test_probe_no_driver),
        cmocka_unit_test(test_driver_library_choice),
        cmocka_unit_test(test_probe_bad_args),
        cmocka_unit_test(test_demo_emu),
        cmocka_unit_test(test_demo_falls_back_without_gpu),
        cmocka_unit_test(test_demo_pool_pressure),
        cmocka_unit_test(test_demo_size_out_of_range),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
