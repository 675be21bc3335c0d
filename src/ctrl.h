/*
 * The control table at the start of every pool: one row per slot, each a
 * ready word followed by one acknowledgement word per consumer rank. Words
 * hold the generation of the slot's current occupant, so a word left over
 * from an earlier occupant can never match a newer one. The producer reads
 * the whole table in one copy; producer and consumers write single words
 * with stream memory operations.
 */
#ifndef VMMT_CTRL_H
#define VMMT_CTRL_H

#include <stdint.h>

#define VMMT__MAX_CONSUMERS 256
#define VMMT__MAX_PACK      64
#define VMMT__DATA_ALIGN    256

/* Row size in bytes: ready + one word per consumer, padded to 16 bytes. */
static inline uint32_t vmmt__ctrl_stride(uint32_t consumers)
{
    return (4u * (1u + consumers) + 15u) & ~15u;
}

static inline uint64_t vmmt__ctrl_ready(uint64_t table, uint32_t stride, uint32_t slot)
{
    return table + (uint64_t)slot * stride;
}

static inline uint64_t vmmt__ctrl_ack(uint64_t table, uint32_t stride, uint32_t slot, uint32_t rank)
{
    return vmmt__ctrl_ready(table, stride, slot) + 4u * (1u + rank);
}

/* Generations start at 1 and skip 0 on wrap, so a zeroed table matches nothing. */
static inline uint32_t vmmt__next_generation(uint32_t g)
{
    return g + 1 == 0 ? 1 : g + 1;
}

#endif
