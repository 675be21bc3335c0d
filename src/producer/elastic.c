/*
 * Elastic device pools, producer side: the reserved range, chunks made when a
 * slice needs them and given back after idle_release_ms without one (the
 * recycler calls the trim), their exported fds served by the pool's broker
 * under per-chunk ids, and their incarnation words in the shared table.
 *
 * Chunks are made and given back under the pool's lock: it happens once per
 * growth or shrink, costs a cuMemCreate + export (about 1 ms on the H200)
 * or an unmap + release, and keeps every count in one place.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clock.h"
#include "ctrl.h"
#include "driver.h"
#include "elastic.h"
#include "pool_internal.h"
#include "status.h"

#define DEFAULT_CHUNK_UNITS 4
#define MAX_CHUNKS          65536u

int vmmt__elastic_check_type(struct vmmt_pool *p)
{
    vmmt_device_probe probe;
    const vmmt_handle_probe *posix = &probe.candidates[1];

    int st = vmmt_probe_device(p->device, &probe);

    /* With no shareable type at all the probe fails, but still fills every candidate. */
    if (posix->type != VMMT_HANDLE_POSIX_FD)
        return st != VMMT_OK ? st
                             : vmmt__fail(VMMT_ESTATE, "the device probe has no POSIX_FD entry");
    if (!posix->works)
        return vmmt__fail(VMMT_ENOTSUP,
                          "an elastic pool exports its chunks as POSIX fds, and POSIX_FD does not "
                          "work on device %d: %s; use a fixed pool",
                          p->device, posix->cause);
    p->type = VMMT_HANDLE_POSIX_FD;
    return VMMT_OK;
}

int vmmt__elastic_allocate(struct vmmt_pool *p)
{
    const struct vmmt_drv *d = vmmt__drv();
    struct vmmt__elastic *el;
    size_t gmin = 0, grec = 0;
    uint64_t chunk, max;
    CUresult r;
    int st;

    st = vmmt__granularity(p->device, p->type, &gmin, &grec);
    if (st != VMMT_OK) return st;
    chunk = p->cfg.chunk_size ? p->cfg.chunk_size : (uint64_t)gmin * DEFAULT_CHUNK_UNITS;
    if (vmmt__align_up(chunk, gmin, &chunk) != VMMT_OK || chunk == 0)
        return vmmt__fail(VMMT_EINVAL, "chunk_size=%" PRIu64 " is too large", p->cfg.chunk_size);
    st = vmmt__size_policy(p->cfg.memory_size, chunk, p->cfg.round_up, &max);
    if (st != VMMT_OK)
        return vmmt__wrap(st, "an elastic pool holds whole chunks of %" PRIu64 " bytes", chunk);
    if (max / chunk > MAX_CHUNKS)
        return vmmt__fail(VMMT_EINVAL,
                          "memory_size=%" PRIu64 " is %" PRIu64 " chunks of %" PRIu64
                          " bytes; at most %u: raise chunk_size",
                          max, max / chunk, chunk, MAX_CHUNKS);
    el = calloc(1, sizeof *el);
    if (el != NULL) el->c = calloc(max / chunk, sizeof *el->c);
    if (el == NULL || el->c == NULL) {
        free(el);
        return vmmt__fail(VMMT_ENOMEM, "no host memory for the chunk table");
    }
    el->chunk = chunk;
    el->count = (uint32_t)(max / chunk);
    el->keep = (uint32_t)((p->cfg.min_resident + chunk - 1) / chunk);
    if (el->keep > el->count) el->keep = el->count;
    el->idle_us = (uint64_t)p->cfg.idle_release_ms * 1000u;
    el->next_incarnation = 1;
    for (uint32_t k = 0; k < el->count; k++)
        el->c[k].fd = -1;
    p->el = el;
    memset(&p->map, 0, sizeof p->map);
    p->map.device = p->device;
    p->map.size = max;
    r = d->cuMemAddressReserve(&p->map.base, max, gmin, 0, 0);
    if (r != CUDA_SUCCESS) return vmmt__cu_fail(r, "cuMemAddressReserve(size=%" PRIu64 ")", max);
    p->map.reserved = 1;
    return VMMT_OK;
}

/* Undo a partly made chunk; lock held, context current. */
static void unmake(struct vmmt_pool *p, struct vmmt__chunk *c, CUdeviceptr at, int mapped)
{
    const struct vmmt_drv *d = vmmt__drv();

    if (mapped && d->cuMemUnmap(at, p->el->chunk) != CUDA_SUCCESS)
        vmmt__log(VMMT_LOG_ERROR, "unmapping chunk at 0x%" PRIx64 " failed", (uint64_t)at);
    if (c->handle != 0) d->cuMemRelease(c->handle);
    if (c->fd >= 0) close(c->fd);
    c->handle = 0;
    c->fd = -1;
}

/* Create, map, grant access, export: chunk k becomes resident. Lock held. */
static int make(struct vmmt_pool *p, uint32_t k)
{
    const struct vmmt_drv *d = vmmt__drv();
    struct vmmt__elastic *el = p->el;
    struct vmmt__chunk *c = &el->c[k];
    CUdeviceptr at = p->map.base + (uint64_t)k * el->chunk;
    CUmemAllocationProp prop;
    int st, mapped = 0;

    st = vmmt__ctx_enter(p->device);
    if (st != VMMT_OK) return st;
    vmmt__prop_init(&prop, p->device, p->type, 0);
    st = VMMT_CU(d, cuMemCreate(&c->handle, el->chunk, &prop, 0));
    if (st == VMMT_OK) st = VMMT_CU(d, cuMemMap(at, el->chunk, 0, c->handle, 0));
    mapped = st == VMMT_OK;
    if (st == VMMT_OK) st = vmmt__grant_device(at, el->chunk, p->device);
    if (st == VMMT_OK) st = vmmt__export_posix_fd(c->handle, &c->fd);
    if (st != VMMT_OK) {
        struct vmmt__saved_error e;
        vmmt__error_save(&e);
        unmake(p, c, at, mapped);
        vmmt__error_restore(&e);
        vmmt__ctx_leave();
        return vmmt__wrap(st, "growing the elastic pool by chunk %u (%" PRIu64 " bytes)", k,
                          el->chunk);
    }
    vmmt__ctx_leave();
    c->incarnation = el->next_incarnation;
    /* Never 0, which the word holds while the chunk is given back. */
    el->next_incarnation = el->next_incarnation == UINT32_MAX ? 1 : el->next_incarnation + 1;
    c->live = 0;
    c->idle_since_us = vmmt__now_us();
    /* Release: a consumer that loads the word finds the chunk exported. */
    __atomic_store_n(&el->words[k], c->incarnation, __ATOMIC_RELEASE);
    el->resident += el->chunk;
    if (el->resident > el->peak) el->peak = el->resident;
    el->made++;
    return VMMT_OK;
}

/* Give chunk k back; lock held. Consumers' copies from it finished: every slice was acknowledged.
 */
static void give_back(struct vmmt_pool *p, uint32_t k)
{
    struct vmmt__elastic *el = p->el;

    __atomic_store_n(&el->words[k], 0, __ATOMIC_RELEASE);
    unmake(p, &el->c[k], p->map.base + (uint64_t)k * el->chunk, 1);
    el->c[k].incarnation = 0;
    el->resident -= el->chunk;
    el->released++;
}

int vmmt__elastic_start(struct vmmt_pool *p)
{
    struct vmmt__elastic *el = p->el;
    int st = VMMT_OK;

    el->words = p->ctrl.host + p->table_bytes / 4;
    pthread_mutex_lock(&p->lock);
    for (uint32_t k = 0; k < el->keep && st == VMMT_OK; k++)
        st = make(p, k);
    pthread_mutex_unlock(&p->lock);
    return st;
}

int vmmt__elastic_hold(struct vmmt_pool *p, uint64_t off, uint64_t bytes)
{
    struct vmmt__elastic *el = p->el;
    uint32_t first = (uint32_t)(off / el->chunk), last = (uint32_t)((off + bytes - 1) / el->chunk);
    int st = VMMT_OK;
    uint32_t k;

    for (k = first; k <= last && st == VMMT_OK; k++)
        if (el->c[k].incarnation == 0) st = make(p, k);
    if (st != VMMT_OK) {
        /* Chunks made for this slice alone go back at once. */
        for (uint32_t j = first; j < k - 1; j++)
            if (el->c[j].live == 0 && j >= el->keep && el->c[j].incarnation != 0) give_back(p, j);
        return st;
    }
    for (k = first; k <= last; k++)
        el->c[k].live++;
    return VMMT_OK;
}

int vmmt__elastic_drop(struct vmmt_pool *p, uint64_t off, uint64_t bytes)
{
    struct vmmt__elastic *el = p->el;
    uint32_t first = (uint32_t)(off / el->chunk), last = (uint32_t)((off + bytes - 1) / el->chunk);
    double now = vmmt__now_us();
    int idle = 0;

    for (uint32_t k = first; k <= last; k++)
        if (--el->c[k].live == 0) {
            el->c[k].idle_since_us = now;
            idle++;
        }
    return idle;
}

int64_t vmmt__elastic_trim(struct vmmt_pool *p)
{
    struct vmmt__elastic *el = p->el;
    double now = vmmt__now_us(), next = -1;

    if (p->failed || p->closing) return -1;
    for (uint32_t k = el->keep; k < el->count; k++) {
        struct vmmt__chunk *c = &el->c[k];
        double due;
        if (c->incarnation == 0 || c->live > 0) continue;
        due = c->idle_since_us + el->idle_us;
        if (due <= now) {
            if (vmmt__ctx_enter(p->device) == VMMT_OK) {
                give_back(p, k);
                vmmt__ctx_leave();
            }
        } else if (next < 0 || due - now < next) {
            next = due - now;
        }
    }
    return next < 0 ? -1 : (int64_t)next + 1;
}

void vmmt__elastic_release(struct vmmt_pool *p)
{
    struct vmmt__elastic *el = p->el;

    if (el == NULL) return;
    for (uint32_t k = 0; k < el->count; k++)
        if (el->c[k].incarnation != 0) give_back(p, k);
}

void vmmt__elastic_free(struct vmmt_pool *p)
{
    if (p->el == NULL) return;
    free(p->el->c);
    free(p->el);
    p->el = NULL;
}

int vmmt__elastic_resolve(void *user, const uint8_t id[16], int fds[VMMT_BROKER_MAX_FDS])
{
    struct vmmt_pool *p = user;
    uint8_t want[16];
    uint32_t k = 0;
    int n = 0;

    /* Which chunk: the id differs from the pool's in its last four bytes only. */
    if (memcmp(id, p->tmpl.pool_id, 12) != 0) return 0;
    for (int i = 0; i < 4; i++)
        k |= (uint32_t)(id[12 + i] ^ p->tmpl.pool_id[12 + i]) << (8 * i);
    if (k == 0) return 0;
    k--;
    vmmt__chunk_id(p->tmpl.pool_id, k, want);
    if (memcmp(id, want, 16) != 0) return 0;
    pthread_mutex_lock(&p->lock);
    if (p->el != NULL && k < p->el->count && p->el->c[k].fd >= 0) {
        fds[0] = fcntl(p->el->c[k].fd, F_DUPFD_CLOEXEC, 0);
        n = fds[0] >= 0;
    }
    pthread_mutex_unlock(&p->lock);
    return n;
}

void vmmt__elastic_describe(const struct vmmt_pool *p, struct vmmt__desc *d, int held)
{
    if (p->el == NULL) return;
    d->chunk_size = p->el->chunk;
    d->chunk = (uint32_t)(d->offset / p->el->chunk);
    /* Unheld, the chunk may be given back or made by the recycler meanwhile
     * (ThreadSanitizer saw that read race with give_back in CI). */
    d->incarnation = held ? p->el->c[d->chunk].incarnation : 1;
}
