"""Outside attacks on Consumer.flush() (vmmt_consumer_flush) and on
vmmt.sglang's CudaVmmMemoryPool recycling through it (_lock, _recycle_chunks,
occupied_chunks / available_chunks, cancel_proxy, shutdown) and on the
proxies (_resolve_consumer_count, _acknowledgement_range,
reconstruct_on_target_device, acknowledge_consumption), written from the
public docs only (vmmt.h, python/README.md, the .pyi stubs, sglang.py's
docstring, docs/design.md, docs/integration.md).

How copies are held back: the emulated driver's stream waits. A raw
Consumer.consume() is stalled on a NON_BLOCKING stream of ours (_NBStall),
so the copy stays queued while everything else proceeds. A
reconstruct_on_target_device() copies on a stream we cannot name, but one
that waits behind the legacy default stream, so a blocking stalled stream
(emu_counters.StalledStream) holds it back; every stall is released by a
watchdog timer long before the emulator's own 10 s limit, so nothing waits
for ever even when a test fails.

Attacked (each a test below; FINDING tests fail, the rest hold):

Consumer.flush
- idle / repeated / argument errors; after close (Closed: message is terse,
  see FINDING 5); after a synchronized consume the slice is free at once for
  host, device and device-control-table pools; only the ranks asked for are
  acknowledged; a queued (stalled) copy is never acknowledged by flush, its
  slice is not reused and its bytes are the buffer's; a cancel while the
  copy is queued is caught by check(); flush from many threads racing
  consume/check/ack/evict; flush racing close (in a child: a fault would
  kill it); flush and check after the producer process was SIGKILLed.

vmmt.sglang
- _recycle_chunks right after a rebuild / ack / release / packed rebuild,
  in the same process, finds the slice free at once (device, elastic, host);
  _lock is reentrant; shutdown inside _lock; shutdown while another thread
  holds _lock (bounded); _recycle_chunks under _lock from many threads while
  wrapping, rebuilding and clearing the process's import cache; cancel racing
  recycle; a rank resolver that recurses into _recycle_chunks or into another
  rebuild; reconstruct / acknowledge after shutdown, and after a new pool
  took its place; consumer_count / consumer_rank / acknowledge_ranks out of
  range, a layout beyond the pool; a pickled proxy in a second process after
  the pool recycled its slice into another tensor; two processes racing one
  rank on one proxy; no thread, fd or driver object left behind.

Findings (the tests named fail with "FINDING:"):
1. test_finding_rebuild_returns_another_buffers_bytes_after_cancel[single]
   (fixed 2026-12-07; the cancel now leaves a queued copy its slice):
   cancel_proxy() while a rank's reconstruct copy is queued, then a wrap
   that takes the freed slice: the reconstruct returns the NEW tensor's
   bytes and raises nothing. The raw API's Consumer.check() says
   ProducerGone for the same sequence (test_raw_check_catches_a_cancel_under_
   a_queued_copy holds); the proxy never asks it. ([packed] holds: a packed
   rebuild's later member is consumed only after the first member's copy,
   so the cancel lands between them and the rebuild is refused, Stale.)
2. test_finding_recycle_waits_for_another_threads_stalled_rebuild (fixed
   2026-12-07):
   _recycle_chunks() (of any pool, even one the rebuild does not touch),
   acknowledge_consumption() of an unrelated proxy and
   _imported_pool_cache_clear() block for as long as another thread's
   reconstruct waits for its stream (here until the test releases it); flush
   itself never waits for a running copy, so the wait is the proxy module's.
3. test_finding_failed_acknowledge_ranks_acknowledged_some_ranks: an
   acknowledge_ranks list with one rank already acknowledged raises Stale
   "nothing was acknowledged again", but the other ranks of the list were
   acknowledged; for reconstruct the rank's copy is lost (a retry is Stale).
4. test_finding_numpy_integers_refused_with_contradicting_messages:
   consumer_count=np.int64(1) -> "consumer_count must be positive; got 1",
   consumer_rank=np.int32(2) -> "consumer_rank=2 is outside
   consumer_count=4", acknowledge_ranks=[np.int64(1)] -> "give distinct ranks
   0..3", while the binding's own ranks= takes any __index__ integer.
5. test_finding_closed_errors_do_not_say_what_was_asked: flush() after
   close() and cancel_proxy() after shutdown() raise Closed with only "the
   consumer is closed" / "the pool is closed": neither names the call nor says
   what to do; and a proxy of a pool shut down before this process first
   imported it raises a plain vmmt.Error (ESYS, "broker ... Connection
   refused"), not the ProducerGone python/README.md promises for consumers of
   a closed pool.
"""
import ctypes
import gc
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time

import numpy as np
import pytest

import emu_counters
from child import run_child
from sglang_fixtures import MiB, clean, make_pool, vmmt, vs  # noqa: F401
from sglang_threads import Call as _Call, LegacyStall as _LegacyStall, wire as _wire
from sglang_threads import copies as _copies, run_threads as _run_threads
from sglang_threads import wait_copies as _wait_copies
from vmmt import _vmmt

DEADLINE = 10.0  # seconds; generous bound of every poll below


# ------------------------------------------------------------------ helpers

class _NBStall:
    """A NON_BLOCKING stream of the emulated driver held back by a wait on a
    word until release(): a raw consume on it stays queued, while the legacy
    default stream (and so publish, rebuilds) is not held. close() releases,
    synchronizes and destroys it."""

    def __init__(self, device=0):
        lib = emu_counters._LIB
        self._lib, self.device = lib, device
        ctx, s = ctypes.c_void_p(), ctypes.c_void_p()
        emu_counters.check(lib.cuInit(0))
        emu_counters.check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device))
        emu_counters.check(lib.cuCtxPushCurrent(ctx))
        emu_counters.check(lib.cuStreamCreate(ctypes.byref(s), 1))  # CU_STREAM_NON_BLOCKING
        self.handle = s.value
        self._word = _vmmt.mem_alloc(device, 4)
        ctypes.c_uint32.from_address(self._word).value = 0
        emu_counters.check(lib.cuStreamWaitValue32(s, ctypes.c_uint64(self._word),
                                                   ctypes.c_uint32(1), 1))
        self._open = True

    def release(self):
        ctypes.c_uint32.from_address(self._word).value = 1

    def synchronize(self):
        emu_counters.check(self._lib.cuStreamSynchronize(ctypes.c_void_p(self.handle)))

    def close(self):
        if not self._open:
            return
        self._open = False
        self.release()
        try:
            self.synchronize()
        finally:
            lib = self._lib
            emu_counters.check(lib.cuStreamDestroy(ctypes.c_void_p(self.handle)))
            _vmmt.mem_free(self.device, self._word)
            emu_counters.check(lib.cuCtxPopCurrent(ctypes.byref(ctypes.c_void_p())))
            emu_counters.check(lib.cuDevicePrimaryCtxRelease(self.device))


def _settled(pool, keep=0):
    """Poll _recycle_chunks until at most `keep` slices are in flight."""
    deadline = time.monotonic() + DEADLINE
    while True:
        pool._recycle_chunks()
        occupied = pool.occupied_chunks
        if len(occupied) <= keep:
            return occupied
        assert time.monotonic() < deadline, "slices still in flight after %ds: %r" % (
            DEADLINE, occupied)
        time.sleep(0.005)


def _tasks():
    return len(os.listdir("/proc/self/task"))


def _raw_pool(kind, **kw):
    opts = dict(memory_size=8 * MiB, max_slices=64)
    if kind == "host":
        opts["memory_location"] = "host"
    elif kind == "device-table":
        opts["device_control_table"] = True
    opts.update(kw)
    return vmmt.Pool(**opts)


# ======================================================= Consumer.flush (raw)

def test_flush_idle_repeated_and_argument_errors(no_leaks):
    with vmmt.Consumer() as c:
        for _ in range(1000):
            assert c.flush() is None
        with pytest.raises(TypeError):
            c.flush(1)
        with pytest.raises(TypeError):
            c.flush(timeout=1)
        with pytest.raises((TypeError, AttributeError)):
            vmmt.Consumer.flush(object())


@pytest.mark.parametrize("kind", ["device", "device-table", "host"])
def test_flush_frees_a_synchronized_consume_at_once(no_leaks, kind):
    """The documented use: synchronize, flush, the producer reclaims at once
    (no polling): 200 times in a row, every pool kind, bytes right."""
    with _raw_pool(kind) as pool, vmmt.Consumer() as c:
        for i in range(200):
            src = np.arange(256, dtype=np.int32) + i
            d = pool.publish(src)
            b = c.consume(d, ranks=0)
            b.synchronize()
            c.flush()
            pool.reclaim()  # (the pool's own recycler may have been first: count in_flight)
            assert pool.stats()["in_flight"] == 0, "FINDING: %s pool: flush after a " \
                "synchronized consume left the slice unacknowledged (iteration %d)" % (kind, i)
            assert np.array_equal(np.from_dlpack(b).view(np.int32), src)
            c.check(d)
            del b
        assert pool.stats()["in_flight"] == 0


def test_flush_acknowledges_only_the_ranks_asked(no_leaks):
    with _raw_pool("host", consumer_count=3) as pool, vmmt.Consumer() as c:
        d = pool.publish(np.arange(16, dtype=np.int32))
        c.consume(d, ranks=0).synchronize()
        c.flush()
        assert pool.reclaim() == 0 and pool.stats()["in_flight"] == 1
        c.consume(d, ranks=range(1, 2)).synchronize()
        c.flush()
        assert pool.reclaim() == 0, "rank 2 never acknowledged, yet the slice came back"
        c.ack(d, ranks=2)
        c.flush()
        deadline = time.monotonic() + DEADLINE
        while pool.stats()["in_flight"]:
            assert time.monotonic() < deadline
            pool.reclaim()
        with pytest.raises(vmmt.Stale):
            c.consume(d, ranks=0)


@pytest.mark.parametrize("kind", ["device", "device-table", "host"])
def test_flush_never_acknowledges_a_queued_copy(no_leaks, kind):
    """A consume whose copy is held back on its stream: flush returns at once
    and leaves the slice in flight, so the next publishes cannot take it;
    once released the bytes are the buffer's and check() is OK."""
    with _raw_pool(kind) as pool, vmmt.Consumer() as c:
        src = np.arange(1024, dtype=np.int32)
        d = pool.publish(src)
        s = _NBStall()
        try:
            b = c.consume(d, stream=s.handle, ranks=0)
            t = time.monotonic()
            for _ in range(100):
                c.flush()
            assert time.monotonic() - t < DEADLINE
            assert pool.reclaim() == 0 and pool.stats()["in_flight"] == 1, \
                "FINDING: flush acknowledged a copy still queued on its stream"
            others = [pool.publish(np.full(1024, 7, np.int32)) for _ in range(8)]
            assert d.slot not in {o.slot for o in others}, \
                "FINDING: a slice under a queued copy was handed to a new publish"
            s.release()
            s.synchronize()
            c.flush()
            got = np.from_dlpack(b).view(np.int32)
            assert np.array_equal(got, src), \
                "FINDING: the queued copy read another buffer's bytes: %r" % got[:4]
            c.check(d)
            for o in others:
                pool.cancel(o)
            del got, b
        finally:
            s.close()


@pytest.mark.parametrize("kind", ["device", "host"])
def test_raw_cancel_leaves_a_queued_copy_its_slice(no_leaks, kind):
    """The library's answer to finding 1 (since 2026-12-07): a descriptor
    cancelled while a consume's copy is queued keeps its slice until that
    copy is acknowledged, so a publish right after cannot take it, the copy
    reads its own buffer, and check() passes. (Before, the slice went to the
    next publish and only check() told: ProducerGone, "left its slot".)"""
    with _raw_pool(kind, max_slices=1) as pool, vmmt.Consumer() as c:
        src = np.arange(1024, dtype=np.int32)
        d = pool.publish(src)
        s = _NBStall()
        try:
            b = c.consume(d, stream=s.handle, ranks=0)
            c.flush()
            pool.cancel(d)
            pool.reclaim()
            with pytest.raises(vmmt.PoolFull):
                pool.publish(np.full(1024, 9, np.int32))
            s.release()
            s.synchronize()
            c.flush()
            got = np.from_dlpack(b).view(np.int32)
            assert np.array_equal(got, src), "the queued copy read another buffer: %r" % got[:4]
            c.check(d)
            del got, b
            pool.drain(5000)
            pool.cancel(pool.publish(np.full(1024, 9, np.int32)))
        finally:
            s.close()


def test_flush_after_close_is_closed(no_leaks):
    c = vmmt.Consumer()
    c.close()
    for _ in range(3):
        with pytest.raises(vmmt.Closed) as e:
            c.flush()
        assert e.value.status == vmmt.ECLOSED
    c.close()  # idempotent


def test_flush_from_many_threads_racing_consume_check_ack_evict(no_leaks):
    """Four threads consume (half of them ack instead), check and flush;
    two only flush; one evicts the pool over and over. Every consumed
    buffer holds its own bytes; evict fails only with Stale (ESTATE: copies
    queued); everything comes back."""
    errors, counts = [], {"consumed": 0, "acked": 0, "evict_ok": 0, "evict_busy": 0}
    lock = threading.Lock()
    stop = threading.Event()
    with _raw_pool("host", memory_size=16 * MiB, max_slices=256) as pool, \
            vmmt.Consumer() as c:

        def worker(tid):
            for i in range(150):
                src = np.full(128 + tid, tid * 100000 + i, np.int32)
                try:
                    d = pool.publish(src)
                except vmmt.NoRoom:
                    c.flush()
                    pool.reclaim()
                    continue
                try:
                    if (tid + i) % 2:
                        c.ack(d, ranks=0)
                        key = "acked"
                    else:
                        b = c.consume(d, ranks=0)
                        b.synchronize()
                        c.check(d)
                        got = np.from_dlpack(b).view(np.int32)
                        if not np.array_equal(got, src):
                            errors.append("thread %d item %d read %r" % (tid, i, got[:2]))
                        del got, b
                        key = "consumed"
                    c.flush()
                    with lock:
                        counts[key] += 1
                except BaseException as e:  # noqa: B902
                    errors.append("thread %d: %r" % (tid, e))
                    return

        def flusher():
            while not stop.is_set():
                try:
                    c.flush()
                except BaseException as e:  # noqa: B902
                    errors.append("flusher: %r" % e)
                    return

        def evicter():
            while not stop.is_set():
                try:
                    c.evict(pool.pool_id)
                    counts["evict_ok"] += 1
                except vmmt.Stale:
                    counts["evict_busy"] += 1
                except BaseException as e:  # noqa: B902
                    errors.append("evict: %r" % e)
                    return
                time.sleep(0.0005)

        workers = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        helpers = [threading.Thread(target=flusher) for _ in range(2)]
        helpers.append(threading.Thread(target=evicter))
        for t in workers + helpers:
            t.start()
        for t in workers:
            t.join(60)
        stop.set()
        for t in helpers:
            t.join(60)
        assert not any(t.is_alive() for t in workers + helpers), "a thread hung"
        assert not errors, errors[:5]
        assert counts["consumed"] + counts["acked"] > 300, counts
        deadline = time.monotonic() + DEADLINE
        while pool.stats()["in_flight"]:
            assert time.monotonic() < deadline, "slices still in flight: %r" % pool.stats()
            c.flush()
            pool.reclaim()


def test_flush_racing_close_in_a_child():
    """Flushers and a consuming thread run while the main thread closes the
    consumer (30 rounds): every flush returns or raises Closed, nothing
    faults (a child, so a fault is a failure, not a dead pytest)."""
    out = run_child("""
        import threading, time
        import numpy as np, vmmt
        pool = vmmt.Pool(memory_size=8 << 20, max_slices=256, memory_location="host")
        bad = []
        for r in range(30):
            c = vmmt.Consumer()
            stop, go = threading.Event(), threading.Barrier(5)
            def flusher():
                go.wait()
                while not stop.is_set():
                    try:
                        c.flush()
                    except vmmt.Closed:
                        return
                    except Exception as e:
                        bad.append(repr(e)); return
            def consumer():
                go.wait()
                while not stop.is_set():
                    try:
                        d = pool.publish(np.arange(64, dtype=np.int32))
                    except vmmt.NoRoom:
                        pool.reclaim(); continue
                    try:
                        b = c.consume(d, ranks=0)
                        if not np.array_equal(np.from_dlpack(b).view(np.int32), np.arange(64)):
                            bad.append("bytes")
                    except vmmt.Closed:
                        pool.cancel(d); return
                    except Exception as e:
                        bad.append(repr(e)); pool.cancel(d); return
            ts = [threading.Thread(target=flusher) for _ in range(3)]
            ts.append(threading.Thread(target=consumer))
            for t in ts: t.start()
            go.wait()
            time.sleep(0.001 * (r % 4))
            c.close()
            stop.set()
            for t in ts: t.join(20)
            assert not any(t.is_alive() for t in ts), "a thread hung"
        deadline = time.monotonic() + 10
        while pool.stats()["in_flight"] and time.monotonic() < deadline:
            pool.reclaim(); time.sleep(0.005)
        print("bad", bad[:3], "in_flight", pool.stats()["in_flight"])
        pool.close()
    """, timeout=60)
    assert "bad [] in_flight 0" in out, out


def _producer_child(conn):
    """A producer process: publishes one buffer, sends its descriptor,
    then waits to be killed."""
    pool = vmmt.Pool(memory_size=4 * MiB, memory_location="host")
    conn.send(bytes(pool.publish(np.arange(512, dtype=np.int32))))
    conn.send(bytes(pool.publish(np.arange(512, dtype=np.int32) + 1)))
    while True:
        time.sleep(1)


def test_flush_and_check_after_the_producer_was_killed():
    """A consume, then the producer SIGKILLed: flush returns at once, check
    of the completed copy is OK, and the undelivered descriptor is
    ProducerGone once the death is seen (bounded)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_producer_child, args=(child,), daemon=True)
    proc.start()
    child.close()
    try:
        assert parent.poll(60), "the producer did not publish within 60 s"
        d1, d2 = vmmt.Descriptor(parent.recv()), vmmt.Descriptor(parent.recv())
        with vmmt.Consumer(timeout_ms=2000) as c:
            b = c.consume(d1, ranks=0)
            b.synchronize()
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(30)
            t = time.monotonic()
            c.flush()
            c.check(d1)
            assert np.array_equal(np.from_dlpack(b).view(np.int32), np.arange(512))
            deadline = time.monotonic() + DEADLINE
            while True:
                c.flush()
                try:
                    c.ack(d2, ranks=0)
                except vmmt.ProducerGone as e:
                    assert "exited" in str(e)
                    break
                except vmmt.Stale:
                    pass  # released for the dead (nothing left to wait on)
                    break
                assert time.monotonic() < deadline, "the producer's death never showed"
                time.sleep(0.01)
            assert time.monotonic() - t < DEADLINE
            del b
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(30)


def test_finding_closed_errors_do_not_say_what_was_asked(clean):
    """FINDING 5 (error clarity): the brief's rule, every failure says what
    was asked, what was found and what to do."""
    c = vmmt.Consumer()
    c.close()
    with pytest.raises(vmmt.Closed) as flush_error:
        c.flush()
    pool = make_pool(pool="host")
    proxy = pool.wrap_tensor(np.ones(4, np.float32))
    pool.shutdown()
    try:
        pool.cancel_proxy(proxy)
        cancel_message = None
    except vmmt.Error as e:
        cancel_message = str(e)
    # A proxy of a pool shut down before this process first imported it.
    with pytest.raises(vmmt.Error) as rebuild_error:
        _wire(proxy).reconstruct_on_target_device(0)
    problems = []
    if not isinstance(rebuild_error.value, vmmt.ProducerGone) or \
            "may be retried" in str(rebuild_error.value):
        problems.append("reconstruct_on_target_device() of a proxy whose pool was shut down "
                        "before this process imported it: %s(status %s) %r, where "
                        "python/README.md says consumers of a closed pool get ProducerGone (an "
                        "engine's `except vmmt.ProducerGone: drop the request` misses it)"
                        % (type(rebuild_error.value).__name__,
                           getattr(rebuild_error.value, "status", None),
                           str(rebuild_error.value)[:120]))
    if "flush" not in str(flush_error.value):
        problems.append("Consumer.flush() after close(): %r (names no call, says nothing "
                        "to do)" % str(flush_error.value))
    if cancel_message is not None and "cancel" not in cancel_message:
        problems.append("CudaVmmMemoryPool.cancel_proxy() after shutdown(): %r (names no call; "
                        "after shutdown nothing is left to cancel, so a no-op would do)"
                        % cancel_message)
    assert not problems, "FINDING: unclear errors after close / shutdown: " + "; ".join(problems)


# ============================================================ vmmt.sglang

@pytest.mark.parametrize("kind", ["device", "elastic", "host"])
def test_recycle_right_after_every_release_path(clean, kind):
    """sglang's tests: release a slice, then at once (no polling) `with
    pool._lock: pool._recycle_chunks()` and read occupied_chunks. Rebuilds,
    rebuilds for all ranks, acknowledgements, releases, packed rebuilds and
    packed acknowledgements, 40 of each."""
    pool = make_pool(consumer_count=2, pool=kind)
    try:
        for n in range(40):
            for how in ("rebuild", "rebuild-all", "ack", "release", "packed", "packed-ack"):
                if how.startswith("packed"):
                    proxies = _wire(pool.wrap_tensors([np.arange(5, dtype=np.int32) + n,
                                                       np.ones(3)]))
                    if how == "packed":
                        got = [p.reconstruct_on_target_device(0, acknowledge_ranks=[0, 1])
                               for p in proxies]
                        assert got[0].tolist() == list(range(n, n + 5))
                    else:
                        proxies[1].acknowledge_consumption(2)
                else:
                    src = np.arange(n + 1, dtype=np.int32)
                    proxy = _wire(pool.wrap_tensor(src))
                    if how == "rebuild":
                        got = proxy.reconstruct_on_target_device(0, consumer_rank=0,
                                                                 acknowledge_ranks=[0, 1])
                        assert np.array_equal(got, src)
                    elif how == "rebuild-all":
                        assert np.array_equal(proxy.reconstruct_on_target_device(
                            0, consumer_count=2), src)
                    elif how == "ack":
                        proxy.acknowledge_consumption(2)
                    else:
                        proxy.release_without_reconstruction(2)
                with pool._lock:
                    pool._recycle_chunks()
                    occupied = pool.occupied_chunks
                    free = sum(c.size for c in pool.available_chunks)
                assert occupied == [] and free == pool.allocation_size, \
                    "FINDING: %s pool, %s #%d: still occupied right after _recycle_chunks: %r" % (
                        kind, how, n, occupied)
    finally:
        pool.shutdown()


def test_lock_is_reentrant_and_shutdown_inside_it(clean):
    pool = make_pool(pool="host")
    proxy = _wire(pool.wrap_tensor(np.arange(8, dtype=np.int32)))
    with pool._lock:
        with pool._lock:
            proxy.reconstruct_on_target_device(0)
            pool._recycle_chunks()
            pool._merge_chunks()
            assert pool.occupied_chunks == []
            pool.shutdown()
            pool.shutdown()
            assert pool.occupied_chunks == [] and pool.available_chunks == []
            assert pool._recycle_chunks() is None  # after shutdown: nothing to do
    with pytest.raises(RuntimeError, match="closing"):
        pool.wrap_tensor(np.ones(2))


def test_shutdown_while_another_thread_holds_the_lock(clean):
    """Bounded: shutdown(timeout_ms=300) from one thread while another sits
    in `with pool._lock:` returns or raises, never waits for the holder."""
    pool = make_pool(pool="host")
    proxy = pool.wrap_tensor(np.arange(8, dtype=np.int32))
    held, release = threading.Event(), threading.Event()

    def holder():
        with pool._lock:
            held.set()
            release.wait(30)
            pool._recycle_chunks()  # after shutdown, under the lock: nothing to do
            return pool.occupied_chunks

    h = _Call(holder)
    try:
        assert held.wait(DEADLINE)
        closer = _Call(lambda: pool.shutdown(timeout_ms=300))
        assert closer.done(DEADLINE), \
            "FINDING: shutdown(timeout_ms=300) waited over %ds for a thread holding _lock" % DEADLINE
        if closer.error is not None:
            assert isinstance(closer.error, RuntimeError) and str(closer.error)
    finally:
        release.set()
        assert h.done(DEADLINE)
    assert h.error is None, repr(h.error)
    pool.shutdown()
    with pytest.raises(vmmt.Error):  # (never imported here: the broker is gone; see finding 5)
        _wire(proxy).reconstruct_on_target_device(0)


def test_recycle_under_lock_from_many_threads_with_cache_clears(clean):
    """Six threads wrap, pickle, rebuild and recycle under _lock while a
    seventh clears the process's import cache (closing the consumer the
    flush writes through) every millisecond, for 2 s: every rebuilt tensor is
    its own, nothing raises, everything comes back, no thread, fd or driver
    object is left."""
    threads_before = _tasks()
    pool = make_pool(memory_size=8 * MiB, pool="host")
    stop = threading.Event()
    errors, done = [], [0]

    def worker(tid):
        i = 0
        while not stop.is_set():
            i += 1
            src = np.full(32 + tid, tid * 100000 + i, np.int32)
            proxy = pool.wrap_tensor(src)
            if isinstance(proxy, np.ndarray):
                with pool._lock:
                    pool._recycle_chunks()
                continue
            try:
                got = _wire(proxy).reconstruct_on_target_device(0, consumer_count=1)
                if not np.array_equal(got, src):
                    errors.append("thread %d #%d rebuilt %r" % (tid, i, got[:2]))
                done[0] += 1
            except BaseException as e:  # noqa: B902
                errors.append("thread %d #%d: %r" % (tid, i, e))
                pool.cancel_proxy(proxy)
                return
            with pool._lock:
                pool._recycle_chunks()
                pool.occupied_chunks
                pool.available_chunks

    def clearer():
        while not stop.is_set():
            vs._imported_pool_cache_clear()
            time.sleep(0.001)

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    ts.append(threading.Thread(target=clearer))
    hung = not _run_threads(ts, 2, stop)
    assert not hung, "a thread hung"
    assert not errors, "FINDING: " + "; ".join(errors[:5])
    assert done[0] > 100
    assert _settled(pool) == []
    pool.shutdown()
    vs._imported_pool_cache_clear()
    gc.collect()
    assert _tasks() <= threads_before, "threads left: %d -> %d" % (threads_before, _tasks())


def test_cancel_racing_rebuild_and_recycle(clean):
    """One thread cancels each proxy as soon as it is wrapped, another
    rebuilds it, a third recycles: a rebuild gets the right bytes or a
    vmmt.Error, never another tensor's; all slices come back. (Not held
    back: copies here run at once, so the window of finding 1 is not open.)"""
    pool = make_pool(memory_size=8 * MiB, pool="host")
    errors, outcomes = [], {"ok": 0, "refused": 0}
    stop = threading.Event()

    def recycler():
        while not stop.is_set():
            with pool._lock:
                pool._recycle_chunks()

    r = threading.Thread(target=recycler)
    r.start()
    try:
        for i in range(300):
            src = np.full(64, i, np.int32)
            proxy = pool.wrap_tensor(src)
            if isinstance(proxy, np.ndarray):
                continue
            wire = _wire(proxy)
            rebuild = _Call(lambda: wire.reconstruct_on_target_device(0, consumer_count=1))
            pool.cancel_proxy(proxy)
            pool.cancel_proxy(proxy)  # idempotent
            assert rebuild.done(DEADLINE), "a rebuild racing a cancel hung"
            if rebuild.error is None:
                if not np.array_equal(rebuild.value, src):
                    errors.append("#%d rebuilt %r" % (i, rebuild.value[:2]))
                outcomes["ok"] += 1
            elif isinstance(rebuild.error, vmmt.Error):
                outcomes["refused"] += 1
            else:
                errors.append("#%d: %r" % (i, rebuild.error))
    finally:
        stop.set()
        r.join(30)
    assert not errors, "FINDING: " + "; ".join(errors[:5])
    assert _settled(pool) == []
    pool.shutdown()


def test_resolver_recursing_into_recycle_and_rebuild(clean):
    """A rank resolver (called while a rebuild selects its ranks) that calls
    _recycle_chunks under _lock, reads the chunk lists and rebuilds another
    proxy: no deadlock, both tensors right."""
    pool = make_pool(consumer_count=2, pool="host")
    try:
        outer_src, inner_src = np.arange(8, dtype=np.int32), np.arange(4, dtype=np.int32) + 50
        outer_proxy = pool.wrap_tensor(outer_src)
        inner_proxy = pool.wrap_tensor(inner_src)
        outer, inner = _wire(outer_proxy), _wire(inner_proxy)
        seen = {}

        def resolver():
            if "inner" not in seen:
                seen["inner"] = None
                with pool._lock:
                    pool._recycle_chunks()
                    pool.occupied_chunks
                seen["inner"] = inner.reconstruct_on_target_device(0, consumer_count=1)
            return vs.ParallelLayout(attn_tp_rank=0, attn_tp_size=2)

        vs.set_rank_resolver(resolver)
        call = _Call(lambda: outer.reconstruct_on_target_device(0, consumer_count=1))
        assert call.done(DEADLINE), "FINDING: a resolver recursing into the pool deadlocked"
        assert call.error is None, repr(call.error)
        assert np.array_equal(call.value, outer_src)
        assert np.array_equal(seen["inner"], inner_src)
        vs.set_rank_resolver(vs.ParallelLayout(attn_tp_rank=1, attn_tp_size=2))
        _wire(outer_proxy).acknowledge_consumption(1)  # rank 1's part of both
        _wire(inner_proxy).acknowledge_consumption(1)
        assert _settled(pool) == []
    finally:
        vs.set_rank_resolver(None)
        pool.shutdown()


def test_resolver_that_raises_leaks_nothing(clean):
    """A resolver that raises: the error comes through, nothing is
    acknowledged or marked released, the same proxy rebuilds once a layout
    is there, and the slice comes back."""
    pool = make_pool(consumer_count=2, pool="host")
    try:
        proxy = _wire(pool.wrap_tensor(np.arange(8, dtype=np.int32)))

        def broken():
            raise LookupError("no parallel context yet")

        vs.set_rank_resolver(broken)
        for call in (lambda: proxy.reconstruct_on_target_device(0, consumer_count=1),
                     lambda: proxy.acknowledge_consumption(1)):
            with pytest.raises(LookupError):
                call()
        vs.set_rank_resolver(vs.ParallelLayout(attn_tp_rank=0, attn_tp_size=2))
        assert proxy.reconstruct_on_target_device(0, consumer_count=1).tolist() == list(range(8))
        assert len(_settled(pool, keep=1)) == 1  # rank 1 still owes it
        vs.set_rank_resolver(vs.ParallelLayout(attn_tp_rank=1, attn_tp_size=2))
        _wire(proxy).acknowledge_consumption(1)
        assert _settled(pool) == []
    finally:
        vs.set_rank_resolver(None)
        pool.shutdown()


@pytest.mark.parametrize("kind", ["device", "elastic", "host"])
def test_reconstruct_and_acknowledge_after_shutdown(clean, kind):
    """After shutdown a pickled proxy is ProducerGone, at once, saying the
    producer shut its pool down and what to do; a new pool in the same
    process does not make the old proxy read the new one's bytes."""
    pool = make_pool(pool=kind)
    old = pool.wrap_tensor(np.arange(8, dtype=np.int32))
    warm = _wire(pool.wrap_tensor(np.arange(8, dtype=np.int32)))
    warm.reconstruct_on_target_device(0)  # the pool is imported in this process
    pool.shutdown()
    t = time.monotonic()
    for call in (lambda: _wire(old).reconstruct_on_target_device(0),
                 lambda: _wire(old).acknowledge_consumption(1)):
        with pytest.raises(vmmt.ProducerGone, match="shut its pool down.*drop the request"):
            call()
    assert time.monotonic() - t < DEADLINE
    pool2 = make_pool(pool=kind)
    try:
        new = pool2.wrap_tensor(np.full(8, 5, np.int32))
        with pytest.raises(vmmt.Error):
            _wire(old).reconstruct_on_target_device(0)
        assert _wire(new).reconstruct_on_target_device(0).tolist() == [5] * 8
        assert _settled(pool2) == []
    finally:
        pool2.shutdown()


def test_consumer_count_selections_out_of_range_acknowledge_nothing(clean):
    """Every bad selection is a ValueError before anything is acknowledged:
    the slice is still owed by all four ranks afterwards."""
    pool = make_pool(consumer_count=4, pool="host")
    try:
        proxy = pool.wrap_tensor(np.arange(8, dtype=np.int32))
        vs.set_rank_resolver(vs.ParallelLayout(attn_tp_rank=1, attn_tp_size=2))
        for cc in (0, -1, 3, 5, 8, 2 ** 64, True, False, 1.0, "1"):
            for call in (lambda: _wire(proxy).reconstruct_on_target_device(0, consumer_count=cc),
                         lambda: _wire(proxy).acknowledge_consumption(cc),
                         lambda: _wire(proxy).release_without_reconstruction(cc)):
                with pytest.raises(ValueError, match="consumer_count"):
                    call()
        for cr in (-1, 4, True, 1.5):
            with pytest.raises(ValueError, match="consumer_rank"):
                _wire(proxy).reconstruct_on_target_device(0, consumer_rank=cr)
        for ar in ([4], [-1], [1.0], "01", [0, 1, 2, 3, 3], [], (True,)):
            with pytest.raises(ValueError, match="acknowledge_ranks"):
                _wire(proxy).acknowledge_consumption(acknowledge_ranks=ar)
        # A layout beyond the pool's ranks (attention group 2 of 2 ranks: ranks 4..5).
        vs.set_rank_resolver(vs.ParallelLayout(attn_tp_rank=1, attn_tp_size=2, attn_cp_rank=2))
        for cc in (None, 1, 2):
            with pytest.raises(ValueError, match=r"range \[4, 6\) is outside consumer_count=4"):
                _wire(proxy).reconstruct_on_target_device(0, consumer_count=cc)
        vs.set_rank_resolver(vs.ParallelLayout(attn_tp_rank=0, attn_tp_size=8))
        with pytest.raises(ValueError, match="outside consumer_count=4"):
            _wire(proxy).acknowledge_consumption(1)
        for bad in (dict(attn_tp_rank=2, attn_tp_size=2), dict(attn_tp_rank=-1, attn_tp_size=2),
                    dict(attn_tp_rank=0, attn_tp_size=0), dict(attn_tp_rank=True, attn_tp_size=2),
                    dict(attn_tp_rank=0, attn_tp_size=2, attn_cp_rank=-1)):
            with pytest.raises(ValueError):
                vs.ParallelLayout(**bad)
        # Nothing was acknowledged by any of that: each rank still can, once.
        pool._recycle_chunks()
        assert len(pool.occupied_chunks) == 1
        _wire(proxy).acknowledge_consumption(acknowledge_ranks=(3, 0, 2, 1))
        assert _settled(pool) == []
    finally:
        vs.set_rank_resolver(None)
        pool.shutdown()


def test_bare_proxy_selection_names_out_of_range(clean):
    vs.set_rank_resolver(vs.ParallelLayout(attn_tp_rank=1, attn_tp_size=2, attn_cp_rank=2))
    try:
        for cls in (vs.CudaVmmTensorTransportProxy, vs.CudaVmmPackedTensorTransportProxy):
            proxy = object.__new__(cls)
            proxy.consumer_count = 4
            for n in (None, 1, 2, 5):
                with pytest.raises(ValueError, match=r"\[4, 6\) is outside consumer_count=4"):
                    proxy._acknowledgement_range(n)
            assert proxy._acknowledgement_range(4) == (0, 4)
            for n in (0, -1, 3.0):
                with pytest.raises(ValueError, match="consumer_count must be (positive|an int)"):
                    proxy._acknowledgement_range(n)
    finally:
        vs.set_rank_resolver(None)


def test_finding_numpy_integers_refused_with_contradicting_messages(clean):
    """FINDING 4 (fixed 2026-12-07: any __index__ integer is taken): NumPy integers (what a rank computed with NumPy holds) are
    refused, and the messages contradict themselves. The binding's ranks=
    takes any __index__ integer (python/README.md); either take them here
    too or say "an int" instead of "positive" / "outside"."""
    pool = make_pool(consumer_count=4, pool="host")
    problems = []
    try:
        proxy = pool.wrap_tensor(np.arange(8, dtype=np.int32))
        vs.set_rank_resolver(vs.ParallelLayout(attn_tp_rank=0, attn_tp_size=2))
        for label, call in (
                ("consumer_count=np.int64(1)",
                 lambda: _wire(proxy).acknowledge_consumption(np.int64(1))),
                ("consumer_rank=np.int32(2)",
                 lambda: _wire(proxy).reconstruct_on_target_device(0, consumer_rank=np.int32(2))),
                ("acknowledge_ranks=[np.int64(1)]",
                 lambda: _wire(proxy).acknowledge_consumption(acknowledge_ranks=[np.int64(1)]))):
            try:
                call()
            except ValueError as e:
                problems.append("%s -> %r" % (label, str(e)))
    finally:
        vs.set_rank_resolver(None)
        pool.shutdown()
    assert not problems, "FINDING: NumPy integers refused with self-contradicting messages: " + \
        "; ".join(problems)


def test_finding_failed_acknowledge_ranks_acknowledged_some_ranks(clean):
    """FINDING 3 (fixed 2026-12-07: one vmmt_consume_ranks or
    vmmt_consumer_ack_ranks call, all or nothing): acknowledge_ranks=[0, 2] with rank 2 acknowledged already
    raises Stale "... nothing was acknowledged again", yet rank 0 was
    acknowledged by the failed call (a later ack for rank 0 is Stale). For a
    rebuild the rank's copy is lost: the retry for its own rank is Stale.
    Either all or nothing, or an error that says which ranks were done."""
    pool = make_pool(consumer_count=4, pool="host")
    problems = []
    try:
        proxy = pool.wrap_tensor(np.arange(8, dtype=np.int32))
        _wire(proxy).acknowledge_consumption(acknowledge_ranks=[2])
        with pytest.raises(vmmt.Stale, match="nothing was acknowledged again") as first:
            _wire(proxy).acknowledge_consumption(acknowledge_ranks=[0, 2])
        try:
            _wire(proxy).acknowledge_consumption(acknowledge_ranks=[0])
        except vmmt.Stale:
            problems.append("acknowledge_consumption(acknowledge_ranks=[0, 2]) raised %r but "
                            "acknowledged rank 0" % str(first.value))
            _wire(proxy).acknowledge_consumption(acknowledge_ranks=[1, 3])
        else:
            _wire(proxy).acknowledge_consumption(acknowledge_ranks=[1, 3])
        assert _settled(pool) == []

        proxy = pool.wrap_tensor(np.arange(8, dtype=np.int32))
        _wire(proxy).acknowledge_consumption(acknowledge_ranks=[3])
        wire = _wire(proxy)
        with pytest.raises(vmmt.Error) as first:
            wire.reconstruct_on_target_device(0, consumer_rank=0, acknowledge_ranks=[0, 3])
        try:
            got = wire.reconstruct_on_target_device(0, consumer_rank=0, acknowledge_ranks=[0])
            assert got.tolist() == list(range(8))
        except vmmt.Stale as e:
            problems.append("reconstruct(consumer_rank=0, acknowledge_ranks=[0, 3]) raised %r, "
                            "and the retry for rank 0 alone is %r: rank 0's copy was consumed "
                            "and thrown away" % (str(first.value), str(e)))
        for r in (0, 1, 2):
            try:
                _wire(proxy).acknowledge_consumption(acknowledge_ranks=[r])
            except vmmt.Stale:
                pass
        assert _settled(pool) == []
    finally:
        pool.shutdown()
    assert not problems, "FINDING: a failed multi-rank acknowledgement acknowledged some " \
        "ranks: " + "; ".join(problems)


def _rebuild_while_held(pool, proxy_wire):
    """Start a rebuild of proxy_wire on a thread, held back behind a legacy
    stall until its copy is queued; returns (stall, call)."""
    stall = _LegacyStall()
    before = _copies()
    call = _Call(lambda: proxy_wire.reconstruct_on_target_device(0, consumer_count=1))
    try:
        _wait_copies(before)
    except BaseException:
        stall.close()
        raise
    return stall, call


@pytest.mark.parametrize("packed", [False, True], ids=["single", "packed"])
def test_finding_rebuild_returns_another_buffers_bytes_after_cancel(clean, packed):
    """FINDING 1 (the worst kind; fixed 2026-12-07): a rank's reconstruct
    copy is queued; the producer cancels the proxy (cancel_proxy). Before,
    the slice was free at once, the next wrap took it with another tensor,
    and the reconstruct returned that tensor's bytes, raising nothing. Now
    the cancel leaves the queued copy its slice (docs/descriptor.md,
    "Acknowledgement words"): the next wrap does not get it, and the rebuild
    returns its own bytes (or is refused, for a packed member consumed after
    the cancel)."""
    pool = make_pool(pool="host")
    src = np.arange(1024, dtype=np.int32)
    try:
        if packed:
            proxies = pool.wrap_tensors([src, np.arange(4, dtype=np.int32)])
            victim, target = proxies[0], _wire(proxies)[0]
        else:
            victim = pool.wrap_tensor(src)
            target = _wire(victim)
        stall, call = _rebuild_while_held(pool, target)
        try:
            pool.cancel_proxy(victim)
            intruder = pool.wrap_tensor(np.full(1024, 9, np.int32))
            reused = intruder.control_offset == victim.control_offset
            assert packed or not reused, "FINDING: a wrap took a slice under a queued copy"
        finally:
            stall.release()
            assert call.done(DEADLINE), "the rebuild did not finish once released"
            stall.close()
        pool.cancel_proxy(intruder)
        assert _settled(pool) == []
    finally:
        pool.shutdown()
    if call.error is not None:
        assert isinstance(call.error, vmmt.Error), repr(call.error)
        return  # refused: the attack held
    got = np.asarray(call.value)
    assert np.array_equal(got, src), (
        "FINDING: reconstruct_on_target_device returned another tensor's bytes as success: "
        "the proxy (slot %d) was cancelled while its copy was queued, a new wrap %s the slot, "
        "and the rebuild gave %r instead of %r, raising nothing (Consumer.check() would have "
        "said ProducerGone)" % (victim.control_offset, "took" if reused else "did not take",
                                got[:4].tolist(), src[:4].tolist()))


def test_finding_recycle_waits_for_another_threads_stalled_rebuild(clean):
    """FINDING 2 (fixed 2026-12-07: a rebuild holds its own proxy's lock, not
    the module's): while one thread's reconstruct waits for its stream (here
    held back; on a GPU, a stream busy with other work), _recycle_chunks of
    ANY pool, acknowledge_consumption of an unrelated proxy (no copy at all)
    and _imported_pool_cache_clear wait for it. Consumer.flush itself never
    waits for a running copy (vmmt.h); test_raw_flush_does_not_wait_for_
    another_threads_copy shows that holds for the binding."""
    pool = make_pool(pool="host")
    other_pool = make_pool(pool="host")
    try:
        target = _wire(pool.wrap_tensor(np.arange(1024, dtype=np.int32)))
        unrelated = _wire(other_pool.wrap_tensor(np.arange(8, dtype=np.int32)))
        stall, rebuild = _rebuild_while_held(pool, target)
        try:
            calls = {"pool._recycle_chunks()": _Call(pool._recycle_chunks),
                     "other_pool._recycle_chunks()": _Call(other_pool._recycle_chunks),
                     "unrelated.acknowledge_consumption(1)":
                         _Call(lambda: unrelated.acknowledge_consumption(1)),
                     "_imported_pool_cache_clear()": _Call(vs._imported_pool_cache_clear)}
            deadline = time.monotonic() + 2.0
            blocked = [name for name, c in calls.items()
                       if not c.done(max(0.0, deadline - time.monotonic()))]
        finally:
            stall.release()
            assert rebuild.done(DEADLINE)
            for c in calls.values():
                assert c.done(DEADLINE)
            stall.close()
        assert rebuild.error is None, repr(rebuild.error)
        for c in calls.values():
            assert c.error is None, repr(c.error)
        _settled(pool)
        _settled(other_pool)
    finally:
        pool.shutdown()
        other_pool.shutdown()
    assert not blocked, ("FINDING: %s waited over 2 s, until another thread's rebuild (its copy "
                         "held on its stream) was let go: a process-wide wait bounded only by "
                         "the other thread's GPU stream" % ", ".join(blocked))


def test_raw_flush_does_not_wait_for_another_threads_copy(no_leaks):
    """The C contract the sglang layer loses in finding 2: one thread
    synchronizes a consume held on its stream; flush, another consume, check
    and reclaim on other threads return at once."""
    with _raw_pool("host") as pool, vmmt.Consumer() as c:
        d1 = pool.publish(np.arange(64, dtype=np.int32))
        d2 = pool.publish(np.arange(64, dtype=np.int32) + 1)
        s = _NBStall()
        try:
            b1 = c.consume(d1, stream=s.handle, ranks=0)
            waiter = _Call(b1.synchronize)
            for name, f in (("flush", c.flush), ("consume", lambda: c.consume(d2, ranks=0)),
                            ("check", lambda: c.check(d2)), ("reclaim", pool.reclaim)):
                call = _Call(f)
                assert call.done(2.0), "FINDING: Consumer.%s waited for another thread's " \
                    "held copy" % name
                assert call.error is None, repr(call.error)
            assert not waiter.done(0)
            s.release()
            assert waiter.done(DEADLINE)
            c.check(d1)
            del b1, call
        finally:
            s.close()
        deadline = time.monotonic() + DEADLINE
        while pool.stats()["in_flight"]:
            assert time.monotonic() < deadline
            c.flush()
            pool.reclaim()


# ============================================================ across processes

def _rank_server(conn, rank, size):
    """A rank process: ("rebuild", wire, kwargs) answers ("ok", values) or
    ("error", class name, message); None stops it."""
    vs.set_rank_resolver(vs.ParallelLayout(attn_tp_rank=rank, attn_tp_size=size))
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            _, wire, kwargs = msg
            try:
                proxy = pickle.loads(wire)
                if isinstance(proxy, list):
                    got = [p.reconstruct_on_target_device(rank, **kwargs).tolist() for p in proxy]
                else:
                    got = proxy.reconstruct_on_target_device(rank, **kwargs).tolist()
                conn.send(("ok", got))
            except Exception as e:  # noqa: B902 - reported to the test
                conn.send(("error", type(e).__name__, str(e)))
    finally:
        vs._imported_pool_cache_clear()
        conn.close()


@pytest.fixture
def two_ranks():
    """Two spawned rank processes, ranks 0 and 1 of an attention group of 2.
    (No fd check: spawn starts multiprocessing's resource tracker.)"""
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_rank_server, args=(child, r, 2), daemon=True)
             for r, (_, child) in enumerate(pipes)]
    for p in procs:
        p.start()
    for _, child in pipes:
        child.close()
    ends = [parent for parent, _ in pipes]

    def ask(rank, wire, **kwargs):
        ends[rank].send(("rebuild", wire, kwargs))
        assert ends[rank].poll(60), "rank %d did not answer within 60 s" % rank
        return ends[rank].recv()

    try:
        yield ask, ends
    finally:
        for e in ends:
            try:
                e.send(None)
            except OSError:
                pass
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(30)
        for e in ends:
            e.close()


@pytest.fixture
def clean_but_fds():
    """`clean` without its fd check (spawn starts multiprocessing's resource
    tracker, whose pipe stays open in this process for good)."""
    previous = vs.set_rank_resolver(None)
    yield
    vs.set_rank_resolver(previous)
    vs._imported_pool_cache_clear()


def test_pickles_in_other_processes_after_the_slice_was_recycled(clean_but_fds, two_ranks):
    """Ranks in other processes: the producer recycles a slice (bounded
    poll: a rank's acknowledgement is its own thread's), fills it with
    another tensor, and resends the OLD pickle: refused, never the new
    bytes. Then two processes race one proxy for the same rank: exactly
    one gets the bytes. Then packed members after recycle."""
    ask, ends = two_ranks
    pool = make_pool(consumer_count=2, pool="host")
    try:
        src = np.arange(64, dtype=np.int32)
        first = pool.wrap_tensor(src)
        old_wire = pickle.dumps(first)
        for r in (0, 1):
            assert ask(r, old_wire, consumer_count=1) == ("ok", src.tolist())
        assert _settled(pool) == []
        second = pool.wrap_tensor(np.full(64, 7, np.int32))
        assert second.control_offset == first.control_offset, "the slot was not reused"
        for r in (0, 1):
            answer = ask(r, old_wire, consumer_count=1)
            assert answer[0] == "error", \
                "FINDING: rank %d rebuilt a recycled proxy: %r" % (r, answer[1][:4])
            assert answer[1] in ("Stale", "Error", "RuntimeError"), answer
        assert len(_settled(pool, keep=1)) == 1  # `second` untouched by the refusals

        # Two processes race rank 0 of `second` (consumer_rank=0, so both ask for rank 0).
        wire = pickle.dumps(second)
        for e in ends:
            e.send(("rebuild", wire, {"consumer_rank": 0, "acknowledge_ranks": [0]}))
        answers = []
        for e in ends:
            assert e.poll(60)
            answers.append(e.recv())
        ok = [a for a in answers if a[0] == "ok"]
        assert len(ok) == 1 and ok[0][1] == [7] * 64, \
            "FINDING: two processes rebuilding one rank's proxy: %r" % (answers,)
        assert len(_settled(pool, keep=1)) == 1  # rank 1 still owes it
        assert ask(1, wire, consumer_count=1) == ("ok", [7] * 64)
        assert _settled(pool) == []

        packed = pool.wrap_tensors([np.arange(3, dtype=np.int32), np.ones(2)])
        packed_wire = pickle.dumps(packed)
        for r in (0, 1):
            assert ask(r, packed_wire, consumer_count=1)[0] == "ok"
        assert _settled(pool) == []
        pool.wrap_tensors([np.full(3, 4, np.int32), np.zeros(2)])
        for r in (0, 1):
            answer = ask(r, packed_wire, consumer_count=1)
            assert answer[0] == "error", \
                "FINDING: a recycled packed proxy rebuilt in rank %d: %r" % (r, answer)
    finally:
        pool.shutdown()
    # After shutdown, a proxy in another process: ProducerGone, at once.
    answer = ask(0, wire, consumer_count=1)
    assert answer[0] == "error" and answer[1] in ("ProducerGone", "Stale"), answer
