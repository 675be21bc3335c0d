/*
 * vmmt._vmmt.Group: the group exchange (vmmt_group_*, docs/group.md) over
 * a collective given in Python, an all-gather of bytes, or over the
 * library's local adapter. vmmt.group_torch puts torch.distributed on top.
 *
 * This replaces a ctypes mirror of vmmt_group_config and its collective,
 * kept by hand beside the header: a field added to the struct would have
 * been read short. Here the header is compiled in, the config is passed
 * with its size, and the collective's callbacks are C functions that call
 * the Python all-gather.
 *
 * Collective calls (creation, register) release the GIL while the library
 * works, so that the ranks of one process (threads) and the job's other
 * work can go on; the callbacks take it back to call Python. A group is not
 * thread-safe: `busy` refuses a second call made meanwhile (from another
 * thread, or from inside the all-gather), and close() during a call
 * destroys the group when that call returns.
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "py_vmmt.h"

#include "status.h"

PyTypeObject *vmmtpy_GroupType;

/* The Python collective: what the C callbacks need. Owned by the group (closed by it). */
struct py_collective {
    PyObject *gather; /* all_gather(bytes) -> world_size blocks of as many bytes */
    int world;
    PyObject *error; /* the exception the last failed call raised, for __cause__ */
    /* Held by Group() while it creates the group, so that a failed creation, which
     * closes the collective, still leaves the all-gather's exception to chain. */
    int held, closed;
};

typedef struct {
    PyObject_HEAD vmmt_group *group;
    struct py_collective *coll; /* NULL for the local adapter */
    pid_t pid;                  /* the process that made it: a forked child's copy is not its */
    int busy, closed;
} GroupObject;

/* TypeError "<what> must be <want>, not <type name>"; NULL. */
static PyObject *type_error(const char *what, const char *want, PyObject *o)
{
    PyObject *name = PyObject_GetAttrString((PyObject *)Py_TYPE(o), "__name__");

    if (name != NULL) PyErr_Format(PyExc_TypeError, "%s must be %s, not %S", what, want, name);
    Py_XDECREF(name);
    return NULL;
}

/* ------------------------------------------------------------ callbacks */

/* "the Python all-gather raised TypeError: ..." into err: the library's message carries it. */
static void write_err(char *err, size_t cap, PyObject *exc)
{
    PyObject *name = PyObject_GetAttrString((PyObject *)Py_TYPE(exc), "__name__");
    PyObject *text = PyObject_Str(exc), *n8 = NULL, *t8 = NULL;

    if (name != NULL) n8 = PyUnicode_AsUTF8String(name);
    if (text != NULL) t8 = PyUnicode_AsUTF8String(text);
    PyErr_Clear(); /* from any of the above: the reason is best effort */
    snprintf(err, cap, "the Python all-gather raised %s: %s",
             n8 != NULL ? PyBytes_AsString(n8) : "an exception",
             t8 != NULL ? PyBytes_AsString(t8) : "");
    Py_XDECREF(name);
    Py_XDECREF(text);
    Py_XDECREF(n8);
    Py_XDECREF(t8);
}

/* Keep the raised exception for the caller, and give the library its text. */
static void keep_error(struct py_collective *pc, char *err, size_t cap)
{
    PyObject *type, *value, *tb;

    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL && tb != NULL) PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    if (value == NULL) {
        snprintf(err, cap, "the Python all-gather failed");
        return;
    }
    write_err(err, cap, value);
    Py_XDECREF(pc->error);
    pc->error = value;
}

static int gather_into(struct py_collective *pc, const void *send, void *recv, size_t bytes)
{
    PyObject *data = PyBytes_FromStringAndSize(send, (Py_ssize_t)bytes), *res, *blocks;
    Py_ssize_t n;
    int rc = -1;

    if (data == NULL) return -1;
    res = PyObject_CallFunctionObjArgs(pc->gather, data, NULL);
    Py_DECREF(data);
    if (res == NULL) return -1;
    blocks = PySequence_Check(res) && !PyBytes_Check(res) ? PySequence_Tuple(res) : NULL;
    if (blocks == NULL) {
        PyErr_Clear();
        type_error("all_gather's result", "a sequence of bytes, one per rank", res);
        Py_DECREF(res);
        return -1;
    }
    Py_DECREF(res);
    n = PyTuple_Size(blocks);
    if (n != pc->world) {
        PyErr_Format(PyExc_ValueError,
                     "all_gather returned %zd blocks; the group has %d ranks, one block each", n,
                     pc->world);
        goto out;
    }
    for (Py_ssize_t r = 0; r < n; r++) {
        PyObject *b = PyBytes_FromObject(PyTuple_GetItem(blocks, r));
        if (b == NULL) goto out;
        if (PyBytes_Size(b) != (Py_ssize_t)bytes) {
            PyErr_Format(PyExc_ValueError,
                         "all_gather's block %zd is %zd bytes; every block must be the %zu sent", r,
                         PyBytes_Size(b), bytes);
            Py_DECREF(b);
            goto out;
        }
        memcpy((char *)recv + (size_t)r * bytes, PyBytes_AsString(b), bytes);
        Py_DECREF(b);
    }
    rc = 0;
out:
    Py_DECREF(blocks);
    return rc;
}

static int py_allgather(void *ctx, const void *send, void *recv, size_t bytes, char *err,
                        size_t cap)
{
    struct py_collective *pc = ctx;
    PyGILState_STATE gil = PyGILState_Ensure();
    int rc = gather_into(pc, send, recv, bytes);

    if (rc != 0) keep_error(pc, err, cap);
    PyGILState_Release(gil);
    return rc;
}

static void py_close(void *ctx)
{
    struct py_collective *pc = ctx;
    PyGILState_STATE gil;

    /* After the interpreter is gone there is nothing to release the objects to. */
    if (!Py_IsInitialized()) return;
    gil = PyGILState_Ensure();
    pc->closed = 1;
    Py_CLEAR(pc->gather);
    if (!pc->held) {
        Py_CLEAR(pc->error);
        free(pc);
    }
    PyGILState_Release(gil);
}

/* ------------------------------------------------------------ arguments */

/* An int argument in lo..hi, or TypeError/ValueError naming it. */
static int int_arg(PyObject *o, const char *name, long lo, long hi, int *out)
{
    long v;

    if (!PyLong_Check(o) || PyBool_Check(o)) {
        char what[64];
        snprintf(what, sizeof what, "Group: %s", name);
        type_error(what, "an int", o);
        return -1;
    }
    v = PyLong_AsLong(o);
    if ((v == -1 && PyErr_Occurred()) || v < lo || v > hi) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "Group: %s=%R is outside %ld..%ld", name, o, lo, hi);
        return -1;
    }
    *out = (int)v;
    return 0;
}

/* A uint64 (pointer, byte count) in lo..UINT64_MAX, or TypeError/ValueError naming it. */
static int u64_arg(PyObject *o, const char *name, unsigned long long lo, unsigned long long *out)
{
    if (!PyLong_Check(o) || PyBool_Check(o)) {
        type_error(name, "an int", o);
        return -1;
    }
    *out = PyLong_AsUnsignedLongLong(o);
    if ((*out == (unsigned long long)-1 && PyErr_Occurred()) || *out < lo) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s=%R is outside %llu..%llu", name, o, lo,
                     (unsigned long long)UINT64_MAX);
        return -1;
    }
    return 0;
}

/* None, or a str as UTF-8 (*keep holds the bytes); TypeError naming it otherwise. */
static int str_arg(PyObject *o, const char *name, PyObject **keep, const char **out)
{
    if (o == Py_None) return 0;
    if (!PyUnicode_Check(o)) {
        type_error(name, "a str or None", o);
        return -1;
    }
    if ((*keep = PyUnicode_AsUTF8String(o)) == NULL) return -1;
    *out = PyBytes_AsString(*keep);
    return 0;
}

static int handle_type_arg(PyObject *o, vmmt_handle_type *out)
{
    static const struct {
        const char *name;
        vmmt_handle_type type;
    } names[] = {{"auto", VMMT_HANDLE_AUTO},
                 {"fabric", VMMT_HANDLE_FABRIC},
                 {"posix_fd", VMMT_HANDLE_POSIX_FD}};

    if (!PyUnicode_Check(o)) {
        type_error("Group: handle_type", "'auto', 'fabric' or 'posix_fd'", o);
        return -1;
    }
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (PyUnicode_CompareWithASCIIString(o, names[i].name) == 0) {
            *out = names[i].type;
            return 0;
        }
    PyErr_Format(PyExc_ValueError, "Group: handle_type=%R; use 'auto', 'fabric' or 'posix_fd'", o);
    return -1;
}

/* ----------------------------------------------------------- life cycle */

/* Raise the failed call's error, with the all-gather's own exception as its cause. */
static PyObject *raise_group(GroupObject *self, struct py_collective *pc, int st)
{
    PyObject *type, *value, *tb;

    vmmtpy_raise(st);
    if (pc == NULL || pc->error == NULL) return NULL;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL) PyException_SetCause(value, pc->error); /* steals it */
    pc->error = NULL;
    PyErr_Restore(type, value, tb);
    (void)self;
    return NULL;
}

static void destroy_now(GroupObject *self)
{
    vmmt_group *g = self->group;
    struct py_collective *pc = self->coll;

    self->group = NULL;
    self->coll = NULL;
    if (g == NULL) return;
    if (getpid() != self->pid) {
        /*
         * A forked child's copy: its mappings and descriptors are the
         * parent's to give back, and a driver may not be used across fork.
         * The Python objects are this process's, though.
         */
        if (pc != NULL) {
            Py_CLEAR(pc->gather);
            Py_CLEAR(pc->error);
            free(pc); /* the child never destroys g, so nothing calls its close */
        }
        return;
    }
    /* Local, not collective: no all-gather runs, so the GIL may stay held (close takes it). */
    vmmt_group_destroy(g);
}

static int group_init(GroupObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {
        "rank",        "world_size", "all_gather",      "job", "device", "timeout_ms",
        "handle_type", "socket_dir", "max_allocations", NULL};
    PyObject *rank_o, *world_o, *gather = Py_None, *device_o = NULL, *job_o = Py_None;
    PyObject *timeout_o = NULL, *type_o = NULL, *max_o = NULL, *dir_o = Py_None;
    PyObject *job_b = NULL, *dir_b = NULL; /* UTF-8 of job and socket_dir, held until created */
    const char *job = NULL;
    struct py_collective *pc = NULL;
    vmmt_group_config c;
    vmmt_group *g = NULL;
    int st, max_allocs = 4096;

    if (self->group != NULL || self->closed) {
        PyErr_SetString(PyExc_RuntimeError, "Group.__init__ called twice");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|O$OOOOOO:Group", kwlist, &rank_o, &world_o,
                                     &gather, &job_o, &device_o, &timeout_o, &type_o, &dir_o,
                                     &max_o))
        return -1;
    vmmt_group_config_init(&c);
    if (int_arg(world_o, "world_size", 1, 4096, &c.world_size) != 0 ||
        int_arg(rank_o, "rank", 0, c.world_size - 1, &c.rank) != 0 ||
        (device_o != NULL && int_arg(device_o, "device", 0, 4095, &c.device) != 0) ||
        (timeout_o != NULL && int_arg(timeout_o, "timeout_ms", 1, INT32_MAX, &c.timeout_ms) != 0) ||
        (max_o != NULL && int_arg(max_o, "max_allocations", 1, 1 << 20, &max_allocs) != 0) ||
        (type_o != NULL && handle_type_arg(type_o, &c.handle_type) != 0))
        return -1;
    c.max_allocations = (uint32_t)max_allocs;
    if (str_arg(job_o, "Group: job", &job_b, &job) != 0 ||
        str_arg(dir_o, "Group: socket_dir", &dir_b, &c.socket_dir) != 0)
        goto fail;
    if ((gather == Py_None) == (job == NULL)) {
        PyErr_SetString(PyExc_TypeError,
                        "Group: give all_gather (a collective: all_gather(bytes) -> one block "
                        "per rank) or job= (the local adapter's job name), not both or neither");
        goto fail;
    }
    if (gather != Py_None && !PyCallable_Check(gather)) {
        type_error("Group: all_gather", "callable", gather);
        goto fail;
    }
    if (gather != Py_None) {
        if ((pc = calloc(1, sizeof *pc)) == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        Py_INCREF(gather);
        pc->gather = gather;
        pc->world = c.world_size;
        c.collective.allgather = py_allgather;
        c.collective.close = py_close;
        c.collective.ctx = pc;
        pc->held = 1;
    }
    /* The group owns pc from here: vmmt_group_create closes it when it fails. */
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS;
    st = job != NULL ? vmmt_group_create_local(&c, job, &g) : vmmt_group_create(&c, &g);
    Py_END_ALLOW_THREADS;
    self->busy = 0;
    if (st != VMMT_OK) raise_group(self, pc, st);
    if (pc != NULL) {
        pc->held = 0;
        if (pc->closed) { /* by the failed create */
            Py_CLEAR(pc->error);
            free(pc);
            pc = NULL;
        }
    }
    if (st != VMMT_OK) goto fail;
    self->group = g;
    self->coll = pc;
    self->pid = getpid();
    Py_XDECREF(job_b);
    Py_XDECREF(dir_b);
    return 0;
fail:
    Py_XDECREF(job_b);
    Py_XDECREF(dir_b);
    return -1;
}

/* Enter a call: the group, or NULL with an error when closed, busy or not this process's. */
static vmmt_group *enter(GroupObject *self, const char *what)
{
    if (self->group == NULL || self->closed) {
        vmmt__fail(VMMT_ECLOSED, "Group.%s: the group is closed", what);
        vmmtpy_raise(VMMT_ECLOSED);
        return NULL;
    }
    if (self->busy) {
        vmmt__fail(VMMT_ESTATE,
                   "Group.%s: another call on this group is running (from another thread, or "
                   "from inside its all-gather); a group is not thread-safe",
                   what);
        vmmtpy_raise(VMMT_ESTATE);
        return NULL;
    }
    if (getpid() != self->pid) {
        vmmt__fail(VMMT_ESTATE,
                   "Group.%s: the group belongs to process %d; a forked child cannot use it "
                   "(create a group in the child)",
                   what, (int)self->pid);
        vmmtpy_raise(VMMT_ESTATE);
        return NULL;
    }
    self->busy = 1;
    return self->group;
}

static void leave(GroupObject *self)
{
    self->busy = 0;
    if (self->closed) destroy_now(self);
}

static PyObject *group_close(GroupObject *self, PyObject *unused)
{
    (void)unused;
    self->closed = 1;
    if (!self->busy) destroy_now(self);
    Py_RETURN_NONE;
}

static int group_traverse(GroupObject *self, visitproc visit, void *arg)
{
    if (self->coll != NULL) {
        Py_VISIT(self->coll->gather);
        Py_VISIT(self->coll->error);
    }
    /* Heap types: instances hold their type. */
    Py_VISIT(Py_TYPE(self));
    return 0;
}

/* A cycle through the all-gather (it holds the group): destroy the group, which lets go of it. */
static int group_clear(GroupObject *self)
{
    if (!self->busy) {
        self->closed = 1;
        destroy_now(self);
    }
    return 0;
}

static void group_dealloc(GroupObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);

    PyObject_GC_UnTrack(self);
    self->busy = 0;
    self->closed = 1;
    destroy_now(self);
    tp_free(self);
    Py_DECREF(tp);
}

/* -------------------------------------------------------------- methods */

/* register(buffers): buffers a sequence of (device pointer, bytes); -> ptrs[i][r]. */
static PyObject *group_register(GroupObject *self, PyObject *arg)
{
    PyObject *seq, *out = NULL;
    vmmt_group_buffer *bufs = NULL;
    uint64_t *ptrs = NULL;
    vmmt_group *g;
    Py_ssize_t n;
    int world, st;

    seq = PySequence_Fast(arg, "Group.register: buffers must be a sequence of (device pointer, "
                               "bytes) pairs");
    if (seq == NULL) return NULL;
    n = PySequence_Size(seq);
    if (n > 65536) {
        PyErr_Format(PyExc_ValueError, "Group.register: %zd buffers; at most 65536 a call", n);
        goto out;
    }
    bufs = PyMem_Calloc((size_t)n + 1, sizeof *bufs);
    if (bufs == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_GetItem(seq, i), *pair;
        char name[48];
        unsigned long long p, b;
        int bad;
        if (item == NULL) goto out;
        pair = PySequence_Check(item) && !PyUnicode_Check(item) && !PyBytes_Check(item)
                   ? PySequence_Tuple(item)
                   : NULL;
        Py_DECREF(item);
        if (pair == NULL || PyTuple_Size(pair) != 2) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError,
                         "Group.register: buffers[%zd] must be a (device pointer, bytes) pair", i);
            Py_XDECREF(pair);
            goto out;
        }
        snprintf(name, sizeof name, "Group.register: buffers[%zd][0] (pointer)", i);
        bad = u64_arg(PyTuple_GetItem(pair, 0), name, 1, &p) != 0;
        snprintf(name, sizeof name, "Group.register: buffers[%zd][1] (bytes)", i);
        bad = bad || u64_arg(PyTuple_GetItem(pair, 1), name, 1, &b) != 0;
        Py_DECREF(pair);
        if (bad) goto out;
        bufs[i].ptr = p;
        bufs[i].nbytes = b;
    }
    if ((g = enter(self, "register")) == NULL) goto out;
    world = vmmt_group_world_size(g);
    ptrs = PyMem_Calloc((size_t)n * (size_t)world + 1, sizeof *ptrs);
    if (ptrs == NULL) {
        leave(self);
        PyErr_NoMemory();
        goto out;
    }
    Py_BEGIN_ALLOW_THREADS;
    st = vmmt_group_register(g, bufs, (size_t)n, ptrs);
    Py_END_ALLOW_THREADS;
    if (st != VMMT_OK) {
        raise_group(self, self->coll, st);
        leave(self);
        goto out;
    }
    leave(self);
    if ((out = PyList_New(n)) == NULL) goto out;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = PyList_New(world);
        if (row == NULL) {
            Py_CLEAR(out);
            goto out;
        }
        PyList_SetItem(out, i, row);
        for (int r = 0; r < world; r++) {
            PyObject *v = PyLong_FromUnsignedLongLong(ptrs[(size_t)i * (size_t)world + (size_t)r]);
            if (v == NULL) {
                Py_CLEAR(out);
                goto out;
            }
            PyList_SetItem(row, r, v);
        }
    }
out:
    PyMem_Free(ptrs);
    PyMem_Free(bufs);
    Py_DECREF(seq);
    return out;
}

static PyObject *group_alloc(GroupObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"nbytes", "chunks", NULL};
    PyObject *n_o, *chunks_o = NULL;
    unsigned long long n;
    uint64_t ptr = 0;
    vmmt_group *g;
    int chunks = 1, st;

    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O:alloc", kwlist, &n_o, &chunks_o)) return NULL;
    if (u64_arg(n_o, "Group.alloc: nbytes", 1, &n) != 0) return NULL;
    if (chunks_o != NULL && int_arg(chunks_o, "chunks", 1, 1024, &chunks) != 0) return NULL;
    if ((g = enter(self, "alloc")) == NULL) return NULL;
    Py_BEGIN_ALLOW_THREADS;
    st = vmmt_group_alloc(g, n, chunks, &ptr);
    Py_END_ALLOW_THREADS;
    leave(self);
    if (st != VMMT_OK) return vmmtpy_raise(st);
    return PyLong_FromUnsignedLongLong(ptr);
}

static PyObject *group_free(GroupObject *self, PyObject *arg)
{
    unsigned long long p;
    vmmt_group *g;
    int st;

    if (u64_arg(arg, "Group.free: ptr", 1, &p) != 0) return NULL;
    if ((g = enter(self, "free")) == NULL) return NULL;
    Py_BEGIN_ALLOW_THREADS;
    st = vmmt_group_free(g, p);
    Py_END_ALLOW_THREADS;
    leave(self);
    if (st != VMMT_OK) return vmmtpy_raise(st);
    Py_RETURN_NONE;
}

static PyObject *group_enter(GroupObject *self, PyObject *unused)
{
    (void)unused;
    Py_INCREF(self);
    return (PyObject *)self;
}

static PyObject *group_exit(GroupObject *self, PyObject *args)
{
    (void)args;
    return group_close(self, NULL);
}

/* ---------------------------------------------------------- attributes */

static PyObject *group_get_closed(GroupObject *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(self->group == NULL || self->closed);
}

/* The accessors are plain reads of the group: fine while a call runs. Closed: Error. */
static vmmt_group *readable(GroupObject *self)
{
    if (self->group != NULL && !self->closed) return self->group;
    vmmt__fail(VMMT_ECLOSED, "the group is closed");
    vmmtpy_raise(VMMT_ECLOSED);
    return NULL;
}

static PyObject *group_get_int(GroupObject *self, void *closure)
{
    vmmt_group *g = readable(self);
    const char *what = closure;

    if (g == NULL) return NULL;
    if (strcmp(what, "rank") == 0) return PyLong_FromLong(vmmt_group_rank(g));
    if (strcmp(what, "world_size") == 0) return PyLong_FromLong(vmmt_group_world_size(g));
    return PyLong_FromLong(vmmt_group_device(g));
}

static PyObject *group_get_handle_type(GroupObject *self, void *closure)
{
    vmmt_group *g = readable(self);

    (void)closure;
    return g != NULL ? PyUnicode_FromString(vmmt_handle_type_name(vmmt_group_handle_type(g)))
                     : NULL;
}

static PyObject *group_get_counts(GroupObject *self, void *closure)
{
    vmmt_group *g = readable(self);
    size_t bufs = 0, peers = 0;

    (void)closure;
    if (g == NULL) return NULL;
    vmmt_group_get_counts(g, &bufs, &peers);
    return Py_BuildValue("{s:n,s:n}", "buffers", (Py_ssize_t)bufs, "peer_allocations",
                         (Py_ssize_t)peers);
}

static PyObject *group_repr(GroupObject *self)
{
    vmmt_group *g = self->group;
    size_t bufs = 0, peers = 0;

    if (g == NULL || self->closed) return PyUnicode_FromString("<vmmt.Group closed>");
    vmmt_group_get_counts(g, &bufs, &peers);
    return PyUnicode_FromFormat("<vmmt.Group rank %d of %d on device %d, %s handles, %s, %zu "
                                "buffer(s) registered, %zu peer allocation(s) mapped>",
                                vmmt_group_rank(g), vmmt_group_world_size(g), vmmt_group_device(g),
                                vmmt_handle_type_name(vmmt_group_handle_type(g)),
                                self->coll != NULL ? "Python all-gather" : "local adapter", bufs,
                                peers);
}

static PyMethodDef group_methods[] = {
    {"register", (PyCFunction)group_register, METH_O,
     "register(buffers) -> ptrs: buffers a sequence of (device pointer, bytes) pairs, the same "
     "count on every rank; ptrs[i][r] is rank r's buffer i as this rank's device sees it. "
     "Collective."},
    {"alloc", (PyCFunction)(void (*)(void))group_alloc, METH_VARARGS | METH_KEYWORDS,
     "alloc(nbytes, chunks=1) -> device pointer: chunks separate VMM allocations mapped side by "
     "side (tools and tests). Not collective."},
    {"free", (PyCFunction)group_free, METH_O, "free(ptr): give back what alloc() made."},
    {"close", (PyCFunction)group_close, METH_NOARGS,
     "Unmap every peer mapping and give back every handle and allocation; later calls raise "
     "vmmt.Error. Not collective; idempotent."},
    {"__enter__", (PyCFunction)group_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)group_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef group_getset[] = {
    {"rank", (getter)group_get_int, NULL, "this rank", "rank"},
    {"world_size", (getter)group_get_int, NULL, "ranks in the group", "world_size"},
    {"device", (getter)group_get_int, NULL, "this rank's device", "device"},
    {"handle_type", (getter)group_get_handle_type, NULL,
     "the handle type the ranks agreed on: 'fabric' or 'posix_fd'", NULL},
    {"counts", (getter)group_get_counts, NULL,
     "{'buffers': registered so far, 'peer_allocations': peer allocations mapped}", NULL},
    {"closed", (getter)group_get_closed, NULL, "whether close() ran", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot group_slots[] = {
    {Py_tp_doc, "Group(rank, world_size, all_gather=None, *, job=None, device=0, "
                "timeout_ms=120000, handle_type='auto', socket_dir=None, max_allocations=4096)\n"
                "--\n\n"
                "The ranks of a job map each other's device allocations (docs/group.md). The "
                "collective is all_gather(data: bytes) -> one block of len(data) bytes per rank, "
                "in rank order, or the library's local adapter for processes of one node "
                "(job=NAME, the same on every rank). Creation is collective."},
    {Py_tp_init, group_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, group_dealloc},
    {Py_tp_traverse, group_traverse},
    {Py_tp_clear, group_clear},
    {Py_tp_repr, group_repr},
    {Py_tp_methods, group_methods},
    {Py_tp_getset, group_getset},
    {0, NULL},
};

PyType_Spec vmmtpy_group_spec = {
    "vmmt._vmmt.Group", sizeof(GroupObject), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    group_slots,
};
