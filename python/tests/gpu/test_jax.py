"""The binding with JAX on a real GPU (the GPU machine has JAX 0.11.2 with
its CUDA backend; no Debian package carries JAX, so elsewhere it skips)."""
import os

from gpu_common import need_real_driver, roundtrip_views, run_module, skip

# JAX takes most of the GPU's memory at its first use unless told not to.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
try:
    import jax
    import jax.numpy as jnp
except ImportError:  # pragma: no cover
    jax = None

import numpy
import vmmt


def need_jax():
    need_real_driver(jax, "needs JAX")
    if not any(d.platform == "gpu" for d in jax.devices()):
        skip("needs JAX with its CUDA backend")


def test_jax_roundtrip():
    need_jax()
    with vmmt.Pool(memory_size=64 << 20) as pool, vmmt.Consumer() as consumer:
        arrays = [(jnp.arange(6 * 7 * 5) % 97).astype(dtype).reshape(6, 7, 5)
                  for dtype in (jnp.float32, jnp.bfloat16, jnp.int32, jnp.uint8)]
        roundtrip_views(pool, consumer, arrays, jax.dlpack.from_dlpack, same)


def same(x, y):
    return numpy.array_equal(numpy.asarray(x.astype(jnp.float32)),
                             numpy.asarray(y.astype(jnp.float32)))


def test_jax_cpu_source_and_packed():
    need_jax()
    print("jax", jax.__version__, [str(d) for d in jax.devices()])
    with vmmt.Pool(memory_size=64 << 20) as pool, vmmt.Consumer() as consumer:
        # A host array is copied to the pool's GPU by the publish.
        a = jax.device_put(jnp.arange(4096, dtype=jnp.int32), jax.devices("cpu")[0])
        x = jax.dlpack.from_dlpack(consumer.consume(pool.publish(a), device=0, ranks=0))
        assert x.devices() == {jax.devices("gpu")[0]} and same(x, a)
        arrays = [jnp.full((n, 3), n, dtype=jnp.float32) for n in (1, 7, 300)]
        descs = pool.publish_many(arrays)
        assert descs is not None and [d.pack_index for d in descs] == [0, 1, 2]
        for d, a in zip(descs, arrays):
            assert same(jax.dlpack.from_dlpack(consumer.consume(d, device=0, ranks=0)), a)


if __name__ == "__main__":
    import sys
    run_module(sys.modules[__name__])
