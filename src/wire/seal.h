/*
 * The seal of a descriptor: a keyed 64-bit tag (SipHash-2-4) over the whole
 * record, the tag field read as zero, under a key of 16 random bytes that
 * only the producer and the processes that imported its pool hold (the
 * pool record, ctrl.h). A consumer checks it before it believes any field:
 * a record altered after the producer wrote it, or made up by a process that
 * never imported the pool, is refused, whichever field was changed. Without
 * it every field a consumer cannot check against the table (the offsets
 * within a slice, the group's member count, the pool's own fields on the
 * first descriptor a process sees of a pool) was taken on trust
 * (tests/model/FINDINGS.md).
 */
#ifndef VMMT_SEAL_H
#define VMMT_SEAL_H

#include <stddef.h>
#include <stdint.h>

#define VMMT__SEAL_KEY_BYTES 16

/* SipHash-2-4 of n bytes under a 16-byte key (Aumasson and Bernstein, 2012). */
uint64_t vmmt__siphash24(const uint8_t key[VMMT__SEAL_KEY_BYTES], const uint8_t *in, size_t n);

/*
 * The tag of a record of record_bytes (a multiple of 8), its 8-byte seal
 * field at seal_offset (a multiple of 8) counted as zero: the SipHash-2-4
 * of those bytes, computed in place.
 */
uint64_t vmmt__seal_of(const uint8_t key[VMMT__SEAL_KEY_BYTES], const uint8_t *record,
                       size_t seal_offset, size_t record_bytes);

/* Fills key with random bytes: VMMT_OK, or VMMT_ESYS when the kernel gives none. */
int vmmt__seal_key_new(uint8_t key[VMMT__SEAL_KEY_BYTES]);

#endif
