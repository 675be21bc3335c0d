/*
 * The consumer: a per-process cache of imported pools, and consume/ack.
 * The first consume of a pool fetches its handle (from the broker, or the
 * FABRIC handle inside the descriptor), imports and maps it for the
 * consumer's device. Later consumes cost one wait, one copy and one
 * acknowledgement write per rank, all enqueued on the caller's stream.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "acker.h"
#include "broker.h"
#include "clock.h"
#include "ctrl.h"
#include "desc.h"
#include "driver.h"
#include "status.h"
#include "vmm.h"

/*
 * A packed group being consumed for one rank range: which members are done
 * and the stream they were copied on. Its acknowledgement goes on that
 * stream after the last member, so it can never overtake a member's copy.
 */
struct pack_group {
    uint32_t first, count;
    uint64_t members;
    CUstream stream;
};

#define PACK_GROUPS 4

/* What this process has done with one slot's current occupant. */
struct slot_state {
    uint32_t generation;
    uint64_t ranks_acked[VMMT__MAX_CONSUMERS / 64];
    struct pack_group groups[PACK_GROUPS];
};

struct imported {
    struct vmmt_consumer *owner;
    struct vmmt__desc geometry; /* the pool-wide fields of the first descriptor */
    int device;
    struct vmmt__mapping map;
    int host_table; /* the control table is the shared memfd in ctrl, read and written by CPU */
    struct vmmt__ctrl ctrl;
    struct vmmt__broker_link *link; /* POSIX_FD: open while we use the pool (liveness) */
    CUdeviceptr table;              /* the control table as streams address it */
    struct slot_state *slots;
    int users; /* consume and ack calls using the mapping, and acknowledgements not yet written */
    uint64_t last_used; /* consumer->clock at the last consume or ack */
    /* Host polling of ready words where a stream may not wait on them. */
    pthread_mutex_t poll_lock;
    CUstream poll_stream;
    uint32_t *poll_word;
    struct imported *next;
};

struct vmmt_consumer {
    vmmt_consumer_config cfg;
    uint64_t clock;            /* counts consume and ack calls, for least-recently-used eviction */
    struct vmmt__acker *acker; /* acknowledgements of shared-host-table pools */
    pthread_mutex_t lock;
    struct imported *pools;
    int count;
};

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
    /* We let go of the pool but live on: the producer must not count our ranks dead. */
    vmmt__broker_link_close(ip->link, 1);
    ip->link = NULL;
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
    struct vmmt__broker_peer producer;

    /* Only the producer named by the descriptor may hand us its pool. */
    vmmt__broker_expect(d->producer_uid, d->producer_pid, d->producer_pidns, &producer);
    st = vmmt__broker_fetch_fds(&d->broker, d->pool_id, &producer, c->cfg.timeout_ms, fds, want,
                                &ip->link);
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
    if (st != VMMT_OK) {
        vmmt__broker_link_close(ip->link, 1);
        ip->link = NULL;
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
    /* After the import, which checked table_slots against what the producer really serves. */
    if (st == VMMT_OK) {
        ip->slots = calloc(d->table_slots, sizeof *ip->slots);
        if (ip->slots == NULL) {
            struct vmmt__saved_error e;
            st = vmmt__fail(VMMT_ENOMEM, "no host memory for %u slot states", d->table_slots);
            vmmt__error_save(&e);
            if (release_pool(ip) != VMMT_OK)
                vmmt__log(VMMT_LOG_ERROR, "releasing a pool imported in vain: %s",
                          vmmt_last_error());
            return vmmt__error_restore(&e);
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

struct request {
    struct vmmt__desc d;
    struct imported *pool;
    CUstream stream;
    uint32_t first, count; /* ranks */
    int ack_now;           /* this call completes the slot for these ranks */
};

static int resolve_ranks(const struct vmmt__desc *d, int first, int count, struct request *rq)
{
    if (first == VMMT_ALL_RANKS) {
        rq->first = 0;
        rq->count = d->consumer_count;
        return VMMT_OK;
    }
    if (first < 0 || count <= 0 || (uint64_t)first + (uint64_t)count > d->consumer_count)
        return vmmt__fail(VMMT_EINVAL,
                          "ranks [%d, %d+%d) are outside the pool's %u consumer ranks; use "
                          "0..%u or VMMT_ALL_RANKS",
                          first, first, count, d->consumer_count, d->consumer_count - 1);
    rq->first = (uint32_t)first;
    rq->count = (uint32_t)count;
    return VMMT_OK;
}

static int ranks_overlap(const struct slot_state *s, uint32_t first, uint32_t count)
{
    for (uint32_t r = first; r < first + count; r++)
        if (s->ranks_acked[r / 64] & (1ull << (r % 64))) return 1;
    return 0;
}

static void mark_acked(struct slot_state *s, uint32_t first, uint32_t count)
{
    for (uint32_t r = first; r < first + count; r++)
        s->ranks_acked[r / 64] |= 1ull << (r % 64);
}

static int fail_twice(const struct request *rq)
{
    return vmmt__fail(VMMT_ESTATE,
                      "descriptor (slot %u, generation %u, member %u) was already consumed or "
                      "acknowledged for ranks [%u, %u) in this process",
                      rq->d.slot, rq->d.generation, rq->d.pack_index, rq->first,
                      rq->first + rq->count);
}

/* The group for this rank range, or a free one; NULL with an error if neither. */
static struct pack_group *group_for(struct slot_state *s, const struct request *rq)
{
    struct pack_group *free_group = NULL;

    for (int i = 0; i < PACK_GROUPS; i++) {
        struct pack_group *g = &s->groups[i];
        if (g->members != 0 && g->first == rq->first && g->count == rq->count) {
            if (g->stream != rq->stream) {
                vmmt__fail(VMMT_EINVAL,
                           "members of packed slot %u are being consumed on another stream; "
                           "consume every member of a packed group on one stream, so its "
                           "single acknowledgement follows all the copies",
                           rq->d.slot);
                return NULL;
            }
            return g;
        }
        if (g->members == 0 && free_group == NULL) free_group = g;
    }
    if (ranks_overlap(s, rq->first, rq->count)) {
        fail_twice(rq);
        return NULL;
    }
    if (free_group == NULL) {
        vmmt__fail(VMMT_EINVAL,
                   "packed slot %u is being consumed for more than %d rank ranges at once in "
                   "this process; consume it with fewer distinct rank ranges",
                   rq->d.slot, PACK_GROUPS);
        return NULL;
    }
    free_group->first = rq->first;
    free_group->count = rq->count;
    free_group->stream = rq->stream;
    return free_group;
}

/*
 * Record the consume in this process's slot state, refusing a descriptor
 * consumed before or one whose slot has moved on; consumer lock held.
 */
static int claim(struct request *rq)
{
    struct slot_state *s = &rq->pool->slots[rq->d.slot];
    uint64_t bit = 1ull << rq->d.pack_index;
    uint64_t all = rq->d.pack_count >= 64 ? ~0ull : (1ull << rq->d.pack_count) - 1;
    struct pack_group *g;

    if (s->generation != rq->d.generation) {
        if (s->generation != 0 && (int32_t)(rq->d.generation - s->generation) < 0)
            return vmmt__fail(VMMT_ESTATE,
                              "descriptor for slot %u generation %u is stale: this process "
                              "already saw generation %u there",
                              rq->d.slot, rq->d.generation, s->generation);
        memset(s, 0, sizeof *s);
        s->generation = rq->d.generation;
    }
    if (rq->d.pack_count <= 1) {
        if (ranks_overlap(s, rq->first, rq->count)) return fail_twice(rq);
        mark_acked(s, rq->first, rq->count);
        rq->ack_now = 1;
        return VMMT_OK;
    }
    g = group_for(s, rq);
    if (g == NULL) return vmmt_last_status();
    if (g->members & bit) return fail_twice(rq);
    g->members |= bit;
    if ((g->members & all) == all) {
        rq->ack_now = 1;
        mark_acked(s, rq->first, rq->count);
        memset(g, 0, sizeof *g);
    }
    return VMMT_OK;
}

/* dst_size is the room at dst, or UINT64_MAX when nothing is copied. */
static int prepare(vmmt_consumer *c, const vmmt_desc *desc, int device, int first, int count,
                   uint64_t dst, uint64_t dst_size, CUstream stream, struct request *rq)
{
    int st;

    if (c == NULL || desc == NULL)
        return vmmt__fail(VMMT_EINVAL, "consumer and descriptor must not be NULL");
    memset(rq, 0, sizeof *rq);
    rq->stream = stream;
    st = vmmt__desc_decode(desc->bytes, &rq->d);
    if (st == VMMT_OK) st = resolve_ranks(&rq->d, first, count, rq);
    if (st != VMMT_OK) return st;
    if (dst_size != UINT64_MAX && (dst == 0 || dst_size < rq->d.nbytes))
        return vmmt__fail(VMMT_EINVAL,
                          "destination has %" PRIu64 " bytes at 0x%" PRIx64
                          "; the buffer needs %" PRIu64,
                          dst_size, dst, rq->d.nbytes);
    pthread_mutex_lock(&c->lock);
    rq->pool = find(c, rq->d.pool_id, device, NULL);
    if (rq->pool != NULL)
        st = vmmt__desc_check_pool(&rq->d, &rq->pool->geometry);
    else
        st = import_pool(c, &rq->d, device, &rq->pool);
    if (st == VMMT_OK) st = claim(rq);
    /* Before any copy or acknowledgement: should we die from here on, the producer knows
     * which ranks to release. Liveness is best effort; the consume does not depend on it. */
    if (st == VMMT_OK && rq->pool->link != NULL &&
        vmmt__broker_link_hold(rq->pool->link, rq->first, rq->count) != VMMT_OK)
        vmmt__log(VMMT_LOG_INFO, "liveness link: %s", vmmt_last_error());
    if (st == VMMT_OK) {
        rq->pool->users++;
        rq->pool->last_used = ++c->clock;
        evict_idle(c);
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}

static void done(vmmt_consumer *c, struct request *rq)
{
    pthread_mutex_lock(&c->lock);
    rq->pool->users--;
    pthread_mutex_unlock(&c->lock);
}

/* Read the ready word on the pool's own stream, within the deadline. */
static int poll_once(const struct imported *ip, CUdeviceptr word, const struct timespec *until,
                     int timeout_ms)
{
    const struct vmmt_drv *d = vmmt__drv();
    struct timespec pause = {0, 10000};
    CUresult r;

    r = d->cuMemcpyDtoHAsync(ip->poll_word, word, sizeof *ip->poll_word, ip->poll_stream);
    if (r != CUDA_SUCCESS) return vmmt__cu_fail(r, "reading the ready flag");
    for (;;) {
        r = d->cuStreamQuery(ip->poll_stream);
        if (r != CUDA_ERROR_NOT_READY) break;
        if (vmmt__deadline_passed(until))
            return vmmt__fail(VMMT_ETIMEDOUT,
                              "reading the producer's ready flag took more than %d ms; the "
                              "device is busy or stalled",
                              timeout_ms);
        nanosleep(&pause, NULL);
    }
    return r == CUDA_SUCCESS ? VMMT_OK : vmmt__cu_fail(r, "reading the ready flag");
}

/* The ready word as the host sees it now: a plain load, or a copy through the pool's stream. */
static int read_ready(struct imported *ip, const struct request *rq, CUdeviceptr word,
                      const struct timespec *until, int timeout_ms, uint32_t *v)
{
    int st;

    if (ip->host_table) {
        *v =
            vmmt__ctrl_load(ip->ctrl.host + vmmt__ctrl_ready(0, rq->d.slot_stride, rq->d.slot) / 4);
        return VMMT_OK;
    }
    st = poll_once(ip, word, until, timeout_ms);
    if (st == VMMT_OK) *v = *ip->poll_word;
    return st;
}

/*
 * The driver refused a stream wait on the ready word: watch it from the host
 * instead, within the consumer's timeout. A device table is read on a stream
 * of the pool's own: the legacy stream would queue behind the application's
 * work.
 */
static int host_wait(vmmt_consumer *c, const struct request *rq, CUdeviceptr word)
{
    const struct vmmt_drv *d = vmmt__drv();
    struct imported *ip = rq->pool;
    struct timespec until, pause = {0, 20000};
    uint32_t gen = rq->d.generation, v = 0;
    int st = VMMT_OK;

    vmmt__deadline(&until, (int64_t)c->cfg.timeout_ms * 1000);
    pthread_mutex_lock(&ip->poll_lock);
    if (!ip->host_table && ip->poll_stream == NULL) {
        st = VMMT_CU(d, cuStreamCreate(&ip->poll_stream, CU_STREAM_NON_BLOCKING));
        if (st == VMMT_OK) st = VMMT_CU(d, cuMemAllocHost((void **)&ip->poll_word, 4));
    }
    while (st == VMMT_OK) {
        st = read_ready(ip, rq, word, &until, c->cfg.timeout_ms, &v);
        if (st != VMMT_OK || v == gen) break;
        if ((int32_t)(v - gen) > 0) {
            st = vmmt__fail(VMMT_ESTATE,
                            "slot holds a newer occupant (generation %u, the descriptor names "
                            "%u): the descriptor was cancelled and its slot reused",
                            v, gen);
            break;
        }
        if (vmmt__deadline_passed(&until)) {
            st = vmmt__fail(VMMT_ETIMEDOUT,
                            "the producer's ready flag did not reach generation %u within %d "
                            "ms (it reads %u); is the producer alive?",
                            gen, c->cfg.timeout_ms, v);
            break;
        }
        nanosleep(&pause, NULL);
    }
    pthread_mutex_unlock(&ip->poll_lock);
    return st;
}

/* Register a shared table on first need; a failure only means host polling. */
static int registered_table(struct imported *ip)
{
    int st;

    pthread_mutex_lock(&ip->poll_lock);
    st = vmmt__ctrl_register(&ip->ctrl);
    pthread_mutex_unlock(&ip->poll_lock);
    if (st != VMMT_OK)
        vmmt__log(VMMT_LOG_INFO, "control table not registered (%s); ready flags are polled",
                  vmmt_last_error());
    return st;
}

/*
 * Order the copy after the producer's. With a shared host table the flag is
 * usually set already and a load proves it, so the stream needs no wait.
 */
static int wait_ready(vmmt_consumer *c, const struct request *rq, CUstream s)
{
    const struct vmmt_drv *d = vmmt__drv();
    CUdeviceptr word = rq->pool->table + vmmt__ctrl_ready(0, rq->d.slot_stride, rq->d.slot);
    const uint32_t *host = rq->pool->ctrl.host;
    CUresult r;

    if (!(rq->d.flags & VMMT__DESC_STREAM_ORDERED)) return VMMT_OK;
    /* A shared table is read by the CPU: the flag is usually set already (the
     * descriptor travelled while the producer's copy ran). */
    if (rq->pool->host_table) {
        uint32_t v = vmmt__ctrl_load(host + vmmt__ctrl_ready(0, rq->d.slot_stride, rq->d.slot) / 4);
        if (v == rq->d.generation) return VMMT_OK;
        /* A newer occupant: this descriptor was cancelled and its slot reused;
         * a stream wait (>=) would pass and copy someone else's bytes. */
        if ((int32_t)(v - rq->d.generation) > 0)
            return vmmt__fail(VMMT_ESTATE,
                              "slot holds a newer occupant (generation %u, the descriptor names "
                              "%u): the descriptor was cancelled and its slot reused",
                              v, rq->d.generation);
        /* Not yet: let the stream wait, which needs the table registered with
         * the driver; that costs once, so it happens only on first need. */
        if (registered_table(rq->pool) != VMMT_OK) return host_wait(c, rq, 0);
        word = rq->pool->ctrl.dev + vmmt__ctrl_ready(0, rq->d.slot_stride, rq->d.slot);
    }
    r = d->cuStreamWaitValue32(s, word, rq->d.generation, CU_STREAM_WAIT_VALUE_GEQ);
    if (r == CUDA_SUCCESS) return VMMT_OK;
    return host_wait(c, rq, word);
}

static void deferred_ack_done(void *arg)
{
    struct imported *ip = arg;

    pthread_mutex_lock(&ip->owner->lock);
    ip->users--;
    pthread_mutex_unlock(&ip->owner->lock);
}

/*
 * The acknowledgements, after the copy on the same stream. A shared host
 * table gets them from the CPU once an event after the copy completes (the
 * pool stays in use until then); a device table gets stream memory writes.
 * (Those keep the memory barrier: the H200's driver refuses
 * CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER with CUDA_ERROR_INVALID_VALUE,
 * tests/gpu/RESULTS.md, 2026-11-29.)
 */
static int write_acks(vmmt_consumer *c, const struct request *rq, CUstream s, int after_copy)
{
    const struct vmmt_drv *d = vmmt__drv();
    CUdeviceptr table = rq->pool->table;
    int st;

    if (rq->pool->host_table) {
        uint32_t *first =
            rq->pool->ctrl.host + vmmt__ctrl_ack(0, rq->d.slot_stride, rq->d.slot, rq->first) / 4;
        if (!after_copy) {
            /* A dropped descriptor: no copy of ours to wait for. */
            for (uint32_t r = 0; r < rq->count; r++)
                vmmt__ctrl_store_newer(&first[r], rq->d.generation);
            return VMMT_OK;
        }
        pthread_mutex_lock(&c->lock);
        rq->pool->users++;
        pthread_mutex_unlock(&c->lock);
        st = vmmt__acker_defer(c->acker, rq->pool->device, s, first, rq->count, rq->d.generation,
                               deferred_ack_done, rq->pool);
        return st;
    }
    for (uint32_t r = rq->first; r < rq->first + rq->count; r++) {
        CUresult res =
            d->cuStreamWriteValue32(s, vmmt__ctrl_ack(table, rq->d.slot_stride, rq->d.slot, r),
                                    rq->d.generation, CU_STREAM_WRITE_VALUE_DEFAULT);
        if (res != CUDA_SUCCESS)
            return vmmt__cu_fail(res, "cuStreamWriteValue32(acknowledgement of rank %u)", r);
    }
    return VMMT_OK;
}

int vmmt_consume(vmmt_consumer *c, const vmmt_desc *desc, int device, uint64_t dst,
                 uint64_t dst_size, void *stream, int rank_first, int rank_count)
{
    struct request rq;
    CUresult r;
    int st, ack_st;

    st = vmmt__ctx_enter(device);
    if (st != VMMT_OK) return vmmt__wrap(st, "vmmt_consume");
    st = prepare(c, desc, device, rank_first, rank_count, dst, dst_size, (CUstream)stream, &rq);
    if (st != VMMT_OK) {
        vmmt__ctx_leave();
        return vmmt__wrap(st, "vmmt_consume");
    }
    st = wait_ready(c, &rq, (CUstream)stream);
    if (st == VMMT_OK) {
        r = vmmt__drv()->cuMemcpyDtoDAsync(dst, rq.pool->map.base + rq.d.offset, rq.d.nbytes,
                                           (CUstream)stream);
        if (r != CUDA_SUCCESS)
            st = vmmt__cu_fail(r, "cuMemcpyDtoDAsync(%" PRIu64 " bytes out of the pool)",
                               rq.d.nbytes);
    }
    /* Acknowledge even after a failure, so the producer gets the slice back;
     * the claim above already forbids a retry of this descriptor. */
    if (rq.ack_now) {
        struct vmmt__saved_error e;
        vmmt__error_save(&e);
        ack_st = write_acks(c, &rq, (CUstream)stream, 1);
        if (st != VMMT_OK) vmmt__error_restore(&e);
        if (st == VMMT_OK) st = ack_st;
    }
    done(c, &rq);
    vmmt__ctx_leave();
    return st == VMMT_OK ? VMMT_OK : vmmt__wrap(st, "vmmt_consume");
}

int vmmt_consumer_ack(vmmt_consumer *c, const vmmt_desc *desc, int device, void *stream,
                      int rank_first, int rank_count)
{
    struct request rq;
    int st;

    st = vmmt__ctx_enter(device);
    if (st != VMMT_OK) return vmmt__wrap(st, "vmmt_consumer_ack");
    st = prepare(c, desc, device, rank_first, rank_count, 0, UINT64_MAX, (CUstream)stream, &rq);
    if (st == VMMT_OK) {
        /* Completing a packed group may follow copies of other members on this stream. */
        if (rq.ack_now) st = write_acks(c, &rq, (CUstream)stream, rq.d.pack_count > 1);
        done(c, &rq);
    }
    vmmt__ctx_leave();
    return st == VMMT_OK ? VMMT_OK : vmmt__wrap(st, "vmmt_consumer_ack");
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
