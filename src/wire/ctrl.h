/*
 * The control table at the start of every pool: one row per slot, each a
 * ready word followed by one acknowledgement word per consumer rank. Words
 * hold the generation of the slot's current occupant, so a word left over
 * from an earlier occupant can never match a newer one. The producer reads
 * the whole table in one copy; producer and consumers write single words
 * with stream memory operations.
 */
#ifndef VMMT_CTRL_H
#define VMMT_CTRL_H

#include <stddef.h>
#include <stdint.h>

#include "cuabi.h"
#include "generation.h"
#include "desc.h"
#include "seal.h"

#define VMMT__DATA_ALIGN 256

/* Row size in bytes: ready + one word per consumer, padded to 16 bytes. */
static inline uint32_t vmmt__ctrl_stride(uint32_t consumers)
{
    return (4u * (1u + consumers) + 15u) & ~15u;
}

static inline uint64_t vmmt__ctrl_ready(uint64_t table, uint32_t stride, uint32_t slot)
{
    return table + (uint64_t)slot * stride;
}

static inline uint64_t vmmt__ctrl_ack(uint64_t table, uint32_t stride, uint32_t slot, uint32_t rank)
{
    return vmmt__ctrl_ready(table, stride, slot) + 4u * (1u + rank);
}

/* Bytes of an elastic pool's chunk incarnation words after the rows of its shared table. */
static inline uint64_t vmmt__elastic_words_bytes(uint64_t alloc_size, uint64_t chunk)
{
    return alloc_size / chunk * 4u;
}

/* Acquire load of a table word written by another process or a GPU. */
static inline uint32_t vmmt__ctrl_load(const uint32_t *word)
{
    return __atomic_load_n(word, __ATOMIC_ACQUIRE);
}

/*
 * Acknowledge generation `gen` in a shared table word, only while `ready`
 * shows gen is the slot's occupant and its bytes landed: 1 if the word holds
 * gen afterwards and the occupant is still gen, 0 if the occupant is not (or
 * no longer) gen, when nothing is written. An acknowledgement thus never
 * names a generation before the producer gave it out (a forged or replayed
 * descriptor ahead of the slot cannot release the next occupant), and one
 * that finishes late (two of one slot in one sweep, in any order) never
 * overwrites its successor's: the compare-and-swap fails if the word changed
 * after it was read, and a successor's acknowledgement is written only after
 * the ready word moved on, which the re-read then sees. A word that holds
 * gen already was written by the producer (a cancel or a rank's release
 * writes it over the TAKEN word this process's consume put there; no other
 * consumer can), so that is 1 only while the slot still shows gen. Whether
 * the copy this acknowledgement follows read the occupant's bytes is not
 * this word's question: the caller asks the ready word once, after the copy
 * completed and before the first store (consume.c, write_shared), since a
 * slot moved on before that may have given the slice to the next buffer
 * (test_attack_outside2, cancel_under_queued_copy_check), and one moved on
 * after it, by this very store, did not.
 */
static inline int vmmt__ctrl_store_ack(uint32_t *word, const uint32_t *ready, uint32_t gen)
{
    for (int tries = 0; tries < 1000; tries++) {
        uint32_t cur = __atomic_load_n(word, __ATOMIC_ACQUIRE);
        if (cur == gen) return vmmt__ctrl_load(ready) == gen;
        if (vmmt__ctrl_load(ready) != gen) return 0;
        if (__atomic_compare_exchange_n(word, &cur, gen, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return 1;
    }
    /* Only writers of the same rank's word race here; a thousand lost races is a livelock. */
    return 0;
}

/*
 * Where the table lives. POSIX_FD pools keep it in host memory shared by
 * every process (a memfd, registered with the driver so that streams can
 * write and wait on it): the producer's recycler and a consumer checking a
 * ready flag read it with plain loads, no driver call at all. FABRIC pools
 * span nodes, which share no host memory, so their table stays at the start
 * of the device allocation.
 */
struct vmmt__ctrl {
    uint32_t *host;  /* CPU view of a shared table's rows; NULL for a device table */
    CUdeviceptr dev; /* the rows where stream operations write and wait */
    void *base;      /* the mapping: the pool record, then the rows at host */
    size_t bytes;    /* length mapped (whole pages) */
    int fd;          /* the memfd while this process keeps it, else -1 */
    int registered;
};

/*
 * The pool record: the first 64 bytes of every control table, before its
 * rows (the memfd's offset 0 for a shared table, the allocation's for a
 * device table), so that no descriptor field decides where a reader finds
 * it. Written by the producer: "POOL", table_slots, slot_stride and
 * consumer_count as little-endian u32, the pool id, table_offset and
 * data_offset as little-endian u64, then the pool's 16-byte seal key
 * (seal.h). A consumer that imports the pool compares all but the key with
 * the descriptor that brought it, and keeps the key, with which it checks
 * the seal of every descriptor of the pool, the first one included. Found
 * after the rows, where the descriptor's geometry placed it, a record could
 * be planted in published data and named by a forged table_offset; without
 * the pool id, one pool's descriptor sealed with its own key imported under
 * another pool's id (tests/unit/test_attack_seal.c).
 */
#define VMMT__CTRL_RECORD_BYTES VMMT__DESC_TABLE_RECORD_BYTES

struct vmmt__ctrl_record {
    uint32_t slots, stride, consumers;
    uint8_t pool_id[16];
    uint64_t table_offset, data_offset;
    uint8_t key[VMMT__SEAL_KEY_BYTES];
};

/* Producer: the record's bytes. */
void vmmt__ctrl_record_encode(const struct vmmt__ctrl_record *r,
                              uint8_t out[VMMT__CTRL_RECORD_BYTES]);

/*
 * The record's one validator, for writer and reader: the bytes must be a
 * record of the pool `want` describes (every field but the key compared); on
 * success want->key is filled from it. `where` names where the bytes were
 * read. VMMT_EPROTO otherwise, naming the field, saying the descriptor is
 * not this pool's.
 */
int vmmt__ctrl_record_check(const uint8_t in[VMMT__CTRL_RECORD_BYTES],
                            struct vmmt__ctrl_record *want, const char *where);

/* Producer: a new zeroed shared table of at least `bytes` (record included), mapped and
 * registered. */
int vmmt__ctrl_create_shared(size_t bytes, struct vmmt__ctrl *c);

/* The same without registration: a host pool's producer needs no context. */
int vmmt__ctrl_create_shared_unregistered(size_t bytes, struct vmmt__ctrl *c);

/*
 * Consumer: map the table behind fd (which the caller keeps): its pool
 * record, then `at` bytes of rows and words. The record must describe the
 * pool of `rec`, whose key is then filled. Registration with the driver
 * (so that streams can address it) only when asked: a consumer that reads
 * flags and writes acknowledgements with the CPU needs none, and
 * registering costs about 100 us on the H200.
 */
int vmmt__ctrl_attach_shared(int fd, size_t at, struct vmmt__ctrl_record *rec,
                             int register_with_driver, struct vmmt__ctrl *c);

/* Register a table mapped without registration (idempotent); fills c->dev. */
int vmmt__ctrl_register(struct vmmt__ctrl *c);

/* Unregister, unmap, close: whatever was done, in reverse. Needs the context current. */
void vmmt__ctrl_release(struct vmmt__ctrl *c);

#endif
