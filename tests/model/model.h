/*
 * The reference model of the hand-off (tests/model/model.c): what the
 * contract lets the library answer, and what its answers change. It knows
 * nothing of the library's insides: pools (instances), slots and their
 * generations, publishes (records: single or packed, with the ranks that
 * acknowledged them), reservations, consumer processes (seats) with the
 * ranks they announced and their per-process progress through packed
 * groups, and the ends of a pool (shutdown, producer death). The driver
 * (driver.c) asks it for a verdict before every call and tells it the answer.
 * docs/reliability.md ("The model") states the contract it holds.
 */
#ifndef VMMT_MODEL_MODEL_H
#define VMMT_MODEL_MODEL_H

#include <stdint.h>

#include "proto.h"

#define M_RECS   2048 /* publishes remembered (ring), for replays */
#define M_INSTS  64   /* pools remembered (ring) */
#define M_SLOTS  64
#define M_PROG   8 /* processes that consumed members of one packed group */
#define M_COPIES 16

/* Answers as a set: bit -status (VMMT_OK is bit 0). */
#define M_A(st) (1u << (unsigned)(-(st)))
/* Once the pool ended (shut down, producer dead): what a consumer may hear. */
#define M_END_REFUSALS                                                                             \
    (M_A(VMMT_ESTATE) | M_A(VMMT_ECLOSED) | M_A(VMMT_EFAILED) | M_A(VMMT_ESYS) |                   \
     M_A(VMMT_EPROTO) | M_A(VMMT_ETIMEDOUT) | M_A(VMMT_ECUDA) | M_A(VMMT_EPERM) |                  \
     M_A(VMMT_ENOTSUP))

enum m_state { M_LIVE = 1, M_DONE, M_CANCELLED };
enum m_end { M_OPEN = 0, M_SHUT, M_DEAD };

struct m_prog {
    uint32_t ctx;     /* the consumer process (and import) that consumed some members */
    unsigned ranks;   /* for these ranks */
    unsigned members; /* these members */
    int done;         /* all of them: the group is acknowledged for `ranks` */
};

struct m_rec {
    int used;
    int inst; /* index into model.inst */
    uint32_t slot, gen;
    int members;
    uint64_t uid[MT_MAX_MEMBERS], nbytes[MT_MAX_MEMBERS];
    vmmt_desc desc[MT_MAX_MEMBERS];
    int state;
    int landed;     /* its bytes are in the slice (a gated publish: not until the gate opens) */
    int handed;     /* some consumer was given it (or a forgery naming it): no cancel */
    int gated;      /* published behind a gate (for reports) */
    unsigned acked; /* ranks that acknowledged it (or were released) */
    /* The consumer process (seat ctx) whose consume or acknowledgement acknowledged each rank;
     * 0 when the producer's side did (a release) or no one yet. */
    uint32_t acked_ctx[MT_MAX_RANKS];
    unsigned dropped; /* ranks the engine will not consume it for (acknowledged at quiescence) */
    /* Ranks a second process consumed or acknowledged before the first one's acknowledgement
     * showed (a device table, judge's "unseen"): the first acknowledgement written may
     * complete the slot while the other process's copy is still queued, so every copy of
     * these ranks may find the slot moved on and check VMMT_EFAILED (seed 9311). */
    unsigned raced;
    /* Copies of it are queued behind a consumer's own gate (the driver's op_cancel_taken):
     * their acknowledgements, written once they complete, are not in the table yet, so
     * the slice is held even where every rank has consumed it. */
    int pinned;
    struct m_prog prog[M_PROG];
    int nprog;
};

struct m_res {
    int state; /* 0 none, 1 open, 2 committed, 3 cancelled */
    uint32_t slot, gen;
    vmmt_desc token;
};

struct m_inst {
    int used, number;
    uint8_t pool_id[16];
    int ranks;
    uint32_t slots;
    int capacity; /* slices that fit: min(slots, data bytes / unit) */
    int ended;
    uint32_t slot_gen[M_SLOTS]; /* the last generation handed out per slot */
    uint32_t last_gen;          /* the last generation handed out in the pool */
    int slot_rec[M_SLOTS];      /* the LIVE occupant (record index), -1 none, -2 a reservation */
    int occupied;               /* LIVE records and open reservations */
    struct m_res res[MT_MAX_RES];
    uint64_t releases_min, releases_max; /* what vmmt_pool_stats.rank_releases may show */
    uint64_t released_at[MT_MAX_RANKS];  /* model clock of the last vmmt_pool_release_rank */
    int shared_table; /* a consume takes its ranks' words there (TAKEN, docs/descriptor.md) */
};

struct m_copy {
    int rec, member;
    int expect;     /* the status vmmt_consumer_check must give */
    unsigned ranks; /* the ranks it was copied for */
    uint64_t at;    /* model clock then: a release of one of them after it lets check fail */
    uint32_t ctx;   /* the seat's process and import then (an evict makes another) */
    int unseen;     /* OK only because another process's acknowledgement did not show yet
                     * (a device table): its own acknowledgement may find the slot moved on */
};

struct m_seat {
    int alive;
    uint32_t ctx;
    unsigned role; /* ranks this process serves */
    unsigned held; /* ranks it announced on the current pool (the library's liveness link) */
    uint64_t held_since[MT_MAX_RANKS]; /* model clock when it first announced each */
    int uncertain; /* an answer that may have announced ranks without taking them */
    int touched;   /* its current import saw a descriptor of the current pool */
    int waits_ok;  /* its driver lets a stream wait on the pool's ready words */
    int deferred;  /* consumes queued behind a gate, not yet verified */
    struct m_copy copies[M_COPIES];
    int ncopies;
};

struct model {
    struct m_rec rec[M_RECS];
    int nrec; /* records made so far; rec[i % M_RECS] */
    struct m_inst inst[M_INSTS];
    int ninst, cur; /* cur: index of the current pool, -1 none */
    struct m_seat seat[MT_MAX_SEATS];
    int nseats;
    uint32_t next_ctx;
    uint64_t clock; /* orders announcements of ranks and their releases */
    int strict_end; /* an OK after the pool ended is a finding too */
};

/* A verdict: the answers the contract allows, and why (for a finding's message). */
struct m_verdict {
    unsigned allow;
    const char *why;
    int named;  /* forgeries: the record they name (-1 none) */
    int unseen; /* an OK allowed only because another process's acknowledgement may not show yet */
};

void m_init(struct model *m, int strict_end);
struct m_inst *m_cur(struct model *m);
struct m_rec *m_rec(struct model *m, int i);
unsigned m_all(const struct m_inst *in);
uint32_t m_next_gen(uint32_t g);

/* A new pool; its figures from the producer's statistics. */
void m_inst_begin(struct model *m, const uint8_t pool_id[16], int ranks, uint32_t slots,
                  int capacity, int nseats);
void m_inst_end(struct model *m, int how);

/* Publishes and reservations. m_publish_check says what is wrong with a handed-out (slot, gen). */
int m_room(const struct model *m);
const char *m_slot_check(struct model *m, uint32_t slot, uint32_t gen);
int m_publish(struct model *m, int members, const uint64_t *uid, const uint64_t *nbytes,
              const vmmt_desc *desc, int landed);
void m_landed(struct model *m, int rec);
/*
 * Cancelled. held: a consumer process's copies taken before the cancel may
 * still be queued (a shared table: their words became CANCELLED,
 * docs/descriptor.md), so the slice stays occupied until m_let_go.
 */
void m_cancel(struct model *m, int rec, int held);
void m_let_go(struct model *m, int rec);
/* Copies of rec queued behind a consumer's gate (pinned 1), or done (0). */
void m_pin(struct model *m, int rec, int pinned);
void m_res_open(struct model *m, int id, const vmmt_desc *token);
int m_res_commit(struct model *m, int id, uint64_t uid, uint64_t nbytes, const vmmt_desc *desc);
void m_res_cancel(struct model *m, int id);

/* Consumes and acknowledgements of a real record's member, by seat s for ranks R. */
struct m_verdict m_judge(const struct model *m, int rec, int member, unsigned R, int s);
void m_took(struct model *m, int rec, int member, unsigned R, int s);
/* The seat's ctx has half a group of rec with other ranks than R: a call the driver avoids. */
int m_conflicts(const struct model *m, int rec, unsigned R, int s);
/* The ranks the seat's ctx consumes rec's members for (0: none yet), and whether it is done. */
unsigned m_prog_ranks(const struct model *m, int rec, int s, int *done);
/* The same for a process and import `ctx` (one the seat had before an evict, say). */
unsigned m_prog_ranks_ctx(const struct model *m, int rec, uint32_t ctx, int *done);

/* Forgeries: what F names and how it differs, judged by the contract. */
struct m_forged {
    int valid;    /* vmmt_desc_inspect accepts it */
    int geometry; /* consumer_count, table_slots or slot_stride changed */
    int token;    /* a reservation's token */
    uint8_t pool_id[16];
    uint32_t slot, gen;
    int pack_index, pack_count;
};
struct m_verdict m_judge_forged(const struct model *m, const struct m_forged *f, unsigned R, int s);
void m_took_forged(struct model *m, const struct m_forged *f, int named, unsigned R, int s);
int m_forged_ahead(const struct model *m, const struct m_forged *f);

/*
 * Ranks released: explicitly (now), or a dead seat's. The pool releases, of
 * the ranks a dead process announced, those no other live process holds and
 * that vmmt_pool_release_rank did not release after the process announced
 * them (docs/broker.md, Liveness): m_dead_ranks.
 */
void m_release(struct model *m, int rank);
unsigned m_dead_ranks(const struct model *m, int s);
void m_seat_died(struct model *m, int s, unsigned released);
void m_seat_started(struct model *m, int s, unsigned role, int waits_ok);
/* The library took ranks R for seat s (an OK the model did not allow, under --keep-going). */
void m_hold(struct model *m, int s, unsigned R);
/* Evict: 1 must succeed, 0 must be refused, -1 either. */
int m_evict_expect(const struct model *m, int s);
void m_evicted(struct model *m, int s);

int m_live_count(const struct model *m);

#endif
