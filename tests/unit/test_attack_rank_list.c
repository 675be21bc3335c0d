/*
 * An outside attack on vmmt_consume_ranks and vmmt_consumer_ack_ranks (a
 * consume or an acknowledgement for a LIST of ranks in one call, all or
 * nothing), written from include/vmmt.h and the docs alone
 * (docs/descriptor.md "Acknowledgement words" and "What a reader must
 * verify", docs/design.md "Invariants" and "Packed publish",
 * docs/integration.md).
 *
 * What every case holds the library to: an OK copies the descriptor's own
 * bytes; a refusal leaves every rank of the list as it was (another
 * consumer, or the same one, can then do each of them once); nothing stays
 * in flight at the end, and the fixture finds no leak.
 *
 * Two consumer objects of one process share nothing but the control table,
 * so they stand for two processes (as in tests/unit/test_rank_list.c).
 * Tests named test_finding_* assert the contract where the library breaks
 * it; each says what goes wrong. One finding, inherited from the run calls,
 * was the documentation's: docs/design.md promised VMMT_EINVAL for a
 * negative device, where every call answers VMMT_ENODEV, as test_args.c
 * holds for vmmt_probe_device (the document now says so;
 * negative_device_is_enodev). Everything else held, on
 * shared and device tables and device, host and elastic pools (also under
 * AddressSanitizer/UBSan and ThreadSanitizer, 2026-12-07): lists in any
 * order, every rank as a list, 256 ranks, lists mixed with runs and with
 * other lists (also of one packed group, also two sets at once), races of
 * overlapping lists (two consumers, or one from two threads), lists under
 * cancel and release_rank (queued behind a gate, during a host wait, and
 * racing), failed waits, timeouts and failed copies, eviction, and
 * huge, negative and duplicated lists.
 */
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "emu.h"
#include "poolfix.h"

#define N 4096

static void drop_stream(CUstream s)
{
    assert_int_equal(vmmt__drv()->cuStreamDestroy(s), CUDA_SUCCESS);
}

/* A device table only where the pool kind allows one (fixed device pools). */
static int table_ok(int device_table)
{
    return !device_table || (!pool_kind_host() && !pool_kind_elastic());
}

static void make_pool_with(struct fixture *f, int consumers, int device_table, uint32_t slices,
                           vmmt_handoff handoff)
{
    vmmt_pool_config c = config(4 * MiB, consumers);

    c.device_control_table = device_table;
    c.max_slices = slices;
    c.handoff = handoff;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
}

static void make_pool(struct fixture *f, int consumers, int device_table)
{
    make_pool_with(f, consumers, device_table, 64, VMMT_HANDOFF_AUTO);
}

static void drop_pool(struct fixture *f)
{
    vmmt_pool_destroy(f->pool);
    f->pool = NULL;
}

static void publish_one(struct fixture *f, uint32_t pattern, vmmt_desc *d)
{
    vmmt_buffer b = bytes(f->src, N);

    put(f, f->src, N, pattern);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, d));
    sync_on(f->stream);
}

/* Publish three members of N bytes each, patterns pattern (one pattern over 3 N bytes). */
static void publish_three(struct fixture *f, uint32_t pattern, vmmt_desc m[3])
{
    vmmt_buffer b[3] = {bytes(f->src, N), bytes(f->src + N, N), bytes(f->src + 2 * N, N)};

    put(f, f->src, 3 * N, pattern);
    assert_vmmt_ok(vmmt_publish_packed(f->pool, b, 3, f->stream, m));
    sync_on(f->stream);
}

static void flush(vmmt_consumer *c)
{
    assert_vmmt_ok(vmmt_consumer_flush(c));
}

/* Every slice came back. */
static void all_back(struct fixture *f)
{
    flush(f->consumer);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_int_equal(stats(f->pool).in_flight, 0);
}

/* The slice is still out: not every rank acknowledged it. */
static void still_out(struct fixture *f)
{
    flush(f->consumer);
    assert_int_equal(vmmt_pool_drain(f->pool, 20), VMMT_ETIMEDOUT);
}

static int consume_list(struct fixture *f, vmmt_consumer *c, const vmmt_desc *d, uint64_t off,
                        CUstream s, const int *ranks, int n)
{
    return vmmt_consume_ranks(c, d, 0, f->dst + off, f->cap - off, s, ranks, n);
}

static int ack_list(struct fixture *f, vmmt_consumer *c, const vmmt_desc *d, CUstream s,
                    const int *ranks, int n)
{
    (void)f;
    return vmmt_consumer_ack_ranks(c, d, 0, s, ranks, n);
}

/*
 * Every rank of the pool as a list, in a shuffled order, is VMMT_ALL_RANKS:
 * one copy completes the slice, and every other way of asking for any rank
 * is refused after. The other way round too.
 */
static void test_every_rank_as_a_list_is_all_ranks(void **state)
{
    struct fixture *f = *state;
    const int every[] = {2, 0, 3, 1}, again[] = {3, 0, 1, 2}, one[] = {1};
    vmmt_desc d;

    for (int table = 0; table < 2; table++) {
        if (!table_ok(table)) continue;
        make_pool(f, 4, table);
        publish_one(f, 41, &d);
        assert_vmmt_ok(consume_list(f, f->consumer, &d, 0, f->stream, every, 4));
        sync_on(f->stream);
        expect(f, f->dst, N, 41);
        flush(f->consumer);
        assert_int_equal(
            vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0),
            VMMT_ESTATE);
        assert_int_equal(ack_list(f, f->consumer, &d, f->stream, one, 1), VMMT_ESTATE);
        assert_int_equal(consume_list(f, f->consumer, &d, 0, f->stream, again, 4), VMMT_ESTATE);
        all_back(f);

        publish_one(f, 42, &d);
        assert_vmmt_ok(vmmt_consumer_ack(f->consumer, &d, 0, f->stream, VMMT_ALL_RANKS, 0));
        sync_on(f->stream);
        flush(f->consumer);
        assert_int_equal(consume_list(f, f->consumer, &d, 0, f->stream, again, 4), VMMT_ESTATE);
        assert_int_equal(ack_list(f, f->consumer, &d, f->stream, one, 1), VMMT_ESTATE);
        all_back(f);
        drop_pool(f);
    }
}

/*
 * Lists mixed with runs for one descriptor: a run that overlaps a rank a
 * list did is refused and leaves its other ranks untouched, and a list that
 * overlaps a run likewise.
 */
static void test_lists_and_runs_overlapping(void **state)
{
    struct fixture *f = *state;
    const int one_three[] = {3, 1}, two_one[] = {2, 1}, two[] = {2}, three[] = {3};
    vmmt_consumer *other;
    vmmt_desc d;

    assert_vmmt_ok(vmmt_consumer_create(NULL, &other));
    for (int table = 0; table < 2; table++) {
        if (!table_ok(table)) continue;
        make_pool(f, 4, table);
        publish_one(f, 43, &d);
        put(f, f->dst, N, 99);
        assert_vmmt_ok(consume_list(f, f->consumer, &d, N, f->stream, one_three, 2));
        sync_on(f->stream);
        flush(f->consumer);
        /* [2, 4) shares rank 3: refused, nothing copied, rank 2 still owed. */
        assert_int_equal(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, 2, 2),
                         VMMT_ESTATE);
        assert_int_equal(vmmt_consume(other, &d, 0, f->dst, f->cap, f->stream, 2, 2), VMMT_ESTATE);
        sync_on(f->stream);
        expect(f, f->dst, N, 99);
        assert_vmmt_ok(vmmt_consume(other, &d, 0, f->dst, f->cap, f->stream, 2, 1));
        sync_on(f->stream);
        expect(f, f->dst, N, 43);
        expect(f, f->dst + N, N, 43);
        flush(other);
        still_out(f);
        assert_vmmt_ok(vmmt_consumer_ack(f->consumer, &d, 0, f->stream, 0, 1));
        sync_on(f->stream);
        all_back(f);

        /* A run [0, 2) first; a list {2, 1} is refused; {2} and {3} are still owed. */
        publish_one(f, 44, &d);
        assert_vmmt_ok(vmmt_consumer_ack(f->consumer, &d, 0, f->stream, 0, 2));
        sync_on(f->stream);
        flush(f->consumer);
        assert_int_equal(ack_list(f, other, &d, f->stream, two_one, 2), VMMT_ESTATE);
        assert_int_equal(consume_list(f, f->consumer, &d, 0, f->stream, two_one, 2), VMMT_ESTATE);
        assert_vmmt_ok(ack_list(f, other, &d, f->stream, two, 1));
        assert_vmmt_ok(consume_list(f, f->consumer, &d, 0, f->stream, three, 1));
        sync_on(f->stream);
        expect(f, f->dst, N, 44);
        flush(other);
        all_back(f);
        drop_pool(f);
    }
    vmmt_consumer_destroy(other);
}

/*
 * The most ranks a pool can have (256), listed all in a shuffled order:
 * one copy completes the slice; a list of 255 and a run for the last
 * complete another; 257 entries (one listed twice) are refused.
 */
static void test_two_hundred_fifty_six_ranks(void **state)
{
    struct fixture *f = *state;
    int all[257], most[255], n = 0;
    vmmt_desc d;

    for (int i = 0; i < 256; i++)
        all[i] = (i * 97 + 13) % 256; /* 97 is prime to 256: every rank once */
    all[256] = all[0];
    for (int i = 0; i < 256; i++)
        if (all[i] != 128) most[n++] = all[i];
    assert_int_equal(n, 255);
    for (int table = 0; table < 2; table++) {
        if (!table_ok(table)) continue;
        make_pool(f, 256, table);
        publish_one(f, 45, &d);
        assert_int_equal(consume_list(f, f->consumer, &d, 0, f->stream, all, 257), VMMT_EINVAL);
        print_message("257 entries: %s\n", vmmt_last_error());
        assert_vmmt_ok(consume_list(f, f->consumer, &d, 0, f->stream, all, 256));
        sync_on(f->stream);
        expect(f, f->dst, N, 45);
        all_back(f);

        publish_one(f, 46, &d);
        assert_vmmt_ok(ack_list(f, f->consumer, &d, f->stream, most, 255));
        sync_on(f->stream);
        still_out(f);
        assert_int_equal(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, 127, 2),
                         VMMT_ESTATE);
        assert_vmmt_ok(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, 128, 1));
        sync_on(f->stream);
        expect(f, f->dst, N, 46);
        all_back(f);
        drop_pool(f);
    }
}

/*
 * nranks larger than the pool, negative, INT_MIN and INT_MAX: VMMT_EINVAL,
 * no crash, nothing done. The INT_MAX list is really there (zero pages of
 * a reserved mapping): ranks 0..3, then 0 again at entry 4.
 */
static void test_huge_and_negative_nranks(void **state)
{
    struct fixture *f = *state;
    const size_t span = (size_t)INT_MAX * sizeof(int);
    int wide[256], five[] = {0, 1, 2, 3, 0}, every[] = {1, 3, 0, 2};
    int *huge;
    vmmt_desc d;

    for (int i = 0; i < 256; i++)
        wide[i] = i;
    make_pool(f, 4, 0);
    publish_one(f, 47, &d);
    assert_int_equal(consume_list(f, f->consumer, &d, 0, f->stream, wide, 256), VMMT_EINVAL);
    print_message("256 ranks, pool of 4: %s\n", vmmt_last_error());
    assert_int_equal(ack_list(f, f->consumer, &d, f->stream, five, 5), VMMT_EINVAL);
    print_message("5 ranks, pool of 4: %s\n", vmmt_last_error());
    assert_int_equal(ack_list(f, f->consumer, &d, f->stream, every, -1), VMMT_EINVAL);
    print_message("nranks -1: %s\n", vmmt_last_error());
    assert_int_equal(consume_list(f, f->consumer, &d, 0, f->stream, every, INT_MIN), VMMT_EINVAL);
    huge = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1,
                0);
    assert_true(huge != MAP_FAILED);
    memcpy(huge, every, sizeof every);
    assert_int_equal(consume_list(f, f->consumer, &d, 0, f->stream, huge, INT_MAX), VMMT_EINVAL);
    print_message("INT_MAX ranks: %s\n", vmmt_last_error());
    assert_int_equal(ack_list(f, f->consumer, &d, f->stream, huge, INT_MAX), VMMT_EINVAL);
    assert_int_equal(munmap(huge, span), 0);
    still_out(f);
    assert_vmmt_ok(consume_list(f, f->consumer, &d, 0, f->stream, every, 4));
    sync_on(f->stream);
    expect(f, f->dst, N, 47);
    all_back(f);
}

/*
 * Destinations and devices a list consume must refuse before anything is
 * taken: the list is then consumed whole.
 */
static void test_bad_destination_takes_nothing(void **state)
{
    struct fixture *f = *state;
    const int zero_two[] = {2, 0}, rest[] = {1, 3};
    vmmt_consumer *other;
    vmmt_desc d;

    assert_vmmt_ok(vmmt_consumer_create(NULL, &other));
    make_pool(f, 4, 0);
    publish_one(f, 48, &d);
    assert_int_equal(vmmt_consume_ranks(f->consumer, &d, 0, 0, f->cap, f->stream, zero_two, 2),
                     VMMT_EINVAL);
    assert_int_equal(vmmt_consume_ranks(f->consumer, &d, 0, f->dst, N - 1, f->stream, zero_two, 2),
                     VMMT_EINVAL);
    assert_int_equal(
        vmmt_consume_ranks(f->consumer, &d, 0, UINT64_MAX - 16, 4096, f->stream, zero_two, 2),
        VMMT_EINVAL);
    assert_int_not_equal(
        vmmt_consume_ranks(f->consumer, &d, -1, f->dst, f->cap, f->stream, zero_two, 2), VMMT_OK);
    assert_int_not_equal(vmmt_consumer_ack_ranks(f->consumer, &d, -1, f->stream, zero_two, 2),
                         VMMT_OK);
    assert_int_equal(
        vmmt_consume_ranks(f->consumer, NULL, 0, f->dst, f->cap, f->stream, zero_two, 2),
        VMMT_EINVAL);
    assert_int_equal(vmmt_consumer_ack_ranks(f->consumer, NULL, 0, f->stream, zero_two, 2),
                     VMMT_EINVAL);
    assert_int_not_equal(
        vmmt_consume_ranks(f->consumer, &d, 63, f->dst, f->cap, f->stream, zero_two, 2), VMMT_OK);
    {
        vmmt_desc bent = d;
        vmmt_reservation res;

        bent.bytes[100] ^= 1;
        assert_int_equal(
            vmmt_consume_ranks(f->consumer, &bent, 0, f->dst, f->cap, f->stream, zero_two, 2),
            VMMT_EPROTO);
        assert_int_equal(vmmt_consumer_ack_ranks(f->consumer, &bent, 0, f->stream, zero_two, 2),
                         VMMT_EPROTO);
        assert_vmmt_ok(vmmt_reserve(f->pool, N, &res));
        assert_int_equal(
            vmmt_consume_ranks(f->consumer, &res.token, 0, f->dst, f->cap, f->stream, zero_two, 2),
            VMMT_EINVAL);
        assert_int_equal(
            vmmt_consumer_ack_ranks(f->consumer, &res.token, 0, f->stream, zero_two, 2),
            VMMT_EINVAL);
        assert_vmmt_ok(vmmt_cancel(f->pool, &res.token));
    }
    /* Neither rank was taken: another process takes them both. */
    assert_vmmt_ok(consume_list(f, other, &d, 0, f->stream, zero_two, 2));
    sync_on(f->stream);
    expect(f, f->dst, N, 48);
    flush(other);
    assert_vmmt_ok(ack_list(f, f->consumer, &d, f->stream, rest, 2));
    sync_on(f->stream);
    all_back(f);
    vmmt_consumer_destroy(other);
}

/*
 * Packed members named by a list and by a run of the same ranks are one set
 * ("compared as a set"): {1, 0} and [0, 2), and VMMT_ALL_RANKS and a list
 * of every rank.
 */
static void test_packed_list_and_run_are_one_set(void **state)
{
    struct fixture *f = *state;
    const int one_zero[] = {1, 0}, every[] = {1, 0};
    vmmt_desc m[3];

    for (int table = 0; table < 2; table++) {
        if (!table_ok(table)) continue;
        make_pool(f, 4, table);
        publish_three(f, 49, m);
        assert_vmmt_ok(consume_list(f, f->consumer, &m[0], 0, f->stream, one_zero, 2));
        assert_vmmt_ok(
            vmmt_consume(f->consumer, &m[1], 0, f->dst + N, f->cap - N, f->stream, 0, 2));
        assert_vmmt_ok(consume_list(f, f->consumer, &m[2], 2 * N, f->stream, one_zero, 2));
        sync_on(f->stream);
        expect(f, f->dst, 3 * N, 49);
        for (int i = 0; i < 3; i++)
            assert_vmmt_ok(vmmt_consumer_ack(f->consumer, &m[i], 0, f->stream, 2, 2));
        sync_on(f->stream);
        all_back(f);
        drop_pool(f);

        make_pool(f, 2, table);
        publish_three(f, 50, m);
        assert_vmmt_ok(
            vmmt_consume(f->consumer, &m[0], 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
        assert_vmmt_ok(consume_list(f, f->consumer, &m[1], N, f->stream, every, 2));
        still_out(f);
        assert_vmmt_ok(
            vmmt_consume(f->consumer, &m[2], 0, f->dst + 2 * N, f->cap - 2 * N, f->stream, 0, 2));
        sync_on(f->stream);
        expect(f, f->dst, 3 * N, 50);
        all_back(f);
        drop_pool(f);
    }
}

/*
 * One process consumes a packed group for {0, 2} and drops it for {1, 3},
 * the two sets interleaved member by member: both complete, the slice comes
 * back once, and the pool cannot be evicted while either is half done.
 */
static void test_packed_two_disjoint_sets_interleaved(void **state)
{
    struct fixture *f = *state;
    const int zero_two[] = {0, 2}, two_zero[] = {2, 0}, one_three[] = {1, 3}, three_one[] = {3, 1};
    vmmt_desc_info in;
    vmmt_desc m[3];

    for (int table = 0; table < 2; table++) {
        if (!table_ok(table)) continue;
        make_pool(f, 4, table);
        publish_three(f, 51, m);
        assert_vmmt_ok(vmmt_desc_inspect(&m[0], &in));
        assert_vmmt_ok(consume_list(f, f->consumer, &m[0], 0, f->stream, zero_two, 2));
        assert_vmmt_ok(ack_list(f, f->consumer, &m[0], f->stream, three_one, 2));
        assert_vmmt_ok(ack_list(f, f->consumer, &m[1], f->stream, one_three, 2));
        assert_vmmt_ok(consume_list(f, f->consumer, &m[1], N, f->stream, two_zero, 2));
        sync_on(f->stream);
        assert_int_equal(vmmt_consumer_evict(f->consumer, in.pool_id, 0), VMMT_ESTATE);
        still_out(f);
        assert_vmmt_ok(ack_list(f, f->consumer, &m[2], f->stream, three_one, 2));
        still_out(f);
        assert_vmmt_ok(consume_list(f, f->consumer, &m[2], 2 * N, f->stream, zero_two, 2));
        sync_on(f->stream);
        expect(f, f->dst, 3 * N, 51);
        for (int i = 0; i < 3; i++)
            assert_vmmt_ok(vmmt_consumer_check(f->consumer, &m[i]));
        all_back(f);
        assert_vmmt_ok(vmmt_consumer_evict(f->consumer, in.pool_id, 0));
        drop_pool(f);
    }
}

/*
 * Another process did rank 2 for every member; a list {0, 2} for a member
 * here is refused and leaves rank 0 to consume the group alone.
 */
static void test_packed_list_refused_for_a_rank_done_elsewhere(void **state)
{
    struct fixture *f = *state;
    const int two[] = {2}, zero_two[] = {0, 2}, zero[] = {0}, one_three[] = {1, 3};
    vmmt_consumer *other;
    vmmt_desc m[3];

    assert_vmmt_ok(vmmt_consumer_create(NULL, &other));
    for (int table = 0; table < 2; table++) {
        if (!table_ok(table)) continue;
        make_pool(f, 4, table);
        publish_three(f, 52, m);
        put(f, f->dst, N, 99);
        for (int i = 0; i < 3; i++)
            assert_vmmt_ok(ack_list(f, other, &m[i], f->stream, two, 1));
        sync_on(f->stream);
        flush(other);
        assert_int_equal(consume_list(f, f->consumer, &m[1], 0, f->stream, zero_two, 2),
                         VMMT_ESTATE);
        print_message("rank 2 done elsewhere: %s\n", vmmt_last_error());
        assert_error_contains("rank 2");
        sync_on(f->stream);
        expect(f, f->dst, N, 99);
        for (int i = 0; i < 3; i++)
            assert_vmmt_ok(consume_list(f, f->consumer, &m[i], i * N, f->stream, zero, 1));
        sync_on(f->stream);
        expect(f, f->dst, 3 * N, 52);
        still_out(f);
        for (int i = 0; i < 3; i++)
            assert_vmmt_ok(ack_list(f, other, &m[i], f->stream, one_three, 2));
        sync_on(f->stream);
        flush(other);
        all_back(f);
        drop_pool(f);
    }
    vmmt_consumer_destroy(other);
}

/*
 * A process's copy for {0, 1} is held behind a gate (its words TAKEN): a
 * list {2, 1} of another process is refused naming rank 1, and leaves rank
 * 2 for a third, which consumes {2, 3}. A shared table of a device pool.
 */
static void test_lists_overlapping_by_one_rank_while_queued(void **state)
{
    struct fixture *f = *state;
    const int zero_one[] = {0, 1}, two_one[] = {2, 1}, two_three[] = {2, 3};
    vmmt_consumer *a, *b, *c;
    CUstream held;
    struct gate g;
    vmmt_desc d;

    if (pool_kind_host()) skip();
    make_pool(f, 4, 0);
    assert_vmmt_ok(vmmt_consumer_create(NULL, &a));
    assert_vmmt_ok(vmmt_consumer_create(NULL, &b));
    assert_vmmt_ok(vmmt_consumer_create(NULL, &c));
    held = new_stream();
    publish_one(f, 53, &d);
    put(f, f->dst + N, N, 99);
    gate_close(&g, held);
    assert_vmmt_ok(consume_list(f, a, &d, 0, held, zero_one, 2));
    assert_int_equal(consume_list(f, b, &d, N, f->stream, two_one, 2), VMMT_ESTATE);
    print_message("rank 1 taken elsewhere: %s\n", vmmt_last_error());
    assert_error_contains("rank 1");
    assert_int_equal(ack_list(f, b, &d, f->stream, two_one, 2), VMMT_ESTATE);
    sync_on(f->stream);
    expect(f, f->dst + N, N, 99);
    assert_vmmt_ok(consume_list(f, c, &d, 2 * N, f->stream, two_three, 2));
    sync_on(f->stream);
    expect(f, f->dst + 2 * N, N, 53);
    flush(c);
    still_out(f);
    gate_open_later(&g, 0);
    gate_free(&g);
    sync_on(held);
    expect(f, f->dst, N, 53);
    flush(a);
    assert_vmmt_ok(vmmt_consumer_check(a, &d));
    assert_vmmt_ok(vmmt_consumer_check(c, &d));
    all_back(f);
    drop_stream(held);
    vmmt_consumer_destroy(c);
    vmmt_consumer_destroy(b);
    vmmt_consumer_destroy(a);
}

/* Two threads racing lists {0, 1} and {2, 1} for one descriptor. */
struct racer {
    struct fixture *f;
    vmmt_consumer *c;
    const vmmt_desc *d;
    const int *ranks;
    uint64_t off;
    CUstream s;
    pthread_barrier_t *start;
    int status;
};

static void *race(void *arg)
{
    struct racer *r = arg;

    pthread_barrier_wait(r->start);
    r->status = consume_list(r->f, r->c, r->d, r->off, r->s, r->ranks, 2);
    return NULL;
}

/*
 * Exactly one of two lists overlapping by rank 1 wins it, whatever the
 * interleaving; the loser leaves its own rank untaken (a third consumer
 * acknowledges it), and the winner's bytes are the descriptor's. `same`:
 * both threads call one consumer (one process); else two consumers (two
 * processes: shared tables only, since a device table has no take).
 */
static void race_lists(struct fixture *f, int device_table, int same)
{
    const int zero_one[] = {0, 1}, two_one[] = {2, 1};
    vmmt_consumer *a, *b, *third;
    pthread_barrier_t start;
    pthread_t ta, tb;
    int wins[2] = {0, 0};

    make_pool(f, 4, device_table);
    assert_vmmt_ok(vmmt_consumer_create(NULL, &a));
    b = a;
    if (!same) assert_vmmt_ok(vmmt_consumer_create(NULL, &b));
    assert_vmmt_ok(vmmt_consumer_create(NULL, &third));
    for (uint32_t i = 0; i < 60; i++) {
        struct racer ra = {f, a, NULL, zero_one, 0, new_stream(), &start, 0};
        struct racer rb = {f, b, NULL, two_one, N, new_stream(), &start, 0};
        int left[2];
        vmmt_desc d;

        publish_one(f, 100 + i, &d);
        put(f, f->dst, 2 * N, 99);
        ra.d = rb.d = &d;
        pthread_barrier_init(&start, NULL, 2);
        pthread_create(&ta, NULL, race, &ra);
        pthread_create(&tb, NULL, race, &rb);
        pthread_join(ta, NULL);
        pthread_join(tb, NULL);
        pthread_barrier_destroy(&start);
        sync_on(ra.s);
        sync_on(rb.s);
        if ((ra.status == VMMT_OK) == (rb.status == VMMT_OK))
            fail_msg("round %u: {0, 1} -> %d, {2, 1} -> %d: exactly one must win rank 1", i,
                     ra.status, rb.status);
        if (ra.status != VMMT_OK) assert_int_equal(ra.status, VMMT_ESTATE);
        if (rb.status != VMMT_OK) assert_int_equal(rb.status, VMMT_ESTATE);
        if (ra.status == VMMT_OK) {
            expect(f, f->dst, N, 100 + i);
            expect(f, f->dst + N, N, 99);
            wins[0]++;
        } else {
            expect(f, f->dst, N, 99);
            expect(f, f->dst + N, N, 100 + i);
            wins[1]++;
        }
        flush(a);
        flush(b);
        /* The loser's own rank and rank 3 are still owed, and nothing else. */
        left[0] = ra.status == VMMT_OK ? 2 : 0;
        left[1] = 3;
        assert_int_equal(ack_list(f, third, &d, f->stream, zero_one, 2), VMMT_ESTATE);
        assert_int_equal(ack_list(f, third, &d, f->stream, two_one, 2), VMMT_ESTATE);
        assert_vmmt_ok(ack_list(f, third, &d, f->stream, left, 2));
        sync_on(f->stream);
        flush(third);
        assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
        assert_int_equal(stats(f->pool).in_flight, 0);
        drop_stream(ra.s);
        drop_stream(rb.s);
    }
    print_message("wins {0,1}: %d, {2,1}: %d\n", wins[0], wins[1]);
    vmmt_consumer_destroy(third);
    if (!same) vmmt_consumer_destroy(b);
    vmmt_consumer_destroy(a);
    drop_pool(f);
}

static void test_race_lists_two_processes(void **state)
{
    race_lists(*state, 0, 0);
}

static void test_race_lists_one_process(void **state)
{
    race_lists(*state, 0, 1);
}

static void test_race_lists_one_process_device_table(void **state)
{
    if (!table_ok(1)) skip();
    race_lists(*state, 1, 1);
}

/*
 * The producer cancels a descriptor whose copy a list {0, 2} holds queued:
 * the slice stays held until that copy is acknowledged, every other list
 * (the taker's own other ranks included) is refused, and the copy has the
 * descriptor's bytes. Shared table of a device pool.
 */
static void test_cancel_under_a_queued_list(void **state)
{
    struct fixture *f = *state;
    const int zero_two[] = {2, 0}, one_three[] = {1, 3}, zero[] = {0};
    vmmt_buffer b = bytes(f->src, N);
    vmmt_consumer *other;
    vmmt_desc d, next;
    CUstream held;
    struct gate g;
    uint32_t freed = 1;

    if (pool_kind_host()) skip();
    make_pool_with(f, 4, 0, 1, VMMT_HANDOFF_AUTO);
    assert_vmmt_ok(vmmt_consumer_create(NULL, &other));
    held = new_stream();
    publish_one(f, 54, &d);
    gate_close(&g, held);
    assert_vmmt_ok(consume_list(f, f->consumer, &d, 0, held, zero_two, 2));
    assert_vmmt_ok(vmmt_cancel(f->pool, &d));
    assert_int_equal(consume_list(f, other, &d, N, f->stream, one_three, 2), VMMT_ESTATE);
    assert_int_equal(ack_list(f, f->consumer, &d, f->stream, one_three, 2), VMMT_ESTATE);
    assert_int_equal(ack_list(f, other, &d, f->stream, zero, 1), VMMT_ESTATE);
    assert_vmmt_ok(vmmt_pool_reclaim(f->pool, &freed));
    assert_int_equal(freed, 0);
    put(f, f->src, N, 55);
    assert_int_equal(vmmt_publish(f->pool, &b, f->stream, &next), VMMT_EFULL);
    gate_open_later(&g, 0);
    gate_free(&g);
    sync_on(held);
    expect(f, f->dst, N, 54);
    flush(f->consumer);
    assert_vmmt_ok(vmmt_consumer_check(f->consumer, &d));
    all_back(f);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &next));
    assert_vmmt_ok(
        vmmt_consume(f->consumer, &next, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    sync_on(f->stream);
    expect(f, f->dst, N, 55);
    all_back(f);
    drop_stream(held);
    vmmt_consumer_destroy(other);
}

/* The same for a packed group half consumed for a list, its copy queued. */
static void test_cancel_under_a_queued_packed_list(void **state)
{
    struct fixture *f = *state;
    const int zero_two[] = {2, 0}, two_zero[] = {0, 2};
    vmmt_buffer b = bytes(f->src, N);
    vmmt_desc m[3], next;
    CUstream held;
    struct gate g;
    uint32_t freed = 1;

    if (pool_kind_host()) skip();
    make_pool_with(f, 4, 0, 1, VMMT_HANDOFF_AUTO);
    held = new_stream();
    publish_three(f, 56, m);
    gate_close(&g, held);
    assert_vmmt_ok(consume_list(f, f->consumer, &m[0], 0, held, zero_two, 2));
    assert_vmmt_ok(vmmt_cancel(f->pool, &m[2]));
    assert_int_equal(consume_list(f, f->consumer, &m[1], N, held, two_zero, 2), VMMT_ESTATE);
    assert_vmmt_ok(vmmt_pool_reclaim(f->pool, &freed));
    assert_int_equal(freed, 0);
    put(f, f->src, N, 57);
    assert_int_equal(vmmt_publish(f->pool, &b, f->stream, &next), VMMT_EFULL);
    gate_open_later(&g, 0);
    gate_free(&g);
    sync_on(held);
    expect(f, f->dst, N, 56);
    flush(f->consumer);
    assert_vmmt_ok(vmmt_consumer_check(f->consumer, &m[0]));
    all_back(f);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &next));
    assert_vmmt_ok(
        vmmt_consume(f->consumer, &next, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    sync_on(f->stream);
    expect(f, f->dst, N, 57);
    all_back(f);
    drop_stream(held);
}

/*
 * vmmt_pool_release_rank of a rank on the list: before the list, the list
 * is refused and its other rank is left; under a queued list copy, the
 * copy's acknowledgement completes the slot and its check says OK.
 */
static void test_release_rank_of_a_listed_rank(void **state)
{
    struct fixture *f = *state;
    const int zero_two[] = {0, 2}, zero[] = {0}, one_three[] = {3, 1};
    vmmt_consumer *other;
    CUstream held;
    struct gate g;
    vmmt_desc d;

    assert_vmmt_ok(vmmt_consumer_create(NULL, &other));
    for (int table = 0; table < 2; table++) {
        if (!table_ok(table)) continue;
        make_pool(f, 4, table);
        publish_one(f, 58, &d);
        assert_vmmt_ok(vmmt_pool_release_rank(f->pool, 2));
        assert_int_equal(consume_list(f, f->consumer, &d, 0, f->stream, zero_two, 2), VMMT_ESTATE);
        assert_int_equal(ack_list(f, other, &d, f->stream, zero_two, 2), VMMT_ESTATE);
        assert_vmmt_ok(consume_list(f, f->consumer, &d, 0, f->stream, zero, 1));
        sync_on(f->stream);
        expect(f, f->dst, N, 58);
        still_out(f);
        assert_vmmt_ok(ack_list(f, other, &d, f->stream, one_three, 2));
        sync_on(f->stream);
        flush(other);
        all_back(f);
        drop_pool(f);
    }
    if (pool_kind_host()) {
        vmmt_consumer_destroy(other);
        return;
    }
    make_pool(f, 4, 0);
    held = new_stream();
    publish_one(f, 59, &d);
    gate_close(&g, held);
    assert_vmmt_ok(consume_list(f, f->consumer, &d, 0, held, zero_two, 2));
    assert_vmmt_ok(vmmt_pool_release_rank(f->pool, 2));
    assert_vmmt_ok(ack_list(f, other, &d, f->stream, one_three, 2));
    sync_on(f->stream);
    flush(other);
    still_out(f);
    gate_open_later(&g, 0);
    gate_free(&g);
    sync_on(held);
    expect(f, f->dst, N, 59);
    flush(f->consumer);
    assert_vmmt_ok(vmmt_consumer_check(f->consumer, &d));
    all_back(f);
    drop_stream(held);
    vmmt_consumer_destroy(other);
}

/*
 * A list consume whose wait for the ready flag fails acknowledges nothing:
 * each of its ranks can be consumed after, by another process or by this
 * one. Stream-ordered device pool, shared table.
 */
static void test_failed_wait_of_a_list_is_retryable(void **state)
{
    struct fixture *f = *state;
    const int two_zero[] = {2, 0}, two[] = {2}, zero[] = {0}, rest[] = {1, 3};
    vmmt_buffer b = bytes(f->src, N);
    vmmt_consumer *other;
    struct gate g;
    vmmt_desc d;

    if (!on_emu() || pool_kind_host()) skip();
    make_pool_with(f, 4, 0, 4, VMMT_HANDOFF_STREAM);
    assert_vmmt_ok(vmmt_consumer_create(NULL, &other));
    put(f, f->src, N, 60);
    gate_close(&g, f->stream); /* PENDING: the consume must wait on its stream */
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    emu_fail("cuStreamWaitValue32:*:CUDA_ERROR_UNKNOWN");
    assert_int_not_equal(consume_list(f, f->consumer, &d, 0, f->stream, two_zero, 2), VMMT_OK);
    print_message("failed wait: %s\n", vmmt_last_error());
    emu_reset();
    gate_open_later(&g, 10);
    gate_free(&g);
    sync_on(f->stream);
    assert_vmmt_ok(consume_list(f, other, &d, N, f->stream, two, 1));
    assert_vmmt_ok(consume_list(f, f->consumer, &d, 0, f->stream, zero, 1));
    sync_on(f->stream);
    expect(f, f->dst, 2 * N, 60);
    flush(other);
    assert_vmmt_ok(ack_list(f, other, &d, f->stream, rest, 2));
    sync_on(f->stream);
    flush(other);
    all_back(f);
    vmmt_consumer_destroy(other);
}

/*
 * An acknowledgement for a list on a shared host table waits for the
 * producer's copy at most timeout_ms: timed out, it acknowledged nothing
 * and is retried. For a packed group, the member that completes the group
 * is the one that waits; its timeout too must leave the group retryable.
 */
static void test_ack_list_timeout_is_retryable(void **state)
{
    struct fixture *f = *state;
    const int zero_two[] = {0, 2}, two[] = {2}, zero[] = {0}, rest[] = {1, 3};
    vmmt_buffer b[2] = {bytes(f->src, N), bytes(f->src + N, N)};
    vmmt_consumer_config cc;
    vmmt_consumer *k;
    struct gate g;
    vmmt_desc d, m[2];

    if (!on_emu()) skip();
    vmmt_consumer_config_init(&cc);
    cc.timeout_ms = 100;
    assert_vmmt_ok(vmmt_consumer_create(&cc, &k));
    make_pool_with(f, 4, 0, 4, VMMT_HANDOFF_STREAM);
    put(f, f->src, 2 * N, 61);

    gate_close(&g, f->stream);
    assert_vmmt_ok(vmmt_publish(f->pool, &b[0], f->stream, &d));
    assert_int_equal(ack_list(f, k, &d, NULL, zero_two, 2), VMMT_ETIMEDOUT);
    print_message("ack timeout: %s\n", vmmt_last_error());
    gate_open_later(&g, 0);
    gate_free(&g);
    sync_on(f->stream);
    assert_vmmt_ok(ack_list(f, k, &d, NULL, two, 1));
    assert_vmmt_ok(ack_list(f, k, &d, NULL, zero, 1));
    assert_vmmt_ok(ack_list(f, k, &d, NULL, rest, 2));
    flush(k);
    all_back(f);

    gate_close(&g, f->stream);
    assert_vmmt_ok(vmmt_publish_packed(f->pool, b, 2, f->stream, m));
    assert_vmmt_ok(ack_list(f, k, &m[0], NULL, zero_two, 2));
    assert_int_equal(ack_list(f, k, &m[1], NULL, zero_two, 2), VMMT_ETIMEDOUT);
    gate_open_later(&g, 0);
    gate_free(&g);
    sync_on(f->stream);
    assert_vmmt_ok(ack_list(f, k, &m[1], NULL, zero_two, 2));
    for (int i = 0; i < 2; i++)
        assert_vmmt_ok(ack_list(f, k, &m[i], NULL, rest, 2));
    flush(k);
    all_back(f);
    vmmt_consumer_destroy(k);
}

/*
 * A FABRIC pool (no broker, a device table) is waited for on the host: a
 * list consume or acknowledgement of a descriptor whose bytes have not
 * landed times out with nothing queued and nothing acknowledged, and is
 * retried.
 */
static void test_fabric_list_timeout_is_retryable(void **state)
{
    const struct vmmt_drv *drv = vmmt__drv();
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 4);
    vmmt_buffer b = bytes(f->src, N);
    const int three_one[] = {3, 1}, one_three[] = {1, 3}, zero_two[] = {0, 2};
    vmmt_consumer_config cc;
    vmmt_consumer *k;
    struct gate g;
    CUstream s2;
    vmmt_desc d;

    if (!on_emu() || pool_kind_host() || pool_kind_elastic()) skip();
    setenv("VMMT_EMU_HANDLES", "fabric,posix_fd", 1);
    vmmt__emu_configure();
    vmmt_probe_reset();
    c.handle_type = VMMT_HANDLE_FABRIC;
    c.handoff = VMMT_HANDOFF_STREAM;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    vmmt_consumer_config_init(&cc);
    cc.timeout_ms = 100;
    assert_vmmt_ok(vmmt_consumer_create(&cc, &k));
    s2 = new_stream();
    put(f, f->src, N, 62);
    gate_close(&g, f->stream);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    assert_int_equal(consume_list(f, k, &d, 0, s2, three_one, 2), VMMT_ETIMEDOUT);
    assert_int_equal(drv->cuStreamQuery(s2), CUDA_SUCCESS);
    assert_int_equal(ack_list(f, k, &d, s2, zero_two, 2), VMMT_ETIMEDOUT);
    assert_int_equal(drv->cuStreamQuery(s2), CUDA_SUCCESS);
    gate_open_later(&g, 0);
    gate_free(&g);
    sync_on(f->stream);
    assert_vmmt_ok(consume_list(f, k, &d, 0, s2, one_three, 2));
    assert_vmmt_ok(ack_list(f, k, &d, s2, zero_two, 2));
    sync_on(s2);
    expect(f, f->dst, N, 62);
    flush(k);
    all_back(f);
    drop_stream(s2);
    vmmt_consumer_destroy(k);
}

/*
 * A list consume whose copy fails still acknowledges every rank listed (the
 * slice is released) and the descriptor cannot be consumed again for any of
 * them; the other ranks complete the slice.
 */
static void test_failed_copy_of_a_list_acknowledges_it_whole(void **state)
{
    struct fixture *f = *state;
    const int zero_two[] = {2, 0}, zero[] = {0}, two[] = {2}, rest[] = {1, 3};
    vmmt_desc d;
    int st;

    if (!on_emu() || pool_kind_host()) skip();
    for (int table = 0; table < 2; table++) {
        if (!table_ok(table)) continue;
        make_pool(f, 4, table);
        publish_one(f, 63, &d);
        emu_fail("cuMemcpyDtoDAsync:*:CUDA_ERROR_UNKNOWN,cuMemcpyAsync:*:CUDA_ERROR_UNKNOWN");
        st = consume_list(f, f->consumer, &d, 0, f->stream, zero_two, 2);
        print_message("failed copy: %d %s\n", st, vmmt_last_error());
        emu_reset();
        assert_int_not_equal(st, VMMT_OK);
        sync_on(f->stream);
        flush(f->consumer);
        assert_int_equal(consume_list(f, f->consumer, &d, 0, f->stream, zero, 1), VMMT_ESTATE);
        assert_int_equal(ack_list(f, f->consumer, &d, f->stream, two, 1), VMMT_ESTATE);
        assert_vmmt_ok(ack_list(f, f->consumer, &d, f->stream, rest, 2));
        sync_on(f->stream);
        all_back(f);
        drop_pool(f);
    }
}

/*
 * This process's own list copy for {0, 2} is queued (its acknowledgement
 * not written yet): a list of this process naming either rank is refused,
 * on either table, and its other ranks are left.
 */
static void test_own_queued_list_refuses_its_ranks(void **state)
{
    struct fixture *f = *state;
    const int zero_two[] = {0, 2}, two[] = {2}, zero_one[] = {0, 1}, one_three[] = {1, 3};
    CUstream held;
    struct gate g;
    vmmt_desc d;

    if (pool_kind_host()) skip();
    for (int table = 0; table < 2; table++) {
        if (!table_ok(table)) continue;
        make_pool(f, 4, table);
        held = new_stream();
        publish_one(f, 64, &d);
        gate_close(&g, held);
        assert_vmmt_ok(consume_list(f, f->consumer, &d, 0, held, zero_two, 2));
        assert_int_equal(consume_list(f, f->consumer, &d, N, f->stream, two, 1), VMMT_ESTATE);
        assert_int_equal(ack_list(f, f->consumer, &d, f->stream, zero_one, 2), VMMT_ESTATE);
        assert_vmmt_ok(ack_list(f, f->consumer, &d, f->stream, one_three, 2));
        sync_on(f->stream);
        gate_open_later(&g, 0);
        gate_free(&g);
        sync_on(held);
        expect(f, f->dst, N, 64);
        assert_vmmt_ok(vmmt_consumer_check(f->consumer, &d));
        all_back(f);
        drop_stream(held);
        drop_pool(f);
    }
}

/*
 * Within one set, members may be consumed or dropped as the process likes:
 * {0, 2} consumes member 0, drops member 1 ({2, 0}) and consumes member 2.
 */
static void test_packed_set_mixes_consume_and_drop(void **state)
{
    struct fixture *f = *state;
    const int zero_two[] = {0, 2}, two_zero[] = {2, 0}, rest[] = {1, 3};
    vmmt_desc m[3];

    for (int table = 0; table < 2; table++) {
        if (!table_ok(table)) continue;
        make_pool(f, 4, table);
        publish_three(f, 65, m);
        put(f, f->dst + N, N, 99);
        assert_vmmt_ok(consume_list(f, f->consumer, &m[0], 0, f->stream, zero_two, 2));
        assert_vmmt_ok(ack_list(f, f->consumer, &m[1], f->stream, two_zero, 2));
        assert_int_equal(consume_list(f, f->consumer, &m[1], N, f->stream, zero_two, 2),
                         VMMT_ESTATE);
        assert_vmmt_ok(consume_list(f, f->consumer, &m[2], 2 * N, f->stream, two_zero, 2));
        sync_on(f->stream);
        expect(f, f->dst, N, 65);
        expect(f, f->dst + N, N, 99);
        still_out(f);
        for (int i = 0; i < 3; i++)
            assert_vmmt_ok(ack_list(f, f->consumer, &m[i], f->stream, rest, 2));
        sync_on(f->stream);
        all_back(f);
        drop_pool(f);
    }
}

/*
 * A list drop of a descriptor whose bytes have not landed, on a device
 * table: the stream waits, and until then the ranks are this process's:
 * another list of it naming one is refused, its other ranks are not.
 */
static void test_device_table_pending_drop_holds_its_ranks(void **state)
{
    struct fixture *f = *state;
    const int zero_two[] = {0, 2}, two[] = {2}, zero_three[] = {3, 0}, rest[] = {1, 3};
    vmmt_buffer b = bytes(f->src, N);
    struct gate g;
    CUstream s2;
    vmmt_desc d;

    if (!table_ok(1)) skip();
    make_pool_with(f, 4, 1, 4, VMMT_HANDOFF_STREAM);
    s2 = new_stream();
    put(f, f->src, N, 66);
    gate_close(&g, f->stream);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    assert_vmmt_ok(ack_list(f, f->consumer, &d, s2, zero_two, 2));
    assert_int_equal(consume_list(f, f->consumer, &d, 0, s2, two, 1), VMMT_ESTATE);
    assert_int_equal(ack_list(f, f->consumer, &d, s2, zero_three, 2), VMMT_ESTATE);
    assert_vmmt_ok(ack_list(f, f->consumer, &d, s2, rest, 2));
    gate_open_later(&g, 0);
    gate_free(&g);
    sync_on(f->stream);
    sync_on(s2);
    all_back(f);
    drop_stream(s2);
}

/* A list consume on its own thread, whose wait on the host ends in a timeout. */
struct waiter {
    struct fixture *f;
    vmmt_consumer *c;
    const vmmt_desc *d;
    const int *ranks;
    int n;
    CUstream s;
    int status;
};

static void *wait_list(void *arg)
{
    struct waiter *w = arg;

    w->status = consume_list(w->f, w->c, w->d, 0, w->s, w->ranks, w->n);
    return NULL;
}

/*
 * A list {0, 2} takes its words, then waits on the host for bytes that do
 * not land (the stream wait refused, so the host polls within timeout_ms);
 * meanwhile the producer cancels the descriptor or releases rank 0. The
 * list must not be OK, and its give-back must not undo the producer's
 * word: the slice comes back (cancel: by itself once its copy lands;
 * release: once ranks 1, 2 and 3 acknowledge). Where the thread had not
 * taken yet, it is refused at once and the end is the same.
 */
static void give_back_under_producer(struct fixture *f, int cancel)
{
    const int zero_two[] = {0, 2}, rest[] = {1, 2, 3};
    vmmt_buffer b = bytes(f->src, N);
    vmmt_consumer_config cc;
    vmmt_consumer *k, *other;
    struct waiter w;
    struct gate g;
    pthread_t t;
    vmmt_desc d;

    if (!on_emu() || pool_kind_host()) skip();
    make_pool_with(f, 4, 0, 4, VMMT_HANDOFF_STREAM);
    vmmt_consumer_config_init(&cc);
    cc.timeout_ms = 1500;
    assert_vmmt_ok(vmmt_consumer_create(&cc, &k));
    assert_vmmt_ok(vmmt_consumer_create(NULL, &other));
    put(f, f->src, N, cancel ? 67 : 68);
    gate_close(&g, f->stream);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    emu_fail("cuStreamWaitValue32:*:CUDA_ERROR_NOT_SUPPORTED");
    w = (struct waiter){f, k, &d, zero_two, 2, new_stream(), 0};
    pthread_create(&t, NULL, wait_list, &w);
    sleep_ms(300); /* coverage only: the end is the same either way */
    if (cancel)
        assert_vmmt_ok(vmmt_cancel(f->pool, &d));
    else
        assert_vmmt_ok(vmmt_pool_release_rank(f->pool, 0));
    pthread_join(t, NULL);
    emu_reset();
    print_message("%s during the wait: list -> %d: %s\n", cancel ? "cancel" : "release", w.status,
                  vmmt_last_error());
    assert_int_not_equal(w.status, VMMT_OK);
    gate_open_later(&g, 0);
    gate_free(&g);
    sync_on(f->stream);
    sync_on(w.s);
    if (!cancel) {
        assert_vmmt_ok(ack_list(f, other, &d, f->stream, rest, 3));
        sync_on(f->stream);
        flush(other);
    }
    flush(k);
    all_back(f);
    drop_stream(w.s);
    vmmt_consumer_destroy(other);
    vmmt_consumer_destroy(k);
}

static void test_cancel_during_a_lists_wait(void **state)
{
    give_back_under_producer(*state, 1);
}

static void test_release_during_a_lists_wait(void **state)
{
    give_back_under_producer(*state, 0);
}

/*
 * A pool is never evicted under a list's queued copy, nor under a list
 * drop whose stream still waits for the producer's copy (device table);
 * once done, it is.
 */
static void test_evict_refused_under_queued_lists(void **state)
{
    struct fixture *f = *state;
    const int zero_two[] = {0, 2}, rest[] = {1, 3};
    vmmt_buffer b = bytes(f->src, N);
    vmmt_desc_info in;
    CUstream held;
    struct gate g;
    vmmt_desc d;
    int st;

    if (pool_kind_host()) skip();
    for (int table = 0; table < 2; table++) {
        if (!table_ok(table)) continue;
        make_pool_with(f, 4, table, 4, VMMT_HANDOFF_STREAM);
        held = new_stream();
        publish_one(f, 71, &d);
        assert_vmmt_ok(vmmt_desc_inspect(&d, &in));
        gate_close(&g, held);
        assert_vmmt_ok(consume_list(f, f->consumer, &d, 0, held, zero_two, 2));
        assert_int_equal(vmmt_consumer_evict(f->consumer, in.pool_id, 0), VMMT_ESTATE);
        gate_open_later(&g, 0);
        gate_free(&g);
        sync_on(held);
        expect(f, f->dst, N, 71);
        assert_vmmt_ok(ack_list(f, f->consumer, &d, held, rest, 2));
        sync_on(held);
        all_back(f);
        assert_vmmt_ok(vmmt_consumer_evict(f->consumer, in.pool_id, 0));

        /* A drop whose stream waits for the producer's copy (a shared table's waits on the
         * host, test_ack_list_timeout_is_retryable). */
        if (table) {
            put(f, f->src, N, 72);
            gate_close(&g, f->stream);
            assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
            assert_vmmt_ok(ack_list(f, f->consumer, &d, held, zero_two, 2));
            st = vmmt_consumer_evict(f->consumer, in.pool_id, 0);
            print_message("evict under a pending list drop (device table): %d %s\n", st,
                          st ? vmmt_last_error() : "");
            assert_int_equal(st, VMMT_ESTATE);
            gate_open_later(&g, 0);
            gate_free(&g);
            sync_on(f->stream);
            sync_on(held);
            assert_vmmt_ok(ack_list(f, f->consumer, &d, held, rest, 2));
            sync_on(held);
            all_back(f);
        }
        drop_stream(held);
        drop_pool(f);
    }
}

/*
 * A packed group's members go on one stream: a member of a list group
 * asked on another stream is refused, records nothing, and the group then
 * completes on its own stream.
 */
static void test_packed_list_member_on_another_stream(void **state)
{
    struct fixture *f = *state;
    const int zero_two[] = {0, 2}, two_zero[] = {2, 0}, rest[] = {3, 1};
    vmmt_desc m[3];
    CUstream s2;
    int st;

    for (int table = 0; table < 2; table++) {
        if (!table_ok(table)) continue;
        make_pool(f, 4, table);
        s2 = new_stream();
        publish_three(f, 73, m);
        put(f, f->dst + N, N, 99);
        assert_vmmt_ok(consume_list(f, f->consumer, &m[0], 0, f->stream, zero_two, 2));
        st = consume_list(f, f->consumer, &m[1], N, s2, two_zero, 2);
        print_message("member on another stream: %d %s\n", st, vmmt_last_error());
        assert_int_not_equal(st, VMMT_OK);
        sync_on(s2);
        expect(f, f->dst + N, N, 99);
        assert_vmmt_ok(consume_list(f, f->consumer, &m[1], N, f->stream, two_zero, 2));
        assert_vmmt_ok(consume_list(f, f->consumer, &m[2], 2 * N, f->stream, zero_two, 2));
        sync_on(f->stream);
        expect(f, f->dst, 3 * N, 73);
        for (int i = 0; i < 3; i++)
            assert_vmmt_ok(ack_list(f, f->consumer, &m[i], f->stream, rest, 2));
        sync_on(f->stream);
        all_back(f);
        drop_stream(s2);
        drop_pool(f);
    }
}

/* Two consumers race a packed group's first member with {0, 1} and {2, 1}. */
static void test_race_packed_lists_two_processes(void **state)
{
    struct fixture *f = *state;
    const int zero_one[] = {0, 1}, two_one[] = {2, 1};
    vmmt_consumer *a, *b, *third;
    pthread_barrier_t start;
    pthread_t ta, tb;

    make_pool(f, 4, 0);
    assert_vmmt_ok(vmmt_consumer_create(NULL, &a));
    assert_vmmt_ok(vmmt_consumer_create(NULL, &b));
    assert_vmmt_ok(vmmt_consumer_create(NULL, &third));
    for (uint32_t i = 0; i < 40; i++) {
        struct racer ra = {f, a, NULL, zero_one, 0, new_stream(), &start, 0};
        struct racer rb = {f, b, NULL, two_one, 3 * N, new_stream(), &start, 0};
        const struct racer *win, *lose;
        int left[2];
        vmmt_desc m[3];

        publish_three(f, 200 + i, m);
        put(f, f->dst, 6 * N, 99);
        ra.d = rb.d = &m[0];
        pthread_barrier_init(&start, NULL, 2);
        pthread_create(&ta, NULL, race, &ra);
        pthread_create(&tb, NULL, race, &rb);
        pthread_join(ta, NULL);
        pthread_join(tb, NULL);
        pthread_barrier_destroy(&start);
        if ((ra.status == VMMT_OK) == (rb.status == VMMT_OK))
            fail_msg("round %u: {0, 1} -> %d, {2, 1} -> %d: exactly one must win rank 1", i,
                     ra.status, rb.status);
        win = ra.status == VMMT_OK ? &ra : &rb;
        lose = win == &ra ? &rb : &ra;
        assert_int_equal(lose->status, VMMT_ESTATE);
        for (int k = 1; k < 3; k++) {
            assert_int_equal(vmmt_consume_ranks(lose->c, &m[k], 0, f->dst + lose->off + k * N, N,
                                                lose->s, lose->ranks, 2),
                             VMMT_ESTATE);
            assert_vmmt_ok(vmmt_consume_ranks(win->c, &m[k], 0, f->dst + win->off + k * N, N,
                                              win->s, win->ranks, 2));
        }
        sync_on(ra.s);
        sync_on(rb.s);
        expect(f, f->dst + win->off, 3 * N, 200 + i);
        expect(f, f->dst + lose->off, 3 * N, 99);
        flush(a);
        flush(b);
        left[0] = win == &ra ? 2 : 0;
        left[1] = 3;
        for (int k = 0; k < 3; k++)
            assert_vmmt_ok(ack_list(f, third, &m[k], f->stream, left, 2));
        sync_on(f->stream);
        flush(third);
        assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
        assert_int_equal(stats(f->pool).in_flight, 0);
        drop_stream(ra.s);
        drop_stream(rb.s);
    }
    vmmt_consumer_destroy(third);
    vmmt_consumer_destroy(b);
    vmmt_consumer_destroy(a);
}

/* One racer against the producer: a list consume released by a barrier. */
struct producer_race {
    struct fixture *f;
    int cancel;
    vmmt_consumer *c, *other;
};

/*
 * A list consume {0, 2} racing vmmt_cancel (then a publish of the next
 * buffer into the pool's only slice) or vmmt_pool_release_rank(0), 60
 * rounds. Whatever the order: an OK has the descriptor's bytes and checks
 * OK, a refusal is VMMT_ESTATE and leaves rank 2 untaken, and the slice
 * comes back. Shared tables (a device table has no take, so a cancel frees
 * the slice under a queued copy there: documented).
 */
static void race_list_against_producer(struct fixture *f, int cancel)
{
    const int zero_two[] = {0, 2}, two[] = {2}, rest[] = {1, 3};
    vmmt_buffer b = bytes(f->src, N);
    vmmt_consumer *a, *other;
    pthread_barrier_t start;
    int oks = 0;

    make_pool_with(f, 4, 0, 1, VMMT_HANDOFF_AUTO);
    assert_vmmt_ok(vmmt_consumer_create(NULL, &a));
    assert_vmmt_ok(vmmt_consumer_create(NULL, &other));
    for (uint32_t i = 0; i < 60; i++) {
        struct racer r = {f, a, NULL, zero_two, 0, new_stream(), &start, 0};
        vmmt_desc d, next;
        pthread_t t;
        int st;

        publish_one(f, 300 + i, &d);
        put(f, f->dst, N, 99);
        put(f, f->src, N, 1000 + i);
        r.d = &d;
        pthread_barrier_init(&start, NULL, 2);
        pthread_create(&t, NULL, race, &r);
        pthread_barrier_wait(&start);
        if (cancel) {
            assert_vmmt_ok(vmmt_cancel(f->pool, &d));
            /* The only slice: taken only once no queued copy can read it. */
            st = vmmt_publish(f->pool, &b, f->stream, &next);
            if (st != VMMT_OK) assert_int_equal(st, VMMT_EFULL);
        } else {
            assert_vmmt_ok(vmmt_pool_release_rank(f->pool, 0));
            st = VMMT_EFULL;
        }
        pthread_join(t, NULL);
        pthread_barrier_destroy(&start);
        sync_on(r.s);
        sync_on(f->stream);
        if (r.status == VMMT_OK) {
            oks++;
            expect(f, f->dst, N, 300 + i);
            flush(a);
            assert_vmmt_ok(vmmt_consumer_check(a, &d));
        } else {
            assert_int_equal(r.status, VMMT_ESTATE);
            expect(f, f->dst, N, 99);
            if (!cancel) assert_vmmt_ok(ack_list(f, other, &d, f->stream, two, 1));
        }
        if (!cancel) assert_vmmt_ok(ack_list(f, other, &d, f->stream, rest, 2));
        sync_on(f->stream);
        flush(other);
        flush(a);
        if (cancel && st == VMMT_OK) {
            /* The next buffer got the slice: its own bytes, for every rank. */
            assert_vmmt_ok(vmmt_consume(other, &next, 0, f->dst + N, f->cap - N, f->stream,
                                        VMMT_ALL_RANKS, 0));
            sync_on(f->stream);
            expect(f, f->dst + N, N, 1000 + i);
            flush(other);
        }
        assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
        assert_int_equal(stats(f->pool).in_flight, 0);
        drop_stream(r.s);
    }
    print_message("%s: %d of 60 lists OK\n", cancel ? "cancel" : "release", oks);
    vmmt_consumer_destroy(other);
    vmmt_consumer_destroy(a);
}

static void test_race_list_against_cancel(void **state)
{
    race_list_against_producer(*state, 1);
}

static void test_race_list_against_release_rank(void **state)
{
    race_list_against_producer(*state, 0);
}

/*
 * A negative device is VMMT_ENODEV, as for every call that takes a device
 * (docs/design.md, "Public API rules", corrected after this test found it
 * promising VMMT_EINVAL), and nothing is taken.
 */
static void test_negative_device_is_enodev(void **state)
{
    struct fixture *f = *state;
    const int zero_two[] = {0, 2}, every[] = {0, 1, 2, 3};
    int consume_st, ack_st;
    vmmt_desc d;

    make_pool(f, 4, 0);
    publish_one(f, 69, &d);
    consume_st = vmmt_consume_ranks(f->consumer, &d, -1, f->dst, f->cap, f->stream, zero_two, 2);
    print_message("device -1: %d %s\n", consume_st, vmmt_last_error());
    ack_st = vmmt_consumer_ack_ranks(f->consumer, &d, -1, f->stream, zero_two, 2);
    assert_vmmt_ok(consume_list(f, f->consumer, &d, 0, f->stream, every, 4));
    sync_on(f->stream);
    expect(f, f->dst, N, 69);
    all_back(f);
    assert_int_equal(consume_st, VMMT_ENODEV);
    assert_int_equal(ack_st, VMMT_ENODEV);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_every_rank_as_a_list_is_all_ranks),
        T(test_lists_and_runs_overlapping),
        T(test_two_hundred_fifty_six_ranks),
        T(test_huge_and_negative_nranks),
        T(test_bad_destination_takes_nothing),
        T(test_packed_list_and_run_are_one_set),
        T(test_packed_two_disjoint_sets_interleaved),
        T(test_packed_list_refused_for_a_rank_done_elsewhere),
        T(test_lists_overlapping_by_one_rank_while_queued),
        T(test_race_lists_two_processes),
        T(test_race_lists_one_process),
        T(test_race_lists_one_process_device_table),
        T(test_cancel_under_a_queued_list),
        T(test_cancel_under_a_queued_packed_list),
        T(test_release_rank_of_a_listed_rank),
        T(test_failed_wait_of_a_list_is_retryable),
        T(test_ack_list_timeout_is_retryable),
        T(test_fabric_list_timeout_is_retryable),
        T(test_failed_copy_of_a_list_acknowledges_it_whole),
        T(test_own_queued_list_refuses_its_ranks),
        T(test_packed_set_mixes_consume_and_drop),
        T(test_device_table_pending_drop_holds_its_ranks),
        T(test_cancel_during_a_lists_wait),
        T(test_release_during_a_lists_wait),
        T(test_evict_refused_under_queued_lists),
        T(test_packed_list_member_on_another_stream),
        T(test_race_packed_lists_two_processes),
        T(test_race_list_against_cancel),
        T(test_race_list_against_release_rank),
        T(test_negative_device_is_enodev),
    };
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
