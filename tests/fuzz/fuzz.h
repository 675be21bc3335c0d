/*
 * What the fuzz targets share: the libFuzzer entry point they define, and an
 * assertion that stops the run with the broken invariant named, so libFuzzer
 * (or the regression driver under CTest) keeps the input that broke it.
 */
#ifndef VMMT_FUZZ_H
#define VMMT_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define FUZZ_ASSERT(cond, ...)                                                                     \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: invariant broken: %s: ", __FILE__, __LINE__, #cond);           \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

/* Every byte printable ASCII: messages carry a peer's text, and end up in logs. */
static inline int fuzz_printable(const char *s)
{
    for (; *s != '\0'; s++)
        if ((unsigned char)*s < 0x20 || (unsigned char)*s > 0x7e) return 0;
    return 1;
}

/* Reads the input front to back; past its end every read gives 0. */
struct fuzz_bytes {
    const uint8_t *p;
    size_t n;
};

static inline uint64_t fuzz_take(struct fuzz_bytes *b, unsigned nbytes)
{
    uint64_t v = 0;
    for (unsigned i = 0; i < nbytes; i++) {
        uint8_t c = 0;
        if (b->n > 0) {
            c = *b->p++;
            b->n--;
        }
        v |= (uint64_t)c << (8 * i);
    }
    return v;
}

#endif
