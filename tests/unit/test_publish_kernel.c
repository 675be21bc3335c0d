/*
 * One kernel per small publish (src/producer/publish_kernel.c): which
 * buffers take it, that its bytes and ready word are a publish's like any
 * other, and that every way it can be refused falls back to the copy and
 * the stream write with nothing lost. Runs on the emulator, which runs the
 * library's kernel by its text, and on a GPU (VMMT_TEST_DRIVER=cuda), where
 * the cases that need the emulator's fault injection skip: there the first
 * cases check the real driver's pointer attributes and the real kernel.
 */
#include <stdlib.h>
#include <string.h>

#include "driver.h"
#include "emu.h"
#include "pattern.h"
#include "poolfix.h"
#include "publish_kernel.h"
#include "testutil.h"

static uint64_t kernels(vmmt_pool *p)
{
    return stats(p).kernel_publishes;
}

/* Publish b (its bytes pattern i already at b.ptr), consume it for all ranks, check it. */
static void through(struct fixture *f, vmmt_buffer b, uint32_t i)
{
    vmmt_desc d;

    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    assert_vmmt_ok(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    expect(f, f->dst, b.nbytes, i);
}

static void create(struct fixture *f, vmmt_pool_config *c)
{
    if (pool_kind_host()) skip(); /* a host pool's CPU copy needs no kernel */
    assert_vmmt_ok(vmmt_pool_create(c, &f->pool));
}

/* Every size from one 16-byte word to 64 KiB goes as one kernel, and nothing else is enqueued. */
static void test_small_publish_is_one_kernel(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    const size_t sizes[] = {16, 48, 4096, 65536 - 16, VMMT__KERNEL_MAX_BYTES};
    uint64_t n = 0;

    create(f, &c);
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        long copies = on_emu() ? vmmt__emu_calls("cuMemcpyDtoDAsync") : 0;
        long writes = on_emu() ? vmmt__emu_calls("cuStreamWriteValue32") : 0;
        vmmt_buffer b = bytes(f->src, sizes[k]);
        vmmt_desc d;

        put(f, f->src, sizes[k], (uint32_t)k + 1);
        assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
        assert_int_equal(kernels(f->pool), ++n);
        if (on_emu()) {
            assert_int_equal(vmmt__emu_calls("cuMemcpyDtoDAsync"), copies);
            assert_int_equal(vmmt__emu_calls("cuStreamWriteValue32"), writes);
        }
        assert_vmmt_ok(
            vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
        expect(f, f->dst, sizes[k], (uint32_t)k + 1);
    }
}

/* The ready word in device memory (a device table), and a synchronous hand-off. */
static void test_kernel_with_device_table_and_sync_handoff(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);

    if (pool_kind_elastic()) skip(); /* a device table: fixed device pools only */
    c.device_control_table = 1;
    create(f, &c);
    assert_int_equal(stats(f->pool).host_control_table, 0);
    put(f, f->src, 4096, 7);
    through(f, bytes(f->src, 4096), 7);
    assert_int_equal(kernels(f->pool), 1);
    vmmt_pool_destroy(f->pool);
    c = config(4 * MiB, 1);
    c.handoff = VMMT_HANDOFF_SYNC;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    put(f, f->src, 4096, 8);
    through(f, bytes(f->src, 4096), 8);
    assert_int_equal(kernels(f->pool), 1);
}

/* What the kernel may not read, or should not copy, goes the two-submission way, bytes intact. */
static void test_kernel_refuses_what_it_may_not_read(void **state)
{
    struct fixture *f = *state;
    const struct vmmt_drv *d = vmmt__drv();
    vmmt_pool_config c = config(8 * MiB, 1);
    vmmt_buffer b, two[2];
    vmmt_desc ds[2];
    void *pinned = NULL;

    create(f, &c);
    put(f, f->src, 8192, 1);
    through(f, bytes(f->src, 4100), 1); /* not a whole number of 16-byte words */
    put(f, f->src + 8, 4096, 2);
    through(f, bytes(f->src + 8, 4096), 2); /* not 16-byte aligned */
    put(f, f->src, VMMT__KERNEL_MAX_BYTES + 16, 3);
    through(f, bytes(f->src, VMMT__KERNEL_MAX_BYTES + 16), 3); /* over the kernel's size */
    /* Packed: two members, one slice. */
    put(f, f->src, 8192, 4);
    two[0] = bytes(f->src, 4096);
    two[1] = bytes(f->src + 4096, 4096);
    assert_vmmt_ok(vmmt_publish_packed(f->pool, two, 2, f->stream, ds));
    assert_vmmt_ok(
        vmmt_consume(f->consumer, &ds[0], 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    assert_vmmt_ok(
        vmmt_consume(f->consumer, &ds[1], 0, f->dst + 4096, 4096, f->stream, VMMT_ALL_RANKS, 0));
    expect(f, f->dst, 8192, 4);
    /* Page-locked host memory, once said to be host memory and once (wrongly) device memory:
     * the kernel never reads host memory; the copy engine does, either way. */
    assert_int_equal(d->cuMemAllocHost(&pinned, 4096), CUDA_SUCCESS);
    tu_pattern_fill(pinned, 4096, 5);
    b = bytes((CUdeviceptr)(uintptr_t)pinned, 4096);
    b.location = VMMT_LOC_HOST;
    through(f, b, 5);
    b.location = VMMT_LOC_DEVICE;
    through(f, b, 5);
    assert_int_equal(d->cuMemFreeHost(pinned), CUDA_SUCCESS);
    assert_int_equal(kernels(f->pool), 0);
}

/*
 * A range that runs past the end of its allocation is never given to the
 * kernel (which would fault the context); the copy refuses it, the publish
 * fails cleanly and the pool goes on. Emulator only: on a GPU, what a copy
 * engine does past an allocation is not this test's to find out.
 */
static void test_range_past_its_allocation(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b = bytes(f->src + f->cap - 1024, 4096);
    vmmt_desc d;

    if (!on_emu()) skip();
    create(f, &c);
    assert_int_equal(vmmt_publish(f->pool, &b, f->stream, &d), VMMT_ECUDA);
    assert_error_contains("cuMemcpyDtoDAsync");
    assert_int_equal(vmmt__emu_calls("cuLaunchKernel"), 0);
    assert_int_equal(stats(f->pool).in_flight, 0);
    tu_roundtrip(f, 4096, 9);
    assert_int_equal(kernels(f->pool), 1);
}

/* A source on another device: the copy engine's work, not a kernel on the pool's device. */
static void test_source_on_another_device(void **state)
{
    struct fixture *f = *state;
    const struct vmmt_drv *d = vmmt__drv();
    vmmt_pool_config c = config(4 * MiB, 1);
    CUdeviceptr other = 0;
    CUstream s1 = NULL;
    vmmt_buffer b;
    vmmt_desc ds;
    int count = 0;

    assert_int_equal(d->cuDeviceGetCount(&count), CUDA_SUCCESS);
    if (count < 2) skip();
    create(f, &c);
    assert_vmmt_ok(vmmt__ctx_enter(1));
    assert_int_equal(d->cuMemAlloc(&other, 4096), CUDA_SUCCESS);
    vmmt__ctx_leave();
    put(f, other, 4096, 6);
    through(f, bytes(other, 4096), 6);
    assert_int_equal(kernels(f->pool), 0);
    assert_vmmt_ok(vmmt__ctx_enter(1));
    assert_int_equal(d->cuMemFree(other), CUDA_SUCCESS);
    vmmt__ctx_leave();
    /* A pool of device 1 loads its kernel there, and takes device 1's buffers with it, on a
     * stream of device 1 (a launch into another context is refused: the copies take it). */
    vmmt_pool_destroy(f->pool);
    c.device = 1;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    assert_vmmt_ok(vmmt__ctx_enter(1));
    assert_int_equal(d->cuMemAlloc(&other, 4096), CUDA_SUCCESS);
    assert_int_equal(d->cuStreamCreate(&s1, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
    vmmt__ctx_leave();
    put(f, other, 4096, 10);
    b = bytes(other, 4096);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, s1, &ds));
    assert_int_equal(kernels(f->pool), 1);
    assert_vmmt_ok(vmmt_consume(f->consumer, &ds, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    expect(f, f->dst, 4096, 10);
    assert_vmmt_ok(vmmt__ctx_enter(1));
    assert_int_equal(d->cuStreamSynchronize(s1), CUDA_SUCCESS);
    assert_int_equal(d->cuStreamDestroy(s1), CUDA_SUCCESS);
    assert_int_equal(d->cuMemFree(other), CUDA_SUCCESS);
    vmmt__ctx_leave();
}

/* A driver that refuses the module, or its function: the pool works without, and holds none. */
static void test_driver_refuses_the_kernel(void **state)
{
    struct fixture *f = *state;
    const char *rules[] = {"cuModuleLoadData:1:CUDA_ERROR_INVALID_PTX",
                           "cuModuleGetFunction:1:CUDA_ERROR_NOT_FOUND"};

    if (!on_emu()) skip();
    for (int k = 0; k < 2; k++) {
        vmmt_pool_config c = config(4 * MiB, 1);
        emu_fail(rules[k]);
        create(f, &c);
        emu_reset();
        assert_int_equal(vmmt__emu_live_modules(), 0);
        tu_roundtrip(f, 4096, 11 + (uint32_t)k);
        assert_int_equal(kernels(f->pool), 0);
        assert_int_equal(vmmt__emu_calls("cuLaunchKernel"), 0);
        vmmt_pool_destroy(f->pool);
        f->pool = NULL;
    }
}

/*
 * A refused launch enqueued nothing: the copies carry that publish; the next
 * one launches again (a refusal says nothing of the next stream).
 */
static void test_launch_refused_falls_back(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);

    if (!on_emu()) skip();
    create(f, &c);
    emu_fail("cuLaunchKernel:1:CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES");
    tu_roundtrip(f, 4096, 13);
    assert_int_equal(kernels(f->pool), 0);
    assert_int_equal(vmmt__emu_calls("cuLaunchKernel"), 1);
    assert_int_equal(vmmt__emu_calls("cuMemcpyDtoDAsync"), 2); /* the publish's and the consume's */
    emu_reset();
    tu_roundtrip(f, 4096, 14);
    assert_int_equal(kernels(f->pool), 1);
    assert_int_equal(vmmt__emu_calls("cuMemcpyDtoDAsync"), 1); /* the consume's */
}

/* A stream of another device's context: the launch is refused there, the copies take it. */
static void test_stream_of_another_context(void **state)
{
    struct fixture *f = *state;
    const struct vmmt_drv *d = vmmt__drv();
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b = bytes(f->src, 4096);
    CUstream other = NULL;
    vmmt_desc ds;
    int count = 0;

    assert_int_equal(d->cuDeviceGetCount(&count), CUDA_SUCCESS);
    if (count < 2) skip();
    create(f, &c);
    assert_vmmt_ok(vmmt__ctx_enter(1));
    assert_int_equal(d->cuStreamCreate(&other, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
    vmmt__ctx_leave();
    put(f, f->src, 4096, 17);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, other, &ds));
    assert_int_equal(d->cuStreamSynchronize(other), CUDA_SUCCESS);
    assert_vmmt_ok(vmmt_consume(f->consumer, &ds, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    expect(f, f->dst, 4096, 17);
    assert_int_equal(kernels(f->pool), 0);
    tu_roundtrip(f, 4096, 18);
    assert_int_equal(kernels(f->pool), 1);
    assert_vmmt_ok(vmmt__ctx_enter(1));
    assert_int_equal(d->cuStreamDestroy(other), CUDA_SUCCESS);
    vmmt__ctx_leave();
}

/* Refused launch, then a failed copy: the publish fails, and nothing stays reserved. */
static void test_launch_and_copy_refused_roll_back(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b = bytes(f->src, 4096);
    vmmt_desc d;

    if (!on_emu()) skip();
    create(f, &c);
    emu_fail("cuLaunchKernel:1:CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,"
             "cuMemcpyDtoDAsync:1:CUDA_ERROR_INVALID_VALUE");
    assert_int_equal(vmmt_publish(f->pool, &b, f->stream, &d), VMMT_ECUDA);
    assert_error_contains("cuMemcpyDtoDAsync");
    emu_reset();
    assert_int_equal(stats(f->pool).in_flight, 0);
    tu_roundtrip(f, 4096, 15);
}

/* Queued behind the caller's own work, as the copy is: the consumer waits for the word. */
static void test_kernel_waits_behind_the_callers_work(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b = bytes(f->src, 4096);
    CUstream rank = NULL;
    struct gate g;
    vmmt_desc d;

    create(f, &c);
    if (stats(f->pool).handoff != VMMT_HANDOFF_STREAM) skip();
    assert_int_equal(vmmt__drv()->cuStreamCreate(&rank, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
    put(f, f->src, 4096, 16);
    gate_close(&g, f->stream);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    assert_int_equal(kernels(f->pool), 1);
    gate_open_later(&g, 100);
    /* The consume's own stream waits on the ready word; the bytes are right once it passes. */
    assert_vmmt_ok(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, rank, VMMT_ALL_RANKS, 0));
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(rank), CUDA_SUCCESS);
    expect(f, f->dst, 4096, 16);
    gate_free(&g);
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    assert_int_equal(vmmt__drv()->cuStreamDestroy(rank), CUDA_SUCCESS);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_small_publish_is_one_kernel),
        T(test_kernel_with_device_table_and_sync_handoff),
        T(test_kernel_refuses_what_it_may_not_read),
        T(test_range_past_its_allocation),
        T(test_source_on_another_device),
        T(test_driver_refuses_the_kernel),
        T(test_launch_refused_falls_back),
        T(test_stream_of_another_context),
        T(test_launch_and_copy_refused_roll_back),
        T(test_kernel_waits_behind_the_callers_work),
    };
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
