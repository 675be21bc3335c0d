"""The binding with CuPy on a real GPU."""
from gpu_common import need_real_driver, roundtrip_views, run_module

try:
    import cupy
except ImportError:  # pragma: no cover
    cupy = None

import vmmt


def need_cupy():
    need_real_driver(cupy, "needs CuPy")


def test_cupy_roundtrip_and_streams():
    need_cupy()
    with vmmt.Pool(memory_size=64 << 20) as pool, vmmt.Consumer() as consumer:
        arrays = [(cupy.arange(6 * 7 * 5) % 251).astype(dtype).reshape(6, 7, 5)
                  for dtype in (cupy.float32, cupy.int64, cupy.float16, cupy.uint8)]
        roundtrip_views(pool, consumer, arrays, cupy.from_dlpack,
                        lambda x, y: bool((x == y).all()))
        s = cupy.cuda.Stream(non_blocking=True)
        with s:
            a = cupy.full((1 << 16,), 3, dtype=cupy.float32)
            d = pool.publish(a)  # on s, CuPy's current stream
            buf = consumer.consume(d, stream=s, ranks=0)
            assert buf.stream == s.ptr
            x = cupy.from_dlpack(buf)
            total = float(x.sum())
        assert total == 3 * (1 << 16)


def test_cupy_out():
    need_cupy()
    with vmmt.Pool(memory_size=64 << 20) as pool, vmmt.Consumer() as consumer:
        a = cupy.arange(1000, dtype=cupy.int32)
        out = cupy.zeros_like(a)
        consumer.consume(pool.publish(a), out=out, ranks=0)
        cupy.cuda.Device().synchronize()
        assert bool((out == a).all())


if __name__ == "__main__":
    import sys
    run_module(sys.modules[__name__])
