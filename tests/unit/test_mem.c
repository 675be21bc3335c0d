/*
 * The public device-memory helpers (vmmt_mem_*) and publishing from host
 * memory (vmmt_buffer.location = VMMT_LOC_HOST), pageable and pinned.
 * Runs on the emulator, and on a GPU with VMMT_TEST_DRIVER=cuda (cases that
 * count the emulator's calls or inject failures skip there).
 */
#include <stdlib.h>
#include <string.h>

#include "driver.h"
#include "emu.h"
#include "pattern.h"
#include "poolfix.h"
#include "testutil.h"

/* ------------------------------------------------------ vmmt_mem_* */

static void test_mem_alloc_copy_free(void **state)
{
    struct fixture *f = *state;
    const size_t n = 100000;
    uint8_t *h = malloc(n), *back = calloc(1, n);
    uint64_t a = 0, b = 0;
    int blocks = on_emu() ? vmmt__emu_live_blocks() : 0;

    tu_pattern_fill(h, n, 5);
    assert_vmmt_ok(vmmt_mem_alloc(0, n, &a));
    assert_vmmt_ok(vmmt_mem_alloc(0, n, &b));
    assert_true(a != 0 && b != 0 && a != b);
    if (on_emu()) assert_int_equal(vmmt__emu_live_blocks(), blocks + 2);
    /* host -> device -> device -> host, on a stream and on the NULL stream */
    assert_vmmt_ok(vmmt_mem_copy(0, a, (uint64_t)(uintptr_t)h, n, f->stream));
    assert_vmmt_ok(vmmt_mem_copy(0, b, a, n, f->stream));
    assert_vmmt_ok(vmmt_mem_copy(0, (uint64_t)(uintptr_t)back, b, n, f->stream));
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    assert_int_equal(tu_pattern_check(back, n, 5), n);
    memset(back, 0, n);
    assert_vmmt_ok(vmmt_mem_copy(0, (uint64_t)(uintptr_t)back, a, n, NULL));
    assert_int_equal(tu_pattern_check(back, n, 5), n);
    assert_vmmt_ok(vmmt_mem_copy(0, a, b, 0, NULL)); /* nothing to do */
    assert_vmmt_ok(vmmt_mem_free(0, a));
    assert_vmmt_ok(vmmt_mem_free(0, b));
    assert_vmmt_ok(vmmt_mem_free(0, 0));
    if (on_emu()) assert_int_equal(vmmt__emu_live_blocks(), blocks);
    free(h);
    free(back);
}

static void test_mem_errors(void **state)
{
    uint64_t p = 1;
    int count = 0;

    (void)state;
    assert_int_equal(vmmt_mem_alloc(0, 0, &p), VMMT_EINVAL);
    assert_error_contains("nbytes=0");
    assert_int_equal(p, 0);
    assert_int_equal(vmmt_mem_alloc(0, 16, NULL), VMMT_EINVAL);
    assert_vmmt_ok(vmmt_device_count(&count));
    assert_int_equal(vmmt_mem_alloc(count, 16, &p), VMMT_ENODEV);
    assert_error_contains("vmmt_mem_alloc(16 bytes on device");
    assert_error_contains("does not exist");
    assert_int_equal(vmmt_mem_alloc(-1, 16, &p), VMMT_ENODEV);
    assert_int_equal(vmmt_mem_copy(0, 0, 4096, 16, NULL), VMMT_EINVAL);
    assert_error_contains("destination pointer is NULL");
    assert_int_equal(vmmt_mem_copy(0, 4096, 0, 16, NULL), VMMT_EINVAL);
    assert_error_contains("source pointer is NULL");
    /* Freeing something that was never allocated, or twice, is refused with a reason. */
    assert_vmmt_ok(vmmt_mem_alloc(0, 64, &p));
    assert_vmmt_ok(vmmt_mem_free(0, p));
    assert_int_not_equal(vmmt_mem_free(0, p), VMMT_OK);
    assert_error_contains("pass a pointer vmmt_mem_alloc gave on that device, once");
}

static void test_mem_alloc_failure(void **state)
{
    uint64_t p = 1;

    (void)state;
    if (!on_emu()) skip();
    emu_fail("cuMemAlloc:1:CUDA_ERROR_OUT_OF_MEMORY");
    assert_int_equal(vmmt_mem_alloc(0, 4096, &p), VMMT_ENOMEM);
    assert_error_contains("cuMemAlloc(4096 bytes on device 0)");
    assert_error_contains("CUDA_ERROR_OUT_OF_MEMORY");
    assert_int_equal(vmmt_last_cuda_error(), CUDA_ERROR_OUT_OF_MEMORY);
    assert_int_equal(p, 0);
    emu_fail("cuMemcpyAsync:1:CUDA_ERROR_INVALID_VALUE");
    assert_int_equal(vmmt_mem_copy(0, 4096, 8192, 16, NULL), VMMT_ECUDA);
    assert_error_contains("cuMemcpyAsync(16 bytes");
}

/* ------------------------------------------------ publish from host */

static vmmt_buffer host_bytes(const void *p, size_t n)
{
    vmmt_buffer b = bytes((CUdeviceptr)(uintptr_t)p, n);
    b.location = VMMT_LOC_HOST;
    return b;
}

/*
 * A pageable source may be reused as soon as publish returns. Caught before
 * the fix: the emulator's stream copies later, so without the publish's
 * synchronize the consumer read the overwritten bytes.
 */
static void test_publish_pageable_host(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(8 * MiB, 1);
    const size_t n = 3 * 4099;
    uint8_t *h = malloc(n);
    vmmt_desc d;
    vmmt_desc_info info;
    vmmt_buffer b = host_bytes(h, n);

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    for (uint32_t i = 0; i < 8; i++) {
        struct gate g;
        tu_pattern_fill(h, n, i);
        b.ptr = (CUdeviceptr)(uintptr_t)h;
        /* Keep the stream busy, so an unsynchronized copy would run late. */
        gate_close(&g, f->stream);
        gate_open_later(&g, 20);
        assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
        memset(h, 0xee, n); /* the caller reuses its memory at once */
        gate_free(&g);
        assert_vmmt_ok(vmmt_desc_inspect(&d, &info));
        assert_int_equal(info.nbytes, n);
        assert_vmmt_ok(
            vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
        expect(f, f->dst, n, i);
    }
    free(h);
}

/* Pinned host memory stays stream-ordered: no synchronize in the publish. */
static void test_publish_pinned_host_is_stream_ordered(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(8 * MiB, 1);
    const size_t n = 65536;
    void *h = NULL;
    long syncs;
    vmmt_desc d;
    vmmt_buffer b;

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    assert_int_equal(vmmt__drv()->cuMemAllocHost(&h, n), CUDA_SUCCESS);
    tu_pattern_fill(h, n, 9);
    b = host_bytes(h, n);
    syncs = on_emu() ? vmmt__emu_calls("cuStreamSynchronize") : 0;
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    if (on_emu() && stats(f->pool).handoff == VMMT_HANDOFF_STREAM)
        assert_int_equal(vmmt__emu_calls("cuStreamSynchronize"), syncs);
    assert_vmmt_ok(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    expect(f, f->dst, n, 9);
    assert_int_equal(vmmt__drv()->cuMemFreeHost(h), CUDA_SUCCESS);
}

/* Device and host members in one packed publish, with dtype and shape kept. */
static void test_packed_device_and_host(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(8 * MiB, 1);
    uint8_t *h = malloc(4000);
    vmmt_buffer bufs[2];
    vmmt_desc d[2];
    vmmt_desc_info info;

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    put(f, f->src, 5000, 1);
    tu_pattern_fill(h, 4000, 2);
    bufs[0] = bytes(f->src, 5000);
    bufs[1] = host_bytes(h, 4000);
    bufs[1].dtype = (vmmt_dtype){2, 32, 1};
    bufs[1].ndim = 2;
    bufs[1].shape[0] = 10;
    bufs[1].shape[1] = 100;
    assert_vmmt_ok(vmmt_publish_packed(f->pool, bufs, 2, f->stream, d));
    memset(h, 0, 4000);
    assert_vmmt_ok(vmmt_desc_inspect(&d[1], &info));
    assert_int_equal(info.ndim, 2);
    assert_int_equal(info.shape[1], 100);
    assert_int_equal(info.pack_count, 2);
    assert_vmmt_ok(
        vmmt_consume(f->consumer, &d[0], 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    expect(f, f->dst, 5000, 1);
    assert_vmmt_ok(
        vmmt_consume(f->consumer, &d[1], 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    expect(f, f->dst, 4000, 2);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    free(h);
}

static void test_location_errors(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(8 * MiB, 1);
    vmmt_buffer b = bytes(f->src, 4096);
    vmmt_desc d;

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    b.location = 7;
    assert_int_equal(vmmt_publish(f->pool, &b, f->stream, &d), VMMT_EINVAL);
    assert_error_contains("location=7");
    b.location = VMMT_LOC_HOST; /* but it is device memory */
    assert_int_equal(vmmt_publish(f->pool, &b, f->stream, &d), VMMT_EINVAL);
    assert_error_contains("is device memory; set location to VMMT_LOC_DEVICE");
    /* Nothing stays reserved after a refused publish. */
    assert_int_equal(stats(f->pool).in_flight, 0);
    b.location = VMMT_LOC_DEVICE;
    tu_roundtrip(f, 4096, 3);
}

/* A failed host copy gives the slice back, like a failed device copy. */
static void test_failed_host_copy_rolls_back(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(8 * MiB, 1);
    uint8_t h[512];
    vmmt_buffer b = host_bytes(h, sizeof h);
    vmmt_desc d;

    if (!on_emu()) skip();
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    memset(h, 1, sizeof h);
    emu_fail("cuMemcpyHtoDAsync:1:CUDA_ERROR_INVALID_VALUE");
    assert_int_equal(vmmt_publish(f->pool, &b, f->stream, &d), VMMT_ECUDA);
    assert_error_contains("cuMemcpyHtoDAsync(512 bytes of buffer 0 into the pool)");
    assert_int_equal(stats(f->pool).in_flight, 0);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    assert_int_equal(stats(f->pool).published, 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_mem_alloc_copy_free),
        T(test_mem_errors),
        T(test_mem_alloc_failure),
        T(test_publish_pageable_host),
        T(test_publish_pinned_host_is_stream_ordered),
        T(test_packed_device_and_host),
        T(test_location_errors),
        T(test_failed_host_copy_rolls_back),
    };
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
