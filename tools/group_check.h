/*
 * The group read-back check shared by `vmmt group-test` and the group tests:
 * every rank fills buffers with a pattern naming it, registers them, and reads
 * every peer's through the pointers the group returns.
 */
#ifndef VMMT_GROUP_CHECK_H
#define VMMT_GROUP_CHECK_H

#include <stdint.h>
#include <stdio.h>

#include "vmmt.h"

struct gc_opts {
    int buffers;   /* registered per rank; every third spans `chunks` allocations */
    int chunks;    /* allocations a multi-allocation buffer crosses (>= 2) */
    uint64_t size; /* bytes per allocation (rounded up to the granularity) */
    int again;     /* register the same buffers a second time: nothing may be shared twice */
};

struct gc_result {
    double register_ms; /* the first vmmt_group_register */
    uint64_t checked;   /* peer bytes read back and compared */
    size_t peer_allocations;
};

/*
 * 0: every peer byte matched; 1: a mismatch (printed to log); 2: an error
 * (vmmt_last_error() printed). Frees what it allocated, not the group.
 */
int gc_run(vmmt_group *g, const struct gc_opts *o, FILE *log, struct gc_result *res);

#endif
