/*
 * The descriptor wire format: a fixed 512-byte little-endian record (layout
 * in docs/descriptor.md). Decoding validates every field before anything is
 * mapped or copied, so a corrupt or foreign record fails here with a message
 * naming the field, never later as a bad address.
 */
#ifndef VMMT_DESC_H
#define VMMT_DESC_H

#include <stdint.h>

#include "broker_addr.h"
#include "seal.h"

#include "vmmt.h"

/* Version 2: the control table's ready words name an occupant's state
 * (src/wire/ctrl.h); version 1's generations stepped by one. */
#define VMMT__DESC_VERSION  2
#define VMMT__MAX_CONSUMERS 256
/* Slots of a control table at most (max_slices), for writer and reader alike. */
#define VMMT__MAX_TABLE_SLOTS (1u << 20)
/* The pool record before a table's rows, at its offset 0 (ctrl.h); table_offset is this. */
#define VMMT__DESC_TABLE_RECORD_BYTES 64u
#define VMMT__MAX_PACK                64 /* buffers of one packed group: a reader tracks them in 64 bits */

/* flags */
#define VMMT__DESC_STREAM_ORDERED 1u /* the consumer waits for the ready word on its stream */
#define VMMT__DESC_PACKED         2u /* one buffer of a packed group sharing a slice */
#define VMMT__DESC_HOST_TABLE                                                                      \
    4u /* the control table is a shared host memfd, not in the allocation */
/* A reservation's token (vmmt_reserve): vmmt_commit and vmmt_cancel take it, readers refuse it. */
#define VMMT__DESC_TOKEN 8u
#define VMMT__DESC_KNOWN_FLAGS                                                                     \
    (VMMT__DESC_STREAM_ORDERED | VMMT__DESC_PACKED | VMMT__DESC_HOST_TABLE | VMMT__DESC_TOKEN)

/* broker.kind */
#define VMMT__BROKER_ABSTRACT 0 /* Linux abstract socket name, without the leading NUL */
#define VMMT__BROKER_PATH     1 /* filesystem path */
#define VMMT__BROKER_NAME_MAX 107

/* The largest element alignment checked: a vector type wider than this needs no more. */
#define VMMT__DESC_MAX_ELEM_ALIGN 256u

struct vmmt__desc {
    uint8_t pool_id[16];             /* random per pool, never all zero */
    uint32_t handle_type;            /* 1 POSIX_FD, 8 FABRIC */
    uint32_t flags;                  /* VMMT__DESC_STREAM_ORDERED, VMMT__DESC_PACKED */
    uint8_t fabric[64];              /* FABRIC handle, zero otherwise */
    struct vmmt__broker_addr broker; /* POSIX_FD: where to fetch the fd; zero for FABRIC */
    int32_t producer_device;         /* >= 0 */
    int32_t producer_pid;            /* >= 0; 0 when unknown */
    uint32_t producer_uid;           /* effective uid of the producer: its broker must have it */
    uint64_t producer_pidns;         /* inode of the producer's pid namespace; 0 when unknown */
    uint32_t consumer_count;         /* 1..VMMT__MAX_CONSUMERS */
    uint64_t alloc_size;             /* size of the exported allocation */
    uint64_t table_offset;           /* control table: slots * slot_stride bytes from here */
    uint32_t table_slots;            /* >= 1 */
    uint32_t slot_stride;      /* bytes per slot, >= 4 * (1 + consumer_count), multiple of 4 */
    uint64_t data_offset;      /* data region start; >= end of the table, <= alloc_size */
    uint32_t slot, generation; /* slot < table_slots, generation != 0 */
    uint64_t slice_offset,
        slice_bytes;         /* the whole slice (covers every buffer of a packed group) */
    uint64_t offset, nbytes; /* this buffer */
    uint16_t pack_index, pack_count;
    uint8_t dtype_code, dtype_bits; /* dtype_bits 0: untyped bytes (code and lanes 0 too) */
    uint16_t dtype_lanes;
    uint32_t ndim;
    int64_t shape[VMMT_MAX_DIMS]; /* entries past ndim are 0 */
    uint64_t chunk_size;          /* elastic pools: bytes per chunk; 0 otherwise */
    uint32_t chunk, incarnation;  /* the chunk the buffer starts in, and which making of it */
    uint32_t memory_location;     /* 0 device memory, 1 host memory */
    uint64_t seal;                /* seal.h: written by vmmt__desc_seal over the encoded bytes */
};

/* Writes d as it is, reserved bytes zero; check it first with vmmt__desc_validate. */
void vmmt__desc_encode(const struct vmmt__desc *d, uint8_t out[VMMT_DESC_SIZE]);

/*
 * Reads and validates a record: VMMT_EPROTO naming the field and what is
 * wrong with it. *d is unspecified on failure.
 */
int vmmt__desc_decode(const uint8_t in[VMMT_DESC_SIZE], struct vmmt__desc *d);

/*
 * The slot and generation of a record this process encoded itself (a
 * publish's output), read without the checks of decode: for a publisher
 * that tracks its own hand-offs. Never for records from elsewhere.
 */
void vmmt__desc_own_slot(const uint8_t in[VMMT_DESC_SIZE], uint32_t *slot, uint32_t *generation);

/*
 * The bytes of a tensor of `ndim` extents (none negative) whose elements
 * have elem_bits bits each, the last byte rounded up: what nbytes must be.
 * -1 when they do not fit in 64 bits.
 */
int vmmt__desc_tensor_bytes(uint32_t ndim, const int64_t *shape, uint64_t elem_bits,
                            uint64_t *nbytes);

/* The field checks of decode on a decoded form: VMMT_EPROTO, "corrupt" advice. */
int vmmt__desc_validate(const struct vmmt__desc *d);

/*
 * The same checks, failing with `status` and ending each message with
 * `advice`: the producer runs them on every record before it reserves
 * anything (VMMT_EINVAL, advice about the buffer), so that nothing is
 * published that a reader would refuse.
 */
int vmmt__desc_check(const struct vmmt__desc *d, int status, const char *advice);

/* Element size ceil(bits * lanes / 8) rounded up to a power of two, capped at 256. */
uint64_t vmmt__desc_elem_align(uint8_t bits, uint16_t lanes);

/* Producer: write the seal of an encoded record under the pool's key (seal.h). */
void vmmt__desc_seal(uint8_t bytes[VMMT_DESC_SIZE], const uint8_t key[VMMT__SEAL_KEY_BYTES]);

/*
 * Reader: VMMT_OK if the record carries the seal `key` gives it, else
 * VMMT_EPROTO. Checked before any field of the record is believed, by every
 * consumer call and by the producer's cancel and commit.
 */
int vmmt__desc_check_seal(const uint8_t bytes[VMMT_DESC_SIZE],
                          const uint8_t key[VMMT__SEAL_KEY_BYTES]);

/*
 * Check a decoded descriptor against the one the pool was imported (or
 * created) with: every field that names or describes the pool (pool_id,
 * handle_type, the flags but PACKED, fabric, broker, producer, consumer_count
 * and the geometry) must be equal; VMMT_EPROTO naming the first that differs.
 */
int vmmt__desc_check_pool(const struct vmmt__desc *d, const struct vmmt__desc *pool);

#endif
