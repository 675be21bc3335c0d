/*
 * Attacks on the merged code, each a defect found by playing a careless user
 * or a hostile peer: hostile but well-typed arguments, and the places where
 * elastic pools, reservations, the import cache and the group exchange meet.
 * Each test says what it caught.
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "driver.h"
#include "emu.h"
#include "pattern.h"
#include "poolfix.h"
#include "status.h"
#include "testutil.h"

#define CHUNK POOLFIX_CHUNK

/*
 * idle_release_ms was turned into microseconds in 32 bits: 4294968 ms (about
 * 72 minutes) wrapped to 704 us, so a pool asked to keep its chunks for an
 * hour gave them back at once (and UINT32_MAX, "keep for ever", meant 71
 * minutes).
 */
static void test_elastic_long_idle_release_does_not_wrap(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = elastic_config(16 * MiB, 4294968u);

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    tu_roundtrip(f, 4096, 1);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    /* Several recycler periods: a wrapped bound of 704 us has long passed. */
    sleep_ms(100);
    assert_vmmt_ok(vmmt_pool_reclaim(f->pool, NULL));
    sleep_ms(50);
    assert_int_equal(stats(f->pool).resident_bytes, CHUNK);
    assert_int_equal(stats(f->pool).chunks_released, 0);
}

/*
 * vmmt_group_create_local added 10 s to timeout_ms in int arithmetic: a
 * timeout near INT_MAX (a caller's "no bound") overflowed, undefined
 * behaviour (the sanitizer build aborts; others wrapped it negative, i.e.
 * the adapter's default of 60 s instead of the bound asked for).
 */
static void test_group_local_huge_timeout(void **state)
{
    vmmt_group_config c;
    vmmt_group *g = NULL;
    vmmt_group_buffer b;
    uint64_t ptrs[2] = {0, 0}, ptr = 0;
    size_t nb = 0, np = 0;

    (void)state;
    vmmt_group_config_init(&c);
    c.rank = 0;
    c.world_size = 1;
    c.timeout_ms = INT_MAX;
    assert_vmmt_ok(vmmt_group_create_local(&c, "attack-huge-timeout", &g));
    assert_vmmt_ok(vmmt_group_alloc(g, 4 * MiB, 2, &ptr));
    /* The same buffer twice, and one starting inside its allocation. */
    b.ptr = ptr + 4096;
    b.nbytes = 4096;
    assert_vmmt_ok(vmmt_group_register(g, &b, 1, ptrs));
    assert_int_equal(ptrs[0], ptr + 4096);
    assert_vmmt_ok(vmmt_group_register(g, &b, 1, ptrs + 1));
    assert_vmmt_ok(vmmt_group_get_counts(g, &nb, &np));
    assert_int_equal(nb, 2);
    vmmt_group_destroy(g);
}

/*
 * A reservation's token is a vmmt_desc, and a careless producer may hand it
 * out: vmmt_consume took it as a descriptor (VMMT_OK) and queued a copy of the
 * whole reservation behind a wait for the commit, acknowledging the slot;
 * the real descriptor was then refused as "already consumed". Had the
 * reservation been cancelled instead, the consumer got unwritten bytes with
 * VMMT_OK. A token must be refused by every reader and still work for
 * vmmt_commit and vmmt_cancel.
 */
static void test_reservation_token_is_no_descriptor(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(8 * MiB, 1);
    vmmt_reservation r;
    vmmt_desc d;

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    assert_vmmt_ok(vmmt_reserve(f->pool, 4096, &r));
    assert_int_equal(
        vmmt_consume(f->consumer, &r.token, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0),
        VMMT_EINVAL);
    assert_error_contains("reservation");
    assert_int_equal(vmmt_consumer_ack(f->consumer, &r.token, 0, f->stream, VMMT_ALL_RANKS, 0),
                     VMMT_EINVAL);
    put(f, r.ptr, 4096, 7);
    assert_vmmt_ok(vmmt_commit(f->pool, &r, NULL, f->stream, &d));
    assert_vmmt_ok(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    expect(f, f->dst, 4096, 7);
    /* A cancelled one: the token still cancels, and is still refused by readers. */
    assert_vmmt_ok(vmmt_reserve(f->pool, 4096, &r));
    assert_vmmt_ok(vmmt_cancel(f->pool, &r.token));
    assert_int_equal(
        vmmt_consume(f->consumer, &r.token, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0),
        VMMT_EINVAL);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_int_equal(stats(f->pool).cancelled, 1);
}

/*
 * The *_size functions trusted the size they were given: a size no vmmt
 * struct can have (a length mixed up with a count, say; SIZE_MAX here) made
 * them memset or read that many bytes, a crash instead of VMMT_EINVAL.
 */
static void test_struct_size_absurd(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(8 * MiB, 1), init;
    vmmt_pool_stats st;
    vmmt_desc_info info;
    vmmt_buffer b[2];
    vmmt_desc d[2];
    vmmt_pool *p = NULL;

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    assert_int_equal(vmmt_pool_get_stats_size(f->pool, &st, SIZE_MAX), VMMT_EINVAL);
    assert_error_contains("bytes");
    assert_int_equal(vmmt_pool_get_stats_size(f->pool, &st, (size_t)1 << 40), VMMT_EINVAL);
    memset(b, 0, sizeof b);
    b[0] = b[1] = bytes(f->src, 64);
    assert_int_equal(vmmt_publish_packed_size(f->pool, b, 2, SIZE_MAX / 2, NULL, d), VMMT_EINVAL);
    assert_int_equal(vmmt_pool_create_size(&c, SIZE_MAX, &p), VMMT_EINVAL);
    assert_null(p);
    vmmt_pool_config_init_size(&init, SIZE_MAX); /* writes nothing, says why */
    assert_error_contains("bytes");
    assert_vmmt_ok(vmmt_publish(f->pool, &b[0], f->stream, &d[0]));
    assert_int_equal(vmmt_desc_inspect_size(&d[0], &info, SIZE_MAX), VMMT_EINVAL);
    assert_vmmt_ok(
        vmmt_consume(f->consumer, &d[0], 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

/*
 * A source range that wraps the address space was taken: a device pool got
 * VMMT_ECUDA from the driver after a slot was reserved, and a host pool's CPU
 * copy (memcpy from the wrapped address) would fault. vmmt.h promises
 * VMMT_EINVAL for a buffer no reader could take, before anything is reserved.
 */
static void test_wrapping_source_refused(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(8 * MiB, 1);
    vmmt_buffer b = bytes(UINT64_MAX - 8, 64);
    vmmt_desc d;

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    assert_int_equal(vmmt_publish(f->pool, &b, f->stream, &d), VMMT_EINVAL);
    assert_error_contains("wraps");
    b.location = VMMT_LOC_HOST;
    assert_int_equal(vmmt_publish(f->pool, &b, f->stream, &d), VMMT_EINVAL);
    vmmt_pool_destroy(f->pool);
    f->pool = NULL;
    c.memory_location = VMMT_MEMORY_HOST;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    assert_int_equal(vmmt_publish(f->pool, &b, NULL, &d), VMMT_EINVAL);
    assert_int_equal(stats(f->pool).published, 0);
}

/*
 * vmmt_mem_copy passed overlapping ranges to cuMemcpyAsync, whose result is
 * undefined for them (the emulator happened to succeed), and let the driver
 * answer a wrapping range with VMMT_ECUDA instead of VMMT_EINVAL.
 */
static void test_mem_copy_overlap_and_wrap(void **state)
{
    uint64_t p = 0;

    (void)state;
    assert_vmmt_ok(vmmt_mem_alloc(0, 8192, &p));
    assert_int_equal(vmmt_mem_copy(0, p + 16, p, 4000, NULL), VMMT_EINVAL);
    assert_error_contains("overlap");
    assert_int_equal(vmmt_mem_copy(0, p, p + 16, 4000, NULL), VMMT_EINVAL);
    assert_int_equal(vmmt_mem_copy(0, p, p, 4096, NULL), VMMT_EINVAL);
    assert_int_equal(vmmt_mem_copy(0, p, p + 8, UINT64_MAX - p, NULL), VMMT_EINVAL);
    assert_int_equal(vmmt_mem_copy(0, UINT64_MAX - 8, p, 64, NULL), VMMT_EINVAL);
    assert_error_contains("wraps");
    /* Adjacent ranges do not overlap. */
    assert_vmmt_ok(vmmt_mem_copy(0, p + 4096, p, 4096, NULL));
    assert_vmmt_ok(vmmt_mem_copy(0, p, p + 4096, 4096, NULL));
    assert_vmmt_ok(vmmt_mem_free(0, p));
}

/*
 * vmmt.h: "a reservation is committed or cancelled once". But vmmt_cancel
 * with the token of a reservation already committed cancelled the published
 * descriptor: its slice was recycled (ready word set, acknowledgements not
 * waited for) while the descriptor was out with consumers. A token cancels a
 * reservation only; the committed descriptor is what vmmt_cancel takes back.
 */
static void test_cancel_token_after_commit(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(8 * MiB, 1);
    vmmt_reservation r;
    vmmt_desc d;

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    assert_vmmt_ok(vmmt_reserve(f->pool, 4096, &r));
    put(f, r.ptr, 4096, 9);
    assert_vmmt_ok(vmmt_commit(f->pool, &r, NULL, f->stream, &d));
    assert_vmmt_ok(vmmt_cancel(f->pool, &r.token)); /* idempotent: nothing to do */
    assert_int_equal(stats(f->pool).cancelled, 0);
    assert_vmmt_ok(vmmt_pool_reclaim(f->pool, NULL));
    assert_int_equal(stats(f->pool).in_flight, 1);
    assert_vmmt_ok(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    expect(f, f->dst, 4096, 9);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_int_equal(stats(f->pool).recycled, 1);
}

/*
 * Caught (issue 16, defect 8): vmmt_commit handed out descriptors no reader
 * accepts (a typed buffer without a shape, a negative dimension), which
 * vmmt_publish refuses: every inspect, consume, ack and cancel then failed
 * and the slice was lost until shutdown. The commit now runs publish's
 * validator first, refuses, and leaves the reservation to commit again.
 */
static void test_commit_refuses_what_readers_refuse(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(8 * MiB, 1);
    vmmt_buffer what;
    vmmt_reservation r;
    vmmt_desc d;
    vmmt_desc_info info;

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    assert_vmmt_ok(vmmt_reserve(f->pool, 4096, &r));
    put(f, r.ptr, 4096, 10);
    memset(&what, 0, sizeof what);
    what.nbytes = 4096;
    what.dtype.code = 2, what.dtype.bits = 32, what.dtype.lanes = 1;
    what.ndim = 1;
    what.shape[0] = -1024; /* a negative dimension */
    assert_int_equal(vmmt_commit(f->pool, &r, &what, f->stream, &d), VMMT_EINVAL);
    assert_error_contains("shape");
    what.shape[0] = 1000; /* 4000 bytes where nbytes says 4096 */
    assert_int_equal(vmmt_commit(f->pool, &r, &what, f->stream, &d), VMMT_EINVAL);
    what.shape[0] = 1024;
    assert_vmmt_ok(vmmt_commit(f->pool, &r, &what, f->stream, &d));
    assert_vmmt_ok(vmmt_desc_inspect(&d, &info));
    assert_int_equal(info.shape[0], 1024);
    assert_vmmt_ok(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    expect(f, f->dst, 4096, 10);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

/*
 * The local adapter's socket name is "vmmt-local-<uid>-<job>", cut silently
 * at the 107 bytes an abstract name holds: two jobs whose long names share
 * their first 80-odd bytes met at one name, and the second job's ranks
 * joined the first (failing it: "two processes claim" a rank). A job name
 * that does not fit is refused instead.
 */
static void test_group_local_long_job_refused(void **state)
{
    char job[200];
    vmmt_group_collective coll;

    (void)state;
    memset(job, 'j', sizeof job - 1);
    job[sizeof job - 1] = '\0';
    assert_int_equal(vmmt_group_local_collective(job, 0, 2, 200, &coll), VMMT_EINVAL);
    assert_error_contains("job");
    assert_null(coll.allgather);
    job[60] = '\0'; /* a name that fits still works (a single rank touches no socket) */
    assert_vmmt_ok(vmmt_group_local_collective(job, 0, 1, 200, &coll));
    coll.close(coll.ctx);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_elastic_long_idle_release_does_not_wrap),
        cmocka_unit_test(test_group_local_huge_timeout),
        cmocka_unit_test(test_group_local_long_job_refused),
        T(test_reservation_token_is_no_descriptor),
        T(test_struct_size_absurd),
        T(test_wrapping_source_refused),
        T(test_cancel_token_after_commit),
        T(test_commit_refuses_what_readers_refuse),
        cmocka_unit_test(test_mem_copy_overlap_and_wrap),
    };
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
