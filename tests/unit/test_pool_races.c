/*
 * The transport under concurrency and in the orderings a review found
 * dangerous: shutdown against publishers and queued copies, a failed ready
 * write, packed groups across ranks and streams, evict during consume.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "emu.h"
#include "pattern.h"
#include "poolfix.h"

/* One process consuming a packed slice separately for ranks 0 and 1. */
static void test_packed_per_rank(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 2);
    vmmt_buffer b[2] = {bytes(f->src, 100), bytes(f->src + 4096, 200)};
    vmmt_desc d[2];

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    assert_vmmt_ok(vmmt_publish_packed(f->pool, b, 2, f->stream, d));
    for (int rank = 0; rank < 2; rank++)
        for (int i = 0; i < 2; i++)
            assert_vmmt_ok(vmmt_consume(f->consumer, &d[i], 0, f->dst + 8192 * (uint64_t)i, 8192,
                                        f->stream, rank, 1));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

/* Members of one packed group on two streams would let the ack overtake a copy. */
static void test_packed_one_stream(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b[2] = {bytes(f->src, 100), bytes(f->src + 4096, 200)};
    vmmt_desc d[2];
    CUstream other;

    assert_int_equal(vmmt__drv()->cuStreamCreate(&other, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    assert_vmmt_ok(vmmt_publish_packed(f->pool, b, 2, f->stream, d));
    assert_vmmt_ok(vmmt_consume(f->consumer, &d[0], 0, f->dst, 8192, f->stream, 0, 1));
    assert_int_equal(vmmt_consume(f->consumer, &d[1], 0, f->dst + 8192, 8192, other, 0, 1),
                     VMMT_EINVAL);
    assert_error_contains("on one stream");
    assert_vmmt_ok(vmmt_consume(f->consumer, &d[1], 0, f->dst + 8192, 8192, f->stream, 0, 1));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    vmmt__drv()->cuStreamDestroy(other);
}

/*
 * The ready-flag write fails after the copy was enqueued behind other work:
 * the slice must not be reused before that copy has run.
 */
static void test_ready_write_failure_waits_for_copy(void **state)
{
    struct fixture *f = *state;
    const struct vmmt_drv *d = vmmt__drv();
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b1 = bytes(f->src, 4096), b2 = bytes(f->src + 65536, 4096);
    vmmt_desc d1, d2;
    struct gate g;

    if (!on_emu()) skip();
    c.handoff = VMMT_HANDOFF_SYNC;
    put(f, b1.ptr, 4096, 1);
    put(f, b2.ptr, 4096, 2);
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    gate_close(&g, f->stream);
    gate_open_later(&g, 100);
    emu_fail_without_kernel("cuStreamWriteValue32:1:CUDA_ERROR_INVALID_VALUE");
    assert_int_equal(vmmt_publish(f->pool, &b1, f->stream, &d1), VMMT_ECUDA);
    assert_error_contains("cuStreamWriteValue32(ready flag)");
    emu_reset();
    assert_int_equal(stats(f->pool).in_flight, 0);
    assert_vmmt_ok(vmmt_publish(f->pool, &b2, g.stream, &d2));
    assert_vmmt_ok(vmmt_consume(f->consumer, &d2, 0, f->dst, 8192, f->stream, VMMT_ALL_RANKS, 0));
    expect(f, f->dst, 4096, 2);
    gate_free(&g);
    assert_int_equal(d->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
}

struct racer {
    vmmt_pool *pool;
    CUdeviceptr src;
    CUstream stream;
    int go; /* atomic: the racer starts when the main thread says so */
};

static void *full_publisher(void *arg)
{
    struct racer *r = arg;
    vmmt_buffer b = bytes(r->src, 1024);
    vmmt_desc d;

    while (!__atomic_load_n(&r->go, __ATOMIC_ACQUIRE))
        ;
    vmmt__ctx_enter(0);
    for (int i = 0; i < 100000; i++)
        if (vmmt_publish(r->pool, &b, r->stream, &d) == VMMT_ECLOSED) break;
    vmmt__ctx_leave();
    return NULL;
}

/* Shutdown while a publisher keeps reclaiming a full pool. */
static void test_shutdown_against_reclaiming_publisher(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b = bytes(f->src, 1024);
    vmmt_desc d;

    c.max_slices = 2;
    vmmt_set_log_level(VMMT_LOG_ERROR); /* every pool here fills up on purpose */
    for (int it = 0; it < 60; it++) {
        struct racer r;
        struct timespec pause = {0, (it % 20) * 20000L};
        pthread_t t;

        memset(&r, 0, sizeof r);
        assert_vmmt_ok(vmmt_pool_create(&c, &r.pool));
        while (vmmt_publish(r.pool, &b, f->stream, &d) == VMMT_OK)
            ; /* fill; never acknowledged */
        r.src = f->src;
        r.stream = f->stream;
        pthread_create(&t, NULL, full_publisher, &r);
        __atomic_store_n(&r.go, 1, __ATOMIC_RELEASE);
        nanosleep(&pause, NULL);
        assert_vmmt_ok(vmmt_pool_shutdown(r.pool));
        pthread_join(t, NULL);
        vmmt_pool_destroy(r.pool);
    }
    vmmt_set_log_level(VMMT_LOG_WARN);
}

/* Stream-ordered publish still queued on the caller's stream: shutdown waits for it. */
static void test_shutdown_waits_for_queued_copy(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b = bytes(f->src, 4096);
    vmmt_desc d;
    struct gate g;

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    if (stats(f->pool).handoff != VMMT_HANDOFF_STREAM) skip();
    gate_close(&g, f->stream);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    gate_open_later(&g, 100);
    assert_vmmt_ok(vmmt_pool_shutdown(f->pool));
    gate_free(&g);
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
}

/* ... and gives up at its timeout, saying what to do, then succeeds on a retry. */
static void test_shutdown_times_out_on_stuck_copy(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b = bytes(f->src, 4096);
    vmmt_desc d;
    struct gate g;

    c.timeout_ms = 200;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    if (stats(f->pool).handoff != VMMT_HANDOFF_STREAM) skip();
    gate_close(&g, f->stream);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    assert_int_equal(vmmt_pool_shutdown(f->pool), VMMT_ETIMEDOUT);
    assert_error_contains("publish copies still queued");
    assert_int_equal(vmmt_publish(f->pool, &b, f->stream, &d), VMMT_ECLOSED);
    gate_open_later(&g, 0);
    gate_free(&g);
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    assert_vmmt_ok(vmmt_pool_shutdown(f->pool));
    assert_int_equal(vmmt_pool_drain(f->pool, 10), VMMT_ECLOSED);
    assert_int_equal(vmmt_cancel(f->pool, &d), VMMT_ECLOSED);
}

static void *shut(void *arg)
{
    vmmt_pool_shutdown(arg);
    return NULL;
}

static void *read_stats(void *arg)
{
    vmmt_pool_stats s;
    for (int i = 0; i < 2000; i++)
        vmmt_pool_get_stats(arg, &s);
    return NULL;
}

/* Two shutdowns and a stats reader at once: one releases, the other waits. */
static void test_concurrent_shutdowns(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    pthread_t t[3];

    for (int it = 0; it < 20; it++) {
        vmmt_pool *p;
        assert_vmmt_ok(vmmt_pool_create(&c, &p));
        pthread_create(&t[0], NULL, read_stats, p);
        pthread_create(&t[1], NULL, shut, p);
        pthread_create(&t[2], NULL, shut, p);
        for (int i = 0; i < 3; i++)
            pthread_join(t[i], NULL);
        vmmt_pool_destroy(p);
    }
    (void)f;
}

struct consumer_thread {
    vmmt_consumer *consumer;
    const vmmt_desc *desc;
    CUdeviceptr dst;
    CUstream stream;
    int status;
};

static void *consume_late(void *arg)
{
    struct consumer_thread *ct = arg;
    vmmt__ctx_enter(0);
    ct->status =
        vmmt_consume(ct->consumer, ct->desc, 0, ct->dst, 8192, ct->stream, VMMT_ALL_RANKS, 0);
    vmmt__ctx_leave();
    return NULL;
}

/* Evict refuses while a consume is using the pool's mapping. */
static void test_evict_while_consuming(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b = bytes(f->src, 4096);
    struct consumer_thread ct;
    vmmt_desc_info info;
    vmmt_desc d;
    pthread_t t;

    if (!on_emu()) skip(); /* needs the emulator's refused wait to hold the call */
    c.handoff = VMMT_HANDOFF_STREAM;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    tu_roundtrip(f, 4096, 1); /* imported */
    setenv("VMMT_EMU_WAIT_IMPORTED", "0", 1);
    setenv("VMMT_EMU_WAIT_HOST", "0", 1);
    vmmt__emu_configure();
    {
        struct gate g;
        gate_close(&g, f->stream);
        assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
        ct = (struct consumer_thread){f->consumer, &d, f->dst, g.stream, -100};
        pthread_create(&t, NULL, consume_late, &ct); /* polls the ready word */
        sleep_ms(50);
        assert_vmmt_ok(vmmt_desc_inspect(&d, &info));
        assert_int_equal(vmmt_consumer_evict(f->consumer, info.pool_id, 0), VMMT_ESTATE);
        assert_error_contains("are using it");
        gate_open_later(&g, 0);
        pthread_join(t, NULL);
        assert_vmmt_ok(ct.status);
        gate_free(&g);
    }
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    assert_vmmt_ok(vmmt_consumer_evict(f->consumer, info.pool_id, 0));
}

/* A failed event record must not acknowledge before the queued copy has run. */
static void test_event_record_failure_waits_for_copy(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b = bytes(f->src, 4096);
    vmmt_desc d;
    struct gate g;

    if (!on_emu()) skip();
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    put(f, b.ptr, 4096, 1);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    gate_close(&g, f->stream); /* the consumer's copy sits behind this */
    gate_open_later(&g, 100);
    emu_fail("cuEventRecord:*:CUDA_ERROR_INVALID_VALUE");
    assert_int_equal(vmmt_consume(f->consumer, &d, 0, f->dst, 8192, f->stream, VMMT_ALL_RANKS, 0),
                     VMMT_ECUDA);
    emu_reset();
    /* Acknowledged, so the slice is free, but only after the copy ran. */
    expect(f, f->dst, 4096, 1);
    gate_free(&g);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

/* A cancelled descriptor consumed after its slot was reused must not copy the new occupant. */
static void test_late_cancelled_consume_refused(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b1 = bytes(f->src, 4096), b2 = bytes(f->src + 65536, 4096);
    vmmt_desc d1, d2;

    put(f, b1.ptr, 4096, 1);
    put(f, b2.ptr, 4096, 2);
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    assert_vmmt_ok(vmmt_publish(f->pool, &b1, f->stream, &d1));
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    assert_vmmt_ok(vmmt_cancel(f->pool, &d1));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_vmmt_ok(vmmt_publish(f->pool, &b2, f->stream, &d2));
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    assert_int_equal(vmmt_consume(f->consumer, &d1, 0, f->dst, 8192, f->stream, VMMT_ALL_RANKS, 0),
                     VMMT_ESTATE);
    assert_error_contains("cancelled");
    assert_vmmt_ok(vmmt_consume(f->consumer, &d2, 0, f->dst, 8192, f->stream, VMMT_ALL_RANKS, 0));
    expect(f, f->dst, 4096, 2);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

#define SHARERS 8

struct sharer {
    vmmt_pool *pool;
    vmmt_consumer *consumer;
    CUdeviceptr src;
    int full;   /* publishes refused with VMMT_EFULL */
    int failed; /* another status: why is kept */
    char why[256];
};

/*
 * Publish, then acknowledge (a drop) for every rank and synchronize the
 * stream: once that returns the acknowledgement is in the control table (a
 * shared host table's is a CPU store made before vmmt_consumer_ack returns,
 * a device table's a stream write, done with the stream). So this thread
 * holds at most one unacknowledged slice at any moment. The legacy default
 * stream: on the emulator its work runs on the calling thread, so the
 * threads meet in the pool far more often than through stream workers.
 */
static void *share_slots(void *arg)
{
    struct sharer *t = arg;
    vmmt_buffer b = bytes(t->src, 1024);
    vmmt_desc desc;

    vmmt__ctx_enter(0);
    for (int i = 0; i < 10000 && !t->failed; i++) {
        int st = vmmt_publish(t->pool, &b, NULL, &desc);
        if (st == VMMT_EFULL) {
            if (t->full++ == 0) snprintf(t->why, sizeof t->why, "%s", vmmt_last_error());
            continue;
        }
        if (st == VMMT_OK) st = vmmt_consumer_ack(t->consumer, &desc, 0, NULL, VMMT_ALL_RANKS, 0);
        if (st == VMMT_OK && vmmt__drv()->cuStreamSynchronize(NULL) != CUDA_SUCCESS)
            st = VMMT_ECUDA;
        if (st != VMMT_OK) {
            t->failed = 1;
            snprintf(t->why, sizeof t->why, "%s: %s", vmmt_strerror(st), vmmt_last_error());
        }
    }
    vmmt__ctx_leave();
    return NULL;
}

/*
 * SHARERS threads share a pool of SHARERS + 1 slots and one consumer; each
 * publishes and acknowledges its own slice at once (share_slots). At every
 * moment at most SHARERS slices are unacknowledged, so at least one slot is
 * free or holds an acknowledged slice, and a publish that reclaims before
 * it answers full always finds room. Nothing here depends on timing.
 *
 * Fails at c7366cf: a publish that finds no free slot reclaims once, then
 * takes the pool lock again to retry; the other threads can take every slot
 * the reclaim freed in between (acknowledging them again), and it answers
 * full with slices acknowledged in the pool. Every run refuses some (3 to
 * 208 of 80,000 publishes; 19 runs of 20 with both cores busy). The Python
 * test of four threads on 256 slots (test_leaks.py) failed so on a busy
 * machine. A sweep and a reservation in one hold of the lock made it pass
 * every run (a trial, not committed: src/producer/publish.c is the lead's).
 */
static void test_publish_finds_acknowledged_slots(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    struct sharer t[SHARERS];
    pthread_t th[SHARERS];
    int full = 0;

    c.max_slices = SHARERS + 1;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    for (int i = 0; i < SHARERS; i++) {
        memset(&t[i], 0, sizeof t[i]);
        t[i].pool = f->pool;
        t[i].consumer = f->consumer;
        t[i].src = f->src + (uint64_t)i * 4096;
        assert_int_equal(pthread_create(&th[i], NULL, share_slots, &t[i]), 0);
    }
    for (int i = 0; i < SHARERS; i++)
        assert_int_equal(pthread_join(th[i], NULL), 0);
    for (int i = 0; i < SHARERS; i++) {
        if (t[i].failed) fail_msg("thread %d: %s", i, t[i].why);
        if (t[i].full) print_error("thread %d: %d publishes refused: %s\n", i, t[i].full, t[i].why);
        full += t[i].full;
    }
    assert_int_equal(full, 0);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

/* The recycler's idle sleep never loses a wake-up: slices recycle without explicit reclaims. */
static void test_recycler_wakes_after_idle(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b = bytes(f->src, 4096);
    vmmt_desc d;

    c.recycle_interval_us = 10; /* a grace period of 2.56 ms, so it idles often */
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    for (int it = 0; it < 60; it++) {
        int waited = 0;
        sleep_ms(it % 7);
        assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
        assert_vmmt_ok(
            vmmt_consume(f->consumer, &d, 0, f->dst, 8192, f->stream, VMMT_ALL_RANKS, 0));
        while (stats(f->pool).in_flight != 0 && waited++ < 2000)
            sleep_ms(1);
        assert_int_equal(stats(f->pool).in_flight, 0);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_packed_per_rank),
        T(test_packed_one_stream),
        T(test_ready_write_failure_waits_for_copy),
        T(test_shutdown_against_reclaiming_publisher),
        T(test_shutdown_waits_for_queued_copy),
        T(test_shutdown_times_out_on_stuck_copy),
        T(test_concurrent_shutdowns),
        T(test_evict_while_consuming),
        T(test_event_record_failure_waits_for_copy),
        T(test_late_cancelled_consume_refused),
        T(test_recycler_wakes_after_idle),
        T(test_publish_finds_acknowledged_slots),
    };
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
