"""Process bodies for test_pool_options.py's host pool across processes."""
import numpy as np

import emu_counters
import vmmt


def host_producer(conn, count, result):
    """A host pool's producer: writes in place with the CPU, never a CUDA context."""
    try:
        with vmmt.Pool(memory_size=4 << 20, max_slices=64, memory_location="host") as pool:
            for i in range(count):
                r = pool.reserve(64 * 4)
                np.frombuffer(r.memoryview(), dtype=np.float32)[:] = np.arange(64) * i
                conn.send(pool.commit(r, "float32", (8, 8)))
                assert emu_counters.live_contexts() == 0
            conn.send(pool.publish(np.arange(10, dtype=np.int64)))  # a plain publish too
            conn.send(None)
            conn.recv()  # the consumer is done
            stats = pool.stats()
        result.put(("producer", stats["memory_location"], stats["published"],
                    emu_counters.calls("cuDevicePrimaryCtxRetain"),
                    emu_counters.calls("cuCtxPushCurrent")))
    except BaseException as e:  # reported, not lost in the child
        result.put(("producer", "error", repr(e), -1, -1))


def host_consumer(conn, result):
    try:
        got = 0
        with vmmt.Consumer() as c:
            i = 0
            while True:
                d = conn.recv()
                if d is None:
                    break
                x = np.from_dlpack(c.consume(d, ranks=0))
                if d.dtype == "float32":
                    assert x.shape == (8, 8) and np.array_equal(x.ravel(), np.arange(64) * i)
                    i += 1
                else:
                    assert np.array_equal(x, np.arange(10))
                got += 1
        conn.send(True)
        result.put(("consumer", got))
    except BaseException as e:
        conn.send(False)
        result.put(("consumer", repr(e)))
