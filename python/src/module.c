/*
 * vmmt._vmmt: the module and its free functions (driver,
 * probe, descriptor inspection, device memory). The types live in pool.c,
 * consumer.c and buffer.c, the exceptions in errors.c; the friendly API is the Python package
 * around it.
 */
#include <string.h>
#include <sys/resource.h>

#include "py_vmmt.h"

/* The library's internals, compiled into this extension with it. */
#include "driver.h"
#include "status.h"
#include "vmm.h"

PyTypeObject *vmmtpy_PoolType, *vmmtpy_ConsumerType, *vmmtpy_BufferType;

int vmmtpy_stream_conv(PyObject *o, void *out)
{
    unsigned long long v;

    if (o == Py_None) {
        *(void **)out = NULL;
        return 1;
    }
    v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_SetString(PyExc_TypeError, "stream must be a CUstream handle (a non-negative int)");
        return 0;
    }
    *(void **)out = (void *)(uintptr_t)v;
    return 1;
}

int vmmtpy_on_emu(void)
{
    const char *name = vmmt_driver_name();
    return name != NULL && strcmp(name, "emu") == 0;
}

/* ------------------------------------------------------------ driver */

static PyObject *py_driver_select(PyObject *self, PyObject *arg)
{
    const char *name;
    int st;

    (void)self;
    if (!PyArg_Parse(arg, "s", &name)) return NULL;
    st = vmmt_driver_select(name);
    if (st != VMMT_OK) return vmmtpy_raise(st);
    Py_RETURN_NONE;
}

/* (name, version, device count): raises when no driver loads. */
static PyObject *py_driver_info(PyObject *self, PyObject *unused)
{
    const char *name;
    int version = 0, count = 0, st;

    (void)self;
    (void)unused;
    name = vmmt_driver_name();
    if (name == NULL) return vmmtpy_raise(vmmt_last_status());
    if ((st = vmmt_driver_version(&version)) != VMMT_OK ||
        (st = vmmt_device_count(&count)) != VMMT_OK)
        return vmmtpy_raise(st);
    return Py_BuildValue("(sii)", name, version, count);
}

/* ------------------------------------------------------------- probe */

static PyObject *handle_probe_dict(const vmmt_handle_probe *c)
{
    return Py_BuildValue("{s:s,s:i,s:K,s:K,s:i,s:i,s:O,s:s}", "type",
                         vmmt_handle_type_name(c->type), "attribute", c->attribute,
                         "granularity_minimum", (unsigned long long)c->granularity_minimum,
                         "granularity_recommended", (unsigned long long)c->granularity_recommended,
                         "create_result", c->create_result, "export_result", c->export_result,
                         "works", c->works ? Py_True : Py_False, "cause", c->cause);
}

/*
 * One device's entry of `vmmt probe --json`, with the same keys and values,
 * plus "status" (the probe's vmmt status) so the caller can tell why.
 */
static PyObject *py_probe_device(PyObject *self, PyObject *arg)
{
    vmmt_device_probe p;
    PyObject *types, *out;
    int dev = (int)PyLong_AsLong(arg), st;
    const char *handoff;

    (void)self;
    if (dev == -1 && PyErr_Occurred()) return NULL;
    Py_BEGIN_ALLOW_THREADS;
    st = vmmt__probe_report(dev, &p);
    Py_END_ALLOW_THREADS;
    if (st != VMMT_OK && st != VMMT_ENOTSUP) return vmmtpy_raise(st);
    types = PyList_New(0);
    if (types == NULL) return NULL;
    for (int i = 0; i < 3; i++) {
        PyObject *c = handle_probe_dict(&p.candidates[i]);
        if (c == NULL || PyList_Append(types, c) != 0) {
            Py_XDECREF(c);
            Py_DECREF(types);
            return NULL;
        }
        Py_DECREF(c);
    }
    handoff = p.stream_wait_imported == 1   ? "stream-ordered"
              : p.stream_wait_imported == 0 ? "synchronous"
                                            : "none";
    out = Py_BuildValue("{s:i,s:s,s:K,s:O,s:O,s:O,s:N,s:i,s:s,s:s,s:s,s:i}", "device", p.device,
                        "name", p.name, "total_memory", (unsigned long long)p.total_memory,
                        "vmm_supported", p.vmm_supported ? Py_True : Py_False,
                        "rdma_with_vmm_supported", p.rdma_with_vmm_supported ? Py_True : Py_False,
                        "imex_channels_present", p.imex_channels_present ? Py_True : Py_False,
                        "handle_types", types, "stream_wait_imported", p.stream_wait_imported,
                        "handoff", handoff, "selected",
                        st == VMMT_OK ? vmmt_handle_type_name(p.selected) : "", "reason",
                        st == VMMT_OK ? p.reason : vmmt_last_error(), "status", st);
    return out;
}

static PyObject *py_probe_reset(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    vmmt_probe_reset();
    Py_RETURN_NONE;
}

static PyObject *py_open_files(PyObject *self, PyObject *unused)
{
    struct rlimit r = {0, 0};

    (void)self;
    (void)unused;
    getrlimit(RLIMIT_NOFILE, &r);
    return Py_BuildValue("(KK)", (unsigned long long)r.rlim_cur, (unsigned long long)r.rlim_max);
}

/* -------------------------------------------------------- descriptor */

int vmmtpy_desc_arg(PyObject *o, vmmt_desc *d)
{
    char *data;
    Py_ssize_t n;

    if (PyBytes_AsStringAndSize(o, &data, &n) != 0) return -1;
    if (n != VMMT_DESC_SIZE) {
        PyErr_Format(PyExc_ValueError, "a vmmt descriptor is %d bytes, got %zd", VMMT_DESC_SIZE, n);
        return -1;
    }
    memcpy(d->bytes, data, VMMT_DESC_SIZE);
    return 0;
}

static PyObject *desc_type, *bytes_new, *fields_name;

/* A decoded descriptor as the tuple Descriptor._field reads (vmmt/__init__.py). */
static PyObject *desc_fields(const vmmt_desc_info *i)
{
    PyObject *shape = PyTuple_New(i->ndim);

    if (shape == NULL) return NULL;
    for (int k = 0; k < i->ndim; k++) {
        PyObject *v = PyLong_FromLongLong(i->shape[k]);
        if (v == NULL) {
            Py_DECREF(shape);
            return NULL;
        }
        PyTuple_SetItem(shape, k, v); /* steals v; cannot fail on a new tuple */
    }
    return Py_BuildValue("(y#siiIIK(iii)Niii)", (const char *)i->pool_id, (Py_ssize_t)16,
                         vmmt_handle_type_name(i->handle_type), i->producer_device,
                         i->consumer_count, i->slot, i->generation, (unsigned long long)i->nbytes,
                         (int)i->dtype.code, (int)i->dtype.bits, (int)i->dtype.lanes, shape,
                         i->stream_ordered, i->pack_index, i->pack_count);
}

/*
 * A Descriptor of what the library just wrote, its fields decoded here: the
 * caller of a publish reads several of them at once (an engine tracks the
 * slot, sglang's proxy keeps size and count), and decoding them in Python
 * later costs a microsecond and a half.
 */
PyObject *vmmtpy_desc_new(const uint8_t *bytes)
{
    PyObject *raw = PyBytes_FromStringAndSize((const char *)bytes, VMMT_DESC_SIZE), *out, *fields;
    vmmt_desc d;
    vmmt_desc_info info;

    if (raw == NULL || desc_type == NULL) return raw;
    out = PyObject_CallFunctionObjArgs(bytes_new, desc_type, raw, NULL);
    Py_DECREF(raw);
    memcpy(d.bytes, bytes, VMMT_DESC_SIZE);
    if (out == NULL || vmmt_desc_inspect(&d, &info) != VMMT_OK) return out;
    if ((fields = desc_fields(&info)) == NULL || PyObject_SetAttr(out, fields_name, fields) != 0) {
        Py_XDECREF(fields);
        Py_DECREF(out);
        return NULL;
    }
    Py_DECREF(fields);
    return out;
}

static PyObject *py_set_descriptor_type(PyObject *self, PyObject *cls)
{
    (void)self;
    if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, &PyBytes_Type)) {
        PyErr_SetString(PyExc_TypeError, "the descriptor type must be a subclass of bytes");
        return NULL;
    }
    if (bytes_new == NULL &&
        (bytes_new = PyObject_GetAttrString((PyObject *)&PyBytes_Type, "__new__")) == NULL)
        return NULL;
    if (fields_name == NULL && (fields_name = PyUnicode_InternFromString("_fields")) == NULL)
        return NULL;
    Py_INCREF(cls);
    Py_XDECREF(desc_type);
    desc_type = cls;
    Py_RETURN_NONE;
}

/* The decoded descriptor as a tuple (see vmmt/__init__.py, Descriptor). */
static PyObject *py_desc_inspect(PyObject *self, PyObject *arg)
{
    vmmt_desc d;
    vmmt_desc_info i;

    (void)self;
    if (vmmtpy_desc_arg(arg, &d) != 0) return NULL;
    if (vmmt_desc_inspect(&d, &i) != VMMT_OK) {
        PyErr_SetString(PyExc_ValueError, vmmt_last_error());
        return NULL;
    }
    return desc_fields(&i);
}

/* desc_check(bytes): validate like desc_inspect, without building its tuple (unpickling). */
static PyObject *py_desc_check(PyObject *self, PyObject *arg)
{
    vmmt_desc d;
    vmmt_desc_info i;

    (void)self;
    if (vmmtpy_desc_arg(arg, &d) != 0) return NULL;
    if (vmmt_desc_inspect(&d, &i) != VMMT_OK) {
        PyErr_SetString(PyExc_ValueError, vmmt_last_error());
        return NULL;
    }
    Py_RETURN_NONE;
}

/*
 * capsule_info(capsule) -> (ptr, nbytes, device_type, device_id, readonly):
 * where a C-contiguous tensor's bytes are, for consuming into it. The
 * capsule keeps its tensor (its destructor returns it).
 */
static PyObject *py_capsule_info(PyObject *self, PyObject *cap)
{
    DLTensor *t;
    vmmt_buffer b;
    int readonly;

    (void)self;
    if (vmmtpy_capsule_tensor(cap, &t, &readonly) != 0 || vmmtpy_tensor_to_buffer(t, &b) != 0)
        return NULL;
    return Py_BuildValue("(KKiii)", (unsigned long long)b.ptr, (unsigned long long)b.nbytes,
                         (int)t->device.device_type, (int)t->device.device_id, readonly);
}

/* ---------------------------------------------------------- memory */

static PyObject *py_mem_alloc(PyObject *self, PyObject *args)
{
    int device, st;
    unsigned long long n;
    uint64_t p = 0;

    (void)self;
    if (!PyArg_ParseTuple(args, "iK", &device, &n)) return NULL;
    Py_BEGIN_ALLOW_THREADS;
    st = vmmt_mem_alloc(device, n, &p);
    Py_END_ALLOW_THREADS;
    if (st != VMMT_OK) return vmmtpy_raise(st);
    return PyLong_FromUnsignedLongLong(p);
}

static PyObject *py_mem_free(PyObject *self, PyObject *args)
{
    int device, st;
    unsigned long long p;

    (void)self;
    if (!PyArg_ParseTuple(args, "iK", &device, &p)) return NULL;
    Py_BEGIN_ALLOW_THREADS;
    st = vmmt_mem_free(device, p);
    Py_END_ALLOW_THREADS;
    if (st != VMMT_OK) return vmmtpy_raise(st);
    Py_RETURN_NONE;
}

static PyObject *py_mem_copy(PyObject *self, PyObject *args)
{
    int device, st;
    unsigned long long dst, src, n;
    void *stream = NULL;

    (void)self;
    if (!PyArg_ParseTuple(args, "iKKK|O&", &device, &dst, &src, &n, vmmtpy_stream_conv, &stream))
        return NULL;
    Py_BEGIN_ALLOW_THREADS;
    st = vmmt_mem_copy(device, dst, src, n, stream);
    Py_END_ALLOW_THREADS;
    if (st != VMMT_OK) return vmmtpy_raise(st);
    Py_RETURN_NONE;
}

/*
 * _slice_view(keeper, device, ptr, nbytes, host_view) -> Buffer over memory
 * keeper holds: a reservation's slice, keeper the object whose life tells
 * the reservation that a view is still alive (vmmt.Reservation._views_anchor).
 */
static PyObject *py_slice_view(PyObject *self, PyObject *args)
{
    PyObject *keeper;
    unsigned long long ptr, n;
    int device, host_view;

    (void)self;
    if (!PyArg_ParseTuple(args, "OiKKp", &keeper, &device, &ptr, &n, &host_view)) return NULL;
    return vmmtpy_buffer_view(device, ptr, n, host_view, keeper);
}

/* device_total_memory(device) -> bytes: what a pool's memory_size is checked against. */
static PyObject *py_device_total_memory(PyObject *self, PyObject *arg)
{
    const struct vmmt_drv *d;
    CUdevice dev;
    size_t total = 0;
    int device = (int)PyLong_AsLong(arg), st;

    (void)self;
    if (device == -1 && PyErr_Occurred()) return NULL;
    if ((d = vmmt__drv()) == NULL) return vmmtpy_raise(vmmt_last_status());
    st = VMMT_CU(d, cuDeviceGet(&dev, device));
    if (st == VMMT_OK) st = VMMT_CU(d, cuDeviceTotalMem(&total, dev));
    if (st != VMMT_OK) return vmmtpy_raise(st);
    return PyLong_FromSize_t(total);
}

/* Wait for a stream (tests, benchmarks and the CPU view of consumed buffers). */
static PyObject *py_stream_synchronize(PyObject *self, PyObject *args)
{
    int device, st;
    void *stream = NULL;

    (void)self;
    if (!PyArg_ParseTuple(args, "i|O&", &device, vmmtpy_stream_conv, &stream)) return NULL;
    Py_BEGIN_ALLOW_THREADS;
    st = vmmt__ctx_enter(device);
    if (st == VMMT_OK) {
        st = VMMT_CU(vmmt__drv(), cuStreamSynchronize((CUstream)stream));
        vmmt__ctx_leave();
    }
    Py_END_ALLOW_THREADS;
    if (st != VMMT_OK) return vmmtpy_raise(st);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"driver_select", py_driver_select, METH_O, "Choose the driver: 'cuda' or 'emu'."},
    {"driver_info", py_driver_info, METH_NOARGS, "(driver name, CUDA version, device count)."},
    {"probe_device", py_probe_device, METH_O, "One device's entry of `vmmt probe --json`."},
    {"probe_reset", py_probe_reset, METH_NOARGS, "Forget cached probes."},
    {"open_files", py_open_files, METH_NOARGS, "(soft, hard) limits of open files."},
    {"desc_inspect", py_desc_inspect, METH_O, "Decode and validate a 512-byte descriptor."},
    {"desc_check", py_desc_check, METH_O, "Validate a 512-byte descriptor (ValueError)."},
    {"capsule_info", py_capsule_info, METH_O,
     "(ptr, nbytes, device_type, device_id, readonly) of a DLPack capsule's tensor."},
    {"mem_alloc", py_mem_alloc, METH_VARARGS, "mem_alloc(device, nbytes) -> device pointer."},
    {"mem_free", py_mem_free, METH_VARARGS, "mem_free(device, ptr)."},
    {"mem_copy", py_mem_copy, METH_VARARGS, "mem_copy(device, dst, src, nbytes, stream=0)."},
    {"_slice_view", py_slice_view, METH_VARARGS,
     "Private: a DLPack exporter over a reservation's slice."},
    {"device_total_memory", py_device_total_memory, METH_O,
     "device_total_memory(device) -> bytes of device memory."},
    {"stream_synchronize", py_stream_synchronize, METH_VARARGS,
     "stream_synchronize(device, stream=0)."},
    {"_set_descriptor_type", py_set_descriptor_type, METH_O,
     "Private: the bytes subclass that publishes return (vmmt.Descriptor)."},
    {"_log_route", vmmtpy_log_route, METH_O,
     "Private: route the library's log lines to a callable (level, message), or None: stderr."},
    {"_log_drain", vmmtpy_log_drain, METH_NOARGS, "Private: deliver the queued log lines now."},
    {"_bench_c", vmmtpy_bench_c, METH_VARARGS,
     "Benchmark only: the C API's cost per publish and per consume, in this process."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "vmmt._vmmt",
    "The C core of the vmmt binding.",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

static int add_type(PyObject *m, PyType_Spec *spec, PyTypeObject **out, const char *name)
{
    PyObject *t = PyType_FromSpec(spec);

    if (t == NULL) return -1;
    *out = (PyTypeObject *)t;
    Py_INCREF(t);
    if (PyModule_AddObject(m, name, t) != 0) {
        Py_DECREF(t);
        return -1;
    }
    return 0;
}

PyMODINIT_FUNC PyInit__vmmt(void); /* the one exported symbol */

PyMODINIT_FUNC PyInit__vmmt(void)
{
    PyObject *m = PyModule_Create(&module_def);

    if (m == NULL) return NULL;
    if (vmmtpy_errors_add(m) != 0 ||
        add_type(m, &vmmtpy_pool_spec, &vmmtpy_PoolType, "Pool") != 0 ||
        add_type(m, &vmmtpy_consumer_spec, &vmmtpy_ConsumerType, "Consumer") != 0 ||
        add_type(m, &vmmtpy_buffer_spec, &vmmtpy_BufferType, "Buffer") != 0 ||
        add_type(m, &vmmtpy_group_spec, &vmmtpy_GroupType, "Group") != 0 ||
        PyModule_AddIntConstant(m, "DESC_SIZE", VMMT_DESC_SIZE) != 0 ||
        PyModule_AddIntConstant(m, "MAX_DIMS", VMMT_MAX_DIMS) != 0 ||
        PyModule_AddIntConstant(m, "ALL_RANKS", VMMT_ALL_RANKS) != 0 ||
        PyModule_AddStringConstant(m, "LIBRARY_VERSION", VMMT_VERSION_STRING) != 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
