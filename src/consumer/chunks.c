/*
 * Elastic pools, consumer side: the pool's whole range reserved once, each
 * chunk imported from the producer's broker (under its chunk id) and mapped
 * at its offset the first time a descriptor needs it, and kept. The shared
 * table's incarnation word says which making of a chunk is current; a chunk
 * the producer gave back and made again is unmapped and imported afresh.
 *
 * A chunk is unmapped only while no copy out of it is queued here (each
 * queued copy holds the chunks it reads: vmmt__chunk_map_hold; counted per
 * chunk, since a consumer that never synchronizes always has some copy in
 * flight, and a count per pool refused it every chunk made again: an
 * outside attack, test_attack_elastic). That the producer gave it back
 * proves nothing: it does so once every slice in it was acknowledged, which
 * a rank released on a consumer's behalf (vmmt_pool_release_rank, the lease)
 * or the pool's shutdown, which gives every chunk back, does not wait for.
 * An unmap under a queued copy faults the consumer's context on a GPU.
 *
 * The range is reserved whole, whatever the pool holds: a buffer may span
 * chunks, and the copy reads it at base + offset. Address space is the
 * process's, so the chunk maps of a process reserve VMMT__ELASTIC_RESERVE_MAX
 * at most together (a pool of at most 1 TiB reserves 1 TiB in every process
 * that imports it; 128 such imports would exhaust an x86-64 process).
 */
#include <inttypes.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "broker.h"
#include "clock.h"
#include "ctrl.h"
#include "driver.h"
#include "chunk_map.h"
#include "status.h"
#include "vmm.h"

struct vmmt__chunk_map {
    CUdeviceptr base;
    uint64_t size, chunk;
    uint32_t count;
    int device;
    int timeout_ms;
    struct vmmt__broker_addr broker;
    struct vmmt__broker_peer producer; /* who must serve the chunks: the descriptor's producer */
    uint8_t pool_id[16];
    CUmemGenericAllocationHandle *handle;
    uint32_t *incarnation; /* what is mapped; 0: nothing */
    uint32_t *mapped;      /* the chunks mapped now, nmapped of them, in no order */
    uint32_t nmapped;
    double last_trim_us;
    _Atomic uint32_t *queued; /* per chunk: copies out of it queued in this process */
    void (*flush)(void *arg); /* counts the copies complete by now (the acker) */
    void *flush_arg;
};

#define TRIM_INTERVAL_US 50000.0

static _Atomic uint64_t g_reserved; /* by the chunk maps of this process */

uint64_t vmmt__chunk_reserved(void)
{
    return atomic_load(&g_reserved);
}

/* Count size against the bound; 0 when it does not fit. */
static int take_space(uint64_t size)
{
    uint64_t now = atomic_load(&g_reserved);

    do
        if (size > VMMT__ELASTIC_RESERVE_MAX - now) return 0;
    while (!atomic_compare_exchange_weak(&g_reserved, &now, now + size));
    return 1;
}

static int no_space(uint64_t size)
{
    const double gib = 1024.0 * 1024 * 1024;

    if (size > VMMT__ELASTIC_RESERVE_MAX)
        return vmmt__fail(VMMT_ETOOBIG,
                          "the elastic pool may grow to %.1f GiB, and a consumer reserves that "
                          "much address space for it; a process reserves at most %.0f GiB for "
                          "elastic pools: ask the producer for a smaller memory_size",
                          size / gib, VMMT__ELASTIC_RESERVE_MAX / gib);
    return vmmt__fail(VMMT_ENOMEM,
                      "importing an elastic pool of at most %.1f GiB reserves that much address "
                      "space, and this process's elastic imports hold %.1f GiB of the %.0f GiB "
                      "they may reserve together, none of this consumer's idle: synchronize the "
                      "streams that consumed from them (idle imports are let go to make room), "
                      "evict some (vmmt_consumer_evict), or ask producers for a smaller "
                      "memory_size",
                      size / gib, vmmt__chunk_reserved() / gib, VMMT__ELASTIC_RESERVE_MAX / gib);
}

CUdeviceptr vmmt__chunk_map_base(const struct vmmt__chunk_map *m)
{
    return m->base;
}

int vmmt__chunk_map_create(int device, const struct vmmt__desc *d, int timeout_ms,
                           void (*flush)(void *arg), void *flush_arg, struct vmmt__chunk_map **out)
{
    const struct vmmt_drv *drv = vmmt__drv();
    struct vmmt__chunk_map *m;
    size_t gmin = 0, grec = 0;
    int st;

    *out = NULL;
    st = vmmt__granularity(device, VMMT_HANDLE_POSIX_FD, &gmin, &grec);
    if (st != VMMT_OK) return st;
    if (d->chunk_size % gmin != 0)
        return vmmt__fail(VMMT_EPROTO,
                          "the pool's chunk_size=%" PRIu64 " is not a multiple of this device's "
                          "granularity %zu",
                          d->chunk_size, gmin);
    m = calloc(1, sizeof *m);
    if (m == NULL) return vmmt__fail(VMMT_ENOMEM, "no host memory for a chunk map");
    m->count = (uint32_t)(d->alloc_size / d->chunk_size);
    m->handle = calloc(m->count, sizeof *m->handle);
    m->incarnation = calloc(m->count, sizeof *m->incarnation);
    m->mapped = calloc(m->count, sizeof *m->mapped);
    m->queued = calloc(m->count, sizeof *m->queued);
    if (m->handle == NULL || m->incarnation == NULL || m->mapped == NULL || m->queued == NULL) {
        vmmt__chunk_map_destroy(m);
        return vmmt__fail(VMMT_ENOMEM, "no host memory for %u chunks", m->count);
    }
    m->size = d->alloc_size;
    m->chunk = d->chunk_size;
    m->device = device;
    m->timeout_ms = timeout_ms;
    m->flush = flush;
    m->flush_arg = flush_arg;
    m->broker = d->broker;
    vmmt__broker_expect(d->producer_uid, d->producer_pid, d->producer_pidns, &m->producer);
    memcpy(m->pool_id, d->pool_id, 16);
    if (!take_space(m->size)) {
        st = no_space(m->size);
        vmmt__chunk_map_destroy(m);
        return st;
    }
    st = VMMT_CU(drv, cuMemAddressReserve(&m->base, m->size, gmin, 0, 0));
    if (st != VMMT_OK) {
        atomic_fetch_sub(&g_reserved, m->size);
        m->base = 0;
        vmmt__chunk_map_destroy(m);
        return vmmt__wrap(st, "reserving %" PRIu64 " bytes for an elastic pool", d->alloc_size);
    }
    *out = m;
    return VMMT_OK;
}

void vmmt__chunk_map_hold(struct vmmt__chunk_map *m, uint64_t offset, uint64_t nbytes, int delta)
{
    uint64_t end = offset + (nbytes ? nbytes : 1);

    for (uint64_t k = offset / m->chunk; k <= (end - 1) / m->chunk && k < m->count; k++)
        if (delta > 0)
            atomic_fetch_add_explicit(&m->queued[k], 1, memory_order_relaxed);
        else
            atomic_fetch_sub_explicit(&m->queued[k], 1, memory_order_release);
}

/* Whether no copy queued here reads chunk k; *flushed: the acker was asked once already. */
static int chunk_idle(struct vmmt__chunk_map *m, uint32_t k, int *flushed)
{
    if (atomic_load_explicit(&m->queued[k], memory_order_acquire) == 0) return 1;
    if (!*flushed) m->flush(m->flush_arg);
    *flushed = 1;
    return atomic_load_explicit(&m->queued[k], memory_order_acquire) == 0;
}

static int unmap_chunk(struct vmmt__chunk_map *m, uint32_t k)
{
    const struct vmmt_drv *d = vmmt__drv();
    CUdeviceptr at = m->base + (uint64_t)k * m->chunk;
    int st;

    if (m->incarnation[k] == 0) return VMMT_OK;
    st = VMMT_CU(d, cuMemUnmap(at, m->chunk));
    if (st != VMMT_OK) return st;
    d->cuMemRelease(m->handle[k]);
    m->handle[k] = 0;
    m->incarnation[k] = 0;
    for (uint32_t i = 0; i < m->nmapped; i++)
        if (m->mapped[i] == k) {
            m->mapped[i] = m->mapped[--m->nmapped];
            break;
        }
    return VMMT_OK;
}

/* Fetch chunk k's fd, import it and map it at its offset with access for the device. */
static int map_chunk(struct vmmt__chunk_map *m, uint32_t k)
{
    const struct vmmt_drv *d = vmmt__drv();
    CUdeviceptr at = m->base + (uint64_t)k * m->chunk;
    uint8_t id[16];
    int fd = -1, st;

    /* A chunk given back since its word was loaded is refused by the broker as an
     * unknown id (VMMT_EINVAL); vmmt__chunk_map_ensure tells that from a broker
     * that serves another pool by the word. */
    vmmt__chunk_id(m->pool_id, k, id);
    st = vmmt__broker_fetch_fds(&m->broker, id, &m->producer, m->timeout_ms, &fd, 1, NULL);
    if (st == VMMT_OK) st = vmmt__import_posix_fd(fd, &m->handle[k]);
    if (fd >= 0) close(fd);
    if (st != VMMT_OK) return vmmt__wrap(st, "importing chunk %u of an elastic pool", k);
    st = VMMT_CU(d, cuMemMap(at, m->chunk, 0, m->handle[k], 0));
    if (st == VMMT_OK) {
        st = vmmt__grant_device(at, m->chunk, m->device);
        if (st != VMMT_OK) d->cuMemUnmap(at, m->chunk);
    }
    if (st != VMMT_OK) {
        d->cuMemRelease(m->handle[k]);
        m->handle[k] = 0;
        return vmmt__wrap(st, "mapping chunk %u of an elastic pool", k);
    }
    return VMMT_OK;
}

int vmmt__chunk_map_ensure(struct vmmt__chunk_map *m, const uint32_t *words,
                           const struct vmmt__desc *d)
{
    uint64_t end = d->offset + (d->nbytes ? d->nbytes : 1);
    uint32_t first = (uint32_t)(d->offset / m->chunk), last = (uint32_t)((end - 1) / m->chunk);
    int st, flushed = 0;

    if (last >= m->count)
        return vmmt__fail(VMMT_EPROTO, "buffer ends in chunk %u of %u", last, m->count);
    for (uint32_t k = first; k <= last; k++) {
        uint32_t now = vmmt__ctrl_load(&words[k]);
        if ((k == d->chunk && now != d->incarnation) || now == 0)
            return vmmt__fail(VMMT_ESTATE,
                              "chunk %u of the pool is %s (the descriptor names incarnation "
                              "%u): the descriptor is stale, its slice was recycled",
                              k, now == 0 ? "given back" : "made again", d->incarnation);
        if (m->incarnation[k] == now) continue;
        /* Its previous making went back without our acknowledgement (a rank released on
         * our behalf): our copy out of it may still be queued. */
        if (m->incarnation[k] != 0 && !chunk_idle(m, k, &flushed))
            return vmmt__fail(VMMT_ESTATE,
                              "chunk %u of the pool was made again while a copy out of its "
                              "previous making is still queued in this process (its rank was "
                              "released on this consumer's behalf?); synchronize the streams "
                              "that consumed from the pool and consume again",
                              k);
        st = unmap_chunk(m, k);
        if (st == VMMT_OK) st = map_chunk(m, k);
        /* The producer stores the word before it closes the chunk's fd (elastic.c): a
         * refusal of a chunk whose word moved on is the descriptor's staleness. */
        if (st != VMMT_OK && vmmt__ctrl_load(&words[k]) != now)
            return vmmt__fail(VMMT_ESTATE,
                              "chunk %u of the pool was given back while it was fetched (the "
                              "descriptor names incarnation %u): the descriptor is stale, its "
                              "slice was recycled",
                              k, d->incarnation);
        if (st != VMMT_OK) return st;
        m->mapped[m->nmapped++] = k;
        /* Made again while we imported? Only a stale descriptor allows that. */
        if (vmmt__ctrl_load(&words[k]) != now) {
            m->incarnation[k] = UINT32_MAX; /* a mapping no word matches: replaced next time */
            return vmmt__fail(VMMT_ESTATE, "chunk %u was given back while it was imported", k);
        }
        m->incarnation[k] = now;
    }
    return VMMT_OK;
}

int vmmt__chunk_map_trim(struct vmmt__chunk_map *m, const uint32_t *words)
{
    double now = vmmt__now_us();
    int st = VMMT_OK, flushed = 0;

    if (now - m->last_trim_us < TRIM_INTERVAL_US) return VMMT_OK;
    m->last_trim_us = now;
    /* Backwards: unmapping moves the last entry into the freed place. A chunk a queued
     * copy reads stays: a call after the next interval tries again. */
    for (uint32_t i = m->nmapped; i-- > 0 && st == VMMT_OK;) {
        uint32_t k = m->mapped[i];
        if (vmmt__ctrl_load(&words[k]) != m->incarnation[k] && chunk_idle(m, k, &flushed))
            st = unmap_chunk(m, k);
    }
    return st;
}

int vmmt__chunk_map_destroy(struct vmmt__chunk_map *m)
{
    int st = VMMT_OK;

    if (m == NULL) return VMMT_OK;
    for (uint32_t k = 0; m->incarnation != NULL && k < m->count && st == VMMT_OK; k++)
        st = unmap_chunk(m, k);
    if (st != VMMT_OK) return st;
    if (m->base != 0) st = VMMT_CU(vmmt__drv(), cuMemAddressFree(m->base, m->size));
    if (st != VMMT_OK) return st;
    if (m->base != 0) atomic_fetch_sub(&g_reserved, m->size);
    free(m->handle);
    free(m->incarnation);
    free(m->mapped);
    free((void *)m->queued);
    free(m);
    return VMMT_OK;
}
