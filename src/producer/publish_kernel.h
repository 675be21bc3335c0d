/*
 * One kernel per small publish (publish_kernel.c): the copy and the ready
 * word in one submission, where that is safe; the two submissions otherwise.
 */
#ifndef VMMT_PUBLISH_KERNEL_H
#define VMMT_PUBLISH_KERNEL_H

#include <stdint.h>

#include "cuabi.h"
#include "vmmt.h"

struct vmmt_pool;

/* The largest buffer the kernel copies: one block's work stays under the two submissions'. */
#define VMMT__KERNEL_MAX_BYTES (64u << 10)

/*
 * Compile the kernel for the pool's device; its context is current. A
 * driver that refuses it leaves the pool publishing with two submissions,
 * said once at INFO: never a failure, and the thread's error is kept.
 */
void vmmt__kernel_load(struct vmmt_pool *p);

/* Unload it; the context is current and no publish runs. */
void vmmt__kernel_unload(struct vmmt_pool *p);

/*
 * Enqueue on s the copy of b into dst and then gen into the ready word, as
 * one kernel. 1: enqueued. 0: nothing enqueued, for the caller to enqueue
 * the copy and the stream write: the pool has no kernel, or b is not one
 * the kernel may read (a host buffer, over VMMT__KERNEL_MAX_BYTES, not
 * 16-byte aligned and sized, not on the pool's device, or a range the
 * driver does not show as readable there: a kernel that faults takes the
 * whole context down, a copy only fails), or the launch was refused
 * (said once per pool). Context current.
 */
int vmmt__kernel_publish(struct vmmt_pool *p, const vmmt_buffer *b, CUdeviceptr dst,
                         CUdeviceptr ready, uint32_t gen, CUstream s);

#endif
