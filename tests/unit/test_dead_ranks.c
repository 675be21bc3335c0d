/*
 * vmmt_pool_take_dead_ranks: the producer learns which ranks of a pool the
 * pool itself found dead (a consumer process died, or the lease ran out),
 * each once, and not those the engine released itself. The deaths are
 * reported to the pool as the broker reports them (vmmt__pool_ranks_dead),
 * so that no process has to be killed at a chosen moment; test_peers and
 * the Python binding's restart test kill real processes.
 */
#include <string.h>

#include "clock.h"
#include "poolfix.h"
#include "pool_internal.h"

static void dead(vmmt_pool *p, const uint64_t ranks[VMMT_BROKER_RANK_WORDS])
{
    uint64_t held[VMMT_BROKER_MAX_RANKS] = {0};

    for (int r = 0; r < VMMT_BROKER_MAX_RANKS; r++)
        held[r] = vmmt__liveness_tick();
    vmmt__pool_ranks_dead(p, ranks, 12345, 0, held);
}

static int take(vmmt_pool *p, int *ranks, int cap)
{
    int n = -1;

    assert_vmmt_ok(vmmt_pool_take_dead_ranks(p, ranks, cap, &n));
    return n;
}

static void test_each_death_once(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 4);
    const uint64_t r1_3[VMMT_BROKER_RANK_WORDS] = {(1u << 1) | (1u << 3)};
    int ranks[8];

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    assert_int_equal(take(f->pool, ranks, 8), 0);
    dead(f->pool, r1_3);
    assert_int_equal(take(f->pool, ranks, 8), 2);
    assert_int_equal(ranks[0], 1);
    assert_int_equal(ranks[1], 3);
    assert_int_equal(take(f->pool, ranks, 8), 0);
}

/* A short array takes the lowest ranks; the rest wait for the next call. */
static void test_capacity(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 4);
    const uint64_t r0_2[VMMT_BROKER_RANK_WORDS] = {(1u << 0) | (1u << 2)};
    int ranks[2] = {-7, -7};

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    dead(f->pool, r0_2);
    assert_int_equal(take(f->pool, NULL, 0), 0);
    assert_int_equal(take(f->pool, ranks, 1), 1);
    assert_int_equal(ranks[0], 0);
    assert_int_equal(ranks[1], -7);
    assert_int_equal(take(f->pool, ranks, 2), 1);
    assert_int_equal(ranks[0], 2);
}

/* What the engine released itself it knows of: not reported again. */
static void test_release_rank_not_reported(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 2);
    int ranks[4];

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    assert_vmmt_ok(vmmt_pool_release_rank(f->pool, 1));
    assert_int_equal(take(f->pool, ranks, 4), 0);
}

/*
 * Found dead, then released by the engine before it polled (it restarts the
 * rank): not reported after, where it would read as the death of the new
 * process. rank_restart.py hung joining a live process before this.
 */
static void test_release_rank_forgets_the_death(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 2);
    const uint64_t r1[VMMT_BROKER_RANK_WORDS] = {1u << 1};
    int ranks[4];

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    dead(f->pool, r1);
    assert_vmmt_ok(vmmt_pool_release_rank(f->pool, 1));
    assert_int_equal(take(f->pool, ranks, 4), 0);
}

/* A rank that sat on a slice past consumer_lease_ms is reported as dead too. */
static void test_lease(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 2);
    vmmt_buffer b = bytes(f->src, 4096);
    vmmt_desc d;
    struct timespec until;
    int ranks[4], n = 0;

    /* Long enough for the consume below to import the pool first, even under TSan on a
     * busy machine (at 20 ms both ranks' lease ran out before it, and the consume was
     * refused: CI, 2026-12-06); the loop below waits for the report. */
    c.consumer_lease_ms = 1000;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    put(f, f->src, 4096, 1);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    assert_vmmt_ok(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, 0, 1));
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    /* Bounded: the recycler runs every interval while the slice is in flight. */
    vmmt__deadline(&until, 10 * 1000 * 1000);
    while (n == 0 && !vmmt__deadline_passed(&until)) {
        n = take(f->pool, ranks, 4);
        if (n == 0) sleep_ms(5);
    }
    assert_int_equal(n, 1);
    assert_int_equal(ranks[0], 1);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 2000));
}

static void test_bad_arguments(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    int ranks[1], n;

    assert_int_equal(vmmt_pool_take_dead_ranks(NULL, ranks, 1, &n), VMMT_EINVAL);
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    assert_int_equal(vmmt_pool_take_dead_ranks(f->pool, ranks, 1, NULL), VMMT_EINVAL);
    assert_int_equal(vmmt_pool_take_dead_ranks(f->pool, NULL, 1, &n), VMMT_EINVAL);
    assert_int_equal(vmmt_pool_take_dead_ranks(f->pool, ranks, -1, &n), VMMT_EINVAL);
    assert_non_null(strstr(vmmt_last_error(), "capacity=-1"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_each_death_once),
        T(test_capacity),
        T(test_release_rank_not_reported),
        T(test_release_rank_forgets_the_death),
        T(test_lease),
        T(test_bad_arguments),
    };
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
