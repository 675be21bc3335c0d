/*
 * Releasing the ranks of dead consumers: acknowledging, on a rank's behalf,
 * every slice in flight, so that a consumer process that died holding slices
 * does not keep them forever. The broker reports a death (the process's
 * liveness link closed and its pidfd shows it exited, so none of its copies
 * can still run); the recycler, which owns the pool's stream, does the
 * writes. An engine may also release a rank itself (vmmt_pool_release_rank).
 * A live rank is never released on the library's own initiative.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "ctrl.h"
#include "driver.h"
#include "generation.h"
#include "pool_internal.h"
#include "status.h"

/* "0,3-5" for the log. */
static const char *rank_list(const uint64_t ranks[VMMT_BROKER_RANK_WORDS], char *buf, size_t cap)
{
    size_t n = 0;

    buf[0] = '\0';
    for (int r = 0; r < VMMT_BROKER_MAX_RANKS && n + 12 < cap; r++) {
        if (!(ranks[r / 64] & (1ull << (r % 64)))) continue;
        int end = r;
        while (end + 1 < VMMT_BROKER_MAX_RANKS &&
               (ranks[(end + 1) / 64] & (1ull << ((end + 1) % 64))))
            end++;
        n += (size_t)snprintf(buf + n, cap - n, n ? ",%d" : "%d", r);
        if (end > r) n += (size_t)snprintf(buf + n, cap - n, "-%d", end);
        r = end;
    }
    return buf;
}

static int has_rank(const uint64_t ranks[VMMT_BROKER_RANK_WORDS], uint32_t r)
{
    return (ranks[r / 64] >> (r % 64)) & 1;
}

/* Note ranks of the pool found dead, for vmmt_pool_take_dead_ranks; lock held. */
static void found_dead(struct vmmt_pool *p, const uint64_t ranks[VMMT_BROKER_RANK_WORDS])
{
    int any = 0;

    for (uint32_t r = 0; r < (uint32_t)p->cfg.consumer_count; r++)
        if (has_rank(ranks, r)) {
            p->found_dead[r / 64] |= 1ull << (r % 64);
            any = 1;
        }
    if (any) __atomic_store_n(&p->found_any, 1, __ATOMIC_RELEASE);
}

/*
 * The broker saw a consumer process die (on its thread). What the dead
 * process could have held is what was in flight up to its death, so the
 * slices in flight now are noted, each with its occupant's generation, and
 * the recycler later releases only those that still hold that occupant: a
 * late release must never acknowledge slices published since for a new
 * process consuming as the same rank (defect 6 in docs/reliability.md: the
 * release used to take every slice in flight when the recycler ran, and
 * recycled a restarted rank's slices under it, wrong bytes with status OK).
 * A rank that the engine released itself (vmmt_pool_release_rank) after
 * this process took that rank is left out: that call released everything the
 * process could hold, and what was published after it is the next
 * process's. Compared per rank: a process that took a rank over after its
 * release (its link held other ranks before) holds what was published for
 * it since (defect 7 of issue 16: that rank was never released). The window that remains, the death
 * seen only after the engine restarted the rank and published for the new process without calling
 * vmmt_pool_release_rank, is narrowed by the recycler skipping ranks that a
 * live link holds again (vmmt__pool_release_pending).
 */
void vmmt__pool_ranks_dead(void *pool, const uint64_t ranks[VMMT_BROKER_RANK_WORDS], pid_t pid,
                           uid_t uid, const uint64_t held[VMMT_BROKER_MAX_RANKS])
{
    struct vmmt_pool *p = pool;
    uint64_t todo[VMMT_BROKER_RANK_WORDS], skipped[VMMT_BROKER_RANK_WORDS] = {0};
    char list[256], left[256];
    int any = 0, any_skipped = 0;

    pthread_mutex_lock(&p->lock);
    memcpy(todo, ranks, sizeof todo);
    for (uint32_t r = 0; r < VMMT_BROKER_MAX_RANKS; r++) {
        if (!has_rank(todo, r) || p->released_at[r] == 0 || p->released_at[r] < held[r]) continue;
        todo[r / 64] &= ~(1ull << (r % 64));
        skipped[r / 64] |= 1ull << (r % 64);
        any_skipped = 1;
    }
    for (int w = 0; w < VMMT_BROKER_RANK_WORDS; w++)
        any |= todo[w] != 0;
    for (uint32_t i = 0; any && i < p->slots; i++) {
        struct vmmt__slot *s = &p->slot[i];
        if (!vmmt__slot_held(s)) continue;
        if (s->dead_gen != s->generation) {
            s->dead_gen = s->generation;
            memset(s->dead_ranks, 0, sizeof s->dead_ranks);
        }
        for (int w = 0; w < VMMT_BROKER_RANK_WORDS; w++)
            s->dead_ranks[w] |= todo[w];
    }
    for (int w = 0; w < VMMT_BROKER_RANK_WORDS; w++)
        p->dead_ranks[w] |= todo[w];
    if (any) {
        p->dead_pid = pid;
        found_dead(p, todo);
    }
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
    if (any)
        vmmt__log(VMMT_LOG_WARN,
                  "consumer process pid %d (uid %u) died holding rank(s) %s of the pool; "
                  "releasing the slices in flight now that they had not acknowledged",
                  (int)pid, (unsigned)uid, rank_list(todo, list, sizeof list));
    if (any_skipped)
        vmmt__log(VMMT_LOG_INFO,
                  "consumer process pid %d (uid %u) died holding rank(s) %s, which "
                  "vmmt_pool_release_rank released since it took them: nothing left to release",
                  (int)pid, (unsigned)uid, rank_list(skipped, left, sizeof left));
}

/*
 * A dead process held ranks that other live processes hold too, so the
 * broker released none of them (the live ones may be reading); but the
 * shared words its consumes took (TAKEN, docs/descriptor.md) will never be
 * acknowledged now that it is gone, and while they stay taken every other
 * process of the rank is refused and the slice stays in flight (an outside
 * attacker's test_attack_outside2, dead_taker_other_holder_leaks). No word
 * names its taker, so every TAKEN word of these ranks goes back to "not
 * acknowledged": one that a live process took instead is then consumed by
 * that process as usual (its acknowledgement's compare-and-swap accepts the
 * word given back), or once more by another process of the rank; the
 * slice is not recycled before some process acknowledged it, and a copy
 * still queued when it is learns so from vmmt_consumer_check
 * (vmmt__ctrl_store_ack). Device tables have no TAKEN words. Broker thread.
 */
void vmmt__pool_shared_ranks_dead(void *pool, const uint64_t ranks[VMMT_BROKER_RANK_WORDS],
                                  pid_t pid, uid_t uid)
{
    struct vmmt_pool *p = pool;
    uint32_t given = 0;

    if (!p->host_table) return;
    pthread_mutex_lock(&p->lock);
    for (uint32_t i = 0; i < p->slots; i++) {
        const struct vmmt__slot *s = &p->slot[i];
        if (!vmmt__slot_held(s)) continue;
        for (uint32_t r = 0; r < (uint32_t)p->cfg.consumer_count; r++) {
            uint32_t *w = &p->table_host[vmmt__ctrl_ack(0, p->stride, i, r) / 4];
            uint32_t taken = vmmt__gen_pending(s->generation);
            uint32_t cancelled = vmmt__ack_cancelled(s->generation);
            if (!has_rank(ranks, r)) continue;
            /* A word cancelled while taken goes to the cancel: the taker's copy cannot run. */
            given +=
                __atomic_compare_exchange_n(w, &taken, 0, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE) ||
                __atomic_compare_exchange_n(w, &cancelled, s->generation, 0, __ATOMIC_ACQ_REL,
                                            __ATOMIC_ACQUIRE);
        }
    }
    pthread_mutex_unlock(&p->lock);
    if (given > 0)
        vmmt__log(VMMT_LOG_WARN,
                  "consumer process pid %d (uid %u) died holding ranks that live processes "
                  "also hold; %u acknowledgement word(s) taken for them given back, so that "
                  "they may consume those slices",
                  (int)pid, (unsigned)uid, given);
}

/*
 * The ranks to release for slot i: `ranks` for every occupant in flight
 * (vmmt_pool_release_rank, the lease), or, with `noted`, those noted at a
 * death for the occupant it still holds, less the ranks in `live` (held by
 * a live link again: a new process of the rank consumes). Lock held.
 */
static int slot_ranks(struct vmmt_pool *p, uint32_t i, const uint64_t ranks[], int noted,
                      const uint64_t live[], uint64_t out[])
{
    const struct vmmt__slot *s = &p->slot[i];
    int any = 0;

    for (int w = 0; w < VMMT_BROKER_RANK_WORDS; w++) {
        out[w] = 0;
        if (!vmmt__slot_held(s)) continue;
        if (!noted)
            out[w] = ranks[w];
        else if (s->dead_gen == s->generation)
            out[w] = s->dead_ranks[w] & ~live[w];
        any |= out[w] != 0;
    }
    return any;
}

/*
 * A shared host table: store the occupant's generation into the rank's word.
 * The producer writes it, not a consumer, so the consumers' rule
 * (vmmt__ctrl_store_ack: only once the ready word shows the occupant) does
 * not apply: the lock is held, so `generation` is the slot's occupant now,
 * and any other value in the word is a predecessor's; the slot is still
 * recycled only once its ready word shows the generation too. Lock held.
 */
static uint32_t release_host(struct vmmt_pool *p, const uint64_t ranks[], int noted,
                             const uint64_t live[])
{
    uint32_t slices = 0;

    for (uint32_t i = 0; i < p->slots; i++) {
        const struct vmmt__slot *s = &p->slot[i];
        uint64_t mine[VMMT_BROKER_RANK_WORDS];
        int any = 0;
        if (!slot_ranks(p, i, ranks, noted, live, mine)) continue;
        for (uint32_t r = 0; r < (uint32_t)p->cfg.consumer_count; r++) {
            uint32_t *w = &p->table_host[vmmt__ctrl_ack(0, p->stride, i, r) / 4];
            if (!has_rank(mine, r) || vmmt__ctrl_load(w) == s->generation) continue;
            __atomic_store_n(w, s->generation, __ATOMIC_RELEASE);
            any = 1;
        }
        slices += (uint32_t)any;
    }
    return slices;
}

/*
 * A device table: read it, then write the missing words on the pool's stream.
 * reclaim_lock and lock are held, so no slot changes occupant meanwhile.
 */
static int release_device(struct vmmt_pool *p, const uint64_t ranks[], int noted,
                          const uint64_t live[], uint32_t *slices)
{
    const struct vmmt_drv *d = vmmt__drv();
    int st = VMMT_OK;

    *slices = 0;
    for (uint32_t i = 0; i < p->slots && st == VMMT_OK; i++) {
        const struct vmmt__slot *s = &p->slot[i];
        uint64_t mine[VMMT_BROKER_RANK_WORDS];
        int any = 0;
        if (!slot_ranks(p, i, ranks, noted, live, mine)) continue;
        for (uint32_t r = 0; r < (uint32_t)p->cfg.consumer_count && st == VMMT_OK; r++) {
            uint64_t off = vmmt__ctrl_ack(0, p->stride, i, r);
            if (!has_rank(mine, r) || vmmt__ctrl_load(&p->table_host[off / 4]) == s->generation)
                continue;
            st = VMMT_CU(d, cuStreamWriteValue32(p->stream, p->ctrl_dev + off, s->generation,
                                                 CU_STREAM_WRITE_VALUE_DEFAULT));
            any = 1;
        }
        *slices += (uint32_t)any;
    }
    if (st == VMMT_OK) st = VMMT_CU(d, cuStreamSynchronize(p->stream));
    return st;
}

/*
 * Acknowledge for `ranks` every slice in flight, or, with `ranks` NULL, what
 * deaths noted and is still to release (slot_ranks); the caller is active or
 * the recycler. A death's pending ranks are taken under the locks, and a
 * release of given ranks drops what a death of theirs still had to do
 * (everything it noted is in flight now, or recycled), so that a death that
 * vmmt_pool_release_rank covered is neither released nor counted again after
 * it: rank_releases stays exact for an engine that waits on it.
 */
static int release_ranks(struct vmmt_pool *p, const uint64_t *given, const char *given_why)
{
    uint64_t live[VMMT_BROKER_RANK_WORDS] = {0}, ranks[VMMT_BROKER_RANK_WORDS] = {0};
    uint32_t slices = 0, nranks = 0;
    int noted = given == NULL;
    char list[256], why[160];
    int st = VMMT_OK;

    snprintf(why, sizeof why, "%s", noted ? "a consumer died" : given_why);
    pthread_mutex_lock(&p->reclaim_lock);
    if (!p->host_table) st = vmmt__pool_read_table(p);
    if (st == VMMT_OK && !p->host_table) st = vmmt__ctx_enter(p->device);
    if (st == VMMT_OK) {
        pthread_mutex_lock(&p->lock);
        if (noted) {
            memcpy(ranks, p->dead_ranks, sizeof ranks);
            snprintf(why, sizeof why, "consumer pid %d died", (int)p->dead_pid);
            vmmt__broker_live_ranks(p->broker, live);
        } else {
            memcpy(ranks, given, sizeof ranks);
        }
        for (int w = 0; w < VMMT_BROKER_RANK_WORDS; w++) {
            p->dead_ranks[w] &= ~ranks[w];
            nranks += (uint32_t)__builtin_popcountll(ranks[w]);
        }
        if (p->host_table)
            slices = release_host(p, ranks, noted, live);
        else if (nranks > 0)
            st = release_device(p, ranks, noted, live, &slices);
        /* Done with, or no longer to be done: the noted ranks of these ranks. */
        for (uint32_t i = 0; i < p->slots; i++)
            for (int w = 0; w < VMMT_BROKER_RANK_WORDS; w++)
                p->slot[i].dead_ranks[w] &= ~ranks[w];
        p->rank_releases += nranks;
        p->released_slices += slices;
        pthread_mutex_unlock(&p->lock);
        if (!p->host_table) vmmt__ctx_leave();
    }
    pthread_mutex_unlock(&p->reclaim_lock);
    rank_list(ranks, list, sizeof list);
    if (st != VMMT_OK) return vmmt__wrap(st, "releasing rank(s) %s (%s)", list, why);
    if (nranks > 0)
        vmmt__log(VMMT_LOG_WARN,
                  "released rank(s) %s (%s): %u slice(s) acknowledged on their behalf", list, why,
                  slices);
    return VMMT_OK;
}

/*
 * consumer_lease_ms: ranks that no live link holds and that sat on a slice
 * (whose ready word shows the producer's copy done) for longer than the
 * lease. A slot's lease starts when the recycler first sees its occupant in
 * flight; the recycler runs every recycle interval while slices are in
 * flight, so that is within an interval of the publish.
 */
void vmmt__pool_lease_check(struct vmmt_pool *p)
{
    uint64_t live[VMMT_BROKER_RANK_WORDS], stale[VMMT_BROKER_RANK_WORDS] = {0};
    int64_t now = vmmt__now_ms(), lease = p->cfg.consumer_lease_ms;
    char why[160];
    int any = 0;

    pthread_mutex_lock(&p->reclaim_lock);
    pthread_mutex_lock(&p->lock);
    vmmt__broker_live_ranks(p->broker, live);
    for (uint32_t i = 0; i < p->slots && p->lease_gen != NULL; i++) {
        const struct vmmt__slot *s = &p->slot[i];
        const uint32_t *row = p->table_host + (size_t)i * (p->stride / 4);
        if (!vmmt__slot_held(s)) continue;
        if (p->lease_gen[i] != s->generation) {
            p->lease_gen[i] = s->generation;
            p->lease_since_ms[i] = now;
            continue;
        }
        if (now - p->lease_since_ms[i] < lease || vmmt__ctrl_load(&row[0]) != s->generation)
            continue;
        for (uint32_t r = 0; r < (uint32_t)p->cfg.consumer_count; r++) {
            if (has_rank(live, r) || vmmt__ctrl_load(&row[1 + r]) == s->generation) continue;
            stale[r / 64] |= 1ull << (r % 64);
            any = 1;
        }
    }
    if (any) found_dead(p, stale);
    pthread_mutex_unlock(&p->lock);
    pthread_mutex_unlock(&p->reclaim_lock);
    if (!any) return;
    snprintf(why, sizeof why,
             "no live consumer process holds it, and it left a slice unacknowledged for more "
             "than consumer_lease_ms=%d",
             p->cfg.consumer_lease_ms);
    if (release_ranks(p, stale, why) != VMMT_OK) vmmt__pool_quarantine(p);
}

void vmmt__pool_release_pending(struct vmmt_pool *p)
{
    if (release_ranks(p, NULL, NULL) != VMMT_OK) {
        /* The table could not be read or written: the device is in trouble. */
        vmmt__pool_quarantine(p);
    }
}

/* How long vmmt_pool_release_rank waits for the broker to read its links. */
#define BROKER_SYNC_MS 1000

int vmmt_pool_release_rank(vmmt_pool *p, int rank)
{
    uint64_t ranks[VMMT_BROKER_RANK_WORDS] = {0};
    int st;

    if (p == NULL) return vmmt__fail(VMMT_EINVAL, "vmmt_pool_release_rank: pool is NULL");
    if (rank < 0 || rank >= p->cfg.consumer_count)
        return vmmt__fail(VMMT_EINVAL,
                          "vmmt_pool_release_rank: rank %d is outside the pool's consumer ranks "
                          "0..%d",
                          rank, p->cfg.consumer_count - 1);
    ranks[rank / 64] = 1ull << (rank % 64);
    st = vmmt__pool_enter(p);
    if (st != VMMT_OK) return vmmt__wrap(st, "vmmt_pool_release_rank");
    /* A consumer that announced the rank before this call took it before this release, so its
     * death must not release the rank again (what is published from now on is the next
     * process's): the broker stamps an announcement when it reads it, so have it read them all
     * first. Late, the next process's slices may be released once under it; say so. */
    if (vmmt__broker_sync(p->broker, BROKER_SYNC_MS) != VMMT_OK)
        vmmt__log(VMMT_LOG_WARN,
                  "vmmt_pool_release_rank(%d): %s; a process that took the rank before this "
                  "call and dies later may have it released again",
                  rank, vmmt_last_error());
    /* Before the release: a death of the rank's process seen from now on, by a
     * broker running late, is known to be covered by it (vmmt__pool_ranks_dead). */
    pthread_mutex_lock(&p->lock);
    p->released_at[rank] = vmmt__liveness_tick();
    /* A death found before this call is the engine's to know now: not reported after it, where
     * it would read as the death of the process the engine starts next under the rank. */
    p->found_dead[rank / 64] &= ~(1ull << (rank % 64));
    pthread_mutex_unlock(&p->lock);
    st = release_ranks(p, ranks, "vmmt_pool_release_rank");
    vmmt__pool_leave(p);
    /* The slices are free once the recycler next reads the table; do it now. */
    if (st == VMMT_OK) st = vmmt_pool_reclaim(p, NULL);
    return st == VMMT_OK ? VMMT_OK : vmmt__wrap(st, "vmmt_pool_release_rank");
}

int vmmt_pool_take_dead_ranks(vmmt_pool *p, int *ranks, int capacity, int *count)
{
    int n = 0, left = 0;

    if (p == NULL || count == NULL)
        return vmmt__fail(VMMT_EINVAL, "vmmt_pool_take_dead_ranks: %s is NULL",
                          p == NULL ? "pool" : "count");
    *count = 0;
    if (capacity < 0 || (ranks == NULL && capacity > 0))
        return vmmt__fail(VMMT_EINVAL,
                          "vmmt_pool_take_dead_ranks: capacity=%d with ranks %s; give an array "
                          "of capacity >= 0 ints (NULL only with 0)",
                          capacity, ranks == NULL ? "NULL" : "set");
    if (!__atomic_load_n(&p->found_any, __ATOMIC_ACQUIRE)) return VMMT_OK;
    pthread_mutex_lock(&p->lock);
    for (uint32_t r = 0; r < VMMT_BROKER_MAX_RANKS; r++) {
        if (!has_rank(p->found_dead, r)) continue;
        if (n == capacity) {
            left = 1;
            break;
        }
        ranks[n++] = (int)r;
        p->found_dead[r / 64] &= ~(1ull << (r % 64));
    }
    if (!left) __atomic_store_n(&p->found_any, 0, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&p->lock);
    *count = n;
    return VMMT_OK;
}
