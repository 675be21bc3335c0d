/* See argconv.h. */
#include "argconv.h"

#include <stdint.h>

int vmmtpy_u64_arg(PyObject *o, void *out)
{
    unsigned long long v;

    if (!PyLong_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "expected an int");
        return 0;
    }
    v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return 0;
    *(unsigned long long *)out = v;
    return 1;
}

int vmmtpy_u32_arg(PyObject *o, void *out)
{
    unsigned long long v;

    if (!vmmtpy_u64_arg(o, &v)) return 0;
    if (v > UINT32_MAX) {
        PyErr_Format(PyExc_OverflowError, "%llu does not fit in 32 bits", v);
        return 0;
    }
    *(unsigned int *)out = (unsigned int)v;
    return 1;
}

int vmmtpy_device_arg(int device)
{
    /* The count cannot change once the driver is loaded: asked once (a consume's hot path). */
    static int known;
    const char *name;
    int count = 0;

    if (device >= 0 && device < known) return 0;
    /* No driver: the call itself says why, with the loader's message. */
    if ((name = vmmt_driver_name()) == NULL || vmmt_device_count(&count) != VMMT_OK) return 0;
    known = count;
    if (device >= 0 && device < count) return 0;
    if (count == 0)
        PyErr_Format(PyExc_ValueError, "device=%d: the %s driver reports no device", device, name);
    else
        PyErr_Format(PyExc_ValueError,
                     "device=%d does not exist: the %s driver reports %d device(s); give one of "
                     "0..%d",
                     device, name, count, count - 1);
    return -1;
}
