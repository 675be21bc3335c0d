/*
 * The consumer's import cache: a per-process list of imported pools. The
 * first consume of a pool fetches its handle (from the broker, or the
 * FABRIC handle inside the descriptor), imports and maps it for the
 * consumer's device; eviction lets go of pools nobody uses.
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "acker.h"
#include "broker.h"
#include "clock.h"
#include "consumer_internal.h"
#include "ctrl.h"
#include "desc.h"
#include "driver.h"
#include "status.h"
#include "vmm.h"

void vmmt_consumer_config_init(vmmt_consumer_config *c)
{
    memset(c, 0, sizeof *c);
    c->timeout_ms = 5000;
    c->max_pools = 16;
}

int vmmt_consumer_create(const vmmt_consumer_config *config, vmmt_consumer **out)
{
    vmmt_consumer *c;

    if (out == NULL) return vmmt__fail(VMMT_EINVAL, "vmmt_consumer_create: out is NULL");
    c = calloc(1, sizeof *c);
    if (c == NULL) return vmmt__fail(VMMT_ENOMEM, "vmmt_consumer_create: no host memory");
    if (config != NULL)
        c->cfg = *config;
    else
        vmmt_consumer_config_init(&c->cfg);
    if (c->cfg.timeout_ms <= 0) c->cfg.timeout_ms = 5000;
    if (c->cfg.max_pools < 0) c->cfg.max_pools = 0;
    if (vmmt__acker_create(&c->acker) != VMMT_OK) {
        free(c);
        return vmmt_last_status();
    }
    pthread_mutex_init(&c->lock, NULL);
    *out = c;
    return VMMT_OK;
}

static int release_pool(struct imported *ip)
{
    const struct vmmt_drv *d = vmmt__drv();
    int st;

    if ((ip->poll_stream != NULL || ip->host_table) && vmmt__ctx_enter(ip->device) == VMMT_OK) {
        if (ip->poll_stream != NULL) {
            d->cuStreamSynchronize(ip->poll_stream);
            d->cuStreamDestroy(ip->poll_stream);
            ip->poll_stream = NULL;
        }
        if (ip->poll_word != NULL) d->cuMemFreeHost(ip->poll_word);
        ip->poll_word = NULL;
        vmmt__ctrl_release(&ip->ctrl);
        ip->host_table = 0;
        vmmt__ctx_leave();
    }
    st = vmmt__mapping_release(&ip->map);
    if (st != VMMT_OK) return st;
    pthread_mutex_destroy(&ip->poll_lock);
    free(ip->slots);
    free(ip);
    return VMMT_OK;
}

/* Fetch the allocation's fd (and the shared control table's) from the broker; map both. */
static int import_posix(vmmt_consumer *c, const struct vmmt__desc *d, struct imported *ip)
{
    int fds[2] = {-1, -1}, want = ip->host_table ? 2 : 1, st;
    double t0 = vmmt__now_us(), t1 = t0, t2 = t0;

    st = vmmt__broker_fetch_fds(&d->broker, d->pool_id, c->cfg.timeout_ms, fds, want);
    t1 = vmmt__now_us();
    if (st == VMMT_OK)
        st = vmmt__mapping_import_posix_fd(ip->device, fds[0], d->alloc_size, &ip->map);
    t2 = vmmt__now_us();
    if (st == VMMT_OK && ip->host_table) {
        st =
            vmmt__ctrl_attach_shared(fds[1], (size_t)d->table_slots * d->slot_stride, 0, &ip->ctrl);
        if (st != VMMT_OK) {
            struct vmmt__saved_error e;
            vmmt__error_save(&e);
            vmmt__mapping_release(&ip->map);
            vmmt__error_restore(&e);
        }
    }
    for (int i = 0; i < 2; i++)
        if (fds[i] >= 0) close(fds[i]);
    /* Where an attach spends its time, for VMMT_LOG=debug. */
    vmmt__log(VMMT_LOG_DEBUG,
              "attach of pool from pid %d: broker %.1f us, import+map+access %.1f us, "
              "control table %.1f us",
              d->producer_pid, t1 - t0, t2 - t1, vmmt__now_us() - t2);
    return st;
}

/* Fetch the handle, import and map; lock held (imports are rare and serial). */
static int import_pool(vmmt_consumer *c, const struct vmmt__desc *d, int device,
                       struct imported **out)
{
    struct imported *ip = calloc(1, sizeof *ip);
    int st;

    if (ip == NULL) return vmmt__fail(VMMT_ENOMEM, "no host memory to import a pool");
    ip->slots = calloc(d->table_slots, sizeof *ip->slots);
    if (ip->slots == NULL) {
        free(ip);
        return vmmt__fail(VMMT_ENOMEM, "no host memory for %u slot states", d->table_slots);
    }
    ip->owner = c;
    ip->geometry = *d;
    ip->device = device;
    ip->host_table = (d->flags & VMMT__DESC_HOST_TABLE) != 0;
    ip->ctrl.fd = -1;
    pthread_mutex_init(&ip->poll_lock, NULL);
    if (d->handle_type == VMMT_HANDLE_FABRIC) {
        CUmemFabricHandle f;
        memcpy(f.data, d->fabric, sizeof f.data);
        st = vmmt__mapping_import_fabric(device, &f, d->alloc_size, &ip->map);
    } else {
        st = import_posix(c, d, ip);
    }
    ip->table = ip->host_table ? 0 : ip->map.base + d->table_offset;
    if (st != VMMT_OK) {
        pthread_mutex_destroy(&ip->poll_lock);
        free(ip->slots);
        free(ip);
        return vmmt__wrap(st, "importing the pool of producer pid %d (device %d) on device %d",
                          d->producer_pid, d->producer_device, device);
    }
    ip->next = c->pools;
    c->pools = ip;
    c->count++;
    *out = ip;
    return VMMT_OK;
}

static struct imported *find(vmmt_consumer *c, const uint8_t id[16], int device,
                             struct imported ***link)
{
    struct imported **pp = &c->pools;

    for (; *pp != NULL; pp = &(*pp)->next) {
        if ((*pp)->device == device && memcmp((*pp)->geometry.pool_id, id, 16) == 0) {
            if (link != NULL) *link = pp;
            return *pp;
        }
    }
    return NULL;
}

/*
 * Over max_pools: let go of the least recently used pool that nobody uses and
 * whose copies are all known finished. Only pools with a shared host table
 * qualify: their acknowledgements are written after the copies completed,
 * while a device table's are stream writes the CPU never sees land. Lock held.
 */
static void evict_idle(vmmt_consumer *c)
{
    struct imported **victim = NULL;

    if (c->cfg.max_pools == 0 || c->count <= c->cfg.max_pools) return;
    for (struct imported **pp = &c->pools; *pp != NULL; pp = &(*pp)->next)
        if ((*pp)->users == 0 && (*pp)->host_table &&
            (victim == NULL || (*pp)->last_used < (*victim)->last_used))
            victim = pp;
    if (victim == NULL) return;
    {
        struct imported *ip = *victim, *next = ip->next;
        struct vmmt__saved_error e;
        vmmt__error_save(&e);
        vmmt__log(VMMT_LOG_INFO,
                  "evicting the least recently used pool (producer pid %d): "
                  "more than max_pools=%d imported",
                  ip->geometry.producer_pid, c->cfg.max_pools);
        if (release_pool(ip) == VMMT_OK) {
            *victim = next;
            c->count--;
        }
        vmmt__error_restore(&e);
    }
}

int vmmt__cache_get(struct vmmt_consumer *c, const struct vmmt__desc *d, int device,
                    struct imported **out)
{
    *out = find(c, d->pool_id, device, NULL);
    if (*out != NULL) return vmmt__desc_check_pool(d, &(*out)->geometry);
    return import_pool(c, d, device, out);
}

void vmmt__cache_use(struct vmmt_consumer *c, struct imported *ip)
{
    ip->users++;
    ip->last_used = ++c->clock;
    evict_idle(c);
}

int vmmt_consumer_evict(vmmt_consumer *c, const uint8_t pool_id[16], int device)
{
    struct imported **link, *ip;
    int st = VMMT_OK;

    if (c == NULL || pool_id == NULL)
        return vmmt__fail(VMMT_EINVAL, "vmmt_consumer_evict: consumer and pool_id are required");
    /* Acknowledgements whose copies are done hold the pool only until written. */
    vmmt__acker_flush(c->acker);
    pthread_mutex_lock(&c->lock);
    ip = find(c, pool_id, device, &link);
    if (ip != NULL && ip->users > 0) {
        st = vmmt__fail(VMMT_ESTATE,
                        "cannot evict the pool: %d consume or acknowledge call(s) on other "
                        "threads are using it; evict once they return",
                        ip->users);
    } else if (ip != NULL) {
        struct imported *next = ip->next;
        st = release_pool(ip);
        if (st == VMMT_OK) {
            *link = next;
            c->count--;
        }
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}

int vmmt_consumer_pool_count(vmmt_consumer *c)
{
    int n;

    if (c == NULL) return 0;
    pthread_mutex_lock(&c->lock);
    n = c->count;
    pthread_mutex_unlock(&c->lock);
    return n;
}

void vmmt_consumer_destroy(vmmt_consumer *c)
{
    if (c == NULL) return;
    /* First every pending acknowledgement: it still uses its pool's table. */
    vmmt__acker_destroy(c->acker);
    pthread_mutex_lock(&c->lock);
    while (c->pools != NULL) {
        struct imported *ip = c->pools;
        c->pools = ip->next;
        if (release_pool(ip) != VMMT_OK)
            vmmt__log(VMMT_LOG_ERROR, "vmmt_consumer_destroy: %s", vmmt_last_error());
    }
    pthread_mutex_unlock(&c->lock);
    pthread_mutex_destroy(&c->lock);
    free(c);
}
