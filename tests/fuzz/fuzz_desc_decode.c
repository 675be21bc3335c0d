/*
 * Fuzz target: the descriptor decoder, public (vmmt_desc_inspect) and
 * internal (vmmt__desc_decode), on any 512 bytes (shorter inputs are padded
 * with zeros, longer ones cut). Invariants:
 * - both agree, and a refusal is VMMT_EPROTO with a printable message;
 * - an accepted record's ranges lie inside its allocation: the control table
 *   (unless it is a separate host table), the data region after it, the slice
 *   within the data region, the buffer within its slice;
 * - an accepted record is canonical: encoding what was decoded gives back the
 *   same 512 bytes, so no two records mean the same thing.
 */
#include <string.h>

#include "desc.h"
#include "fuzz.h"
#include "status.h"

static void check_ranges(const struct vmmt__desc *d)
{
    uint64_t table_bytes = (uint64_t)d->table_slots * d->slot_stride;

    FUZZ_ASSERT(d->slot < d->table_slots, "slot %u of %u", d->slot, d->table_slots);
    FUZZ_ASSERT(d->data_offset <= d->alloc_size, "data region starts past the allocation");
    if (!(d->flags & VMMT__DESC_HOST_TABLE)) {
        FUZZ_ASSERT(d->table_offset <= d->alloc_size &&
                        table_bytes <= d->alloc_size - d->table_offset,
                    "control table outside the allocation");
        FUZZ_ASSERT(d->data_offset >= d->table_offset + table_bytes,
                    "data region overlaps the control table");
    }
    FUZZ_ASSERT(d->slice_offset >= d->data_offset && d->slice_offset <= d->alloc_size &&
                    d->slice_bytes <= d->alloc_size - d->slice_offset,
                "slice outside the data region");
    FUZZ_ASSERT(d->offset >= d->slice_offset && d->offset - d->slice_offset <= d->slice_bytes &&
                    d->nbytes <= d->slice_bytes - (d->offset - d->slice_offset),
                "buffer outside its slice");
    FUZZ_ASSERT(d->pack_index < d->pack_count, "pack index %u of %u", d->pack_index, d->pack_count);
    FUZZ_ASSERT(d->ndim <= VMMT_MAX_DIMS, "ndim %u", d->ndim);
    FUZZ_ASSERT(d->consumer_count >= 1 && d->consumer_count <= VMMT__MAX_CONSUMERS,
                "consumer_count %u", d->consumer_count);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    vmmt_desc raw;
    vmmt_desc_info info;
    struct vmmt__desc d;
    uint8_t again[VMMT_DESC_SIZE];
    int st_public, st_internal;

    memset(&raw, 0, sizeof raw);
    memcpy(raw.bytes, data, size < VMMT_DESC_SIZE ? size : VMMT_DESC_SIZE);

    st_public = vmmt_desc_inspect(&raw, &info);
    if (st_public != VMMT_OK) {
        FUZZ_ASSERT(st_public == VMMT_EPROTO, "inspect returned %d", st_public);
        FUZZ_ASSERT(vmmt_last_error()[0] != '\0', "refusal without a message");
        FUZZ_ASSERT(fuzz_printable(vmmt_last_error()), "message: %s", vmmt_last_error());
    }
    st_internal = vmmt__desc_decode(raw.bytes, &d);
    FUZZ_ASSERT(st_internal == st_public, "inspect %d, decode %d", st_public, st_internal);
    if (st_internal != VMMT_OK) return 0;

    check_ranges(&d);
    FUZZ_ASSERT(vmmt__desc_validate(&d) == VMMT_OK, "decoded but does not validate");
    FUZZ_ASSERT(vmmt__desc_check_pool(&d, &d) == VMMT_OK, "differs from itself");
    vmmt__desc_encode(&d, again);
    FUZZ_ASSERT(memcmp(again, raw.bytes, VMMT_DESC_SIZE) == 0, "not canonical");

    FUZZ_ASSERT(memcmp(info.pool_id, d.pool_id, 16) == 0, "pool_id");
    FUZZ_ASSERT(info.slot == d.slot && info.generation == d.generation, "slot/generation");
    FUZZ_ASSERT(info.nbytes == d.nbytes, "nbytes");
    FUZZ_ASSERT(info.ndim == (int)d.ndim, "ndim");
    FUZZ_ASSERT(info.pack_index == d.pack_index && info.pack_count == d.pack_count, "pack");
    FUZZ_ASSERT(info.consumer_count == (int)d.consumer_count, "consumer_count");
    return 0;
}
