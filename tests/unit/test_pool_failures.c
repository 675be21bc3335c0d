/*
 * The producer under failures: a quarantined pool's shutdown never unmaps
 * under a publish copy still queued, and one transient failure of the
 * recycler's table read does not quarantine the pool. Emulator only (they
 * need its injected failures).
 */
#include <stdlib.h>
#include <string.h>

#include "driver.h"
#include "emu.h"
#include "pool_internal.h"
#include "poolfix.h"
#include "status.h"
#include "testutil.h"

/*
 * Caught (issue 8, defect 8): the shutdown of a quarantined pool returned at
 * once and unmapped the pool under a publish copy still queued on the
 * caller's stream (CUDA_ERROR_ILLEGAL_ADDRESS on that stream). When whether
 * the copies are done cannot be known, shutdown keeps the mapping and says so.
 */
static void test_quarantined_shutdown_keeps_mapping_under_queued_copy(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b = bytes(f->src, 4096);
    vmmt_desc d;
    struct gate g;
    int st = VMMT_OK;

    if (!on_emu()) skip();
    c.device_control_table = 1; /* the recycler reads the table with a driver copy */
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    gate_close(&g, f->stream);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d)); /* its copy stays queued */
    emu_fail("cuMemcpyDtoHAsync:*:CUDA_ERROR_UNKNOWN");
    for (int i = 0; i < 400 && st != VMMT_EFAILED; i++) {
        sleep_ms(5);
        st = vmmt_pool_reclaim(f->pool, NULL);
    }
    assert_int_equal(st, VMMT_EFAILED); /* the recycler gave up: quarantined */
    assert_int_equal(vmmt_pool_shutdown(f->pool), VMMT_EFAILED);
    assert_error_contains("stays mapped");
    gate_open_later(&g, 10);
    gate_free(&g); /* the publish copy ran into mapped memory */
    emu_reset();
    /* Once the table can be read and shows the copy landed, shutdown completes. */
    assert_vmmt_ok(vmmt_pool_shutdown(f->pool));
}

/*
 * Caught (issue 8, defect 8): one failed table read of the recycler
 * quarantined the pool for good. It is retried now.
 */
static void test_recycler_retries_transient_failure(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b = bytes(f->src, 4096);
    struct gate g;
    vmmt_desc d;

    if (!on_emu()) skip();
    c.device_control_table = 1;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    tu_roundtrip(f, 4096, 1);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    /* The consume reads the table row itself; its acknowledgement is held
     * back behind a gate, so the recycler's reads find nothing to free until
     * the failure is armed for the next of them. */
    gate_close(&g, f->stream);
    assert_vmmt_ok(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    emu_fail("cuMemcpyDtoHAsync:1:CUDA_ERROR_UNKNOWN"); /* the recycler's next read */
    gate_open_later(&g, 10);
    gate_free(&g);
    for (int i = 0; i < 200 && vmmt__emu_calls("cuMemcpyDtoHAsync") < 2; i++)
        sleep_ms(2);
    emu_reset();
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_int_equal(stats(f->pool).recycled, 2);
}

/*
 * Caught (CI, test_fault_sweep's sweep_recycle, 3 runs in 20): a table read
 * whose cuStreamSynchronize failed left its copy into the pinned table
 * queued on the pool's stream. The next publish staged its PENDING word in
 * that same pinned table and copied it from there; the late read overwrote
 * the staged word first, so the device got the slot's old word (0) and a
 * consumer refused the fresh descriptor as never handed out. Gates keep the
 * late read and the publish's LIVE word queued, so the consume below sees
 * exactly what the PENDING write left.
 */
static void test_failed_table_read_does_not_clobber_pending_word(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b = bytes(f->src, 4096);
    vmmt_desc first, next;
    struct gate pool_gate, caller_gate;

    if (!on_emu() || pool_kind_host()) skip();
    c.device_control_table = 1;
    c.recycle_interval_us = 60u * 1000 * 1000; /* the recycler stays out of the way */
    c.handoff = VMMT_HANDOFF_STREAM;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    put(f, f->src, 4096, 7);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &first)); /* in flight: reclaim reads */
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    gate_close(&pool_gate, f->pool->stream);
    emu_fail("cuStreamSynchronize:1:CUDA_ERROR_UNKNOWN");
    assert_int_not_equal(vmmt_pool_reclaim(f->pool, NULL), VMMT_OK); /* its read stays queued */
    emu_reset();
    gate_open_later(&pool_gate, 50); /* the publish's PENDING write waits behind the read */
    gate_close(&caller_gate, f->stream);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &next));
    gate_free(&pool_gate);
    assert_vmmt_ok(
        vmmt_consume(f->consumer, &next, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    gate_open_later(&caller_gate, 0);
    gate_free(&caller_gate);
    expect(f, f->dst, 4096, 7);
    assert_vmmt_ok(
        vmmt_consume(f->consumer, &first, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_quarantined_shutdown_keeps_mapping_under_queued_copy),
        T(test_recycler_retries_transient_failure),
        T(test_failed_table_read_does_not_clobber_pending_word),
    };
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
