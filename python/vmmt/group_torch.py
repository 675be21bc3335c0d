"""The vmmt group exchange over torch.distributed (docs/group.md).

Every rank of a torch.distributed process group maps every other rank's
CUDA VMM allocations (PyTorch's expandable segments allocate with VMM:
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) and gets, for each
registered tensor, a device pointer per rank:

    from vmmt.group_torch import TorchGroup
    g = TorchGroup()                       # the default process group
    ptrs = g.register([t1, t2])            # ptrs[i][r]: rank r's t_i, here
    ...
    g.close()                              # or drop g: it is destroyed then

NOTE: this module talks to libvmmt's C group API (vmmt_group_*) through
ctypes, so it works without the C extension. Once the binding (vmmt._vmmt)
has a group API of its own, this adapter should hand it the same
all-gather instead; until then the library is found through VMMT_LIBRARY,
or as libvmmt.so on the loader's path.

The all-gather runs torch.distributed.all_gather on uint8 tensors: on the
CPU for gloo, on the current CUDA device for nccl. Its bound is the process
group's timeout; the descriptor exchange's bound is timeout_ms.
"""

import ctypes
import ctypes.util
import functools
import os
import weakref

_ALLGATHER = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
    ctypes.c_void_p, ctypes.c_size_t)
_BARRIER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_CLOSE = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

HANDLE_AUTO, HANDLE_POSIX_FD, HANDLE_FABRIC = -1, 1, 8


class _Collective(ctypes.Structure):
    _fields_ = [("allgather", _ALLGATHER), ("barrier", _BARRIER), ("close", _CLOSE),
                ("ctx", ctypes.c_void_p)]


class _Config(ctypes.Structure):
    _fields_ = [("rank", ctypes.c_int), ("world_size", ctypes.c_int), ("device", ctypes.c_int),
                ("collective", _Collective), ("handle_type", ctypes.c_int),
                ("timeout_ms", ctypes.c_int), ("socket_dir", ctypes.c_char_p),
                ("max_allocations", ctypes.c_uint32)]


class _Buffer(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_uint64), ("nbytes", ctypes.c_uint64)]


class GroupError(RuntimeError):
    """A vmmt group call failed; the message is vmmt_last_error()."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


def load_library(path=None):
    """libvmmt.so: path, $VMMT_LIBRARY, or the loader's search."""
    path = path or os.environ.get("VMMT_LIBRARY") or ctypes.util.find_library("vmmt") or "libvmmt.so"
    lib = ctypes.CDLL(path)
    lib.vmmt_last_error.restype = ctypes.c_char_p
    lib.vmmt_group_config_init.argtypes = [ctypes.POINTER(_Config)]
    lib.vmmt_group_create.argtypes = [ctypes.POINTER(_Config), ctypes.POINTER(ctypes.c_void_p)]
    lib.vmmt_group_register.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Buffer), ctypes.c_size_t,
                                        ctypes.POINTER(ctypes.c_uint64)]
    lib.vmmt_group_destroy.argtypes = [ctypes.c_void_p]
    lib.vmmt_group_handle_type.argtypes = [ctypes.c_void_p]
    lib.vmmt_group_alloc.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int,
                                     ctypes.POINTER(ctypes.c_uint64)]
    lib.vmmt_group_free.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
    return lib


def _write_err(err, cap, text):
    data = text.encode("utf-8", "replace")[: max(cap - 1, 0)] + b"\0"
    if cap > 0:
        ctypes.memmove(err, data, len(data))


def _allgather_callback(gather, world_size):
    def allgather(_ctx, send, recv, nbytes, err, cap):
        try:
            blocks = gather(ctypes.string_at(send, nbytes))
            if len(blocks) != world_size or any(len(b) != nbytes for b in blocks):
                raise ValueError("the all-gather returned blocks of other sizes or count")
            ctypes.memmove(recv, b"".join(blocks), nbytes * world_size)
            return 0
        except Exception as e:  # a Python error must become a failed collective, not a crash
            _write_err(err, cap, f"{type(e).__name__}: {e}")
            return -1
    return allgather


def _barrier_callback(gather):
    def barrier(_ctx, err, cap):
        try:
            gather(b"\1")
            return 0
        except Exception as e:
            _write_err(err, cap, f"{type(e).__name__}: {e}")
            return -1
    return barrier


def _destroy(lib, handle, pid):
    # A forked child's copy of the group is the parent's to destroy.
    if os.getpid() == pid:
        lib.vmmt_group_destroy(handle)


class BytesGroup:
    """A group over any all-gather of bytes: all_gather(data) -> list of every rank's data."""

    def __init__(self, rank, world_size, all_gather, device=0, timeout_ms=120000,
                 handle_type=HANDLE_AUTO, lib=None):
        self._lib = lib or load_library()
        self._gather = all_gather
        self.rank, self.world_size, self.device = rank, world_size, device
        cfg = _Config()
        self._lib.vmmt_group_config_init(ctypes.byref(cfg))
        cfg.rank, cfg.world_size, cfg.device = rank, world_size, device
        cfg.timeout_ms, cfg.handle_type = timeout_ms, handle_type
        # The callbacks live as long as this object: the C side keeps pointers to them.
        # They hold the all-gather, not this object, so that dropping it frees it at once.
        self._cb_allgather = _ALLGATHER(_allgather_callback(all_gather, world_size))
        self._cb_barrier = _BARRIER(_barrier_callback(all_gather))
        cfg.collective.allgather = self._cb_allgather
        cfg.collective.barrier = self._cb_barrier
        self._handle = ctypes.c_void_p()
        self._check(self._lib.vmmt_group_create(ctypes.byref(cfg), ctypes.byref(self._handle)))
        # Dropped without close(), the group still gives back its allocations,
        # mappings and imported handles. The finalizer may run after the
        # callbacks are gone (a collected cycle): vmmt_group_destroy calls none.
        self._destroy = weakref.finalize(self, _destroy, self._lib, self._handle.value, os.getpid())

    def _check(self, status):
        if status != 0:
            raise GroupError(status, self._lib.vmmt_last_error().decode("utf-8", "replace"))

    @property
    def handle_type(self):
        return {HANDLE_FABRIC: "fabric", HANDLE_POSIX_FD: "posix_fd"}.get(
            self._lib.vmmt_group_handle_type(self._handle), "none")

    def register(self, buffers):
        """buffers: tensors, or (device pointer, bytes) pairs. Returns ptrs[i][r]."""
        items = []
        for b in buffers:
            if hasattr(b, "data_ptr"):
                items.append((b.data_ptr(), b.numel() * b.element_size()))
            else:
                items.append((int(b[0]), int(b[1])))
        arr = (_Buffer * max(len(items), 1))(*[_Buffer(p, n) for p, n in items])
        out = (ctypes.c_uint64 * max(len(items) * self.world_size, 1))()
        self._check(self._lib.vmmt_group_register(self._handle, arr, len(items), out))
        w = self.world_size
        return [[out[i * w + r] for r in range(w)] for i in range(len(items))]

    def alloc(self, nbytes, chunks=1):
        """A buffer of `chunks` VMM allocations mapped side by side (tests, tools)."""
        p = ctypes.c_uint64()
        self._check(self._lib.vmmt_group_alloc(self._handle, nbytes, chunks, ctypes.byref(p)))
        return p.value

    def free(self, ptr):
        self._check(self._lib.vmmt_group_free(self._handle, ptr))

    def close(self):
        if self._handle:
            self._handle = ctypes.c_void_p()
            self._destroy()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class TorchGroup(BytesGroup):
    """A group over a torch.distributed process group (default: the world)."""

    def __init__(self, group=None, device=None, timeout_ms=120000, handle_type=HANDLE_AUTO,
                 lib=None):
        import torch
        import torch.distributed as dist

        self._torch, self._dist, self._pg = torch, dist, group
        backend = dist.get_backend(group)
        if device is None:
            device = torch.cuda.current_device()
        self._tensor_device = torch.device("cuda", device) if backend == "nccl" else torch.device("cpu")
        # Not a bound method: the group's callbacks would hold the group (see BytesGroup).
        gather = functools.partial(_torch_all_gather, torch, dist, group, self._tensor_device)
        super().__init__(dist.get_rank(group), dist.get_world_size(group), gather,
                         device=device, timeout_ms=timeout_ms, handle_type=handle_type, lib=lib)


def _torch_all_gather(torch, dist, group, device, data):
    inp = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    outs = [torch.empty_like(inp) for _ in range(dist.get_world_size(group))]
    dist.all_gather(outs, inp, group=group)
    return [o.cpu().numpy().tobytes() for o in outs]
