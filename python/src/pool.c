/*
 * vmmt._vmmt.Pool: a producer pool. publish() takes DLPack capsules, so it
 * reads each tensor's pointer, dtype and shape itself and publishes them in
 * one call. A stream-ordered publish returns before its copy has run, so the
 * source tensors must outlive the copy: the pool keeps each publish's
 * managed tensors with an event recorded after it, and calls their deleters
 * once the event has completed (checked at every publish, reclaim, drain and
 * close), never earlier.
 */
#include <string.h>

#include "py_vmmt.h"

#include "argconv.h"

#include "driver.h"
#include "status.h"

/* The sources of one publish, alive until `done` has completed. */
struct keep {
    struct keep *next;
    CUevent done;
    PyObject *owners; /* publish_raw: the arrays themselves (a tuple) */
    size_t n;
    struct vmmtpy_src src[];
};

typedef struct {
    PyObject_HEAD vmmt_pool *pool;
    int device;
    int closed;
    struct keep *kept;  /* oldest first */
    struct keep **tail; /* where the next one goes */
    CUevent spare[8];   /* events to reuse: creating one per publish costs microseconds */
    int spare_count;
    Py_ssize_t kept_count;
} PoolObject;

static void keep_release(struct keep *k)
{
    for (size_t i = 0; i < k->n; i++)
        vmmtpy_src_release(&k->src[i]);
    Py_CLEAR(k->owners);
}

/* Take k out of the kept list; pp points at the link that holds it. GIL held. */
static void unlink_keep(PoolObject *self, struct keep **pp, struct keep *k)
{
    *pp = k->next;
    if (self->tail == &k->next) self->tail = pp;
    self->kept_count--;
}

/*
 * Give back the sources whose copies are done; with `wait`, all of them,
 * waiting for each copy without the GIL. An entry leaves the list before
 * the GIL is released or any deleter runs (deleters run Python code, which
 * may publish again), so no other thread or reentrant call ever sees it.
 * A failed event says nothing about the copy: those sources stay alive
 * forever. GIL held.
 */
static int retire(PoolObject *self, int wait)
{
    const struct vmmt_drv *d;
    struct keep **pp = &self->kept, *k, *done = NULL;
    int st = VMMT_OK;

    if (self->kept == NULL) return VMMT_OK;
    d = vmmt__drv();
    if (d == NULL || vmmt__ctx_enter(self->device) != VMMT_OK) return vmmt_last_status();
    while ((k = *pp) != NULL) {
        CUresult r = k->done != NULL ? d->cuEventQuery(k->done) : CUDA_SUCCESS;
        if (r == CUDA_ERROR_NOT_READY) {
            pp = &k->next;
            continue;
        }
        if (r != CUDA_SUCCESS) {
            st = vmmt__cu_fail(r, "checking that a publish's copy finished");
            k->n = 0;
            k->owners = NULL;
        }
        unlink_keep(self, pp, k);
        k->next = done;
        done = k;
    }
    while (wait && (k = self->kept) != NULL) {
        CUresult r = CUDA_SUCCESS;
        unlink_keep(self, &self->kept, k);
        if (k->done != NULL) {
            Py_BEGIN_ALLOW_THREADS;
            r = d->cuEventSynchronize(k->done);
            Py_END_ALLOW_THREADS;
        }
        if (r != CUDA_SUCCESS) {
            st = vmmt__cu_fail(r, "waiting for a publish's copy to finish");
            k->n = 0;
            k->owners = NULL;
        }
        k->next = done;
        done = k;
    }
    for (k = done; k != NULL; k = k->next) {
        if (k->done == NULL) continue;
        if (self->spare_count < (int)(sizeof self->spare / sizeof self->spare[0]))
            self->spare[self->spare_count++] = k->done;
        else
            d->cuEventDestroy(k->done);
    }
    vmmt__ctx_leave();
    while ((k = done) != NULL) {
        done = k->next;
        keep_release(k);
        PyMem_Free(k);
    }
    return st;
}

static int pool_init(PoolObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {
        "device",      "memory_size",          "consumer_count", "max_slices",
        "handle_type", "allow_posix_fallback", "round_up",       "broker_path",
        "timeout_ms",  "recycle_interval_us",  "handoff",        "device_control_table",
        NULL};
    vmmt_pool_config c;
    const char *handle = "auto", *handoff = "auto", *broker = NULL;
    unsigned long long size = 0;
    unsigned int max_slices, recycle;
    int fallback, round_up, dct, st;
    vmmt_handle_type ht;

    if (self->pool != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Pool.__init__ called twice");
        return -1;
    }
    vmmt_pool_config_init(&c);
    max_slices = c.max_slices;
    recycle = c.recycle_interval_us;
    fallback = c.allow_posix_fallback;
    round_up = c.round_up;
    dct = c.device_control_table;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iO&i|O&sppziO&sp", kwlist, &c.device,
                                     vmmtpy_u64_arg, &size, &c.consumer_count, vmmtpy_u32_arg,
                                     &max_slices, &handle, &fallback, &round_up, &broker,
                                     &c.timeout_ms, vmmtpy_u32_arg, &recycle, &handoff, &dct))
        return -1;
    if ((st = vmmt_handle_type_parse(handle, &ht)) != VMMT_OK) {
        vmmtpy_raise(st);
        return -1;
    }
    if (strcmp(handoff, "auto") == 0)
        c.handoff = VMMT_HANDOFF_AUTO;
    else if (strcmp(handoff, "stream") == 0)
        c.handoff = VMMT_HANDOFF_STREAM;
    else if (strcmp(handoff, "sync") == 0)
        c.handoff = VMMT_HANDOFF_SYNC;
    else {
        PyErr_Format(PyExc_ValueError, "handoff='%s'; use 'auto', 'stream' or 'sync'", handoff);
        return -1;
    }
    c.memory_size = size;
    c.max_slices = max_slices;
    c.recycle_interval_us = recycle;
    c.handle_type = ht;
    c.allow_posix_fallback = fallback;
    c.round_up = round_up;
    c.broker_path = broker;
    c.device_control_table = dct;
    Py_BEGIN_ALLOW_THREADS;
    st = vmmt_pool_create(&c, &self->pool);
    Py_END_ALLOW_THREADS;
    if (st != VMMT_OK) {
        self->pool = NULL;
        vmmtpy_raise(st);
        return -1;
    }
    self->device = c.device;
    self->tail = &self->kept;
    return 0;
}

static int check_open(PoolObject *self)
{
    if (self->pool != NULL && !self->closed) return 0;
    vmmt__fail(VMMT_ECLOSED, "the pool is closed");
    vmmtpy_raise(VMMT_ECLOSED);
    return -1;
}

/*
 * The emulated driver's device memory is host memory, so its consumed
 * buffers present themselves as CPU arrays; published again (a relay), they
 * are device memory all the same. On the real driver a CPU array is never
 * device memory, so this asks only the emulator.
 */
static int emu_device_memory(PoolObject *self, uint64_t ptr)
{
    unsigned type = 0;
    int yes = 0;

    if (!vmmtpy_on_emu() || vmmt__ctx_enter(self->device) != VMMT_OK) return 0;
    yes = vmmt__drv()->cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr) ==
              CUDA_SUCCESS &&
          type == CU_MEMORYTYPE_DEVICE;
    vmmt__ctx_leave();
    return yes;
}

/* An event recorded on `stream` after the publish; NULL with an error set on failure. */
static int record_done(PoolObject *self, void *stream, CUevent *out)
{
    const struct vmmt_drv *d = vmmt__drv();
    CUevent ev = NULL;
    int st;

    if ((st = vmmt__ctx_enter(self->device)) != VMMT_OK) return st;
    if (self->spare_count > 0)
        ev = self->spare[--self->spare_count];
    else
        st = VMMT_CU(d, cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
    if (st == VMMT_OK) {
        st = VMMT_CU(d, cuEventRecord(ev, (CUstream)stream));
        if (st != VMMT_OK) d->cuEventDestroy(ev);
    }
    vmmt__ctx_leave();
    *out = st == VMMT_OK ? ev : NULL;
    return st;
}

/*
 * The common part of both publishes, sources taken into k and described in
 * bufs: publish, build the descriptors, and keep the sources until an event
 * after the copy has completed. Frees k (or keeps it) and bufs.
 */
static PyObject *publish_taken(PoolObject *self, struct keep *k, vmmt_buffer *bufs, Py_ssize_t n,
                               void *stream, int none_when_full)
{
    PyObject *out = NULL;
    vmmt_desc *descs = PyMem_Calloc((size_t)n, sizeof *descs);
    int st;

    if (descs == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (bufs[i].location == VMMT_LOC_HOST && emu_device_memory(self, bufs[i].ptr))
            bufs[i].location = VMMT_LOC_DEVICE;
    {
        vmmt_pool *pool = self->pool; /* read with the GIL: see close_pool */
        Py_BEGIN_ALLOW_THREADS;
        st = vmmt_publish_packed(pool, bufs, (size_t)n, stream, descs);
        Py_END_ALLOW_THREADS;
    }
    if (st == VMMT_EFULL && none_when_full) {
        out = Py_None;
        Py_INCREF(out);
        goto out;
    }
    if (st != VMMT_OK) {
        /* Quarantined: the copy may still read the sources, so they stay alive. */
        if (st == VMMT_EFAILED) k = NULL;
        vmmtpy_raise(st);
        goto out;
    }
    out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *b = PyBytes_FromStringAndSize((const char *)descs[i].bytes, VMMT_DESC_SIZE);
        if (b == NULL)
            Py_CLEAR(out);
        else
            PyList_SetItem(out, i, b);
    }
    /* The copy is on `stream`: keep the sources until it has passed. */
    if (record_done(self, stream, &k->done) != VMMT_OK) {
        vmmtpy_raise(vmmt_last_status());
        Py_CLEAR(out);
        /* Without an event the only safe point is after a synchronize. */
        if (vmmt__ctx_enter(self->device) == VMMT_OK) {
            vmmt__drv()->cuStreamSynchronize((CUstream)stream);
            vmmt__ctx_leave();
        }
        goto out;
    }
    *self->tail = k;
    self->tail = &k->next;
    self->kept_count++;
    k = NULL;
out:
    if (k != NULL) {
        keep_release(k);
        PyMem_Free(k);
    }
    PyMem_Free(bufs);
    PyMem_Free(descs);
    return out;
}

static int count_arg(PyObject *seq, Py_ssize_t *n)
{
    *n = PySequence_Size(seq);
    if (*n < 0) return -1;
    if (*n == 0 || *n > 64) {
        PyErr_Format(PyExc_ValueError, "publish takes 1 to 64 tensors at once, got %zd", *n);
        return -1;
    }
    return 0;
}

static int prepare(PoolObject *self, Py_ssize_t n, struct keep **k, vmmt_buffer **bufs)
{
    if (retire(self, 0) != VMMT_OK) {
        vmmtpy_raise(vmmt_last_status());
        return -1;
    }
    *k = PyMem_Calloc(1, sizeof **k + (size_t)n * sizeof(*k)->src[0]);
    *bufs = PyMem_Calloc((size_t)n, sizeof **bufs);
    if (*k != NULL && *bufs != NULL) return 0;
    PyMem_Free(*k);
    PyMem_Free(*bufs);
    PyErr_NoMemory();
    return -1;
}

/*
 * publish(capsules, stream, none_when_full) -> list of 512-byte descriptors.
 * One capsule is vmmt_publish, several are one packed publish. Every capsule
 * is taken (renamed "used_..."), whatever the outcome.
 */
static PyObject *pool_publish(PoolObject *self, PyObject *args)
{
    PyObject *seq;
    void *stream = NULL;
    int none_when_full = 0;
    Py_ssize_t n;
    struct keep *k;
    vmmt_buffer *bufs;

    if (!PyArg_ParseTuple(args, "OO&|p", &seq, vmmtpy_stream_conv, &stream, &none_when_full))
        return NULL;
    if (check_open(self) != 0 || count_arg(seq, &n) != 0 || prepare(self, n, &k, &bufs) != 0)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *cap = PySequence_GetItem(seq, i);
        int bad = cap == NULL || vmmtpy_src_take(cap, &k->src[i]) != 0;
        Py_XDECREF(cap);
        if (!bad) k->n = (size_t)i + 1;
        if (bad || vmmtpy_tensor_to_buffer(k->src[i].t, &bufs[i]) != 0) {
            keep_release(k);
            PyMem_Free(k);
            PyMem_Free(bufs);
            return NULL;
        }
    }
    return publish_taken(self, k, bufs, n, stream, none_when_full);
}

/*
 * publish_raw(items, stream, none_when_full): the fast path for arrays whose
 * library is known (PyTorch), without a DLPack capsule. Each item is
 * (owner, ptr, nbytes, code, bits, lanes, shape, location); the owner is
 * kept alive until the copy is done. The caller has checked that the array
 * is contiguous and that its library's work is ordered before `stream`.
 */
static PyObject *pool_publish_raw(PoolObject *self, PyObject *args)
{
    PyObject *seq, *owners;
    void *stream = NULL;
    int none_when_full = 0;
    Py_ssize_t n;
    struct keep *k;
    vmmt_buffer *bufs;

    if (!PyArg_ParseTuple(args, "OO&|p", &seq, vmmtpy_stream_conv, &stream, &none_when_full))
        return NULL;
    if (check_open(self) != 0 || count_arg(seq, &n) != 0) return NULL;
    if ((owners = PyTuple_New(n)) == NULL) return NULL;
    if (prepare(self, n, &k, &bufs) != 0) {
        Py_DECREF(owners);
        return NULL;
    }
    k->owners = owners;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_GetItem(seq, i), *owner, *shape;
        unsigned long long ptr, nbytes;
        int code, bits, lanes, loc, ok;
        vmmt_buffer *b = &bufs[i];

        ok = item != NULL && PyArg_ParseTuple(item, "OKKiiiOi", &owner, &ptr, &nbytes, &code, &bits,
                                              &lanes, &shape, &loc);
        if (ok) {
            Py_INCREF(owner);
            PyTuple_SetItem(owners, i, owner);
            b->ndim = (int)PySequence_Size(shape);
            if (b->ndim < 0 || b->ndim > VMMT_MAX_DIMS) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_ValueError,
                                 "tensor has %d dimensions; vmmt carries at most %d", b->ndim,
                                 VMMT_MAX_DIMS);
                ok = 0;
            }
        }
        for (int d = 0; ok && d < b->ndim; d++) {
            PyObject *v = PySequence_GetItem(shape, d);
            b->shape[d] = v ? PyLong_AsLongLong(v) : -1;
            Py_XDECREF(v);
            ok = !PyErr_Occurred();
        }
        Py_XDECREF(item);
        if (!ok) {
            keep_release(k);
            PyMem_Free(k);
            PyMem_Free(bufs);
            return NULL;
        }
        b->ptr = ptr;
        b->nbytes = nbytes;
        b->dtype.code = (uint8_t)code;
        b->dtype.bits = (uint8_t)bits;
        b->dtype.lanes = (uint16_t)lanes;
        b->location = loc;
    }
    return publish_taken(self, k, bufs, n, stream, none_when_full);
}

static PyObject *pool_cancel(PoolObject *self, PyObject *arg)
{
    vmmt_desc d;
    int st;

    if (check_open(self) != 0 || vmmtpy_desc_arg(arg, &d) != 0) return NULL;
    st = vmmt_cancel(self->pool, &d);
    if (st != VMMT_OK) return vmmtpy_raise(st);
    Py_RETURN_NONE;
}

static PyObject *pool_reclaim(PoolObject *self, PyObject *unused)
{
    uint32_t freed = 0;
    int st;

    (void)unused;
    if (check_open(self) != 0) return NULL;
    retire(self, 0);
    {
        vmmt_pool *pool = self->pool;
        Py_BEGIN_ALLOW_THREADS;
        st = vmmt_pool_reclaim(pool, &freed);
        Py_END_ALLOW_THREADS;
    }
    if (st != VMMT_OK) return vmmtpy_raise(st);
    return PyLong_FromUnsignedLong(freed);
}

static PyObject *pool_drain(PoolObject *self, PyObject *args)
{
    int timeout_ms = 5000, st;

    if (!PyArg_ParseTuple(args, "|i", &timeout_ms)) return NULL;
    if (check_open(self) != 0) return NULL;
    {
        vmmt_pool *pool = self->pool;
        Py_BEGIN_ALLOW_THREADS;
        st = vmmt_pool_drain(pool, timeout_ms);
        Py_END_ALLOW_THREADS;
    }
    if (st != VMMT_OK) return vmmtpy_raise(st);
    /* Drained: every copy is done, so every source can go. */
    retire(self, 1);
    Py_RETURN_NONE;
}

static PyObject *pool_stats(PoolObject *self, PyObject *unused)
{
    vmmt_pool_stats s;
    int st;

    (void)unused;
    if (check_open(self) != 0) return NULL;
    st = vmmt_pool_get_stats(self->pool, &s);
    if (st != VMMT_OK) return vmmtpy_raise(st);
    return Py_BuildValue(
        "{s:s,s:s,s:O,s:O,s:K,s:K,s:K,s:I,s:I,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K}", "handle_type",
        vmmt_handle_type_name(s.handle_type), "handoff", vmmt_handoff_name(s.handoff),
        "fell_back_to_posix", s.fell_back_to_posix ? Py_True : Py_False, "host_control_table",
        s.host_control_table ? Py_True : Py_False, "allocation_size",
        (unsigned long long)s.allocation_size, "table_bytes", (unsigned long long)s.table_bytes,
        "data_bytes", (unsigned long long)s.data_bytes, "slots", s.slots, "in_flight", s.in_flight,
        "in_flight_bytes", (unsigned long long)s.in_flight_bytes, "published",
        (unsigned long long)s.published, "recycled", (unsigned long long)s.recycled, "cancelled",
        (unsigned long long)s.cancelled, "full", (unsigned long long)s.full, "reclaims",
        (unsigned long long)s.reclaims, "broker_served", (unsigned long long)s.broker_served,
        "broker_refused", (unsigned long long)s.broker_refused);
}

/* Sources still held for copies that may be running (tests use it). */
static PyObject *pool_pending(PoolObject *self, PyObject *unused)
{
    (void)unused;
    return PyLong_FromSsize_t(self->kept_count);
}

static void release_events(PoolObject *self)
{
    if (self->spare_count == 0) return;
    if (vmmt__drv() == NULL || vmmt__ctx_enter(self->device) != VMMT_OK) return;
    while (self->spare_count > 0)
        vmmt__drv()->cuEventDestroy(self->spare[--self->spare_count]);
    vmmt__ctx_leave();
}

/* Shut the pool down: every copy done, sources given back, device memory freed. */
/*
 * Shut the pool down: every copy done, sources given back, device memory
 * released. The handle itself is freed only in dealloc: another thread may
 * still be inside a call that read it before close (the library answers it
 * with VMMT_ECLOSED), and dealloc cannot run while any call holds the object.
 */
static int close_pool(PoolObject *self)
{
    vmmt_pool *pool = self->pool;
    int st = VMMT_OK;

    if (pool == NULL || self->closed) return VMMT_OK;
    self->closed = 1;
    retire(self, 1);
    release_events(self);
    Py_BEGIN_ALLOW_THREADS;
    st = vmmt_pool_shutdown(pool);
    Py_END_ALLOW_THREADS;
    return st;
}

static PyObject *pool_close(PoolObject *self, PyObject *unused)
{
    int st;

    (void)unused;
    st = close_pool(self);
    if (st != VMMT_OK) return vmmtpy_raise(st);
    Py_RETURN_NONE;
}

static PyObject *pool_get_closed(PoolObject *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(self->pool == NULL || self->closed);
}

static PyObject *pool_get_device(PoolObject *self, void *closure)
{
    (void)closure;
    return PyLong_FromLong(self->device);
}

static void pool_dealloc(PoolObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);

    if (close_pool(self) != VMMT_OK) PyErr_Clear();
    retire(self, 1); /* publishes that finished on other threads after close */
    release_events(self);
    vmmt_pool_destroy(self->pool);
    self->pool = NULL;
    tp_free(self);
    Py_DECREF(tp);
}

vmmt_pool *vmmtpy_pool_handle(PyObject *o)
{
    if (!PyObject_TypeCheck(o, vmmtpy_PoolType) || ((PoolObject *)o)->pool == NULL ||
        ((PoolObject *)o)->closed) {
        PyErr_SetString(PyExc_TypeError, "expected an open vmmt._vmmt.Pool");
        return NULL;
    }
    return ((PoolObject *)o)->pool;
}

static PyMethodDef pool_methods[] = {
    {"publish", (PyCFunction)pool_publish, METH_VARARGS,
     "publish(capsules, stream, none_when_full=False) -> list of descriptor bytes"},
    {"publish_raw", (PyCFunction)pool_publish_raw, METH_VARARGS,
     "publish_raw(items, stream, none_when_full=False): the capsule-free fast path"},
    {"cancel", (PyCFunction)pool_cancel, METH_O, "cancel(descriptor bytes)"},
    {"reclaim", (PyCFunction)pool_reclaim, METH_NOARGS, "reclaim() -> slices freed"},
    {"drain", (PyCFunction)pool_drain, METH_VARARGS, "drain(timeout_ms=5000)"},
    {"stats", (PyCFunction)pool_stats, METH_NOARGS, "stats() -> dict"},
    {"pending", (PyCFunction)pool_pending, METH_NOARGS, "sources kept for running copies"},
    {"close", (PyCFunction)pool_close, METH_NOARGS, "close()"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef pool_getset[] = {
    {"closed", (getter)pool_get_closed, NULL, "whether close() ran", NULL},
    {"device", (getter)pool_get_device, NULL, "the producer's device", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot pool_slots[] = {
    {Py_tp_doc, "The C producer pool; use vmmt.Pool."},
    {Py_tp_init, pool_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, pool_dealloc},
    {Py_tp_methods, pool_methods},
    {Py_tp_getset, pool_getset},
    {0, NULL},
};

PyType_Spec vmmtpy_pool_spec = {
    "vmmt._vmmt.Pool", sizeof(PoolObject), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE, pool_slots,
};
