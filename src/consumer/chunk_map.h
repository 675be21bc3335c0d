/*
 * Elastic device pools, consumer side (chunks.c): the pool's range is
 * reserved once at import; chunk k is mapped on first use and mapped again
 * when its incarnation word in the shared table (after the slot rows, ctrl.h)
 * shows another making than the one mapped (producer side: producer/elastic.h).
 */
#ifndef VMMT_CHUNK_MAP_H
#define VMMT_CHUNK_MAP_H

#include <stdint.h>

#include "cuabi.h"
#include "desc.h"

struct vmmt__chunk_map;

/*
 * Address space that the elastic imports of a process reserve together at
 * most: each reserves its pool's whole maximum (docs/design.md, "Elastic
 * pools"). 16 TiB, an eighth of what x86-64 gives a process.
 */
#define VMMT__ELASTIC_RESERVE_MAX (16ull << 40)

/* What the chunk maps of this process reserve now; thread-safe. */
uint64_t vmmt__chunk_reserved(void);

/*
 * Reserve the range of a chunked pool for `device` (context current); nothing
 * mapped yet. VMMT_ENOMEM when that would take the process's chunk maps past
 * VMMT__ELASTIC_RESERVE_MAX (VMMT_ETOOBIG for a pool larger than that).
 * flush(flush_arg) has the copies already complete let go of their chunks
 * (vmmt__chunk_map_hold) before the map decides that one is held.
 */
int vmmt__chunk_map_create(int device, const struct vmmt__desc *d, int timeout_ms,
                           void (*flush)(void *arg), void *flush_arg, struct vmmt__chunk_map **out);
/*
 * A copy out of [offset, offset + nbytes) is queued in this process (delta 1)
 * or has completed (-1): a chunk it touches is not unmapped meanwhile, and
 * only such a chunk (an unrelated copy in flight does not stop a chunk made
 * again from being mapped afresh). Thread-safe.
 */
void vmmt__chunk_map_hold(struct vmmt__chunk_map *m, uint64_t offset, uint64_t nbytes, int delta);
CUdeviceptr vmmt__chunk_map_base(const struct vmmt__chunk_map *m);
/*
 * Make sure every chunk of [d->offset, d->offset + d->nbytes) is mapped at the
 * incarnation `words` (the table's incarnation words) shows, importing from
 * the broker what is missing or was made again. VMMT_ESTATE when the
 * descriptor's chunk was given back since (a stale descriptor), or when a
 * chunk made again is still mapped from its previous making and a copy out
 * of that chunk may be queued (retry once the streams are synchronized).
 */
int vmmt__chunk_map_ensure(struct vmmt__chunk_map *m, const uint32_t *words,
                           const struct vmmt__desc *d);
/*
 * Let go of chunks the producer gave back (or made again) since they were
 * mapped here: until then the device memory stays allocated for this
 * mapping. At most once per 50 ms, and only chunks no copy queued here
 * holds (the others at a later call).
 */
int vmmt__chunk_map_trim(struct vmmt__chunk_map *m, const uint32_t *words);
/* Unmap, release and free; NULL is allowed. */
int vmmt__chunk_map_destroy(struct vmmt__chunk_map *m);

#endif
