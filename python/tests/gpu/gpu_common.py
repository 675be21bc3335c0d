"""Shared helpers of the GPU tests (real driver, PyTorch, CuPy).

These tests run on the GPU machine through tests/gpu/run, with pytest when
it is importable and otherwise with run_module() below, so they use plain
functions (parameters are loops inside) and no pytest fixtures.
"""
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
_pkg = os.environ.get("VMMT_PYTHON_PATH")
if _pkg and _pkg not in sys.path:
    sys.path.insert(0, _pkg)
if HERE not in sys.path:
    sys.path.insert(0, HERE)


class Skip(Exception):
    """The test cannot run here (no GPU, no library)."""


def skip(reason):
    if os.environ.get("PYTEST_CURRENT_TEST"):  # under pytest
        import pytest
        pytest.skip(reason)
    raise Skip(reason)


def need_real_driver(library, reason):
    """Skip unless `library` imported (not None) and vmmt runs on the real driver."""
    if library is None:
        skip(reason)
    import vmmt
    try:
        driver = vmmt.driver_name()
    except vmmt.Error as e:
        skip("no driver: %s" % e)
    if driver != "cuda":
        skip("needs the real driver (VMMT_DRIVER=cuda)")


def roundtrip_views(pool, consumer, arrays, from_dlpack, equal):
    """Each 3-d array, a strided view and a transposed view of it through
    publish and consume on device 0: same dtype, shape and values."""
    for a in arrays:
        for view in (a, a[:, ::2], a.transpose(2, 1, 0)):
            x = from_dlpack(consumer.consume(pool.publish(view), device=0, ranks=0))
            assert x.dtype == view.dtype and x.shape == view.shape
            assert equal(x, view)


def run_module(module):
    """A minimal runner: every test_* function, in order; exit status 1 on a failure."""
    names = [n for n in sorted(vars(module)) if n.startswith("test_")]
    failed = 0
    for n in names:
        t0 = time.perf_counter()
        try:
            getattr(module, n)()
            status = "PASSED"
        except Skip as e:
            status = "SKIPPED (%s)" % e
        except BaseException:
            status = "FAILED"
            failed += 1
            traceback.print_exc()
        print("%s::%s %s (%.2f s)" % (module.__name__, n, status, time.perf_counter() - t0),
              flush=True)
    print("%d passed or skipped, %d failed" % (len(names) - failed, failed))
    sys.exit(1 if failed else 0)
