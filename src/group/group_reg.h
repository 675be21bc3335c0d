/*
 * What the steps of one registration share (group_reg.c runs the rounds,
 * group_prepare.c finds and exports this rank's allocations, group_map.c
 * imports and maps the peers'). Wire layouts of the R2 table are here too.
 */
#ifndef VMMT_GROUP_REG_H
#define VMMT_GROUP_REG_H

#include <stddef.h>
#include <stdint.h>

#include "group_internal.h"

struct r2_head {
    uint32_t first_id;
    uint32_t n_new;
    uint32_t nbuf;
    uint32_t nchain;
    struct vmmt__broker_addr addr;
    uint8_t pad[2];
};

struct r2_alloc {
    uint64_t size;
    uint8_t fabric[64];
};

struct r2_buf {
    uint64_t nbytes;
    uint64_t offset; /* of the buffer's start in its first allocation */
    uint32_t chain_first;
    uint32_t chain_len;
};

/* What one call holds until it commits or undoes. */
struct reg {
    vmmt_group *g;
    const vmmt_group_buffer *bufs;
    size_t nbuf;
    size_t local_mark, span_mark;
    size_t *import_mark; /* per rank */
    uint32_t *chain;     /* this rank's chain of allocation ids */
    size_t nchain, capchain;
    struct r2_buf *mybufs;
    int *fds; /* exported descriptors of new allocations */
    struct r2_alloc *newallocs;
    size_t n_new;
    struct vmmt__gx gx;
    uint8_t *table; /* R2 result: world * r2_size */
    size_t r2_size;
};

/* Rank r's table, validated against what this rank knows of it. */
struct peer_table {
    struct r2_head h;
    const struct r2_alloc *allocs;
    const struct r2_buf *bufs;
    const uint32_t *chain;
};

/* Walk every buffer, retain and export the allocations not shared yet, open the socket. */
int vmmt__group_prepare(struct reg *R);

/* Exchange descriptors (POSIX_FD) or read FABRIC handles; import each peer's new allocations. */
int vmmt__group_exchange_and_import(struct reg *R, const struct peer_table *t);

/* One range per peer buffer chain, every allocation at its offset; fills ptrs. */
int vmmt__group_map_buffers(struct reg *R, const struct peer_table *t, uint64_t *ptrs);

#endif
