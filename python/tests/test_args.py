"""Every bad argument is a TypeError (wrong kind) or ValueError (out of range)
that names the argument and what it accepts, raised before anything is
copied, allocated or consumed (issue 17, items 3, 5 and 6). Before: Pool
(memory_size=-1) was an OverflowError, memory_size=1e9 "expected an int",
Pool(4 << 20) silently device=4194304, reserve(-1) "18446744073709551615
bytes can never fit", consume(d, out=[...]) an AttributeError, device=5 an
Error about vmmt_mem_alloc, memory_size=1 << 50 "out of memory" for a
device allocation, a 1 GiB broadcast view took 1 GiB before the fit check,
and ranks=None acknowledged every rank."""
import resource

import numpy as np
import pytest

import vmmt


@pytest.mark.parametrize("kw, exc, what", [
    (dict(memory_size=-1), ValueError,
     r"memory_size=-1 is out of range: give an int of 1\.\.18446744073709551615 bytes"),
    (dict(memory_size=1e9), TypeError, r"memory_size=1000000000\.0: give an int"),
    (dict(memory_size="4M"), TypeError, r"memory_size='4M' \(str\): give an int"),
    (dict(memory_size=1 << 50), ValueError, r"memory_size=1125899906842624 \(1024\.0 TiB\) is "
                                            r"more than device 0's memory"),
    (dict(memory_size=1 << 50, memory_location="host"), ValueError, "more than host memory"),
    (dict(memory_size=4 << 20, device=5), ValueError, r"device=5 does not exist: the emu driver "
                                                      r"reports 2 device\(s\); give one of 0\.\.1"),
    (dict(memory_size=4 << 20, device=True), TypeError, "device=True"),
    (dict(memory_size=4 << 20, consumer_count=257), ValueError, r"consumer_count=257 .*1\.\.256"),
    (dict(memory_size=4 << 20, timeout_ms=0), ValueError, "timeout_ms=0 is out of range"),
    (dict(memory_size=4 << 20, consumer_lease_ms=-1), ValueError, "consumer_lease_ms=-1"),
    (dict(memory_size=4 << 20, round_up="yes"), TypeError, "round_up='yes': give True or False"),
    (dict(memory_size=4 << 20, broker_path=5), TypeError, "broker_path=5"),
])
def test_pool_options(no_leaks, kw, exc, what):
    with pytest.raises(exc, match=what):
        vmmt.Pool(**kw)


def test_pool_options_are_keywords(no_leaks):
    with pytest.raises(TypeError, match="positional"):
        vmmt.Pool(4 << 20)  # was device=4194304
    with pytest.raises(TypeError, match="memory_size"):
        vmmt.Pool()


def test_reserve(pool):
    for bad, exc in ((-1, ValueError), (0, ValueError), (1.5, TypeError), ("8", TypeError)):
        with pytest.raises(exc, match="nbytes=.*give an int of 1\\.\\..* bytes"):
            pool.reserve(bad)
    assert pool.stats()["in_flight"] == 0


def test_consume_arguments_checked_before_consuming(pool, consumer):
    d = pool.publish(np.arange(4, dtype=np.int32))
    with pytest.raises(TypeError, match="out=list: give an array with __dlpack__"):
        consumer.consume(d, out=[0, 0, 0, 0], ranks=0)
    with pytest.raises(ValueError, match="device=5 does not exist"):
        consumer.consume(d, device=5, ranks=0)
    with pytest.raises(ValueError, match="device=5 does not exist"):
        consumer.ack(d, device=5, ranks=0)
    with pytest.raises(TypeError, match="device=1.0"):
        consumer.consume(d, device=1.0, ranks=0)
    # Nothing was consumed: the descriptor is still whole.
    assert np.array_equal(np.from_dlpack(consumer.consume(d, ranks=0)), np.arange(4))


def test_ranks_required(pool, consumer):
    """A tensor-parallel rank that forgot ranks= acknowledged every rank."""
    d = pool.publish(np.arange(4, dtype=np.int32))
    with pytest.raises(TypeError, match="ranks"):
        consumer.consume(d)
    with pytest.raises(TypeError, match="ranks"):
        consumer.ack(d)
    with pytest.raises(TypeError, match="ranks=None: say which rank"):
        consumer.consume(d, ranks=None)
    with pytest.raises(ValueError, match="ranks='every'"):
        consumer.ack(d, ranks="every")
    assert vmmt.ALL_RANKS == "all"
    consumer.ack(d, ranks=vmmt.ALL_RANKS)
    pool.drain(5000)


def test_all_ranks_explicit(no_leaks):
    with vmmt.Pool(memory_size=2 << 20, consumer_count=3) as p, vmmt.Consumer() as c:
        d = p.publish(np.arange(5, dtype=np.int32))
        np.testing.assert_array_equal(np.from_dlpack(c.consume(d, ranks="all")), np.arange(5))
        p.drain(5000)  # one consume for every rank


def test_broadcast_view_checked_before_it_is_materialized(pool):
    """A 4-byte broadcast view of 1 GiB took 1 GiB of memory, then could never fit;
    one of 4 TiB raised NumPy's MemoryError."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    for n in (1 << 28, 1 << 40):
        view = np.broadcast_to(np.float32(1), (n,))
        with pytest.raises(vmmt.TooLarge, match="can never fit") as e:
            pool.publish(view)
        assert e.value.status == vmmt.ETOOBIG
        with pytest.raises(vmmt.TooLarge):
            pool.publish_many([np.zeros(4), view])
    grew_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grew_mib < 256, "%.0f MiB" % grew_mib  # not the 1 GiB a copy takes
    small = np.broadcast_to(np.arange(4, dtype=np.int32), (3, 4))  # fits: made contiguous
    assert pool.publish(small).shape == (3, 4)
