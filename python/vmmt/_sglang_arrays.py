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
    # ascontiguousarray makes a 0-d array 1-d: only a copy where one is needed.
    return t if t.flags.c_contiguous else numpy.ascontiguousarray(t)


def to_cpu(t):
    """sglang's fallback when no slice fits: the tensor in host memory, sent inline."""
    return t.cpu() if library(t) == TORCH else t


# Every proxy that crosses a pipe names its dtype, and every rank rebuilds
# one from the name: numpy.dtype(...).name alone costs about 4 us, and torch
# before 2.1 has no dtype.itemsize. The answers, once found, are kept here;
# a process meets a handful of dtypes, and the caps bound what odd callers
# (a dtype made per call) can add.
_CACHE_CAP = 256
_names, _dtypes, _itemsizes = {}, {}, {}


def _kept(cache, key, value):
    if len(cache) < _CACHE_CAP:
        cache[key] = value
    return value


def dtype_name(dtype):
    """'float32' for torch.float32, numpy.float32 or numpy.dtype('float32')."""
    try:
        return _names[dtype]
    except (KeyError, TypeError):  # TypeError: unhashable, answered but not kept
        pass
    name = str(dtype)
    name = name[len("torch."):] if name.startswith("torch.") else numpy.dtype(dtype).name
    try:
        return _kept(_names, dtype, name)
    except TypeError:
        return name


def dtype_of(name, lib):
    """The dtype object of `lib` named `name` (lib's own where it is imported)."""
    torch = _torch() if lib == TORCH else None
    if torch is not None:
        return getattr(torch, name)
    try:
        return _dtypes[name]
    except (KeyError, TypeError):
        pass
    dtype = numpy.dtype(name)
    return _kept(_dtypes, name, dtype) if isinstance(name, str) else dtype


def itemsize(dtype):
    if isinstance(dtype, numpy.dtype):
        return dtype.itemsize
    try:
        return _itemsizes[dtype]
    except (KeyError, TypeError):
        pass
    size = getattr(dtype, "itemsize", None)  # torch 2.1 and newer
    if size is None:
        size = _torch().empty((), dtype=dtype).element_size()
    try:
        return _kept(_itemsizes, dtype, size)
    except TypeError:
        return size


def consumer_library(lib):
    """What a consumer rebuilds with: the producer's library if imported here
    (a rank process of sglang has torch), else NumPy."""
    return TORCH if lib == TORCH and _torch() is not None else NUMPY


def empty_bytes(nbytes, device, lib, on_device):
    """A flat uint8 buffer on `device` (host memory where the driver is the
    emulator, whose device memory is host memory)."""
    if lib == TORCH:
        torch = _torch()
        where = "cuda:%d" % device if on_device else "cpu"
        return torch.empty(nbytes, dtype=torch.uint8, device=where)
    return numpy.empty(nbytes, dtype=numpy.uint8)


def empty_typed(shape, dtype, device, lib, on_device):
    """An array of `shape` and `dtype` on `device`, as empty_bytes places it
    (an int device: torch parses no "cuda:N" string)."""
    if lib == TORCH:
        return _torch().empty(tuple(shape), dtype=dtype, device=device if on_device else "cpu")
    return numpy.empty(tuple(shape), dtype=dtype)


def typed_view(flat, offset, nbytes, dtype, shape):
    """Bytes [offset, offset + nbytes) of a flat uint8 buffer as dtype and shape."""
    return flat[offset:offset + nbytes].view(dtype).reshape(tuple(shape))


def shares_storage(a, b):
    """Whether two arrays are views of one allocation (for the tests)."""
    if library(a) == TORCH:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    return numpy.shares_memory(a, b)
