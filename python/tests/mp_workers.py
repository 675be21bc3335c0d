"""Process bodies for test_multiprocess.py (importable by spawned children)."""
import numpy as np

import emu_counters
import vmmt


def expected(i):
    """Buffer i: varying shape and dtype, known contents."""
    shape = (1 + i % 3, 2 + i % 5, 3)
    dtype = (np.float32, np.int64, np.uint8, np.float16)[i % 4]
    return (np.arange(int(np.prod(shape))) * (i + 1) % 251).astype(dtype).reshape(shape)


def producer(conns, count, packed, result):
    """Publish `count` arrays (or pairs), send each descriptor to every consumer."""
    try:
        with vmmt.Pool(memory_size=8 << 20, consumer_count=len(conns), max_slices=64) as pool:
            for i in range(count):
                a = expected(i)
                if packed:
                    descs = pool.publish_many([a, a[::-1].copy()])
                else:
                    descs = [pool.publish(a)]
                for c in conns:
                    c.send(list(descs))
            for c in conns:
                c.send(None)
            for c in conns:
                assert c.recv() == "done"
            pool.drain(10000)
            stats = pool.stats()
        result.put(("producer", stats["published"], stats["recycled"], emu_counters.live()))
    except BaseException as e:  # reported to the test, which fails with it
        result.put(("producer-error", repr(e)))


def consumer(conn, rank, result):
    try:
        checked = 0
        with vmmt.Consumer() as c:
            i = 0
            while True:
                descs = conn.recv()
                if descs is None:
                    break
                want = [expected(i), expected(i)[::-1]]
                for d, w in zip(descs, want):
                    assert isinstance(d, vmmt.Descriptor)
                    x = np.from_dlpack(c.consume(d, device=rank % 2, ranks=rank))
                    np.testing.assert_array_equal(x, w)
                    checked += 1
                    del x  # the last array must not outlive the leak check below
                i += 1
            conn.send("done")
        import gc
        gc.collect()
        result.put(("consumer", rank, checked, emu_counters.live()))
    except BaseException as e:
        result.put(("consumer-error", rank, repr(e)))
