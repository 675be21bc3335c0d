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

#include "broker.h"
#include "ctrl.h"
#include "desc.h"
#include "driver.h"
#include "status.h"
#include "vmm.h"

/* What this process has done with one slot's current occupant. */
struct slot_state {
    uint32_t generation;
    uint64_t members_done; /* packed members consumed or dropped */
    uint64_t ranks_acked[VMMT__MAX_CONSUMERS / 64];
};

struct imported {
    struct vmmt__desc geometry; /* the pool-wide fields of the first descriptor */
    int device;
    struct vmmt__mapping map;
    struct slot_state *slots;
    struct imported *next;
};

struct vmmt_consumer {
    vmmt_consumer_config cfg;
    pthread_mutex_t lock;
    struct imported *pools;
    int count;
};

void vmmt_consumer_config_init(vmmt_consumer_config *c)
{
    memset(c, 0, sizeof *c);
    c->timeout_ms = 5000;
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
    pthread_mutex_init(&c->lock, NULL);
    *out = c;
    return VMMT_OK;
}

static int release_pool(struct imported *ip)
{
    int st = vmmt__mapping_release(&ip->map);
    if (st != VMMT_OK) return st;
    free(ip->slots);
    free(ip);
    return VMMT_OK;
}

/* Fetch the handle, import and map; lock held (imports are rare and serial). */
static int import_pool(vmmt_consumer *c, const struct vmmt__desc *d, int device,
                       struct imported **out)
{
    struct imported *ip = calloc(1, sizeof *ip);
    int fd = -1, st;

    if (ip == NULL) return vmmt__fail(VMMT_ENOMEM, "no host memory to import a pool");
    ip->slots = calloc(d->table_slots, sizeof *ip->slots);
    if (ip->slots == NULL) {
        free(ip);
        return vmmt__fail(VMMT_ENOMEM, "no host memory for %u slot states", d->table_slots);
    }
    ip->geometry = *d;
    ip->device = device;
    if (d->handle_type == VMMT_HANDLE_FABRIC) {
        CUmemFabricHandle f;
        memcpy(f.data, d->fabric, sizeof f.data);
        st = vmmt__mapping_import_fabric(device, &f, d->alloc_size, &ip->map);
    } else {
        st = vmmt__broker_fetch(&d->broker, d->pool_id, c->cfg.timeout_ms, &fd);
        if (st == VMMT_OK) st = vmmt__mapping_import_posix_fd(device, fd, d->alloc_size, &ip->map);
        if (fd >= 0) close(fd);
    }
    if (st != VMMT_OK) {
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

struct request {
    struct vmmt__desc d;
    struct imported *pool;
    uint32_t first, count; /* ranks */
    int ack_now;           /* this call completes the slice for this process */
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

/*
 * Record the consume in this process's slot state, refusing a descriptor
 * consumed before or one whose slot has moved on; lock held.
 */
static int claim(struct request *rq)
{
    struct slot_state *s = &rq->pool->slots[rq->d.slot];
    uint64_t bit = 1ull << rq->d.pack_index;
    uint64_t all = rq->d.pack_count >= 64 ? ~0ull : (1ull << rq->d.pack_count) - 1;

    if (s->generation != rq->d.generation) {
        if (s->generation != 0 && (int32_t)(rq->d.generation - s->generation) < 0)
            return vmmt__fail(VMMT_ESTATE,
                              "descriptor for slot %u generation %u is stale: this process "
                              "already saw generation %u there",
                              rq->d.slot, rq->d.generation, s->generation);
        memset(s, 0, sizeof *s);
        s->generation = rq->d.generation;
    }
    if (ranks_overlap(s, rq->first, rq->count) || (rq->d.pack_count > 1 && (s->members_done & bit)))
        return vmmt__fail(VMMT_ESTATE,
                          "descriptor (slot %u, generation %u, member %u) was already consumed "
                          "or acknowledged for ranks [%u, %u) in this process",
                          rq->d.slot, rq->d.generation, rq->d.pack_index, rq->first,
                          rq->first + rq->count);
    s->members_done |= bit;
    rq->ack_now = (s->members_done & all) == all;
    if (rq->ack_now)
        for (uint32_t r = rq->first; r < rq->first + rq->count; r++)
            s->ranks_acked[r / 64] |= 1ull << (r % 64);
    return VMMT_OK;
}

/* dst_size is the room at dst, or UINT64_MAX when nothing is copied. */
static int prepare(vmmt_consumer *c, const vmmt_desc *desc, int device, int first, int count,
                   uint64_t dst, uint64_t dst_size, struct request *rq)
{
    int st;

    if (c == NULL || desc == NULL)
        return vmmt__fail(VMMT_EINVAL, "consumer and descriptor must not be NULL");
    memset(rq, 0, sizeof *rq);
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
    pthread_mutex_unlock(&c->lock);
    return st;
}

/*
 * The driver refused a stream wait on the imported word: poll it from the
 * host instead, within the consumer's timeout.
 */
static int host_wait(vmmt_consumer *c, CUdeviceptr word, uint32_t gen)
{
    const struct vmmt_drv *d = vmmt__drv();
    struct timespec pause = {0, 20000}, start, now;
    uint32_t v = 0;

    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        CUresult r = d->cuMemcpyDtoHAsync(&v, word, sizeof v, NULL);
        if (r == CUDA_SUCCESS) r = d->cuStreamSynchronize(NULL);
        if (r != CUDA_SUCCESS) return vmmt__cu_fail(r, "reading the ready flag");
        if ((int32_t)(v - gen) >= 0) return VMMT_OK;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if ((now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000 >
            c->cfg.timeout_ms)
            return vmmt__fail(VMMT_ETIMEDOUT,
                              "the producer's ready flag did not reach generation %u within %d "
                              "ms (it reads %u); is the producer alive?",
                              gen, c->cfg.timeout_ms, v);
        nanosleep(&pause, NULL);
    }
}

static int wait_ready(vmmt_consumer *c, const struct request *rq, CUstream s)
{
    const struct vmmt_drv *d = vmmt__drv();
    CUdeviceptr word =
        rq->pool->map.base + vmmt__ctrl_ready(rq->d.table_offset, rq->d.slot_stride, rq->d.slot);
    CUresult r;

    if (!(rq->d.flags & VMMT__DESC_STREAM_ORDERED)) return VMMT_OK;
    r = d->cuStreamWaitValue32(s, word, rq->d.generation, CU_STREAM_WAIT_VALUE_GEQ);
    if (r == CUDA_SUCCESS) return VMMT_OK;
    return host_wait(c, word, rq->d.generation);
}

static int write_acks(const struct request *rq, CUstream s)
{
    const struct vmmt_drv *d = vmmt__drv();
    CUdeviceptr table = rq->pool->map.base + rq->d.table_offset;

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
    st = prepare(c, desc, device, rank_first, rank_count, dst, dst_size, &rq);
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
        ack_st = write_acks(&rq, (CUstream)stream);
        if (st != VMMT_OK) vmmt__error_restore(&e);
        if (st == VMMT_OK) st = ack_st;
    }
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
    st = prepare(c, desc, device, rank_first, rank_count, 0, UINT64_MAX, &rq);
    if (st == VMMT_OK && rq.ack_now) st = write_acks(&rq, (CUstream)stream);
    vmmt__ctx_leave();
    return st == VMMT_OK ? VMMT_OK : vmmt__wrap(st, "vmmt_consumer_ack");
}

int vmmt_consumer_evict(vmmt_consumer *c, const uint8_t pool_id[16], int device)
{
    struct imported **link, *ip;
    int st = VMMT_OK;

    if (c == NULL || pool_id == NULL)
        return vmmt__fail(VMMT_EINVAL, "vmmt_consumer_evict: consumer and pool_id are required");
    pthread_mutex_lock(&c->lock);
    ip = find(c, pool_id, device, &link);
    if (ip != NULL) {
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
