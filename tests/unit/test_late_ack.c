/*
 * A late acknowledgement: a restarted consumer process acknowledges what its
 * predecessor left (the remedy for a dead consumer without
 * vmmt_pool_release_rank), and some of that was acknowledged already, its
 * slice recycled and its slot given to a newer occupant, which this rank has
 * acknowledged too. The late acknowledgement of the earlier occupant must
 * neither release the newer one early nor take its acknowledgement back (the
 * slice would never be recycled). Found by the soak (tests/soak/soak.c) with
 * the control table in device memory.
 */
#include <string.h>

#include "ctrl.h"
#include "emu.h"
#include "pool_internal.h"
#include "poolfix.h"

/* One slot, so the second publish takes the first one's slot with a newer generation. */
static void late_ack(struct fixture *f, int device_table)
{
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b = bytes(f->src, 4096);
    vmmt_consumer *restarted;
    vmmt_desc first, second;
    vmmt_desc_info i1, i2;
    int st;

    c.max_slices = 1;
    c.device_control_table = device_table;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    put(f, f->src, 4096, 1);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &first));
    assert_vmmt_ok(
        vmmt_consume(f->consumer, &first, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    expect(f, f->dst, 4096, 1);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));

    put(f, f->src, 4096, 2);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &second));
    assert_vmmt_ok(vmmt_desc_inspect(&first, &i1));
    assert_vmmt_ok(vmmt_desc_inspect(&second, &i2));
    assert_int_equal(i1.slot, i2.slot);
    assert_true(i2.generation != i1.generation);
    assert_vmmt_ok(
        vmmt_consume(f->consumer, &second, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    expect(f, f->dst, 4096, 2);

    /* The restarted process: no memory of what was consumed before it. */
    assert_vmmt_ok(vmmt_consumer_create(NULL, &restarted));
    st = vmmt_consumer_ack(restarted, &first, 0, f->stream, VMMT_ALL_RANKS, 0);
    /* Refusing it as stale is right; accepting it is too, if it changes nothing. */
    if (st != VMMT_OK) assert_true(vmmt_last_error()[0] != '\0');
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    /* Failed before the fix on a device control table (XFAIL then): the late
     * acknowledgement stored the earlier generation over the newer occupant's,
     * and the slice was never released (consume.c, check_occupant). */
    st = vmmt_pool_drain(f->pool, 2000);
    vmmt_consumer_destroy(restarted);
    assert_vmmt_ok(st);
}

/* Whether rank 0's acknowledgement word holds the descriptor's generation (emulator or not). */
static int rank0_acked(vmmt_pool *pool, const vmmt_desc *d)
{
    struct vmmt_pool *p = pool;
    vmmt_desc_info i;

    assert_vmmt_ok(vmmt_desc_inspect(d, &i));
    if (!p->host_table) {
        /* The acker's stream write after the copy: read the word where it lands. */
        const struct vmmt_drv *drv = vmmt__drv();
        uint32_t v = 0;
        CUstream s;
        assert_int_equal(drv->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
        assert_int_equal(
            drv->cuMemcpyDtoHAsync(&v, p->ctrl_dev + vmmt__ctrl_ack(0, p->stride, i.slot, 0), 4, s),
            CUDA_SUCCESS);
        assert_int_equal(drv->cuStreamSynchronize(s), CUDA_SUCCESS);
        assert_int_equal(drv->cuStreamDestroy(s), CUDA_SUCCESS);
        return v == i.generation;
    }
    return vmmt__ctrl_load(p->table_host + vmmt__ctrl_ack(0, p->stride, i.slot, 0) / 4) ==
           i.generation;
}

/*
 * The second way: the occupant is still the same, but the predecessor
 * acknowledged it for the rank already. The restarted process's own write
 * would then be a duplicate that the producer does not wait for: it could
 * still be queued on a stream when the slot is recycled, and land after the
 * rank acknowledged the next occupant. The table shows the rank has it, so
 * the descriptor is refused (VMMT_ESTATE) and nothing is written.
 * Two ranks, so that the slot stays in flight while rank 0 is acknowledged twice.
 */
static void duplicate_ack(struct fixture *f, int device_table)
{
    vmmt_pool_config c = config(4 * MiB, 2);
    vmmt_buffer b = bytes(f->src, 4096);
    vmmt_consumer *restarted;
    vmmt_desc first, second;
    long writes;

    c.max_slices = 1;
    c.device_control_table = device_table;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    put(f, f->src, 4096, 1);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &first));
    assert_vmmt_ok(vmmt_consume(f->consumer, &first, 0, f->dst, f->cap, f->stream, 0, 1));
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    /* The acknowledgement is the acker thread's, after the copy's event (a store into a
     * shared table, a stream write into a device table): wait until it is there, as the
     * restarted process would find it. */
    for (int i = 0; i < 5000 && !rank0_acked(f->pool, &first); i++)
        sleep_ms(1);

    assert_vmmt_ok(vmmt_consumer_create(NULL, &restarted));
    writes = vmmt__emu_calls("cuStreamWriteValue32");
    assert_int_equal(vmmt_consumer_ack(restarted, &first, 0, f->stream, 0, 1), VMMT_ESTATE);
    assert_error_contains("already acknowledged, or is being consumed, for rank 0");
    /* Rank 0's word holds the generation already: nothing more is queued for it. */
    assert_int_equal(vmmt__emu_calls("cuStreamWriteValue32"), writes);

    /* Rank 1 completes the slot; the next occupant goes through both ranks as usual. */
    assert_vmmt_ok(vmmt_consumer_ack(f->consumer, &first, 0, f->stream, 1, 1));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 2000));
    put(f, f->src, 4096, 2);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &second));
    assert_vmmt_ok(vmmt_consume(restarted, &second, 0, f->dst, f->cap, f->stream, 0, 1));
    expect(f, f->dst, 4096, 2);
    assert_vmmt_ok(vmmt_consumer_ack(f->consumer, &second, 0, f->stream, 1, 1));
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 2000));
    vmmt_consumer_destroy(restarted);
}

static void test_duplicate_ack_host_table(void **state)
{
    duplicate_ack(*state, 0);
}

static void test_duplicate_ack_device_table(void **state)
{
    duplicate_ack(*state, 1);
}

static void test_late_ack_host_table(void **state)
{
    late_ack(*state, 0);
}

static void test_late_ack_device_table(void **state)
{
    late_ack(*state, 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_late_ack_host_table),
        T(test_late_ack_device_table),
        T(test_duplicate_ack_host_table),
        T(test_duplicate_ack_device_table),
    };
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
