"""Outside attack on vmmt.Consumer's buffer cache (python/README.md,
"Streams and lifetimes": freed buffers are kept up to cache_bytes, 16
blocks, the oldest freed to make room for a block that fits; one larger than
cache_bytes goes to cuMemFree; a cached buffer is reused only on its own
device and stream; close() frees the cache). Written from the README alone.

Counters: cache_info() -> (hits, misses, blocks, bytes), and the emulated
driver's live cuMemAlloc blocks and cuMemAlloc calls (emu_counters).
"""
import gc
import random
import threading

import numpy as np
import pytest

import emu_counters
import vmmt

KiB = 1024
MiB = 1 << 20


def blocks():
    gc.collect()
    return emu_counters.live()["blocks"]


def allocs():
    return emu_counters.calls("cuMemAlloc")


def take(consumer, pool, n, value, **kw):
    """Consume n bytes of `value` (uint8) and return the array over the Buffer."""
    buf = consumer.consume(pool.publish(np.full(n, value % 256, np.uint8)), ranks=0, **kw)
    buf.synchronize()
    return np.from_dlpack(buf)


def drop(consumer, pool, n, value=7, **kw):
    """Consume n bytes and drop the buffer at once (it goes to the cache or is freed)."""
    x = take(consumer, pool, n, value, **kw)
    assert (x == value % 256).all()
    del x
    gc.collect()


def addr(x):
    return x.__array_interface__["data"][0]


def invariant(consumer, cache_bytes):
    hits, misses, nblocks, held = consumer.cache_info()
    assert 0 <= nblocks <= 16, consumer.cache_info()
    assert held <= cache_bytes, consumer.cache_info()
    if nblocks == 0:
        assert held == 0
    return hits, misses, nblocks, held


@pytest.fixture
def big_pool(no_leaks):
    with vmmt.Pool(memory_size=32 << 20, max_slices=256) as p:
        yield p


def test_more_than_16_sizes_keeps_16_and_the_newest(big_pool):
    # README: 16 blocks; the oldest freed to make room, "so the latest steady
    # size stays cached". 20 sizes, each dropped once: at most 16 kept, the
    # newest among them; the first four gone.
    with vmmt.Consumer(cache_bytes=4 << 20) as c:
        base = blocks()
        sizes = [(i + 1) * 4 * KiB for i in range(20)]
        for n in sizes:
            drop(c, big_pool, n)
            invariant(c, 4 << 20)
        hits, misses, nblocks, held = c.cache_info()
        assert (hits, misses) == (0, 20)
        assert nblocks == 16 and held == sum(sizes[4:])
        assert blocks() - base == 16  # the four evicted went back to the driver
        before = allocs()
        drop(c, big_pool, sizes[-1])  # the newest: a hit
        assert allocs() == before and c.cache_info()[0] == 1
        drop(c, big_pool, sizes[0])  # the oldest: gone, a miss
        assert allocs() == before + 1
        invariant(c, 4 << 20)
    assert blocks() == base


def test_cache_bytes_zero_caches_nothing(big_pool):
    with vmmt.Consumer(cache_bytes=0) as c:
        base = blocks()
        a0 = allocs()
        for i in range(5):
            drop(c, big_pool, 4 * KiB, i)
            assert c.cache_info()[2:] == (0, 0)
            assert blocks() == base
        assert allocs() - a0 == 5
        hits, misses, _, _ = c.cache_info()
        assert hits == 0


def test_larger_than_cache_evicts_nothing(big_pool):
    # A block that can never fit goes to cuMemFree; making room for it would
    # only throw the cache away.
    with vmmt.Consumer(cache_bytes=1 << 20) as c:
        drop(c, big_pool, 256 * KiB)
        drop(c, big_pool, 260 * KiB)
        assert c.cache_info()[2:] == (2, 516 * KiB)
        base = blocks()
        drop(c, big_pool, 2 << 20)
        assert c.cache_info()[2:] == (2, 516 * KiB)
        assert blocks() == base
        before = allocs()
        drop(c, big_pool, 256 * KiB)
        drop(c, big_pool, 260 * KiB)
        assert allocs() == before  # both still cached: hits


def test_block_of_exactly_cache_bytes_fits(big_pool):
    with vmmt.Consumer(cache_bytes=1 << 20) as c:
        drop(c, big_pool, 100 * KiB)
        drop(c, big_pool, 200 * KiB)
        drop(c, big_pool, 1 << 20)
        assert c.cache_info()[2:] == (1, 1 << 20)
        before = allocs()
        drop(c, big_pool, 1 << 20)
        assert allocs() == before
        drop(c, big_pool, (1 << 20) + 1)  # one byte over: freed, the cache kept
        assert c.cache_info()[2:] == (1, 1 << 20)


def test_oldest_freed_first(big_pool):
    # A (256K), B (260K), C (264K) cached in that order; D (512K) needs
    # room for 512K in 1 MiB: A and B go (oldest first), C and D stay.
    with vmmt.Consumer(cache_bytes=1 << 20) as c:
        for n in (256 * KiB, 260 * KiB, 264 * KiB, 512 * KiB):
            drop(c, big_pool, n)
        assert c.cache_info()[2:] == (2, (264 + 512) * KiB)
        before = allocs()
        drop(c, big_pool, 264 * KiB)
        drop(c, big_pool, 512 * KiB)
        assert allocs() == before
        drop(c, big_pool, 256 * KiB)
        assert allocs() == before + 1


def test_a_reused_block_counts_as_new(big_pool):
    # A, B cached; A taken and given back: B is now the oldest, and a block
    # needing one of them freed takes B.
    with vmmt.Consumer(cache_bytes=1 << 20) as c:
        drop(c, big_pool, 300 * KiB)  # A
        drop(c, big_pool, 304 * KiB)  # B
        drop(c, big_pool, 300 * KiB)  # A again: a hit, back at the newest end
        assert c.cache_info()[:3] == (1, 2, 2)
        drop(c, big_pool, 500 * KiB)  # 604 + 500 > 1024: one goes
        assert c.cache_info()[2:] == (2, 800 * KiB)
        before = allocs()
        drop(c, big_pool, 300 * KiB)
        assert allocs() == before  # A kept


def test_no_reuse_while_a_view_is_alive(big_pool):
    # The Buffer dropped but a DLPack view alive: its memory is not in the
    # cache; consumes of its size, and evictions, never touch it.
    with vmmt.Consumer(cache_bytes=1 << 20) as c:
        buf = c.consume(big_pool.publish(np.full(64 * KiB, 11, np.uint8)), ranks=0)
        x = np.from_dlpack(buf)
        y = np.from_dlpack(buf)
        del buf
        gc.collect()
        keep = []
        for i in range(20):
            z = take(c, big_pool, 64 * KiB, 100 + i)
            assert addr(z) != addr(x)
            if i % 3 == 0:
                keep.append(z)
            del z
            gc.collect()
            # fill and churn the cache with other sizes to force evictions
            drop(c, big_pool, (300 + i) * KiB, i)
            invariant(c, 1 << 20)
        assert (x == 11).all() and (y == 11).all()
        for i, z in enumerate(keep):
            assert (z == (100 + 3 * i) % 256).all()
        del x
        gc.collect()
        assert (y == 11).all()
        del y, keep
        gc.collect()
        invariant(c, 1 << 20)


def test_views_alive_across_close(no_leaks):
    # close() with buffers alive: their arrays stay valid; they are freed when
    # the last view goes, not put into the closed cache (no_leaks checks).
    with vmmt.Pool(memory_size=8 << 20) as pool:
        c = vmmt.Consumer(cache_bytes=1 << 20)
        x = take(c, pool, 64 * KiB, 5)
        buf = c.consume(pool.publish(np.full(32 * KiB, 6, np.uint8)), ranks=0)
        drop(c, pool, 16 * KiB)  # cached
        assert c.cache_info()[2] == 1
        c.close()
        assert (x == 5).all()
        assert (np.from_dlpack(buf) == 6).all()
        with pytest.raises(vmmt.Closed):
            c.consume(pool.publish(np.zeros(4, np.uint8)), ranks=0)
        holder = [buf]
        del buf
        t = threading.Thread(target=holder.clear)  # the last reference goes on another thread
        t.start()
        t.join(30)
        del x
        gc.collect()
        c.close()  # idempotent


def test_close_frees_the_cache_at_once(big_pool):
    base = blocks()
    c = vmmt.Consumer(cache_bytes=1 << 20)
    for i in range(5):
        drop(c, big_pool, (i + 1) * 16 * KiB)
    assert blocks() == base + 5
    c.close()
    assert blocks() == base


def test_streams_are_kept_apart(big_pool):
    with vmmt.Consumer(cache_bytes=1 << 20) as c, emu_counters.StalledStream(0) as s1, \
            emu_counters.StalledStream(0) as s2:
        s1.release()
        s2.release()
        drop(c, big_pool, 64 * KiB, 1, stream=s1.handle)
        before = allocs()
        drop(c, big_pool, 64 * KiB, 2, stream=s2.handle)  # other stream: a miss
        assert allocs() == before + 1
        drop(c, big_pool, 64 * KiB, 3, stream=s1.handle)
        drop(c, big_pool, 64 * KiB, 4, stream=s2.handle)
        assert allocs() == before + 1  # each stream hits its own
        assert c.cache_info()[2:] == (2, 128 * KiB)
        # A block of s2 that needs room frees s1's (the oldest) and stays.
        drop(c, big_pool, 960 * KiB, 5, stream=s2.handle)
        invariant(c, 1 << 20)
        c.close()
        s1.synchronize()
        s2.synchronize()


def test_devices_are_kept_apart(big_pool):
    if vmmt.device_count() < 2:
        pytest.skip("one device")
    with vmmt.Consumer(cache_bytes=1 << 20) as c:
        drop(c, big_pool, 64 * KiB, 1, device=1)
        before = allocs()
        drop(c, big_pool, 64 * KiB, 2, device=0)
        assert allocs() == before + 1
        drop(c, big_pool, 64 * KiB, 3, device=1)
        drop(c, big_pool, 64 * KiB, 4, device=0)
        assert allocs() == before + 1
        # Device 0's large block evicts device 1's: freed on its own device.
        base = blocks()
        drop(c, big_pool, 1000 * KiB, 5, device=0)
        assert c.cache_info()[2:] == (1, 1000 * KiB)
        assert blocks() == base - 1
        x = take(c, big_pool, 64 * KiB, 9, device=1)
        assert (x == 9).all()
        del x


def test_cache_bytes_arguments():
    with pytest.raises(ValueError):
        vmmt.Consumer(cache_bytes=-1)
    with pytest.raises(TypeError):
        vmmt.Consumer(cache_bytes=1.5)
    with pytest.raises(TypeError):
        vmmt.Consumer(cache_bytes="64")
    with vmmt.Consumer(cache_bytes=1 << 62) as c:
        assert c.cache_info() == (0, 0, 0, 0)


def test_host_out_goes_through_the_cache_and_gives_it_back(big_pool):
    # A host `out` is filled through device memory (vmmt/__init__.py): it may
    # take a cached block, but gives it back and allocates nothing new.
    with vmmt.Consumer(cache_bytes=1 << 20) as c:
        drop(c, big_pool, 4 * KiB)
        info = c.cache_info()
        before = allocs()
        out = np.zeros(4 * KiB, np.uint8)
        c.consume(big_pool.publish(np.full(4 * KiB, 3, np.uint8)), out=out, ranks=0)
        gc.collect()
        assert (out == 3).all()
        assert c.cache_info()[2:] == info[2:]
        assert allocs() == before


def test_many_of_one_size_alive_then_dropped(big_pool):
    # 20 buffers of one size alive at once, then all dropped: 16 kept at
    # most (and within cache_bytes), the rest freed; nothing leaks.
    with vmmt.Consumer(cache_bytes=1 << 20) as c:
        base = blocks()
        xs = [take(c, big_pool, 32 * KiB, i) for i in range(20)]
        assert len({addr(x) for x in xs}) == 20
        for i, x in enumerate(xs):
            assert (x == i).all()
        del xs, x
        gc.collect()
        _, _, nblocks, held = invariant(c, 1 << 20)
        assert nblocks == 16 and held == 16 * 32 * KiB
        assert blocks() == base + 16


def test_interleaved_consumes_and_frees(big_pool):
    # A deterministic random mix of sizes (some larger than the cache),
    # buffers held for a while and dropped in any order: every array keeps
    # its bytes until dropped, the cache stays within its bounds, and the
    # driver's live blocks are exactly the cached ones plus those alive.
    rng = random.Random(4242)
    sizes = [(i + 1) * 12 * KiB for i in range(24)] + [1536 * KiB, 3 << 20]
    cache = 1 << 20
    with vmmt.Consumer(cache_bytes=cache) as c:
        base = blocks()
        alive = []  # (array, value)
        consumes = 0
        for step in range(400):
            if alive and (len(alive) > 10 or rng.random() < 0.45):
                x, v = alive.pop(rng.randrange(len(alive)))
                assert (x == v).all(), "an array's bytes changed while it was alive"
                del x
                gc.collect()
            else:
                v = step % 256
                alive.append((take(c, big_pool, rng.choice(sizes), v), v))
                consumes += 1
            hits, misses, nblocks, held = invariant(c, cache)
            assert hits + misses == consumes
            assert blocks() - base == nblocks + len(alive)
        for x, v in alive:
            assert (x == v).all()
        del alive, x
        gc.collect()
        _, _, nblocks, _ = invariant(c, cache)
        assert blocks() - base == nblocks
    assert blocks() == base


def test_frees_on_other_threads_while_consuming(big_pool):
    # The DLPack deleter on other threads, concurrently with consumes on
    # this one: the cache stays consistent and nothing leaks.
    import queue
    q = queue.Queue()

    def dropper():
        while True:
            item = q.get()
            if item is None:
                return
            x, v = item
            assert (x == v).all()
            del x, item

    with vmmt.Consumer(cache_bytes=1 << 20) as c:
        base = blocks()
        threads = [threading.Thread(target=dropper) for _ in range(3)]
        for t in threads:
            t.start()
        for i in range(300):
            n = (1 + i % 7) * 40 * KiB
            q.put((take(c, big_pool, n, i % 256), i % 256))
        for _ in threads:
            q.put(None)
        for t in threads:
            t.join(60)
        gc.collect()
        _, _, nblocks, _ = invariant(c, 1 << 20)
        assert blocks() - base == nblocks


def test_hit_keeps_the_age_order(big_pool):
    # DEFECT (found by the attack, fixed since; this holds it): a cache hit moves the newest block into the taken block's place
    # (vmmtpy_cache_take removes by swapping in the last entry), so the
    # "oldest first" order that cache_put relies on is lost: here the newest
    # block D is freed to make room while the older C is kept. README:
    # "the oldest blocks are freed to make room, so the latest steady size
    # stays cached". Observed: the D-size consume misses (cuMemAlloc);
    # expected: a hit, and the C-size one a miss.
    with vmmt.Consumer(cache_bytes=1 << 20) as c:
        for n in (200 * KiB, 204 * KiB, 208 * KiB, 212 * KiB):  # A, B, C, D: oldest first
            drop(c, big_pool, n)
        held = take(c, big_pool, 204 * KiB, 1)  # B: a hit, kept alive
        assert c.cache_info()[:3] == (1, 4, 3)
        drop(c, big_pool, 700 * KiB)  # room for 700K: A, then C (the oldest) go
        kept = c.cache_info()[2:]
        before = allocs()
        drop(c, big_pool, 212 * KiB)  # D, the newest of the old sizes: must be a hit
        d_hit = allocs() == before
        del held
        gc.collect()
    assert kept == (2, (212 + 700) * KiB), (
        "kept %r: C (208K) kept and the newer D (212K) freed" % (kept,))
    assert d_hit, "the newest cached block (D) was freed before an older one (C)"
