/*
 * The producer pool's life cycle: configuration, handle type, layout,
 * allocation and export, the hand-off mode, and shutdown in reverse order.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "abi.h"
#include "clock.h"
#include "ctrl.h"
#include "driver.h"
#include "pool_internal.h"
#include "publish_kernel.h"
#include "status.h"

#define DEFAULT_SLICES 4096
#define MAX_SLICES     VMMT__MAX_TABLE_SLOTS

const char *vmmt_handoff_name(vmmt_handoff mode)
{
    switch (mode) {
    case VMMT_HANDOFF_AUTO: return "auto";
    case VMMT_HANDOFF_STREAM: return "stream-ordered";
    case VMMT_HANDOFF_SYNC: return "synchronous";
    }
    return "unknown";
}

const char *vmmt_memory_location_name(vmmt_memory_location loc)
{
    switch (loc) {
    case VMMT_MEMORY_DEVICE: return "device";
    case VMMT_MEMORY_HOST: return "host";
    }
    return "unknown";
}

#define POOL_CONFIG_V1 VMMT__SIZE_V1(vmmt_pool_config, device_control_table)
#define POOL_STATS_V1  VMMT__SIZE_V1(vmmt_pool_stats, broker_refused)

static void config_defaults(vmmt_pool_config *c)
{
    memset(c, 0, sizeof *c);
    c->max_slices = DEFAULT_SLICES;
    c->recycle_interval_us = 1000;
    c->handle_type = VMMT_HANDLE_AUTO;
    c->allow_posix_fallback = 1;
    c->handoff = VMMT_HANDOFF_AUTO;
    c->timeout_ms = 5000;
    c->memory_location = VMMT_MEMORY_DEVICE;
    c->host_numa_node = -1;
    c->idle_release_ms = 1500;
    c->consumer_lease_ms = 0; /* off: only liveness links and vmmt_pool_release_rank release */
}

void vmmt_pool_config_init_size(vmmt_pool_config *config, size_t size)
{
    vmmt_pool_config c;

    config_defaults(&c);
    vmmt__struct_out(config, size, &c, sizeof c, POOL_CONFIG_V1, "vmmt_pool_config_init: config");
}

static int check_config(const vmmt_pool_config *c)
{
    if (c->device < 0) return vmmt__fail(VMMT_EINVAL, "device=%d is negative", c->device);
    if (c->memory_size == 0) return vmmt__fail(VMMT_EINVAL, "memory_size must be positive");
    if (c->consumer_count <= 0) return vmmt__fail(VMMT_EINVAL, "consumer_count must be positive");
    if (c->consumer_count > VMMT__MAX_CONSUMERS)
        return vmmt__fail(VMMT_EINVAL, "consumer_count=%d is more than the %d a pool supports",
                          c->consumer_count, VMMT__MAX_CONSUMERS);
    if (c->recycle_interval_us == 0)
        return vmmt__fail(VMMT_EINVAL, "recycle_interval must be positive");
    if (c->max_slices == 0 || c->max_slices > MAX_SLICES)
        return vmmt__fail(VMMT_EINVAL, "max_slices=%u must be between 1 and %u", c->max_slices,
                          MAX_SLICES);
    if (c->timeout_ms <= 0) return vmmt__fail(VMMT_EINVAL, "timeout_ms must be positive");
    if (c->consumer_lease_ms < 0)
        return vmmt__fail(VMMT_EINVAL, "consumer_lease_ms=%d must be 0 (off) or positive",
                          c->consumer_lease_ms);
    /* An unknown value would only surface later, as advice about something else. */
    if (c->handle_type != VMMT_HANDLE_AUTO && c->handle_type != VMMT_HANDLE_NONE &&
        c->handle_type != VMMT_HANDLE_POSIX_FD && c->handle_type != VMMT_HANDLE_FABRIC)
        return vmmt__fail(VMMT_EINVAL,
                          "handle_type=%d is not a handle type; use auto (-1), posix_fd (1) or "
                          "fabric (8)",
                          (int)c->handle_type);
    if (c->handle_type == VMMT_HANDLE_NONE)
        return vmmt__fail(VMMT_EINVAL,
                          "handle_type=none cannot be shared with other processes; use auto, "
                          "posix_fd or fabric");
    if (c->allowed_uid_count > 0 && c->allowed_uids == NULL)
        return vmmt__fail(VMMT_EINVAL,
                          "allowed_uid_count=%zu but allowed_uids is NULL; pass the array, or "
                          "a count of 0",
                          c->allowed_uid_count);
    if (c->allowed_uid_count > 65536)
        return vmmt__fail(VMMT_EINVAL, "allowed_uid_count=%zu is more than 65536 users",
                          c->allowed_uid_count);
    if (c->broker_path != NULL && c->broker_path[0] == '\0')
        return vmmt__fail(VMMT_EINVAL,
                          "broker_path is empty; pass NULL for a random abstract name");
    if (c->broker_path != NULL && strlen(c->broker_path) > 107)
        return vmmt__fail(VMMT_EINVAL,
                          "broker_path is %zu bytes; a Unix socket path holds at "
                          "most 107",
                          strlen(c->broker_path));
    if (c->handoff != VMMT_HANDOFF_AUTO && c->handoff != VMMT_HANDOFF_STREAM &&
        c->handoff != VMMT_HANDOFF_SYNC)
        return vmmt__fail(VMMT_EINVAL,
                          "handoff=%d is not a hand-off mode; use auto (0), stream (1) or sync (2)",
                          (int)c->handoff);
    if (c->memory_location != VMMT_MEMORY_DEVICE && c->memory_location != VMMT_MEMORY_HOST)
        return vmmt__fail(VMMT_EINVAL,
                          "memory_location=%d is not a memory location; use device (0) or host (1)",
                          (int)c->memory_location);
    if (c->memory_location == VMMT_MEMORY_HOST && c->handle_type == VMMT_HANDLE_FABRIC)
        return vmmt__fail(VMMT_EINVAL, "a host pool is shared within one node through a POSIX fd; "
                                       "handle_type=fabric needs a device pool");
    if (c->memory_location == VMMT_MEMORY_HOST && c->device_control_table)
        return vmmt__fail(VMMT_EINVAL, "a host pool keeps its control table in shared host "
                                       "memory; device_control_table needs a device pool");
    if (c->elastic && c->memory_location == VMMT_MEMORY_HOST)
        return vmmt__fail(VMMT_EINVAL, "elastic pools are device pools; a host pool holds no "
                                       "device memory to give back");
    if (c->elastic && (c->handle_type == VMMT_HANDLE_FABRIC || c->device_control_table))
        return vmmt__fail(VMMT_EINVAL, "an elastic pool shares its chunks through POSIX fds and "
                                       "a shared host control table; use handle_type posix_fd "
                                       "(or auto) without device_control_table");
    return VMMT_OK;
}

/* The type to try first: the configured one, or the probe's choice. */
static int pick_type(struct vmmt_pool *p)
{
    int st;

    /* A host pool is POSIX_FD by construction; the probe would need a context. */
    if (p->host_mem) {
        p->type = VMMT_HANDLE_POSIX_FD;
        return VMMT_OK;
    }
    /* An elastic pool may make no chunk until its first publish: know now that POSIX_FD works. */
    if (p->cfg.elastic) return vmmt__elastic_check_type(p);
    if (p->cfg.handle_type != VMMT_HANDLE_AUTO) {
        p->type = p->cfg.handle_type;
        return VMMT_OK;
    }
    st = vmmt_select_handle_type(p->device, &p->type);
    if (st == VMMT_OK && p->type == VMMT_HANDLE_NONE)
        st = vmmt__fail(VMMT_ENOTSUP, "VMMT_HANDLE_TYPE=none: a pool cannot be shared between "
                                      "processes with handle type NONE; unset VMMT_HANDLE_TYPE "
                                      "or set it to posix_fd or fabric");
    return st;
}

/* Create the allocation; FABRIC that fails falls back to POSIX_FD if allowed. */
static int allocate(struct vmmt_pool *p)
{
    size_t gmin = 0, grec = 0;
    uint64_t size;
    int st;

    if (p->host_mem) return vmmt__host_pool_allocate(p);
    if (p->cfg.elastic) return vmmt__elastic_allocate(p);
    st = vmmt__granularity(p->device, p->type, &gmin, &grec);
    if (st == VMMT_OK) st = vmmt__size_policy(p->cfg.memory_size, gmin, p->cfg.round_up, &size);
    if (st != VMMT_OK) return st;
    st = vmmt__mapping_create(p->device, size, p->type, 0, &p->map);
    if (st == VMMT_OK || p->type != VMMT_HANDLE_FABRIC) return st;
    if (!p->cfg.allow_posix_fallback)
        return vmmt__wrap(st, "the pool requires FABRIC handles and POSIX_FD fallback is not "
                              "allowed (set allow_posix_fallback to share within this node)");
    vmmt__log(VMMT_LOG_WARN,
              "FABRIC allocation failed (%s); falling back to POSIX_FD: buffers "
              "can be shared within this node only",
              vmmt_last_error());
    p->type = VMMT_HANDLE_POSIX_FD;
    p->fell_back = 1;
    return allocate(p);
}

/*
 * The pool record (ctrl.h) into `out`: where a shared table keeps it, or a
 * buffer bound for a device table. Put through the readers' validator, so
 * that the producer never serves a record its consumers would refuse.
 */
int vmmt__pool_put_record(const struct vmmt_pool *p, uint8_t out[VMMT__CTRL_RECORD_BYTES])
{
    struct vmmt__ctrl_record r;

    memset(&r, 0, sizeof r);
    r.slots = p->slots;
    r.stride = p->stride;
    r.consumers = (uint32_t)p->cfg.consumer_count;

    /* Called before the layout is done for a shared table, whose data starts at 0. */
    r.table_offset = VMMT__CTRL_RECORD_BYTES;
    r.data_offset = p->host_table ? 0 : p->data_offset;
    memcpy(r.pool_id, p->tmpl.pool_id, sizeof r.pool_id);
    memcpy(r.key, p->seal_key, sizeof r.key);
    vmmt__ctrl_record_encode(&r, out);
    return vmmt__ctrl_record_check(out, &r, "the pool record just written");
}

/*
 * A POSIX_FD device pool's shared host table, made before the layout because
 * where the table lives decides where the data starts. Where memfd_create is
 * refused (a container's seccomp profile, say), a fixed pool keeps its table
 * at the start of the allocation, as device_control_table=1 asks, and works
 * there; an elastic pool's chunk words must be shared host memory.
 */
static int make_shared_table(struct vmmt_pool *p)
{
    uint64_t words = p->el ? vmmt__elastic_words_bytes(p->map.size, p->el->chunk) : 0;
    int st = vmmt__ctrl_create_shared(p->table_bytes + words + VMMT__CTRL_RECORD_BYTES, &p->ctrl);

    if (st == VMMT_OK) st = vmmt__pool_put_record(p, p->ctrl.base);
    p->table_host = p->ctrl.host;
    p->ctrl_dev = p->ctrl.dev;
    if (st != VMMT_ENOTSUP) return st;
    if (p->el != NULL)
        return vmmt__wrap(st, "an elastic pool shares its control table and chunk words in host "
                              "memory; allow memfd_create (the seccomp profile), or make a fixed "
                              "pool (elastic=0), which keeps its table in device memory then");
    vmmt__log(VMMT_LOG_WARN,
              "%s; the control table goes into device memory, as device_control_table=1 "
              "would put it (consumers check ready flags through the driver)",
              vmmt_last_error());
    p->host_table = 0;
    return VMMT_OK;
}

static int layout(struct vmmt_pool *p)
{
    uint64_t data;
    int st;

    p->slots = p->cfg.max_slices;
    p->stride = vmmt__ctrl_stride((uint32_t)p->cfg.consumer_count);
    p->table_bytes = (uint64_t)p->slots * p->stride;
    p->host_table = p->type == VMMT_HANDLE_POSIX_FD && !p->cfg.device_control_table;
    if (p->host_table && !p->host_mem && (st = make_shared_table(p)) != VMMT_OK) return st;
    if (p->host_table)
        data = 0; /* the whole allocation is data */
    else if (vmmt__align_up(VMMT__CTRL_RECORD_BYTES + p->table_bytes, VMMT__DATA_ALIGN, &data) !=
             VMMT_OK)
        return VMMT_EINVAL;
    p->data_offset = data;
    if (p->data_offset + VMMT__DATA_ALIGN > p->map.size)
        return vmmt__fail(VMMT_EINVAL,
                          "memory_size=%" PRIu64 " leaves no room for data after the control "
                          "table (%u slots x %u bytes); raise memory_size or lower max_slices",
                          p->map.size, p->slots, p->stride);
    return vmmt__slab_create(p->map.size - p->data_offset, p->slots, &p->slab);
}

static int alloc_host_state(struct vmmt_pool *p)
{
    p->slot = calloc(p->slots, sizeof *p->slot);
    p->free_slots = malloc(p->slots * sizeof *p->free_slots);
    p->retiring = malloc(p->slots * sizeof *p->retiring);
    if (p->slot == NULL || p->free_slots == NULL || p->retiring == NULL)
        return vmmt__fail(VMMT_ENOMEM, "no host memory for %u slots", p->slots);
    if (p->cfg.consumer_lease_ms > 0) {
        p->lease_gen = calloc(p->slots, sizeof *p->lease_gen);
        p->lease_since_ms = calloc(p->slots, sizeof *p->lease_since_ms);
        if (p->lease_gen == NULL || p->lease_since_ms == NULL)
            return vmmt__fail(VMMT_ENOMEM, "no host memory for %u slot leases", p->slots);
    }
    /* Low slot numbers on top, so a quiet pool touches few table rows. */
    for (uint32_t i = 0; i < p->slots; i++)
        p->free_slots[i] = p->slots - 1 - i;
    p->free_count = p->slots;
    return VMMT_OK;
}

/* The pool's stream, and its zeroed control table: shared host memory (a device pool's was made
 * with the layout), or device memory, its pool record before the rows, and a pinned copy. */
static int setup_stream(struct vmmt_pool *p)
{
    const struct vmmt_drv *d = vmmt__drv();
    uint8_t record[VMMT__CTRL_RECORD_BYTES];
    int st;

    if (p->host_mem) {
        st = vmmt__host_pool_table(p);
        if (st == VMMT_ENOTSUP)
            return vmmt__wrap(st, "a host pool keeps its control table in shared host memory; "
                                  "allow memfd_create (the seccomp profile), or make a device "
                                  "pool (memory_location=device), which keeps its table in "
                                  "device memory then");
        return st;
    }
    st = VMMT_CU(d, cuStreamCreate(&p->stream, CU_STREAM_NON_BLOCKING));
    if (st != VMMT_OK) return st;
    vmmt__kernel_load(p);
    /* A shared host table was made with the layout. */
    if (p->host_table) return VMMT_OK;
    p->ctrl_dev = p->map.base + VMMT__CTRL_RECORD_BYTES; /* the rows, after the pool record */
    st = VMMT_CU(d, cuMemAllocHost((void **)&p->table_host, p->table_bytes));
    if (st != VMMT_OK) return st;
    st = vmmt__pool_put_record(p, record);
    if (st == VMMT_OK) st = VMMT_CU(d, cuMemsetD8Async(p->ctrl_dev, 0, p->table_bytes, p->stream));
    /* Stream writes of the words' values, not a copy from `record`: a failed synchronize
     * returns with the copy still queued, reading a stack frame gone by then. */
    for (uint32_t i = 0; st == VMMT_OK && i < sizeof record / 4; i++) {
        uint32_t w = (uint32_t)record[4 * i] | (uint32_t)record[4 * i + 1] << 8 |
                     (uint32_t)record[4 * i + 2] << 16 | (uint32_t)record[4 * i + 3] << 24;
        st = VMMT_CU(d, cuStreamWriteValue32(p->stream, p->map.base + 4 * i, w,
                                             CU_STREAM_WRITE_VALUE_DEFAULT));
    }
    if (st == VMMT_OK) st = VMMT_CU(d, cuStreamSynchronize(p->stream));
    return st;
}

/*
 * Stream-ordered where the device probe saw a stream wait on imported memory
 * work (the probe tried exactly that), synchronous otherwise.
 */
static vmmt_handoff choose_handoff(struct vmmt_pool *p)
{
    vmmt_device_probe probe;

    if (p->cfg.handoff != VMMT_HANDOFF_AUTO) return p->cfg.handoff;
    /* A consumer that may not wait on a shared host table polls it with plain loads. */
    if (p->host_table) return VMMT_HANDOFF_STREAM;
    if (vmmt_probe_device(p->device, &probe) == VMMT_OK && probe.stream_wait_imported == 1)
        return VMMT_HANDOFF_STREAM;
    vmmt__log(VMMT_LOG_INFO,
              "stream wait on imported memory refused on device %d (%s); "
              "publishes will synchronize",
              p->device, probe.stream_wait_cause);
    return VMMT_HANDOFF_SYNC;
}

static int start_broker(struct vmmt_pool *p, int fd)
{
    struct vmmt__broker_config bc;
    int fds[2] = {fd, p->ctrl.fd}, n = p->host_table ? 2 : 1;

    memset(&bc, 0, sizeof bc);
    bc.path = p->cfg.broker_path;
    bc.allowed_uids = (const uid_t *)p->allowed_uids;
    bc.allowed_count = p->cfg.allowed_uid_count;
    bc.timeout_ms = p->cfg.timeout_ms;
    /* Consumers keep their connection as a liveness link: a death releases its ranks. */
    bc.ranks = p->cfg.consumer_count;
    bc.on_dead = vmmt__pool_ranks_dead;
    bc.on_dead_shared = vmmt__pool_shared_ranks_dead;
    bc.user = p;
    /* An elastic pool serves its table under the pool's id, each chunk under its own. */
    if (p->el != NULL) {
        bc.resolve = vmmt__elastic_resolve;
        bc.resolve_user = p;
        return vmmt__broker_start_fds(&fds[1], 1, p->tmpl.pool_id, &bc, &p->broker);
    }
    /* Consumers get the allocation, and the shared control table where there is one. */
    return vmmt__broker_start_fds(fds, n, p->tmpl.pool_id, &bc, &p->broker);
}

/* Export, decide the hand-off, start the broker: the exported fd never outlives this call. */
static int share(struct vmmt_pool *p)
{
    int fd = -1, st;

    if (p->type == VMMT_HANDLE_FABRIC) {
        st = vmmt__export_fabric(p->map.handle, &p->fabric);
        if (st != VMMT_OK) return st;
        p->handoff = choose_handoff(p);
        return VMMT_OK;
    }
    if (p->el != NULL) {
        p->handoff = choose_handoff(p);
        return start_broker(p, -1);
    }
    st = vmmt__export_posix_fd(p->map.handle, &fd);
    if (st != VMMT_OK) return st;
    p->handoff = choose_handoff(p);
    st = start_broker(p, fd);
    close(fd);
    return st;
}

static void fill_template(struct vmmt_pool *p)
{
    struct vmmt__desc *t = &p->tmpl;
    const struct vmmt__broker_addr *a;

    t->handle_type = (uint32_t)p->type;
    t->flags = p->handoff == VMMT_HANDOFF_STREAM ? VMMT__DESC_STREAM_ORDERED : 0;
    if (p->host_table) t->flags |= VMMT__DESC_HOST_TABLE;
    if (p->type == VMMT_HANDLE_FABRIC) {
        memcpy(t->fabric, p->fabric.data, sizeof t->fabric);
    } else {
        a = vmmt__broker_address(p->broker);
        memcpy(&t->broker, a, sizeof t->broker);
    }
    t->producer_device = p->device;
    t->producer_pid = (int32_t)getpid();
    /* Consumers check that the broker they reach runs as this uid (and pid). */
    t->producer_uid = (uint32_t)geteuid();
    t->producer_pidns = vmmt__pidns_id();
    t->consumer_count = (uint32_t)p->cfg.consumer_count;
    t->alloc_size = p->map.size;
    t->table_offset = VMMT__CTRL_RECORD_BYTES; /* shared or device table: the record comes first */
    t->table_slots = p->slots;
    t->slot_stride = p->stride;
    t->data_offset = p->data_offset;
    t->memory_location = p->host_mem ? 1 : 0;
    t->chunk_size = p->el != NULL ? p->el->chunk : 0;
}

static int copy_config(struct vmmt_pool *p, const vmmt_pool_config *c)
{
    p->cfg = *c;
    if (c->broker_path != NULL) {
        snprintf(p->broker_path, sizeof p->broker_path, "%s", c->broker_path);
        p->cfg.broker_path = p->broker_path;
    }
    if (c->allowed_uid_count > 0) {
        p->allowed_uids = malloc(c->allowed_uid_count * sizeof *p->allowed_uids);
        if (p->allowed_uids == NULL) return vmmt__fail(VMMT_ENOMEM, "no host memory");
        memcpy(p->allowed_uids, c->allowed_uids, c->allowed_uid_count * sizeof *p->allowed_uids);
        p->cfg.allowed_uids = p->allowed_uids;
    }
    p->device = c->device;
    p->host_mem = c->memory_location == VMMT_MEMORY_HOST;
    if (getrandom(p->tmpl.pool_id, sizeof p->tmpl.pool_id, 0) != (ssize_t)sizeof p->tmpl.pool_id)
        return vmmt__sys_fail("getrandom for the pool id");
    return vmmt__seal_key_new(p->seal_key);
}

/* Undo whatever part of creation succeeded; used by create and shutdown alike. */
static void release_all(struct vmmt_pool *p)
{
    const struct vmmt_drv *d = vmmt__drv();
    struct vmmt__saved_error e;

    struct vmmt__broker *b;

    vmmt__error_save(&e);
    vmmt__recycler_stop(p);
    /* Detached under the lock: vmmt_pool_get_stats reads the broker's counters. */
    pthread_mutex_lock(&p->lock);
    b = p->broker;
    p->broker = NULL;
    pthread_mutex_unlock(&p->lock);
    vmmt__broker_stop(b);
    /* A host pool that never published from device memory has no context to enter. */
    if (d != NULL && p->host_mem && !p->device_ready) {
        vmmt__ctrl_release(&p->ctrl);
        p->table_host = NULL;
        /* As below: a second try resumes where the first failed. */
        if (vmmt__mapping_release(&p->map) != VMMT_OK && vmmt__mapping_release(&p->map) != VMMT_OK)
            vmmt__log(VMMT_LOG_ERROR, "releasing the pool's host memory failed twice: %s; leaked",
                      vmmt_last_error());
    } else if (d != NULL && vmmt__ctx_enter(p->device) == VMMT_OK) {
        /* A release that fails leaks what it held; say so, then go on with the rest. */
        if (p->stream != NULL) {
            CUresult r = d->cuStreamSynchronize(p->stream);
            if (r != CUDA_SUCCESS)
                vmmt__log(VMMT_LOG_WARN, "synchronizing the recycler's stream failed (%s)",
                          vmmt__cu_name(r));
            r = d->cuStreamDestroy(p->stream);
            if (r != CUDA_SUCCESS)
                vmmt__log(VMMT_LOG_ERROR, "releasing the recycler's stream failed (%s); leaked",
                          vmmt__cu_name(r));
            p->stream = NULL;
        }
        vmmt__kernel_unload(p);
        /* Chunks first: giving one back clears its word in the table. */
        if (p->el != NULL && p->el->words != NULL) vmmt__elastic_release(p);
        if (p->host_table) {
            vmmt__ctrl_release(&p->ctrl);
        } else if (p->table_host != NULL) {
            CUresult r = d->cuMemFreeHost(p->table_host);
            if (r != CUDA_SUCCESS)
                vmmt__log(VMMT_LOG_ERROR,
                          "cuMemFreeHost of the recycler's table copy failed (%s); leaked",
                          vmmt__cu_name(r));
        }
        p->table_host = NULL;
        /* Each step of a mapping's release is done at most once: a second try
         * resumes where the first failed. */
        if (vmmt__mapping_release(&p->map) != VMMT_OK && vmmt__mapping_release(&p->map) != VMMT_OK)
            vmmt__log(VMMT_LOG_ERROR, "releasing the pool's device memory failed twice: %s; leaked",
                      vmmt_last_error());
        vmmt__ctx_leave();
    }
    vmmt__slab_destroy(p->slab);
    p->slab = NULL;
    vmmt__error_restore(&e);
}

static void free_pool(struct vmmt_pool *p)
{
    pthread_cond_destroy(&p->wake);
    pthread_cond_destroy(&p->changed);
    pthread_mutex_destroy(&p->reclaim_lock);
    pthread_mutex_destroy(&p->dev_lock);
    pthread_mutex_destroy(&p->lock);
    vmmt__elastic_free(p);
    free(p->slot);
    free(p->free_slots);
    free(p->retiring);
    free(p->lease_gen);
    free(p->lease_since_ms);
    free(p->allowed_uids);
    free(p);
}

static struct vmmt_pool *new_pool(void)
{
    struct vmmt_pool *p = calloc(1, sizeof *p);
    pthread_condattr_t ca;

    if (p == NULL) return NULL;
    p->ctrl.fd = -1;
    pthread_mutex_init(&p->lock, NULL);
    pthread_mutex_init(&p->reclaim_lock, NULL);
    pthread_mutex_init(&p->dev_lock, NULL);
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&p->changed, &ca);
    pthread_cond_init(&p->wake, &ca);
    pthread_condattr_destroy(&ca);
    return p;
}

static int create_steps(struct vmmt_pool *p)
{
    int st;

    st = pick_type(p);
    if (st == VMMT_OK) st = allocate(p);
    if (st == VMMT_OK) st = layout(p);
    if (st == VMMT_OK) st = alloc_host_state(p);
    if (st == VMMT_OK) st = setup_stream(p);
    if (st == VMMT_OK && p->el != NULL) st = vmmt__elastic_start(p);
    if (st == VMMT_OK) st = share(p);
    if (st == VMMT_OK) fill_template(p);
    if (st == VMMT_OK) st = vmmt__recycler_start(p);
    return st;
}

int vmmt_pool_create_size(const vmmt_pool_config *theirs, size_t size, vmmt_pool **out)
{
    vmmt_pool_config cfg, *config = &cfg;
    struct vmmt_pool *p;
    int st;

    if (out == NULL) return vmmt__fail(VMMT_EINVAL, "vmmt_pool_create: out is NULL");
    *out = NULL;
    /* Fields the caller's (older) struct lacks keep their defaults. */
    config_defaults(&cfg);
    st =
        vmmt__struct_in(&cfg, sizeof cfg, theirs, size, POOL_CONFIG_V1, "vmmt_pool_create: config");
    if (st != VMMT_OK) return st;
    st = check_config(config);
    if (st != VMMT_OK) return vmmt__wrap(st, "creating a vmmt pool");
    p = new_pool();
    if (p == NULL) return vmmt__fail(VMMT_ENOMEM, "creating a vmmt pool: no host memory");
    st = copy_config(p, config);
    /* A host pool's producer needs no context: it may never touch a GPU. */
    if (st == VMMT_OK && !p->host_mem) st = vmmt__ctx_enter(p->device);
    if (st != VMMT_OK) goto fail_free;
    st = create_steps(p);
    if (!p->host_mem) vmmt__ctx_leave();
    if (st != VMMT_OK) goto fail_release;
    vmmt__log(VMMT_LOG_INFO,
              "%s pool for device %d: %" PRIu64 " bytes, %s handles, %s hand-off, %u "
              "slots for %d consumer(s)",
              vmmt_memory_location_name(p->cfg.memory_location), p->device, p->map.size,
              vmmt_handle_type_name(p->type), vmmt_handoff_name(p->handoff), p->slots,
              p->cfg.consumer_count);
    *out = p;
    return VMMT_OK;

fail_release:
    release_all(p);
fail_free:
    free_pool(p);
    return vmmt__wrap(st, "creating a vmmt pool of %" PRIu64 " bytes on device %d",
                      config->memory_size, config->device);
}

int vmmt__pool_check_usable(struct vmmt_pool *p)
{
    if (p->failed)
        return vmmt__fail(VMMT_EFAILED,
                          "the pool is unusable after an earlier failure (%s); destroy it and "
                          "create a new one",
                          p->failure);
    if (p->closing) return vmmt__fail(VMMT_ECLOSED, "the pool is shut down");
    return VMMT_OK;
}

int vmmt__pool_enter(struct vmmt_pool *p)
{
    int st;

    pthread_mutex_lock(&p->lock);
    st = vmmt__pool_check_usable(p);
    if (st == VMMT_OK) p->active++;
    pthread_mutex_unlock(&p->lock);
    return st;
}

void vmmt__pool_leave(struct vmmt_pool *p)
{
    pthread_mutex_lock(&p->lock);
    p->active--;
    pthread_cond_broadcast(&p->changed);
    pthread_mutex_unlock(&p->lock);
}

void vmmt__pool_quarantine(struct vmmt_pool *p)
{
    pthread_mutex_lock(&p->lock);
    if (!p->failed) {
        p->failed = 1;
        snprintf(p->failure, sizeof p->failure, "%s", vmmt_last_error());
    }
    pthread_cond_broadcast(&p->changed);
    pthread_mutex_unlock(&p->lock);
    vmmt__log(VMMT_LOG_ERROR, "pool quarantined: %s", vmmt_last_error());
}

/* Wait for calls inside the pool to return; lock held. timeout_ms: until's, for the message. */
static int wait_callers(struct vmmt_pool *p, const struct timespec *until, int timeout_ms)
{
    while (p->active > 0)
        if (pthread_cond_timedwait(&p->changed, &p->lock, until) != 0 && p->active > 0)
            return vmmt__fail(VMMT_ETIMEDOUT,
                              "shutdown waited %d ms for %d call(s) still inside the pool; call "
                              "vmmt_pool_shutdown again once they return",
                              timeout_ms, p->active);
    return VMMT_OK;
}

/*
 * Is every publish copy into the pool finished? Needs a fresh table copy. A
 * word past LIVE, RETIRED, says so too: a reclaim wrote it, whose
 * confirmation failed (recycle.c, row_done), and the slot was left in flight
 * for the next one, which shutdown, its recycler stopped, would never run
 * (test_attack_kernel, shutdown_after_failed_retire_confirmation).
 */
static int copies_landed(const struct vmmt_pool *p)
{
    for (uint32_t i = 0; i < p->slots; i++) {
        const struct vmmt__slot *s = &p->slot[i];
        uint32_t ready;
        if (s->state != SLOT_IN_FLIGHT && s->state != SLOT_CANCELLED) continue;
        ready = vmmt__ctrl_load(&p->table_host[(size_t)i * (p->stride / 4)]);
        if (ready != s->generation && ready != vmmt__gen_retired(s->generation)) return 0;
    }
    return 1;
}

/*
 * Stream-ordered publishes return with their copy into the pool still queued
 * on the caller's stream; unmapping under it would fault that stream. Wait
 * until every ready word shows its copy finished. A quarantined pool is no
 * exception: where the table cannot be read, whether the copies are done
 * cannot be known, and the memory stays mapped until a later shutdown can
 * tell.
 */
static int wait_copies(struct vmmt_pool *p, const struct timespec *until, int timeout_ms)
{
    struct timespec pause = {0, 50000};
    int st;

    if (p->handoff != VMMT_HANDOFF_STREAM) return VMMT_OK;
    for (;;) {
        if (p->in_flight == 0) return VMMT_OK;
        st = vmmt__pool_read_table(p);
        if (st != VMMT_OK && p->failed)
            return vmmt__fail(VMMT_EFAILED,
                              "the pool is quarantined (%s) and whether publish copies still "
                              "queued on the callers' streams have finished cannot be known "
                              "(%s); its memory stays mapped: synchronize those streams and "
                              "call vmmt_pool_shutdown again",
                              p->failure, vmmt_last_error());
        if (st != VMMT_OK) return st;
        if (copies_landed(p)) return VMMT_OK;
        if (vmmt__deadline_passed(until))
            return vmmt__fail(VMMT_ETIMEDOUT,
                              "shutdown waited %d ms for publish copies still queued on the "
                              "callers' streams; synchronize those streams and call "
                              "vmmt_pool_shutdown again",
                              timeout_ms);
        nanosleep(&pause, NULL);
    }
}

int vmmt_pool_shutdown(vmmt_pool *p)
{
    struct timespec until;

    if (p == NULL) return vmmt__fail(VMMT_EINVAL, "vmmt_pool_shutdown: pool is NULL");
    vmmt__deadline(&until, (int64_t)p->cfg.timeout_ms * 1000);
    return vmmt__pool_shutdown_until(p, &until, p->cfg.timeout_ms);
}

int vmmt__pool_shutdown_until(struct vmmt_pool *p, const struct timespec *until, int timeout_ms)
{
    int st;

    pthread_mutex_lock(&p->lock);
    while (p->shutting_down && !p->closed)
        pthread_cond_wait(&p->changed, &p->lock);
    if (p->closed) {
        pthread_mutex_unlock(&p->lock);
        return VMMT_OK;
    }
    p->shutting_down = 1;
    p->closing = 1;
    pthread_cond_broadcast(&p->wake);
    st = wait_callers(p, until, timeout_ms);
    pthread_mutex_unlock(&p->lock);
    if (st == VMMT_OK) {
        vmmt__recycler_stop(p);
        st = wait_copies(p, until, timeout_ms);
    }
    if (st == VMMT_OK) release_all(p);
    pthread_mutex_lock(&p->lock);
    p->closed = st == VMMT_OK;
    p->shutting_down = 0;
    pthread_cond_broadcast(&p->changed);
    pthread_mutex_unlock(&p->lock);
    return st;
}

void vmmt_pool_destroy(vmmt_pool *p)
{
    if (p == NULL) return;
    if (vmmt_pool_shutdown(p) != VMMT_OK) {
        /* Publishers still inside the pool would touch freed memory: keep it. */
        vmmt__log(VMMT_LOG_ERROR,
                  "vmmt_pool_destroy: %s; the pool is leaked rather than freed "
                  "under active callers",
                  vmmt_last_error());
        return;
    }
    free_pool(p);
}

int vmmt_pool_get_stats_size(vmmt_pool *p, vmmt_pool_stats *theirs, size_t size)
{
    struct vmmt__broker_stats bs;
    vmmt_pool_stats s, *out = &s;

    if (p == NULL) return vmmt__fail(VMMT_EINVAL, "vmmt_pool_get_stats: pool is NULL");
    if (theirs == NULL) return vmmt__fail(VMMT_EINVAL, "vmmt_pool_get_stats: out is NULL");
    memset(out, 0, sizeof *out);
    memset(&bs, 0, sizeof bs);
    pthread_mutex_lock(&p->lock);
    out->handle_type = p->type;
    out->handoff = p->handoff;
    out->fell_back_to_posix = p->fell_back;
    out->host_control_table = p->host_table;
    out->allocation_size = p->map.size;
    out->table_bytes = p->table_bytes;
    out->data_bytes = p->map.size - p->data_offset;
    out->slots = p->slots;
    out->in_flight = p->in_flight;
    out->in_flight_bytes = p->in_flight_bytes;
    out->published = p->published;
    out->recycled = p->recycled;
    out->cancelled = p->cancelled;
    out->full = p->full;
    out->reclaims = p->reclaims;
    out->rank_releases = p->rank_releases;
    out->released_slices = p->released_slices;
    out->kernel_publishes = __atomic_load_n(&p->kernel_publishes, __ATOMIC_RELAXED);
    if (p->broker != NULL) vmmt__broker_stats(p->broker, &bs);
    out->memory_location = p->host_mem ? VMMT_MEMORY_HOST : VMMT_MEMORY_DEVICE;
    out->device_bytes = p->host_mem ? 0 : out->allocation_size;
    out->resident_bytes = out->peak_bytes = out->max_bytes = out->device_bytes;
    if (p->el != NULL) {
        out->device_bytes = out->resident_bytes = p->el->resident;
        out->peak_bytes = p->el->peak;
        out->chunk_bytes = p->el->chunk;
        out->chunks_made = p->el->made;
        out->chunks_released = p->el->released;
    }
    out->host_bytes = p->host_mem ? out->allocation_size : 0;
    pthread_mutex_unlock(&p->lock);
    out->broker_served = bs.served;
    out->broker_refused = bs.refused_peer + bs.refused_pool;
    out->consumer_links = (uint32_t)bs.held;
    return vmmt__struct_out(theirs, size, &s, sizeof s, POOL_STATS_V1, "vmmt_pool_get_stats: out");
}
