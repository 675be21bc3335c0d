"""pool_keep.c's fallback proof: where no event can be recorded after a
publish (or the pool was shut down meanwhile), the publish synchronizes its
stream before it gives the sources back. Run in a child process: it
reconfigures the emulated driver to fail cuEventRecord."""
import vmmt
from child import run_child as run_in_child

# The child's start: a pool that proves copies by events (a device control
# table), a consumer, a device source, and a switch for driver failures.
_PRELUDE = """
import gc, os, sys, threading, time
import numpy as np, vmmt, emu_counters

def emu_fail(rules):
    os.environ["VMMT_EMU_FAIL"] = rules
    emu_counters._LIB.vmmt__emu_configure()

pool = vmmt.Pool(memory_size=4 << 20, device_control_table=True)
consumer = vmmt.Consumer()
src = consumer.consume(pool.publish(np.arange(64, dtype=np.float32)), ranks=0)
src.synchronize()
"""


def run_child(body, **env):
    return run_in_child(_PRELUDE, body, **env)


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
        got = np.from_dlpack(consumer.consume(d, ranks=0))
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
    pool = vmmt.Pool(memory_size=4 << 20, timeout_ms=300)
    src = consumer.consume(pool.publish(np.arange(64, dtype=np.float32)), ranks=0)
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


# close()'s bound (issue 16, item 12). A copy queued behind a held stream
# never completes on its own here: the emulator's wait would fail the stream
# only after VMMT_EMU_WAIT_TIMEOUT_MS, ten minutes, past any run of these
# tests, so a close that waits for it without bound is still waiting when
# the child's 30 s are up, while a close bounded by its timeout_ms returns
# in about that long: a margin of 30 or more, whatever else the machine runs.
_HELD = {"VMMT_EMU_WAIT_TIMEOUT_MS": "600000"}
_CLOSE_PRELUDE = """
import gc, numpy as np, vmmt, emu_counters

def held_close(pool, publishes, **close_args):
    '''close() with `publishes` copies queued behind a held stream raises
    Timeout and keeps their sources; once the stream goes on, close() again
    shuts the pool down and gives them back.'''
    consumer = vmmt.Consumer()
    src = consumer.consume(pool.publish(np.arange(64, dtype=np.float32)), ranks=0)
    src.synchronize()
    with emu_counters.StalledStream(0) as held:
        for _ in range(publishes):
            pool._pool.publish_tensor(src, src.ptr, 2, 32, (8,), held.handle)
        try:
            pool.close(**close_args)
            raise SystemExit("close() returned with copies still queued")
        except vmmt.Timeout as e:
            print("timeout:", e)
        assert pool.closed and pool._pool.pending() == publishes, pool._pool.pending()
        held.release()
        held.synchronize()
        pool.close()
    assert pool._pool.pending() == 0
    consumer.close()
    del src
    gc.collect()
    assert all(v == 0 for v in emu_counters.live().values()), emu_counters.live()
    print("ok")
"""


def run_held(body):
    out = run_in_child(_CLOSE_PRELUDE, body, timeout=30, **_HELD)
    assert "timeout:" in out and "ok" in out, out
    return out


def test_close_polls_an_event_proof_within_timeout_ms():
    """Issue 16 (12): a pool whose copies are proven by events (a device
    control table) waited for each with cuEventSynchronize, without bound:
    close() with a copy that never completes never returned. Failed before
    the fix: the child was still in close() after 30 s."""
    run_held("""
        held_close(vmmt.Pool(memory_size=4 << 20, device_control_table=True, timeout_ms=300), 1)
    """)


def test_close_shares_one_deadline_among_its_kept_sources():
    """Issue 16 (12): each kept source's ready word had a full timeout_ms of
    its own, and the shutdown after them one more: 48 copies queued behind a
    held stream made close() with timeout_ms=1000 wait 49 s. Failed before the
    fix: the child was still in close() after 30 s."""
    run_held("""
        held_close(vmmt.Pool(memory_size=8 << 20, max_slices=64, timeout_ms=1000), 48)
    """)


def test_close_takes_a_timeout_of_its_own():
    """close(timeout_ms=...) bounds this close instead of the pool's
    timeout_ms (ten minutes here). Failed before the fix: close() took no
    argument."""
    run_held("""
        held_close(vmmt.Pool(memory_size=4 << 20, timeout_ms=600000), 2, timeout_ms=200)
        held_close(vmmt.Pool(memory_size=4 << 20, device_control_table=True, timeout_ms=600000), 2,
                   timeout_ms=200)
    """)
