/*
 * Shared declarations of the CPython extension vmmt._vmmt. Written against
 * the limited API (abi3, CPython 3.9 and newer): one build serves every
 * CPython version, which is how the package built here with Debian's 3.11
 * runs unchanged on the GPU machine's 3.12 (python/README.md says more).
 */
#ifndef VMMT_PY_H
#define VMMT_PY_H

#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x03090000
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "dlpack.h"
#include "vmmt.h"

/* The exception family (errors.c has the tree). */
extern PyObject *vmmtpy_Error, *vmmtpy_NoRoom, *vmmtpy_PoolFull, *vmmtpy_TooLarge, *vmmtpy_Closed,
    *vmmtpy_Stale, *vmmtpy_ProducerGone, *vmmtpy_Timeout;

/*
 * Raise the exception for a failed call, from the one status table
 * (errors.c): ValueError for bad arguments (VMMT_EINVAL), PoolFull,
 * TooLarge, Closed, Stale, Timeout, or Error, with the library's message
 * (its C function names replaced by the Python methods) and a `status`
 * attribute. Returns NULL.
 */
PyObject *vmmtpy_raise(int status);
/* The same for consume, ack and check: VMMT_ECLOSED and VMMT_EFAILED are ProducerGone. */
PyObject *vmmtpy_raise_consume(int status);
/* A library message with its C function names replaced by the Python methods (a new str). */
PyObject *vmmtpy_python_message(const char *msg);
/* Add the exceptions and the status constants to the module; -1 with an error set. */
int vmmtpy_errors_add(PyObject *m);

/*
 * A new vmmt.Descriptor (the Python bytes subclass, registered by the
 * package through _set_descriptor_type) holding these 512 bytes, made by
 * bytes.__new__ without the validation of Descriptor(): the library just
 * built them. Plain bytes before the type is registered.
 */
PyObject *vmmtpy_desc_new(const uint8_t *bytes);

/* A 512-byte descriptor from bytes; ValueError otherwise. */
int vmmtpy_desc_arg(PyObject *o, vmmt_desc *d);

/* "O&" converter: a Python int (a CUstream handle, 0 for the default stream). */
int vmmtpy_stream_conv(PyObject *o, void *out);

/*
 * A tensor taken from a DLPack capsule: the capsule is renamed "used_...",
 * so the binding owns the managed tensor and must call its deleter once,
 * when the bytes are no longer needed (vmmtpy_src_release).
 */
struct vmmtpy_src {
    void *managed; /* DLManagedTensor or DLManagedTensorVersioned */
    int versioned;
    DLTensor *t;
};
int vmmtpy_src_take(PyObject *capsule, struct vmmtpy_src *out);
void vmmtpy_src_release(struct vmmtpy_src *s);
/* Read a capsule's tensor without taking it (the capsule keeps ownership). */
int vmmtpy_capsule_tensor(PyObject *capsule, DLTensor **t, int *readonly);
/* Fill a vmmt_buffer from a C-contiguous tensor; ValueError otherwise. */
int vmmtpy_tensor_to_buffer(const DLTensor *t, vmmt_buffer *b);

/* Types, made from their specs at module init. */
extern PyTypeObject *vmmtpy_PoolType, *vmmtpy_ConsumerType, *vmmtpy_BufferType;
extern PyType_Spec vmmtpy_pool_spec, vmmtpy_consumer_spec, vmmtpy_buffer_spec;
/* The group exchange (group.c): vmmt._vmmt.Group. */
extern PyTypeObject *vmmtpy_GroupType;
extern PyType_Spec vmmtpy_group_spec;

/*
 * A Buffer that owns nbytes of device memory at ptr (vmmt_mem_alloc), with
 * the consumed tensor's dtype and shape, and the stream its bytes were
 * written on. host_view: the emulated driver's device memory is host memory,
 * so the buffer presents itself as a CPU array.
 */
PyObject *vmmtpy_buffer_new(int device, uint64_t ptr, uint64_t nbytes, const vmmt_desc_info *info,
                            void *stream, int host_view);

/*
 * A Buffer that exports nbytes at ptr as flat writable uint8 without owning
 * them (a reservation's slice): keeper stays referenced while it lives.
 */
PyObject *vmmtpy_buffer_view(int device, uint64_t ptr, uint64_t nbytes, int host_view,
                             PyObject *keeper);

/*
 * A consumer's cache of freed device buffers (consume without out=), so a
 * steady stream of same-size consumes does not call cuMemAlloc/cuMemFree
 * (which synchronizes). A buffer is reused only for a consume on the same
 * device and stream it was consumed on, so stream order keeps work queued on
 * that stream ahead of the copy that overwrites it; work on other streams
 * must be ordered before the array is dropped (PyTorch's record_stream rule
 * for its own caching allocator). Bounded by bytes and entries; emptied on
 * the consumer's close. Used with the GIL held only; shared by the consumer
 * and its live buffers through `refs`.
 */
#define VMMTPY_CACHE_ENTRIES 16
struct vmmtpy_mem_cache {
    long refs;
    int closed; /* the consumer closed: buffers free straight to the driver */
    uint64_t limit, bytes;
    int count;
    struct {
        int device;
        void *stream;
        uint64_t nbytes, ptr;
    } e[VMMTPY_CACHE_ENTRIES];
    uint64_t hits, misses;
};
/* A cached block of exactly nbytes for (device, stream), or 0. */
uint64_t vmmtpy_cache_take(struct vmmtpy_mem_cache *c, int device, void *stream, uint64_t nbytes);
/* Drop one reference; the last frees the struct (after close emptied it). */
void vmmtpy_cache_unref(struct vmmtpy_mem_cache *c);
/* Close: free every cached block, and let later frees go to the driver. */
void vmmtpy_cache_close(struct vmmtpy_mem_cache *c);

/* Give a consumed Buffer its cache (a reference is taken); NULL: freed at once. */
void vmmtpy_buffer_set_cache(PyObject *buffer, struct vmmtpy_mem_cache *c);

/* Pool(...)'s arguments as a config (pool_config.c); -1 with an error set. broker_path
 * points into args: use the config while they are alive. */
int vmmtpy_pool_config(PyObject *args, PyObject *kw, vmmt_pool_config *c);

/* Every field of a pool's stats as a dict (pool_stats.c). */
PyObject *vmmtpy_pool_stats_dict(const vmmt_pool_stats *s);

/* The C handles behind the types (the benchmark's C loop uses them); NULL + TypeError. */
vmmt_pool *vmmtpy_pool_handle(PyObject *o);
vmmt_consumer *vmmtpy_consumer_handle(PyObject *o);

/* The log bridge's module functions (log_bridge.c). */
PyObject *vmmtpy_log_route(PyObject *self, PyObject *fn);
PyObject *vmmtpy_log_drain(PyObject *self, PyObject *unused);

/* The benchmark's C loop (bench.c), a module function. */
PyObject *vmmtpy_bench_c(PyObject *self, PyObject *args);

/* Whether the emulated driver is in use (its device memory is host memory). */
int vmmtpy_on_emu(void);

#endif
