/*
 * The CPU copy of a host pool's publish (host_pool.c): one memcpy, split
 * across a few short-lived threads when it is large.
 */
#ifndef VMMT_CPU_COPY_H
#define VMMT_CPU_COPY_H

#include <stddef.h>

/* Copy n bytes; returns when every byte is written. Cannot fail. */
void vmmt__cpu_copy(void *dst, const void *src, size_t n);

/* How many parts a copy of n bytes is split into (tests and docs). */
int vmmt__cpu_copy_parts(size_t n);

#endif
