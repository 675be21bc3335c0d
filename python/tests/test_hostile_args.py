"""Hostile and careless arguments to the binding's private fast paths and to
consume(out=)/ranks=: each is refused with a clear error before anything is
published or consumed, and nothing leaks."""
import ctypes

import numpy as np
import pytest

import vmmt


def device_buffer(consumer, pool, a):
    buf = consumer.consume(pool.publish(a), ranks=0)
    buf.synchronize()
    return buf


class HugeLen:
    """A shape whose __len__ claims more items than an int holds."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return 4


def test_shape_length_beyond_int_refused(no_leaks):
    """Attack finding: raw_fill cast the shape's length to int, so a length of
    2**32 + 1 published a 1-d tensor and 2**32 a 0-d one. Failed before the
    fix: both published."""
    with vmmt.Pool(memory_size=4 << 20) as pool, vmmt.Consumer() as consumer:
        src = device_buffer(consumer, pool, np.arange(64, dtype=np.float32))
        for n in (2**32 + 1, 2**32, 2**31):
            with pytest.raises(ValueError, match="dimensions"):
                pool._pool.publish_tensor(src, src.ptr, 2, 32, HugeLen(n), 0)
            with pytest.raises(ValueError, match="dimensions"):
                pool._pool.publish_raw([(src, src.ptr, 16, 2, 32, 1, HugeLen(n), 0)], 0)
        assert pool.stats()["published"] == 1
        pool.drain(5000)


def test_dtype_fields_beyond_their_width_refused(no_leaks):
    """Attack finding: code, bits and lanes were cast to DLPack's uint8, uint8
    and uint16 without a check: bits=288 published float32, code=258 float,
    bits=-32 a 224-bit type whose size (from the shape) reached past the
    source. Failed before the fix: every one published."""
    with vmmt.Pool(memory_size=4 << 20) as pool, vmmt.Consumer() as consumer:
        src = device_buffer(consumer, pool, np.arange(64, dtype=np.float32))
        p = pool._pool
        for code, bits in ((2, 256 + 32), (258, 32), (2, -32), (-1, 32)):
            with pytest.raises(ValueError, match="dtype"):
                p.publish_tensor(src, src.ptr, code, bits, (4,), 0)
            with pytest.raises(ValueError, match="dtype"):
                p.publish_raw([(src, src.ptr, 16, code, bits, 1, (4,), 0)], 0)
        with pytest.raises(ValueError, match="dtype"):
            p.publish_raw([(src, src.ptr, 16, 2, 32, 65536 + 1, (4,), 0)], 0)
        r = pool.reserve(16)
        with pytest.raises(ValueError, match="dtype"):
            p.commit(r.ptr, r.nbytes, r._location, r._token, 16, 2, 256 + 32, 1, (4,), None)
        pool.cancel(r)
        assert pool.stats()["published"] == 1
        pool.drain(5000)


# ---------------------------------------------------------------- out=

class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32),
                ("device_id", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16),
                ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _ManagedVersioned(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_VERSIONED = b"dltensor_versioned"
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class ReadOnlyExporter:
    """A host array exported the way NumPy 2.1 and newer export a read-only
    one: with max_version=(1, 0), a versioned capsule flagged READ_ONLY; a
    legacy export (which cannot say read-only) raises BufferError."""

    def __init__(self, a):
        self.a = a
        self.shape = (ctypes.c_int64 * 1)(a.size)
        self.m = _ManagedVersioned(major=1, minor=0, flags=1)  # DLPACK_FLAG_BITMASK_READ_ONLY
        t = self.m.dl_tensor
        t.data, t.device_type, t.device_id, t.ndim = a.ctypes.data, 1, 0, 1
        t.code, t.bits, t.lanes, t.shape = 2, 32, 1, self.shape

    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        if max_version is None or max_version[0] < 1:
            raise BufferError("Cannot export readonly array since signalling readonly is "
                              "unsupported by DLPack.")
        return _capsule_new(ctypes.addressof(self.m), _VERSIONED, None)


def test_read_only_out_refused_with_value_error(no_leaks):
    """Attack finding: python/README.md says a read-only `out` raises
    ValueError, but consume asked for a legacy (unversioned) capsule, which
    cannot carry the read-only flag: NumPy's BufferError came through instead,
    and an exporter that flags read-only only in a versioned capsule (NumPy
    2.1 and newer) was never asked for one. Failed before the fix: BufferError
    for both."""
    a = np.arange(16, dtype=np.float32)
    with vmmt.Pool(memory_size=4 << 20) as pool, vmmt.Consumer() as consumer:
        d = pool.publish(a)
        ro = np.zeros(16, np.float32)
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="read-only|readonly"):
            consumer.consume(d, out=ro, ranks=0)
        target = np.zeros(16, np.float32)
        with pytest.raises(ValueError, match="read-only"):
            consumer.consume(d, out=ReadOnlyExporter(target), ranks=0)
        assert not target.any()
        # Refused before anything was consumed: the descriptor is still good.
        out = np.zeros(16, np.float32)
        assert consumer.consume(d, out=out, ranks=0) is out
        np.testing.assert_array_equal(out, a)
        pool.drain(5000)


class OtherDeviceOut:
    """A CUDA array on device 1 (only its device is asked)."""

    exported = False

    def __dlpack_device__(self):
        return (2, 1)

    def __dlpack__(self, *args, **kwargs):
        OtherDeviceOut.exported = True
        raise RuntimeError("exported, then its copy would run on device 0's stream")


def test_out_on_another_device_than_asked_refused(no_leaks):
    """Attack finding: consume(desc, device=0, out=<array on CUDA device 1>)
    copied on device 0's current stream into device 1's memory, ordered before
    nothing the array's own stream runs. Failed before the fix: it went on to
    export the array."""
    with vmmt.Pool(memory_size=4 << 20) as pool, vmmt.Consumer() as consumer:
        d = pool.publish(np.arange(4, dtype=np.float32))
        with pytest.raises(ValueError, match="device 1.*device=0"):
            consumer.consume(d, device=0, out=OtherDeviceOut(), ranks=0)
        assert not OtherDeviceOut.exported
        consumer.ack(d, ranks=0)
        pool.drain(5000)


# ---------------------------------------------------------------- ranks=

def test_ranks_bool_refused_and_index_ints_taken(no_leaks):
    """Attack finding: ranks=True was taken as rank 1 (a bool is an int), and
    ranks=numpy.int64(0) failed with "'numpy.int64' object is not iterable".
    Failed before the fix: the first consumed rank 1, the second raised
    TypeError."""
    with vmmt.Pool(memory_size=2 << 20, consumer_count=2) as pool, vmmt.Consumer() as consumer:
        a = np.arange(5, dtype=np.int32)
        d = pool.publish(a)
        for bad in (True, False, [True, 2]):
            with pytest.raises(TypeError, match="ranks"):
                consumer.consume(d, ranks=bad)
            with pytest.raises(TypeError, match="ranks"):
                consumer.ack(d, ranks=bad)
        np.testing.assert_array_equal(np.from_dlpack(consumer.consume(d, ranks=np.int64(0))), a)
        consumer.ack(d, ranks=[np.int64(1)])
        d = pool.publish(a)
        consumer.ack(d, ranks=np.arange(2))
        pool.drain(5000)
        assert pool.stats()["recycled"] == 2


class NoShapeExporter:
    """A buggy exporter: a 1-d host tensor whose shape pointer is NULL."""

    def __init__(self, a):
        self.a = a
        self.m = _ManagedVersioned(major=1, minor=0, flags=0)
        t = self.m.dl_tensor
        t.data, t.device_type, t.device_id, t.ndim = a.ctypes.data, 1, 0, 1
        t.code, t.bits, t.lanes = 2, 32, 1

    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        return _capsule_new(ctypes.addressof(self.m), _VERSIONED, None)


def test_capsule_without_shape_refused(no_leaks):
    """Attack finding: a capsule with ndim > 0 and a NULL shape (a buggy
    exporter) was read through the NULL pointer by publish and consume(out=).
    Failed before the fix: the interpreter died of SIGSEGV."""
    a = np.arange(4, dtype=np.float32)
    with vmmt.Pool(memory_size=4 << 20) as pool, vmmt.Consumer() as consumer:
        with pytest.raises(ValueError, match="shape"):
            pool.publish(NoShapeExporter(a))
        d = pool.publish(a)
        with pytest.raises(ValueError, match="shape"):
            consumer.consume(d, out=NoShapeExporter(np.zeros(4, np.float32)), ranks=0)
        consumer.ack(d, ranks=0)
        pool.drain(5000)
        assert pool.stats()["published"] == 1


def test_buffer_cannot_be_made_directly():
    """Attack finding: vmmt.Buffer() (the type inherited object's tp_new)
    made a Buffer over address 0 with no dtype, which exported a NULL tensor
    and freed address 0 when dropped. Failed before the fix: it was made."""
    for make in (vmmt.Buffer, lambda: vmmt.Buffer.__new__(vmmt.Buffer)):
        with pytest.raises(TypeError, match="consume"):
            make()


def test_reservation_views_refused_once_it_ends(no_leaks):
    """Attack finding: Reservation.__dlpack__ still exported the slice after
    commit or cancel (memoryview() refused), so from_dlpack gave a writable
    view of a published (or recycled) slice; and neither refused after the
    pool's close, when the slice is unmapped (a write there killed the
    process). Failed before the fix: from_dlpack(r) after commit returned an
    array."""
    with vmmt.Consumer() as consumer:
        with vmmt.Pool(memory_size=4 << 20) as pool:
            r = pool.reserve(16)
            np.frombuffer(r.memoryview(), np.uint8)[:] = 7
            d = pool.commit(r)
            for view in (np.from_dlpack, lambda r: r.memoryview()):
                with pytest.raises(ValueError, match="committed or cancelled"):
                    view(r)
            assert (np.from_dlpack(consumer.consume(d, ranks=0)) == 7).all()
            open_one = pool.reserve(16)
        for view in (np.from_dlpack, lambda r: r.memoryview()):
            with pytest.raises(ValueError, match="closed"):
                view(open_one)


def test_commit_takes_numpy_scalar_types(no_leaks):
    """Careless-user finding: commit(r, np.float32, shape) (NumPy's scalar
    type, which NumPy takes wherever a dtype goes) raised "dtype <class
    'numpy.float32'> is not one vmmt carries". Failed before the fix."""
    with vmmt.Pool(memory_size=4 << 20) as pool, vmmt.Consumer() as consumer:
        for dtype, name in ((np.float32, "float32"), (np.int64, "int64"), (np.bool_, "bool"),
                            (np.dtype(np.uint8), "uint8")):
            r = pool.reserve(64)
            np.frombuffer(r.memoryview(), np.uint8)[:] = 1
            d = pool.commit(r, dtype, (2,))
            assert d.dtype == name and d.shape == (2,)
            out = np.zeros(d.nbytes, np.uint8)  # NumPy 1.x has no DLPack bool
            assert (consumer.consume(d, out=out, ranks=0) == 1).all()
        with pytest.raises(ValueError, match="dtype"):
            pool.commit(pool.reserve(64), float, (2,))  # ambiguous: not taken
        pool.drain(5000)


def test_evict_takes_descriptor_bytes(no_leaks):
    """Careless-user finding: evict(pool_id_or_desc) took a Descriptor, but
    not the same 512 bytes as they arrive from a socket (plain bytes): "a pool
    id is 16 bytes, got 512". Failed before the fix."""
    with vmmt.Pool(memory_size=2 << 20) as pool, vmmt.Consumer() as consumer:
        d = pool.publish(np.zeros(4, np.uint8))
        consumer.consume(bytes(d), ranks=0)
        pool.drain(5000)
        assert consumer.pool_count() == 1
        consumer.evict(bytes(d))
        assert consumer.pool_count() == 0
        with pytest.raises(ValueError, match="16 bytes"):
            consumer.evict(b"x" * 17)


class TorchStreamOn1:
    """What consume reads of a torch.cuda.Stream of device 1."""
    cuda_stream = 0
    device_index = 1


class CupyStreamOn1:
    """What consume reads of a cupy.cuda.Stream of device 1."""
    ptr = 0
    device_id = 1


def test_stream_object_names_the_device(no_leaks):
    """Careless-user finding: consume(desc, stream=<a PyTorch or CuPy stream
    of device 1>) without device= copied on device 0 (the default device)
    into memory of device 0, enqueued on device 1's stream; with device=0 it
    went ahead just the same. Failed before the fix: the Buffer was on
    device 0."""
    a = np.arange(6, dtype=np.int16)
    with vmmt.Pool(memory_size=2 << 20) as pool, vmmt.Consumer() as consumer:
        for stream in (TorchStreamOn1(), CupyStreamOn1()):
            d = pool.publish(a)
            with pytest.raises(ValueError, match="device 1.*device=0"):
                consumer.consume(d, device=0, stream=stream, ranks=0)
            with pytest.raises(ValueError, match="device 1.*device=0"):
                consumer.ack(d, device=0, stream=stream, ranks=0)
            buf = consumer.consume(d, stream=stream, ranks=0)
            assert buf.device == 1
            np.testing.assert_array_equal(np.from_dlpack(buf), a)
            consumer.ack(pool.publish(a), stream=stream, ranks=0)
        pool.drain(5000)


def test_dropped_reservation_warns(no_leaks):
    """Careless-user finding: a Reservation dropped without commit or cancel
    kept its slice until the pool closed, silently (it cannot be given back
    behind the caller's back: queued work may still write through a view).
    Now it says so with a ResourceWarning, as an unclosed file does. Failed
    before the fix: no warning."""
    import gc
    import warnings
    with vmmt.Pool(memory_size=4 << 20) as pool:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            r = pool.reserve(64)
            del r
            gc.collect()
            done = pool.reserve(64)
            pool.cancel(done)
            del done
            gc.collect()
        msgs = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        assert len(msgs) == 1 and "without commit or cancel" in msgs[0]


def test_non_native_byte_order_refused_with_advice(no_leaks):
    """A big-endian NumPy array cannot go through DLPack: NumPy's bare
    BufferError ("DLPack only supports native byte order") came out of
    publish and of vmmt.sglang's wrap_tensor; a ValueError saying what to do
    now, and nothing is published."""
    with vmmt.Pool(memory_size=2 << 20) as pool:
        for a in (np.arange(6, dtype=">f4"), np.arange(6, dtype=">i8").reshape(2, 3)):
            with pytest.raises(ValueError, match="byte order.*astype"):
                pool.publish(a)
            with pytest.raises(ValueError, match="byte order"):
                pool.publish_many([np.ones(2), a])
        assert pool.stats()["in_flight"] == 0
        # Native order, said explicitly, is taken.
        pool.cancel(pool.publish(np.arange(6, dtype="=f4")))
