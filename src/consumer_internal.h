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

#include "acker.h"
#include "ctrl.h"
#include "cuabi.h"
#include "desc.h"
#include "vmm.h"
#include "vmmt.h"

/*
 * A packed group being consumed for one rank range: which members are done
 * and the stream they were copied on. Its acknowledgement goes on that
 * stream after the last member, so it can never overtake a member's copy.
 */
struct pack_group {
    uint32_t first, count;
    uint64_t members;
    CUstream stream;
};

#define PACK_GROUPS 4

/* What this process has done with one slot's current occupant. */
struct slot_state {
    uint32_t generation;
    uint64_t ranks_acked[VMMT__MAX_CONSUMERS / 64];
    struct pack_group groups[PACK_GROUPS];
};

struct imported {
    struct vmmt_consumer *owner;
    struct vmmt__desc geometry; /* the pool-wide fields of the first descriptor */
    int device;
    struct vmmt__mapping map;
    int host_table; /* the control table is the shared memfd in ctrl, read and written by CPU */
    struct vmmt__ctrl ctrl;
    CUdeviceptr table; /* the control table as streams address it */
    struct slot_state *slots;
    int users; /* consume and ack calls using the mapping, and acknowledgements not yet written */
    uint64_t last_used; /* consumer->clock at the last consume or ack */
    /* Host polling of ready words where a stream may not wait on them. */
    pthread_mutex_t poll_lock;
    CUstream poll_stream;
    uint32_t *poll_word;
    struct imported *next;
};

struct vmmt_consumer {
    vmmt_consumer_config cfg;
    uint64_t clock;            /* counts consume and ack calls, for least-recently-used eviction */
    struct vmmt__acker *acker; /* acknowledgements of shared-host-table pools */
    pthread_mutex_t lock;
    struct imported *pools;
    int count;
};

/*
 * The import of the pool `d` names for `device`: the cached one after
 * checking d against it, or a new import. Lock held (imports are rare and
 * serial).
 */
int vmmt__cache_get(struct vmmt_consumer *c, const struct vmmt__desc *d, int device,
                    struct imported **out);

/* A call starts using ip (the lock held); may evict another idle pool. */
void vmmt__cache_use(struct vmmt_consumer *c, struct imported *ip);

#endif
