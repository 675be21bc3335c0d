"""pool_keep.c's fallback proof: where no event can be recorded after a
publish (or the pool was shut down meanwhile), the publish synchronizes its
stream before it gives the sources back. Run in a child process: it
reconfigures the emulated driver to fail cuEventRecord."""
import os
import subprocess
import sys
import textwrap

import vmmt

_PATHS = [os.path.dirname(os.path.dirname(os.path.abspath(vmmt.__file__))),
          os.path.dirname(os.path.abspath(__file__))]

# The child's start: a pool that proves copies by events (a device control
# table), a consumer, a device source, and a switch for driver failures.
_PRELUDE = """
import gc, os, sys, threading, time
sys.path[:0] = %r
import numpy as np, vmmt, emu_counters

def emu_fail(rules):
    os.environ["VMMT_EMU_FAIL"] = rules
    emu_counters._LIB.vmmt__emu_configure()

pool = vmmt.Pool(0, 4 << 20, 1, device_control_table=True)
consumer = vmmt.Consumer()
src = consumer.consume(pool.publish(np.arange(64, dtype=np.float32)))
src.synchronize()
""" % (_PATHS,)


def run_child(body, **env):
    out = subprocess.run([sys.executable, "-c", _PRELUDE + textwrap.dedent(body)],
                         capture_output=True, text=True, timeout=60, env=dict(os.environ, **env))
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_failed_event_synchronizes_without_the_gil_and_publishes():
    """Attack finding: when cuEventRecord failed after a publish (a pool with
    a device control table proves copies by events), the binding synchronized
    the stream holding the GIL, so a Python thread that would let the stream
    go on could not run (here the emulator's 10 s wait timeout ended it; on a
    GPU nothing would), and then it raised although the synchronize had proven
    the copy done, losing a descriptor that was published: its slice stayed in
    flight until shutdown. Failed before the fix: the publish took 10 s and
    raised vmmt.Error."""
    out = run_child("""
        emu_fail("cuEventRecord:*:CUDA_ERROR_UNKNOWN")
        with emu_counters.StalledStream(0) as stalled:
            def release():
                time.sleep(0.3)
                stalled.release()
            th = threading.Thread(target=release)
            th.start()
            t0 = time.monotonic()
            try:
                d = pool._pool.publish_tensor(src, src.ptr, 2, 32, (8,), stalled.handle)
            finally:
                took = time.monotonic() - t0
                th.join()
        emu_fail("")
        assert pool._pool.pending() == 0  # proven done by the synchronize
        got = np.from_dlpack(consumer.consume(d))
        assert (got == np.arange(8, dtype=np.float32)).all(), got
        pool.drain(5000)
        del src, got
        pool.close()
        consumer.close()
        gc.collect()
        assert all(v == 0 for v in emu_counters.live().values()), emu_counters.live()
        print("took %.2f" % took)
    """, VMMT_EMU_WAIT_TIMEOUT_MS="10000")
    took = float(out.split("took ")[1])
    assert took < 5, "the publish held the GIL while it synchronized: %.2f s" % took


def test_publish_that_raises_after_publishing_takes_its_descriptor_back():
    """Attack finding: when neither an event nor a synchronize could prove a
    publish's copy done, publish raised after the library had published, and
    the descriptor nobody would ever see kept its slice in flight until
    shutdown (drain timed out). Failed before the fix: drain raised
    vmmt.Timeout. Now the publish is cancelled: the slice comes back once its
    copy shows done. (The sources stay alive for good: nothing proved the
    copy done.)"""
    out = run_child("""
        emu_fail("cuEventRecord:*:CUDA_ERROR_UNKNOWN,cuStreamSynchronize:*:CUDA_ERROR_UNKNOWN")
        try:
            pool._pool.publish_tensor(src, src.ptr, 2, 32, (8,), 0)
            raise SystemExit("published without a proof")
        except vmmt.Error as e:
            assert "cuEventRecord" in str(e), e
        finally:
            emu_fail("")
        assert pool._pool.pending() == 0  # kept for good, outside the list
        pool.drain(2000)
        s = pool.stats()
        assert s["in_flight"] == 0 and s["cancelled"] == 1, s
        pool.close()
        print("ok")
    """)
    assert "ok" in out


def test_close_again_after_a_timed_out_close(no_leaks):
    """Attack finding: a close whose shutdown timed out (a publish's copy
    still queued on a stream held back) said "synchronize those streams and
    call vmmt_pool_shutdown again", but close() again returned at once and
    did nothing: the pool's memory stayed until the object died, and the
    publish's source stayed alive for good (the timed-out wait dropped it
    from the list). Failed before the fix: the second close released
    nothing."""
    import numpy as np
    import pytest
    import emu_counters

    consumer = vmmt.Consumer()
    pool = vmmt.Pool(0, 4 << 20, 1, timeout_ms=300)
    src = consumer.consume(pool.publish(np.arange(64, dtype=np.float32)))
    src.synchronize()
    with emu_counters.StalledStream(0) as stalled:
        pool._pool.publish_tensor(src, src.ptr, 2, 32, (8,), stalled.handle)
        with pytest.raises(vmmt.Timeout):
            pool.close()
        assert pool.closed
        held = emu_counters.live()
        stalled.release()
        stalled.synchronize()
        pool.close()  # the shutdown again, as the message says
        assert emu_counters.live()["allocations"] < held["allocations"]
        assert pool._pool.pending() == 0
        pool.close()  # and once done, close is a no-op
    consumer.close()
    del src, pool, consumer
