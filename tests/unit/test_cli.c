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
    assert_contains(g_out, "--driver opencl: expected cuda, emu, auto, or the path of a driver "
                           "library");
}

/* The demo's child, started by hand with words for numbers, says so instead of atoi's 0. */
static void test_demo_consumer_bad_args(void **state)
{
    const char *args[] = {"demo-consumer", "zero", "1", "--driver", "emu", NULL};
    const char *args2[] = {"demo-consumer", "0", "1x", "--driver", "emu", NULL};
    (void)state;
    assert_int_equal(run_tool(NULL, args, g_out), 2);
    assert_contains(g_out, "expected DEVICE RANK (numbers from 0), got \"zero\" \"1\"");
    assert_int_equal(run_tool(NULL, args2, g_out), 2);
    assert_contains(g_out, "started by vmmt demo, not by hand");
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

/*
 * One rule without a GPU for every subcommand (issue 17): the default driver
 * stops with exit 2, naming --driver emu and --driver auto; --driver auto
 * falls back to the emulator, saying so first. Before, demo and group-test
 * fell back on their own while probe and bench stopped.
 */
static void test_no_gpu_rule(void **state)
{
    const char *env[] = {"VMMT_LIBCUDA=/nonexistent/libcuda.so.1", NULL};
    const char *plain[][8] = {
        {"probe", NULL},
        {"demo", "--count", "2", "--size", "64K", NULL},
        {"bench", "--quick", "--only", "S1", NULL},
        {"group-test", "--ranks", "2", "--buffers", "1", "--size", "64K", NULL},
    };
    (void)state;
    for (size_t i = 0; i < sizeof plain / sizeof plain[0]; i++) {
        const char *autoargs[12];
        char prefix[64];
        size_t n = 0;
        snprintf(prefix, sizeof prefix, "vmmt %s: no NVIDIA driver", plain[i][0]);
        assert_int_equal(run_tool(env, plain[i], g_out), 2);
        if (strncmp(g_out, prefix, strlen(prefix)) != 0)
            fail_msg("%s without a GPU does not start with \"%s\":\n%s", plain[i][0], prefix,
                     g_out);
        assert_contains(g_out, "to run without a GPU: --driver emu");
        assert_contains(g_out, "--driver auto");
        for (; plain[i][n] != NULL; n++)
            autoargs[n] = plain[i][n];
        autoargs[n++] = "--driver";
        autoargs[n++] = "auto";
        autoargs[n] = NULL;
        if (run_tool(env, autoargs, g_out) != 0)
            fail_msg("%s --driver auto without a GPU failed:\n%s", plain[i][0], g_out);
        snprintf(prefix, sizeof prefix, "vmmt %s: no GPU here (no NVIDIA driver", plain[i][0]);
        if (strncmp(g_out, prefix, strlen(prefix)) != 0)
            fail_msg("%s --driver auto does not say first that there is no GPU:\n%s", plain[i][0],
                     g_out);
        assert_contains(g_out, "--driver auto: running on the emulated driver");
    }
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

/* The demo says which pool it makes and why, before making it (issue 17). */
static void test_demo_says_its_pool(void **state)
{
    const char *def[] = {"demo", "--driver", "emu", "--count", "2", "--size", "16M", NULL};
    const char *small[] = {"demo", "--driver", "emu", "--count", "2", "--size", "64K", NULL};
    const char *pool[] = {"demo",   "--driver", "emu",    "--count", "2",
                          "--size", "1M",       "--pool", "8M",      NULL};
    (void)state;
    assert_int_equal(run_tool(NULL, def, g_out), 0);
    assert_contains(g_out, "a device pool of 128 MiB for 2 consumer(s): room for 8 buffers of "
                           "16 MiB (--size) in flight; --pool sets another size");
    assert_contains(g_out, "pool: device memory for device 0, 128.0 MiB");
    assert_int_equal(run_tool(NULL, small, g_out), 0);
    assert_contains(g_out, "a device pool of 64 MiB for 2 consumer(s): room for 8 buffers of "
                           "64 KiB (--size) in flight, raised to the 64 MiB minimum");
    assert_int_equal(run_tool(NULL, pool, g_out), 0);
    assert_contains(g_out, "a device pool of 8 MiB for 2 consumer(s): as --pool says");
    assert_contains(g_out, "pool: device memory for device 0, 8.0 MiB");
    assert_contains(g_out, "result: OK");
}

/*
 * A --size the device cannot hold is refused naming --size and what it
 * needs, before anything is allocated. Failed before: a bare
 * "cuMemAlloc(&o->src[p], o->size) -> CUDA_ERROR_OUT_OF_MEMORY".
 */
static void test_demo_size_too_large_for_device(void **state)
{
    const char *env[] = {"VMMT_EMU_TOTAL_MEM=268435456", NULL}; /* 256 MiB a device */
    const char *big[] = {"demo", "--driver", "emu", "--count", "1", "--size", "40M", NULL};
    const char *pool[] = {"demo",   "--driver", "emu",    "--count", "1",
                          "--size", "1M",       "--pool", "1G",      NULL};
    const char *elastic[] = {"demo",   "--driver", "emu",       "--count", "1",
                             "--size", "60M",      "--elastic", NULL};
    (void)state;
    assert_int_equal(run_tool(env, big, g_out), 2);
    assert_contains(g_out, "--size 40 MiB needs 520 MiB on device 0 (the 320 MiB pool; 4 source "
                           "and 1 consumer buffer(s) of --size), more than its 256 MiB; use a "
                           "smaller --size or --pool");
    assert_int_equal(run_tool(env, pool, g_out), 2);
    assert_contains(g_out, "(the 1 GiB pool; 4 source and 1 consumer buffer(s) of --size)");
    /* An elastic pool holds memory only while buffers are in flight: its sources count. */
    assert_int_equal(run_tool(env, elastic, g_out), 2);
    assert_contains(g_out, "--size 60 MiB needs 300 MiB on device 0 (4 source and 1 consumer "
                           "buffer(s) of --size)");
    assert_null(strstr(g_out, "CUDA_ERROR_OUT_OF_MEMORY"));
}

static void test_version(void **state)
{
    const char *args[] = {"version", NULL};
    char want[64];
    (void)state;
    snprintf(want, sizeof want, "vmmt %s\n", VMMT_VERSION_STRING);
    assert_int_equal(run_tool(NULL, args, g_out), 0);
    assert_string_equal(g_out, want);
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
        cmocka_unit_test(test_demo_consumer_bad_args),
        cmocka_unit_test(test_demo_emu),
        cmocka_unit_test(test_no_gpu_rule),
        cmocka_unit_test(test_demo_pool_pressure),
        cmocka_unit_test(test_demo_says_its_pool),
        cmocka_unit_test(test_demo_size_too_large_for_device),
        cmocka_unit_test(test_version),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
