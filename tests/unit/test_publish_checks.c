/*
 * Issue 8, defects 1 and 7: publish and every reader run one validator.
 *
 * Before the fix, vmmt_publish accepted buffers whose descriptors inspect,
 * consume, ack and cancel all refused with VMMT_EPROTO (dtype.lanes 0, a
 * sub-byte tensor with an odd element count, an untyped buffer with a dtype
 * code or a negative dimension, an element count that overflows), and the
 * slice stayed in flight until the pool was destroyed. test_refused_buffers
 * and test_random_buffers_one_validator failed then; test_pool_check_flags
 * failed because a descriptor with STREAM_ORDERED cleared was consumed.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "desc.h"
#include "driver.h"
#include "poolfix.h"
#include "status.h"
#include "testutil.h"

static vmmt_buffer typed(CUdeviceptr p, uint64_t n, uint8_t code, uint8_t bits, uint16_t lanes,
                         int ndim, const int64_t *shape)
{
    vmmt_buffer b = bytes(p, n);
    b.dtype.code = code;
    b.dtype.bits = bits;
    b.dtype.lanes = lanes;
    b.ndim = ndim;
    for (int i = 0; i < ndim; i++)
        b.shape[i] = shape[i];
    return b;
}

/* Refused with VMMT_EINVAL naming the field, and nothing reserved. */
static void expect_refused(struct fixture *f, const vmmt_buffer *b, const char *text)
{
    vmmt_desc d;
    vmmt_pool_stats before = stats(f->pool), after;

    assert_int_equal(vmmt_publish(f->pool, b, f->stream, &d), VMMT_EINVAL);
    assert_error_contains(text);
    assert_error_contains("consumers would refuse this descriptor");
    after = stats(f->pool);
    assert_int_equal(after.in_flight, before.in_flight);
    assert_int_equal(after.published, before.published);
    assert_int_equal(after.full, before.full);
}

static void test_refused_buffers(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    const int64_t s3[] = {3}, s2x4[] = {2, 4}, neg[] = {-1}, huge[] = {(1ll << 61) + 1};
    vmmt_buffer b;
    vmmt_desc d;
    vmmt_desc_info info;

    c.max_slices = 4;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));

    /* A designated initializer leaves lanes 0. */
    b = typed(f->src, 32, 2, 32, 0, 2, s2x4);
    expect_refused(f, &b, "dtype_lanes=0 with dtype_bits=32");
    /* int4 x 3: 12 bits, which is 2 bytes (publish used to round down to 1). */
    b = typed(f->src, 1, 0, 4, 1, 1, s3);
    expect_refused(f, &b, "nbytes=1 does not match shape [3]");
    /* Untyped bytes with a dtype code, or with a negative dimension. */
    b = typed(f->src, 16, 2, 0, 0, 0, NULL);
    expect_refused(f, &b, "dtype_bits=0 (untyped bytes) but dtype_code=2");
    b = typed(f->src, 16, 0, 0, 0, 1, neg);
    expect_refused(f, &b, "shape[0]=-1 is negative");
    b = typed(f->src, 16, 0, 0, 1, 0, NULL);
    expect_refused(f, &b, "dtype_lanes=1 are not 0");
    /* (2^61 + 1) bytes of uint8 x 8 lanes: 2^64 + 8 bits wrapped to 1 byte before. */
    b = typed(f->src, 1, 1, 8, 8, 1, huge);
    expect_refused(f, &b, "overflows 64 bits");
    /* A member of a packed publish: the index says which. */
    {
        vmmt_buffer two[2] = {bytes(f->src, 64), typed(f->src, 32, 2, 32, 0, 2, s2x4)};
        vmmt_desc out[2];
        assert_int_equal(vmmt_publish_packed(f->pool, two, 2, f->stream, out), VMMT_EINVAL);
        assert_error_contains("buffer 1");
        assert_error_contains("dtype_lanes=0");
    }

    /* Every slot is still free: four publishes fit, and every reader accepts them. */
    for (int i = 0; i < 4; i++) {
        b = typed(f->src, 2, 0, 4, 1, 1, s3); /* the int4 x 3 tensor, as 2 bytes */
        assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
        assert_vmmt_ok(vmmt_desc_inspect(&d, &info));
        assert_int_equal(info.nbytes, 2);
        assert_vmmt_ok(
            vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    }
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_int_equal(stats(f->pool).full, 0);
}

#define rnd tu_rand

static int64_t pick_dim(void)
{
    switch (rnd() % 8) {
    case 0: return -(int64_t)(rnd() % 4) - 1;
    case 1: return 0;
    case 2: return (int64_t)(rnd() >> 1); /* huge */
    default: return (int64_t)(rnd() % 9);
    }
}

/*
 * The property: whatever the buffer, publish either refuses it (EINVAL or
 * ETOOBIG) with nothing reserved, or hands out descriptors that inspect
 * accepts and the consumer acknowledges. 3000 random buffers.
 */
static void test_random_buffers_one_validator(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    const uint8_t bits_choice[] = {0, 1, 2, 4, 6, 8, 16, 32, 64, 128, 255};
    int accepted = 0, refused = 0;

    c.max_slices = 8;
    tu_rand_seed(0x9e3779b97f4a7c15ull);
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    for (int iter = 0; iter < 3000; iter++) {
        vmmt_buffer b;
        vmmt_desc d;
        vmmt_desc_info info;
        uint64_t elems = 1, bits;
        int st, exact = 1;

        memset(&b, 0, sizeof b);
        b.ptr = f->src;
        b.dtype.code = (uint8_t)(rnd() % 3 == 0 ? rnd() % 8 : 0);
        b.dtype.bits = bits_choice[rnd() % sizeof bits_choice];
        b.dtype.lanes = (uint16_t)(rnd() % 4 == 0 ? rnd() % 3 : 1);
        b.ndim = (int)(rnd() % 4);
        for (int k = 0; k < b.ndim; k++)
            b.shape[k] = pick_dim();
        /* nbytes: usually the exact size (rounded up, down, or off by one), else random. */
        for (int k = 0; k < b.ndim; k++) {
            if (b.shape[k] < 0 || (b.shape[k] > 0 && elems > UINT64_MAX / (uint64_t)b.shape[k]))
                exact = 0;
            else
                elems *= (uint64_t)b.shape[k];
        }
        bits = (uint64_t)b.dtype.bits * b.dtype.lanes;
        if (exact && bits != 0 && elems <= UINT64_MAX / bits) {
            uint64_t n = elems * bits;
            switch (rnd() % 4) {
            case 0: b.nbytes = n / 8; break;
            case 1: b.nbytes = n / 8 + 1; break;
            default: b.nbytes = (n + 7) / 8; break;
            }
        } else {
            b.nbytes = rnd() % 5000;
        }
        if (b.nbytes > f->cap) b.nbytes = 1 + rnd() % 64;

        st = vmmt_publish(f->pool, &b, f->stream, &d);
        if (st != VMMT_OK) {
            if (st != VMMT_EINVAL && st != VMMT_ETOOBIG)
                fail_msg("iteration %d: publish -> %d: %s", iter, st, vmmt_last_error());
            assert_int_equal(stats(f->pool).in_flight, 0);
            refused++;
            continue;
        }
        if (vmmt_desc_inspect(&d, &info) != VMMT_OK)
            fail_msg("iteration %d: published, yet inspect refuses: %s", iter, vmmt_last_error());
        assert_vmmt_ok(vmmt_consumer_ack(f->consumer, &d, 0, f->stream, VMMT_ALL_RANKS, 0));
        assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
        accepted++;
    }
    /* Both sides were exercised. */
    assert_true(accepted > 300);
    assert_true(refused > 300);
}

/*
 * Defect 7: a descriptor of an imported pool with STREAM_ORDERED cleared
 * (which would skip the wait for the ready word) is refused by consume.
 */
static void test_pool_check_flags(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b = bytes(f->src, 4096);
    struct vmmt__desc raw;
    vmmt_desc d, forged;

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    tu_roundtrip(f, 4096, 1); /* imports the pool */
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    assert_vmmt_ok(vmmt__desc_decode(d.bytes, &raw));
    assert_true(raw.flags & VMMT__DESC_STREAM_ORDERED);
    raw.flags &= ~VMMT__DESC_STREAM_ORDERED;
    vmmt__desc_encode(&raw, forged.bytes);
    reseal(f->pool, &forged); /* a key holder's forgery reaches the check behind the seal */
    assert_int_equal(
        vmmt_consume(f->consumer, &forged, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0),
        VMMT_EPROTO);
    assert_error_contains("flags=0x4 differs from the imported pool's flags=0x5");
    assert_int_equal(vmmt_cancel(f->pool, &forged), VMMT_EPROTO);
    /* The real one still goes through. */
    assert_vmmt_ok(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_refused_buffers),
        T(test_random_buffers_one_validator),
        T(test_pool_check_flags),
    };
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
