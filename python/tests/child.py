"""Python code run in a child process, with the package under test and these
helpers importable: for sequences that kill the interpreter when they fail
(a fault), wait without bound, or reconfigure the emulated driver."""
import os
import subprocess
import sys
import textwrap

import vmmt

PATHS = [os.path.dirname(os.path.dirname(os.path.abspath(vmmt.__file__))),
         os.path.dirname(os.path.abspath(__file__))]
# The emulated driver the package uses, for a child that loads libvmmt.so too:
# pointed at by VMMT_EMU_LIBRARY, both copies of the library and the counters
# (emu_counters.py) share one emulator.
EMU_LIBRARY = os.path.join(os.path.dirname(os.path.abspath(vmmt.__file__)), "libvmmt_emu.so")


def source(*parts):
    """The child's program: sys.path set, then each part dedented."""
    return "import sys\nsys.path[:0] = %r\n" % (PATHS,) + "".join(textwrap.dedent(p)
                                                                for p in parts)


def run_child(*parts, timeout=60, **env):
    """Run the parts in a child python; its stdout once it has exited 0 within
    `timeout` seconds, else an AssertionError with what it printed."""
    try:
        out = subprocess.run([sys.executable, "-c", source(*parts)], capture_output=True,
                             text=True, timeout=timeout, env=dict(os.environ, **env))
    except subprocess.TimeoutExpired as e:
        raise AssertionError("the child was still running after %d s:\n%s%s"
                             % (timeout, _text(e.stdout), _text(e.stderr))) from None
    assert out.returncode == 0, "the child exited with %d:\n%s%s" % (out.returncode, out.stdout,
                                                                     out.stderr)
    return out.stdout


def _text(data):
    if isinstance(data, bytes):
        return data.decode("utf-8", "replace")
    return data or ""
