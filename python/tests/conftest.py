"""Python tests of the binding on the emulated driver (NumPy, no GPU).

The package under test comes from $VMMT_PYTHON_PATH (what `make test` built
under build/python), else from an in-place build in python/. Every test runs
on the emulated driver, whose device memory is host memory, so consumed
buffers are CPU arrays for numpy.from_dlpack.
"""
import gc
import os
import sys

import pytest

os.environ.setdefault("VMMT_DRIVER", "emu")
_path = os.environ.get("VMMT_PYTHON_PATH") or os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.abspath(_path))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import emu_counters  # noqa: E402
import vmmt  # noqa: E402


def pytest_report_header(config):
    try:
        driver = vmmt.driver_name()
    except vmmt.Error as e:  # the GPU tests skip then, saying why
        driver = "none: %s" % e
    return "vmmt from %s (driver %s)" % (os.path.dirname(vmmt.__file__), driver)


@pytest.fixture
def no_leaks():
    """The emulator's live counters and this process's fds are back after the test."""
    gc.collect()
    before = emu_counters.live()
    fds = emu_counters.open_fds()
    yield
    gc.collect()
    after = emu_counters.live()
    assert after == before, "emulated driver objects leaked: %r -> %r" % (before, after)
    assert emu_counters.open_fds() == fds, "file descriptors leaked"


@pytest.fixture
def pool(no_leaks):
    with vmmt.Pool(memory_size=8 << 20, max_slices=64) as p:
        yield p


@pytest.fixture
def consumer(no_leaks):
    with vmmt.Consumer() as c:
        yield c
