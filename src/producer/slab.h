/*
 * The slice allocator of a producer's pool: hands out byte ranges of the data
 * region, one per published buffer (or packed group), and takes them back in
 * any order once every consumer acknowledged.
 *
 * Best fit with coalescing. Every block (free or live) is a node in a list
 * ordered by offset, so freeing finds its neighbours in O(1); free blocks are
 * also in a balanced tree ordered by (size, offset) for the best-fit search,
 * and live slices in a tree ordered by offset so free() can check that its
 * offset is one it handed out. Alloc and free are O(log n); node storage is
 * allocated once at create, so neither calls malloc.
 *
 * Not thread-safe: the pool serialises every call under its own lock.
 */
#ifndef VMMT_SLAB_H
#define VMMT_SLAB_H

#include <stdint.h>

/* The largest alignment alloc accepts; slices need no more than a page. */
#define VMMT__SLAB_MAX_ALIGN 4096u

struct vmmt__slab;

struct vmmt__slab_stats {
    uint64_t capacity;     /* bytes managed */
    uint64_t free_bytes;   /* capacity minus the bytes of live slices */
    uint64_t largest_free; /* the largest free block, 0 when none */
    uint32_t live;         /* live slices */
    uint32_t free_blocks;  /* free blocks (after coalescing) */
};

/*
 * A slab over [0, size) that holds at most max_live live slices at once.
 * VMMT_EINVAL for size 0 or max_live 0 (or too large to index),
 * VMMT_ENOMEM when the node storage cannot be allocated.
 */
int vmmt__slab_create(uint64_t size, uint32_t max_live, struct vmmt__slab **out);

/* Frees the slab and every slice in it; NULL is ignored. */
void vmmt__slab_destroy(struct vmmt__slab *s);

/*
 * Best fit among free blocks, offset aligned to `align` (power of two,
 * <= 4096). Padding the alignment leaves in front of a slice stays a free
 * block, so free() restores the bytes exactly.
 * VMMT_EFULL when no free block fits now (or max_live slices are live),
 * VMMT_ETOOBIG when size can never fit (size > capacity), VMMT_EINVAL for
 * size 0 / bad align.
 *
 * The choice is the smallest block that fits, ties broken by the lowest
 * offset, among the first VMMT__SLAB_SCAN blocks of at least `size` bytes;
 * past those (only when many near-size blocks are misaligned), the smallest
 * block that fits at any alignment. It never answers EFULL while some block
 * fits.
 */
int vmmt__slab_alloc(struct vmmt__slab *s, uint64_t size, uint64_t align, uint64_t *offset);

/* How many near-size candidates alloc examines before it settles for a sure fit. */
#define VMMT__SLAB_SCAN 32u

/*
 * Frees the slice starting at offset, coalescing with free neighbours.
 * VMMT_EINVAL (message names the offset) for an offset that is not a live
 * slice (double free).
 */
int vmmt__slab_free(struct vmmt__slab *s, uint64_t offset);

void vmmt__slab_stats(const struct vmmt__slab *s, struct vmmt__slab_stats *out);

/*
 * Walks every structure and checks it against the others (block list covers
 * [0, capacity) without gaps, no two free blocks adjacent, trees ordered and
 * balanced, counters right). VMMT_OK, or VMMT_ESTATE naming the first broken
 * invariant. O(n); for tests.
 */
int vmmt__slab_check(const struct vmmt__slab *s);

#endif
