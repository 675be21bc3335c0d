#include <stdio.h>
#include <string.h>

#include "desc.h"
#include "generation.h"
#include "status.h"
#include "testutil.h"

#define MiB (1024ull * 1024ull)

/* A single POSIX_FD publish: a float32 tensor [4, 8, 16] (2048 bytes) in slot 70. */
static struct vmmt__desc valid_fd(void)
{
    struct vmmt__desc d;
    memset(&d, 0, sizeof d);
    for (int i = 0; i < 16; i++)
        d.pool_id[i] = (uint8_t)(0xa0 + i);
    d.handle_type = VMMT_HANDLE_POSIX_FD;
    d.flags = VMMT__DESC_STREAM_ORDERED;
    d.broker.kind = VMMT__BROKER_ABSTRACT;
    d.broker.len = 20;
    memcpy(d.broker.name, "vmmt-0123456789abcde", 20);
    d.producer_device = 3;
    d.producer_pid = 4242;
    d.producer_uid = 1000;
    d.producer_pidns = 0x1122334455667788ull;
    d.consumer_count = 2;
    d.alloc_size = 64 * MiB;
    d.table_offset = 64;  /* the rows follow the 64-byte pool record */
    d.table_slots = 4092; /* 65472 bytes of rows, ending at 65536 */
    d.slot_stride = 16;
    d.data_offset = 65536;
    d.slot = 70;
    d.generation = 9;
    d.slice_offset = 65536 + 4096;
    d.slice_bytes = 8192;
    d.offset = d.slice_offset;
    d.nbytes = 2048;
    d.pack_index = 0;
    d.pack_count = 1;
    d.dtype_code = 2;
    d.dtype_bits = 32;
    d.dtype_lanes = 1;
    d.ndim = 3;
    d.shape[0] = 4;
    d.shape[1] = 8;
    d.shape[2] = 16;
    return d;
}

/* The second of three bfloat16 buffers packed in one slice. */
static struct vmmt__desc valid_packed(void)
{
    struct vmmt__desc d = valid_fd();
    d.flags = VMMT__DESC_STREAM_ORDERED | VMMT__DESC_PACKED;
    d.broker.kind = VMMT__BROKER_PATH;
    memset(d.broker.name, 0, sizeof d.broker.name);
    memcpy(d.broker.name, "/run/vmmt/broker.sock", 21);
    d.broker.len = 21;
    d.pack_index = 1;
    d.pack_count = 3;
    d.slice_bytes = 3 * 1024;
    d.offset = d.slice_offset + 1024;
    d.nbytes = 1024;
    d.dtype_code = 4;
    d.dtype_bits = 16;
    d.ndim = 2;
    d.shape[0] = 16;
    d.shape[1] = 32;
    d.shape[2] = 0;
    return d;
}

/* A FABRIC pool: a 64-byte handle and no broker, on a big allocation near the 64-bit limit. */
static struct vmmt__desc valid_fabric(void)
{
    struct vmmt__desc d = valid_fd();
    d.handle_type = VMMT_HANDLE_FABRIC;
    d.flags = 0;
    memset(&d.broker, 0, sizeof d.broker);
    for (int i = 0; i < 64; i++)
        d.fabric[i] = (uint8_t)(255 - i);
    d.consumer_count = 256;
    d.slot_stride = 4 * 257;
    d.table_slots = 1;
    d.alloc_size = UINT64_MAX - 4095;
    d.table_offset = 64;
    d.data_offset = 2 * MiB;
    d.slot = 0;
    d.generation = VMMT__GEN_LAST;
    d.slice_offset = UINT64_MAX - 8191;
    d.slice_bytes = 4096; /* ends exactly at alloc_size */
    d.offset = d.slice_offset;
    d.nbytes = 4096;
    d.dtype_code = 0; /* untyped bytes */
    d.dtype_bits = 0;
    d.dtype_lanes = 0;
    d.ndim = 0;
    memset(d.shape, 0, sizeof d.shape);
    d.producer_pid = 0;
    return d;
}

static void assert_desc_equal(const struct vmmt__desc *a, const struct vmmt__desc *b)
{
    assert_memory_equal(a->pool_id, b->pool_id, 16);
    assert_int_equal(a->handle_type, b->handle_type);
    assert_int_equal(a->flags, b->flags);
    assert_memory_equal(a->fabric, b->fabric, 64);
    assert_int_equal(a->broker.kind, b->broker.kind);
    assert_int_equal(a->broker.len, b->broker.len);
    assert_memory_equal(a->broker.name, b->broker.name, sizeof a->broker.name);
    assert_int_equal(a->producer_device, b->producer_device);
    assert_int_equal(a->producer_pid, b->producer_pid);
    assert_int_equal(a->consumer_count, b->consumer_count);
    assert_int_equal(a->alloc_size, b->alloc_size);
    assert_int_equal(a->table_offset, b->table_offset);
    assert_int_equal(a->table_slots, b->table_slots);
    assert_int_equal(a->slot_stride, b->slot_stride);
    assert_int_equal(a->data_offset, b->data_offset);
    assert_int_equal(a->slot, b->slot);
    assert_int_equal(a->generation, b->generation);
    assert_int_equal(a->slice_offset, b->slice_offset);
    assert_int_equal(a->slice_bytes, b->slice_bytes);
    assert_int_equal(a->offset, b->offset);
    assert_int_equal(a->nbytes, b->nbytes);
    assert_int_equal(a->pack_index, b->pack_index);
    assert_int_equal(a->pack_count, b->pack_count);
    assert_int_equal(a->dtype_code, b->dtype_code);
    assert_int_equal(a->dtype_bits, b->dtype_bits);
    assert_int_equal(a->dtype_lanes, b->dtype_lanes);
    assert_int_equal(a->ndim, b->ndim);
    for (int i = 0; i < VMMT_MAX_DIMS; i++)
        assert_true(a->shape[i] == b->shape[i]);
}

static void round_trip(const struct vmmt__desc *d)
{
    uint8_t buf[VMMT_DESC_SIZE];
    struct vmmt__desc back;

    assert_vmmt_ok(vmmt__desc_validate(d));
    vmmt__desc_encode(d, buf);
    memset(&back, 0x5a, sizeof back);
    assert_vmmt_ok(vmmt__desc_decode(buf, &back));
    assert_desc_equal(d, &back);
}

static void test_round_trip(void **state)
{
    struct vmmt__desc d = valid_fd();
    (void)state;

    round_trip(&d);
    d = valid_packed();
    round_trip(&d);
    d = valid_fabric();
    round_trip(&d);

    /* Negative and extreme values of the signed fields survive too. */
    d = valid_fd();
    d.producer_device = INT32_MAX;
    d.producer_pid = INT32_MAX;
    d.producer_uid = UINT32_MAX;
    d.producer_pidns = UINT64_MAX;
    round_trip(&d);
}

static void test_edge_cases_accepted(void **state)
{
    struct vmmt__desc d;
    (void)state;

    /* A 4-bit type with an odd element count rounds the last byte up. */
    d = valid_fd();
    d.dtype_code = 1;
    d.dtype_bits = 4;
    d.ndim = 1;
    d.shape[0] = 3;
    d.shape[1] = d.shape[2] = 0;
    d.nbytes = 2;
    round_trip(&d);

    /* An empty tensor. */
    d = valid_fd();
    d.shape[1] = 0;
    d.nbytes = 0;
    round_trip(&d);

    /* A scalar. */
    d = valid_fd();
    d.ndim = 0;
    memset(d.shape, 0, sizeof d.shape);
    d.nbytes = 4;
    round_trip(&d);

    /* A 512-byte vector element needs only 256-byte alignment. */
    d = valid_fd();
    d.dtype_lanes = 128;
    d.ndim = 1;
    d.shape[0] = 2;
    d.shape[1] = d.shape[2] = 0;
    d.nbytes = 1024;
    d.offset = d.slice_offset + 256;
    round_trip(&d);

    /* The data region may end the allocation with no room left: a zero-byte slice at its end. */
    d = valid_fd();
    d.data_offset = d.alloc_size;
    d.slice_offset = d.alloc_size;
    d.slice_bytes = 0;
    d.offset = d.alloc_size;
    d.shape[0] = 0;
    d.nbytes = 0;
    round_trip(&d);

    /* An abstract name is bytes: a NUL inside it is fine. */
    d = valid_fd();
    d.broker.name[3] = '\0';
    round_trip(&d);
}

/* Values at the offsets docs/descriptor.md gives, in little-endian order. */
static void test_golden_bytes(void **state)
{
    struct vmmt__desc d = valid_fd();
    uint8_t b[VMMT_DESC_SIZE];
    (void)state;

    d.table_slots = 0x00020304; /* distinct bytes show the order (at most 2^20) */
    d.alloc_size = 0x1122334455667788ull;
    d.shape[0] = -2;
    d.seal = 0x0102030405060708ull;
    memset(b, 0xee, sizeof b);
    vmmt__desc_encode(&d, b);

    assert_memory_equal(b + 0, "VMMTDESC", 8);
    assert_memory_equal(b + 8, "\x02\x00", 2);          /* version 2 */
    assert_memory_equal(b + 10, "\x00\x02", 2);         /* 512 */
    assert_memory_equal(b + 12, "\x01\x00\x00\x00", 4); /* POSIX_FD */
    assert_memory_equal(b + 16, "\x01\x00\x00\x00", 4); /* STREAM_ORDERED */
    assert_memory_equal(b + 24, d.pool_id, 16);
    assert_int_equal(b[104], 0);
    assert_int_equal(b[105], 20);
    assert_memory_equal(b + 106, "vmmt-0123456789abcde", 20);
    assert_memory_equal(b + 216, "\x03\x00\x00\x00", 4);
    assert_memory_equal(b + 220, "\x92\x10\x00\x00", 4); /* 4242 */
    assert_memory_equal(b + 228, "\x04\x03\x02\x00", 4);
    assert_memory_equal(b + 232, "\x88\x77\x66\x55\x44\x33\x22\x11", 8);
    assert_memory_equal(b + 248, "\x10\x00\x00\x00", 4);
    assert_memory_equal(b + 256, "\x00\x00\x01\x00\x00\x00\x00\x00", 8); /* 65536 */
    assert_memory_equal(b + 264, "\x46\x00\x00\x00", 4);                 /* slot 70 */
    assert_memory_equal(b + 268, "\x09\x00\x00\x00", 4);
    assert_memory_equal(b + 296, "\x00\x08\x00\x00\x00\x00\x00\x00", 8); /* 2048 */
    assert_memory_equal(b + 306, "\x01\x00", 2);
    assert_memory_equal(b + 308, "\x02\x20\x01\x00", 4); /* float, 32 bits, 1 lane */
    assert_memory_equal(b + 312, "\x03\x00\x00\x00", 4);
    assert_memory_equal(b + 320, "\xfe\xff\xff\xff\xff\xff\xff\xff", 8); /* -2 */
    assert_memory_equal(b + 328, "\x08\x00\x00\x00\x00\x00\x00\x00", 8);

    /* Encode writes every byte: the broker name past its length and the reserved bytes are 0. */
    static const uint8_t zero[128];
    assert_memory_equal(b + 126, zero, 88);
    assert_memory_equal(b + 20, zero, 4);
    assert_memory_equal(b + 214, zero, 2);
    assert_memory_equal(b + 252, "\xe8\x03\x00\x00", 4); /* producer_uid 1000 */
    assert_memory_equal(b + 316, zero, 4);
    assert_memory_equal(b + 384, "\x88\x77\x66\x55\x44\x33\x22\x11", 8); /* producer_pidns */
    assert_memory_equal(b + 392, "\x08\x07\x06\x05\x04\x03\x02\x01", 8); /* seal */
    assert_memory_equal(b + 400, zero, 112);
}

/* Garbage past the name's length never reaches the wire. */
static void test_encode_zeroes_name_tail(void **state)
{
    struct vmmt__desc d = valid_fd(), back;
    uint8_t b[VMMT_DESC_SIZE];
    (void)state;

    memset(d.broker.name + d.broker.len, 'X', sizeof d.broker.name - d.broker.len);
    vmmt__desc_encode(&d, b);
    assert_vmmt_ok(vmmt__desc_decode(b, &back));
    assert_int_equal(back.broker.name[d.broker.len], 0);
}

/* ----------------------------------------------------------------- rejects */

static void expect_reject_bytes(const uint8_t *b, const char *text)
{
    struct vmmt__desc d;
    int st = vmmt__desc_decode(b, &d);
    if (st != VMMT_EPROTO)
        fail_msg("expected VMMT_EPROTO mentioning \"%s\", got %d: %s", text, st, vmmt_last_error());
    assert_error_contains(text);
}

static void expect_reject(const struct vmmt__desc *d, const char *text)
{
    uint8_t b[VMMT_DESC_SIZE];
    vmmt__desc_encode(d, b);
    expect_reject_bytes(b, text);
    /* The producer-side check says the same. */
    assert_int_equal(vmmt__desc_validate(d), VMMT_EPROTO);
    assert_error_contains(text);
}

static void test_reject_frame(void **state)
{
    struct vmmt__desc d = valid_fd();
    uint8_t good[VMMT_DESC_SIZE], b[VMMT_DESC_SIZE];
    (void)state;

    vmmt__desc_encode(&d, good);

    memcpy(b, good, sizeof b);
    b[3] = 'X';
    expect_reject_bytes(b, "magic is 56 4d 4d 58");
    assert_error_contains("not a vmmt descriptor");

    memcpy(b, good, sizeof b);
    b[8] = 3;
    expect_reject_bytes(b, "version=3 is newer than this build of vmmt reads (version 2 only)");

    memcpy(b, good, sizeof b);
    b[8] = 1;
    expect_reject_bytes(b, "version=1 comes from an older vmmt");

    memcpy(b, good, sizeof b);
    b[8] = 0;
    expect_reject_bytes(b, "version=0 is not a valid version");

    memcpy(b, good, sizeof b);
    b[10] = 0;
    b[11] = 1;
    expect_reject_bytes(b, "field size=256 is not 512");

    /* One byte of every reserved range, its first and its last. */
    static const unsigned res[] = {20, 23, 214, 215, 316, 319, 400, 511};
    for (size_t i = 0; i < sizeof res / sizeof res[0]; i++) {
        char text[64];
        memcpy(b, good, sizeof b);
        b[res[i]] = 0x40;
        snprintf(text, sizeof text, "reserved byte at offset %u is 0x40", res[i]);
        expect_reject_bytes(b, text);
    }

    /* Every reserved byte is checked, and with several set the message names the first
     * (all_zero compares a range at once, then a byte scan finds it). */
    static const unsigned range[][2] = {{20, 4}, {214, 2}, {316, 4}, {400, 80}, {500, 12}};
    for (size_t r = 0; r < sizeof range / sizeof range[0]; r++)
        for (unsigned i = range[r][0]; i < range[r][0] + range[r][1]; i++) {
            char text[64];
            memcpy(b, good, sizeof b);
            b[i] = 0x81;
            b[range[r][0] + range[r][1] - 1] |= 0x02;
            snprintf(text, sizeof text, "reserved byte at offset %u is 0x%02x", i,
                     i == range[r][0] + range[r][1] - 1 ? 0x83 : 0x81);
            expect_reject_bytes(b, text);
        }
    memcpy(b, good, sizeof b);
    b[511] = 1;
    b[23] = 2;
    expect_reject_bytes(b, "reserved byte at offset 23 is 0x02");

    /* A broker name tail is only reachable on the wire: encode never writes one. */
    memcpy(b, good, sizeof b);
    b[106 + 20] = 'x';
    expect_reject_bytes(b, "broker.name has non-zero bytes past broker.len=20");

    assert_int_equal(vmmt__desc_decode(NULL, &d), VMMT_EINVAL);
    assert_int_equal(vmmt__desc_decode(good, NULL), VMMT_EINVAL);
    assert_int_equal(vmmt__desc_validate(NULL), VMMT_EINVAL);
}

static void test_reject_handle(void **state)
{
    struct vmmt__desc d;
    (void)state;

    d = valid_fd();
    memset(d.pool_id, 0, sizeof d.pool_id);
    expect_reject(&d, "pool_id is all zero");

    d = valid_fd();
    d.handle_type = 2;
    expect_reject(&d, "handle_type=2 is neither POSIX_FD (1) nor FABRIC (8)");
    d.handle_type = VMMT_HANDLE_NONE;
    expect_reject(&d, "handle_type=0");

    d = valid_fd();
    d.flags |= 0x80000010u;
    expect_reject(&d, "flags=0x80000011 has unknown bits 0x80000010");

    d = valid_fd();
    d.flags |= VMMT__DESC_HOST_TABLE;
    d.table_offset = 0; /* the record comes first in a shared table too */
    expect_reject(&d, "table_offset=0 is not 64");

    d = valid_fabric();
    d.flags |= VMMT__DESC_HOST_TABLE;
    expect_reject(&d, "shared host control table");

    d = valid_fd();
    d.fabric[63] = 1;
    expect_reject(&d, "fabric is set for handle_type=POSIX_FD");

    d = valid_fabric();
    d.broker.kind = 1;
    expect_reject(&d, "broker is set for handle_type=FABRIC");
    d = valid_fabric();
    d.broker.len = 3;
    expect_reject(&d, "broker is set");
    d = valid_fabric();
    memset(d.fabric, 0, sizeof d.fabric);
    expect_reject(&d, "fabric is all zero");

    d = valid_fd();
    d.broker.kind = 2;
    expect_reject(&d, "broker.kind=2");
    d = valid_fd();
    d.broker.len = 0;
    memset(d.broker.name, 0, sizeof d.broker.name);
    expect_reject(&d, "broker.len=0 is outside 1..107");
    d = valid_fd();
    d.broker.len = 108;
    expect_reject(&d, "broker.len=108");
    d = valid_packed();
    d.broker.name[5] = '\0';
    expect_reject(&d, "broker.name holds a NUL byte");

    d = valid_fd();
    d.producer_device = -1;
    expect_reject(&d, "producer_device=-1");
    d = valid_fd();
    d.producer_pid = INT32_MIN;
    expect_reject(&d, "producer_pid=-2147483648");
}

static void test_reject_geometry(void **state)
{
    struct vmmt__desc d;
    (void)state;

    d = valid_fd();
    d.consumer_count = 0;
    expect_reject(&d, "consumer_count=0 is outside 1..256");
    d.consumer_count = 257;
    expect_reject(&d, "consumer_count=257");

    d = valid_fd();
    d.table_slots = 0;
    expect_reject(&d, "table_slots=0");

    d = valid_fd();
    d.slot_stride = 8; /* 2 consumers need 12 */
    expect_reject(&d, "slot_stride=8 is not a multiple of 4 of at least 12");
    d.slot_stride = 18;
    expect_reject(&d, "slot_stride=18");
    d.slot_stride = UINT32_MAX - 3; /* a multiple of 4, but the table is then too big */
    expect_reject(&d, "does not fit in alloc_size");

    /* The record takes the table's first 64 bytes: the rows start there, nowhere else. */
    d = valid_fd();
    d.table_offset = 0;
    expect_reject(&d, "table_offset=0 is not 64");
    d.table_offset = 68;
    expect_reject(&d, "table_offset=68 is not 64");
    d.table_offset = UINT64_MAX - 3;
    expect_reject(&d, "is not 64");
    d = valid_fd();
    d.alloc_size = 65000; /* the rows end past the allocation */
    d.data_offset = 0;
    expect_reject(&d, "with 65472 table bytes (4092 slots of 16) does not fit in alloc_size=65000");

    d = valid_fd();
    d.data_offset = 100;
    expect_reject(&d, "data_offset=100 is not between the end of the control table (65536)");
    d.data_offset = 65535; /* inside the last row */
    expect_reject(&d, "data_offset=65535 is not between");
    d.data_offset = d.alloc_size + 1;
    expect_reject(&d, "data_offset=67108865");

    d = valid_fd();
    d.slot = 70000;
    expect_reject(&d, "slot=70000 is outside the control table (4092 slots)");
    assert_error_contains("corrupt or belongs to another pool");
    d = valid_fd();
    d.slot = 4096;
    expect_reject(&d, "slot=4096");
    d = valid_fd();
    d.generation = 0;
    expect_reject(&d, "generation=0");
    /* Only 4k + 1 (k >= 1) is a generation: the other words are states (src/wire/generation.h). */
    for (uint32_t g = 1; g <= 8; g++) {
        d.generation = g;
        if (g == VMMT__GEN_FIRST) continue;
        expect_reject(&d, "is never used by a producer");
    }
    d = valid_fd();
    d.table_slots = VMMT__MAX_TABLE_SLOTS + 1;
    expect_reject(&d, "more than a producer makes");
}

static void test_reject_extent(void **state)
{
    struct vmmt__desc d;
    (void)state;

    d = valid_fd();
    d.slice_offset = d.data_offset - 4096;
    d.offset = d.slice_offset;
    expect_reject(&d, "slice_offset=61440 slice_bytes=8192 is not inside the data region");
    d = valid_fd();
    d.slice_bytes = d.alloc_size;
    expect_reject(&d, "is not inside the data region");
    /* Sums near the 64-bit limit must not wrap into range. */
    d = valid_fd();
    d.slice_bytes = UINT64_MAX - d.slice_offset + 1;
    expect_reject(&d, "is not inside the data region");
    d = valid_fd();
    d.slice_offset = UINT64_MAX;
    expect_reject(&d, "slice_offset=18446744073709551615");

    d = valid_fd();
    d.offset = d.slice_offset - 4;
    expect_reject(&d, "is not inside its slice");
    d = valid_fd();
    d.offset = d.slice_offset + 8192 - 1024; /* 2048 bytes from here run past the slice */
    expect_reject(&d, "offset=76800 nbytes=2048 is not inside its slice");
    d = valid_fd();
    d.nbytes = UINT64_MAX;
    expect_reject(&d, "is not inside its slice");
    d = valid_fd();
    d.offset = UINT64_MAX;
    expect_reject(&d, "is not inside its slice");
    d = valid_fd();
    d.offset = d.slice_offset + 8192 + 1;
    d.nbytes = 0;
    expect_reject(&d, "is not inside its slice");
}

static void test_reject_pack(void **state)
{
    struct vmmt__desc d;
    (void)state;

    d = valid_packed();
    d.pack_count = 0;
    d.pack_index = 0;
    expect_reject(&d, "pack_count=0");
    d = valid_packed();
    d.pack_index = 3;
    expect_reject(&d, "pack_index=3 is not below pack_count=3");
    d = valid_packed();
    d.flags &= ~VMMT__DESC_PACKED;
    expect_reject(&d, "PACKED is clear but pack_count=3");
    d = valid_fd();
    d.flags |= VMMT__DESC_PACKED;
    expect_reject(&d, "PACKED is set but pack_count=1");
    /* Issue 8, defect 7: a consumer tracks members in 64 bits; pack_count 65535
     * with pack_index 65000 reached 1ull << 65000 (UBSan) before this bound. */
    d = valid_packed();
    d.pack_count = 65535;
    d.pack_index = 65000;
    expect_reject(&d, "pack_count=65535 is above 64");
    d.pack_count = 65;
    d.pack_index = 64;
    expect_reject(&d, "pack_count=65 is above 64");
    d.pack_count = 64;
    d.pack_index = 63;
    round_trip(&d);
}

static void test_reject_tensor(void **state)
{
    struct vmmt__desc d;
    (void)state;

    d = valid_fd();
    d.ndim = 9;
    expect_reject(&d, "ndim=9 is above 8");
    d = valid_fd();
    d.shape[1] = -1;
    expect_reject(&d, "shape[1]=-1 is negative");
    d = valid_fd();
    d.shape[5] = 7;
    expect_reject(&d, "shape[5]=7 is set past ndim=3");

    d = valid_fd();
    d.nbytes = 2044;
    expect_reject(&d, "nbytes=2044 does not match shape [4, 8, 16] of dtype (code 2, bits 32, "
                      "lanes 1), which is 2048 bytes");
    d = valid_fd();
    d.dtype_bits = 0;
    expect_reject(&d, "dtype_bits=0 (untyped bytes) but dtype_code=2");
    d = valid_fd();
    d.dtype_lanes = 0;
    expect_reject(&d, "dtype_lanes=0 with dtype_bits=32");

    /* The element count overflows; then the count is fine but times 32 bits is not. */
    d = valid_fd();
    d.shape[0] = INT64_MAX;
    d.shape[1] = INT64_MAX;
    expect_reject(&d, "overflows 64 bits");
    d = valid_fd();
    d.shape[0] = (int64_t)1 << 60;
    d.shape[1] = 1;
    d.shape[2] = 1;
    expect_reject(&d, "shape [1152921504606846976, 1, 1] with dtype (bits 32, lanes 1) overflows");

    d = valid_fd();
    d.offset += 2;
    d.slice_bytes += 2;
    expect_reject(&d, "offset=69634 is not aligned to 4 bytes");
    /* An element of 3 bytes is aligned to 4; one of 1024 bytes only to 256. */
    d = valid_fd();
    d.dtype_bits = 24;
    d.nbytes = 512 * 3;
    d.offset += 3;
    expect_reject(&d, "not aligned to 4 bytes");
    d = valid_fd();
    d.dtype_bits = 8;
    d.dtype_lanes = 1024;
    d.ndim = 1;
    d.shape[0] = 2;
    d.shape[1] = d.shape[2] = 0;
    d.offset += 128;
    expect_reject(&d, "not aligned to 256 bytes");
}

/* ------------------------------------------------------------- pool match */

static void expect_pool_differs(const struct vmmt__desc *d, const struct vmmt__desc *pool,
                                const char *text)
{
    assert_int_equal(vmmt__desc_check_pool(d, pool), VMMT_EPROTO);
    assert_error_contains(text);
}

static void test_check_pool(void **state)
{
    struct vmmt__desc pool = valid_fd(), d;
    (void)state;

    /* Another buffer of the same pool matches, whatever its slot, slice and tensor. */
    d = valid_packed();
    d.broker = pool.broker;
    assert_vmmt_ok(vmmt__desc_check_pool(&d, &pool));

    /* Issue 8, defect 7: every field that names or describes the pool is
     * compared; before, a cleared STREAM_ORDERED flag passed and the consumer
     * skipped its wait for the ready word. */
    d = valid_fd();
    d.flags &= ~VMMT__DESC_STREAM_ORDERED;
    expect_pool_differs(&d, &pool, "flags=0x0 differs from the imported pool's flags=0x1");
    d = valid_fd();
    d.flags |= VMMT__DESC_HOST_TABLE;
    expect_pool_differs(&d, &pool, "flags=0x5 differs");
    d = valid_packed(); /* a different broker address */
    expect_pool_differs(&d, &pool, "broker differs");
    d = valid_fd();
    d.broker.name[3] ^= 1;
    expect_pool_differs(&d, &pool, "broker differs");
    d = valid_fd();
    d.producer_device = 4;
    expect_pool_differs(&d, &pool, "producer_device=4 differs");
    d = valid_fd();
    d.producer_pid = 1;
    expect_pool_differs(&d, &pool, "producer_pid=1 differs");
    /* The broker's credentials check uses the import's: a later descriptor must agree. */
    d = valid_fd();
    d.producer_uid = 7;
    expect_pool_differs(&d, &pool, "producer_uid=7 differs");
    d = valid_fd();
    d.producer_pidns = 9;
    expect_pool_differs(&d, &pool, "producer_pidns=9 differs");
    {
        struct vmmt__desc fa = valid_fabric(), fb = valid_fabric();
        fb.fabric[17] ^= 1;
        expect_pool_differs(&fb, &fa, "fabric differs");
    }

    d = valid_fd();
    d.pool_id[15] ^= 1;
    expect_pool_differs(&d, &pool,
                        "pool_id=a0a1a2a3a4a5a6a7a8a9aaabacadaeae differs from the "
                        "imported pool's pool_id=a0a1a2a3a4a5a6a7a8a9aaabacadaeaf");
    d = valid_fd();
    d.handle_type = VMMT_HANDLE_FABRIC;
    expect_pool_differs(&d, &pool, "handle_type=8 differs from the imported pool's handle_type=1");
    d = valid_fd();
    d.alloc_size *= 2;
    expect_pool_differs(&d, &pool, "alloc_size=134217728 differs");
    d = valid_fd();
    d.table_offset = 4;
    expect_pool_differs(&d, &pool, "table_offset=4 differs");
    d = valid_fd();
    d.table_slots = 2048;
    expect_pool_differs(&d, &pool, "table_slots=2048 differs");
    d = valid_fd();
    d.slot_stride = 32;
    expect_pool_differs(&d, &pool, "slot_stride=32 differs");
    d = valid_fd();
    d.data_offset = 2 * MiB;
    expect_pool_differs(&d, &pool, "data_offset=2097152 differs");
    d = valid_fd();
    d.consumer_count = 3;
    expect_pool_differs(&d, &pool,
                        "consumer_count=3 differs from the imported pool's "
                        "consumer_count=2");
    assert_error_contains("import it again");
    assert_int_equal(vmmt__desc_check_pool(NULL, &pool), VMMT_EINVAL);
}

/* ------------------------------------------------------------------ public */

static void test_inspect(void **state)
{
    struct vmmt__desc d = valid_packed();
    vmmt_desc desc;
    vmmt_desc_info info;
    (void)state;

    vmmt__desc_encode(&d, desc.bytes);
    assert_vmmt_ok(vmmt_desc_inspect(&desc, &info));
    assert_memory_equal(info.pool_id, d.pool_id, 16);
    assert_int_equal(info.handle_type, VMMT_HANDLE_POSIX_FD);
    assert_int_equal(info.producer_device, 3);
    assert_int_equal(info.consumer_count, 2);
    assert_int_equal(info.slot, 70);
    assert_int_equal(info.generation, 9);
    assert_int_equal(info.nbytes, 1024);
    assert_int_equal(info.dtype.code, 4);
    assert_int_equal(info.dtype.bits, 16);
    assert_int_equal(info.dtype.lanes, 1);
    assert_int_equal(info.ndim, 2);
    assert_true(info.shape[0] == 16 && info.shape[1] == 32 && info.shape[2] == 0);
    assert_int_equal(info.stream_ordered, 1);
    assert_int_equal(info.pack_index, 1);
    assert_int_equal(info.pack_count, 3);

    d = valid_fabric();
    vmmt__desc_encode(&d, desc.bytes);
    assert_vmmt_ok(vmmt_desc_inspect(&desc, &info));
    assert_int_equal(info.handle_type, VMMT_HANDLE_FABRIC);
    assert_int_equal(info.consumer_count, 256);
    assert_int_equal(info.stream_ordered, 0);
    assert_int_equal(info.generation, VMMT__GEN_LAST);

    desc.bytes[300] ^= 0xff; /* nbytes */
    assert_int_equal(vmmt_desc_inspect(&desc, &info), VMMT_EPROTO);
    assert_int_equal(vmmt_desc_inspect(NULL, &info), VMMT_EINVAL);
    assert_int_equal(vmmt_desc_inspect(&desc, NULL), VMMT_EINVAL);
}

/* SipHash-2-4's vectors from its paper (key 00..0f): the empty message, and 00..0e. */
static void test_siphash_vectors(void **state)
{
    uint8_t key[16], msg[15];
    (void)state;

    for (int i = 0; i < 16; i++)
        key[i] = (uint8_t)i;
    for (int i = 0; i < 15; i++)
        msg[i] = (uint8_t)i;
    assert_true(vmmt__siphash24(key, msg, 0) == 0x726fdb47dd0e0e31ull);
    assert_true(vmmt__siphash24(key, msg, 15) == 0xa129ca6149be45e5ull);
}

/* A record's seal covers every byte but its own, under the key it was made with only. */
static void test_seal_covers_record(void **state)
{
    struct vmmt__desc d = valid_fd();
    uint8_t b[VMMT_DESC_SIZE], key[16] = {1, 2, 3}, other[16] = {1, 2, 4};
    (void)state;

    vmmt__desc_encode(&d, b);
    vmmt__desc_seal(b, key);
    assert_int_equal(vmmt__desc_check_seal(b, key), VMMT_OK);
    assert_int_equal(vmmt__desc_check_seal(b, other), VMMT_EPROTO);
    assert_error_contains("does not match its pool");
    for (size_t i = 0; i < VMMT_DESC_SIZE; i++) {
        b[i] ^= 0x80;
        assert_int_equal(vmmt__desc_check_seal(b, key), VMMT_EPROTO);
        b[i] ^= 0x80;
    }
    /* The in-place tag is SipHash-2-4 of the record with its seal field zeroed. */
    uint8_t zeroed[VMMT_DESC_SIZE];
    memcpy(zeroed, b, sizeof zeroed);
    memset(zeroed + 392, 0, 8);
    assert_true(vmmt__seal_of(key, b, 392, VMMT_DESC_SIZE) ==
                vmmt__siphash24(key, zeroed, sizeof zeroed));
    /* Sealing again gives the same tag: the seal field is read as zero. */
    uint8_t again[VMMT_DESC_SIZE];
    memcpy(again, b, sizeof again);
    vmmt__desc_seal(again, key);
    assert_memory_equal(again, b, sizeof b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip),         cmocka_unit_test(test_edge_cases_accepted),
        cmocka_unit_test(test_golden_bytes),       cmocka_unit_test(test_siphash_vectors),
        cmocka_unit_test(test_seal_covers_record), cmocka_unit_test(test_encode_zeroes_name_tail),
        cmocka_unit_test(test_reject_frame),       cmocka_unit_test(test_reject_handle),
        cmocka_unit_test(test_reject_geometry),    cmocka_unit_test(test_reject_extent),
        cmocka_unit_test(test_reject_pack),        cmocka_unit_test(test_reject_tensor),
        cmocka_unit_test(test_check_pool),         cmocka_unit_test(test_inspect),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
