/*
 * Descriptor codec. Every field is stored byte by byte in little-endian
 * order, never by copying a struct, so the record is the same whatever the
 * host's byte order, padding or alignment. The layout table is in
 * docs/descriptor.md; the OFF_ constants below must match it.
 */
#include "desc.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "abi.h"
#include "generation.h"
#include "seal.h"
#include "status.h"

/* The codec knows bytes and integers only; it must build without any CUDA type. */
#ifdef VMMT_CUABI_H
#error "desc.c must not include cuabi.h (directly or through another header)"
#endif

/* ------------------------------------------------------------------ layout */

#define OFF_MAGIC           0
#define OFF_VERSION         8
#define OFF_SIZE            10
#define OFF_HANDLE_TYPE     12
#define OFF_FLAGS           16
#define OFF_POOL_ID         24
#define OFF_FABRIC          40
#define OFF_BROKER_KIND     104
#define OFF_BROKER_LEN      105
#define OFF_BROKER_NAME     106
#define OFF_PRODUCER_DEVICE 216
#define OFF_PRODUCER_PID    220
#define OFF_CONSUMER_COUNT  224
#define OFF_TABLE_SLOTS     228
#define OFF_ALLOC_SIZE      232
#define OFF_TABLE_OFFSET    240
#define OFF_SLOT_STRIDE     248
#define OFF_PRODUCER_UID    252
#define OFF_DATA_OFFSET     256
#define OFF_SLOT            264
#define OFF_GENERATION      268
#define OFF_SLICE_OFFSET    272
#define OFF_SLICE_BYTES     280
#define OFF_OFFSET          288
#define OFF_NBYTES          296
#define OFF_PACK_INDEX      304
#define OFF_PACK_COUNT      306
#define OFF_DTYPE_CODE      308
#define OFF_DTYPE_BITS      309
#define OFF_DTYPE_LANES     310
#define OFF_NDIM            312
#define OFF_SHAPE           320
#define OFF_PRODUCER_PIDNS  384 /* u64 */
#define OFF_SEAL            392 /* u64: seal.h */
#define OFF_CHUNK_SIZE      480 /* elastic pools: bytes per chunk, 0 for a single allocation */
#define OFF_CHUNK           488 /* the chunk the buffer starts in */
#define OFF_INCARNATION     492 /* which making of that chunk */
#define OFF_MEMORY          496 /* 0 device memory, 1 host memory */

static const char desc_magic[8] = {'V', 'M', 'M', 'T', 'D', 'E', 'S', 'C'};

/* Bytes that version 2 leaves unused: zero now, so a later version can give them meaning. */
static const struct {
    unsigned off, len;
} reserved[] = {{20, 4}, {214, 2}, {316, 4}, {400, 80}, {500, 12}};

#define CORRUPT "the descriptor is corrupt or belongs to another pool"

/* ------------------------------------------------------ little-endian bytes */

static void put_u8(uint8_t *p, unsigned off, uint8_t v)
{
    p[off] = v;
}

static void put_u16(uint8_t *p, unsigned off, uint16_t v)
{
    p[off] = (uint8_t)v;
    p[off + 1] = (uint8_t)(v >> 8);
}

static void put_u32(uint8_t *p, unsigned off, uint32_t v)
{
    for (unsigned i = 0; i < 4; i++)
        p[off + i] = (uint8_t)(v >> (8 * i));
}

static void put_u64(uint8_t *p, unsigned off, uint64_t v)
{
    for (unsigned i = 0; i < 8; i++)
        p[off + i] = (uint8_t)(v >> (8 * i));
}

static uint16_t get_u16(const uint8_t *p, unsigned off)
{
    return (uint16_t)(p[off] | (unsigned)p[off + 1] << 8);
}

static uint32_t get_u32(const uint8_t *p, unsigned off)
{
    uint32_t v = 0;
    for (unsigned i = 0; i < 4; i++)
        v |= (uint32_t)p[off + i] << (8 * i);
    return v;
}

static uint64_t get_u64(const uint8_t *p, unsigned off)
{
    uint64_t v = 0;
    for (unsigned i = 0; i < 8; i++)
        v |= (uint64_t)p[off + i] << (8 * i);
    return v;
}

/* Two's complement both ways; the conversion to signed is done without relying on wrap. */
static int32_t as_i32(uint32_t v)
{
    return v <= INT32_MAX ? (int32_t)v : (int32_t)(v - (uint32_t)INT32_MAX - 1u) + INT32_MIN;
}

static int64_t as_i64(uint64_t v)
{
    return v <= INT64_MAX ? (int64_t)v : (int64_t)(v - (uint64_t)INT64_MAX - 1u) + INT64_MIN;
}

/* Every publish and consume checks a few hundred bytes for zero: memcmp
 * against zeros compares them many at a time, a byte loop one by one. */
static int all_zero(const void *p, size_t n)
{
    static const uint8_t zeros[128];
    const uint8_t *b = p;

    for (size_t step; n > 0; b += step, n -= step) {
        step = n < sizeof zeros ? n : sizeof zeros;
        if (memcmp(b, zeros, step) != 0) return 0;
    }
    return 1;
}

/* ----------------------------------------------------------------- encode */

void vmmt__desc_encode(const struct vmmt__desc *d, uint8_t out[VMMT_DESC_SIZE])
{
    uint8_t len = d->broker.len <= VMMT__BROKER_NAME_MAX ? d->broker.len : VMMT__BROKER_NAME_MAX;

    memset(out, 0, VMMT_DESC_SIZE);
    memcpy(out + OFF_MAGIC, desc_magic, sizeof desc_magic);
    put_u16(out, OFF_VERSION, VMMT__DESC_VERSION);
    put_u16(out, OFF_SIZE, VMMT_DESC_SIZE);
    put_u32(out, OFF_HANDLE_TYPE, d->handle_type);
    put_u32(out, OFF_FLAGS, d->flags);
    memcpy(out + OFF_POOL_ID, d->pool_id, sizeof d->pool_id);
    memcpy(out + OFF_FABRIC, d->fabric, sizeof d->fabric);
    put_u8(out, OFF_BROKER_KIND, d->broker.kind);
    put_u8(out, OFF_BROKER_LEN, d->broker.len);
    /* Only the used part of the name travels, so the rest is zero on the wire. */
    memcpy(out + OFF_BROKER_NAME, d->broker.name, len);
    put_u32(out, OFF_PRODUCER_DEVICE, (uint32_t)d->producer_device);
    put_u32(out, OFF_PRODUCER_PID, (uint32_t)d->producer_pid);
    put_u32(out, OFF_PRODUCER_UID, d->producer_uid);
    put_u64(out, OFF_PRODUCER_PIDNS, d->producer_pidns);
    put_u64(out, OFF_SEAL, d->seal);
    put_u32(out, OFF_CONSUMER_COUNT, d->consumer_count);
    put_u32(out, OFF_TABLE_SLOTS, d->table_slots);
    put_u64(out, OFF_ALLOC_SIZE, d->alloc_size);
    put_u64(out, OFF_TABLE_OFFSET, d->table_offset);
    put_u32(out, OFF_SLOT_STRIDE, d->slot_stride);
    put_u64(out, OFF_DATA_OFFSET, d->data_offset);
    put_u32(out, OFF_SLOT, d->slot);
    put_u32(out, OFF_GENERATION, d->generation);
    put_u64(out, OFF_SLICE_OFFSET, d->slice_offset);
    put_u64(out, OFF_SLICE_BYTES, d->slice_bytes);
    put_u64(out, OFF_OFFSET, d->offset);
    put_u64(out, OFF_NBYTES, d->nbytes);
    put_u16(out, OFF_PACK_INDEX, d->pack_index);
    put_u16(out, OFF_PACK_COUNT, d->pack_count);
    put_u8(out, OFF_DTYPE_CODE, d->dtype_code);
    put_u8(out, OFF_DTYPE_BITS, d->dtype_bits);
    put_u16(out, OFF_DTYPE_LANES, d->dtype_lanes);
    put_u32(out, OFF_NDIM, d->ndim);
    for (unsigned i = 0; i < VMMT_MAX_DIMS; i++)
        put_u64(out, OFF_SHAPE + 8 * i, (uint64_t)d->shape[i]);
    put_u64(out, OFF_CHUNK_SIZE, d->chunk_size);
    put_u32(out, OFF_CHUNK, d->chunk);
    put_u32(out, OFF_INCARNATION, d->incarnation);
    put_u32(out, OFF_MEMORY, d->memory_location);
}

/* ----------------------------------------------------------------- decode */

static int check_frame(const uint8_t *in)
{
    uint16_t version = get_u16(in, OFF_VERSION), size = get_u16(in, OFF_SIZE);

    if (memcmp(in + OFF_MAGIC, desc_magic, sizeof desc_magic) != 0)
        return vmmt__fail(VMMT_EPROTO,
                          "descriptor magic is %02x %02x %02x %02x %02x %02x %02x %02x, not "
                          "\"VMMTDESC\"; these %d bytes are not a vmmt descriptor (another "
                          "message, or a record cut or shifted in transport)",
                          in[0], in[1], in[2], in[3], in[4], in[5], in[6], in[7], VMMT_DESC_SIZE);
    if (version > VMMT__DESC_VERSION)
        return vmmt__fail(VMMT_EPROTO,
                          "descriptor version=%u is newer than this build of vmmt reads (version "
                          "%d only); upgrade vmmt on the consumer side to match the producer",
                          version, VMMT__DESC_VERSION);
    if (version == 1)
        return vmmt__fail(VMMT_EPROTO,
                          "descriptor version=1 comes from an older vmmt, whose control table "
                          "follows other rules (this build reads version %d only); run the same "
                          "vmmt version on the producer and consumer sides",
                          VMMT__DESC_VERSION);
    if (version != VMMT__DESC_VERSION)
        return vmmt__fail(
            VMMT_EPROTO,
            "descriptor version=%u is not a valid version (this build reads %d); " CORRUPT, version,
            VMMT__DESC_VERSION);
    if (size != VMMT_DESC_SIZE)
        return vmmt__fail(
            VMMT_EPROTO,
            "descriptor field size=%u is not %d, the record size of version %d; " CORRUPT, size,
            VMMT_DESC_SIZE, VMMT__DESC_VERSION);
    for (size_t r = 0; r < sizeof reserved / sizeof reserved[0]; r++) {
        if (all_zero(in + reserved[r].off, reserved[r].len)) continue;
        for (unsigned i = reserved[r].off; i < reserved[r].off + reserved[r].len; i++)
            if (in[i] != 0)
                return vmmt__fail(VMMT_EPROTO,
                                  "descriptor reserved byte at offset %u is 0x%02x, not 0; the "
                                  "descriptor is corrupt or was written by a newer vmmt",
                                  i, in[i]);
    }
    return VMMT_OK;
}

static void load(const uint8_t *in, struct vmmt__desc *d)
{
    memset(d, 0, sizeof *d);
    memcpy(d->pool_id, in + OFF_POOL_ID, sizeof d->pool_id);
    d->handle_type = get_u32(in, OFF_HANDLE_TYPE);
    d->flags = get_u32(in, OFF_FLAGS);
    memcpy(d->fabric, in + OFF_FABRIC, sizeof d->fabric);
    d->broker.kind = in[OFF_BROKER_KIND];
    d->broker.len = in[OFF_BROKER_LEN];
    memcpy(d->broker.name, in + OFF_BROKER_NAME, sizeof d->broker.name);
    d->producer_device = as_i32(get_u32(in, OFF_PRODUCER_DEVICE));
    d->producer_pid = as_i32(get_u32(in, OFF_PRODUCER_PID));
    d->producer_uid = get_u32(in, OFF_PRODUCER_UID);
    d->producer_pidns = get_u64(in, OFF_PRODUCER_PIDNS);
    d->seal = get_u64(in, OFF_SEAL);
    d->consumer_count = get_u32(in, OFF_CONSUMER_COUNT);
    d->table_slots = get_u32(in, OFF_TABLE_SLOTS);
    d->alloc_size = get_u64(in, OFF_ALLOC_SIZE);
    d->table_offset = get_u64(in, OFF_TABLE_OFFSET);
    d->slot_stride = get_u32(in, OFF_SLOT_STRIDE);
    d->data_offset = get_u64(in, OFF_DATA_OFFSET);
    d->slot = get_u32(in, OFF_SLOT);
    d->generation = get_u32(in, OFF_GENERATION);
    d->slice_offset = get_u64(in, OFF_SLICE_OFFSET);
    d->slice_bytes = get_u64(in, OFF_SLICE_BYTES);
    d->offset = get_u64(in, OFF_OFFSET);
    d->nbytes = get_u64(in, OFF_NBYTES);
    d->pack_index = get_u16(in, OFF_PACK_INDEX);
    d->pack_count = get_u16(in, OFF_PACK_COUNT);
    d->dtype_code = in[OFF_DTYPE_CODE];
    d->dtype_bits = in[OFF_DTYPE_BITS];
    d->dtype_lanes = get_u16(in, OFF_DTYPE_LANES);
    d->ndim = get_u32(in, OFF_NDIM);
    for (unsigned i = 0; i < VMMT_MAX_DIMS; i++)
        d->shape[i] = as_i64(get_u64(in, OFF_SHAPE + 8 * i));
    d->chunk_size = get_u64(in, OFF_CHUNK_SIZE);
    d->chunk = get_u32(in, OFF_CHUNK);
    d->incarnation = get_u32(in, OFF_INCARNATION);
    d->memory_location = get_u32(in, OFF_MEMORY);
}

void vmmt__desc_own_slot(const uint8_t in[VMMT_DESC_SIZE], uint32_t *slot, uint32_t *generation)
{
    *slot = get_u32(in, OFF_SLOT);
    *generation = get_u32(in, OFF_GENERATION);
}

int vmmt__desc_decode(const uint8_t in[VMMT_DESC_SIZE], struct vmmt__desc *d)
{
    int st;

    if (in == NULL || d == NULL)
        return vmmt__fail(VMMT_EINVAL, "descriptor decode: input or output is NULL");
    st = check_frame(in);
    if (st != VMMT_OK) return st;
    load(in, d);
    return vmmt__desc_validate(d);
}

/* --------------------------------------------------------------- validate */

/*
 * One set of field checks serves every side: a reader (decode: inspect,
 * consume, ack, cancel) reports VMMT_EPROTO with "corrupt" advice, and the
 * producer runs the very same checks on the record it is about to publish,
 * reporting VMMT_EINVAL with advice about the buffer. A record publish
 * accepts is thus one every reader accepts.
 */
struct check_ctx {
    int status;
    const char *advice;
};

static int check_broker(const struct vmmt__broker_addr *b, const struct check_ctx *x)
{
    if (b->kind != VMMT__BROKER_ABSTRACT && b->kind != VMMT__BROKER_PATH)
        return vmmt__fail(x->status,
                          "descriptor field broker.kind=%u is neither abstract (0) nor a "
                          "filesystem path (1); %s",
                          b->kind, x->advice);
    if (b->len < 1 || b->len > VMMT__BROKER_NAME_MAX)
        return vmmt__fail(x->status, "descriptor field broker.len=%u is outside 1..%d; %s", b->len,
                          VMMT__BROKER_NAME_MAX, x->advice);
    if (!all_zero(b->name + b->len, sizeof b->name - b->len))
        return vmmt__fail(x->status,
                          "descriptor field broker.name has non-zero bytes past broker.len=%u; %s",
                          b->len, x->advice);
    /* An abstract name is arbitrary bytes; a path ends at its first NUL. */
    if (b->kind == VMMT__BROKER_PATH && memchr(b->name, '\0', b->len) != NULL)
        return vmmt__fail(
            x->status, "descriptor field broker.name holds a NUL byte within its %u-byte path; %s",
            b->len, x->advice);
    return VMMT_OK;
}

static int check_handle(const struct vmmt__desc *d, const struct check_ctx *x)
{
    if (all_zero(d->pool_id, sizeof d->pool_id))
        return vmmt__fail(x->status, "descriptor field pool_id is all zero; %s", x->advice);
    if (d->flags & ~VMMT__DESC_KNOWN_FLAGS)
        return vmmt__fail(x->status,
                          "descriptor field flags=0x%" PRIx32 " has unknown bits 0x%" PRIx32
                          " (this build knows 0x%x); %s",
                          d->flags, d->flags & ~VMMT__DESC_KNOWN_FLAGS, VMMT__DESC_KNOWN_FLAGS,
                          x->advice);
    if (d->handle_type == VMMT_HANDLE_FABRIC) {
        if (all_zero(d->fabric, sizeof d->fabric))
            return vmmt__fail(x->status,
                              "descriptor field fabric is all zero for handle_type=FABRIC; %s",
                              x->advice);
        if (d->broker.kind != 0 || d->broker.len != 0 ||
            !all_zero(d->broker.name, sizeof d->broker.name))
            return vmmt__fail(x->status,
                              "descriptor field broker is set for handle_type=FABRIC, which "
                              "needs no fd broker; %s",
                              x->advice);
        return VMMT_OK;
    }
    if (d->handle_type == VMMT_HANDLE_POSIX_FD) {
        if (!all_zero(d->fabric, sizeof d->fabric))
            return vmmt__fail(x->status,
                              "descriptor field fabric is set for handle_type=POSIX_FD; %s",
                              x->advice);
        return check_broker(&d->broker, x);
    }
    return vmmt__fail(x->status,
                      "descriptor field handle_type=%" PRIu32
                      " is neither POSIX_FD (1) nor FABRIC (8); %s",
                      d->handle_type, x->advice);
}

static int check_producer(const struct vmmt__desc *d, const struct check_ctx *x)
{
    if (d->producer_device < 0)
        return vmmt__fail(x->status, "descriptor field producer_device=%" PRId32 " is negative; %s",
                          d->producer_device, x->advice);
    if (d->producer_pid < 0)
        return vmmt__fail(x->status, "descriptor field producer_pid=%" PRId32 " is negative; %s",
                          d->producer_pid, x->advice);
    return VMMT_OK;
}

/* The control table and data region within the allocation; no sum here can wrap. */
static int check_geometry(const struct vmmt__desc *d, const struct check_ctx *x)
{
    uint64_t table_bytes = (uint64_t)d->table_slots * d->slot_stride;

    if (d->consumer_count < 1 || d->consumer_count > VMMT__MAX_CONSUMERS)
        return vmmt__fail(x->status,
                          "descriptor field consumer_count=%" PRIu32 " is outside 1..%d; %s",
                          d->consumer_count, VMMT__MAX_CONSUMERS, x->advice);
    if (d->table_slots > VMMT__MAX_TABLE_SLOTS)
        return vmmt__fail(x->status,
                          "descriptor field table_slots=%" PRIu32
                          " is more than a producer makes (%u); %s",
                          d->table_slots, VMMT__MAX_TABLE_SLOTS, x->advice);
    if (d->table_slots < 1)
        return vmmt__fail(x->status,
                          "descriptor field table_slots=0: the control table has no slot; %s",
                          x->advice);
    if (d->slot_stride % 4 != 0 || d->slot_stride < 4 * (1 + d->consumer_count))
        return vmmt__fail(
            x->status,
            "descriptor field slot_stride=%" PRIu32 " is not a multiple of 4 of at least %" PRIu32
            " (a ready word and one ack word for each of %" PRIu32 " consumers); %s",
            d->slot_stride, 4 * (1 + d->consumer_count), d->consumer_count, x->advice);
    /* The pool record fills the table's first bytes, the rows follow (ctrl.h): one place,
     * whatever the table, so that no field decides where a reader finds the record. */
    if (d->table_offset != VMMT__DESC_TABLE_RECORD_BYTES)
        return vmmt__fail(x->status,
                          "descriptor field table_offset=%" PRIu64
                          " is not %u (the rows follow the %u-byte pool record); %s",
                          d->table_offset, VMMT__DESC_TABLE_RECORD_BYTES,
                          VMMT__DESC_TABLE_RECORD_BYTES, x->advice);
    if (d->flags & VMMT__DESC_HOST_TABLE) {
        /* The table is a separate shared memfd: the allocation holds only data. */
        if (d->handle_type != VMMT_HANDLE_POSIX_FD)
            return vmmt__fail(x->status,
                              "descriptor flags name a shared host control table, which only "
                              "POSIX_FD pools have (found handle_type=%" PRIu32 "); %s",
                              d->handle_type, x->advice);
        if (d->data_offset > d->alloc_size)
            return vmmt__fail(x->status,
                              "descriptor field data_offset=%" PRIu64
                              " is beyond alloc_size=%" PRIu64 "; %s",
                              d->data_offset, d->alloc_size, x->advice);
        return VMMT_OK;
    }
    if (d->table_offset > d->alloc_size || table_bytes > d->alloc_size - d->table_offset)
        return vmmt__fail(
            x->status,
            "descriptor field table_offset=%" PRIu64 " with %" PRIu64 " table bytes (%" PRIu32
            " slots of %" PRIu32 ") does not fit in alloc_size=%" PRIu64 "; %s",
            d->table_offset, table_bytes, d->table_slots, d->slot_stride, d->alloc_size, x->advice);
    if (d->data_offset < d->table_offset + table_bytes || d->data_offset > d->alloc_size)
        return vmmt__fail(x->status,
                          "descriptor field data_offset=%" PRIu64
                          " is not between the end of the control table (%" PRIu64
                          ") and alloc_size=%" PRIu64 "; %s",
                          d->data_offset, d->table_offset + table_bytes, d->alloc_size, x->advice);
    return VMMT_OK;
}

static int check_slot(const struct vmmt__desc *d, const struct check_ctx *x)
{
    if (d->slot >= d->table_slots)
        return vmmt__fail(x->status,
                          "descriptor field slot=%" PRIu32 " is outside the control table (%" PRIu32
                          " slots); %s",
                          d->slot, d->table_slots, x->advice);
    if (!vmmt__generation_valid(d->generation))
        return vmmt__fail(x->status,
                          "descriptor field generation=%" PRIu32
                          " is never used by a producer (generations are 4k + 1, k >= 1); %s",
                          d->generation, x->advice);
    return VMMT_OK;
}

/* Slice within the data region, buffer within its slice; compared by differences, never sums. */
static int check_extent(const struct vmmt__desc *d, const struct check_ctx *x)
{
    uint64_t rel;

    if (d->slice_offset < d->data_offset || d->slice_offset > d->alloc_size ||
        d->slice_bytes > d->alloc_size - d->slice_offset)
        return vmmt__fail(x->status,
                          "descriptor field slice_offset=%" PRIu64 " slice_bytes=%" PRIu64
                          " is not inside the data region [%" PRIu64 ", %" PRIu64 "); %s",
                          d->slice_offset, d->slice_bytes, d->data_offset, d->alloc_size,
                          x->advice);
    rel = d->offset - d->slice_offset;
    if (d->offset < d->slice_offset || rel > d->slice_bytes || d->nbytes > d->slice_bytes - rel)
        return vmmt__fail(x->status,
                          "descriptor field offset=%" PRIu64 " nbytes=%" PRIu64
                          " is not inside its slice [%" PRIu64 ", +%" PRIu64 "); %s",
                          d->offset, d->nbytes, d->slice_offset, d->slice_bytes, x->advice);
    return VMMT_OK;
}

static int check_pack(const struct vmmt__desc *d, const struct check_ctx *x)
{
    int packed = (d->flags & VMMT__DESC_PACKED) != 0;

    if (d->pack_count < 1)
        return vmmt__fail(x->status,
                          "descriptor field pack_count=0; a single publish has pack_count=1; %s",
                          x->advice);
    /* A reader keeps one bit per member in a 64-bit word: a larger group is no vmmt record. */
    if (d->pack_count > VMMT__MAX_PACK)
        return vmmt__fail(x->status, "descriptor field pack_count=%u is above %d; %s",
                          d->pack_count, VMMT__MAX_PACK, x->advice);
    if (d->pack_index >= d->pack_count)
        return vmmt__fail(x->status,
                          "descriptor field pack_index=%u is not below pack_count=%u; %s",
                          d->pack_index, d->pack_count, x->advice);
    if (packed != (d->pack_count > 1))
        return vmmt__fail(x->status, "descriptor field flags: PACKED is %s but pack_count=%u; %s",
                          packed ? "set" : "clear", d->pack_count, x->advice);
    return VMMT_OK;
}

static int mul_overflows(uint64_t a, uint64_t b, uint64_t *out)
{
    if (a != 0 && b > UINT64_MAX / a) return 1;
    *out = a * b;
    return 0;
}

static void format_shape(const struct vmmt__desc *d, char *buf, size_t cap)
{
    size_t used = 0;

    used += (size_t)snprintf(buf, cap, "[");
    for (uint32_t i = 0; i < d->ndim && used < cap; i++)
        used += (size_t)snprintf(buf + used, cap - used, "%s%" PRId64, i ? ", " : "", d->shape[i]);
    if (used < cap) snprintf(buf + used, cap - used, "]");
}

int vmmt__desc_tensor_bytes(uint32_t ndim, const int64_t *shape, uint64_t elem_bits,
                            uint64_t *nbytes)
{
    uint64_t total = 1;

    for (uint32_t i = 0; i < ndim; i++)
        if (mul_overflows(total, (uint64_t)shape[i], &total)) return -1;
    if (mul_overflows(total, elem_bits, &total)) return -1;
    *nbytes = total / 8 + (total % 8 != 0);
    return 0;
}

/* Element size in bytes rounded up to a power of two, capped: what the offset must be aligned to.
 */
uint64_t vmmt__desc_elem_align(uint8_t bits, uint16_t lanes)
{
    uint64_t bytes = ((uint64_t)bits * lanes + 7) / 8, a = 1;

    while (a < bytes && a < VMMT__DESC_MAX_ELEM_ALIGN)
        a *= 2;
    return a;
}

static int check_shape(const struct vmmt__desc *d, const struct check_ctx *x)
{
    if (d->ndim > VMMT_MAX_DIMS)
        return vmmt__fail(x->status, "descriptor field ndim=%" PRIu32 " is above %d; %s", d->ndim,
                          VMMT_MAX_DIMS, x->advice);
    for (uint32_t i = 0; i < VMMT_MAX_DIMS; i++) {
        if (i < d->ndim && d->shape[i] < 0)
            return vmmt__fail(x->status,
                              "descriptor field shape[%" PRIu32 "]=%" PRId64 " is negative; %s", i,
                              d->shape[i], x->advice);
        if (i >= d->ndim && d->shape[i] != 0)
            return vmmt__fail(x->status,
                              "descriptor field shape[%" PRIu32 "]=%" PRId64
                              " is set past ndim=%" PRIu32 "; %s",
                              i, d->shape[i], d->ndim, x->advice);
    }
    return VMMT_OK;
}

/* nbytes must be exactly the tensor's bytes; sub-byte types round the last byte up. */
static int check_dtype(const struct vmmt__desc *d, const struct check_ctx *x)
{
    uint64_t bits = (uint64_t)d->dtype_bits * d->dtype_lanes, total = 1;
    char shape[256];

    if (d->dtype_bits == 0) {
        if (d->dtype_code != 0 || d->dtype_lanes != 0)
            return vmmt__fail(x->status,
                              "descriptor field dtype_bits=0 (untyped bytes) but dtype_code=%u "
                              "dtype_lanes=%u are not 0; %s",
                              d->dtype_code, d->dtype_lanes, x->advice);
        return VMMT_OK;
    }
    if (d->dtype_lanes == 0)
        return vmmt__fail(x->status, "descriptor field dtype_lanes=0 with dtype_bits=%u; %s",
                          d->dtype_bits, x->advice);
    if (vmmt__desc_tensor_bytes(d->ndim, d->shape, bits, &total) != 0) goto overflow;
    /* The shape is formatted only for a message: every publish and consume passes here. */
    if (d->nbytes != total) {
        format_shape(d, shape, sizeof shape);
        return vmmt__fail(x->status,
                          "descriptor field nbytes=%" PRIu64 " does not match shape %s of dtype "
                          "(code %u, bits %u, lanes %u), which is %" PRIu64 " bytes; %s",
                          d->nbytes, shape, d->dtype_code, d->dtype_bits, d->dtype_lanes, total,
                          x->advice);
    }
    if (d->offset % vmmt__desc_elem_align(d->dtype_bits, d->dtype_lanes) != 0)
        return vmmt__fail(x->status,
                          "descriptor field offset=%" PRIu64 " is not aligned to %" PRIu64
                          " bytes, the element size of dtype (bits %u, lanes %u); %s",
                          d->offset, vmmt__desc_elem_align(d->dtype_bits, d->dtype_lanes),
                          d->dtype_bits, d->dtype_lanes, x->advice);
    return VMMT_OK;

overflow:
    format_shape(d, shape, sizeof shape);
    return vmmt__fail(x->status,
                      "descriptor field shape %s with dtype (bits %u, lanes %u) overflows 64 bits "
                      "of size; %s",
                      shape, d->dtype_bits, d->dtype_lanes, x->advice);
}

static int check_memory(const struct vmmt__desc *d, const struct check_ctx *x)
{
    int shared = d->handle_type == VMMT_HANDLE_POSIX_FD && (d->flags & VMMT__DESC_HOST_TABLE);

    if (d->memory_location > 1)
        return vmmt__fail(x->status,
                          "descriptor field memory_location=%" PRIu32 " is neither 0 (device) "
                          "nor 1 (host); %s",
                          d->memory_location, x->advice);
    if (d->memory_location == 1 && !shared)
        return vmmt__fail(x->status,
                          "descriptor of a host pool without a POSIX fd and a "
                          "shared host table; %s",
                          x->advice);
    if (d->chunk_size == 0) {
        if (d->chunk != 0 || d->incarnation != 0)
            return vmmt__fail(x->status,
                              "descriptor names chunk %" PRIu32 " (incarnation "
                              "%" PRIu32 ") of a pool without chunks; %s",
                              d->chunk, d->incarnation, x->advice);
        return VMMT_OK;
    }
    if (!shared || d->chunk_size % 4096 != 0 || d->alloc_size % d->chunk_size != 0)
        return vmmt__fail(x->status,
                          "descriptor field chunk_size=%" PRIu64
                          " does not divide alloc_size=%" PRIu64
                          " in whole pages, or the pool has no POSIX fd and shared table; %s",
                          d->chunk_size, d->alloc_size, x->advice);
    if (d->chunk != d->offset / d->chunk_size || d->incarnation == 0)
        return vmmt__fail(x->status,
                          "descriptor names chunk %" PRIu32 " incarnation %" PRIu32
                          " for a buffer at offset %" PRIu64 " (chunk %" PRIu64 "); %s",
                          d->chunk, d->incarnation, d->offset, d->offset / d->chunk_size,
                          x->advice);
    return VMMT_OK;
}

int vmmt__desc_check(const struct vmmt__desc *d, int status, const char *advice)
{
    int (*const checks[])(const struct vmmt__desc *, const struct check_ctx *) = {
        check_handle, check_producer, check_geometry, check_slot,   check_extent,
        check_pack,   check_shape,    check_dtype,    check_memory,
    };
    const struct check_ctx x = {status, advice};

    if (d == NULL) return vmmt__fail(VMMT_EINVAL, "descriptor check: descriptor is NULL");
    for (size_t i = 0; i < sizeof checks / sizeof checks[0]; i++) {
        int st = checks[i](d, &x);
        if (st != VMMT_OK) return st;
    }
    return VMMT_OK;
}

/*
 * Host memory and chunks (elastic pools) are shared through POSIX fds and a
 * shared host table only; a chunked buffer names the chunk it starts in.
 */
int vmmt__desc_validate(const struct vmmt__desc *d)
{
    return vmmt__desc_check(d, VMMT_EPROTO, CORRUPT);
}

/* ------------------------------------------------------------- pool match */

static void hex16(const uint8_t id[16], char out[33])
{
    for (int i = 0; i < 16; i++)
        snprintf(out + 2 * i, 3, "%02x", id[i]);
}

#define POOL_DIFFERS                                                                               \
    "; the descriptor belongs to another pool, or the pool was recreated: import it again"

static int differs_u64(const char *field, uint64_t got, uint64_t want)
{
    return vmmt__fail(VMMT_EPROTO,
                      "descriptor field %s=%" PRIu64
                      " differs from the imported pool's %s=%" PRIu64 POOL_DIFFERS,
                      field, got, field, want);
}

int vmmt__desc_check_pool(const struct vmmt__desc *d, const struct vmmt__desc *pool)
{
    if (d == NULL || pool == NULL)
        return vmmt__fail(VMMT_EINVAL, "descriptor pool check: descriptor or pool is NULL");
    if (memcmp(d->pool_id, pool->pool_id, sizeof d->pool_id) != 0) {
        char got[33], want[33];
        hex16(d->pool_id, got);
        hex16(pool->pool_id, want);
        return vmmt__fail(
            VMMT_EPROTO,
            "descriptor field pool_id=%s differs from the imported pool's "
            "pool_id=%s; it names another pool: hand it to that pool's producer or consumer",
            got, want);
    }
    if (d->handle_type != pool->handle_type)
        return differs_u64("handle_type", d->handle_type, pool->handle_type);
    /* PACKED and TOKEN are the only per-buffer flags; the others say how the pool is
     * read (a cleared STREAM_ORDERED would skip the wait for the ready word). */
    if ((d->flags & ~(VMMT__DESC_PACKED | VMMT__DESC_TOKEN)) !=
        (pool->flags & ~(VMMT__DESC_PACKED | VMMT__DESC_TOKEN)))
        return vmmt__fail(VMMT_EPROTO,
                          "descriptor field flags=0x%" PRIx32
                          " differs from the imported pool's flags=0x%" PRIx32
                          " (PACKED aside)" POOL_DIFFERS,
                          d->flags, pool->flags);
    if (memcmp(d->fabric, pool->fabric, sizeof d->fabric) != 0)
        return vmmt__fail(VMMT_EPROTO,
                          "descriptor field fabric differs from the imported pool's" POOL_DIFFERS);
    if (d->broker.kind != pool->broker.kind || d->broker.len != pool->broker.len ||
        memcmp(d->broker.name, pool->broker.name, sizeof d->broker.name) != 0)
        return vmmt__fail(VMMT_EPROTO,
                          "descriptor field broker differs from the address the pool was "
                          "imported from" POOL_DIFFERS);
    if (d->producer_device != pool->producer_device)
        return differs_u64("producer_device", (uint64_t)d->producer_device,
                           (uint64_t)pool->producer_device);
    if (d->producer_pid != pool->producer_pid)
        return differs_u64("producer_pid", (uint64_t)d->producer_pid, (uint64_t)pool->producer_pid);
    if (d->producer_uid != pool->producer_uid)
        return differs_u64("producer_uid", d->producer_uid, pool->producer_uid);
    if (d->producer_pidns != pool->producer_pidns)
        return differs_u64("producer_pidns", d->producer_pidns, pool->producer_pidns);
    if (d->alloc_size != pool->alloc_size)
        return differs_u64("alloc_size", d->alloc_size, pool->alloc_size);
    if (d->table_offset != pool->table_offset)
        return differs_u64("table_offset", d->table_offset, pool->table_offset);
    if (d->table_slots != pool->table_slots)
        return differs_u64("table_slots", d->table_slots, pool->table_slots);
    if (d->slot_stride != pool->slot_stride)
        return differs_u64("slot_stride", d->slot_stride, pool->slot_stride);
    if (d->data_offset != pool->data_offset)
        return differs_u64("data_offset", d->data_offset, pool->data_offset);
    if (d->consumer_count != pool->consumer_count)
        return differs_u64("consumer_count", d->consumer_count, pool->consumer_count);
    if (d->chunk_size != pool->chunk_size)
        return differs_u64("chunk_size", d->chunk_size, pool->chunk_size);
    if (d->memory_location != pool->memory_location)
        return differs_u64("memory_location", d->memory_location, pool->memory_location);
    return VMMT_OK;
}

/* ------------------------------------------------------------------ public */

#define DESC_INFO_V1 VMMT__SIZE_V1(vmmt_desc_info, pack_count)

int vmmt_desc_inspect_size(const vmmt_desc *desc, vmmt_desc_info *theirs, size_t size)
{
    vmmt_desc_info info, *out = &info;
    struct vmmt__desc d;
    int st;

    if (desc == NULL || theirs == NULL)
        return vmmt__fail(VMMT_EINVAL, "vmmt_desc_inspect: desc or out is NULL");
    st = vmmt__struct_check(theirs, size, DESC_INFO_V1, "vmmt_desc_inspect: out");
    if (st != VMMT_OK) return st;
    st = vmmt__desc_decode(desc->bytes, &d);
    if (st != VMMT_OK) return st;
    memset(out, 0, sizeof *out);
    memcpy(out->pool_id, d.pool_id, sizeof out->pool_id);
    out->handle_type = (vmmt_handle_type)d.handle_type;
    out->producer_device = d.producer_device;
    out->consumer_count = (int)d.consumer_count;
    out->slot = d.slot;
    out->generation = d.generation;
    out->nbytes = d.nbytes;
    out->dtype = (vmmt_dtype){.code = d.dtype_code, .bits = d.dtype_bits, .lanes = d.dtype_lanes};
    out->ndim = (int)d.ndim;
    memcpy(out->shape, d.shape, sizeof out->shape);
    out->stream_ordered = (d.flags & VMMT__DESC_STREAM_ORDERED) != 0;
    out->pack_index = d.pack_index;
    out->pack_count = d.pack_count;
    out->memory_location = (int)d.memory_location;
    out->chunk_size = d.chunk_size;
    out->chunk = d.chunk;
    out->incarnation = d.incarnation;
    return vmmt__struct_out(theirs, size, &info, sizeof info, DESC_INFO_V1,
                            "vmmt_desc_inspect: out");
}

/* ------------------------------------------------------------------- seal */

void vmmt__desc_seal(uint8_t bytes[VMMT_DESC_SIZE], const uint8_t key[VMMT__SEAL_KEY_BYTES])
{
    put_u64(bytes, OFF_SEAL, vmmt__seal_of(key, bytes, OFF_SEAL, VMMT_DESC_SIZE));
}

int vmmt__desc_check_seal(const uint8_t bytes[VMMT_DESC_SIZE],
                          const uint8_t key[VMMT__SEAL_KEY_BYTES])
{
    uint64_t want = vmmt__seal_of(key, bytes, OFF_SEAL, VMMT_DESC_SIZE);

    if (get_u64(bytes, OFF_SEAL) == want) return VMMT_OK;
    return vmmt__fail(VMMT_EPROTO,
                      "descriptor seal 0x%016" PRIx64 " does not match its pool (slot %" PRIu32
                      " generation %" PRIu32 "): the record was changed after its producer "
                      "wrote it, or made by a process that never held the pool; hand out "
                      "descriptors exactly as vmmt_publish returned them (nothing was copied or "
                      "acknowledged)",
                      get_u64(bytes, OFF_SEAL), get_u32(bytes, OFF_SLOT),
                      get_u32(bytes, OFF_GENERATION));
}
