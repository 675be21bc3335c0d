/*
 * Generations and the states of a slot's ready word: the rule every reader
 * and writer of the control table follows (docs/descriptor.md, "The control
 * table"). Pure arithmetic, so the descriptor's validator can use it too.
 */
#ifndef VMMT_GENERATION_H
#define VMMT_GENERATION_H

#include <stdint.h>

/*
 * A slot's ready word says which occupant holds the slot and how far it has
 * got, so that every process reads occupancy from one place. The words of a
 * slot's occupant G (a descriptor's generation) are:
 *
 *     G - 1   PENDING    the producer gave the slot to G; its copy may still run
 *     G       LIVE       G's bytes landed; G may be consumed
 *     G + 1   RETIRED    G left: recycled, cancelled, or released for dead ranks
 *     G + 2   ABANDONED  G's producer died before G's bytes landed (a consumer wrote it)
 *
 * Generations are therefore 4k + 1 for k of 1 .. 2^30 - 1, drawn from one
 * counter per pool (stepping by 4, wrapping to the first one), so that a
 * generation names one occupant of the whole pool: a descriptor whose slot
 * field was changed finds another generation in that slot's word. A zeroed
 * table (word 0) names no occupant. The four words of G sort above any
 * earlier occupant's of the slot and below any later one's, so a stream
 * wait for "word >= G" (the driver's wrap-aware GEQ) passes once G is live
 * and never for a predecessor.
 *
 * The producer moves the word forwards only: PENDING (a CPU store for a
 * shared table, a stream write ahead of the copy for a device table), LIVE
 * (after the copy, on the same stream, or by the CPU after its memcpy), then
 * RETIRED, written before the slice can go to anyone else, so a descriptor
 * is refused from the moment its slice could hold another buffer's bytes.
 * A publish that fails after PENDING retires its generation instead of
 * giving it back.
 */
#define VMMT__GEN_FIRST 5u
#define VMMT__GEN_LAST  0xFFFFFFFDu

static inline uint32_t vmmt__next_generation(uint32_t g)
{
    return g == 0 || g == VMMT__GEN_LAST ? VMMT__GEN_FIRST : g + 4;
}

static inline int vmmt__generation_valid(uint32_t g)
{
    return (g & 3u) == 1u && g != 1u;
}

static inline uint32_t vmmt__gen_pending(uint32_t g)
{
    return g - 1;
}

static inline uint32_t vmmt__gen_retired(uint32_t g)
{
    return g + 1;
}

static inline uint32_t vmmt__gen_abandoned(uint32_t g)
{
    return g + 2;
}

/*
 * A shared table's acknowledgement word of occupant G holds, besides a
 * predecessor's value (or 0, "not acknowledged"):
 *
 *     G - 1   TAKEN      a process of the rank is consuming G (its copy may be queued)
 *     G       ACKED      the rank is done with G (acknowledged, released, or cancelled)
 *     G + 1   CANCELLED  G was cancelled while TAKEN: the taker's copy may still be
 *                        queued, so the slice stays until the taker (or a release of
 *                        the rank, or its death) turns the word into G
 *
 * Every take refuses a word at CANCELLED, the taker's own later packed
 * members included. A device table's words are only ever a predecessor's or G.
 */
static inline uint32_t vmmt__ack_cancelled(uint32_t g)
{
    return g + 1;
}

enum vmmt__occupant {
    VMMT__OCC_READY,     /* LIVE: the named occupant is there, its bytes landed */
    VMMT__OCC_COPYING,   /* PENDING: the named occupant's copy may still run */
    VMMT__OCC_ABANDONED, /* the producer died before the bytes landed */
    VMMT__OCC_GONE       /* anything else: retired, another occupant's, or not handed out */
};

static inline enum vmmt__occupant vmmt__occupant_of(uint32_t ready, uint32_t gen)
{
    if (!vmmt__generation_valid(gen)) return VMMT__OCC_GONE;
    if (ready == gen) return VMMT__OCC_READY;
    if (ready == vmmt__gen_pending(gen)) return VMMT__OCC_COPYING;
    if (ready == vmmt__gen_abandoned(gen)) return VMMT__OCC_ABANDONED;
    return VMMT__OCC_GONE;
}

#endif
