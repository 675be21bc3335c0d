/*
 * Consume and acknowledge. Once a pool is imported (import_cache.c), a
 * consume costs one wait, one copy and one acknowledgement per rank, all
 * enqueued on the caller's stream.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "abi.h"
#include "acker.h"
#include "broker.h"
#include "clock.h"
#include "consumer_internal.h"
#include "ctrl.h"
#include "desc.h"
#include "driver.h"
#include "chunk_map.h"
#include "rank_set.h"
#include "status.h"

struct request {
    struct vmmt__desc d;
    struct imported *pool;
    CUstream stream;
    struct vmmt__ranks ranks; /* what the call is for: a run, or a list */
    int ack_now;              /* this call completes the slot for these ranks */
    int gone;                 /* check_occupant found the occupant gone from its slot */
    int landed;               /* check_occupant found its bytes landed (the ready word held it) */
    int held; /* the buffer's chunks are held for this call's copy (vmmt__chunk_map_hold) until
                 whoever tracks the copy takes them over, or done() lets go */
    uint64_t took[VMMT__MAX_CONSUMERS / 64]; /* ranks whose shared word this call took */
    /* A forgotten group's words, to give back after its stream (forget_groups_with). */
    struct vmmt__ranks back;
};

/* Each rank r of the set *s, lowest first. */
#define FOR_RANKS(r, s) for (uint32_t r = (s)->lo; r < (s)->hi; r = vmmt__ranks_after((s), r))

/* The ranks a call asked for: `list` (n of them) when not NULL, else the run [first, +n). */
static int resolve_ranks(const struct vmmt__desc *d, const int *list, int first, int n,
                         struct request *rq)
{
    if (list != NULL) return vmmt__ranks_list(&rq->ranks, list, n, d->consumer_count);
    return vmmt__ranks_run(&rq->ranks, first, n, d->consumer_count);
}

static int fail_twice(const struct request *rq)
{
    char name[96];

    return vmmt__fail(VMMT_ESTATE,
                      "descriptor (slot %u, generation %u, member %u) was already consumed or "
                      "acknowledged for ranks %s in this process",
                      rq->d.slot, rq->d.generation, rq->d.pack_index,
                      vmmt__ranks_name(&rq->ranks, name, sizeof name));
}

/* The group for this rank set, or a free one; NULL with an error if neither. */
static struct pack_group *group_for(struct slot_state *s, const struct request *rq)
{
    struct pack_group *free_group = NULL;
    uint64_t bit = 1ull << rq->d.pack_index;
    char had[96], asked[96];

    for (int i = 0; i < PACK_GROUPS; i++) {
        struct pack_group *g = &s->groups[i];
        int same = g->members != 0 && vmmt__ranks_equal(&g->ranks, &rq->ranks);
        /* Another set that shares a rank: the group's one acknowledgement
         * is per set, so mixing sets would copy a member twice for a rank
         * or leave the group for ever partly consumed. */
        if (g->members != 0 && !same && vmmt__ranks_meet(&rq->ranks, g->ranks.bits)) {
            if (g->members & bit) {
                fail_twice(rq);
                return NULL;
            }
            vmmt__fail(VMMT_EINVAL,
                       "members of packed slot %u are being consumed for ranks %s; consume "
                       "every member of a packed group for the same ranks (asked %s)",
                       rq->d.slot, vmmt__ranks_name(&g->ranks, had, sizeof had),
                       vmmt__ranks_name(&rq->ranks, asked, sizeof asked));
            return NULL;
        }
        if (same) {
            if (g->stream != rq->stream) {
                vmmt__fail(VMMT_EINVAL,
                           "members of packed slot %u are being consumed on another stream; "
                           "consume every member of a packed group on one stream, so its "
                           "single acknowledgement follows all the copies",
                           rq->d.slot);
                return NULL;
            }
            return g;
        }
        if (g->members == 0 && free_group == NULL) free_group = g;
    }
    if (vmmt__ranks_meet(&rq->ranks, s->ranks_acked)) {
        fail_twice(rq);
        return NULL;
    }
    if (free_group == NULL) {
        vmmt__fail(VMMT_EINVAL,
                   "packed slot %u is being consumed for more than %d rank sets at once in "
                   "this process; consume it with fewer distinct rank sets",
                   rq->d.slot, PACK_GROUPS);
        return NULL;
    }
    free_group->ranks = rq->ranks;
    free_group->stream = rq->stream;
    return free_group;
}

/*
 * The occupant this process has a record of left its slot: a packed group of
 * it half consumed here will never complete, and must not keep the pool from
 * being evicted. Consumer lock held.
 */
static void forget(struct request *rq)
{
    struct slot_state *s = &rq->pool->slots[rq->d.slot];

    if (s->generation != rq->d.generation) return;
    for (int i = 0; i < PACK_GROUPS; i++)
        if (s->groups[i].members != 0) {
            rq->pool->open_groups--;
            /* Its members' copies may have read the slice's next buffer: check says so. */
            vmmt__consumer_remember_failed(rq->pool->owner, rq->pool, rq->d.slot, rq->d.generation,
                                           VMMT__FAILED_OVERTAKEN);
        }
    memset(s, 0, sizeof *s);
}

/*
 * Rank r's shared word back from TAKEN (take_words, below), if it still holds
 * it: a release may have written G meanwhile, and then it stays. One the
 * producer's cancel found taken (CANCELLED, generation.h) goes to the
 * cancel, G, which frees the slice.
 */
static void give_back_at(struct imported *pool, uint32_t stride, uint32_t slot, uint32_t gen,
                         uint32_t r)
{
    uint32_t expect = vmmt__gen_pending(gen), cancelled = vmmt__ack_cancelled(gen);
    uint32_t *w = pool->ctrl.host + vmmt__ctrl_ack(0, stride, slot, r) / 4;

    if (!__atomic_compare_exchange_n(w, &expect, 0, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        __atomic_compare_exchange_n(w, &cancelled, gen, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

static void give_back_word(const struct request *rq, uint32_t r)
{
    give_back_at(rq->pool, rq->d.slot_stride, rq->d.slot, rq->d.generation, r);
}

static uint32_t *shared_row(const struct request *rq)
{
    return rq->pool->ctrl.host + vmmt__ctrl_ready(0, rq->d.slot_stride, rq->d.slot) / 4;
}

/*
 * Rank r's acknowledgement word holds the occupant while a packed group of it
 * for a range with r is half consumed here: another process of the rank, its
 * release, or the producer's cancel acknowledged it, and the group can never
 * complete here. Forgotten, so that it never keeps the pool from eviction
 * (an outside review: a group half consumed, then cancelled, blocked it for
 * good). Groups of other ranges keep their progress.
 *
 * A shared table's words the group took go back (CANCELLED to the cancel,
 * TAKEN to "not acknowledged") once the work now on the group's stream, its
 * members' copies, has completed: prepare hands them to the acker after it
 * lets go of the consumer's lock (give_back_after). Given back at once, a
 * cancel freed the slice under those copies (test_cancel_taken). Only a call
 * on another stream (which the group could not use anyway) gives them back
 * now. vmmt_consumer_check tells the copies failed where the slot may be
 * recycled under them: a release wrote the generation into a word, the
 * words went back at once, or a device table (no words hold the slice).
 * Ranges of groups never overlap, so at most one group is forgotten here.
 * Consumer lock held.
 */
static void forget_groups_with(struct request *rq, uint32_t r)
{
    struct slot_state *s = &rq->pool->slots[rq->d.slot];
    const uint32_t *row = rq->pool->host_table ? shared_row(rq) : NULL;

    if (s->generation != rq->d.generation) return;
    for (int i = 0; i < PACK_GROUPS; i++) {
        struct pack_group *g = &s->groups[i];
        int held = row != NULL && g->stream == rq->stream;
        if (g->members == 0 || !vmmt__ranks_has(&g->ranks, r)) continue;
        FOR_RANKS(k, &g->ranks)
        {
            if (held) held = vmmt__ctrl_load(&row[1 + k]) != rq->d.generation;
        }
        FOR_RANKS(k, &g->ranks)
        {
            if (row != NULL && g->stream != rq->stream) give_back_word(rq, k);
        }
        vmmt__ranks_mark(&g->ranks, s->ranks_taken, 0);
        if (row != NULL && g->stream == rq->stream) {
            rq->back = g->ranks;
            /* Counted as a copy from now on, so that the pool cannot be evicted before. */
            __atomic_add_fetch(&rq->pool->copies, 1, __ATOMIC_RELAXED);
        }
        memset(g, 0, sizeof *g);
        rq->pool->open_groups--;
        /* The slot may be recycled now, under copies of members consumed here. */
        if (!held)
            vmmt__consumer_remember_failed(rq->pool->owner, rq->pool, rq->d.slot, rq->d.generation,
                                           VMMT__FAILED_OVERTAKEN);
    }
}

/*
 * Record the consume in this process's slot state, refusing a descriptor
 * consumed before (check_occupant, earlier in this call, and take_words
 * after the chunks were mapped, refused one whose slot has moved on);
 * consumer lock held.
 */
static int claim(struct request *rq)
{
    struct slot_state *s = &rq->pool->slots[rq->d.slot];
    uint64_t bit = 1ull << rq->d.pack_index;
    uint64_t all = rq->d.pack_count >= 64 ? ~0ull : (1ull << rq->d.pack_count) - 1;
    struct pack_group *g;

    /* check_occupant vouched for the generation: a different one is a new occupant. */
    if (s->generation != rq->d.generation) {
        /* A new occupant: groups of the old one will never complete here, and the slot
         * moved on under their members' copies, which may have read the new occupant's
         * bytes (vmmt_consumer_check says so: an outside attacker's
         * test_attack_outside3, packed_*_under_queued_copy_check). */
        for (int i = 0; i < PACK_GROUPS; i++)
            if (s->groups[i].members != 0) {
                rq->pool->open_groups--;
                vmmt__consumer_remember_failed(rq->pool->owner, rq->pool, rq->d.slot, s->generation,
                                               VMMT__FAILED_OVERTAKEN);
            }
        memset(s, 0, sizeof *s);
        s->generation = rq->d.generation;
        s->slice_offset = rq->d.slice_offset;
        s->pack_count = rq->d.pack_count;
    }
    if (s->pack_count != rq->d.pack_count || s->slice_offset != rq->d.slice_offset)
        return vmmt__fail(VMMT_EPROTO,
                          "descriptor for slot %u generation %u says %u member(s) in a slice at "
                          "%" PRIu64 ", where the occupant's other descriptors here said %u at "
                          "%" PRIu64 ": the descriptor was altered; nothing was acknowledged",
                          rq->d.slot, rq->d.generation, rq->d.pack_count, rq->d.slice_offset,
                          s->pack_count, s->slice_offset);
    if (rq->d.pack_count <= 1) {
        if (vmmt__ranks_meet(&rq->ranks, s->ranks_acked)) return fail_twice(rq);
        vmmt__ranks_mark(&rq->ranks, s->ranks_acked, 1);
        rq->ack_now = 1;
        return VMMT_OK;
    }
    g = group_for(s, rq);
    if (g == NULL) return vmmt_last_status();
    if (g->members & bit) return fail_twice(rq);
    if (g->members == 0) rq->pool->open_groups++;
    g->members |= bit;
    if ((g->members & all) == all) {
        rq->ack_now = 1;
        vmmt__ranks_mark(&rq->ranks, s->ranks_acked, 1);
        memset(g, 0, sizeof *g);
        rq->pool->open_groups--;
    }
    return VMMT_OK;
}

/*
 * Take back what claim recorded, when the wait for the ready word or the
 * acknowledgement write failed: nothing was acknowledged, so the caller may
 * retry. Consumer lock taken here.
 */
static void unclaim(vmmt_consumer *c, const struct request *rq)
{
    struct slot_state *s = &rq->pool->slots[rq->d.slot];
    uint64_t bit = 1ull << rq->d.pack_index;
    uint64_t all = rq->d.pack_count >= 64 ? ~0ull : (1ull << rq->d.pack_count) - 1;

    pthread_mutex_lock(&c->lock);
    if (s->generation != rq->d.generation) goto out; /* a newer occupant took the state */
    /* A shared table's words this call took go back (take_words, below): nothing was
     * acknowledged, so another process of the rank may consume it. */
    FOR_RANKS(r, &rq->ranks)
    {
        if (!rq->pool->host_table || !(rq->took[r / 64] & (1ull << (r % 64)))) continue;
        give_back_word(rq, r);
        s->ranks_taken[r / 64] &= ~(1ull << (r % 64));
    }
    if (rq->ack_now) vmmt__ranks_mark(&rq->ranks, s->ranks_acked, 0);
    if (rq->d.pack_count <= 1) goto out;
    for (int i = 0; i < PACK_GROUPS; i++) {
        struct pack_group *g = &s->groups[i];
        if (rq->ack_now && g->members == 0) {
            /* The group was complete and cleared: every member but this one stays done. */
            g->ranks = rq->ranks;
            g->stream = rq->stream;
            g->members = all & ~bit;
            rq->pool->open_groups++; /* partly consumed again: the import must stay */
            break;
        }
        if (!rq->ack_now && g->members != 0 && vmmt__ranks_equal(&g->ranks, &rq->ranks)) {
            g->members &= ~bit;
            if (g->members == 0) rq->pool->open_groups--;
            break;
        }
    }
out:
    pthread_mutex_unlock(&c->lock);
}

static int load_row(vmmt_consumer *c, struct request *rq, uint32_t *ready, uint32_t *acked);

/*
 * A ready word v that will never show the descriptor's occupant LIVE: its
 * status with a message, or VMMT_OK while it still may (PENDING).
 */
static int not_coming(const struct request *rq, uint32_t v)
{
    enum vmmt__occupant occ = vmmt__occupant_of(v, rq->d.generation);

    if (occ == VMMT__OCC_COPYING || occ == VMMT__OCC_READY) return VMMT_OK;
    if (occ == VMMT__OCC_ABANDONED)
        return vmmt__fail(VMMT_ECLOSED,
                          "the producer (pid %d) died before the bytes of slot %u generation %u "
                          "landed; nothing was copied: drop the request",
                          rq->d.producer_pid, rq->d.slot, rq->d.generation);
    return vmmt__fail(VMMT_ESTATE,
                      "slot %u no longer holds generation %u (its ready word reads %u): the "
                      "buffer was cancelled or released and its slice may be reused",
                      rq->d.slot, rq->d.generation, v);
}

/*
 * Whether the descriptor names the slot's live occupant and the ranks asking
 * still owe it an acknowledgement, read from the control table: the one
 * record every process shares (docs/design.md, "Invariants"). A record of
 * this process's own could not do: a restarted rank, a new consumer, or
 * this one after evicting the pool has none, and the soak and an outside
 * review found each of them consuming a recycled slice with OK. So:
 *
 * - the ready word must show the occupant LIVE, or PENDING for a
 *   stream-ordered descriptor (its wait then orders the copy); RETIRED or
 *   any other word means the slice may hold another buffer's bytes
 *   (VMMT_ESTATE), ABANDONED that the producer died first (VMMT_ECLOSED);
 * - a word of no state of this generation means the descriptor was never
 *   handed out (PENDING lands before a publish returns, publish.c) or was
 *   moved to another slot (generations are pool-wide): one ahead of its
 *   slot is refused at once, so it can neither wait for the next occupant's
 *   bytes nor acknowledge them;
 * - no rank asked for may hold the generation in its acknowledgement word:
 *   that rank has consumed the occupant, in this process or another.
 *
 * A device table costs a read through the pool's stream (about 10 us on the
 * H200) for every call: a packed member of an occupant this process has
 * read before is no exception, since the group may have left the slot since
 * (cancelled, or completed by another process of the rank), its slice holding
 * another buffer (tests/unit/test_attack_occupancy.c). Consumer lock held.
 */
static int check_occupant(vmmt_consumer *c, struct request *rq)
{
    uint32_t gen = rq->d.generation, ready = 0, acked = UINT32_MAX;
    int stream_ordered = (rq->d.flags & VMMT__DESC_STREAM_ORDERED) != 0;
    enum vmmt__occupant occ;
    int st;

    st = load_row(c, rq, &ready, &acked);
    occ = vmmt__occupant_of(ready, gen);
    if (st != VMMT_OK)
        return vmmt__wrap(st, "reading the control table row of slot %u to check generation %u",
                          rq->d.slot, gen);
    rq->gone = occ != VMMT__OCC_READY && occ != VMMT__OCC_COPYING;
    rq->landed = occ == VMMT__OCC_READY;
    if (occ == VMMT__OCC_ABANDONED) return not_coming(rq, ready);
    if (occ != VMMT__OCC_READY && !(occ == VMMT__OCC_COPYING && stream_ordered))
        return vmmt__fail(VMMT_ESTATE,
                          "descriptor for slot %u generation %u names no live occupant of the "
                          "slot: its ready word holds %u, so the buffer was recycled, "
                          "cancelled or released, or the descriptor was not made by this "
                          "pool's producer; nothing was acknowledged",
                          rq->d.slot, gen, ready);
    if (acked != UINT32_MAX) {
        forget_groups_with(rq, acked);
        return vmmt__fail(VMMT_ESTATE,
                          "descriptor for slot %u generation %u was already acknowledged, or "
                          "is being consumed, for rank %u (by this process or another of that "
                          "rank), or was cancelled by its producer; nothing was acknowledged "
                          "again: drop it for that rank (ask again without it for others)",
                          rq->d.slot, gen, acked);
    }
    return VMMT_OK;
}

/*
 * A shared table's acknowledgement word goes through TAKEN (G - 1) before it
 * holds G: a consume moves each asked rank's word there with a
 * compare-and-swap before it copies, and its acknowledgement, written by the
 * acker once the copy is done, moves it on to G. So a second process of the
 * same rank that comes while the first's copy is queued finds the word
 * taken and is refused (before, it found no acknowledgement yet, was
 * accepted, and its own acknowledgement could recycle the slice under the
 * first one's copy: the model test, seed 1015). The producer waits for G,
 * as before; a release writes G over TAKEN. Device tables have no atomic
 * operation across processes: there, one process per rank stays the rule
 * (docs/design.md). Consumer lock held.
 */
static int taken_here(const struct request *rq, uint32_t r)
{
    const struct slot_state *s = &rq->pool->slots[rq->d.slot];

    return s->generation == rq->d.generation && (s->ranks_taken[r / 64] & (1ull << (r % 64)));
}

/* Give back the words this call took (a failure after take_words). */
static void give_back_words(struct request *rq)
{
    FOR_RANKS(r, &rq->ranks)
    {
        if (!(rq->took[r / 64] & (1ull << (r % 64)))) continue;
        give_back_word(rq, r);
        rq->took[r / 64] &= ~(1ull << (r % 64));
    }
}

static int take_words(struct request *rq)
{
    uint32_t gen = rq->d.generation, taken = vmmt__gen_pending(gen), *row;

    if (!rq->pool->host_table) return VMMT_OK;
    row = shared_row(rq);
    FOR_RANKS(r, &rq->ranks)
    {
        uint32_t cur = vmmt__ctrl_load(&row[1 + r]), ready;
        /* A later member of a group this process opened, unless it was cancelled since. */
        if (taken_here(rq, r) && cur != vmmt__ack_cancelled(gen)) continue;
        for (;;) {
            if (cur == gen || cur == taken || cur == vmmt__ack_cancelled(gen)) {
                give_back_words(rq);
                /* Cancelled since check_occupant looked: a group opened here is over. */
                if (cur == vmmt__ack_cancelled(gen)) forget_groups_with(rq, r);
                return vmmt__fail(VMMT_ESTATE,
                                  "descriptor for slot %u generation %u is being consumed or "
                                  "was acknowledged for rank %u by another process of that "
                                  "rank, or was cancelled by its producer; nothing was "
                                  "acknowledged",
                                  rq->d.slot, gen, r);
            }
            ready = vmmt__ctrl_load(&row[0]);
            if (ready != gen && ready != taken) {
                give_back_words(rq);
                return vmmt__fail(VMMT_ESTATE,
                                  "slot %u no longer holds generation %u (its ready word reads "
                                  "%u); nothing was acknowledged",
                                  rq->d.slot, gen, ready);
            }
            if (__atomic_compare_exchange_n(&row[1 + r], &cur, taken, 0, __ATOMIC_ACQ_REL,
                                            __ATOMIC_ACQUIRE))
                break;
        }
        rq->took[r / 64] |= 1ull << (r % 64);
    }
    return VMMT_OK;
}

/* The words taken are this process's now (claim made the slot state this occupant's). */
static void keep_words(struct request *rq)
{
    struct slot_state *s = &rq->pool->slots[rq->d.slot];

    for (int i = 0; i < VMMT__MAX_CONSUMERS / 64; i++)
        s->ranks_taken[i] |= rq->took[i];
}

static void give_back_after(vmmt_consumer *c, struct request *rq);

/* copy: dst and dst_size name the destination; 0 for an acknowledgement alone. */
static int prepare(vmmt_consumer *c, const vmmt_desc *desc, int device, const int *list, int first,
                   int count, int copy, uint64_t dst, uint64_t dst_size, CUstream stream,
                   struct request *rq)
{
    int st;

    if (c == NULL || desc == NULL)
        return vmmt__fail(VMMT_EINVAL, "consumer and descriptor must not be NULL");
    memset(rq, 0, sizeof *rq);
    rq->stream = stream;
    st = vmmt__desc_decode(desc->bytes, &rq->d);
    if (st == VMMT_OK && (rq->d.flags & VMMT__DESC_TOKEN))
        st = vmmt__fail(VMMT_EINVAL,
                        "this is the token of a reservation (vmmt_reserve), not a descriptor: "
                        "vmmt_commit it and hand out the descriptor that returns");
    if (st == VMMT_OK) st = resolve_ranks(&rq->d, list, first, count, rq);
    if (st != VMMT_OK) return st;
    if (copy && (dst == 0 || dst_size < rq->d.nbytes || dst > UINT64_MAX - rq->d.nbytes))
        return vmmt__fail(VMMT_EINVAL,
                          "destination has %" PRIu64 " bytes at 0x%" PRIx64
                          "; the buffer needs %" PRIu64 " (a non-NULL pointer, not wrapping)",
                          dst_size, dst, rq->d.nbytes);
    pthread_mutex_lock(&c->lock);
    st = vmmt__cache_get(c, desc->bytes, &rq->d, device, &rq->pool);
    if (st == VMMT_OK) {
        st = check_occupant(c, rq);
        if (st != VMMT_OK && rq->gone) forget(rq);
    }
    /* A copy needs the buffer's chunks mapped, at the incarnation the table shows;
     * chunks the producer gave back are let go here, so their memory is freed. After
     * the occupant's check: a stale descriptor fetches nothing, and so cannot meet a
     * chunk given back under its fetch (the model test, seed 15). */
    if (st == VMMT_OK && rq->pool->chunks != NULL) {
        const uint32_t *words =
            rq->pool->ctrl.host + (uint64_t)rq->d.table_slots * rq->d.slot_stride / 4;
        if (copy) st = vmmt__chunk_map_ensure(rq->pool->chunks, words, &rq->d);
        if (st == VMMT_OK) st = vmmt__chunk_map_trim(rq->pool->chunks, words);
    }
    if (st == VMMT_OK) st = take_words(rq);
    if (st == VMMT_OK) {
        st = claim(rq);
        if (st == VMMT_OK)
            keep_words(rq);
        else
            give_back_words(rq);
    }
    /* Before any copy or acknowledgement: should we die from here on, the producer knows
     * which ranks to release. Liveness is best effort; the consume does not depend on it. */
    for (uint32_t r = 0, n = 0;
         st == VMMT_OK && rq->pool->link != NULL && vmmt__ranks_next_run(&rq->ranks, &r, &n);
         r += n)
        if (vmmt__broker_link_hold(rq->pool->link, r, n) != VMMT_OK) {
            vmmt__log(VMMT_LOG_INFO, "liveness link: %s", vmmt_last_error());
            break;
        }
    if (st == VMMT_OK) vmmt__cache_use(c, rq->pool);
    /* Under the lock, so that no other call unmaps a chunk between here and the copy. */
    if (st == VMMT_OK && copy && rq->pool->chunks != NULL) {
        vmmt__chunk_map_hold(rq->pool->chunks, rq->d.offset, rq->d.nbytes, 1);
        rq->held = 1;
    }
    pthread_mutex_unlock(&c->lock);
    give_back_after(c, rq);
    return st;
}

/* The chunks a copy held, let go once it is done (or was never queued). */
static void unhold(struct imported *ip, uint64_t offset, uint64_t nbytes)
{
    vmmt__chunk_map_hold(ip->chunks, offset, nbytes, -1);
}

static void done(vmmt_consumer *c, struct request *rq)
{
    if (rq->held) unhold(rq->pool, rq->d.offset, rq->d.nbytes);
    rq->held = 0;
    vmmt__cache_unuse(c, rq->pool);
}

/* The ready word as the host sees it now: a plain load, or a copy through the pool's stream. */
static int read_ready(struct imported *ip, const struct request *rq, CUdeviceptr word,
                      const struct timespec *until, int timeout_ms, uint32_t *v)
{
    int st;

    if (ip->host_table) {
        *v =
            vmmt__ctrl_load(ip->ctrl.host + vmmt__ctrl_ready(0, rq->d.slot_stride, rq->d.slot) / 4);
        return VMMT_OK;
    }
    st = vmmt__table_read_words(ip, word, 1, until, timeout_ms);
    if (st == VMMT_OK) *v = ip->poll_word[0];
    return st;
}

/*
 * The descriptor's ready word and the first of its ranks whose
 * acknowledgement word holds the generation (UINT32_MAX if none): loads from
 * a shared table, one read of the row through the pool's stream for a
 * device table, within the consumer's timeout.
 */
static int load_row(vmmt_consumer *c, struct request *rq, uint32_t *ready, uint32_t *acked)
{
    struct imported *ip = rq->pool;
    CUdeviceptr row = ip->table + vmmt__ctrl_ready(0, rq->d.slot_stride, rq->d.slot);
    uint32_t words = 1 + rq->ranks.hi;
    const uint32_t *w = NULL;
    struct timespec until;
    int st = VMMT_OK;

    *acked = UINT32_MAX;
    if (ip->host_table) {
        w = ip->ctrl.host + vmmt__ctrl_ready(0, rq->d.slot_stride, rq->d.slot) / 4;
        *ready = vmmt__ctrl_load(&w[0]);
        FOR_RANKS(r, &rq->ranks)
        {
            uint32_t v = vmmt__ctrl_load(&w[1 + r]);
            /* Acknowledged, cancelled (even under this process's own take), or taken
             * by another process's consume (take_words). */
            if (v == rq->d.generation || v == vmmt__ack_cancelled(rq->d.generation) ||
                (v == vmmt__gen_pending(rq->d.generation) && !taken_here(rq, r))) {
                *acked = r;
                break;
            }
        }
        return VMMT_OK;
    }
    vmmt__deadline(&until, (int64_t)c->cfg.timeout_ms * 1000);
    pthread_mutex_lock(&ip->poll_lock);
    st = vmmt__table_open_poll(ip);
    if (st == VMMT_OK) st = vmmt__table_read_words(ip, row, words, &until, c->cfg.timeout_ms);
    if (st == VMMT_OK) {
        *ready = ip->poll_word[0];
        FOR_RANKS(r, &rq->ranks)
        {
            if (ip->poll_word[1 + r] != rq->d.generation) continue;
            *acked = r;
            break;
        }
    }
    pthread_mutex_unlock(&ip->poll_lock);
    return st;
}

/*
 * A device table's ready word reaches the generation even for an occupant
 * cancelled while its copy was queued (the producer's queued write lands
 * after the cancel); the cancel, or a rank's release, shows in the
 * acknowledgement words instead. So a consume that waited on the host reads
 * the row again once the word arrived: an outside attack had a cancel return
 * during the wait and the consume then answer OK, its copy reading the next
 * occupant's bytes. (A shared table's cancel retires the ready word itself,
 * which host_wait sees.)
 */
static int still_live(vmmt_consumer *c, struct request *rq)
{
    uint32_t ready = 0, acked = UINT32_MAX;
    int st;

    if (rq->pool->host_table) return VMMT_OK;
    st = load_row(c, rq, &ready, &acked);
    if (st != VMMT_OK)
        return vmmt__wrap(st, "reading the control table row of slot %u again after its wait",
                          rq->d.slot);
    if (ready != rq->d.generation || acked != UINT32_MAX)
        return vmmt__fail(VMMT_ESTATE,
                          "slot %u generation %u was cancelled or released while this call "
                          "waited for its bytes (ready word %u, rank %u acknowledged); nothing "
                          "was copied or acknowledged: drop the request",
                          rq->d.slot, rq->d.generation, ready, acked);
    return VMMT_OK;
}

/*
 * Watch the ready word from the host, within the consumer's timeout: where
 * the driver refused a stream wait, or where this process could not learn
 * of the producer's death (wait_ready). A device table is read on a stream
 * of the pool's own: the legacy stream would queue behind the application's
 * work. The import's poll lock is taken for each read only: every consume
 * of a device table reads its row under it, and an outside attack found a
 * descriptor whose bytes had landed, and through the consumer's lock another
 * pool's, held up for this whole wait.
 */
static int host_wait(vmmt_consumer *c, struct request *rq, CUdeviceptr word)
{
    struct imported *ip = rq->pool;
    struct timespec until, pause = {0, 20000};
    uint32_t gen = rq->d.generation, v = 0;
    int st = VMMT_OK, seen = 0;

    vmmt__deadline(&until, (int64_t)c->cfg.timeout_ms * 1000);
    for (;;) {
        pthread_mutex_lock(&ip->poll_lock);
        st = vmmt__table_open_poll(ip);
        if (st == VMMT_OK) st = read_ready(ip, rq, word, &until, c->cfg.timeout_ms, &v);
        pthread_mutex_unlock(&ip->poll_lock);
        /* A device table's read still running when this wait's deadline
         * passed: the answer is the flag's (below), not a busy device. */
        if (st == VMMT_ETIMEDOUT && seen && vmmt__deadline_passed(&until)) st = VMMT_OK;
        if (st != VMMT_OK) break;
        if (v == gen) return still_live(c, rq);
        seen = 1;
        st = not_coming(rq, v);
        if (st != VMMT_OK) break;
        if (vmmt__cache_pidfd_exited(ip)) {
            st = vmmt__fail(VMMT_ECLOSED,
                            "the producer (pid %d) exited before setting its ready flag to "
                            "generation %u; nothing was copied: drop the request",
                            rq->d.producer_pid, gen);
            break;
        }
        if (vmmt__deadline_passed(&until)) {
            st = vmmt__fail(VMMT_ETIMEDOUT,
                            "the bytes of slot %u generation %u did not land within %d ms (its "
                            "ready word reads %u: the producer's copy is still pending); nothing "
                            "was copied or acknowledged: retry the call later, or drop the "
                            "request if the producer is gone",
                            rq->d.slot, gen, c->cfg.timeout_ms, v);
            break;
        }
        nanosleep(&pause, NULL);
    }
    return st;
}

/* Register a shared table on first need; a failure only means host polling. */
static int registered_table(struct imported *ip)
{
    int st;

    pthread_mutex_lock(&ip->poll_lock);
    st = vmmt__ctrl_register(&ip->ctrl);
    pthread_mutex_unlock(&ip->poll_lock);
    if (st != VMMT_OK)
        vmmt__log(VMMT_LOG_INFO, "control table not registered (%s); ready flags are polled",
                  vmmt_last_error());
    return st;
}

/*
 * Whether this process learns of ip's producer's death (producer_watch.c):
 * through its broker link or its pidfd. A FABRIC import has neither (its
 * producer may be on another node), so nothing of its own would ever end a
 * stream wait on a ready word its dead producer never wrote.
 */
static int death_seen(const struct imported *ip)
{
    return ip->link != NULL || ip->pidfd >= 0;
}

/*
 * Order the copy (and the acknowledgement) after the producer's copy; *queued
 * says whether a stream wait was enqueued. Bytes known to have landed need no
 * wait: a shared host table's flag is usually set already (the descriptor
 * travelled while the producer's copy ran) and a load proves it; a device
 * table's row was just read by check_occupant. A pool whose producer's death
 * this process cannot see is waited for on the host, within the consumer's
 * timeout, never on the stream: on a GPU such a wait, its producer dead,
 * would hold the caller's stream for ever (the model test, seed 8002). (The
 * stream wait is GEQ, the driver's wrap-aware (int32_t)(word - value) >= 0;
 * check_occupant made sure the generation is the ready word's or the next,
 * so it cannot be passed by any other occupant.)
 */
static int wait_ready(vmmt_consumer *c, struct request *rq, CUstream s, int *queued)
{
    const struct vmmt_drv *d = vmmt__drv();
    CUdeviceptr word = rq->pool->table + vmmt__ctrl_ready(0, rq->d.slot_stride, rq->d.slot);
    const uint32_t *host = rq->pool->ctrl.host;
    CUresult r;

    *queued = 0;
    if (!(rq->d.flags & VMMT__DESC_STREAM_ORDERED)) return VMMT_OK;
    if (rq->pool->host_table) {
        uint32_t v = vmmt__ctrl_load(host + vmmt__ctrl_ready(0, rq->d.slot_stride, rq->d.slot) / 4);
        if (v == rq->d.generation) return VMMT_OK;
        /* Retired since check_occupant looked (cancelled): a stream wait (>=)
         * would pass and copy whatever the slice holds next. */
        if (vmmt__occupant_of(v, rq->d.generation) != VMMT__OCC_COPYING)
            return not_coming(rq, v) != VMMT_OK ? vmmt_last_status() : VMMT_ESTATE;
        /* Not yet: let the stream wait, which needs the table registered with
         * the driver; that costs once, so it happens only on first need. */
        if (!death_seen(rq->pool) || registered_table(rq->pool) != VMMT_OK)
            return host_wait(c, rq, 0);
        word = rq->pool->ctrl.dev + vmmt__ctrl_ready(0, rq->d.slot_stride, rq->d.slot);
    } else if (rq->landed) {
        return VMMT_OK;
    } else if (!death_seen(rq->pool)) {
        return host_wait(c, rq, word);
    }
    r = d->cuStreamWaitValue32(s, word, rq->d.generation, CU_STREAM_WAIT_VALUE_GEQ);
    if (r == CUDA_SUCCESS) {
        *queued = 1;
        return VMMT_OK;
    }
    return host_wait(c, rq, word);
}

/* The acker saw a copy complete; the last access to ip (it may be let go right after). */
static void deferred_ack_done(void *arg, int acked)
{
    struct imported *ip = arg;

    (void)acked;
    __atomic_sub_fetch(&ip->copies, 1, __ATOMIC_RELEASE);
}

/*
 * An acknowledgement the acker writes once the copy has completed. Not
 * written (acked 0): the occupant left while the copy ran, so the slice may
 * have been reused under it; vmmt_consumer_check says so (docs/design.md,
 * "Invariants", the case not covered).
 */
struct ack_note {
    struct imported *pool;
    uint32_t slot, gen, stride;
    struct vmmt__ranks ranks;
    int timeout_ms;
    int64_t failing_since_ms;          /* a device table's write failing since then; 0: it is not */
    uint64_t held_offset, held_nbytes; /* chunks the copy holds (request.held); 0 bytes: none */
};

/*
 * A shared table: compare-and-swaps, each only while the ready word shows
 * gen. Whether the copy read the occupant's bytes is judged once, by the
 * ready word as the acker finds it before the first store: the copy has
 * completed by then, and the producer writes RETIRED before the slice can
 * go to anyone else (generation.h). Judged word by word instead, a slot
 * that this note's own store of one rank completed (the others written by
 * vmmt_pool_release_rank) could be retired by the recycler before the
 * next word was read, and a good copy was reported EFAILED
 * (test_attack_outside3, release_of_later_taken_ranks). A word not written
 * after that is no question about the bytes: the slot moved on after the
 * copy, or (a thousand lost races) the slice waits for a release.
 */
static int write_shared(void *arg)
{
    const struct ack_note *n = arg;
    uint32_t *words = n->pool->ctrl.host + vmmt__ctrl_ack(0, n->stride, n->slot, 0) / 4;
    const uint32_t *ready = n->pool->ctrl.host + vmmt__ctrl_ready(0, n->stride, n->slot) / 4;

    if (vmmt__ctrl_load(ready) != n->gen) {
        vmmt__log(VMMT_LOG_DEBUG,
                  "acknowledgement of generation %u not written: the slot moved on during the copy",
                  n->gen);
        return 0;
    }
    FOR_RANKS(r, &n->ranks)
    {
        if (!vmmt__ctrl_store_ack(&words[r], ready, n->gen) && vmmt__ctrl_load(ready) == n->gen)
            vmmt__log(VMMT_LOG_WARN,
                      "acknowledgement of rank %u for slot %u generation %u lost a thousand "
                      "races for its word; its slice waits for vmmt_pool_release_rank",
                      r, n->slot, n->gen);
    }
    return 1;
}

/*
 * A device table: stream writes, after a read of the ready word
 * (device_table.c). From the acker's thread, after vmmt_consume returned:
 * a failure cannot be reported to its caller, so it is tried again on the
 * acker's later passes (the fault sweep injects one failed call; an
 * attacker's test_attack_flush three in a row, which three tries in a row
 * did not outlast, and the acknowledgement was lost for good). One that
 * persists past the consumer's timeout means the device is failing: the
 * slice waits for vmmt_pool_release_rank (logged), and vmmt_consumer_check
 * says VMMT_EFAILED, as whether the slot moved on during the copy was never
 * learned.
 */
static int write_device(void *arg)
{
    struct ack_note *n = arg;
    struct vmmt__saved_error e;
    int written = 0, st;

    vmmt__error_save(&e);
    st = vmmt__table_write_acks(n->pool, n->slot, n->stride, &n->ranks, n->gen, n->timeout_ms,
                                &written);
    if (st != VMMT_OK && n->failing_since_ms == 0) {
        n->failing_since_ms = vmmt__now_ms();
        vmmt__log(VMMT_LOG_WARN,
                  "acknowledgement of slot %u generation %u not written yet (%s): trying again",
                  n->slot, n->gen, vmmt_last_error());
    }
    if (st != VMMT_OK && vmmt__now_ms() - n->failing_since_ms <= n->timeout_ms) {
        vmmt__error_restore(&e);
        return VMMT__ACK_AGAIN;
    }
    if (st != VMMT_OK)
        vmmt__log(VMMT_LOG_ERROR,
                  "acknowledgement of slot %u generation %u could not be written for %d ms (%s): "
                  "its slice waits for vmmt_pool_release_rank",
                  n->slot, n->gen, n->timeout_ms, vmmt_last_error());
    else if (!written)
        vmmt__log(VMMT_LOG_DEBUG, "acknowledgement of generation %u not written: the slot moved on",
                  n->gen);
    vmmt__error_restore(&e);
    return st != VMMT_OK ? VMMT__ACK_LOST : written;
}

static void ack_done(void *arg, int acked)
{
    struct ack_note *n = arg;
    struct imported *ip = n->pool;

    if (acked == 0)
        vmmt__consumer_remember_failed(ip->owner, ip, n->slot, n->gen, VMMT__FAILED_OVERTAKEN);
    else if (acked == VMMT__ACK_LOST)
        vmmt__consumer_remember_failed(ip->owner, ip, n->slot, n->gen, VMMT__FAILED_UNCONFIRMED);
    else if (acked == VMMT__ACK_COPY_FAILED)
        vmmt__consumer_remember_failed(ip->owner, ip, n->slot, n->gen, VMMT__FAILED_COPY);
    if (n->held_nbytes != 0) unhold(ip, n->held_offset, n->held_nbytes);
    free(n);
    __atomic_sub_fetch(&ip->copies, 1, __ATOMIC_RELEASE);
}

/*
 * A forgotten group's words back (forget_groups_with), once its copies are
 * done: acker. Its copies read the occupant's bytes only if the slot still
 * shows it now, as write_shared judges: the words held the slice, unless a
 * release wrote the generation over them meanwhile, and then the slice may
 * have gone to the next publish, slot and all, under the copies (the model
 * test, a release while a refused half group's copies were held: check said
 * OK for another buffer's bytes). 0 then, so that vmmt_consumer_check says
 * VMMT_EFAILED.
 */
static int give_back_shared(void *arg)
{
    const struct ack_note *n = arg;
    const uint32_t *ready = n->pool->ctrl.host + vmmt__ctrl_ready(0, n->stride, n->slot) / 4;
    int held = vmmt__ctrl_load(ready) == n->gen;

    FOR_RANKS(r, &n->ranks)
    {
        give_back_at(n->pool, n->stride, n->slot, n->gen, r);
    }
    return held;
}

/*
 * The words of the group forget_groups_with let go, after the work now on
 * the call's stream (the group's): the acker gives them back once its event
 * completes, and keeps the pool mapped until then. Without memory for that,
 * after a synchronize of the stream. The call's status is kept: it failed
 * already, and says why. Consumer lock not held (a fallback waits).
 */
static void give_back_after(vmmt_consumer *c, struct request *rq)
{
    struct ack_note now = {rq->pool,
                           rq->d.slot,
                           rq->d.generation,
                           rq->d.slot_stride,
                           rq->back,
                           c->cfg.timeout_ms,
                           0,
                           0,
                           0},
                    *note;
    struct vmmt__saved_error e;

    if (rq->back.hi == 0) return;
    memset(&rq->back, 0, sizeof rq->back);
    vmmt__error_save(&e);
    note = malloc(sizeof *note);
    if (note != NULL) {
        *note = now;
        /* Every path of the acker gives them back and frees the note, failing or not. */
        (void)vmmt__acker_defer(c->acker, rq->pool->device, rq->stream, give_back_shared, ack_done,
                                note);
    } else {
        vmmt__log(VMMT_LOG_WARN, "no host memory to track a give-back: synchronizing the stream");
        if (vmmt__drv()->cuStreamSynchronize(rq->stream) != CUDA_SUCCESS)
            vmmt__consumer_remember_failed(c, rq->pool, rq->d.slot, rq->d.generation,
                                           VMMT__FAILED_COPY);
        (void)give_back_shared(&now);
        __atomic_sub_fetch(&rq->pool->copies, 1, __ATOMIC_RELEASE);
    }
    vmmt__error_restore(&e);
}

/* The same for a copy that holds chunks: a note (struct ack_note) with no ranks. */
static void held_copy_done(void *arg, int acked)
{
    struct ack_note *n = arg;
    struct imported *ip = n->pool;

    (void)acked;
    unhold(ip, n->held_offset, n->held_nbytes);
    free(n);
    __atomic_sub_fetch(&ip->copies, 1, __ATOMIC_RELEASE);
}

/*
 * Keep the pool mapped until the work now on `s` (a copy out of it) has
 * completed: the acker sees an event after it and lets go. Without this an
 * eviction could unmap the pool under the queued copy.
 */
static int track_copy(vmmt_consumer *c, struct request *rq, CUstream s)
{
    struct ack_note *n = NULL;

    if (rq->held) {
        n = calloc(1, sizeof *n);
        if (n == NULL) {
            /* Its chunks cannot stay held without a note: wait for the copy (done lets go). */
            vmmt__log(VMMT_LOG_WARN, "no host memory to track a copy: synchronizing the stream");
            return VMMT_CU(vmmt__drv(), cuStreamSynchronize(s));
        }
        n->pool = rq->pool;
        n->held_offset = rq->d.offset;
        n->held_nbytes = rq->d.nbytes;
        rq->held = 0;
    }
    /* The call still counts as a user, so the pool cannot go before this. */
    __atomic_add_fetch(&rq->pool->copies, 1, __ATOMIC_RELAXED);
    if (n != NULL) return vmmt__acker_defer(c->acker, rq->pool->device, s, NULL, held_copy_done, n);
    return vmmt__acker_defer(c->acker, rq->pool->device, s, NULL, deferred_ack_done, rq->pool);
}

/*
 * The acknowledgements. After a copy (or with members' copies before it on
 * the stream), written by the acker once an event after them completes (the
 * pool stays in use until then): a shared table's with compare-and-swaps, a
 * device table's with stream writes of the import's after a read of the
 * ready word (the stream writes keep the memory barrier: the H200's driver
 * refuses CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER with
 * CUDA_ERROR_INVALID_VALUE, tests/gpu/RESULTS.md, 2026-11-29). A dropped
 * descriptor whose ready word showed it landed has nothing to wait for: it
 * is written here. *written: the claim stands (defect 1 of issue 16 was
 * leaving it unset, so each device-table consume was undone and accepted
 * again); 0 only when nothing was queued, so the descriptor may be consumed
 * again.
 */
static int write_acks(vmmt_consumer *c, struct request *rq, CUstream s, int after_copy,
                      int *written)
{
    struct ack_note now = {rq->pool,
                           rq->d.slot,
                           rq->d.generation,
                           rq->d.slot_stride,
                           rq->ranks,
                           c->cfg.timeout_ms,
                           0,
                           0,
                           0},
                    *note;
    int st;

    *written = 0;
    if (!after_copy) {
        if (rq->pool->host_table) {
            (void)write_shared(&now); /* a CPU store cannot fail */
            *written = 1;
            return VMMT_OK;
        }
        return vmmt__table_write_acks(rq->pool, now.slot, now.stride, &now.ranks, now.gen,
                                      now.timeout_ms, written);
    }
    note = malloc(sizeof *note);
    if (note == NULL) return vmmt__fail(VMMT_ENOMEM, "no host memory to track an acknowledgement");
    *note = now;
    if (rq->held) { /* the note holds the copy's chunks from now on (ack_done lets go) */
        note->held_offset = rq->d.offset;
        note->held_nbytes = rq->d.nbytes;
        rq->held = 0;
    }
    __atomic_add_fetch(&rq->pool->copies, 1, __ATOMIC_RELAXED);
    /* Every path writes (or finds the slot moved on), before or after returning. */
    *written = 1;
    st = vmmt__acker_defer(c->acker, rq->pool->device, s,
                           rq->pool->host_table ? write_shared : write_device, ack_done, note);
    return st;
}

/* vmmt_consume and vmmt_consume_ranks: ranks `list` (n of them), or the run [first, +n). */
static int consume(vmmt_consumer *c, const vmmt_desc *desc, int device, uint64_t dst,
                   uint64_t dst_size, CUstream stream, const int *list, int first, int n,
                   const char *call)
{
    struct request rq;
    CUresult r;
    int st, ack_st, queued = 0, written = 0;

    if (c == NULL || desc == NULL)
        return vmmt__fail(VMMT_EINVAL, "%s: consumer and descriptor must not be NULL", call);
    st = vmmt__ctx_enter(device);
    if (st != VMMT_OK) return vmmt__wrap(st, "%s", call);
    st = prepare(c, desc, device, list, first, n, 1, dst, dst_size, stream, &rq);
    if (st != VMMT_OK) {
        vmmt__ctx_leave();
        return vmmt__wrap(st, "%s", call);
    }
    st = wait_ready(c, &rq, stream, &queued);
    if (st != VMMT_OK) {
        /* The occupant's bytes are not known to be there: acknowledge nothing,
         * and let the caller retry (the producer may be slow, not gone). */
        unclaim(c, &rq);
        done(c, &rq);
        vmmt__ctx_leave();
        return vmmt__wrap(st, "%s", call);
    }
    r = vmmt__drv()->cuMemcpyDtoDAsync(dst, rq.pool->map.base + rq.d.offset, rq.d.nbytes, stream);
    if (r != CUDA_SUCCESS)
        st = vmmt__cu_fail(r, "cuMemcpyDtoDAsync(%" PRIu64 " bytes out of the pool)", rq.d.nbytes);
    /* A packed member's copy without the group's acknowledgement yet: the
     * pool stays mapped until the copy is done. */
    if (st == VMMT_OK && !rq.ack_now) st = track_copy(c, &rq, stream);
    /* Acknowledge even after a failed copy, so the producer gets the slice
     * back. An acknowledgement that could not be written is taken back, so
     * the descriptor can be consumed again. */
    if (rq.ack_now) {
        struct vmmt__saved_error e;
        vmmt__error_save(&e);
        ack_st = write_acks(c, &rq, stream, 1, &written);
        if (!written) unclaim(c, &rq);
        if (st != VMMT_OK) vmmt__error_restore(&e);
        if (st == VMMT_OK) st = ack_st;
    }
    done(c, &rq);
    vmmt__ctx_leave();
    return st == VMMT_OK ? VMMT_OK : vmmt__wrap(st, "%s", call);
}

int vmmt_consume(vmmt_consumer *c, const vmmt_desc *desc, int device, uint64_t dst,
                 uint64_t dst_size, void *stream, int rank_first, int rank_count)
{
    return consume(c, desc, device, dst, dst_size, (CUstream)stream, NULL, rank_first, rank_count,
                   "vmmt_consume");
}

int vmmt_consume_ranks(vmmt_consumer *c, const vmmt_desc *desc, int device, uint64_t dst,
                       uint64_t dst_size, void *stream, const int *ranks, int nranks)
{
    /* A NULL list is the caller's error here, not a request for a run. */
    if (ranks == NULL)
        return vmmt__fail(VMMT_EINVAL, "vmmt_consume_ranks: the rank list must not be NULL");
    return consume(c, desc, device, dst, dst_size, (CUstream)stream, ranks, 0, nranks,
                   "vmmt_consume_ranks");
}

/* vmmt_consumer_ack and vmmt_consumer_ack_ranks, as consume above. */
static int ack(vmmt_consumer *c, const vmmt_desc *desc, int device, CUstream stream,
               const int *list, int first, int n, const char *call)
{
    struct request rq;
    int st;

    if (c == NULL || desc == NULL)
        return vmmt__fail(VMMT_EINVAL, "%s: consumer and descriptor must not be NULL", call);
    st = vmmt__ctx_enter(device);
    if (st != VMMT_OK) return vmmt__wrap(st, "%s", call);
    st = prepare(c, desc, device, list, first, n, 0, 0, 0, stream, &rq);
    if (st == VMMT_OK) {
        int queued = 0, written = 0;
        /* Even a dropped descriptor is acknowledged only once its bytes
         * landed: before, its acknowledgement could be taken for an occupant
         * the producer had not yet given out (one generation ahead). A shared
         * table is watched with loads (the producer's copy is usually done),
         * so the acknowledgement is written when this returns; a device
         * table's waits on the stream, ahead of the stream's writes. */
        if (rq.ack_now && rq.pool->host_table)
            st = host_wait(c, &rq, 0);
        else if (rq.ack_now)
            st = wait_ready(c, &rq, stream, &queued);
        /* Completing a packed group may follow copies of other members on this
         * stream. A device table's acknowledgement always goes to the acker,
         * even with nothing queued before it: the acker tries a failed stream
         * write again, where one written here would leave the ranks before
         * the failure acknowledged and the call not retryable
         * (test_ack_generations, test_failed_ack_write_retry). */
        if (rq.ack_now && st == VMMT_OK)
            st = write_acks(c, &rq, stream, rq.d.pack_count > 1 || queued || !rq.pool->host_table,
                            &written);
        if (rq.ack_now && !written) unclaim(c, &rq);
        done(c, &rq);
    }
    vmmt__ctx_leave();
    return st == VMMT_OK ? VMMT_OK : vmmt__wrap(st, "%s", call);
}

int vmmt_consumer_ack(vmmt_consumer *c, const vmmt_desc *desc, int device, void *stream,
                      int rank_first, int rank_count)
{
    return ack(c, desc, device, (CUstream)stream, NULL, rank_first, rank_count,
               "vmmt_consumer_ack");
}

int vmmt_consumer_ack_ranks(vmmt_consumer *c, const vmmt_desc *desc, int device, void *stream,
                            const int *ranks, int nranks)
{
    if (ranks == NULL)
        return vmmt__fail(VMMT_EINVAL, "vmmt_consumer_ack_ranks: the rank list must not be NULL");
    return ack(c, desc, device, (CUstream)stream, ranks, 0, nranks, "vmmt_consumer_ack_ranks");
}

int vmmt_consumer_flush(vmmt_consumer *c)
{
    if (c == NULL) return vmmt__fail(VMMT_EINVAL, "vmmt_consumer_flush: consumer is NULL");
    /* The acker's own pass, in this thread: each copy's event is asked in its
     * device's context, and a copy not finished stays pending. */
    vmmt__acker_flush(c->acker);
    return VMMT_OK;
}
