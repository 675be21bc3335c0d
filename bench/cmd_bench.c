/*
 * vmmt bench: options, the shared device state, the helpers every scenario
 * uses (pool, copy floor, check of the copied bytes), dispatch, and output:
 * the table printed last and, with --json, a file with every sample.
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "cli.h"
#include "status.h"

typedef int (*bench_fn)(struct bench_env *e);

static const bench_fn g_scenarios[BENCH_SCENARIOS] = {
    bench_s1, bench_s2, bench_s3, bench_s4,  bench_s5,  bench_s6,
    bench_s7, bench_s8, bench_s9, bench_s10, bench_s11,
};

/* ---------------------------------------------------------------- options */

static int parse_only(const char *list, unsigned *out)
{
    char buf[128], *save = NULL;

    if (strlen(list) >= sizeof buf) return -1;
    snprintf(buf, sizeof buf, "%s", list);
    *out = 0;
    for (char *t = strtok_r(buf, ",", &save); t != NULL; t = strtok_r(NULL, ",", &save)) {
        char *end;
        long n;
        if (t[0] == 'S' || t[0] == 's') t++;
        if (*t < '0' || *t > '9') return -1;
        n = strtol(t, &end, 10);
        if (*end != '\0' || n < 1 || n > BENCH_SCENARIOS) return -1;
        *out |= 1u << (n - 1);
    }
    return *out ? 0 : -1;
}

static int check_only(const char *list)
{
    unsigned bits;
    return parse_only(list, &bits);
}

static const struct cli_opt bench_opts_table[] = {
    CLI_DRIVER_OPT(struct bench_opts),
    {"--quick", CLI_FLAG, NULL, 0, 0, offsetof(struct bench_opts, quick),
     "fewer repetitions and smaller sizes (CI's run)", NULL, NULL, 0},
    {"--json", CLI_TEXT, "PATH", 0, 0, offsetof(struct bench_opts, json),
     "also write every sample to PATH", NULL, "a file name", 0},
    {"--only", CLI_TEXT, "S1,S3", 0, 0, offsetof(struct bench_opts, only_arg),
     "run these scenarios only (default: every one)", check_only,
     "scenarios S1 to S11, separated by commas: S1,S3", 0},
    {"--reps", CLI_INT, "N", 1, 1000000, offsetof(struct bench_opts, reps),
     "repetitions of each small-size loop (default 200, --quick 20; large sizes a tenth)", NULL,
     NULL, 0},
    {"--device", CLI_INT, "N", 0, 4095, offsetof(struct bench_opts, device),
     "the producer's device (default 0)", NULL, NULL, 0},
    {"--peer-device", CLI_INT, "N", 0, 4095, offsetof(struct bench_opts, peer_device),
     "every peer process on device N (default: another device than the producer's, where "
     "there is one)",
     NULL, NULL, 0},
};

const struct cli_command cli_bench_command = {
    "bench",
    "benchmark scenarios S1-S11, each against its floor measured in the same run",
    "The benchmark scenarios S1-S11 of BENCHMARKS.md, each against its floor measured in the\n"
    "same run; nothing asserts on time.",
    bench_opts_table,
    sizeof bench_opts_table / sizeof bench_opts_table[0],
    "exit status: 0 when every scenario ran and met its target, 1 when one did not, 2 on error.\n",
};

static int parse(int argc, char **argv, struct bench_opts *o)
{
    int rc = cli_parse(&cli_bench_command, argc, argv, o);

    if (rc == CLI_OK && o->only_arg != NULL) parse_only(o->only_arg, &o->only);
    return rc;
}

/* ------------------------------------------------------ shared helpers */

int bench_reps(const struct bench_env *e, uint64_t bytes)
{
    int big = bytes >= 16 * BENCH_MIB;

    if (e->opt.reps > 0) return big ? (e->opt.reps / 10 > 3 ? e->opt.reps / 10 : 3) : e->opt.reps;
    if (e->opt.quick) return big ? 5 : 20;
    return big ? 20 : 200;
}

int bench_warmup(int reps)
{
    return reps / 10 > 3 ? reps / 10 : 3;
}

static void note_pool(struct bench_env *e, vmmt_pool *pool)
{
    vmmt_pool_stats s;

    if (e->rep->handoff[0] || vmmt_pool_get_stats(pool, &s) != VMMT_OK) return;
    snprintf(e->rep->handoff, sizeof e->rep->handoff, "%s", vmmt_handoff_name(s.handoff));
    snprintf(e->rep->handle_type, sizeof e->rep->handle_type, "%s",
             vmmt_handle_type_name(s.handle_type));
}

int bench_pool_create(struct bench_env *e, uint64_t memory, int consumers, uint32_t max_slices,
                      vmmt_pool **out)
{
    vmmt_pool_config c;
    int st;

    vmmt_pool_config_init(&c);
    c.device = e->device;
    c.memory_size = memory;
    c.consumer_count = consumers;
    c.max_slices = max_slices;
    c.round_up = 1;
    st = vmmt_pool_create(&c, out);
    if (st == VMMT_OK) note_pool(e, *out);
    return st;
}

/*
 * One sample of the copy floor: the driver's DtoD of the same size on the
 * same stream, synchronized. It writes tmp, never dst, so that a consume
 * that copied nothing cannot pass the check of dst.
 */
int bench_copy_sample(struct bench_env *e, CUstream s, uint64_t nbytes, double *us)
{
    const struct vmmt_drv *d = e->d;
    double t0 = bench_now_us();
    int st = VMMT_CU(d, cuMemcpyDtoDAsync(e->tmp, e->src, nbytes, s));

    if (st == VMMT_OK) st = VMMT_CU(d, cuStreamSynchronize(s));
    *us = bench_now_us() - t0;
    return st;
}

int bench_copy_floor(struct bench_env *e, CUstream s, uint64_t nbytes, int reps,
                     struct bench_series *out)
{
    int warm = bench_warmup(reps);
    double us;

    for (int i = 0; i < warm + reps; i++) {
        int st = bench_copy_sample(e, s, nbytes, &us);
        if (st != VMMT_OK) return st;
        if (i >= warm && bench_series_add(out, us) != 0) return VMMT_ENOMEM;
    }
    return VMMT_OK;
}

/* Zero dst before a scenario's copies so that bench_verify proves they happened. */
int bench_clear(struct bench_env *e, CUdeviceptr dst, uint64_t nbytes)
{
    int st = VMMT_CU(e->d, cuMemsetD8Async(dst, 0, nbytes, e->cs));
    return st == VMMT_OK ? VMMT_CU(e->d, cuStreamSynchronize(e->cs)) : st;
}

static int compare_at(const uint8_t *h, uint64_t from, uint64_t n)
{
    for (uint64_t j = 0; j < n; j++)
        if (h[j] != bench_byte(from + j))
            return vmmt__fail(VMMT_EPROTO, "copied bytes differ from the source at byte %llu",
                              (unsigned long long)(from + j));
    return VMMT_OK;
}

/* Outside every timed region: the head and tail of dst must hold the source's bytes. */
int bench_verify(struct bench_env *e, CUdeviceptr dst, uint64_t nbytes)
{
    const struct vmmt_drv *d = e->d;
    uint64_t n = nbytes < 4096 ? nbytes : 4096, tail = nbytes - n;
    uint8_t *h = NULL;
    int st;

    st = VMMT_CU(d, cuMemAllocHost((void **)&h, 2 * n));
    if (st != VMMT_OK) return st;
    st = VMMT_CU(d, cuMemcpyDtoHAsync(h, dst, n, e->cs));
    if (st == VMMT_OK) st = VMMT_CU(d, cuMemcpyDtoHAsync(h + n, dst + tail, n, e->cs));
    if (st == VMMT_OK) st = VMMT_CU(d, cuStreamSynchronize(e->cs));
    if (st == VMMT_OK) st = compare_at(h, 0, n);
    if (st == VMMT_OK) st = compare_at(h + n, tail, n);
    d->cuMemFreeHost(h);
    return st;
}

/*
 * Peer k's device. A serving engine's tensor-parallel workers each own a GPU,
 * and two processes with work on one GPU time-slice it (no MPS), so peers go
 * to the other devices in turn; they share the producer's only when it is
 * alone, or when --peer-device says so.
 */
int bench_peer_device(const struct bench_env *e, int k)
{
    if (e->opt.peer_device >= 0) return e->opt.peer_device;
    if (e->ndevices < 2) return e->device;
    return (e->device + 1 + k % (e->ndevices - 1)) % e->ndevices;
}

int bench_fail(struct bench_env *e, const char *id, const char *label, const char *what)
{
    struct bench_row *row = bench_row_add(e->rep, id, "", "%s", label);

    fprintf(stderr, "vmmt bench: %s %s: %s: %s\n", id, label, what, vmmt_last_error());
    if (row != NULL) {
        row->failed = 1;
        bench_row_note(row, "%s: %s", what, vmmt_last_error());
    }
    return CLI_FAIL;
}

/* ------------------------------------------------------------ set-up */

static int fill_source(struct bench_env *e)
{
    const struct vmmt_drv *d = e->d;
    const uint64_t chunk = 4 * BENCH_MIB;
    uint8_t *h = NULL;
    int st;

    st = VMMT_CU(d, cuMemAllocHost((void **)&h, chunk));
    for (uint64_t at = 0; st == VMMT_OK && at < e->cap; at += chunk) {
        uint64_t n = e->cap - at < chunk ? e->cap - at : chunk;
        for (uint64_t j = 0; j < n; j++)
            h[j] = bench_byte(at + j);
        st = VMMT_CU(d, cuMemcpyHtoDAsync(e->src + at, h, n, e->ps));
        /* The pinned chunk is reused: wait before overwriting it. */
        if (st == VMMT_OK) st = VMMT_CU(d, cuStreamSynchronize(e->ps));
    }
    if (h != NULL) d->cuMemFreeHost(h);
    return st;
}

static void describe(struct bench_env *e)
{
    struct bench_report *r = e->rep;
    time_t now = time(NULL);
    struct tm tm;
    CUdevice dev;

    snprintf(r->driver, sizeof r->driver, "%s", e->driver);
    vmmt_driver_version(&r->driver_version);
    if (e->d->cuDeviceGet(&dev, e->device) != CUDA_SUCCESS ||
        e->d->cuDeviceGetName(r->device_name, (int)sizeof r->device_name, dev) != CUDA_SUCCESS)
        snprintf(r->device_name, sizeof r->device_name, "device %d", e->device);
    gmtime_r(&now, &tm);
    strftime(r->date, sizeof r->date, "%Y-%m-%dT%H:%M:%SZ", &tm);
}

static int setup(struct bench_env *e)
{
    const struct vmmt_drv *d;
    ssize_t n = readlink("/proc/self/exe", e->exe, sizeof e->exe - 1);
    int st;

    if (n <= 0) return vmmt__sys_fail("readlink /proc/self/exe");
    e->exe[n] = '\0';
    d = e->d = vmmt__drv();
    if (d == NULL) return vmmt_last_status();
    e->driver = d->name;
    e->device = e->opt.device;
    st = vmmt_device_count(&e->ndevices);
    if (st != VMMT_OK) return st;
    e->rep->device_count = e->ndevices;
    if (e->opt.device >= e->ndevices)
        return vmmt__fail(VMMT_ENODEV, "--device %d: the %s driver reports %d device(s)",
                          e->opt.device, d->name, e->ndevices);
    if (e->opt.peer_device >= e->ndevices)
        return vmmt__fail(VMMT_ENODEV, "--peer-device %d: the %s driver reports %d device(s)",
                          e->opt.peer_device, d->name, e->ndevices);
    /* The bench waits for room itself when a pool is full: no warning for that. */
    if (getenv("VMMT_LOG") == NULL) vmmt_set_log_level(VMMT_LOG_ERROR);
    st = vmmt__ctx_enter(e->device);
    if (st != VMMT_OK) return st;
    describe(e);
    e->cap = e->opt.quick ? 16 * BENCH_MIB : 256 * BENCH_MIB;
    st = VMMT_CU(d, cuStreamCreate(&e->ps, CU_STREAM_NON_BLOCKING));
    if (st == VMMT_OK) st = VMMT_CU(d, cuStreamCreate(&e->cs, CU_STREAM_NON_BLOCKING));
    if (st == VMMT_OK) st = VMMT_CU(d, cuMemAlloc(&e->src, e->cap));
    if (st == VMMT_OK) st = VMMT_CU(d, cuMemAlloc(&e->dst, e->cap));
    if (st == VMMT_OK) st = VMMT_CU(d, cuMemAlloc(&e->tmp, e->cap));
    if (st == VMMT_OK) st = fill_source(e);
    return st;
}

static void teardown(struct bench_env *e)
{
    const struct vmmt_drv *d = e->d;

    if (d == NULL) return;
    if (e->ps) d->cuStreamSynchronize(e->ps);
    if (e->cs) d->cuStreamSynchronize(e->cs);
    if (e->src) d->cuMemFree(e->src);
    if (e->dst) d->cuMemFree(e->dst);
    if (e->tmp) d->cuMemFree(e->tmp);
    if (e->ps) d->cuStreamDestroy(e->ps);
    if (e->cs) d->cuStreamDestroy(e->cs);
    vmmt__ctx_leave();
}

/* ------------------------------------------------------------ running */

static void banner(const struct bench_env *e)
{
    const struct bench_report *r = e->rep;

    printf("vmmt bench: driver %s (CUDA %d.%d), device %d: %s, %s run\n", r->driver,
           r->driver_version / 1000, r->driver_version % 1000 / 10, e->device, r->device_name,
           e->opt.quick ? "quick" : "full");
    printf("vmmt bench: %d device(s); peer processes on GPU %d", r->device_count,
           bench_peer_device(e, 0));
    for (int k = 1; k < 4; k++) /* S5 runs the most peers: four */
        printf(",%d", bench_peer_device(e, k));
    printf(" (peers 0-3)%s\n", e->opt.peer_device >= 0 ? ", as --peer-device says" : "");
    if (strcmp(r->driver, "emu") == 0)
        printf("vmmt bench: emulated driver (host memory): the code paths are the real ones, "
               "the timings say nothing about a GPU\n");
    fflush(stdout);
}

static int run_all(struct bench_env *e)
{
    int rc = CLI_OK;

    for (int i = 0; i < BENCH_SCENARIOS; i++) {
        double t0 = bench_now_us();
        if (e->opt.only && !(e->opt.only & (1u << i))) continue;
        printf("S%d ...", i + 1);
        fflush(stdout);
        if (g_scenarios[i](e) != CLI_OK) rc = CLI_FAIL;
        printf(" %.2f s\n", (bench_now_us() - t0) / 1e6);
        fflush(stdout);
    }
    if (bench_overhead(e) != CLI_OK) rc = CLI_FAIL;
    return rc;
}

static void print_info(const struct bench_report *r)
{
    printf("\npool: %s handles, %s hand-off\n", r->handle_type[0] ? r->handle_type : "?",
           r->handoff[0] ? r->handoff : "?");
    for (size_t i = 0; i < r->ninfo; i++)
        printf("  %-52s %14.0f %s\n", r->info[i].key, r->info[i].value, r->info[i].unit);
}

int cmd_bench(int argc, char **argv)
{
    struct bench_env e;
    int rc;

    if (argc >= 1 && strcmp(argv[0], "bench-peer") == 0) return bench_peer_main(argc, argv);
    memset(&e, 0, sizeof e);
    e.opt.peer_device = -1;
    if ((rc = parse(argc, argv, &e.opt)) != CLI_OK) return rc == CLI_HELP ? CLI_OK : CLI_ERROR;
    if (cli_open_driver("bench", e.opt.driver, stdout) != CLI_OK) return CLI_ERROR;
    e.rep = calloc(1, sizeof *e.rep);
    if (e.rep == NULL) return CLI_ERROR;
    if (setup(&e) != VMMT_OK) {
        printf("vmmt bench: %s\n", vmmt_last_error());
        teardown(&e);
        free(e.rep);
        return CLI_ERROR;
    }
    banner(&e);
    rc = run_all(&e);
    teardown(&e);
    print_info(e.rep);
    bench_print_table(stdout, e.rep);
    if (e.opt.json != NULL && bench_write_json(e.opt.json, e.rep, &e.opt) != 0) {
        printf("vmmt bench: cannot write %s\n", e.opt.json);
        rc = CLI_ERROR;
    }
    bench_report_free(e.rep);
    free(e.rep);
    return rc;
}
