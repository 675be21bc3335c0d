/*
 * Acknowledgements written by the CPU. For a pool whose control table is
 * shared host memory, a consumer records an event after its copy and this
 * writes the acknowledgement words with plain stores once the event has
 * completed: the consumer's stream carries one copy and one event record
 * (measured nearly free) instead of a stream memory write (about a third of
 * a 4 KiB copy on the H200), and the consumer needs no registration of the
 * table with the driver.
 */
#ifndef VMMT_ACKER_H
#define VMMT_ACKER_H

#include <stdint.h>

#include "cuabi.h"

struct vmmt__acker;

int vmmt__acker_create(struct vmmt__acker **out);

/* Finish every pending acknowledgement (waiting for its event), stop the thread, free. */
void vmmt__acker_destroy(struct vmmt__acker *a);

/*
 * After the work already on `stream`, acknowledge `gen` in words[0..count)
 * (vmmt__ctrl_store_ack: only while `ready` shows gen) and call
 * done(arg, acked): acked is 0 when the slot no longer showed gen, so that
 * nothing (or not every word) was written.
 * Done at once when the stream is idle, else by the acker's thread. The
 * caller's context for `device` must be current. Every path writes (or finds
 * the slot moved on) before or after returning: a failure returned here is
 * about the copy or the event, never an acknowledgement left unwritten.
 */
int vmmt__acker_defer(struct vmmt__acker *a, int device, CUstream stream, uint32_t *words,
                      uint32_t count, const uint32_t *ready, uint32_t gen,
                      void (*done)(void *, int), void *arg);

/* Write now, in the caller's thread, every acknowledgement whose event has completed. */
void vmmt__acker_flush(struct vmmt__acker *a);

/*
 * Before destroy: stop the thread, then write every acknowledgement whose
 * copy completes within timeout_ms. The others are dropped unwritten (their
 * done is not called: the pool stays in use) and counted in the result.
 */
int vmmt__acker_finish(struct vmmt__acker *a, int timeout_ms);

#endif
