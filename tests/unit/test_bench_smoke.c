/*
 * vmmt bench --quick on the emulated driver, as CI runs it: every scenario
 * runs to the end (S8 says it needs the real driver), the table is printed
 * and the JSON file names every scenario. Timings are never checked.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"

#define OUT_CAP  (256 * 1024)
#define JSON_CAP (4 * 1024 * 1024)

static char g_out[OUT_CAP];

static int run_tool(const char *const args[], char *out)
{
    return tu_run_tool(NULL, args, out, OUT_CAP);
}

static char *read_file(const char *path)
{
    FILE *f = fopen(path, "r");
    char *buf = malloc(JSON_CAP);
    size_t n;

    assert_non_null(f);
    assert_non_null(buf);
    n = fread(buf, 1, JSON_CAP - 1, f);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

#define assert_contains(hay, needle)                                                               \
    do {                                                                                           \
        if (strstr((hay), (needle)) == NULL) fail_msg("lacks \"%s\":\n%.4000s", (needle), (hay));  \
    } while (0)

/* The JSON object of the first result row of scenario id, up to its closing brace. */
static void row_of(const char *json, const char *id, char *row, size_t cap)
{
    char key[32];
    const char *at, *end;

    snprintf(key, sizeof key, "{\"id\": \"%s\"", id);
    at = strstr(json, key);
    if (at == NULL) fail_msg("the JSON file has no result for %s", id);
    end = strchr(at, '}');
    assert_non_null(end);
    snprintf(row, cap, "%.*s", (int)(end - at + 1), at);
}

static void test_bench_quick_emu(void **state)
{
    char path[] = "/tmp/vmmt-bench-smoke-XXXXXX", row[1024], id[8];
    const char *args[] = {"bench", "--driver", "emu", "--quick", "--json", path, NULL};
    char *json;
    int fd;

    (void)state;
    fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    if (run_tool(args, g_out) != 0) fail_msg("vmmt bench exited non-zero:\n%s", g_out);
    assert_contains(g_out, "floor p50");
    assert_contains(g_out, "skipped: needs the real driver");
    /* Two emulated devices: every peer on the other one, and S3 once more on the producer's. */
    assert_contains(g_out, "peer processes on GPU 1,1,1,1");
    assert_contains(g_out, "peer on GPU 1; floor = socket ping-pong");
    assert_contains(g_out, "consume copy GPU 0->1");
    assert_contains(g_out, "S3  end to end, same GPU 4 KiB");
    assert_contains(g_out, "consumers on GPU 1,1,1,1");
    assert_contains(g_out, "broker fetch alone");
    /* S10 and S11: the same-GPU floor, host pools, elastic pools, writing in place. */
    assert_contains(g_out, "S10 two-process floor, same GPU 4 KiB");
    assert_contains(g_out, "S10 host pool e2e, same GPU 4 MiB");
    assert_contains(g_out, "S10 device memory held by a host pool");
    assert_contains(g_out, "S11 publish that grows the pool 1 MiB");
    assert_contains(g_out, "S11 device memory held by an idle elastic pool");
    assert_contains(g_out, "S11 in-place publish 1 MiB");
    json = read_file(path);
    unlink(path);
    assert_contains(json, "\"driver\": \"emu\"");
    assert_contains(json, "\"device\": \"vmmt emulated device 0\"");
    assert_contains(json, "\"series\": [");
    for (int i = 1; i <= 11; i++) {
        snprintf(id, sizeof id, "S%d", i);
        row_of(json, id, row, sizeof row);
        assert_contains(row, "\"failed\": false");
        assert_contains(row, i == 8 ? "\"skipped\": true" : "\"skipped\": false");
    }
    free(json);
}

/*
 * Peers on the producer's GPU: every row's floor is measured by two (or
 * more) processes without vmmt, alternating with the row's own samples,
 * never summed from parts one process timed. Before the fix, S3's same-GPU
 * floor was measured after one-process parts that absorbed a context switch
 * (172 us against S10's 329 us on one H200), and S5's floor counted the
 * copies at one-process rates.
 */
static void test_bench_same_gpu_floors(void **state)
{
    const char *args[] = {"bench", "--driver", "emu",   "--quick", "--peer-device",
                          "0",     "--only",   "S3,S5", NULL};
    (void)state;
    if (run_tool(args, g_out) != 0) fail_msg("vmmt bench exited non-zero:\n%s", g_out);
    assert_contains(g_out, "peer processes on GPU 0,0,0,0");
    assert_contains(g_out, "S3  end to end, 2 processes 4 KiB");
    assert_contains(g_out, "floor = the two-process floor (producer DtoD+sync, then the peer's");
    assert_contains(g_out, "alternating with the round trips");
    assert_contains(g_out, "consumers on GPU 0,0,0,0, the producer's; floor = the same pipeline");
    if (strstr(g_out, "one-process parts") != NULL || strstr(g_out, "socket ping-pong p50") != NULL)
        fail_msg("a same-GPU floor is made of one-process parts:\n%s", g_out);
    if (strstr(g_out, "to the consumers' GPUs at") != NULL)
        fail_msg("S5's same-GPU floor counts copies at one-process rates:\n%s", g_out);
}

static void test_bench_bad_option(void **state)
{
    const char *args[] = {"bench", "--only", "S12", NULL};
    (void)state;
    assert_int_equal(run_tool(args, g_out), 2);
    assert_contains(g_out, "--only S12: expected scenarios S1 to S11");
}

static void test_bench_peer_device_missing(void **state)
{
    const char *args[] = {"bench", "--driver", "emu", "--quick", "--peer-device", "2", NULL};
    (void)state;
    assert_int_equal(run_tool(args, g_out), 2);
    assert_contains(g_out, "--peer-device 2: the emu driver reports 2 device(s)");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bench_quick_emu),
        cmocka_unit_test(test_bench_same_gpu_floors),
        cmocka_unit_test(test_bench_bad_option),
        cmocka_unit_test(test_bench_peer_device_missing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
