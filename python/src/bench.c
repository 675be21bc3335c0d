/*
 * The C side of bench/python_bench.py: the same publishes and consumes the
 * binding makes, through the C API directly, timed call by call in this
 * process, so the binding's own cost per call is the difference of two
 * numbers measured in one run. Not part of the API.
 */
#include <string.h>
#include <time.h>

#include "py_vmmt.h"

#include "driver.h"

static double now_ns(void)
{
    struct timespec t;

    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

/*
 * _bench_c(pool, consumer, src, nbytes, location, dst, device, stream, n)
 * -> (list of publish ns, list of consume ns): n publishes of the bytes at
 * src, then n consumes of them into dst, each call timed on its own; then
 * the stream is synchronized.
 */
PyObject *vmmtpy_bench_c(PyObject *self, PyObject *args)
{
    PyObject *po, *co, *pub = NULL, *con = NULL;
    unsigned long long src, nbytes, dst;
    int location, device, n, st = VMMT_OK;
    void *stream = NULL;
    vmmt_pool *pool;
    vmmt_consumer *consumer;
    vmmt_desc *descs;
    double *tp, *tc;
    vmmt_buffer b;

    (void)self;
    if (!PyArg_ParseTuple(args, "OOKKiKiO&i", &po, &co, &src, &nbytes, &location, &dst, &device,
                          vmmtpy_stream_conv, &stream, &n))
        return NULL;
    if ((pool = vmmtpy_pool_handle(po)) == NULL || (consumer = vmmtpy_consumer_handle(co)) == NULL)
        return NULL;
    if (n <= 0 || n > 100000) {
        PyErr_SetString(PyExc_ValueError, "n must be 1..100000");
        return NULL;
    }
    descs = PyMem_Calloc((size_t)n, sizeof *descs);
    tp = PyMem_Calloc((size_t)n, sizeof *tp);
    tc = PyMem_Calloc((size_t)n, sizeof *tc);
    if (descs == NULL || tp == NULL || tc == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    memset(&b, 0, sizeof b);
    b.ptr = src;
    b.nbytes = nbytes;
    b.location = location;
    Py_BEGIN_ALLOW_THREADS;
    for (int i = 0; i < n && st == VMMT_OK; i++) {
        double t0 = now_ns();
        st = vmmt_publish(pool, &b, stream, &descs[i]);
        tp[i] = now_ns() - t0;
    }
    for (int i = 0; i < n && st == VMMT_OK; i++) {
        double t0 = now_ns();
        st = vmmt_consume(consumer, &descs[i], device, dst, nbytes, stream, VMMT_ALL_RANKS, 0);
        tc[i] = now_ns() - t0;
    }
    if (st == VMMT_OK && vmmt__ctx_enter(device) == VMMT_OK) {
        vmmt__drv()->cuStreamSynchronize((CUstream)stream);
        vmmt__ctx_leave();
    }
    Py_END_ALLOW_THREADS;
    if (st != VMMT_OK) {
        vmmtpy_raise(st);
        goto out;
    }
    pub = PyList_New(n);
    con = PyList_New(n);
    if (pub == NULL || con == NULL) goto out;
    for (int i = 0; i < n; i++) {
        PyList_SetItem(pub, i, PyFloat_FromDouble(tp[i]));
        PyList_SetItem(con, i, PyFloat_FromDouble(tc[i]));
    }
out:
    PyMem_Free(descs);
    PyMem_Free(tp);
    PyMem_Free(tc);
    if (pub == NULL || con == NULL) {
        Py_XDECREF(pub);
        Py_XDECREF(con);
        return NULL;
    }
    return Py_BuildValue("(NN)", pub, con);
}
