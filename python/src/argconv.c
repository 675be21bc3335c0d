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
