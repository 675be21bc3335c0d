/*
 * What the group exchange assumes of the driver when it walks a buffer
 * (src/group/group_reg.c), checked on the emulator here and on the real driver by
 * tests/gpu/run (VMMT_TEST_DRIVER=cuda): cuMemGetAddressRange gives each
 * cuMemMap'ed allocation as its own range even when several sit side by side
 * in one reservation; cuMemRetainAllocationHandle at any address inside gives
 * the allocation's handle back (the value cuMemCreate gave, which is how the
 * group recognises an allocation it shared already), each retain released
 * once; the properties name the handle types and device; cuMemAlloc memory
 * has a range but no handle.
 */
#include <stdlib.h>
#include <string.h>

#include "driver.h"
#include "emu.h"
#include "testutil.h"
#include "vmm.h"

static int on_emu(void)
{
    return strcmp(vmmt_driver_name(), "emu") == 0;
}

static void test_side_by_side_allocations(void **state)
{
    const struct vmmt_drv *d;
    CUmemGenericAllocationHandle h[3], r1, r2;
    CUmemAllocationProp prop;
    CUdeviceptr base, b;
    size_t g, rec, size;
    int allocs0 = 0;

    (void)state;
    assert_vmmt_ok(vmmt__granularity(0, VMMT_HANDLE_POSIX_FD, &g, &rec));
    assert_vmmt_ok(vmmt__ctx_enter(0));
    d = vmmt__drv();
    if (on_emu()) allocs0 = vmmt__emu_live_allocations();
    vmmt__prop_init(&prop, 0, VMMT_HANDLE_POSIX_FD, 0);
    for (int i = 0; i < 3; i++)
        assert_int_equal(d->cuMemCreate(&h[i], g, &prop, 0), CUDA_SUCCESS);
    assert_int_equal(d->cuMemAddressReserve(&base, 3 * g, 0, 0, 0), CUDA_SUCCESS);
    for (int i = 0; i < 3; i++)
        assert_int_equal(d->cuMemMap(base + i * g, g, 0, h[i], 0), CUDA_SUCCESS);
    assert_vmmt_ok(vmmt__grant_rw(base, 3 * g, 0));

    for (int i = 0; i < 3; i++) {
        b = 0;
        size = 0;
        assert_int_equal(d->cuMemGetAddressRange(&b, &size, base + i * g + 5), CUDA_SUCCESS);
        assert_true(b == base + i * g);
        assert_int_equal(size, g);
        /* Inside the allocation, not at its start: still its handle. */
        assert_int_equal(d->cuMemRetainAllocationHandle(&r1, (void *)(uintptr_t)(b + 7)),
                         CUDA_SUCCESS);
        assert_true(r1 == h[i]);
        assert_int_equal(d->cuMemRelease(r1), CUDA_SUCCESS);
    }
    assert_int_not_equal(d->cuMemGetAddressRange(&b, &size, base + 3 * g + 5), CUDA_SUCCESS);

    /* The creator lets go; a retained handle keeps it alive and usable. */
    assert_int_equal(d->cuMemRetainAllocationHandle(&r1, (void *)(uintptr_t)(base + g)),
                     CUDA_SUCCESS);
    assert_int_equal(d->cuMemRetainAllocationHandle(&r2, (void *)(uintptr_t)(base + g)),
                     CUDA_SUCCESS);
    assert_true(r1 == r2);
    for (int i = 0; i < 3; i++)
        assert_int_equal(d->cuMemRelease(h[i]), CUDA_SUCCESS);
    memset(&prop, 0, sizeof prop);
    assert_int_equal(d->cuMemGetAllocationPropertiesFromHandle(&prop, r1), CUDA_SUCCESS);
    assert_true(prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    assert_int_equal(prop.location.type, CU_MEM_LOCATION_TYPE_DEVICE);
    assert_int_equal(prop.location.id, 0);
    assert_int_equal(d->cuMemRelease(r1), CUDA_SUCCESS);
    assert_int_equal(d->cuMemRelease(r2), CUDA_SUCCESS);
    /* Only the mappings hold the memory now. */
    assert_int_equal(d->cuMemsetD8Async(base, 0x5a, 3 * g, NULL), CUDA_SUCCESS);
    assert_int_equal(d->cuStreamSynchronize(NULL), CUDA_SUCCESS);
    for (int i = 0; i < 3; i++)
        assert_int_equal(d->cuMemUnmap(base + i * g, g), CUDA_SUCCESS);
    assert_int_equal(d->cuMemAddressFree(base, 3 * g), CUDA_SUCCESS);
    if (on_emu()) assert_int_equal(vmmt__emu_live_allocations(), allocs0);
    vmmt__ctx_leave();
}

static void test_plain_device_memory(void **state)
{
    const struct vmmt_drv *d;
    CUmemGenericAllocationHandle h;
    CUdeviceptr p, b;
    size_t size;

    (void)state;
    assert_vmmt_ok(vmmt__ctx_enter(0));
    d = vmmt__drv();
    assert_int_equal(d->cuMemAlloc(&p, 1 << 20), CUDA_SUCCESS);
    assert_int_equal(d->cuMemGetAddressRange(&b, &size, p + 100), CUDA_SUCCESS);
    assert_true(b == p);
    assert_true(size >= (1 << 20));
    /* Not VMM memory: no handle, which the group reports as such. */
    assert_int_not_equal(d->cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)p), CUDA_SUCCESS);
    assert_int_equal(d->cuMemFree(p), CUDA_SUCCESS);
    vmmt__ctx_leave();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_side_by_side_allocations),
        cmocka_unit_test(test_plain_device_memory),
    };
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
