/*
 * Taking tensors from DLPack capsules (the __dlpack__ of the array being
 * published, or of an `out` array being filled). Versioned capsules
 * ("dltensor_versioned", DLPack 1.x) and legacy ones ("dltensor") both work.
 */
#include <string.h>

#include "py_vmmt.h"

static const char NAME_V[] = "dltensor_versioned", NAME_L[] = "dltensor";
static const char USED_V[] = "used_dltensor_versioned", USED_L[] = "used_dltensor";

static int capsule_kind(PyObject *capsule, int *versioned)
{
    if (PyCapsule_IsValid(capsule, NAME_V)) {
        *versioned = 1;
        return 0;
    }
    if (PyCapsule_IsValid(capsule, NAME_L)) {
        *versioned = 0;
        return 0;
    }
    PyErr_SetString(PyExc_TypeError,
                    "expected a DLPack capsule named 'dltensor' or 'dltensor_versioned' that no "
                    "one has consumed yet (what __dlpack__() returns)");
    return -1;
}

int vmmtpy_capsule_tensor(PyObject *capsule, DLTensor **t, int *readonly)
{
    int versioned;

    if (capsule_kind(capsule, &versioned) != 0) return -1;
    *readonly = 0;
    if (versioned) {
        DLManagedTensorVersioned *m = PyCapsule_GetPointer(capsule, NAME_V);
        if (m == NULL) return -1;
        if (m->version.major > VMMT_DLPACK_MAJOR) {
            PyErr_Format(PyExc_BufferError,
                         "DLPack %u.%u capsule; this vmmt understands major version %d",
                         (unsigned)m->version.major, (unsigned)m->version.minor, VMMT_DLPACK_MAJOR);
            return -1;
        }
        *readonly = (m->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;
        *t = &m->dl_tensor;
    } else {
        DLManagedTensor *m = PyCapsule_GetPointer(capsule, NAME_L);
        if (m == NULL) return -1;
        *t = &m->dl_tensor;
    }
    return 0;
}

int vmmtpy_src_take(PyObject *capsule, struct vmmtpy_src *out)
{
    int versioned = 0, readonly;
    DLTensor *t;

    if (vmmtpy_capsule_tensor(capsule, &t, &readonly) != 0) return -1;
    (void)capsule_kind(capsule, &versioned);
    out->versioned = versioned;
    out->t = t;
    out->managed = PyCapsule_GetPointer(capsule, versioned ? NAME_V : NAME_L);
    /* Renamed, the capsule's destructor leaves the tensor to us. */
    if (PyCapsule_SetName(capsule, versioned ? USED_V : USED_L) != 0) return -1;
    return 0;
}

void vmmtpy_src_release(struct vmmtpy_src *s)
{
    if (s->managed == NULL) return;
    if (s->versioned) {
        DLManagedTensorVersioned *m = s->managed;
        if (m->deleter != NULL) m->deleter(m);
    } else {
        DLManagedTensor *m = s->managed;
        if (m->deleter != NULL) m->deleter(m);
    }
    s->managed = NULL;
    s->t = NULL;
}

int vmmtpy_tensor_to_buffer(const DLTensor *t, vmmt_buffer *b)
{
    uint64_t elems = 1, expect = 1, elem_bytes;

    memset(b, 0, sizeof *b);
    switch ((int)t->device.device_type) {
    case kDLCUDA:
    case kDLCUDAManaged: b->location = VMMT_LOC_DEVICE; break;
    case kDLCPU:
    case kDLCUDAHost: b->location = VMMT_LOC_HOST; break;
    default:
        PyErr_Format(PyExc_ValueError,
                     "cannot publish a tensor on DLPack device type %d; vmmt takes CUDA device "
                     "memory (2, 13) and host memory (1, 3)",
                     (int)t->device.device_type);
        return -1;
    }
    if (t->ndim < 0 || t->ndim > VMMT_MAX_DIMS) {
        PyErr_Format(PyExc_ValueError, "tensor has %d dimensions; vmmt carries at most %d",
                     (int)t->ndim, VMMT_MAX_DIMS);
        return -1;
    }
    /* A buggy exporter's NULL shape would be read below. */
    if (t->ndim > 0 && t->shape == NULL) {
        PyErr_Format(PyExc_ValueError,
                     "DLPack tensor has ndim=%d but no shape array; its exporter is broken",
                     (int)t->ndim);
        return -1;
    }
    if (t->dtype.bits == 0 || t->dtype.bits % 8 != 0) {
        PyErr_Format(PyExc_ValueError, "dtype of %d bits is not a whole number of bytes",
                     (int)t->dtype.bits);
        return -1;
    }
    elem_bytes = (uint64_t)t->dtype.bits / 8 * (t->dtype.lanes ? t->dtype.lanes : 1);
    /* C-contiguous: strides absent, or each one the product of the later sizes
     * (a dimension of size 1 may carry any stride). */
    for (int k = t->ndim - 1; k >= 0; k--) {
        int64_t n = t->shape[k];
        if (n < 0) {
            PyErr_Format(PyExc_ValueError, "tensor has shape[%d]=%lld", k, (long long)n);
            return -1;
        }
        if (t->strides != NULL && n > 1 && (uint64_t)t->strides[k] != expect) {
            PyErr_SetString(PyExc_ValueError,
                            "tensor is not C-contiguous; make it contiguous first");
            return -1;
        }
        if (n != 0 && elems > UINT64_MAX / (uint64_t)n) {
            PyErr_SetString(PyExc_OverflowError, "tensor size overflows 64 bits");
            return -1;
        }
        elems *= (uint64_t)n;
        expect *= (uint64_t)(n ? n : 1);
        b->shape[k] = n;
    }
    if (elems == 0) {
        PyErr_SetString(PyExc_ValueError, "tensor has no elements; there is nothing to publish");
        return -1;
    }
    b->ptr = (uint64_t)(uintptr_t)t->data + t->byte_offset;
    b->nbytes = elems * elem_bytes;
    b->dtype.code = t->dtype.code;
    b->dtype.bits = t->dtype.bits;
    b->dtype.lanes = t->dtype.lanes ? t->dtype.lanes : 1;
    b->ndim = t->ndim;
    return 0;
}
