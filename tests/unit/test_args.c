/*
 * Issue 8, defect 9: every public call checks its arguments. Each function
 * of vmmt.h is called with every NULL and sentinel argument it takes; none
 * may crash, each failing one says VMMT_EINVAL (or its documented answer),
 * and the pool and consumer keep working afterwards.
 *
 * Before the fix these crashed: vmmt_pool_create with allowed_uid_count > 0
 * and allowed_uids NULL, vmmt_handle_type_parse(..., NULL),
 * vmmt_select_handle_type(..., NULL), vmmt_pool_config_init(NULL),
 * vmmt_consumer_config_init(NULL); and vmmt_consume with dst 0 and
 * dst_size UINT64_MAX passed the check. test_struct_versions covers the
 * versioned structs (the *_size entry points did not exist).
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "driver.h"
#include "poolfix.h"
#include "status.h"
#include "testutil.h"

#define EXPECT_EINVAL(call)                                                                        \
    do {                                                                                           \
        vmmt__clear();                                                                             \
        assert_int_equal((call), VMMT_EINVAL);                                                     \
        assert_int_equal(vmmt_last_status(), VMMT_EINVAL);                                         \
        assert_true(vmmt_last_error()[0] != '\0');                                                 \
    } while (0)

static void test_status_log_driver_probe(void **state)
{
    vmmt_handle_type t = VMMT_HANDLE_AUTO;
    vmmt_device_probe probe;
    (void)state;

    assert_non_null(vmmt_strerror(INT_MIN));
    assert_non_null(vmmt_strerror(INT_MAX));
    assert_non_null(vmmt_strerror(1));
    assert_non_null(vmmt_last_error());
    vmmt_set_log(NULL, NULL);
    vmmt_set_log_level((vmmt_log_level)99);
    vmmt_set_log_level((vmmt_log_level)-7);
    vmmt_set_log_level(VMMT_LOG_WARN);

    EXPECT_EINVAL(vmmt_driver_select(NULL));
    EXPECT_EINVAL(vmmt_driver_select("nvidia"));
    EXPECT_EINVAL(vmmt_driver_select(""));
    EXPECT_EINVAL(vmmt_driver_version(NULL));
    EXPECT_EINVAL(vmmt_device_count(NULL));

    assert_string_equal(vmmt_handle_type_name((vmmt_handle_type)77), "unknown");
    assert_string_equal(vmmt_handoff_name((vmmt_handoff)-3), "unknown");
    EXPECT_EINVAL(vmmt_handle_type_parse(NULL, &t));
    EXPECT_EINVAL(vmmt_handle_type_parse("fabric", NULL));
    EXPECT_EINVAL(vmmt_handle_type_parse(NULL, NULL));
    EXPECT_EINVAL(vmmt_handle_type_parse("", &t));
    assert_int_equal(t, VMMT_HANDLE_AUTO);

    EXPECT_EINVAL(vmmt_probe_device(0, NULL));
    EXPECT_EINVAL(vmmt_probe_device_size(0, &probe, 10));
    assert_int_equal(vmmt_probe_device(-1, &probe), VMMT_ENODEV);
    assert_int_equal(vmmt_probe_device(INT_MAX, &probe), VMMT_ENODEV);
    EXPECT_EINVAL(vmmt_select_handle_type(0, NULL));
    assert_int_not_equal(vmmt_select_handle_type(-1, &t), VMMT_OK);
    assert_int_not_equal(vmmt_select_handle_type(INT_MIN, &t), VMMT_OK);
    vmmt_probe_reset();
}

static void test_descriptor_and_config_init(void **state)
{
    vmmt_desc d;
    vmmt_desc_info info;
    vmmt_pool_config pc;
    vmmt_consumer_config cc;
    (void)state;

    memset(&d, 0, sizeof d);
    EXPECT_EINVAL(vmmt_desc_inspect(NULL, &info));
    EXPECT_EINVAL(vmmt_desc_inspect(&d, NULL));
    EXPECT_EINVAL(vmmt_desc_inspect_size(&d, &info, 3));
    assert_int_equal(vmmt_desc_inspect(&d, &info), VMMT_EPROTO);

    vmmt__clear();
    vmmt_pool_config_init(NULL);
    assert_int_equal(vmmt_last_status(), VMMT_EINVAL);
    vmmt__clear();
    vmmt_consumer_config_init(NULL);
    assert_int_equal(vmmt_last_status(), VMMT_EINVAL);
    /* A size no version had: nothing written. */
    memset(&pc, 0x5a, sizeof pc);
    vmmt__clear();
    vmmt_pool_config_init_size(&pc, 4);
    assert_int_equal(vmmt_last_status(), VMMT_EINVAL);
    assert_int_equal(((unsigned char *)&pc)[0], 0x5a);
    memset(&cc, 0x5a, sizeof cc);
    vmmt_consumer_config_init_size(&cc, 1);
    assert_int_equal(((unsigned char *)&cc)[0], 0x5a);
    vmmt_consumer_config_init(&cc);
    assert_int_equal(cc.timeout_ms, 5000);
}

static void test_pool_create_arguments(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_pool *p = (vmmt_pool *)&c; /* must come back NULL */

    EXPECT_EINVAL(vmmt_pool_create(NULL, &p));
    assert_null(p);
    EXPECT_EINVAL(vmmt_pool_create(&c, NULL));
    c.allowed_uid_count = 3; /* and allowed_uids NULL */
    p = (vmmt_pool *)&c;
    EXPECT_EINVAL(vmmt_pool_create(&c, &p));
    assert_null(p);
    assert_error_contains("allowed_uid_count=3 but allowed_uids is NULL");
    c = config(4 * MiB, 1);
    c.allowed_uid_count = (size_t)-1;
    c.allowed_uids = (const uint32_t *)&c;
    EXPECT_EINVAL(vmmt_pool_create(&c, &p));
    c = config(4 * MiB, 1);
    c.device = -1;
    EXPECT_EINVAL(vmmt_pool_create(&c, &p));
    c = config(4 * MiB, 1);
    c.broker_path = "";
    EXPECT_EINVAL(vmmt_pool_create(&c, &p));
    c = config(4 * MiB, 1);
    c.consumer_count = INT_MIN;
    EXPECT_EINVAL(vmmt_pool_create(&c, &p));
    c = config(4 * MiB, 1);
    c.timeout_ms = -1;
    EXPECT_EINVAL(vmmt_pool_create(&c, &p));
    c = config(4 * MiB, 1);
    c.handoff = (vmmt_handoff)42;
    EXPECT_EINVAL(vmmt_pool_create(&c, &p));
    c = config(4 * MiB, 1);
    EXPECT_EINVAL(vmmt_pool_create_size(&c, 8, &p));
    /* Still works. */
    c = config(4 * MiB, 1);
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    tu_roundtrip(f, 4096, 1);
}

static void test_pool_call_arguments(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 2);
    vmmt_buffer b = bytes(f->src, 4096), two[2] = {bytes(f->src, 64), bytes(f->src, 64)};
    vmmt_buffer many[65];
    vmmt_desc d, out[65];
    vmmt_pool_stats s;
    uint32_t freed = 0;

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    EXPECT_EINVAL(vmmt_publish(NULL, &b, f->stream, &d));
    EXPECT_EINVAL(vmmt_publish(f->pool, NULL, f->stream, &d));
    EXPECT_EINVAL(vmmt_publish(f->pool, &b, f->stream, NULL));
    EXPECT_EINVAL(vmmt_publish_packed(f->pool, two, 0, f->stream, out));
    EXPECT_EINVAL(vmmt_publish_packed(f->pool, NULL, 2, f->stream, out));
    EXPECT_EINVAL(vmmt_publish_packed(f->pool, two, 2, f->stream, NULL));
    for (int i = 0; i < 65; i++)
        many[i] = bytes(f->src, 64);
    EXPECT_EINVAL(vmmt_publish_packed(f->pool, many, 65, f->stream, out));
    EXPECT_EINVAL(vmmt_publish_packed(f->pool, many, SIZE_MAX, f->stream, out));
    EXPECT_EINVAL(vmmt_publish_packed_size(f->pool, two, 2, 0, f->stream, out));
    b.ptr = 0;
    EXPECT_EINVAL(vmmt_publish(f->pool, &b, f->stream, &d));
    b = bytes(f->src, 0);
    EXPECT_EINVAL(vmmt_publish(f->pool, &b, f->stream, &d));
    b = bytes(f->src, 4096);
    b.ndim = -1;
    EXPECT_EINVAL(vmmt_publish(f->pool, &b, f->stream, &d));
    b.ndim = VMMT_MAX_DIMS + 1;
    EXPECT_EINVAL(vmmt_publish(f->pool, &b, f->stream, &d));
    b.ndim = INT_MIN;
    EXPECT_EINVAL(vmmt_publish(f->pool, &b, f->stream, &d));

    EXPECT_EINVAL(vmmt_cancel(NULL, &d));
    EXPECT_EINVAL(vmmt_cancel(f->pool, NULL));
    EXPECT_EINVAL(vmmt_pool_reclaim(NULL, &freed));
    assert_vmmt_ok(vmmt_pool_reclaim(f->pool, NULL));
    EXPECT_EINVAL(vmmt_pool_drain(NULL, 0));
    EXPECT_EINVAL(vmmt_pool_drain(f->pool, -1));
    EXPECT_EINVAL(vmmt_pool_drain(f->pool, INT_MIN));
    EXPECT_EINVAL(vmmt_pool_get_stats(NULL, &s));
    EXPECT_EINVAL(vmmt_pool_get_stats(f->pool, NULL));
    EXPECT_EINVAL(vmmt_pool_get_stats_size(f->pool, &s, 7));
    EXPECT_EINVAL(vmmt_pool_shutdown(NULL));
    vmmt_pool_destroy(NULL);

    /* Nothing was reserved by any of that. */
    assert_int_equal(stats(f->pool).in_flight, 0);
    assert_int_equal(stats(f->pool).published, 0);
    b = bytes(f->src, 4096);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    assert_vmmt_ok(vmmt_consumer_ack(f->consumer, &d, 0, f->stream, VMMT_ALL_RANKS, 0));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

static void test_consumer_arguments(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 2);
    vmmt_buffer b = bytes(f->src, 4096);
    vmmt_consumer *cons = (vmmt_consumer *)&c;
    vmmt_desc d;
    vmmt_desc_info info;
    uint8_t id[16] = {1};

    EXPECT_EINVAL(vmmt_consumer_create(NULL, NULL));
    EXPECT_EINVAL(vmmt_consumer_create_size(&(vmmt_consumer_config){0}, 2, &cons));
    assert_null(cons);
    assert_int_equal(vmmt_consumer_pool_count(NULL), 0);
    vmmt_consumer_destroy(NULL);

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    put(f, f->src, 4096, 5);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    assert_vmmt_ok(vmmt_desc_inspect(&d, &info));

    EXPECT_EINVAL(vmmt_consume(NULL, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    EXPECT_EINVAL(vmmt_consume(f->consumer, NULL, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    /* dst 0 with dst_size UINT64_MAX used to pass the check. */
    EXPECT_EINVAL(vmmt_consume(f->consumer, &d, 0, 0, UINT64_MAX, f->stream, VMMT_ALL_RANKS, 0));
    EXPECT_EINVAL(vmmt_consume(f->consumer, &d, 0, 0, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    EXPECT_EINVAL(vmmt_consume(f->consumer, &d, 0, UINT64_MAX - 100, UINT64_MAX, f->stream,
                               VMMT_ALL_RANKS, 0));
    EXPECT_EINVAL(vmmt_consume(f->consumer, &d, 0, f->dst, 100, f->stream, VMMT_ALL_RANKS, 0));
    EXPECT_EINVAL(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, -2, 1));
    EXPECT_EINVAL(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, 0, 0));
    EXPECT_EINVAL(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, 0, -1));
    EXPECT_EINVAL(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, 1, 2));
    EXPECT_EINVAL(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, INT_MAX, INT_MAX));
    assert_int_not_equal(
        vmmt_consume(f->consumer, &d, -1, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0), VMMT_OK);
    assert_int_not_equal(
        vmmt_consume(f->consumer, &d, INT_MAX, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0),
        VMMT_OK);

    EXPECT_EINVAL(vmmt_consumer_ack(NULL, &d, 0, f->stream, VMMT_ALL_RANKS, 0));
    EXPECT_EINVAL(vmmt_consumer_ack(f->consumer, NULL, 0, f->stream, VMMT_ALL_RANKS, 0));
    EXPECT_EINVAL(vmmt_consumer_ack(f->consumer, &d, 0, f->stream, 2, 1));
    EXPECT_EINVAL(vmmt_consumer_ack(f->consumer, &d, 0, f->stream, INT_MIN, 1));
    assert_int_not_equal(vmmt_consumer_ack(f->consumer, &d, -1, f->stream, VMMT_ALL_RANKS, 0),
                         VMMT_OK);

    EXPECT_EINVAL(vmmt_consumer_evict(NULL, info.pool_id, 0));
    EXPECT_EINVAL(vmmt_consumer_evict(f->consumer, NULL, 0));
    assert_vmmt_ok(vmmt_consumer_evict(f->consumer, id, -1)); /* not cached */

    /* None of it consumed or acknowledged anything: the real consume works. */
    assert_vmmt_ok(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    expect(f, f->dst, 4096, 5);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

/* The versioned structs: an older caller's shorter struct, a newer caller's longer one. */
static void test_struct_versions(void **state)
{
    struct fixture *f = *state;
    struct {
        vmmt_pool_config c;
        unsigned char newer[16];
    } big;
    struct {
        vmmt_pool_stats s;
        unsigned char newer[32];
    } st;
    struct wide_buffer {
        vmmt_buffer b;
        uint64_t newer;
    } wide[2];
    vmmt_pool_stats zero = {0};
    vmmt_desc out[2];
    vmmt_desc_info info;

    /* init fills the whole of a newer caller's struct: defaults, then zeros. */
    memset(&big, 0xee, sizeof big);
    vmmt_pool_config_init_size(&big.c, sizeof big);
    assert_int_equal(big.c.timeout_ms, 5000);
    for (size_t i = 0; i < sizeof big.newer; i++)
        assert_int_equal(big.newer[i], 0);
    big.c.memory_size = 4 * MiB;
    big.c.consumer_count = 1;
    big.c.max_slices = 16;
    /* A field this library does not know, set: refused, not ignored. */
    big.newer[5] = 1;
    EXPECT_EINVAL(vmmt_pool_create_size(&big.c, sizeof big, &f->pool));
    assert_error_contains("does not know");
    big.newer[5] = 0;
    assert_vmmt_ok(vmmt_pool_create_size(&big.c, sizeof big, &f->pool));

    /* Stats: a zero-initialised struct works; a longer one gets its tail zeroed. */
    assert_vmmt_ok(vmmt_pool_get_stats(f->pool, &zero));
    assert_int_equal(zero.slots, 16);
    memset(&st, 0xee, sizeof st);
    assert_vmmt_ok(vmmt_pool_get_stats_size(f->pool, &st.s, sizeof st));
    assert_int_equal(st.s.slots, 16);
    for (size_t i = 0; i < sizeof st.newer; i++)
        assert_int_equal(st.newer[i], 0);

    /* Buffers: the caller's array stride is its own struct size. */
    memset(wide, 0, sizeof wide);
    wide[0].b = bytes(f->src, 100);
    wide[1].b = bytes(f->src + 4096, 300);
    assert_vmmt_ok(
        vmmt_publish_packed_size(f->pool, &wide[0].b, 2, sizeof wide[0], f->stream, out));
    assert_vmmt_ok(vmmt_desc_inspect(&out[1], &info));
    assert_int_equal(info.nbytes, 300);
    assert_int_equal(info.pack_count, 2);
    assert_vmmt_ok(vmmt_cancel(f->pool, &out[0]));
    wide[1].newer = 7;
    EXPECT_EINVAL(vmmt_publish_packed_size(f->pool, &wide[0].b, 2, sizeof wide[0], f->stream, out));
    assert_error_contains("buffer 1");
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_status_log_driver_probe),
        cmocka_unit_test(test_descriptor_and_config_init),
        T(test_pool_create_arguments),
        T(test_pool_call_arguments),
        T(test_consumer_arguments),
        T(test_struct_versions),
    };
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
