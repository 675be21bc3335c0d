/*
 * vmmt_cancel of a descriptor that a consumer process has already taken in a
 * shared host table (its rank's acknowledgement word TAKEN, its copy still
 * queued behind other work): the cancel must not free the slice under that
 * copy. Before, it wrote the generation over the TAKEN word, the recycler
 * freed the slice at once, the next publish took it and the queued copy read
 * that buffer; vmmt_consume had said OK, and vmmt.sglang's rebuild, which
 * never calls vmmt_consumer_check, returned the other tensor (an outside
 * attack, python/tests/test_attack_sglang_flush.py). Now such a word becomes
 * "cancelled while taken" (docs/descriptor.md, "Acknowledgement words"):
 * refused by every take, the taker's own packed members included, and
 * handed to the cancel by the taker's acknowledgement or give-back, or by a
 * release of the rank.
 *
 * A host pool's consumer copy is queued on the consumer's stream as a device
 * pool's is (VMMT_TEST_POOL_KIND=host runs these on one).
 */
#include <stdlib.h>
#include <string.h>

#include "emu.h"
#include "pool_internal.h"
#include "poolfix.h"

#define N 4096

/* A shared-table pool of one slice, so that the next publish would take the cancelled one's. */
static void make_pool(struct fixture *f, int consumers)
{
    vmmt_pool_config c = config(4 * MiB, consumers);

    c.max_slices = 1;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
}

/* The slice is still held: reclaiming frees nothing and a publish finds no room. */
static void slice_held(struct fixture *f)
{
    vmmt_buffer b = bytes(f->src, N);
    uint32_t freed = 1;
    vmmt_desc next;

    assert_vmmt_ok(vmmt_pool_reclaim(f->pool, &freed));
    assert_int_equal(freed, 0);
    assert_int_equal(vmmt_publish(f->pool, &b, f->stream, &next), VMMT_EFULL);
}

/* The slice came back: a publish takes it, and its bytes are consumed right. */
static void slice_back(struct fixture *f, uint32_t pattern)
{
    vmmt_buffer b = bytes(f->src, N);
    vmmt_desc next;

    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_int_equal(stats(f->pool).in_flight, 0);
    put(f, f->src, N, pattern);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &next));
    assert_vmmt_ok(
        vmmt_consume(f->consumer, &next, 0, f->dst + N, f->cap - N, f->stream, VMMT_ALL_RANKS, 0));
    sync_on(f->stream);
    expect(f, f->dst + N, N, pattern);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

/*
 * A packed pair of pattern i whose first member's copy is queued on `first`
 * behind gate g (closed here) when the producer cancels it; the taker's
 * next member is then refused, which gives the group's words back after
 * the copies already on `first`.
 */
static void cancel_half_group(struct fixture *f, uint32_t i, CUstream first, struct gate *g,
                              vmmt_desc pair[2])
{
    vmmt_buffer b[2] = {bytes(f->src, N), bytes(f->src + N, N)};

    put(f, f->src, 2 * N, i);
    assert_vmmt_ok(vmmt_publish_packed(f->pool, b, 2, f->stream, pair));
    sync_on(f->stream);
    gate_close(g, first);
    assert_vmmt_ok(vmmt_consume(f->consumer, &pair[0], 0, f->dst, f->cap, first, 0, 1));
    assert_vmmt_ok(vmmt_cancel(f->pool, &pair[0]));
    assert_int_equal(vmmt_consume(f->consumer, &pair[1], 0, f->dst + N, f->cap - N, first, 0, 1),
                     VMMT_ESTATE);
}

/*
 * Rank 0's copy is queued behind a gate when the producer cancels: the other
 * rank and another process of rank 0 are refused, the slice stays held, and
 * once the gate opens the copy holds its own bytes, checked OK; then the
 * slice comes back.
 */
static void test_cancel_leaves_a_queued_copy_its_slice(void **state)
{
    struct fixture *f = *state;
    vmmt_buffer b = bytes(f->src, N);
    vmmt_consumer *other;
    CUstream first;
    struct gate g;
    vmmt_desc d;

    make_pool(f, 2);
    assert_vmmt_ok(vmmt_consumer_create(NULL, &other));
    first = new_stream();
    put(f, f->src, N, 21);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    sync_on(f->stream);
    gate_close(&g, first);
    assert_vmmt_ok(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, first, 0, 1));
    assert_vmmt_ok(vmmt_cancel(f->pool, &d));
    assert_int_equal(vmmt_consume(other, &d, 0, f->dst + N, f->cap - N, f->stream, 0, 1),
                     VMMT_ESTATE);
    assert_int_equal(vmmt_consume(other, &d, 0, f->dst + N, f->cap - N, f->stream, 1, 1),
                     VMMT_ESTATE);
    slice_held(f);
    gate_open_later(&g, 0);
    gate_free(&g);
    sync_on(first);
    expect(f, f->dst, N, 21);
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    assert_vmmt_ok(vmmt_consumer_check(f->consumer, &d));
    slice_back(f, 22);
    assert_int_equal(vmmt__drv()->cuStreamDestroy(first), CUDA_SUCCESS);
    vmmt_consumer_destroy(other);
}

/*
 * The same for a packed group whose first member's copy is queued: the
 * taker's own next member is refused (the group was cancelled), and that
 * refusal gives the group's words to the cancel only after the copies
 * queued on the group's stream, so the first member keeps its bytes.
 */
static void test_packed_cancel_leaves_queued_members_their_slice(void **state)
{
    struct fixture *f = *state;
    vmmt_consumer *other;
    vmmt_desc pair[2];
    CUstream first;
    struct gate g;

    make_pool(f, 2);
    assert_vmmt_ok(vmmt_consumer_create(NULL, &other));
    first = new_stream();
    cancel_half_group(f, 23, first, &g, pair);
    assert_int_equal(vmmt_consume(other, &pair[0], 0, f->dst + N, f->cap - N, f->stream, 0, 1),
                     VMMT_ESTATE);
    assert_int_equal(vmmt_consume(other, &pair[1], 0, f->dst + N, f->cap - N, f->stream, 1, 1),
                     VMMT_ESTATE);
    slice_held(f);
    gate_open_later(&g, 0);
    gate_free(&g);
    sync_on(first);
    expect(f, f->dst, N, 23);
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    assert_vmmt_ok(vmmt_consumer_check(f->consumer, &pair[0]));
    slice_back(f, 24);
    assert_int_equal(vmmt__drv()->cuStreamDestroy(first), CUDA_SUCCESS);
    vmmt_consumer_destroy(other);
}

/*
 * A packed group half consumed, its copy done, then cancelled: the slice is
 * the consumer's until it learns of the cancel (its next member is refused),
 * since the producer cannot tell a finished copy from a queued one. Then it
 * comes back, and the pool can be evicted.
 */
static void test_packed_cancel_half_group_holds_until_refused(void **state)
{
    struct fixture *f = *state;
    vmmt_buffer b[2] = {bytes(f->src, N), bytes(f->src + N, N)};
    vmmt_desc pair[2];
    vmmt_desc_info in;

    make_pool(f, 1);
    put(f, f->src, 2 * N, 25);
    assert_vmmt_ok(vmmt_publish_packed(f->pool, b, 2, f->stream, pair));
    assert_vmmt_ok(
        vmmt_consume(f->consumer, &pair[0], 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    sync_on(f->stream);
    assert_vmmt_ok(vmmt_cancel(f->pool, &pair[1]));
    assert_int_equal(vmmt_pool_drain(f->pool, 50), VMMT_ETIMEDOUT);
    assert_int_equal(vmmt_consume(f->consumer, &pair[1], 0, f->dst + N, f->cap - N, f->stream,
                                  VMMT_ALL_RANKS, 0),
                     VMMT_ESTATE);
    sync_on(f->stream);
    expect(f, f->dst, N, 25);
    assert_vmmt_ok(vmmt_desc_inspect(&pair[0], &in));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_vmmt_ok(vmmt_consumer_evict(f->consumer, in.pool_id, 0));
    slice_back(f, 26);
}

/*
 * The engine releases the rank whose copy is queued under a cancel: that
 * was its call to make (vmmt.h), so the slice comes back at once, and the
 * queued copy's check then says it may have read another buffer.
 */
static void test_release_rank_gives_a_cancelled_taken_slice_back(void **state)
{
    struct fixture *f = *state;
    vmmt_buffer b = bytes(f->src, N);
    CUstream first;
    struct gate g;
    vmmt_desc d;

    make_pool(f, 1);
    first = new_stream();
    put(f, f->src, N, 27);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    sync_on(f->stream);
    gate_close(&g, first);
    assert_vmmt_ok(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, first, VMMT_ALL_RANKS, 0));
    assert_vmmt_ok(vmmt_cancel(f->pool, &d));
    slice_held(f);
    assert_vmmt_ok(vmmt_pool_release_rank(f->pool, 0));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    gate_open_later(&g, 0);
    gate_free(&g);
    sync_on(first);
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    assert_int_equal(vmmt_consumer_check(f->consumer, &d), VMMT_EFAILED);
    slice_back(f, 28);
    assert_int_equal(vmmt__drv()->cuStreamDestroy(first), CUDA_SUCCESS);
}

/*
 * A packed group half consumed behind a gate, cancelled, its next member
 * refused (its words go back once the group's copies are done), then the
 * rank released: the slice comes back at once and the next publish takes
 * it, slot and all, under the queued copy. The copy's check must say so
 * (the model test, op_cancel_taken with a release while the copies are
 * held: the give-back found the slot moved on and said nothing, so check
 * said OK for another buffer's bytes).
 */
static void test_release_under_a_refused_half_group(void **state)
{
    struct fixture *f = *state;
    vmmt_buffer one = bytes(f->src, N);
    vmmt_desc pair[2], next;
    CUstream first;
    struct gate g;

    make_pool(f, 1);
    first = new_stream();
    cancel_half_group(f, 29, first, &g, pair);
    slice_held(f);
    assert_vmmt_ok(vmmt_pool_release_rank(f->pool, 0));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    put(f, f->src, N, 30);
    assert_vmmt_ok(vmmt_publish(f->pool, &one, f->stream, &next));
    sync_on(f->stream);
    gate_open_later(&g, 0);
    gate_free(&g);
    sync_on(first);
    expect(f, f->dst, N, 30); /* the queued copy read the next buffer */
    assert_int_equal(vmmt_consumer_check(f->consumer, &pair[0]), VMMT_EFAILED);
    assert_vmmt_ok(
        vmmt_consume(f->consumer, &next, 0, f->dst + N, f->cap - N, f->stream, VMMT_ALL_RANKS, 0));
    sync_on(f->stream);
    expect(f, f->dst + N, N, 30);
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_int_equal(vmmt__drv()->cuStreamDestroy(first), CUDA_SUCCESS);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_cancel_leaves_a_queued_copy_its_slice),
        T(test_packed_cancel_leaves_queued_members_their_slice),
        T(test_packed_cancel_half_group_holds_until_refused),
        T(test_release_rank_gives_a_cancelled_taken_slice_back),
        T(test_release_under_a_refused_half_group),
    };
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
