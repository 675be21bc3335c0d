/*
 * vmmt._vmmt.Pool: a producer pool. publish() takes DLPack capsules, so it
 * reads each tensor's pointer, dtype and shape itself and publishes them in
 * one call; publish_raw and publish_tensor take PyTorch tensors' fields
 * directly. The sources stay alive until their copies are proven done
 * (pool_keep.c); the arguments (pool_config.c) and the stats (pool_stats.c)
 * have files of their own.
 */
#include <stdint.h>
#include <string.h>

#include "argconv.h"
#include "pool_keep.h"

#include "clock.h"
#include "desc.h"
#include "driver.h"
#include "pool_internal.h"
#include "status.h"

typedef struct {
    PyObject_HEAD vmmt_pool *pool;
    int device;
    int closed;
    int shut_down;           /* vmmt_pool_shutdown succeeded: nothing left to do */
    struct vmmtpy_kept kept; /* sources of copies that may still run */
} PoolObject;

static int pool_init(PoolObject *self, PyObject *args, PyObject *kw)
{
    vmmt_pool_config c;
    int st;

    if (self->pool != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Pool.__init__ called twice");
        return -1;
    }
    if (vmmtpy_pool_config(args, kw, &c) != 0) return -1;
    Py_BEGIN_ALLOW_THREADS;
    st = vmmt_pool_create(&c, &self->pool);
    Py_END_ALLOW_THREADS;
    if (st != VMMT_OK) {
        self->pool = NULL;
        vmmtpy_raise(st);
        return -1;
    }
    self->device = c.device;
    vmmtpy_kept_init(&self->kept, self->pool, self->device);
    return 0;
}

/* Whether the pool is open for call `what`; else an error naming the call. */
static int check_open(PoolObject *self, const char *what)
{
    if (self->pool != NULL && !self->closed) return 0;
    vmmt__fail(VMMT_ECLOSED, "Pool.%s: this pool is closed (Pool.close ran): make a new vmmt.Pool",
               what);
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

    /* A host pool copies host sources with the CPU: asking would make a context. */
    if (!vmmtpy_on_emu() || self->pool->host_mem || vmmt__ctx_enter(self->device) != VMMT_OK)
        return 0;
    yes = vmmt__drv()->cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr) ==
              CUDA_SUCCESS &&
          type == CU_MEMORYTYPE_DEVICE;
    vmmt__ctx_leave();
    return yes;
}

/*
 * The common part of both publishes, sources taken into k and described in
 * bufs: publish, build the descriptors, and keep the sources until an event
 * after the copy has completed. Frees k (or keeps it) and bufs.
 */
static PyObject *publish_taken(PoolObject *self, struct keep *k, vmmt_buffer *bufs, Py_ssize_t n,
                               void *stream)
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
    if (st != VMMT_OK) {
        /* Quarantined: the copy may still read the sources, so they stay alive. */
        if (st == VMMT_EFAILED) k = NULL;
        vmmtpy_raise(st);
        goto out;
    }
    out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *b = vmmtpy_desc_new(descs[i].bytes);
        if (b == NULL)
            Py_CLEAR(out);
        else
            PyList_SetItem(out, i, b);
    }
    /* The copy is on `stream`: its sources stay until it is proven done. */
    if (vmmtpy_kept_add(&self->kept, k, &descs[0], stream) != 0) Py_CLEAR(out);
    k = NULL;
    if (out == NULL) {
        /*
         * Published, but the caller gets an exception instead of the
         * descriptors: no consumer will ever acknowledge them, so take them
         * back (the recycler frees the slice once its copy shows done).
         */
        struct vmmt__saved_error e;
        vmmt__error_save(&e);
        if (vmmt_cancel(self->pool, &descs[0]) != VMMT_OK)
            vmmt__log(VMMT_LOG_WARN, "cancelling a publish that raised: %s", vmmt_last_error());
        vmmt__error_restore(&e);
    }
out:
    vmmtpy_keep_free(k);
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
    if (vmmtpy_kept_retire(&self->kept, NULL, 0) != VMMT_OK) {
        vmmtpy_raise(vmmt_last_status());
        return -1;
    }
    if ((*k = vmmtpy_keep_new(n)) == NULL) return -1;
    if ((*bufs = PyMem_Calloc((size_t)n, sizeof **bufs)) != NULL) return 0;
    PyMem_Free(*k);
    PyErr_NoMemory();
    return -1;
}

/*
 * A capsule given as (capsule, code): one-byte elements exported as uint8
 * that are `code` (kDLBool: a NumPy bool array, which NumPy before 1.25 will
 * not export). -1: the capsule's own dtype. 0, or -1 with ValueError.
 */
static int bytes_as(vmmt_buffer *b, int code)
{
    if (code < 0) return 0;
    if (code != kDLBool || b->dtype.bits != 8 || b->dtype.lanes != 1) {
        PyErr_Format(PyExc_ValueError,
                     "(capsule, %d): only one-byte elements may be renamed, and only to bool (%d)",
                     code, (int)kDLBool);
        return -1;
    }
    b->dtype.code = (uint8_t)code;
    return 0;
}

/*
 * publish(capsules, stream) -> list of 512-byte descriptors.
 * One capsule is vmmt_publish, several are one packed publish; an item may
 * be (capsule, code) (bytes_as). Every capsule is taken (renamed
 * "used_..."), whatever the outcome.
 */
static PyObject *pool_publish(PoolObject *self, PyObject *args)
{
    PyObject *seq;
    void *stream = NULL;
    Py_ssize_t n;
    struct keep *k;
    vmmt_buffer *bufs;

    if (!PyArg_ParseTuple(args, "OO&", &seq, vmmtpy_stream_conv, &stream)) return NULL;
    if (check_open(self, "publish") != 0 || count_arg(seq, &n) != 0 ||
        prepare(self, n, &k, &bufs) != 0)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *cap = PySequence_GetItem(seq, i);
        int code = -1, bad;
        if (cap != NULL && PyTuple_Check(cap)) {
            PyObject *inner = NULL;
            if (PyArg_ParseTuple(cap, "Oi", &inner, &code)) Py_INCREF(inner);
            Py_DECREF(cap);
            cap = inner;
        }
        bad = cap == NULL || vmmtpy_src_take(cap, &k->src[i]) != 0;
        Py_XDECREF(cap);
        if (!bad) k->n = (size_t)i + 1;
        if (bad || vmmtpy_tensor_to_buffer(k->src[i].t, &bufs[i]) != 0 ||
            bytes_as(&bufs[i], code) != 0) {
            vmmtpy_keep_free(k);
            PyMem_Free(bufs);
            return NULL;
        }
    }
    return publish_taken(self, k, bufs, n, stream);
}

/*
 * One raw item into b: shape is any sequence of ints. 0, or -1 with an error
 * set. The length and the dtype's fields are checked before they are
 * narrowed: a cast alone turned a length of 2**32 + 1 into one dimension and
 * bits=288 into 32.
 */
static int raw_fill(vmmt_buffer *b, unsigned long long ptr, unsigned long long nbytes, int code,
                    int bits, int lanes, PyObject *shape, int loc)
{
    Py_ssize_t ndim = PySequence_Size(shape);

    if (ndim < 0) return -1;
    if (ndim > VMMT_MAX_DIMS) {
        PyErr_Format(PyExc_ValueError, "tensor has %zd dimensions; vmmt carries at most %d", ndim,
                     VMMT_MAX_DIMS);
        return -1;
    }
    if (code < 0 || code > UINT8_MAX || bits < 0 || bits > UINT8_MAX || lanes < 0 ||
        lanes > UINT16_MAX) {
        PyErr_Format(PyExc_ValueError,
                     "dtype (code %d, bits %d, lanes %d) does not fit DLPack's fields (code and "
                     "bits 0..255, lanes 0..65535)",
                     code, bits, lanes);
        return -1;
    }
    b->ndim = (int)ndim;
    for (int d = 0; d < b->ndim; d++) {
        PyObject *v = PySequence_GetItem(shape, d);
        b->shape[d] = v ? PyLong_AsLongLong(v) : -1;
        Py_XDECREF(v);
        if (PyErr_Occurred()) return -1;
    }
    b->ptr = ptr;
    b->nbytes = nbytes;
    b->dtype.code = (uint8_t)code;
    b->dtype.bits = (uint8_t)bits;
    b->dtype.lanes = (uint16_t)lanes;
    b->location = loc;
    return 0;
}

/*
 * publish_raw(items, stream): the fast path for arrays whose
 * library is known (PyTorch), without a DLPack capsule. Each item is
 * (owner, ptr, nbytes, code, bits, lanes, shape, location); the owner is
 * kept alive until the copy is done. The caller has checked that the array
 * is contiguous and that its library's work is ordered before `stream`.
 */
static PyObject *pool_publish_raw(PoolObject *self, PyObject *args)
{
    PyObject *seq, *owners;
    void *stream = NULL;
    Py_ssize_t n;
    struct keep *k;
    vmmt_buffer *bufs;

    if (!PyArg_ParseTuple(args, "OO&", &seq, vmmtpy_stream_conv, &stream)) return NULL;
    if (check_open(self, "publish_raw") != 0 || count_arg(seq, &n) != 0) return NULL;
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

        ok = item != NULL && PyArg_ParseTuple(item, "OKKiiiOi", &owner, &ptr, &nbytes, &code, &bits,
                                              &lanes, &shape, &loc);
        if (ok) {
            Py_INCREF(owner);
            PyTuple_SetItem(owners, i, owner);
            ok = raw_fill(&bufs[i], ptr, nbytes, code, bits, lanes, shape, loc) == 0;
        }
        Py_XDECREF(item);
        if (!ok) {
            vmmtpy_keep_free(k);
            PyMem_Free(bufs);
            return NULL;
        }
    }
    return publish_taken(self, k, bufs, n, stream);
}

/*
 * The bytes of a contiguous array of shape b->shape and dtype b->dtype (one
 * lane), rounded up to a whole byte; 0, or -1 with ValueError for a
 * negative extent or a size beyond 64 bits.
 */
static int contiguous_nbytes(vmmt_buffer *b)
{
    for (int d = 0; d < b->ndim; d++)
        if (b->shape[d] < 0) {
            PyErr_Format(PyExc_ValueError, "shape[%d]=%lld is negative", d, (long long)b->shape[d]);
            return -1;
        }
    /* The same size the publish's descriptor check requires. */
    if (vmmt__desc_tensor_bytes((uint32_t)b->ndim, b->shape, b->dtype.bits, &b->nbytes) != 0) {
        PyErr_SetString(PyExc_ValueError, "the tensor's size does not fit in 64 bits");
        return -1;
    }
    return 0;
}

/*
 * publish_tensor(owner, ptr, code, bits, shape, stream) -> Descriptor: one
 * contiguous device array of one lane on the pool's device, its size taken
 * from its shape; publish_raw without the lists (the hot path of
 * Pool.publish for a PyTorch tensor).
 */
static PyObject *pool_publish_tensor(PoolObject *self, PyObject *args)
{
    PyObject *owner, *shape, *list, *one;
    unsigned long long ptr;
    int code, bits;
    void *stream = NULL;
    struct keep *k;
    vmmt_buffer *bufs;

    if (!PyArg_ParseTuple(args, "OKiiOO&", &owner, &ptr, &code, &bits, &shape, vmmtpy_stream_conv,
                          &stream))
        return NULL;
    if (check_open(self, "publish_tensor") != 0 || prepare(self, 1, &k, &bufs) != 0) return NULL;
    Py_INCREF(owner);
    k->owners = owner;
    if (raw_fill(&bufs[0], ptr, 0, code, bits, 1, shape, VMMT_LOC_DEVICE) != 0 ||
        contiguous_nbytes(&bufs[0]) != 0) {
        vmmtpy_keep_free(k);
        PyMem_Free(bufs);
        return NULL;
    }
    list = publish_taken(self, k, bufs, 1, stream);
    if (list == NULL) return NULL;
    one = PyList_GetItem(list, 0);
    Py_INCREF(one);
    Py_DECREF(list);
    return one;
}

static PyObject *pool_cancel(PoolObject *self, PyObject *arg)
{
    vmmt_desc d;
    int st;

    if (check_open(self, "cancel") != 0 || vmmtpy_desc_arg(arg, &d) != 0) return NULL;
    st = vmmt_cancel(self->pool, &d);
    if (st != VMMT_OK) return vmmtpy_raise(st);
    Py_RETURN_NONE;
}

/* reserve(nbytes) -> (ptr, nbytes, location, token bytes): vmmt_reserve. */
static PyObject *pool_reserve(PoolObject *self, PyObject *args)
{
    unsigned long long nbytes;
    vmmt_reservation r;
    vmmt_pool *pool;
    int st;

    if (!PyArg_ParseTuple(args, "O&", vmmtpy_u64_arg, &nbytes) || check_open(self, "reserve") != 0)
        return NULL;
    pool = self->pool;
    Py_BEGIN_ALLOW_THREADS;
    st = vmmt_reserve(pool, nbytes, &r);
    Py_END_ALLOW_THREADS;
    if (st != VMMT_OK) return vmmtpy_raise(st);
    return Py_BuildValue("(KKiy#)", (unsigned long long)r.ptr, (unsigned long long)r.nbytes,
                         r.location, (const char *)r.token.bytes, (Py_ssize_t)VMMT_DESC_SIZE);
}

/*
 * commit(ptr, nbytes, location, token, what_nbytes, code, bits, lanes,
 * shape, stream) -> Descriptor: vmmt_commit of the reservation reserve()
 * described; bits == 0 publishes untyped bytes (shape ignored).
 */
static PyObject *pool_commit(PoolObject *self, PyObject *args)
{
    unsigned long long ptr, nbytes, what_nbytes;
    int location, code, bits, lanes, st;
    PyObject *token, *shape;
    void *stream = NULL;
    vmmt_reservation r;
    vmmt_buffer what;
    vmmt_desc out;
    vmmt_pool *pool;

    if (!PyArg_ParseTuple(args, "KKiOKiiiOO&", &ptr, &nbytes, &location, &token, &what_nbytes,
                          &code, &bits, &lanes, &shape, vmmtpy_stream_conv, &stream))
        return NULL;
    if (check_open(self, "commit") != 0 || vmmtpy_desc_arg(token, &r.token) != 0) return NULL;
    r.ptr = ptr;
    r.nbytes = nbytes;
    r.location = location;
    memset(&what, 0, sizeof what);
    if (bits != 0) {
        if (raw_fill(&what, 0, what_nbytes, code, bits, lanes, shape, 0) != 0) return NULL;
    } else {
        what.nbytes = what_nbytes;
    }
    pool = self->pool;
    Py_BEGIN_ALLOW_THREADS;
    st = vmmt_commit(pool, &r, &what, stream, &out);
    Py_END_ALLOW_THREADS;
    if (st != VMMT_OK) return vmmtpy_raise(st);
    return vmmtpy_desc_new(out.bytes);
}

static PyObject *pool_reclaim(PoolObject *self, PyObject *unused)
{
    uint32_t freed = 0;
    int st;

    (void)unused;
    if (check_open(self, "reclaim") != 0) return NULL;
    vmmtpy_kept_retire(&self->kept, NULL, 0);
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
    if (check_open(self, "drain") != 0) return NULL;
    {
        vmmt_pool *pool = self->pool;
        Py_BEGIN_ALLOW_THREADS;
        st = vmmt_pool_drain(pool, timeout_ms);
        Py_END_ALLOW_THREADS;
    }
    if (st != VMMT_OK) return vmmtpy_raise(st);
    /* Drained: every copy is done, so every source can go (the wait ends at once). */
    {
        struct timespec until;
        vmmt__deadline(&until, (int64_t)timeout_ms * 1000);
        vmmtpy_kept_retire(&self->kept, &until, timeout_ms);
    }
    Py_RETURN_NONE;
}

static PyObject *pool_stats(PoolObject *self, PyObject *unused)
{
    vmmt_pool_stats s;
    int st;

    (void)unused;
    if (check_open(self, "stats") != 0) return NULL;
    memset(&s, 0, sizeof s);
    st = vmmt_pool_get_stats(self->pool, &s);
    if (st != VMMT_OK) return vmmtpy_raise(st);
    return vmmtpy_pool_stats_dict(&s);
}

/* release_rank(rank): vmmt_pool_release_rank. */
static PyObject *pool_release_rank(PoolObject *self, PyObject *arg)
{
    int rank = (int)PyLong_AsLong(arg), st;
    vmmt_pool *pool;

    if (rank == -1 && PyErr_Occurred()) return NULL;
    if (check_open(self, "release_rank") != 0) return NULL;
    pool = self->pool;
    Py_BEGIN_ALLOW_THREADS;
    st = vmmt_pool_release_rank(pool, rank);
    Py_END_ALLOW_THREADS;
    if (st != VMMT_OK) return vmmtpy_raise(st);
    Py_RETURN_NONE;
}

/* take_dead_ranks() -> tuple of ranks the pool found dead since the last call. */
static PyObject *pool_take_dead_ranks(PoolObject *self, PyObject *unused)
{
    int ranks[VMMT_BROKER_MAX_RANKS], n = 0, st;
    PyObject *out;

    (void)unused;
    if (self->pool == NULL) return PyTuple_New(0);
    st = vmmt_pool_take_dead_ranks(self->pool, ranks, VMMT_BROKER_MAX_RANKS, &n);
    if (st != VMMT_OK) return vmmtpy_raise(st);
    if ((out = PyTuple_New(n)) == NULL) return NULL;
    for (int i = 0; i < n; i++) {
        PyObject *v = PyLong_FromLong(ranks[i]);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SetItem(out, i, v);
    }
    return out;
}

/* Sources still held for copies that may be running (tests use it). */
static PyObject *pool_pending(PoolObject *self, PyObject *unused)
{
    (void)unused;
    return PyLong_FromSsize_t(self->kept.count);
}

/*
 * Shut the pool down: every copy done, sources given back, device memory
 * released, all within timeout_ms: one deadline for the kept sources' proofs
 * and the shutdown after them, however many sources wait. The handle itself
 * is freed only in dealloc: another thread may still be inside a call that
 * read it before close (the library answers it with VMMT_ECLOSED), and
 * dealloc cannot run while any call holds the object.
 */
static int close_pool(PoolObject *self, int timeout_ms)
{
    vmmt_pool *pool = self->pool;
    struct timespec until;
    int st = VMMT_OK;

    if (pool == NULL || self->shut_down) return VMMT_OK;
    vmmt__deadline(&until, (int64_t)timeout_ms * 1000);
    /*
     * A shutdown that failed (copies still queued past timeout_ms) said to
     * call it again: a later close() does, and no table is read then. The
     * retire's status is not the answer: the shutdown after it, even past
     * the deadline, looks at the copies once more and frees the pool if
     * they have landed meanwhile.
     */
    if (!self->closed) {
        self->closed = 1;
        vmmtpy_kept_retire(&self->kept, &until, timeout_ms);
        vmmtpy_kept_release_events(&self->kept);
        vmmtpy_kept_shut(&self->kept);
    }
    Py_BEGIN_ALLOW_THREADS;
    st = vmmt__pool_shutdown_until(pool, &until, timeout_ms);
    Py_END_ALLOW_THREADS;
    if (st == VMMT_OK && !self->shut_down) {
        self->shut_down = 1;
        vmmtpy_kept_release_proven(&self->kept);
    }
    return st;
}

/* close(timeout_ms=the pool's) */
static PyObject *pool_close(PoolObject *self, PyObject *args)
{
    int timeout_ms = self->pool != NULL ? self->pool->cfg.timeout_ms : 0, st;

    if (!PyArg_ParseTuple(args, "|i", &timeout_ms)) return NULL;
    if (timeout_ms < 0) {
        PyErr_Format(PyExc_ValueError, "close(timeout_ms=%d): give 0 or more milliseconds",
                     timeout_ms);
        return NULL;
    }
    st = close_pool(self, timeout_ms);
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

static PyObject *pool_get_pool_id(PoolObject *self, void *closure)
{
    (void)closure;
    if (self->pool == NULL) Py_RETURN_NONE;
    return PyBytes_FromStringAndSize((const char *)self->pool->tmpl.pool_id,
                                     sizeof self->pool->tmpl.pool_id);
}

static void pool_dealloc(PoolObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);

    if (close_pool(self, self->pool != NULL ? self->pool->cfg.timeout_ms : 0) != VMMT_OK)
        PyErr_Clear();
    /*
     * What a close that timed out kept and is proven done since goes; the
     * rest stays alive for good (vmmt_pool_destroy leaks a pool it cannot
     * shut down, and the copies may still read those sources).
     */
    vmmtpy_kept_retire(&self->kept, NULL, 0);
    vmmtpy_kept_release_events(&self->kept);
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
     "publish(capsules, stream) -> list of descriptor bytes"},
    {"publish_raw", (PyCFunction)pool_publish_raw, METH_VARARGS,
     "publish_raw(items, stream): the capsule-free fast path"},
    {"publish_tensor", (PyCFunction)pool_publish_tensor, METH_VARARGS,
     "publish_tensor(owner, ptr, code, bits, shape, stream) -> Descriptor"},
    {"cancel", (PyCFunction)pool_cancel, METH_O, "cancel(descriptor or reservation token bytes)"},
    {"reserve", (PyCFunction)pool_reserve, METH_VARARGS,
     "reserve(nbytes) -> (ptr, nbytes, location, token)"},
    {"commit", (PyCFunction)pool_commit, METH_VARARGS,
     "commit(ptr, nbytes, location, token, what_nbytes, code, bits, lanes, shape, stream)"},
    {"reclaim", (PyCFunction)pool_reclaim, METH_NOARGS, "reclaim() -> slices freed"},
    {"drain", (PyCFunction)pool_drain, METH_VARARGS, "drain(timeout_ms=5000)"},
    {"stats", (PyCFunction)pool_stats, METH_NOARGS, "stats() -> dict"},
    {"release_rank", (PyCFunction)pool_release_rank, METH_O, "release_rank(rank)"},
    {"take_dead_ranks", (PyCFunction)pool_take_dead_ranks, METH_NOARGS,
     "take_dead_ranks() -> ranks found dead since the last call"},
    {"pending", (PyCFunction)pool_pending, METH_NOARGS, "sources kept for running copies"},
    {"close", (PyCFunction)pool_close, METH_VARARGS, "close(timeout_ms=the pool's)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef pool_getset[] = {
    {"closed", (getter)pool_get_closed, NULL, "whether close() ran", NULL},
    {"device", (getter)pool_get_device, NULL, "the producer's device", NULL},
    {"pool_id", (getter)pool_get_pool_id, NULL, "the 16-byte id its descriptors carry", NULL},
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
