/*
 * vmmt: hand GPU buffers between processes through CUDA virtual memory
 * management (VMM).
 *
 * One producer owns a bounded pool of device memory, exported once as a
 * shareable handle; consumers import it, copy out what was published for
 * them and acknowledge, so the slice can be reused. A pool may instead be
 * elastic (device memory in chunks, held only while buffers are in flight)
 * or live in host memory (its producer then needs no CUDA context at all).
 *
 * Conventions: every function that can fail returns a vmmt_status (VMMT_OK is
 * 0, failures are negative). On failure, vmmt_last_error() gives a message
 * for the calling thread that says what was asked, what was found and what to
 * do. Handles are opaque; every create has a matching destroy.
 *
 * Arguments: every function checks its pointers and sentinel values: a NULL
 * where an object or an output is needed, a count with a NULL array, a NULL
 * or wrapping destination or source range, is VMMT_EINVAL with a message (a function without
 * a status to return ignores it, as documented at the function), never a
 * crash.
 *
 * Threads: every function may be called from any thread, concurrently with
 * any other, on the same object too, unless its comment says "Not
 * thread-safe". The exceptions: vmmt_driver_select (before everything
 * else), and vmmt_pool_destroy / vmmt_consumer_destroy, which must be the
 * last call on their object (no other thread may be using it, or use it
 * after). The library's own threads (recycler, broker, acknowledgements) may
 * call the log callback; it must be thread-safe, and may be called with the
 * library's locks held: it must not call vmmt, nor wait for a thread that
 * may be inside a vmmt call.
 *
 * Struct versions: the config (pool, consumer and group), stats, buffer,
 * descriptor-info and device-probe structs may gain fields at their end in later versions. The
 * functions that take them are `static inline` wrappers that pass the struct's size as the caller
 * was compiled (sizeof), to exported `*_size` functions: a program built against an older vmmt.h
 * gets defaults for fields it does not know, and one built against a newer vmmt.h is refused
 * (VMMT_EINVAL) if it sets a field this library does not know. Bindings that do not compile this
 * header (ctypes, other languages) call the `*_size` functions with the size
 * of the struct they lay out. A size above 65536 bytes is no struct's and is
 * refused (VMMT_EINVAL). Initialise configs with *_config_init; stats
 * and info structs need no initialisation.
 */
#ifndef VMMT_H
#define VMMT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Builds that compile the library into another object (the Python
 * extension) define VMMT_API empty to keep its symbols private. */
#ifndef VMMT_API
#if defined(__GNUC__)
#define VMMT_API __attribute__((visibility("default")))
#else
#define VMMT_API
#endif
#endif

/*
 * The version of this header. VMMT_VERSION orders versions (0x000100 for
 * 0.1.0); vmmt_version() and vmmt_version_string() give the library's, which
 * may differ from the header a program was built with (see "Struct versions").
 */
#define VMMT_VERSION_MAJOR  0
#define VMMT_VERSION_MINOR  1
#define VMMT_VERSION_PATCH  0
#define VMMT_VERSION_STRING "0.1.0"
#define VMMT_VERSION        ((VMMT_VERSION_MAJOR << 16) | (VMMT_VERSION_MINOR << 8) | VMMT_VERSION_PATCH)

/* The library's VMMT_VERSION and VMMT_VERSION_STRING, as it was built. */
VMMT_API unsigned int vmmt_version(void);
VMMT_API const char *vmmt_version_string(void);

/* ------------------------------------------------------------------ status */

typedef enum vmmt_status {
    VMMT_OK = 0,
    VMMT_EINVAL = -1,    /* an argument or configuration is wrong */
    VMMT_ENODRIVER = -2, /* no NVIDIA driver could be loaded or initialised */
    VMMT_ENODEV = -3,    /* no such device, or no device at all */
    VMMT_ENOTSUP = -4,   /* the driver or device cannot do what was asked */
    VMMT_ECUDA = -5,     /* a CUDA driver call failed */
    VMMT_ENOMEM = -6,    /* memory exhausted: host, or the driver's (CUDA_ERROR_OUT_OF_MEMORY) */
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

/*
 * Set the calling thread's vmmt_last_error() to message (copied as text,
 * so '%' is a character; it may be vmmt_last_error() itself or a part of
 * it; at most 4095 bytes, never cut inside a UTF-8 character; NULL or ""
 * reads "no message given"), vmmt_last_status() to status (stored as given:
 * pass a failure's status, one of the negative VMMT_E*) and
 * vmmt_last_cuda_error() to 0, and return status. For libraries built on this API alone
 * (libvmmt_mpi, an engine's own adapter), so that their failures leave a
 * message as vmmt's own calls do.
 */
VMMT_API int vmmt_set_error(int status, const char *message);

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
 * unset). Passing NULL restores the default. The callback may run on any
 * thread, the library's own included, several at once. A level outside
 * VMMT_LOG_ERROR..VMMT_LOG_DEBUG is ignored.
 */
VMMT_API void vmmt_set_log(vmmt_log_fn fn, void *user);
VMMT_API void vmmt_set_log_level(vmmt_log_level level);

/* ------------------------------------------------------------------ driver */

/*
 * Choose the driver: "cuda" (libcuda.so.1, or the file named by
 * VMMT_LIBCUDA) or "emu" (the emulated driver on host memory, for machines
 * without a GPU). Without a call, VMMT_DRIVER decides, and "cuda" if unset.
 * Must precede every other call that touches a device: thread-safe, but a
 * call racing the first use of the driver on another thread may come too late
 * (VMMT_ESTATE). NULL or another name: VMMT_EINVAL.
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

/* "fabric", "posix_fd", "none" or "auto"; "unknown" for any other value. Never NULL. */
VMMT_API const char *vmmt_handle_type_name(vmmt_handle_type type);

/* Parse those names; VMMT_EINVAL with a message for anything else, NULL included. */
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

/*
 * Grows at its end only. (vmmt_handle_probe, an array member, keeps its
 * layout: what a candidate gains later goes into a new array at the end.)
 */
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
VMMT_API int vmmt_probe_device_size(int device, vmmt_device_probe *out, size_t out_size);
static inline int vmmt_probe_device(int device, vmmt_device_probe *out)
{
    return vmmt_probe_device_size(device, out, sizeof(vmmt_device_probe));
}

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

/* What a descriptor says, decoded and checked. Grows at its end only. */
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
    int stream_ordered;  /* the consumer must wait for the ready word */
    int pack_index;      /* position within a packed publish */
    int pack_count;      /* 1 for a single publish */
    int memory_location; /* VMMT_MEMORY_DEVICE or VMMT_MEMORY_HOST */
    uint64_t chunk_size; /* elastic pools: bytes per chunk; 0 otherwise */
    uint32_t chunk;      /* the chunk the buffer starts in */
    uint32_t
        incarnation; /* which making of that chunk (a chunk given back and made again differs) */
} vmmt_desc_info;

/*
 * Decode and validate a descriptor without touching any device: VMMT_EPROTO,
 * naming the field and what was wrong, for anything inconsistent. The seal
 * (docs/descriptor.md) needs the pool's key, so only consumers of the pool
 * and its producer check it.
 */
VMMT_API int vmmt_desc_inspect_size(const vmmt_desc *desc, vmmt_desc_info *out, size_t out_size);
static inline int vmmt_desc_inspect(const vmmt_desc *desc, vmmt_desc_info *out)
{
    return vmmt_desc_inspect_size(desc, out, sizeof(vmmt_desc_info));
}

/* -------------------------------------------------------------- producer */

typedef struct vmmt_pool vmmt_pool;

/* How a consumer learns that a published buffer's bytes are in the pool. */
typedef enum vmmt_handoff {
    VMMT_HANDOFF_AUTO = 0,   /* stream-ordered where the driver allows a wait on imported memory */
    VMMT_HANDOFF_STREAM = 1, /* publish enqueues copy + ready flag and returns at once */
    VMMT_HANDOFF_SYNC = 2    /* publish synchronizes its stream before returning */
} vmmt_handoff;

VMMT_API const char *vmmt_handoff_name(vmmt_handoff mode);

/*
 * Where a pool's memory lives. A host pool is pinned host memory shared with
 * the consumers: its producer writes it with the CPU and needs no CUDA
 * context and no device memory (a process that never touches the GPU can
 * publish); consumers copy from it to their device as from a device pool.
 */
typedef enum vmmt_memory_location {
    VMMT_MEMORY_DEVICE = 0, /* device memory of `device` (default) */
    VMMT_MEMORY_HOST = 1    /* host memory on a NUMA node, exported as a POSIX fd */
} vmmt_memory_location;

VMMT_API const char *vmmt_memory_location_name(vmmt_memory_location loc);

/* Grows at its end only (see "Struct versions" at the top). */
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
     * pools always do. Default 0. Where memfd_create is refused (a seccomp
     * profile), a fixed device pool keeps it in device memory anyway, and
     * logs a warning saying why; host and elastic pools need the shared
     * table and fail (VMMT_ENOTSUP).
     */
    int device_control_table;
    /*
     * VMMT_MEMORY_HOST: the pool lives in host memory (POSIX_FD handles, a
     * shared host control table); `device` is then only the GPU whose
     * host NUMA node the memory is placed on, and the one a publish from
     * device memory copies on. Default VMMT_MEMORY_DEVICE.
     */
    vmmt_memory_location memory_location;
    int host_numa_node; /* host pools: the NUMA node; -1 (default): the device's, else 0 */
    /*
     * Elastic device pools: memory_size becomes the most the pool may hold.
     * Its address range is reserved once; physical chunks of chunk_size back
     * it only while slices in them are in flight, and a chunk idle for
     * idle_release_ms goes back to the device. Consumers import each chunk on
     * first use and keep it until the producer makes it again. A fixed pool is
     * the case min_resident = memory_size. Needs POSIX_FD (and a shared host
     * control table). Default 0: one fixed allocation.
     */
    int elastic;
    uint64_t chunk_size;      /* rounded up to the granularity; 0 (default): 4 granularity units */
    uint64_t min_resident;    /* bytes kept resident from the start, whole chunks; default 0 */
    uint32_t idle_release_ms; /* default 1500 */
    /*
     * Backstop for consumers the pool cannot watch (FABRIC pools, consumers
     * served without a liveness link): a rank that no live consumer process
     * has announced on its broker link, and that leaves a slice
     * unacknowledged for longer than this, is presumed dead and released as
     * by vmmt_pool_release_rank. 0 (the default): never; a rank that a live
     * process holds is never released this way. A rank is held from its
     * first consume of the pool: one whose first descriptor reaches it later
     * than the lease is presumed dead, so choose seconds, not milliseconds.
     */
    int consumer_lease_ms;
} vmmt_pool_config;

/*
 * Defaults as documented above; memory_size and consumer_count are left 0 and
 * must be set. NULL: nothing is written (the thread's error says why).
 */
VMMT_API void vmmt_pool_config_init_size(vmmt_pool_config *config, size_t size);
static inline void vmmt_pool_config_init(vmmt_pool_config *config)
{
    vmmt_pool_config_init_size(config, sizeof(vmmt_pool_config));
}

/*
 * Allocate, map and export the pool, and start its recycler (and broker, for
 * POSIX_FD). The application's current CUDA context is left as it was.
 * allowed_uid_count > 0 needs allowed_uids; *out is NULL on failure.
 */
VMMT_API int vmmt_pool_create_size(const vmmt_pool_config *config, size_t size, vmmt_pool **out);
static inline int vmmt_pool_create(const vmmt_pool_config *config, vmmt_pool **out)
{
    return vmmt_pool_create_size(config, sizeof(vmmt_pool_config), out);
}

/* Where a buffer's bytes are (vmmt_buffer.location). */
typedef enum vmmt_location {
    VMMT_LOC_DEVICE = 0, /* device memory the pool's device can read (the default) */
    VMMT_LOC_HOST = 1    /* host memory: pageable (malloc) or page-locked (pinned) */
} vmmt_location;

/*
 * A tensor to publish: device pointer, bytes, and optionally its DLPack dtype
 * and shape. Grows at its end only; a field added later means "as before"
 * when 0.
 */
typedef struct vmmt_buffer {
    uint64_t ptr; /* CUdeviceptr on the pool's device, or one it can read; a host address for
                     VMMT_LOC_HOST */
    uint64_t nbytes;
    vmmt_dtype dtype; /* bits == 0: untyped bytes */
    int ndim;
    int64_t shape[VMMT_MAX_DIMS];
    int location; /* a vmmt_location; 0 (device) when zero-initialised */
} vmmt_buffer;

/*
 * Several buffers in one slice under one control slot, each aligned to its
 * element size; out[i] describes bufs[i] (count 1..64). The slice is
 * acknowledged once a consumer has consumed (or dropped) every member, and
 * recycled once. buf_size is sizeof(vmmt_buffer) as the caller compiled it
 * (the array's stride).
 *
 * Before anything is reserved, each descriptor is built and checked exactly
 * as every reader (vmmt_desc_inspect, vmmt_consume, vmmt_consumer_ack,
 * vmmt_cancel) checks it: a buffer they would refuse is refused here with
 * VMMT_EINVAL naming the field (dtype.lanes 0 with bits > 0; code or lanes
 * set with bits 0; a negative dimension; nbytes other than
 * ceil(elements * bits * lanes / 8); an element count that overflows).
 */
VMMT_API int vmmt_publish_packed_size(vmmt_pool *pool, const vmmt_buffer *bufs, size_t count,
                                      size_t buf_size, void *stream, vmmt_desc *out);
static inline int vmmt_publish_packed(vmmt_pool *pool, const vmmt_buffer *bufs, size_t count,
                                      void *stream, vmmt_desc *out)
{
    return vmmt_publish_packed_size(pool, bufs, count, sizeof(vmmt_buffer), stream, out);
}

/*
 * Copy buf into a free slice on `stream` (a CUstream; NULL for the default
 * stream) and describe it in *out. Into a host pool, a buffer in host memory
 * (location VMMT_LOC_HOST) is copied by the CPU before the call returns, in
 * no CUDA context, and the stream is not used; one in device memory is
 * copied on the stream as for a device pool. VMMT_EFULL at once when no slice is free
 * even after reclaiming (fall back to another path, or retry later);
 * VMMT_ETOOBIG when it could never fit; VMMT_EINVAL for a buffer no reader
 * would accept (see vmmt_publish_packed).
 *
 * Host sources into a device pool: from page-locked memory the copy is
 * stream-ordered like a device source, so the caller keeps the bytes alive
 * and unchanged until `stream` has passed the publish. From pageable memory
 * the publish synchronizes `stream` before it returns (the driver would
 * stage such a copy through its own pinned buffer anyway), so the caller may
 * reuse the memory at once. The library asks the driver which one a pointer
 * is.
 */
static inline int vmmt_publish(vmmt_pool *pool, const vmmt_buffer *buf, void *stream,
                               vmmt_desc *out)
{
    return vmmt_publish_packed_size(pool, buf, 1, sizeof(vmmt_buffer), stream, out);
}

/*
 * Take back a descriptor that was never handed to a consumer. Idempotent:
 * cancelling another member of the same packed group, or the same
 * descriptor again, succeeds and does nothing. From the moment it returns
 * every consumer refuses the descriptor (VMMT_ESTATE), should it be handed
 * out by mistake; its slice is free once the publish's copy has landed.
 * Handed out after all, with a shared control table (POSIX_FD pools): a
 * consumer whose copy of it was already queued keeps the slice until that
 * copy is acknowledged, so the copy reads the buffer's own bytes. A packed
 * group half consumed keeps it until a later member is refused on the
 * group's stream (given back once the copies queued there are done) or the
 * rank is released; refused on another stream, the group gives it back at
 * once and vmmt_consumer_check says VMMT_EFAILED for its members' copies.
 * A device control table (FABRIC, device_control_table) has no such hold:
 * the slice is freed under the copy, and vmmt_consumer_check tells it
 * VMMT_EFAILED. VMMT_EPROTO for a descriptor altered after vmmt_publish
 * returned it (its seal fails) or from another pool.
 */
VMMT_API int vmmt_cancel(vmmt_pool *pool, const vmmt_desc *desc);

/*
 * Writing in place: a free slice of nbytes for the producer to fill itself
 * (its own kernel, or a memcpy for a host pool), saving the copy of
 * vmmt_publish. `ptr` is a device address for a device pool and a host
 * address (writable by this process's CPU) for a host pool. The slice is the
 * producer's until vmmt_commit hands it out or vmmt_cancel (with `token`)
 * gives it back; `token` is no descriptor for consumers (they refuse it with
 * VMMT_EINVAL), and once committed it cancels nothing: cancel the descriptor
 * the commit gave instead.
 */
typedef struct vmmt_reservation {
    uint64_t ptr;
    uint64_t nbytes;
    int location;    /* VMMT_LOC_DEVICE or VMMT_LOC_HOST: what ptr is */
    vmmt_desc token; /* names the reservation for vmmt_commit and vmmt_cancel */
} vmmt_reservation;

VMMT_API int vmmt_reserve(vmmt_pool *pool, uint64_t nbytes, vmmt_reservation *out);

/*
 * Publish a reservation: its first `what->nbytes` bytes (at most the
 * reserved size) with what's dtype and shape; `what` may be NULL for all
 * reserved bytes, untyped; what->ptr and location are ignored. Device pool:
 * the ready flag is written on `stream` after whatever filled the slice
 * there (the call synchronizes for a synchronous hand-off). Host pool: NULL
 * stream means the CPU wrote the bytes; a stream is synchronized first. A
 * reservation is committed or cancelled once; a second try is VMMT_ESTATE.
 * Cancel a reservation only when nothing writes into it any more.
 */
VMMT_API int vmmt_commit(vmmt_pool *pool, const vmmt_reservation *res, const vmmt_buffer *what,
                         void *stream, vmmt_desc *out);

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
 * released but by this call. An engine that restarts a rank under the same
 * number should call this after reaping the old process and before
 * publishing for the new one: the pool's own release of the dead process
 * then knows it has nothing left to do. A packed group a process is
 * consuming for a set of ranks that includes `rank` can no longer complete
 * there: its next member is refused, and its members are to be consumed
 * again for the set's other ranks. VMMT_EINVAL for a rank outside the pool.
 * Thread-safe; counted in vmmt_pool_stats.rank_releases and released_slices.
 */
VMMT_API int vmmt_pool_release_rank(vmmt_pool *pool, int rank);
/* Defined where vmmt_pool_release_rank exists, for code that builds against older headers. */
#define VMMT_HAVE_RELEASE_RANK 1

/*
 * Which ranks the pool found dead on its own since the last call: a
 * consumer process died holding them (POSIX_FD pools), or consumer_lease_ms
 * ran out. Writes at most `capacity` of them to `ranks`, lowest first, and
 * forgets those; the rest wait for the next call. *count says how many were
 * written (0: none new). Ranks released by vmmt_pool_release_rank are not
 * reported (the engine knows them), nor a death found before that call and
 * not yet taken: it would read as the death of the process restarted next.
 * For an engine that restarts ranks: poll it (cheap: no lock taken when
 * nothing is new) to learn which rank of which pool to restart. VMMT_EINVAL for a NULL pool or
 * count, a negative capacity, or NULL ranks with capacity > 0. Thread-safe.
 */
VMMT_API int vmmt_pool_take_dead_ranks(vmmt_pool *pool, int *ranks, int capacity, int *count);

/* Wait until nothing is in flight, at most timeout_ms (>= 0); VMMT_ETIMEDOUT otherwise. */
VMMT_API int vmmt_pool_drain(vmmt_pool *pool, int timeout_ms);

/* Grows at its end only; needs no initialisation. */
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
    vmmt_memory_location memory_location;
    uint64_t device_bytes; /* device memory the pool holds now (0 for a host pool) */
    uint64_t host_bytes;   /* pinned host memory of a host pool's allocation */
    /* Elastic pools (a fixed pool reports its allocation as resident, peak and max). */
    uint64_t resident_bytes; /* device memory backing the pool now */
    uint64_t peak_bytes;     /* the most resident at once */
    uint64_t max_bytes;      /* the most it may hold */
    uint64_t chunk_bytes;    /* 0 for a fixed pool */
    uint64_t chunks_made;    /* chunks created (and exported) */
    uint64_t chunks_released;
    /* Dead consumers: ranks released (a consumer process died, or vmmt_pool_release_rank). */
    uint64_t rank_releases;
    uint64_t released_slices; /* slices acknowledged on behalf of released ranks */
    uint32_t consumer_links;  /* consumer processes whose liveness link is open now */
    /* Publishes whose copy and ready flag went to the GPU as one kernel, not two submissions:
     * one device buffer of at most 64 KiB, 16-byte aligned and sized, on the pool's device. */
    uint64_t kernel_publishes;
} vmmt_pool_stats;

VMMT_API int vmmt_pool_get_stats_size(vmmt_pool *pool, vmmt_pool_stats *out, size_t out_size);
static inline int vmmt_pool_get_stats(vmmt_pool *pool, vmmt_pool_stats *out)
{
    return vmmt_pool_get_stats_size(pool, out, sizeof(vmmt_pool_stats));
}

/*
 * Refuse new publishes, wait for publishes in progress, stop the recycler
 * and broker, and release the device memory in reverse order. Bounded by
 * timeout_ms; idempotent, and safe while other threads still call into the
 * pool (they get VMMT_ECLOSED). Consumers that imported the pool keep their
 * mappings valid until they evict it. Open reservations (vmmt_reserve) are
 * not waited for: the memory under them is released, so the producer must
 * finish (synchronize) its own writes into a reservation before shutdown.
 */
VMMT_API int vmmt_pool_shutdown(vmmt_pool *pool);

/*
 * Shut down (if needed) and free. NULL is allowed. Not thread-safe: the last
 * call on the pool; no other thread may use it during or after.
 */
VMMT_API void vmmt_pool_destroy(vmmt_pool *pool);

/* ---------------------------------------------------------- device memory */

/*
 * Plain device memory, for buffers to publish from or consume into when the
 * application has no allocator of its own (the Python binding uses these).
 * Each call makes `device`'s primary context current for its duration.
 */

/* cuMemAlloc of nbytes (> 0) on device; *ptr receives the address. */
VMMT_API int vmmt_mem_alloc(int device, uint64_t nbytes, uint64_t *ptr);

/* Free what vmmt_mem_alloc gave; ptr 0 does nothing. Work using it must be done. */
VMMT_API int vmmt_mem_free(int device, uint64_t ptr);

/*
 * Copy nbytes from src to dst on `stream` (NULL: the default stream). Either
 * side may be device memory or host memory (pageable or pinned): unified
 * addressing tells them apart. Stream-ordered; synchronize `stream` before
 * reading the result from the host. Overlapping or wrapping ranges:
 * VMMT_EINVAL.
 */
VMMT_API int vmmt_mem_copy(int device, uint64_t dst, uint64_t src, uint64_t nbytes, void *stream);

/* -------------------------------------------------------------- consumer */

typedef struct vmmt_consumer vmmt_consumer;

/* Acknowledge for every consumer rank of the pool (one process serving all). */
#define VMMT_ALL_RANKS (-1)

/* Grows at its end only (see "Struct versions" at the top). */
typedef struct vmmt_consumer_config {
    int timeout_ms; /* broker fetch, waits for a ready flag on the host, and how long a device
                       table's acknowledgement that fails to write is tried again; default
                       (and 0) 5000; negative is VMMT_EINVAL */
    /*
     * Imported pools kept at most; importing one more evicts the least
     * recently used idle pool: no copy out of it still queued (each copy is
     * followed by an event the consumer watches) and no packed group half
     * consumed. Where none is idle, eviction waits for a later call, so the
     * count may exceed this while copies are queued; a pool is never unmapped
     * under a queued copy. A pool of a producer that restarted is thus let go
     * instead of holding its device memory forever; a pool whose producer
     * died, or shut the pool down, is let go once idle whatever the count.
     * Default 16; 0: no limit; negative is VMMT_EINVAL.
     */
    int max_pools;
} vmmt_consumer_config;

/* Defaults as documented above. NULL: nothing is written (the thread's error says why). */
VMMT_API void vmmt_consumer_config_init_size(vmmt_consumer_config *config, size_t size);
static inline void vmmt_consumer_config_init(vmmt_consumer_config *config)
{
    vmmt_consumer_config_init_size(config, sizeof(vmmt_consumer_config));
}

/* A per-process cache of imported pools. config may be NULL (the defaults). */
VMMT_API int vmmt_consumer_create_size(const vmmt_consumer_config *config, size_t size,
                                       vmmt_consumer **out);
static inline int vmmt_consumer_create(const vmmt_consumer_config *config, vmmt_consumer **out)
{
    return vmmt_consumer_create_size(config, sizeof(vmmt_consumer_config), out);
}

/*
 * Copy the buffer a descriptor names to dst (a device pointer on `device`,
 * dst_size bytes available) on `stream`, then acknowledge for ranks
 * [rank_first, rank_first + rank_count) (rank_first = VMMT_ALL_RANKS: all).
 * The first consume of a pool imports it (broker or FABRIC), maps it and
 * grants `device` access. Stream-ordered pools: the copy waits for the
 * producer's ready flag on `stream` (when the flag is not set yet), and the
 * call returns without synchronizing; except on a pool whose producer's death
 * this process cannot see (FABRIC: no broker), and where the driver refuses
 * the stream wait, whose flag is watched from the host, at most the
 * consumer's timeout_ms (VMMT_ETIMEDOUT, nothing queued), so that no stream
 * can wait for ever on a dead producer. A cancel of the descriptor during
 * such a wait is seen when it ends (its bytes landed: the copy is made, of
 * the slice the cancel leaves it; or the timeout, and a retry is refused). A failed copy still
 * acknowledges, so the slice is released; the descriptor cannot be consumed
 * again. A wait for the ready flag that failed, or an acknowledgement that
 * could not be queued, acknowledges nothing: the call may be retried. (The
 * acknowledgement itself is written by a thread of the consumer's once the
 * copy has completed, and only while the slot still shows the occupant; a
 * device table's is tried again there if its write fails, for up to the
 * consumer's timeout_ms, after which vmmt_consumer_check says VMMT_EFAILED and
 * the slice waits for vmmt_pool_release_rank. Never while the driver cannot
 * say whether the copy has completed: a copy whose event keeps failing for a
 * second is taken as failed on its stream, acknowledged, and
 * vmmt_consumer_check says VMMT_EFAILED.) dst must not be 0,
 * and dst + nbytes must not wrap. A descriptor changed in any byte after
 * vmmt_publish returned it, or made by a process that never held the pool,
 * fails its seal: VMMT_EPROTO, nothing imported, copied or written. A
 * descriptor whose slot no longer shows it live (cancelled, recycled,
 * released for dead ranks), or that any of the ranks asked for has already
 * consumed or acknowledged, in this process or any other, is VMMT_ESTATE, and
 * nothing is written; one whose producer died before its bytes landed is
 * VMMT_ECLOSED, as is the first of a pool whose broker no longer listens
 * (shut down, or its producer exited, before this process imported it).
 */
VMMT_API int vmmt_consume(vmmt_consumer *consumer, const vmmt_desc *desc, int device, uint64_t dst,
                          uint64_t dst_size, void *stream, int rank_first, int rank_count);

/*
 * Acknowledge without copying (a dropped request). The acknowledgement is
 * written only once the producer's copy has landed: with a shared host table
 * this call waits for it (at most the consumer's timeout_ms; usually it has
 * landed); with a device table the stream waits unless the row showed it
 * landed. A pool whose producer's death this process cannot see (FABRIC)
 * is waited for on the host, within timeout_ms, as by vmmt_consume. A
 * packed member that does not complete its group only records its part and
 * returns at once; the member that completes it waits. A failure
 * acknowledges nothing, and the call may be retried.
 */
VMMT_API int vmmt_consumer_ack(vmmt_consumer *consumer, const vmmt_desc *desc, int device,
                               void *stream, int rank_first, int rank_count);

/*
 * vmmt_consume and vmmt_consumer_ack for the `nranks` ranks listed in
 * `ranks` (any order, each once, each below the pool's consumer count), in
 * one call: one copy, then one acknowledgement for all of them. All or
 * nothing: where any rank listed has consumed or acknowledged the
 * descriptor already (or is consuming it in another process), the call is
 * VMMT_ESTATE and takes, copies and acknowledges nothing for the others,
 * which may then be asked for again. A process that acknowledges for a
 * group of ranks that are not consecutive (sglang's acknowledge_ranks) uses
 * these: called run by run, a later run's refusal left the earlier runs
 * acknowledged. The members of a packed group are consumed for the same
 * list (as a set: order does not matter). A NULL list, nranks < 1, a rank
 * listed twice or outside the pool: VMMT_EINVAL, nothing done.
 */
VMMT_API int vmmt_consume_ranks(vmmt_consumer *consumer, const vmmt_desc *desc, int device,
                                uint64_t dst, uint64_t dst_size, void *stream, const int *ranks,
                                int nranks);
VMMT_API int vmmt_consumer_ack_ranks(vmmt_consumer *consumer, const vmmt_desc *desc, int device,
                                     void *stream, const int *ranks, int nranks);

/*
 * Write now, in this thread, the acknowledgements of this consumer's copies
 * that have completed. A stream-ordered consume's acknowledgement is
 * otherwise written by the consumer's own thread, which looks at pending
 * copies every few tens of microseconds. Call this after synchronizing the
 * consume's stream when the producer should find the slice acknowledged at
 * once (a producer in the same process that recycles right after, as
 * sglang's tests do).
 * Never waits for a copy still running: those stay with the thread.
 * VMMT_EINVAL for NULL. Thread-safe.
 */
VMMT_API int vmmt_consumer_flush(vmmt_consumer *consumer);

/*
 * Were the bytes a consume copied really the producer's? VMMT_OK, or
 * VMMT_EFAILED when the producer died before its copy into the slice was
 * done (its ready flag never set): a consumer (this one or another) then
 * marked the flag ABANDONED so that streams are not blocked for ever, and
 * what landed at dst is not the buffer; also when the occupant left its slot
 * while this process's copy ran, and for a member of a packed group this
 * process never completed once the slot moved on (docs/design.md, the case
 * not covered).
 * Call it after synchronizing the consume's stream, before using the bytes,
 * wherever producers may die: it judges copies completed by then, and reads
 * a shared table's ready word, whatever this process has seen of the death.
 * It judges copies: of a descriptor this process never consumed it knows
 * only a shared table's ABANDONED, and otherwise says OK; it is not a test of
 * whether a descriptor is live (vmmt_consume refuses one that is not).
 * VMMT_EPROTO for a descriptor whose seal fails. A consumer learns of a producer's death
 * through the broker connection (POSIX_FD pools); consumes of such a pool
 * then fail with VMMT_ECLOSED, and the pool is let go once its copies are
 * done. Thread-safe.
 */
VMMT_API int vmmt_consumer_check(vmmt_consumer *consumer, const vmmt_desc *desc);

/*
 * Unmap a pool and forget it. VMMT_ESTATE while a call uses it, a copy out of
 * it has not finished (synchronize the streams that consumed from it) or a
 * packed group of it is half consumed. VMMT_OK if it was not cached. A
 * release that fails is retried later; the pool is never used again. The
 * producer is told that this process lets go of the pool and lives on (its
 * ranks are not released), as it is by vmmt_consumer_destroy.
 */
VMMT_API int vmmt_consumer_evict(vmmt_consumer *consumer, const uint8_t pool_id[16], int device);

/* Pools currently imported; 0 for NULL. */
VMMT_API int vmmt_consumer_pool_count(vmmt_consumer *consumer);

/*
 * Evict every pool and free. NULL is allowed. Bounded by timeout_ms: the
 * ready flags of dead producers are set first so that no stream of ours
 * waits on them; acknowledgements whose copies finish within the timeout are
 * written; a pool with a copy still queued after it stays mapped (leaked,
 * logged) rather than being unmapped under the copy.
 * Not thread-safe: the last call on the consumer; no other thread may use it
 * during or after.
 */
VMMT_API void vmmt_consumer_destroy(vmmt_consumer *consumer);

/* ---------------------------------------------------------- group exchange */

/*
 * The ranks of a job (tensor-parallel workers, say) map each other's device
 * allocations: every rank registers the same list of buffers, and gets for
 * each buffer a pointer per rank that this rank's device can read and write.
 * The exchange runs on the job's own collective (MPI, torch.distributed, or
 * the local adapter below), given as callbacks. docs/group.md has the
 * protocol and what happens on every failure.
 *
 * Every group call except the vmmt_group_get_* accessors is collective: all
 * ranks make it, in the same order. A group is not thread-safe.
 */
typedef struct vmmt_group vmmt_group;

/*
 * The job's collective. allgather copies `bytes` from every rank's `send`
 * into `recv` (world_size * bytes, rank r's block at r * bytes), on every
 * rank. barrier may be NULL. Both return 0 on success, anything else on
 * failure, with a reason written to err (err_cap bytes, NUL-terminated). They
 * must not wait forever: a collective whose peer died must fail. close, if
 * set, is called once: by vmmt_group_destroy, or by vmmt_group_create when
 * it fails (the group owns the adapter from the call on), unless the size
 * passed is no vmmt_group_config's, when the collective cannot be read.
 */
typedef struct vmmt_group_collective {
    int (*allgather)(void *ctx, const void *send, void *recv, size_t bytes, char *err,
                     size_t err_cap);
    int (*barrier)(void *ctx, char *err, size_t err_cap);
    void (*close)(void *ctx);
    void *ctx;
} vmmt_group_collective;

/* Grows at its end only (see "Struct versions" at the top). */
typedef struct vmmt_group_config {
    int rank;       /* 0 .. world_size - 1 */
    int world_size; /* 1 .. 4096 */
    int device;     /* this rank's device; default 0 */
    vmmt_group_collective collective;
    vmmt_handle_type handle_type; /* AUTO (default): the vote below; FABRIC or POSIX_FD to insist */
    int timeout_ms;               /* bound of each descriptor exchange; default 120000 */
    const char *socket_dir;       /* NULL: abstract socket names; else a directory for them */
    uint32_t max_allocations;     /* per rank and registration; default 4096 */
} vmmt_group_config;

/*
 * Defaults as documented above; rank, world_size and collective must be set.
 * A NULL config, or a size no vmmt_group_config has, is ignored.
 */
VMMT_API void vmmt_group_config_init_size(vmmt_group_config *config, size_t size);
static inline void vmmt_group_config_init(vmmt_group_config *config)
{
    vmmt_group_config_init_size(config, sizeof(vmmt_group_config));
}

/*
 * Agree on a handle type: every rank probes its device (vmmt_probe_device);
 * FABRIC when every rank can create and export it, else POSIX_FD when every
 * rank can and all ranks share a node. Otherwise every rank fails with the
 * same message naming each rank that cannot and why (VMMT_ENOTSUP); ranks on
 * different nodes without FABRIC fail naming the IMEX channel they need.
 * A node is the host name plus the kernel's boot id, or VMMT_GROUP_NODE.
 */
VMMT_API int vmmt_group_create_size(const vmmt_group_config *config, size_t size, vmmt_group **out);
static inline int vmmt_group_create(const vmmt_group_config *config, vmmt_group **out)
{
    return vmmt_group_create_size(config, sizeof(vmmt_group_config), out);
}

/*
 * The local adapter: processes of one node started together, meeting at
 * an abstract AF_UNIX name derived from `job` (any string the ranks share,
 * at most 85 bytes: a longer one is VMMT_EINVAL rather than cut).
 * Rank 0 gathers and answers; every wait is bounded by timeout_ms (0: 60000),
 * and a rank that dies fails the others' current collective. The group owns
 * the adapter. config->collective is ignored.
 */
VMMT_API int vmmt_group_create_local_size(const vmmt_group_config *config, size_t size,
                                          const char *job, vmmt_group **out);
static inline int vmmt_group_create_local(const vmmt_group_config *config, const char *job,
                                          vmmt_group **out)
{
    return vmmt_group_create_local_size(config, sizeof(vmmt_group_config), job, out);
}

/*
 * The local adapter's collective alone (to wrap it, say): rank 0 waits up to
 * timeout_ms for the others to join. Hand it to vmmt_group_create, which
 * owns it from then on; its close callback frees it.
 */
VMMT_API int vmmt_group_local_collective(const char *job, int rank, int world_size, int timeout_ms,
                                         vmmt_group_collective *out);

/* MPI: vmmt_group_create_mpi is in libvmmt_mpi, declared in vmmt_mpi.h. */

/* What the group agreed on, and this rank's place in it. */
VMMT_API vmmt_handle_type vmmt_group_handle_type(const vmmt_group *group);
VMMT_API int vmmt_group_rank(const vmmt_group *group);
VMMT_API int vmmt_group_world_size(const vmmt_group *group);
VMMT_API int vmmt_group_device(const vmmt_group *group);

/*
 * One buffer to register: a device pointer of this rank's device and its
 * size. Passed in arrays, so its layout is fixed: it never grows.
 */
typedef struct vmmt_group_buffer {
    uint64_t ptr;
    uint64_t nbytes;
} vmmt_group_buffer;

/*
 * Register `count` buffers (the same count on every rank; sizes may differ).
 * A buffer may cross several VMM allocations of its owner (each mapped whole,
 * as PyTorch's expandable segments and cuMemCreate users map them); every
 * allocation is shared once per group, whatever number of buffers or
 * registrations name it. On success ptrs[i * world_size + r] is rank r's
 * buffer i as this rank's device sees it (its own pointer for r == rank);
 * a buffer that spans several allocations is one contiguous range.
 * All or nothing, on every rank: when any rank fails, every rank returns an
 * error naming the failed ranks and causes, and nothing of this call stays
 * mapped or open.
 */
VMMT_API int vmmt_group_register(vmmt_group *group, const vmmt_group_buffer *buffers, size_t count,
                                 uint64_t *ptrs);

/* Buffers registered so far and peer allocations mapped, for tools and tests. */
VMMT_API int vmmt_group_get_counts(const vmmt_group *group, size_t *buffers,
                                   size_t *peer_allocations);

/*
 * A helper for tools and tests: `chunks` separate allocations of the group's
 * handle type on its device, mapped side by side into one range (so the
 * buffer crosses chunks - 1 allocation boundaries) with read-write access.
 * nbytes is rounded up to whole granularity units per chunk. Not collective.
 */
VMMT_API int vmmt_group_alloc(vmmt_group *group, uint64_t nbytes, int chunks, uint64_t *ptr);
VMMT_API int vmmt_group_free(vmmt_group *group, uint64_t ptr);

/*
 * Unmap every peer mapping, release every handle, free every range and close
 * every descriptor, also after failed calls; allocations from
 * vmmt_group_alloc are freed too. Not collective. NULL is allowed.
 */
VMMT_API void vmmt_group_destroy(vmmt_group *group);

#ifdef __cplusplus
}
#endif

#endif
