/*
 * An outsider's view of a descriptor and its broker, written from
 * docs/descriptor.md and docs/broker.md alone (not from src/): little-endian
 * field access by offset, and a raw broker client, for the attack tests.
 */
#ifndef VMMT_RAWBROKER_H
#define VMMT_RAWBROKER_H

#include <stddef.h>
#include <stdint.h>

#include "vmmt.h"

/* Little-endian fields of a descriptor at byte offset `off`. */
uint32_t tu_get32(const vmmt_desc *d, size_t off);
uint64_t tu_get64(const vmmt_desc *d, size_t off);
void tu_put32(vmmt_desc *d, size_t off, uint32_t v);
void tu_put64(vmmt_desc *d, size_t off, uint64_t v);

/*
 * Fetch the fds the broker of d (an abstract name) serves for d's pool id:
 * request version 3, no HOLD. The first two fds that arrive land in fds
 * (*n counts them), any others are closed; returns the reply's status.
 */
int tu_raw_fetch(const vmmt_desc *d, int fds[2], int *n);

#endif
