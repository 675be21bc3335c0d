/*
 * Fuzz target: encode then decode. The input chooses a descriptor's fields,
 * mostly inside the shapes a producer writes (so that many pass validation)
 * and sometimes raw. Invariants:
 * - a descriptor that validates encodes to a record that decodes to the same
 *   fields (and encodes to the same bytes again);
 * - encoding never turns an invalid descriptor into one that decodes, except
 *   by the one thing encoding does: zeroing the broker name past its length.
 */
#include <string.h>

#include "desc.h"
#include "fuzz.h"
#include "status.h"

/* A value below `bound` most of the time; the raw 64 bits when the selector says so. */
static uint64_t pick(struct fuzz_bytes *b, uint64_t bound, int raw)
{
    uint64_t v = fuzz_take(b, 8);
    return raw || bound == 0 ? v : v % bound;
}

static uint64_t align_up(uint64_t v, uint64_t a)
{
    return (v + a - 1) / a * a;
}

/*
 * Fields in the order a producer fixes them: handle and broker, table
 * geometry, the tensor, then its place. Each bit of the selector word (sel)
 * makes one group of fields raw instead, so that every check sees its edge
 * cases.
 */
static void build(struct fuzz_bytes *b, struct vmmt__desc *d)
{
    /* Half the inputs are shaped like a producer's; the rest have a few raw groups each. */
    uint32_t sel = (fuzz_take(b, 1) & 1) ? (uint32_t)(fuzz_take(b, 4) & fuzz_take(b, 4)) : 0;
    uint64_t table_bytes, elems = 1, bits, align = 1;
    int fabric = fuzz_take(b, 1) & 1;

    memset(d, 0, sizeof *d);
    for (int i = 0; i < 16; i++)
        d->pool_id[i] = (uint8_t)fuzz_take(b, 1);
    d->handle_type = (sel & 1) ? (uint32_t)fuzz_take(b, 4)
                               : (fabric ? VMMT_HANDLE_FABRIC : VMMT_HANDLE_POSIX_FD);
    if (d->handle_type == VMMT_HANDLE_FABRIC) {
        for (int i = 0; i < 64; i++)
            d->fabric[i] = (uint8_t)fuzz_take(b, 1);
    } else {
        d->broker.kind = (uint8_t)fuzz_take(b, 1) & ((sel & 4) ? 0xff : 1);
        d->broker.len = (uint8_t)((sel & 4) ? fuzz_take(b, 1) : 1 + fuzz_take(b, 1) % 107);
        for (unsigned i = 0; i < sizeof d->broker.name; i++) {
            uint8_t c = (uint8_t)fuzz_take(b, 1);
            /* A path has no NUL inside; an abstract name may. */
            if (!(sel & 4) && d->broker.kind == 1 && c == 0) c = '/';
            d->broker.name[i] = (i < d->broker.len || (sel & 8)) ? (char)c : 0;
        }
    }
    d->producer_device = (int32_t)((sel & 2) ? fuzz_take(b, 4) : fuzz_take(b, 1));
    d->producer_pid = (int32_t)((sel & 2) ? fuzz_take(b, 4) : fuzz_take(b, 4) & 0x7fffffff);

    d->consumer_count = (uint32_t)pick(b, 256, sel & 16) + !(sel & 16);
    d->table_slots = (uint32_t)pick(b, 4096, sel & 32) + !(sel & 32);
    d->slot_stride = (uint32_t)((sel & 64) ? fuzz_take(b, 4)
                                           : 4u * (1 + d->consumer_count) + 4u * pick(b, 8, 0));
    d->pack_count = (uint16_t)((sel & 8192) ? fuzz_take(b, 2) : 1 + fuzz_take(b, 1) % 8);
    d->pack_index = (uint16_t)pick(b, d->pack_count, sel & 8192);
    d->flags = (sel & 2) ? (uint32_t)fuzz_take(b, 4)
                         : ((uint32_t)fuzz_take(b, 1) & VMMT__DESC_STREAM_ORDERED) |
                               (d->pack_count > 1 ? VMMT__DESC_PACKED : 0) |
                               (d->handle_type == VMMT_HANDLE_POSIX_FD && (fuzz_take(b, 1) & 1)
                                    ? VMMT__DESC_HOST_TABLE
                                    : 0);
    table_bytes = (uint64_t)d->table_slots * d->slot_stride;
    d->table_offset = (d->flags & VMMT__DESC_HOST_TABLE) ? 0 : 4 * pick(b, 1024, sel & 128);
    d->slot = (uint32_t)pick(b, d->table_slots, sel & 1024);
    d->generation = (uint32_t)fuzz_take(b, 4);

    /* The tensor: untyped bytes, or a dtype with a small shape. */
    d->dtype_bits = (uint8_t)fuzz_take(b, 1);
    d->dtype_code = d->dtype_bits || (sel & 32768) ? (uint8_t)fuzz_take(b, 1) : 0;
    d->dtype_lanes = (uint16_t)((sel & 32768)   ? fuzz_take(b, 2)
                                : d->dtype_bits ? 1 + fuzz_take(b, 1) % 4
                                                : 0);
    d->ndim = (uint32_t)pick(b, VMMT_MAX_DIMS + 1, sel & 16384);
    for (unsigned i = 0; i < VMMT_MAX_DIMS; i++)
        d->shape[i] = (i < d->ndim || (sel & 32768)) ? (int64_t)pick(b, 8, sel & 65536) : 0;
    for (unsigned i = 0; i < d->ndim && i < VMMT_MAX_DIMS; i++)
        elems *= (uint64_t)d->shape[i];
    bits = elems * d->dtype_bits * d->dtype_lanes;
    /* nbytes as a producer computes it (rounded up), so the dtype check can pass. */
    d->nbytes = (sel & 131072) ? fuzz_take(b, 8) : d->dtype_bits ? (bits + 7) / 8 : fuzz_take(b, 3);
    while (d->dtype_bits && align < ((uint64_t)d->dtype_bits * d->dtype_lanes + 7) / 8 &&
           align < VMMT__DESC_MAX_ELEM_ALIGN)
        align *= 2;

    /* Its place: data region after the table, slice in it, buffer in the slice. */
    d->data_offset =
        (sel & 512) ? fuzz_take(b, 8) : d->table_offset + table_bytes + pick(b, 1u << 20, 0);
    d->slice_offset = (sel & 2048) ? fuzz_take(b, 8) : d->data_offset + pick(b, 1ull << 30, 0);
    d->offset =
        (sel & 4096) ? fuzz_take(b, 8) : align_up(d->slice_offset + pick(b, 4096, 0), align);
    d->slice_bytes =
        (sel & 2048) ? fuzz_take(b, 8) : d->offset - d->slice_offset + d->nbytes + pick(b, 4096, 0);
    d->alloc_size =
        (sel & 256) ? fuzz_take(b, 8) : d->slice_offset + d->slice_bytes + pick(b, 1ull << 30, 0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct fuzz_bytes b = {data, size};
    struct vmmt__desc d, back;
    uint8_t wire[VMMT_DESC_SIZE], again[VMMT_DESC_SIZE];
    int valid, decoded;

    build(&b, &d);
    valid = vmmt__desc_validate(&d) == VMMT_OK;
    vmmt__desc_encode(&d, wire);
    decoded = vmmt__desc_decode(wire, &back) == VMMT_OK;
    if (valid) {
        FUZZ_ASSERT(decoded, "valid descriptor does not decode: %s", vmmt_last_error());
        FUZZ_ASSERT(memcmp(&back, &d, sizeof d) == 0, "decoded fields differ");
        vmmt__desc_encode(&back, again);
        FUZZ_ASSERT(memcmp(wire, again, sizeof wire) == 0, "second encoding differs");
        return 0;
    }
    if (decoded) {
        /* Only the name's tail may have made d invalid: put it as encoding left it. */
        struct vmmt__desc trimmed = d;
        if (trimmed.broker.len <= sizeof trimmed.broker.name)
            memset(trimmed.broker.name + trimmed.broker.len, 0,
                   sizeof trimmed.broker.name - trimmed.broker.len);
        FUZZ_ASSERT(vmmt__desc_validate(&trimmed) == VMMT_OK,
                    "invalid descriptor decodes after encoding");
    }
    return 0;
}
