/*
 * The reference model of the hand-off (model.h): the contract of issue 16,
 * written as state and rules, without any of the library's code.
 *
 *   A real descriptor D is LIVE from its publish until every rank
 *   acknowledged it (or was released), it is cancelled, or its pool ends
 *   (shutdown, producer death). A consume or acknowledgement of D for ranks
 *   R may be OK only while D is LIVE and no rank of R acknowledged it, in
 *   any process; while that holds and the pool is open it MUST be OK
 *   (VMMT_ETIMEDOUT aside). A packed group is acknowledged for R when the
 *   last of its members was consumed for R in one process. On a device
 *   table (no TAKEN words, one process per rank its rule) a consumer's
 *   acknowledgement shows to other processes a moment after its stream
 *   passes it, so there another process of R may also be OK until the
 *   slot is handed out again (judge, "unseen"). A forgery may be
 *   OK only when it names a LIVE, unacknowledged (pool, slot, generation),
 *   never with a changed table geometry, never ahead of the slot.
 *
 * Capacity is exact because the driver uses one slice size per pool:
 * occupied = LIVE records + open reservations, and a pool has room exactly
 * while occupied < capacity.
 */
#include "model.h"

#include <string.h>

void m_init(struct model *m, int strict_end)
{
    memset(m, 0, sizeof *m);
    m->cur = -1;
    m->next_ctx = 1;
    m->strict_end = strict_end;
}

struct m_inst *m_cur(struct model *m)
{
    return m->cur >= 0 ? &m->inst[m->cur] : NULL;
}

struct m_rec *m_rec(struct model *m, int i)
{
    return &m->rec[i % M_RECS];
}

static const struct m_rec *crec(const struct model *m, int i)
{
    return &m->rec[i % M_RECS];
}

unsigned m_all(const struct m_inst *in)
{
    return (1u << in->ranks) - 1;
}

/* The next generation a publish could hand out (src/wire/generation.h): 4k + 1, stepping by 4. */
uint32_t m_next_gen(uint32_t g)
{
    return g == 0 || g == 0xfffffffdu ? 5 : g + 4;
}

void m_inst_begin(struct model *m, const uint8_t pool_id[16], int ranks, uint32_t slots,
                  int capacity, int nseats)
{
    struct m_inst *in;

    m->cur = m->ninst++ % M_INSTS;
    in = &m->inst[m->cur];
    /* Records of the pool that had this place are forgotten with it. */
    for (int i = 0; i < M_RECS; i++)
        if (m->rec[i].used && m->rec[i].inst == m->cur) m->rec[i].used = 0;
    memset(in, 0, sizeof *in);
    in->used = 1;
    in->number = m->ninst - 1;
    memcpy(in->pool_id, pool_id, 16);
    in->ranks = ranks;
    in->slots = slots;
    in->capacity = capacity;
    for (int i = 0; i < M_SLOTS; i++)
        in->slot_rec[i] = -1;
    m->nseats = nseats;
    for (int s = 0; s < nseats; s++)
        memset(&m->seat[s], 0, sizeof m->seat[s]);
}

void m_inst_end(struct model *m, int how)
{
    struct m_inst *in = m_cur(m);
    if (in != NULL && in->ended == M_OPEN) in->ended = how;
}

int m_room(const struct model *m)
{
    const struct m_inst *in = &m->inst[m->cur];
    return in->occupied < in->capacity;
}

/* A slot the library hands out must be free in the model, at the next generation. */
const char *m_slot_check(struct model *m, uint32_t slot, uint32_t gen)
{
    struct m_inst *in = m_cur(m);

    if (slot >= in->slots || slot >= M_SLOTS) return "slot out of the table";
    if (in->slot_rec[slot] != -1)
        return "a slot the model still holds (LIVE occupant or open reservation) was handed out "
               "again: an occupant was recycled before all its ranks acknowledged it";
    /* One counter per pool: later than every generation handed out in the pool (a failed
     * publish retires the one it took, so the step may be more than one). The runs are
     * far too short for the counter to wrap. */
    if ((gen & 3u) != 1u || gen <= in->last_gen)
        return "the generation is not a later one of the pool's counter (4k + 1, above every "
               "generation handed out before: skipped backwards or reused)";
    return NULL;
}

static int new_rec(struct model *m)
{
    int i = m->nrec++;
    struct m_rec *r = m_rec(m, i);
    memset(r, 0, sizeof *r);
    r->used = 1;
    r->inst = m->cur;
    return i;
}

static void occupy(struct m_inst *in, uint32_t slot, uint32_t gen, int what)
{
    in->slot_gen[slot] = gen;
    if (gen > in->last_gen) in->last_gen = gen;
    in->slot_rec[slot] = what;
    in->occupied++;
}

static void vacate(struct m_inst *in, uint32_t slot)
{
    in->slot_rec[slot] = -1;
    in->occupied--;
}

int m_publish(struct model *m, int members, const uint64_t *uid, const uint64_t *nbytes,
              const vmmt_desc *desc, int landed)
{
    struct m_inst *in = m_cur(m);
    int i = new_rec(m);
    struct m_rec *r = m_rec(m, i);

    r->slot = (uint32_t)mt_get(&desc[0], MT_OFF_SLOT, 4);
    r->gen = (uint32_t)mt_get(&desc[0], MT_OFF_GENERATION, 4);
    r->members = members;
    for (int k = 0; k < members; k++) {
        r->uid[k] = uid[k];
        r->nbytes[k] = nbytes[k];
        r->desc[k] = desc[k];
    }
    r->state = M_LIVE;
    r->landed = landed;
    r->gated = !landed;
    occupy(in, r->slot, r->gen, i);
    return i;
}

static void maybe_done(struct model *m, struct m_rec *r)
{
    struct m_inst *in = &m->inst[r->inst];
    if (r->state != M_LIVE || !r->landed || r->pinned || (r->acked & m_all(in)) != m_all(in))
        return;
    r->state = M_DONE;
    if (in->slot_rec[r->slot] >= 0 && m_rec(m, in->slot_rec[r->slot]) == r) vacate(in, r->slot);
}

void m_landed(struct model *m, int rec)
{
    struct m_rec *r = m_rec(m, rec);
    r->landed = 1;
    maybe_done(m, r);
}

void m_cancel(struct model *m, int rec, int held)
{
    struct m_rec *r = m_rec(m, rec);
    struct m_inst *in = &m->inst[r->inst];
    if (r->state != M_LIVE) return;
    r->state = M_CANCELLED;
    if (!held) vacate(in, r->slot);
}

void m_pin(struct model *m, int rec, int pinned)
{
    struct m_rec *r = m_rec(m, rec);
    r->pinned = pinned;
    maybe_done(m, r);
}

void m_let_go(struct model *m, int rec)
{
    struct m_rec *r = m_rec(m, rec);
    struct m_inst *in = &m->inst[r->inst];
    if (r->state == M_CANCELLED && in->slot_rec[r->slot] >= 0 &&
        m_rec(m, in->slot_rec[r->slot]) == r)
        vacate(in, r->slot);
}

void m_res_open(struct model *m, int id, const vmmt_desc *token)
{
    struct m_inst *in = m_cur(m);
    struct m_res *res = &in->res[id];

    res->state = 1;
    res->slot = (uint32_t)mt_get(token, MT_OFF_SLOT, 4);
    res->gen = (uint32_t)mt_get(token, MT_OFF_GENERATION, 4);
    res->token = *token;
    occupy(in, res->slot, res->gen, -2);
}

int m_res_commit(struct model *m, int id, uint64_t uid, uint64_t nbytes, const vmmt_desc *desc)
{
    struct m_inst *in = m_cur(m);
    struct m_res *res = &in->res[id];
    int i;

    res->state = 2;
    vacate(in, res->slot);
    i = m_publish(m, 1, &uid, &nbytes, desc, 1);
    return i;
}

void m_res_cancel(struct model *m, int id)
{
    struct m_inst *in = m_cur(m);
    struct m_res *res = &in->res[id];
    if (res->state != 1) return;
    res->state = 3;
    vacate(in, res->slot);
}

static const struct m_prog *prog_of(const struct m_rec *r, uint32_t ctx)
{
    for (int i = 0; i < r->nprog; i++)
        if (r->prog[i].ctx == ctx) return &r->prog[i];
    return NULL;
}

/* The seat's link announces ranks R (HOLD) if it had not yet. */
void m_hold(struct model *m, int s, unsigned R)
{
    struct m_seat *st = &m->seat[s];
    for (int r = 0; r < MT_MAX_RANKS; r++)
        if ((R & (1u << r)) && !(st->held & (1u << r))) st->held_since[r] = ++m->clock;
    st->held |= R;
}

int m_conflicts(const struct model *m, int rec, unsigned R, int s)
{
    const struct m_prog *p = prog_of(crec(m, rec), m->seat[s].ctx);
    return p != NULL && p->ranks != R;
}

unsigned m_prog_ranks_ctx(const struct model *m, int rec, uint32_t ctx, int *done)
{
    const struct m_prog *p = prog_of(crec(m, rec), ctx);
    if (done != NULL) *done = p != NULL && p->done;
    return p != NULL ? p->ranks : 0;
}

unsigned m_prog_ranks(const struct model *m, int rec, int s, int *done)
{
    return m_prog_ranks_ctx(m, rec, m->seat[s].ctx, done);
}

/*
 * The rule for one member of a record, real or named by a forgery. `forged`
 * only widens the refusals allowed (a forgery may be refused for its bytes).
 */
static struct m_verdict judge(const struct model *m, const struct m_rec *r, int member, unsigned R,
                              int s, int forged)
{
    const struct m_inst *in = &m->inst[r->inst];
    const struct m_prog *p = prog_of(r, m->seat[s].ctx);
    struct m_verdict v = {0, "", -1, 0};
    unsigned refusals = M_A(VMMT_ESTATE);
    int unacked = r->state == M_LIVE && (r->acked & R) == 0;
    int twice = p != NULL && (p->members & (1u << member));
    int taken = 0;

    /* A shared table: another process holding a packed group of it half consumed for one
     * of these ranks has taken their words; this process is refused until that group is
     * acknowledged or released. */
    for (int i = 0; in->shared_table && i < r->nprog; i++) {
        const struct m_prog *q = &r->prog[i];
        if (q->ctx != m->seat[s].ctx && !q->done && q->members != 0 && (q->ranks & R)) taken = 1;
    }

    if (forged)
        refusals |= M_A(VMMT_EPROTO) | M_A(VMMT_EINVAL) | M_A(VMMT_ESYS) | M_A(VMMT_EPERM) |
                    M_A(VMMT_ETIMEDOUT) | M_A(VMMT_ECUDA) | M_A(VMMT_ECLOSED) | M_A(VMMT_EFAILED);
    if (in->ended != M_OPEN) {
        v.allow = refusals | M_END_REFUSALS;
        if (unacked && !twice && !m->strict_end) v.allow |= M_A(VMMT_OK);
        v.why = unacked ? "the pool ended: a refusal, or (not --strict-end) the bytes as they were"
                        : "the pool ended and the ranks acknowledged it: refused";
        return v;
    }
    /* A device table's acknowledgement is written by the acknowledging process's thread
     * once its copy's event completed and a read showed the slot still LIVE
     * (src/consumer/device_table.c), not by the copy's stream: a moment after that stream
     * was synchronized, another process of the same rank may not see it yet. Until the slot
     * is handed out again (the producer then saw it) that process may be OK too; its bytes
     * are checked as any consume's. */
    if (!in->shared_table && !twice && !taken && (r->acked & R) != 0 &&
        (r->state == M_LIVE || (r->state == M_DONE && in->slot_gen[r->slot] == r->gen))) {
        int others = 1;
        for (int k = 0; k < MT_MAX_RANKS; k++)
            if ((R & r->acked & (1u << k)) &&
                (r->acked_ctx[k] == 0 || r->acked_ctx[k] == m->seat[s].ctx))
                others = 0;
        v.unseen = others;
    }
    if (r->state == M_CANCELLED) {
        v.allow = refusals;
        v.why = "cancelled: refused (VMMT_ESTATE)";
    } else if (!unacked) {
        v.allow = refusals;
        v.why = r->state == M_DONE
                    ? "every rank acknowledged it (recycled): refused (VMMT_ESTATE)"
                    : "already acknowledged by a rank of these: refused (VMMT_ESTATE)";
        if (v.unseen) {
            v.allow |= M_A(VMMT_OK) | M_A(VMMT_ETIMEDOUT);
            v.why = "a device table, acknowledged by these ranks in another process a moment "
                    "ago: refused (VMMT_ESTATE), or OK while the row does not show it yet";
        }
    } else if (twice) {
        v.allow = refusals;
        v.why = "this member was consumed already in this process: refused (VMMT_ESTATE)";
    } else if (taken) {
        v.allow = refusals;
        v.why = "another process of these ranks is consuming its group (their words are "
                "taken): refused (VMMT_ESTATE)";
    } else {
        v.allow = M_A(VMMT_OK) | M_A(VMMT_ETIMEDOUT) | (forged ? refusals : 0);
        v.why = forged ? "names a LIVE unacknowledged occupant: OK or a refusal"
                       : "LIVE and not acknowledged by these ranks, producer alive: must be OK";
    }
    return v;
}

struct m_verdict m_judge(const struct model *m, int rec, int member, unsigned R, int s)
{
    return judge(m, crec(m, rec), member, R, s, 0);
}

/* Ranks R acknowledge r, through process ctx (0: the producer's side); the first one counts. */
static void acked_by(struct m_rec *r, unsigned R, uint32_t ctx)
{
    for (int k = 0; k < MT_MAX_RANKS; k++)
        if ((R & (1u << k)) && !(r->acked & (1u << k))) r->acked_ctx[k] = ctx;
    r->acked |= R;
}

void m_took(struct model *m, int rec, int member, unsigned R, int s)
{
    struct m_rec *r = m_rec(m, rec);
    struct m_seat *st = &m->seat[s];
    struct m_prog *p = (struct m_prog *)prog_of(r, st->ctx);

    if (r->inst == m->cur && m->inst[m->cur].ended == M_OPEN) m_hold(m, s, R);
    st->touched = 1;
    r->handed = 1;
    if (r->members == 1) {
        acked_by(r, R, st->ctx);
    } else {
        if (p == NULL && r->nprog < M_PROG) {
            p = &r->prog[r->nprog++];
            p->ctx = st->ctx;
            p->ranks = R;
            p->members = 0;
        }
        if (p == NULL) { /* more half-consumers than tracked: count it done */
            acked_by(r, R, 0);
        } else {
            p->members |= 1u << member;
            /* Kept when done: this process has consumed the group's members, and
             * consuming them again for other ranks is a case the driver avoids. */
            if (p->members == (1u << r->members) - 1) {
                acked_by(r, p->ranks, st->ctx);
                p->done = 1;
            }
        }
    }
    maybe_done(m, r);
}

/* The record a forgery names: the LIVE occupant of its (pool, slot) at its generation. */
static int named_by(const struct model *m, const struct m_forged *f, const struct m_inst **inp)
{
    for (int i = 0; i < M_INSTS; i++) {
        const struct m_inst *in = &m->inst[i];
        if (!in->used || memcmp(in->pool_id, f->pool_id, 16) != 0) continue;
        *inp = in;
        if (f->slot >= in->slots || f->slot >= M_SLOTS || in->slot_rec[f->slot] < 0) return -1;
        if (crec(m, in->slot_rec[f->slot])->gen != f->gen) return -1;
        return in->slot_rec[f->slot];
    }
    *inp = NULL;
    return -1;
}

int m_forged_ahead(const struct model *m, const struct m_forged *f)
{
    const struct m_inst *in;
    named_by(m, f, &in);
    if (in == NULL || f->slot >= in->slots || f->slot >= M_SLOTS) return 0;
    return (int32_t)(f->gen - in->slot_gen[f->slot]) > 0;
}

struct m_verdict m_judge_forged(const struct model *m, const struct m_forged *f, unsigned R, int s)
{
    const struct m_inst *in;
    struct m_verdict v = {0, "", -1, 0};
    unsigned refusals = M_A(VMMT_ESTATE) | M_A(VMMT_EPROTO) | M_A(VMMT_EINVAL) | M_A(VMMT_ESYS) |
                        M_A(VMMT_EPERM) | M_A(VMMT_ETIMEDOUT) | M_A(VMMT_ECUDA) |
                        M_A(VMMT_ECLOSED) | M_A(VMMT_EFAILED) | M_A(VMMT_ENOTSUP);
    int named = named_by(m, f, &in);

    if (f->token) {
        v.allow = M_A(VMMT_EINVAL);
        v.why = "a reservation's token is no descriptor: VMMT_EINVAL";
        return v;
    }
    if (!f->valid) {
        v.allow = M_A(VMMT_EPROTO) | M_A(VMMT_EINVAL);
        v.why = "fails the descriptor's validation: VMMT_EPROTO (or VMMT_EINVAL)";
        return v;
    }
    /* Every record is sealed by its producer (src/wire/seal.h): one with any byte changed is no
     * producer's, whatever it names, and an OK for it is a finding. */
    (void)named;
    (void)in;
    (void)R;
    (void)s;
    v.allow = refusals;
    v.why = f->geometry ? "a forged table geometry must never be accepted"
            : m_forged_ahead(m, f)
                ? "a generation ahead of its slot (never handed out) must never be OK"
                : "a record its producer did not write (its seal fails): refused";
    return v;
}

void m_took_forged(struct model *m, const struct m_forged *f, int named, unsigned R, int s)
{
    struct m_rec *r = m_rec(m, named);
    if (f->pack_count == r->members && f->pack_index < r->members) {
        m_took(m, named, f->pack_index, R, s);
        return;
    }
    /* Another group shape: the contract counts it as the ranks' acknowledgement. */
    if (r->inst == m->cur && m->inst[m->cur].ended == M_OPEN) m_hold(m, s, R);
    acked_by(r, R, m->seat[s].ctx);
    maybe_done(m, r);
}

void m_release(struct model *m, int rank)
{
    struct m_inst *in = m_cur(m);
    in->released_at[rank] = ++m->clock;
    for (uint32_t s = 0; s < in->slots && s < M_SLOTS; s++) {
        if (in->slot_rec[s] < 0) continue;
        struct m_rec *r = m_rec(m, in->slot_rec[s]);
        r->acked |= 1u << rank;
        r->acked_ctx[rank] = 0; /* the producer wrote it: every process sees it */
        maybe_done(m, r);
    }
}

unsigned m_dead_ranks(const struct model *m, int s)
{
    const struct m_inst *in = &m->inst[m->cur];
    unsigned others = 0, out = 0;

    for (int k = 0; k < m->nseats; k++)
        if (k != s && m->seat[k].alive) others |= m->seat[k].held;
    for (int r = 0; r < in->ranks; r++)
        if ((m->seat[s].held & ~others & (1u << r)) &&
            in->released_at[r] < m->seat[s].held_since[r])
            out |= 1u << r;
    return out;
}

void m_seat_died(struct model *m, int s, unsigned released)
{
    m->seat[s].alive = 0;
    for (int r = 0; r < m_cur(m)->ranks; r++)
        if (released & (1u << r)) m_release(m, r);
}

void m_seat_started(struct model *m, int s, unsigned role, int waits_ok)
{
    struct m_seat *st = &m->seat[s];
    memset(st, 0, sizeof *st);
    st->alive = 1;
    st->ctx = m->next_ctx++;
    st->role = role;
    st->waits_ok = waits_ok;
}

int m_evict_expect(const struct model *m, int s)
{
    const struct m_seat *st = &m->seat[s];
    int stale = 0;

    if (st->deferred) return 0;
    for (int i = 0; i < M_RECS; i++) {
        const struct m_rec *r = &m->rec[i];
        const struct m_prog *p = r->used ? prog_of(r, st->ctx) : NULL;
        if (!r->used || r->inst != m->cur || p == NULL || p->done) continue;
        /* A group one of whose ranks another party acknowledged (a release, a cancel) is
         * forgotten by the library once a member of it is tried again: either answer. */
        if (r->state == M_LIVE && m->inst[m->cur].ended == M_OPEN && (r->acked & p->ranks) == 0)
            return 0;
        stale = 1;
    }
    return stale ? -1 : 1;
}

void m_evicted(struct model *m, int s)
{
    struct m_seat *st = &m->seat[s];
    st->ctx = m->next_ctx++;
    st->held = 0;
    st->touched = 0;
}

int m_live_count(const struct model *m)
{
    const struct m_inst *in = &m->inst[m->cur];
    int n = 0;
    for (uint32_t s = 0; s < in->slots && s < M_SLOTS; s++)
        if (in->slot_rec[s] >= 0) n++;
    return n;
}
