/*
 * Soak: one producer process and several consumer processes (one rank each)
 * on the emulated driver, for VMMT_SOAK_SECONDS (default 60; --seconds N
 * overrides). The producer publishes buffers of random sizes, single or
 * packed, cancels some before handing them out, and sends the rest to every
 * consumer over a socket; each consumer consumes (and checks every byte) or
 * drops what it is sent. Now and then the producer kills a consumer with
 * SIGKILL and starts a new one for the same rank. What the dead one left
 * unacknowledged is then released:
 *   - with VMMT_HAVE_RELEASE_RANK defined (by vmmt.h beside its declaration
 *     of vmmt_pool_release_rank, or -D on the compiler line), by the
 *     producer calling it for that rank once the dead process is reaped;
 *   - otherwise, or with --successor-acks, by the new consumer, which
 *     acknowledges every descriptor its predecessor had not reported done
 *     (whole packed groups).
 * Now and then a consumer consumes a descriptor again right after consuming
 * it (a replay, which must be refused), and evicts the pool once a whole
 * publish is done with (which must then succeed: nothing of it is in use).
 * At the end: no consumer saw a wrong byte, every consumer exits cleanly with
 * nothing held in its emulator, the pool drains to empty, and the producer's
 * fd and mapping counts are what they were before the first consumer.
 *
 * Every path the soak claims to exercise has a counter (see struct soak); a
 * path whose counter is still 0 fails the soak, by name: a soak that never
 * evicted, or never killed, proves nothing about evicting or killing. The
 * run goes on past its time until every path has been taken, at most
 * WAIT_MS more, so that a short run on a busy machine still takes them all.
 *
 *     soak [--seconds N] [--consumers N] [--seed N] [--device-table] [--successor-acks]
 *
 * --device-table keeps the control table in device memory (as FABRIC pools
 * do) instead of shared host memory.
 *     soak --consumer RANK   (internal: a consumer on fd 3)
 */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "driver.h"
#include "emu.h"
#include "pattern.h"
#include "publish_kernel.h"
#include "rng.h"
#include "testutil.h"
#include "vmmt.h"

#define MiB           (1024ull * 1024)
#define MAX_CONSUMERS 8
#define MAX_ITEMS     48 /* publishes in flight at most */
#define MAX_MEMBERS   4  /* buffers of a packed publish */
#define MAX_BYTES     (256u * 1024)
#define SRC_BYTES     (MAX_MEMBERS * MAX_BYTES)
#define WAIT_MS       20000 /* any single wait of the soak; a hang fails it */
#define CONSUMER_FD   3

/*
 * ThreadSanitizer maps shadow and allocator regions as the process touches new
 * memory, so there the mapping count says nothing about the library; it is
 * printed but not compared. AddressSanitizer's named regions are left out of
 * the count by tu_count_maps, but its allocator's anonymous ones still come
 * and go (92 -> 93, 94 -> 92 in 3 s device-table runs), so there too the
 * count is only printed; the plain build's soak (CTest, `make soak`) and the
 * emulator's live counts in every consumer still check mappings exactly.
 */
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
#define MAPS_GROW_ON_THEIR_OWN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
#define MAPS_GROW_ON_THEIR_OWN 1
#endif
#endif
#ifndef MAPS_GROW_ON_THEIR_OWN
#define MAPS_GROW_ON_THEIR_OWN 0
#endif

enum kind { MSG_CONSUME, MSG_DROP, MSG_ACK_LEFT, MSG_QUIT };

/* What a consumer is asked to do besides the message's kind. */
enum {
    MSG_REPLAY = 1, /* consume the descriptor again right after: it must be refused */
    MSG_EVICT = 2   /* the last member of a publish: evict the pool after it */
};

struct msg {
    uint32_t kind;
    uint32_t pattern;
    uint32_t item;
    uint32_t member;
    uint64_t nbytes;
    uint32_t flags;
    uint32_t unused;
    vmmt_desc desc;
};

/* What a consumer did for a message, for the producer's counters. */
enum {
    DID_CHECK = 1,           /* consumed, and every byte checked */
    DID_DROP = 2,            /* acknowledged without a copy */
    DID_EVICT = 4,           /* evicted the pool, and it was gone after */
    DID_EVICT_REFUSED = 8,   /* vmmt_consumer_evict refused with nothing of the pool in use */
    DID_REPLAY_REFUSED = 16, /* a second consume of the descriptor refused (VMMT_ESTATE) */
    DID_FAIL = 32            /* a call failed that must not have (printed by the consumer) */
};

struct reply {
    uint32_t item, member;
    int32_t status;
    uint32_t bytes_ok;
    uint32_t did;
};

static void die(const char *what)
{
    fprintf(stderr, "soak: %s: %s\n", what, vmmt_last_error());
    exit(2);
}

static uint64_t rng_state;
static uint64_t rnd(void)
{
    return tu_rng_next(&rng_state);
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static void send_all(int fd, const void *p, size_t n)
{
    if (send(fd, p, n, MSG_NOSIGNAL) != (ssize_t)n && errno != EPIPE && errno != ECONNRESET) {
        perror("soak: send");
        exit(2);
    }
}

/* ------------------------------------------------------------ consumer */

/*
 * The descriptor just consumed, consumed again: the library must refuse it
 * (VMMT_ESTATE), whether this process still remembers the consume or the
 * slot has moved on since.
 */
static uint32_t replay(vmmt_consumer *c, const struct msg *m, CUdeviceptr dst, CUstream s, int rank)
{
    static int printed;
    int st = vmmt_consume(c, &m->desc, 0, dst, MAX_BYTES, s, rank, 1);

    if (st == VMMT_ESTATE) return DID_REPLAY_REFUSED;
    /* A few are enough to say what went wrong; the producer counts them all as failed calls. */
    if (printed++ < 3)
        fprintf(stderr, "soak: rank %d item %u member %u consumed twice: %s (%s)\n", rank, m->item,
                m->member, vmmt_strerror(st), st == VMMT_OK ? "accepted" : vmmt_last_error());
    return DID_FAIL;
}

/*
 * A whole publish is done with here (its members come one after another, and
 * every call on them has returned): once the stream is synchronized nothing
 * of the pool is in use, so the eviction must succeed and leave no pool.
 */
static uint32_t evict(vmmt_consumer *c, const struct msg *m, CUstream s, int rank)
{
    static int printed;
    vmmt_desc_info info;
    int st;

    if (vmmt__drv()->cuStreamSynchronize(s) != CUDA_SUCCESS) die("synchronize before evict");
    if (vmmt_desc_inspect(&m->desc, &info) != VMMT_OK) die("inspect");
    if (vmmt_consumer_pool_count(c) != 1) {
        fprintf(stderr, "soak: rank %d: %d pools imported before an eviction, not 1\n", rank,
                vmmt_consumer_pool_count(c));
        return DID_FAIL;
    }
    st = vmmt_consumer_evict(c, info.pool_id, 0);
    if (st != VMMT_OK) {
        /* As for replays: a few printed, all counted. */
        if (printed++ < 3)
            fprintf(stderr, "soak: rank %d evict after item %u: %s\n", rank, m->item,
                    vmmt_last_error());
        return DID_EVICT_REFUSED;
    }
    if (vmmt_consumer_pool_count(c) != 0) {
        fprintf(stderr, "soak: rank %d: the pool is still imported after its eviction\n", rank);
        return DID_FAIL;
    }
    return DID_EVICT;
}

static int consumer_main(int rank)
{
    const struct vmmt_drv *d;
    vmmt_consumer *c;
    CUstream s;
    CUdeviceptr dst;
    uint8_t *host = malloc(MAX_BYTES);
    struct msg m;
    struct reply r;
    int bad = 0;

    if (host == NULL) return 2;
    tu_use_test_driver();
    if (vmmt__ctx_enter(0) != VMMT_OK) die("consumer init");
    d = vmmt__drv();
    if (d->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) die("stream");
    if (d->cuMemAlloc(&dst, MAX_BYTES) != CUDA_SUCCESS) die("dst");
    if (vmmt_consumer_create(NULL, &c) != VMMT_OK) die("consumer");
    for (;;) {
        ssize_t n = recv(CONSUMER_FD, &m, sizeof m, 0);
        if (n != (ssize_t)sizeof m) break; /* the producer went away */
        if (m.kind == MSG_QUIT) break;
        memset(&r, 0, sizeof r);
        r.item = m.item;
        r.member = m.member;
        r.bytes_ok = 1;
        if (m.kind == MSG_CONSUME) {
            r.status = vmmt_consume(c, &m.desc, 0, dst, MAX_BYTES, s, rank, 1);
            if (r.status == VMMT_OK) {
                if (d->cuStreamSynchronize(s) != CUDA_SUCCESS ||
                    d->cuMemcpyDtoHAsync(host, dst, m.nbytes, s) != CUDA_SUCCESS ||
                    d->cuStreamSynchronize(s) != CUDA_SUCCESS)
                    die("read back");
                if (tu_pattern_check(host, m.nbytes, m.pattern) != m.nbytes) {
                    r.bytes_ok = 0;
                    bad = 1;
                    fprintf(stderr, "soak: rank %d item %u member %u: wrong bytes at %zu\n", rank,
                            m.item, m.member, tu_pattern_check(host, m.nbytes, m.pattern));
                }
                r.did |= DID_CHECK;
                if (m.flags & MSG_REPLAY) r.did |= replay(c, &m, dst, s, rank);
            } else {
                fprintf(stderr, "soak: rank %d consume: %s\n", rank, vmmt_last_error());
            }
        } else {
            r.status = vmmt_consumer_ack(c, &m.desc, 0, s, rank, 1);
            /* What a dead predecessor left may be refused as stale: that is the library's guard. */
            if (r.status != VMMT_OK && m.kind == MSG_ACK_LEFT) r.status = VMMT_OK;
            if (r.status != VMMT_OK)
                fprintf(stderr, "soak: rank %d ack: %s\n", rank, vmmt_last_error());
            else if (m.kind == MSG_DROP)
                r.did |= DID_DROP;
        }
        if (r.status == VMMT_OK && (m.flags & MSG_EVICT)) r.did |= evict(c, &m, s, rank);
        send_all(CONSUMER_FD, &r, sizeof r);
    }
    d->cuStreamSynchronize(s);
    vmmt_consumer_destroy(c);
    d->cuMemFree(dst);
    d->cuStreamDestroy(s);
    free(host);
    if (vmmt__emu_live_allocations() || vmmt__emu_live_mappings() ||
        vmmt__emu_live_reservations() || vmmt__emu_live_streams() || vmmt__emu_live_blocks()) {
        fprintf(stderr, "soak: rank %d holds emulator resources at exit\n", rank);
        bad = 1;
    }
    vmmt__ctx_leave();
    return bad ? 3 : 0;
}

/* ------------------------------------------------------------ producer */

struct item {
    int used;
    int members;
    int released; /* a dead rank's part was released or handed to its successor */
    uint32_t pattern[MAX_MEMBERS];
    uint64_t nbytes[MAX_MEMBERS];
    vmmt_desc desc[MAX_MEMBERS];
    int left[MAX_CONSUMERS]; /* members this rank has not reported done */
};

/*
 * Recently finished publishes: a consumer reports a consume done once its
 * copy is, but its acknowledgement may be written a moment later (by its
 * acknowledgement thread); a kill in between leaves that slice owed by a
 * rank that reported it done. A restarted consumer acknowledges these again
 * too; for a slice acknowledged already, or recycled since, that does
 * nothing (acknowledgements are generation-tagged, never lowered).
 */
#define RECENT 256
struct recent {
    int members;
    vmmt_desc desc[MAX_MEMBERS];
};

struct soak {
    struct recent recent[RECENT];
    uint64_t nrecent;
    vmmt_pool *pool;
    CUstream stream;
    CUdeviceptr src;
    int nconsumers;
    pid_t pid[MAX_CONSUMERS];
    int fd[MAX_CONSUMERS];
    struct item items[MAX_ITEMS];
    int in_flight;
    uint32_t next_pattern;
    /* figures: what was asked for, then what the consumers report they did */
    uint64_t published, packed, cancelled, full, kills, left_acked;
    uint64_t checked, dropped, packed_done, evicted, evict_refused, replays_refused;
    uint64_t wrong_bytes, failures;
};

static void start_consumer(struct soak *k, int rank)
{
    int sv[2];
    char rank_text[16], exe[4096];
    ssize_t n;

    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) die("socketpair");
    n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) die("readlink");
    exe[n] = '\0';
    snprintf(rank_text, sizeof rank_text, "%d", rank);
    k->pid[rank] = fork();
    if (k->pid[rank] < 0) die("fork");
    if (k->pid[rank] == 0) {
        char *argv[] = {exe, "--consumer", rank_text, NULL};
        dup2(sv[1], CONSUMER_FD);
        execv(exe, argv);
        _exit(127);
    }
    close(sv[1]);
    k->fd[rank] = sv[0];
}

/* 1 when no rank owes anything of item i any more: it is finished. */
static int item_done(struct soak *k, int i)
{
    struct recent *rc;

    for (int r = 0; r < k->nconsumers; r++)
        if (k->items[i].left[r] > 0) return 0;
    rc = &k->recent[k->nrecent++ % RECENT];
    rc->members = k->items[i].members;
    memcpy(rc->desc, k->items[i].desc, sizeof rc->desc);
    k->items[i].used = 0;
    k->in_flight--;
    return 1;
}

static void handle_reply(struct soak *k, int rank, const struct reply *r)
{
    struct item *it;

    /* What the consumer did counts even for a publish released meanwhile. */
    if (!r->bytes_ok) k->wrong_bytes++;
    if (r->status != VMMT_OK || (r->did & DID_FAIL)) k->failures++;
    k->checked += (r->did & DID_CHECK) != 0;
    k->dropped += (r->did & DID_DROP) != 0;
    k->evicted += (r->did & DID_EVICT) != 0;
    k->evict_refused += (r->did & DID_EVICT_REFUSED) != 0;
    k->replays_refused += (r->did & DID_REPLAY_REFUSED) != 0;
    if (r->item >= MAX_ITEMS || !k->items[r->item].used) return; /* stale: released already */
    it = &k->items[r->item];
    if (it->left[rank] > 0) it->left[rank]--;
    /* A packed publish every rank reported done, member by member (none released). */
    if (item_done(k, (int)r->item) && it->members > 1 && !it->released) k->packed_done++;
}

/* Read every reply that has arrived, waiting up to timeout_ms for the first. */
static void pump(struct soak *k, int timeout_ms)
{
    struct pollfd p[MAX_CONSUMERS];
    struct reply r;

    for (int i = 0; i < k->nconsumers; i++)
        p[i] = (struct pollfd){.fd = k->fd[i], .events = POLLIN};
    if (poll(p, (nfds_t)k->nconsumers, timeout_ms) <= 0) return;
    for (int i = 0; i < k->nconsumers; i++) {
        if (!(p[i].revents & POLLIN)) continue;
        while (recv(k->fd[i], &r, sizeof r, MSG_DONTWAIT) == (ssize_t)sizeof r)
            handle_reply(k, i, &r);
    }
}

static void send_msg(struct soak *k, int rank, const struct msg *m);

static int free_item(struct soak *k)
{
    for (int i = 0; i < MAX_ITEMS; i++)
        if (!k->items[i].used) return i;
    return -1;
}

static void fill(struct soak *k, CUdeviceptr at, uint64_t n, uint32_t pattern)
{
    static uint8_t host[MAX_BYTES];
    const struct vmmt_drv *d = vmmt__drv();

    tu_pattern_fill(host, n, pattern);
    /* Same stream as the publishes: this copy waits for the last publish's copy out of src. */
    if (d->cuMemcpyHtoDAsync(at, host, n, k->stream) != CUDA_SUCCESS ||
        d->cuStreamSynchronize(k->stream) != CUDA_SUCCESS)
        die("fill");
}

/* One publish (packed when members > 1); sent to every consumer unless cancelled. */
static void publish(struct soak *k, int members, int cancel)
{
    vmmt_buffer b[MAX_MEMBERS];
    struct item *it;
    int i = free_item(k), st;

    if (i < 0) return;
    it = &k->items[i];
    memset(it, 0, sizeof *it);
    memset(b, 0, sizeof b);
    for (int m = 0; m < members; m++) {
        /* float32 tensors half the time, so packed members get aligned by element size. */
        int typed = rnd() & 1;
        uint64_t n = 1 + rnd() % MAX_BYTES;
        /* A quarter small and in whole 16-byte words: what a publish sends as one kernel. */
        if (rnd() % 4 == 0) n = 16 * (1 + rnd() % (VMMT__KERNEL_MAX_BYTES / 16));
        if (typed) n = 4 * (1 + (n - 1) / 4);
        b[m].ptr = k->src + (uint64_t)m * MAX_BYTES;
        b[m].nbytes = n;
        if (typed) {
            b[m].dtype = (vmmt_dtype){.code = 2, .bits = 32, .lanes = 1};
            b[m].ndim = 1;
            b[m].shape[0] = (int64_t)(n / 4);
        }
        it->pattern[m] = k->next_pattern++;
        it->nbytes[m] = n;
        fill(k, b[m].ptr, n, it->pattern[m]);
    }
    st = members == 1 ? vmmt_publish(k->pool, b, k->stream, it->desc)
                      : vmmt_publish_packed(k->pool, b, (size_t)members, k->stream, it->desc);
    if (st == VMMT_EFULL) {
        k->full++;
        return;
    }
    if (st != VMMT_OK) die("publish");
    k->published++;
    if (members > 1) k->packed++;
    if (cancel) {
        if (vmmt_cancel(k->pool, &it->desc[rnd() % (uint64_t)members]) != VMMT_OK) die("cancel");
        k->cancelled++;
        return;
    }
    it->used = 1;
    it->members = members;
    k->in_flight++;
    for (int r = 0; r < k->nconsumers; r++) {
        /* Evict after the last member, now and then: the whole publish is done with then. */
        int evict_after = rnd() % 16 == 0;
        it->left[r] = members;
        for (int m = 0; m < members; m++) {
            struct msg msg = {.kind = (rnd() % 8 == 0) ? MSG_DROP : MSG_CONSUME,
                              .pattern = it->pattern[m],
                              .item = (uint32_t)i,
                              .member = (uint32_t)m,
                              .nbytes = it->nbytes[m],
                              .desc = it->desc[m]};
            if (msg.kind == MSG_CONSUME && rnd() % 16 == 0) msg.flags |= MSG_REPLAY;
            if (evict_after && m == members - 1) msg.flags |= MSG_EVICT;
            send_msg(k, r, &msg);
        }
    }
}

/*
 * Send to a consumer without blocking on it: while its queue is full, read
 * replies, so that neither side can wait on the other forever.
 */
static void send_msg(struct soak *k, int rank, const struct msg *m)
{
    double until = now_s() + WAIT_MS / 1000.0;

    for (;;) {
        ssize_t n = send(k->fd[rank], m, sizeof *m, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n == (ssize_t)sizeof *m) return;
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) die("send");
        if (now_s() > until) {
            fprintf(stderr, "soak: consumer %d takes nothing for %d ms\n", rank, WAIT_MS);
            exit(2);
        }
        pump(k, 10);
    }
}

/* --successor-acks: the restarted consumer acknowledges what its predecessor left. */
static int successor_acks;

static void kill_and_restart(struct soak *k, int rank)
{
    int status;

    kill(k->pid[rank], SIGKILL);
    if (waitpid(k->pid[rank], &status, 0) != k->pid[rank]) die("waitpid");
    close(k->fd[rank]);
    k->kills++;
#ifdef VMMT_HAVE_RELEASE_RANK
    if (!successor_acks) {
        /* The library acknowledges for the dead rank; nothing it was sent is owed any more. */
        if (vmmt_pool_release_rank(k->pool, rank) != VMMT_OK) die("vmmt_pool_release_rank");
        start_consumer(k, rank);
        for (int i = 0; i < MAX_ITEMS; i++) {
            if (!k->items[i].used || k->items[i].left[rank] == 0) continue;
            k->left_acked += (uint64_t)k->items[i].left[rank];
            k->items[i].left[rank] = 0;
            k->items[i].released = 1;
            item_done(k, i);
        }
        return;
    }
#endif
    /*
     * The new consumer acknowledges, oldest first, the recently finished publishes and
     * every one in flight (whole groups): its predecessor may have reported a drop or a
     * consume done before the acknowledgement was written. Oldest first and all of those
     * in flight last: on a device control table an acknowledgement is a plain store of
     * the generation, and this order was once needed so that a slot's earlier occupant
     * was not acknowledged over its newer one. The library now refuses or skips such a
     * late acknowledgement (defect 7, test_late_ack); the order stays, as an engine's.
     */
    start_consumer(k, rank);
    for (uint64_t j = k->nrecent > RECENT ? k->nrecent - RECENT : 0; j < k->nrecent; j++) {
        const struct recent *rc = &k->recent[j % RECENT];
        for (int m = 0; m < rc->members; m++) {
            struct msg msg = {.kind = MSG_ACK_LEFT, .item = UINT32_MAX, .desc = rc->desc[m]};
            send_msg(k, rank, &msg);
        }
    }
    /* Then every publish in flight, those this rank reported done too (see above). */
    for (int i = 0; i < MAX_ITEMS; i++) {
        struct item *it = &k->items[i];
        int owed;
        if (!it->used) continue;
        owed = it->left[rank] > 0;
        if (owed) {
            it->left[rank] = it->members;
            it->released = 1;
        }
        for (int m = 0; m < it->members; m++) {
            struct msg msg = {.kind = MSG_ACK_LEFT,
                              .item = owed ? (uint32_t)i : UINT32_MAX,
                              .member = (uint32_t)m,
                              .desc = it->desc[m]};
            send_msg(k, rank, &msg);
            k->left_acked += (uint64_t)owed;
        }
    }
}

/*
 * A rank that owes something of a publish in flight, at random; -1 if none
 * does. Only such a kill leaves something for the release (or the successor)
 * to do, so every kill exercises it.
 */
static int owing_rank(struct soak *k)
{
    int owing[MAX_CONSUMERS], n = 0;

    for (int r = 0; r < k->nconsumers; r++) {
        for (int i = 0; i < MAX_ITEMS; i++) {
            if (k->items[i].used && k->items[i].left[r] > 0) {
                owing[n++] = r;
                break;
            }
        }
    }
    return n ? owing[rnd() % (uint64_t)n] : -1;
}

/* The paths a soak claims to take: each counter must end above 0. */
struct path {
    const char *what;
    uint64_t count;
    uint64_t refused; /* tries the library refused, where they are counted */
};

static int list_paths(const struct soak *k, const vmmt_pool_stats *st, struct path *out)
{
    int n = 0;

    out[n++] = (struct path){.what = "publishes", .count = k->published};
    out[n++] = (struct path){.what = "packed publishes", .count = k->packed};
    out[n++] =
        (struct path){.what = "packed publishes completed by every rank", .count = k->packed_done};
    out[n++] = (struct path){.what = "cancels", .count = k->cancelled};
    out[n++] = (struct path){.what = "consumes checked byte for byte", .count = k->checked};
    out[n++] = (struct path){.what = "drops (acknowledged without a copy)", .count = k->dropped};
    out[n++] = (struct path){.what = "replays refused", .count = k->replays_refused};
    out[n++] = (struct path){.what = "evictions", .count = k->evicted, .refused = k->evict_refused};
    out[n++] = (struct path){.what = "publishes refused full", .count = k->full};
    out[n++] = (struct path){.what = "kills", .count = k->kills};
    out[n++] = (struct path){.what = "descriptors left by dead consumers acknowledged",
                             .count = k->left_acked};
    out[n++] = (struct path){.what = "slices recycled", .count = st->recycled};
    out[n++] = (struct path){.what = "publishes as one kernel", .count = st->kernel_publishes};
#ifdef VMMT_HAVE_RELEASE_RANK
    /* The successor acknowledges instead; a release by the library itself may not come
     * then (the restarted rank's live link holds it), so it is not asked for. */
    if (!successor_acks) {
        out[n++] = (struct path){.what = "rank releases", .count = st->rank_releases};
        out[n++] =
            (struct path){.what = "slices released for dead ranks", .count = st->released_slices};
    }
#endif
    return n;
}

/* Paths not taken so far, named in buf (cap 0: only counted), with their refusals. */
static int paths_missing(const struct soak *k, const vmmt_pool_stats *st, char *buf, size_t cap)
{
    struct path p[16];
    int n = list_paths(k, st, p), missing = 0;
    size_t at = 0;

    if (cap) buf[0] = '\0';
    for (int i = 0; i < n; i++) {
        if (p[i].count > 0) continue;
        missing++;
        if (at < cap)
            at += (size_t)snprintf(buf + at, cap - at, "%s%s", missing > 1 ? ", " : "", p[i].what);
        if (at < cap && p[i].refused)
            at += (size_t)snprintf(buf + at, cap - at, " (%" PRIu64 " refused)", p[i].refused);
    }
    return missing;
}

/*
 * The producer's fd count once the broker has let go of the consumers. It
 * closes an exited consumer's link (and the pidfd it watched the process
 * with) on its own thread when it sees the process gone: a moment after the
 * producer reaped it, later still on a busy machine, where a count taken at
 * once came out high (with the broker's closes held back 100 ms it reads 11
 * -> 17 every time). So the count waits for no link to be open and, where
 * counts are exact, for the fds to be back, at most WAIT_MS: what is still
 * open then is a leak, which the caller reports.
 */
static int settled_fds(vmmt_pool *pool, int want, int exact)
{
    struct timespec pause = {0, 1000000};
    vmmt_pool_stats st;
    int fds = tu_count_fds();

    for (double until = now_s() + WAIT_MS / 1000.0; now_s() < until; fds = tu_count_fds()) {
        if (vmmt_pool_get_stats(pool, &st) != VMMT_OK) die("stats");
        if (st.consumer_links == 0 && (!exact || fds == want)) break;
        nanosleep(&pause, NULL);
    }
    return fds;
}

static int producer_main(double seconds, int nconsumers, uint64_t seed, int device_table)
{
    static struct soak k;
    const struct vmmt_drv *d;
    vmmt_pool_config cfg;
    vmmt_pool_stats st;
    tu_resources before;
    double start, ran, end, give_up, next_kill;
    char missing[1024];
    int status, failed = 0;
    int fds_after, maps_after, exact;

    memset(&k, 0, sizeof k);
    k.nconsumers = nconsumers;
    k.next_pattern = 1;
    rng_state = seed ? seed : 1;
    tu_use_test_driver();
    if (vmmt__ctx_enter(0) != VMMT_OK) die("init");
    d = vmmt__drv();
    vmmt_pool_config_init(&cfg);
    cfg.memory_size = 4 * MiB; /* small enough to run full now and then */
    cfg.consumer_count = nconsumers;
    cfg.max_slices = 64;
    cfg.device_control_table = device_table;
    if (vmmt_pool_create(&cfg, &k.pool) != VMMT_OK) die("pool create");
    if (d->cuStreamCreate(&k.stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) die("stream");
    if (d->cuMemAlloc(&k.src, SRC_BYTES) != CUDA_SUCCESS) die("src");
    tu_resources_take(&before);
    for (int r = 0; r < nconsumers; r++)
        start_consumer(&k, r);

    start = now_s();
    end = start + seconds;
    give_up = end + WAIT_MS / 1000.0;
    next_kill = now_s() + 0.5 + (double)(rnd() % 1500) / 1000.0;
    while (now_s() < end || (now_s() < give_up && vmmt_pool_get_stats(k.pool, &st) == VMMT_OK &&
                             paths_missing(&k, &st, NULL, 0) > 0)) {
        uint64_t dice = rnd() % 100;
        int victim;
        if (now_s() >= next_kill && (victim = owing_rank(&k)) >= 0) {
            kill_and_restart(&k, victim);
            next_kill = now_s() + 0.5 + (double)(rnd() % 1500) / 1000.0;
        }
        if (k.in_flight >= MAX_ITEMS - 1)
            pump(&k, 10);
        else if (dice < 60)
            publish(&k, 1, 0);
        else if (dice < 85)
            publish(&k, 2 + (int)(rnd() % (MAX_MEMBERS - 1)), 0);
        else if (dice < 95)
            publish(&k, 1 + (int)(rnd() % MAX_MEMBERS), 1);
        pump(&k, 0);
    }
    ran = now_s() - start;

    /* Settle: every reply in, every consumer told to stop, and reaped. */
    for (double until = now_s() + WAIT_MS / 1000.0; k.in_flight > 0 && now_s() < until;)
        pump(&k, 50);
    if (k.in_flight > 0) {
        fprintf(stderr, "soak: %d publishes still unanswered after %d ms\n", k.in_flight, WAIT_MS);
        failed = 1;
    }
    for (int r = 0; r < nconsumers; r++) {
        struct msg quit = {.kind = MSG_QUIT};
        send_msg(&k, r, &quit);
    }
    for (int r = 0; r < nconsumers; r++) {
        status = tu_wait(k.pid[r], WAIT_MS);
        close(k.fd[r]);
        if (status != 0) {
            fprintf(stderr, "soak: consumer %d ended with %d\n", r, status);
            failed = 1;
        }
    }
    if (vmmt_pool_drain(k.pool, WAIT_MS) != VMMT_OK) {
        fprintf(stderr, "soak: the pool does not drain: %s\n", vmmt_last_error());
        failed = 1;
    }
    exact = strcmp(vmmt_driver_name(), "emu") == 0;
    fds_after = settled_fds(k.pool, before.fds, exact);
    if (vmmt_pool_get_stats(k.pool, &st) != VMMT_OK) die("stats");
    maps_after = tu_count_maps();
    printf("soak: %.0f s, %d consumers, seed %" PRIu64 ": %" PRIu64 " publishes (%" PRIu64
           " packed, %" PRIu64 " of them completed by every rank, %" PRIu64 " cancelled), %" PRIu64
           " consumes checked byte for byte, %" PRIu64 " replays refused, %" PRIu64
           " drops, %" PRIu64 " evictions (%" PRIu64 " refused), %" PRIu64 " refused full, %" PRIu64
           " kills survived, %" PRIu64 " descriptors left by dead consumers acknowledged, %" PRIu64
           " wrong bytes, %" PRIu64 " failed calls; pool: %u in flight, %" PRIu64
           " recycled, %" PRIu64 " publishes as one kernel, %" PRIu64 " rank releases (%" PRIu64
           " slices); fds %d -> %d, mappings %d -> %d\n",
           ran, nconsumers, seed, k.published, k.packed, k.packed_done, k.cancelled, k.checked,
           k.replays_refused, k.dropped, k.evicted, k.evict_refused, k.full, k.kills, k.left_acked,
           k.wrong_bytes, k.failures, st.in_flight, st.recycled, st.kernel_publishes,
           st.rank_releases, st.released_slices, before.fds, fds_after, before.maps, maps_after);
    if (st.consumer_links != 0) {
        fprintf(stderr, "soak: %u liveness links still open with every consumer gone\n",
                st.consumer_links);
        failed = 1;
    }
    if (k.wrong_bytes || k.failures || st.in_flight != 0 || (exact && fds_after != before.fds) ||
        (exact && maps_after != before.maps && !MAPS_GROW_ON_THEIR_OWN))
        failed = 1;
    /* Nothing was refused that had to succeed: an eviction with the pool unused. */
    if (k.evict_refused) {
        fprintf(stderr,
                "soak: %" PRIu64 " evictions refused with nothing of the pool in use (the "
                "consumers printed why)\n",
                k.evict_refused);
        failed = 1;
    }
    if (paths_missing(&k, &st, missing, sizeof missing) > 0) {
        fprintf(stderr, "soak: paths never taken (their counters are 0): %s\n", missing);
        failed = 1;
    }
    d->cuMemFree(k.src);
    d->cuStreamDestroy(k.stream);
    vmmt_pool_destroy(k.pool);
    vmmt__ctx_leave();
    printf("soak: %s\n", failed ? "FAILED" : "passed");
    return failed;
}

int main(int argc, char **argv)
{
    const char *env = getenv("VMMT_SOAK_SECONDS");
    double seconds = env ? atof(env) : 60;
    int consumers = 3, device_table = 0;
    uint64_t seed = (uint64_t)time(NULL);

    setvbuf(stdout, NULL, _IOLBF, 0);
    /* The emulator by default, whose live counters every consumer checks at
     * exit; VMMT_TEST_DRIVER=cuda runs it on a GPU (tests/gpu/run), where
     * those counters read 0 and the driver's own descriptors and mappings
     * come and go, so there they are printed, not compared. Consumers
     * inherit the choice. */
    setenv("VMMT_TEST_DRIVER", "emu", 0);
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--consumer") == 0 && i + 1 < argc)
            return consumer_main(atoi(argv[i + 1]));
        if (strcmp(argv[i], "--seconds") == 0 && i + 1 < argc)
            seconds = atof(argv[++i]);
        else if (strcmp(argv[i], "--consumers") == 0 && i + 1 < argc)
            consumers = atoi(argv[++i]);
        else if (strcmp(argv[i], "--device-table") == 0)
            device_table = 1;
        else if (strcmp(argv[i], "--successor-acks") == 0)
            successor_acks = 1;
        else if (strcmp(argv[i], "--seed") == 0 && i + 1 < argc)
            seed = strtoull(argv[++i], NULL, 0);
        else {
            fprintf(stderr,
                    "usage: %s [--seconds N] [--consumers N] [--seed N] [--device-table] "
                    "[--successor-acks]\n",
                    argv[0]);
            return 2;
        }
    }
    if (consumers < 1 || consumers > MAX_CONSUMERS || seconds <= 0) {
        fprintf(stderr, "soak: 1 to %d consumers, and a positive duration\n", MAX_CONSUMERS);
        return 2;
    }
    return producer_main(seconds, consumers, seed, device_table);
}
