"""The binding with CuPy on a real GPU."""
from gpu_common import run_module, skip

try:
    import cupy
except ImportError:  # pragma: no cover
    cupy = None

import vmmt


def need_cupy():
    if cupy is None:
        skip("needs CuPy")
    try:
        driver = vmmt.driver_name()
    except vmmt.Error as e:
        skip("no driver: %s" % e)
    if driver != "cuda":
        skip("needs the real driver")


def test_cupy_roundtrip_and_streams():
    need_cupy()
    with vmmt.Pool(0, 64 << 20, 1) as pool, vmmt.Consumer() as consumer:
        for dtype in (cupy.float32, cupy.int64, cupy.float16, cupy.uint8):
            a = (cupy.arange(6 * 7 * 5) % 251).astype(dtype).reshape(6, 7, 5)
            for view in (a, a[:, ::2], a.transpose(2, 1, 0)):
                x = cupy.from_dlpack(consumer.consume(pool.publish(view), device=0))
                assert x.dtype == view.dtype and x.shape == view.shape
                assert bool((x == view).all())
        s = cupy.cuda.Stream(non_blocking=True)
        with s:
            a = cupy.full((1 << 16,), 3, dtype=cupy.float32)
            d = pool.publish(a)  # on s, CuPy's current stream
            buf = consumer.consume(d, stream=s)
            assert buf.stream == s.ptr
            x = cupy.from_dlpack(buf)
            total = float(x.sum())
        assert total == 3 * (1 << 16)


def test_cupy_out():
    need_cupy()
    with vmmt.Pool(0, 64 << 20, 1) as pool, vmmt.Consumer() as consumer:
        a = cupy.arange(1000, dtype=cupy.int32)
        out = cupy.zeros_like(a)
        consumer.consume(pool.publish(a), out=out)
        cupy.cuda.Device().synchronize()
        assert bool((out == a).all())


if __name__ == "__main__":
    import sys
    run_module(sys.modules[__name__])
