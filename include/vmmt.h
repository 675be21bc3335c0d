/*
 * vmmt: hand GPU buffers between processes through CUDA virtual memory
 * management (VMM).
 *
 * One producer owns a bounded pool of device memory, exported once as a
 * shareable handle; consumers import it, copy out what was published for
 * them and acknowledge, so the slice can be reused.
 *
 * Conventions: every function that can fail returns a vmmt_status (VMMT_OK is
 * 0, failures are negative). On failure, vmmt_last_error() gives a message
 * for the calling thread that says what was asked, what was found and what to
 * do. Handles are opaque; every create has a matching destroy.
 */
#ifndef VMMT_H
#define VMMT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define VMMT_API __attribute__((visibility("default")))
#else
#define VMMT_API
#endif

#define VMMT_VERSION_MAJOR  0
#define VMMT_VERSION_MINOR  1
#define VMMT_VERSION_PATCH  0
#define VMMT_VERSION_STRING "0.1.0"

/* ------------------------------------------------------------------ status */

typedef enum vmmt_status {
    VMMT_OK = 0,
    VMMT_EINVAL = -1,    /* an argument or configuration is wrong */
    VMMT_ENODRIVER = -2, /* no NVIDIA driver could be loaded or initialised */
    VMMT_ENODEV = -3,    /* no such device, or no device at all */
    VMMT_ENOTSUP = -4,   /* the driver or device cannot do what was asked */
    VMMT_ECUDA = -5,     /* a CUDA driver call failed */
    VMMT_ENOMEM = -6,    /* host memory exhausted */
    VMMT_EFULL = -7,     /* the pool has no room now; fall back or retry */
    VMMT_ETIMEDOUT = -8, /* a wait or a socket ran past its timeout */
    VMMT_EFAILED = -9,   /* the pool is quarantined after an uncertain failure */
    VMMT_ECLOSED = -10,  /* the object is shut down */
    VMMT_EPROTO = -11,   /* a descriptor or message is malformed */
    VMMT_EPERM = -12,    /* a peer or operation was refused */
    VMMT_ESYS = -13,     /* an operating-system call failed */
    VMMT_ESTATE = -14,   /* the call does not fit the object's state */
    VMMT_ETOOBIG = -15   /* the request can never fit */
} vmmt_status;

/* Short fixed text for a status ("pool is full"). Never NULL. */
VMMT_API const char *vmmt_strerror(int status);

/*
 * The detailed message of the last failure on the calling thread, with its
 * causes joined by ": ", outermost first. Empty when nothing failed yet.
 * Valid until the next vmmt call on this thread.
 */
VMMT_API const char *vmmt_last_error(void);

/* Status of the last failure on the calling thread (VMMT_OK if none). */
VMMT_API int vmmt_last_status(void);

/* The CUresult behind the last failure on the calling thread, 0 if none. */
VMMT_API int vmmt_last_cuda_error(void);

/* --------------------------------------------------------------------- log */

typedef enum vmmt_log_level {
    VMMT_LOG_ERROR = 0,
    VMMT_LOG_WARN = 1,
    VMMT_LOG_INFO = 2,
    VMMT_LOG_DEBUG = 3
} vmmt_log_level;

typedef void (*vmmt_log_fn)(vmmt_log_level level, const char *message, void *user);

/*
 * Route the library's warnings and notices. The default writes to stderr at
 * the level named by VMMT_LOG (error, warn, info, debug or off; warn if
 * unset). Passing NULL restores the default.
 */
VMMT_API void vmmt_set_log(vmmt_log_fn fn, void *user);
VMMT_API void vmmt_set_log_level(vmmt_log_level level);

/* ------------------------------------------------------------------ driver */

/*
 * Choose the driver: "cuda" (libcuda.so.1, or the file named by
 * VMMT_LIBCUDA) or "emu" (the emulated driver on host memory, for machines
 * without a GPU). Without a call, VMMT_DRIVER decides, and "cuda" if unset.
 * Must precede every other call that touches a device.
 */
VMMT_API int vmmt_driver_select(const char *name);

/* "cuda" or "emu", loading the driver if needed; NULL with a message if none. */
VMMT_API const char *vmmt_driver_name(void);

/* The driver's CUDA version (12080 for 12.8). */
VMMT_API int vmmt_driver_version(int *version);

VMMT_API int vmmt_device_count(int *count);

/* --------------------------------------------------------- handle types */

typedef enum vmmt_handle_type {
    VMMT_HANDLE_AUTO = -1,    /* let the probe decide */
    VMMT_HANDLE_NONE = 0,     /* not shareable: one process only */
    VMMT_HANDLE_POSIX_FD = 1, /* a file descriptor, one node */
    VMMT_HANDLE_FABRIC = 8    /* a 64-byte handle, across an NVLink domain */
} vmmt_handle_type;

/* "fabric", "posix_fd", "none" or "auto". */
VMMT_API const char *vmmt_handle_type_name(vmmt_handle_type type);

/* Parse those names; VMMT_EINVAL with a message for anything else. */
VMMT_API int vmmt_handle_type_parse(const char *name, vmmt_handle_type *out);

/* What the probe found for one handle type on one device. */
typedef struct vmmt_handle_probe {
    vmmt_handle_type type;
    int attribute;              /* the device attribute, -1 where none exists */
    size_t granularity_minimum; /* 0 when the query failed */
    size_t granularity_recommended;
    int create_result; /* CUresult of cuMemCreate of one granularity unit */
    int export_result; /* CUresult of the export, -1 when not tried */
    int works;         /* create (and export, if shareable) succeeded */
    char cause[320];   /* why it does not work; empty when it does */
} vmmt_handle_probe;

typedef struct vmmt_device_probe {
    int device;
    char name[128];
    size_t total_memory;
    int vmm_supported;
    int rdma_with_vmm_supported;
    int imex_channels_present;       /* /dev/nvidia-caps-imex-channels exists */
    vmmt_handle_probe candidates[3]; /* FABRIC, POSIX_FD, NONE: probe order */
    vmmt_handle_type selected;       /* the first that works, or the override */
    int overridden;                  /* VMMT_HANDLE_TYPE chose it */
    char reason[1024];               /* why `selected` was chosen */
    /*
     * Can a stream wait on a word of an imported allocation (the selected
     * type, imported in this process)? 1: pools hand off stream-ordered;
     * 0: publishes synchronize; -1: not tried (no shareable type).
     */
    int stream_wait_imported;
    char stream_wait_cause[320]; /* why the wait was refused */
} vmmt_device_probe;

/*
 * Probe every handle type on a device by a real allocation of one
 * granularity unit (and its export). The result is cached per device; a later
 * call returns the cached report. VMMT_OK when a shareable type (FABRIC or
 * POSIX_FD) works; VMMT_ENOTSUP, with every candidate's cause in the message,
 * when none does (out is still filled).
 */
VMMT_API int vmmt_probe_device(int device, vmmt_device_probe *out);

/*
 * The handle type the library will use on a device: VMMT_HANDLE_TYPE
 * (auto, fabric, posix_fd, none) if set, else the probe's choice.
 */
VMMT_API int vmmt_select_handle_type(int device, vmmt_handle_type *out);

/* Forget cached probes (after changing VMMT_HANDLE_TYPE, say). */
VMMT_API void vmmt_probe_reset(void);

/* -------------------------------------------------------------- descriptor */

/*
 * A published buffer travels to consumers as a descriptor: a fixed-size,
 * versioned, little-endian record that any transport can carry as bytes (a
 * socket, ZeroMQ, a pickle). It names the pool, the slot and generation, the
 * bytes and the tensor's DLPack dtype and shape.
 */
#define VMMT_DESC_SIZE 512
#define VMMT_MAX_DIMS  8

typedef struct vmmt_desc {
    uint8_t bytes[VMMT_DESC_SIZE];
} vmmt_desc;

/* DLPack's DLDataType: code (0 int, 1 uint, 2 float, 4 bfloat, ...), bits, lanes. */
typedef struct vmmt_dtype {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} vmmt_dtype;

/* What a descriptor says, decoded and checked. */
typedef struct vmmt_desc_info {
    uint8_t pool_id[16];
    vmmt_handle_type handle_type;
    int producer_device;
    int consumer_count;
    uint32_t slot;
    uint32_t generation;
    uint64_t nbytes;
    vmmt_dtype dtype;
    int ndim;
    int64_t shape[VMMT_MAX_DIMS];
    int stream_ordered; /* the consumer must wait for the ready word */
    int pack_index;     /* position within a packed publish */
    int pack_count;     /* 1 for a single publish */
} vmmt_desc_info;

/*
 * Decode and validate a descriptor without touching any device: VMMT_EPROTO,
 * naming the field and what was wrong, for anything inconsistent.
 */
VMMT_API int vmmt_desc_inspect(const vmmt_desc *desc, vmmt_desc_info *out);

/* -------------------------------------------------------------- producer */

typedef struct vmmt_pool vmmt_pool;

/* How a consumer learns that a published buffer's bytes are in the pool. */
typedef enum vmmt_handoff {
    VMMT_HANDOFF_AUTO = 0,   /* stream-ordered where the driver allows a wait on imported memory */
    VMMT_HANDOFF_STREAM = 1, /* publish enqueues copy + ready flag and returns at once */
    VMMT_HANDOFF_SYNC = 2    /* publish synchronizes its stream before returning */
} vmmt_handoff;

VMMT_API const char *vmmt_handoff_name(vmmt_handoff mode);

typedef struct vmmt_pool_config {
    int device;                   /* producer's device; default 0 */
    uint64_t memory_size;         /* bytes of device memory, control table included */
    int consumer_count;           /* acknowledgements needed per slice; 1..256 */
    uint32_t max_slices;          /* slices in flight at most; default 4096 */
    uint32_t recycle_interval_us; /* background recycler period while slices are in flight; default
                                     1000 */
    vmmt_handle_type handle_type; /* default VMMT_HANDLE_AUTO (the probe's choice) */
    int allow_posix_fallback;     /* FABRIC failing at creation falls back to POSIX_FD; default 1 */
    int round_up;         /* a memory_size below one granularity unit becomes one unit; default 0 */
    vmmt_handoff handoff; /* default VMMT_HANDOFF_AUTO */
    const char *broker_path;      /* POSIX_FD: socket path; NULL: a random abstract name */
    const uint32_t *allowed_uids; /* broker peers allowed besides the producer's user */
    size_t allowed_uid_count;
    int timeout_ms; /* bound of shutdown and broker waits; default 5000 */
    /*
     * POSIX_FD pools keep their control table in host memory shared with the
     * consumers (plain loads to check ready flags and acknowledgements, no
     * driver call). Set this to keep it in device memory instead, as FABRIC
     * pools always do. Default 0.
     */
    int device_control_table;
    /*
     * Backstop for consumers the pool cannot watch (FABRIC pools, consumers
     * served without a liveness link): a rank that no live consumer process
     * has announced on its broker link, and that leaves a slice
     * unacknowledged for longer than this, is presumed dead and released as
     * by vmmt_pool_release_rank. 0 (the default): never; a rank that a live
     * process holds is never released this way.
     */
    int consumer_lease_ms;
} vmmt_pool_config;

/* Defaults as documented above; memory_size and consumer_count are left 0 and must be set. */
VMMT_API void vmmt_pool_config_init(vmmt_pool_config *config);

/*
 * Allocate, map and export the pool, and start its recycler (and broker, for
 * POSIX_FD). The application's current CUDA context is left as it was.
 */
VMMT_API int vmmt_pool_create(const vmmt_pool_config *config, vmmt_pool **out);

/* A tensor to publish: device pointer, bytes, and optionally its DLPack dtype and shape. */
typedef struct vmmt_buffer {
    uint64_t ptr; /* CUdeviceptr on the pool's device, or one it can read */
    uint64_t nbytes;
    vmmt_dtype dtype; /* bits == 0: untyped bytes */
    int ndim;
    int64_t shape[VMMT_MAX_DIMS];
} vmmt_buffer;

/*
 * Copy buf into a free slice on `stream` (a CUstream; NULL for the default
 * stream) and describe it in *out. VMMT_EFULL at once when no slice is free
 * even after reclaiming (fall back to another path, or retry later);
 * VMMT_ETOOBIG when it could never fit.
 */
VMMT_API int vmmt_publish(vmmt_pool *pool, const vmmt_buffer *buf, void *stream, vmmt_desc *out);

/*
 * Several buffers in one slice under one control slot, each aligned to its
 * element size; out[i] describes bufs[i]. The slice is acknowledged once a
 * consumer has consumed (or dropped) every member, and recycled once.
 */
VMMT_API int vmmt_publish_packed(vmmt_pool *pool, const vmmt_buffer *bufs, size_t count,
                                 void *stream, vmmt_desc *out);

/*
 * Take back a descriptor that was never handed to a consumer. Idempotent:
 * cancelling another member of the same packed group, or the same
 * descriptor again, succeeds and does nothing.
 */
VMMT_API int vmmt_cancel(vmmt_pool *pool, const vmmt_desc *desc);

/* Recycle every acknowledged slice now; *freed (if not NULL) counts them. */
VMMT_API int vmmt_pool_reclaim(vmmt_pool *pool, uint32_t *freed);

/*
 * Acknowledge, on behalf of consumer rank `rank`, every slice in flight now,
 * and log how many. For an engine that learns of a rank's death itself, or
 * restarts a rank under the same number: the rank's earlier descriptors
 * must not be consumed after this call (their slices may hold new data by
 * then). Slices published later still need the rank. POSIX_FD pools do this
 * on their own when a consumer process dies (its broker connection closes
 * and the process is gone): see docs/broker.md. A live rank is never
 * released but by this call. VMMT_EINVAL for a rank outside the pool.
 * Thread-safe; counted in vmmt_pool_stats.rank_releases and released_slices.
 */
VMMT_API int vmmt_pool_release_rank(vmmt_pool *pool, int rank);

/* Wait until nothing is in flight, at most timeout_ms; VMMT_ETIMEDOUT otherwise. */
VMMT_API int vmmt_pool_drain(vmmt_pool *pool, int timeout_ms);

typedef struct vmmt_pool_stats {
    vmmt_handle_type handle_type;
    vmmt_handoff handoff;
    int fell_back_to_posix;   /* FABRIC was asked for and failed */
    int host_control_table;   /* the control table is in shared host memory */
    uint64_t allocation_size; /* the exported allocation */
    uint64_t table_bytes;     /* control table */
    uint64_t data_bytes;      /* usable for slices */
    uint32_t slots;
    uint32_t in_flight; /* slices published and not yet recycled */
    uint64_t in_flight_bytes;
    uint64_t published; /* descriptors handed out */
    uint64_t recycled;  /* slices recycled */
    uint64_t cancelled;
    uint64_t full;          /* publishes refused with VMMT_EFULL */
    uint64_t reclaims;      /* control-table reads */
    uint64_t broker_served; /* POSIX_FD descriptors handed to consumers */
    uint64_t broker_refused;
    /* Dead consumers: ranks released (a consumer process died, or vmmt_pool_release_rank). */
    uint64_t rank_releases;
    uint64_t released_slices; /* slices acknowledged on behalf of released ranks */
    uint32_t consumer_links;  /* consumer processes whose liveness link is open now */
} vmmt_pool_stats;

VMMT_API int vmmt_pool_get_stats(vmmt_pool *pool, vmmt_pool_stats *out);

/*
 * Refuse new publishes, wait for publishes in progress, stop the recycler
 * and broker, and release the device memory in reverse order. Bounded by
 * timeout_ms; idempotent. Consumers that imported the pool keep their
 * mappings valid until they evict it.
 */
VMMT_API int vmmt_pool_shutdown(vmmt_pool *pool);

/* Shut down (if needed) and free. NULL is allowed. */
VMMT_API void vmmt_pool_destroy(vmmt_pool *pool);

/* -------------------------------------------------------------- consumer */

typedef struct vmmt_consumer vmmt_consumer;

/* Acknowledge for every consumer rank of the pool (one process serving all). */
#define VMMT_ALL_RANKS (-1)

typedef struct vmmt_consumer_config {
    int timeout_ms; /* broker fetch, and waits for a ready flag on the host; default 5000 */
    /*
     * Imported pools kept at most; importing one more evicts the least
     * recently used idle pool whose last copies are known to be done (every
     * acknowledgement written, which is the case for pools with a shared host
     * control table). A pool of a producer that restarted is thus let go
     * instead of holding its device memory forever. Default 16; 0: no limit.
     */
    int max_pools;
} vmmt_consumer_config;

VMMT_API void vmmt_consumer_config_init(vmmt_consumer_config *config);

/* A per-process cache of imported pools; thread-safe. config may be NULL. */
VMMT_API int vmmt_consumer_create(const vmmt_consumer_config *config, vmmt_consumer **out);

/*
 * Copy the buffer a descriptor names to dst (a device pointer on `device`,
 * dst_size bytes available) on `stream`, then acknowledge for ranks
 * [rank_first, rank_first + rank_count) (rank_first = VMMT_ALL_RANKS: all).
 * The first consume of a pool imports it (broker or FABRIC), maps it and
 * grants `device` access. Stream-ordered pools: the copy waits for the
 * producer's ready flag on `stream`, and the call returns without
 * synchronizing. A failed copy still acknowledges, so the slice is released;
 * the descriptor cannot be consumed again.
 */
VMMT_API int vmmt_consume(vmmt_consumer *consumer, const vmmt_desc *desc, int device, uint64_t dst,
                          uint64_t dst_size, void *stream, int rank_first, int rank_count);

/* Acknowledge without copying (a dropped request). */
VMMT_API int vmmt_consumer_ack(vmmt_consumer *consumer, const vmmt_desc *desc, int device,
                               void *stream, int rank_first, int rank_count);

/*
 * Unmap a pool and forget it. Streams that consumed from it must be
 * synchronized first. VMMT_OK if it was not cached. The producer is told that
 * this process lets go of the pool and lives on (its ranks are not released),
 * as it is by vmmt_consumer_destroy.
 */
VMMT_API int vmmt_consumer_evict(vmmt_consumer *consumer, const uint8_t pool_id[16], int device);

/* Pools currently imported. */
VMMT_API int vmmt_consumer_pool_count(vmmt_consumer *consumer);

/* Evict every pool and free. NULL is allowed. */
VMMT_API void vmmt_consumer_destroy(vmmt_consumer *consumer);

#ifdef __cplusplus
}
#endif

#endif
