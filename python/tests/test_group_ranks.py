"""vmmt.Group across processes on the emulated driver: two ranks, each in
its own process, read each other's buffer (one crossing three allocations),
once over a Python all-gather (socket pairs, as torch.distributed would
carry it) and once over the library's local adapter (job=). A rank whose
all-gather fails makes every rank fail, with an error and no hang.

Replaces tests/group/test_group_torch.py, which checked the ctypes mirror of
the C structs that the extension type (python/src/group.c) replaced."""
import os
import socket
import subprocess
import sys

from child import EMU_LIBRARY, source

_RANK = """
import ctypes, socket, struct, sys
import vmmt
from vmmt import group_torch

rank, mode, fd = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
sock = socket.socket(fileno=fd) if fd >= 0 else None
incoming = sock.makefile("rb") if sock else None
GRAN = 65536


calls = [0]


def gather(data):
    calls[0] += 1
    if mode == "fail" and rank == 1 and calls[0] > 1:  # the first is creation's hello
        raise RuntimeError("injected all-gather failure on rank 1")
    sock.sendall(struct.pack("<Q", len(data)) + data)
    head = incoming.read(8)
    if len(head) != 8:
        raise EOFError("the other rank is gone")
    (n,) = struct.unpack("<Q", head)
    theirs = incoming.read(n)
    return [data, theirs] if rank == 0 else [theirs, data]


if mode == "local":
    g = vmmt.Group(rank, 2, job="pytest-group-%s" % sys.argv[4], timeout_ms=20000)
else:
    g = group_torch.BytesGroup(rank, 2, gather, timeout_ms=20000)
ptr = g.alloc(3 * GRAN, chunks=3)
ctypes.memset(ptr, rank + 1, 3 * GRAN)
try:
    ptrs = g.register([(ptr + 100, 3 * GRAN - 200)])
except vmmt.Error as e:
    print("rank %d: register failed: %s" % (rank, e))
    sys.exit(3)
for r in range(2):
    got = ctypes.string_at(ptrs[0][r], 3 * GRAN - 200)
    assert got == bytes([r + 1]) * len(got), "rank %d's buffer is wrong" % r
if sock:
    gather(b"done")  # neither rank unmaps while the other still reads
else:
    g.register([])  # the local adapter's own barrier of sorts: one more collective
print("rank %d: %s: read the peer's 3-allocation buffer" % (rank, g.handle_type))
g.close()
"""


def run_ranks(mode, timeout=60):
    env = dict(os.environ, VMMT_EMU_LIBRARY=EMU_LIBRARY, VMMT_EMU_GRANULARITY="65536")
    ends = socket.socketpair() if mode != "local" else (None, None)
    procs = []
    try:
        for rank, end in enumerate(ends):
            fd = end.fileno() if end else -1
            procs.append(subprocess.Popen(
                [sys.executable, "-c", source(_RANK), str(rank), mode, str(fd), str(os.getpid())],
                pass_fds=(fd,) if end else (), env=env, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True))
    finally:
        for end in ends:
            if end:
                end.close()
    outs = []
    for p in procs:
        try:
            outs.append((p.communicate(timeout=timeout)[0], p.returncode))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
                q.wait()
            raise AssertionError("a rank was still running after %d s" % timeout) from None
    return outs


def test_two_ranks_over_a_python_all_gather():
    for rank, (out, rc) in enumerate(run_ranks("python")):
        assert rc == 0, "rank %d exited with %d:\n%s" % (rank, rc, out)
        assert "posix_fd: read the peer's 3-allocation buffer" in out


def test_two_ranks_over_the_local_adapter():
    for rank, (out, rc) in enumerate(run_ranks("local")):
        assert rc == 0, "rank %d exited with %d:\n%s" % (rank, rc, out)
        assert "read the peer's 3-allocation buffer" in out


def test_one_rank_failing_fails_both():
    """Rank 1's all-gather raises during registration: it fails with its own
    exception named, and rank 0, whose peer went away, fails too."""
    outs = run_ranks("fail")
    (out0, rc0), (out1, rc1) = outs
    assert rc1 == 3 and "injected all-gather failure on rank 1" in out1, out1
    assert rc0 == 3 and "register failed" in out0, out0
