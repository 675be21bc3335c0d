/*
 * vmmt._vmmt.Consumer: the per-process cache of imported pools. consume()
 * allocates the destination itself and returns a Buffer (DLPack exporter);
 * consume_into() fills memory the caller owns.
 */
#include <string.h>

#include "argconv.h"
#include "py_vmmt.h"

#include "status.h"

/*
 * Calls release the GIL while the library works, so another thread may
 * close the consumer meanwhile: `busy` counts calls in progress (changed
 * only with the GIL held) and the last one out destroys a closed consumer.
 */
typedef struct {
    PyObject_HEAD vmmt_consumer *consumer;
    int busy;
    int closed;
    struct vmmtpy_mem_cache *cache; /* freed buffers of consume(); NULL when disabled */
} ConsumerObject;

static void destroy_now(ConsumerObject *self)
{
    vmmt_consumer *c = self->consumer;

    self->consumer = NULL;
    if (c == NULL) return;
    Py_BEGIN_ALLOW_THREADS;
    vmmt_consumer_destroy(c);
    Py_END_ALLOW_THREADS;
}

/* Whether the consumer is closed; if so, Closed raised naming call `what`. */
static int raise_if_closed(ConsumerObject *self, const char *what)
{
    if (self->consumer != NULL && !self->closed) return 0;
    vmmt__fail(VMMT_ECLOSED,
               "Consumer.%s: this consumer is closed (Consumer.close ran): make a new "
               "vmmt.Consumer",
               what);
    vmmtpy_raise(VMMT_ECLOSED);
    return 1;
}

/* Enter call `what`: the handle to use, NULL (error set, naming the call) when closed. */
static vmmt_consumer *enter(ConsumerObject *self, const char *what)
{
    if (raise_if_closed(self, what)) return NULL;
    self->busy++;
    return self->consumer;
}

static void leave(ConsumerObject *self)
{
    if (--self->busy == 0 && self->closed) destroy_now(self);
}

/*
 * The ranks a call is for: the run (first, count), or, where `list` is a
 * tuple, the ranks it lists (vmmt_consume_ranks: all or nothing). The
 * Python layer (vmmt._args.ranks) has checked each is an int of 0..255.
 */
struct ranks_arg {
    int first, count;
    int list[256];
    int n; /* 0: the run */
};

static int ranks_from(PyObject *list, struct ranks_arg *r)
{
    Py_ssize_t n;

    r->n = 0;
    if (list == Py_None) return 0;
    if (!PyTuple_Check(list) || (n = PyTuple_Size(list)) < 1 ||
        n > (Py_ssize_t)(sizeof r->list / sizeof r->list[0])) {
        PyErr_SetString(PyExc_TypeError, "ranks list: a tuple of 1..256 ints, or None");
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int overflow = 0;
        long v = PyLong_AsLongAndOverflow(PyTuple_GetItem(list, i), &overflow);
        if (v == -1 && PyErr_Occurred()) return -1;
        if (overflow || v < 0 || v > 255) {
            PyErr_Format(PyExc_ValueError, "ranks list: entry %zd is not a rank of 0..255", i);
            return -1;
        }
        r->list[i] = (int)v;
    }
    r->n = (int)n;
    return 0;
}

static int consume_for(vmmt_consumer *c, const vmmt_desc *d, int device, uint64_t dst,
                       uint64_t size, void *stream, const struct ranks_arg *r)
{
    if (r->n > 0) return vmmt_consume_ranks(c, d, device, dst, size, stream, r->list, r->n);
    return vmmt_consume(c, d, device, dst, size, stream, r->first, r->count);
}

static int consumer_init(ConsumerObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"timeout_ms", "max_pools", "cache_bytes", NULL};
    vmmt_consumer_config c;
    long long cache_bytes = 64ll << 20;
    int st;

    if (self->consumer != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Consumer.__init__ called twice");
        return -1;
    }
    vmmt_consumer_config_init(&c);
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|iiL", kwlist, &c.timeout_ms, &c.max_pools,
                                     &cache_bytes))
        return -1;
    if (cache_bytes < 0) {
        PyErr_Format(PyExc_ValueError, "cache_bytes=%lld; use 0 (no cache) or more", cache_bytes);
        return -1;
    }
    if (c.timeout_ms <= 0) {
        PyErr_Format(PyExc_ValueError, "timeout_ms=%d; give a positive number of milliseconds",
                     c.timeout_ms);
        return -1;
    }
    if (c.max_pools < 0) {
        PyErr_Format(PyExc_ValueError, "max_pools=%d; use 0 (no limit) or more", c.max_pools);
        return -1;
    }
    if (cache_bytes > 0) {
        if ((self->cache = PyMem_Calloc(1, sizeof *self->cache)) == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->cache->refs = 1;
        self->cache->limit = (uint64_t)cache_bytes;
    }
    st = vmmt_consumer_create(&c, &self->consumer);
    if (st != VMMT_OK) {
        self->consumer = NULL;
        vmmtpy_cache_unref(self->cache);
        self->cache = NULL;
        vmmtpy_raise(st);
        return -1;
    }
    return 0;
}

/* consume(desc, device, stream, rank_first, rank_count, rank_list=None) -> Buffer */
static PyObject *consumer_consume(ConsumerObject *self, PyObject *args)
{
    PyObject *o, *buf, *list = Py_None;
    vmmt_consumer *c;
    vmmt_desc d;
    vmmt_desc_info info;
    void *stream = NULL;
    struct ranks_arg r;
    int device, st;
    uint64_t ptr = 0;

    if (!PyArg_ParseTuple(args, "OiO&ii|O", &o, &device, vmmtpy_stream_conv, &stream, &r.first,
                          &r.count, &list))
        return NULL;
    if (ranks_from(list, &r) != 0 || vmmtpy_device_arg(device) != 0 || vmmtpy_desc_arg(o, &d) != 0)
        return NULL;
    if (vmmt_desc_inspect(&d, &info) != VMMT_OK) return vmmtpy_raise(VMMT_EINVAL);
    if ((c = enter(self, "consume")) == NULL) return NULL;
    ptr = vmmtpy_cache_take(self->cache, device, stream, info.nbytes);
    Py_BEGIN_ALLOW_THREADS;
    st = ptr != 0 ? VMMT_OK : vmmt_mem_alloc(device, info.nbytes, &ptr);
    if (st == VMMT_OK) {
        st = consume_for(c, &d, device, ptr, info.nbytes, stream, &r);
        /* A failed consume still acknowledged, and its copy never ran or was drained. */
        if (st != VMMT_OK) {
            struct vmmt__saved_error e;
            vmmt__error_save(&e);
            vmmt_mem_free(device, ptr);
            st = vmmt__error_restore(&e);
        }
    }
    Py_END_ALLOW_THREADS;
    leave(self);
    if (st != VMMT_OK) return vmmtpy_raise_consume(st);
    buf = vmmtpy_buffer_new(device, ptr, info.nbytes, &info, stream, vmmtpy_on_emu());
    if (buf == NULL)
        vmmt_mem_free(device, ptr);
    else
        vmmtpy_buffer_set_cache(buf, self->cache);
    return buf;
}

/* consume_into(desc, device, dst, dst_size, stream, rank_first, rank_count, rank_list=None) */
static PyObject *consumer_consume_into(ConsumerObject *self, PyObject *args)
{
    vmmt_consumer *c;
    PyObject *o, *list = Py_None;
    vmmt_desc d;
    void *stream = NULL;
    unsigned long long dst, size;
    struct ranks_arg r;
    int device, st;

    if (!PyArg_ParseTuple(args, "OiKKO&ii|O", &o, &device, &dst, &size, vmmtpy_stream_conv, &stream,
                          &r.first, &r.count, &list))
        return NULL;
    if (ranks_from(list, &r) != 0 || vmmtpy_device_arg(device) != 0 ||
        vmmtpy_desc_arg(o, &d) != 0 || (c = enter(self, "consume")) == NULL)
        return NULL;
    Py_BEGIN_ALLOW_THREADS;
    st = consume_for(c, &d, device, dst, size, stream, &r);
    Py_END_ALLOW_THREADS;
    leave(self);
    if (st != VMMT_OK) return vmmtpy_raise_consume(st);
    Py_RETURN_NONE;
}

/* ack(desc, device, stream, rank_first, rank_count, rank_list=None) */
static PyObject *consumer_ack(ConsumerObject *self, PyObject *args)
{
    vmmt_consumer *c;
    PyObject *o, *list = Py_None;
    vmmt_desc d;
    void *stream = NULL;
    struct ranks_arg r;
    int device, st;

    if (!PyArg_ParseTuple(args, "OiO&ii|O", &o, &device, vmmtpy_stream_conv, &stream, &r.first,
                          &r.count, &list))
        return NULL;
    if (ranks_from(list, &r) != 0 || vmmtpy_device_arg(device) != 0 ||
        vmmtpy_desc_arg(o, &d) != 0 || (c = enter(self, "ack")) == NULL)
        return NULL;
    Py_BEGIN_ALLOW_THREADS;
    st = r.n > 0 ? vmmt_consumer_ack_ranks(c, &d, device, stream, r.list, r.n)
                 : vmmt_consumer_ack(c, &d, device, stream, r.first, r.count);
    Py_END_ALLOW_THREADS;
    leave(self);
    if (st != VMMT_OK) return vmmtpy_raise_consume(st);
    Py_RETURN_NONE;
}

/* check(desc): vmmt_consumer_check; ProducerGone when the bytes are not the producer's. */
static PyObject *consumer_check(ConsumerObject *self, PyObject *arg)
{
    vmmt_consumer *c;
    vmmt_desc d;
    int st;

    if (vmmtpy_desc_arg(arg, &d) != 0 || (c = enter(self, "check")) == NULL) return NULL;
    Py_BEGIN_ALLOW_THREADS;
    st = vmmt_consumer_check(c, &d);
    Py_END_ALLOW_THREADS;
    leave(self);
    if (st != VMMT_OK) return vmmtpy_raise_consume(st);
    Py_RETURN_NONE;
}

/* flush(): vmmt_consumer_flush, the acknowledgements of completed copies written now. */
static PyObject *consumer_flush(ConsumerObject *self, PyObject *unused)
{
    vmmt_consumer *c;
    int st;

    (void)unused;
    if ((c = enter(self, "flush")) == NULL) return NULL;
    Py_BEGIN_ALLOW_THREADS;
    st = vmmt_consumer_flush(c);
    Py_END_ALLOW_THREADS;
    leave(self);
    if (st != VMMT_OK) return vmmtpy_raise(st);
    Py_RETURN_NONE;
}

/* evict(pool_id: 16 bytes, device) */
static PyObject *consumer_evict(ConsumerObject *self, PyObject *args)
{
    vmmt_consumer *c;
    const char *id;
    Py_ssize_t n;
    int device, st;

    if (!PyArg_ParseTuple(args, "y#i", &id, &n, &device)) return NULL;
    if (n != 16) {
        PyErr_Format(PyExc_ValueError, "a pool id is 16 bytes, got %zd", n);
        return NULL;
    }
    if ((c = enter(self, "evict")) == NULL) return NULL;
    Py_BEGIN_ALLOW_THREADS;
    st = vmmt_consumer_evict(c, (const uint8_t *)id, device);
    Py_END_ALLOW_THREADS;
    leave(self);
    if (st != VMMT_OK) return vmmtpy_raise(st);
    Py_RETURN_NONE;
}

static PyObject *consumer_pool_count(ConsumerObject *self, PyObject *unused)
{
    (void)unused;
    if (raise_if_closed(self, "pool_count")) return NULL;
    return PyLong_FromLong(vmmt_consumer_pool_count(self->consumer));
}

/* cache_info() -> (hits, misses, blocks, bytes): the buffer cache (tests use it). */
static PyObject *consumer_cache_info(ConsumerObject *self, PyObject *unused)
{
    struct vmmtpy_mem_cache *c = self->cache;

    (void)unused;
    if (c == NULL) return Py_BuildValue("(KKiK)", 0ull, 0ull, 0, 0ull);
    return Py_BuildValue("(KKiK)", (unsigned long long)c->hits, (unsigned long long)c->misses,
                         c->count, (unsigned long long)c->bytes);
}

static void close_consumer(ConsumerObject *self)
{
    /* Buffers still alive hold the cache; they free to the driver from now on. */
    vmmtpy_cache_close(self->cache);
    vmmtpy_cache_unref(self->cache);
    self->cache = NULL;
    self->closed = 1;
    if (self->busy == 0) destroy_now(self);
}

static PyObject *consumer_close(ConsumerObject *self, PyObject *unused)
{
    (void)unused;
    close_consumer(self);
    Py_RETURN_NONE;
}

static PyObject *consumer_get_closed(ConsumerObject *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(self->consumer == NULL || self->closed);
}

static void consumer_dealloc(ConsumerObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);

    close_consumer(self);
    tp_free(self);
    Py_DECREF(tp);
}

vmmt_consumer *vmmtpy_consumer_handle(PyObject *o)
{
    if (!PyObject_TypeCheck(o, vmmtpy_ConsumerType) || ((ConsumerObject *)o)->consumer == NULL ||
        ((ConsumerObject *)o)->closed) {
        PyErr_SetString(PyExc_TypeError, "expected an open vmmt._vmmt.Consumer");
        return NULL;
    }
    return ((ConsumerObject *)o)->consumer;
}

static PyMethodDef consumer_methods[] = {
    {"consume", (PyCFunction)consumer_consume, METH_VARARGS,
     "consume(desc, device, stream, rank_first, rank_count, rank_list=None) -> Buffer"},
    {"consume_into", (PyCFunction)consumer_consume_into, METH_VARARGS,
     "consume_into(desc, device, dst, dst_size, stream, rank_first, rank_count, rank_list=None)"},
    {"ack", (PyCFunction)consumer_ack, METH_VARARGS,
     "ack(desc, device, stream, rank_first, rank_count, rank_list=None)"},
    {"check", (PyCFunction)consumer_check, METH_O, "check(desc): vmmt_consumer_check"},
    {"flush", (PyCFunction)consumer_flush, METH_NOARGS, "flush(): vmmt_consumer_flush"},
    {"evict", (PyCFunction)consumer_evict, METH_VARARGS, "evict(pool_id, device)"},
    {"pool_count", (PyCFunction)consumer_pool_count, METH_NOARGS, "pools imported now"},
    {"cache_info", (PyCFunction)consumer_cache_info, METH_NOARGS,
     "(hits, misses, blocks, bytes) of the buffer cache"},
    {"close", (PyCFunction)consumer_close, METH_NOARGS, "close()"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef consumer_getset[] = {
    {"closed", (getter)consumer_get_closed, NULL, "whether close() ran", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot consumer_slots[] = {
    {Py_tp_doc, "The C consumer; use vmmt.Consumer."},
    {Py_tp_init, consumer_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, consumer_dealloc},
    {Py_tp_methods, consumer_methods},
    {Py_tp_getset, consumer_getset},
    {0, NULL},
};

PyType_Spec vmmtpy_consumer_spec = {
    "vmmt._vmmt.Consumer", sizeof(ConsumerObject), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    consumer_slots,
};
