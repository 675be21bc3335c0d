/*
 * SipHash-2-4, written from its paper ("SipHash: a fast short-input PRF",
 * Aumasson and Bernstein, 2012). It is small, keyed and made for short
 * inputs, which is what a 512-byte record is; a library for it (libsodium's
 * crypto_shorthash) would be the shipped library's only dependency beyond
 * libc, for twenty lines.
 */
#include "seal.h"

#include <errno.h>
#include <sys/random.h>

#include "status.h"

static uint64_t rotl(uint64_t x, int b)
{
    return (x << b) | (x >> (64 - b));
}

static uint64_t load_le64(const uint8_t *p)
{
    uint64_t v = 0;

    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

struct sip {
    uint64_t v0, v1, v2, v3;
};

static void round_(struct sip *s)
{
    s->v0 += s->v1;
    s->v1 = rotl(s->v1, 13) ^ s->v0;
    s->v0 = rotl(s->v0, 32);
    s->v2 += s->v3;
    s->v3 = rotl(s->v3, 16) ^ s->v2;
    s->v0 += s->v3;
    s->v3 = rotl(s->v3, 21) ^ s->v0;
    s->v2 += s->v1;
    s->v1 = rotl(s->v1, 17) ^ s->v2;
    s->v2 = rotl(s->v2, 32);
}

static void compress(struct sip *s, uint64_t m)
{
    s->v3 ^= m;
    round_(s);
    round_(s);
    s->v0 ^= m;
}

static struct sip start(const uint8_t key[VMMT__SEAL_KEY_BYTES])
{
    uint64_t k0 = load_le64(key), k1 = load_le64(key + 8);
    struct sip s = {k0 ^ 0x736f6d6570736575ull, k1 ^ 0x646f72616e646f6dull,
                    k0 ^ 0x6c7967656e657261ull, k1 ^ 0x7465646279746573ull};
    return s;
}

static uint64_t finish(struct sip *s, uint64_t last)
{
    compress(s, last);
    s->v2 ^= 0xff;
    for (int r = 0; r < 4; r++)
        round_(s);
    return s->v0 ^ s->v1 ^ s->v2 ^ s->v3;
}

uint64_t vmmt__siphash24(const uint8_t key[VMMT__SEAL_KEY_BYTES], const uint8_t *in, size_t n)
{
    struct sip s = start(key);
    uint64_t last = (uint64_t)n << 56;
    size_t i = 0;

    for (; i + 8 <= n; i += 8)
        compress(&s, load_le64(in + i));
    for (size_t j = 0; i + j < n; j++)
        last |= (uint64_t)in[i + j] << (8 * j);
    return finish(&s, last);
}

/* The record's words in place, the seal's word read as zero: no copy of the record. */
uint64_t vmmt__seal_of(const uint8_t key[VMMT__SEAL_KEY_BYTES], const uint8_t *record,
                       size_t seal_offset, size_t record_bytes)
{
    struct sip s = start(key);

    /* Records and their seal field are whole, aligned words; anything else is a caller's bug. */
    if (record_bytes % 8 != 0 || seal_offset % 8 != 0) return 0;
    for (size_t i = 0; i < record_bytes; i += 8)
        compress(&s, i == seal_offset ? 0 : load_le64(record + i));
    return finish(&s, (uint64_t)record_bytes << 56);
}

int vmmt__seal_key_new(uint8_t key[VMMT__SEAL_KEY_BYTES])
{
    ssize_t got = getrandom(key, VMMT__SEAL_KEY_BYTES, 0);

    if (got != VMMT__SEAL_KEY_BYTES) {
        if (got >= 0) errno = EIO;
        return vmmt__sys_fail("getrandom for the pool's seal key");
    }
    return VMMT_OK;
}
