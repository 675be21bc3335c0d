/*
 * A small seeded generator for randomized tests (xorshift64*): fast, and the
 * seed a test prints reproduces its run. Not for anything that needs to be
 * unpredictable.
 */
#ifndef VMMT_TEST_RNG_H
#define VMMT_TEST_RNG_H

#include <stdint.h>

static inline uint64_t tu_rng_next(uint64_t *state)
{
    uint64_t x = *state ? *state : 1;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    return x * 2685821657736338717ull;
}

#endif
