/*
 * The consumer's import cache: eviction never unmaps a pool under a copy
 * still queued out of it, teardown that fails can be retried, pools of dead
 * producers are let go. Runs on the emulator (and on a GPU with
 * VMMT_TEST_DRIVER=cuda, where the cases that need fault injection skip).
 */
#include <pthread.h>
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

static vmmt_consumer *one_pool_consumer(void)
{
    vmmt_consumer_config cc;
    vmmt_consumer *c;

    vmmt_consumer_config_init(&cc);
    cc.max_pools = 1;
    assert_vmmt_ok(vmmt_consumer_create(&cc, &c));
    return c;
}

/*
 * Caught (issue 8, defect 2): with max_pools reached, importing another pool
 * evicted one whose copy was still queued (a packed member consumed, the rest
 * of its group not yet): the queued copy read unmapped memory, and the
 * group's progress was lost.
 */
static void test_no_eviction_under_queued_copy(void **state)
{
    struct fixture *f = *state;
    const struct vmmt_drv *d = vmmt__drv();
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_consumer *one = one_pool_consumer();
    vmmt_pool *second;
    vmmt_buffer b[2] = {bytes(f->src, 4096), bytes(f->src + 8192, 4096)};
    vmmt_desc pd[2], other;
    CUstream s2;
    struct gate g;

    put(f, b[0].ptr, 4096, 10);
    put(f, b[1].ptr, 4096, 11);
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    assert_vmmt_ok(vmmt_pool_create(&c, &second));
    assert_int_equal(d->cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
    assert_vmmt_ok(vmmt_publish_packed(f->pool, b, 2, f->stream, pd));
    assert_int_equal(d->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    gate_close(&g, f->stream); /* the member's copy stays queued */
    assert_vmmt_ok(vmmt_consume(one, &pd[0], 0, f->dst, 8192, f->stream, VMMT_ALL_RANKS, 0));
    assert_vmmt_ok(vmmt_publish(second, &b[0], s2, &other));
    assert_vmmt_ok(vmmt_consume(one, &other, 0, f->dst + 65536, 8192, s2, VMMT_ALL_RANKS, 0));
    assert_int_equal(d->cuStreamSynchronize(s2), CUDA_SUCCESS);
    gate_open_later(&g, 20);
    gate_free(&g); /* the stream must have run its copy out of a mapped pool */
    expect(f, f->dst, 4096, 10);
    /* The group's progress survived: the second member completes it. */
    assert_vmmt_ok(vmmt_consume(one, &pd[1], 0, f->dst + 8192, 8192, f->stream, VMMT_ALL_RANKS, 0));
    expect(f, f->dst + 8192, 4096, 11);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_int_equal(stats(f->pool).recycled, 1);
    assert_vmmt_ok(vmmt_pool_drain(second, 5000));
    vmmt_consumer_destroy(one);
    vmmt_pool_destroy(second);
    d->cuStreamDestroy(s2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_no_eviction_under_queued_copy),
    };
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
