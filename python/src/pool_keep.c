/*
 * The sources a pool keeps alive while its publish copies may still read
 * them. A stream-ordered publish returns before its copy has run, so the
 * source tensors must outlive the copy: each publish's sources are kept and
 * given back once the copy is proven done (checked at every publish,
 * reclaim, drain and close), never earlier.
 *
 * The proof: where the control table is in host memory (POSIX_FD pools, the
 * default), the publish's own ready word, which the stream writes after the
 * copy; reading it is a plain load, where an event per publish costs a
 * cuEventCreate/cuEventRecord on the hot path. Elsewhere (a device control
 * table, FABRIC), an event recorded after the publish.
 */
#include <string.h>
#include <time.h>

#include "pool_keep.h"

#include "clock.h"
#include "ctrl.h"
#include "desc.h"
#include "driver.h"
#include "pool_internal.h"
#include "status.h"

void vmmtpy_kept_init(struct vmmtpy_kept *l, vmmt_pool *pool, int device)
{
    memset(l, 0, sizeof *l);
    l->pool = pool;
    l->device = device;
    l->tail = &l->head;
    l->uses_events = !pool->host_table || pool->table_host == NULL;
}

struct keep *vmmtpy_keep_new(Py_ssize_t n)
{
    struct keep *k = PyMem_Calloc(1, sizeof *k + (size_t)n * sizeof k->src[0]);

    if (k == NULL) PyErr_NoMemory();
    return k;
}

static void keep_release(struct keep *k)
{
    for (size_t i = 0; i < k->n; i++)
        vmmtpy_src_release(&k->src[i]);
    Py_CLEAR(k->owners);
}

/* Take k out of the kept list; pp points at the link that holds it. GIL held. */
static void unlink_keep(struct vmmtpy_kept *l, struct keep **pp, struct keep *k)
{
    *pp = k->next;
    if (l->tail == &k->next) l->tail = pp;
    l->count--;
}

/*
 * Whether a publish proven by its ready word has landed: the word shows its
 * generation, or a later occupant's (the slot is given a new generation only
 * after the ready word showed this one). The table stays mapped while the
 * pool is open, and no such entry is kept past close (publish_taken).
 */
static int landed(const struct vmmtpy_kept *l, const struct keep *k)
{
    const struct vmmt_pool *p = l->pool;
    const uint32_t *word = &p->table_host[vmmt__ctrl_ready(0, p->stride, k->slot) / 4];

    return vmmt__occupant_of(vmmt__ctrl_load(word), k->gen) != VMMT__OCC_COPYING;
}

/*
 * Another thread's close may shut the pool down while a drain waits here
 * without the GIL: the table is read only with the GIL held and before
 * `shut`, so a proof cut short leaves the sources alive instead.
 */
static int shut_fail(const struct keep *k)
{
    return vmmt__fail(VMMT_ECLOSED,
                      "the pool was shut down before a publish's copy (slot %u, generation %u) "
                      "was proven done; its sources stay alive",
                      k->slot, k->gen);
}

/* Whether k's copy is done: 1 yes, 0 not yet, -1 the check failed (error set). */
static int keep_done(struct vmmtpy_kept *l, const struct vmmt_drv *d, const struct keep *k)
{
    CUresult r;

    if (k->by_ready) return l->shut ? (shut_fail(k), -1) : landed(l, k);
    if (k->done == NULL) return 1;
    r = d->cuEventQuery(k->done);
    if (r == CUDA_ERROR_NOT_READY) return 0;
    if (r == CUDA_SUCCESS) return 1;
    vmmt__cu_fail(r, "checking that a publish's copy finished");
    return -1;
}

/*
 * Wait until k's copy is done, or `until` has passed (VMMT_ETIMEDOUT, no
 * message: the caller says it once for all). Polled without the GIL, an
 * event by cuEventQuery as much as a ready word: cuEventSynchronize would
 * wait past any deadline for a stream that never gets there.
 */
static int wait_done(struct vmmtpy_kept *l, const struct vmmt_drv *d, const struct keep *k,
                     const struct timespec *until)
{
    const struct timespec nap = {0, 50 * 1000};
    int r;

    while ((r = keep_done(l, d, k)) == 0) {
        if (vmmt__deadline_passed(until)) return VMMT_ETIMEDOUT;
        Py_BEGIN_ALLOW_THREADS;
        nanosleep(&nap, NULL);
        Py_END_ALLOW_THREADS;
    }
    return r > 0 ? VMMT_OK : vmmt_last_status();
}

/* Running copies a retire without `wait` looks past before it stops. */
#define RETIRE_SCAN_RUNNING 4

/*
 * Give back the sources whose copies are done; with `until`, all of them,
 * waiting for the copies without the GIL until that one deadline, which all
 * of them share. An entry leaves the list before the GIL is released or any
 * deleter runs (deleters run Python code, which may publish again), so no
 * other thread or reentrant call ever sees it. A failed check says nothing
 * about the copy: those sources stay alive forever. GIL held.
 */
int vmmtpy_kept_retire(struct vmmtpy_kept *l, const struct timespec *until, int timeout_ms)
{
    const struct vmmt_drv *d = NULL;
    struct keep **pp = &l->head, *k, *done = NULL, *late = NULL, *oldest_late = NULL;
    int st = VMMT_OK, entered = 0, running = 0, wait = until != NULL;
    Py_ssize_t nlate = 0;

    if (l->head == NULL) return VMMT_OK;
    if (l->uses_events) {
        d = vmmt__drv();
        if (d == NULL || vmmt__ctx_enter(l->device) != VMMT_OK) return vmmt_last_status();
        entered = 1;
    }
    while ((k = *pp) != NULL) {
        int r = keep_done(l, d, k);
        if (r == 0) {
            /*
             * Copies on one stream finish in order, so behind a few that are
             * still running the rest are too: stop there, or a burst of
             * publishes ahead of the GPU would scan its whole backlog each time.
             */
            if (++running == RETIRE_SCAN_RUNNING && !wait) break;
            pp = &k->next;
            continue;
        }
        if (r < 0) {
            st = vmmt_last_status();
            k->n = 0;
            k->owners = NULL;
        }
        unlink_keep(l, pp, k);
        k->next = done;
        done = k;
    }
    while (wait && (k = l->head) != NULL) {
        int r;
        unlink_keep(l, &l->head, k);
        r = wait_done(l, d, k, until);
        if (r == VMMT_ETIMEDOUT) {
            /* Still running, not unknown: kept for a later proof (a shutdown that succeeds). */
            if (oldest_late == NULL) oldest_late = k;
            nlate++;
            k->next = late;
            late = k;
            continue;
        }
        if (r != VMMT_OK) {
            st = r;
            k->n = 0;
            k->owners = NULL;
        }
        k->next = done;
        done = k;
    }
    if (oldest_late != NULL)
        st = vmmt__fail(VMMT_ETIMEDOUT,
                        "publish copies not proven done within timeout_ms=%d: %zd (the oldest: "
                        "slot %u, generation %u); their sources stay alive until a later close "
                        "proves them done",
                        timeout_ms, nlate, oldest_late->slot, oldest_late->gen);
    while ((k = late) != NULL) {
        late = k->next;
        k->next = l->head;
        if (l->head == NULL) l->tail = &k->next;
        l->head = k;
        l->count++;
    }
    for (k = done; entered && k != NULL; k = k->next) {
        if (k->done == NULL) continue;
        if (l->spare_count < (int)(sizeof l->spare / sizeof l->spare[0]))
            l->spare[l->spare_count++] = k->done;
        else
            d->cuEventDestroy(k->done);
    }
    if (entered) vmmt__ctx_leave();
    while ((k = done) != NULL) {
        done = k->next;
        keep_release(k);
        PyMem_Free(k);
    }
    return st;
}

/* An event recorded on `stream` after the publish; NULL with an error set on failure. */
static int record_done(struct vmmtpy_kept *l, void *stream, CUevent *out)
{
    const struct vmmt_drv *d = vmmt__drv();
    CUevent ev = NULL;
    int st;

    if ((st = vmmt__ctx_enter(l->device)) != VMMT_OK) return st;
    if (l->spare_count > 0)
        ev = l->spare[--l->spare_count];
    else
        st = VMMT_CU(d, cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
    if (st == VMMT_OK) {
        st = VMMT_CU(d, cuEventRecord(ev, (CUstream)stream));
        if (st != VMMT_OK) d->cuEventDestroy(ev);
    }
    vmmt__ctx_leave();
    *out = st == VMMT_OK ? ev : NULL;
    return st;
}

void vmmtpy_kept_release_proven(struct vmmtpy_kept *l)
{
    struct keep *k, *done = NULL;
    int entered = 0;

    /* Out of the list first: the deleters below run Python code. */
    while ((k = l->head) != NULL) {
        unlink_keep(l, &l->head, k);
        k->next = done;
        done = k;
    }
    for (k = done; k != NULL; k = k->next) {
        if (k->done == NULL) continue;
        if (!entered && vmmt__drv() != NULL && vmmt__ctx_enter(l->device) == VMMT_OK) entered = 1;
        if (entered) vmmt__drv()->cuEventDestroy(k->done);
        k->done = NULL;
    }
    if (entered) vmmt__ctx_leave();
    while ((k = done) != NULL) {
        done = k->next;
        keep_release(k);
        PyMem_Free(k);
    }
}

void vmmtpy_kept_release_events(struct vmmtpy_kept *l)
{
    if (l->spare_count == 0) return;
    if (vmmt__drv() == NULL || vmmt__ctx_enter(l->device) != VMMT_OK) return;
    while (l->spare_count > 0)
        vmmt__drv()->cuEventDestroy(l->spare[--l->spare_count]);
    vmmt__ctx_leave();
}

void vmmtpy_keep_free(struct keep *k)
{
    if (k == NULL) return;
    keep_release(k);
    PyMem_Free(k);
}

void vmmtpy_kept_shut(struct vmmtpy_kept *l)
{
    l->shut = 1;
}

/*
 * Only a finished synchronize proves the copy done; else the sources stay
 * alive (*k = NULL). Without the GIL: the stream may wait for work that
 * another Python thread has yet to enqueue or release, and every other
 * thread would stop for the copy meanwhile. k is in no list, so no other
 * thread can see it.
 */
static void sync_stream(struct vmmtpy_kept *l, void *stream, struct keep **k)
{
    int done = 0;

    Py_BEGIN_ALLOW_THREADS;
    if (vmmt__ctx_enter(l->device) == VMMT_OK) {
        done = vmmt__drv()->cuStreamSynchronize((CUstream)stream) == CUDA_SUCCESS;
        vmmt__ctx_leave();
    }
    Py_END_ALLOW_THREADS;
    if (!done) *k = NULL;
}

int vmmtpy_kept_add(struct vmmtpy_kept *l, struct keep *k, const vmmt_desc *first, void *stream)
{
    /* The publish just wrote this record: its fields need no checks. */
    vmmt__desc_own_slot(first->bytes, &k->slot, &k->gen);
    if (l->shut) {
        /* Shut down meanwhile by another thread: no proof outlives the pool, so wait now. */
        sync_stream(l, stream, &k);
    } else if (!l->uses_events) {
        k->by_ready = 1;
        /* A synchronous hand-off, or a host pool's CPU copy, has landed already. */
        if (!landed(l, k)) goto keep;
    } else if (record_done(l, stream, &k->done) == VMMT_OK) {
        goto keep;
    } else {
        /*
         * Without an event the only safe point is after a synchronize, which
         * proves the copy done as well: then the publish stands (raising
         * would lose a descriptor already published, its slice in flight
         * until shutdown). Only a failed synchronize is an error.
         */
        struct vmmt__saved_error e;
        vmmt__error_save(&e);
        sync_stream(l, stream, &k);
        vmmt__error_restore(&e);
        if (k == NULL) {
            vmmtpy_raise(vmmt_last_status());
            return -1;
        }
        vmmt__log(VMMT_LOG_WARN, "%s; the publish synchronized its stream instead",
                  vmmt_last_error());
    }
    vmmtpy_keep_free(k);
    return 0;
keep:
    *l->tail = k;
    l->tail = &k->next;
    l->count++;
    return 0;
}
