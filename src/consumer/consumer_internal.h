/*
 * The consumer, shared by import_cache.c (the per-process cache of imported
 * pools: import, eviction, teardown that can be retried) and consume.c
 * (consume and acknowledge). consume.c reaches an import only through the
 * calls below, made with the consumer's lock held.
 */
#ifndef VMMT_CONSUMER_INTERNAL_H
#define VMMT_CONSUMER_INTERNAL_H

#include <pthread.h>
#include <stdint.h>
#include <time.h>

#include "acker.h"
#include "ctrl.h"
#include "cuabi.h"
#include "desc.h"
#include "rank_set.h"
#include "vmm.h"
#include "vmmt.h"

/*
 * A packed group being consumed for one rank set: which members are done
 * and the stream they were copied on. Its acknowledgement goes on that
 * stream after the last member, so it can never overtake a member's copy.
 */
struct pack_group {
    struct vmmt__ranks ranks;
    uint64_t members;
    CUstream stream;
};

#define PACK_GROUPS 4

/* What this process has done with one slot's current occupant. */
struct slot_state {
    uint32_t generation;
    /* The occupant's slice and member count as its first descriptor here said:
     * a later member must agree, or a forged one could complete the group. */
    uint64_t slice_offset;
    uint16_t pack_count;
    /* Its producer died before its ready word reached the generation: what
     * this process copied out of the slot is not the producer's buffer. */
    int failed;
    uint64_t ranks_acked[VMMT__MAX_CONSUMERS / 64];
    /* Ranks whose word of a shared table this process moved to TAKEN (consume.c,
     * take_words) for this occupant: its own, not another process's consume. */
    uint64_t ranks_taken[VMMT__MAX_CONSUMERS / 64];
    struct pack_group groups[PACK_GROUPS];
};

struct vmmt__chunk_map;
struct vmmt__broker_link;

struct imported {
    struct vmmt_consumer *owner;
    struct vmmt__desc geometry; /* the pool-wide fields of the first descriptor */
    int device;
    struct vmmt__mapping map;
    int host_table; /* the control table is the shared memfd in ctrl, read and written by CPU */
    struct vmmt__ctrl ctrl;
    struct vmmt__broker_link *link; /* POSIX_FD: open while we use the pool (our liveness) */
    CUdeviceptr table;              /* the control table as streams address it */
    struct vmmt__chunk_map *chunks; /* elastic pools: chunks mapped on first use (chunks.c) */
    struct slot_state *slots;
    int users; /* consume and ack calls using the mapping (lock held) */
    /*
     * Copies out of the pool not yet known complete: each is followed by an
     * event the acker watches, and its acknowledgement, if any, is written
     * then. Atomic: the acker lowers it without the consumer's lock, so that
     * an eviction may flush the acker while holding that lock. Never unmapped
     * while nonzero: a queued copy would read unmapped memory.
     */
    int copies;
    int open_groups;     /* packed groups partly consumed: their progress lives here */
    uint64_t last_used;  /* consumer->clock at the last consume or ack */
    uint64_t serial;     /* names this import to the producer watch (never reused) */
    int pidfd;           /* the producer process, from the broker connection; -1 if unknown */
    int dead;            /* the producer exited or shut the pool down: no new consumes; let go
                            once idle */
    uint64_t checked_us; /* when the pidfd was last polled by a consume */
    /* Host polling of ready words where a stream may not wait on them. */
    pthread_mutex_t poll_lock;
    CUstream poll_stream;
    uint32_t *poll_word; /* pinned: a slot's ready word and its rank words (VMMT__POLL_WORDS) */
    uint8_t seal_key[VMMT__SEAL_KEY_BYTES]; /* from the pool record: checks every descriptor */
    struct imported *next;
};

/* A descriptor whose bytes are not its producer's, remembered after its pool is let go. */
struct failed_desc {
    uint8_t pool_id[16];
    uint32_t slot, generation;
    int why; /* VMMT__FAILED_*: what check says of it */
};

#define FAILED_KEPT 1024 /* failed descriptors remembered per consumer */
#define DEAD_KEPT   64   /* pools of dead producers remembered per consumer */

struct vmmt__watch; /* producer_watch.c */

struct vmmt_consumer {
    vmmt_consumer_config cfg;
    uint64_t clock;            /* counts consume and ack calls, for least-recently-used eviction */
    struct vmmt__acker *acker; /* acknowledgements written by the CPU, and copy completion */
    pthread_mutex_t lock;
    struct imported *pools;
    int count;
    /* Imports let go of whose teardown failed: never used again, retried. */
    struct imported *retired;
    uint64_t serials;
    struct vmmt__watch *watch; /* started with the first pool whose producer is known */
    /* Own lock: the acknowledgement thread adds to it (consume.c) without the consumer's. */
    pthread_mutex_t failed_lock;
    struct failed_desc failed[FAILED_KEPT];
    uint32_t failed_next, failed_count;
    uint8_t dead_ids[DEAD_KEPT][16];
    uint32_t dead_next, dead_count;
};

/* A device table's row as a consume reads it: the ready word, then one word per rank. */
#define VMMT__POLL_WORDS (1 + VMMT__MAX_CONSUMERS)

/* The import's polling stream and pinned words, made if missing; poll_lock held (device_table.c).
 */
int vmmt__table_open_poll(struct imported *ip);

/*
 * Read `words` (at most VMMT__POLL_WORDS) words of a device table at `word`
 * into ip->poll_word, polled until `until`; poll_lock held.
 */
int vmmt__table_read_words(const struct imported *ip, CUdeviceptr word, uint32_t words,
                           const struct timespec *until, int timeout_ms);

/*
 * Acknowledge `gen` for `ranks` of `slot` in a device table, only while its
 * ready word shows gen (read first); *written 1 once they have landed, 0 when the slot had moved on
 * (nothing written) or on a failure, which is returned. Takes the context and poll_lock.
 */
int vmmt__table_write_acks(struct imported *ip, uint32_t slot, uint32_t stride,
                           const struct vmmt__ranks *ranks, uint32_t gen, int timeout_ms,
                           int *written);

/* A device table's ready word of `slot`, within timeout_ms; takes the context and poll_lock. */
int vmmt__table_read_ready(struct imported *ip, uint32_t slot, uint32_t stride, int timeout_ms,
                           uint32_t *out);

/*
 * The import of the pool `d` (decoded from `bytes`) names for `device`: the
 * cached one, or a new import; either way the record's seal is checked with
 * the pool's key first, and d against the import's own record of the pool.
 * A new import whose first descriptor fails the seal is let go at once, so a
 * forged first descriptor leaves nothing behind. Then, over max_pools,
 * another idle pool is evicted. Lock held (imports are rare and serial).
 */
int vmmt__cache_get(struct vmmt_consumer *c, const uint8_t bytes[VMMT_DESC_SIZE],
                    const struct vmmt__desc *d, int device, struct imported **out);

/* A call starts using ip (the lock held). */
void vmmt__cache_use(struct vmmt_consumer *c, struct imported *ip);

/* A call or a copy stops using ip; takes the lock. */
void vmmt__cache_unuse(struct vmmt_consumer *c, struct imported *ip);

/*
 * The producer of ip is gone (lock held): mark what this process copied
 * before its ready word was set as failed, set those ready words itself so
 * that no stream of ours waits on them for ever, and let the pool go once
 * idle. Idempotent.
 */
void vmmt__cache_producer_died(struct vmmt_consumer *c, struct imported *ip);

/*
 * 1 if ip's producer is gone, exited or shut the pool down (and handled);
 * polls its pidfd and liveness link at most once a millisecond unless
 * forced. Lock held.
 */
int vmmt__cache_producer_gone(struct vmmt_consumer *c, struct imported *ip, int force);

/* The same without the lock and without handling it (a wait in progress). */
int vmmt__cache_pidfd_exited(const struct imported *ip);

/* A pool whose producer this consumer saw die (lock held). */
int vmmt__cache_known_dead(const struct vmmt_consumer *c, const uint8_t pool_id[16]);

/* Let go of idle pools of dead producers, and retry failed teardowns (lock held). */
void vmmt__cache_reap(struct vmmt_consumer *c);

/* The producer watch (producer_watch.c): a thread that learns of deaths by pidfd or link. */
int vmmt__watch_add(struct vmmt_consumer *c, struct imported *ip);     /* lock held */
void vmmt__watch_remove(struct vmmt_consumer *c, struct imported *ip); /* lock held */
void vmmt__watch_stop(struct vmmt_consumer *c);                        /* lock not held */

/* Why a copy is not known to be its buffer, as vmmt_consumer_check tells it. */
#define VMMT__FAILED_DEAD        0 /* its producer died before the bytes were ready */
#define VMMT__FAILED_OVERTAKEN   1 /* its occupant left the slot while the copy ran */
#define VMMT__FAILED_UNCONFIRMED 2 /* the driver kept failing after the copy: not judged */
#define VMMT__FAILED_COPY        3 /* the copy failed on its stream */

/* Remember a descriptor whose copy is not its buffer, for vmmt_consumer_check (any thread). */
void vmmt__consumer_remember_failed(struct vmmt_consumer *c, const struct imported *ip,
                                    uint32_t slot, uint32_t gen, int why);

#endif
