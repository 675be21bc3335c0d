"""Deaths of either side, from Python (issue 17, items 1 and 4): a producer and
two rank processes; rank 1 is SIGKILLed while it holds descriptors, the
producer learns which rank of which pool died (poll_deaths and a logging
record), restarts it with the recipe of python/README.md ("Deaths"), and the
pool keeps working. Before: no release_rank, no way to learn the rank, and the
dead rank's later slices filled the pool for good."""
import logging
import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

import mp_ranks
import vmmt


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def wait_for(what, until, timeout_s=20):
    """Poll `until()` (no timing claim: a bound so that nothing waits for ever)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = until()
        if value:
            return value
        assert time.monotonic() < deadline, "no %s within %d s" % (what, timeout_s)
        time.sleep(0.01)


def in_flight(pool):
    """Slices in flight once what was acknowledged is recycled (acknowledgements
    land a little after a consume returns: polled, never assumed)."""
    pool.reclaim()
    return pool.stats()["in_flight"]


class Rank:
    """One rank process and its pipe."""

    def __init__(self, ctx, rank):
        self.rank = rank
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=mp_ranks.rank_main, args=(child, rank))
        self.proc.start()
        child.close()

    def stop(self):
        self.conn.send(None)
        self.proc.join(30)


def publish_to_all(pool, ranks, i):
    d = pool.publish(mp_ranks.payload(i))
    for r in ranks:
        r.conn.send((i, d))
    for r in ranks:
        assert r.conn.recv() == (i, True)


def test_rank_killed_and_restarted():
    ctx = mp.get_context("spawn")
    records = Records()
    logging.getLogger("vmmt").addHandler(records)
    try:
        with vmmt.Pool(memory_size=4 << 20, consumer_count=2, max_slices=64) as pool:
            ranks = [Rank(ctx, 0), Rank(ctx, 1)]
            for i in range(50):
                publish_to_all(pool, ranks, i)
            assert pool.stats()["consumer_links"] == 2
            # Rank 1 stops reading and is killed holding 20 descriptors it was sent.
            ranks[1].conn.send(("hold",))
            assert ranks[1].conn.recv() == ("holding", 1)
            for i in range(50, 70):
                d = pool.publish(mp_ranks.payload(i))
                ranks[0].conn.send((i, d))
                assert ranks[0].conn.recv() == (i, True)
                ranks[1].conn.send((i, d))
            wait_for("20 in flight", lambda: in_flight(pool) == 20)
            os.kill(ranks[1].proc.pid, signal.SIGKILL)

            # The producer learns which rank of which pool died.
            assert wait_for("death", pool.poll_deaths) == [1]
            assert pool.poll_deaths() == []  # each death once
            vmmt._logging.drain()
            named = [m for m in records.messages if pool.pool_id.hex()[:8] in m]
            assert any("rank(s) 1 found dead" in m for m in named), records.messages
            wait_for("release", lambda: pool.stats()["released_slices"] >= 20)
            # Published while rank 1 is down: these still wait for rank 1.
            for i in range(70, 75):
                publish_to_all(pool, ranks[:1], i)
            wait_for("5 in flight", lambda: in_flight(pool) == 5)

            # The recipe: reap the old process, release its rank (the 5 above
            # are acknowledged on its behalf), start the new one.
            ranks[1].proc.join()
            pool.release_rank(1)
            ranks[1] = Rank(ctx, 1)
            for i in range(75, 400):  # more than max_slices: the dead rank's slices came back
                publish_to_all(pool, ranks, i)
            for r in ranks:
                r.stop()
            pool.drain(10000)
            s = pool.stats()
            assert s["in_flight"] == 0 and s["published"] == 400
            assert s["rank_releases"] >= 2 and s["released_slices"] >= 25
            assert s["full"] == 0
    finally:
        logging.getLogger("vmmt").removeHandler(records)
        for r in ranks:
            if r.proc.is_alive():
                r.proc.kill()


def test_lease_reports_a_silent_rank(no_leaks):
    """consumer_lease_ms: a rank that no process holds and that sits on a slice
    is released and reported like a dead one."""
    with vmmt.Pool(memory_size=4 << 20, consumer_count=2, consumer_lease_ms=20) as pool, \
            vmmt.Consumer() as consumer:
        d = pool.publish(np.arange(4, dtype=np.int32))
        consumer.consume(d, ranks=0)
        assert wait_for("lease", pool.poll_deaths) == [1]
        pool.drain(5000)
        assert pool.stats()["rank_releases"] == 1


def test_release_rank_arguments(no_leaks):
    with vmmt.Pool(memory_size=4 << 20, consumer_count=2) as pool:
        for bad in (-1, 2):
            with pytest.raises(ValueError, match="rank=%d is out of range.*0..1" % bad):
                pool.release_rank(bad)
        with pytest.raises(TypeError, match="rank"):
            pool.release_rank("1")
        d = pool.publish(np.arange(4, dtype=np.int32))
        pool.release_rank(0)
        pool.release_rank(1)
        pool.drain(5000)  # acknowledged on both ranks' behalf
        assert pool.poll_deaths() == []  # the engine's own releases are not deaths
        with vmmt.Consumer() as c, pytest.raises(vmmt.Stale):
            c.consume(d, ranks=0)  # released: its slice may hold new data


def producer_main(conn):
    with vmmt.Pool(memory_size=4 << 20) as pool:
        conn.send([pool.publish(mp_ranks.payload(i)) for i in range(3)])
        conn.recv()  # killed here


def test_producer_killed(no_leaks):
    """The other side: a consumer whose producer died gets ProducerGone, named
    as such, for what it had not consumed yet; check() passes what it had."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=producer_main, args=(child,))
    proc.start()
    try:
        descs = conn.recv()
        with vmmt.Consumer() as c:
            assert np.array_equal(np.from_dlpack(c.consume(descs[0], ranks=0)),
                                  mp_ranks.payload(0))
            c.check(descs[0])  # the producer's bytes
            os.kill(proc.pid, signal.SIGKILL)
            proc.join()
            for d in descs[1:]:
                with pytest.raises(vmmt.ProducerGone, match="producer .* has exited") as e:
                    c.consume(d, ranks=0)
                assert e.value.status == vmmt.ECLOSED
                assert "Consumer.check()" in str(e.value)  # the Python name, not the C one
                assert "vmmt_consumer_check" not in str(e.value)
    finally:
        if proc.is_alive():
            proc.kill()
