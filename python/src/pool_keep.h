/*
 * The sources a pool keeps alive while publish copies may still read them
 * (pool_keep.c), and the proof that a copy is done. Every function runs
 * with the GIL held (some release it while they wait).
 */
#ifndef VMMT_PY_POOL_KEEP_H
#define VMMT_PY_POOL_KEEP_H

#include <time.h>

#include "py_vmmt.h"

#include "cuabi.h"

/* The sources of one publish, alive until its copy is proven done. */
struct keep {
    struct keep *next;
    CUevent done;       /* the event proof; NULL with by_ready or a failed event */
    int by_ready;       /* proven by the ready word of (slot, gen) instead */
    uint32_t slot, gen; /* the publish's (its first descriptor's), for messages too */
    PyObject *owners;   /* publish_raw: the arrays themselves (a tuple, or one) */
    size_t n;
    struct vmmtpy_src src[];
};

struct vmmtpy_kept {
    vmmt_pool *pool;
    int device;
    int uses_events;    /* no host control table: copies are proven by events */
    int shut;           /* shutdown began: the table may be gone */
    struct keep *head;  /* oldest first */
    struct keep **tail; /* where the next one goes */
    Py_ssize_t count;
    CUevent spare[8]; /* events to reuse: creating one per publish costs microseconds */
    int spare_count;
};

void vmmtpy_kept_init(struct vmmtpy_kept *l, vmmt_pool *pool, int device);

/* A keep for n sources, zeroed; NULL with MemoryError. */
struct keep *vmmtpy_keep_new(Py_ssize_t n);
/* Give its sources back and free it. */
void vmmtpy_keep_free(struct keep *k);

/*
 * Keep k until the copy of the publish whose first descriptor is `first`,
 * enqueued on `stream`, is proven done; or give it back now if it has landed
 * already. k is the list's (or freed) after the call, whatever the outcome.
 * Where no event can be recorded, a synchronize of `stream` (without the
 * GIL) proves the copy done instead; -1 (error set) only when that fails
 * too, and then the sources stay alive. May release the GIL.
 */
int vmmtpy_kept_add(struct vmmtpy_kept *l, struct keep *k, const vmmt_desc *first, void *stream);

/*
 * Give back the sources whose copies are done; with `until` (CLOCK_MONOTONIC,
 * clock.h), all of them, waiting without the GIL until then at the most
 * (those not proven done by then stay kept: VMMT_ETIMEDOUT, its message
 * naming timeout_ms); NULL waits for none. A vmmt status.
 */
int vmmtpy_kept_retire(struct vmmtpy_kept *l, const struct timespec *until, int timeout_ms);

/* Shutdown is about to begin: no table read from now on. Then the spare events go. */
void vmmtpy_kept_shut(struct vmmtpy_kept *l);
/*
 * A shutdown succeeded, which waits until every publish copy into the pool
 * has landed: give back every source still kept, without checks.
 */
void vmmtpy_kept_release_proven(struct vmmtpy_kept *l);
void vmmtpy_kept_release_events(struct vmmtpy_kept *l);

#endif
