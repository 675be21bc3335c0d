/*
 * Acknowledgements written once the copy has completed, by a thread of the
 * consumer's. A consumer records an event after its copy, and this calls the
 * acknowledgement's writer once the event has completed: the consumer's
 * stream carries one copy and one event record (measured nearly free)
 * instead of a stream memory write (about a third of a 4 KiB copy on the
 * H200), and the writer can look at the slot first. A shared host table is
 * written with compare-and-swaps, without any driver call; a device table
 * with stream writes on a stream of the import's, after a read of its ready
 * word (consume.c, device_table.c).
 */
#ifndef VMMT_ACKER_H
#define VMMT_ACKER_H

#include <stdint.h>

#include "cuabi.h"

struct vmmt__acker;

int vmmt__acker_create(struct vmmt__acker **out);

/* Finish every pending acknowledgement (waiting for its event), stop the thread, free. */
void vmmt__acker_destroy(struct vmmt__acker *a);

/* What a writer returns to be called again later (a driver call failed). */
#define VMMT__ACK_AGAIN (-1)
/* done's answer when nothing was written because the driver kept failing:
 * the copy's end, or the table's words, could not be confirmed. */
#define VMMT__ACK_LOST (-2)
/* done's answer for a copy that failed on its stream (written as usual). */
#define VMMT__ACK_COPY_FAILED (-3)

/*
 * After the work already on `stream`, call write(arg) (NULL: nothing to
 * write, only the copy's end to wait for), then done(arg, acked): acked is
 * write's answer, 0 when the slot no longer showed the occupant, so that
 * nothing (or not every word) was written; a writer that answers
 * VMMT__ACK_AGAIN is called again on a later pass. Done at once when the
 * stream is idle, else by the acker's thread. The caller's context for
 * `device` must be current. Never written while the copy may still be
 * queued: when the driver cannot say (the event's query fails), the entry
 * waits, until the failure has lasted long enough to be the copy's own; a
 * copy that failed on its stream is written and done(arg,
 * VMMT__ACK_COPY_FAILED); without the device's context at destroy, done(arg,
 * VMMT__ACK_LOST) and nothing is written. A failure returned here is about the copy or the event.
 */
int vmmt__acker_defer(struct vmmt__acker *a, int device, CUstream stream, int (*write)(void *),
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
