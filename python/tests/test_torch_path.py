"""The PyTorch hot paths of Pool.publish and Consumer.consume(out=) on the
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

    def __init__(self, buf, shape, contiguous=True, dtype=FLOAT32, conj=False, neg=False):
        self.buf, self.shape, self._contiguous = buf, tuple(shape), contiguous
        self.is_cuda, self.layout, self.dtype = True, STRIDED, dtype
        self._conj, self._neg = conj, neg

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
        return 0

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
    buf = consumer.consume(pool.publish(a))
    buf.synchronize()
    return buf


def test_publish_hot_path(no_leaks, torch_path):
    with vmmt.Pool(0, 4 << 20, 1) as pool, vmmt.Consumer() as consumer:
        src = device_array(consumer, pool, np.arange(256, dtype=np.float32))
        t = FakeTensor(src, (16, 16))
        d = pool.publish(t)
        assert isinstance(d, vmmt.Descriptor)
        assert d.dtype == "float32" and d.shape == (16, 16) and d.nbytes == 1024
        assert torch_path == [0]  # the raw current stream, once
        got = np.from_dlpack(consumer.consume(d))
        assert np.array_equal(got.ravel(), np.arange(256, dtype=np.float32))
        # consume(out=) into a "tensor": the consume_into path on its stream.
        dst = device_array(consumer, pool, np.zeros(256, dtype=np.float32))
        out = FakeTensor(dst, (256,))
        assert consumer.consume(pool.publish(t), out=out) is out
        dst.synchronize()
        assert np.array_equal(np.from_dlpack(dst), np.arange(256, dtype=np.float32))
        assert torch_path == [0, 0, 0]
        del t, out
        pool.drain(5000)


def test_publish_hot_path_declines(no_leaks, torch_path):
    # Not contiguous, or on an explicit stream: not the hot path (the fake is no
    # DLPack array, so the general path refuses it, naming what it needs).
    with vmmt.Pool(0, 4 << 20, 1) as pool, vmmt.Consumer() as consumer:
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
    with vmmt.Pool(0, 4 << 20, 1) as pool, vmmt.Consumer() as consumer:
        src = device_array(consumer, pool, np.arange(8, dtype=np.float32))
        d = pool.publish(FakeTensor(src, (2, 2), dtype=COMPLEX64))
        assert d.nbytes == 32 and d.shape == (2, 2)
        got = np.from_dlpack(consumer.consume(d))
        assert np.array_equal(got.view(np.float32).ravel(), np.arange(8, dtype=np.float32))
        for shape, what in (((4, -1), "negative"), ((1 << 40, 1 << 40), "64 bits")):
            with pytest.raises(ValueError, match=what):
                pool._pool.publish_tensor(src, src.ptr, 2, 32, shape, 0)
        assert pool.stats()["published"] == 2
        pool.drain(5000)
