/*
 * Forged descriptors: a real descriptor with one field changed, at the
 * offsets of docs/descriptor.md (the wire contract, not the library's
 * structs). Each mutation comes in the forms the field allows: one that
 * still decodes (a valid re-encoding that names something else) and one
 * that breaks a rule of the decoder; vmmt_desc_inspect, the readers'
 * validator, says afterwards which one it is, so that the model judges the
 * answer by what the bytes are, not by what was meant.
 */
#include "forge.h"
#include "model.h"

#include <string.h>

enum {
    F_MAGIC,
    F_VERSION,
    F_SIZE,
    F_RESERVED,
    F_HANDLE_TYPE,
    F_FLAGS_UNKNOWN,
    F_FLAGS_STREAM_ORDERED,
    F_FLAGS_HOST_TABLE,
    F_FLAGS_TOKEN,
    F_POOL_ID,
    F_POOL_ID_ZERO,
    F_FABRIC,
    F_BROKER_KIND,
    F_BROKER_LEN,
    F_BROKER_NAME,
    F_PRODUCER_DEVICE,
    F_PRODUCER_PID,
    F_CONSUMER_COUNT,
    F_TABLE_SLOTS,
    F_ALLOC_SIZE,
    F_TABLE_OFFSET,
    F_SLOT_STRIDE,
    F_PRODUCER_UID,
    F_DATA_OFFSET,
    F_SLOT,
    F_SLOT_AND_GEN,
    F_GEN_ZERO,
    F_GEN_OLDER,
    F_GEN_ONE_AHEAD,
    F_GEN_FAR_AHEAD,
    F_SLICE,
    F_OFFSET,
    F_NBYTES,
    F_PACK_INDEX,
    F_PACK_COUNT,
    F_DTYPE,
    F_NDIM,
    F_SHAPE,
    F_PIDNS,
    F_CHUNK_SIZE,
    F_CHUNK,
    F_INCARNATION,
    F_MEMORY_LOCATION,
    F_COUNT
};

static const char *const names[F_COUNT] = {"magic",
                                           "version",
                                           "size",
                                           "reserved",
                                           "handle_type",
                                           "flags.unknown",
                                           "flags.stream_ordered",
                                           "flags.host_table",
                                           "flags.token",
                                           "pool_id",
                                           "pool_id.zero",
                                           "fabric",
                                           "broker.kind",
                                           "broker.len",
                                           "broker.name",
                                           "producer_device",
                                           "producer_pid",
                                           "consumer_count",
                                           "table_slots",
                                           "alloc_size",
                                           "table_offset",
                                           "slot_stride",
                                           "producer_uid",
                                           "data_offset",
                                           "slot",
                                           "slot+generation",
                                           "generation.zero",
                                           "generation.older",
                                           "generation.one_ahead",
                                           "generation.far_ahead",
                                           "slice",
                                           "offset",
                                           "nbytes",
                                           "pack_index",
                                           "pack_count",
                                           "dtype",
                                           "ndim",
                                           "shape",
                                           "producer_pidns",
                                           "chunk_size",
                                           "chunk",
                                           "incarnation",
                                           "memory_location"};

int mt_forge_count(void)
{
    return F_COUNT;
}

const char *mt_forge_name(int which)
{
    return which >= 0 && which < F_COUNT ? names[which] : "?";
}

int mt_forge_is_one_ahead(int which)
{
    return which == F_GEN_ONE_AHEAD;
}

#define GET(off, n)    mt_get(d, off, n)
#define PUT(off, n, v) mt_put(d, off, n, v)

/* Reserved ranges, [start, end). */
static const unsigned reserved[][2] = {{20, 24}, {214, 216}, {316, 320}, {392, 480}, {500, 512}};

void mt_forge(vmmt_desc *d, int which, uint64_t r, const struct mt_forge_in *in)
{
    int invalid = (int)(r & 1); /* the rule-breaking form, where the field has both */
    uint64_t v;

    r >>= 1;
    switch (which) {
    case F_MAGIC: d->bytes[r % 8] ^= (uint8_t)(1 + r % 255); break;
    case F_VERSION: PUT(8, 2, invalid ? 0 : 2); break;
    case F_SIZE: PUT(10, 2, GET(10, 2) - 1 - r % 4); break;
    case F_RESERVED: {
        const unsigned *range = reserved[r % 5];
        d->bytes[range[0] + (r >> 3) % (range[1] - range[0])] = (uint8_t)(1 + (r >> 8) % 255);
        break;
    }
    case F_HANDLE_TYPE: PUT(12, 4, invalid ? 2 : (GET(12, 4) == 1 ? 8 : 1)); break;
    case F_FLAGS_UNKNOWN: PUT(16, 4, GET(16, 4) | (1u << (4 + r % 28))); break;
    case F_FLAGS_STREAM_ORDERED: PUT(16, 4, GET(16, 4) ^ 1u); break;
    case F_FLAGS_HOST_TABLE: PUT(16, 4, GET(16, 4) ^ 4u); break;
    case F_FLAGS_TOKEN: PUT(16, 4, GET(16, 4) | 8u); break;
    case F_POOL_ID: d->bytes[24 + r % 16] ^= (uint8_t)(1 + (r >> 4) % 255); break;
    case F_POOL_ID_ZERO: memset(d->bytes + 24, 0, 16); break;
    case F_FABRIC: d->bytes[40 + r % 64] ^= (uint8_t)(1 + (r >> 6) % 255); break;
    case F_BROKER_KIND: PUT(104, 1, invalid ? 2 : (GET(104, 1) ^ 1)); break;
    case F_BROKER_LEN:
        v = GET(105, 1);
        if (invalid)
            PUT(105, 1, r % 2 ? 0 : 108);
        else if (v > 1 && r % 2) /* shorter: the byte left past len breaks the rule */
            PUT(105, 1, v - 1);
        else if (v < 107) { /* longer, the new byte a letter: another address */
            d->bytes[106 + v] = 'x';
            PUT(105, 1, v + 1);
        }
        break;
    case F_BROKER_NAME:
        v = GET(105, 1);
        if (v > 0) d->bytes[106 + r % v] ^= (uint8_t)(invalid ? 0 : 1);
        if (invalid) d->bytes[106 + v + r % (108 - v)] = 'y';
        break;
    case F_PRODUCER_DEVICE: PUT(216, 4, invalid ? UINT32_MAX : GET(216, 4) + 1); break;
    case F_PRODUCER_PID: PUT(220, 4, invalid ? UINT32_MAX : GET(220, 4) + 1 + r % 7); break;
    case F_CONSUMER_COUNT:
        v = GET(224, 4);
        PUT(224, 4, invalid ? (r % 2 ? 0 : 257) : (v > 1 && r % 2 ? v - 1 : v + 1));
        break;
    case F_TABLE_SLOTS:
        v = GET(228, 4);
        PUT(228, 4, invalid ? 0 : (v > 1 && r % 2 ? v - 1 : v + 1 + r % 3));
        break;
    case F_ALLOC_SIZE:
        v = GET(232, 8);
        PUT(232, 8, invalid ? 1 : (r % 2 ? v + (2u << 20) : v - 4096));
        break;
    case F_TABLE_OFFSET: PUT(240, 8, GET(240, 8) + (invalid ? 2 : 256)); break;
    case F_SLOT_STRIDE: PUT(248, 4, invalid ? 4 : GET(248, 4) + 16); break;
    case F_PRODUCER_UID: PUT(252, 4, GET(252, 4) + 1 + r % 1000); break;
    case F_DATA_OFFSET: PUT(256, 8, invalid ? GET(232, 8) + 1 : GET(256, 8) + 256); break;
    case F_SLOT:
        v = GET(228, 4);
        PUT(264, 4, invalid ? v + r % 3 : (GET(264, 4) + 1 + r % (v > 1 ? v - 1 : 1)) % v);
        break;
    case F_SLOT_AND_GEN: /* another LIVE occupant's slot and generation: a real name */
        if (in->live_ok) {
            PUT(264, 4, in->live_slot);
            PUT(268, 4, in->live_gen);
        } else {
            PUT(268, 4, GET(268, 4) + 1000);
        }
        break;
    case F_GEN_ZERO: PUT(268, 4, 0); break;
    case F_GEN_OLDER:
        v = GET(268, 4);
        PUT(268, 4, v > 1 + r % 3 ? v - 1 - r % 3 : UINT32_MAX);
        break;
    case F_GEN_ONE_AHEAD: {
        uint32_t s = (uint32_t)GET(264, 4);
        uint32_t g = s < in->slots ? in->slot_gen[s] : (uint32_t)GET(268, 4);
        PUT(268, 4, m_next_gen(g));
        break;
    }
    case F_GEN_FAR_AHEAD: {
        uint32_t s = (uint32_t)GET(264, 4);
        uint32_t g = s < in->slots ? in->slot_gen[s] : (uint32_t)GET(268, 4);
        /* Often a valid generation (4k + 1), so that it reaches the occupancy checks. */
        PUT(268, 4, r % 3 ? g + 4 * (2 + r % 1000) : g + 2 + r % (r % 2 ? 1000 : 0x7fff0000u));
        break;
    }
    case F_SLICE:
        if (invalid) {
            PUT(280, 8, GET(232, 8));
        } else if (GET(272, 8) >= GET(256, 8) + 256) {
            PUT(272, 8, GET(272, 8) - 256);
            PUT(280, 8, GET(280, 8) + 256);
        } else {
            PUT(280, 8, GET(280, 8) - 16); /* a slice shorter than its members: invalid */
        }
        break;
    case F_OFFSET:
        if (invalid || GET(309, 1) != 0 || GET(296, 8) <= 16) {
            PUT(288, 8, GET(272, 8) + GET(280, 8)); /* past the slice */
        } else {
            PUT(288, 8, GET(288, 8) + 16);
            PUT(296, 8, GET(296, 8) - 16);
        }
        break;
    case F_NBYTES:
        if (invalid || GET(309, 1) != 0)
            PUT(296, 8, GET(296, 8) + 1 + r % 4096);
        else if (GET(296, 8) > 16)
            PUT(296, 8, GET(296, 8) - 1 - r % 15);
        break;
    case F_PACK_INDEX:
        v = GET(306, 2);
        PUT(304, 2, invalid || v == 1 ? v : (GET(304, 2) + 1 + r % (v - 1)) % v);
        break;
    case F_PACK_COUNT:
        v = GET(306, 2);
        if (invalid) {
            PUT(306, 2, r % 2 ? 0 : 65);
        } else {
            PUT(306, 2, v + 1);
            PUT(16, 4, GET(16, 4) | 2u); /* PACKED, as a group of more than one has */
        }
        break;
    case F_DTYPE:
        if (GET(309, 1) == 0) { /* untyped bytes become a uint8 vector of the same bytes */
            PUT(308, 1, 1);
            PUT(309, 1, 8);
            PUT(310, 2, 1);
            PUT(312, 4, 1);
            PUT(320, 8, GET(296, 8));
            if (invalid) PUT(309, 1, 16);
        } else if (invalid) {
            PUT(309, 1, 0);
        } else { /* float32 [n] as int32 [n] */
            PUT(308, 1, 0);
        }
        break;
    case F_NDIM: PUT(312, 4, invalid ? 9 : GET(312, 4) + 1); break;
    case F_SHAPE: PUT(320 + 8 * (r % 8), 8, invalid ? UINT64_MAX : GET(320, 8) + 1); break;
    case F_PIDNS: PUT(384, 8, GET(384, 8) + 1 + r % 5); break;
    case F_CHUNK_SIZE: PUT(480, 8, GET(480, 8) ? GET(480, 8) * 2 : (2u << 20)); break;
    case F_CHUNK: PUT(488, 4, GET(488, 4) + 1); break;
    case F_INCARNATION: PUT(492, 4, invalid ? 0 : GET(492, 4) + 1 + r % 3); break;
    case F_MEMORY_LOCATION: PUT(496, 4, invalid ? 2 : GET(496, 4) ^ 1); break;
    }
}
