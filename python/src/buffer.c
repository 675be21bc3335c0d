/*
 * vmmt._vmmt.Buffer: device memory a consume filled, handed to array
 * libraries through DLPack (torch.from_dlpack, cupy.from_dlpack,
 * numpy.from_dlpack on the emulated driver).
 *
 * Lifetime: each capsule's managed tensor holds a reference to the Buffer,
 * so the memory lives until the last array made from it is gone. The
 * deleter may run on any thread, with or without the GIL, and even after the
 * interpreter has shut down: it frees its own block in plain C and touches
 * Python only while the interpreter is alive (taking the GIL for the
 * DECREF); after shutdown it leaves the Buffer, whose memory the process's
 * exit returns.
 *
 * Streams: the consume's copy was enqueued on `stream`. __dlpack__(stream=s)
 * orders s after that copy with an event (no host synchronization); a CPU
 * view (emulated driver) synchronizes the copy stream first, since a CPU
 * reader has no stream to order.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "py_vmmt.h"

#include "driver.h"
#include "status.h"

#define CU_STREAM_LEGACY_HANDLE ((CUstream)0x1)

typedef struct {
    PyObject_HEAD uint64_t ptr;
    uint64_t nbytes;
    int device;
    int host_view;
    int synced; /* the copy stream was synchronized since the consume */
    void *stream;
    DLDataType dtype;
    int ndim;
    int64_t shape[VMMT_MAX_DIMS];
    int64_t strides[VMMT_MAX_DIMS];
    PyObject *keeper; /* a view (reservation): the memory is keeper's, not freed here */
    struct vmmtpy_mem_cache *cache; /* where the memory goes back; NULL: to the driver */
} BufferObject;

uint64_t vmmtpy_cache_take(struct vmmtpy_mem_cache *c, int device, void *stream, uint64_t nbytes)
{
    for (int i = 0; c != NULL && !c->closed && i < c->count; i++) {
        if (c->e[i].device != device || c->e[i].stream != stream || c->e[i].nbytes != nbytes)
            continue;
        uint64_t ptr = c->e[i].ptr;
        c->bytes -= nbytes;
        /* The rest keep their order, oldest first: cache_put frees from the
         * front (an outside attack found a hit moving the newest block there). */
        memmove(&c->e[i], &c->e[i + 1], sizeof c->e[0] * (size_t)(c->count - i - 1));
        c->count--;
        c->hits++;
        return ptr;
    }
    if (c != NULL) c->misses++;
    return 0;
}

/* Free the oldest block held: the first, since blocks are appended as they
 * are freed into the cache and a hit keeps the others' order. */
static void cache_drop_oldest(struct vmmtpy_mem_cache *c)
{
    if (vmmt_mem_free(c->e[0].device, c->e[0].ptr) != VMMT_OK)
        vmmt__log(VMMT_LOG_WARN, "freeing a cached buffer: %s", vmmt_last_error());
    c->bytes -= c->e[0].nbytes;
    memmove(&c->e[0], &c->e[1], sizeof c->e[0] * (size_t)(c->count - 1));
    c->count--;
}

/*
 * Keep a freed block; 0 when it is larger than the whole cache (the caller
 * frees it). Older blocks make room for it, oldest first, so that a new
 * steady size takes over: before, a block as large as the cache was never
 * kept once anything smaller was, and each such consume paid cuMemAlloc and
 * cuMemFree (316 us of a 64 MiB round trip on the H200, BENCHMARKS.md).
 */
static int cache_put(struct vmmtpy_mem_cache *c, int device, void *stream, uint64_t nbytes,
                     uint64_t ptr)
{
    if (c == NULL || c->closed || nbytes > c->limit) return 0;
    while (c->count > 0 && (c->count == VMMTPY_CACHE_ENTRIES || nbytes > c->limit - c->bytes))
        cache_drop_oldest(c);
    c->e[c->count].device = device;
    c->e[c->count].stream = stream;
    c->e[c->count].nbytes = nbytes;
    c->e[c->count].ptr = ptr;
    c->count++;
    c->bytes += nbytes;
    return 1;
}

void vmmtpy_cache_close(struct vmmtpy_mem_cache *c)
{
    if (c == NULL || c->closed) return;
    c->closed = 1;
    while (c->count > 0) {
        c->count--;
        if (vmmt_mem_free(c->e[c->count].device, c->e[c->count].ptr) != VMMT_OK)
            vmmt__log(VMMT_LOG_WARN, "freeing a cached buffer: %s", vmmt_last_error());
    }
    c->bytes = 0;
}

void vmmtpy_cache_unref(struct vmmtpy_mem_cache *c)
{
    if (c != NULL && --c->refs == 0) {
        vmmtpy_cache_close(c);
        PyMem_Free(c);
    }
}

void vmmtpy_buffer_set_cache(PyObject *buffer, struct vmmtpy_mem_cache *c)
{
    BufferObject *b = (BufferObject *)buffer;

    if (c != NULL) c->refs++;
    b->cache = c;
}

/* One exported tensor: the managed struct first, so the deleter finds the block. */
struct export_block {
    union {
        DLManagedTensorVersioned v;
        DLManagedTensor l;
    } m;
    int versioned;
    int64_t shape[VMMT_MAX_DIMS];
    int64_t strides[VMMT_MAX_DIMS];
    PyObject *owner;
};

PyObject *vmmtpy_buffer_new(int device, uint64_t ptr, uint64_t nbytes, const vmmt_desc_info *info,
                            void *stream, int host_view)
{
    BufferObject *b = PyObject_New(BufferObject, vmmtpy_BufferType);
    int64_t stride = 1;

    if (b == NULL) return NULL;
    b->ptr = ptr;
    b->nbytes = nbytes;
    b->device = device;
    b->host_view = host_view;
    b->synced = 0;
    b->stream = stream;
    b->keeper = NULL;
    b->cache = NULL;
    /* An untyped descriptor becomes a flat array of bytes. */
    if (info->dtype.bits == 0) {
        b->dtype.code = kDLUInt;
        b->dtype.bits = 8;
        b->dtype.lanes = 1;
        b->ndim = 1;
        b->shape[0] = (int64_t)nbytes;
    } else {
        b->dtype.code = info->dtype.code;
        b->dtype.bits = info->dtype.bits;
        b->dtype.lanes = info->dtype.lanes;
        b->ndim = info->ndim;
        memcpy(b->shape, info->shape, sizeof b->shape);
    }
    for (int k = b->ndim - 1; k >= 0; k--) {
        b->strides[k] = stride;
        stride *= b->shape[k] ? b->shape[k] : 1;
    }
    return (PyObject *)b;
}

PyObject *vmmtpy_buffer_view(int device, uint64_t ptr, uint64_t nbytes, int host_view,
                             PyObject *keeper)
{
    vmmt_desc_info info;
    BufferObject *b;

    memset(&info, 0, sizeof info);
    b = (BufferObject *)vmmtpy_buffer_new(device, ptr, nbytes, &info, NULL, host_view);
    if (b == NULL) return NULL;
    b->synced = 1; /* nothing was copied into it: no stream to wait for */
    Py_INCREF(keeper);
    b->keeper = keeper;
    return (PyObject *)b;
}

static void drop_owner(PyObject *owner)
{
    PyGILState_STATE g;

    /* After shutdown nothing Python may run: leave the Buffer to the exit. */
    if (!Py_IsInitialized()) return;
    g = PyGILState_Ensure();
    Py_DECREF(owner);
    PyGILState_Release(g);
}

static void deleter_versioned(DLManagedTensorVersioned *m)
{
    struct export_block *e = (struct export_block *)m;
    PyObject *owner = e->owner;

    free(e);
    drop_owner(owner);
}

static void deleter_legacy(DLManagedTensor *m)
{
    struct export_block *e = (struct export_block *)m;
    PyObject *owner = e->owner;

    free(e);
    drop_owner(owner);
}

/* A capsule nobody consumed: its tensor goes back through the deleter. */
static void capsule_destructor(PyObject *cap)
{
    void *p;

    if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
        p = PyCapsule_GetPointer(cap, "dltensor_versioned");
        deleter_versioned(p);
    } else if (PyCapsule_IsValid(cap, "dltensor")) {
        p = PyCapsule_GetPointer(cap, "dltensor");
        deleter_legacy(p);
    }
}

static int dl_device_type(const BufferObject *b)
{
    return b->host_view ? kDLCPU : kDLCUDA;
}

/* Make `consumer` (a DLPack stream value) see the copy; synchronize for a CPU view. */
static int order_after_copy(BufferObject *self, PyObject *stream_obj)
{
    const struct vmmt_drv *d;
    CUstream copy = self->stream ? (CUstream)self->stream : CU_STREAM_LEGACY_HANDLE, want;
    long long v = 0;
    CUevent ev = NULL;
    int st;

    /*
     * The array API: on the CPU, which has no streams, only None is accepted
     * (the view synchronizes instead); a stream there names nothing to order.
     */
    if (stream_obj != Py_None && self->host_view) {
        PyErr_Format(PyExc_ValueError,
                     "stream=%R: this buffer is exported as a CPU array, which takes no stream "
                     "(the array API: only None on the CPU); leave stream out",
                     stream_obj);
        return -1;
    }
    if (stream_obj != Py_None) {
        v = PyLong_AsLongLong(stream_obj);
        if (v == -1 && PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "stream must be an int (a CUstream handle)");
            return -1;
        }
    }
    if (v == -1) return 0; /* the consumer asked for no synchronization */
    if (v < -1) {
        PyErr_Format(PyExc_ValueError, "stream=%lld is not a CUDA stream", v);
        return -1;
    }
    d = vmmt__drv();
    if (d == NULL) return vmmtpy_raise(vmmt_last_status()), -1;
    if (self->host_view || dl_device_type(self) == kDLCPU) {
        if (self->synced) return 0;
        Py_BEGIN_ALLOW_THREADS;
        st = vmmt__ctx_enter(self->device);
        if (st == VMMT_OK) {
            st = VMMT_CU(d, cuStreamSynchronize(self->stream));
            vmmt__ctx_leave();
        }
        Py_END_ALLOW_THREADS;
        if (st != VMMT_OK) return vmmtpy_raise(st), -1;
        self->synced = 1;
        return 0;
    }
    /* None and 0 mean the legacy default stream (the array API's rule for CUDA). */
    want = (v == 0) ? CU_STREAM_LEGACY_HANDLE : (CUstream)(uintptr_t)v;
    if (want == copy || self->synced) return 0;
    if ((st = vmmt__ctx_enter(self->device)) != VMMT_OK) return vmmtpy_raise(st), -1;
    st = VMMT_CU(d, cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
    if (st == VMMT_OK) st = VMMT_CU(d, cuEventRecord(ev, copy));
    if (st == VMMT_OK) st = VMMT_CU(d, cuStreamWaitEvent(want, ev, 0));
    /* Destroying an event with a wait queued on it is allowed; the wait stands. */
    if (ev != NULL) d->cuEventDestroy(ev);
    vmmt__ctx_leave();
    if (st != VMMT_OK) return vmmtpy_raise(st), -1;
    return 0;
}

static PyObject *buffer_dlpack(BufferObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"stream", "max_version", "dl_device", "copy", NULL};
    PyObject *stream = Py_None, *max_version = Py_None, *dl_device = Py_None, *copy = Py_None;
    struct export_block *e;
    DLTensor *t;
    PyObject *cap;
    int versioned = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kw, "|O$OOO", kwlist, &stream, &max_version, &dl_device,
                                     &copy))
        return NULL;
    if (max_version != Py_None) {
        long major;
        PyObject *first = PySequence_GetItem(max_version, 0);
        if (first == NULL) return NULL;
        major = PyLong_AsLong(first);
        Py_DECREF(first);
        if (major == -1 && PyErr_Occurred()) return NULL;
        versioned = major >= 1;
    }
    if (dl_device != Py_None) {
        int type, id;
        if (!PyArg_ParseTuple(dl_device, "ii", &type, &id)) return NULL;
        if (type != dl_device_type(self) || (type == kDLCUDA && id != self->device)) {
            PyErr_Format(PyExc_BufferError,
                         "dl_device=(%d, %d): the buffer is on (%d, %d) and vmmt does not copy "
                         "it elsewhere",
                         type, id, dl_device_type(self), self->host_view ? 0 : self->device);
            return NULL;
        }
    }
    if (copy == Py_True) {
        PyErr_SetString(PyExc_BufferError,
                        "copy=True: vmmt hands out the consumed buffer itself and does not copy");
        return NULL;
    }
    if (order_after_copy(self, stream) != 0) return NULL;
    e = calloc(1, sizeof *e);
    if (e == NULL) return PyErr_NoMemory();
    memcpy(e->shape, self->shape, sizeof e->shape);
    memcpy(e->strides, self->strides, sizeof e->strides);
    e->owner = (PyObject *)self;
    e->versioned = versioned;
    if (versioned) {
        e->m.v.version.major = VMMT_DLPACK_MAJOR;
        e->m.v.version.minor = VMMT_DLPACK_MINOR;
        e->m.v.manager_ctx = e;
        e->m.v.deleter = deleter_versioned;
        e->m.v.flags = 0;
        t = &e->m.v.dl_tensor;
    } else {
        e->m.l.manager_ctx = e;
        e->m.l.deleter = deleter_legacy;
        t = &e->m.l.dl_tensor;
    }
    t->data = (void *)(uintptr_t)self->ptr;
    t->device.device_type = (DLDeviceType)dl_device_type(self);
    t->device.device_id = self->host_view ? 0 : self->device;
    t->ndim = self->ndim;
    t->dtype = self->dtype;
    t->shape = e->shape;
    t->strides = e->strides;
    t->byte_offset = 0;
    cap = PyCapsule_New(e, versioned ? "dltensor_versioned" : "dltensor", capsule_destructor);
    if (cap == NULL) {
        free(e);
        return NULL;
    }
    Py_INCREF(self); /* released by the deleter */
    return cap;
}

static PyObject *buffer_dlpack_device(BufferObject *self, PyObject *unused)
{
    (void)unused;
    return Py_BuildValue("(ii)", dl_device_type(self), self->host_view ? 0 : self->device);
}

/* Wait on the host until the consume's copy is done. */
static PyObject *buffer_synchronize(BufferObject *self, PyObject *unused)
{
    int st;

    (void)unused;
    Py_BEGIN_ALLOW_THREADS;
    st = vmmt__ctx_enter(self->device);
    if (st == VMMT_OK) {
        st = VMMT_CU(vmmt__drv(), cuStreamSynchronize((CUstream)self->stream));
        vmmt__ctx_leave();
    }
    Py_END_ALLOW_THREADS;
    if (st != VMMT_OK) return vmmtpy_raise(st);
    self->synced = 1;
    Py_RETURN_NONE;
}

static void buffer_dealloc(BufferObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);

    /*
     * The real driver's cuMemFree waits for work still using the memory; the
     * emulator's does not (a queued copy would then fault), so wait for the
     * copy there first.
     */
    if (self->keeper != NULL) {
        Py_CLEAR(self->keeper);
        tp_free(self);
        Py_DECREF(tp);
        return;
    }
    if (!self->synced && vmmtpy_on_emu() && self->stream != NULL &&
        vmmt__ctx_enter(self->device) == VMMT_OK) {
        vmmt__drv()->cuStreamSynchronize((CUstream)self->stream);
        vmmt__ctx_leave();
    }
    if (!cache_put(self->cache, self->device, self->stream, self->nbytes, self->ptr) &&
        vmmt_mem_free(self->device, self->ptr) != VMMT_OK)
        vmmt__log(VMMT_LOG_WARN, "freeing a consumed buffer: %s", vmmt_last_error());
    vmmtpy_cache_unref(self->cache);
    tp_free(self);
    Py_DECREF(tp);
}

static PyObject *get_ptr(BufferObject *self, void *c)
{
    (void)c;
    return PyLong_FromUnsignedLongLong(self->ptr);
}
static PyObject *get_nbytes(BufferObject *self, void *c)
{
    (void)c;
    return PyLong_FromUnsignedLongLong(self->nbytes);
}
static PyObject *get_device(BufferObject *self, void *c)
{
    (void)c;
    return PyLong_FromLong(self->device);
}
static PyObject *get_stream(BufferObject *self, void *c)
{
    (void)c;
    return PyLong_FromUnsignedLongLong((uintptr_t)self->stream);
}
static PyObject *get_shape(BufferObject *self, void *c)
{
    PyObject *t = PyTuple_New(self->ndim);

    (void)c;
    if (t == NULL) return NULL;
    for (int k = 0; k < self->ndim; k++)
        PyTuple_SetItem(t, k, PyLong_FromLongLong(self->shape[k]));
    return t;
}
static PyObject *get_dl_dtype(BufferObject *self, void *c)
{
    (void)c;
    return Py_BuildValue("(iii)", self->dtype.code, self->dtype.bits, self->dtype.lanes);
}

/* "float32", "bfloat16", "bool": DLPack's type code names (dlpack.h) with the bits. */
static PyObject *dtype_name(const DLDataType *t)
{
    static const char *const codes[] = {"int", "uint", "float", "handle", "bfloat", "complex"};

    if (t->code == kDLBool && t->bits == 8 && t->lanes == 1) return PyUnicode_FromString("bool");
    if (t->code < sizeof codes / sizeof codes[0] && t->lanes == 1)
        return PyUnicode_FromFormat("%s%d", codes[t->code], (int)t->bits);
    return PyUnicode_FromFormat("dl(%d,%d,%d)", (int)t->code, (int)t->bits, (int)t->lanes);
}

/* What it holds and where: dtype, shape, bytes, device, and a view's or an owner's memory. */
static PyObject *buffer_repr(BufferObject *self)
{
    PyObject *shape = get_shape(self, NULL), *dtype = dtype_name(&self->dtype), *out = NULL;
    char ptr[32];

    if (shape != NULL && dtype != NULL) {
        snprintf(ptr, sizeof ptr, "0x%llx", (unsigned long long)self->ptr);
        out = PyUnicode_FromFormat("Buffer(dtype=%U, shape=%R, nbytes=%llu, device=%d, "
                                   "memory=%s, ptr=%s%s)",
                                   dtype, shape, (unsigned long long)self->nbytes, self->device,
                                   self->host_view ? "host" : "device", ptr,
                                   self->keeper != NULL ? ", view of a reservation" : "");
    }
    Py_XDECREF(shape);
    Py_XDECREF(dtype);
    return out;
}

static PyMethodDef buffer_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))buffer_dlpack, METH_VARARGS | METH_KEYWORDS,
     "__dlpack__(stream=None, *, max_version=None, dl_device=None, copy=None) -> capsule"},
    {"__dlpack_device__", (PyCFunction)buffer_dlpack_device, METH_NOARGS,
     "(device type, device id): (2, n) for CUDA, (1, 0) on the emulated driver"},
    {"synchronize", (PyCFunction)buffer_synchronize, METH_NOARGS,
     "Wait on the host until the consume's copy is done."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef buffer_getset[] = {
    {"ptr", (getter)get_ptr, NULL, "device address", NULL},
    {"nbytes", (getter)get_nbytes, NULL, "bytes", NULL},
    {"device", (getter)get_device, NULL, "CUDA device", NULL},
    {"stream", (getter)get_stream, NULL, "the stream the consume copied on", NULL},
    {"shape", (getter)get_shape, NULL, "shape", NULL},
    {"dl_dtype", (getter)get_dl_dtype, NULL, "DLPack (code, bits, lanes)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

/*
 * Buffers come from consume() and reservations only: one made by Buffer()
 * would export a NULL pointer of no dtype and free address 0 when it goes.
 */
static PyObject *buffer_tp_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    (void)type;
    (void)args;
    (void)kw;
    PyErr_SetString(PyExc_TypeError,
                    "vmmt.Buffer cannot be made directly; Consumer.consume() returns one");
    return NULL;
}

static PyType_Slot buffer_slots[] = {
    {Py_tp_doc, "A consumed buffer in device memory; pass it to from_dlpack()."},
    {Py_tp_new, buffer_tp_new},
    {Py_tp_dealloc, buffer_dealloc},
    {Py_tp_repr, buffer_repr},
    {Py_tp_methods, buffer_methods},
    {Py_tp_getset, buffer_getset},
    {0, NULL},
};

PyType_Spec vmmtpy_buffer_spec = {
    "vmmt._vmmt.Buffer", sizeof(BufferObject), 0, Py_TPFLAGS_DEFAULT, buffer_slots,
};
