/*
 * Checked arguments. Unsigned ones for PyArg_Parse* "O&": the "K" and "I" formats
 * wrap a negative or too large int silently (max_slices=2**32+4 became 4
 * slots, recycle_interval_us=-5 a period of 71 minutes); these raise
 * OverflowError (TypeError for a non-int) instead.
 */
#ifndef VMMTPY_ARGCONV_H
#define VMMTPY_ARGCONV_H

#include "py_vmmt.h"

/* out: unsigned long long */
int vmmtpy_u64_arg(PyObject *o, void *out);
/* out: unsigned int, at most UINT32_MAX */
int vmmtpy_u32_arg(PyObject *o, void *out);

/*
 * 0 when `device` is one the driver has, else -1 with a ValueError naming
 * `device=` and the range (checked before anything is allocated or
 * consumed: a later failure of the allocation would name vmmt_mem_alloc).
 * No driver loaded: 0, and the call that follows says why.
 */
int vmmtpy_device_arg(int device);

#endif
