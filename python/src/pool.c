/*
 * vmmt._vmmt.Pool: a producer pool. publish() takes DLPack capsules, so it
 * reads each tensor's pointer, dtype and shape itself and publishes them in
 * one call. A stream-ordered publish returns before its copy has run, so the
 * source tensors must outlive the copy: the pool keeps each publish's
 * sources and gives them back once the copy is proven done (checked at every
 * publish, reclaim, drain and close), never earlier.
 *
 * The proof: where the control table is in host memory (POSIX_FD pools, the
 * default), the publish's own ready word, which the stream writes after the
 * copy; reading it is a plain load, where an event per publish costs a
 * cuEventCreate/cuEventRecord on the hot path. Elsewhere (a device control
 * table, FABRIC), an event recorded after the publish.
 */
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "py_vmmt.h"

#include "ctrl.h"
#include "desc.h"
#include "driver.h"
#include "pool_internal.h"
#include "status.h"

/* The sources of one publish, alive until its copy is proven done. */
struct keep {
    struct keep *next;
    CUevent done; /* the event proof; NULL with by_ready or a failed event */
    int by_ready; /* proven by the ready word of (slot, gen) instead */
    uint32_t slot, gen;
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
    int uses_events; /* no host control table: copies are proven by events */
    int shut;        /* shutdown began: the table may be gone (set with the GIL held) */
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
 * Whether a publish proven by its ready word has landed: the word shows its
 * generation, or a later occupant's (the slot is given a new generation only
 * after the ready word showed this one). The table stays mapped while the
 * pool is open, and no such entry is kept past close (publish_taken).
 */
static int landed(const PoolObject *self, const struct keep *k)
{
    const struct vmmt_pool *p = self->pool;
    const uint32_t *word = &p->table_host[vmmt__ctrl_ready(0, p->stride, k->slot) / 4];

    return vmmt__occupant_of(vmmt__ctrl_load(word), k->gen) != VMMT__OCC_COPYING;
}

/*
 * Another thread's close may shut the pool down while a drain waits here
 * without the GIL: the table is read only with the GIL held and before
 * `shut`, so a proof cut short leaves the sources alive instead.
 */
static int shut_fail(const struct keep *k)
{
    return vmmt__fail(VMMT_ECLOSED,
                      "the pool was shut down before a publish's copy (slot %u, generation %u) "
                      "was proven done; its sources stay alive",
                      k->slot, k->gen);
}

/* Wait for a ready word without the GIL, bounded by the pool's timeout_ms. */
static int wait_landed(PoolObject *self, const struct keep *k)
{
    const struct timespec nap = {0, 50 * 1000};
    long bound = (long)(self->pool->cfg.timeout_ms > 0 ? self->pool->cfg.timeout_ms : 5000) * 20;

    for (long i = 0; self->shut ? 0 : !landed(self, k); i++) {
        if (i >= bound)
            return vmmt__fail(VMMT_ETIMEDOUT,
                              "a publish's copy (slot %u, generation %u) did not land within "
                              "timeout_ms=%d; its sources stay alive",
                              k->slot, k->gen, self->pool->cfg.timeout_ms);
        Py_BEGIN_ALLOW_THREADS;
        nanosleep(&nap, NULL);
        Py_END_ALLOW_THREADS;
    }
    return self->shut ? shut_fail(k) : VMMT_OK;
}

/* Whether k's copy is done: 1 yes, 0 not yet, -1 the check failed (error set). */
static int keep_done(PoolObject *self, const struct vmmt_drv *d, const struct keep *k)
{
    CUresult r;

    if (k->by_ready) return self->shut ? (shut_fail(k), -1) : landed(self, k);
    if (k->done == NULL) return 1;
    r = d->cuEventQuery(k->done);
    if (r == CUDA_ERROR_NOT_READY) return 0;
    if (r == CUDA_SUCCESS) return 1;
    vmmt__cu_fail(r, "checking that a publish's copy finished");
    return -1;
}

/* Running copies a retire without `wait` looks past before it stops. */
#define RETIRE_SCAN_RUNNING 4

/*
 * Give back the sources whose copies are done; with `wait`, all of them,
 * waiting for each copy without the GIL. An entry leaves the list before
 * the GIL is released or any deleter runs (deleters run Python code, which
 * may publish again), so no other thread or reentrant call ever sees it.
 * A failed check says nothing about the copy: those sources stay alive
 * forever. GIL held.
 */
static int retire(PoolObject *self, int wait)
{
    const struct vmmt_drv *d = NULL;
    struct keep **pp = &self->kept, *k, *done = NULL;
    int st = VMMT_OK, entered = 0, running = 0;

    if (self->kept == NULL) return VMMT_OK;
    if (self->uses_events) {
        d = vmmt__drv();
        if (d == NULL || vmmt__ctx_enter(self->device) != VMMT_OK) return vmmt_last_status();
        entered = 1;
    }
    while ((k = *pp) != NULL) {
        int r = keep_done(self, d, k);
        if (r == 0) {
            /*
             * Copies on one stream finish in order, so behind a few that are
             * still running the rest are too: stop there, or a burst of
             * publishes ahead of the GPU would scan its whole backlog each time.
             */
            if (++running == RETIRE_SCAN_RUNNING && !wait) break;
            pp = &k->next;
            continue;
        }
        if (r < 0) {
            st = vmmt_last_status();
            k->n = 0;
            k->owners = NULL;
        }
        unlink_keep(self, pp, k);
        k->next = done;
        done = k;
    }
    while (wait && (k = self->kept) != NULL) {
        int r = VMMT_OK;
        unlink_keep(self, &self->kept, k);
        if (k->by_ready) {
            r = wait_landed(self, k);
        } else if (k->done != NULL) {
            CUresult cr;
            Py_BEGIN_ALLOW_THREADS;
            cr = d->cuEventSynchronize(k->done);
            Py_END_ALLOW_THREADS;
            if (cr != CUDA_SUCCESS) r = vmmt__cu_fail(cr, "waiting for a publish's copy to finish");
        }
        if (r != VMMT_OK) {
            st = r;
            k->n = 0;
            k->owners = NULL;
        }
        k->next = done;
        done = k;
    }
    for (k = done; entered && k != NULL; k = k->next) {
        if (k->done == NULL) continue;
        if (self->spare_count < (int)(sizeof self->spare / sizeof self->spare[0]))
            self->spare[self->spare_count++] = k->done;
        else
            d->cuEventDestroy(k->done);
    }
    if (entered) vmmt__ctx_leave();
    while ((k = done) != NULL) {
        done = k->next;
        keep_release(k);
        PyMem_Free(k);
    }
    return st;
}

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
    self->tail = &self->kept;
    self->uses_events = !self->pool->host_table || self->pool->table_host == NULL;
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

    /* A host pool copies host sources with the CPU: asking would make a context. */
    if (!vmmtpy_on_emu() || self->pool->host_mem || vmmt__ctx_enter(self->device) != VMMT_OK)
        return 0;
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
        PyObject *b = vmmtpy_desc_new(descs[i].bytes);
        if (b == NULL)
            Py_CLEAR(out);
        else
            PyList_SetItem(out, i, b);
    }
    if (self->closed) {
        /* Closed meanwhile by another thread: no proof outlives the pool, so wait now. */
        if (vmmt__ctx_enter(self->device) == VMMT_OK) {
            if (vmmt__drv()->cuStreamSynchronize((CUstream)stream) != CUDA_SUCCESS) k = NULL;
            vmmt__ctx_leave();
        } else {
            k = NULL; /* unknown: the sources stay alive */
        }
        goto out;
    }
    if (!self->uses_events) {
        struct vmmt__desc dd;
        if (vmmt__desc_decode(descs[0].bytes, &dd) != VMMT_OK) {
            vmmtpy_raise(vmmt_last_status());
            Py_CLEAR(out);
            k = NULL; /* cannot be tracked: the sources stay alive */
            goto out;
        }
        k->by_ready = 1;
        k->slot = dd.slot;
        k->gen = dd.generation;
        /* A synchronous hand-off, or a host pool's CPU copy, has landed already. */
        if (landed(self, k)) goto out;
    } else if (record_done(self, stream, &k->done) != VMMT_OK) {
        /* The copy is on `stream`: keep the sources until an event after it has passed. */
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

/* One raw item into b: shape is any sequence of ints. 0, or -1 with an error set. */
static int raw_fill(vmmt_buffer *b, unsigned long long ptr, unsigned long long nbytes, int code,
                    int bits, int lanes, PyObject *shape, int loc)
{
    b->ndim = (int)PySequence_Size(shape);
    if (b->ndim < 0 || b->ndim > VMMT_MAX_DIMS) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "tensor has %d dimensions; vmmt carries at most %d",
                         b->ndim, VMMT_MAX_DIMS);
        return -1;
    }
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

        ok = item != NULL && PyArg_ParseTuple(item, "OKKiiiOi", &owner, &ptr, &nbytes, &code, &bits,
                                              &lanes, &shape, &loc);
        if (ok) {
            Py_INCREF(owner);
            PyTuple_SetItem(owners, i, owner);
            ok = raw_fill(&bufs[i], ptr, nbytes, code, bits, lanes, shape, loc) == 0;
        }
        Py_XDECREF(item);
        if (!ok) {
            keep_release(k);
            PyMem_Free(k);
            PyMem_Free(bufs);
            return NULL;
        }
    }
    return publish_taken(self, k, bufs, n, stream, none_when_full);
}

/*
 * publish_tensor(owner, ptr, nbytes, code, bits, shape, location, stream)
 * -> Descriptor: publish_raw for one array of one lane, without the lists
 * (the hot path of Pool.publish for a PyTorch tensor).
 */
static PyObject *pool_publish_tensor(PoolObject *self, PyObject *args)
{
    PyObject *owner, *shape, *list, *one;
    unsigned long long ptr, nbytes;
    int code, bits, loc;
    void *stream = NULL;
    struct keep *k;
    vmmt_buffer *bufs;

    if (!PyArg_ParseTuple(args, "OKKiiOiO&", &owner, &ptr, &nbytes, &code, &bits, &shape, &loc,
                          vmmtpy_stream_conv, &stream))
        return NULL;
    if (check_open(self) != 0 || prepare(self, 1, &k, &bufs) != 0) return NULL;
    Py_INCREF(owner);
    k->owners = owner;
    if (raw_fill(&bufs[0], ptr, nbytes, code, bits, 1, shape, loc) != 0) {
        keep_release(k);
        PyMem_Free(k);
        PyMem_Free(bufs);
        return NULL;
    }
    list = publish_taken(self, k, bufs, 1, stream, 0);
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

    if (check_open(self) != 0 || vmmtpy_desc_arg(arg, &d) != 0) return NULL;
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

    if (!PyArg_ParseTuple(args, "K", &nbytes) || check_open(self) != 0) return NULL;
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
    if (check_open(self) != 0 || vmmtpy_desc_arg(token, &r.token) != 0) return NULL;
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
    memset(&s, 0, sizeof s);
    st = vmmt_pool_get_stats(self->pool, &s);
    if (st != VMMT_OK) return vmmtpy_raise(st);
    return vmmtpy_pool_stats_dict(&s);
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
    self->shut = 1;
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
    {"publish_tensor", (PyCFunction)pool_publish_tensor, METH_VARARGS,
     "publish_tensor(owner, ptr, nbytes, code, bits, shape, location, stream) -> Descriptor"},
    {"cancel", (PyCFunction)pool_cancel, METH_O, "cancel(descriptor or reservation token bytes)"},
    {"reserve", (PyCFunction)pool_reserve, METH_VARARGS,
     "reserve(nbytes) -> (ptr, nbytes, location, token)"},
    {"commit", (PyCFunction)pool_commit, METH_VARARGS,
     "commit(ptr, nbytes, location, token, what_nbytes, code, bits, lanes, shape, stream)"},
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
