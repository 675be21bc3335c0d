"""Pool options (host and elastic pools), stats and writing in place."""
import multiprocessing as mp

import numpy as np
import pytest

import mp_host_pool
import vmmt

STATS = ("handle_type", "handoff", "fell_back_to_posix", "host_control_table",
         "allocation_size", "table_bytes", "data_bytes", "slots", "in_flight",
         "in_flight_bytes", "published", "recycled", "cancelled", "full", "reclaims",
         "broker_served", "broker_refused", "memory_location", "device_bytes", "host_bytes",
         "resident_bytes", "peak_bytes", "max_bytes", "chunk_bytes", "chunks_made",
         "chunks_released")


def test_stats_every_field(pool):
    s = pool.stats()
    assert set(STATS) <= set(s)
    assert s["memory_location"] == "device" and s["device_bytes"] == s["allocation_size"]
    assert s["host_bytes"] == 0 and s["chunk_bytes"] == 0


@pytest.mark.parametrize("kw, what", [
    ({"memory_location": "gpu"}, "memory_location"),
    ({"host_numa_node": -2}, "host_numa_node"),
    ({"chunk_size": -1}, "chunk_size"),
    ({"min_resident": "1"}, "min_resident='1' \\(str\\): give an int"),
    ({"idle_release_ms": -5}, "idle_release_ms"),
    ({"memory_location": "host", "elastic": True}, "elastic"),
    ({"handoff": "later"}, "handoff='later': give one of 'auto', 'stream', 'sync'"),
])
def test_bad_options(no_leaks, kw, what):
    """Each names the option and what it takes; a wrong kind is a TypeError."""
    with pytest.raises((ValueError, TypeError), match=what):
        vmmt.Pool(memory_size=4 << 20, **kw)


def test_c_pool_checks_location(no_leaks):
    with pytest.raises(ValueError, match="memory_location='gpu'; use one of 'device', 'host'"):
        vmmt._vmmt.Pool(0, 4 << 20, 1, memory_location="gpu")


def test_host_pool(no_leaks, consumer):
    with vmmt.Pool(memory_size=4 << 20, memory_location="host") as pool:
        s = pool.stats()
        assert s["memory_location"] == "host" and s["host_bytes"] > 0 and s["device_bytes"] == 0
        a = np.arange(100, dtype=np.float64)
        assert np.array_equal(np.from_dlpack(consumer.consume(pool.publish(a), ranks=0)), a)


def test_elastic_pool(no_leaks, consumer):
    with vmmt.Pool(memory_size=16 << 20, elastic=True, chunk_size=2 << 20,
                   idle_release_ms=10) as pool:
        assert pool.stats()["chunk_bytes"] == 2 << 20
        a = np.arange(1000, dtype=np.int32)
        assert np.array_equal(np.from_dlpack(consumer.consume(pool.publish(a), ranks=0)), a)
        s = pool.stats()
        assert s["chunks_made"] >= 1 and s["max_bytes"] == 16 << 20


@pytest.mark.parametrize("location", ["device", "host"])
def test_reserve_commit_cancel(no_leaks, consumer, location):
    with vmmt.Pool(memory_size=4 << 20, memory_location=location) as pool:
        r = pool.reserve(4096)
        assert r.nbytes >= 4096 and r.location == location
        view = np.from_dlpack(r)
        assert view.dtype == np.uint8 and view.nbytes == r.nbytes
        w = np.frombuffer(r.memoryview(), dtype=np.float32)
        w[:1024] = np.arange(1024)
        del view, w  # the views end first: commit refuses while they live
        like = np.zeros((32, 32), np.float32)
        d = pool.commit(r, like=like)
        assert isinstance(d, vmmt.Descriptor) and d.shape == (32, 32) and d.dtype == "float32"
        with pytest.raises(ValueError, match="already"):
            pool.commit(r, "float32", (4,))
        got = np.from_dlpack(consumer.consume(d, ranks=0))
        assert np.array_equal(got.ravel(), np.arange(1024))
        # Untyped, and by name.
        r2 = pool.reserve(100)
        r2.memoryview()[:3] = b"abc"
        assert bytes(np.from_dlpack(consumer.consume(pool.commit(r2), ranks=0))[:3]) == b"abc"
        r3 = pool.reserve(64)
        d3 = pool.commit(r3, "int64", [2, 4])
        assert d3.shape == (2, 4) and d3.dtype == "int64"
        consumer.ack(d3, ranks=0)
        # Cancel: the slice goes back, and the reservation is spent.
        r4 = pool.reserve(1 << 20)
        pool.cancel(r4)
        with pytest.raises(ValueError, match="already"):
            pool.commit(r4)
        with pytest.raises(ValueError):
            pool.commit(pool.reserve(64), "float32", (1000,))  # more than reserved
        with pytest.raises(ValueError, match="dtype"):
            pool.commit(pool.reserve(64), "float8", (4,))
        pool.drain(5000)


def test_host_pool_across_processes():
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    a, b = ctx.Pipe()
    procs = [ctx.Process(target=mp_host_pool.host_producer, args=(a, 20, result)),
             ctx.Process(target=mp_host_pool.host_consumer, args=(b, result))]
    for p in procs:
        p.start()
    try:
        reports = dict((r[0], r[1:]) for r in (result.get(timeout=120) for _ in procs))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        for p in procs:
            if not p.is_alive():
                p.close()  # its sentinel fd, now rather than at some later gc
        for end in (a, b):
            end.close()
        result.close()
        result.join_thread()
    assert reports["consumer"] == (21,), reports
    # The producer published 21 buffers from a host pool without a CUDA context.
    assert reports["producer"] == ("host", 21, 0, 0), reports
