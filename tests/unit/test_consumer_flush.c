/*
 * vmmt_consumer_flush: once a stream-ordered consume's stream is
 * synchronized, the flush writes its acknowledgement in the caller's thread,
 * so a reclaim right after finds the slice free. Without it the consumer's
 * thread writes it tens of microseconds later, and a producer in the same
 * process that recycles at once (sglang's tests do) found it in flight.
 */
#include "poolfix.h"

/* Each round: the copy held behind a gate so that its acknowledgement is the
 * thread's, then the gate opened and the stream synchronized. */
#define ROUNDS 40

static void flush_frees_at_once(struct fixture *f, int device_table)
{
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b = bytes(f->src, 4096);
    struct gate g;
    vmmt_desc d;
    uint32_t freed;

    c.device_control_table = device_table;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    for (int i = 0; i < ROUNDS; i++) {
        put(f, f->src, 4096, (uint32_t)i);
        assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
        assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
        gate_close(&g, f->stream);
        assert_vmmt_ok(
            vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
        gate_open_later(&g, 0);
        gate_free(&g); /* the stream is synchronized, past the copy */
        expect(f, f->dst, 4096, (uint32_t)i);
        assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
        assert_vmmt_ok(vmmt_pool_reclaim(f->pool, &freed));
        assert_int_equal(stats(f->pool).in_flight, 0);
    }
}

static void test_flush_host_table(void **state)
{
    flush_frees_at_once(*state, 0);
}

static void test_flush_device_table(void **state)
{
    flush_frees_at_once(*state, 1);
}

/* Nothing pending, or a copy still queued: returns at once, the copy's
 * acknowledgement left to the thread. */
static void test_flush_never_waits(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b = bytes(f->src, 4096);
    struct gate g;
    vmmt_desc d;

    assert_int_equal(vmmt_consumer_flush(NULL), VMMT_EINVAL);
    assert_true(vmmt_last_error()[0] != '\0');
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    put(f, f->src, 4096, 3);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    gate_close(&g, f->stream);
    assert_vmmt_ok(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    assert_vmmt_ok(vmmt_pool_reclaim(f->pool, NULL));
    assert_int_equal(stats(f->pool).in_flight, 1); /* the copy has not run: not acknowledged */
    gate_open_later(&g, 0);
    gate_free(&g);
    expect(f, f->dst, 4096, 3);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_flush_host_table),
        T(test_flush_device_table),
        T(test_flush_never_waits),
    };
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
