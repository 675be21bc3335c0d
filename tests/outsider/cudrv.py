"""The CUDA driver entry points this client needs, through ctypes, with the
structures of the public CUDA driver API (cuda.h), which the vmmt docs name
but do not lay out."""

import ctypes
import mmap
import os
import platform

c_u64 = ctypes.c_uint64
CUdeviceptr = ctypes.c_uint64

CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_HANDLE_TYPE_FABRIC = 8
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
CU_STREAM_NON_BLOCKING = 1
CU_STREAM_WAIT_VALUE_GEQ = 0
CU_MEMHOSTREGISTER_PORTABLE = 1
CU_MEMHOSTREGISTER_DEVICEMAP = 2


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte),
                ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class CUmemAllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", CUmemLocation), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", _AllocFlags)]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_int)]


class CudaError(Exception):
    def __init__(self, name, code, what):
        super().__init__(f"{what}: {name} ({code})")
        self.code = code


class Driver:
    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        self.fns = {}
        self.check("cuInit", self._fn("cuInit")(0))

    def _fn(self, name):
        # Through cuGetProcAddress (its 4-argument form, CUDA 12.0 semantics), as
        # the emulator is loaded by vmmt: a plain dlsym of "cuMemcpyDtoHAsync"
        # would get libcuda's legacy (pre-_v2) ABI on a real driver.
        f = self.fns.get(name)
        if f is None:
            p = ctypes.c_void_p()
            rc = self.lib.cuGetProcAddress(name.encode(), ctypes.byref(p), 12000,
                                           ctypes.c_uint64(0))
            if rc == 0 and p.value:
                f = ctypes.CFUNCTYPE(ctypes.c_int)(p.value)
            else:
                f = getattr(self.lib, name)
            self.fns[name] = f
        return f

    def check(self, what, rc):
        if rc != 0:
            name = ctypes.c_char_p()
            self._fn("cuGetErrorName")(rc, ctypes.byref(name))
            raise CudaError(name.value.decode() if name.value else "?", rc, what)

    def call(self, name, *args):
        self.check(name, self._fn(name)(*args))

    # --- devices and contexts
    def device(self, ordinal):
        dev = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(dev), ordinal)
        return dev.value

    def primary_ctx(self, dev):
        ctx = ctypes.c_void_p()
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        return ctx

    def push(self, ctx):
        self.call("cuCtxPushCurrent", ctx)

    def pop(self):
        ctx = ctypes.c_void_p()
        self.call("cuCtxPopCurrent", ctypes.byref(ctx))

    def granularity(self, dev, handle_type):
        prop = CUmemAllocationProp()
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
        prop.requestedHandleTypes = handle_type
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = dev
        g = ctypes.c_size_t()
        self.call("cuMemGetAllocationGranularity", ctypes.byref(g), ctypes.byref(prop),
                  CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        return g.value

    # --- VMM
    def import_fd(self, fd):
        h = c_u64()
        self.call("cuMemImportFromShareableHandle", ctypes.byref(h),
                  ctypes.c_void_p(fd), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return h.value

    def import_fabric(self, handle64):
        h = c_u64()
        buf = ctypes.create_string_buffer(bytes(handle64), 64)
        self.call("cuMemImportFromShareableHandle", ctypes.byref(h),
                  ctypes.cast(buf, ctypes.c_void_p), CU_MEM_HANDLE_TYPE_FABRIC)
        return h.value

    def reserve(self, size, align=0):
        p = CUdeviceptr()
        self.call("cuMemAddressReserve", ctypes.byref(p), ctypes.c_size_t(size),
                  ctypes.c_size_t(align), CUdeviceptr(0), c_u64(0))
        return p.value

    def free_range(self, ptr, size):
        self.call("cuMemAddressFree", CUdeviceptr(ptr), ctypes.c_size_t(size))

    def map(self, ptr, size, handle):
        self.call("cuMemMap", CUdeviceptr(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
                  c_u64(handle), c_u64(0))

    def unmap(self, ptr, size):
        self.call("cuMemUnmap", CUdeviceptr(ptr), ctypes.c_size_t(size))

    def release(self, handle):
        self.call("cuMemRelease", c_u64(handle))

    def set_access_rw(self, ptr, size, dev):
        a = CUmemAccessDesc()
        a.location.type = CU_MEM_LOCATION_TYPE_DEVICE
        a.location.id = dev
        a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.call("cuMemSetAccess", CUdeviceptr(ptr), ctypes.c_size_t(size),
                  ctypes.byref(a), ctypes.c_size_t(1))

    # --- streams (need a current context)
    def stream(self):
        s = ctypes.c_void_p()
        self.call("cuStreamCreate", ctypes.byref(s), CU_STREAM_NON_BLOCKING)
        return s

    def sync(self, s):
        self.call("cuStreamSynchronize", s)

    def dtoh_async(self, dst_addr, src, n, s):
        self.call("cuMemcpyDtoHAsync", ctypes.c_void_p(dst_addr), CUdeviceptr(src),
                  ctypes.c_size_t(n), s)

    def wait_geq(self, s, addr, value):
        self.call("cuStreamWaitValue32", s, CUdeviceptr(addr), ctypes.c_uint32(value),
                  CU_STREAM_WAIT_VALUE_GEQ)

    def write_value(self, s, addr, value):
        self.call("cuStreamWriteValue32", s, CUdeviceptr(addr), ctypes.c_uint32(value), 0)

    def host_register(self, addr, size):
        self.call("cuMemHostRegister", ctypes.c_void_p(addr), ctypes.c_size_t(size),
                  CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP)
        p = CUdeviceptr()
        self.call("cuMemHostGetDevicePointer", ctypes.byref(p), ctypes.c_void_p(addr), 0)
        return p.value


# --- host memory: a shared mapping of an fd, and a 32-bit compare-and-swap.
# The docs ask a reader to compare-and-swap words of the shared memfd; Python
# has no atomic operation on foreign memory, so this builds one: x86-64 code
#   mov eax, esi; lock cmpxchg [rdi], edx; ret   -> returns the old value.

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
MAP_FAILED = ctypes.c_void_p(-1).value


def mmap_shared(fd, size):
    p = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if p == MAP_FAILED or p is None:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return p


def munmap(addr, size):
    _libc.munmap(addr, size)


def _make_cas():
    if platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError("the compare-and-swap helper is x86-64 code")
    code = bytes([0x89, 0xF0, 0xF0, 0x0F, 0xB1, 0x17, 0xC3])
    p = _libc.mmap(None, 4096, mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC,
                   mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if p == MAP_FAILED or p is None:
        raise OSError(ctypes.get_errno(), "mmap of the CAS helper")
    ctypes.memmove(p, code, len(code))
    f = ctypes.CFUNCTYPE(ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint32,
                         ctypes.c_uint32)(p)
    return f


_cas = _make_cas()


def cas32(addr, expected, desired):
    """Atomically: if *addr == expected, *addr = desired. Returns the old value."""
    return _cas(addr, expected & 0xFFFFFFFF, desired & 0xFFFFFFFF)


def load32(addr):
    # An aligned 32-bit load; on x86-64 every load has acquire order.
    return ctypes.c_uint32.from_address(addr).value


def store32(addr, v):
    # An aligned 32-bit store; on x86-64 every store has release order.
    ctypes.c_uint32.from_address(addr).value = v
