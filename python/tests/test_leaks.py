"""No Python object, file descriptor or (emulated) device memory leaks on
any path: repeated calls, failures, gc, tracemalloc, reference counts and
the emulated driver's live counters."""
import gc
import subprocess
import sys
import textwrap
import threading
import tracemalloc

import numpy as np
import pytest

import emu_counters
import vmmt


def test_repeated_calls_hold_nothing(no_leaks):
    a = np.arange(1000, dtype=np.float32)
    refs = sys.getrefcount(a)
    with vmmt.Pool(memory_size=8 << 20, max_slices=4096) as pool, vmmt.Consumer() as consumer:
        for _ in range(20):  # warm up caches and the allocator
            np.from_dlpack(consumer.consume(pool.publish(a), ranks=0))
        gc.collect()
        live = emu_counters.live()
        tracemalloc.start()
        snap = tracemalloc.take_snapshot()
        for _ in range(300):
            x = np.from_dlpack(consumer.consume(pool.publish(a), ranks=0))
            del x
        gc.collect()
        grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(snap, "filename"))
        tracemalloc.stop()
        assert grown < 64 * 1024, "Python memory grew by %d bytes over 300 round trips" % grown
        assert emu_counters.live() == live  # every consumed buffer was freed
        pool.drain(5000)
        assert pool._pool.pending() == 0 or pool.publish(a) is not None
    gc.collect()
    assert sys.getrefcount(a) == refs  # the pool gave every source back


def test_failures_leak_nothing(no_leaks):
    a = np.arange(100, dtype=np.uint8)
    refs = sys.getrefcount(a)
    with vmmt.Pool(memory_size=2 << 20, max_slices=2) as pool, vmmt.Consumer() as consumer:
        for _ in range(50):
            d1 = pool.publish(a)
            d2 = pool.publish(a)
            with pytest.raises(vmmt.PoolFull):  # out of slots: raised as publish raises
                pool.publish_many([a])
            with pytest.raises(vmmt.PoolFull):
                pool.publish(a)
            with pytest.raises(ValueError):
                pool.publish_many([a, np.zeros([1] * 9, np.uint8)])
            with pytest.raises(ValueError):
                consumer.consume(d1, out=np.zeros(1, np.uint8), ranks=0)  # too small: refused first
            consumer.ack(d1, ranks=0)  # not consumed by the refused call
            consumer.ack(d2, ranks=0)
            pool.drain(5000)
        with pytest.raises(ValueError):
            consumer.consume(b"\0" * 512, ranks=0)
    gc.collect()
    assert sys.getrefcount(a) == refs


def test_pageable_source_released_at_once(no_leaks):
    # A pageable host source is copied before publish returns: nothing to keep.
    a = np.arange(4096, dtype=np.uint8)
    refs = sys.getrefcount(a)
    with vmmt.Pool(memory_size=2 << 20) as pool, vmmt.Consumer() as consumer:
        d = pool.publish(a)
        assert pool._pool.pending() == 0
        assert sys.getrefcount(a) == refs
        consumer.consume(d, ranks=0)
        pool.drain(5000)
    gc.collect()
    assert sys.getrefcount(a) == refs


def test_sources_kept_until_copy_done_then_released(no_leaks):
    # A device source on a stream held back by a wait: the pool keeps it
    # until the publish's ready word shows the copy landed, and no longer.
    with vmmt.Pool(memory_size=2 << 20) as pool, vmmt.Consumer() as consumer:
        dev = consumer.consume(pool.publish(np.arange(4096, dtype=np.uint8)), ranks=0)
        dev.synchronize()  # its own copy done: exporting it waits for nothing
        refs = sys.getrefcount(dev)
        with emu_counters.StalledStream(0) as s:
            d = pool.publish(dev, stream=s.handle)
            assert pool._pool.pending() == 1
            assert sys.getrefcount(dev) > refs
            pool.reclaim()  # checked again: still copying
            assert pool._pool.pending() == 1 and sys.getrefcount(dev) > refs
            s.release()
            consumer.consume(d, stream=s.handle, ranks=0).synchronize()
            pool.drain(5000)
            assert pool._pool.pending() == 0
            assert sys.getrefcount(dev) == refs
            pool.publish(dev, stream=s.handle)  # kept again; close gives it back
        del dev
    gc.collect()


def test_close_waits_for_kept_sources(no_leaks):
    with vmmt.Pool(memory_size=2 << 20) as pool, vmmt.Consumer() as consumer:
        dev = consumer.consume(pool.publish(np.arange(64, dtype=np.uint8)), ranks=0)
        dev.synchronize()
        refs = sys.getrefcount(dev)
        with emu_counters.StalledStream(0) as s:
            pool.publish(dev, stream=s.handle)
            assert pool._pool.pending() == 1
            threading.Timer(0.2, s.release).start()
            pool.close()  # waits (without the GIL) for the ready word
            assert sys.getrefcount(dev) == refs


def test_device_source_given_back_once_landed(no_leaks):
    # A device source (a consumed buffer, relayed): kept only while its copy
    # may run, proven by the publish's ready word; given back by drain at the latest.
    with vmmt.Pool(memory_size=2 << 20) as pool, vmmt.Consumer() as consumer:
        dev = consumer.consume(pool.publish(np.arange(4096, dtype=np.uint8)), ranks=0)
        refs = sys.getrefcount(dev)
        for _ in range(20):
            d = pool.publish(dev)
            assert pool._pool.pending() <= 1
            got = np.from_dlpack(consumer.consume(d, ranks=0))
            assert np.array_equal(got, np.arange(4096) % 256)
        pool.drain(5000)
        assert pool._pool.pending() == 0
        assert sys.getrefcount(dev) == refs
        del dev
    gc.collect()


def test_buffer_lives_while_arrays_use_it(no_leaks):
    with vmmt.Pool(memory_size=2 << 20) as pool, vmmt.Consumer(cache_bytes=0) as consumer:
        buf = consumer.consume(pool.publish(np.arange(10, dtype=np.int64)), ranks=0)
        blocks = emu_counters.live()["blocks"]
        x = np.from_dlpack(buf)
        y = np.from_dlpack(buf)
        del buf
        gc.collect()
        assert emu_counters.live()["blocks"] == blocks
        del x
        gc.collect()
        assert emu_counters.live()["blocks"] == blocks
        assert y.sum() == 45
        del y
        gc.collect()
        assert emu_counters.live()["blocks"] == blocks - 1


def test_consume_reuses_freed_buffers(no_leaks):
    # Same-size consumes on one stream: one cuMemAlloc, then the cache.
    with vmmt.Pool(memory_size=2 << 20) as pool, vmmt.Consumer(cache_bytes=1 << 20) as consumer:
        allocs = emu_counters.calls("cuMemAlloc")
        for i in range(50):
            x = np.from_dlpack(consumer.consume(pool.publish(np.full(256, i, np.int32)), ranks=0))
            assert (x == i).all()
            del x
        assert emu_counters.calls("cuMemAlloc") - allocs == 1
        hits, misses, blocks, held = consumer.cache_info()
        assert (hits, misses, blocks, held) == (49, 1, 1, 1024)
        # Another size misses; one too big for the cache is freed at once.
        consumer.consume(pool.publish(np.zeros(10, np.int8)), ranks=0)
        assert consumer.cache_info()[2:] == (2, 1034)
        live = emu_counters.live()["blocks"]
        consumer.consume(pool.publish(np.zeros(200000, np.int64)), ranks=0)
        assert emu_counters.live()["blocks"] == live
        # A buffer alive at close frees to the driver later (no_leaks checks).
        keep = consumer.consume(pool.publish(np.zeros(256, np.int32)), ranks=0)
    del keep


def test_cache_makes_room_for_a_size_that_fits(no_leaks):
    # A block as large as the cache, after a small one: the small one goes
    # (oldest first), so the steady size is kept. Before, a 64 MiB feature
    # with the default 64 MiB cache went to cuMemAlloc and cuMemFree at every
    # consume once any smaller block was held (the H200 bench, 2026-12-02:
    # reconstruct 316 us at 64 MiB, against 69 us at 4 KiB).
    with vmmt.Pool(memory_size=4 << 20) as pool, vmmt.Consumer(cache_bytes=1 << 20) as consumer:
        consumer.consume(pool.publish(np.zeros(256, np.int32)), ranks=0)  # dropped: cached
        assert consumer.cache_info()[2:] == (1, 1024)
        allocs = emu_counters.calls("cuMemAlloc")
        for i in range(3):
            x = np.from_dlpack(consumer.consume(pool.publish(np.full(1 << 18, i, np.int32)),
                                                ranks=0))
            assert (x == i).all()
            del x
        assert emu_counters.calls("cuMemAlloc") - allocs == 1
        assert consumer.cache_info()[2:] == (1, 1 << 20)


def test_unconsumed_capsules_and_deleter_on_other_thread(no_leaks):
    with vmmt.Pool(memory_size=2 << 20) as pool, vmmt.Consumer(cache_bytes=0) as consumer:
        buf = consumer.consume(pool.publish(np.arange(10, dtype=np.int64)), ranks=0)
        blocks = emu_counters.live()["blocks"]
        for _ in range(100):
            buf.__dlpack__(max_version=(1, 0))  # dropped unconsumed: the capsule returns it
            buf.__dlpack__()
        holder = [np.from_dlpack(buf) for _ in range(8)]
        del buf
        t = threading.Thread(target=holder.clear)  # the deleters run on this thread
        t.start()
        t.join(10)
        gc.collect()
        assert emu_counters.live()["blocks"] == blocks - 1


def test_deleter_after_interpreter_shutdown(tmp_path):
    """Arrays still holding consumed buffers at exit: no crash, no hang."""
    script = textwrap.dedent("""
        import sys, threading
        sys.path[:0] = %r
        import numpy as np, vmmt
        pool = vmmt.Pool(memory_size=2 << 20)
        c = vmmt.Consumer()
        KEEP = [np.from_dlpack(c.consume(pool.publish(np.arange(8, dtype=np.int32)), ranks=0))]
        CAPS = [c.consume(pool.publish(np.arange(8, dtype=np.int32)), ranks=0).__dlpack__()]
        # a capsule alive in a thread that outlives the interpreter's teardown
        def hold(x=c.consume(pool.publish(np.arange(4, dtype=np.int32)), ranks=0)):
            import time; time.sleep(0.2)
        threading.Thread(target=hold, daemon=True).start()
        print("ok", KEEP[0].sum())
    """ % (sys.path[:3],))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "ok 28" in out.stdout


def test_raw_fast_path_keeps_owner_and_releases_it(no_leaks):
    """The capsule-free path PyTorch tensors take (exercised here with NumPy)."""
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    refs = sys.getrefcount(a)
    item = (a, a.ctypes.data, a.nbytes, 2, 32, 1, a.shape, 1)
    with vmmt.Pool(memory_size=2 << 20) as pool, vmmt.Consumer() as consumer:
        for _ in range(50):
            (raw,) = pool._pool.publish_raw([item], 0)
            d = vmmt.Descriptor(raw)
            assert d.shape == (2, 3, 4) and d.dtype == "float32"
            np.testing.assert_array_equal(np.from_dlpack(consumer.consume(d, ranks=0)), a)
        two = pool._pool.publish_raw([item, item], 0)
        assert len(two) == 2 and vmmt.Descriptor(two[1]).pack_count == 2
        for bad in ([(a, a.ctypes.data, a.nbytes, 2, 32, 1, (1,) * 9, 1)],
                    [(a, a.ctypes.data, a.nbytes, 2, 32, 1, "xy", 1)], [("short",)], []):
            with pytest.raises((ValueError, TypeError)):
                pool._pool.publish_raw(bad, 0)
        with pytest.raises(ValueError, match="does not match shape"):
            pool._pool.publish_raw([(a, a.ctypes.data, 7, 2, 32, 1, a.shape, 1)], 0)
        for r in two:
            consumer.consume(r, ranks=0)
        pool.drain(5000)
        assert sys.getrefcount(a) == refs + 1  # `item` holds one
    del item
    gc.collect()
    assert sys.getrefcount(a) == refs


def test_threads_share_pool_and_consumer_and_close_races(no_leaks):
    """Calls release the GIL: threads publish and consume at once, and a close
    from another thread in the middle ends them with vmmt.Error, not a crash."""
    a = np.arange(256, dtype=np.int32)
    errors = []

    def worker(pool, consumer, n, expect_close):
        try:
            for _ in range(n):
                x = np.from_dlpack(consumer.consume(pool.publish(a), ranks=0))
                assert x[-1] == 255
        except vmmt.Error as e:
            # Closed under it: ECLOSED, or an import that met the broker gone.
            if not expect_close:
                errors.append(repr(e))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    for expect_close in (False, True):
        pool = vmmt.Pool(memory_size=8 << 20, max_slices=256)
        consumer = vmmt.Consumer()
        threads = [threading.Thread(target=worker, args=(pool, consumer, 150, expect_close))
                   for _ in range(4)]
        for t in threads:
            t.start()
        if expect_close:
            consumer.close()
            pool.close()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors
        pool.close()
        consumer.close()
        del pool, consumer
        gc.collect()


class _Reentrant(np.ndarray):
    """An array whose release (the pool's deleter call) publishes again."""
    pool = None
    count = 0

    def __del__(self):
        if _Reentrant.pool is not None and _Reentrant.count < 20:
            _Reentrant.count += 1
            _Reentrant.pool.publish(np.arange(4, dtype=np.int8))


def test_deleter_that_publishes_again(no_leaks):
    with vmmt.Pool(memory_size=4 << 20, max_slices=256) as pool, vmmt.Consumer() as consumer:
        _Reentrant.pool, _Reentrant.count = pool, 0
        try:
            for _ in range(10):
                a = np.arange(64, dtype=np.int8).view(_Reentrant)
                pool.publish(a)
                del a  # the pool holds the last reference now
            pool.reclaim()
            for _ in range(3):
                pool.publish(np.zeros(4, np.int8))  # each publish retires finished ones
        finally:
            _Reentrant.pool = None
        assert _Reentrant.count > 0
        assert pool.stats()["published"] >= 10 + _Reentrant.count
    gc.collect()
