/*
 * A late automatic release of a dead consumer must not take a restarted
 * rank's slices (defect 6 in docs/reliability.md, found by the soak built
 * with VMMT_HAVE_RELEASE_RANK: `soak --seconds 20 --seed 7` got wrong bytes
 * with status OK). The pool learns of a death on the broker's thread
 * (vmmt__pool_ranks_dead), possibly after the engine has reaped the
 * process, released its rank and published for the process restarted under
 * it. These tests call vmmt__pool_ranks_dead directly, at those moments, so
 * that the order is not left to the scheduler. Before the fix, the late
 * release acknowledged every slice in flight when the recycler ran, so the
 * new process's descriptor was released (and its slice recycled) unconsumed.
 */
#include <string.h>
#include <time.h>

#include "clock.h"
#include "poolfix.h"
#include "pool_internal.h"

static const uint64_t rank0[VMMT_BROKER_RANK_WORDS] = {1};

/* What a link that held rank 0 since `tick` reports at its death. */
static void dead_rank0(vmmt_pool *p, uint64_t tick)
{
    uint64_t held[VMMT_BROKER_MAX_RANKS] = {tick};

    vmmt__pool_ranks_dead(p, rank0, 12345, 0, held);
}

/* Long enough for the recycler (woken by the death) to have run. */
static void settle(void)
{
    struct timespec t = {0, 100 * 1000 * 1000};
    nanosleep(&t, NULL);
}

/* The engine released the rank itself after the dead process took it; the death is seen later. */
static void test_death_seen_after_release_rank(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b = bytes(f->src, 4096);
    vmmt_desc old, fresh;
    uint64_t held;

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    held = vmmt__liveness_tick(); /* the dead process's link took rank 0 */
    put(f, f->src, 4096, 1);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &old));
    /* The process died unseen; the engine reaps it and releases its rank. */
    assert_vmmt_ok(vmmt_pool_release_rank(f->pool, 0));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 2000));
    /* The restarted process's descriptor, then the broker's late word of the death. */
    put(f, f->src, 4096, 2);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &fresh));
    dead_rank0(f->pool, held);
    settle();
    assert_int_equal(stats(f->pool).in_flight, 1);
    assert_vmmt_ok(
        vmmt_consume(f->consumer, &fresh, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    expect(f, f->dst, 4096, 2);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 2000));
}

/* The death is noted while one slice is in flight; only that occupant is released. */
static void test_release_covers_what_was_in_flight(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b = bytes(f->src, 4096);
    vmmt_desc old, fresh;

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    put(f, f->src, 4096, 1);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &old));
    /* Held by the pool's lock, so the recycler releases only after the next publish. */
    pthread_mutex_lock(&f->pool->reclaim_lock);
    dead_rank0(f->pool, vmmt__liveness_tick());
    put(f, f->src, 4096, 2);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &fresh));
    pthread_mutex_unlock(&f->pool->reclaim_lock);
    settle();
    /* The dead process's slice went back; the new one waits for its consumer. */
    assert_int_equal(stats(f->pool).released_slices, 1);
    assert_int_equal(stats(f->pool).in_flight, 1);
    assert_vmmt_ok(
        vmmt_consume(f->consumer, &fresh, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    expect(f, f->dst, 4096, 2);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 2000));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_death_seen_after_release_rank),
        T(test_release_covers_what_was_in_flight),
    };
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
