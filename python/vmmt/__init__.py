"""vmmt: hand GPU buffers between processes through CUDA VMM, for any array
library that speaks DLPack (PyTorch, CuPy, JAX, NumPy).

A producer publishes arrays into a :class:`Pool` and sends the 512-byte
:class:`Descriptor` to its consumers by any means (a pipe, a socket, a
pickle); each consumer's :class:`Consumer` copies the bytes out and returns an
object that ``torch.from_dlpack`` (or ``cupy.from_dlpack``,
``numpy.from_dlpack``) turns into an array that owns its memory.

The C core is ``vmmt._vmmt``; this module resolves streams and devices, makes
arrays contiguous, and gives descriptors a Python face.
"""
import sys

from . import _vmmt
from ._vmmt import Error, PoolFull, Timeout

__all__ = ["Pool", "Consumer", "Descriptor", "Error", "PoolFull", "Timeout", "probe",
           "select_driver", "driver_name", "device_count", "ALL_RANKS"]
__version__ = _vmmt.LIBRARY_VERSION

ALL_RANKS = _vmmt.ALL_RANKS

# DLPack (code, bits) -> name, for Descriptor.dtype.
_DTYPE_NAMES = {
    (0, 8): "int8", (0, 16): "int16", (0, 32): "int32", (0, 64): "int64",
    (1, 8): "uint8", (1, 16): "uint16", (1, 32): "uint32", (1, 64): "uint64",
    (2, 16): "float16", (2, 32): "float32", (2, 64): "float64",
    (4, 16): "bfloat16", (5, 64): "complex64", (5, 128): "complex128", (6, 8): "bool",
}

_DL_CUDA_TYPES = (2, 13)  # kDLCUDA, kDLCUDAManaged


# ------------------------------------------------------------------ driver

def select_driver(name):
    """Choose 'cuda' or 'emu' before any other call (VMMT_DRIVER does the same)."""
    _vmmt.driver_select(name)


def driver_name():
    """'cuda' or 'emu', loading the driver if needed; raises Error if none loads."""
    return _vmmt.driver_info()[0]


def device_count():
    return _vmmt.driver_info()[2]


_EMU = None  # the driver cannot change once loaded: asked once


def _on_emu():
    global _EMU
    if _EMU is None:
        try:
            _EMU = _vmmt.driver_info()[0] == "emu"
        except Error:
            return False
    return _EMU


def probe(device=None):
    """What ``vmmt probe --json`` prints, as a dict (every device, or one)."""
    try:
        name, version, count = _vmmt.driver_info()
    except Error as e:
        return {"driver": None, "status": str(e).split(":")[0], "error": str(e)}
    if device is not None and not 0 <= device < count:
        raise ValueError("device %d does not exist; the %s driver reports %d device(s)"
                         % (device, name, count))
    soft, hard = _vmmt.open_files()
    devices = []
    for d in ([device] if device is not None else range(count)):
        entry = _vmmt.probe_device(d)
        entry.pop("status")
        if not entry["selected"]:
            entry["selected"] = None
        devices.append(entry)
    return {"driver": name, "driver_version": version, "device_count": count,
            "open_files_soft": soft, "open_files_hard": hard, "devices": devices}


# ----------------------------------------------------------------- streams

def _stream_value(stream):
    """A CUstream handle from an int, `cuda_stream`, `__cuda_stream__` or `ptr`."""
    if isinstance(stream, int):
        if stream < 0:
            raise ValueError("stream=%d is not a CUstream handle" % stream)
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        value = proto() if callable(proto) else proto
        return int(value[1] if isinstance(value, tuple) else value)
    for attr in ("cuda_stream", "ptr", "handle"):
        value = getattr(stream, attr, None)
        if isinstance(value, int):
            return value
    raise TypeError("stream must be an int (CUstream), or have cuda_stream or __cuda_stream__; "
                    "got %r" % type(stream).__name__)


def _library_of(array):
    return type(array).__module__.split(".")[0] if array is not None else None


def _current_stream(device, array=None):
    """The current stream of the array's library (PyTorch, CuPy) on `device`, else 0."""
    if _on_emu():
        return 0  # the libraries' streams belong to the real driver
    lib = _library_of(array)
    torch = sys.modules.get("torch")
    if torch is not None and lib in ("torch", None) and torch.cuda.is_available() and \
            (lib == "torch" or torch.cuda.is_initialized()):
        return torch.cuda.current_stream(device).cuda_stream
    cupy = sys.modules.get("cupy")
    if cupy is not None and lib in ("cupy", None):
        with cupy.cuda.Device(device):
            return cupy.cuda.get_current_stream().ptr
    return 0


def _resolve_stream(stream, device, array=None):
    return _current_stream(device, array) if stream is None else _stream_value(stream)


# ------------------------------------------------------------------ arrays

def _contiguous(array):
    """The array itself when C-contiguous, else a contiguous copy (same library)."""
    lib = _library_of(array)
    if lib == "torch":
        return array if array.is_contiguous() else array.contiguous()
    flags = getattr(array, "flags", None)
    if flags is not None and not getattr(flags, "c_contiguous", True):
        module = sys.modules.get(lib)
        if module is not None and hasattr(module, "ascontiguousarray"):
            return module.ascontiguousarray(array)
    return array


def _capsule(array, stream):
    """array.__dlpack__ with the stream contract: the library orders its work
    before `stream` (CUDA arrays); host arrays take no stream."""
    if not hasattr(array, "__dlpack__"):
        raise TypeError("%s has no __dlpack__; vmmt publishes DLPack arrays (PyTorch, CuPy, JAX, "
                        "NumPy)" % type(array).__name__)
    kind = array.__dlpack_device__()[0] if hasattr(array, "__dlpack_device__") else 1
    kwargs = {}
    if kind in _DL_CUDA_TYPES:
        kwargs["stream"] = stream if stream else 1  # 0 is ambiguous: the legacy default stream
    if type(array) not in _PRE_DLPACK_1:
        try:
            return array.__dlpack__(max_version=(1, 0), **kwargs)
        except TypeError:  # a library older than DLPack 1.0; remembered: raising costs
            _PRE_DLPACK_1.add(type(array))
    try:
        return array.__dlpack__(**kwargs)
    except BufferError:
        # NumPy before 2.1 will not export a read-only array (it cannot say
        # "read-only" in DLPack 0.x); publishing only reads it, so a copy does.
        flags = getattr(array, "flags", None)
        module = sys.modules.get(_library_of(array))
        if flags is None or getattr(flags, "writeable", True) or not hasattr(module, "array"):
            raise
        return module.array(array, copy=True).__dlpack__(**kwargs)


_PRE_DLPACK_1 = set()


_TORCH_DL = {}  # torch.dtype -> DLPack (code, bits)


def _torch_items(arrays, device):
    """publish_raw items for contiguous PyTorch tensors on `device` or the CPU,
    or None when any array is something else (then DLPack is the path)."""
    torch = sys.modules.get("torch")
    if torch is None or _on_emu():
        return None
    if not _TORCH_DL:
        for name, dl in (("float32", (2, 32)), ("float64", (2, 64)), ("float16", (2, 16)),
                         ("bfloat16", (4, 16)), ("int8", (0, 8)), ("int16", (0, 16)),
                         ("int32", (0, 32)), ("int64", (0, 64)), ("uint8", (1, 8)),
                         ("bool", (6, 8)), ("complex64", (5, 64)), ("complex128", (5, 128))):
            if hasattr(torch, name):
                _TORCH_DL[getattr(torch, name)] = dl
    items = []
    for a in arrays:
        if type(a) is not torch.Tensor or a.layout != torch.strided or a.is_conj() or \
                a.is_neg() or not a.is_contiguous():
            return None
        dl = _TORCH_DL.get(a.dtype)
        if dl is None:
            return None
        if a.is_cuda:
            if a.device.index != device:
                return None  # its stream is another device's: let DLPack order it
            location = 0
        elif a.device.type == "cpu":
            location = 1
        else:
            return None
        items.append((a, a.data_ptr(), a.numel() * a.element_size(), dl[0], dl[1], 1,
                      tuple(a.shape), location))
    return items


# -------------------------------------------------------------- descriptor

class Descriptor(bytes):
    """A published buffer's 512-byte descriptor: bytes on the wire, picklable.

    ``Descriptor(b)`` and ``Descriptor.from_bytes(b)`` validate every field;
    the attributes decode it (vmmt_desc_inspect).
    """
    __slots__ = ()

    def __new__(cls, data):
        data = bytes(data)
        _vmmt.desc_inspect(data)  # ValueError naming the field that is wrong
        return super().__new__(cls, data)

    @classmethod
    def from_bytes(cls, data):
        return cls(data)

    @classmethod
    def _trusted(cls, data):
        return bytes.__new__(cls, data)

    def __reduce__(self):
        return (Descriptor, (bytes(self),))

    def _field(self, i):
        return _vmmt.desc_inspect(bytes(self))[i]

    pool_id = property(lambda self: self._field(0), doc="16-byte id of the pool")
    handle_type = property(lambda self: self._field(1), doc="'posix_fd' or 'fabric'")
    producer_device = property(lambda self: self._field(2))
    consumer_count = property(lambda self: self._field(3))
    slot = property(lambda self: self._field(4))
    generation = property(lambda self: self._field(5))
    nbytes = property(lambda self: self._field(6))
    dl_dtype = property(lambda self: self._field(7), doc="DLPack (code, bits, lanes)")
    shape = property(lambda self: self._field(8))
    stream_ordered = property(lambda self: bool(self._field(9)))
    pack_index = property(lambda self: self._field(10))
    pack_count = property(lambda self: self._field(11))

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def dtype(self):
        """'float32', 'bfloat16', ... ; None for untyped bytes."""
        code, bits, lanes = self.dl_dtype
        if bits == 0:
            return None
        name = _DTYPE_NAMES.get((code, bits), "dl(%d,%d)" % (code, bits))
        return name if lanes == 1 else "%sx%d" % (name, lanes)

    def __repr__(self):
        i = _vmmt.desc_inspect(bytes(self))
        return ("Descriptor(slot=%d, generation=%d, nbytes=%d, dtype=%s, shape=%r, pack=%d/%d)"
                % (i[4], i[5], i[6], self.dtype, i[8], i[10], i[11]))

    __str__ = __repr__


def _desc_bytes(desc):
    if isinstance(desc, (bytes, bytearray, memoryview)):
        return bytes(desc)
    raise TypeError("expected a Descriptor (or its 512 bytes), got %r" % type(desc).__name__)


# -------------------------------------------------------------------- pool

class Pool:
    """A producer's pool of device memory, exported once to its consumers.

    ``publish`` copies an array into a free slice on ``stream`` and returns
    its Descriptor at once; the copy is stream-ordered where the driver
    allows. The pool keeps the source array alive until that copy is done,
    so the caller may drop it right away; the caller must not *write* it
    until ``stream`` has passed the publish.
    """

    def __init__(self, device=0, memory_size=None, consumer_count=1, *, max_slices=4096,
                 handle_type="auto", allow_posix_fallback=True, round_up=False,
                 broker_path=None, timeout_ms=5000, recycle_interval_us=1000, handoff="auto",
                 device_control_table=False):
        if memory_size is None:
            raise ValueError("memory_size is required: the pool's bytes of device memory "
                             "(a multiple of the VMM granularity, 2 MiB on H200)")
        self.device = device
        self._pool = _vmmt.Pool(device, memory_size, consumer_count, max_slices, handle_type,
                                allow_posix_fallback, round_up, broker_path, timeout_ms,
                                recycle_interval_us, handoff, device_control_table)

    def _publish(self, arrays, stream, none_when_full):
        arrays = [_contiguous(a) for a in arrays]
        s = _resolve_stream(stream, self.device, arrays[0] if arrays else None)
        # PyTorch tensors on the default stream skip DLPack: torch's __dlpack__
        # costs several microseconds, and on its current stream orders nothing.
        items = _torch_items(arrays, self.device) if stream is None else None
        if items is not None:
            raw = self._pool.publish_raw(items, s, none_when_full)
        else:
            raw = self._pool.publish([_capsule(a, s) for a in arrays], s, none_when_full)
        if raw is None:
            return None
        return [Descriptor._trusted(b) for b in raw]

    def publish(self, array, stream=None):
        """Publish one array; raises PoolFull when there is no room now."""
        return self._publish([array], stream, False)[0]

    def publish_many(self, arrays, stream=None):
        """Publish up to 64 arrays packed in one slice; None when the pool has no room."""
        return self._publish(list(arrays), stream, True)

    def cancel(self, desc):
        """Take back a descriptor never handed to a consumer (idempotent)."""
        self._pool.cancel(_desc_bytes(desc))

    def reclaim(self):
        """Recycle every acknowledged slice now; returns how many were freed."""
        return self._pool.reclaim()

    def drain(self, timeout_ms=5000):
        """Wait until nothing is in flight; raises Timeout otherwise."""
        self._pool.drain(timeout_ms)

    def stats(self):
        """Every field of vmmt_pool_stats, as a dict."""
        return self._pool.stats()

    def close(self):
        """Wait for copies, give sources back, shut the pool down (idempotent)."""
        self._pool.close()

    @property
    def closed(self):
        return self._pool.closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


# ---------------------------------------------------------------- consumer

def _ranks(ranks):
    """(rank_first, rank_count) from None (all), an int, or consecutive ints."""
    if ranks is None:
        return ALL_RANKS, 0
    # A negative first rank would reach the C API as VMMT_ALL_RANKS (-1) and
    # acknowledge every rank of the pool: refused here.
    if isinstance(ranks, int):
        if ranks < 0:
            raise ValueError("ranks=%d is negative; give a rank 0.. or None for all" % ranks)
        return ranks, 1
    ranks = list(ranks)
    if not ranks or ranks != list(range(ranks[0], ranks[0] + len(ranks))):
        raise ValueError("ranks must be None, an int, or consecutive ints (a range); got %r"
                         % (ranks,))
    if ranks[0] < 0:
        raise ValueError("ranks %r start below 0; give ranks 0.. or None for all" % (ranks,))
    return ranks[0], len(ranks)


def _default_device():
    torch = sys.modules.get("torch")
    if torch is not None and not _on_emu() and torch.cuda.is_available() and \
            torch.cuda.is_initialized():
        return torch.cuda.current_device()
    cupy = sys.modules.get("cupy")
    if cupy is not None and not _on_emu():
        return cupy.cuda.Device().id
    return 0


class Consumer:
    """A per-process cache of imported pools; thread-safe."""

    def __init__(self, *, timeout_ms=5000, max_pools=16):
        self._c = _vmmt.Consumer(timeout_ms, max_pools)

    def consume(self, desc, device=None, out=None, stream=None, ranks=None):
        """Copy the buffer a descriptor names and acknowledge it for `ranks`.

        Without ``out``: returns a Buffer in new device memory, for
        ``torch.from_dlpack`` (it owns the memory). With ``out`` (any DLPack
        array of at least desc.nbytes, C-contiguous): fills it and returns
        it. The copy runs on ``stream`` (default: the current stream of
        PyTorch or CuPy on `device`, else the default stream).
        """
        first, count = _ranks(ranks)
        raw = _desc_bytes(desc)
        if out is None:
            if device is None:
                device = _default_device()
            s = _resolve_stream(stream, device)
            return self._c.consume(raw, device, s, first, count)
        return self._consume_into(raw, device, out, stream, first, count)

    def _consume_into(self, raw, device, out, stream, first, count):
        torch = sys.modules.get("torch")
        if torch is not None and stream is None and type(out) is torch.Tensor and out.is_cuda \
                and out.is_contiguous() and not _on_emu() and device in (None, out.device.index):
            # The current stream is the tensor's own: nothing to order, no DLPack needed.
            device = out.device.index
            self._c.consume_into(raw, device, out.data_ptr(), out.numel() * out.element_size(),
                                 torch.cuda.current_stream(device).cuda_stream, first, count)
            return out
        kind, dev_id = out.__dlpack_device__()
        if device is None:
            device = dev_id if kind in _DL_CUDA_TYPES else _default_device()
        s = _resolve_stream(stream, device, out)
        cap = out.__dlpack__(stream=(s or 1)) if kind in _DL_CUDA_TYPES else out.__dlpack__()
        ptr, nbytes, _, _, readonly = _vmmt.capsule_info(cap)
        if readonly:
            raise ValueError("out is read-only")
        if kind in _DL_CUDA_TYPES:
            self._c.consume_into(raw, device, ptr, nbytes, s, first, count)
            return out
        # Host memory: through device memory, then one copy to the host. The
        # size is checked first: the consume acknowledges, so a refusal after
        # it would lose the buffer for good.
        need = _vmmt.desc_inspect(raw)[6]
        if need > nbytes:
            raise ValueError("out holds %d bytes; the buffer has %d" % (nbytes, need))
        buf = self._c.consume(raw, device, s, first, count)
        _vmmt.mem_copy(device, ptr, buf.ptr, buf.nbytes, s)
        _vmmt.stream_synchronize(device, s)
        del cap
        return out

    def ack(self, desc, device=None, stream=None, ranks=None):
        """Acknowledge without copying (a dropped request)."""
        first, count = _ranks(ranks)
        if device is None:
            device = _default_device()
        self._c.ack(_desc_bytes(desc), device, _resolve_stream(stream, device), first, count)

    def evict(self, pool_id, device=None):
        """Unmap a pool (by its 16-byte id, or any of its Descriptors)."""
        if isinstance(pool_id, Descriptor):
            pool_id = pool_id.pool_id
        self._c.evict(bytes(pool_id), _default_device() if device is None else device)

    def pool_count(self):
        return self._c.pool_count()

    def close(self):
        self._c.close()

    @property
    def closed(self):
        return self._c.closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


Buffer = _vmmt.Buffer
