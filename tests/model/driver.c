/*
 * model_test: a seeded, reproducible randomized test of the hand-off. This
 * process holds the reference model (model.c) and decides every step from
 * the seed; a producer process and 2-3 consumer processes (children.c, this
 * same program started with --producer / --consumer) run the real library
 * and answer. Every answer is judged against the model; the first one it
 * does not allow is a finding: the seed, the step and a command that
 * replays it are printed, and the test fails.
 *
 *     model_test [--seed N] [--kind K] [--steps N | --seconds S]
 *                [--skip op,op,...] [--strict-end] [--verbose]
 *
 * Kinds (one per pool; "all" picks one per pool): host_table (fixed pool,
 * control table in shared host memory), device_table (control table in
 * device memory, stream-ordered), sync (device table, the emulator refusing
 * stream waits on imported memory: publishes synchronize), host (a host
 * pool), elastic (an elastic pool of 2 MiB chunks given back after 20 ms
 * idle), fabric (FABRIC handles on the emulator). Every kind gets the same
 * operations: publish (single, packed, from device or host memory),
 * reserve/commit/cancel, cancel, consume (every byte checked), acknowledge
 * without consume, drop, replays of any earlier descriptor to any consumer
 * for any ranks, forged descriptors (forge.c), evict, kill -9 of a consumer
 * and its restart, kill -9 of the producer (also while copies are queued
 * behind a gate), release of ranks, reclaim, shutdown; at quiescent points
 * nothing may stay in flight, and at each pool's end every process must be
 * back to what it held before.
 *
 * The counters printed at the end must show every path taken; one that was
 * not fails the test. docs/reliability.md ("The model") describes it.
 */
#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "children.h"
#include "forge.h"
#include "model.h"
#include "rng.h"
#include "testutil.h"

#define ANSWER_MS   90000 /* any one answer; the children's own waits are far shorter */
#define RETRY_MS    15000 /* a publish or reserve the model says must fit */
#define IDLE_MS     20000 /* nothing in flight at a quiescent point */
#define CONS_TMO_MS 1500  /* the consumers' timeout_ms */

enum kind { K_HOST_TABLE, K_DEVICE_TABLE, K_SYNC, K_HOST, K_ELASTIC, K_FABRIC, K_COUNT };
static const char *const kind_names[K_COUNT] = {"host_table", "device_table", "sync",
                                                "host",       "elastic",      "fabric"};

/* ---------------------------------------------------------------- counters */

#define COUNTERS(X)                                                                                \
    X(instances, "pools made", 1)                                                                  \
    X(publish, "single publishes", 1)                                                              \
    X(packed, "packed publishes", 1)                                                               \
    X(host_source, "publishes from host memory", 1)                                                \
    X(kernel, "publishes as one kernel (copy and ready word)", 6)                                  \
    X(kernel_gated, "of those, queued behind a gate", 7)                                           \
    X(full, "publishes refused full where the model is full", 1)                                   \
    X(reserve, "reservations", 1)                                                                  \
    X(commit, "commits", 1)                                                                        \
    X(commit_again, "second commits refused", 1)                                                   \
    X(res_cancel, "reservations cancelled", 1)                                                     \
    X(cancel, "cancels", 1)                                                                        \
    X(cancel_replay, "cancels of descriptors no longer live", 1)                                   \
    X(cancel_taken, "cancels of descriptors a consumer's gated copy had taken", 1)                 \
    X(cancel_taken_held, "of those, the pool full until the copy was acknowledged", 8)             \
    X(cancel_taken_half, "of those, half groups refused their next member", 1)                     \
    X(cancel_taken_released, "of those, the taker's rank released while its copies were held", 1)  \
    X(cancel_taken_killed, "of those, the taker killed while its copies were held", 1)             \
    X(check_cancel_failed, "checks VMMT_EFAILED of a copy whose slice the cancel freed", 0)        \
    X(consume_ok, "consumes OK, bytes checked", 1)                                                 \
    X(ack_ok, "acknowledgements without consume OK", 1)                                            \
    X(packed_done, "packed groups completed by their last member", 1)                              \
    X(drop, "descriptors dropped (released later)", 1)                                             \
    X(replay, "replays sent", 1)                                                                   \
    X(replay_refused, "replays refused", 1)                                                        \
    X(replay_ok, "replays OK (not yet acknowledged by those ranks)", 0)                            \
    X(forged, "forgeries sent", 1)                                                                 \
    X(forged_invalid, "invalid forgeries refused", 1)                                              \
    X(forged_valid_refused, "valid forgeries refused", 1)                                          \
    X(forged_ok, "forgeries OK (a finding: records are sealed)", 0)                                \
    X(forged_ahead, "forgeries ahead of their slot refused", 1)                                    \
    X(forged_geometry, "forged geometries refused", 1)                                             \
    X(token, "reservation tokens refused by consumers", 1)                                         \
    X(bad_ranks, "rank ranges outside the pool refused", 1)                                        \
    X(bad_list, "rank lists outside the pool or naming a rank twice refused", 1)                   \
    X(list, "consumes and acknowledgements for a rank list", 1)                                    \
    X(list_gap, "of those, ranks not consecutive", 1)                                              \
    X(list_refused_part, "list calls refused where some of the ranks still owed it", 1)            \
    X(check_ok, "checks OK", 1)                                                                    \
    X(check_failed, "checks VMMT_EFAILED after a producer died mid-copy", 2)                       \
    X(check_released, "checks VMMT_EFAILED after a rank of the copy was released", 0)              \
    X(check_group_left, "checks VMMT_EFAILED of a member of a group left open", 0)                 \
    X(unseen_ok, "OKs before another process's ack showed (device table)", 0)                      \
    X(check_unseen, "checks VMMT_EFAILED of such a copy", 0)                                       \
    X(check_raced, "checks VMMT_EFAILED of a copy whose rank such a one completed", 0)             \
    X(flush, "flushes of completed copies' acknowledgements", 1)                                   \
    X(evict_ok, "evictions", 1)                                                                    \
    X(evict_refused, "evictions refused (copy queued or group half consumed)", 1)                  \
    X(consumer_kill, "consumers killed and restarted", 1)                                          \
    X(auto_release, "dead consumers released by the pool itself", 3)                               \
    X(release_rank, "vmmt_pool_release_rank calls", 1)                                             \
    X(producer_kill, "producers killed", 1)                                                        \
    X(gated_open, "publishes consumed behind a gate, then landed", 4)                              \
    X(gated_kill, "producers killed with copies queued behind a gate", 2)                          \
    X(shutdown, "shutdowns", 1)                                                                    \
    X(after_end_ok, "consumes OK after the pool ended, bytes right", 0)                            \
    X(reclaim, "reclaims", 1)                                                                      \
    X(stats, "statistics checked", 1)                                                              \
    X(quiescent, "quiescent points: 0 in flight", 1)                                               \
    X(chunk_cycle, "elastic chunks all given back, then made again", 5)                            \
    X(chunk_remade_held, "consumes OK in a chunk made again while a copy from another was queued", \
      5)                                                                                           \
    X(leak_check, "processes back to baseline at a pool's end", 1)

enum {
#define X(name, text, req) CTR_##name,
    COUNTERS(X)
#undef X
        CTR_COUNT
};
static const char *const ctr_text[] = {
#define X(name, text, req) text,
    COUNTERS(X)
#undef X
};
/* 0: informative; 1: every kind; 2: kinds whose producer death mid-copy is seen (gated kills);
 * 3: kinds with a broker (POSIX_FD); 4: kinds that hand off stream-ordered; 5: elastic;
 * 6: device pools (a host pool copies with the CPU); 7: device pools with gates (4 and 6);
 * 8: kinds with a shared host table. */
static const int ctr_req[] = {
#define X(name, text, req) req,
    COUNTERS(X)
#undef X
};

/* ---------------------------------------------------------------- run state */

struct child {
    pid_t pid;
    int fd, alive;
    uint32_t seq;
    char env[64]; /* K=V for this child only */
};

struct deferred {
    int seat, id, rec, member;
};

static struct {
    uint64_t seed, rng;
    int kind_arg; /* K_COUNT: all */
    long steps_max, step;
    double seconds, t0;
    int strict_end, verbose, keep_going, findings;
    char skip[512];
    char self[4096];
    char argv_line[1024];
    /* the pool now */
    int kind;
    struct mt_params prm;
    vmmt_pool_stats st0;
    int can_gate, has_broker, host_table;
    int ending; /* 0 normal, 1 shutdown, 2 kill */
    int one_ahead_left;
    struct child prod, cons[MT_MAX_SEATS];
    int nseats;
    uint64_t next_uid;
    struct deferred def[MT_MAX_SEATS * MT_MAX_DEFER];
    int ndef;
    uint64_t ctr[CTR_COUNT];
    uint64_t refused[16];
    int kinds_run[K_COUNT];
} R;

static struct model M;
static struct mt_reply rep;

/* The real driver (tests/gpu/run): no emulator knobs, no FABRIC. */
static int on_cuda(void)
{
    const char *d = getenv("VMMT_TEST_DRIVER");
    return d != NULL && strcmp(d, "cuda") == 0;
}

static uint64_t rnd(void)
{
    return tu_rng_next(&R.rng);
}

static uint64_t below(uint64_t n)
{
    return n ? rnd() % n : 0;
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static int skipped(const char *op)
{
    const char *p = R.skip;
    size_t n = strlen(op);
    while ((p = strstr(p, op)) != NULL) {
        if ((p == R.skip || p[-1] == ',') && (p[n] == ',' || p[n] == '\0')) return 1;
        p += n;
    }
    return 0;
}

static const char *st_name(int st)
{
    static char buf[8][48];
    static int i;
    char *b = buf[i++ % 8];
    static const char *const names[] = {
        "VMMT_OK",        "VMMT_EINVAL",  "VMMT_ENODRIVER", "VMMT_ENODEV",
        "VMMT_ENOTSUP",   "VMMT_ECUDA",   "VMMT_ENOMEM",    "VMMT_EFULL",
        "VMMT_ETIMEDOUT", "VMMT_EFAILED", "VMMT_ECLOSED",   "VMMT_EPROTO",
        "VMMT_EPERM",     "VMMT_ESYS",    "VMMT_ESTATE",    "VMMT_ETOOBIG"};
    if (st <= 0 && st >= -15) return names[-st];
    snprintf(b, 48, "status %d", st);
    return b;
}

static const char *allowed_text(unsigned allow)
{
    static char buf[4][256];
    static int i;
    char *b = buf[i++ % 4];
    size_t n = 0;
    b[0] = '\0';
    for (int k = 0; k < 16; k++)
        if (allow & (1u << k))
            n += (size_t)snprintf(b + n, 256 - n, "%s%s", n ? "|" : "", st_name(-k) + 5);
    return b;
}

static const char *ranks_text(unsigned R_)
{
    static char buf[4][16];
    static int i;
    char *b = buf[i++ % 4];
    size_t n = 0;
    for (int r = 0; r < MT_MAX_RANKS; r++)
        if (R_ & (1u << r)) n += (size_t)snprintf(b + n, 16 - n, "%s%d", n ? "," : "", r);
    if (n == 0) snprintf(b, 16, "-");
    return b;
}

static void print_counters(FILE *f)
{
    fprintf(f, "model_test counters (seed %" PRIu64 "):\n", R.seed);
    for (int i = 0; i < CTR_COUNT; i++)
        fprintf(f, "  %-58s %" PRIu64 "\n", ctr_text[i], R.ctr[i]);
    fprintf(f, "  refusals by status:");
    for (int k = 1; k < 16; k++)
        if (R.refused[k]) fprintf(f, " %s %" PRIu64, st_name(-k) + 5, R.refused[k]);
    fprintf(f, "\n  OKs checked against the model: %" PRIu64 "\n",
            R.ctr[CTR_consume_ok] + R.ctr[CTR_ack_ok] + R.ctr[CTR_forged_ok] +
                R.ctr[CTR_after_end_ok] + R.ctr[CTR_check_ok]);
}

static void kill_all(void)
{
    struct child *all[1 + MT_MAX_SEATS] = {&R.prod, &R.cons[0], &R.cons[1], &R.cons[2]};
    for (int i = 0; i < 1 + MT_MAX_SEATS; i++) {
        if (!all[i]->alive) continue;
        kill(all[i]->pid, SIGKILL);
        waitpid(all[i]->pid, NULL, 0);
        close(all[i]->fd);
        all[i]->alive = 0;
    }
}

static void replay_line(FILE *f)
{
    fprintf(f, "replay: %s --seed %" PRIu64 " --kind %s --steps %ld%s%s%s%s\n", R.self, R.seed,
            R.kind_arg == K_COUNT ? "all" : kind_names[R.kind_arg], R.step + 1,
            R.strict_end ? " --strict-end" : "", R.keep_going ? " --keep-going" : "",
            R.skip[0] ? " --skip " : "", R.skip);
}

/*
 * A finding: an answer the model does not allow. The run stops at the first,
 * unless --keep-going: then each distinct finding (its message without its
 * numbers) is printed once and the run goes on, the model left as it was
 * before the answer; findings_stop() is for those after which the model and
 * the library can no longer agree (a slot handed out twice, a process gone).
 */
static void report(int stop, const char *fmt, va_list ap)
{
    static char keys[64][160];
    static int nkeys;
    char msg[2048], key[160];
    size_t k = 0;
    int fresh = 1;

    vsnprintf(msg, sizeof msg, fmt, ap);
    /* The key: the message without numbers, uids or the library's text. */
    for (const char *p = msg; *p && k + 1 < sizeof key && strncmp(p, "library:", 8) != 0; p++) {
        if ((*p >= '0' && *p <= '9') || *p == ',' ||
            ((*p >= 'a' && *p <= 'f') && p[1] >= '0' && p[1] <= 'f' &&
             isxdigit((unsigned char)p[1]) && isxdigit((unsigned char)p[2])))
            continue;
        key[k++] = *p;
    }
    key[k] = '\0';
    for (int i = 0; i < nkeys; i++)
        if (strcmp(keys[i], key) == 0) fresh = 0;
    R.findings++;
    if (fresh && nkeys < 64) snprintf(keys[nkeys++], sizeof keys[0], "%s", key);
    if (fresh || stop || !R.keep_going) {
        fflush(stdout);
        fprintf(stderr, "\nFINDING at step %ld (seed %" PRIu64 ", pool #%d of kind %s): %s\n",
                R.step, R.seed, M.ninst - 1, kind_names[R.kind], msg);
        replay_line(stderr);
    }
    if (!stop && R.keep_going) return;
    kill_all();
    print_counters(stderr);
    fprintf(stderr, "model_test: FAILED (%d finding(s), %d distinct)\n", R.findings, nkeys);
    exit(1);
}

static void finding(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void finding(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    report(0, fmt, ap);
    va_end(ap);
}

static void finding_stop(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void finding_stop(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    report(1, fmt, ap);
    va_end(ap);
    exit(1);
}

static void fatal(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void fatal(const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "model_test: setup failed at step %ld (seed %" PRIu64 "): ", R.step, R.seed);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n");
    kill_all();
    exit(2);
}

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...)
{
    va_list ap;
    if (!R.verbose) return;
    printf("[%ld] ", R.step);
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    printf("\n");
}

/* ---------------------------------------------------------------- children */

static void spawn(struct child *c, char *const argv[])
{
    int sv[2];

    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) fatal("socketpair");
    c->pid = fork();
    if (c->pid < 0) fatal("fork");
    if (c->pid == 0) {
        if (dup2(sv[1], MT_CHILD_FD) < 0) _exit(126);
        if (c->env[0]) putenv(c->env);
        /* This process's own binary, not the file at its path: a rebuild that
         * relinked it mid-run made every later child fail to start (exit 127). */
        execv("/proc/self/exe", argv);
        _exit(127);
    }
    close(sv[1]);
    c->fd = sv[0];
    c->alive = 1;
    c->seq = 0;
}

static const char *child_name(const struct child *c)
{
    static char buf[32];
    if (c == &R.prod) return "the producer";
    snprintf(buf, sizeof buf, "consumer %d", (int)(c - R.cons));
    return buf;
}

static void call(struct child *c, struct mt_cmd *cmd)
{
    struct pollfd p = {.fd = c->fd, .events = POLLIN};
    ssize_t n;

    cmd->seq = ++c->seq;
    if (send(c->fd, cmd, sizeof *cmd, MSG_NOSIGNAL) != (ssize_t)sizeof *cmd)
        finding_stop("%s is gone (send: %s)", child_name(c), strerror(errno));
    for (;;) {
        int k = poll(&p, 1, ANSWER_MS);
        if (k < 0 && errno == EINTR) continue;
        if (k == 0)
            finding_stop("%s did not answer command %u within %d s", child_name(c), cmd->op,
                         ANSWER_MS / 1000);
        break;
    }
    n = recv(c->fd, &rep, sizeof rep, 0);
    if (n != (ssize_t)sizeof rep) {
        int status = 0;
        waitpid(c->pid, &status, 0);
        c->alive = 0;
        finding_stop("%s died during command %u (%s %d): a crash in the library?", child_name(c),
                     cmd->op, WIFSIGNALED(status) ? "signal" : "exit",
                     WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
    }
    if (rep.seq != cmd->seq) finding_stop("%s answered out of turn", child_name(c));
}

static void reap(struct child *c)
{
    close(c->fd);
    if (tu_wait(c->pid, 30000) != 0) finding_stop("%s did not exit cleanly", child_name(c));
    c->alive = 0;
}

static void start_consumer(int s)
{
    char seat[16], tmo[16], unit[32];
    char *argv[] = {R.self, "--consumer", seat, tmo, unit, NULL};
    snprintf(seat, sizeof seat, "%d", s);
    snprintf(tmo, sizeof tmo, "%d", CONS_TMO_MS);
    /* Destinations of the largest slice: replays of earlier pools' descriptors fit too. */
    snprintf(unit, sizeof unit, "%" PRIu64, (uint64_t)MT_MAX_UNIT);
    spawn(&R.cons[s], argv);
}

/* ---------------------------------------------------------------- helpers */

static struct m_inst *cur(void)
{
    return m_cur(&M);
}

static int popcount(unsigned x)
{
    return __builtin_popcount(x);
}

static int is_run(unsigned mask)
{
    unsigned low = mask >> __builtin_ctz(mask);
    return (low & (low + 1)) == 0;
}

/*
 * The call's ranks: a run (first, count, or VMMT_ALL_RANKS), or a list
 * (vmmt_consume_ranks), which ranks that are not consecutive need and any
 * set may take, in either order. The model judges a set, whichever way it
 * is asked: all of it or none (a refusal leaves every rank of it as it was).
 */
static void set_ranks(struct mt_cmd *c, unsigned mask, unsigned all, int list)
{
    if (list || !is_run(mask) || below(4) == 0) {
        c->list = mask | (below(2) ? MT_LIST_DOWN : 0);
        R.ctr[CTR_list]++;
        if (!is_run(mask)) R.ctr[CTR_list_gap]++;
        return;
    }
    if (mask == all && below(3) == 0) {
        c->first = VMMT_ALL_RANKS;
        c->count = 0;
        return;
    }
    c->first = __builtin_ctz(mask);
    c->count = popcount(mask);
}

/* Ranks for a replay or forgery: one of the seat's, all of them, any set, or any range. */
static unsigned pick_ranks(int ranks, unsigned role)
{
    unsigned all = (1u << ranks) - 1;
    uint64_t d = below(12);
    if (d < 2) return all;
    if (d >= 10) return 1u + (unsigned)below(all); /* 1..all */
    if (d < 6 && (role & all)) {
        int r;
        do
            r = (int)below((uint64_t)ranks);
        while (!(role & (1u << r)));
        return 1u << r;
    }
    int a = (int)below((uint64_t)ranks);
    int b = a + 1 + (int)below((uint64_t)(ranks - a));
    return ((1u << b) - 1) & ~((1u << a) - 1);
}

static int live_seat_random(void)
{
    int n = 0, alive[MT_MAX_SEATS];
    for (int s = 0; s < R.nseats; s++)
        if (M.seat[s].alive) alive[n++] = s;
    return n ? alive[below((uint64_t)n)] : -1;
}

static int touched_seat_random(void)
{
    int n = 0, seats[MT_MAX_SEATS];
    for (int s = 0; s < R.nseats; s++)
        if (M.seat[s].alive && M.seat[s].touched) seats[n++] = s;
    return n ? seats[below((uint64_t)n)] : -1;
}

static void note_refusal(int st)
{
    if (st < 0 && st >= -15) R.refused[-st]++;
}

static void cmd_init(struct mt_cmd *c, uint32_t op)
{
    memset(c, 0, sizeof *c);
    c->op = op;
}

static void prod_call(struct mt_cmd *c)
{
    if (!R.prod.alive) fatal("a producer command after its death");
    call(&R.prod, c);
}

/*
 * The LIVE records of the current pool in publish order. The slots the library
 * hands out depend on when its recycler ran, so no choice of the driver may
 * follow slot order: the same seed must make the same choices.
 */
static int live_list(int *out, int need_landed)
{
    struct m_inst *in = cur();
    int n = 0;
    for (uint32_t s = 0; s < in->slots; s++) {
        int i = in->slot_rec[s];
        if (i >= 0 && m_rec(&M, i)->state == M_LIVE && (!need_landed || m_rec(&M, i)->landed))
            out[n++] = i;
    }
    for (int a = 1; a < n; a++)
        for (int b = a; b > 0 && out[b - 1] > out[b]; b--) {
            int t = out[b];
            out[b] = out[b - 1];
            out[b - 1] = t;
        }
    return n;
}

static int random_live(int need_landed)
{
    int cand[M_SLOTS], n = live_list(cand, need_landed);
    return n ? cand[below((uint64_t)n)] : -1;
}

/* Any remembered record, of the current pool with probability p_cur percent. */
static int random_record(int p_cur)
{
    int n = M.nrec < M_RECS ? M.nrec : M_RECS;
    if (n == 0) return -1;
    for (int tries = 0; tries < 64; tries++) {
        int i = M.nrec - 1 - (int)below((uint64_t)n);
        struct m_rec *r = m_rec(&M, i);
        if (!r->used) continue;
        if ((r->inst == M.cur) == (below(100) < (uint64_t)p_cur)) return i;
    }
    return M.nrec - 1;
}

static void pool_id_seen(const vmmt_desc *d)
{
    struct m_inst *in = cur();
    static const uint8_t zero[16];
    if (memcmp(in->pool_id, zero, 16) == 0) memcpy(in->pool_id, d->bytes + MT_OFF_POOL_ID, 16);
    if (memcmp(in->pool_id, d->bytes + MT_OFF_POOL_ID, 16) != 0)
        finding_stop("a descriptor of this pool names another pool id");
}

static int pool_known(void)
{
    static const uint8_t zero[16];
    return memcmp(cur()->pool_id, zero, 16) != 0;
}

/* ---------------------------------------------------------------- consumer calls */

static void recover_seat(int s);
static void diagnose_stuck(void);

static struct m_copy *add_copy(int s, int rec, int member, int expect, unsigned ranks)
{
    struct m_seat *st = &M.seat[s];
    struct m_copy *c = &st->copies[st->ncopies < M_COPIES ? st->ncopies++ : (int)below(M_COPIES)];
    c->rec = rec;
    c->member = member;
    c->expect = expect;
    c->ranks = ranks;
    c->at = M.clock;
    c->ctx = st->ctx;
    c->unseen = 0;
    return c;
}

/*
 * A member this seat copied of a packed group it never completed, whose ranks
 * another party acknowledged since (another process of the rank completed
 * it, a cancel, a release) or that is no longer LIVE: the slot may have
 * moved on under the copy, and no acknowledgement of this seat's looked, so
 * vmmt_consumer_check may say VMMT_EFAILED for it (docs/design.md, the case
 * not covered; test_attack_outside3).
 */
static int left_open_in(const struct m_copy *cp, const struct m_rec *r, uint32_t ctx)
{
    int done = 0;
    unsigned ranks = m_prog_ranks_ctx(&M, cp->rec, ctx, &done);

    if (r->members <= 1 || ranks == 0 || done) return 0;
    return r->state != M_LIVE || (r->acked & ranks) != 0;
}

/*
 * The import the copy was made in (an evict since, of a group forgotten as
 * stale, makes the seat another, and the library remembers the failure past
 * it), or the seat's import now: a check names a descriptor, not a copy, so
 * one consumed again for other ranks in a later import (a group still open
 * there) is judged by that one (seed 6001 of the by-hand run).
 */
static int group_left_open(const struct m_copy *cp, const struct m_rec *r, int s)
{
    return left_open_in(cp, r, cp->ctx) || left_open_in(cp, r, M.seat[s].ctx);
}

/*
 * Were the copy's ranks released (vmmt_pool_release_rank, or the pool itself
 * for a dead holder) after the copy was made? Then the slot may have been
 * recycled before this process wrote its acknowledgement, which finds the
 * slot moved on and cannot tell whether the slice was reused under the copy:
 * vmmt_consumer_check may then say VMMT_EFAILED (docs/design.md,
 * "Invariants": releasing a live rank is the case the library reports, not
 * prevents). A shared table: all of them. One rank left is a word this
 * process took (TAKEN) and only its own acknowledgement completes, after the
 * copy, so the slot was still the occupant's when that acknowledgement
 * looked: OK (test_attack_outside3, release_of_later_taken_ranks: it said
 * EFAILED when this process's store of rank 0 completed the slot). A device
 * table has no taken words: another process of the rank may complete it, so
 * any one will do.
 */
static int released_since(const struct m_copy *cp, const struct m_rec *r)
{
    const struct m_inst *in = &M.inst[r->inst];
    int any = 0, all = 1;

    for (int k = 0; k < MT_MAX_RANKS; k++) {
        if (!(cp->ranks & (1u << k))) continue;
        if (in->released_at[k] > cp->at)
            any = 1;
        else
            all = 0;
    }
    return in->shared_table ? any && all : any;
}

/*
 * Consume (or acknowledge, ack != 0) member `member` of record `rec` at seat
 * s for ranks mask `Rm`, and judge the answer. flags MT_F_DEFER: queued
 * behind a gate, verified later. Returns the status.
 */
static int real_call(int s, int rec, int member, unsigned Rm, int ack, int flags, const char *what)
{
    struct m_rec *r = m_rec(&M, rec);
    struct m_inst *in = &M.inst[r->inst];
    struct m_verdict v = m_judge(&M, rec, member, Rm, s);
    int ended = in->ended != M_OPEN;
    int was_acked = (r->acked & Rm) != 0;
    struct mt_cmd c;
    int st;

    if (m_conflicts(&M, rec, Rm, s)) fatal("driver: a call the model cannot judge");
    cmd_init(&c, ack ? C_ACK : C_CONSUME);
    set_ranks(&c, Rm, m_all(in), flags & MT_F_LIST);
    /* A deferred refusal's destination is not read back: its stream may be held by a gate. */
    c.flags = flags | ((flags & MT_F_DEFER) ? 0 : MT_F_POISON);
    c.uid[0] = r->uid[member];
    c.nbytes[0] = r->nbytes[member];
    c.desc = r->desc[member];
    call(&R.cons[s], &c);
    st = rep.status;
    if (r->inst == M.cur) M.seat[s].touched = 1;
    say("%s: consumer %d %s rec %d.%d (slot %u gen %u) ranks %s -> %s", what, s,
        ack ? "acks" : "consumes", rec, member, r->slot, r->gen, ranks_text(Rm), st_name(st));
    if (!(v.allow & M_A(st))) {
        finding("%s: consumer %d %s member %d of publish uid %" PRIx64
                " (pool #%d, slot %u, generation %u) for ranks %s: got %s, the model allows %s "
                "(%s); library: %s",
                what, s, ack ? "acknowledges" : "consumes", member, r->uid[member], in->number,
                r->slot, r->gen, ranks_text(Rm), st_name(st), allowed_text(v.allow), v.why,
                rep.msg);
        /* --keep-going: the model stays as it was, but for the ranks the process now holds. */
        if (st == VMMT_OK && !ended) {
            m_hold(&M, s, Rm);
            M.seat[s].uncertain = 1;
        }
        if (st == VMMT_OK && !ack && !(flags & MT_F_DEFER) && !rep.stream_ok) recover_seat(s);
        return st;
    }
    if (st != VMMT_OK) {
        note_refusal(st);
        /* The model holds the ranks of a refused set as they were: a later call for the
         * ones still owing must be OK, so a refusal that did some of them is found. */
        if (c.list != 0 && st == VMMT_ESTATE && r->state == M_LIVE && (r->acked & Rm) != 0 &&
            (r->acked & Rm) != Rm)
            R.ctr[CTR_list_refused_part]++;
        if (!ack && (st == VMMT_ESTATE || st == VMMT_EPROTO || st == VMMT_EINVAL) && !rep.poison_ok)
            finding("%s: a consume refused with %s wrote into the destination (%s)", what,
                    st_name(st), rep.msg);
        if (st != VMMT_ESTATE && st != VMMT_EPROTO && st != VMMT_EINVAL && !ended)
            M.seat[s].uncertain = 1;
        return st;
    }
    if (!ack && !(flags & MT_F_DEFER)) {
        if (!rep.stream_ok || !rep.verified) {
            finding("%s: consume OK but the stream failed afterwards (%s)", what, rep.msg);
            recover_seat(s);
            return st;
        }
        if (r->landed && (rep.first_bad != rep.nbytes || rep.found_uid != r->uid[member]))
            finding("%s: consume OK of publish uid %" PRIx64 " (slot %u gen %u) but the bytes "
                    "are not its own: first wrong byte at %" PRIu64 " of %" PRIu64
                    ", the buffer names publish uid %" PRIx64,
                    what, r->uid[member], r->slot, r->gen, rep.first_bad, rep.nbytes,
                    rep.found_uid);
        if (r->landed && rep.status2 != VMMT_OK)
            finding("%s: vmmt_consumer_check says %s for bytes that arrived right", what,
                    st_name(rep.status2));
        if (!r->landed && rep.status2 != VMMT_EFAILED)
            finding("%s: consume OK of publish uid %" PRIx64 " whose producer died before its "
                    "copy ran, and vmmt_consumer_check says %s, not VMMT_EFAILED: the bytes "
                    "are not the producer's",
                    what, r->uid[member], st_name(rep.status2));
        if (r->landed) R.ctr[CTR_check_ok]++;
        add_copy(s, rec, member, r->landed ? VMMT_OK : VMMT_EFAILED, Rm)->unseen = v.unseen;
    }
    if (v.unseen) {
        R.ctr[CTR_unseen_ok]++;
        r->raced |= Rm;
    }
    if (ended)
        R.ctr[CTR_after_end_ok]++;
    else if (ack)
        R.ctr[CTR_ack_ok]++;
    else
        R.ctr[CTR_consume_ok]++;
    (void)was_acked;
    {
        int before = r->members > 1 && (r->acked & Rm) != Rm;
        m_took(&M, rec, member, Rm, s);
        if (before && (r->acked & Rm) == Rm) R.ctr[CTR_packed_done]++;
    }
    return st;
}

/* Adjust Rm so that a half-consumed group in the seat's process keeps its ranks. */
static unsigned keep_group_ranks(int rec, unsigned Rm, int s)
{
    unsigned y = m_prog_ranks(&M, rec, s, NULL);
    return y ? y : Rm;
}

/* ---------------------------------------------------------------- producer ops */

static void split_unit(int members, uint64_t *nbytes)
{
    uint64_t left = R.prm.unit;
    for (int m = 0; m < members; m++) {
        uint64_t rest = (uint64_t)(members - m - 1) * 16;
        if (m == members - 1) {
            nbytes[m] = left;
        } else {
            uint64_t most = left - rest;
            nbytes[m] = 16 * (1 + below(most / 16 > 1 ? most / 16 - 1 : 1));
        }
        left -= nbytes[m];
    }
}

static const char *check_descs(int members, const vmmt_desc *d)
{
    uint32_t slot = (uint32_t)mt_get(&d[0], MT_OFF_SLOT, 4);
    uint32_t gen = (uint32_t)mt_get(&d[0], MT_OFF_GENERATION, 4);
    for (int m = 0; m < members; m++) {
        vmmt_desc_info info;
        if (vmmt_desc_inspect(&d[m], &info) != VMMT_OK)
            return "publish handed out a descriptor its readers refuse";
        if (info.slot != slot || info.generation != gen || info.pack_count != members ||
            info.pack_index != m)
            return "the members of a packed group do not share one slot and generation";
    }
    return NULL;
}

/* Publish one record (gated: its copies held behind a gate). Returns the record or -1. */
static int do_publish(int members, int gated)
{
    struct mt_cmd c;
    int room = m_room(&M), rec, want_kernel;
    const char *bad;

    cmd_init(&c, P_PUBLISH);
    c.members = members;
    split_unit(members, c.nbytes);
    for (int m = 0; m < members; m++) {
        c.uid[m] = mt_mix(R.seed) + ++R.next_uid;
        c.typed[m] = below(3) == 0;
    }
    if (!gated && below(R.kind == K_HOST ? 10 : 6) < (R.kind == K_HOST ? 7 : 1))
        c.flags |= MT_F_HOSTSRC;
    if (gated) c.flags |= MT_F_GATED;
    if (room) c.flags |= MT_F_RETRY;
    c.timeout_ms = RETRY_MS;
    prod_call(&c);
    say("publish %d member(s)%s%s -> %s (%d tries): slot %u gen %u slice at %" PRIu64
        " uid %" PRIx64,
        members, gated ? " gated" : "", (c.flags & MT_F_HOSTSRC) ? " host source" : "",
        st_name(rep.status), rep.attempts, (uint32_t)mt_get(&rep.desc[0], MT_OFF_SLOT, 4),
        (uint32_t)mt_get(&rep.desc[0], MT_OFF_GENERATION, 4), mt_get(&rep.desc[0], 272, 8),
        c.uid[0]);
    if (!room) {
        if (rep.status == VMMT_EFULL) {
            R.ctr[CTR_full]++;
            return -1;
        }
        finding_stop("publish answered %s where the model says the pool is full (%d of %d slices "
                     "held): a slice still LIVE was recycled, or one was never counted; slot %u "
                     "generation %u handed out",
                     st_name(rep.status), cur()->occupied, cur()->capacity,
                     (uint32_t)mt_get(&rep.desc[0], MT_OFF_SLOT, 4),
                     (uint32_t)mt_get(&rep.desc[0], MT_OFF_GENERATION, 4));
    }
    if (rep.status == VMMT_EFULL) {
        struct mt_reply saved = rep;
        diagnose_stuck();
        rep = saved;
    }
    if (rep.status != VMMT_OK)
        finding_stop(
            "publish answered %s after %d tries over %d ms although the model has room (%d "
            "of %d slices held, %d LIVE): %s",
            st_name(rep.status), rep.attempts, RETRY_MS, cur()->occupied, cur()->capacity,
            m_live_count(&M), rep.msg);
    if ((bad = check_descs(members, rep.desc)) != NULL) finding_stop("%s", bad);
    pool_id_seen(&rep.desc[0]);
    bad = m_slot_check(&M, (uint32_t)mt_get(&rep.desc[0], MT_OFF_SLOT, 4),
                       (uint32_t)mt_get(&rep.desc[0], MT_OFF_GENERATION, 4));
    if (bad != NULL)
        finding_stop("publish handed out slot %u generation %u: %s",
                     (uint32_t)mt_get(&rep.desc[0], MT_OFF_SLOT, 4),
                     (uint32_t)mt_get(&rep.desc[0], MT_OFF_GENERATION, 4), bad);
    rec = m_publish(&M, members, c.uid, c.nbytes, rep.desc, !gated);
    R.ctr[members > 1 ? CTR_packed : CTR_publish]++;
    if (c.flags & MT_F_HOSTSRC) R.ctr[CTR_host_source]++;
    /* One device buffer of a device pool, small, whole 16-byte words from an aligned source:
     * one kernel; anything else: the copy and the stream write (publish_kernel.h). */
    want_kernel = members == 1 && !(c.flags & MT_F_HOSTSRC) &&
                  R.prm.memory_location != VMMT_MEMORY_HOST && c.nbytes[0] <= 65536 &&
                  c.nbytes[0] % 16 == 0;
    if (rep.kernel != want_kernel)
        finding("publish of %d member(s), %" PRIu64 " bytes%s went as %d kernel(s); the model "
                "says %d",
                members, c.nbytes[0], (c.flags & MT_F_HOSTSRC) ? " from host memory" : "",
                rep.kernel, want_kernel);
    if (rep.kernel) R.ctr[gated ? CTR_kernel_gated : CTR_kernel]++;
    return rec;
}

static int op_publish(void)
{
    if (skipped("publish")) return 0;
    if (!m_room(&M) && below(3) != 0) return 0;
    do_publish(1, 0);
    return 1;
}

static int op_packed(void)
{
    if (skipped("packed")) return 0;
    if (!m_room(&M) && below(3) != 0) return 0;
    do_publish(2 + (int)below(MT_MAX_MEMBERS - 1), 0);
    return 1;
}

static int free_res_id(void)
{
    for (int i = 0; i < MT_MAX_RES; i++)
        if (cur()->res[i].state == 0) return i;
    return -1;
}

static int op_reserve(void)
{
    struct mt_cmd c;
    int id = free_res_id(), room = m_room(&M);
    const char *bad;

    if (skipped("reserve") || id < 0 || (!room && below(3) != 0)) return 0;
    cmd_init(&c, P_RESERVE);
    c.id = id;
    c.nbytes[0] = R.prm.unit;
    c.flags = room ? MT_F_RETRY : 0;
    c.timeout_ms = RETRY_MS;
    prod_call(&c);
    if (!room) {
        if (rep.status != VMMT_EFULL)
            finding_stop("reserve answered %s where the model says the pool is full",
                         st_name(rep.status));
        R.ctr[CTR_full]++;
        return 1;
    }
    if (rep.status != VMMT_OK)
        finding_stop("reserve answered %s although the model has room: %s", st_name(rep.status),
                     rep.msg);
    pool_id_seen(&rep.desc[0]);
    bad = m_slot_check(&M, (uint32_t)mt_get(&rep.desc[0], MT_OFF_SLOT, 4),
                       (uint32_t)mt_get(&rep.desc[0], MT_OFF_GENERATION, 4));
    if (bad != NULL)
        finding_stop("reserve took slot %u: %s", (uint32_t)mt_get(&rep.desc[0], MT_OFF_SLOT, 4),
                     bad);
    m_res_open(&M, id, &rep.desc[0]);
    say("reserve %d: slot %u gen %u", id, (uint32_t)mt_get(&rep.desc[0], MT_OFF_SLOT, 4),
        (uint32_t)mt_get(&rep.desc[0], MT_OFF_GENERATION, 4));
    R.ctr[CTR_reserve]++;
    return 1;
}

static int res_with(int state)
{
    int ids[MT_MAX_RES], n = 0;
    for (int i = 0; i < MT_MAX_RES; i++)
        if (cur()->res[i].state == state) ids[n++] = i;
    return n ? ids[below((uint64_t)n)] : -1;
}

static void do_commit(int id)
{
    struct m_res *res = &cur()->res[id];
    struct mt_cmd c;
    uint64_t n = R.prm.unit - 16 * below(R.prm.unit / 64);

    cmd_init(&c, P_COMMIT);
    c.id = id;
    c.uid[0] = mt_mix(R.seed) + ++R.next_uid;
    c.nbytes[0] = n;
    c.typed[0] = below(2) == 0;
    prod_call(&c);
    if (rep.status != VMMT_OK)
        finding_stop("commit of an open reservation answered %s: %s", st_name(rep.status), rep.msg);
    if ((uint32_t)mt_get(&rep.desc[0], MT_OFF_SLOT, 4) != res->slot ||
        (uint32_t)mt_get(&rep.desc[0], MT_OFF_GENERATION, 4) != res->gen)
        finding_stop("commit's descriptor names another slot or generation than its token");
    if (check_descs(1, rep.desc) != NULL)
        finding_stop("commit handed out a descriptor readers refuse");
    m_res_commit(&M, id, c.uid[0], n, &rep.desc[0]);
    say("commit %d: slot %u gen %u", id, res->slot, res->gen);
    R.ctr[CTR_commit]++;
}

static int op_commit(void)
{
    int id = res_with(1);
    if (skipped("reserve") || id < 0) return 0;
    do_commit(id);
    return 1;
}

static int op_commit_again(void)
{
    int id = res_with(below(2) ? 2 : 3);
    struct mt_cmd c;
    if (skipped("reserve") || id < 0) return 0;
    cmd_init(&c, P_COMMIT);
    c.id = id;
    c.uid[0] = mt_mix(R.seed) + ++R.next_uid;
    c.nbytes[0] = R.prm.unit;
    prod_call(&c);
    if (rep.status != VMMT_ESTATE)
        finding("a second commit of a reservation (%s before) answered %s, not VMMT_ESTATE",
                cur()->res[id].state == 2 ? "committed" : "cancelled", st_name(rep.status));
    say("commit again %d -> %s", id, st_name(rep.status));
    R.ctr[CTR_commit_again]++;
    cur()->res[id].state = 0;
    return 1;
}

static void do_res_cancel(int id)
{
    struct mt_cmd c;
    int was = cur()->res[id].state;
    cmd_init(&c, P_RES_CANCEL);
    c.id = id;
    prod_call(&c);
    if (was == 1 && rep.status != VMMT_OK)
        finding("cancel of an open reservation answered %s: %s", st_name(rep.status), rep.msg);
    if (was != 1 && rep.status != VMMT_OK && rep.status != VMMT_ESTATE)
        finding("cancel of a committed reservation's token answered %s", st_name(rep.status));
    say("cancel reservation %d (state %d) -> %s", id, was, st_name(rep.status));
    if (was == 1) {
        m_res_cancel(&M, id);
        R.ctr[CTR_res_cancel]++;
    }
}

static int op_res_cancel(void)
{
    int id = res_with(below(4) ? 1 : 2);
    if (skipped("reserve") || id < 0) return 0;
    do_res_cancel(id);
    return 1;
}

static int op_cancel(void)
{
    int all[M_SLOTS], cand[M_SLOTS], n = 0, nall = live_list(all, 1);
    struct mt_cmd c;

    if (skipped("cancel")) return 0;
    for (int k = 0; k < nall; k++)
        if (!m_rec(&M, all[k])->handed) cand[n++] = all[k];
    if (n == 0) return 0;
    int rec = cand[below((uint64_t)n)];
    struct m_rec *r = m_rec(&M, rec);
    cmd_init(&c, P_CANCEL);
    c.desc = r->desc[below((uint64_t)r->members)];
    prod_call(&c);
    if (rep.status != VMMT_OK)
        finding("cancel of a live descriptor never handed out answered %s: %s", st_name(rep.status),
                rep.msg);
    m_cancel(&M, rec, 0);
    say("cancel rec %d (slot %u gen %u)", rec, r->slot, r->gen);
    R.ctr[CTR_cancel]++;
    return 1;
}

static int op_cancel_replay(void)
{
    int rec = random_record(90);
    struct mt_cmd c;
    struct m_rec *r;

    if (skipped("cancel") || rec < 0) return 0;
    r = m_rec(&M, rec);
    if (r->state == M_LIVE) return 0;
    cmd_init(&c, P_CANCEL);
    c.desc = r->desc[below((uint64_t)r->members)];
    prod_call(&c);
    /* Idempotent, or refused: either way the slot's present occupant stays (checked later). */
    if (rep.status != VMMT_OK && rep.status != VMMT_ESTATE && rep.status != VMMT_EPROTO &&
        rep.status != VMMT_EINVAL)
        finding("cancel of a descriptor no longer live answered %s: %s", st_name(rep.status),
                rep.msg);
    say("cancel again rec %d (slot %u gen %u) -> %s", rec, r->slot, r->gen, st_name(rep.status));
    R.ctr[CTR_cancel_replay]++;
    return 1;
}

static void do_release(int rank)
{
    struct mt_cmd c;
    cmd_init(&c, P_RELEASE_RANK);
    c.first = rank;
    prod_call(&c);
    if (rep.status != VMMT_OK)
        finding("vmmt_pool_release_rank(%d) answered %s: %s", rank, st_name(rep.status), rep.msg);
    m_release(&M, rank);
    say("release rank %d", rank);
    cur()->releases_min++;
    cur()->releases_max++;
    R.ctr[CTR_release_rank]++;
}

static int op_release(void)
{
    if (skipped("release")) return 0;
    do_release((int)below((uint64_t)cur()->ranks));
    return 1;
}

static int op_reclaim(void)
{
    struct mt_cmd c;
    cmd_init(&c, P_RECLAIM);
    prod_call(&c);
    if (rep.status != VMMT_OK) finding("reclaim answered %s: %s", st_name(rep.status), rep.msg);
    R.ctr[CTR_reclaim]++;
    return 1;
}

static int op_stats(void)
{
    struct mt_cmd c;
    cmd_init(&c, P_STATS);
    prod_call(&c);
    if (rep.status != VMMT_OK) finding("stats answered %s", st_name(rep.status));
    if ((int)rep.stats.in_flight < m_live_count(&M))
        finding("vmmt_pool_get_stats shows %u slices in flight, the model holds %d LIVE: a live "
                "occupant was recycled before all its ranks acknowledged it",
                rep.stats.in_flight, m_live_count(&M));
    if (rep.stats.rank_releases > cur()->releases_max)
        finding("rank_releases is %" PRIu64 ", the model allows at most %" PRIu64
                ": a rank was released that no death or call released",
                rep.stats.rank_releases, cur()->releases_max);
    R.ctr[CTR_stats]++;
    return 1;
}

/* ---------------------------------------------------------------- consumer ops */

/* A (record, rank) still to acknowledge: a LIVE landed record, a rank neither acked nor dropped. */
static int pick_work(int *rank)
{
    for (int tries = 0; tries < 16; tries++) {
        int rec = random_live(1);
        if (rec < 0) return -1;
        struct m_rec *r = m_rec(&M, rec);
        unsigned open = m_all(cur()) & ~r->acked & ~r->dropped;
        if (!open) continue;
        int rr;
        do
            rr = (int)below((uint64_t)cur()->ranks);
        while (!(open & (1u << rr)));
        *rank = rr;
        return rec;
    }
    return -1;
}

static int holder_of(int rank)
{
    for (int s = 0; s < R.nseats; s++)
        if (M.seat[s].alive && (M.seat[s].role & (1u << rank))) return s;
    return -1;
}

/* The next member rec needs from seat s for ranks Rm (-1: none left, or stuck). */
static int next_member(int rec, int s, unsigned Rm)
{
    struct m_rec *r = m_rec(&M, rec);
    const struct m_prog *p = NULL;
    for (int i = 0; i < r->nprog; i++)
        if (r->prog[i].ctx == M.seat[s].ctx) p = &r->prog[i];
    if (p != NULL && (p->done || p->ranks != Rm)) return -1;
    for (int m = 0; m < r->members; m++)
        if (p == NULL || !(p->members & (1u << m))) return m;
    return -1;
}

static int op_work(void)
{
    int rank, rec = pick_work(&rank), s, member;
    unsigned Rm;

    if (rec < 0 || skipped("consume")) return 0;
    s = holder_of(rank);
    if (s < 0) return 0;
    Rm = 1u << rank;
    /* Sometimes the seat's whole role, when none of it acknowledged yet: a list where its
     * ranks are not consecutive. */
    if (below(4) == 0 && (M.seat[s].role & m_rec(&M, rec)->acked) == 0) Rm = M.seat[s].role;
    Rm = keep_group_ranks(rec, Rm, s);
    if (m_rec(&M, rec)->acked & Rm) return 0;
    member = next_member(rec, s, Rm);
    if (member < 0) return 0;
    real_call(s, rec, member, Rm, below(7) == 0, 0, "consume");
    return 1;
}

static int op_drop(void)
{
    int rank, rec = pick_work(&rank);
    if (rec < 0 || skipped("drop")) return 0;
    m_rec(&M, rec)->dropped |= 1u << rank;
    R.ctr[CTR_drop]++;
    return 1;
}

static int op_replay(void)
{
    int rec = random_record(75), s = live_seat_random(), member;
    struct m_rec *r;
    unsigned Rm;
    int st;

    if (rec < 0 || s < 0 || skipped("replay")) return 0;
    r = m_rec(&M, rec);
    if (!r->landed && M.inst[r->inst].ended == M_OPEN) return 0; /* queued behind a gate */
    member = (int)below((uint64_t)r->members);
    Rm = keep_group_ranks(rec, pick_ranks(M.inst[r->inst].ranks, M.seat[s].role), s);
    R.ctr[CTR_replay]++;
    st = real_call(s, rec, member, Rm, below(4) == 0, 0, "replay");
    R.ctr[st == VMMT_OK ? CTR_replay_ok : CTR_replay_refused]++;
    return 1;
}

/*
 * A list of ranks some of which acknowledged a LIVE record and some not, from
 * a process with no group of it open: refused whole (VMMT_ESTATE), and the
 * model keeps the others owing, so that their later consumes must be OK (a
 * call that did some of them is found there: vmmt.sglang's acknowledge_ranks,
 * an outside attack of 2026-12-07).
 */
static int op_list_part(void)
{
    int rec = random_live(1), s = live_seat_random();
    unsigned all, done, owed, Rm;
    struct m_rec *r;

    if (rec < 0 || s < 0 || skipped("list_part")) return 0;
    r = m_rec(&M, rec);
    all = m_all(&M.inst[r->inst]);
    done = r->acked & all;
    owed = all & ~r->acked;
    if (done == 0 || owed == 0 || m_prog_ranks(&M, rec, s, NULL) != 0) return 0;
    Rm = (done & -done) | owed; /* one done rank and every owing one */
    if (below(2)) Rm = done | (owed & -owed);
    real_call(s, rec, (int)below((uint64_t)r->members), Rm, below(2), MT_F_LIST, "list_part");
    return 1;
}

static int op_bad_ranks(void)
{
    int rec = random_live(1), s = live_seat_random();
    struct mt_cmd c;
    if (rec < 0 || s < 0) return 0;
    cmd_init(&c, below(2) ? C_CONSUME : C_ACK);
    c.first = cur()->ranks + (int)below(3);
    c.count = 1;
    /* A list: one rank outside the pool among good ones, or a good one listed twice. */
    if (below(2)) {
        c.list = (unsigned)below(m_all(cur()) + 1);
        if (below(2))
            c.list |= 1u << (cur()->ranks + (int)below(3));
        else
            c.list |= MT_LIST_TWICE | 1u;
        c.list |= below(2) ? MT_LIST_DOWN : 0;
    }
    c.desc = m_rec(&M, rec)->desc[0];
    c.nbytes[0] = m_rec(&M, rec)->nbytes[0];
    call(&R.cons[s], &c);
    if (rep.status != VMMT_EINVAL)
        finding("a consume for ranks %s (list %#x) of a pool of %d ranks answered %s, not "
                "VMMT_EINVAL: %s",
                c.list ? "listed" : "a range", c.list, cur()->ranks, st_name(rep.status), rep.msg);
    R.ctr[c.list ? CTR_bad_list : CTR_bad_ranks]++;
    return 1;
}

static int op_token(void)
{
    int id = res_with(1), s = live_seat_random();
    struct mt_cmd c;
    if (id < 0 || s < 0 || skipped("forge")) return 0;
    cmd_init(&c, below(2) ? C_CONSUME : C_ACK);
    c.first = 0;
    c.count = 1;
    c.desc = cur()->res[id].token;
    c.nbytes[0] = R.prm.unit;
    c.flags = MT_F_NOCHECK | MT_F_POISON;
    call(&R.cons[s], &c);
    if (rep.status != VMMT_EINVAL)
        finding("a reservation's token handed to a consumer answered %s, not VMMT_EINVAL: %s",
                st_name(rep.status), rep.msg);
    R.ctr[CTR_token]++;
    return 1;
}

static int seat_fresh(void)
{
    int n = 0, cand[MT_MAX_SEATS];
    for (int s = 0; s < R.nseats; s++)
        if (M.seat[s].alive && !M.seat[s].touched) cand[n++] = s;
    return n ? cand[below((uint64_t)n)] : -1;
}

static int op_forge(void)
{
    int base = random_record(85), s, which, named_prog = -1;
    struct m_rec *r;
    struct m_inst *in;
    struct mt_forge_in fi;
    struct m_forged f;
    struct m_verdict v;
    vmmt_desc_info info;
    vmmt_desc d;
    unsigned Rm;
    struct mt_cmd c;
    int st, member, other;

    if (base < 0 || skipped("forge")) return 0;
    r = m_rec(&M, base);
    /* forge_dead: only forgeries of LIVE descriptors (a dead one's replay is a finding of its own).
     */
    if (r->state != M_LIVE && skipped("forge_dead")) return 0;
    in = &M.inst[r->inst];
    /* forge_first: no forgery as the first descriptor a process sees of a pool. Open
     * finding (tests/model/FINDINGS.md): such a forgery becomes that process's record of
     * the pool, and its real descriptors are then refused (VMMT_EPROTO) until evicted. */
    if (skipped("forge_first") && r->inst != M.cur) return 0;
    s = below(4) == 0 && !skipped("forge_first") ? seat_fresh() : -1;
    if (s < 0) s = skipped("forge_first") ? touched_seat_random() : live_seat_random();
    if (s < 0) return 0;
    which = (int)below((uint64_t)mt_forge_count());
    if (mt_forge_is_one_ahead(which)) {
        if (R.one_ahead_left <= 0 || skipped("one_ahead")) return 0;
        R.one_ahead_left--;
    }
    member = (int)below((uint64_t)r->members);
    memset(&fi, 0, sizeof fi);
    fi.slots = in->slots;
    fi.slot_gen = in->slot_gen;
    other = r->inst == M.cur ? random_live(1) : -1;
    if (other >= 0) {
        fi.live_ok = 1;
        fi.live_slot = m_rec(&M, other)->slot;
        fi.live_gen = m_rec(&M, other)->gen;
    }
    /* A form that leaves the field as it was (0 where it is 0) is no forgery: another value. */
    for (int tries = 0; tries < 8; tries++) {
        d = r->desc[member];
        mt_forge(&d, which, rnd(), &fi);
        if (memcmp(&d, &r->desc[member], sizeof d) != 0) break;
    }
    if (memcmp(&d, &r->desc[member], sizeof d) == 0) return 0;
    memset(&f, 0, sizeof f);
    f.valid = vmmt_desc_inspect(&d, &info) == VMMT_OK;
    f.token = f.valid && (mt_get(&d, 16, 4) & 8u);
    f.geometry = mt_get(&d, 224, 4) != mt_get(&r->desc[member], 224, 4) ||
                 mt_get(&d, 228, 4) != mt_get(&r->desc[member], 228, 4) ||
                 mt_get(&d, 248, 4) != mt_get(&r->desc[member], 248, 4);
    memcpy(f.pool_id, d.bytes + MT_OFF_POOL_ID, 16);
    f.slot = (uint32_t)mt_get(&d, MT_OFF_SLOT, 4);
    f.gen = (uint32_t)mt_get(&d, MT_OFF_GENERATION, 4);
    f.pack_index = (int)mt_get(&d, MT_OFF_PACK_INDEX, 2);
    f.pack_count = (int)mt_get(&d, MT_OFF_PACK_COUNT, 2);
    Rm = pick_ranks(in->ranks, M.seat[s].role);
    v = m_judge_forged(&M, &f, Rm, s);
    if (v.named >= 0 && m_conflicts(&M, v.named, Rm, s)) {
        Rm = m_prog_ranks(&M, v.named, s, NULL);
        v = m_judge_forged(&M, &f, Rm, s);
        named_prog = 1;
    }
    (void)named_prog;
    cmd_init(&c, below(5) == 0 ? C_ACK : C_CONSUME);
    set_ranks(&c, Rm, m_all(in), 0);
    c.flags = MT_F_NOCHECK | MT_F_POISON;
    c.desc = d;
    c.nbytes[0] = r->nbytes[member];
    call(&R.cons[s], &c);
    st = rep.status;
    if (r->inst == M.cur && memcmp(f.pool_id, in->pool_id, 16) == 0) M.seat[s].touched = 1;
    R.ctr[CTR_forged]++;
    say("forge %s (%s) of rec %d.%d to consumer %d ranks %s -> %s", mt_forge_name(which),
        f.valid ? "valid" : "invalid", base, member, s, ranks_text(Rm), st_name(st));
    if (!(v.allow & M_A(st))) {
        finding("forged descriptor (%s changed, %s) from publish uid %" PRIx64
                " (pool #%d, slot %u, generation %u) now naming slot %u generation %u, %s by "
                "consumer %d for ranks %s: got %s, the model allows %s (%s); library: %s",
                mt_forge_name(which), f.valid ? "still valid" : "invalid", r->uid[member],
                in->number, r->slot, r->gen, f.slot, f.gen,
                c.op == C_ACK ? "acknowledged" : "consumed", s, ranks_text(Rm), st_name(st),
                allowed_text(v.allow), v.why, rep.msg);
        /* --keep-going: the model stays as it was, but for the ranks the process now
         * holds; a process whose stream failed behind the forgery starts afresh (its
         * groups' stream is gone). */
        if (st == VMMT_OK && in->ended == M_OPEN && r->inst == M.cur) {
            m_hold(&M, s, Rm);
            M.seat[s].uncertain = 1;
        }
        if (st == VMMT_OK && c.op == C_CONSUME && !rep.stream_ok) recover_seat(s);
        return 1;
    }
    if (st != VMMT_OK) {
        note_refusal(st);
        if (c.op == C_CONSUME && !rep.poison_ok &&
            (st == VMMT_ESTATE || st == VMMT_EPROTO || st == VMMT_EINVAL))
            finding("a forged descriptor refused with %s wrote into the destination", st_name(st));
        if (!f.valid || f.token)
            R.ctr[f.token ? CTR_token : CTR_forged_invalid]++;
        else if (f.geometry)
            R.ctr[CTR_forged_geometry]++;
        else if (m_forged_ahead(&M, &f))
            R.ctr[CTR_forged_ahead]++;
        else
            R.ctr[CTR_forged_valid_refused]++;
        if (st != VMMT_ESTATE && st != VMMT_EPROTO && st != VMMT_EINVAL && in->ended == M_OPEN)
            M.seat[s].uncertain = 1;
        return 1;
    }
    if (c.op == C_CONSUME && !rep.stream_ok) {
        finding("a forged descriptor accepted (%s changed) failed the consumer's stream: %s",
                mt_forge_name(which), rep.msg);
        recover_seat(s);
        return 1;
    }
    R.ctr[CTR_forged_ok]++;
    m_took_forged(&M, &f, v.named, Rm, s);
    return 1;
}

static int op_check(void)
{
    int s = live_seat_random();
    struct m_seat *st;
    struct mt_cmd c;
    if (s < 0 || skipped("check")) return 0;
    st = &M.seat[s];
    if (st->ncopies == 0) return 0;
    struct m_copy *cp = &st->copies[below((uint64_t)st->ncopies)];
    struct m_rec *r = m_rec(&M, cp->rec);
    if (!r->used) return 0;
    cmd_init(&c, C_CHECK);
    c.desc = r->desc[cp->member];
    call(&R.cons[s], &c);
    if (rep.status == VMMT_EFAILED && cp->expect == VMMT_OK && released_since(cp, r)) {
        R.ctr[CTR_check_released]++;
        return 1;
    }
    if (rep.status == VMMT_EFAILED && cp->expect == VMMT_OK && cp->unseen) {
        R.ctr[CTR_check_unseen]++;
        return 1;
    }
    /* The other side of "unseen": this copy came first, and the second process's
     * acknowledgement may have completed the slot before this one's thread looked. */
    if (rep.status == VMMT_EFAILED && cp->expect == VMMT_OK && (r->raced & cp->ranks) != 0) {
        R.ctr[CTR_check_raced]++;
        return 1;
    }
    if (rep.status == VMMT_EFAILED && cp->expect == VMMT_OK && group_left_open(cp, r, s)) {
        R.ctr[CTR_check_group_left]++;
        return 1;
    }
    if (rep.status != cp->expect) {
        int done = 0;
        unsigned pr = m_prog_ranks(&M, cp->rec, s, &done);
        finding("vmmt_consumer_check of a descriptor consumer %d copied (publish uid %" PRIx64
                ", member %d of %d, slot %u gen %u, for ranks %s; record state %d, acked by %s; "
                "this seat's group: ranks %s, done %d) says %s, the model expects %s (%s); "
                "library: %s",
                s, r->uid[cp->member], cp->member, r->members, r->slot, r->gen,
                ranks_text(cp->ranks), r->state, ranks_text(r->acked), ranks_text(pr), done,
                st_name(rep.status), st_name(cp->expect),
                cp->expect == VMMT_OK ? "its bytes arrived" : "its producer died before the copy",
                rep.msg);
    }
    R.ctr[cp->expect == VMMT_OK ? CTR_check_ok : CTR_check_failed]++;
    return 1;
}

/*
 * vmmt_consumer_flush at a random point of a consumer's life: it only moves
 * the acknowledgements of completed copies from the consumer's thread to
 * this call, so every answer after it must still be one the model allows
 * (tests/unit/test_consumer_flush.c holds that a reclaim right after frees).
 */
static int op_flush(void)
{
    int s = live_seat_random();
    struct mt_cmd c;
    if (s < 0 || skipped("flush")) return 0;
    cmd_init(&c, C_FLUSH);
    call(&R.cons[s], &c);
    if (rep.status != VMMT_OK)
        finding("vmmt_consumer_flush by consumer %d answered %s: %s", s, st_name(rep.status),
                rep.msg);
    R.ctr[CTR_flush]++;
    return 1;
}

static int do_evict(int s, int must)
{
    struct mt_cmd c;
    int rec = -1;
    for (int i = M.nrec - 1; i >= 0 && i >= M.nrec - M_RECS; i--)
        if (m_rec(&M, i)->used && m_rec(&M, i)->inst == M.cur) {
            rec = i;
            break;
        }
    if (rec < 0) return 0;
    cmd_init(&c, C_EVICT);
    c.desc = m_rec(&M, rec)->desc[0];
    c.flags = must == 1 ? MT_F_RETRY : 0;
    c.timeout_ms = 5000;
    call(&R.cons[s], &c);
    say("evict by consumer %d (model: %d) -> %s", s, must, st_name(rep.status));
    if (must == 1 && rep.status != VMMT_OK && R.verbose)
        for (int i = 0; i < M.nrec && i < M_RECS; i++) {
            struct m_rec *r = &M.rec[i];
            for (int k = 0; r->used && r->inst == M.cur && k < r->nprog; k++)
                if (r->prog[k].ctx == M.seat[s].ctx)
                    say("  rec %d (slot %u gen %u, state %d, acked %s): members %x ranks %s done "
                        "%d",
                        i, r->slot, r->gen, r->state, ranks_text(r->acked), r->prog[k].members,
                        ranks_text(r->prog[k].ranks), r->prog[k].done);
        }
    if (must == 1 && rep.status != VMMT_OK)
        finding("evict of a pool this process left idle (no copy queued, no group half "
                "consumed) answered %s after %d tries: %s",
                st_name(rep.status), rep.attempts, rep.msg);
    if (must == 0 && rep.status != VMMT_ESTATE)
        finding("evict answered %s while %s: the group's progress or the copy would be lost",
                st_name(rep.status),
                M.seat[s].deferred ? "a copy out of the pool is queued"
                                   : "a group is half consumed");
    if (must == -1 && rep.status != VMMT_OK && rep.status != VMMT_ESTATE)
        finding("evict answered %s", st_name(rep.status));
    if (rep.status == VMMT_OK) {
        m_evicted(&M, s);
        R.ctr[CTR_evict_ok]++;
    } else {
        R.ctr[CTR_evict_refused]++;
    }
    return 1;
}

static int op_evict(void)
{
    int s = live_seat_random();
    if (s < 0 || skipped("evict") || !pool_known()) return 0;
    /* Prefer, now and then, a process half way through a group: the refusal is the point. */
    for (int t = 0; t < R.nseats && below(2); t++) {
        int k = (s + t) % R.nseats;
        if (M.seat[k].alive && m_evict_expect(&M, k) == 0) {
            s = k;
            break;
        }
    }
    return do_evict(s, m_evict_expect(&M, s));
}

static int op_evict_old(void)
{
    int rec = random_record(0), s = live_seat_random();
    struct mt_cmd c;
    if (rec < 0 || s < 0 || m_rec(&M, rec)->inst == M.cur || skipped("evict")) return 0;
    cmd_init(&c, C_EVICT);
    c.desc = m_rec(&M, rec)->desc[0];
    call(&R.cons[s], &c);
    if (rep.status != VMMT_OK && rep.status != VMMT_ESTATE)
        finding("evict of an earlier pool answered %s: %s", st_name(rep.status), rep.msg);
    return 1;
}

/* ---------------------------------------------------------------- deaths */

static void restart_seat(int s)
{
    unsigned role = M.seat[s].role;
    int waits = M.seat[s].waits_ok;
    start_consumer(s);
    m_seat_started(&M, s, role, waits);
}

static void kill_consumer(int s, int may_wait);

static int op_kill_consumer(void)
{
    int s = live_seat_random();
    if (s < 0 || skipped("kill_consumer") || M.seat[s].deferred) return 0;
    kill_consumer(s, 1);
    return 1;
}

/* --keep-going after a stream of consumer s failed: it starts again in a new process. */
static void recover_seat(int s)
{
    if (!M.seat[s].deferred && M.seat[s].alive && cur()->ended == M_OPEN) kill_consumer(s, 0);
}

/* The pool's rank_releases now (what a wait for a death's release counts from). */
static uint64_t releases_now(void)
{
    struct mt_cmd c;
    cmd_init(&c, P_STATS);
    prod_call(&c);
    if (rep.status != VMMT_OK) finding("stats answered %s", st_name(rep.status));
    return rep.stats.rank_releases;
}

static void kill_consumer(int s, int may_wait)
{
    unsigned held, dead, engine;
    int any_uncertain = 0, automatic;
    uint64_t base;

    for (int k = 0; k < R.nseats; k++)
        any_uncertain |= M.seat[k].uncertain;
    held = M.seat[s].held;
    /* An answer that may have announced ranks the model does not know of: the engine
     * releases every rank the process served, as an engine restarting it does. */
    engine = held | (M.seat[s].uncertain ? M.seat[s].role : 0);
    dead = R.has_broker ? m_dead_ranks(&M, s) : 0;
    /* Counted from what the pool shows now, not from the model's least: an earlier death
     * that the engine released may have been released by the pool too (the model allows
     * it), and a wait from the least would end at once, before this death is seen (seeds
     * 11 and 222 of FINDINGS.md: the pool then released a slice published after). */
    base = R.has_broker ? releases_now() : 0;
    kill(R.cons[s].pid, SIGKILL);
    waitpid(R.cons[s].pid, NULL, 0);
    close(R.cons[s].fd);
    R.cons[s].alive = 0;
    R.ctr[CTR_consumer_kill]++;
    /*
     * The pool releases by itself the ranks m_dead_ranks names (docs/broker.md,
     * Liveness). Wait for it only where the model knows exactly which those are and
     * the dead process can have left nothing else owed; otherwise the engine
     * releases every rank the process announced, as an engine restarting a rank does.
     */
    /* The die is cast first: the same seed draws the same numbers whatever the answers. */
    automatic = below(2) == 0;
    automatic = automatic && may_wait && R.has_broker && !any_uncertain && dead == held &&
                !skipped("auto_release");
    say("kill consumer %d (held %s, the pool's to release %s) %s", s, ranks_text(held),
        ranks_text(dead), automatic ? "pool releases" : "engine releases");
    if (automatic) {
        struct mt_cmd c;
        m_seat_died(&M, s, dead);
        if (dead) {
            cmd_init(&c, P_WAIT);
            c.id = MT_WAIT_RELEASES;
            c.target = base + (uint64_t)popcount(dead);
            c.timeout_ms = IDLE_MS;
            prod_call(&c);
            if (rep.status != VMMT_OK)
                finding_stop(
                    "consumer %d was killed holding rank(s) %s, which no other process "
                    "holds; rank_releases is %" PRIu64 " after %d s, the model expects %" PRIu64,
                    s, ranks_text(dead), rep.stats.rank_releases, IDLE_MS / 1000, c.target);
            if (cur()->releases_min < base) cur()->releases_min = base;
            cur()->releases_min += (uint64_t)popcount(dead);
            cur()->releases_max += (uint64_t)popcount(dead);
            R.ctr[CTR_auto_release]++;
        }
    } else {
        m_seat_died(&M, s, 0);
        /* The pool may still release them too, if it saw the death first: any rank the
         * process announced on its link, even one released since while it lived on (the
         * link still names it; m_dead_ranks leaves those out, seed 15 elastic). */
        cur()->releases_max += (uint64_t)popcount(engine | dead);
        for (int r = 0; r < cur()->ranks; r++)
            if (engine & (1u << r)) do_release(r);
    }
    restart_seat(s);
}

static void producer_killed(void)
{
    kill(R.prod.pid, SIGKILL);
    waitpid(R.prod.pid, NULL, 0);
    close(R.prod.fd);
    R.prod.alive = 0;
    m_inst_end(&M, M_DEAD);
    R.ctr[CTR_producer_kill]++;
    say("producer killed");
}

/* A publish whose copies wait behind a gate, consumed meanwhile; then landed, or the producer
 * killed. */
static int op_gated(int kill_producer)
{
    int rec, members = below(3) == 0 ? 2 + (int)below(MT_MAX_MEMBERS - 1) : 1;
    struct m_rec *r;
    struct mt_cmd c;

    if (!R.can_gate || !m_room(&M) || skipped("gate")) return 0;
    rec = do_publish(members, 1);
    r = m_rec(&M, rec);
    R.ndef = 0;
    for (int s = 0; s < R.nseats; s++) {
        struct m_seat *st = &M.seat[s];
        if (!st->alive || !st->waits_ok || !(st->role & m_all(cur()))) continue;
        int rank;
        do
            rank = (int)below((uint64_t)cur()->ranks);
        while (!(st->role & (1u << rank)));
        for (int m = 0; m < members; m++) {
            if (real_call(s, rec, m, 1u << rank, 0, MT_F_DEFER, "consume behind a gate") != VMMT_OK)
                break;
            R.def[R.ndef++] = (struct deferred){s, rep.id, rec, m};
            st->deferred++;
        }
    }
    if (R.ndef > 0 && below(2) == 0) {
        struct deferred *dd = &R.def[below((uint64_t)R.ndef)];
        do_evict(dd->seat, 0); /* a copy is queued: refused */
    }
    if (kill_producer) {
        producer_killed();
        R.ctr[CTR_gated_kill]++;
    } else {
        cmd_init(&c, P_GATE_OPEN);
        prod_call(&c);
        if (rep.status != VMMT_OK) finding("the gated stream failed: %s", rep.msg);
        m_landed(&M, rec);
        R.ctr[CTR_gated_open]++;
    }
    for (int i = 0; i < R.ndef; i++) {
        struct deferred *dd = &R.def[i];
        cmd_init(&c, C_VERIFY);
        c.id = dd->id;
        call(&R.cons[dd->seat], &c);
        M.seat[dd->seat].deferred--;
        if (!rep.stream_ok)
            finding("consumer %d's stream failed (or stayed blocked) after a consume queued "
                    "behind the producer's %s: %s",
                    dd->seat, kill_producer ? "death" : "gate", rep.msg);
        if (!kill_producer) {
            if (rep.first_bad != rep.nbytes || rep.found_uid != r->uid[dd->member])
                finding("a consume queued before the producer's copy landed got other bytes "
                        "(first wrong byte %" PRIu64 " of %" PRIu64 ", buffer names uid %" PRIx64
                        ")",
                        rep.first_bad, rep.nbytes, rep.found_uid);
            if (rep.status2 != VMMT_OK)
                finding("vmmt_consumer_check says %s for a copy that landed", st_name(rep.status2));
            R.ctr[CTR_check_ok]++;
            add_copy(dd->seat, rec, dd->member, VMMT_OK, m_all(&M.inst[r->inst]));
        } else {
            if (rep.status2 != VMMT_EFAILED)
                finding("consumer %d copied publish uid %" PRIx64 " whose producer was killed "
                        "before its copy ran, and vmmt_consumer_check says %s, not VMMT_EFAILED "
                        "(the bytes copied name uid %" PRIx64 ")",
                        dd->seat, r->uid[dd->member], st_name(rep.status2), rep.found_uid);
            R.ctr[CTR_check_failed]++;
            add_copy(dd->seat, rec, dd->member, VMMT_EFAILED, m_all(&M.inst[r->inst]));
        }
    }
    R.ndef = 0;
    return 1;
}

/* Open or close seat s's own gate on its deferred stream. */
static void seat_gate(int s, int open)
{
    struct mt_cmd c;
    cmd_init(&c, open ? C_GATE_OPEN : C_GATE_CLOSE);
    call(&R.cons[s], &c);
    if (rep.status != VMMT_OK) finding("consumer %d's gate: %s", s, rep.msg);
}

/*
 * A cancel of a descriptor that consumer seat s has taken for one rank, its
 * copies queued behind a gate of the seat's own (docs/descriptor.md,
 * "Acknowledgement words"). On a shared table the slice stays the taker's
 * until its copies are acknowledged and a half group learns of the cancel
 * (its next member is refused): the pool is full meanwhile if it was full,
 * and the copies read their own bytes, checked OK. That refusal on another
 * stream than the group's gives the words back at once, and a device table
 * frees the slice once the publish landed: a copy that then read another
 * buffer's bytes must check VMMT_EFAILED, one that checks OK must hold its
 * own. (Before 2026-12-07 a shared table's cancel freed the slice under the
 * copy, and vmmt.sglang's rebuild returned the next buffer.)
 */
static int op_cancel_taken(void)
{
    int members = below(2) == 0 ? 2 + (int)below(MT_MAX_MEMBERS - 1) : 1;
    int cand[MT_MAX_SEATS], n = 0, s, rank, rec, upto, took = 0, half, held, late, strict;
    int other_stream = 0, fate;
    struct m_rec *r;
    struct mt_cmd c;

    if (!m_room(&M) || skipped("cancel_taken")) return 0;
    for (int k = 0; k < R.nseats; k++)
        if (M.seat[k].alive && (M.seat[k].role & m_all(cur())) && !M.seat[k].deferred)
            cand[n++] = k;
    if (n == 0) return 0;
    s = cand[below((uint64_t)n)];
    rec = do_publish(members, 0);
    if (rec < 0) return 1;
    r = m_rec(&M, rec);
    do
        rank = (int)below((uint64_t)cur()->ranks);
    while (!(M.seat[s].role & (1u << rank)));
    seat_gate(s, 0);
    m_pin(&M, rec, 1);
    R.ndef = 0;
    upto = members == 1 ? 1 : 1 + (int)below((uint64_t)members);
    for (int m = 0; m < upto; m++) {
        if (real_call(s, rec, m, 1u << rank, 0, MT_F_DEFER, "consume behind the seat's gate") !=
            VMMT_OK)
            break;
        R.def[R.ndef++] = (struct deferred){s, rep.id, rec, m};
        M.seat[s].deferred++;
        took++;
    }
    half = members > 1 && took > 0 && took < members;
    held = cur()->shared_table && took > 0;
    strict = held;
    cmd_init(&c, P_CANCEL);
    c.desc = r->desc[below((uint64_t)members)];
    prod_call(&c);
    if (rep.status != VMMT_OK)
        finding("cancel of a descriptor whose copy is queued answered %s: %s", st_name(rep.status),
                rep.msg);
    m_cancel(&M, rec, held);
    say("cancel rec %d (slot %u gen %u), taken by consumer %d for rank %d (%d of %d member(s))%s",
        rec, r->slot, r->gen, s, rank, took, members, held ? ": held" : "");
    R.ctr[CTR_cancel_taken]++;
    late = half && below(2) == 0;
    /* While the copies are held: 0, the engine releases the taker's rank; 1, the taker dies;
     * in turn, so that a short run (CI's sanitizer builds: some 20 of these) takes both. */
    fate = (int)(R.ctr[CTR_cancel_taken] % 4);
    if (half && !late) {
        other_stream = below(3) == 0;
        real_call(s, rec, took, 1u << rank, 0, other_stream ? 0 : MT_F_DEFER,
                  "a member after its group's cancel");
        R.ctr[CTR_cancel_taken_half]++;
        if (other_stream && held) {
            m_let_go(&M, rec); /* given back at once: the copies are told failed */
            held = strict = 0;
        }
    }
    if (held && cur()->capacity - cur()->occupied <= 6) {
        while (m_room(&M) && do_publish(1, 0) >= 0)
            ;
        if (do_publish(1, 0) < 0) R.ctr[CTR_cancel_taken_held]++;
    } else if (!held && m_room(&M) && below(2) == 0) {
        do_publish(1, 0); /* may take the freed slice under the queued copy */
    }
    if (fate == 0) {
        /* The engine's call to make (vmmt.h): the slice comes back at once, and a
         * publish may take it under the copies, whose checks then tell. */
        do_release(rank);
        if (held) m_let_go(&M, rec);
        held = strict = 0;
        if (m_room(&M)) do_publish(1, 0);
        R.ctr[CTR_cancel_taken_released]++;
    } else if (fate == 1) {
        /* Its copies die with it; the pool (or the engine) releases its rank, which must
         * give the slice back: one left CANCELLED would stay in flight for good. */
        R.ndef = 0;
        m_pin(&M, rec, 0);
        kill_consumer(s, 1);
        if (held) m_let_go(&M, rec);
        R.ctr[CTR_cancel_taken_killed]++;
        return 1;
    }
    seat_gate(s, 1);
    for (int i = 0; i < R.ndef; i++) {
        struct deferred *dd = &R.def[i];
        int own;
        cmd_init(&c, C_VERIFY);
        c.id = dd->id;
        call(&R.cons[dd->seat], &c);
        M.seat[dd->seat].deferred--;
        own = rep.verified && rep.first_bad == rep.nbytes && rep.found_uid == r->uid[dd->member];
        if (!rep.stream_ok)
            finding("consumer %d's stream failed after its gate opened: %s", dd->seat, rep.msg);
        if (strict && (!own || rep.status2 != VMMT_OK))
            finding("a copy queued when its descriptor was cancelled, on a shared table, %s and "
                    "vmmt_consumer_check says %s (the slice must stay the copy's): %s",
                    own ? "holds its bytes" : "holds another buffer's bytes", st_name(rep.status2),
                    rep.msg);
        if (!strict && rep.status2 == VMMT_OK && !own)
            finding("a copy whose descriptor was cancelled under it read another buffer's bytes "
                    "(uid %" PRIx64 ") and vmmt_consumer_check says OK",
                    rep.found_uid);
        if (!strict && rep.status2 != VMMT_OK && rep.status2 != VMMT_EFAILED)
            finding("vmmt_consumer_check of a copy cancelled under it says %s",
                    st_name(rep.status2));
        if (rep.status2 == VMMT_EFAILED) R.ctr[CTR_check_cancel_failed]++;
        if (rep.status2 == VMMT_OK) R.ctr[CTR_check_ok]++;
        add_copy(dd->seat, rec, dd->member, rep.status2 == VMMT_OK ? VMMT_OK : VMMT_EFAILED,
                 1u << rank);
    }
    R.ndef = 0;
    m_pin(&M, rec, 0);
    if (late) {
        real_call(s, rec, took, 1u << rank, 0, below(2) ? MT_F_DEFER : 0,
                  "a member after its group's cancel, its copies done");
        R.ctr[CTR_cancel_taken_half]++;
    }
    if (held) m_let_go(&M, rec);
    return 1;
}

/* ---------------------------------------------------------------- quiescence */

/* Acknowledge rank `rank` of rec through seat s, member by member, for ranks Rm. */
static int finish_through(int rec, int s, unsigned Rm, int use_ack)
{
    int m;
    while ((m = next_member(rec, s, Rm)) >= 0 && !(m_rec(&M, rec)->acked & Rm))
        if (real_call(s, rec, m, Rm, use_ack, 0, "quiescence") != VMMT_OK) return 0;
    return (m_rec(&M, rec)->acked & Rm) == Rm;
}

static void settle_rank(int rec, int rank)
{
    struct m_rec *r = m_rec(&M, rec);
    unsigned bit = 1u << rank;
    int use_ack = (r->dropped & bit) != 0 || below(4) == 0;

    /* A process half way through the group for ranks that include this one. */
    for (int s = 0; s < R.nseats; s++) {
        int done;
        unsigned y = M.seat[s].alive ? m_prog_ranks(&M, rec, s, &done) : 0;
        if (y & bit && !done && !(y & r->acked) && finish_through(rec, s, y, use_ack)) return;
    }
    if (below(6) != 0) {
        int order[MT_MAX_SEATS], n = 0, h = holder_of(rank);
        if (h >= 0) order[n++] = h;
        for (int s = 0; s < R.nseats; s++)
            if (s != h) order[n++] = s;
        for (int i = 0; i < n; i++) {
            int s = order[i];
            if (!M.seat[s].alive || m_prog_ranks(&M, rec, s, NULL) != 0) continue;
            if (finish_through(rec, s, bit, use_ack)) return;
        }
    }
    do_release(rank);
}

/*
 * A slice stays in flight that the model says is done: find which, for the
 * report. A fresh consumer process acknowledges, for every rank, the pool's
 * records that the model holds done or cancelled, newest first, until the
 * pool is idle (a fresh process takes such a descriptor today: finding F1 in
 * tests/model/FINDINGS.md; once it refuses them, this says nothing).
 */
static void diagnose_stuck(void)
{
    struct child probe = {0};
    struct mt_reply saved = rep;
    char tmo[16], unit[32];
    char *argv[] = {R.self, "--consumer", "9", tmo, unit, NULL};

    snprintf(tmo, sizeof tmo, "%d", CONS_TMO_MS);
    snprintf(unit, sizeof unit, "%d", MT_MAX_UNIT);
    spawn(&probe, argv);
    for (int i = M.nrec - 1; i >= 0 && i >= M.nrec - M_RECS; i--) {
        struct m_rec *r = m_rec(&M, i);
        struct mt_cmd c;
        if (!r->used || r->inst != M.cur || r->state == M_LIVE) continue;
        int st = VMMT_OK;
        for (int m = 0; m < r->members; m++) {
            cmd_init(&c, C_ACK);
            c.first = VMMT_ALL_RANKS;
            c.desc = r->desc[m];
            call(&probe, &c);
            if (rep.status != VMMT_OK) st = rep.status;
        }
        /* Reclaim, then read: the recycler's own pass could come a moment later. */
        cmd_init(&c, P_RECLAIM);
        call(&R.prod, &c);
        cmd_init(&c, P_STATS);
        call(&R.prod, &c);
        say("diagnosis: acknowledging record %d (slot %u gen %u) again: %s; %u in flight", i,
            r->slot, r->gen, st_name(st), rep.stats.in_flight);
        if ((int)rep.stats.in_flight <= m_live_count(&M)) {
            fprintf(stderr,
                    "model_test: the slice left in flight was publish record %d (slot %u, "
                    "generation %u, %d member(s), %s, %s%s): acknowledging it again freed it\n",
                    i, r->slot, r->gen, r->members,
                    r->state == M_CANCELLED ? "cancelled" : "acknowledged by every rank",
                    r->handed ? "handed out" : "never handed out",
                    r->gated ? ", published behind a gate" : "");
            break;
        }
    }
    kill(probe.pid, SIGKILL);
    waitpid(probe.pid, NULL, 0);
    close(probe.fd);
    rep = saved;
}

static void quiesce(void)
{
    struct m_inst *in = cur();
    struct mt_cmd c;

    for (int id = 0; id < MT_MAX_RES; id++)
        if (in->res[id].state == 1) {
            if (below(2))
                do_commit(id);
            else
                do_res_cancel(id);
        }
    for (;;) {
        int list[M_SLOTS], rec;
        if (live_list(list, 0) == 0) break;
        rec = list[0];
        struct m_rec *r = m_rec(&M, rec);
        settle_rank(rec, __builtin_ctz(m_all(in) & ~r->acked));
    }
    cmd_init(&c, P_WAIT);
    c.id = MT_WAIT_IDLE;
    c.timeout_ms = IDLE_MS;
    prod_call(&c);
    if (rep.status != VMMT_OK) diagnose_stuck();
    if (rep.status != VMMT_OK)
        finding("at a quiescent point (every descriptor acknowledged or released, reclaimed) "
                "%u slices (%" PRIu64 " bytes) stay in flight after %d s",
                rep.stats.in_flight, rep.stats.in_flight_bytes, IDLE_MS / 1000);
    if (rep.stats.rank_releases < in->releases_min || rep.stats.rank_releases > in->releases_max)
        finding("rank_releases is %" PRIu64 ", the model expects %" PRIu64 "..%" PRIu64,
                rep.stats.rank_releases, in->releases_min, in->releases_max);
    R.ctr[CTR_quiescent]++;
    say("quiescent");
}

static int op_quiesce(void)
{
    quiesce();
    return 1;
}

static int op_chunk_remade_held(void);
static void wait_chunks_released(uint64_t target, const char *why);

/*
 * Elastic: every chunk given back once idle; the next publish makes one
 * again. Or, half the time, op_chunk_remade_held. One entry of the op table
 * for both, which answers other kinds before it draws from the seed: their
 * runs take the steps they took before that op was added (CI's seeds reach
 * their paths in the steps they are given).
 */
static int op_chunk_cycle(void)
{
    struct mt_cmd c;
    if (R.kind != K_ELASTIC) return 0;
    if (below(2) == 0 && op_chunk_remade_held()) return 1;
    quiesce();
    cmd_init(&c, P_STATS);
    prod_call(&c);
    wait_chunks_released(rep.stats.chunks_made, "an idle elastic pool kept chunks");
    R.ctr[CTR_chunk_cycle]++;
    return 1;
}

/* The chunks of an elastic pool that record rec's slice lies in, a bit each. */
static unsigned rec_chunks(int rec)
{
    const vmmt_desc *d = &m_rec(&M, rec)->desc[0];
    uint64_t off = mt_get(d, MT_OFF_SLICE_OFFSET, 8), n = mt_get(d, MT_OFF_SLICE_BYTES, 8);
    unsigned set = 0;
    for (uint64_t k = off / R.prm.chunk_size; k <= (off + n - 1) / R.prm.chunk_size; k++)
        set |= 1u << k;
    return set;
}

/* Cancel records never handed out (this op's fillers). */
static void cancel_unhanded(const int *recs, int n)
{
    struct mt_cmd c;
    for (int i = 0; i < n; i++) {
        cmd_init(&c, P_CANCEL);
        c.desc = m_rec(&M, recs[i])->desc[0];
        prod_call(&c);
        if (rep.status != VMMT_OK)
            finding("cancel of a live descriptor never handed out answered %s: %s",
                    st_name(rep.status), rep.msg);
        m_cancel(&M, recs[i], 0);
    }
}

/* Publish fillers until a record lands in no chunk of `avoid`; cancel the fillers. -1: none. */
static int publish_outside(unsigned avoid)
{
    int fill[M_SLOTS], n = 0, rec = -1;
    while (m_room(&M) && n < M_SLOTS) {
        int r = do_publish(1, 0);
        if (r < 0) break;
        if (!(rec_chunks(r) & avoid)) {
            rec = r;
            break;
        }
        fill[n++] = r;
    }
    cancel_unhanded(fill, n);
    return rec;
}

static void wait_chunks_released(uint64_t target, const char *why)
{
    struct mt_cmd c;
    cmd_init(&c, P_WAIT);
    c.id = MT_WAIT_CHUNK_RELEASED;
    c.target = target;
    c.timeout_ms = IDLE_MS;
    prod_call(&c);
    if (rep.status != VMMT_OK)
        finding("%s: %" PRIu64 " chunks made, %" PRIu64 " released after %d s, %" PRIu64
                " expected",
                why, rep.stats.chunks_made, rep.stats.chunks_released, IDLE_MS / 1000, target);
}

/*
 * Elastic: a consumer process's copy from chunk X queued behind its own
 * gate, while another chunk Y, which the same process had mapped, is given
 * back and made again; a LIVE buffer in Y must then be consumed OK, its own
 * bytes, and the queued copy must still land its own. Queued copies hold
 * the chunks they read, not the whole import (docs/design.md, "Elastic
 * pools"): before 2026-12-07 a process with any copy queued was refused
 * every chunk made again (VMMT_ESTATE, the outside attack's finding in
 * tests/unit/test_attack_elastic.c).
 */
static int op_chunk_remade_held(void)
{
    int cand[MT_MAX_SEATS], n = 0, s, rank, a, c, b, id, remade;
    unsigned ca, cc, cb;
    uint64_t made, released, made_c;
    struct m_rec *ra;
    struct mt_cmd cmd;

    if (R.kind != K_ELASTIC || !R.can_gate || skipped("chunk_remade")) return 0;
    /* A second chunk is reached only by more slices than one chunk holds. */
    if ((uint64_t)cur()->capacity * R.prm.unit <= R.prm.chunk_size + R.prm.unit) return 0;
    for (int k = 0; k < R.nseats; k++)
        if (M.seat[k].alive && M.seat[k].waits_ok && (M.seat[k].role & m_all(cur())) &&
            !M.seat[k].deferred)
            cand[n++] = k;
    if (n == 0) return 0;
    s = cand[below((uint64_t)n)];
    do
        rank = (int)below((uint64_t)cur()->ranks);
    while (!(M.seat[s].role & (1u << rank)));

    /* From no chunk resident: A, then C in other chunks than A's. */
    quiesce();
    cmd_init(&cmd, P_STATS);
    prod_call(&cmd);
    wait_chunks_released(rep.stats.chunks_made, "an idle elastic pool kept chunks");
    made = rep.stats.chunks_made;
    released = rep.stats.chunks_released;
    if ((a = do_publish(1, 0)) < 0) return 1;
    ca = rec_chunks(a);
    if ((c = publish_outside(ca)) < 0) return 1;
    cc = rec_chunks(c);
    if (real_call(s, c, 0, 1u << rank, 0, 0, "consume in a chunk to be given back") != VMMT_OK)
        return 1;
    for (int k = 0; k < cur()->ranks; k++)
        if (!(m_rec(&M, c)->acked & (1u << k))) settle_rank(c, k);
    if (m_rec(&M, c)->state == M_LIVE || M.inst[m_rec(&M, a)->inst].ended != M_OPEN) return 1;

    /* A's copy queued behind the seat's gate: it holds A's chunks, and only those. */
    ra = m_rec(&M, a);
    seat_gate(s, 0);
    m_pin(&M, a, 1);
    if (real_call(s, a, 0, 1u << rank, 0, MT_F_DEFER, "consume behind the seat's gate") !=
        VMMT_OK) {
        m_pin(&M, a, 0);
        seat_gate(s, 1);
        return 1;
    }
    id = rep.id;
    M.seat[s].deferred++;
    cmd_init(&cmd, P_STATS);
    prod_call(&cmd);
    made_c = rep.stats.chunks_made;
    wait_chunks_released(released + (made_c - made) - (unsigned)__builtin_popcount(ca),
                         "chunks no slice uses stayed resident while a copy from another was "
                         "queued");

    /* B in C's chunks, made again: a LIVE buffer there is the consumer's to take. */
    b = publish_outside(ca);
    cb = b >= 0 ? rec_chunks(b) : 0;
    cmd_init(&cmd, P_STATS);
    prod_call(&cmd);
    remade = (cb & cc) != 0 && rep.stats.chunks_made > made_c;
    if (b >= 0 &&
        real_call(s, b, 0, 1u << rank, 0, 0,
                  "consume in a chunk made again while a copy from another is queued") == VMMT_OK &&
        remade)
        R.ctr[CTR_chunk_remade_held]++;
    say("chunk remade: A in chunks %#x queued at consumer %d, C in %#x, B in %#x", ca, s, cc, cb);

    seat_gate(s, 1);
    cmd_init(&cmd, C_VERIFY);
    cmd.id = id;
    call(&R.cons[s], &cmd);
    M.seat[s].deferred--;
    m_pin(&M, a, 0);
    if (!rep.stream_ok)
        finding("consumer %d's stream failed after its gate opened: %s", s, rep.msg);
    if (rep.first_bad != rep.nbytes || rep.found_uid != ra->uid[0] || rep.status2 != VMMT_OK)
        finding("a copy queued while another chunk was made again got %s bytes (first wrong "
                "byte %" PRIu64 " of %" PRIu64 ", the buffer names uid %" PRIx64
                "), vmmt_consumer_check says %s",
                rep.found_uid == ra->uid[0] ? "its own" : "another buffer's", rep.first_bad,
                rep.nbytes, rep.found_uid, st_name(rep.status2));
    if (rep.status2 == VMMT_OK) R.ctr[CTR_check_ok]++;
    add_copy(s, a, 0, VMMT_OK, 1u << rank);
    return 1;
}

/* ---------------------------------------------------------------- pools */

static void choose_params(void)
{
    static const uint64_t units[] = {4096, 16384, 65536, 262144, MT_MAX_UNIT};
    static const int slots[] = {3, 4, 6, 8, 12};
    struct mt_params *p = &R.prm;

    memset(p, 0, sizeof *p);
    p->unit = units[below(5)];
    p->max_slices = slots[below(5)];
    p->consumer_count = 1 + (int)below(MT_MAX_RANKS);
    p->memory_size = (below(3) == 0 ? 4u : 2u) << 20;
    p->handoff = VMMT_HANDOFF_AUTO;
    switch (R.kind) {
    case K_DEVICE_TABLE: p->device_table = 1; break;
    case K_SYNC:
        p->device_table = 1;
        p->handoff = VMMT_HANDOFF_SYNC;
        break;
    case K_HOST: p->memory_location = VMMT_MEMORY_HOST; break;
    case K_ELASTIC:
        p->elastic = 1;
        p->memory_size = 8u << 20;
        p->chunk_size = 2u << 20;
        p->idle_release_ms = 20;
        /* Half the pools with slices that reach past one chunk (op_chunk_remade_held). */
        if (below(2) == 0) {
            p->unit = MT_MAX_UNIT;
            p->max_slices = slots[2 + below(3)];
        }
        break;
    case K_FABRIC: p->fabric = 1; break;
    }
}

static void kind_env(void)
{
    unsetenv("VMMT_EMU_HANDLES");
    unsetenv("VMMT_EMU_WAIT_IMPORTED");
    unsetenv("VMMT_EMU_WAIT_HOST");
    if (R.kind == K_FABRIC) setenv("VMMT_EMU_HANDLES", "fabric,posix_fd", 1);
    if (R.kind == K_SYNC) setenv("VMMT_EMU_WAIT_IMPORTED", "0", 1);
}

static void begin_pool(void)
{
    char *argv[] = {R.self, "--producer", NULL};
    struct mt_cmd c;
    int nseats, capacity;
    uint64_t fit;

    R.kind = R.kind_arg == K_COUNT ? (int)below(K_COUNT - (on_cuda() ? 1 : 0)) : R.kind_arg;
    R.kinds_run[R.kind]++;
    choose_params();
    kind_env();
    R.prod.env[0] = '\0';
    spawn(&R.prod, argv);
    cmd_init(&c, P_CREATE);
    c.params = R.prm;
    prod_call(&c);
    if (rep.status != VMMT_OK) fatal("pool of kind %s: %s", kind_names[R.kind], rep.msg);
    R.st0 = rep.stats;
    R.host_table = R.st0.host_control_table;
    R.has_broker = R.kind != K_FABRIC;
    /* A FABRIC consumer waits for a copy behind a gate on the host, within its timeout
     * (it cannot see its producer die: src/consumer/consume.c, wait_ready), so a gated
     * publish would only time out there; test_occupancy.c holds that. */
    R.can_gate = R.st0.handoff == VMMT_HANDOFF_STREAM && R.kind != K_FABRIC;
    if ((R.kind == K_SYNC) != (R.st0.handoff == VMMT_HANDOFF_SYNC))
        fatal("kind %s got hand-off %s", kind_names[R.kind], vmmt_handoff_name(R.st0.handoff));
    if ((R.kind == K_FABRIC) != (R.st0.handle_type == VMMT_HANDLE_FABRIC))
        fatal("kind %s got handle type %s", kind_names[R.kind],
              vmmt_handle_type_name(R.st0.handle_type));
    fit = R.st0.data_bytes / R.prm.unit;
    capacity = (int)(fit < R.st0.slots ? fit : R.st0.slots);
    nseats = 2 + (int)below(MT_MAX_SEATS - 1);
    R.nseats = nseats;
    m_inst_begin(&M, (const uint8_t[16]){0}, R.prm.consumer_count, R.st0.slots, capacity, nseats);
    cur()->shared_table = R.host_table;
    /* Ranks to seats: each rank one holder; with more seats than ranks, a seat holds none. */
    int off = (int)below((uint64_t)nseats);
    for (int s = 0; s < nseats; s++) {
        unsigned role = 0;
        for (int r = 0; r < R.prm.consumer_count; r++)
            if ((r + off) % nseats == s) role |= 1u << r;
        /* A seat whose driver refuses stream waits polls the ready word from the host. */
        int waits = !(s == nseats - 1 && below(3) == 0 && R.kind != K_SYNC && !on_cuda());
        R.cons[s].env[0] = '\0';
        if (!waits)
            snprintf(R.cons[s].env, sizeof R.cons[s].env, "%s=0",
                     R.host_table ? "VMMT_EMU_WAIT_HOST" : "VMMT_EMU_WAIT_IMPORTED");
        start_consumer(s);
        m_seat_started(&M, s, role, waits);
    }
    R.ending = (int)((M.ninst + R.seed) % 3);
    R.ctr[CTR_instances]++;
    printf("model_test: pool #%d: kind %s, %d rank(s), %d consumer process(es), %u slots, "
           "slice %" PRIu64 " bytes, capacity %d, hand-off %s, %s table, ending %s\n",
           M.ninst - 1, kind_names[R.kind], R.prm.consumer_count, nseats, R.st0.slots, R.prm.unit,
           capacity, vmmt_handoff_name(R.st0.handoff), R.host_table ? "host" : "device",
           R.ending == 0   ? "normal"
           : R.ending == 1 ? "shutdown"
                           : "producer kill");
}

static void end_consumers(void)
{
    struct mt_cmd c;
    for (int s = 0; s < R.nseats; s++) {
        if (!R.cons[s].alive) continue;
        cmd_init(&c, C_END);
        call(&R.cons[s], &c);
        if (rep.status2 != VMMT_OK)
            finding("consumer %d holds more after vmmt_consumer_destroy than before it created "
                    "its consumer: fds %d -> %d, mappings %d -> %d, threads %d -> %d, emulator "
                    "allocations %d -> %d, reservations %d -> %d, mappings %d -> %d, streams %d "
                    "-> %d, events %d -> %d, blocks %d -> %d",
                    s, rep.before.fds, rep.after.fds, rep.before.maps, rep.after.maps,
                    rep.before.threads, rep.after.threads, rep.before.allocations,
                    rep.after.allocations, rep.before.reservations, rep.after.reservations,
                    rep.before.mappings, rep.after.mappings, rep.before.streams, rep.after.streams,
                    rep.before.events, rep.after.events, rep.before.blocks, rep.after.blocks);
        R.ctr[CTR_leak_check]++;
        reap(&R.cons[s]);
    }
}

static void end_producer(void)
{
    struct mt_cmd c;
    m_inst_end(&M, M_SHUT); /* destroyed: its descriptors are no longer LIVE */
    cmd_init(&c, P_END);
    prod_call(&c);
    if (rep.status2 != VMMT_OK)
        finding("the producer holds more after vmmt_pool_destroy than before the pool: fds %d "
                "-> %d, mappings %d -> %d, threads %d -> %d, emulator allocations %d -> %d, "
                "reservations %d -> %d, mappings %d -> %d, streams %d -> %d, events %d -> %d",
                rep.before.fds, rep.after.fds, rep.before.maps, rep.after.maps, rep.before.threads,
                rep.after.threads, rep.before.allocations, rep.after.allocations,
                rep.before.reservations, rep.after.reservations, rep.before.mappings,
                rep.after.mappings, rep.before.streams, rep.after.streams, rep.before.events,
                rep.after.events);
    R.ctr[CTR_leak_check]++;
    reap(&R.prod);
}

/* After a shutdown: the producer's calls that must be refused, or may be. */
static int op_after_shutdown(void)
{
    struct mt_cmd c;
    int what = (int)below(5);
    if (!R.prod.alive || cur()->ended != M_SHUT) return 0;
    if (what == 0) {
        int members = 1 + (int)below(2);
        cmd_init(&c, P_PUBLISH);
        c.members = members;
        split_unit(members, c.nbytes);
        c.uid[0] = c.uid[1] = mt_mix(R.seed) + ++R.next_uid;
        prod_call(&c);
        if (rep.status != VMMT_ECLOSED)
            finding("publish after shutdown answered %s, not VMMT_ECLOSED", st_name(rep.status));
    } else if (what == 1) {
        int id = free_res_id();
        if (id < 0) return 0;
        cmd_init(&c, P_RESERVE);
        c.id = id;
        c.nbytes[0] = R.prm.unit;
        prod_call(&c);
        if (rep.status != VMMT_ECLOSED)
            finding("reserve after shutdown answered %s, not VMMT_ECLOSED", st_name(rep.status));
    } else if (what == 2) {
        int id = res_with(1);
        if (id < 0) return 0;
        cmd_init(&c, P_COMMIT);
        c.id = id;
        c.uid[0] = mt_mix(R.seed) + ++R.next_uid;
        c.nbytes[0] = R.prm.unit;
        prod_call(&c);
        if (rep.status != VMMT_ECLOSED)
            finding("commit after shutdown answered %s, not VMMT_ECLOSED", st_name(rep.status));
        cur()->res[id].state = 3;
    } else if (what == 3) {
        cmd_init(&c, P_SHUTDOWN);
        prod_call(&c);
        if (rep.status != VMMT_OK)
            finding("a second shutdown answered %s (idempotent: VMMT_OK)", st_name(rep.status));
    } else {
        cmd_init(&c, P_STATS);
        prod_call(&c);
        if (rep.status != VMMT_OK) finding("stats after shutdown answered %s", st_name(rep.status));
    }
    return 1;
}

struct op {
    int (*fn)(void);
    int weight;
};

static int op_gated_open(void)
{
    return op_gated(0);
}

static const struct op normal_ops[] = {
    {op_publish, 14},     {op_packed, 7},        {op_reserve, 3},   {op_commit, 4},
    {op_commit_again, 1}, {op_res_cancel, 1},    {op_cancel, 2},    {op_cancel_replay, 1},
    {op_work, 34},        {op_drop, 2},          {op_replay, 9},    {op_forge, 9},
    {op_token, 1},        {op_bad_ranks, 1},     {op_check, 2},     {op_evict, 2},
    {op_evict_old, 1},    {op_kill_consumer, 1}, {op_release, 1},   {op_reclaim, 1},
    {op_stats, 2},        {op_gated_open, 2},    {op_quiesce, 2},   {op_chunk_cycle, 1},
    {op_flush, 2},        {op_cancel_taken, 2},  {op_list_part, 2},
};

static const struct op after_ops[] = {
    {op_replay, 6},         {op_forge, 3}, {op_check, 2},
    {op_after_shutdown, 3}, {op_evict, 1}, {op_flush, 1},
};

static void run_op(const struct op *ops, size_t n)
{
    int total = 0;
    for (size_t i = 0; i < n; i++)
        total += ops[i].weight;
    for (int tries = 0; tries < 50; tries++) {
        int pick = (int)below((uint64_t)total);
        for (size_t i = 0; i < n; i++) {
            if (pick < ops[i].weight) {
                if (ops[i].fn()) return;
                break;
            }
            pick -= ops[i].weight;
        }
    }
}

static int time_left(void)
{
    if (R.seconds > 0) return now_s() - R.t0 < R.seconds;
    return R.step < R.steps_max;
}

/* One pool from creation to its end. */
static void one_pool(void)
{
    long length = 60 + (long)below(140);

    begin_pool();
    R.step++;
    for (long i = 0; i < length && time_left(); i++, R.step++)
        run_op(normal_ops, sizeof normal_ops / sizeof normal_ops[0]);
    if (!time_left()) R.ending = 0; /* the run ends: no step after this one may be cut off */
    if (R.ending == 0) {
        quiesce();
        end_producer();
    } else {
        if (R.ending == 1) {
            struct mt_cmd c;
            if (below(2)) quiesce();
            cmd_init(&c, P_SHUTDOWN);
            prod_call(&c);
            if (rep.status != VMMT_OK)
                finding("shutdown answered %s: %s", st_name(rep.status), rep.msg);
            m_inst_end(&M, M_SHUT);
            R.ctr[CTR_shutdown]++;
        } else if (!(R.can_gate && below(4) != 0 && !skipped("gate_kill") && op_gated(1))) {
            producer_killed();
        }
        R.step++;
        for (int i = 0; i < 8 + (int)below(12); i++, R.step++)
            run_op(after_ops, sizeof after_ops / sizeof after_ops[0]);
        if (R.prod.alive) end_producer();
    }
    end_consumers();
    R.step++;
}

/* ---------------------------------------------------------------- main */

static int check_counters(void)
{
    int failed = 0, any_gate_kill = 0, any_broker = 0, any_stream = 0, any_elastic = 0;
    int any_device = 0, any_device_gate = 0, any_shared = 0;
    for (int k = 0; k < K_COUNT; k++) {
        if (!R.kinds_run[k]) continue;
        any_gate_kill |= k != K_SYNC && k != K_FABRIC;
        any_broker |= k != K_FABRIC;
        any_stream |= k != K_SYNC && k != K_FABRIC; /* gates: stream-ordered, not FABRIC */
        any_elastic |= k == K_ELASTIC;
        any_device |= k != K_HOST;
        any_device_gate |= k != K_HOST && k != K_SYNC && k != K_FABRIC;
        any_shared |= k == K_HOST_TABLE || k == K_HOST || k == K_ELASTIC;
    }
    for (int i = 0; i < CTR_COUNT; i++) {
        int need = ctr_req[i] == 1 || (ctr_req[i] == 2 && any_gate_kill) ||
                   (ctr_req[i] == 3 && any_broker) || (ctr_req[i] == 4 && any_stream) ||
                   (ctr_req[i] == 5 && any_elastic) || (ctr_req[i] == 6 && any_device) ||
                   (ctr_req[i] == 7 && any_device_gate) || (ctr_req[i] == 8 && any_shared);
        if (need && R.ctr[i] == 0) {
            fprintf(stderr, "model_test: path never taken: %s (run longer, or another seed)\n",
                    ctr_text[i]);
            failed = 1;
        }
    }
    return failed;
}

static int parse_kind(const char *s)
{
    if (strcmp(s, "all") == 0) return K_COUNT;
    for (int k = 0; k < K_COUNT; k++)
        if (strcmp(s, kind_names[k]) == 0) return k;
    fprintf(stderr,
            "model_test: unknown kind %s (host_table, device_table, sync, host, elastic, "
            "fabric, all)\n",
            s);
    exit(2);
}

int main(int argc, char **argv)
{
    ssize_t n;

    setvbuf(stdout, NULL, _IOLBF, 0);
    setenv("VMMT_TEST_DRIVER", "emu", 0);
    /* The library warns of what the test does on purpose (releases, full pools, deaths). */
    setenv("VMMT_LOG", "error", 0);
    if (argc >= 2 && strcmp(argv[1], "--producer") == 0) return mt_producer_main();
    if (argc >= 5 && strcmp(argv[1], "--consumer") == 0)
        return mt_consumer_main(atoi(argv[3]), strtoull(argv[4], NULL, 0));
    R.seed = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 20);
    R.kind_arg = K_COUNT;
    R.steps_max = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--seed") == 0 && i + 1 < argc)
            R.seed = strtoull(argv[++i], NULL, 0);
        else if (strcmp(argv[i], "--kind") == 0 && i + 1 < argc)
            R.kind_arg = parse_kind(argv[++i]);
        else if (strcmp(argv[i], "--steps") == 0 && i + 1 < argc)
            R.steps_max = atol(argv[++i]);
        else if (strcmp(argv[i], "--seconds") == 0 && i + 1 < argc)
            R.seconds = atof(argv[++i]);
        else if (strcmp(argv[i], "--skip") == 0 && i + 1 < argc)
            snprintf(R.skip, sizeof R.skip, "%s", argv[++i]);
        else if (strcmp(argv[i], "--strict-end") == 0)
            R.strict_end = 1;
        else if (strcmp(argv[i], "--verbose") == 0)
            R.verbose = 1;
        else if (strcmp(argv[i], "--keep-going") == 0)
            R.keep_going = 1;
        else if (strcmp(argv[i], "--one-ahead") == 0 && i + 1 < argc)
            R.one_ahead_left = atoi(argv[++i]) > 0 ? atoi(argv[i]) : -1;
        else {
            fprintf(stderr,
                    "usage: %s [--seed N] [--kind host_table|device_table|sync|host|elastic|"
                    "fabric|all] [--steps N | --seconds S] [--skip op,...] [--strict-end] "
                    "[--keep-going] [--one-ahead N] [--verbose]\n  ops to skip: publish packed "
                    "reserve cancel consume drop "
                    "replay forge one_ahead check flush evict kill_consumer auto_release release "
                    "gate gate_kill cancel_taken\n",
                    argv[0]);
            return 2;
        }
    }
    if (R.steps_max <= 0 && R.seconds <= 0) R.steps_max = 400;
    n = readlink("/proc/self/exe", R.self, sizeof R.self - 1);
    if (n <= 0) fatal("readlink /proc/self/exe");
    R.self[n] = '\0';
    if (R.kind_arg == K_FABRIC && on_cuda()) {
        printf("model_test: kind fabric needs the emulator (FABRIC handles on a real GPU need an "
               "IMEX channel): skipped\n");
        return 77;
    }
    R.rng = R.seed ? R.seed : 1;
    if (R.one_ahead_left == 0) R.one_ahead_left = 3;
    m_init(&M, R.strict_end);
    printf("model_test: seed %" PRIu64 ", kind %s, %s %g%s%s\n", R.seed,
           R.kind_arg == K_COUNT ? "all" : kind_names[R.kind_arg],
           R.seconds > 0 ? "seconds" : "steps", R.seconds > 0 ? R.seconds : (double)R.steps_max,
           R.skip[0] ? ", skipping " : "", R.skip);
    R.t0 = now_s();
    while (time_left())
        one_pool();
    print_counters(stdout);
    if (check_counters() | (R.findings != 0)) {
        if (R.findings)
            printf("model_test: %d finding(s); each distinct one printed above\n", R.findings);
        replay_line(stderr);
        printf("model_test: FAILED\n");
        return 1;
    }
    printf("model_test: passed (%ld steps, %d pools)\n", R.step, M.ninst);
    return 0;
}
