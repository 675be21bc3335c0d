/* The model test's child processes (tests/model/children.c). */
#ifndef VMMT_MODEL_CHILDREN_H
#define VMMT_MODEL_CHILDREN_H

#include "proto.h"

/* Run as the producer / a consumer on fd 3 until the driver ends it; the exit code. */
int mt_producer_main(void);
int mt_consumer_main(int timeout_ms, uint64_t unit);

/* What this process holds now: fds, mappings, threads and the emulator's live objects. */
void mt_res_take(struct mt_res *r);

#endif
