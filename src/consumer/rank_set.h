/*
 * The consumer ranks one consume or acknowledgement is for (consume.c): a
 * run of consecutive ranks, or any set of them (vmmt_consume_ranks). A set
 * is taken and acknowledged whole or not at all, so a call for ranks {0, 2}
 * that finds rank 2 done leaves rank 0 as it was; called run by run, the
 * first run stayed acknowledged (vmmt.sglang's acknowledge_ranks, an outside
 * attack of 2026-12-07).
 */
#ifndef VMMT_RANK_SET_H
#define VMMT_RANK_SET_H

#include <stddef.h>
#include <stdint.h>

#include "desc.h"

struct vmmt__ranks {
    uint64_t bits[VMMT__MAX_CONSUMERS / 64];
    uint32_t lo, hi; /* the lowest rank of the set and one past the highest; 0, 0: empty */
};

static inline int vmmt__ranks_has(const struct vmmt__ranks *s, uint32_t r)
{
    return r < VMMT__MAX_CONSUMERS && (s->bits[r / 64] >> (r % 64)) & 1;
}

/* The set's next rank after r (hi when none): for (r = s->lo; r < s->hi; r = ..._after(s, r)). */
static inline uint32_t vmmt__ranks_after(const struct vmmt__ranks *s, uint32_t r)
{
    while (++r < s->hi && !vmmt__ranks_has(s, r))
        continue;
    return r;
}

/* Any rank of the set in a mask of VMMT__MAX_CONSUMERS bits. */
static inline int vmmt__ranks_meet(const struct vmmt__ranks *s, const uint64_t *mask)
{
    for (int i = 0; i < VMMT__MAX_CONSUMERS / 64; i++)
        if (s->bits[i] & mask[i]) return 1;
    return 0;
}

static inline int vmmt__ranks_equal(const struct vmmt__ranks *a, const struct vmmt__ranks *b)
{
    for (int i = 0; i < VMMT__MAX_CONSUMERS / 64; i++)
        if (a->bits[i] != b->bits[i]) return 0;
    return 1;
}

/* Set or clear the set's ranks in a mask. */
static inline void vmmt__ranks_mark(const struct vmmt__ranks *s, uint64_t *mask, int on)
{
    for (int i = 0; i < VMMT__MAX_CONSUMERS / 64; i++)
        mask[i] = on ? mask[i] | s->bits[i] : mask[i] & ~s->bits[i];
}

/* Ranks [first, first + count) of a pool of `total`; VMMT_EINVAL outside it. */
int vmmt__ranks_run(struct vmmt__ranks *s, int first, int count, uint32_t total);

/* The `n` ranks listed, distinct, each below `total`; VMMT_EINVAL otherwise. */
int vmmt__ranks_list(struct vmmt__ranks *s, const int *ranks, int n, uint32_t total);

/* The next run of the set at or after rank *r: its first rank and length; 0 when none is left. */
int vmmt__ranks_next_run(const struct vmmt__ranks *s, uint32_t *r, uint32_t *count);

/* The set as runs for a message ("[0, 2) and [3, 4)"), cut short to fit `size`. */
const char *vmmt__ranks_name(const struct vmmt__ranks *s, char *buf, size_t size);

#endif
