/*
 * Recycling: a slice is free again once its ready word and every consumer's
 * acknowledgement word hold the slot's current generation. The whole control
 * table comes to the host in one copy, whatever the number of slices in
 * flight. A background thread does this while anything is in flight; a
 * publish that finds no room does it at once. Before a slice goes back to
 * the slab its slot's word is RETIRED (ctrl.h), so no consumer can take the
 * descriptor once the slice may hold another buffer's bytes.
 */
#include <errno.h>
#include <time.h>

#include "clock.h"
#include "ctrl.h"
#include "driver.h"
#include "pool_internal.h"
#include "status.h"

void vmmt__slot_release(struct vmmt_pool *p, uint32_t slot)
{
    struct vmmt__slot *s = &p->slot[slot];

    /* The offset came from this slab, so freeing it cannot fail. */
    (void)vmmt__slab_free(p->slab, s->slice_offset);
    /* A chunk left idle must be given back in time: a recycler asleep without a deadline
     * (nothing was in flight, every chunk live) would never see it (test_elastic,
     * chunk_idle_while_recycler_sleeps), so it is woken to set one. */
    if (p->el != NULL && vmmt__elastic_drop(p, s->slice_offset, s->slice_bytes) > 0 &&
        p->recycler_idle)
        pthread_cond_signal(&p->wake);
    s->state = SLOT_FREE;
    p->free_slots[p->free_count++] = slot;
}

/*
 * Whether slot's occupant gen is done with: its copy landed and every rank
 * acknowledged it, or, cancelled, no rank's copy taken before the cancel may
 * still be queued (no word CANCELLED, generation.h; only a shared table has
 * them). Lock held.
 */
static int row_done(const struct vmmt_pool *p, uint32_t slot, uint32_t gen, int cancelled)
{
    const uint32_t *row = p->table_host + (size_t)slot * (p->stride / 4);
    uint32_t ready = vmmt__ctrl_load(&row[0]);

    /* Retired by an earlier reclaim whose confirmation failed (retire): done. */
    if (ready == vmmt__gen_retired(gen)) return 1;
    if (ready != gen) return 0; /* the producer's copy has not finished */
    for (int r = 0; r < p->cfg.consumer_count; r++) {
        uint32_t w = vmmt__ctrl_load(&row[1 + r]);
        if (cancelled ? w == vmmt__ack_cancelled(gen) : w != gen) return 0;
    }
    return 1;
}

/*
 * A device table's slots the snapshot shows finished, marked SLOT_RETIRING,
 * into p->retiring; lock held. Their words are written without the lock
 * (write_ready waits for the stream), then settle frees them.
 */
#define RETIRING_CANCELLED 0x80000000u

static uint32_t collect(struct vmmt_pool *p)
{
    uint32_t n = 0;

    for (uint32_t i = 0; i < p->slots; i++) {
        struct vmmt__slot *s = &p->slot[i];
        if (s->state != SLOT_IN_FLIGHT && s->state != SLOT_CANCELLED) continue;
        if (!row_done(p, i, s->generation, s->state == SLOT_CANCELLED)) continue;
        p->retiring[n++] = i | (s->state == SLOT_CANCELLED ? RETIRING_CANCELLED : 0);
        s->state = SLOT_RETIRING;
    }
    return n;
}

/*
 * Wait for the pool's stream, polled within the pool's timeout_ms: a few
 * words take microseconds, and a device that stalls must not hold a publish
 * or the recycler for ever. A stream still busy at the deadline leaves the
 * words' fate unknown, which the callers treat as a failure. Context current.
 */
static int wait_stream(struct vmmt_pool *p)
{
    const struct vmmt_drv *d = vmmt__drv();
    struct timespec until, pause = {0, 2000};
    CUresult r;

    vmmt__deadline(&until, (int64_t)p->cfg.timeout_ms * 1000);
    while ((r = d->cuStreamQuery(p->stream)) == CUDA_ERROR_NOT_READY) {
        if (vmmt__deadline_passed(&until))
            return vmmt__fail(VMMT_ETIMEDOUT,
                              "the pool's stream did not finish writing control table words "
                              "within %d ms; the device is stalled",
                              p->cfg.timeout_ms);
        nanosleep(&pause, NULL);
    }
    return r == CUDA_SUCCESS ? VMMT_OK : vmmt__cu_fail(r, "writing control table words");
}

/*
 * Ready words of the n slots in p->retiring, now: RETIRED, or PENDING for a
 * publish into a device table. CPU stores into a shared table; else stream
 * writes of the value on the pool's stream, synchronized, so that each has
 * landed when this returns. Not copies from the pinned table: a table read
 * whose synchronize failed may still be queued to overwrite that buffer, and
 * a staged word it overwrites goes to the device as the slot's old word
 * (tests/unit/test_pool_failures.c). reclaim_lock held.
 */
static int write_ready(struct vmmt_pool *p, uint32_t n, int pending)
{
    const struct vmmt_drv *d = vmmt__drv();
    int st, sw;

    if (p->host_table) {
        for (uint32_t i = 0; i < n; i++) {
            uint32_t slot = p->retiring[i] & ~RETIRING_CANCELLED, gen = p->slot[slot].generation;
            __atomic_store_n(p->table_host + vmmt__ctrl_ready(0, p->stride, slot) / 4,
                             pending ? vmmt__gen_pending(gen) : vmmt__gen_retired(gen),
                             __ATOMIC_RELEASE);
        }
        return VMMT_OK;
    }
    st = vmmt__ctx_enter(p->device);
    if (st != VMMT_OK) return st;
    for (uint32_t i = 0; st == VMMT_OK && i < n; i++) {
        uint32_t slot = p->retiring[i] & ~RETIRING_CANCELLED, gen = p->slot[slot].generation;
        st = VMMT_CU(d,
                     cuStreamWriteValue32(p->stream, vmmt__ctrl_ready(p->ctrl_dev, p->stride, slot),
                                          pending ? vmmt__gen_pending(gen) : vmmt__gen_retired(gen),
                                          CU_STREAM_WRITE_VALUE_DEFAULT));
    }
    /* Even after a failed write: what was queued must land before anything is freed. */
    sw = wait_stream(p);
    if (st == VMMT_OK) st = sw;
    vmmt__ctx_leave();
    return st == VMMT_OK ? st
                         : vmmt__wrap(st, "writing the %s word of %u slot(s)",
                                      pending ? "pending" : "retired", n);
}

/* A slot whose RETIRED word has landed leaves the in-flight count for the free lists; lock held. */
static void free_retired(struct vmmt_pool *p, uint32_t slot, int cancelled)
{
    p->in_flight--;
    p->in_flight_bytes -= p->slot[slot].slice_bytes;
    if (!cancelled) p->recycled++;
    vmmt__slot_release(p, slot);
}

/* Free the n slots retired, or put them back for the next reclaim if that failed; lock held. */
static void settle(struct vmmt_pool *p, uint32_t n, int retired)
{
    for (uint32_t i = 0; i < n; i++) {
        uint32_t slot = p->retiring[i] & ~RETIRING_CANCELLED;
        int cancelled = (p->retiring[i] & RETIRING_CANCELLED) != 0;
        struct vmmt__slot *s = &p->slot[slot];
        if (!retired) {
            s->state = cancelled ? SLOT_CANCELLED : SLOT_IN_FLIGHT;
            continue;
        }
        free_retired(p, slot, cancelled);
    }
}

/*
 * A shared table's sweep in one hold of the pool's lock: the recycler's, and
 * a publish's that found the pool full, which frees and takes in one
 * critical section, so that other publishers cannot take every slice it
 * frees before it looks again (tests/unit/test_pool_races.c,
 * test_publish_finds_acknowledged_slots). The RETIRED word is a CPU store,
 * so nothing here waits. Lock held.
 */
uint32_t vmmt__pool_sweep_locked(struct vmmt_pool *p)
{
    uint32_t freed = 0;

    if (!p->host_table) return 0;
    for (uint32_t i = 0; i < p->slots && p->in_flight > 0; i++) {
        struct vmmt__slot *s = &p->slot[i];
        int cancelled = s->state == SLOT_CANCELLED;
        if (s->state != SLOT_IN_FLIGHT && !cancelled) continue;
        if (!row_done(p, i, s->generation, cancelled)) continue;
        __atomic_store_n(p->table_host + vmmt__ctrl_ready(0, p->stride, i) / 4,
                         vmmt__gen_retired(s->generation), __ATOMIC_RELEASE);
        free_retired(p, i, cancelled);
        freed++;
    }
    if (freed > 0) pthread_cond_broadcast(&p->changed);
    return freed;
}

static int write_ready_now(struct vmmt_pool *p, uint32_t slot, int pending)
{
    int st;

    pthread_mutex_lock(&p->reclaim_lock);
    p->retiring[0] = slot;
    st = write_ready(p, 1, pending);
    pthread_mutex_unlock(&p->reclaim_lock);
    return st;
}

int vmmt__pool_retire_now(struct vmmt_pool *p, uint32_t slot)
{
    return write_ready_now(p, slot, 0);
}

int vmmt__pool_pending_now(struct vmmt_pool *p, uint32_t slot)
{
    return write_ready_now(p, slot, 1);
}

/*
 * A cancelled occupant's acknowledgement words, every rank's, hold its
 * generation before vmmt_cancel returns: a consumer refuses an occupant its
 * ranks acknowledged whatever the ready word says, and the publish's ready
 * write, which may still be queued on the caller's stream, writes only the
 * ready word; so the descriptor is refused from then on, by every process.
 * (A RETIRED ready word written now would be overwritten by that queued
 * write; before, a cancelled descriptor was consumed with OK until the
 * recycler retired it, tests/unit/test_occupancy.c.) A word TAKEN by a
 * consume whose copy may still be queued becomes CANCELLED instead
 * (generation.h): refused just the same, it keeps the slice until that copy
 * is acknowledged (before, the slice went to the next publish under the
 * copy, and vmmt.sglang's rebuild returned that buffer,
 * tests/unit/test_cancel_taken.c). Each word by compare-and-swap, since
 * consumers take and give back words meanwhile. Shared table: CPU stores,
 * lock held.
 */
void vmmt__pool_cancel_acks_locked(struct vmmt_pool *p, uint32_t slot)
{
    uint32_t gen = p->slot[slot].generation;

    for (int r = 0; r < p->cfg.consumer_count; r++) {
        uint32_t *w = p->table_host + vmmt__ctrl_ack(0, p->stride, slot, (uint32_t)r) / 4;
        uint32_t cur = vmmt__ctrl_load(w), want;
        do {
            if (cur == gen || cur == vmmt__ack_cancelled(gen)) break;
            want = cur == vmmt__gen_pending(gen) ? vmmt__ack_cancelled(gen) : gen;
        } while (
            !__atomic_compare_exchange_n(w, &cur, want, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
    }
}

int vmmt__pool_cancel_acks_now(struct vmmt_pool *p, uint32_t slot, uint32_t gen)
{
    const struct vmmt_drv *d = vmmt__drv();
    int st, sw, here;

    /* Under reclaim_lock no reclaim frees the slot, so it keeps this occupant throughout. */
    pthread_mutex_lock(&p->reclaim_lock);
    pthread_mutex_lock(&p->lock);
    here = p->slot[slot].generation == gen && p->slot[slot].state == SLOT_CANCELLED;
    pthread_mutex_unlock(&p->lock);
    st = here ? vmmt__ctx_enter(p->device) : VMMT_OK;
    if (!here || st != VMMT_OK) {
        pthread_mutex_unlock(&p->reclaim_lock);
        return st;
    }
    for (int r = 0; st == VMMT_OK && r < p->cfg.consumer_count; r++)
        st = VMMT_CU(d, cuStreamWriteValue32(
                            p->stream, vmmt__ctrl_ack(p->ctrl_dev, p->stride, slot, (uint32_t)r),
                            gen, CU_STREAM_WRITE_VALUE_DEFAULT));
    sw = wait_stream(p);
    if (st == VMMT_OK) st = sw;
    vmmt__ctx_leave();
    pthread_mutex_unlock(&p->reclaim_lock);
    return st == VMMT_OK
               ? st
               : vmmt__wrap(st, "writing the acknowledgement words of cancelled slot %u", slot);
}

int vmmt__pool_read_table(struct vmmt_pool *p)
{
    const struct vmmt_drv *d = vmmt__drv();
    int st;

    /* A shared host table is read in place, word by word, with acquire loads. */
    if (p->host_table) return VMMT_OK;
    st = vmmt__ctx_enter(p->device);
    if (st != VMMT_OK) return st;
    st = VMMT_CU(d, cuMemcpyDtoHAsync(p->table_host, p->ctrl_dev, p->table_bytes, p->stream));
    if (st == VMMT_OK) st = VMMT_CU(d, cuStreamSynchronize(p->stream));
    vmmt__ctx_leave();
    return st == VMMT_OK ? st : vmmt__wrap(st, "reading the pool's control table");
}

int vmmt__pool_reclaim(struct vmmt_pool *p, uint32_t *freed)
{
    uint32_t n = 0;
    int st = VMMT_OK, busy;

    pthread_mutex_lock(&p->reclaim_lock);
    pthread_mutex_lock(&p->lock);
    busy = p->in_flight > 0 && p->table_host != NULL;
    pthread_mutex_unlock(&p->lock);
    if (busy) st = vmmt__pool_read_table(p);
    if (busy && st == VMMT_OK && p->host_table) {
        /* CPU loads and stores only: one critical section, no slot ever RETIRING. */
        pthread_mutex_lock(&p->lock);
        p->reclaims++;
        n = vmmt__pool_sweep_locked(p);
        pthread_mutex_unlock(&p->lock);
    } else if (busy && st == VMMT_OK) {
        uint32_t found;
        pthread_mutex_lock(&p->lock);
        p->reclaims++;
        found = collect(p);
        pthread_mutex_unlock(&p->lock);
        /* Outside the pool's lock: a device table's writes wait for the stream. */
        if (found > 0) st = write_ready(p, found, 0);
        pthread_mutex_lock(&p->lock);
        settle(p, found, st == VMMT_OK);
        n = st == VMMT_OK ? found : 0;
        if (n > 0) pthread_cond_broadcast(&p->changed);
        pthread_mutex_unlock(&p->lock);
    }
    pthread_mutex_unlock(&p->reclaim_lock);
    if (freed != NULL) *freed = n;
    return st;
}

int vmmt_pool_reclaim(vmmt_pool *p, uint32_t *freed)
{
    int st;

    if (p == NULL) return vmmt__fail(VMMT_EINVAL, "vmmt_pool_reclaim: pool is NULL");
    st = vmmt__pool_enter(p);
    if (st != VMMT_OK) return st;
    st = vmmt__pool_reclaim(p, freed);
    vmmt__pool_leave(p);
    return st;
}

/*
 * Reclaim once per interval while slices are in flight, and for a grace
 * period after the last one left (so that a steady stream of publishes never
 * pays for waking this thread); then sleep until a publish wakes it. The
 * first read after waking waits an interval too: a slice published a moment
 * ago cannot be acknowledged yet, and an early table read would only compete
 * with the publisher for the device.
 */
#define GRACE_INTERVALS 256

/*
 * Failed table reads in a row before the pool is quarantined. A read only
 * copies the table into the recycler's own buffer and frees nothing, so
 * trying again is harmless; a device or context that is really broken keeps
 * failing and is quarantined a few intervals later.
 */
#define READ_RETRIES 3

/*
 * One reclaim by the recycler, lock not held. A failed table read means the
 * device or context is broken, once it fails READ_RETRIES times in a row:
 * nothing can be recycled safely any more. Returns 1 when it succeeded.
 */
static int reclaim(struct vmmt_pool *p, int *failures)
{
    if (vmmt__pool_reclaim(p, NULL) == VMMT_OK) {
        *failures = 0;
        return 1;
    }
    if (++*failures < READ_RETRIES) {
        vmmt__log(VMMT_LOG_WARN, "background recycling failed (%s); retrying (%d of %d)",
                  vmmt_last_error(), *failures, READ_RETRIES - 1);
    } else {
        vmmt__wrap(VMMT_EFAILED, "background recycling, %d times in a row", *failures);
        vmmt__pool_quarantine(p);
    }
    return 0;
}

static void *recycler_main(void *arg)
{
    struct vmmt_pool *p = arg;
    struct timespec next;
    int quiet = 0, failures = 0;

    pthread_mutex_lock(&p->lock);
    while (!p->stop) {
        /* Ranks of a dead consumer first: their slices are what the producer waits for. */
        if (!p->failed &&
            (p->dead_ranks[0] | p->dead_ranks[1] | p->dead_ranks[2] | p->dead_ranks[3]) != 0) {
            pthread_mutex_unlock(&p->lock);
            vmmt__pool_release_pending(p);
            reclaim(p, &failures);
            pthread_mutex_lock(&p->lock);
            continue;
        }
        /* An elastic pool gives idle chunks back; sleeping, it wakes when the next is due. */
        int64_t trim_us = p->el != NULL ? vmmt__elastic_trim(p) : -1;
        if (p->failed || (p->in_flight == 0 && quiet >= GRACE_INTERVALS)) {
            int timed_out = 0;
            p->recycler_idle = 1;
            if (trim_us >= 0 && !p->failed) {
                vmmt__deadline(&next, trim_us);
                timed_out = pthread_cond_timedwait(&p->wake, &p->lock, &next) == ETIMEDOUT;
            } else {
                pthread_cond_wait(&p->wake, &p->lock);
            }
            p->recycler_idle = 0;
            if (!timed_out) quiet = 0;
            continue;
        }
        quiet = p->in_flight == 0 ? quiet + 1 : 0;
        vmmt__deadline(&next, p->cfg.recycle_interval_us);
        while (!p->stop && !p->dead_ranks[0] && !p->dead_ranks[1] && !p->dead_ranks[2] &&
               !p->dead_ranks[3] && pthread_cond_timedwait(&p->wake, &p->lock, &next) != ETIMEDOUT)
            ;
        if (p->stop || p->in_flight == 0) continue;
        pthread_mutex_unlock(&p->lock);
        if (reclaim(p, &failures) && p->cfg.consumer_lease_ms > 0) vmmt__pool_lease_check(p);
        pthread_mutex_lock(&p->lock);
    }
    pthread_mutex_unlock(&p->lock);
    return NULL;
}

int vmmt__recycler_start(struct vmmt_pool *p)
{
    int err = pthread_create(&p->thread, NULL, recycler_main, p);

    if (err != 0) {
        errno = err;
        return vmmt__sys_fail("starting the pool's recycler thread");
    }
    p->thread_started = 1;
    return VMMT_OK;
}

void vmmt__recycler_stop(struct vmmt_pool *p)
{
    if (!p->thread_started) return;
    pthread_mutex_lock(&p->lock);
    p->stop = 1;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
    pthread_join(p->thread, NULL);
    p->thread_started = 0;
}

int vmmt_pool_drain(vmmt_pool *p, int timeout_ms)
{
    struct timespec until, pause = {0, 50000};
    uint32_t left;
    int st;

    if (p == NULL) return vmmt__fail(VMMT_EINVAL, "vmmt_pool_drain: pool is NULL");
    if (timeout_ms < 0)
        return vmmt__fail(VMMT_EINVAL, "vmmt_pool_drain: timeout_ms=%d is negative", timeout_ms);
    vmmt__deadline(&until, (int64_t)timeout_ms * 1000);
    for (;;) {
        st = vmmt__pool_enter(p);
        if (st != VMMT_OK) return st;
        pthread_mutex_lock(&p->lock);
        left = p->in_flight;
        pthread_mutex_unlock(&p->lock);
        if (left > 0) st = vmmt__pool_reclaim(p, NULL);
        pthread_mutex_lock(&p->lock);
        left = p->in_flight;
        pthread_mutex_unlock(&p->lock);
        vmmt__pool_leave(p);
        if (st != VMMT_OK || left == 0) return st;
        if (vmmt__deadline_passed(&until)) break;
        nanosleep(&pause, NULL);
    }
    return vmmt__fail(VMMT_ETIMEDOUT,
                      "pool still has %u slice(s) in flight after %d ms; a consumer has not "
                      "acknowledged (is it alive, and does it consume every descriptor?)",
                      left, timeout_ms);
}
