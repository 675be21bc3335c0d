/*
 * vmmt bench S10: a peer on the producer's own GPU, where two processes
 * doing GPU work time-slice one device. Its floor is the two-process floor:
 * the producer copies and synchronizes, then the peer copies and
 * synchronizes, in turn, with no vmmt at all. Against it: a device pool's
 * hand-off, and a host pool's, whose producer only writes host memory with
 * the CPU (one GPU context in the round trip); the host pool's own floor is a
 * plain shared memfd the peer registered once, written with memcpy.
 */
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "bench.h"
#include "cli.h"
#include "status.h"

#define S10_HOST_GOAL    1.2  /* host pool p50 against the memfd floor */
#define S10_SPEEDUP_GOAL 10.0 /* device pool p50 / host pool p50, same GPU, 4 KiB */
#define S10_MAX          (4 * BENCH_MIB)
#define DRAIN_MS         5000

static const uint64_t g_sizes[] = {4 * BENCH_KIB, BENCH_MIB, 4 * BENCH_MIB, 0};

struct s10 {
    struct bench_env *e;
    struct bench_peer peer;
    int memfd;
    uint8_t *shared; /* the memfd, mapped here too */
    uint8_t *hsrc;   /* the host pool's source: bench_byte() */
    vmmt_pool *device_pool, *host_pool;
    double twoproc_p50, device_p50;
};

static int call(struct s10 *t, enum bench_op op, uint32_t rank, uint64_t n)
{
    struct bench_reply r;
    struct bench_msg m;

    memset(&m, 0, sizeof m);
    m.h.op = op;
    m.h.rank = rank;
    m.h.nbytes = n;
    return bench_peer_call(&t->peer, &m, 0, &r);
}

int bench_twoproc_sample(struct bench_env *e, struct bench_peer *peer, uint64_t n, double *us)
{
    struct bench_reply r;
    struct bench_msg m;
    double t0 = bench_now_us();
    int st = bench_copy_sample(e, e->ps, n, us);

    memset(&m, 0, sizeof m);
    m.h.op = BOP_COPY;
    m.h.nbytes = n;
    if (st == VMMT_OK) st = bench_peer_call(peer, &m, 0, &r);
    *us = bench_now_us() - t0;
    return st;
}

/*
 * Two series measured alternately, sample by sample, after a warm-up of each,
 * so that drift of the machine weighs on both alike. With a peer on the
 * producer's GPU this is also what makes two of them comparable: each sample
 * starts with the peer's context the last one on the GPU, as in a stream of
 * hand-offs, so each pays the same switches (one into the producer's
 * context, one back into the peer's).
 */
int bench_alternate(struct bench_env *e, uint64_t n, bench_sample_fn a, void *actx,
                    struct bench_series *sa, bench_sample_fn b, void *bctx, struct bench_series *sb)
{
    int reps = bench_reps(e, n), warm = bench_warmup(reps), st = VMMT_OK;
    double us;

    for (int i = 0; i < warm + reps && st == VMMT_OK; i++) {
        st = a(actx, n, &us);
        if (st == VMMT_OK && i >= warm && bench_series_add(sa, us)) st = VMMT_ENOMEM;
        if (st == VMMT_OK) st = b(bctx, n, &us);
        if (st == VMMT_OK && i >= warm && bench_series_add(sb, us)) st = VMMT_ENOMEM;
    }
    return st;
}

static int twoproc_sample(struct s10 *t, uint64_t n, double *us)
{
    return bench_twoproc_sample(t->e, &t->peer, n, us);
}

static int memfd_sample(struct s10 *t, uint64_t n, double *us)
{
    double t0 = bench_now_us();
    int st;

    memcpy(t->shared, t->hsrc, n);
    st = call(t, BOP_MEMFD_COPY, 0, n);
    *us = bench_now_us() - t0;
    return st;
}

/* Publish from host memory (a memcpy), the peer consumes to its GPU and synchronizes. */
static int host_sample(struct s10 *t, uint64_t n, double *us)
{
    vmmt_buffer b = bench_buffer((uint64_t)(uintptr_t)t->hsrc, n);
    struct bench_reply r;
    struct bench_msg m;
    vmmt_desc desc;
    double t0 = bench_now_us();
    int st;

    b.location = VMMT_LOC_HOST;
    st = vmmt_publish(t->host_pool, &b, NULL, &desc);
    if (st == VMMT_OK) {
        bench_consume_msg(&m, &desc, 0, n);
        st = bench_peer_call(&t->peer, &m, VMMT_DESC_SIZE, &r);
    }
    *us = bench_now_us() - t0;
    return st == VMMT_OK ? vmmt_pool_drain(t->host_pool, DRAIN_MS) : st;
}

typedef int (*sample_fn)(struct s10 *t, uint64_t n, double *us);

struct s10_pair {
    struct s10 *t;
    sample_fn a, b;
};

static int pair_a(void *ctx, uint64_t n, double *us)
{
    struct s10_pair *p = ctx;
    return p->a(p->t, n, us);
}

static int pair_b(void *ctx, uint64_t n, double *us)
{
    struct s10_pair *p = ctx;
    return p->b(p->t, n, us);
}

static int measure_pair(struct s10 *t, uint64_t n, sample_fn a, struct bench_series *sa,
                        sample_fn b, struct bench_series *sb)
{
    struct s10_pair p = {t, a, b};
    return bench_alternate(t->e, n, pair_a, &p, sa, pair_b, &p, sb);
}

static int device_sample(struct s10 *t, uint64_t n, double *us)
{
    return bench_rt_vmmt(t->e, t->device_pool, &t->peer, n, us);
}

/* The floor of every same-GPU row, and a device pool's hand-off against it. */
static int s10_device(struct s10 *t)
{
    struct bench_series *two = bench_series_new(t->e->rep, "us", "S10 two-process floor 4KiB");
    struct bench_series *dev = bench_series_new(t->e->rep, "us", "S10 device pool same GPU 4KiB");
    struct bench_summary a, b;
    struct bench_row *row;
    int st;

    if (two == NULL || dev == NULL) return VMMT_ENOMEM;
    st = measure_pair(t, 4 * BENCH_KIB, twoproc_sample, two, device_sample, dev);
    if (st == VMMT_OK) st = bench_peer_verify(&t->peer, 4 * BENCH_KIB);
    if (st != VMMT_OK) return st;
    bench_summarize(two, &a);
    bench_summarize(dev, &b);
    t->twoproc_p50 = a.p50;
    t->device_p50 = b.p50;
    row = bench_row_add(t->e->rep, "S10", "us", "two-process floor, same GPU 4 KiB");
    bench_row_values(row, a.p50, a.p99, NAN, NAN);
    bench_row_note(row, "producer DtoD+sync, then the peer DtoD+sync on the same GPU, no vmmt: "
                        "the floor of every same-GPU row");
    row = bench_row_add(t->e->rep, "S10", "us", "device pool e2e, same GPU 4 KiB");
    bench_row_values(row, b.p50, b.p99, a.p50, b.p50 / a.p50);
    bench_row_note(row, "publish copy on the producer's stream, peer consumes + syncs; floor: "
                        "the two-process floor");
    return VMMT_OK;
}

static int s10_host_size(struct s10 *t, uint64_t n)
{
    struct bench_series *fl, *hp;
    struct bench_summary f, h;
    struct bench_row *row;
    char sz[16];
    int st;

    bench_size_name(n, sz, sizeof sz);
    fl = bench_series_new(t->e->rep, "us", "S10 memfd floor same GPU %s", sz);
    hp = bench_series_new(t->e->rep, "us", "S10 host pool same GPU %s", sz);
    if (fl == NULL || hp == NULL) return VMMT_ENOMEM;
    st = measure_pair(t, n, memfd_sample, fl, host_sample, hp);
    /* The last copy into the peer's buffer came from the host pool: check it. */
    if (st == VMMT_OK) st = bench_peer_verify(&t->peer, n);
    if (st != VMMT_OK) return st;
    bench_summarize(fl, &f);
    bench_summarize(hp, &h);
    row = bench_row_add(t->e->rep, "S10", "us", "host pool e2e, same GPU %s", sz);
    bench_row_values(row, h.p50, h.p99, f.p50, h.p50 / f.p50);
    bench_row_goal(row, BENCH_GOAL_RATIO_MAX, S10_HOST_GOAL, 0);
    bench_row_note(row,
                   "producer memcpy into the host pool (no GPU work), peer copies host to its "
                   "GPU + syncs; floor: memcpy into a shared memfd the peer registered, same copy");
    if (n == 4 * BENCH_KIB && t->device_p50 > 0) {
        row = bench_row_add(t->e->rep, "S10", "x", "host vs device pool, same GPU 4 KiB");
        bench_row_values(row, t->device_p50 / h.p50, NAN, NAN, t->device_p50 / h.p50);
        bench_row_goal(row, BENCH_GOAL_RATIO_MIN, S10_SPEEDUP_GOAL, 0);
        bench_row_note(row, "device pool e2e p50 %.1f us / host pool e2e p50 %.1f us",
                       t->device_p50, h.p50);
    }
    return VMMT_OK;
}

static int s10_host_memory(struct s10 *t)
{
    vmmt_pool_stats s;
    struct bench_row *row;
    int st = vmmt_pool_get_stats(t->host_pool, &s);

    if (st != VMMT_OK) return st;
    row = bench_row_add(t->e->rep, "S10", "MiB", "device memory held by a host pool");
    bench_row_values(row, (double)s.device_bytes / BENCH_MIB, NAN, NAN, NAN);
    bench_row_goal(row, BENCH_GOAL_ABS_MAX, NAN, 0);
    bench_row_note(row, "the pool's own count; %.0f MiB of pinned host memory instead",
                   (double)s.host_bytes / BENCH_MIB);
    return VMMT_OK;
}

static int setup(struct s10 *t)
{
    vmmt_pool_config c;
    int st;

    int fd = memfd_create("vmmt-bench-floor", MFD_CLOEXEC);

    if (fd < 0) return vmmt__sys_fail("a memfd for the floor");
    /* Without CLOEXEC, so the peer inherits it, and above the fds the peer's start sets up. */
    t->memfd = fcntl(fd, F_DUPFD, 64);
    close(fd);
    if (t->memfd < 0) return vmmt__sys_fail("a memfd for the floor");
    if (ftruncate(t->memfd, (off_t)S10_MAX) != 0) {
        close(t->memfd);
        return vmmt__sys_fail("sizing the floor's memfd");
    }
    t->shared = mmap(NULL, S10_MAX, PROT_READ | PROT_WRITE, MAP_SHARED, t->memfd, 0);
    t->hsrc = malloc(S10_MAX);
    if (t->shared == MAP_FAILED || t->hsrc == NULL) {
        if (t->shared == MAP_FAILED) t->shared = NULL;
        close(t->memfd);
        return vmmt__fail(VMMT_ENOMEM, "host memory for the floor");
    }
    for (uint64_t j = 0; j < S10_MAX; j++)
        t->hsrc[j] = bench_byte(j);
    st = bench_peer_spawn(t->e, t->e->device, &t->peer);
    close(t->memfd); /* the peer has its copy; later peers get none */
    if (st == VMMT_OK) st = call(t, BOP_MEMFD_ATTACH, (uint32_t)t->memfd, S10_MAX);
    if (st == VMMT_OK) st = bench_pool_create(t->e, 64 * BENCH_MIB, 1, 64, &t->device_pool);
    if (st != VMMT_OK) return st;
    vmmt_pool_config_init(&c);
    c.device = t->e->device;
    c.memory_size = 64 * BENCH_MIB;
    c.consumer_count = 1;
    c.max_slices = 64;
    c.memory_location = VMMT_MEMORY_HOST;
    return vmmt_pool_create(&c, &t->host_pool);
}

int bench_s10(struct bench_env *e)
{
    struct s10 t;
    int rc = CLI_OK, st;

    memset(&t, 0, sizeof t);
    t.e = e;
    t.peer.pid = t.peer.sock = -1;
    st = setup(&t);
    if (st != VMMT_OK) {
        rc = bench_fail(e, "S10", "same GPU", "setting up the peer, the floor and the pools");
        goto out;
    }
    if (s10_device(&t) != VMMT_OK) rc = bench_fail(e, "S10", "device pool e2e, same GPU", "4 KiB");
    for (const uint64_t *n = g_sizes; *n && rc == CLI_OK; n++)
        if (s10_host_size(&t, *n) != VMMT_OK) rc = bench_fail(e, "S10", "host pool e2e", "");
    if (rc == CLI_OK && s10_host_memory(&t) != VMMT_OK)
        rc = bench_fail(e, "S10", "host pool memory", "stats");
out:
    if (t.peer.pid > 0) bench_peer_reset(&t.peer);
    bench_peer_stop(&t.peer);
    vmmt_pool_destroy(t.host_pool);
    vmmt_pool_destroy(t.device_pool);
    if (t.shared != NULL) munmap(t.shared, S10_MAX);
    free(t.hsrc);
    return rc;
}
