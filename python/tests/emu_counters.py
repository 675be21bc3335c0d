"""Test-only hooks into the emulated driver, libvmmt_emu.so beside the
extension (the one the library loads), by ctypes: its live counters
(allocations, reservations, mappings, streams, events, cuMemAlloc blocks) for
leak checks, its call counts, and a stream held back on demand.

Not vmmt's API.
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


_LIB = _library()


def live():
    if _LIB is None:
        raise RuntimeError("no emulated driver counters: no libvmmt_emu.so beside the extension "
                           "(or at $VMMT_EMU_LIBRARY)")
    return {n: getattr(_LIB, "vmmt__emu_live_" + n)() for n in _NAMES}


class StalledStream:
    """A stream of the emulated driver held back by a wait on a word until
    release(): work queued on it stays pending. `handle` is for stream=.
    (Anything that synchronizes the legacy default stream waits for it too.)"""

    def __init__(self, device):
        if _LIB is None:
            raise RuntimeError("no libvmmt_emu.so beside the extension")
        self.device, ctx, s = device, ctypes.c_void_p(), ctypes.c_void_p()
        check(_LIB.cuInit(0))
        check(_LIB.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device))
        check(_LIB.cuCtxPushCurrent(ctx))
        check(_LIB.cuStreamCreate(ctypes.byref(s), 0))
        self.handle = s.value
        self._word = _vmmt.mem_alloc(device, 4)
        ctypes.c_uint32.from_address(self._word).value = 0
        # Waits for the word to equal 1 (CU_STREAM_WAIT_VALUE_EQ).
        check(_LIB.cuStreamWaitValue32(s, ctypes.c_uint64(self._word), ctypes.c_uint32(1), 1))

    def release(self):
        ctypes.c_uint32.from_address(self._word).value = 1

    def synchronize(self):
        check(_LIB.cuStreamSynchronize(ctypes.c_void_p(self.handle)))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
        self.synchronize()
        check(_LIB.cuStreamDestroy(ctypes.c_void_p(self.handle)))
        _vmmt.mem_free(self.device, self._word)
        check(_LIB.cuCtxPopCurrent(ctypes.byref(ctypes.c_void_p())))
        check(_LIB.cuDevicePrimaryCtxRelease(self.device))
        return False


def check(result):
    if result != 0:
        raise RuntimeError("emulated driver call failed: CUresult %d" % result)


def live_contexts():
    """Devices whose primary context this process holds (retained, not released)."""
    _LIB.vmmt__emu_live_contexts.restype = ctypes.c_int
    return _LIB.vmmt__emu_live_contexts()


def calls(entry):
    """How often this process called a driver entry point (vmmt__emu_calls)."""
    if _LIB is None:
        raise RuntimeError("no libvmmt_emu.so beside the extension")
    _LIB.vmmt__emu_calls.restype = ctypes.c_long
    _LIB.vmmt__emu_calls.argtypes = [ctypes.c_char_p]
    return _LIB.vmmt__emu_calls(entry.encode())


def open_fds():
    return len(os.listdir("/proc/self/fd"))
