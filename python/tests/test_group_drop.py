"""vmmt.group_torch: a group dropped without close() gives back everything it
holds (issue 16, item 13): its allocations, the address ranges and mappings
of its own and its peer's buffers, the peer's imported handles and their fds.

Two ranks in two processes, their all-gather over a socket pair; each counts
the emulated driver's live objects and its own fds before the group and
after dropping it. The group is the extension's vmmt.Group (python/src/group.c),
whose finalizer destroys it; before issue 17 it was libvmmt's C API through a
ctypes mirror, with a weakref finalizer."""
import os
import socket
import subprocess
import sys

from child import EMU_LIBRARY, source

_RANK = """
import gc, os, socket, struct, sys, ctypes
import emu_counters
from vmmt import group_torch

rank, sock = int(sys.argv[1]), socket.socket(fileno=int(sys.argv[2]))
incoming = sock.makefile("rb")  # read(n): n bytes, fewer only once the other rank is gone


def gather(data):
    sock.sendall(struct.pack("<Q", len(data)) + data)
    (n,) = struct.unpack("<Q", incoming.read(8))
    theirs = incoming.read(n)
    if len(theirs) != n:
        raise EOFError("the other rank is gone")
    return [data, theirs] if rank == 0 else [theirs, data]


before, fds = emu_counters.live(), emu_counters.open_fds()
g = group_torch.BytesGroup(rank, 2, gather, timeout_ms=20000)
size = 2 * 65536
ptr = g.alloc(size, chunks=2)
ctypes.memset(ptr, rank + 1, size)
ptrs = g.register([(ptr, size)])
assert ctypes.string_at(ptrs[0][1 - rank], size) == bytes([2 - rank]) * size
held = emu_counters.live()
assert held["mappings"] > before["mappings"], (before, held)
gather(b"done")  # neither rank drops its group while the other still reads it
del g
gc.collect()
after = emu_counters.live()
assert after == before, "dropped without close(): %r -> %r" % (before, after)
assert emu_counters.open_fds() == fds, "fds leaked"
print("rank %d: dropped; nothing left of %r" % (rank, held))
"""


def test_group_dropped_without_close_leaks_nothing():
    """Failed before the fix (issue 16): a dropped group kept every
    allocation, mapping and imported handle (no finalizer called
    vmmt_group_destroy)."""
    env = dict(os.environ, VMMT_EMU_LIBRARY=EMU_LIBRARY, VMMT_EMU_GRANULARITY="65536")
    ends = socket.socketpair()
    ranks = []
    try:
        for rank, end in enumerate(ends):
            ranks.append(subprocess.Popen(
                [sys.executable, "-c", source(_RANK), str(rank), str(end.fileno())],
                pass_fds=(end.fileno(),), env=env, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True))
    finally:
        for end in ends:
            end.close()
    outs = []
    for p in ranks:
        try:
            outs.append((p.communicate(timeout=60)[0], p.returncode))
        except subprocess.TimeoutExpired:
            for q in ranks:
                q.kill()
            raise AssertionError("a rank was still running after 60 s") from None
    for rank, (out, rc) in enumerate(outs):
        assert rc == 0, "rank %d exited with %d:\n%s" % (rank, rc, out)
