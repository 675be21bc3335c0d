/*
 * Elastic pools, consumer side: the pool's whole range reserved once, each
 * chunk imported from the producer's broker (under its chunk id) and mapped
 * at its offset the first time a descriptor needs it, and kept. The shared
 * table's incarnation word says which making of a chunk is current; a chunk
 * the producer gave back and made again is unmapped and imported afresh. That
 * is safe without waiting: the producer gives a chunk back only once every
 * slice in it was acknowledged, and a shared-table acknowledgement is written
 * only after the copy it follows has finished.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "broker.h"
#include "clock.h"
#include "ctrl.h"
#include "driver.h"
#include "elastic.h"
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
};

#define TRIM_INTERVAL_US 50000.0

CUdeviceptr vmmt__chunk_map_base(const struct vmmt__chunk_map *m)
{
    return m->base;
}

int vmmt__chunk_map_create(int device, const struct vmmt__desc *d, int timeout_ms,
                           struct vmmt__chunk_map **out)
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
    if (m->handle == NULL || m->incarnation == NULL || m->mapped == NULL) {
        vmmt__chunk_map_destroy(m);
        return vmmt__fail(VMMT_ENOMEM, "no host memory for %u chunks", m->count);
    }
    m->size = d->alloc_size;
    m->chunk = d->chunk_size;
    m->device = device;
    m->timeout_ms = timeout_ms;
    m->broker = d->broker;
    vmmt__broker_expect(d->producer_uid, d->producer_pid, d->producer_pidns, &m->producer);
    memcpy(m->pool_id, d->pool_id, 16);
    st = VMMT_CU(drv, cuMemAddressReserve(&m->base, m->size, gmin, 0, 0));
    if (st != VMMT_OK) {
        m->base = 0;
        vmmt__chunk_map_destroy(m);
        return vmmt__wrap(st, "reserving %" PRIu64 " bytes for an elastic pool", d->alloc_size);
    }
    *out = m;
    return VMMT_OK;
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
     * unknown id (VMMT_EINVAL, passed on): only a stale descriptor meets that. */
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
    int st;

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
        st = unmap_chunk(m, k);
        if (st == VMMT_OK) st = map_chunk(m, k);
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
    int st = VMMT_OK;

    if (now - m->last_trim_us < TRIM_INTERVAL_US) return VMMT_OK;
    m->last_trim_us = now;
    /* Backwards: unmapping moves the last entry into the freed place. */
    for (uint32_t i = m->nmapped; i-- > 0 && st == VMMT_OK;) {
        uint32_t k = m->mapped[i];
        if (vmmt__ctrl_load(&words[k]) != m->incarnation[k]) st = unmap_chunk(m, k);
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
    free(m->handle);
    free(m->incarnation);
    free(m->mapped);
    free(m);
    return VMMT_OK;
}
