"""python/vmmt/group_torch.py on the emulated driver, without torch: BytesGroup
over an all-gather between forked processes (socket pairs), checking that
each rank reads the others' buffers and that a failing all-gather becomes an
error on every rank. Run by CTest with VMMT_LIBRARY set to build/libvmmt.so."""

import ctypes
import os
import socket
import struct
import sys

import importlib.util

os.environ.setdefault("VMMT_DRIVER", "emu")
os.environ["VMMT_EMU_GRANULARITY"] = "65536"
# The file alone, not the package: vmmt/__init__.py loads the C extension, which
# this test does not need (and which may not be built).
_path = os.path.join(os.path.dirname(__file__), "..", "..", "python", "vmmt", "group_torch.py")
_spec = importlib.util.spec_from_file_location("vmmt_group_torch", _path)
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
BytesGroup, GroupError, load_library = _mod.BytesGroup, _mod.GroupError, _mod.load_library


def recv_exact(s, n):
    buf = b""
    while len(buf) < n:
        part = s.recv(n - len(buf))
        if not part:
            raise EOFError("peer closed")
        buf += part
    return buf


def make_gather(rank, socks, world, fail_at=None):
    calls = [0]

    def gather(data):
        calls[0] += 1
        if fail_at is not None and calls[0] == fail_at:
            raise RuntimeError("injected all-gather failure")
        blocks = [None] * world
        blocks[rank] = data
        for r, s in socks.items():
            s.sendall(struct.pack("<Q", len(data)) + data)
        for r, s in socks.items():
            (n,) = struct.unpack("<Q", recv_exact(s, 8))
            blocks[r] = recv_exact(s, n)
        return blocks
    return gather


def rank_main(rank, world, socks, lib):
    g = BytesGroup(rank, world, make_gather(rank, socks, world), timeout_ms=3000, lib=lib)
    ptr = g.alloc(3 * 65536, chunks=3)
    drv_fill = bytes([rank + 1]) * (3 * 65536)
    # Unified addressing on the emulator: the device pointer is a host address of this process.
    ctypes.memmove(ptr, drv_fill, len(drv_fill))
    ptrs = g.register([(ptr + 100, 3 * 65536 - 200)])
    for r in range(world):
        got = ctypes.string_at(ptrs[0][r], 3 * 65536 - 200)
        if got != bytes([r + 1]) * len(got):
            print(f"rank {rank}: rank {r}'s buffer is wrong")
            return 1
    kind = g.handle_type
    g.free(ptr)
    g.close()
    print(f"rank {rank}: {kind}: read every peer's 3-allocation buffer")
    return 0


def main():
    world = 2
    lib = load_library()
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        a.close()
        os._exit(rank_main(1, world, {0: b}, lib))
    b.close()
    rc = rank_main(0, world, {1: a}, lib)
    _, status = os.waitpid(pid, 0)
    rc = rc or os.waitstatus_to_exitcode(status)
    # A failing all-gather (Python exception) is a vmmt error, not a crash.
    try:
        BytesGroup(0, 2, lambda data: (_ for _ in ()).throw(RuntimeError("boom")), lib=lib)
        print("a failing all-gather did not fail the group")
        rc = 1
    except GroupError as e:
        assert "boom" in str(e), str(e)
        print("failing all-gather:", e)
    return rc


if __name__ == "__main__":
    sys.exit(main())
