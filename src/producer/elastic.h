/*
 * Elastic device pools, producer side (elastic.c; the consumer's is
 * consumer/chunk_map.h). The pool's address range is reserved for its maximum size once;
 * chunk k covers [k * chunk, (k + 1) * chunk) of it and is backed by its own
 * physical allocation only while a slice touching it is in flight (or while
 * it is among the first chunks kept resident). Each making of a chunk gets a
 * new incarnation number, written into a word of the shared host control
 * table after the slot rows; a consumer maps a chunk on first use and maps it
 * again when the word shows another incarnation than the one it imported.
 */
#ifndef VMMT_ELASTIC_H
#define VMMT_ELASTIC_H

#include <stdint.h>

#include "broker.h"
#include "cuabi.h"
#include "desc.h"

struct vmmt_pool;

struct vmmt__chunk {
    CUmemGenericAllocationHandle handle;
    int fd;               /* exported once per making; -1 while not resident */
    uint32_t incarnation; /* 0 while not resident */
    uint32_t live;        /* slices in flight (or reserved) touching the chunk */
    double idle_since_us; /* when live last fell to 0 */
};

struct vmmt__elastic {
    uint64_t chunk;   /* bytes per chunk, a multiple of the granularity */
    uint32_t count;   /* chunks in the reserved range */
    uint32_t keep;    /* chunks 0..keep-1 stay resident for the pool's life */
    uint64_t idle_us; /* a chunk idle this long goes back (64 bits: ms x 1000 overflows 32) */
    uint32_t next_incarnation;
    uint32_t *words; /* incarnation words in the shared table */
    struct vmmt__chunk *c;
    uint64_t resident, peak, made, released;
};

/* ----------------------------------------------------- producer (elastic.c) */

/* POSIX_FD must work on the device (the probe's real allocation); sets p->type. */
int vmmt__elastic_check_type(struct vmmt_pool *p);
/* Choose the chunk size and reserve the range; fills p->map (reserved only) and p->el. */
int vmmt__elastic_allocate(struct vmmt_pool *p);
/* Make the chunks kept resident; after the shared table exists (context current). */
int vmmt__elastic_start(struct vmmt_pool *p);
/* A slice [off, off + bytes) of the data region is taken: make missing chunks. Lock held. */
int vmmt__elastic_hold(struct vmmt_pool *p, uint64_t off, uint64_t bytes);
/* The slice is free again; returns how many chunks that left idle. Lock held. */
int vmmt__elastic_drop(struct vmmt_pool *p, uint64_t off, uint64_t bytes);
/*
 * Give back chunks idle for idle_release_ms. Lock held. Returns microseconds
 * until the next chunk becomes due, or -1 when none is waiting.
 */
int64_t vmmt__elastic_trim(struct vmmt_pool *p);
/* Unmap and release every chunk (shutdown; context current). */
void vmmt__elastic_release(struct vmmt_pool *p);
void vmmt__elastic_free(struct vmmt_pool *p);
/* Broker resolver: a resident chunk's fd for its vmmt__chunk_id. */
int vmmt__elastic_resolve(void *user, const uint8_t id[16], int fds[VMMT_BROKER_MAX_FDS]);
/*
 * Fill a descriptor's chunk and incarnation for its offset. held: the caller
 * holds the lock or the slice's slot, so the chunk's incarnation cannot
 * change under the read; otherwise (a record checked before anything is
 * reserved) no chunk is read, and 1 stands for the incarnation it will have.
 */
void vmmt__elastic_describe(const struct vmmt_pool *p, struct vmmt__desc *d, int held);

#endif
