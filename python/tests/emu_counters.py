"""Test-only hook: the emulated driver's live counters (allocations,
reservations, mappings, streams, events, cuMemAlloc blocks) for leak checks.

Not vmmt's API. Once the emulator is its own library (libvmmt_emu.so, beside
the extension), its counters are read from it with ctypes; while it is
compiled into the extension, the extension's private _emu_live() gives them.
"""
import ctypes
import os

import vmmt
from vmmt import _vmmt

_NAMES = ("allocations", "reservations", "mappings", "streams", "events", "blocks")


def _library():
    path = os.environ.get("VMMT_EMU_LIBRARY") or os.path.join(
        os.path.dirname(vmmt.__file__), "libvmmt_emu.so")
    if not os.path.exists(path):
        return None
    lib = ctypes.CDLL(path)
    for name in _NAMES:
        getattr(lib, "vmmt__emu_live_" + name).restype = ctypes.c_int
    return lib


_LIB = None if hasattr(_vmmt, "_emu_live") else _library()


def live():
    if hasattr(_vmmt, "_emu_live"):
        return _vmmt._emu_live()
    if _LIB is None:
        raise RuntimeError("no emulated driver counters: neither _vmmt._emu_live nor "
                           "libvmmt_emu.so beside the extension")
    return {n: getattr(_LIB, "vmmt__emu_live_" + n)() for n in _NAMES}


def calls(entry):
    """How often this process called a driver entry point (vmmt__emu_calls)."""
    if _LIB is None:
        raise RuntimeError("no libvmmt_emu.so beside the extension")
    _LIB.vmmt__emu_calls.restype = ctypes.c_long
    _LIB.vmmt__emu_calls.argtypes = [ctypes.c_char_p]
    return _LIB.vmmt__emu_calls(entry.encode())


def open_fds():
    return len(os.listdir("/proc/self/fd"))
