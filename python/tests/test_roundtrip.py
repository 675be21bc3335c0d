"""Publish and consume in one process with NumPy: dtypes, shapes, layouts,
packed publishes, `out`, DLPack capsules, descriptors."""
import pickle

import numpy as np
import pytest

import vmmt

DTYPES = [np.float32, np.float64, np.float16, np.int8, np.int16, np.int32, np.int64, np.uint8,
          np.uint16, np.uint32, np.uint64, np.bool_, np.complex64, np.complex128]


def sample(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return np.asarray(rng.integers(0, 100, size=shape) % (2 if dtype == np.bool_ else 100)).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes(pool, consumer, dtype):
    a = sample((3, 5), dtype)
    try:
        a.__dlpack__()
    except BufferError:
        pytest.skip("this NumPy cannot export %s through DLPack" % np.dtype(dtype).name)
    d = pool.publish(a)
    assert d.shape == (3, 5) and d.nbytes == a.nbytes
    assert d.dtype == np.dtype(dtype).name
    x = np.from_dlpack(consumer.consume(d, ranks=0))
    assert x.dtype == a.dtype and x.shape == a.shape
    np.testing.assert_array_equal(x, a)


@pytest.mark.parametrize("ndim", range(0, 9))
def test_up_to_eight_dims(pool, consumer, ndim):
    shape = tuple([2] * ndim)
    a = sample(shape, np.int32, ndim)
    x = np.from_dlpack(consumer.consume(pool.publish(a), ranks=0))
    assert x.shape == shape
    np.testing.assert_array_equal(x, a)


def test_nine_dims_refused(pool):
    with pytest.raises(ValueError, match="at most 8"):
        pool.publish(np.zeros([1] * 9, np.uint8))
    assert pool.stats()["in_flight"] == 0


def test_non_contiguous_made_contiguous(pool, consumer):
    base = np.arange(4 * 6 * 5, dtype=np.float32).reshape(4, 6, 5)
    for view in (base[:, ::2], base.transpose(2, 0, 1), base[::-1], np.asfortranarray(base)):
        x = np.from_dlpack(consumer.consume(pool.publish(view), ranks=0))
        np.testing.assert_array_equal(x, view)


def test_publish_many_packed(pool, consumer):
    arrays = [sample((i + 1, 7), np.float32, i) for i in range(5)] + [np.arange(3, dtype=np.int64)]
    descs = pool.publish_many(arrays)
    assert [d.pack_index for d in descs] == list(range(6))
    assert {d.pack_count for d in descs} == {6}
    assert pool.stats()["in_flight"] == 1  # one slice for the whole group
    for d, a in zip(descs, arrays):
        np.testing.assert_array_equal(np.from_dlpack(consumer.consume(d, ranks=0)), a)
    pool.drain(5000)
    assert pool.stats()["recycled"] == 1


def test_full_raises_the_same_from_publish_and_publish_many(no_leaks):
    with vmmt.Pool(memory_size=2 << 20, max_slices=4) as p, vmmt.Consumer() as c:
        big = np.zeros(p.stats()["data_bytes"] // 2 + 1, np.uint8)
        d = p.publish(big)
        with pytest.raises(vmmt.PoolFull, match="pool [0-9a-f]* is full"):
            p.publish_many([big])
        with pytest.raises(vmmt.PoolFull, match="pool [0-9a-f]* is full") as e:
            p.publish(big)
        assert isinstance(e.value, vmmt.Error) and isinstance(e.value, RuntimeError)
        assert e.value.status == -7
        assert p.stats()["full"] == 2
        c.consume(d, ranks=0)
        p.drain(5000)
        p.publish(big)  # room again
        with pytest.raises(vmmt.TooLarge, match="can never fit"):
            p.publish(np.zeros(p.stats()["data_bytes"] * 2, np.uint8))


def test_cancel_reclaim_drain_stats(pool, consumer):
    a = np.arange(100, dtype=np.int16)
    d = pool.publish(a)
    pool.cancel(d)
    pool.cancel(d)  # idempotent
    pool.drain(5000)
    s = pool.stats()
    assert s["cancelled"] == 1 and s["in_flight"] == 0
    expected = {"handle_type", "handoff", "fell_back_to_posix", "host_control_table",
                "allocation_size", "table_bytes", "data_bytes", "slots", "in_flight",
                "in_flight_bytes", "published", "recycled", "cancelled", "full", "reclaims",
                "broker_served", "broker_refused"}
    assert expected <= set(s)  # all of vmmt_pool_stats: test_pool_options.py checks the rest
    d = pool.publish(a)
    consumer.consume(d, ranks=0)
    assert pool.reclaim() in (0, 1)
    pool.drain(5000)
    assert pool.stats()["recycled"] >= 1


def test_drain_times_out(pool):
    pool.publish(np.zeros(16, np.uint8))  # nobody consumes it
    with pytest.raises(vmmt.Timeout, match="in flight after 50 ms"):
        pool.drain(50)


def test_closed_pool(no_leaks):
    p = vmmt.Pool(memory_size=2 << 20)
    p.close()
    p.close()
    assert p.closed
    with pytest.raises(vmmt.Error, match="closed"):
        p.publish(np.zeros(4, np.uint8))


def test_config_errors():
    with pytest.raises(ValueError, match="memory_size=4096 is smaller than CUDA VMM "
                                         "granularity=2097152; use at least 2097152 bytes "
                                         r"\(2 MiB\) or enable round-up"):
        vmmt.Pool(memory_size=4096)
    with vmmt.Pool(memory_size=4096, round_up=True) as p:
        assert p.stats()["allocation_size"] >= 4096
    with pytest.raises(ValueError, match="consumer_count"):
        vmmt.Pool(memory_size=2 << 20, consumer_count=0)
    with pytest.raises(TypeError, match="memory_size"):
        vmmt.Pool(device=0)
    with pytest.raises(TypeError, match="positional"):  # Pool(4 << 20) was device=4194304
        vmmt.Pool(4 << 20)
    with pytest.raises(ValueError, match="handle_type='carrier-pigeon': give one of"):
        vmmt.Pool(memory_size=2 << 20, handle_type="carrier-pigeon")
    with pytest.raises(ValueError, match="handoff"):
        vmmt.Pool(memory_size=2 << 20, handoff="maybe")
    with pytest.raises(ValueError, match="device=7 does not exist"):
        vmmt.Pool(device=7, memory_size=2 << 20, consumer_count=1)
    with pytest.raises(ValueError, match="timeout_ms"):
        vmmt.Consumer(timeout_ms=0)


@pytest.mark.parametrize("kw", [dict(memory_size=-1), dict(memory_size=2 ** 64 + (2 << 20)),
                                dict(max_slices=-1), dict(max_slices=2 ** 32 + 4),
                                dict(recycle_interval_us=-5),
                                dict(recycle_interval_us=2 ** 32 + 1000)])
def test_config_numbers_out_of_range(no_leaks, kw):
    """Attack finding: unchecked conversions wrapped these silently (max_slices=2**32+4
    made a pool of 4 slots, recycle_interval_us=-5 a recycler period of 71 minutes,
    memory_size=-1 a request for 16 EiB)."""
    args = dict(device=0, memory_size=2 << 20, consumer_count=1)
    args.update(kw)
    name = next(iter(kw))
    with pytest.raises(ValueError, match=name + "=.* out of range: give an int"):
        vmmt.Pool(**args)


def test_bad_inputs(pool):
    with pytest.raises(TypeError, match="__dlpack__"):
        pool.publish([1, 2, 3])
    with pytest.raises(ValueError, match="no elements"):
        pool.publish(np.zeros((0, 3), np.float32))
    with pytest.raises(ValueError, match="1 to 64"):
        pool.publish_many([])
    with pytest.raises(TypeError):
        pool.publish(np.zeros(3), stream="fast")
    with pytest.raises(ValueError, match="stream=-3"):
        pool.publish(np.zeros(3), stream=-3)
    assert pool.stats()["in_flight"] == 0


def test_descriptor_bytes_and_pickle(pool, consumer):
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    d = pool.publish(a)
    assert isinstance(d, bytes) and len(d) == 512
    assert d.ndim == 3 and d.pack_index == 0 and d.pack_count == 1
    assert d.producer_device == 0 and d.consumer_count == 1 and len(d.pool_id) == 16
    assert d.dl_dtype == (2, 32, 1) and d.handle_type == "posix_fd"
    back = pickle.loads(pickle.dumps(d))
    assert type(back) is vmmt.Descriptor and back == d
    again = vmmt.Descriptor.from_bytes(bytearray(d))
    assert again.shape == (2, 3, 4)
    assert "float32" in repr(d)
    np.testing.assert_array_equal(np.from_dlpack(consumer.consume(bytes(d), ranks=0)), a)


def test_descriptor_validation():
    with pytest.raises(ValueError, match="512 bytes"):
        vmmt.Descriptor(b"short")
    with pytest.raises(ValueError):
        vmmt.Descriptor(bytes(512))
    with vmmt.Pool(memory_size=2 << 20) as p:
        d = bytearray(p.publish(np.zeros(8, np.uint8)))
        d[100] ^= 0xFF
        with pytest.raises(ValueError, match="descriptor"):
            vmmt.Descriptor.from_bytes(d)
        p.cancel(bytes(p.publish(np.zeros(8, np.uint8))))


def test_out_numpy(pool, consumer):
    a = np.arange(10, dtype=np.int64)
    out = np.zeros(10, np.int64)
    assert consumer.consume(pool.publish(a), out=out, ranks=0) is out
    np.testing.assert_array_equal(out, a)
    with pytest.raises(ValueError, match="not C-contiguous"):
        consumer.consume(pool.publish(a), out=np.zeros(20, np.int64)[::2], ranks=0)
    d = pool.publish(a)
    with pytest.raises(ValueError, match="out holds"):
        consumer.consume(d, out=np.zeros(2, np.int64), ranks=0)
    # Attack finding: a host `out` too small was refused only after the consume had
    # copied and acknowledged the buffer, so the descriptor was lost for good.
    out[:] = 0
    assert consumer.consume(d, out=out, ranks=0) is out
    np.testing.assert_array_equal(out, a)


def test_consume_into_consumed_buffer(pool, consumer):
    """A Buffer is a DLPack array too: consume into one, relay one."""
    a = np.arange(32, dtype=np.uint8)
    first = consumer.consume(pool.publish(a), ranks=0)
    relayed = consumer.consume(pool.publish(first), ranks=0)  # device memory published again
    np.testing.assert_array_equal(np.from_dlpack(relayed), a)


def test_dlpack_capsules(pool, consumer):
    buf = consumer.consume(pool.publish(np.arange(6, dtype=np.float32)), ranks=0)
    assert buf.__dlpack_device__() == (1, 0)  # host memory on the emulated driver
    assert '"dltensor_versioned"' in repr(buf.__dlpack__(max_version=(1, 0)))
    assert '"dltensor"' in repr(buf.__dlpack__())
    assert '"dltensor"' in repr(buf.__dlpack__(max_version=(0, 8)))
    assert '"dltensor"' in repr(buf.__dlpack__(None))  # NumPy 1.x passes the stream positionally
    with pytest.raises(BufferError, match="dl_device"):
        buf.__dlpack__(dl_device=(2, 0))
    buf.__dlpack__(dl_device=(1, 0))
    with pytest.raises(BufferError, match="copy=True"):
        buf.__dlpack__(copy=True)
    buf.__dlpack__(copy=False)
    x = np.from_dlpack(buf)
    del buf  # the array keeps the memory
    np.testing.assert_array_equal(x, np.arange(6, dtype=np.float32))
    assert buf_props_ok(consumer.consume(pool.publish(np.zeros((2, 3), np.int16)), ranks=0))


def buf_props_ok(b):
    return b.shape == (2, 3) and b.nbytes == 12 and b.dl_dtype == (0, 16, 1) and b.ptr != 0


def test_ranks_and_ack(no_leaks):
    with vmmt.Pool(memory_size=2 << 20, consumer_count=3) as p, vmmt.Consumer() as c:
        a = np.arange(5, dtype=np.int32)
        d = p.publish(a)
        np.testing.assert_array_equal(np.from_dlpack(c.consume(d, ranks=0)), a)
        np.testing.assert_array_equal(np.from_dlpack(c.consume(d, ranks=range(1, 3))), a)
        p.drain(5000)
        d = p.publish(a)
        c.ack(d, ranks=[0, 1])
        c.ack(d, ranks=2)
        p.drain(5000)
        assert p.stats()["recycled"] == 2
        with pytest.raises(vmmt.Stale):
            c.ack(d, ranks=[0, 2])
        for bad in ([1, 1], [], (0, 256)):
            with pytest.raises(ValueError, match="rank"):
                c.ack(d, ranks=bad)


def test_rank_list_all_or_nothing(no_leaks):
    """ranks= a list of ranks that are not consecutive: one call, all of them
    or none (vmmt_consume_ranks). Rank 2 done already, a consume for [0, 2]
    copies nothing for rank 0, which consumes after."""
    with vmmt.Pool(memory_size=2 << 20, consumer_count=4) as p, vmmt.Consumer() as c:
        a = np.arange(7, dtype=np.int64)
        d = p.publish(a)
        c.ack(d, ranks=[2])
        out = np.zeros(7, np.int64)
        with pytest.raises(vmmt.Stale, match="rank 2"):
            c.consume(d, out=out, ranks=[0, 2])
        assert not out.any()
        np.testing.assert_array_equal(c.consume(d, out=out, ranks={3, 0}), a)
        with pytest.raises(vmmt.Stale):
            c.ack(d, ranks=[1, 3])
        p.reclaim()
        assert p.stats()["in_flight"] == 1
        c.ack(d, ranks=(1,))
        p.drain(5000)


def test_negative_ranks_refused(no_leaks):
    """Attack finding: ranks=-1 (or a range from -1) reached the C API as
    rank_first=VMMT_ALL_RANKS and acknowledged every rank of the pool."""
    with vmmt.Pool(memory_size=2 << 20, consumer_count=3) as p, vmmt.Consumer() as c:
        d = p.publish(np.arange(5, dtype=np.int32))
        for bad in (-1, -2, range(-1, 1), [-1]):
            with pytest.raises(ValueError, match="ranks"):
                c.ack(d, ranks=bad)
            with pytest.raises(ValueError, match="ranks"):
                c.consume(d, ranks=bad)
        p.reclaim()
        assert p.stats()["in_flight"] == 1
        c.ack(d, ranks=vmmt.ALL_RANKS)
        p.drain(5000)


def test_evict_and_pool_count(pool, consumer):
    d = pool.publish(np.zeros(4, np.uint8))
    consumer.consume(d, ranks=0)
    assert consumer.pool_count() == 1
    pool.drain(5000)
    consumer.evict(d)
    assert consumer.pool_count() == 0
    with pytest.raises(ValueError, match="16 bytes"):
        consumer.evict(b"x")


def test_streams_accepted(pool, consumer):
    class TorchLike:
        cuda_stream = 0

    class CudaCore:
        def __cuda_stream__(self):
            return (0, 0)

    a = np.arange(3, dtype=np.uint8)
    for s in (0, TorchLike(), CudaCore()):
        d = pool.publish(a, stream=s)
        np.testing.assert_array_equal(np.from_dlpack(consumer.consume(d, stream=s, ranks=0)), a)


def test_memory_helpers(no_leaks):
    from vmmt import _vmmt
    src = np.arange(64, dtype=np.uint8)
    back = np.zeros(64, np.uint8)
    p = _vmmt.mem_alloc(0, 64)
    try:
        _vmmt.mem_copy(0, p, src.ctypes.data, 64)
        _vmmt.mem_copy(0, back.ctypes.data, p, 64, 0)
        _vmmt.stream_synchronize(0, 0)
    finally:
        _vmmt.mem_free(0, p)
    np.testing.assert_array_equal(back, src)
    with pytest.raises(ValueError, match="nbytes=0"):
        _vmmt.mem_alloc(0, 0)


def test_probe_matches_cli():
    import json
    import os
    import subprocess
    report = vmmt.probe()
    assert report["driver"] == "emu" and report["device_count"] >= 1
    dev = report["devices"][0]
    assert dev["selected"] == "posix_fd"
    assert [t["type"] for t in dev["handle_types"]] == ["fabric", "posix_fd", "none"]
    assert vmmt.probe(0)["devices"] == [dev]
    tool = os.environ.get("VMMT_TEST_TOOL")
    if tool:
        out = subprocess.run([tool, "probe", "--json", "--driver", "emu"], capture_output=True,
                             text=True, timeout=60)
        assert json.loads(out.stdout) == report


def test_read_only_array_published(pool, consumer):
    """Attack finding: a read-only NumPy array (np.frombuffer of bytes, say) could not
    be published: NumPy before 2.1 refuses to export it through DLPack (BufferError),
    although publishing only reads it."""
    a = np.frombuffer(bytes(range(64)), dtype=np.uint8).reshape(8, 8)
    assert not a.flags.writeable
    np.testing.assert_array_equal(np.from_dlpack(consumer.consume(pool.publish(a), ranks=0)), a)
    d = pool.publish_many([a, np.arange(3, dtype=np.int16)])
    np.testing.assert_array_equal(np.from_dlpack(consumer.consume(d[0], ranks=0)), a)
    consumer.ack(d[1], ranks=0)
