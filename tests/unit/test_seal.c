/*
 * Every descriptor carries a seal under its pool's key (src/wire/seal.h), checked
 * before any field is believed. Each case here got an answer other than a
 * refusal from a record that was not the producer's (tests/model/FINDINGS.md):
 * a forged first descriptor became a process's record of the pool and its
 * real descriptors were refused; a forged member count became the group's
 * and its real members were refused; an offset moved inside a live slice was
 * consumed with OK and the wrong bytes. Written against the public API only,
 * so that it runs against any build of the library.
 */
#include <stdlib.h>
#include <string.h>

#include "emu.h"
#include "poolfix.h"

#define N 4096

/* Field offsets of docs/descriptor.md, "Layout". */
#define OFF_FLAGS          16
#define OFF_POOL_ID        24
#define OFF_PRODUCER_PID   220
#define OFF_CONSUMER_COUNT 224
#define OFF_TABLE_SLOTS    228
#define OFF_SLOT_STRIDE    248
#define OFF_OFFSET         288
#define OFF_NBYTES         296
#define OFF_PACK_COUNT     306
#define OFF_SHAPE          320
#define OFF_PIDNS          384
#define OFF_SEAL           392

static uint64_t get64(const vmmt_desc *d, size_t off)
{
    uint64_t v = 0;

    for (int i = 7; i >= 0; i--)
        v = (v << 8) | d->bytes[off + (size_t)i];
    return v;
}

static void put64(vmmt_desc *d, size_t off, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        d->bytes[off + (size_t)i] = (uint8_t)(v >> (8 * i));
}

static void put32(vmmt_desc *d, size_t off, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        d->bytes[off + (size_t)i] = (uint8_t)(v >> (8 * i));
}

static void put16(vmmt_desc *d, size_t off, uint16_t v)
{
    d->bytes[off] = (uint8_t)v;
    d->bytes[off + 1] = (uint8_t)(v >> 8);
}

static void sync_stream(struct fixture *f)
{
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
}

static int consume_all(struct fixture *f, vmmt_consumer *c, const vmmt_desc *d)
{
    return vmmt_consume(c, d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0);
}

static void make_pool(struct fixture *f, int consumers, int device_table)
{
    vmmt_pool_config c = config(4 * MiB, consumers);

    c.max_slices = 8;
    c.device_control_table = device_table;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
}

static vmmt_consumer *fresh_consumer(void)
{
    vmmt_consumer *c;

    assert_vmmt_ok(vmmt_consumer_create(NULL, &c));
    return c;
}

/*
 * Every single bit flip of a real descriptor, outside its seal, is refused
 * by a consumer that holds the pool, and by the producer's cancel; the real
 * one is still consumed with its bytes afterwards. A flip of the seal is
 * refused too.
 */
static void every_flip(struct fixture *f, int device_table)
{
    vmmt_buffer b = bytes(f->src, N);
    vmmt_desc d, forged;
    int ok = 0;

    make_pool(f, 2, device_table);
    put(f, f->src, N, 1);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    sync_stream(f);
    assert_vmmt_ok(vmmt_consumer_ack(f->consumer, &d, 0, f->stream, 0, 1)); /* imports */
    for (size_t i = 0; i < VMMT_DESC_SIZE; i++) {
        forged = d;
        forged.bytes[i] ^= (uint8_t)(1u << (i % 8));
        if (vmmt_consume(f->consumer, &forged, 0, f->dst, f->cap, f->stream, 1, 1) == VMMT_OK) {
            ok++;
            print_error("byte %zu flipped: consumed with OK\n", i);
            continue;
        }
        if (vmmt_cancel(f->pool, &forged) == VMMT_OK) {
            ok++;
            print_error("byte %zu flipped: cancelled with OK\n", i);
        }
    }
    assert_int_equal(ok, 0);
    assert_int_equal(vmmt_consumer_pool_count(f->consumer), 1);
    assert_vmmt_ok(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, 1, 1));
    sync_stream(f);
    expect(f, f->dst, N, 1);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

static void test_every_flip_host_table(void **state)
{
    every_flip(*state, 0);
}

static void test_every_flip_device_table(void **state)
{
    if (pool_kind_host()) skip(); /* a host pool's table is always shared */
    every_flip(*state, 1);
}

/*
 * A forgery of a field no import checks (the pid namespace, the stream
 * flag) as the first descriptor a process sees of the pool: refused, and the
 * process keeps no record of the pool, so the real descriptor goes through.
 * Before the seal the forgery was the import's record of the pool, and the
 * real descriptor was refused with VMMT_EPROTO until the pool was evicted.
 */
static void first_forged(struct fixture *f, int device_table, size_t field)
{
    vmmt_buffer b = bytes(f->src, N);
    vmmt_consumer *c = fresh_consumer();
    vmmt_desc d, forged;

    make_pool(f, 1, device_table);
    put(f, f->src, N, 2);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    sync_stream(f);
    forged = d;
    if (field == OFF_PIDNS)
        put64(&forged, OFF_PIDNS, get64(&d, OFF_PIDNS) ^ 0x10);
    else
        forged.bytes[OFF_FLAGS] ^= 1; /* STREAM_ORDERED */
    assert_int_not_equal(consume_all(f, c, &forged), VMMT_OK);
    sync_stream(f);
    assert_vmmt_ok(consume_all(f, c, &d));
    sync_stream(f);
    expect(f, f->dst, N, 2);
    vmmt_consumer_destroy(c);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

static void test_first_forged_pidns_host_table(void **state)
{
    first_forged(*state, 0, OFF_PIDNS);
}

static void test_first_forged_flags_host_table(void **state)
{
    first_forged(*state, 0, OFF_FLAGS);
}

static void test_first_forged_flags_device_table(void **state)
{
    if (pool_kind_host()) skip();
    first_forged(*state, 1, OFF_FLAGS);
}

/*
 * A forged member count as a process's first member of a live packed group:
 * refused, and the real members are then consumed and complete the group,
 * whose slice is recycled. Before the seal the forgery fixed the group's
 * member count in that process, its real members were refused, and the
 * slice stayed in flight until the rank was released.
 */
static void pack_count_forged(struct fixture *f, int device_table)
{
    vmmt_buffer pk[2] = {bytes(f->src, 1000), bytes(f->src + 8192, 3000)};
    vmmt_consumer *c = fresh_consumer();
    vmmt_desc p[2], forged;

    make_pool(f, 1, device_table);
    put(f, f->src, 8192 + 3000, 3);
    assert_vmmt_ok(vmmt_publish_packed(f->pool, pk, 2, f->stream, p));
    sync_stream(f);
    forged = p[0];
    put16(&forged, OFF_PACK_COUNT, 3);
    assert_int_not_equal(consume_all(f, c, &forged), VMMT_OK);
    assert_vmmt_ok(consume_all(f, c, &p[0]));
    assert_vmmt_ok(consume_all(f, c, &p[1]));
    sync_stream(f);
    vmmt_consumer_destroy(c);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

static void test_pack_count_forged_host_table(void **state)
{
    pack_count_forged(*state, 0);
}

static void test_pack_count_forged_device_table(void **state)
{
    if (pool_kind_host()) skip();
    pack_count_forged(*state, 1);
}

/*
 * An offset and size moved within a live slice (a packed group's other
 * member, or bytes the slice holds past the buffer): a valid record, which
 * the table cannot tell from the real one. Refused; before the seal it was
 * consumed with OK and another buffer's bytes.
 */
static void test_offset_moved_in_slice(void **state)
{
    struct fixture *f = *state;
    vmmt_buffer pk[2] = {bytes(f->src, 1024), bytes(f->src + 8192, 1024)};
    vmmt_desc p[2], forged;

    make_pool(f, 1, 0);
    put(f, f->src, 8192 + 1024, 4);
    assert_vmmt_ok(vmmt_publish_packed(f->pool, pk, 2, f->stream, p));
    sync_stream(f);
    forged = p[0];
    put64(&forged, OFF_OFFSET, get64(&p[1], OFF_OFFSET));
    assert_vmmt_ok(vmmt_desc_inspect(&forged, &(vmmt_desc_info){0})); /* a valid record */
    assert_int_equal(consume_all(f, f->consumer, &forged), VMMT_EPROTO);
    assert_error_contains("seal");
    assert_vmmt_ok(consume_all(f, f->consumer, &p[0]));
    assert_vmmt_ok(consume_all(f, f->consumer, &p[1]));
    sync_stream(f);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

/* Each field of a pool's own the import does not check, changed and refused with the seal's
 * message by a consumer that already holds the pool. */
static void test_pool_fields_forged(void **state)
{
    struct fixture *f = *state;
    vmmt_buffer b = bytes(f->src, N);
    vmmt_desc d, forged;

    make_pool(f, 2, 0);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    sync_stream(f);
    assert_vmmt_ok(vmmt_consumer_ack(f->consumer, &d, 0, f->stream, 0, 1)); /* imports */
    forged = d;
    put32(&forged, OFF_PRODUCER_PID, 1);
    assert_int_equal(vmmt_consume(f->consumer, &forged, 0, f->dst, f->cap, f->stream, 1, 1),
                     VMMT_EPROTO);
    assert_error_contains("seal");
    forged = d;
    put64(&forged, OFF_NBYTES, 8);
    put64(&forged, OFF_SHAPE, 2); /* 2 float32, a valid record */
    assert_int_equal(vmmt_consume(f->consumer, &forged, 0, f->dst, f->cap, f->stream, 1, 1),
                     VMMT_EPROTO);
    assert_vmmt_ok(vmmt_consumer_ack(f->consumer, &d, 0, f->stream, 1, 1));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

/*
 * A device table's geometry, forged so that the rows keep their size (the
 * check a shared table's size gave): refused at import by the pool record,
 * which device tables now carry too, and nothing stays imported.
 */
static void test_device_table_geometry_forged(void **state)
{
    struct fixture *f = *state;
    vmmt_buffer b = bytes(f->src, N);
    vmmt_consumer *c = fresh_consumer();
    vmmt_desc d, forged;

    if (pool_kind_host()) skip();
    make_pool(f, 1, 1);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    sync_stream(f);
    forged = d;
    put32(&forged, OFF_CONSUMER_COUNT, 2); /* 8 slots x 16 bytes = 4 slots x 32 */
    put32(&forged, OFF_SLOT_STRIDE, 32);
    put32(&forged, OFF_TABLE_SLOTS, 4);
    assert_vmmt_ok(vmmt_desc_inspect(&forged, &(vmmt_desc_info){0}));
    assert_int_equal(vmmt_consume(c, &forged, 0, f->dst, f->cap, f->stream, 1, 1), VMMT_EPROTO);
    assert_error_contains("the descriptor was altered");
    assert_int_equal(vmmt_consumer_pool_count(c), 0);
    assert_vmmt_ok(consume_all(f, c, &d));
    sync_stream(f);
    vmmt_consumer_destroy(c);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

/* The same for a FABRIC pool (emulated FABRIC handles), whose table is always in device memory. */
static void test_fabric_geometry_and_seal(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b = bytes(f->src, N);
    vmmt_consumer *fresh;
    vmmt_desc d, forged;
    vmmt_desc_info info;

    if (!on_emu() || pool_kind_host()) skip();
    setenv("VMMT_EMU_HANDLES", "fabric,posix_fd", 1);
    vmmt__emu_configure();
    vmmt_probe_reset();
    c.max_slices = 8;
    c.handle_type = VMMT_HANDLE_FABRIC;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    put(f, f->src, N, 5);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    sync_stream(f);
    assert_vmmt_ok(vmmt_desc_inspect(&d, &info));
    assert_int_equal(info.handle_type, VMMT_HANDLE_FABRIC);
    fresh = fresh_consumer();
    forged = d;
    put32(&forged, OFF_CONSUMER_COUNT, 2);
    put32(&forged, OFF_SLOT_STRIDE, 32);
    put32(&forged, OFF_TABLE_SLOTS, 4);
    assert_int_equal(vmmt_consume(fresh, &forged, 0, f->dst, f->cap, f->stream, 1, 1), VMMT_EPROTO);
    assert_int_equal(vmmt_consumer_pool_count(fresh), 0);
    /* Another pool id, the real handle: the import under that id is let go, nothing acked. */
    forged = d;
    forged.bytes[OFF_POOL_ID] ^= 0x55;
    assert_int_equal(consume_all(f, fresh, &forged), VMMT_EPROTO);
    assert_int_equal(vmmt_consumer_pool_count(fresh), 0);
    assert_vmmt_ok(consume_all(f, fresh, &d));
    sync_stream(f);
    expect(f, f->dst, N, 5);
    vmmt_consumer_destroy(fresh);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    emu_reset();
}

/* A reservation's token with a field changed is refused by commit and cancel alike. */
static void test_token_forged(void **state)
{
    struct fixture *f = *state;
    vmmt_reservation r, forged;
    vmmt_desc d;

    make_pool(f, 1, 0);
    assert_vmmt_ok(vmmt_reserve(f->pool, N, &r));
    forged = r;
    forged.token.bytes[OFF_SEAL] ^= 1;
    assert_int_equal(vmmt_commit(f->pool, &forged, NULL, f->stream, &d), VMMT_EPROTO);
    assert_int_equal(vmmt_cancel(f->pool, &forged.token), VMMT_EPROTO);
    assert_vmmt_ok(vmmt_commit(f->pool, &r, NULL, f->stream, &d));
    sync_stream(f);
    assert_vmmt_ok(consume_all(f, f->consumer, &d));
    sync_stream(f);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_every_flip_host_table),
        T(test_every_flip_device_table),
        T(test_first_forged_pidns_host_table),
        T(test_first_forged_flags_host_table),
        T(test_first_forged_flags_device_table),
        T(test_pack_count_forged_host_table),
        T(test_pack_count_forged_device_table),
        T(test_offset_moved_in_slice),
        T(test_pool_fields_forged),
        T(test_device_table_geometry_forged),
        T(test_fabric_geometry_and_seal),
        T(test_token_forged),
    };
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
