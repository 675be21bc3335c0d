/*
 * The binding's exceptions and status constants, and the one place that
 * maps a library status to an exception.
 *
 * One family, so that a caller falls back on one class whatever the call:
 *
 *   Error (RuntimeError), .status
 *     NoRoom                 no room for this buffer: use the fallback path
 *       PoolFull             full now (VMMT_EFULL): retry later, or fall back
 *       TooLarge             can never fit (VMMT_ETOOBIG)
 *     Closed                 the pool or consumer is shut down (VMMT_ECLOSED)
 *     Stale                  the descriptor is spent (VMMT_ESTATE)
 *     ProducerGone           the producer died (consume/ack/check)
 *     Timeout (also TimeoutError)
 *
 * A bad argument (VMMT_EINVAL) is a ValueError, as Python's own are.
 */
#include <string.h>

#include "py_vmmt.h"

PyObject *vmmtpy_Error, *vmmtpy_NoRoom, *vmmtpy_PoolFull, *vmmtpy_TooLarge, *vmmtpy_Closed,
    *vmmtpy_Stale, *vmmtpy_ProducerGone, *vmmtpy_Timeout;

/*
 * Every status of vmmt.h, once: the module's constants (vmmt.EFULL) and the
 * exception each raises. test_errors.py checks this list against the
 * header's enum, so a status the library adds without a line here fails.
 */
static const struct {
    const char *name;
    int status;
    PyObject **type; /* NULL: vmmt.Error */
} statuses[] = {
    {"OK", VMMT_OK, NULL},
    {"EINVAL", VMMT_EINVAL, &PyExc_ValueError},
    {"ENODRIVER", VMMT_ENODRIVER, NULL},
    {"ENODEV", VMMT_ENODEV, NULL},
    {"ENOTSUP", VMMT_ENOTSUP, NULL},
    {"ECUDA", VMMT_ECUDA, NULL},
    {"ENOMEM", VMMT_ENOMEM, NULL},
    {"EFULL", VMMT_EFULL, &vmmtpy_PoolFull},
    {"ETIMEDOUT", VMMT_ETIMEDOUT, &vmmtpy_Timeout},
    {"EFAILED", VMMT_EFAILED, NULL},
    {"ECLOSED", VMMT_ECLOSED, &vmmtpy_Closed},
    {"EPROTO", VMMT_EPROTO, NULL},
    {"EPERM", VMMT_EPERM, NULL},
    {"ESYS", VMMT_ESYS, NULL},
    {"ESTATE", VMMT_ESTATE, &vmmtpy_Stale},
    {"ETOOBIG", VMMT_ETOOBIG, &vmmtpy_TooLarge},
};

/*
 * The library's messages name its C functions; a Python caller has the
 * methods instead. Each name is replaced where it stands as a whole word,
 * so a message never sends a Python user to a function the binding does
 * not have (vmmt_consume is not the start of vmmt_consumer_check).
 */
static const char *const c_to_python[][2] = {
    {"vmmt_consume", "Consumer.consume()"},
    {"vmmt_consume_ranks", "Consumer.consume()"},
    {"vmmt_consumer_ack", "Consumer.ack()"},
    {"vmmt_consumer_ack_ranks", "Consumer.ack()"},
    {"vmmt_consumer_check", "Consumer.check()"},
    {"vmmt_consumer_flush", "Consumer.flush()"},
    {"vmmt_consumer_evict", "Consumer.evict()"},
    {"vmmt_pool_release_rank", "Pool.release_rank()"},
    {"vmmt_pool_drain", "Pool.drain()"},
    {"vmmt_pool_get_stats", "Pool.stats()"},
    {"vmmt_pool_reclaim", "Pool.reclaim()"},
    {"vmmt_publish", "Pool.publish()"},
    {"vmmt_publish_packed", "Pool.publish_many()"},
    {"vmmt_reserve", "Pool.reserve()"},
    {"vmmt_commit", "Pool.commit()"},
    {"vmmt_cancel", "Pool.cancel()"},
};

static int word_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

/* The Python name of the C function at the start of `at`, and its length; NULL if none. */
static const char *python_name(const char *at, const char *msg, size_t *len)
{
    if (at > msg && word_char(at[-1])) return NULL;
    for (size_t i = 0; i < sizeof c_to_python / sizeof c_to_python[0]; i++) {
        size_t n = strlen(c_to_python[i][0]);
        if (strncmp(at, c_to_python[i][0], n) == 0 && !word_char(at[n])) {
            *len = n;
            return c_to_python[i][1];
        }
    }
    return NULL;
}

PyObject *vmmtpy_python_message(const char *msg)
{
    /* No Python name is longer than twice its C name: 2 * strlen(msg) is room enough. */
    size_t cap = strlen(msg) * 2 + 16, o = 0;
    char *out = PyMem_Malloc(cap);
    PyObject *s;

    if (out == NULL) return PyErr_NoMemory();
    for (const char *p = msg; *p != '\0';) {
        size_t n = 0;
        const char *name = python_name(p, msg, &n);
        if (name != NULL) {
            memcpy(out + o, name, strlen(name));
            o += strlen(name);
            p += n;
        } else {
            out[o++] = *p++;
        }
    }
    s = PyUnicode_DecodeUTF8(out, (Py_ssize_t)o, "replace");
    PyMem_Free(out);
    return s;
}

static PyObject *raise_as(PyObject *type, int status)
{
    PyObject *exc, *code, *msg;
    const char *text = vmmt_last_error();

    if (text == NULL || *text == '\0') text = vmmt_strerror(status);
    if ((msg = vmmtpy_python_message(text)) == NULL) return NULL;
    exc = PyObject_CallFunctionObjArgs(type, msg, NULL);
    Py_DECREF(msg);
    if (exc == NULL) return NULL;
    code = PyLong_FromLong(status);
    if (code != NULL) {
        PyObject_SetAttrString(exc, "status", code);
        Py_DECREF(code);
    }
    PyErr_SetObject(type, exc);
    Py_DECREF(exc);
    return NULL;
}

PyObject *vmmtpy_raise(int status)
{
    for (size_t i = 0; i < sizeof statuses / sizeof statuses[0]; i++)
        if (statuses[i].status == status)
            return raise_as(statuses[i].type != NULL ? *statuses[i].type : vmmtpy_Error, status);
    return raise_as(vmmtpy_Error, status);
}

/*
 * What a consume, an acknowledgement or a check says: VMMT_ECLOSED there is
 * the producer's death (its pool is gone, or it died before the bytes
 * landed), and VMMT_EFAILED from a check the same death seen afterwards.
 */
PyObject *vmmtpy_raise_consume(int status)
{
    if (status == VMMT_ECLOSED || status == VMMT_EFAILED)
        return raise_as(vmmtpy_ProducerGone, status);
    return vmmtpy_raise(status);
}

static int add_error(PyObject *m, const char *qual, PyObject *bases, PyObject **out,
                     const char *doc)
{
    if (bases == NULL) return -1;
    *out = PyErr_NewExceptionWithDoc(qual, doc, bases, NULL);
    Py_DECREF(bases);
    if (*out == NULL) return -1;
    Py_INCREF(*out);
    if (PyModule_AddObject(m, strrchr(qual, '.') + 1, *out) != 0) {
        Py_DECREF(*out);
        return -1;
    }
    return 0;
}

/* One base as a new reference (add_error takes it). */
static PyObject *base(PyObject *b)
{
    Py_INCREF(b);
    return b;
}

int vmmtpy_errors_add(PyObject *m)
{
    if (add_error(m, "vmmt.Error", base(PyExc_RuntimeError), &vmmtpy_Error,
                  "A vmmt call failed; the message says what was asked, found and to do, and "
                  "`status` is the library's status (vmmt.EFULL, ...).") != 0 ||
        add_error(m, "vmmt.NoRoom", base(vmmtpy_Error), &vmmtpy_NoRoom,
                  "The pool has no room for this buffer: send it another way (the fallback).") !=
            0 ||
        add_error(m, "vmmt.PoolFull", base(vmmtpy_NoRoom), &vmmtpy_PoolFull,
                  "The pool is full now: fall back, or retry once consumers acknowledge.") != 0 ||
        add_error(m, "vmmt.TooLarge", base(vmmtpy_NoRoom), &vmmtpy_TooLarge,
                  "The buffer can never fit this pool: fall back, or make a larger pool.") != 0 ||
        add_error(m, "vmmt.Closed", base(vmmtpy_Error), &vmmtpy_Closed,
                  "The pool or consumer is closed or shut down.") != 0 ||
        add_error(m, "vmmt.Stale", base(vmmtpy_Error), &vmmtpy_Stale,
                  "The descriptor was already consumed or acknowledged for these ranks, "
                  "cancelled, or released and its slice recycled: drop it.") != 0 ||
        add_error(m, "vmmt.ProducerGone", base(vmmtpy_Error), &vmmtpy_ProducerGone,
                  "The producer died, or shut its pool down, before the bytes were there: drop "
                  "the request.") != 0 ||
        add_error(m, "vmmt.Timeout", PyTuple_Pack(2, vmmtpy_Error, PyExc_TimeoutError),
                  &vmmtpy_Timeout, "A wait or a socket ran past its timeout.") != 0)
        return -1;
    for (size_t i = 0; i < sizeof statuses / sizeof statuses[0]; i++)
        if (PyModule_AddIntConstant(m, statuses[i].name, statuses[i].status) != 0) return -1;
    return 0;
}
