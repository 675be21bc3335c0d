"""The PyTorch hot paths of Pool.publish and Consumer.consume(out=, ranks=0) on the
emulated driver, driven by a stand-in for torch: its tensors point at
emulated device memory (consumed Buffers), so the real publish_tensor and
consume_into calls run. The GPU tests (python/tests/gpu) run real PyTorch."""
import types

import numpy as np
import pytest

import vmmt


class FakeDtype:
    def __init__(self, name):
        self.name = name


FLOAT32 = FakeDtype("float32")
COMPLEX64 = FakeDtype("complex64")
STRIDED = object()


class FakeTensor:
    """What the hot path reads of a torch.Tensor, over emulated device memory."""

    def __init__(self, buf, shape, contiguous=True, dtype=FLOAT32, conj=False, neg=False,
                 device=0):
        self.buf, self.shape, self._contiguous = buf, tuple(shape), contiguous
        self.is_cuda, self.layout, self.dtype = True, STRIDED, dtype
        self._conj, self._neg, self._device = conj, neg, device

    @property
    def nbytes(self):
        return self.buf.nbytes

    def is_contiguous(self):
        return self._contiguous

    def is_conj(self):
        return self._conj

    def is_neg(self):
        return self._neg

    def get_device(self):
        return self._device

    def data_ptr(self):
        return self.buf.ptr

    def numel(self):
        return self.nbytes // 4

    def element_size(self):
        return 4


def fake_torch(calls):
    cuda = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True,
                                 current_device=lambda: 0)

    def raw_stream(device):
        calls.append(device)
        return 0

    return types.SimpleNamespace(Tensor=FakeTensor, strided=STRIDED, float32=FLOAT32,
                                 complex64=COMPLEX64, cuda=cuda,
                                 _C=types.SimpleNamespace(_cuda_getCurrentRawStream=raw_stream))


@pytest.fixture
def torch_path(monkeypatch):
    calls = []
    monkeypatch.setattr(vmmt, "_TORCH", vmmt._Torch(fake_torch(calls)))
    return calls


def device_array(consumer, pool, a):
    buf = consumer.consume(pool.publish(a), ranks=0)
    buf.synchronize()
    return buf


def test_publish_hot_path(no_leaks, torch_path):
    with vmmt.Pool(memory_size=4 << 20) as pool, vmmt.Consumer() as consumer:
        src = device_array(consumer, pool, np.arange(256, dtype=np.float32))
        t = FakeTensor(src, (16, 16))
        d = pool.publish(t)
        assert isinstance(d, vmmt.Descriptor)
        assert d.dtype == "float32" and d.shape == (16, 16) and d.nbytes == 1024
        assert torch_path == [0]  # the raw current stream, once
        got = np.from_dlpack(consumer.consume(d, ranks=0))
        assert np.array_equal(got.ravel(), np.arange(256, dtype=np.float32))
        # consume(out=) into a "tensor": the consume_into path on its stream.
        dst = device_array(consumer, pool, np.zeros(256, dtype=np.float32))
        out = FakeTensor(dst, (256,))
        assert consumer.consume(pool.publish(t), out=out, ranks=0) is out
        dst.synchronize()
        assert np.array_equal(np.from_dlpack(dst), np.arange(256, dtype=np.float32))
        assert torch_path == [0, 0, 0]
        del t, out
        pool.drain(5000)


def test_publish_hot_path_declines(no_leaks, torch_path):
    # Not contiguous, or on an explicit stream: not the hot path (the fake is no
    # DLPack array, so the general path refuses it, naming what it needs).
    with vmmt.Pool(memory_size=4 << 20) as pool, vmmt.Consumer() as consumer:
        src = device_array(consumer, pool, np.arange(4, dtype=np.float32))
        for t, stream in ((FakeTensor(src, (4,), contiguous=False), None),
                          (FakeTensor(src, (4,)), 0),
                          # Lazy conjugate or negative views: their bytes are not the values.
                          (FakeTensor(src, (2,), dtype=COMPLEX64, conj=True), None),
                          (FakeTensor(src, (4,), neg=True), None)):
            with pytest.raises((TypeError, AttributeError)):
                pool.publish(t, stream=stream)
        assert pool.stats()["published"] == 1
        pool.drain(5000)


def test_publish_tensor_size_from_shape(no_leaks, torch_path):
    # The hot path takes the size from the shape: a complex tensor (not
    # conjugated) is 8 bytes an element, and an extent that is negative or a
    # size beyond 64 bits is refused before anything is reserved.
    with vmmt.Pool(memory_size=4 << 20) as pool, vmmt.Consumer() as consumer:
        src = device_array(consumer, pool, np.arange(8, dtype=np.float32))
        d = pool.publish(FakeTensor(src, (2, 2), dtype=COMPLEX64))
        assert d.nbytes == 32 and d.shape == (2, 2)
        got = np.from_dlpack(consumer.consume(d, ranks=0))
        assert np.array_equal(got.view(np.float32).ravel(), np.arange(8, dtype=np.float32))
        for shape, what in (((4, -1), "negative"), ((1 << 40, 1 << 40), "64 bits")):
            with pytest.raises(ValueError, match=what):
                pool._pool.publish_tensor(src, src.ptr, 2, 32, shape, 0)
        assert pool.stats()["published"] == 2
        pool.drain(5000)


def test_publish_tensor_zero_d_and_empty(no_leaks, torch_path):
    # A 0-d tensor is one element; an empty one is refused (as the DLPack path
    # refuses it) before anything is reserved.
    with vmmt.Pool(memory_size=4 << 20) as pool, vmmt.Consumer() as consumer:
        src = device_array(consumer, pool, np.array([7.5, 1], dtype=np.float32))
        d = pool.publish(FakeTensor(src, ()))
        assert d.shape == () and d.nbytes == 4
        got = np.from_dlpack(consumer.consume(d, ranks=0))
        assert got.shape == () and got == np.float32(7.5)
        for shape in ((0,), (3, 0), (0, 1 << 62, 1 << 62)):
            with pytest.raises(ValueError, match="nbytes=0|64 bits"):
                pool.publish(FakeTensor(src, shape))
        assert pool.stats()["published"] == 2
        pool.drain(5000)


def test_consume_out_conj_or_neg_view_refused(no_leaks, torch_path):
    """Attack finding: consume(out=) took a CUDA tensor's hot path without
    looking at its lazy conjugate or negative bit, so the bytes landed under a
    view that reads them conjugated or negated (the DLPack path refuses such a
    tensor; publish's hot path declines it). Failed before the fix: the
    consume went through and returned `out`."""
    with vmmt.Pool(memory_size=4 << 20) as pool, vmmt.Consumer() as consumer:
        a = np.arange(4, dtype=np.float32)
        dst = device_array(consumer, pool, np.zeros(4, dtype=np.float32))
        d = pool.publish(a)
        for out in (FakeTensor(dst, (2,), dtype=COMPLEX64, conj=True),
                    FakeTensor(dst, (4,), neg=True)):
            with pytest.raises(ValueError, match="conjugate or negative"):
                consumer.consume(d, out=out, ranks=0)
        # Refused before anything was consumed: the descriptor is still good.
        assert consumer.consume(d, out=FakeTensor(dst, (4,)), ranks=0) is not None
        dst.synchronize()
        assert np.array_equal(np.from_dlpack(dst), a)
        pool.drain(5000)


def test_consume_out_on_another_device_refused(no_leaks, torch_path):
    """Attack finding: consume(desc, device=0, out=a tensor on device 1) left
    the hot path and enqueued the copy on device 0's current stream, which
    nothing orders before work on device 1's (the tensor's) stream. Failed
    before the fix: AttributeError from the DLPack path, after the hot path
    had been skipped silently."""
    with vmmt.Pool(memory_size=4 << 20) as pool, vmmt.Consumer() as consumer:
        dst = device_array(consumer, pool, np.zeros(4, dtype=np.float32))
        d = pool.publish(np.arange(4, dtype=np.float32))
        with pytest.raises(ValueError, match="device 1.*device=0"):
            consumer.consume(d, device=0, out=FakeTensor(dst, (4,), device=1), ranks=0)
        consumer.ack(d, ranks=0)
        pool.drain(5000)
