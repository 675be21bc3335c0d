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
#include "abi.h"
#include "ctrl.h"
#include "desc.h"
#include "driver.h"
#include "chunk_map.h"
#include "status.h"
#include "vmm.h"

#define CONSUMER_CONFIG_V1 VMMT__SIZE_V1(vmmt_consumer_config, max_pools)

static void config_defaults(vmmt_consumer_config *c)
{
    memset(c, 0, sizeof *c);
    c->timeout_ms = 5000;
    c->max_pools = 16;
}

void vmmt_consumer_config_init_size(vmmt_consumer_config *config, size_t size)
{
    vmmt_consumer_config c;

    config_defaults(&c);
    vmmt__struct_out(config, size, &c, sizeof c, CONSUMER_CONFIG_V1,
                     "vmmt_consumer_config_init: config");
}

int vmmt_consumer_create_size(const vmmt_consumer_config *config, size_t size, vmmt_consumer **out)
{
    vmmt_consumer_config cfg;
    vmmt_consumer *c;

    if (out == NULL) return vmmt__fail(VMMT_EINVAL, "vmmt_consumer_create: out is NULL");
    *out = NULL;
    config_defaults(&cfg);
    if (config != NULL && vmmt__struct_in(&cfg, sizeof cfg, config, size, CONSUMER_CONFIG_V1,
                                          "vmmt_consumer_create: config") != VMMT_OK)
        return vmmt_last_status();
    if (cfg.timeout_ms < 0 || cfg.max_pools < 0)
        return vmmt__fail(VMMT_EINVAL,
                          "vmmt_consumer_create: %s=%d is negative; use a positive value, or 0 "
                          "for the default (timeout_ms 5000) or no limit (max_pools)",
                          cfg.timeout_ms < 0 ? "timeout_ms" : "max_pools",
                          cfg.timeout_ms < 0 ? cfg.timeout_ms : cfg.max_pools);
    c = calloc(1, sizeof *c);
    if (c == NULL) return vmmt__fail(VMMT_ENOMEM, "vmmt_consumer_create: no host memory");
    c->cfg = cfg;
    if (c->cfg.timeout_ms == 0) c->cfg.timeout_ms = 5000;
    if (vmmt__acker_create(&c->acker) != VMMT_OK) {
        free(c);
        return vmmt_last_status();
    }
    pthread_mutex_init(&c->lock, NULL);
    pthread_mutex_init(&c->failed_lock, NULL);
    *out = c;
    return VMMT_OK;
}

/* Free what the import holds on the host; its device objects are released or leaked already. */
static void forget(struct imported *ip)
{
    /* We let go of the pool but live on: the producer must not count our ranks dead. */
    vmmt__broker_link_close(ip->link, 1);
    ip->link = NULL;
    if (ip->pidfd >= 0) close(ip->pidfd);
    pthread_mutex_destroy(&ip->poll_lock);
    free(ip->slots);
    free(ip);
}

/*
 * Undo an import, each step at most once and in an order that can be
 * retried: a step that fails leaves everything after it in place, and the
 * import (already out of the cache, so no consume can see it half released)
 * is retried later. The mapping goes first: it is the device memory, the
 * costly part, and nothing else needs it gone before itself.
 */
static int release_pool(struct imported *ip)
{
    const struct vmmt_drv *d = vmmt__drv();
    int st;

    if (ip->chunks != NULL) {
        st = vmmt__ctx_enter(ip->device);
        if (st == VMMT_OK) {
            st = vmmt__chunk_map_destroy(ip->chunks);
            vmmt__ctx_leave();
        }
        if (st != VMMT_OK) return st;
        ip->chunks = NULL;
    }
    /* An elastic pool's map only lends the chunk map's base: it holds nothing. */
    st = vmmt__mapping_release(&ip->map);
    if (st != VMMT_OK) return st;
    if (ip->poll_stream != NULL || ip->poll_word != NULL || ip->ctrl.host != NULL) {
        st = vmmt__ctx_enter(ip->device);
        if (st != VMMT_OK) return st;
        if (ip->poll_stream != NULL) {
            /* A failed synchronize leaves only reads of ready words, into
             * poll_word, which stays until the stream is gone. */
            CUresult r = d->cuStreamSynchronize(ip->poll_stream);
            if (r != CUDA_SUCCESS)
                vmmt__log(VMMT_LOG_WARN, "synchronizing the ready-flag polling stream failed (%s)",
                          vmmt__cu_name(r));
            r = d->cuStreamDestroy(ip->poll_stream);
            if (r != CUDA_SUCCESS) {
                vmmt__ctx_leave();
                return vmmt__cu_fail(r, "releasing the ready-flag polling stream");
            }
            ip->poll_stream = NULL;
        }
        if (ip->poll_word != NULL) {
            CUresult r = d->cuMemFreeHost(ip->poll_word);
            if (r != CUDA_SUCCESS) {
                vmmt__ctx_leave();
                return vmmt__cu_fail(r, "cuMemFreeHost(ready-flag polling word)");
            }
            ip->poll_word = NULL;
        }
        vmmt__ctrl_release(&ip->ctrl); /* logs what it cannot undo */
        vmmt__ctx_leave();
    }
    forget(ip);
    return VMMT_OK;
}

/* A teardown failed: say so, and keep the import aside for a retry; lock held. */
static void retire_failed(vmmt_consumer *c, struct imported *ip, const char *why)
{
    vmmt__log(VMMT_LOG_ERROR,
              "%s the pool of producer pid %d failed (%s); it is no longer used and its "
              "release is retried at the next eviction and at vmmt_consumer_destroy",
              why, ip->geometry.producer_pid, vmmt_last_error());
    ip->next = c->retired;
    c->retired = ip;
}

/*
 * Take ip out of the cache (so no consume can find it again), then tear it
 * down; a teardown that fails is retired, never left cached half released.
 * Lock held; the caller's message survives.
 */
static void let_go(vmmt_consumer *c, struct imported **link, const char *why)
{
    struct imported *ip = *link;
    struct vmmt__saved_error e;

    *link = ip->next;
    c->count--;
    vmmt__watch_remove(c, ip);
    vmmt__error_save(&e);
    if (release_pool(ip) != VMMT_OK) retire_failed(c, ip, why);
    vmmt__error_restore(&e);
}

/* Retry the teardowns that failed before; lock held. */
static void retry_retired(vmmt_consumer *c)
{
    struct imported *list = c->retired;
    struct vmmt__saved_error e;

    if (list == NULL) return;
    c->retired = NULL;
    vmmt__error_save(&e);
    while (list != NULL) {
        struct imported *ip = list;
        list = ip->next;
        if (release_pool(ip) != VMMT_OK) {
            ip->next = c->retired;
            c->retired = ip;
        }
    }
    vmmt__error_restore(&e);
}

static int copies(const struct imported *ip);

/* The pool record a descriptor's pool must have (ctrl.h); the key is the record's to give. */
static struct vmmt__ctrl_record record_of(const struct vmmt__desc *d)
{
    struct vmmt__ctrl_record r;

    memset(&r, 0, sizeof r);
    r.slots = d->table_slots;
    r.stride = d->slot_stride;
    r.consumers = d->consumer_count;
    memcpy(r.pool_id, d->pool_id, sizeof r.pool_id);
    r.table_offset = d->table_offset;
    r.data_offset = d->data_offset;
    return r;
}

/* For the chunk map, before it finds a chunk held by a queued copy: the copies done let go. */
static void flush(void *arg)
{
    struct imported *ip = arg;

    if (copies(ip) > 0) vmmt__acker_flush(ip->owner->acker);
}

/*
 * An elastic pool: the broker serves the shared table under the pool's id
 * (its chunks come one by one, on first use); the range is reserved now.
 */
static int import_chunked(vmmt_consumer *c, const struct vmmt__desc *d, struct imported *ip)
{
    uint64_t table = (uint64_t)d->table_slots * d->slot_stride;
    struct vmmt__ctrl_record rec = record_of(d);
    struct vmmt__broker_peer producer;
    int fd = -1, st;

    /* Only the producer named by the descriptor may hand us its pool. */
    vmmt__broker_expect(d->producer_uid, d->producer_pid, d->producer_pidns, &producer);
    st = vmmt__broker_fetch_fds_pidfd(&d->broker, d->pool_id, &producer, c->cfg.timeout_ms, &fd, 1,
                                      &ip->link, &ip->pidfd);
    if (st == VMMT_OK)
        st = vmmt__ctrl_attach_shared(
            fd, table + vmmt__elastic_words_bytes(d->alloc_size, d->chunk_size), &rec, 0,
            &ip->ctrl);
    if (st == VMMT_OK) memcpy(ip->seal_key, rec.key, sizeof ip->seal_key);
    if (fd >= 0) close(fd);
    if (st == VMMT_OK)
        st = vmmt__chunk_map_create(ip->device, d, c->cfg.timeout_ms, flush, ip, &ip->chunks);
    if (st != VMMT_OK) {
        vmmt__ctrl_release(&ip->ctrl);
        vmmt__broker_link_close(ip->link, 1);
        ip->link = NULL;
        if (ip->pidfd >= 0) {
            close(ip->pidfd);
            ip->pidfd = -1;
        }
        return st;
    }
    /* The mapping object holds nothing: it only lends its base to the copies. */
    ip->map.base = vmmt__chunk_map_base(ip->chunks);
    ip->map.size = d->alloc_size;
    return VMMT_OK;
}

/* Fetch the allocation's fd (and the shared control table's) from the broker; map both. */
static int import_posix(vmmt_consumer *c, const struct vmmt__desc *d, struct imported *ip)
{
    int fds[2] = {-1, -1}, want = ip->host_table ? 2 : 1, st;
    double t0 = vmmt__now_us(), t1 = t0, t2 = t0;
    struct vmmt__broker_peer producer;

    /* Only the producer named by the descriptor may hand us its pool; the connection stays
     * open as our liveness link, and gives the producer's pidfd for the death watch. */
    vmmt__broker_expect(d->producer_uid, d->producer_pid, d->producer_pidns, &producer);
    st = vmmt__broker_fetch_fds_pidfd(&d->broker, d->pool_id, &producer, c->cfg.timeout_ms, fds,
                                      want, &ip->link, &ip->pidfd);
    t1 = vmmt__now_us();
    if (st == VMMT_OK)
        st = vmmt__mapping_import_posix_fd(ip->device, fds[0], d->alloc_size, &ip->map);
    t2 = vmmt__now_us();
    if (st == VMMT_OK && ip->host_table) {
        struct vmmt__ctrl_record rec = record_of(d);
        st = vmmt__ctrl_attach_shared(fds[1], (size_t)d->table_slots * d->slot_stride, &rec, 0,
                                      &ip->ctrl);
        if (st == VMMT_OK) memcpy(ip->seal_key, rec.key, sizeof ip->seal_key);
        if (st != VMMT_OK) {
            struct vmmt__saved_error e;
            vmmt__error_save(&e);
            if (vmmt__mapping_release(&ip->map) != VMMT_OK)
                vmmt__log(VMMT_LOG_ERROR,
                          "releasing a pool whose control table could not be attached failed "
                          "(%s); its mapping is leaked",
                          vmmt_last_error());
            vmmt__error_restore(&e);
        }
    }
    for (int i = 0; i < 2; i++)
        if (fds[i] >= 0) close(fds[i]);
    if (st != VMMT_OK) {
        vmmt__broker_link_close(ip->link, 1);
        ip->link = NULL;
        if (ip->pidfd >= 0) close(ip->pidfd);
        ip->pidfd = -1;
    }
    /* Where an attach spends its time, for VMMT_LOG=debug. */
    vmmt__log(VMMT_LOG_DEBUG,
              "attach of pool from pid %d: broker %.1f us, import+map+access %.1f us, "
              "control table %.1f us",
              d->producer_pid, t1 - t0, t2 - t1, vmmt__now_us() - t2);
    return st;
}

/*
 * A device table's pool record (ctrl.h), at the allocation's offset 0: the
 * pool it describes against the descriptor, and the seal key.
 */
static int read_device_record(vmmt_consumer *c, const struct vmmt__desc *d, struct imported *ip)
{
    struct vmmt__ctrl_record rec = record_of(d);
    CUdeviceptr at = ip->map.base; /* offset 0: no descriptor field says where */
    struct timespec until;
    int st;

    vmmt__deadline(&until, (int64_t)c->cfg.timeout_ms * 1000);
    st = vmmt__ctx_enter(ip->device);
    if (st != VMMT_OK) return st;
    pthread_mutex_lock(&ip->poll_lock);
    st = vmmt__table_open_poll(ip);
    if (st == VMMT_OK)
        st = vmmt__table_read_words(ip, at, VMMT__CTRL_RECORD_BYTES / 4, &until, c->cfg.timeout_ms);
    if (st == VMMT_OK)
        st = vmmt__ctrl_record_check((const uint8_t *)ip->poll_word, &rec,
                                     "the control table in the pool's memory");
    pthread_mutex_unlock(&ip->poll_lock);
    vmmt__ctx_leave();
    if (st == VMMT_OK) memcpy(ip->seal_key, rec.key, sizeof ip->seal_key);
    return st;
}

static void make_room(vmmt_consumer *c, uint64_t size);

/* Fetch the handle, import and map; lock held (imports are rare and serial). */
static int import_pool(vmmt_consumer *c, const struct vmmt__desc *d, int device,
                       struct imported **out)
{
    struct imported *ip = calloc(1, sizeof *ip);
    int st;

    if (ip == NULL) return vmmt__fail(VMMT_ENOMEM, "no host memory to import a pool");
    ip->owner = c;
    ip->geometry = *d;
    ip->device = device;
    ip->host_table = (d->flags & VMMT__DESC_HOST_TABLE) != 0;
    ip->ctrl.fd = -1;
    ip->pidfd = -1;
    ip->serial = ++c->serials;
    pthread_mutex_init(&ip->poll_lock, NULL);
    if (d->handle_type == VMMT_HANDLE_FABRIC) {
        CUmemFabricHandle f;
        memcpy(f.data, d->fabric, sizeof f.data);
        st = vmmt__mapping_import_fabric(device, &f, d->alloc_size, &ip->map);
    } else if (d->chunk_size != 0) {
        make_room(c, d->alloc_size);
        st = vmmt__ctx_enter(device);
        if (st == VMMT_OK) {
            st = import_chunked(c, d, ip);
            vmmt__ctx_leave();
        }
    } else {
        st = import_posix(c, d, ip);
    }
    ip->table = ip->host_table ? 0 : ip->map.base + d->table_offset;
    /* After the import, which checked table_slots against what the producer really serves. */
    if (st == VMMT_OK) {
        int kept = ip->host_table ? VMMT_OK : read_device_record(c, d, ip);
        if (kept == VMMT_OK) {
            ip->slots = calloc(d->table_slots, sizeof *ip->slots);
            if (ip->slots == NULL)
                kept = vmmt__fail(VMMT_ENOMEM, "no host memory for %u slot states", d->table_slots);
        }
        if (kept != VMMT_OK) {
            struct vmmt__saved_error e;
            st = kept;
            vmmt__error_save(&e);
            if (release_pool(ip) != VMMT_OK) retire_failed(c, ip, "releasing an import in vain of");
            vmmt__error_restore(&e);
            return vmmt__wrap(st, "importing the pool of producer pid %d (device %d) on device %d",
                              d->producer_pid, d->producer_device, device);
        }
    }
    if (st != VMMT_OK) {
        pthread_mutex_destroy(&ip->poll_lock);
        free(ip);
        return vmmt__wrap(st, "importing the pool of producer pid %d (device %d) on device %d",
                          d->producer_pid, d->producer_device, device);
    }
    ip->next = c->pools;
    c->pools = ip;
    c->count++;
    /* Without the watch the pool still works; a death is then noticed only
     * by later calls on the pool (consume, check, destroy). */
    if (vmmt__watch_add(c, ip) != VMMT_OK)
        vmmt__log(VMMT_LOG_WARN,
                  "the death of producer pid %d will be noticed only by later calls on its "
                  "pool: %s",
                  d->producer_pid, vmmt_last_error());
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

static int copies(const struct imported *ip)
{
    return __atomic_load_n(&ip->copies, __ATOMIC_ACQUIRE);
}

/*
 * Can ip be let go without harm? No call uses it, every copy out of it is
 * known complete (its event was seen; its acknowledgement is written), and no
 * packed group is half consumed (its progress would be lost) unless its
 * producer is gone.
 */
static int idle(const struct imported *ip)
{
    return ip->users == 0 && copies(ip) == 0 && (ip->open_groups == 0 || ip->dead);
}

/* The least recently used idle pool other than `except` (elastic ones only, if asked). */
static struct imported **lru_idle(vmmt_consumer *c, const struct imported *except, int elastic)
{
    struct imported **victim = NULL;

    for (int pass = 0; pass < 2 && victim == NULL; pass++) {
        /* Copies that finished a moment ago count as done once the acker has
         * seen them; it never takes the consumer's lock, so it can be asked. */
        if (pass == 1) vmmt__acker_flush(c->acker);
        for (struct imported **pp = &c->pools; *pp != NULL; pp = &(*pp)->next)
            if (*pp != except && (!elastic || (*pp)->chunks != NULL) && idle(*pp) &&
                (victim == NULL || (*pp)->last_used < (*victim)->last_used))
                victim = pp;
    }
    return victim;
}

/*
 * An elastic pool of at most `size` bytes is about to be imported: while the
 * process's elastic imports would reserve more than they may with it, let go
 * of this cache's idle elastic pools, least recently used first. Lock held.
 */
static void make_room(vmmt_consumer *c, uint64_t size)
{
    struct imported **victim;

    while (vmmt__chunk_reserved() + size > VMMT__ELASTIC_RESERVE_MAX &&
           (victim = lru_idle(c, NULL, 1)) != NULL) {
        vmmt__log(VMMT_LOG_INFO,
                  "evicting the least recently used elastic pool (producer pid %d): importing "
                  "another would reserve more address space than elastic imports may",
                  (*victim)->geometry.producer_pid);
        let_go(c, victim, "evicting");
    }
}

/*
 * Over max_pools: let go of the least recently used idle pool other than
 * `except`. Where none is idle, eviction waits for a later call: the cache
 * may hold more than max_pools for as long as their copies are queued. Lock
 * held.
 */
static void evict_idle(vmmt_consumer *c, const struct imported *except)
{
    struct imported **victim;

    retry_retired(c);
    if (c->cfg.max_pools == 0 || c->count <= c->cfg.max_pools) return;
    victim = lru_idle(c, except, 0);
    if (victim == NULL) {
        vmmt__log(VMMT_LOG_DEBUG,
                  "%d pools imported, max_pools=%d: none is idle (copies queued), so "
                  "eviction waits",
                  c->count, c->cfg.max_pools);
        return;
    }
    vmmt__log(VMMT_LOG_INFO,
              "evicting the least recently used pool (producer pid %d): more than max_pools=%d "
              "imported",
              (*victim)->geometry.producer_pid, c->cfg.max_pools);
    let_go(c, victim, "evicting");
}

void vmmt__cache_reap(struct vmmt_consumer *c)
{
    struct imported **pp = &c->pools;

    retry_retired(c);
    while (*pp != NULL) {
        if ((*pp)->dead && idle(*pp)) {
            vmmt__log(VMMT_LOG_INFO,
                      "letting go of the pool of producer pid %d: the producer is gone and "
                      "every copy out of it is done",
                      (*pp)->geometry.producer_pid);
            let_go(c, pp, "letting go of");
        } else {
            pp = &(*pp)->next;
        }
    }
}

static int producer_gone(const struct vmmt__desc *d)
{
    return vmmt__fail(VMMT_ECLOSED,
                      "the producer (pid %d) of this pool has exited or shut its pool down; "
                      "nothing more can be "
                      "consumed from it (vmmt_consumer_check reports descriptors consumed before "
                      "their bytes were ready): drop the request",
                      d->producer_pid);
}

int vmmt__cache_get(struct vmmt_consumer *c, const uint8_t bytes[VMMT_DESC_SIZE],
                    const struct vmmt__desc *d, int device, struct imported **out)
{
    struct imported **link = NULL;
    int st;

    *out = find(c, d->pool_id, device, NULL);
    if (*out != NULL) {
        st = vmmt__desc_check_seal(bytes, (*out)->seal_key);
        if (st == VMMT_OK) st = vmmt__desc_check_pool(d, &(*out)->geometry);
        if (st == VMMT_OK && vmmt__cache_producer_gone(c, *out, 0)) st = producer_gone(d);
    } else if (vmmt__cache_known_dead(c, d->pool_id)) {
        return producer_gone(d);
    } else {
        st = import_pool(c, d, device, out);
        /* The import's record of the pool is this descriptor: it must be the producer's. */
        if (st == VMMT_OK && (st = vmmt__desc_check_seal(bytes, (*out)->seal_key)) != VMMT_OK) {
            find(c, d->pool_id, device, &link);
            let_go(c, link, "letting go of a pool imported with a forged descriptor,");
            *out = NULL;
        }
    }
    /* Here, on every call, not once the consume succeeds: one that fails from here
     * on (a stale descriptor) has still imported its pool. Not the pool asked for:
     * it is not in use yet, but about to be. */
    if (*out != NULL) evict_idle(c, *out);
    return st;
}

void vmmt__cache_use(struct vmmt_consumer *c, struct imported *ip)
{
    ip->users++;
    ip->last_used = ++c->clock;
}

void vmmt__cache_unuse(struct vmmt_consumer *c, struct imported *ip)
{
    pthread_mutex_lock(&c->lock);
    ip->users--;
    pthread_mutex_unlock(&c->lock);
}

int vmmt_consumer_evict(vmmt_consumer *c, const uint8_t pool_id[16], int device)
{
    struct imported **link, *ip;
    int st = VMMT_OK;

    if (c == NULL || pool_id == NULL)
        return vmmt__fail(VMMT_EINVAL, "vmmt_consumer_evict: consumer and pool_id are required");
    /* Copies known done release the pool only once their events are seen. */
    vmmt__acker_flush(c->acker);
    pthread_mutex_lock(&c->lock);
    retry_retired(c);
    ip = find(c, pool_id, device, &link);
    if (ip != NULL && (ip->users > 0 || copies(ip) > 0)) {
        st = vmmt__fail(VMMT_ESTATE,
                        "cannot evict the pool: %d consume or acknowledge call(s), or copies "
                        "out of it not yet finished, are using it; synchronize the streams that "
                        "consumed from it and evict again",
                        ip->users + copies(ip));
    } else if (ip != NULL && !idle(ip)) {
        st = vmmt__fail(VMMT_ESTATE,
                        "cannot evict the pool: %d packed group(s) are partly consumed in this "
                        "process; consume or acknowledge their other members first",
                        ip->open_groups);
    } else if (ip != NULL) {
        *link = ip->next;
        c->count--;
        vmmt__watch_remove(c, ip);
        st = release_pool(ip);
        if (st != VMMT_OK) {
            retire_failed(c, ip, "evicting");
            st = vmmt__wrap(st, "vmmt_consumer_evict: the pool is no longer used; its release "
                                "is retried later");
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

/*
 * Bounded by the consumer's timeout: producers found dead get their ready
 * words set by us, so our streams do not wait on them; acknowledgements
 * whose copies finish within the timeout are written; a pool with a copy
 * still queued after that keeps its mapping (logged), since unmapping it
 * could fault the stream.
 */
void vmmt_consumer_destroy(vmmt_consumer *c)
{
    int abandoned;

    if (c == NULL) return;
    vmmt__watch_stop(c);
    pthread_mutex_lock(&c->lock);
    for (struct imported *ip = c->pools; ip != NULL; ip = ip->next)
        vmmt__cache_producer_gone(c, ip, 1);
    pthread_mutex_unlock(&c->lock);
    abandoned = vmmt__acker_finish(c->acker, c->cfg.timeout_ms);
    vmmt__acker_destroy(c->acker);
    pthread_mutex_lock(&c->lock);
    retry_retired(c);
    while (c->pools != NULL) {
        struct imported *ip = c->pools;
        c->pools = ip->next;
        if (ip->users > 0 || copies(ip) > 0) {
            vmmt__log(VMMT_LOG_ERROR,
                      "vmmt_consumer_destroy: %d copies out of the pool of producer pid %d "
                      "were still queued after %d ms; its mapping is kept (leaked) rather "
                      "than unmapped under them",
                      ip->users + copies(ip), ip->geometry.producer_pid, c->cfg.timeout_ms);
            forget(ip);
            continue;
        }
        if (release_pool(ip) != VMMT_OK) retire_failed(c, ip, "releasing");
    }
    retry_retired(c);
    while (c->retired != NULL) {
        struct imported *ip = c->retired;
        c->retired = ip->next;
        vmmt__log(VMMT_LOG_ERROR,
                  "vmmt_consumer_destroy: the pool of producer pid %d could not be released; "
                  "what is left of it is leaked",
                  ip->geometry.producer_pid);
        forget(ip);
    }
    if (abandoned > 0)
        vmmt__log(VMMT_LOG_ERROR,
                  "vmmt_consumer_destroy: %d acknowledgements not written (copies still "
                  "queued after %d ms); their slices stay held in the producer",
                  abandoned, c->cfg.timeout_ms);
    pthread_mutex_unlock(&c->lock);
    pthread_mutex_destroy(&c->failed_lock);
    pthread_mutex_destroy(&c->lock);
    free(c);
}
