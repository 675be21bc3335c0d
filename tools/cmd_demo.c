/*
 * vmmt demo: the main job. A producer (this process) and N consumer
 * processes (fork, then exec of this same program) move buffers of known
 * content through a vmmt pool; every consumer checks every byte. Exit 0 only
 * when every byte matched and the pool drained.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "demo_proto.h"
#include "driver.h"
#include "status.h"

#define MAX_CONSUMERS  64
#define TIMEOUT_MS     30000
#define DEMO_IN_FLIGHT 8           /* buffers the default pool has room for */
#define DEMO_MIN_POOL  (64u << 20) /* the smallest default pool */
#define DEMO_MAX_SIZE  (1ull << 40)

struct demo {
    int consumers;
    uint64_t size;
    int count;
    uint64_t pool_size; /* --pool; 0: room for DEMO_IN_FLIGHT buffers, at least DEMO_MIN_POOL */
    const char *driver;
    int devices;
    int host;    /* --host: a host pool, published from host memory with no context */
    int elastic; /* --elastic: an elastic device pool */
    double rate; /* --rate: publishes per second at most; 0: as fast as possible */
    uint8_t *hsrc[DEMO_PATTERNS];
    vmmt_pool *pool;
    CUstream stream;
    CUdeviceptr src[DEMO_PATTERNS];
    int sock[MAX_CONSUMERS];
    pid_t pid[MAX_CONSUMERS];
    uint64_t replies, verified, mismatched;
    char first_error[300];
};

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static const struct cli_opt demo_opts_table[] = {
    {"--consumers", CLI_INT, "N", 1, MAX_CONSUMERS, offsetof(struct demo, consumers),
     "consumer processes, on the devices in turn (default 2)", NULL, NULL, 0},
    {"--size", CLI_SIZE, "BYTES", 1, (double)DEMO_MAX_SIZE, offsetof(struct demo, size),
     "bytes per buffer (default 4M)", NULL, NULL, 0},
    {"--count", CLI_INT, "N", 1, 100000000, offsetof(struct demo, count),
     "buffers to publish (default 64)", NULL, NULL, 0},
    {"--pool", CLI_SIZE, "BYTES", 1, (double)(8 * DEMO_MAX_SIZE), offsetof(struct demo, pool_size),
     "pool size (default: room for 8 buffers in flight, at least 64M)", NULL, NULL, 0},
    {"--host", CLI_FLAG, NULL, 0, 0, offsetof(struct demo, host),
     "a host pool: published from host memory, no CUDA context in the producer", NULL, NULL, 0},
    {"--elastic", CLI_FLAG, NULL, 0, 0, offsetof(struct demo, elastic),
     "an elastic device pool: device memory held only while buffers are in flight", NULL, NULL, 0},
    {"--rate", CLI_REAL, "HZ", 0, 1e6, offsetof(struct demo, rate),
     "publishes per second at most (default 0: as fast as the pool allows)", NULL, NULL, 0},
    CLI_DRIVER_OPT(struct demo),
};

const struct cli_command cli_demo_command = {
    "demo",
    "a producer and consumer processes moving buffers, checked byte for byte",
    "The main job: this process publishes buffers of known content through a vmmt pool and\n"
    "consumer processes check every byte. Exit 0 only when every byte matched and the pool\n"
    "drained.",
    demo_opts_table,
    sizeof demo_opts_table / sizeof demo_opts_table[0],
    "--host and --elastic exclude each other. The pool holds the control table too, so it\n"
    "needs a little more than the buffers; the demo says which pool it makes before it\n"
    "makes it.\n",
};

static int parse(int argc, char **argv, struct demo *o)
{
    char a[32], b[32];
    int rc;

    o->consumers = 2;
    o->size = 4 << 20;
    o->count = 64;
    if ((rc = cli_parse(&cli_demo_command, argc, argv, o)) != CLI_OK) return rc;
    if (o->host && o->elastic) {
        fprintf(stderr, "vmmt demo: --host and --elastic exclude each other: choose one\n");
        return CLI_ERROR;
    }
    if (o->pool_size != 0 && o->pool_size < o->size) {
        fprintf(stderr,
                "vmmt demo: --pool %s cannot hold one buffer of --size %s: use a larger --pool "
                "or a smaller --size\n",
                cli_bytes(o->pool_size, a, sizeof a), cli_bytes(o->size, b, sizeof b));
        return CLI_ERROR;
    }
    return CLI_OK;
}

/* The driver by the tool's one rule (cli_open_driver); consumers get the same one. */
static int choose_driver(struct demo *o)
{
    int named_path = o->driver != NULL && strchr(o->driver, '/') != NULL;

    if (cli_open_driver("demo", o->driver, stdout) != CLI_OK) return CLI_ERROR;
    if (!named_path) o->driver = vmmt_driver_name();
    if (vmmt_device_count(&o->devices) != VMMT_OK || o->devices < 1) {
        printf("vmmt demo: %s\n",
               o->devices < 1 ? "the driver reports no device" : vmmt_last_error());
        return CLI_ERROR;
    }
    return CLI_OK;
}

static int spawn(struct demo *o, int k)
{
    char dev[16], rank[16], exe[4096];
    char *args[] = {"vmmt", "demo-consumer", dev, rank, "--driver", (char *)o->driver, NULL};
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    int sv[2];

    if (n <= 0 || socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) return -1;
    exe[n] = '\0';
    snprintf(dev, sizeof dev, "%d", k % o->devices);
    snprintf(rank, sizeof rank, "%d", k);
    o->pid[k] = fork();
    if (o->pid[k] == 0) {
        if (dup2(sv[1], 3) < 0) _exit(126);
        execv(exe, args);
        _exit(127);
    }
    close(sv[1]);
    o->sock[k] = sv[0];
    return o->pid[k] > 0 ? 0 : -1;
}

static int make_sources(struct demo *o)
{
    const struct vmmt_drv *d = vmmt__drv();
    uint8_t *h = malloc(o->size);
    int st = VMMT_OK;

    if (h == NULL) return vmmt__fail(VMMT_ENOMEM, "no host memory for %" PRIu64 " bytes", o->size);
    for (uint32_t p = 0; p < DEMO_PATTERNS && st == VMMT_OK; p++) {
        for (uint64_t j = 0; j < o->size; j++)
            h[j] = demo_byte(p, j);
        st = VMMT_CU(d, cuMemAlloc(&o->src[p], o->size));
        if (st == VMMT_OK) st = VMMT_CU(d, cuMemcpyHtoDAsync(o->src[p], h, o->size, o->stream));
        if (st == VMMT_OK) st = VMMT_CU(d, cuStreamSynchronize(o->stream));
    }
    free(h);
    return st;
}

/* A host pool's producer: the patterns in plain host memory, no GPU touched. */
static int make_host_sources(struct demo *o)
{
    for (uint32_t p = 0; p < DEMO_PATTERNS; p++) {
        o->hsrc[p] = malloc(o->size);
        if (o->hsrc[p] == NULL)
            return vmmt__fail(VMMT_ENOMEM, "no host memory for %" PRIu64 " bytes", o->size);
        for (uint64_t j = 0; j < o->size; j++)
            o->hsrc[p][j] = demo_byte(p, j);
    }
    return VMMT_OK;
}

static void take_reply(struct demo *o, const struct demo_reply *r)
{
    o->replies++;
    if (r->status == VMMT_OK) {
        o->verified++;
        return;
    }
    o->mismatched++;
    if (o->first_error[0] == '\0')
        snprintf(o->first_error, sizeof o->first_error, "buffer %u: %s", r->index, r->error);
}

/* Read replies that are ready; block up to wait_ms for the first one. */
static int collect(struct demo *o, int wait_ms)
{
    struct pollfd pf[MAX_CONSUMERS];
    int got = 0;

    for (int k = 0; k < o->consumers; k++)
        pf[k] = (struct pollfd){o->sock[k], POLLIN, 0};
    if (poll(pf, (nfds_t)o->consumers, wait_ms) <= 0) return 0;
    for (int k = 0; k < o->consumers; k++) {
        struct demo_reply r;
        while ((pf[k].revents & (POLLIN | POLLHUP)) &&
               recv(o->sock[k], &r, sizeof r, MSG_DONTWAIT) == (ssize_t)sizeof r) {
            take_reply(o, &r);
            got++;
        }
        if (pf[k].revents & POLLHUP && got == 0) return -1;
    }
    return got;
}

/* Publish, waiting for consumers to free room when the pool is full. */
static int publish(struct demo *o, uint32_t i, vmmt_desc *desc)
{
    vmmt_buffer b;
    double give_up = now_s() + TIMEOUT_MS / 1000.0;
    int st;

    memset(&b, 0, sizeof b);
    b.ptr = o->src[i % DEMO_PATTERNS];
    b.nbytes = o->size;
    if (o->host) {
        b.ptr = (uint64_t)(uintptr_t)o->hsrc[i % DEMO_PATTERNS];
        b.location = VMMT_LOC_HOST;
    }
    while ((st = vmmt_publish(o->pool, &b, o->stream, desc)) == VMMT_EFULL && now_s() < give_up)
        if (collect(o, 1) < 0) break;
    return st;
}

static int send_all(struct demo *o, uint32_t i, const vmmt_desc *desc)
{
    struct demo_msg m;

    memset(&m, 0, sizeof m);
    m.index = i;
    m.pattern = i % DEMO_PATTERNS;
    if (desc != NULL) m.desc = *desc;
    for (int k = 0; k < o->consumers; k++)
        if (send(o->sock[k], &m, sizeof m, MSG_NOSIGNAL) != (ssize_t)sizeof m) return -1;
    return 0;
}

static int run(struct demo *o, double *elapsed)
{
    uint64_t expected = (uint64_t)o->count * (uint64_t)o->consumers;
    double t0 = now_s(), deadline;
    vmmt_desc desc;

    for (uint32_t i = 0; i < (uint32_t)o->count; i++) {
        /* Paced (bench/interference.py): publish i no earlier than i / rate seconds in. */
        while (o->rate > 0 && now_s() < t0 + i / o->rate) {
            struct timespec pause = {0, 100000};
            collect(o, 0);
            nanosleep(&pause, NULL);
        }
        if (publish(o, i, &desc) != VMMT_OK) {
            printf("vmmt demo: publish %u failed: %s\n", i, vmmt_last_error());
            return CLI_ERROR;
        }
        if (send_all(o, i, &desc) != 0) {
            printf("vmmt demo: a consumer process went away\n");
            return CLI_ERROR;
        }
        collect(o, 0);
    }
    deadline = now_s() + TIMEOUT_MS / 1000.0;
    while (o->replies < expected && now_s() < deadline)
        if (collect(o, 100) < 0) break;
    *elapsed = now_s() - t0;
    send_all(o, DEMO_END, NULL);
    return o->replies == expected ? CLI_OK : CLI_FAIL;
}

/* Consumers exit when their socket closes; one that does not within 10 s is killed. */
static int reap(struct demo *o)
{
    double give_up = now_s() + 10.0;
    struct timespec pause = {0, 2000000};
    int bad = 0;

    for (int k = 0; k < o->consumers; k++)
        if (o->pid[k] > 0) shutdown(o->sock[k], SHUT_WR);
    for (int k = 0; k < o->consumers; k++) {
        int status = 0;
        pid_t r = 0;
        if (o->pid[k] <= 0) continue;
        while ((r = waitpid(o->pid[k], &status, WNOHANG)) == 0 && now_s() < give_up)
            nanosleep(&pause, NULL);
        if (r == 0) {
            printf("vmmt demo: consumer %d did not exit; killing it\n", k);
            kill(o->pid[k], SIGKILL);
            waitpid(o->pid[k], &status, 0);
        }
        if (r != o->pid[k] || !WIFEXITED(status) || WEXITSTATUS(status) != 0) bad++;
        close(o->sock[k]);
    }
    return bad;
}

static void summary(struct demo *o, double elapsed, int drained, int bad_exits)
{
    vmmt_pool_stats s;
    double moved = (double)o->size * o->count * o->consumers;
    int ok = o->verified == (uint64_t)o->count * o->consumers && o->mismatched == 0 && drained &&
             bad_exits == 0;

    vmmt_pool_get_stats(o->pool, &s);
    printf("pool: %s memory for device 0, %.1f MiB (%.1f MiB for data), %s handles, %s "
           "hand-off, %u slots\n",
           vmmt_memory_location_name(s.memory_location), (double)s.allocation_size / (1 << 20),
           (double)s.data_bytes / (1 << 20), vmmt_handle_type_name(s.handle_type),
           vmmt_handoff_name(s.handoff), s.slots);
    if (o->host)
        printf("producer: published from host memory with the CPU; device memory held by the "
               "pool: %" PRIu64 " bytes, no CUDA context made\n",
               s.device_bytes);
    if (o->elastic)
        printf("elastic: %.1f MiB resident now, %.1f MiB at the peak, of %.1f MiB; %" PRIu64
               " chunks of %.1f MiB made, %" PRIu64 " given back\n",
               (double)s.resident_bytes / (1 << 20), (double)s.peak_bytes / (1 << 20),
               (double)s.max_bytes / (1 << 20), s.chunks_made, (double)s.chunk_bytes / (1 << 20),
               s.chunks_released);
    printf("consumers: %d process(es) on device(s)", o->consumers);
    for (int k = 0; k < o->consumers && k < 8; k++)
        printf("%s%d", k ? ", " : " ", k % o->devices);
    printf("%s\n", o->consumers > 8 ? ", ..." : "");
    printf("moved: %d buffers x %.2f MiB to %d consumer(s) = %" PRIu64 " transfers, %.1f MiB\n",
           o->count, (double)o->size / (1 << 20), o->consumers, o->replies, moved / (1 << 20));
    printf("verified: %" PRIu64 " of %" PRIu64 " byte for byte, %" PRIu64 " failed%s%s\n",
           o->verified, (uint64_t)o->count * o->consumers, o->mismatched,
           o->first_error[0] ? " (first: " : "", o->first_error[0] ? o->first_error : "");
    if (o->first_error[0]) printf(")\n");
    printf("time: %.3f s, %.2f GB/s aggregate, each consumer's copy counted; this includes "
           "bringing every byte back to the host to check it (transport speed: vmmt bench)\n",
           elapsed, elapsed > 0 ? moved / elapsed / 1e9 : 0.0);
    printf("recycling: %" PRIu64 " published, %" PRIu64 " recycled, %u in flight, %" PRIu64
           " full, %" PRIu64 " table reads\n",
           s.published, s.recycled, s.in_flight, s.full, s.reclaims);
    printf("result: %s\n", ok ? "OK" : "FAILED");
}

static void cleanup(struct demo *o)
{
    const struct vmmt_drv *d = vmmt__drv();

    vmmt_pool_destroy(o->pool);
    for (int p = 0; p < DEMO_PATTERNS; p++) {
        if (o->src[p]) d->cuMemFree(o->src[p]);
        free(o->hsrc[p]);
    }
    if (o->stream) d->cuStreamDestroy(o->stream);
    vmmt__ctx_leave();
}

/* The pool --pool asks for, or room for DEMO_IN_FLIGHT buffers (at least DEMO_MIN_POOL). */
static uint64_t pool_bytes(const struct demo *o)
{
    uint64_t want = o->size * DEMO_IN_FLIGHT;

    if (o->pool_size != 0) return o->pool_size;
    return want > DEMO_MIN_POOL ? want : DEMO_MIN_POOL;
}

/* Say which pool the demo makes and why, before making it. */
static void describe_pool(const struct demo *o)
{
    char p[32], b[32];

    printf("vmmt demo: %s pool of %s%s for %d consumer(s): ",
           o->host      ? "a host"
           : o->elastic ? "an elastic device"
                        : "a device",
           cli_bytes(pool_bytes(o), p, sizeof p), o->elastic ? " at most" : "", o->consumers);
    if (o->pool_size != 0)
        printf("as --pool says\n");
    else
        printf("room for %d buffers of %s (--size) in flight%s; --pool sets another size\n",
               DEMO_IN_FLIGHT, cli_bytes(o->size, b, sizeof b),
               o->size * DEMO_IN_FLIGHT < DEMO_MIN_POOL ? ", raised to the 64 MiB minimum" : "");
}

/*
 * Refuse, naming the options, what the devices cannot hold: the pool and the
 * producer's four source buffers on device 0, one buffer per consumer on
 * its device. Found by the driver instead, it was a bare
 * CUDA_ERROR_OUT_OF_MEMORY from a call the user never made.
 */
static int check_memory(const struct demo *o)
{
    const struct vmmt_drv *d = vmmt__drv();
    char need[32], have[32], sz[32], pl[32], parts[128];

    for (int dev = 0; dev < o->devices && dev < o->consumers; dev++) {
        CUdevice h;
        size_t total = 0;
        double bytes;
        int here = 0, pool_here = dev == 0 && !o->host && !o->elastic;
        for (int k = dev; k < o->consumers; k += o->devices)
            here++;
        /* An elastic pool holds device memory only while buffers are in flight. */
        bytes = (double)o->size * (here + (dev == 0 && !o->host ? DEMO_PATTERNS : 0)) +
                (pool_here ? (double)pool_bytes(o) : 0.0);
        if (d->cuDeviceGet(&h, dev) != CUDA_SUCCESS ||
            d->cuDeviceTotalMem(&total, h) != CUDA_SUCCESS)
            continue; /* the allocations themselves will say */
        if (bytes <= (double)total) continue;
        snprintf(parts, sizeof parts, "%s%s%s%s%d consumer buffer(s) of --size",
                 pool_here ? "the " : "", pool_here ? cli_bytes(pool_bytes(o), pl, sizeof pl) : "",
                 pool_here ? " pool; " : "", dev == 0 && !o->host ? "4 source and " : "", here);
        printf("vmmt demo: --size %s needs %s on device %d (%s), more than its "
               "%s; use a smaller --size%s\n",
               cli_bytes(o->size, sz, sizeof sz), cli_bytes((uint64_t)bytes, need, sizeof need),
               dev, parts, cli_bytes(total, have, sizeof have), pool_here ? " or --pool" : "");
        return CLI_ERROR;
    }
    return CLI_OK;
}

/* A failure to make the pool or its sources, with the options that decided its size. */
static int setup_failed(const struct demo *o, const char *what)
{
    char p[32], b[32];

    printf("vmmt demo: cannot make %s (pool %s, buffers of %s): %s\n"
           "vmmt demo: a smaller --size%s may fit\n",
           what, cli_bytes(pool_bytes(o), p, sizeof p), cli_bytes(o->size, b, sizeof b),
           vmmt_last_error(), o->pool_size ? " or --pool" : "");
    return CLI_ERROR;
}

static int setup(struct demo *o)
{
    vmmt_pool_config c;

    describe_pool(o);
    fflush(stdout);
    if (check_memory(o) != CLI_OK) return CLI_ERROR;
    vmmt_pool_config_init(&c);
    c.memory_size = pool_bytes(o);
    c.consumer_count = o->consumers;
    c.round_up = 1;
    c.memory_location = o->host ? VMMT_MEMORY_HOST : VMMT_MEMORY_DEVICE;
    c.elastic = o->elastic;
    /* The demo waits for room itself when the pool is full: no warning for that. */
    vmmt_set_log_level(VMMT_LOG_ERROR);
    if (o->host) {
        /* The producer of a host pool never makes a context current. */
        if (vmmt_pool_create(&c, &o->pool) != VMMT_OK) return setup_failed(o, "the pool");
        if (make_host_sources(o) != VMMT_OK) return setup_failed(o, "the source buffers");
    } else if (vmmt__ctx_enter(0) != VMMT_OK) {
        printf("vmmt demo: %s\n", vmmt_last_error());
        return CLI_ERROR;
    } else if (vmmt_pool_create(&c, &o->pool) != VMMT_OK) {
        return setup_failed(o, "the pool");
    } else if (VMMT_CU(vmmt__drv(), cuStreamCreate(&o->stream, CU_STREAM_NON_BLOCKING)) !=
                   VMMT_OK ||
               make_sources(o) != VMMT_OK) {
        return setup_failed(o, "the source buffers");
    }
    for (int k = 0; k < o->consumers; k++)
        if (spawn(o, k) != 0) {
            printf("vmmt demo: cannot start consumer %d: %s\n", k, strerror(errno));
            return CLI_ERROR;
        }
    return CLI_OK;
}

int cmd_demo(int argc, char **argv)
{
    struct demo o;
    double elapsed = 0;
    int rc, drained, bad;

    memset(&o, 0, sizeof o);
    if (argc >= 1 && strcmp(argv[0], "demo-consumer") == 0) return demo_consumer_main(argc, argv);
    if ((rc = parse(argc, argv, &o)) != CLI_OK) return rc == CLI_HELP ? CLI_OK : CLI_ERROR;
    if (choose_driver(&o) != CLI_OK) return CLI_ERROR;
    printf("vmmt demo: driver %s, %d device(s), %d consumer process(es), %d buffers of %" PRIu64
           " bytes\n",
           vmmt_driver_name(), o.devices, o.consumers, o.count, o.size);
    fflush(stdout);
    rc = setup(&o);
    if (rc == CLI_OK) rc = run(&o, &elapsed);
    bad = reap(&o);
    drained = o.pool != NULL && vmmt_pool_drain(o.pool, 10000) == VMMT_OK;
    if (o.pool != NULL && !drained) printf("vmmt demo: %s\n", vmmt_last_error());
    if (o.pool != NULL && rc != CLI_ERROR) summary(&o, elapsed, drained, bad);
    cleanup(&o);
    if (rc == CLI_ERROR) return CLI_ERROR;
    return rc == CLI_OK && drained && bad == 0 && o.mismatched == 0 ? CLI_OK : CLI_FAIL;
}
