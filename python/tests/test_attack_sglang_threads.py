"""Outside attacks, with threads and a careless user's sequences, on
vmmt.sglang's rebuilds since 2026-12-07 (a rebuild holds only its own
proxy's lock, a packed member its owner's; a cancel under a rank's queued
rebuild copy leaves the copy its slice; a rebuild of a proxy whose pool was
shut down before this process imported it is ProducerGone). Written from
python/README.md ("From sglang"), vmmt/sglang.py's docstring, sglang.pyi and
docs/reliability.md alone.

How a rebuild is held: its copy waits behind the legacy default stream, so
a blocking stalled stream of the emulated driver (emu_counters.StalledStream)
holds it queued; every stall has a watchdog that lets it go after a few
seconds, so a failing test still ends. Every wait is bounded.

Finding (fixed 2026-12-07: a rebuild leases the process's consumer, which a
cache clear closes only once the rebuild is done):
1. test_finding_packed_rebuild_racing_cache_clear_holds_its_slice: a packed
   member's rebuild racing _imported_pool_cache_clear() raises vmmt.Closed
   ("make a new vmmt.Consumer"), the proxy then says "already released",
   and the slice stays in flight for good (a fresh pickle is Stale: the
   closed consumer's take is never given back). Singles under the same race
   hold.
"""
import gc
import multiprocessing as mp
import os
import pickle
import threading
import time

import numpy as np
import pytest

import emu_counters
from sglang_fixtures import MiB, clean, make_pool, vmmt, vs  # noqa: F401
from sglang_threads import Call as _Call, LegacyStall as _Stall, wire as _wire
from sglang_threads import copies as _copies, run_threads as _run_threads
from sglang_threads import wait_copies as _wait_copies

DEADLINE = 10.0


# ------------------------------------------------------------------ helpers

def _all_done(calls, timeout=DEADLINE):
    deadline = time.monotonic() + timeout
    return all(c.done(max(0.0, deadline - time.monotonic())) for c in calls)


def _settled(pool, keep=0):
    deadline = time.monotonic() + DEADLINE
    while True:
        with pool._lock:
            pool._recycle_chunks()
            occupied = pool.occupied_chunks
        if len(occupied) <= keep:
            return occupied
        assert time.monotonic() < deadline, "slices still in flight after %ds: %r %r" % (
            DEADLINE, occupied, pool.stats())
        time.sleep(0.005)


def _empty(pool):
    assert _settled(pool) == []
    st = pool.stats()
    assert st["in_flight"] == 0 and st["in_flight_bytes"] == 0, st
    assert sum(c.size for c in pool.available_chunks) == pool.allocation_size or \
        pool.pool_kind == "elastic"


def _tasks():
    return len(os.listdir("/proc/self/task"))


def _held_rebuild(proxy, **kw):
    """A rebuild of `proxy` on a thread, its copy queued behind a stall."""
    stall = _Stall()
    before = _copies()
    call = _Call(lambda: proxy.reconstruct_on_target_device(0, **kw))
    try:
        _wait_copies(before)
    except BaseException:
        stall.close()
        raise
    return stall, call


# ======================================== one proxy rebuilt from many threads

@pytest.mark.parametrize("kind", ["device", "elastic", "host"])
def test_same_proxy_from_many_threads_is_one_tensor(clean, kind):
    """Eight threads rebuild one proxy object at once (a barrier), 25 rounds:
    every thread gets the same tensor, its bytes, no error; the rank is
    acknowledged once (rank 1 still owes it and can acknowledge once)."""
    pool = make_pool(consumer_count=2, pool=kind)
    vs.set_rank_resolver(vs.ParallelLayout(attn_tp_rank=0, attn_tp_size=2))
    try:
        for n in range(25):
            src = np.arange(100 + n, dtype=np.int32) * (n + 1)
            proxy = _wire(pool.wrap_tensor(src))
            go = threading.Barrier(8)
            calls = [_Call(lambda: (go.wait(DEADLINE),
                                    proxy.reconstruct_on_target_device(0, consumer_count=1))[1])
                     for _ in range(8)]
            assert _all_done(calls), "a concurrent rebuild of one proxy hung"
            errors = [repr(c.error) for c in calls if c.error is not None]
            assert not errors, "round %d: %s" % (n, errors)
            first = calls[0].value
            assert all(c.value is first for c in calls), \
                "round %d: threads got different tensors for one proxy" % n
            assert np.array_equal(first, src)
            assert len(_settled(pool, keep=1)) == 1, "rank 1 never acknowledged, yet freed"
            vs.set_rank_resolver(vs.ParallelLayout(attn_tp_rank=1, attn_tp_size=2))
            _wire(proxy).acknowledge_consumption(1)
            vs.set_rank_resolver(vs.ParallelLayout(attn_tp_rank=0, attn_tp_size=2))
            _empty(pool)
    finally:
        vs.set_rank_resolver(None)
        pool.shutdown()


def test_same_proxy_while_its_first_rebuild_is_held(clean):
    """A rebuild's copy held on its stream; four more threads rebuild the
    same proxy object: none returns before the copy is let go (nor with
    another tensor), all get the first's tensor with its bytes after; an
    unrelated proxy of the same pool rebuilds meanwhile."""
    pool = make_pool(pool="host")
    try:
        src = np.arange(2048, dtype=np.int32)
        proxy = _wire(pool.wrap_tensor(src))
        other_src = np.arange(16, dtype=np.int32) + 7
        other = _wire(pool.wrap_tensor(other_src))
        stall, first = _held_rebuild(proxy, consumer_count=1)
        try:
            more = [_Call(lambda: proxy.reconstruct_on_target_device(0, consumer_count=1))
                    for _ in range(4)]
            early = [c for c in more if c.done(0.3)]
            assert not first.done(0)
            # Another proxy's own copy waits behind the same legacy stall,
            # so only its start is checked here: it must not be refused.
            unrelated = _Call(lambda: other.reconstruct_on_target_device(0, consumer_count=1))
        finally:
            stall.release()
            assert first.done(DEADLINE)
            assert _all_done(more) and unrelated.done(DEADLINE)
            stall.close()
        assert first.error is None, repr(first.error)
        assert np.array_equal(first.value, src)
        assert not [c for c in early if c.error is None], \
            "a second rebuild returned while the first's copy was still queued"
        for c in more:
            assert c.error is None and c.value is first.value, repr(c.error)
        assert unrelated.error is None and np.array_equal(unrelated.value, other_src)
        _empty(pool)
    finally:
        pool.shutdown()


def test_copies_of_one_proxy_race_for_one_rank(clean):
    """Six unpickled copies of one proxy (six objects, one rank) rebuilt at
    once, 20 rounds: exactly one gets the bytes, the others a vmmt.Error
    (a descriptor is consumed once per rank), never a second copy."""
    pool = make_pool(pool="host")
    try:
        for n in range(20):
            src = np.full(64, n, np.int32)
            wire = pickle.dumps(pool.wrap_tensor(src))
            copies = [pickle.loads(wire) for _ in range(6)]
            go = threading.Barrier(6)
            calls = [_Call(lambda p=p: (go.wait(DEADLINE),
                                        p.reconstruct_on_target_device(0))[1]) for p in copies]
            assert _all_done(calls)
            ok = [c for c in calls if c.error is None]
            bad = [c.error for c in calls if c.error is not None]
            assert len(ok) == 1, "round %d: %d copies rebuilt one rank's slice (%r)" % (
                n, len(ok), bad)
            assert np.array_equal(ok[0].value, src)
            assert all(isinstance(e, vmmt.Error) for e in bad), bad
            _empty(pool)
    finally:
        pool.shutdown()


# ===================================================== packed members

@pytest.mark.parametrize("kind", ["device", "host"])
def test_packed_members_from_different_threads(clean, kind):
    """One packed list of five members, each rebuilt by its own thread at
    once (plus a duplicate thread per member), 20 rounds: each member its
    bytes, all views of the owner's one tensor, one acknowledgement."""
    pool = make_pool(pool=kind)
    try:
        for n in range(20):
            srcs = [np.arange(3 + i + n, dtype=np.int32) * (i + 1) for i in range(4)]
            srcs.append(np.full(5, n + 0.5, np.float64))
            proxies = _wire(pool.wrap_tensors(srcs))
            assert len(proxies) == 5
            go = threading.Barrier(10)
            calls = [_Call(lambda p=p: (go.wait(DEADLINE),
                                        p.reconstruct_on_target_device(0))[1])
                     for p in proxies + proxies]
            assert _all_done(calls)
            errors = [repr(c.error) for c in calls if c.error is not None]
            assert not errors, "round %d: %s" % (n, errors)
            for i, s in enumerate(srcs):
                a, b = calls[i].value, calls[i + 5].value
                assert a is b, "member %d rebuilt twice" % i
                assert np.array_equal(a, s), "member %d: %r" % (i, a[:4])
                assert np.shares_memory(a, proxies[0]._packed_owner.reconstruct_tensor)
            _empty(pool)
    finally:
        pool.shutdown()


def test_packed_member_while_another_member_is_held(clean):
    """Member 0's rebuild held on its stream; member 1 on another thread
    waits for the owner (does not return before), then has its bytes."""
    pool = make_pool(pool="host")
    try:
        a, b = np.arange(1024, dtype=np.int32), np.arange(8, dtype=np.float32) + 0.25
        proxies = _wire(pool.wrap_tensors([a, b]))
        stall, first = _held_rebuild(proxies[0])
        try:
            second = _Call(lambda: proxies[1].reconstruct_on_target_device(0))
            early = second.done(0.3) and second.error is None
        finally:
            stall.release()
            assert first.done(DEADLINE) and second.done(DEADLINE)
            stall.close()
        assert first.error is None and second.error is None, (first.error, second.error)
        assert not early, "member 1 returned while the group's copy was still queued"
        assert np.array_equal(first.value, a) and np.array_equal(second.value, b)
        _empty(pool)
    finally:
        pool.shutdown()


def test_release_of_a_member_while_another_members_rebuild_is_held(clean):
    """Member 0's rebuild held on its stream; another thread releases member
    1 (release_without_reconstruction: "releasing one packed member releases
    the group") and the producer wraps intruders: bounded; member 0 gets its
    own bytes (or a clear error), no wrap takes the slice under the copy,
    member 1 then refuses to rebuild, and the slice comes back."""
    pool = make_pool(pool="host", memory_size=2 * MiB)
    try:
        a = np.arange(1 << 17, dtype=np.int32)  # 512 KiB
        proxies = _wire(pool.wrap_tensors([a, np.arange(4, dtype=np.int32)]))
        stall, first = _held_rebuild(proxies[0])
        intruders = []
        try:
            rel = _Call(lambda: proxies[1].release_without_reconstruction(1))
            rel.done(0.3)
            for _ in range(5):
                p = pool.wrap_tensor(np.full(1 << 17, 9, np.int32))
                if isinstance(p, np.ndarray):
                    break
                intruders.append(p)
        finally:
            stall.release()
            assert first.done(DEADLINE) and rel.done(DEADLINE)
            stall.close()
        for p in intruders:
            pool.cancel_proxy(p)
        assert len(intruders) <= 3, "a wrap took the group's slice under its queued copy"
        assert rel.error is None or isinstance(rel.error, (vmmt.Error, RuntimeError)), rel.error
        if first.error is None:
            assert np.array_equal(first.value, a), "member 0 read another tensor's bytes"
        else:
            assert isinstance(first.error, (vmmt.Error, RuntimeError)), repr(first.error)
        with pytest.raises((vmmt.Error, RuntimeError)):
            proxies[1].reconstruct_on_target_device(0)
        _empty(pool)
    finally:
        pool.shutdown()


# ============================== rebuild racing ack / release of the same proxy

@pytest.mark.parametrize("how", ["ack", "release"])
def test_rebuild_racing_ack_of_the_same_proxy(clean, how):
    """Thread A rebuilds a proxy, thread B acknowledges (or releases) the
    same proxy object at once, 60 rounds: the rebuild gets its bytes, or a
    clear error ("already released"); B returns or raises vmmt.Error /
    RuntimeError; nothing else; the slice always comes back."""
    pool = make_pool(pool="host")
    outcomes = {}
    try:
        for n in range(60):
            src = np.full(256, n, np.int32)
            proxy = _wire(pool.wrap_tensor(src))
            go = threading.Barrier(2)
            other = (proxy.acknowledge_consumption if how == "ack"
                     else proxy.release_without_reconstruction)
            r = _Call(lambda: (go.wait(DEADLINE), proxy.reconstruct_on_target_device(0))[1])
            b = _Call(lambda: (go.wait(DEADLINE), other(1))[1])
            assert _all_done([r, b]), "round %d hung" % n
            if r.error is None:
                assert np.array_equal(r.value, src), "round %d: wrong bytes %r" % (n, r.value[:3])
                key = "rebuilt"
            else:
                assert isinstance(r.error, (vmmt.Error, RuntimeError)), repr(r.error)
                assert "released" in str(r.error), repr(r.error)
                key = "refused"
            if b.error is not None:
                assert isinstance(b.error, (vmmt.Error, RuntimeError)), repr(b.error)
                key += "/b-raised"
            outcomes[key] = outcomes.get(key, 0) + 1
            _empty(pool)
            # Once the race is over the proxy is settled: a rebuild is the cached
            # tensor or "already released", never a fresh consume.
            try:
                again = proxy.reconstruct_on_target_device(0)
                assert r.error is None and again is r.value
            except RuntimeError as e:
                assert "released" in str(e)
    finally:
        pool.shutdown()
    assert sum(outcomes.values()) == 60, outcomes


def test_ack_while_the_same_proxys_rebuild_is_held(clean):
    """A rebuild held; acknowledge_consumption of the same proxy from another
    thread: bounded, and the rebuild still returns its own bytes (the ack
    must not free the slice under the queued copy, nor void the rebuild)."""
    pool = make_pool(pool="host", consumer_count=1)
    try:
        src = np.arange(4096, dtype=np.int32)
        proxy = _wire(pool.wrap_tensor(src))
        stall, r = _held_rebuild(proxy)
        try:
            ack = _Call(lambda: proxy.acknowledge_consumption(1))
            ack.done(0.3)
            intruders = []
            for _ in range(4):
                p = pool.wrap_tensor(np.full(4096, 9, np.int32))
                intruders.append(p)
        finally:
            stall.release()
            assert r.done(DEADLINE) and ack.done(DEADLINE)
            stall.close()
        for p in intruders:
            pool.cancel_proxy(p)
        assert r.error is None, repr(r.error)
        assert np.array_equal(r.value, src), "the held rebuild read another tensor: %r" % (
            r.value[:3],)
        assert ack.error is None or isinstance(ack.error, (vmmt.Error, RuntimeError))
        _empty(pool)
    finally:
        pool.shutdown()


# ================================= rebuild racing the process's consumer close

def test_cache_clear_under_a_held_rebuild(clean):
    """A rebuild's copy queued; another thread clears the process's import
    cache (its consumer closed): the clear is bounded, the rebuild returns
    its bytes or a vmmt error, the slice comes back, the next rebuild works
    (a new consumer) and nothing leaks (the `clean` fixture)."""
    pool = make_pool(pool="host")
    try:
        src = np.arange(4096, dtype=np.int32)
        proxy = _wire(pool.wrap_tensor(src))
        stall, r = _held_rebuild(proxy)
        try:
            clear = _Call(vs._imported_pool_cache_clear)
            cleared_early = clear.done(2.0)
        finally:
            stall.release()
            assert r.done(DEADLINE), "the rebuild hung after the cache clear"
            assert clear.done(DEADLINE), "the cache clear hung"
            stall.close()
        assert clear.error is None, repr(clear.error)
        if r.error is None:
            assert np.array_equal(r.value, src), "wrong bytes after a cache clear"
        else:
            assert isinstance(r.error, (vmmt.Error, RuntimeError)), repr(r.error)
        _empty(pool)
        nxt = np.arange(8, dtype=np.int32) + 3
        assert np.array_equal(_wire(pool.wrap_tensor(nxt)).reconstruct_on_target_device(0), nxt)
        _empty(pool)
        assert cleared_early, "_imported_pool_cache_clear waited for another thread's " \
            "held rebuild"
    finally:
        pool.shutdown()


@pytest.mark.parametrize("mix", ["singles+clear", "packed+recycle"])
def test_rebuilds_of_several_pools_racing_cache_clear_and_recycle(clean, mix):
    """Five threads wrap and rebuild in three pools (device, elastic, host),
    singles (and packed, for "packed+recycle"), while one thread recycles
    every pool under its lock (and, for "singles+clear", another clears the
    import cache): every success its own bytes, every failure a vmmt error,
    everything comes back, no thread left. (Packed rebuilds racing the cache
    clear: test_finding_packed_rebuild_racing_cache_clear_holds_its_slice.)"""
    packed_too, clearing = mix == "packed+recycle", mix == "singles+clear"
    threads_before = _tasks()
    pools = [make_pool(memory_size=4 * MiB, pool=k) for k in ("device", "elastic", "host")]
    stop = threading.Event()
    errors, done, refused = [], [0], [0]

    def worker(tid):
        i = 0
        while not stop.is_set():
            i += 1
            pool = pools[(tid + i) % 3]
            try:
                if packed_too and i % 4 == 0:
                    srcs = [np.full(9 + tid, tid * 1000 + i, np.int32),
                            np.full(3, i + 0.5, np.float64)]
                    proxies = pool.wrap_tensors(srcs)
                    if proxies is None:
                        continue
                    wire = _wire(proxies)
                    got = [p.reconstruct_on_target_device(0) for p in wire[::-1]][::-1]
                else:
                    srcs = [np.full(33 + tid, tid * 1000 + i, np.int32)]
                    p = pool.wrap_tensor(srcs[0])
                    if isinstance(p, np.ndarray):
                        continue
                    got = [_wire(p).reconstruct_on_target_device(0)]
                for g, s in zip(got, srcs):
                    if not np.array_equal(g, s):
                        errors.append("thread %d #%d got %r for %r" % (tid, i, g[:2], s[:2]))
                done[0] += 1
            except vmmt.Error:
                refused[0] += 1
            except BaseException as e:  # noqa: B902
                errors.append("thread %d #%d: %r" % (tid, i, e))
                return

    def recycler():
        while not stop.is_set():
            for pool in pools:
                with pool._lock:
                    pool._recycle_chunks()
                    pool.occupied_chunks
            time.sleep(0.0005)

    def clearer():
        while not stop.is_set():
            vs._imported_pool_cache_clear()
            time.sleep(0.003)

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(5)]
    ts.append(threading.Thread(target=recycler))
    if clearing:
        ts.append(threading.Thread(target=clearer))
    hung = not _run_threads(ts, 1.5, stop)
    try:
        assert not hung, "a thread hung"
        assert not errors, errors[:5]
        assert done[0] > 50, (done, refused)
        for pool in pools:
            _empty(pool)
    finally:
        for pool in pools:
            pool.shutdown()
    vs._imported_pool_cache_clear()
    gc.collect()
    deadline = time.monotonic() + DEADLINE
    while _tasks() > threads_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _tasks() <= threads_before, "threads left: %d -> %d" % (threads_before, _tasks())


def test_finding_packed_rebuild_racing_cache_clear_holds_its_slice(clean):
    """A thread clears the process's import cache every half millisecond
    (as the flush attack's test does); the main thread wraps a packed pair,
    pickles it and rebuilds member 0 then member 1, until a rebuild raises
    (at most 3 s; it raised at the first or second pair in every run).
    What happens: member 0's rebuild raises vmmt.Closed "Consumer.consume:
    this consumer is closed (Consumer.close ran): make a new vmmt.Consumer"
    (an sglang caller made no Consumer); afterwards both members say
    "already released", acknowledge/release return None, a fresh pickle is
    Stale ("already acknowledged, or is being consumed, for rank 0"), and
    the slice stays in flight for good (still after 0.5 s of recycling).
    Single proxies under the same race never raise (singles+clear above).
    The docs: "A failed rebuild releases, and says so ... where even that
    acknowledgement cannot be written, the error says the slice is still
    held and the call may be retried"; the brief's rule: a rebuild racing
    the consumer's close gives the bytes or a clear error, and the slice is
    not held for good."""
    pool = make_pool(pool="host")
    stop = threading.Event()

    def clearer():
        while not stop.is_set():
            vs._imported_pool_cache_clear()
            time.sleep(0.0005)

    c = threading.Thread(target=clearer)
    c.start()
    failure, n = None, 0
    try:
        t0 = time.monotonic()
        while failure is None and time.monotonic() - t0 < 3.0:
            n += 1
            srcs = [np.full(9, n, np.int32), np.full(3, n + 0.5)]
            members = _wire(pool.wrap_tensors(srcs))
            for m, s in zip(members, srcs):
                try:
                    got = m.reconstruct_on_target_device(0)
                except vmmt.Error as e:
                    failure = e
                    break
                assert np.array_equal(got, s), "wrong bytes"
    finally:
        stop.set()
        c.join(DEADLINE)
    try:
        assert not c.is_alive()
        problems = []
        if failure is not None:
            if "still held" not in str(failure) and isinstance(failure, vmmt.Closed):
                problems.append("pair %d: the rebuild raised %s %r" % (
                    n, type(failure).__name__, str(failure)))
        deadline = time.monotonic() + 0.5
        while pool.stats()["in_flight"] and time.monotonic() < deadline:
            with pool._lock:
                pool._recycle_chunks()
            time.sleep(0.01)
        if pool.stats()["in_flight"]:
            problems.append("%d slice(s) still in flight after the failed rebuild and 0.5 s "
                            "of recycling" % pool.stats()["in_flight"])
        assert not problems, "; ".join(problems)
    finally:
        pool.shutdown()


# ============================================ rebuild racing cancel / shutdown

def test_cancel_under_a_held_rebuild_then_many_wraps(clean):
    """cancel_proxy (twice) while a rank's rebuild copy is queued, then
    wraps until the pool is full: no wrap takes the slice under the copy,
    the rebuild returns its own bytes; after, the slice comes back."""
    pool = make_pool(pool="host", memory_size=2 * MiB)
    try:
        src = np.arange(1 << 17, dtype=np.int32)  # 512 KiB
        victim = pool.wrap_tensor(src)
        stall, r = _held_rebuild(_wire(victim))
        intruders = []
        try:
            pool.cancel_proxy(victim)
            pool.cancel_proxy(victim)
            for _ in range(6):
                with pool._lock:
                    pool._recycle_chunks()
                p = pool.wrap_tensor(np.full(1 << 17, 9, np.int32))
                if isinstance(p, np.ndarray):
                    break
                intruders.append(p)
            # 2 MiB hold four 512 KiB slices: with the victim's kept, three fit.
            overlap = [p.control_offset for p in intruders
                       if p.control_offset == victim.control_offset]
            if len(intruders) > 3:
                overlap.append("%d intruders fit beside the victim" % len(intruders))
        finally:
            stall.release()
            assert r.done(DEADLINE)
            stall.close()
        for p in intruders:
            pool.cancel_proxy(p)
        assert not overlap, "a wrap took the cancelled slice under a queued copy"
        if r.error is None:
            assert np.array_equal(r.value, src), "the rebuild returned another tensor's bytes"
        else:
            assert isinstance(r.error, vmmt.Error), repr(r.error)
        _empty(pool)
    finally:
        pool.shutdown()


def test_shutdown_under_a_held_rebuild_is_bounded(clean):
    """cancel_proxy then shutdown(timeout_ms=500) in the producer while a
    rank's rebuild copy is queued: shutdown returns or raises within its
    bound; the rebuild returns its own bytes or ProducerGone; a later
    rebuild of another proxy of that pool is ProducerGone saying what to do;
    shutdown again finishes."""
    pool = make_pool(pool="host")
    src = np.arange(4096, dtype=np.int32)
    victim = pool.wrap_tensor(src)
    later = pool.wrap_tensor(np.arange(8, dtype=np.int32))
    stall, r = _held_rebuild(_wire(victim))
    try:
        pool.cancel_proxy(victim)
        t = time.monotonic()
        sd = _Call(lambda: pool.shutdown(timeout_ms=500))
        assert sd.done(5.0), "shutdown(timeout_ms=500) did not return within 5 s"
        took = time.monotonic() - t
    finally:
        stall.release()
        assert r.done(DEADLINE)
        stall.close()
    pool.shutdown()
    assert took < 5.0
    if sd.error is not None:
        assert isinstance(sd.error, (RuntimeError, vmmt.Error)) and str(sd.error)
    if r.error is None:
        assert np.array_equal(r.value, src), "rebuild under shutdown returned wrong bytes"
    else:
        assert isinstance(r.error, vmmt.ProducerGone), repr(r.error)
    with pytest.raises(vmmt.ProducerGone, match="drop the request"):
        _wire(later).reconstruct_on_target_device(0)


def test_rebuild_racing_cancel_and_shutdown_from_threads(clean):
    """Ten proxies rebuilt by ten threads while the producer cancels them all
    and shuts down, 6 rounds: each rebuild its own bytes or a vmmt.Error
    (ProducerGone once the pool is down), nothing hangs."""
    for n in range(6):
        pool = make_pool(pool=("host", "device")[n % 2])
        srcs = [np.full(512, n * 100 + i, np.int32) for i in range(10)]
        proxies = [pool.wrap_tensor(s) for s in srcs]
        wires = [_wire(p) for p in proxies]
        go = threading.Event()
        calls = [_Call(lambda w=w: w.reconstruct_on_target_device(0), start=go) for w in wires]
        go.set()
        for p in proxies:
            pool.cancel_proxy(p)
        sd = _Call(lambda: pool.shutdown(timeout_ms=1000))
        assert _all_done(calls + [sd]), "round %d hung" % n
        pool.shutdown()
        for c, s in zip(calls, srcs):
            if c.error is None:
                assert np.array_equal(c.value, s), "round %d: wrong bytes %r" % (n, c.value[:2])
            else:
                assert isinstance(c.error, vmmt.Error), repr(c.error)
        vs._imported_pool_cache_clear()


# =========================================== after shutdown: ProducerGone

@pytest.mark.parametrize("kind", ["device", "elastic", "host"])
def test_never_imported_pool_shut_down_is_producer_gone_from_threads(clean, kind):
    """A pool shut down before this process imported it: eight threads
    rebuild (single and packed members), acknowledge and release pickles of
    its proxies at once: every one ProducerGone, saying what to do, bounded."""
    pool = make_pool(pool=kind)
    single = pickle.dumps(pool.wrap_tensor(np.arange(8, dtype=np.int32)))
    packed = pickle.dumps(pool.wrap_tensors([np.ones(4), np.arange(3, dtype=np.int32)]))
    pool.shutdown()
    ops = [lambda: pickle.loads(single).reconstruct_on_target_device(0),
           lambda: pickle.loads(packed)[1].reconstruct_on_target_device(0),
           lambda: pickle.loads(single).acknowledge_consumption(1),
           lambda: pickle.loads(packed)[0].release_without_reconstruction(1)]
    go = threading.Barrier(8)
    calls = [_Call(lambda f=ops[i % 4]: (go.wait(DEADLINE), f())[1]) for i in range(8)]
    assert _all_done(calls)
    for c in calls:
        assert isinstance(c.error, vmmt.ProducerGone), repr(c.error)
        assert "drop the request" in str(c.error), str(c.error)
        assert "may be retried" not in str(c.error)


def test_one_proxy_object_after_shutdown_from_threads(clean):
    """One proxy object, its pool shut down, rebuilt by six threads at once,
    twice: each raises ProducerGone (no thread caches a tensor, none hangs)."""
    pool = make_pool(pool="host")
    proxy = _wire(pool.wrap_tensor(np.arange(8, dtype=np.int32)))
    pool.shutdown()
    for _ in range(2):
        go = threading.Barrier(6)
        calls = [_Call(lambda: (go.wait(DEADLINE), proxy.reconstruct_on_target_device(0))[1])
                 for _ in range(6)]
        assert _all_done(calls)
        for c in calls:
            assert isinstance(c.error, (vmmt.ProducerGone, RuntimeError)), repr(c.error)
            if not isinstance(c.error, vmmt.ProducerGone):
                assert "released" in str(c.error), repr(c.error)


# ================================================ a second process (spawn)

def _spawned_rank(conn):
    """Rebuilds every pickle it is sent; answers ("ok", values) or
    ("error", class name, message); None stops it."""
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            out = []
            for wire in msg:
                try:
                    p = pickle.loads(wire)
                    if isinstance(p, list):
                        out.append(("ok", [m.reconstruct_on_target_device(0).tolist()
                                           for m in p]))
                    else:
                        out.append(("ok", p.reconstruct_on_target_device(0).tolist()))
                except Exception as e:  # noqa: B902 - reported to the test
                    out.append(("error", type(e).__name__, str(e)))
            conn.send(out)
    finally:
        vs._imported_pool_cache_clear()
        conn.close()


def test_spawned_rank_rebuilds_while_the_parent_cancels(clean_no_fds):
    """A spawned rank rebuilds batches of pickled proxies (singles and
    packed) while the parent cancels them from another thread and keeps
    wrapping new tensors: every success is its own bytes, every failure a
    vmmt error; all slices come back; then the pool is shut down and the
    next batch is ProducerGone."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_spawned_rank, args=(child,), daemon=True)
    proc.start()
    child.close()
    pool = make_pool(pool="host", memory_size=8 * MiB)
    counts = {"ok": 0, "error": 0}
    try:
        for n in range(8):
            srcs, proxies = [], []
            for i in range(12):
                if i % 3 == 2:
                    s = [np.full(40, n * 100 + i, np.int32), np.full(2, i, np.int32)]
                    p = pool.wrap_tensors(s)
                else:
                    s = np.full(300, n * 100 + i, np.int32)
                    p = pool.wrap_tensor(s)
                srcs.append(s)
                proxies.append(p)
            parent.send([pickle.dumps(p) for p in proxies])

            intruders = []

            def canceller():
                for p in proxies[n % 2::2]:
                    time.sleep(0.0005)
                    pool.cancel_proxy(p[0] if isinstance(p, list) else p)
                    intruders.append(pool.wrap_tensor(np.full(300, -1, np.int32)))
            c = _Call(canceller)
            assert parent.poll(60), "the spawned rank did not answer"
            answers = parent.recv()
            assert c.done(DEADLINE) and c.error is None, repr(c.error)
            for a, s in zip(answers, srcs):
                if a[0] == "ok":
                    want = [x.tolist() for x in s] if isinstance(s, list) else s.tolist()
                    assert a[1] == want, "wrong bytes in the rank: %r" % (a[1][:3],)
                else:
                    assert a[1] in ("Stale", "ProducerGone", "Error", "RuntimeError"), a
                counts[a[0]] += 1
            for p in intruders:
                pool.cancel_proxy(p)
            _empty(pool)
        assert counts["ok"] > 0
        live = pool.wrap_tensor(np.arange(8, dtype=np.int32))
        pool.shutdown()
        parent.send([pickle.dumps(live)])
        assert parent.poll(60)
        answer = parent.recv()[0]
        assert answer[0] == "error" and answer[1] == "ProducerGone", answer
        assert "drop the request" in answer[2], answer
    finally:
        pool.shutdown()
        try:
            parent.send(None)
        except OSError:
            pass
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(30)
        parent.close()


@pytest.fixture
def clean_no_fds():
    """`clean` without the fd check (spawn starts a resource tracker)."""
    previous = vs.set_rank_resolver(None)
    before = emu_counters.live()
    yield
    vs.set_rank_resolver(previous)
    vs._imported_pool_cache_clear()
    gc.collect()
    assert emu_counters.live() == before
