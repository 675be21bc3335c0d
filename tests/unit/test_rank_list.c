/*
 * vmmt_consume_ranks and vmmt_consumer_ack_ranks: one call for a list of
 * ranks, all or nothing. Before these, a process acknowledging for ranks
 * that are not consecutive (vmmt.sglang's acknowledge_ranks) called once
 * per run of them, and a refusal of a later run left the earlier runs
 * acknowledged, or a rank's copy consumed and thrown away (an outside
 * attack, python/tests/test_attack_sglang_flush.py, finding 3).
 */
#include <string.h>

#include "emu.h"
#include "poolfix.h"

#define N 4096

static void publish_one(struct fixture *f, uint32_t pattern, vmmt_desc *d)
{
    vmmt_buffer b = bytes(f->src, N);

    put(f, f->src, N, pattern);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, d));
    sync_on(f->stream);
}

static void make_pool(struct fixture *f, int consumers, int device_table)
{
    vmmt_pool_config c = config(4 * MiB, consumers);

    c.device_control_table = device_table && !pool_kind_host() && !pool_kind_elastic();
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
}

/* Every slice came back. */
static void all_back(struct fixture *f)
{
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_int_equal(stats(f->pool).in_flight, 0);
}

/* The slice is still out: not every rank acknowledged it. */
static void still_out(struct fixture *f)
{
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    assert_int_equal(vmmt_pool_drain(f->pool, 20), VMMT_ETIMEDOUT);
}

/* The last ranks acknowledge: every slice comes back, and the pool goes for the next round. */
static void finish(struct fixture *f, const vmmt_desc *d, const int *rest, int n)
{
    assert_vmmt_ok(vmmt_consumer_ack_ranks(f->consumer, d, 0, f->stream, rest, n));
    sync_on(f->stream);
    all_back(f);
    vmmt_pool_destroy(f->pool);
    f->pool = NULL;
}

/* An acknowledgement for {0, 2}, rank 2 done already, leaves rank 0 as it was. */
static void test_ack_list_refused_whole(void **state)
{
    struct fixture *f = *state;
    const int two[] = {2}, zero_two[] = {0, 2}, zero[] = {0}, rest[] = {3, 1};
    vmmt_desc d;

    for (int table = 0; table < 2; table++) {
        make_pool(f, 4, table);
        publish_one(f, 31, &d);
        assert_vmmt_ok(vmmt_consumer_ack_ranks(f->consumer, &d, 0, f->stream, two, 1));
        sync_on(f->stream);
        assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
        assert_int_equal(vmmt_consumer_ack_ranks(f->consumer, &d, 0, f->stream, zero_two, 2),
                         VMMT_ESTATE);
        assert_non_null(strstr(vmmt_last_error(), "rank 2"));
        assert_vmmt_ok(vmmt_consumer_ack_ranks(f->consumer, &d, 0, f->stream, zero, 1));
        still_out(f);
        finish(f, &d, rest, 2);
    }
}

/* A consume for {0, 3}, rank 3 done already, copies nothing; rank 0 may consume after. */
static void test_consume_list_refused_whole(void **state)
{
    struct fixture *f = *state;
    const int three[] = {3}, zero_three[] = {0, 3}, zero[] = {0}, rest[] = {1, 2};
    vmmt_desc d;

    for (int table = 0; table < 2; table++) {
        make_pool(f, 4, table);
        publish_one(f, 32, &d);
        put(f, f->dst, N, 99);
        assert_vmmt_ok(vmmt_consumer_ack_ranks(f->consumer, &d, 0, f->stream, three, 1));
        sync_on(f->stream);
        assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
        assert_int_equal(
            vmmt_consume_ranks(f->consumer, &d, 0, f->dst, f->cap, f->stream, zero_three, 2),
            VMMT_ESTATE);
        sync_on(f->stream);
        expect(f, f->dst, N, 99); /* nothing copied */
        assert_vmmt_ok(vmmt_consume_ranks(f->consumer, &d, 0, f->dst, f->cap, f->stream, zero, 1));
        sync_on(f->stream);
        expect(f, f->dst, N, 32);
        assert_vmmt_ok(vmmt_consumer_check(f->consumer, &d));
        still_out(f);
        finish(f, &d, rest, 2);
    }
}

/* One copy for ranks {3, 1} in any order acknowledges both; each is refused after. */
static void test_consume_list_acknowledges_every_rank(void **state)
{
    struct fixture *f = *state;
    const int three_one[] = {3, 1}, one[] = {1}, three[] = {3}, zero_two[] = {2, 0};
    vmmt_desc d;

    for (int table = 0; table < 2; table++) {
        make_pool(f, 4, table);
        publish_one(f, 33, &d);
        assert_vmmt_ok(
            vmmt_consume_ranks(f->consumer, &d, 0, f->dst, f->cap, f->stream, three_one, 2));
        sync_on(f->stream);
        expect(f, f->dst, N, 33);
        assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
        assert_int_equal(vmmt_consume_ranks(f->consumer, &d, 0, f->dst, f->cap, f->stream, one, 1),
                         VMMT_ESTATE);
        assert_int_equal(vmmt_consumer_ack_ranks(f->consumer, &d, 0, f->stream, three, 1),
                         VMMT_ESTATE);
        assert_int_equal(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, 1, 3),
                         VMMT_ESTATE);
        still_out(f);
        finish(f, &d, zero_two, 2);
    }
}

/* Lists that are no set of the pool's ranks: VMMT_EINVAL, and nothing done. */
static void test_bad_lists_do_nothing(void **state)
{
    struct fixture *f = *state;
    const int twice[] = {1, 1}, outside[] = {0, 2}, negative[] = {-1}, all[] = {0, 1};
    vmmt_desc d;

    make_pool(f, 2, 0);
    publish_one(f, 34, &d);
    assert_int_equal(vmmt_consumer_ack_ranks(f->consumer, &d, 0, f->stream, NULL, 1), VMMT_EINVAL);
    assert_non_null(strstr(vmmt_last_error(), "NULL"));
    assert_int_equal(vmmt_consume_ranks(f->consumer, &d, 0, f->dst, f->cap, f->stream, NULL, 0),
                     VMMT_EINVAL);
    assert_int_equal(vmmt_consumer_ack_ranks(f->consumer, &d, 0, f->stream, all, 0), VMMT_EINVAL);
    assert_non_null(strstr(vmmt_last_error(), "at least one rank"));
    assert_int_equal(vmmt_consumer_ack_ranks(f->consumer, &d, 0, f->stream, twice, 2), VMMT_EINVAL);
    assert_non_null(strstr(vmmt_last_error(), "listed twice"));
    assert_int_equal(vmmt_consumer_ack_ranks(f->consumer, &d, 0, f->stream, outside, 2),
                     VMMT_EINVAL);
    assert_non_null(strstr(vmmt_last_error(), "rank 2 (entry 1"));
    assert_int_equal(vmmt_consume_ranks(f->consumer, &d, 0, f->dst, f->cap, f->stream, negative, 1),
                     VMMT_EINVAL);
    assert_int_equal(vmmt_consume_ranks(NULL, &d, 0, f->dst, f->cap, f->stream, all, 2),
                     VMMT_EINVAL);
    still_out(f);
    assert_vmmt_ok(vmmt_consume_ranks(f->consumer, &d, 0, f->dst, f->cap, f->stream, all, 2));
    sync_on(f->stream);
    expect(f, f->dst, N, 34);
    all_back(f);
}

/*
 * A packed group consumed for {0, 2}: its members may name the set in any
 * order; a member asked for a set that shares a rank but is another set is
 * refused (EINVAL), and the group completes with one acknowledgement.
 */
static void test_packed_members_share_one_set(void **state)
{
    struct fixture *f = *state;
    vmmt_buffer b[3] = {bytes(f->src, N), bytes(f->src + N, N), bytes(f->src + 2 * N, N)};
    const int zero_two[] = {0, 2}, two_zero[] = {2, 0}, zero[] = {0}, one_three[] = {1, 3};
    vmmt_desc m[3];

    make_pool(f, 4, 0);
    put(f, f->src, 3 * N, 35);
    assert_vmmt_ok(vmmt_publish_packed(f->pool, b, 3, f->stream, m));
    sync_on(f->stream);
    assert_vmmt_ok(
        vmmt_consume_ranks(f->consumer, &m[0], 0, f->dst, f->cap, f->stream, zero_two, 2));
    assert_int_equal(
        vmmt_consume_ranks(f->consumer, &m[1], 0, f->dst + N, f->cap - N, f->stream, zero, 1),
        VMMT_EINVAL);
    assert_non_null(strstr(vmmt_last_error(), "[0, 1) and [2, 3)"));
    assert_vmmt_ok(
        vmmt_consume_ranks(f->consumer, &m[1], 0, f->dst + N, f->cap - N, f->stream, two_zero, 2));
    assert_vmmt_ok(vmmt_consume_ranks(f->consumer, &m[2], 0, f->dst + 2 * N, f->cap - 2 * N,
                                      f->stream, zero_two, 2));
    sync_on(f->stream);
    expect(f, f->dst, 3 * N, 35);
    still_out(f);
    for (int i = 0; i < 3; i++)
        assert_vmmt_ok(vmmt_consumer_ack_ranks(f->consumer, &m[i], 0, f->stream, one_three, 2));
    sync_on(f->stream);
    all_back(f);
}

/*
 * Another process of rank 2 has taken the descriptor (its copy held behind a
 * gate): a consume for {0, 2} here is refused and leaves rank 0's word as it
 * was, so a third process consumes for rank 0 (a shared table: the plain
 * device pool, or a host or elastic one).
 */
static void test_list_refused_under_another_processes_take(void **state)
{
    struct fixture *f = *state;
    const int two[] = {2}, zero_two[] = {0, 2}, zero[] = {0}, rest[] = {1, 3};
    vmmt_consumer *other, *third;
    CUstream held;
    struct gate g;
    vmmt_desc d;

    make_pool(f, 4, 0);
    assert_vmmt_ok(vmmt_consumer_create(NULL, &other));
    assert_vmmt_ok(vmmt_consumer_create(NULL, &third));
    assert_int_equal(vmmt__drv()->cuStreamCreate(&held, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
    publish_one(f, 36, &d);
    gate_close(&g, held);
    assert_vmmt_ok(vmmt_consume_ranks(other, &d, 0, f->dst + N, f->cap - N, held, two, 1));
    assert_int_equal(vmmt_consume_ranks(f->consumer, &d, 0, f->dst, f->cap, f->stream, zero_two, 2),
                     VMMT_ESTATE);
    assert_vmmt_ok(
        vmmt_consume_ranks(third, &d, 0, f->dst + 2 * N, f->cap - 2 * N, f->stream, zero, 1));
    sync_on(f->stream);
    expect(f, f->dst + 2 * N, N, 36);
    gate_open_later(&g, 0);
    gate_free(&g);
    sync_on(held);
    expect(f, f->dst + N, N, 36);
    assert_vmmt_ok(vmmt_consumer_flush(other));
    assert_vmmt_ok(vmmt_consumer_flush(third));
    assert_vmmt_ok(vmmt_consumer_ack_ranks(f->consumer, &d, 0, f->stream, rest, 2));
    sync_on(f->stream);
    all_back(f);
    assert_int_equal(vmmt__drv()->cuStreamDestroy(held), CUDA_SUCCESS);
    vmmt_consumer_destroy(third);
    vmmt_consumer_destroy(other);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_ack_list_refused_whole),
        T(test_consume_list_refused_whole),
        T(test_consume_list_acknowledges_every_rank),
        T(test_bad_lists_do_nothing),
        T(test_packed_members_share_one_set),
        T(test_list_refused_under_another_processes_take),
    };
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
