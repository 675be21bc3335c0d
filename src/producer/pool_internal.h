/*
 * The producer's pool, shared by pool.c (life cycle), publish.c (publish and
 * cancel) and recycle.c (the recycler).
 */
#ifndef VMMT_POOL_INTERNAL_H
#define VMMT_POOL_INTERNAL_H

#include <pthread.h>
#include <stdint.h>
#include <time.h>

#include "broker.h"
#include "ctrl.h"
#include "cuabi.h"
#include "desc.h"
#include "elastic.h"
#include "slab.h"
#include "vmm.h"
#include "vmmt.h"

/*
 * SLOT_RESERVED: handed to the producer by vmmt_reserve, not yet committed.
 * SLOT_RETIRING: done, its RETIRED word being written by the recycler
 * (recycle.c); nothing else may free it meanwhile.
 */
enum slot_state {
    SLOT_FREE,
    SLOT_PUBLISHING,
    SLOT_IN_FLIGHT,
    SLOT_CANCELLED,
    SLOT_RESERVED,
    SLOT_RETIRING
};

struct vmmt__slot {
    uint32_t generation;
    /* The slot's previous occupant's generation (0: none), to tell a wrap. */
    uint32_t prev_generation;
    uint8_t state;
    uint64_t slice_offset; /* relative to the data region, as the slab sees it */
    uint64_t slice_bytes;
    /*
     * Dead consumers (release.c): the occupant in flight when a consumer
     * process's death was seen, and the ranks to release for it. Released
     * only while the slot still holds that occupant; lock held.
     */
    uint32_t dead_gen;
    uint64_t dead_ranks[VMMT_BROKER_RANK_WORDS];
};

/*
 * Handed out and not yet free: in flight, or cancelled while consumer
 * processes may still hold its acknowledgement words taken (recycle.c).
 * What releases a rank (release.c) covers both.
 */
static inline int vmmt__slot_held(const struct vmmt__slot *s)
{
    return s->state == SLOT_IN_FLIGHT || s->state == SLOT_CANCELLED;
}

/* The pool's counter wrapped since the slot's previous occupant (its generation is not later). */
static inline int vmmt__slot_wrapped(const struct vmmt__slot *s)
{
    return s->prev_generation != 0 && s->generation <= s->prev_generation;
}

struct vmmt_pool {
    vmmt_pool_config cfg; /* broker_path and allowed_uids point into this object */
    char broker_path[108];
    uint32_t *allowed_uids;
    int device;
    vmmt_handle_type type;
    vmmt_handoff handoff;
    int fell_back;

    struct vmmt__mapping map;
    struct vmmt__broker *broker;
    CUmemFabricHandle fabric;
    struct vmmt__desc tmpl; /* pool-wide descriptor fields */
    uint8_t
        seal_key[VMMT__SEAL_KEY_BYTES]; /* seals every descriptor (seal.h); in the pool record */

    uint32_t slots, stride;
    uint64_t table_bytes, data_offset;
    int host_table; /* control table in shared host memory (ctrl) */
    struct vmmt__ctrl ctrl;
    CUdeviceptr ctrl_dev; /* the table as streams address it */
    struct vmmt__slab *slab;
    struct vmmt__slot *slot;
    uint32_t *free_slots;     /* stack of free slot numbers */
    uint32_t last_generation; /* the pool's one generation counter (generation.h); lock held */
    uint32_t free_count;

    pthread_mutex_t lock;   /* slots, slab, counters, state below */
    pthread_cond_t changed; /* publishers finished, slices recycled */
    int closing;            /* no new calls: shutdown has begun */
    int shutting_down;      /* one shutdown runs; a second caller waits for it */
    int closed;             /* resources released */
    int active;             /* calls inside the pool (publish, cancel, reclaim, drain) */
    int failed;
    char failure[1024];
    int warned_full;

    /* Recycler: one thread, one stream, one pinned copy of the table. */
    pthread_mutex_t reclaim_lock; /* one table read at a time */
    pthread_cond_t wake;
    pthread_t thread;
    int thread_started, stop;
    int recycler_idle; /* in its untimed sleep: a publish must wake it */
    CUstream stream;
    uint32_t *table_host; /* the shared table itself, or a pinned copy of the device table */
    uint32_t *retiring;   /* slots one reclaim retires (recycle.c); reclaim_lock held */

    uint32_t in_flight;
    uint64_t in_flight_bytes;
    uint64_t published, recycled, cancelled, full, reclaims;

    /* The publish kernel (publish_kernel.c): NULL where the driver refused it. */
    CUmodule kmod;
    CUfunction kfn;
    int kernel_warned;         /* a refused launch was logged (atomic) */
    uint64_t kernel_publishes; /* atomic */

    /*
     * Host pools (host_pool.c): the allocation is host memory on NUMA node
     * `numa`, written by the CPU; the pool holds no context until a publish
     * from device memory grants `device` access and registers the table.
     */
    int host_mem;
    int numa;
    struct vmmt__elastic *el; /* elastic pools (elastic.c); NULL for a fixed allocation */
    int device_ready;         /* device access granted and table registered (lock held to set) */
    pthread_mutex_t dev_lock; /* serialises that one-time setup */

    /* Ranks whose consumer died, for the recycler to release (release.c); lock held. */
    uint64_t dead_ranks[VMMT_BROKER_RANK_WORDS];
    pid_t dead_pid;
    /* Per rank: when vmmt_pool_release_rank last released it (vmmt__liveness_tick); lock held. */
    uint64_t released_at[VMMT_BROKER_MAX_RANKS];
    uint64_t rank_releases, released_slices;
    /* Ranks found dead (a death, the lease) not yet taken by vmmt_pool_take_dead_ranks; lock
     * held to change; `found_any` is read without it, so a poll with nothing new takes no lock. */
    uint64_t found_dead[VMMT_BROKER_RANK_WORDS];
    int found_any;
    /* consumer_lease_ms: when the recycler first saw each slot's occupant in flight. */
    uint32_t *lease_gen;
    int64_t *lease_since_ms;
};

/* Fail with VMMT_EFAILED / VMMT_ECLOSED if the pool cannot take calls; lock held. */
int vmmt__pool_check_usable(struct vmmt_pool *p);

/*
 * Every public call that uses the pool's memory, stream or table counts
 * itself active for its whole duration, so shutdown releases nothing under
 * it. enter fails once the pool is closing or quarantined.
 */
int vmmt__pool_enter(struct vmmt_pool *p);
void vmmt__pool_leave(struct vmmt_pool *p);

/* Record an uncertain failure: every later call returns VMMT_EFAILED with it. */
void vmmt__pool_quarantine(struct vmmt_pool *p);

/*
 * vmmt_pool_shutdown bounded by a deadline of the caller's (CLOCK_MONOTONIC,
 * clock.h) instead of timeout_ms from now: a caller that waited for other
 * things first (the Python binding's kept sources) keeps one bound for the
 * whole close. timeout_ms is the bound the messages name.
 */
int vmmt__pool_shutdown_until(struct vmmt_pool *p, const struct timespec *until, int timeout_ms);

/* Recycler (recycle.c). */
int vmmt__recycler_start(struct vmmt_pool *p);
void vmmt__recycler_stop(struct vmmt_pool *p);
int vmmt__pool_reclaim(struct vmmt_pool *p, uint32_t *freed);
/* A shared table's reclaim under the pool's lock (recycle.c); 0 for a device table. */
uint32_t vmmt__pool_sweep_locked(struct vmmt_pool *p);

/*
 * Write slot's RETIRED word now (src/wire/generation.h): a CPU store into a
 * shared table, else a copy on the pool's stream, synchronized, so that it
 * has landed before the slice can be given to anyone else. The context need
 * not be current; the caller is active or the recycler.
 */
int vmmt__pool_retire_now(struct vmmt_pool *p, uint32_t slot);
/* The same for a publish's PENDING word in a device table (its CPU-side store otherwise). */
int vmmt__pool_pending_now(struct vmmt_pool *p, uint32_t slot);

/*
 * A cancelled slot's acknowledgement words, every rank's, to its generation
 * (recycle.c): CPU stores into a shared table, lock held; or, for a device
 * table, stream writes waited for, neither lock held (VMMT_OK too when the
 * occupant has left meanwhile).
 */
void vmmt__pool_cancel_acks_locked(struct vmmt_pool *p, uint32_t slot);
int vmmt__pool_cancel_acks_now(struct vmmt_pool *p, uint32_t slot, uint32_t gen);

/* The pool record (ctrl.h) of p into out, checked by the readers' validator. */
int vmmt__pool_put_record(const struct vmmt_pool *p, uint8_t out[VMMT__CTRL_RECORD_BYTES]);

/* Read the control table into p->table_host; the caller is active or the recycler. */
int vmmt__pool_read_table(struct vmmt_pool *p);

/* Publishing steps shared by publish.c, reserve.c and host_pool.c. */
int vmmt__publish_check_buffer(const vmmt_buffer *b, size_t i);
/* The readers' validator on every record a publish or commit will hand out (publish.c). */
int vmmt__publish_check_records(const struct vmmt_pool *p, const vmmt_buffer *bufs, size_t n,
                                const uint64_t *rel, uint64_t total);
int vmmt__publish_reserve(struct vmmt_pool *p, uint64_t bytes, uint32_t *slot);
void vmmt__publish_finish(struct vmmt_pool *p, uint32_t slot, int st, size_t n);
void vmmt__publish_describe(struct vmmt_pool *p, const vmmt_buffer *bufs, size_t n,
                            const uint64_t *rel, uint32_t slot, vmmt_desc *out);
/* Device copies and the ready flag on stream s; the context is current. */
int vmmt__publish_clear_acks(struct vmmt_pool *p, uint32_t slot, CUstream s);
int vmmt__publish_pending(struct vmmt_pool *p, uint32_t slot);
int vmmt__publish_enqueue(struct vmmt_pool *p, const vmmt_buffer *bufs, size_t n,
                          const uint64_t *rel, uint32_t slot, CUstream s);

/* Host pools (host_pool.c); none of these makes a context current unless said. */
int vmmt__host_pool_allocate(struct vmmt_pool *p);
int vmmt__host_pool_table(struct vmmt_pool *p);
/* Copy into the slice: host sources by memcpy, device ones on s (in a context). */
int vmmt__host_pool_copy(struct vmmt_pool *p, const vmmt_buffer *bufs, size_t n,
                         const uint64_t *rel, uint32_t slot, CUstream s);
/* Grant the device access and register the table, once (enters the context). */
int vmmt__host_pool_device_setup(struct vmmt_pool *p);
/* The CPU's view of the pool's data at slice offset off. */
void *vmmt__host_pool_cpu(struct vmmt_pool *p, uint64_t off);
/* Store a ready flag with the CPU (release order after the slice's bytes). */
void vmmt__host_pool_set_ready(struct vmmt_pool *p, uint32_t slot, uint32_t gen);

/*
 * Dead consumers (release.c). The broker calls vmmt__pool_ranks_dead on its
 * thread, which notes the slices in flight then; the recycler then calls
 * vmmt__pool_release_pending, which acknowledges on the dead ranks' behalf
 * those of them still in flight (release.c says which are left out).
 */
void vmmt__pool_ranks_dead(void *pool, const uint64_t ranks[VMMT_BROKER_RANK_WORDS], pid_t pid,
                           uid_t uid, const uint64_t held[VMMT_BROKER_MAX_RANKS]);
void vmmt__pool_release_pending(struct vmmt_pool *p);
/* A dead process held ranks that live ones hold too: give back the shared words it took. */
void vmmt__pool_shared_ranks_dead(void *pool, const uint64_t ranks[VMMT_BROKER_RANK_WORDS],
                                  pid_t pid, uid_t uid);

/* consumer_lease_ms: release ranks no live link holds that sat on a slice too long (recycler). */
void vmmt__pool_lease_check(struct vmmt_pool *p);

/* Return a slot and its slice to the free lists; lock held. */
void vmmt__slot_release(struct vmmt_pool *p, uint32_t slot);

#endif
