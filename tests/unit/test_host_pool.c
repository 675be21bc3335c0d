/*
 * Host pools and writing in place: a producer in host memory that needs no
 * GPU, publishes from host or device memory, packed groups mixing both,
 * vmmt_reserve / vmmt_commit / vmmt_cancel on host and device pools, and the
 * emulator's model of host-NUMA allocations. (The transport suites
 * test_pool and test_pool_races run on host pools too: test_*_host.)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "cpu_copy.h"
#include "driver.h"
#include "emu.h"
#include "pattern.h"
#include "poolfix.h"
#include "status.h"
#include "testutil.h"

static vmmt_pool_config host_config(uint64_t size, int consumers)
{
    vmmt_pool_config c = config(size, consumers);
    c.memory_location = VMMT_MEMORY_HOST;
    return c;
}

static vmmt_buffer host_bytes(const void *p, size_t n)
{
    vmmt_buffer b = bytes((CUdeviceptr)(uintptr_t)p, n);
    b.location = VMMT_LOC_HOST;
    return b;
}

static void consume_check(struct fixture *f, const vmmt_desc *d, size_t n, uint32_t i)
{
    assert_vmmt_ok(vmmt_consume(f->consumer, d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    expect(f, f->dst, n, i);
}

/* ------------------------------------------------------- host pools */

static void test_host_publish_from_host_memory(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = host_config(8 * MiB, 1);
    uint8_t *h = malloc(1 * MiB);
    vmmt_pool_stats s;

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    s = stats(f->pool);
    assert_int_equal(s.memory_location, VMMT_MEMORY_HOST);
    assert_int_equal(s.device_bytes, 0);
    assert_int_equal(s.host_bytes, s.allocation_size);
    assert_int_equal(s.handle_type, VMMT_HANDLE_POSIX_FD);
    assert_true(s.host_control_table);
    for (uint32_t i = 0; i < 24; i++) {
        size_t n = 4096 + i * 40961;
        vmmt_buffer b = host_bytes(h, n);
        vmmt_desc d;
        tu_pattern_fill(h, n, i);
        assert_vmmt_ok(vmmt_publish(f->pool, &b, NULL, &d));
        /* The source may change at once: the CPU copy is done when publish returns. */
        memset(h, 0xee, n);
        consume_check(f, &d, n, i);
    }
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_int_equal(stats(f->pool).recycled, 24);
    free(h);
}

/*
 * A large host source is copied by a few threads made for the copy
 * (src/producer/cpu_copy.c): every byte lands, at every size around the
 * split points, before publish returns, and no thread or mapping outlives
 * the call (the fixture's leak check).
 */
static void test_host_large_copy_split(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = host_config(32 * MiB, 1);
    const size_t sizes[] = {2 * MiB - 1,    2 * MiB,      4 * MiB - 1,
                            4 * MiB + 4097, 6 * MiB + 13, 8 * MiB};
    uint8_t *h = malloc(8 * MiB);

    assert_non_null(h);
    assert_int_equal(vmmt__cpu_copy_parts(2 * MiB - 1), 1);
    assert_int_equal(vmmt__cpu_copy_parts(4 * MiB + 4097), 2);
    assert_int_equal(vmmt__cpu_copy_parts(8 * MiB), 4);
    assert_int_equal(vmmt__cpu_copy_parts((size_t)1 << 30), 4);
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    for (uint32_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        vmmt_buffer b = host_bytes(h, sizes[i]);
        vmmt_desc d;
        tu_pattern_fill(h, sizes[i], 40 + i);
        assert_vmmt_ok(vmmt_publish(f->pool, &b, NULL, &d));
        memset(h, 0xee, sizes[i]); /* every part was copied when publish returned */
        consume_check(f, &d, sizes[i], 40 + i);
    }
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    free(h);
}

/* Host and device members in one slice: one ready flag after both kinds of copy. */
static void test_host_packed_mixed_sources(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = host_config(8 * MiB, 1);
    uint8_t *h = malloc(70000);
    vmmt_buffer b[3];
    vmmt_desc d[3];

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    tu_pattern_fill(h, 70000, 1);
    put(f, f->src, 50000, 2);
    b[0] = host_bytes(h, 70000);
    b[1] = bytes(f->src, 50000);
    b[2] = host_bytes(h, 300);
    assert_vmmt_ok(vmmt_publish_packed(f->pool, b, 3, f->stream, d));
    consume_check(f, &d[0], 70000, 1);
    consume_check(f, &d[1], 50000, 2);
    consume_check(f, &d[2], 300, 1);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_int_equal(stats(f->pool).recycled, 1);
    free(h);
}

static void test_host_config_errors(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = host_config(8 * MiB, 1);

    c.handle_type = VMMT_HANDLE_FABRIC;
    assert_int_equal(vmmt_pool_create(&c, &f->pool), VMMT_EINVAL);
    assert_error_contains("handle_type=fabric needs a device pool");
    c = host_config(8 * MiB, 1);
    c.device_control_table = 1;
    assert_int_equal(vmmt_pool_create(&c, &f->pool), VMMT_EINVAL);
    assert_error_contains("device_control_table needs a device pool");
    c = host_config(8 * MiB, 1);
    c.memory_location = (vmmt_memory_location)7;
    assert_int_equal(vmmt_pool_create(&c, &f->pool), VMMT_EINVAL);
    assert_error_contains("memory_location=7");
    c = host_config(4096, 1);
    assert_int_equal(vmmt_pool_create(&c, &f->pool), VMMT_EINVAL);
    assert_error_contains("smaller than CUDA VMM granularity");
    c = host_config(8 * MiB, 1);
    c.device = 99;
    assert_int_equal(vmmt_pool_create(&c, &f->pool), VMMT_ENODEV);
    if (!on_emu()) return;
    c = host_config(8 * MiB, 1);
    c.host_numa_node = 9; /* the emulator has nodes 0-3 */
    assert_int_equal(vmmt_pool_create(&c, &f->pool), VMMT_ECUDA);
    assert_error_contains("host NUMA node 9");
    assert_null(f->pool);
}

/*
 * The point of host pools: a producer process that never makes a context
 * current and holds no device memory, whose buffers a consumer (this
 * process) copies to its device.
 */
static void test_host_producer_process_without_context(void **state)
{
    struct fixture *f = *state;
    char count[16], size[16];
    char *argv[] = {count, size, NULL};
    const size_t n = 300000;
    int sv[2];
    pid_t pid;

    snprintf(count, sizeof count, "%d", 9);
    snprintf(size, sizeof size, "%zu", n);
    assert_int_equal(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
    pid = tu_spawn("host_producer", argv, sv[1]);
    assert_true(pid > 0);
    close(sv[1]);
    for (uint32_t k = 0; k < 100; k++) {
        struct tu_msg m;
        struct tu_reply r;
        vmmt_desc d;
        assert_int_equal(read(sv[0], &m, sizeof m), sizeof m);
        if (m.index == UINT32_MAX) break;
        memcpy(d.bytes, m.desc, sizeof d.bytes);
        consume_check(f, &d, n, m.index);
        /* The slice goes back to the producer only after our copy: drain the stream first. */
        assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
        memset(&r, 0, sizeof r);
        r.index = m.index;
        r.status = VMMT_OK;
        assert_int_equal(write(sv[0], &r, sizeof r), sizeof r);
    }
    assert_int_equal(tu_wait(pid, 30000), 0);
    close(sv[0]);
    /* The producer is gone: its pool is let go here too, once idle (producer_watch.c). */
    for (int i = 0; i < 200 && vmmt_consumer_pool_count(f->consumer) != 0; i++)
        usleep(10000);
    assert_int_equal(vmmt_consumer_pool_count(f->consumer), 0);
}

/* ------------------------------------------------- writing in place */

static void fill_device(struct fixture *f, uint64_t at, size_t n, uint32_t i)
{
    uint8_t *h = malloc(n);
    tu_pattern_fill(h, n, i);
    assert_int_equal(vmmt__drv()->cuMemcpyHtoDAsync(at, h, n, f->stream), CUDA_SUCCESS);
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    free(h);
}

static void reserve_commit_roundtrip(struct fixture *f, int host)
{
    vmmt_reservation r;
    vmmt_buffer shape;
    vmmt_desc d;
    vmmt_desc_info info;

    assert_vmmt_ok(vmmt_reserve(f->pool, 96, &r));
    assert_int_equal(r.nbytes, 96);
    assert_int_equal(r.location, host ? VMMT_LOC_HOST : VMMT_LOC_DEVICE);
    if (host)
        tu_pattern_fill((uint8_t *)(uintptr_t)r.ptr, 96, 5);
    else
        fill_device(f, r.ptr, 96, 5);
    /* Commit fewer bytes than reserved, typed: 2 x 3 float32 = 24 bytes. */
    memset(&shape, 0, sizeof shape);
    shape.nbytes = 24;
    shape.dtype.code = 2;
    shape.dtype.bits = 32;
    shape.dtype.lanes = 1;
    shape.ndim = 2;
    shape.shape[0] = 2, shape.shape[1] = 3;
    assert_vmmt_ok(vmmt_commit(f->pool, &r, &shape, host ? NULL : f->stream, &d));
    assert_vmmt_ok(vmmt_desc_inspect(&d, &info));
    assert_int_equal(info.nbytes, 24);
    assert_int_equal(info.shape[1], 3);
    assert_int_equal(info.memory_location, host ? VMMT_MEMORY_HOST : VMMT_MEMORY_DEVICE);
    assert_int_equal(stats(f->pool).published, 1);
    /* Once only: a second commit, or a cancel that finds it committed, changes nothing. */
    assert_int_equal(vmmt_commit(f->pool, &r, NULL, NULL, &d), VMMT_ESTATE);
    assert_error_contains("already committed or cancelled");
    consume_check(f, &d, 24, 5);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_int_equal(stats(f->pool).recycled, 1);
}

static void test_reserve_commit_device_pool(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(8 * MiB, 1);

    c.memory_location = VMMT_MEMORY_DEVICE;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    reserve_commit_roundtrip(f, 0);
}

static void test_reserve_commit_host_pool(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = host_config(8 * MiB, 1);

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    reserve_commit_roundtrip(f, 1);
}

static void test_reserve_cancel_and_misuse(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_reservation r, r2, other;
    vmmt_buffer big;
    vmmt_desc d;
    uint64_t data;

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    data = stats(f->pool).data_bytes;
    assert_int_equal(vmmt_reserve(f->pool, 0, &r), VMMT_EINVAL);
    assert_int_equal(vmmt_reserve(f->pool, data + 1, &r), VMMT_ETOOBIG);
    /* The whole data region, reserved and given back, can be reserved again. */
    assert_vmmt_ok(vmmt_reserve(f->pool, data, &r));
    assert_int_equal(vmmt_reserve(f->pool, 4096, &r2), VMMT_EFULL);
    assert_vmmt_ok(vmmt_cancel(f->pool, &r.token));
    assert_vmmt_ok(vmmt_cancel(f->pool, &r.token)); /* idempotent */
    assert_int_equal(stats(f->pool).cancelled, 1);
    assert_int_equal(vmmt_commit(f->pool, &r, NULL, NULL, &d), VMMT_ESTATE);
    assert_vmmt_ok(vmmt_reserve(f->pool, data, &r2));
    /* A token from before is stale even though its slot is reserved again. */
    assert_int_equal(vmmt_commit(f->pool, &r, NULL, NULL, &d), VMMT_ESTATE);
    memset(&big, 0, sizeof big);
    big.nbytes = data + 1;
    assert_int_equal(vmmt_commit(f->pool, &r2, &big, NULL, &d), VMMT_EINVAL);
    assert_error_contains("into a reservation of");
    /* A forged token for another pool. */
    other = r2;
    other.token.bytes[0] ^= 0xff;
    assert_int_not_equal(vmmt_commit(f->pool, &other, NULL, NULL, &d), VMMT_OK);
    assert_int_equal(vmmt_commit(f->pool, NULL, NULL, NULL, &d), VMMT_EINVAL);
    assert_vmmt_ok(vmmt_cancel(f->pool, &r2.token));
    assert_int_equal(stats(f->pool).in_flight, 0);
}

/* Shutdown does not wait for a reservation nobody commits. */
static void test_shutdown_with_open_reservation(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = host_config(4 * MiB, 1);
    vmmt_reservation r;
    vmmt_desc d;

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    assert_vmmt_ok(vmmt_reserve(f->pool, 1000, &r));
    assert_vmmt_ok(vmmt_pool_shutdown(f->pool));
    assert_int_equal(vmmt_commit(f->pool, &r, NULL, NULL, &d), VMMT_ECLOSED);
}

/* ------------------------------------------------------------ the CLI */

static void expect_in(const char *hay, const char *needle)
{
    if (strstr(hay, needle) == NULL) fail_msg("output lacks \"%s\":\n%s", needle, hay);
}

static void test_demo_host_and_elastic(void **state)
{
    const char *host[] = {"demo", "--host", "--driver", "emu", "--count",
                          "12",   "--size", "300K",     NULL};
    const char *elastic[] = {"demo", "--elastic", "--driver", "emu", "--count", "12", NULL};
    const char *both[] = {"demo", "--host", "--elastic", "--driver", "emu", NULL};
    static char out[16384];

    (void)state;
    assert_int_equal(tu_run_tool(NULL, host, out, sizeof out), 0);
    expect_in(out, "pool: host memory");
    expect_in(out, "device memory held by the pool: 0 bytes, no CUDA context made");
    expect_in(out, "result: OK");
    assert_int_equal(tu_run_tool(NULL, elastic, out, sizeof out), 0);
    expect_in(out, "elastic: ");
    expect_in(out, "result: OK");
    assert_int_not_equal(tu_run_tool(NULL, both, out, sizeof out), 0);
    expect_in(out, "--host and --elastic exclude each other");
}

/* ------------------------------------------------- emulator model */

static void test_emu_host_numa_model(void **state)
{
    const struct vmmt_drv *d = vmmt__drv();
    CUmemAllocationProp prop;
    CUmemAccessDesc a;
    CUmemGenericAllocationHandle h;
    CUdeviceptr va;
    size_t g = 0;
    unsigned long long before;

    (void)state;
    if (!on_emu()) skip();
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    /* Plain HOST with POSIX_FD is refused, as on the H200. */
    prop.location.type = CU_MEM_LOCATION_TYPE_HOST;
    assert_int_equal(d->cuMemCreate(&h, 2 * MiB, &prop, 0), CUDA_ERROR_INVALID_VALUE);
    prop.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    assert_int_equal(d->cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                     CUDA_SUCCESS);
    before = vmmt__emu_device_bytes();
    assert_int_equal(d->cuMemCreate(&h, g, &prop, 0), CUDA_SUCCESS);
    assert_int_equal(vmmt__emu_device_bytes(), before); /* host memory is no device's */
    assert_true(vmmt__emu_host_numa_bytes() >= g);
    assert_int_equal(d->cuMemAddressReserve(&va, g, g, 0, 0), CUDA_SUCCESS);
    assert_int_equal(d->cuMemMap(va, g, 0, h, 0), CUDA_SUCCESS);
    memset(&a, 0, sizeof a);
    a.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    a.location.id = 0;
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    assert_int_equal(d->cuMemSetAccess(va, g, &a, 1), CUDA_SUCCESS);
    memset((void *)(uintptr_t)va, 0x5a, 64); /* the CPU may write it now */
    assert_int_equal(d->cuMemUnmap(va, g), CUDA_SUCCESS);
    assert_int_equal(d->cuMemRelease(h), CUDA_SUCCESS);
    /* Device memory is never the CPU's to access. */
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    assert_int_equal(d->cuMemCreate(&h, g, &prop, 0), CUDA_SUCCESS);
    assert_int_equal(d->cuMemMap(va, g, 0, h, 0), CUDA_SUCCESS);
    assert_int_equal(d->cuMemSetAccess(va, g, &a, 1), CUDA_ERROR_INVALID_VALUE);
    assert_int_equal(d->cuMemUnmap(va, g), CUDA_SUCCESS);
    assert_int_equal(d->cuMemRelease(h), CUDA_SUCCESS);
    assert_int_equal(d->cuMemAddressFree(va, g), CUDA_SUCCESS);
    assert_int_equal(vmmt__emu_host_numa_bytes(), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_host_publish_from_host_memory),
        T(test_host_packed_mixed_sources),
        T(test_host_large_copy_split),
        T(test_host_config_errors),
        T(test_host_producer_process_without_context),
        T(test_reserve_commit_device_pool),
        T(test_reserve_commit_host_pool),
        T(test_reserve_cancel_and_misuse),
        T(test_shutdown_with_open_reservation),
        T(test_emu_host_numa_model),
        cmocka_unit_test(test_demo_host_and_elastic),
    };
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
