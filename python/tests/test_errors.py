"""One exception family and the status constants (issue 17, item 2): every
publishing call says "no room" the same way (NoRoom: PoolFull now, TooLarge
never), and closed, stale, producer-gone and timeout cases have classes of
their own, so that a program written from the docs falls back without
reading vmmt.h. Before: publish_many returned None when full, a too-large
buffer was a plain Error with status -15, Timeout was no TimeoutError, and
there were no constants."""
import os
import re

import numpy as np
import pytest

import vmmt

HEADER = os.path.join(os.path.dirname(__file__), "..", "..", "include", "vmmt.h")


def test_status_constants_match_the_header():
    text = open(HEADER).read()
    enum = text[text.index("typedef enum vmmt_status {"):text.index("} vmmt_status;")]
    want = {m.group(1): int(m.group(2)) for m in re.finditer(r"VMMT_(\w+) = (-?\d+)", enum)}
    assert want and {k: getattr(vmmt, k) for k in want} == want
    assert vmmt.STATUSES == want
    assert set(want) <= set(vmmt.__all__)


def test_family():
    assert issubclass(vmmt.Error, RuntimeError)
    for cls in (vmmt.NoRoom, vmmt.Closed, vmmt.Stale, vmmt.ProducerGone, vmmt.Timeout):
        assert issubclass(cls, vmmt.Error)
    assert issubclass(vmmt.PoolFull, vmmt.NoRoom) and issubclass(vmmt.TooLarge, vmmt.NoRoom)
    assert issubclass(vmmt.Timeout, TimeoutError)


def publishers(pool, nbytes):
    """Every publishing call, each trying to publish `nbytes`."""
    def commit():
        r = pool.reserve(nbytes)
        return pool.commit(r)
    return {"publish": lambda: pool.publish(np.zeros(nbytes, np.uint8)),
            "publish_many": lambda: pool.publish_many([np.zeros(nbytes, np.uint8)]),
            "reserve+commit": commit}


def test_every_publishing_call_says_no_room_alike(no_leaks):
    with vmmt.Pool(memory_size=2 << 20, max_slices=4) as pool, vmmt.Consumer() as c:
        room = pool.data_bytes
        for name, call in publishers(pool, room * 2).items():
            with pytest.raises(vmmt.TooLarge, match="can never fit") as e:
                call()
            assert e.value.status == vmmt.ETOOBIG, name
        held = pool.publish(np.zeros(room // 2 + 1, np.uint8))
        for name, call in publishers(pool, room // 2 + 1).items():
            with pytest.raises(vmmt.PoolFull, match="pool [0-9a-f]* is full") as e:
                call()
            assert e.value.status == vmmt.EFULL, name
        c.ack(held, ranks=0)
        pool.drain(5000)


def test_integration_snippet_handles_every_case(no_leaks):
    """docs/integration.md's fallback, as written there: one except clause."""
    sent, fell_back = [], []

    def send(pool, tensors):
        try:
            sent.append(pool.publish_many(tensors))
        except vmmt.NoRoom:  # full now, or never fits: the fallback path
            fell_back.append(len(tensors))

    with vmmt.Pool(memory_size=2 << 20, max_slices=2) as pool, vmmt.Consumer() as c:
        send(pool, [np.zeros(pool.data_bytes + 1, np.uint8)])  # never fits
        send(pool, [np.zeros(8, np.uint8)])
        send(pool, [np.zeros(8, np.uint8)])
        send(pool, [np.zeros(8, np.uint8)])  # no slot left
        assert len(sent) == 2 and fell_back == [1, 1]
        for descs in sent:
            c.ack(descs[0], ranks=0)
        pool.drain(5000)


def test_closed(no_leaks):
    pool = vmmt.Pool(memory_size=2 << 20)
    pool.close()
    for call in list(publishers(pool, 8).values()) + [pool.stats, pool.reclaim]:
        with pytest.raises(vmmt.Closed, match="closed") as e:
            call()
        assert e.value.status == vmmt.ECLOSED
    with vmmt.Pool(memory_size=2 << 20) as pool:
        d = pool.publish(np.zeros(4, np.uint8))
        c = vmmt.Consumer()
        c.close()
        for call in (lambda: c.consume(d, ranks=0), lambda: c.ack(d, ranks=0),
                     lambda: c.check(d), c.flush):
            with pytest.raises(vmmt.Closed, match="consumer is closed"):
                call()
        pool.cancel(d)


def test_stale(pool, consumer):
    d = pool.publish(np.arange(4, dtype=np.int32))
    consumer.consume(d, ranks=0)
    # Refused as consumed already, or (once its acknowledgement landed and the recycler
    # retired the slot, which a loaded machine can do between two calls) as no longer live.
    for call in (lambda: consumer.consume(d, ranks=0), lambda: consumer.ack(d, ranks=0)):
        with pytest.raises(vmmt.Stale, match="already|no live occupant") as e:
            call()
        assert e.value.status == vmmt.ESTATE
    d = pool.publish(np.arange(4, dtype=np.int32))
    pool.cancel(d)
    pool.reclaim()
    with pytest.raises(vmmt.Stale):
        consumer.consume(d, ranks=0)


def test_timeout_is_a_timeout_error(pool):
    pool.publish(np.zeros(4, np.uint8))  # never consumed
    with pytest.raises(TimeoutError, match="in flight after 20 ms") as e:
        pool.drain(20)
    assert isinstance(e.value, vmmt.Timeout) and e.value.status == vmmt.ETIMEDOUT


def test_messages_name_python_methods(pool, consumer):
    d = pool.publish(np.arange(4, dtype=np.int32))
    consumer.ack(d, ranks=0)
    with pytest.raises(vmmt.Stale) as e:
        consumer.ack(d, ranks=0)
    assert "Consumer.ack()" in str(e.value) and "vmmt_consumer_ack" not in str(e.value)
