/*
 * An outside attacker's sequences against the version-2 control-table rules
 * (docs/descriptor.md "Generations", "What a reader must verify";
 * docs/design.md "Invariants"), written from the public surface and the docs
 * alone. A test named "finding" fails against the library as it is and says
 * what the docs promise instead; one named "holds" is a regression test for
 * an attack that was refused as documented.
 */
#include <limits.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "emu.h"
#include "pattern.h"
#include "poolfix.h"
#include "rawbroker.h"

#define N 4096

/* Field offsets of docs/descriptor.md, "Layout". */
#define OFF_TABLE_SLOTS  228
#define OFF_SLOT_STRIDE  248
#define OFF_SLOT         264
#define OFF_GENERATION   268
#define OFF_SLICE_OFFSET 272
#define OFF_OFFSET       288

static void sync_stream(struct fixture *f)
{
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
}

static void make_pool(struct fixture *f, int consumers, int device_table, vmmt_handoff handoff,
                      uint32_t slices)
{
    vmmt_pool_config c = config(4 * MiB, consumers);

    c.max_slices = slices;
    c.device_control_table = device_table;
    c.handoff = handoff;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
}

static int consume(struct fixture *f, vmmt_consumer *c, const vmmt_desc *d, int first, int count)
{
    return vmmt_consume(c, d, 0, f->dst, f->cap, f->stream, first, count);
}

/* Does dst hold n bytes of pattern i? */
static int holds(struct fixture *f, CUdeviceptr at, size_t n, uint32_t i)
{
    uint8_t *h = malloc(n);
    int ok;

    assert_non_null(h);
    assert_int_equal(vmmt__drv()->cuMemcpyDtoHAsync(h, at, n, f->stream), CUDA_SUCCESS);
    sync_stream(f);
    ok = tu_pattern_check(h, n, i) == n;
    free(h);
    return ok;
}

/* Publish two members of N bytes, patterns p0 and p1, packed into one slot. */
static void publish_pair(struct fixture *f, uint32_t p0, uint32_t p1, vmmt_desc out[2])
{
    vmmt_buffer b[2] = {bytes(f->src, N), bytes(f->src + N, N)};

    put(f, f->src, N, p0);
    put(f, f->src + N, N, p1);
    assert_vmmt_ok(vmmt_publish_packed(f->pool, b, 2, f->stream, out));
    sync_stream(f);
}

/*
 * The group's occupant has left (how: `how`): publish pattern 3 where the
 * group was, then consume member 1 in the consumer that read the occupant
 * for member 0. It must be refused; an OK copies the new publish's bytes.
 */
static void member_1_after_reuse(struct fixture *f, const vmmt_desc pair[2], const char *how)
{
    vmmt_buffer b = bytes(f->src, 2 * N);
    vmmt_desc next;
    int st;

    put(f, f->src, 2 * N, 3);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &next));
    sync_stream(f);
    assert_int_equal(tu_get64(&next, OFF_SLICE_OFFSET), tu_get64(&pair[0], OFF_SLICE_OFFSET));

    st = consume(f, f->consumer, &pair[1], VMMT_ALL_RANKS, 0);
    sync_stream(f);
    if (st == VMMT_OK && !holds(f, f->dst, N, 2))
        fail_msg("consume of a %s packed member returned VMMT_OK and copied another publish's "
                 "bytes",
                 how);
    assert_int_equal(st, VMMT_ESTATE);
    assert_vmmt_ok(consume(f, f->consumer, &next, VMMT_ALL_RANKS, 0));
    sync_stream(f);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

/*
 * The skip of a device table's row for a packed member of an occupant
 * already read (docs/descriptor.md, step 2) against a cancel.
 *
 * Sequence: device table; publish a packed pair (members p0, p1); consume
 * member 0; the producer cancels the group (vmmt_cancel on member 0: the
 * slot is RETIRED and the slice free); publish another buffer into the same
 * slice; consume member 1 in the same consumer.
 *
 * vmmt.h promises VMMT_ESTATE for "a descriptor whose slot no longer shows it
 * live (cancelled, recycled, ...)". The consumer trusts its own memory of the
 * occupant instead (Invariant 2 says occupancy is never read from a
 * process's own memory), so on a device table the consume says VMMT_OK and
 * the destination holds the later publish's bytes. A shared host table is
 * read every time: see the regression test below.
 */
static void packed_member_after_cancel(struct fixture *f, int device_table)
{
    vmmt_desc pair[2];

    make_pool(f, 1, device_table, VMMT_HANDOFF_AUTO, 4);
    publish_pair(f, 1, 2, pair);
    assert_vmmt_ok(consume(f, f->consumer, &pair[0], VMMT_ALL_RANKS, 0));
    sync_stream(f);
    assert_true(holds(f, f->dst, N, 1));

    assert_vmmt_ok(vmmt_cancel(f->pool, &pair[0]));
    if (!device_table) {
        /* A shared table's half group holds the slice until this consumer learns of the
         * cancel (docs/descriptor.md, "Acknowledgement words"): member 1 is refused, and
         * only then can the slice be reused. */
        assert_int_equal(vmmt_pool_drain(f->pool, 50), VMMT_ETIMEDOUT);
        assert_int_equal(consume(f, f->consumer, &pair[1], VMMT_ALL_RANKS, 0), VMMT_ESTATE);
        sync_stream(f);
    }
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    member_1_after_reuse(f, pair, "cancelled");
}

/* Finding: a device table's packed member survives its group's cancel. */
static void test_finding_packed_member_after_cancel_device_table(void **state)
{
    packed_member_after_cancel(*state, 1);
}

/* Holds: a shared host table is read for every member. */
static void test_holds_packed_member_after_cancel_host_table(void **state)
{
    packed_member_after_cancel(*state, 0);
}

/*
 * One rank; the fixture's consumer consumes member 0 of a packed pair, then
 * the group is finished by another party and its slice recycled (drained).
 * On a device table another consumer object consumes both members; on a
 * shared table that consumer is refused (the first one's consume took rank
 * 0's word, docs/descriptor.md "TAKEN"), so the producer releases the rank.
 */
static void half_then_other_finishes(struct fixture *f, int device_table, vmmt_desc pair[2])
{
    vmmt_consumer *other;

    make_pool(f, 1, device_table, VMMT_HANDOFF_AUTO, 4);
    publish_pair(f, 1, 2, pair);
    assert_vmmt_ok(consume(f, f->consumer, &pair[0], VMMT_ALL_RANKS, 0));
    sync_stream(f);
    assert_vmmt_ok(vmmt_consumer_create(NULL, &other));
    if (device_table) {
        assert_vmmt_ok(consume(f, other, &pair[0], VMMT_ALL_RANKS, 0));
        assert_vmmt_ok(consume(f, other, &pair[1], VMMT_ALL_RANKS, 0));
    } else {
        assert_int_equal(consume(f, other, &pair[0], VMMT_ALL_RANKS, 0), VMMT_ESTATE);
        assert_int_equal(consume(f, other, &pair[1], VMMT_ALL_RANKS, 0), VMMT_ESTATE);
        assert_vmmt_ok(vmmt_pool_release_rank(f->pool, 0));
    }
    sync_stream(f);
    vmmt_consumer_destroy(other);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

/*
 * The same skip against another consumer object (a restarted process of the
 * same rank, or one of two consumer objects) that finished the group.
 *
 * Sequence: one consumer rank; consumer A consumes member 0; consumer B
 * consumes members 0 and 1 (the group is acknowledged and recycled); a new
 * publish takes the slice; A consumes member 1.
 *
 * vmmt.h: a descriptor "that any of the ranks asked for has already consumed
 * or acknowledged, in this process or any other, is VMMT_ESTATE"; Invariant
 * 1 names "acked_by_another". A device table gives VMMT_OK with the later
 * publish's bytes.
 */
static void packed_member_after_other_acked(struct fixture *f, int device_table)
{
    vmmt_desc pair[2];

    half_then_other_finishes(f, device_table, pair);
    member_1_after_reuse(f, pair, "recycled");
}

static void test_finding_packed_member_after_other_acked_device_table(void **state)
{
    packed_member_after_other_acked(*state, 1);
}

static void test_holds_packed_member_after_other_acked_host_table(void **state)
{
    packed_member_after_other_acked(*state, 0);
}

/*
 * After another consumer finished a group that this one half consumed, the
 * half group names an occupant that has left, and nothing can complete it.
 *
 * Sequence (shared host table): consumer A consumes member 0; consumer B
 * consumes both (the group is acknowledged and recycled); A's consume of
 * member 1 is refused (VMMT_ESTATE, right); A evicts the pool.
 *
 * vmmt.h: evict is VMMT_ESTATE only while "a packed group of it is half
 * consumed", and max_pools lets go of idle pools. What happens: evict is
 * refused for ever ("1 packed group(s) are partly consumed ... consume or
 * acknowledge their other members first"), though consuming or
 * acknowledging the other member is refused too: the pool stays mapped
 * until vmmt_consumer_destroy, and the LRU never lets it go. (On a device
 * table A's consume of member 1 is wrongly accepted instead, see
 * test_finding_packed_member_after_other_acked_device_table.)
 */
static void half_group_then_evict(struct fixture *f, int device_table)
{
    vmmt_desc pair[2];
    vmmt_desc_info in;

    half_then_other_finishes(f, device_table, pair);
    assert_vmmt_ok(vmmt_desc_inspect(&pair[0], &in));
    /* A learns that the occupant left when it tries the rest of the group. */
    assert_int_not_equal(consume(f, f->consumer, &pair[1], VMMT_ALL_RANKS, 0), VMMT_OK);
    assert_int_not_equal(vmmt_consumer_ack(f->consumer, &pair[1], 0, f->stream, VMMT_ALL_RANKS, 0),
                         VMMT_OK);
    sync_stream(f);
    assert_vmmt_ok(vmmt_consumer_evict(f->consumer, in.pool_id, 0));
    assert_int_equal(vmmt_consumer_pool_count(f->consumer), 0);
}

static void test_finding_half_group_never_evicted_host_table(void **state)
{
    half_group_then_evict(*state, 0);
}

/*
 * A packed group whose members are consumed for different rank ranges.
 * Every rank consumed every member, so the slice must come back
 * (docs/descriptor.md step 5: "a packed group is acknowledged once, after
 * its last member, per rank range").
 *
 * Sequence A: two ranks; member 0 for all ranks; member 1 for rank 0, then
 * for rank 1. Sequence B: member 0 for rank 0, then rank 1; member 1 for all.
 *
 * What happens: every consume is VMMT_OK with the right bytes, but no rank
 * is ever acknowledged: the slice stays in flight for ever (drain times
 * out). Progress is kept per exact (first, count) range, so the only way
 * out is to consume a member a second time for a rank that already has it
 * (see test_finding_packed_member_twice_other_range). Either the split must
 * be refused up front (before anything is recorded, as a member on another
 * stream is) or acknowledged per rank; the docs say neither.
 */
static void packed_split_ranks(struct fixture *f, int device_table, int all_first)
{
    vmmt_desc pair[2];

    make_pool(f, 2, device_table, VMMT_HANDOFF_AUTO, 4);
    publish_pair(f, 1, 2, pair);
    /* Fixed by refusing the mixed range (VMMT_EINVAL, nothing recorded): every
     * member of a group is consumed for the same ranks, and the group completes. */
    if (all_first) {
        assert_vmmt_ok(consume(f, f->consumer, &pair[0], VMMT_ALL_RANKS, 0));
        assert_int_equal(consume(f, f->consumer, &pair[1], 0, 1), VMMT_EINVAL);
        assert_error_contains("for the same ranks");
        assert_vmmt_ok(consume(f, f->consumer, &pair[1], VMMT_ALL_RANKS, 0));
    } else {
        assert_vmmt_ok(consume(f, f->consumer, &pair[0], 0, 1));
        assert_vmmt_ok(consume(f, f->consumer, &pair[0], 1, 1));
        assert_int_equal(consume(f, f->consumer, &pair[1], VMMT_ALL_RANKS, 0), VMMT_EINVAL);
        assert_vmmt_ok(consume(f, f->consumer, &pair[1], 0, 1));
        assert_vmmt_ok(consume(f, f->consumer, &pair[1], 1, 1));
    }
    sync_stream(f);
    assert_true(holds(f, f->dst, N, 2));
    /* Each rank consumed each member: the slice is free once acknowledged. */
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 3000));
}

/* Finding: sequence A on a shared host table leaves the slice in flight for ever. */
static void test_finding_packed_split_ranks_leaks_host_table(void **state)
{
    packed_split_ranks(*state, 0, 1);
}

/* Finding: sequence B on a device table, the same. */
static void test_finding_packed_split_ranks_leaks_device_table(void **state)
{
    packed_split_ranks(*state, 1, 0);
}

/*
 * A packed member consumed twice for the same rank, under another rank
 * range. vmmt.h: a descriptor "that any of the ranks asked for has already
 * consumed or acknowledged, in this process or any other, is VMMT_ESTATE";
 * design.md "Consumer rules": consuming a descriptor twice is VMMT_ESTATE.
 *
 * Sequence: two ranks; member 0 for all ranks; member 0 again for rank 0.
 * What happens: VMMT_OK (a second copy for rank 0).
 */
static void packed_member_twice_other_range(struct fixture *f, int device_table)
{
    vmmt_desc pair[2];
    int st;

    make_pool(f, 2, device_table, VMMT_HANDOFF_AUTO, 4);
    publish_pair(f, 1, 2, pair);
    assert_vmmt_ok(consume(f, f->consumer, &pair[0], VMMT_ALL_RANKS, 0));
    st = consume(f, f->consumer, &pair[0], 0, 1);
    sync_stream(f);
    assert_vmmt_ok(consume(f, f->consumer, &pair[1], VMMT_ALL_RANKS, 0));
    sync_stream(f);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_int_equal(st, VMMT_ESTATE);
}

static void test_finding_packed_member_twice_other_range_host_table(void **state)
{
    packed_member_twice_other_range(*state, 0);
}

static void test_finding_packed_member_twice_other_range_device_table(void **state)
{
    packed_member_twice_other_range(*state, 1);
}

/*
 * A descriptor's slot field moved to another live slot. Every slot's first
 * occupant is generation 5, so (slot, generation) of one publish names a
 * live occupant of another slot, and nothing in the table ties a row to
 * the slice the descriptor names.
 *
 * Sequence: one rank; publish A (slot a) and B (slot b), both generation 5;
 * consume A; reclaim; publish C, which takes A's slice; a descriptor that is
 * A's with the slot field (offset 264) set to b is consumed.
 *
 * vmmt.h: a forged descriptor is VMMT_ESTATE and nothing is written. What
 * happens: VMMT_OK, the destination holds C's bytes (not A's), and B's slot
 * is acknowledged on A's behalf, so B is recycled and its real consumer is
 * refused.
 */
static void slot_moved(struct fixture *f, int device_table)
{
    vmmt_buffer b = bytes(f->src, N);
    vmmt_desc a, bb, c, forged;
    int st, genuine;

    make_pool(f, 1, device_table, VMMT_HANDOFF_AUTO, 8);
    put(f, f->src, N, 1);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &a));
    put(f, f->src, N, 2);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &bb));
    sync_stream(f);
    assert_int_not_equal(tu_get32(&a, OFF_SLOT), tu_get32(&bb, OFF_SLOT));
    /* Fixed: one generation counter per pool, so A's generation is not B's (it was 5
     * for both), and the moved descriptor names nobody in B's slot. */
    assert_int_not_equal(tu_get32(&a, OFF_GENERATION), tu_get32(&bb, OFF_GENERATION));
    assert_vmmt_ok(consume(f, f->consumer, &a, VMMT_ALL_RANKS, 0));
    sync_stream(f);
    sleep_ms(20);
    assert_vmmt_ok(vmmt_pool_reclaim(f->pool, NULL));
    assert_int_equal(stats(f->pool).in_flight, 1);
    put(f, f->src, N, 3);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &c));
    sync_stream(f);
    assert_int_equal(tu_get64(&c, OFF_OFFSET), tu_get64(&a, OFF_OFFSET));

    forged = a;
    tu_put32(&forged, OFF_SLOT, tu_get32(&bb, OFF_SLOT));
    reseal(f->pool, &forged); /* by a key holder: the seal alone refuses any other forger */
    assert_vmmt_ok(vmmt_desc_inspect(&forged, &(vmmt_desc_info){0}));
    st = consume(f, f->consumer, &forged, VMMT_ALL_RANKS, 0);
    sync_stream(f);
    sleep_ms(20);
    vmmt_pool_reclaim(f->pool, NULL);
    genuine = consume(f, f->consumer, &bb, VMMT_ALL_RANKS, 0);
    sync_stream(f);
    if (st == VMMT_OK)
        fail_msg("a descriptor with its slot moved to another live slot: consume OK (dst holds "
                 "publish A's bytes: %d, publish C's: %d), then B's own consume: %d",
                 holds(f, f->dst, N, 1), holds(f, f->dst, N, 3), genuine);
    assert_int_equal(genuine, VMMT_OK);
    assert_vmmt_ok(consume(f, f->consumer, &c, VMMT_ALL_RANKS, 0));
    sync_stream(f);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

static void test_finding_slot_moved_host_table(void **state)
{
    slot_moved(*state, 0);
}

static void test_finding_slot_moved_device_table(void **state)
{
    slot_moved(*state, 1);
}

/*
 * Rank arguments that overflow int: rank_first + rank_count wraps. Holds if
 * refused with VMMT_EINVAL and nothing recorded (the real consume after it
 * succeeds).
 */
static void test_holds_rank_range_overflow(void **state)
{
    struct fixture *f = *state;
    vmmt_buffer b = bytes(f->src, N);
    vmmt_desc d;

    make_pool(f, 2, 0, VMMT_HANDOFF_AUTO, 4);
    put(f, f->src, N, 7);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    assert_int_equal(consume(f, f->consumer, &d, 1, INT_MAX), VMMT_EINVAL);
    assert_int_equal(consume(f, f->consumer, &d, INT_MAX, 2), VMMT_EINVAL);
    assert_int_equal(consume(f, f->consumer, &d, 0, 0), VMMT_EINVAL);
    assert_int_equal(consume(f, f->consumer, &d, -2, 1), VMMT_EINVAL);
    assert_int_equal(vmmt_consumer_ack(f->consumer, &d, 0, f->stream, 1, INT_MAX), VMMT_EINVAL);
    assert_vmmt_ok(consume(f, f->consumer, &d, VMMT_ALL_RANKS, 0));
    sync_stream(f);
    assert_true(holds(f, f->dst, N, 7));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

/*
 * docs/broker.md twice says the control table memfd is "table_slots x
 * slot_stride bytes rounded up to whole pages (4096)" (the table of what a
 * consumer is handed, and the client's check after the fetch), and that a
 * client refuses any other size. docs/descriptor.md says the memfd holds the
 * rows, the incarnation words, then a 16-byte geometry record, rounded up.
 * With 256 slots of 16 bytes (one page of rows exactly) the two differ: a
 * client written from broker.md refuses every such pool's table.
 */
static void test_finding_broker_doc_table_size(void **state)
{
    struct fixture *f = *state;
    vmmt_buffer b = bytes(f->src, N);
    vmmt_desc d;
    struct stat sb;
    int fds[2], n;
    uint64_t rows;

    make_pool(f, 1, 0, VMMT_HANDOFF_AUTO, 256);
    put(f, f->src, N, 1);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    sync_stream(f);
    rows = (uint64_t)tu_get32(&d, OFF_TABLE_SLOTS) * tu_get32(&d, OFF_SLOT_STRIDE);
    assert_int_equal(tu_raw_fetch(&d, fds, &n), VMMT_OK);
    assert_int_equal(n, 2);
    assert_int_equal(fstat(fds[1], &sb), 0);
    close(fds[0]);
    close(fds[1]);
    assert_vmmt_ok(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    sync_stream(f);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    /* Fixed in the docs: the 64-byte pool record, then the rows, in whole pages. */
    if ((uint64_t)sb.st_size != (64 + rows + 4095) / 4096 * 4096)
        fail_msg("descriptor.md: table memfd is 64 + rows (%llu) rounded up to pages; "
                 "the broker sent %lld bytes",
                 (unsigned long long)rows, (long long)sb.st_size);
}

/*
 * docs/descriptor.md: the pool record opens every control table, before the
 * rows: "POOL", table_slots, slot_stride, consumer_count, ... Holds if it is
 * at the memfd's offset 0, where an independent reader looks for it.
 */
static void test_holds_pool_record_first(void **state)
{
    struct fixture *f = *state;
    vmmt_buffer b = bytes(f->src, N);
    vmmt_desc d;
    struct stat sb;
    int fds[2], n;
    uint64_t rows;
    uint8_t *m;
    uint32_t w[3];

    make_pool(f, 3, 0, VMMT_HANDOFF_AUTO, 100);
    put(f, f->src, N, 1);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    sync_stream(f);
    rows = (uint64_t)tu_get32(&d, OFF_TABLE_SLOTS) * tu_get32(&d, OFF_SLOT_STRIDE);
    assert_int_equal(tu_raw_fetch(&d, fds, &n), VMMT_OK);
    assert_int_equal(n, 2);
    close(fds[0]);
    assert_int_equal(fstat(fds[1], &sb), 0);
    assert_true((uint64_t)sb.st_size >= 64 + rows);
    m = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_SHARED, fds[1], 0);
    assert_true(m != MAP_FAILED);
    close(fds[1]);
    int at = memcmp(m, "POOL", 4) == 0;
    memcpy(w, m + 4, sizeof w);
    munmap(m, (size_t)sb.st_size);
    assert_vmmt_ok(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    sync_stream(f);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_true(at);
    assert_int_equal(w[0], tu_get32(&d, OFF_TABLE_SLOTS));
    assert_int_equal(w[1], tu_get32(&d, OFF_SLOT_STRIDE));
    assert_int_equal(w[2], 3);
    /* "slot_stride = 4 * (1 + consumer_count) rounded up to 16". */
    assert_int_equal(w[1], 16);
}

/*
 * The decoder refuses table_slots above 2^20 (docs/descriptor.md), and "no
 * descriptor is ever handed out that a reader refuses". Holds if a pool asked
 * for more slices either is refused at creation or hands out descriptors
 * that vmmt_desc_inspect accepts and a consumer consumes.
 */
static void test_holds_max_slices_above_decoder_bound(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b = bytes(f->src, N);
    vmmt_desc d;
    vmmt_desc_info in;

    c.max_slices = (1u << 20) + 1;
    if (vmmt_pool_create(&c, &f->pool) != VMMT_OK) return;
    put(f, f->src, N, 1);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    sync_stream(f);
    assert_vmmt_ok(vmmt_desc_inspect(&d, &in));
    assert_vmmt_ok(consume(f, f->consumer, &d, VMMT_ALL_RANKS, 0));
    sync_stream(f);
    assert_true(holds(f, f->dst, N, 1));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

/* A zero-byte publish: consumed or refused, it never leaves a slice in flight. */
static void test_holds_zero_byte_publish(void **state)
{
    struct fixture *f = *state;
    vmmt_buffer b = bytes(f->src, 0);
    vmmt_desc d;

    make_pool(f, 1, 0, VMMT_HANDOFF_AUTO, 4);
    if (vmmt_publish(f->pool, &b, f->stream, &d) == VMMT_OK) {
        sync_stream(f);
        assert_vmmt_ok(consume(f, f->consumer, &d, VMMT_ALL_RANKS, 0));
        sync_stream(f);
    }
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_int_equal(stats(f->pool).in_flight, 0);
}

/*
 * Packed members: a dropped member is not consumed afterwards, a member on
 * another stream is refused before anything is recorded, and a too-small
 * destination records nothing; the group still finishes and the slice comes
 * back, on both tables.
 */
static void packed_misuse(struct fixture *f, int device_table)
{
    vmmt_desc pair[2];
    CUstream other;

    make_pool(f, 1, device_table, VMMT_HANDOFF_AUTO, 4);
    publish_pair(f, 1, 2, pair);
    assert_vmmt_ok(vmmt_consumer_ack(f->consumer, &pair[0], 0, f->stream, VMMT_ALL_RANKS, 0));
    assert_int_equal(consume(f, f->consumer, &pair[0], VMMT_ALL_RANKS, 0), VMMT_ESTATE);
    assert_int_equal(vmmt__drv()->cuStreamCreate(&other, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
    assert_int_not_equal(
        vmmt_consume(f->consumer, &pair[1], 0, f->dst, f->cap, other, VMMT_ALL_RANKS, 0), VMMT_OK);
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(other), CUDA_SUCCESS);
    assert_int_equal(vmmt__drv()->cuStreamDestroy(other), CUDA_SUCCESS);
    assert_int_equal(
        vmmt_consume(f->consumer, &pair[1], 0, f->dst, N - 1, f->stream, VMMT_ALL_RANKS, 0),
        VMMT_EINVAL);
    assert_vmmt_ok(consume(f, f->consumer, &pair[1], VMMT_ALL_RANKS, 0));
    sync_stream(f);
    assert_true(holds(f, f->dst, N, 2));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

static void test_holds_packed_misuse_host_table(void **state)
{
    packed_misuse(*state, 0);
}

static void test_holds_packed_misuse_device_table(void **state)
{
    packed_misuse(*state, 1);
}

/*
 * Negative consumer settings. design.md "Public API rules": every function
 * checks "negative devices and timeouts" and answers VMMT_EINVAL with a
 * message. What happens: timeout_ms = -1 is accepted and silently means the
 * default (a vmmt_consumer_ack of a pending slot gave up after 5000 ms).
 */
static void test_finding_consumer_negative_timeout(void **state)
{
    vmmt_consumer_config cc;
    vmmt_consumer *c = NULL;
    int st;

    (void)state;
    vmmt_consumer_config_init(&cc);
    cc.timeout_ms = -1;
    st = vmmt_consumer_create(&cc, &c);
    vmmt_consumer_destroy(c);
    assert_int_equal(st, VMMT_EINVAL);
}

/* max_pools = -1: accepted too, meaning undocumented (vmmt.h: "0: no limit"). */
static void test_finding_consumer_negative_max_pools(void **state)
{
    vmmt_consumer_config cc;
    vmmt_consumer *c = NULL;
    int st;

    (void)state;
    vmmt_consumer_config_init(&cc);
    cc.max_pools = -1;
    st = vmmt_consumer_create(&cc, &c);
    vmmt_consumer_destroy(c);
    assert_int_equal(st, VMMT_EINVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_finding_packed_member_after_cancel_device_table),
        T(test_holds_packed_member_after_cancel_host_table),
        T(test_finding_packed_member_after_other_acked_device_table),
        T(test_holds_packed_member_after_other_acked_host_table),
        T(test_finding_half_group_never_evicted_host_table),
        T(test_finding_packed_split_ranks_leaks_host_table),
        T(test_finding_packed_split_ranks_leaks_device_table),
        T(test_finding_packed_member_twice_other_range_host_table),
        T(test_finding_packed_member_twice_other_range_device_table),
        T(test_finding_slot_moved_host_table),
        T(test_finding_slot_moved_device_table),
        T(test_holds_rank_range_overflow),
        T(test_finding_broker_doc_table_size),
        T(test_holds_pool_record_first),
        T(test_holds_max_slices_above_decoder_bound),
        T(test_holds_zero_byte_publish),
        T(test_holds_packed_misuse_host_table),
        T(test_holds_packed_misuse_device_table),
        T(test_finding_consumer_negative_timeout),
        T(test_finding_consumer_negative_max_pools),
    };
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
