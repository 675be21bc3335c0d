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
import ctypes
import gc
import os
import sys
import weakref

from . import _vmmt
from . import _args
from . import _logging
from ._args import ALL_RANKS
from ._vmmt import Error, Group, NoRoom, PoolFull, TooLarge, Closed, Stale, ProducerGone, Timeout

# The library's statuses (vmmt.OK, vmmt.EFULL, ...), from the one table in python/src/errors.c.
STATUSES = {name: getattr(_vmmt, name) for name in dir(_vmmt)
            if name == "OK" or (name[:1] == "E" and name.isupper())}
globals().update(STATUSES)

__all__ = ["Pool", "Consumer", "Descriptor", "Reservation", "Buffer", "Error", "NoRoom",
           "PoolFull", "TooLarge", "Closed", "Stale", "ProducerGone", "Timeout", "probe",
           "select_driver", "driver_name", "device_count", "ALL_RANKS", "log_to_logging",
           "log_to_stderr", "Group"] + sorted(STATUSES)
__version__ = _vmmt.LIBRARY_VERSION


def log_to_logging():
    """Send the library's log lines to the ``logging`` logger "vmmt" (the
    default from import): ERROR, WARNING, INFO and DEBUG records, at the
    levels VMMT_LOG lets through (warn by default)."""
    _logging.route()


def log_to_stderr():
    """Give the library's log lines back to its own writer (stderr)."""
    _logging.to_stderr()


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


def _stream_device(stream, device):
    """The device of a stream object that says which it is (PyTorch's
    device_index, CuPy's device_id), checked against `device`; `device` as
    given for an int or a stream that does not say. A copy enqueued in one
    device's context on another device's stream fails, and a failed copy
    still acknowledges."""
    if stream is None or isinstance(stream, int):
        return device
    own = getattr(stream, "device_index", None)
    if own is None:
        own = getattr(stream, "device_id", None)
    if isinstance(own, bool) or not isinstance(own, int):
        return device
    if device is not None and device != own:
        raise ValueError("stream is on device %d but device=%r; leave device out, or pass a "
                         "stream of that device" % (own, device))
    return own


def _library_of(array):
    return type(array).__module__.split(".")[0] if array is not None else None


_DL_COMPLEX = 5  # DLPack's kDLComplex


class _Torch:
    """PyTorch's names on the hot path, looked up once (attribute chains such
    as torch.cuda.current_stream cost microseconds per call)."""

    def __init__(self, torch):
        self.torch = torch
        self.Tensor = torch.Tensor
        self.strided = torch.strided
        self.dl = {}  # torch.dtype -> DLPack (code, bits)
        for name, dl in (("float32", (2, 32)), ("float64", (2, 64)), ("float16", (2, 16)),
                         ("bfloat16", (4, 16)), ("int8", (0, 8)), ("int16", (0, 16)),
                         ("int32", (0, 32)), ("int64", (0, 64)), ("uint8", (1, 8)),
                         ("bool", (6, 8)), ("complex64", (5, 64)), ("complex128", (5, 128))):
            if hasattr(torch, name):
                self.dl[getattr(torch, name)] = dl
        # The current stream as an int without building a torch.cuda.Stream
        # (PyTorch 1.13 and newer); else through the public API.
        raw = getattr(getattr(torch, "_C", None), "_cuda_getCurrentRawStream", None)
        self.raw_stream = raw if raw is not None else (
            lambda device: torch.cuda.current_stream(device).cuda_stream)
        self._available = None

    def available(self):
        if self._available is None:
            self._available = bool(self.torch.cuda.is_available())
        return self._available

    def stream(self, device):
        """The current stream on `device` (CUDA initialised on first use, as PyTorch does)."""
        if not self.torch.cuda.is_initialized():
            return self.torch.cuda.current_stream(device).cuda_stream
        return self.raw_stream(device)


_TORCH = None  # a _Torch once torch is imported; False on the emulated driver


def _torch():
    """The _Torch for an imported PyTorch, None when it is not (yet) imported or unused."""
    global _TORCH
    if _TORCH is not None:
        return _TORCH or None
    torch = sys.modules.get("torch")
    if torch is None:
        return None  # asked again: it may be imported later
    if _on_emu():
        _TORCH = False  # the libraries' streams and memory belong to the real driver
        return None
    _TORCH = _Torch(torch)
    return _TORCH


def _current_stream(device, array=None):
    """The current stream of the array's library (PyTorch, CuPy) on `device`, else 0."""
    if _on_emu():
        return 0  # the libraries' streams belong to the real driver
    lib = _library_of(array)
    t = _torch()
    if t is not None and lib in ("torch", None) and t.available() and \
            (lib == "torch" or t.torch.cuda.is_initialized()):
        return t.stream(device)
    cupy = sys.modules.get("cupy")
    if cupy is not None and lib in ("cupy", None):
        with cupy.cuda.Device(device):
            return cupy.cuda.get_current_stream().ptr
    return 0


def _resolve_stream(stream, device, array=None):
    return _current_stream(device, array) if stream is None else _stream_value(stream)


# ------------------------------------------------------------------ arrays

def _contiguous(array):
    """The array itself when C-contiguous, else a contiguous copy (same library).
    A PyTorch tensor's lazy negation or conjugation is resolved first (a copy):
    its DLPack export refuses the conjugate bit and drops the negative one, so
    the bytes published would not be the values read (test_attack_wire). One
    that requires grad is detached (no copy): publishing only reads it."""
    lib = _library_of(array)
    if lib == "torch":
        if array.requires_grad:
            array = array.detach()
        if array.is_conj():
            array = array.resolve_conj()
        if array.is_neg():
            array = array.resolve_neg()
        return array if array.is_contiguous() else array.contiguous()
    flags = getattr(array, "flags", None)
    if flags is not None and not getattr(flags, "c_contiguous", True):
        module = sys.modules.get(lib)
        if module is not None and hasattr(module, "ascontiguousarray"):
            return module.ascontiguousarray(array)
    return array


def _logical_nbytes(array):
    """The bytes a contiguous copy of `array` would take, from its shape and
    element size alone (no copy); None when the array does not say."""
    lib = _library_of(array)
    try:
        if lib == "torch":
            return array.numel() * array.element_size()
        size, itemsize = array.size, array.itemsize
        return int(size) * int(itemsize) if isinstance(size, int) else None
    except (AttributeError, TypeError):
        return None


_DL_BOOL = 6  # DLPack's kDLBool: one byte per element, 0 or 1


def _numpy_bool(array):
    """A NumPy bool array: NumPy before 1.25 will not export one through
    DLPack, so vmmt takes its bytes as uint8 and names them bool itself."""
    return type(array).__module__ == "numpy" and getattr(array.dtype, "kind", None) == "b"


def _torch_bool(array):
    """A PyTorch bool tensor: PyTorch before 2.0 will not export one through
    DLPack ("Bool type is not supported by dlpack"); taken as for NumPy."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(array, torch.Tensor) and array.dtype is torch.bool


def _native_order(array):
    """DLPack has no byte order: NumPy refuses to export a non-native array
    with a bare BufferError. Say what to do instead."""
    dtype = getattr(array, "dtype", None)
    if type(array).__module__ == "numpy" and getattr(dtype, "isnative", True) is False:
        raise ValueError("an array of dtype %s is not in this machine's byte order, which "
                         "DLPack cannot describe; convert it first: "
                         "array.astype(array.dtype.newbyteorder('='))" % dtype.str)


def _capsule(array, stream):
    """array.__dlpack__ with the stream contract: the library orders its work
    before `stream` (CUDA arrays); host arrays take no stream. A NumPy bool
    array is (capsule of its bytes, kDLBool)."""
    if _numpy_bool(array):
        return (_capsule(array.view(sys.modules["numpy"].uint8), stream), _DL_BOOL)
    if _torch_bool(array):
        return (_capsule(array.view(sys.modules["torch"].uint8), stream), _DL_BOOL)
    _native_order(array)
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


def _out_capsule(out, kind, stream):
    """The capsule of an array to be written (consume's out=): versioned where
    the library can, since only DLPack 1.0 can say "read-only"; a refusal to
    export (NumPy's for a read-only array) is a bad `out`, a ValueError."""
    kwargs = {"stream": stream if stream else 1} if kind in _DL_CUDA_TYPES else {}
    try:
        if type(out) not in _PRE_DLPACK_1:
            try:
                return out.__dlpack__(max_version=(1, 0), **kwargs)
            except TypeError:  # a library older than DLPack 1.0
                _PRE_DLPACK_1.add(type(out))
        return out.__dlpack__(**kwargs)
    except BufferError as e:
        raise ValueError("out cannot be written through DLPack: %s" % e) from e


def _other_device(array_device, device):
    return ValueError("out is on CUDA device %d but device=%r; leave device out, or pass an out "
                      "on that device" % (array_device, device))


def _torch_items(arrays, device):
    """publish_raw items for contiguous PyTorch tensors on `device` or the CPU,
    or None when any array is something else (then DLPack is the path)."""
    t = _torch()
    if t is None:
        return None
    items = []
    for a in arrays:
        if type(a) is not t.Tensor or a.layout is not t.strided or a.is_conj() or \
                a.is_neg() or not a.is_contiguous():
            return None
        dl = t.dl.get(a.dtype)
        if dl is None:
            return None
        if a.is_cuda:
            if a.get_device() != device:
                return None  # its stream is another device's: let DLPack order it
            location = 0
        elif a.device.type == "cpu":
            location = 1
        else:
            return None
        items.append((a, a.data_ptr(), a.numel() * a.element_size(), dl[0], dl[1], 1,
                      a.shape, location))
    return items


# -------------------------------------------------------------- descriptor

class Descriptor(bytes):
    """A published buffer's 512-byte descriptor: bytes on the wire, picklable.

    ``Descriptor(b)`` and ``Descriptor.from_bytes(b)`` validate every field;
    the attributes decode it (vmmt_desc_inspect), once: the fields are kept
    in the instance's dict (not pickled: a pickle carries the bytes alone).
    """

    def __new__(cls, data):
        if type(data) is not bytes:
            data = bytes(data)
        _vmmt.desc_check(data)  # ValueError naming the field that is wrong
        return super().__new__(cls, data)

    @classmethod
    def from_bytes(cls, data):
        return cls(data)

    @classmethod
    def _trusted(cls, data):
        return bytes.__new__(cls, data)

    def __reduce__(self):
        return (Descriptor, (bytes(self),))

    def _decoded(self):
        # Decoded once: an engine reads several fields of every descriptor it
        # hands on (slot and generation to track it, shape and dtype to
        # rebuild it), and each decode costs about a microsecond and a half.
        fields = self.__dict__.get("_fields")
        if fields is None:
            fields = self.__dict__["_fields"] = _vmmt.desc_inspect(bytes(self))
        return fields

    def _field(self, i):
        return self._decoded()[i]

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
    if isinstance(desc, bytes):
        return desc  # a Descriptor is bytes already: no copy
    if isinstance(desc, (bytearray, memoryview)):
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

    def __init__(self, *, memory_size, device=0, consumer_count=1, max_slices=4096,
                 handle_type="auto", allow_posix_fallback=True, round_up=False,
                 broker_path=None, timeout_ms=5000, recycle_interval_us=1000, handoff="auto",
                 device_control_table=False, memory_location="device", host_numa_node=-1,
                 elastic=False, chunk_size=0, min_resident=0, idle_release_ms=1500,
                 consumer_lease_ms=0):
        """Create and export a pool (vmmt_pool_create). Every option is a keyword.

        memory_location: "device" (default) or "host": a host pool is pinned
        host memory shared with the consumers; its producer writes it with
        the CPU and needs no CUDA context (a process that never touches the
        GPU can publish NumPy arrays); `device` is then the GPU whose NUMA
        node holds it. host_numa_node: host pools only, -1 (default) for
        the device's node. elastic=True: memory_size is the most the pool
        may hold; chunks of chunk_size bytes (0: four granularity units) are
        made while slices in them are in flight and given back after
        idle_release_ms idle; min_resident bytes stay resident from the start.
        consumer_lease_ms (0: off): a rank that no live consumer process holds
        and that leaves a slice unacknowledged for longer is released as dead.

        A bad option is a TypeError or ValueError naming it and its range.
        """
        memory_location = _args.choice("memory_location", memory_location, ("device", "host"))
        handoff = _args.choice("handoff", handoff, ("auto", "stream", "sync"))
        handle_type = _args.choice("handle_type", handle_type, ("auto", "posix_fd", "fabric"))
        elastic = _args.flag("elastic", elastic)
        device = _args.device(device)
        memory_size = _args.memory_size(memory_size, device, memory_location, elastic)
        ints = dict(
            consumer_count=_args.integer("consumer_count", consumer_count, 1, 256),
            max_slices=_args.integer("max_slices", max_slices, 1, _args.U32),
            timeout_ms=_args.integer("timeout_ms", timeout_ms, 1, _args.I32, " milliseconds"),
            recycle_interval_us=_args.integer("recycle_interval_us", recycle_interval_us, 1,
                                              _args.U32, " microseconds"),
            host_numa_node=_args.integer("host_numa_node", host_numa_node, -1, _args.I32),
            chunk_size=_args.integer("chunk_size", chunk_size, 0, _args.U64, " bytes"),
            min_resident=_args.integer("min_resident", min_resident, 0, _args.U64, " bytes"),
            idle_release_ms=_args.integer("idle_release_ms", idle_release_ms, 0, _args.U32,
                                          " milliseconds"),
            consumer_lease_ms=_args.integer("consumer_lease_ms", consumer_lease_ms, 0,
                                            _args.I32, " milliseconds"))
        flags = {name: _args.flag(name, value) for name, value in
                 (("allow_posix_fallback", allow_posix_fallback), ("round_up", round_up),
                  ("device_control_table", device_control_table))}
        if broker_path is not None:
            try:
                broker_path = os.fsdecode(broker_path)
            except TypeError:
                raise TypeError("broker_path=%r: give a path (str) or None for an abstract name"
                                % (broker_path,)) from None
        if memory_location == "host" and elastic:
            raise ValueError("elastic=True with memory_location='host': elastic pools are "
                             "device pools; drop one of the two")
        self.device = device
        self.memory_location = memory_location
        self.consumer_count = ints["consumer_count"]
        self._viewed = weakref.WeakSet()  # Reservations with views made (Reservation._anchor)
        self._deaths = []  # ranks found dead and not yet returned by poll_deaths
        self._pool = _vmmt.Pool(device, memory_size, ints["consumer_count"], ints["max_slices"],
                                handle_type, flags["allow_posix_fallback"], flags["round_up"],
                                broker_path, ints["timeout_ms"], ints["recycle_interval_us"],
                                handoff, flags["device_control_table"], memory_location,
                                ints["host_numa_node"], elastic, ints["chunk_size"],
                                ints["min_resident"], ints["idle_release_ms"],
                                ints["consumer_lease_ms"])
        self._data_bytes = self._pool.stats()["data_bytes"]
        _logging._pools.add(self)

    @property
    def pool_id(self):
        """The 16-byte id every descriptor of this pool carries (Descriptor.pool_id)."""
        return self._pool.pool_id

    def __repr__(self):
        if getattr(self, "_pool", None) is None:
            return "Pool(not created)"
        if self.closed:
            return "Pool(closed, id=%s)" % self._pool.pool_id.hex()[:8]
        st = self._pool.stats()
        return ("Pool(id=%s, device=%d, memory_location=%r, handle_type=%r, consumer_count=%d, "
                "data_bytes=%d, slots=%d, in_flight=%d, in_flight_bytes=%d, published=%d)"
                % (self._pool.pool_id.hex()[:8], self.device, self.memory_location,
                   st["handle_type"], self.consumer_count, st["data_bytes"], st["slots"],
                   st["in_flight"], st["in_flight_bytes"], st["published"]))

    # ------------------------------------------------------------- deaths

    def _note_deaths(self):
        """Take what the library found dead into _deaths, with a record naming the pool."""
        if self._pool.closed:
            return
        ranks = self._pool.take_dead_ranks()
        if ranks:
            self._deaths.extend(r for r in ranks if r not in self._deaths)
            _logging.logger.warning(
                "pool %s (device %d, %d consumer ranks): rank(s) %s found dead (a consumer "
                "process died, or consumer_lease_ms ran out); its slices in flight were "
                "released. Restart the rank, calling release_rank(rank) after reaping the old "
                "process and before publishing for the new one (python/README.md, \"Deaths\")",
                self._pool.pool_id.hex()[:8], self.device, self.consumer_count,
                ",".join(map(str, ranks)))

    def poll_deaths(self):
        """The ranks of this pool found dead since the last call (a consumer
        process died holding them, or consumer_lease_ms ran out), each once,
        lowest first: [] when none. Cheap enough to call after every publish.
        Each death is also a WARNING record of the logger "vmmt" naming the
        pool, when it is found. Ranks released by release_rank are not
        reported."""
        self._note_deaths()
        out = []
        # Popped one at a time: a death noted meanwhile (the log dispatch runs
        # between any two bytecodes of the main thread) is returned or kept.
        while self._deaths:
            out.append(self._deaths.pop(0))
        return sorted(out)

    def release_rank(self, rank):
        """Acknowledge, for consumer rank `rank`, every slice in flight now
        (vmmt_pool_release_rank). For a rank restarted under the same number:
        call it after the old process is reaped and before publishing for the
        new one; the old process's descriptors must not be consumed after it.
        Also for a rank the engine knows is dead, so that the slices it held
        come back at once."""
        rank = _args.integer("rank", rank, 0, self.consumer_count - 1)
        self._pool.release_rank(rank)
        # A death found before is the caller's to know now (the library forgets it too).
        if rank in self._deaths:
            self._deaths.remove(rank)

    def _publish(self, arrays, stream):
        # The stream first: a bad one is refused before any contiguous copy is made.
        s = _resolve_stream(stream, self.device, arrays[0] if arrays else None)
        arrays = [self._contiguous(a) for a in arrays]
        # PyTorch tensors on the default stream skip DLPack: torch's __dlpack__
        # costs several microseconds, and on its current stream orders nothing.
        items = _torch_items(arrays, self.device) if stream is None else None
        try:
            if items is not None:
                return self._pool.publish_raw(items, s)
            return self._pool.publish([_capsule(a, s) for a in arrays], s)
        except PoolFull:
            self._note_deaths()  # a rank found dead is the likely reason: say so
            raise

    def _contiguous(self, array):
        """The array, contiguous; one that could never fit is refused before a
        contiguous copy is made (a 4-byte broadcast view of 1 GiB would take
        1 GiB of memory only to be refused)."""
        nbytes = _logical_nbytes(array)
        if nbytes is not None and nbytes > self._data_bytes:
            e = TooLarge("an array (%s) of %d bytes can never fit: the pool's data region holds %d "
                         "bytes; publish it another way or create a larger pool"
                         % (type(array).__name__, nbytes, self._data_bytes))
            e.status = ETOOBIG
            raise e
        return _contiguous(array)

    def publish(self, array, stream=None):
        """Publish one array -> Descriptor.

        Raises PoolFull (no room now: retry later or fall back) or TooLarge
        (can never fit), both NoRoom; Closed once the pool is closed."""
        t = _TORCH or _torch()
        # The hot path: a contiguous CUDA tensor of this device on PyTorch's
        # current stream, checked and described with the fewest calls (each
        # costs 60-120 ns on the H200's host): only a complex tensor can carry
        # the conjugate bit, and publish_tensor takes the size from the shape.
        if t and stream is None and type(array) is t.Tensor and array.is_cuda and \
                array.get_device() == self.device and array.layout is t.strided and \
                array.is_contiguous() and not array.is_neg():
            dl = t.dl.get(array.dtype)
            if dl is not None and (dl[0] != _DL_COMPLEX or not array.is_conj()):
                try:
                    return self._pool.publish_tensor(array, array.data_ptr(), dl[0], dl[1],
                                                     array.shape, t.raw_stream(self.device))
                except PoolFull:
                    self._note_deaths()
                    raise
        return self._publish([array], stream)[0]

    def publish_many(self, arrays, stream=None):
        """Publish up to 64 arrays packed in one slice -> list of Descriptors.

        Raises as publish does: PoolFull or TooLarge (NoRoom) when they do not fit."""
        return self._publish(list(arrays), stream)

    def cancel(self, desc):
        """Take back a descriptor never handed to a consumer (idempotent), or a
        Reservation never committed (once nothing writes into it any more).
        Handed out after all: consumers refuse it from now on, and one whose
        copy was already queued keeps the slice until that copy is done
        (POSIX pools; vmmt_cancel in vmmt.h)."""
        if isinstance(desc, Reservation):
            desc._finish("cancel")
            self._pool.cancel(desc._token)
            return
        self._pool.cancel(_desc_bytes(desc))

    def reserve(self, nbytes):
        """A free slice of `nbytes` to write in place (vmmt_reserve): no copy.

        Returns a Reservation: a DLPack exporter of flat uint8 (CUDA for a
        device pool, CPU for a host pool), and for host memory
        ``memoryview()``. Fill it, then ``commit`` it (or ``cancel`` it).
        Raises PoolFull (no room now) or TooLarge (never fits), both NoRoom.
        """
        nbytes = _args.integer("nbytes", nbytes, 1, _args.U64, " bytes")
        try:
            ptr, n, location, token = self._pool.reserve(nbytes)
        except PoolFull:
            self._note_deaths()
            raise
        return Reservation(self, ptr, n, location, token)

    def commit(self, reservation, dtype=None, shape=None, *, like=None, stream=None):
        """Publish a filled reservation (vmmt_commit) -> Descriptor.

        dtype (a name such as "float32", a NumPy/PyTorch dtype or a NumPy
        scalar type) and shape describe its first bytes; or ``like=array``
        takes both from an array; neither: all reserved bytes, untyped.
        stream: what wrote the slice (default: the current stream for a
        device pool; for a host pool the CPU wrote it, and a stream given is
        synchronized first).
        """
        if not isinstance(reservation, Reservation) or reservation._pool is not self:
            raise TypeError("commit takes a Reservation of this pool")
        if like is not None:
            if dtype is not None or shape is not None:
                raise ValueError("give like= or dtype/shape, not both")
            dtype, shape = like.dtype, tuple(like.shape)
        if dtype is None:
            if shape is not None:
                raise ValueError("shape without dtype: give both, or neither for untyped bytes")
            code, bits, nbytes, shape = 0, 0, reservation.nbytes, ()
        else:
            code, bits = _dl_dtype(dtype)
            shape = (reservation.nbytes * 8 // bits,) if shape is None else tuple(shape)
            count = 1
            for dim in shape:
                count *= dim
            nbytes = (count * bits + 7) // 8
        if stream is not None:
            s = _stream_value(stream)
        elif self.memory_location == "host":
            s = None  # the CPU wrote it
        else:
            s = _current_stream(self.device)
        reservation._finish("commit")
        try:
            return self._pool.commit(reservation.ptr, reservation.nbytes, reservation._location,
                                     reservation._token, nbytes, code, bits, 1, shape, s)
        except BaseException:
            reservation._done = False  # not published: still the caller's to commit or cancel
            raise

    def reclaim(self):
        """Recycle every acknowledged slice now; returns how many were freed."""
        return self._pool.reclaim()

    def drain(self, timeout_ms=5000):
        """Wait until nothing is in flight; raises Timeout otherwise."""
        self._pool.drain(timeout_ms)

    def stats(self):
        """Every field of vmmt_pool_stats, as a dict."""
        return self._pool.stats()

    @property
    def data_bytes(self):
        """Bytes usable for slices: the largest buffer (or packed group) that can fit."""
        return self._data_bytes

    def close(self, timeout_ms=None):
        """Wait for copies, give sources back, shut the pool down (idempotent).

        timeout_ms (default: the pool's) bounds the whole close. Raises
        Timeout when copies are still queued then; the pool takes no new
        calls, and close() again finishes the shutdown. While a view of a
        Reservation is alive, raises BufferError and leaves the pool open
        (see Reservation)."""
        for r in list(self._viewed):
            r._end_views("close")
        if timeout_ms is None:
            self._pool.close()
        else:
            self._pool.close(timeout_ms)

    @property
    def closed(self):
        return self._pool.closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


_DL_BY_NAME = {name: dl for dl, name in _DTYPE_NAMES.items()}


def _dl_dtype(dtype):
    """DLPack (code, bits) of a dtype name, a NumPy dtype or a PyTorch dtype."""
    if isinstance(dtype, type) and dtype.__module__ == "numpy":
        name = dtype.__name__.rstrip("_")  # a scalar type (numpy.float32, numpy.bool_)
    else:
        name = str(dtype)
        name = name[len("torch."):] if name.startswith("torch.") else name
    dl = _DL_BY_NAME.get(name)
    if dl is None:
        raise ValueError("dtype %r is not one vmmt carries; use one of %s"
                         % (dtype, ", ".join(sorted(_DL_BY_NAME))))
    return dl


class Reservation:
    """A slice reserved for writing in place (Pool.reserve); commit or cancel it once.

    ``ptr`` and ``nbytes`` name the slice; ``location`` is "device" or
    "host". ``from_dlpack(reservation)`` (torch, cupy, numpy) gives a flat
    uint8 view of it; ``memoryview()`` a writable view of a host slice.

    Views never outlive the slice: commit, cancel and the pool's close first
    release the memoryviews memoryview() returned (using one then raises
    ValueError); then, while any view is still alive (an array made by
    from_dlpack, a slice or array made from a memoryview), they raise
    BufferError and do nothing else. No view is made after them.
    """

    __slots__ = ("_pool", "ptr", "nbytes", "_location", "_token", "_done", "_anchor",
                 "_memoryviews", "__weakref__")

    def __init__(self, pool, ptr, nbytes, location, token):
        self._pool, self.ptr, self.nbytes = pool, ptr, nbytes
        self._location, self._token, self._done = location, token, False
        self._anchor = None  # weak reference to what every live view holds (_views_anchor)
        self._memoryviews = []  # weak references to what memoryview() returned

    @property
    def location(self):
        return "host" if self._location == 1 else "device"

    def _host_view(self):
        return self._location == 1 or _on_emu()

    def _views_anchor(self):
        """The object every view of the slice holds, made with the first one.

        A ctypes array over the slice: memoryview() exports it (a memoryview,
        and each slice or array made from one, keeps it alive), and each
        DLPack export's Buffer keeps it as its keeper. So the slice has a
        live view exactly while it is alive, which the weak reference tells,
        with no count to keep; and it keeps this Reservation (and so the
        pool) alive, so close() finds the views of a dropped Reservation too.
        """
        anchor = self._anchor() if self._anchor is not None else None
        if anchor is None:
            anchor = (ctypes.c_ubyte * self.nbytes).from_address(self.ptr)
            anchor.reservation = self
            self._anchor = weakref.ref(anchor)
            self._pool._viewed.add(self)
        return anchor

    def _end_views(self, what):
        """Release the memoryviews handed out; BufferError, naming `what`,
        while any view of the slice is still alive."""
        left = []
        for ref in self._memoryviews:
            view = ref()
            if view is not None:
                try:
                    view.release()
                except BufferError:  # exported further: still alive, so refused below
                    left.append(ref)
        self._memoryviews = left
        if self._anchor is None:
            return
        if self._anchor() is not None:
            gc.collect()  # views left in reference cycles
        if self._anchor() is not None:
            harm = {"commit": "would change what consumers read",
                    "cancel": "would land in a slice that a later publish takes",
                    "close": "would fault: the slice is unmapped"}[what]
            raise BufferError(
                "%s: a view of the %d-byte reservation at 0x%x is still alive (an array made by "
                "from_dlpack, or a memoryview() slice or array made from one); writing or "
                "reading it after %s %s. Delete the views (del array) and try again; nothing was "
                "done but releasing what memoryview() returned" % (what, self.nbytes, self.ptr,
                                                                   what, harm))
        self._anchor = None
        self._pool._viewed.discard(self)

    def _finish(self, what):
        if self._done:
            raise ValueError("this reservation was already committed or cancelled")
        self._done = True  # first: no view is made from now on
        try:
            self._end_views(what)
        except BufferError:
            self._done = False
            raise

    def __del__(self):
        # Dropped unfinished, the slice stays reserved until the pool closes:
        # queued work may still write through a view of it, so it is never
        # given back behind the caller's back. Say so, as an unclosed file does.
        try:
            if not self._done and not self._pool.closed:
                import warnings
                warnings.warn("a Reservation of %d bytes was dropped without commit or cancel; "
                              "its slice stays reserved until the pool closes" % self.nbytes,
                              ResourceWarning, stacklevel=2)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    def _check_live(self):
        """Views are valid until commit, cancel or close: none is made after."""
        if self._done:
            raise ValueError("this reservation was already committed or cancelled; its slice "
                             "is the consumers' now")
        if self._pool.closed:
            raise ValueError("the pool is closed: its reservations' slices are gone")

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """A flat uint8 view of the slice (the array API's arguments, keywords
        only; on the CPU, a host slice, stream must be None)."""
        self._check_live()
        if stream is not None and self._host_view():
            raise ValueError("stream=%r: this slice is exported as a CPU array, which takes no "
                             "stream (the array API: only None on the CPU); leave stream out"
                             % (stream,))
        view = _vmmt._slice_view(self._views_anchor(), self._pool.device, self.ptr, self.nbytes,
                                 self._host_view())
        return view.__dlpack__(stream=stream, max_version=max_version, dl_device=dl_device,
                               copy=copy)

    def __dlpack_device__(self):
        return (1, 0) if self._host_view() else (2, self._pool.device)  # kDLCPU, kDLCUDA

    def memoryview(self):
        """A writable memoryview of a host slice (host pools; the emulator's memory too)."""
        if self._location != 1 and not _on_emu():
            raise ValueError("a device pool's slice is device memory: use from_dlpack with a "
                             "CUDA library, or write it with a kernel")
        self._check_live()
        view = memoryview(self._views_anchor()).cast("B")  # ctypes says "<B"; "B" indexes
        self._memoryviews.append(weakref.ref(view))
        return view

    def __repr__(self):
        return "Reservation(ptr=0x%x, nbytes=%d, location=%s)" % (self.ptr, self.nbytes,
                                                                   self.location)


# ---------------------------------------------------------------- consumer

def _default_device():
    t = _torch()
    if t is not None and t.available() and t.torch.cuda.is_initialized():
        return t.torch.cuda.current_device()
    cupy = sys.modules.get("cupy")
    if cupy is not None and not _on_emu():
        return cupy.cuda.Device().id
    return 0


class Consumer:
    """A per-process cache of imported pools; thread-safe.

    cache_bytes: consume() without ``out`` keeps up to this many bytes of
    freed buffers (default 64 MiB; 0: none) and reuses one of the same size
    for a later consume on the same device and stream, so a steady stream of
    consumes calls neither cuMemAlloc nor the synchronizing cuMemFree. Work on
    *other* streams that reads a consumed array must be ordered before the
    array is dropped (as for PyTorch's own caching allocator). close() frees
    the cache.
    """

    def __init__(self, *, timeout_ms=5000, max_pools=16, cache_bytes=64 << 20):
        self._c = _vmmt.Consumer(timeout_ms, max_pools, cache_bytes)

    def cache_info(self):
        """(hits, misses, blocks held, bytes held) of the buffer cache."""
        return self._c.cache_info()

    def consume(self, desc, device=None, out=None, stream=None, *, ranks):
        """Copy the buffer a descriptor names and acknowledge it for `ranks`.

        ranks (required): this process's rank (an int), ranks (a range, or a
        list or set of distinct ranks: all of them are consumed and
        acknowledged, or, where any of them is done already, none), or
        vmmt.ALL_RANKS for every rank of the pool. Without ``out``:
        returns a Buffer in new device memory, for ``torch.from_dlpack`` (it
        owns the memory). With ``out`` (any DLPack array of at least
        desc.nbytes, C-contiguous): fills it and returns it. The copy runs on
        ``stream`` (default: the current stream of PyTorch or CuPy on
        `device`, else the default stream).

        Raises Stale (consumed, acknowledged, cancelled or recycled already),
        ProducerGone (the producer died before the bytes were there), Closed
        (this consumer is closed), Timeout; ValueError/TypeError for a bad
        argument, before anything is consumed.
        """
        rk = _args.ranks(ranks)
        raw = desc if isinstance(desc, bytes) else _desc_bytes(desc)
        if stream is not None:
            device = _stream_device(stream, device)
        if device is not None:
            device = _args.device(device)
        if out is None:
            if device is None:
                device = _default_device()
            s = _resolve_stream(stream, device)
            return self._c.consume(raw, device, s, *rk)
        return self._consume_into(raw, device, out, stream, rk)

    def _consume_into(self, raw, device, out, stream, rk):
        t = _TORCH or _torch()
        if t and stream is None and type(out) is t.Tensor and out.is_cuda:
            dev = out.get_device()
            if device not in (None, dev):
                raise _other_device(dev, device)
            if out.is_contiguous():
                # Bytes written under a lazy conjugate or negative view read
                # back conjugated or negated (its DLPack export is refused too).
                if out.is_neg() or out.is_conj():
                    raise ValueError("out is a conjugate or negative view (is_conj()/is_neg()): "
                                     "the bytes would read back changed; pass a tensor without "
                                     "the bit (resolve_conj(), resolve_neg())")
                # The current stream is the tensor's own: nothing to order, no DLPack needed.
                self._c.consume_into(raw, dev, out.data_ptr(), out.numel() * out.element_size(),
                                     t.raw_stream(dev), *rk)
                return out
        if not hasattr(out, "__dlpack__") or not hasattr(out, "__dlpack_device__"):
            raise TypeError("out=%s: give an array with __dlpack__ and __dlpack_device__ (a "
                            "PyTorch, CuPy or NumPy array) of at least desc.nbytes, or leave "
                            "out out for a new Buffer" % type(out).__name__)
        target = out
        if _numpy_bool(out):
            target = out.view(sys.modules["numpy"].uint8)
        elif _torch_bool(out):  # its DLPack export, as for publish (_capsule)
            target = out.view(sys.modules["torch"].uint8)
        kind, dev_id = target.__dlpack_device__()
        if kind in _DL_CUDA_TYPES and device not in (None, dev_id):
            # The copy would run on `device`'s stream, ordered before nothing
            # that the array's own device runs.
            raise _other_device(dev_id, device)
        if device is None:
            device = dev_id if kind in _DL_CUDA_TYPES else _default_device()
        s = _resolve_stream(stream, device, out)
        cap = _out_capsule(target, kind, s)
        ptr, nbytes, _, _, readonly = _vmmt.capsule_info(cap)
        if readonly:
            raise ValueError("out is read-only")
        if kind in _DL_CUDA_TYPES:
            self._c.consume_into(raw, device, ptr, nbytes, s, *rk)
            return out
        # Host memory: through device memory, then one copy to the host. The
        # size is checked first: the consume acknowledges, so a refusal after
        # it would lose the buffer for good.
        need = _vmmt.desc_inspect(raw)[6]
        if need > nbytes:
            raise ValueError("out holds %d bytes; the buffer has %d" % (nbytes, need))
        buf = self._c.consume(raw, device, s, *rk)
        _vmmt.mem_copy(device, ptr, buf.ptr, buf.nbytes, s)
        _vmmt.stream_synchronize(device, s)
        del cap
        return out

    def ack(self, desc, device=None, stream=None, *, ranks):
        """Acknowledge without copying (a dropped request), for `ranks` (required, as
        for consume)."""
        rk = _args.ranks(ranks)
        device = _stream_device(stream, device)
        device = _default_device() if device is None else _args.device(device)
        self._c.ack(_desc_bytes(desc), device, _resolve_stream(stream, device), *rk)

    def check(self, desc):
        """After synchronizing a consume's stream, before using the bytes: raises
        ProducerGone when the producer died before its copy into the slice was
        done (what landed is not the buffer); returns None when the bytes are
        the producer's. Call it wherever producers may die."""
        self._c.check(_desc_bytes(desc))

    def flush(self):
        """Write now the acknowledgements of consumes whose copies have
        completed (this consumer's thread does within tens of microseconds
        otherwise): after synchronizing the stream, for a producer that
        should find the slices acknowledged at once. Never waits for a copy."""
        self._c.flush()

    def __repr__(self):
        if self.closed:
            return "Consumer(closed)"
        hits, misses, blocks, held = self.cache_info()
        return ("Consumer(pools=%d, cache=%d blocks/%d bytes, cache_hits=%d, cache_misses=%d)"
                % (self.pool_count(), blocks, held, hits, misses))

    def evict(self, pool_id, device=None):
        """Unmap a pool (by its 16-byte id, or any of its descriptors, as a
        Descriptor or its 512 bytes)."""
        if isinstance(pool_id, (bytes, bytearray, memoryview)) and \
                len(pool_id) == _vmmt.DESC_SIZE:
            pool_id = Descriptor(pool_id)  # a descriptor as it came off the wire
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
_vmmt._set_descriptor_type(Descriptor)
