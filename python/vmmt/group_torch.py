"""The vmmt group exchange over torch.distributed (docs/group.md).

Every rank of a torch.distributed process group maps every other rank's
CUDA VMM allocations (PyTorch's expandable segments allocate with VMM:
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) and gets, for each
registered tensor, a device pointer per rank:

    from vmmt.group_torch import TorchGroup
    g = TorchGroup()                       # the default process group
    ptrs = g.register([t1, t2])            # ptrs[i][r]: rank r's t_i, here
    ...
    g.close()                              # or drop g, or leave `with`

The group itself is the C extension's ``vmmt.Group`` (libvmmt's vmmt_group_*
compiled into the package): this module gives it torch.distributed's
all-gather, and accepts tensors where the group takes (pointer, bytes)
pairs. Errors are ``vmmt.Error`` (``ValueError``/``TypeError`` for bad
arguments), with the all-gather's own exception as ``__cause__``.

The all-gather runs torch.distributed.all_gather on uint8 tensors: on the
CPU for gloo, on the current CUDA device for nccl. Its bound is the process
group's timeout; the descriptor exchange's bound is timeout_ms.
"""

import functools

from . import _vmmt

Error = _vmmt.Error
HANDLE_AUTO, HANDLE_POSIX_FD, HANDLE_FABRIC = "auto", "posix_fd", "fabric"


def _pair(b):
    """A tensor's (pointer, bytes), or a (pointer, bytes) pair as given."""
    if hasattr(b, "data_ptr"):
        return (b.data_ptr(), b.numel() * b.element_size())
    return b


class BytesGroup:
    """A group over any all-gather of bytes: all_gather(data) -> list of every rank's data.

    Closed by close(), by leaving a ``with`` block, or when dropped (the C
    type's finalizer, also when the group is in a reference cycle through its
    all-gather, which the garbage collector then breaks): its mappings,
    imported handles and allocations are given back on every path. Closing
    is local to a rank.
    """

    def __init__(self, rank, world_size, all_gather, device=0, timeout_ms=120000,
                 handle_type=HANDLE_AUTO):
        self._group = _vmmt.Group(rank, world_size, all_gather, device=device,
                                  timeout_ms=timeout_ms, handle_type=handle_type)

    rank = property(lambda self: self._group.rank)
    world_size = property(lambda self: self._group.world_size)
    device = property(lambda self: self._group.device)
    handle_type = property(lambda self: self._group.handle_type, doc="'fabric' or 'posix_fd'")
    closed = property(lambda self: self._group.closed)

    def register(self, buffers):
        """buffers: tensors, or (device pointer, bytes) pairs. Returns ptrs[i][r]. Collective."""
        return self._group.register([_pair(b) for b in buffers])

    def alloc(self, nbytes, chunks=1):
        """A buffer of `chunks` VMM allocations mapped side by side (tests, tools)."""
        return self._group.alloc(nbytes, chunks)

    def free(self, ptr):
        self._group.free(ptr)

    def close(self):
        self._group.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return repr(self._group).replace("vmmt.Group", type(self).__name__, 1)


class TorchGroup(BytesGroup):
    """A group over a torch.distributed process group (default: the world)."""

    def __init__(self, group=None, device=None, timeout_ms=120000, handle_type=HANDLE_AUTO):
        import torch
        import torch.distributed as dist

        backend = dist.get_backend(group)
        if device is None:
            device = torch.cuda.current_device()
        tensor_device = torch.device("cuda", device) if backend == "nccl" else torch.device("cpu")
        # A partial of a module function, not a bound method: the group holds its all-gather.
        gather = functools.partial(_torch_all_gather, torch, dist, group, tensor_device)
        super().__init__(dist.get_rank(group), dist.get_world_size(group), gather,
                         device=device, timeout_ms=timeout_ms, handle_type=handle_type)


def _torch_all_gather(torch, dist, group, device, data):
    inp = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    outs = [torch.empty_like(inp) for _ in range(dist.get_world_size(group))]
    dist.all_gather(outs, inp, group=group)
    return [o.cpu().numpy().tobytes() for o in outs]
