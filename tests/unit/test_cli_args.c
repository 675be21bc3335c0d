/*
 * The tool's argument handling (issue 17): every option of every subcommand
 * is checked, and a mistake is refused (exit 2, nothing run) with a message
 * that names the option, the value and what is accepted; every subcommand's
 * --help and the tool's help list every option and the one rule for a
 * machine without a GPU.
 *
 * Failed before: `demo --count -1` ran 4294967295 buffers, `--rate abc` and
 * `--consumers x` were taken (as 0), every other mistake printed one line
 * naming no option, `probe --help` was an error, and the tool's help lacked
 * --host, --elastic and --rate.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

#define OUT_CAP (64 * 1024)

static char g_out[OUT_CAP];

#define assert_contains(hay, needle)                                                               \
    do {                                                                                           \
        if (strstr((hay), (needle)) == NULL)                                                       \
            fail_msg("output lacks \"%s\":\n%s", (needle), (hay));                                 \
    } while (0)

/* Every public option of each subcommand, as a user would look for it. */
static const char *const probe_opts[] = {"--device N", "--json", "--driver", NULL};
static const char *const demo_opts[] = {"--consumers N", "--size BYTES", "--count N",
                                        "--pool BYTES",  "--host",       "--elastic",
                                        "--rate HZ",     "--driver",     NULL};
static const char *const bench_opts[] = {"--driver", "--quick",  "--json PATH",     "--only",
                                         "--reps N", "--device", "--peer-device N", NULL};
static const char *const group_opts[] = {"--ranks N", "--buffers K",  "--chunks C", "--size BYTES",
                                         "--spread",  "--timeout MS", "--driver",   NULL};

static const struct {
    const char *cmd;
    const char *const *opts;
} g_cmds[] = {
    {"probe", probe_opts},
    {"demo", demo_opts},
    {"bench", bench_opts},
    {"group-test", group_opts},
};

static void test_help_of_every_subcommand(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof g_cmds / sizeof g_cmds[0]; i++) {
        const char *forms[][3] = {{g_cmds[i].cmd, "--help", NULL},
                                  {g_cmds[i].cmd, "-h", NULL},
                                  {"help", g_cmds[i].cmd, NULL}};
        for (size_t f = 0; f < 3; f++) {
            char usage[64];
            if (tu_run_tool(NULL, forms[f], g_out, OUT_CAP) != 0)
                fail_msg("vmmt %s %s exited non-zero:\n%s", forms[f][0], forms[f][1], g_out);
            snprintf(usage, sizeof usage, "usage: vmmt %s [", g_cmds[i].cmd);
            assert_contains(g_out, usage);
            for (size_t k = 0; g_cmds[i].opts[k] != NULL; k++)
                assert_contains(g_out, g_cmds[i].opts[k]);
            assert_contains(g_out, "Without a GPU: --driver cuda (the default");
            assert_contains(g_out, "--driver auto");
            /* The tool's own child-process options stay out of the help. */
            assert_null(strstr(g_out, "--rank R"));
            assert_null(strstr(g_out, "--job"));
        }
    }
}

static void test_top_help_lists_every_option(void **state)
{
    const char *args[] = {"--help", NULL};
    (void)state;
    assert_int_equal(tu_run_tool(NULL, args, g_out, OUT_CAP), 0);
    for (size_t i = 0; i < sizeof g_cmds / sizeof g_cmds[0]; i++) {
        char head[64];
        snprintf(head, sizeof head, "vmmt %s [", g_cmds[i].cmd);
        assert_contains(g_out, head);
        for (size_t k = 0; g_cmds[i].opts[k] != NULL; k++)
            assert_contains(g_out, g_cmds[i].opts[k]);
    }
    assert_contains(g_out, "vmmt version");
    assert_contains(g_out, "The same for probe, demo, bench and group-test.");
}

/* A mistake: the arguments after the subcommand, and the message it must print. */
struct mistake {
    const char *args[8];
    const char *message;
};

static const struct mistake g_mistakes[] = {
    {{"demo", "--count", "-1"},
     "vmmt demo: --count -1: expected a whole number from 1 to 100000000"},
    {{"demo", "--count", "0"}, "--count 0: expected a whole number from 1 to"},
    {{"demo", "--count", "4294967297"}, "--count 4294967297: expected a whole number"},
    {{"demo", "--count", "12abc"}, "--count 12abc: expected a whole number"},
    {{"demo", "--count", " 5"}, "--count  5: expected a whole number"},
    {{"demo", "--count"}, "vmmt demo: --count needs a value: a whole number from 1 to 100000000"},
    {{"demo", "--rate", "abc"}, "vmmt demo: --rate abc: expected a number from 0 to 1000000"},
    {{"demo", "--rate", "-5"}, "--rate -5: expected a number from 0 to 1000000"},
    {{"demo", "--rate", "nan"}, "--rate nan: expected a number"},
    {{"demo", "--rate", "inf"}, "--rate inf: expected a number"},
    {{"demo", "--rate", "1e9"}, "--rate 1e9: expected a number from 0 to 1000000"},
    {{"demo", "--consumers", "x"}, "--consumers x: expected a whole number from 1 to 64"},
    {{"demo", "--consumers", "65"}, "--consumers 65: expected a whole number from 1 to 64"},
    {{"demo", "--consumers", "0"}, "--consumers 0: expected a whole number from 1 to 64"},
    /* strtoull took "-1" as 2^64 - 1 and saturated past 2^64; "20000000000G" wrapped. */
    {{"demo", "--size", "-1"},
     "--size -1: expected a size from 1 byte to 1 TiB (bytes, or with K, "
     "M, G or T: 96K, 4M)"},
    {{"demo", "--size", "-4M"}, "--size -4M: expected a size from 1 byte to 1 TiB"},
    {{"demo", "--size", "99999999999999999999999"}, "--size 99999999999999999999999: expected"},
    {{"demo", "--size", "20000000000G"}, "--size 20000000000G: expected a size"},
    {{"demo", "--size", "18446744073709551615"}, "--size 18446744073709551615: expected"},
    {{"demo", "--size", "0"}, "--size 0: expected a size from 1 byte"},
    {{"demo", "--size", "4X"}, "--size 4X: expected a size"},
    {{"demo", "--size", "2T"}, "--size 2T: expected a size from 1 byte to 1 TiB"},
    {{"demo", "--pool", "abc"}, "--pool abc: expected a size from 1 byte to 8 TiB"},
    {{"demo", "--size", "8M", "--pool", "4M"},
     "vmmt demo: --pool 4 MiB cannot hold one buffer of "
     "--size 8 MiB"},
    {{"demo", "--host", "--elastic"}, "vmmt demo: --host and --elastic exclude each other"},
    {{"demo", "--host=1"}, "vmmt demo: --host takes no value (got '--host=1')"},
    {{"demo", "--count=x"}, "vmmt demo: --count x: expected a whole number"},
    {{"demo", "--driver", "opencl"},
     "vmmt demo: --driver opencl: expected cuda, emu, auto, or the "
     "path of a driver library"},
    {{"demo", "--driver", ""}, "vmmt demo: --driver '': expected cuda, emu, auto"},
    {{"demo", "--frobnicate"},
     "vmmt demo: unknown option '--frobnicate'; `vmmt demo --help` "
     "lists the options"},
    {{"demo", "extra"}, "vmmt demo: unexpected argument 'extra'"},
    {{"probe", "--device", "-1"}, "vmmt probe: --device -1: expected a whole number from 0 to"},
    {{"probe", "--device", "abc"}, "vmmt probe: --device abc: expected a whole number"},
    {{"probe", "--json=1"}, "vmmt probe: --json takes no value"},
    {{"bench", "--only", "S12"},
     "vmmt bench: --only S12: expected scenarios S1 to S11, separated "
     "by commas: S1,S3"},
    {{"bench", "--only", "S1,,x"}, "vmmt bench: --only S1,,x: expected scenarios"},
    {{"bench", "--reps", "0"}, "vmmt bench: --reps 0: expected a whole number from 1 to 1000000"},
    {{"bench", "--device", "x"}, "vmmt bench: --device x: expected a whole number"},
    {{"bench", "--peer-device", "-2"}, "vmmt bench: --peer-device -2: expected a whole number"},
    {{"bench", "--json"}, "vmmt bench: --json needs a value: a file name"},
    {{"group-test", "--ranks", "0"},
     "vmmt group-test: --ranks 0: expected a whole number from 1 "
     "to 64"},
    {{"group-test", "--buffers", "5000"}, "--buffers 5000: expected a whole number from 1 to 4096"},
    {{"group-test", "--chunks", "1"}, "--chunks 1: expected a whole number from 2 to 64"},
    {{"group-test", "--size", "1"}, "--size 1: expected a size from 2 bytes to 1 GiB"},
    {{"group-test", "--size", "-1"}, "--size -1: expected a size"},
    {{"group-test", "--timeout", "0"}, "--timeout 0: expected a whole number from 1 to 3600000"},
    {{"group-test", "--rank", "0"},
     "vmmt group-test: --rank 0 --job (none): the job's own rank "
     "processes pass both"},
};

/* Refused before anything runs: no driver is even loaded (VMMT_LIBCUDA names nothing). */
static void test_every_mistake_named(void **state)
{
    const char *env[] = {"VMMT_LIBCUDA=/nonexistent/libcuda.so.1", NULL};
    (void)state;
    for (size_t i = 0; i < sizeof g_mistakes / sizeof g_mistakes[0]; i++) {
        const struct mistake *m = &g_mistakes[i];
        int rc = tu_run_tool(env, m->args, g_out, OUT_CAP);
        if (rc != 2 || strstr(g_out, m->message) == NULL)
            fail_msg("vmmt %s %s %s %s: exit %d (want 2), want \"%s\" in:\n%s", m->args[0],
                     m->args[1] ? m->args[1] : "", m->args[2] ? m->args[2] : "",
                     m->args[3] ? m->args[3] : "", rc, m->message, g_out);
        if (strstr(g_out, "no NVIDIA driver") != NULL)
            fail_msg("vmmt %s %s: the driver was loaded before the arguments were checked:\n%s",
                     m->args[0], m->args[1], g_out);
    }
}

/* Values at the edges of each range are taken: --rate 0, --size with every suffix form. */
static void test_accepted_forms(void **state)
{
    const char *forms[][12] = {
        {"demo", "--driver", "emu", "--count", "1", "--size", "64KiB", "--rate", "0", NULL},
        {"demo", "--driver=emu", "--count=1", "--size=1MB", "--consumers=1", NULL},
        {"demo", "--driver", "emu", "--count", "2", "--size", "65536", "--rate", "1000000", NULL},
    };
    (void)state;
    for (size_t i = 0; i < sizeof forms / sizeof forms[0]; i++)
        if (tu_run_tool(NULL, forms[i], g_out, OUT_CAP) != 0)
            fail_msg("form %zu refused:\n%s", i, g_out);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_help_of_every_subcommand),
        cmocka_unit_test(test_top_help_lists_every_option),
        cmocka_unit_test(test_every_mistake_named),
        cmocka_unit_test(test_accepted_forms),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
