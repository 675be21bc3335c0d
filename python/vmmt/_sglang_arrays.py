"""The tensor library behind vmmt.sglang: PyTorch where it is, NumPy otherwise.

sglang's transport handles torch tensors only. The adapter also takes NumPy
arrays, so that it imports and runs where torch is absent (the CI machine's
emulated driver); everything it does to a tensor goes through here, and
torch is never imported by this module: a torch tensor can only exist once
the caller has imported torch.
"""
import sys

import numpy

TORCH, NUMPY = "torch", "numpy"


def _torch():
    return sys.modules.get("torch")


def library(x):
    """TORCH or NUMPY for a tensor this adapter can publish, else None."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        return TORCH
    if isinstance(x, numpy.ndarray):
        return NUMPY
    return None


def is_tensor(x):
    return library(x) is not None


def numel(t):
    return t.numel() if library(t) == TORCH else t.size


def nbytes(t):
    return t.numel() * t.element_size() if library(t) == TORCH else t.nbytes


def is_meta(t):
    return library(t) == TORCH and t.is_meta


def is_device(t):
    """Whether the tensor is in CUDA device memory (its copy is stream-ordered)."""
    return library(t) == TORCH and t.is_cuda


def contiguous(t):
    if library(t) == TORCH:
        return t if t.is_contiguous() else t.contiguous()
    return numpy.ascontiguousarray(t)


def to_cpu(t):
    """sglang's fallback when no slice fits: the tensor in host memory, sent inline."""
    return t.cpu() if library(t) == TORCH else t


def dtype_name(dtype):
    """'float32' for torch.float32, numpy.float32 or numpy.dtype('float32')."""
    name = str(dtype)
    return name[len("torch."):] if name.startswith("torch.") else numpy.dtype(dtype).name


def dtype_of(name, lib):
    """The dtype object of `lib` named `name` (lib's own where it is imported)."""
    torch = _torch() if lib == TORCH else None
    if torch is not None:
        return getattr(torch, name)
    return numpy.dtype(name)


def itemsize(dtype):
    if isinstance(dtype, numpy.dtype):
        return dtype.itemsize
    size = getattr(dtype, "itemsize", None)  # torch 2.1 and newer
    if size is None:
        size = _torch().empty((), dtype=dtype).element_size()
    return size


def consumer_library(lib):
    """What a consumer rebuilds with: the producer's library if imported here
    (a rank process of sglang has torch), else NumPy."""
    return TORCH if lib == TORCH and _torch() is not None else NUMPY


def from_buffer(buf, lib):
    """An array that owns a consumed vmmt.Buffer (via DLPack)."""
    if lib == TORCH:
        return _torch().from_dlpack(buf)
    return numpy.from_dlpack(buf)


def empty_bytes(nbytes, device, lib, on_device):
    """A flat uint8 buffer on `device` (host memory where the driver is the
    emulator, whose device memory is host memory)."""
    if lib == TORCH:
        torch = _torch()
        where = "cuda:%d" % device if on_device else "cpu"
        return torch.empty(nbytes, dtype=torch.uint8, device=where)
    return numpy.empty(nbytes, dtype=numpy.uint8)


def typed_view(flat, offset, nbytes, dtype, shape):
    """Bytes [offset, offset + nbytes) of a flat uint8 buffer as dtype and shape."""
    return flat[offset:offset + nbytes].view(dtype).reshape(tuple(shape))


def shares_storage(a, b):
    """Whether two arrays are views of one allocation (for the tests)."""
    if library(a) == TORCH:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    return numpy.shares_memory(a, b)
