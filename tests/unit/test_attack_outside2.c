/*
 * A second outside attacker's sequences, written from include/vmmt.h and the
 * docs alone (docs/descriptor.md "What a reader must verify", docs/design.md
 * "Invariants" 7 and 9 and "The one case not covered", docs/broker.md
 * "Liveness"), against the surfaces added last: the TAKEN acknowledgement
 * words of shared tables, vmmt_consumer_check after a repair or a taking
 * back, vmmt_pool_release_rank and dead-consumer releases, vmmt_cancel of a
 * descriptor already handed out, and packed groups split across processes.
 *
 * Each test asserts what the docs promise, and fails with "FINDING:" and
 * what happened. Regression tests for attacks that held, and for the five
 * findings, each of which failed when it was written and is fixed since:
 *  - cancel/release_under_queued_copy_check (fixed: src/wire/ctrl.h,
 *    vmmt__ctrl_store_ack): a shared table's TAKEN word overwritten with d
 *    by vmmt_cancel or vmmt_pool_release_rank read, to the late
 *    acknowledgement, as its own: vmmt_consumer_check said OK for a copy
 *    that held the next occupant's bytes.
 *  - cancel/release_late_device_ack (fixed: src/consumer/device_table.c,
 *    vmmt__table_write_acks): on a device table the taken-back consume's
 *    unconditional stream write of d landed over the next occupant's
 *    acknowledgement: that slice never came back.
 *  - dead_taker_other_holder_leaks (fixed: src/producer/release.c,
 *    vmmt__pool_shared_ranks_dead): a process killed with its rank's word
 *    TAKEN while another live process holds the rank: the word stayed
 *    TAKEN, the live process was refused, the slice stayed in flight.
 *
 * Two consumer objects of one process share nothing but the control table
 * (each imports the pool, takes words and acknowledges on its own), so they
 * stand for two processes where a test needs to hold a copy queued at will;
 * real processes (tests/children/consumer_child, producer_child) are used
 * where the liveness link matters.
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "attack_helpers.h"
#include "emu.h"
#include "pattern.h"
#include "poolfix.h"
#include "rawbroker.h"

/* ------------------------------------------------------------ helpers */

static void make_pool(struct fixture *f, int consumers, int device_table, uint32_t slices,
                      uint32_t recycle_us, int lease_ms)
{
    vmmt_pool_config c = config(4 * MiB, consumers);

    c.max_slices = slices;
    c.device_control_table = device_table;
    if (recycle_us) c.recycle_interval_us = recycle_us;
    c.consumer_lease_ms = lease_ms;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
}

/* Two members of N bytes, patterns p0 and p1, packed into one slot; landed. */
static void publish_pair(struct fixture *f, uint32_t p0, uint32_t p1, vmmt_desc out[2])
{
    vmmt_buffer b[2] = {bytes(f->src, N), bytes(f->src + N, N)};

    put(f, f->src, N, p0);
    put(f, f->src + N, N, p1);
    assert_vmmt_ok(vmmt_publish_packed(f->pool, b, 2, f->stream, out));
    sync_s(f->stream);
}

static int wait_rank_releases(struct fixture *f, uint64_t want, int ms)
{
    for (int i = 0; i < ms / 2 && stats(f->pool).rank_releases < want; i++)
        sleep_ms(2);
    return stats(f->pool).rank_releases >= want;
}

/* ======================================================= 1. TAKEN words */

/*
 * docs/descriptor.md step 3: "a word found at d or d - 1 (another process
 * got there first) refuses, after giving back the words this call took."
 *
 * Two ranks. Consumer A takes rank 1 (its copy held queued). Consumer B asks
 * for both ranks: it takes rank 0, finds rank 1 taken and must refuse AND
 * give rank 0 back. Consumer C then consumes rank 0 with the right bytes and
 * the slice comes back. A rank 0 word left TAKEN by B's refused call would
 * keep the slice in flight for ever (nobody could consume or acknowledge it).
 */
static void test_holds_partial_take_given_back(void **state)
{
    struct fixture *f = *state;
    vmmt_consumer *b, *c;
    CUstream sa = new_stream();
    struct gate g;
    vmmt_desc d;

    make_pool(f, 2, 0, 4, 0, 0);
    assert_vmmt_ok(vmmt_consumer_create(NULL, &b));
    assert_vmmt_ok(vmmt_consumer_create(NULL, &c));
    d = publish(f, 11);
    sync_s(f->stream);
    gate_close(&g, sa);
    assert_vmmt_ok(consume_at(f->consumer, &d, f->dst, sa, 1, 1));
    assert_int_equal(consume_at(b, &d, f->dst + MiB, f->stream, VMMT_ALL_RANKS, 0), VMMT_ESTATE);
    assert_int_equal(vmmt_consumer_ack(b, &d, 0, f->stream, VMMT_ALL_RANKS, 0), VMMT_ESTATE);
    assert_vmmt_ok(consume_at(c, &d, f->dst + 2 * MiB, f->stream, 0, 1));
    sync_s(f->stream);
    assert_true(holds(f->stream, f->dst + 2 * MiB, 11));
    gate_open_later(&g, 5);
    gate_free(&g);
    sync_s(sa);
    assert_true(holds(f->stream, f->dst, 11));
    assert_vmmt_ok(vmmt_consumer_check(f->consumer, &d));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    vmmt_consumer_destroy(b);
    vmmt_consumer_destroy(c);
    free_stream(sa);
}

/* Racing calls of two consumers for one descriptor, many times over. */
struct racer {
    vmmt_consumer *c;
    const vmmt_desc *d;
    CUdeviceptr dst;
    CUstream s;
    int first, count, ack; /* ack: vmmt_consumer_ack instead of a consume */
    pthread_barrier_t *go;
    int st;
};

static void *race_one(void *arg)
{
    struct racer *r = arg;

    pthread_barrier_wait(r->go);
    if (r->ack)
        r->st = vmmt_consumer_ack(r->c, r->d, 0, r->s, r->first, r->count);
    else
        r->st = vmmt_consume(r->c, r->d, 0, r->dst, N, r->s, r->first, r->count);
    return NULL;
}

static void race_pair(struct racer *a, struct racer *b)
{
    pthread_barrier_t go;
    pthread_t ta, tb;

    pthread_barrier_init(&go, NULL, 2);
    a->go = b->go = &go;
    assert_int_equal(pthread_create(&ta, NULL, race_one, a), 0);
    assert_int_equal(pthread_create(&tb, NULL, race_one, b), 0);
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    pthread_barrier_destroy(&go);
}

/*
 * Invariant 9: "two processes of one rank can never both copy one
 * occupant". Two consumers of rank 0 race for each of 150 descriptors, as
 * consume against consume and consume against a drop (vmmt_consumer_ack).
 * Exactly one of each pair may succeed; an OK consume holds its own bytes;
 * no slice stays in flight.
 */
static void test_holds_same_rank_race(void **state)
{
    struct fixture *f = *state;
    vmmt_consumer *other;
    CUstream s1 = new_stream(), s2 = new_stream();
    int both = 0, none = 0;

    make_pool(f, 1, 0, 8, 0, 0);
    assert_vmmt_ok(vmmt_consumer_create(NULL, &other));
    for (uint32_t i = 0; i < 150; i++) {
        vmmt_desc d = publish(f, i % 64);
        struct racer a = {f->consumer, &d, f->dst, s1, 0, 1, 0, NULL, 0};
        struct racer b = {other, &d, f->dst + MiB, s2, 0, 1, (int)(i % 2), NULL, 0};

        if (i % 3 == 0) sync_s(f->stream); /* LIVE; else it may still be PENDING */
        race_pair(&a, &b);
        sync_s(s1);
        sync_s(s2);
        both += a.st == VMMT_OK && b.st == VMMT_OK;
        none += a.st != VMMT_OK && b.st != VMMT_OK;
        if (a.st == VMMT_OK)
            PROMISE(holds(f->stream, f->dst, i % 64), "race %u: OK with wrong bytes", i);
        if (b.st == VMMT_OK && !b.ack)
            PROMISE(holds(f->stream, f->dst + MiB, i % 64), "race %u: OK with wrong bytes", i);
    }
    PROMISE(both == 0, "%d of 150 races: both calls of rank 0 returned OK", both);
    PROMISE(none == 0, "%d of 150 races: neither call of rank 0 succeeded", none);
    PROMISE(vmmt_pool_drain(f->pool, 5000) == VMMT_OK, "slices left in flight after the races");
    vmmt_consumer_destroy(other);
    free_stream(s1);
    free_stream(s2);
}

/*
 * The give-back under a race: consumer A asks for all ranks (0 and 1),
 * consumer B for rank 1 alone. One of them wins rank 1; whatever A took of
 * rank 0 while losing must come back, so that a third call for what is left
 * succeeds and the slice is recycled.
 */
static void test_holds_all_ranks_race_gives_back(void **state)
{
    struct fixture *f = *state;
    vmmt_consumer *other;
    CUstream s1 = new_stream(), s2 = new_stream();

    make_pool(f, 2, 0, 8, 0, 0);
    assert_vmmt_ok(vmmt_consumer_create(NULL, &other));
    for (uint32_t i = 0; i < 150; i++) {
        vmmt_desc d = publish(f, i % 64);
        struct racer a = {f->consumer, &d, f->dst, s1, VMMT_ALL_RANKS, 0, 0, NULL, 0};
        struct racer b = {other, &d, f->dst + MiB, s2, 1, 1, 0, NULL, 0};

        if (i % 2) sync_s(f->stream);
        race_pair(&a, &b);
        PROMISE(!(a.st == VMMT_OK && b.st == VMMT_OK), "race %u: rank 1 consumed twice", i);
        PROMISE(a.st == VMMT_OK || b.st == VMMT_OK, "race %u: both refused (%d, %d)", i, a.st,
                b.st);
        if (a.st != VMMT_OK) {
            /* Rank 0 is still owed: A's refused call must have given it back. */
            int st = consume_at(f->consumer, &d, f->dst, s1, 0, 1);
            PROMISE(st == VMMT_OK, "race %u: rank 0 after A lost rank 1: %d (%s)", i, st,
                    vmmt_last_error());
        }
        sync_s(s1);
        sync_s(s2);
        PROMISE(holds(f->stream, f->dst, i % 64), "race %u: wrong bytes", i);
    }
    PROMISE(vmmt_pool_drain(f->pool, 5000) == VMMT_OK, "slices left in flight after the races");
    vmmt_consumer_destroy(other);
    free_stream(s1);
    free_stream(s2);
}

/*
 * vmmt.h: "A failed copy still acknowledges, so the slice is released; the
 * descriptor cannot be consumed again." With TAKEN words the failed copy's
 * words go from TAKEN to acknowledged, never back to free: a second process
 * of the rank is refused, and the slice is recycled.
 */
static void test_holds_failed_copy_acknowledges(void **state)
{
    struct fixture *f = *state;
    vmmt_consumer *other;
    const char *entry = NULL;
    vmmt_desc d;
    long before[2];
    int st;

    if (!on_emu()) skip();
    make_pool(f, 1, 0, 4, 0, 0);
    assert_vmmt_ok(vmmt_consumer_create(NULL, &other));
    /* Which copy entry point a consume uses (the emulator's call counters). */
    d = publish(f, 1);
    sync_s(f->stream);
    before[0] = vmmt__emu_calls("cuMemcpyDtoDAsync");
    before[1] = vmmt__emu_calls("cuMemcpyAsync");
    assert_vmmt_ok(consume_at(f->consumer, &d, f->dst, f->stream, 0, 1));
    sync_s(f->stream);
    if (vmmt__emu_calls("cuMemcpyDtoDAsync") > before[0]) entry = "cuMemcpyDtoDAsync";
    if (vmmt__emu_calls("cuMemcpyAsync") > before[1]) entry = "cuMemcpyAsync";
    assert_non_null(entry);

    d = publish(f, 2);
    sync_s(f->stream);
    char spec[64];
    snprintf(spec, sizeof spec, "%s:*:CUDA_ERROR_UNKNOWN", entry);
    emu_fail(spec);
    st = consume_at(f->consumer, &d, f->dst, f->stream, 0, 1);
    emu_reset();
    assert_int_not_equal(st, VMMT_OK);
    sync_s(f->stream);
    PROMISE(consume_at(other, &d, f->dst + MiB, f->stream, 0, 1) == VMMT_ESTATE,
            "a descriptor whose copy failed was consumed again by another process");
    PROMISE(consume_at(f->consumer, &d, f->dst, f->stream, 0, 1) == VMMT_ESTATE,
            "a descriptor whose copy failed was consumed again");
    sync_s(f->stream);
    PROMISE(vmmt_pool_drain(f->pool, 5000) == VMMT_OK,
            "the slice of a failed copy stayed in flight");
    vmmt_consumer_destroy(other);
}

/*
 * A wait that times out "acknowledges nothing: the call may be retried",
 * and gives its rank's word back (docs/descriptor.md step 3). Here on the
 * path where the consumer watches the ready word with loads (the emulator
 * refuses stream waits on host and imported memory): a consume and a drop
 * of a descriptor whose producer's copy is held time out; once the copy
 * lands another consumer of the rank is served, and the slice comes back.
 */
static void test_holds_polled_timeout_gives_word_back(void **state)
{
    struct fixture *f = *state;
    vmmt_buffer b = bytes(f->src, N);
    vmmt_consumer_config cc;
    vmmt_consumer *quick, *other;
    struct gate g;
    vmmt_desc d;
    int st, st_ack, st_other;

    if (!on_emu()) skip();
    make_pool(f, 1, 0, 4, 0, 0);
    vmmt_consumer_config_init(&cc);
    cc.timeout_ms = 150;
    assert_vmmt_ok(vmmt_consumer_create(&cc, &quick));
    assert_vmmt_ok(vmmt_consumer_create(NULL, &other));
    put(f, f->src, N, 12);
    gate_close(&g, f->stream);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d)); /* PENDING */
    setenv("VMMT_EMU_WAIT_HOST", "0", 1);
    setenv("VMMT_EMU_WAIT_IMPORTED", "0", 1);
    vmmt__emu_configure();
    vmmt_probe_reset();
    st = consume_at(quick, &d, f->dst, f->stream, 0, 1);
    st_ack = vmmt_consumer_ack(quick, &d, 0, f->stream, 0, 1);
    gate_open_later(&g, 0);
    gate_free(&g);
    sync_s(f->stream);
    st_other = consume_at(other, &d, f->dst + MiB, f->stream, 0, 1);
    sync_s(f->stream);
    emu_reset();
    int drained = vmmt_pool_drain(f->pool, 5000);
    int right = st_other == VMMT_OK && holds(f->stream, f->dst + MiB, 12);
    vmmt_consumer_destroy(quick);
    vmmt_consumer_destroy(other);
    PROMISE(st == VMMT_ETIMEDOUT && st_ack == VMMT_ETIMEDOUT,
            "polled consume / drop of a held copy: %d / %d, not VMMT_ETIMEDOUT", st, st_ack);
    PROMISE(right, "after a timed-out consume the rank's other process was refused: %d", st_other);
    PROMISE(drained == VMMT_OK, "slice left in flight after a timed-out consume");
}

/* ========================================== 2. check after repair / death */

struct producer {
    pid_t pid;
    int sock;
    vmmt_desc d[3]; /* landed, landed, queued behind a wait that never opens */
};

static void spawn_producer(struct producer *p, int device_table)
{
    char arg[4];
    char *argv[] = {arg, NULL};
    int sv[2];

    snprintf(arg, sizeof arg, "%d", device_table);
    assert_int_equal(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
    p->pid = tu_spawn("producer_child", argv, sv[1]);
    assert_true(p->pid > 0);
    close(sv[1]);
    p->sock = sv[0];
    for (uint32_t i = 0; i < 3; i++) {
        struct tu_msg m;
        assert_int_equal(read(p->sock, &m, sizeof m), sizeof m);
        assert_int_equal(m.index, i + 1);
        memcpy(p->d[i].bytes, m.desc, sizeof p->d[i].bytes);
    }
}

static void kill_producer(struct producer *p)
{
    kill(p->pid, SIGKILL);
    tu_wait(p->pid, 5000);
    close(p->sock);
}

static int wait_pool_count(vmmt_consumer *c, int want, int ms)
{
    for (int i = 0; i < ms && vmmt_consumer_pool_count(c) != want; i++)
        sleep_ms(1);
    return vmmt_consumer_pool_count(c);
}

/*
 * A copy out of a dead producer's pool that is still queued on the
 * consumer's stream when the death is seen (the stream is held by a gate).
 * Buffer 1 had landed before the death: its bytes are the producer's, so
 * vmmt_consumer_check says OK ("EFAILED when the producer died before its
 * copy into the slice was done"), and the pool is never unmapped under the
 * queued copy (vmmt.h, max_pools: "a pool is never unmapped under a queued
 * copy"; design.md: "once every copy out of the pool is done, the pool is
 * let go"). Buffer 3, whose bytes never came, queued behind the same gate:
 * EFAILED. Both tables.
 */
static void dead_producer_gated_copy(struct fixture *f, int device_table)
{
    CUstream s = new_stream();
    struct producer p;
    struct gate g;

    spawn_producer(&p, device_table);
    gate_close(&g, s);
    assert_vmmt_ok(consume_at(f->consumer, &p.d[0], f->dst, s, 0, 1));
    assert_vmmt_ok(vmmt_consume(f->consumer, &p.d[2], 0, f->dst + MiB, N, s, 0, 1));
    kill_producer(&p);
    sleep_ms(100); /* the watch sees the death; the copies are still held */
    PROMISE(vmmt_consumer_pool_count(f->consumer) == 1,
            "a dead producer's pool was let go under a queued copy");
    gate_open_later(&g, 0);
    gate_free(&g);
    sync_s(s);
    PROMISE(holds(f->stream, f->dst, 1), "buffer 1, landed before the death, copied wrong bytes");
    int st = vmmt_consumer_check(f->consumer, &p.d[0]);
    PROMISE(st == VMMT_OK, "check of a buffer that landed before its producer died: %d (%s)", st,
            vmmt_last_error());
    st = vmmt_consumer_check(f->consumer, &p.d[2]);
    PROMISE(st == VMMT_EFAILED, "check of a buffer that never landed: %d", st);
    /* A drop of the landed but unconsumed buffer 2 is refused: the pool is closed. */
    st = vmmt_consumer_ack(f->consumer, &p.d[1], 0, f->stream, 1, 1);
    PROMISE(st == VMMT_ECLOSED, "ack of a dead producer's descriptor: %d", st);
    sync_s(f->stream);
    assert_int_equal(wait_pool_count(f->consumer, 0, 3000), 0);
    free_stream(s);
}

static void test_holds_dead_producer_gated_copy_host_table(void **state)
{
    dead_producer_gated_copy(*state, 0);
}

static void test_holds_dead_producer_gated_copy_device_table(void **state)
{
    dead_producer_gated_copy(*state, 1);
}

struct acker {
    vmmt_consumer *c;
    const vmmt_desc *d;
    CUstream s;
    int st;
    volatile int done;
};

static void *ack_thread(void *arg)
{
    struct acker *a = arg;
    a->st = vmmt_consumer_ack(a->c, a->d, 0, a->s, 1, 1);
    a->done = 1;
    return NULL;
}

/*
 * vmmt_consumer_ack of a descriptor whose producer's copy is still queued
 * waits for it ("at most the consumer's timeout_ms"). The producer is
 * killed during that wait: the drop must not be acknowledged (nothing
 * landed) and must return, well before a default timeout, or at the latest
 * with it ("nothing waits forever"). A consumer that comes later is refused.
 */
static void test_holds_ack_waiting_when_producer_dies(void **state)
{
    struct fixture *f = *state;
    struct acker a = {0};
    struct producer p;
    vmmt_consumer *late;
    pthread_t t;
    struct timespec dl;
    int st;

    spawn_producer(&p, 0);
    a.c = f->consumer;
    a.d = &p.d[2];
    a.s = f->stream;
    assert_int_equal(pthread_create(&t, NULL, ack_thread, &a), 0);
    sleep_ms(50);
    kill_producer(&p);
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += 8;
    st = pthread_timedjoin_np(t, NULL, &dl);
    PROMISE(st == 0, "vmmt_consumer_ack still waiting 8 s after its producer died");
    PROMISE(a.st != VMMT_OK, "a drop of a buffer that never landed was acknowledged (OK)");
    assert_vmmt_ok(vmmt_consumer_create(NULL, &late));
    st = consume_at(late, &p.d[2], f->dst, f->stream, 0, 1);
    sync_s(f->stream);
    PROMISE(st != VMMT_OK, "a later consumer consumed a dead producer's unlanded buffer");
    vmmt_consumer_destroy(late);
    assert_int_equal(wait_pool_count(f->consumer, 0, 3000), 0);
}

/* ============================== 3. taking back from under a queued copy */

/*
 * docs/design.md, "The one case not covered": a consume that queued its
 * copy, after which the occupant left without this consumer's
 * acknowledgement (vmmt_cancel of a descriptor already handed out,
 * vmmt_pool_release_rank of a live rank) "may copy from a slice reused
 * meanwhile; with a shared table vmmt_consumer_check then says
 * VMMT_EFAILED". vmmt.h says the same ("also when the occupant left its
 * slot while this process's copy ran").
 *
 * Sequence: one rank, one slot; consumer A consumes buffer 1 with its
 * stream held by a gate (its rank's word TAKEN); the producer takes the
 * slot back (how); the slot is recycled and buffer 2 is published into the
 * same slice; the gate opens and A's copy runs: dst holds buffer 2's bytes.
 * vmmt_consumer_check must then say EFAILED, never OK.
 */
enum take_back { BY_CANCEL, BY_RELEASE };

static void taken_back_under_copy(struct fixture *f, enum take_back how)
{
    CUstream s = new_stream();
    struct gate g;
    vmmt_desc d1, d2;
    int st, st_later, got;

    make_pool(f, 1, 0, 1, 0, 0);
    d1 = publish(f, 1);
    sync_s(f->stream);
    gate_close(&g, s);
    assert_vmmt_ok(consume_at(f->consumer, &d1, f->dst, s, 0, 1));
    if (how == BY_CANCEL)
        assert_vmmt_ok(vmmt_cancel(f->pool, &d1));
    else
        assert_vmmt_ok(vmmt_pool_release_rank(f->pool, 0));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    d2 = publish(f, 2);
    sync_s(f->stream);
    assert_int_equal(tu_get64(&d2, OFF_OFFSET), tu_get64(&d1, OFF_OFFSET));
    gate_open_later(&g, 0);
    gate_free(&g);
    sync_s(s);
    got = which(f->stream, f->dst);
    st = vmmt_consumer_check(f->consumer, &d1);
    sleep_ms(50); /* the acknowledgement thread has run too: ask again */
    st_later = vmmt_consumer_check(f->consumer, &d1);
    /* Buffer 2's own consumer is served. */
    assert_vmmt_ok(consume_at(f->consumer, &d2, f->dst, f->stream, 0, 1));
    sync_s(f->stream);
    assert_true(holds(f->stream, f->dst, 2));
    assert_vmmt_ok(vmmt_consumer_check(f->consumer, &d2));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    free_stream(s);
    PROMISE(st == VMMT_EFAILED && st_later == VMMT_EFAILED,
            "%s of a descriptor whose copy was queued, slice reused: dst holds buffer %d's bytes, "
            "vmmt_consumer_check says %d, and %d 50 ms later (0 is VMMT_OK), not VMMT_EFAILED",
            how == BY_CANCEL ? "vmmt_cancel" : "vmmt_pool_release_rank", got, st, st_later);
}

/*
 * The cancel's side of the sequence above, since 2026-12-07: on a shared
 * table the cancel turns A's TAKEN word into CANCELLED (docs/descriptor.md,
 * "Acknowledgement words"), so the slot is not recycled while A's copy is
 * queued (before, it was, and vmmt.sglang's rebuild, which never calls
 * check, returned buffer 2: test_cancel_taken.c). The copy reads buffer 1,
 * check says OK, and the slice comes back once it is acknowledged.
 */
static void test_cancel_under_queued_copy_check(void **state)
{
    struct fixture *f = *state;
    CUstream s = new_stream();
    struct gate g;
    vmmt_desc d1, d2;
    int st, st_later, got, held;

    make_pool(f, 1, 0, 1, 0, 0);
    d1 = publish(f, 1);
    sync_s(f->stream);
    gate_close(&g, s);
    assert_vmmt_ok(consume_at(f->consumer, &d1, f->dst, s, 0, 1));
    assert_vmmt_ok(vmmt_cancel(f->pool, &d1));
    held = vmmt_pool_drain(f->pool, 50) == VMMT_ETIMEDOUT;
    gate_open_later(&g, 0);
    gate_free(&g);
    sync_s(s);
    got = which(f->stream, f->dst);
    st = vmmt_consumer_check(f->consumer, &d1);
    sleep_ms(50);
    st_later = vmmt_consumer_check(f->consumer, &d1);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    d2 = publish(f, 2);
    sync_s(f->stream);
    assert_int_equal(tu_get64(&d2, OFF_OFFSET), tu_get64(&d1, OFF_OFFSET));
    assert_vmmt_ok(consume_at(f->consumer, &d2, f->dst, f->stream, 0, 1));
    sync_s(f->stream);
    assert_true(holds(f->stream, f->dst, 2));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    free_stream(s);
    PROMISE(held, "vmmt_cancel freed the slice under a queued copy");
    PROMISE(got == 1 && st == VMMT_OK && st_later == VMMT_OK,
            "vmmt_cancel under a queued copy: dst holds buffer %d's bytes, vmmt_consumer_check "
            "says %d, and %d 50 ms later (0 is VMMT_OK)",
            got, st, st_later);
}

static void test_release_under_queued_copy_check(void **state)
{
    taken_back_under_copy(*state, BY_RELEASE);
}

/*
 * The same taking back on a device table, seen from the next occupant. A
 * device table's acknowledgement is "a stream write of d after the copy ...
 * unconditional" (docs/descriptor.md step 6), queued when A consumed. Here
 * A's copy of buffer 1 is held; the producer takes the slot back (how), it
 * is recycled and buffer 2 takes it; B, the rank's consumer of buffer 2,
 * consumes and acknowledges it; then A's held copy and its write of buffer
 * 1's generation run. design.md says what this case may cost ("may copy
 * from a slice reused meanwhile"); it does not say that the next occupant
 * is then never recycled. Expected: buffer 2's slice comes back (drain OK),
 * as the brief's promise "no slice leaks in flight" and Invariant 5 ("An
 * acknowledgement releases only the occupant it names") would have it.
 */
static void late_device_ack(struct fixture *f, enum take_back how)
{
    CUstream s = new_stream();
    vmmt_consumer *b;
    struct gate g;
    vmmt_desc d1, d2;
    int st, drained;

    /* The recycler kept away: only drain reads the table, after A's write. */
    make_pool(f, 1, 1, 1, 60u * 1000 * 1000, 0);
    assert_vmmt_ok(vmmt_consumer_create(NULL, &b));
    d1 = publish(f, 1);
    sync_s(f->stream);
    gate_close(&g, s);
    assert_vmmt_ok(consume_at(f->consumer, &d1, f->dst, s, 0, 1));
    if (how == BY_CANCEL)
        assert_vmmt_ok(vmmt_cancel(f->pool, &d1));
    else
        assert_vmmt_ok(vmmt_pool_release_rank(f->pool, 0));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    d2 = publish(f, 2);
    sync_s(f->stream);
    st = consume_at(b, &d2, f->dst + MiB, f->stream, 0, 1);
    sync_s(f->stream);
    assert_vmmt_ok(st);
    assert_true(holds(f->stream, f->dst + MiB, 2));
    gate_open_later(&g, 0);
    gate_free(&g);
    sync_s(s);
    drained = vmmt_pool_drain(f->pool, 2000);
    uint32_t inflight = stats(f->pool).in_flight;
    if (drained != VMMT_OK) assert_vmmt_ok(vmmt_pool_release_rank(f->pool, 0)); /* clean up */
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    vmmt_consumer_destroy(b);
    free_stream(s);
    PROMISE(drained == VMMT_OK,
            "device table, %s of a descriptor whose copy was queued: the late stream "
            "acknowledgement of buffer 1 overwrote buffer 2's, whose consumer had acknowledged "
            "it; buffer 2's slice stays in flight (drain %d, in_flight %u) until another "
            "vmmt_pool_release_rank",
            how == BY_CANCEL ? "vmmt_cancel" : "vmmt_pool_release_rank", drained, inflight);
}

static void test_cancel_late_device_ack(void **state)
{
    late_device_ack(*state, BY_CANCEL);
}

static void test_release_late_device_ack(void **state)
{
    late_device_ack(*state, BY_RELEASE);
}

/*
 * The lease never takes from a live process (vmmt.h: "a rank that a live
 * process holds is never released this way"), however long its copy stays
 * queued: consumer A (whose link holds rank 0) consumes with its stream
 * held for 5 leases; the slice stays in flight, and its bytes and check are
 * right once the gate opens.
 */
static void test_holds_lease_spares_queued_copy(void **state)
{
    struct fixture *f = *state;
    CUstream s = new_stream();
    struct gate g;
    vmmt_desc d, warm;

    make_pool(f, 1, 0, 2, 0, 200);
    warm = publish(f, 3);
    assert_vmmt_ok(consume_at(f->consumer, &warm, f->dst, f->stream, 0, 1)); /* HOLD rank 0 */
    sync_s(f->stream);
    d = publish(f, 4);
    sync_s(f->stream);
    gate_close(&g, s);
    assert_vmmt_ok(consume_at(f->consumer, &d, f->dst + MiB, s, 0, 1));
    sleep_ms(1000);
    uint32_t inflight = in_flight_settled(f);
    uint64_t released = stats(f->pool).released_slices;
    gate_open_later(&g, 0);
    gate_free(&g);
    sync_s(s);
    PROMISE(inflight == 1 && released == 0,
            "lease released a rank whose live consumer's copy was queued (in flight %u, "
            "released %llu)",
            inflight, (unsigned long long)released);
    assert_true(holds(f->stream, f->dst + MiB, 4));
    assert_vmmt_ok(vmmt_consumer_check(f->consumer, &d));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    free_stream(s);
}

/* ================================================ 4. late cancels */

/*
 * A late cancel must never free another occupant (Invariants 3 and 7).
 * One slot: buffer A is published, consumed and recycled; B takes the slot
 * (and the slice). vmmt_cancel of A, a stale descriptor now, must leave B in
 * flight and its bytes alone: a later publish gets no room (VMMT_EFULL)
 * until B is consumed, and B's consume holds B's bytes. Both tables.
 */
static void late_cancel(struct fixture *f, int device_table)
{
    vmmt_buffer b = bytes(f->src, N);
    vmmt_desc a, bd, c;
    int st;

    make_pool(f, 1, device_table, 1, 0, 0);
    a = publish(f, 1);
    assert_vmmt_ok(consume_at(f->consumer, &a, f->dst, f->stream, 0, 1));
    sync_s(f->stream);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    bd = publish(f, 2);
    sync_s(f->stream);
    st = vmmt_cancel(f->pool, &a);
    PROMISE(st == VMMT_OK || st == VMMT_ESTATE, "late cancel: %d (%s)", st, vmmt_last_error());
    PROMISE(in_flight_settled(f) == 1, "a stale cancel freed the slot's next occupant");
    put(f, f->src, N, 3);
    st = vmmt_publish(f->pool, &b, f->stream, &c);
    sync_s(f->stream);
    PROMISE(st == VMMT_EFULL,
            "publish into a one-slot pool whose occupant a stale cancel "
            "freed: %d",
            st);
    st = consume_at(f->consumer, &bd, f->dst, f->stream, 0, 1);
    sync_s(f->stream);
    PROMISE(st == VMMT_OK && holds(f->stream, f->dst, 2),
            "B after a stale cancel of A: %d, buffer %d", st, which(f->stream, f->dst));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

static void test_holds_late_cancel_host_table(void **state)
{
    late_cancel(*state, 0);
}

static void test_holds_late_cancel_device_table(void **state)
{
    late_cancel(*state, 1);
}

/*
 * vmmt.h: "once committed it cancels nothing: cancel the descriptor the
 * commit gave instead"; docs/descriptor.md "Tokens". A reservation is
 * committed, then its token is cancelled; another publish follows. If the
 * token's cancel had freed the slice, that publish would land in it and the
 * committed descriptor would be consumed with its bytes. Then a second
 * reservation is cancelled and committed afterwards (VMMT_ESTATE).
 */
static void test_holds_token_cancel_after_commit(void **state)
{
    struct fixture *f = *state;
    vmmt_reservation r, r2;
    vmmt_desc d, other, junk;
    int st;

    make_pool(f, 1, 0, 4, 0, 0);
    assert_vmmt_ok(vmmt_reserve(f->pool, N, &r));
    put(f, r.ptr, N, 5);
    assert_vmmt_ok(vmmt_commit(f->pool, &r, NULL, f->stream, &d));
    sync_s(f->stream);
    assert_int_equal(consume_at(f->consumer, &r.token, f->dst, f->stream, 0, 1), VMMT_EINVAL);
    st = vmmt_cancel(f->pool, &r.token);
    PROMISE(st == VMMT_OK || st == VMMT_ESTATE, "cancel of a committed token: %d", st);
    PROMISE(in_flight_settled(f) == 1, "cancel of a committed token freed its slice");
    other = publish(f, 6);
    sync_s(f->stream);
    PROMISE(tu_get64(&other, OFF_SLICE_OFFSET) != tu_get64(&d, OFF_SLICE_OFFSET),
            "a publish took the committed slice after its token was cancelled");
    assert_vmmt_ok(consume_at(f->consumer, &d, f->dst, f->stream, 0, 1));
    assert_vmmt_ok(consume_at(f->consumer, &other, f->dst + MiB, f->stream, 0, 1));
    sync_s(f->stream);
    PROMISE(holds(f->stream, f->dst, 5), "the committed buffer holds buffer %d's bytes",
            which(f->stream, f->dst));
    assert_true(holds(f->stream, f->dst + MiB, 6));

    assert_vmmt_ok(vmmt_reserve(f->pool, N, &r2));
    assert_vmmt_ok(vmmt_cancel(f->pool, &r2.token));
    assert_int_equal(vmmt_commit(f->pool, &r2, NULL, f->stream, &junk), VMMT_ESTATE);
    sync_s(f->stream);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_int_equal(stats(f->pool).in_flight, 0);
}

/*
 * vmmt_cancel of a descriptor already consumed and acknowledged, before the
 * recycler came (kept away for a minute): the slice must come back once,
 * not twice. Two later publishes must then get two different slices and
 * each its own bytes, and in_flight must count right.
 */
static void test_holds_cancel_after_ack_frees_once(void **state)
{
    struct fixture *f = *state;
    struct rawtab t;
    vmmt_desc a, x, y;
    int st;

    make_pool(f, 1, 0, 4, 60u * 1000 * 1000, 0);
    a = publish(f, 1);
    assert_vmmt_ok(consume_at(f->consumer, &a, f->dst, f->stream, 0, 1));
    sync_s(f->stream);
    rawtab_open(&a, &t);
    assert_true(wait_word(&t, &a, 1, gen(&a), 5000)); /* acknowledged */
    st = vmmt_cancel(f->pool, &a);
    PROMISE(st == VMMT_OK || st == VMMT_ESTATE, "cancel after ack: %d", st);
    assert_vmmt_ok(vmmt_pool_reclaim(f->pool, NULL));
    assert_vmmt_ok(vmmt_pool_reclaim(f->pool, NULL));
    PROMISE(stats(f->pool).in_flight == 0, "in_flight %u after cancel and reclaim",
            stats(f->pool).in_flight);
    x = publish(f, 7);
    vmmt_buffer b = bytes(f->src + MiB, N);
    put(f, f->src + MiB, N, 8);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &y));
    sync_s(f->stream);
    PROMISE(tu_get64(&x, OFF_SLICE_OFFSET) != tu_get64(&y, OFF_SLICE_OFFSET),
            "two buffers in flight share a slice after a cancel of an acknowledged one");
    assert_int_equal(stats(f->pool).in_flight, 2);
    assert_vmmt_ok(consume_at(f->consumer, &x, f->dst, f->stream, 0, 1));
    assert_vmmt_ok(consume_at(f->consumer, &y, f->dst + MiB, f->stream, 0, 1));
    sync_s(f->stream);
    assert_true(holds(f->stream, f->dst, 7));
    assert_true(holds(f->stream, f->dst + MiB, 8));
    assert_vmmt_ok(vmmt_pool_reclaim(f->pool, NULL));
    rawtab_close(&t);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

struct canceller {
    vmmt_pool *pool;
    const vmmt_desc *d;
    pthread_barrier_t *go;
    int st;
};

static void *cancel_one(void *arg)
{
    struct canceller *c = arg;
    pthread_barrier_wait(c->go);
    c->st = vmmt_cancel(c->pool, c->d);
    return NULL;
}

static void *consume_one(void *arg)
{
    struct racer *r = arg;
    pthread_barrier_wait(r->go);
    r->st = vmmt_consume(r->c, r->d, 0, r->dst, N, r->s, r->first, r->count);
    return NULL;
}

/*
 * Consume during cancel, 150 times: whichever wins, the slice comes back
 * (no leak), a later consumer is refused, and an OK consume whose check
 * says OK holds its own bytes.
 */
static void test_holds_consume_during_cancel(void **state)
{
    struct fixture *f = *state;
    CUstream s = new_stream();
    vmmt_consumer *late;

    make_pool(f, 1, 0, 4, 0, 0);
    assert_vmmt_ok(vmmt_consumer_create(NULL, &late));
    for (uint32_t i = 0; i < 150; i++) {
        vmmt_desc d = publish(f, i % 64);
        pthread_barrier_t go;
        pthread_t ta, tb;
        struct racer r = {f->consumer, &d, f->dst, s, 0, 1, 0, NULL, 0};
        struct canceller c = {f->pool, &d, NULL, 0};

        if (i % 2) sync_s(f->stream);
        pthread_barrier_init(&go, NULL, 2);
        r.go = c.go = &go;
        assert_int_equal(pthread_create(&ta, NULL, consume_one, &r), 0);
        assert_int_equal(pthread_create(&tb, NULL, cancel_one, &c), 0);
        pthread_join(ta, NULL);
        pthread_join(tb, NULL);
        pthread_barrier_destroy(&go);
        sync_s(s);
        sync_s(f->stream);
        assert_vmmt_ok(c.st);
        if (r.st == VMMT_OK && vmmt_consumer_check(f->consumer, &d) == VMMT_OK)
            PROMISE(holds(f->stream, f->dst, i % 64), "race %u: OK and check OK with wrong bytes",
                    i);
        int st = consume_at(late, &d, f->dst + MiB, s, 0, 1);
        sync_s(s);
        PROMISE(st == VMMT_ESTATE, "race %u: a cancelled descriptor consumed later: %d", i, st);
        PROMISE(vmmt_pool_drain(f->pool, 5000) == VMMT_OK, "race %u: slice left in flight", i);
    }
    vmmt_consumer_destroy(late);
    free_stream(s);
}

/* ================================== 5. dead consumers and release_rank */

/*
 * A consumer process killed while its copy is queued, its rank's word
 * TAKEN (docs/descriptor.md: "a release writes d over d - 1"). The copy
 * waits for the producer's ready word (the publish is held by a gate), so
 * the child blocks in its synchronize; the test sees the word at d - 1 in
 * the shared table, kills the child, and the pool must release the rank:
 * once the producer's copy lands the slice comes back, and a restarted
 * consumer of rank 0 is refused the old descriptor.
 */
static void test_holds_killed_consumer_with_taken_word(void **state)
{
    struct fixture *f = *state;
    vmmt_buffer b = bytes(f->src, N);
    vmmt_consumer *fresh;
    struct rawtab t;
    struct gate g;
    vmmt_desc d0, d1;
    int sock;
    pid_t pid;

    make_pool(f, 1, 0, 4, 0, 0);
    pid = spawn_rank(0, 1, &sock);
    d0 = publish(f, 0);
    send_msg(sock, 0, &d0, 0);
    assert_int_equal(reply(sock, 0), VMMT_OK); /* the child's link holds rank 0 */
    put(f, f->src, N, 1);
    gate_close(&g, f->stream);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d1)); /* PENDING until the gate opens */
    rawtab_open(&d1, &t);
    send_msg(sock, 1, &d1, 0);
    assert_true(wait_word(&t, &d1, 1, gen(&d1) - 1, 5000));
    kill_reap(pid);
    close(sock);
    int released = wait_rank_releases(f, 1, 5000);
    gate_open_later(&g, 0);
    gate_free(&g);
    sync_s(f->stream);
    PROMISE(released, "a consumer killed with its word TAKEN: its rank was never released");
    PROMISE(vmmt_pool_drain(f->pool, 5000) == VMMT_OK,
            "the slice of a consumer killed with its word TAKEN stays in flight (word %u, gen %u)",
            rawtab_word(&t, &d1, 1), gen(&d1));
    assert_vmmt_ok(vmmt_consumer_create(NULL, &fresh));
    PROMISE(consume_at(fresh, &d1, f->dst, f->stream, 0, 1) == VMMT_ESTATE,
            "a released descriptor consumed by the restarted rank");
    sync_s(f->stream);
    vmmt_consumer_destroy(fresh);
    rawtab_close(&t);
}

/*
 * docs/broker.md: on a death the broker hands the pool "the ranks the dead
 * link held that no other live link or orphan holds". Two processes of rank
 * 0 (A, then B) both hold it; A keeps a slice and is killed. The slice must
 * stay in flight for B, which then consumes it with the right bytes.
 */
static void test_holds_death_spares_rank_another_process_holds(void **state)
{
    struct fixture *f = *state;
    vmmt_desc d0, d1, d2;
    int sa, sb;
    pid_t a, b;

    make_pool(f, 1, 0, 8, 0, 0);
    a = spawn_rank(0, 1, &sa);
    b = spawn_rank(0, 1, &sb);
    d0 = publish(f, 0);
    send_msg(sa, 0, &d0, 0);
    assert_int_equal(reply(sa, 0), VMMT_OK);
    d1 = publish(f, 1);
    send_msg(sb, 1, &d1, 0);
    assert_int_equal(reply(sb, 1), VMMT_OK);
    assert_true(wait_links(f, 2, 5000));
    d2 = publish(f, 2);
    sync_s(f->stream);
    send_msg(sa, 2, &d2, TU_MSG_KEEP);
    assert_int_equal(reply(sa, 2), 1);
    /* A's acknowledgement of buffer 0 is written a moment after its reply. */
    for (int k = 0; k < 2000 && in_flight_settled(f) != 1; k++)
        ;
    kill_reap(a);
    close(sa);
    assert_true(wait_links(f, 1, 5000));
    sleep_ms(100);
    uint32_t inflight = in_flight_settled(f);
    vmmt_pool_stats s = stats(f->pool);
    PROMISE(inflight == 1 && s.released_slices == 0,
            "a death released rank 0 that a live process holds (in flight %u, released %llu)",
            inflight, (unsigned long long)s.released_slices);
    send_msg(sb, 2, &d2, 0);
    PROMISE(reply(sb, 2) == VMMT_OK, "the live process of rank 0 was refused its slice");
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    end_child(sb, b);
}

/*
 * Two processes of rank 0 (Invariant 9 lets them share a rank on a shared
 * table). A takes rank 0's word for buffer 1, whose producer's copy is held
 * (so A's copy is queued, the word TAKEN), and is killed; B, alive, holds
 * rank 0 too, so the death releases nothing (docs/broker.md). Once the
 * producer's copy lands, either B may consume buffer 1 or the slice must
 * be released some other way: the promise "no slice leaks in flight". The
 * docs say nothing of a TAKEN word whose taker died while another process
 * holds its rank.
 */
static void test_dead_taker_other_holder_leaks(void **state)
{
    struct fixture *f = *state;
    vmmt_buffer b = bytes(f->src, N);
    struct rawtab t;
    struct gate g;
    vmmt_desc d0, dx, d1;
    int sa, sb, st_b, drained;
    pid_t a, bp;

    make_pool(f, 1, 0, 8, 0, 0);
    a = spawn_rank(0, 1, &sa);
    bp = spawn_rank(0, 1, &sb);
    d0 = publish(f, 0);
    send_msg(sa, 0, &d0, 0);
    assert_int_equal(reply(sa, 0), VMMT_OK);
    dx = publish(f, 5);
    send_msg(sb, 5, &dx, 0);
    assert_int_equal(reply(sb, 5), VMMT_OK);
    assert_true(wait_links(f, 2, 5000));
    put(f, f->src, N, 1);
    gate_close(&g, f->stream);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d1)); /* PENDING */
    rawtab_open(&d1, &t);
    send_msg(sa, 1, &d1, 0);
    assert_true(wait_word(&t, &d1, 1, gen(&d1) - 1, 5000)); /* TAKEN */
    kill_reap(a);
    close(sa);
    assert_true(wait_links(f, 1, 5000));
    gate_open_later(&g, 0);
    gate_free(&g);
    sync_s(f->stream);
    send_msg(sb, 1, &d1, 0);
    st_b = reply(sb, 1);
    drained = vmmt_pool_drain(f->pool, 2000);
    uint32_t word = rawtab_word(&t, &d1, 1);
    rawtab_close(&t);
    if (drained != VMMT_OK) assert_vmmt_ok(vmmt_pool_release_rank(f->pool, 0)); /* clean up */
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    end_child(sb, bp);
    PROMISE(st_b == VMMT_OK || drained == VMMT_OK,
            "a process of rank 0 killed with its word TAKEN while another live process holds "
            "rank 0: the word stays TAKEN (%u, generation %u), the live process is refused (%d) "
            "and the slice stays in flight (drain %d) until vmmt_pool_release_rank",
            word, gen(&d1), st_b, drained);
}

/*
 * vmmt.h, vmmt_pool_release_rank: "An engine that restarts a rank under the
 * same number should call this after reaping the old process and before
 * publishing for the new one: the pool's own release of the dead process
 * then knows it has nothing left to do." Rank 0's process dies holding a
 * slice; the engine reaps it, releases rank 0 and restarts it; the new
 * process consumes one buffer and keeps another. Once the broker has seen
 * the old death, the new process's slice must still be in flight, the old
 * descriptor refused to it, and the kept one served with its bytes.
 */
static void test_holds_restart_after_release_rank(void **state)
{
    struct fixture *f = *state;
    vmmt_desc d0, d1, d2, d3;
    int sa, sb;
    pid_t a, b;

    make_pool(f, 1, 0, 8, 0, 0);
    a = spawn_rank(0, 1, &sa);
    d0 = publish(f, 0);
    send_msg(sa, 0, &d0, 0);
    assert_int_equal(reply(sa, 0), VMMT_OK);
    d1 = publish(f, 1);
    sync_s(f->stream);
    send_msg(sa, 1, &d1, TU_MSG_KEEP);
    assert_int_equal(reply(sa, 1), 1);
    /* Buffer 0's acknowledgement is written a moment after the reply. */
    for (int k = 0; k < 2000 && in_flight_settled(f) != 1; k++)
        ;
    kill_reap(a);
    close(sa);
    assert_vmmt_ok(vmmt_pool_release_rank(f->pool, 0));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    vmmt_pool_stats s0 = stats(f->pool);
    b = spawn_rank(0, 1, &sb);
    d2 = publish(f, 2);
    send_msg(sb, 2, &d2, 0);
    assert_int_equal(reply(sb, 2), VMMT_OK);
    d3 = publish(f, 3);
    sync_s(f->stream);
    send_msg(sb, 3, &d3, TU_MSG_KEEP);
    assert_int_equal(reply(sb, 3), 1);
    assert_true(wait_links(f, 1, 5000)); /* the old link's death is seen */
    sleep_ms(100);
    uint32_t inflight = in_flight_settled(f);
    vmmt_pool_stats s = stats(f->pool);
    PROMISE(inflight == 1 && s.released_slices == s0.released_slices,
            "the old process's late release took the new one's slice (in flight %u, released "
            "%llu, rank releases %llu; after release_rank: released %llu, rank releases %llu)",
            inflight, (unsigned long long)s.released_slices, (unsigned long long)s.rank_releases,
            (unsigned long long)s0.released_slices, (unsigned long long)s0.rank_releases);
    send_msg(sb, 1, &d1, 0);
    int32_t st = reply(sb, 1);
    PROMISE(st == VMMT_ESTATE, "the restarted rank consumed a released descriptor: %d", st);
    send_msg(sb, 3, &d3, 0);
    PROMISE(reply(sb, 3) == VMMT_OK, "the restarted rank's kept slice was refused");
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    end_child(sb, b);
}

/*
 * A rank released while another rank still owes the slice: the slot stays
 * in flight, and the released rank's earlier descriptor is refused to a
 * restarted consumer of that rank (vmmt.h: "released for dead ranks ... is
 * VMMT_ESTATE"), on both tables; rank 1 is still served.
 */
static void release_one_of_two(struct fixture *f, int device_table)
{
    vmmt_consumer *fresh;
    vmmt_desc d;
    int st;

    make_pool(f, 2, device_table, 4, 0, 0);
    d = publish(f, 9);
    sync_s(f->stream);
    assert_vmmt_ok(vmmt_pool_release_rank(f->pool, 0));
    assert_vmmt_ok(vmmt_consumer_create(NULL, &fresh));
    st = consume_at(fresh, &d, f->dst, f->stream, 0, 1);
    sync_s(f->stream);
    PROMISE(st == VMMT_ESTATE, "a released rank's descriptor consumed afterwards: %d", st);
    st = consume_at(fresh, &d, f->dst, f->stream, VMMT_ALL_RANKS, 0);
    sync_s(f->stream);
    PROMISE(st == VMMT_ESTATE, "ALL_RANKS over a released rank: %d", st);
    PROMISE(in_flight_settled(f) == 1, "released before rank 1 consumed");
    assert_vmmt_ok(consume_at(fresh, &d, f->dst + MiB, f->stream, 1, 1));
    sync_s(f->stream);
    assert_true(holds(f->stream, f->dst + MiB, 9));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    vmmt_consumer_destroy(fresh);
}

static void test_holds_release_one_of_two_host_table(void **state)
{
    release_one_of_two(*state, 0);
}

static void test_holds_release_one_of_two_device_table(void **state)
{
    release_one_of_two(*state, 1);
}

/* stop and calls cross threads: atomics (ThreadSanitizer). */
struct releaser {
    vmmt_pool *pool;
    int stop;
    int calls;
};

static void *release_loop(void *arg)
{
    struct releaser *r = arg;
    while (!__atomic_load_n(&r->stop, __ATOMIC_ACQUIRE)) {
        if (vmmt_pool_release_rank(r->pool, 0) != VMMT_OK) break;
        __atomic_add_fetch(&r->calls, 1, __ATOMIC_RELEASE);
        sleep_ms(1);
    }
    return NULL;
}

/*
 * vmmt_pool_release_rank racing consumes of the rank it releases (an engine
 * that releases a rank it believes dead while a process of it still runs):
 * every consume is VMMT_OK or VMMT_ESTATE, an OK one holds its own bytes
 * (each slice is reused only after its consume's copy was synchronized
 * here), and nothing is left in flight or waits.
 */
static void test_holds_release_rank_races_consume(void **state)
{
    struct fixture *f = *state;
    struct releaser r = {0};
    pthread_t t;
    int ok = 0, refused = 0, other = 0, wrong = 0;

    make_pool(f, 1, 0, 4, 0, 0);
    r.pool = f->pool;
    vmmt_set_log_level(VMMT_LOG_ERROR); /* each release logs a line */
    assert_int_equal(pthread_create(&t, NULL, release_loop, &r), 0);
    uint32_t n_cons = 0;
    for (uint32_t i = 0; i < 5000 && (i < 200 || __atomic_load_n(&r.calls, __ATOMIC_ACQUIRE) < 100);
         i++, n_cons++) {
        vmmt_desc d = publish(f, i % 64);
        if (i % 2) sync_s(f->stream);
        int st = consume_at(f->consumer, &d, f->dst, f->stream, 0, 1);
        sync_s(f->stream);
        ok += st == VMMT_OK;
        refused += st == VMMT_ESTATE;
        other += st != VMMT_OK && st != VMMT_ESTATE;
        if (st == VMMT_OK && !holds(f->stream, f->dst, i % 64)) wrong++;
    }
    __atomic_store_n(&r.stop, 1, __ATOMIC_RELEASE);
    pthread_join(t, NULL);
    vmmt_set_log_level(VMMT_LOG_WARN);
    print_message("release_rank x%d racing %u consumes: %d OK, %d refused\n", r.calls, n_cons, ok,
                  refused);
    PROMISE(other == 0 && wrong == 0, "%d consumes neither OK nor ESTATE, %d OK with wrong bytes",
            other, wrong);
    PROMISE(vmmt_pool_drain(f->pool, 5000) == VMMT_OK, "slices left in flight");
}

/* ================================================= 6. packed groups */

/*
 * A packed group half consumed by one process, the rest asked for by
 * another process of the same rank: the second is refused ("its later
 * members find them taken by themselves" - only the first process's), the
 * first cannot evict its half group (VMMT_ESTATE), then completes it with
 * the right bytes, evicts, and the slice comes back.
 */
static void test_holds_packed_half_then_other_process(void **state)
{
    struct fixture *f = *state;
    vmmt_consumer *other;
    vmmt_desc pair[2];
    vmmt_desc_info in;
    int st;

    make_pool(f, 1, 0, 4, 0, 0);
    assert_vmmt_ok(vmmt_consumer_create(NULL, &other));
    publish_pair(f, 1, 2, pair);
    assert_vmmt_ok(vmmt_desc_inspect(&pair[0], &in));
    assert_vmmt_ok(consume_at(f->consumer, &pair[0], f->dst, f->stream, 0, 1));
    sync_s(f->stream);
    st = consume_at(other, &pair[1], f->dst + MiB, f->stream, 0, 1);
    sync_s(f->stream);
    PROMISE(st == VMMT_ESTATE,
            "another process consumed the second member of a group the first "
            "half consumed: %d",
            st);
    assert_int_equal(vmmt_consumer_ack(other, &pair[1], 0, f->stream, 0, 1), VMMT_ESTATE);
    assert_int_equal(vmmt_consumer_evict(f->consumer, in.pool_id, 0), VMMT_ESTATE);
    assert_vmmt_ok(consume_at(f->consumer, &pair[1], f->dst + MiB, f->stream, 0, 1));
    sync_s(f->stream);
    assert_true(holds(f->stream, f->dst, 1));
    assert_true(holds(f->stream, f->dst + MiB, 2));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_vmmt_ok(vmmt_consumer_evict(f->consumer, in.pool_id, 0));
    assert_int_equal(consume_at(other, &pair[0], f->dst, f->stream, 0, 1), VMMT_ESTATE);
    sync_s(f->stream);
    vmmt_consumer_destroy(other);
}

/*
 * A consumer process killed after consuming one member of a packed pair:
 * its rank's word is TAKEN and the group never acknowledged. The dead
 * release must give the slice back; the other member is refused to a
 * restarted consumer afterwards.
 */
static void test_holds_packed_half_then_killed(void **state)
{
    struct fixture *f = *state;
    vmmt_consumer *fresh;
    vmmt_desc pair[2];
    int sock;
    pid_t pid;

    make_pool(f, 1, 0, 4, 0, 0);
    pid = spawn_rank(0, 1, &sock);
    publish_pair(f, 0, 1, pair);
    send_msg(sock, 0, &pair[0], 0);
    assert_int_equal(reply(sock, 0), VMMT_OK);
    PROMISE(in_flight_settled(f) == 1, "a half consumed group was recycled");
    kill_reap(pid);
    close(sock);
    PROMISE(vmmt_pool_drain(f->pool, 5000) == VMMT_OK,
            "a consumer killed with a half consumed packed group: the slice stays in flight");
    assert_int_equal(stats(f->pool).released_slices, 1);
    assert_vmmt_ok(vmmt_consumer_create(NULL, &fresh));
    PROMISE(consume_at(fresh, &pair[1], f->dst, f->stream, 0, 1) == VMMT_ESTATE,
            "the rest of a released group consumed after the release");
    sync_s(f->stream);
    vmmt_consumer_destroy(fresh);
}

/*
 * A consumer that consumed one member of a group and then let go of the
 * pool and lives on (vmmt_consumer_destroy: a goodbye, its ranks not
 * released). vmmt_pool_release_rank must then give the slice back; after
 * it, neither member is consumed by a new consumer of that rank, and that
 * consumer can evict the pool (no half group of its own).
 */
static void test_holds_packed_half_then_destroy_and_release(void **state)
{
    struct fixture *f = *state;
    vmmt_consumer *a, *fresh;
    vmmt_desc pair[2];
    vmmt_desc_info in;
    int st0, st1;

    make_pool(f, 1, 0, 4, 0, 0);
    assert_vmmt_ok(vmmt_consumer_create(NULL, &a));
    publish_pair(f, 1, 2, pair);
    assert_vmmt_ok(vmmt_desc_inspect(&pair[0], &in));
    assert_vmmt_ok(consume_at(a, &pair[0], f->dst, f->stream, 0, 1));
    sync_s(f->stream);
    vmmt_consumer_destroy(a);
    assert_vmmt_ok(vmmt_pool_release_rank(f->pool, 0));
    PROMISE(vmmt_pool_drain(f->pool, 5000) == VMMT_OK,
            "release_rank left a half consumed group's slice in flight");
    assert_vmmt_ok(vmmt_consumer_create(NULL, &fresh));
    st0 = consume_at(fresh, &pair[0], f->dst, f->stream, 0, 1);
    st1 = consume_at(fresh, &pair[1], f->dst, f->stream, 0, 1);
    sync_s(f->stream);
    PROMISE(st0 == VMMT_ESTATE && st1 == VMMT_ESTATE,
            "members of a released group consumed afterwards: %d, %d", st0, st1);
    st0 = vmmt_consumer_evict(fresh, in.pool_id, 0);
    PROMISE(st0 == VMMT_OK, "evict after refused members of a released group: %d (%s)", st0,
            vmmt_last_error());
    vmmt_consumer_destroy(fresh);
}

/*
 * vmmt.h, max_pools: importing one more pool evicts the least recently used
 * idle pool, never one with "a packed group half consumed". A consumer
 * with max_pools = 1 consumes member 0 of a group of pool P, then a buffer
 * of pool Q: P must stay imported (its group's progress lives in the
 * import), and member 1 then completes the group, whose slice comes back.
 */
static void test_holds_lru_keeps_half_group(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config qc = config(4 * MiB, 1);
    vmmt_consumer_config cc;
    vmmt_consumer *c;
    vmmt_pool *q;
    vmmt_desc pair[2], dq;
    vmmt_buffer b = bytes(f->src + 2 * N, N);
    int count, st;

    make_pool(f, 1, 0, 4, 0, 0);
    qc.max_slices = 4;
    assert_vmmt_ok(vmmt_pool_create(&qc, &q));
    vmmt_consumer_config_init(&cc);
    cc.max_pools = 1;
    assert_vmmt_ok(vmmt_consumer_create(&cc, &c));
    publish_pair(f, 1, 2, pair);
    assert_vmmt_ok(consume_at(c, &pair[0], f->dst, f->stream, 0, 1));
    sync_s(f->stream);
    put(f, f->src + 2 * N, N, 3);
    assert_vmmt_ok(vmmt_publish(q, &b, f->stream, &dq));
    sync_s(f->stream);
    assert_vmmt_ok(consume_at(c, &dq, f->dst + 2 * MiB, f->stream, 0, 1));
    sync_s(f->stream);
    count = vmmt_consumer_pool_count(c);
    st = consume_at(c, &pair[1], f->dst + MiB, f->stream, 0, 1);
    sync_s(f->stream);
    int right = st == VMMT_OK && holds(f->stream, f->dst + MiB, 2) && holds(f->stream, f->dst, 1);
    int drained = vmmt_pool_drain(f->pool, 5000);
    assert_vmmt_ok(vmmt_pool_drain(q, 5000));
    vmmt_consumer_destroy(c);
    vmmt_pool_destroy(q);
    PROMISE(count == 2, "a pool with a half consumed group was evicted for another (count %d)",
            count);
    PROMISE(right, "member 1 after another pool's import: %d", st);
    PROMISE(drained == VMMT_OK, "the group's slice stayed in flight");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_holds_partial_take_given_back),
        T(test_holds_same_rank_race),
        T(test_holds_all_ranks_race_gives_back),
        T(test_holds_failed_copy_acknowledges),
        T(test_holds_polled_timeout_gives_word_back),
        T(test_holds_dead_producer_gated_copy_host_table),
        T(test_holds_dead_producer_gated_copy_device_table),
        T(test_holds_ack_waiting_when_producer_dies),
        T(test_cancel_under_queued_copy_check),
        T(test_release_under_queued_copy_check),
        T(test_cancel_late_device_ack),
        T(test_release_late_device_ack),
        T(test_holds_lease_spares_queued_copy),
        T(test_holds_late_cancel_host_table),
        T(test_holds_late_cancel_device_table),
        T(test_holds_token_cancel_after_commit),
        T(test_holds_cancel_after_ack_frees_once),
        T(test_holds_consume_during_cancel),
        T(test_holds_killed_consumer_with_taken_word),
        T(test_holds_death_spares_rank_another_process_holds),
        T(test_dead_taker_other_holder_leaks),
        T(test_holds_restart_after_release_rank),
        T(test_holds_release_one_of_two_host_table),
        T(test_holds_release_one_of_two_device_table),
        T(test_holds_release_rank_races_consume),
        T(test_holds_packed_half_then_other_process),
        T(test_holds_packed_half_then_killed),
        T(test_holds_packed_half_then_destroy_and_release),
        T(test_holds_lru_keeps_half_group),
    };
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
