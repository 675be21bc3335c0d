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

/* Exceptions: vmmt.Error (RuntimeError) and its subclasses PoolFull, Timeout. */
extern PyObject *vmmtpy_Error, *vmmtpy_PoolFull, *vmmtpy_Timeout;

/*
 * Raise the exception for a failed call: ValueError for bad arguments
 * (VMMT_EINVAL), PoolFull, Timeout, or Error, with the library's message
 * and a `status` attribute. Returns NULL.
 */
PyObject *vmmtpy_raise(int status);

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

/* The C handles behind the types (the benchmark's C loop uses them); NULL + TypeError. */
vmmt_pool *vmmtpy_pool_handle(PyObject *o);
vmmt_consumer *vmmtpy_consumer_handle(PyObject *o);

/* The benchmark's C loop (bench.c), a module function. */
PyObject *vmmtpy_bench_c(PyObject *self, PyObject *args);

/* Whether the emulated driver is in use (its device memory is host memory). */
int vmmtpy_on_emu(void);

#endif
