"""Python conventions (issue 17, item 7): reprs that show what an object holds,
bool arrays published and consumed (one byte each, DLPack's kDLBool), keyword
arguments of Reservation.__dlpack__, the array API's stream rule on the CPU,
the library's log lines in `logging`, and stubs that say what consume
returns. Before: default reprs, NumPy's refusal of bool, positional
__dlpack__ arguments, stream=1 accepted on the CPU, stderr only, Any."""
import logging
import os
import re

import numpy as np

import pytest

import vmmt

STUB = os.path.join(os.path.dirname(vmmt.__file__), "__init__.pyi")


def test_reprs(pool, consumer):
    r = repr(pool)
    assert r.startswith("Pool(id=%s" % pool.pool_id.hex()[:8])
    for part in ("device=0", "consumer_count=1", "data_bytes=", "in_flight=0"):
        assert part in r, r
    d = pool.publish(np.zeros((2, 3), np.float32))
    assert "in_flight=1" in repr(pool)
    buf = consumer.consume(d, ranks=0)
    assert repr(buf).startswith("Buffer(dtype=float32, shape=(2, 3), nbytes=24, device=0")
    assert repr(consumer).startswith("Consumer(pools=1")
    del buf
    consumer.close()
    assert repr(consumer) == "Consumer(closed)"


def test_repr_of_a_closed_pool(no_leaks):
    pool = vmmt.Pool(memory_size=2 << 20)
    pool.close()
    assert repr(pool).startswith("Pool(closed, id=")


def test_bool_arrays(pool, consumer):
    """Attention masks: NumPy before 1.25 refuses to export bool through DLPack."""
    mask = np.array([[True, False, True], [False, False, True]])
    d = pool.publish(mask)
    assert d.dtype == "bool" and d.dl_dtype == (6, 8, 1) and d.nbytes == 6
    out = np.zeros_like(mask)
    assert consumer.consume(d, out=out, ranks=0) is out
    assert np.array_equal(out, mask)
    d = pool.publish(mask[:, ::2])  # not contiguous: made so first
    buf = consumer.consume(d, ranks=0)
    assert buf.dl_dtype == (6, 8, 1) and buf.shape == (2, 2)
    assert "dtype=bool" in repr(buf)
    packed = pool.publish_many([mask, np.arange(3, dtype=np.int64)])
    assert [p.dtype for p in packed] == ["bool", "int64"]
    out = np.zeros_like(mask)
    consumer.consume(packed[0], out=out, ranks=0)
    consumer.ack(packed[1], ranks=0)
    assert np.array_equal(out, mask)
    r = pool.reserve(6)
    np.frombuffer(r.memoryview(), np.uint8)[:] = mask.ravel()
    d = pool.commit(r, "bool", (2, 3))
    out = np.zeros_like(mask)
    consumer.consume(d, out=out, ranks=0)
    assert np.array_equal(out, mask)


def test_reservation_dlpack_keywords_and_cpu_stream(pool, consumer):
    r = pool.reserve(16)
    with pytest.raises(TypeError):
        r.__dlpack__(None)  # keywords only, as the array API has them
    with pytest.raises(ValueError, match="stream=1: .*CPU.*only None"):
        r.__dlpack__(stream=1)
    np.frombuffer(r.memoryview(), np.uint8)[:] = 7
    d = pool.commit(r)
    buf = consumer.consume(d, ranks=0)
    with pytest.raises(ValueError, match="stream=1: .*CPU"):
        buf.__dlpack__(stream=1)
    with pytest.raises(ValueError, match="stream=-1: .*CPU"):
        buf.__dlpack__(stream=-1)
    assert (np.from_dlpack(buf) == 7).all()  # stream=None: synchronizes


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_library_log_lines_are_logging_records(no_leaks):
    handler = Records()
    logger = logging.getLogger("vmmt")
    logger.addHandler(handler)
    try:
        with vmmt.Pool(memory_size=2 << 20, max_slices=1) as pool:
            d = pool.publish(np.zeros(4, np.uint8))
            with pytest.raises(vmmt.PoolFull):
                pool.publish(np.zeros(4, np.uint8))  # the library warns, once per pool
            vmmt._logging.drain()
            pool.cancel(d)
    finally:
        logger.removeHandler(handler)
    full = [r for r in handler.records if re.search("pool [0-9a-f]+ is full", r.getMessage())]
    assert full and full[0].levelno == logging.WARNING and full[0].name == "vmmt"
    assert "Pool.stats()" in full[0].getMessage()  # the Python name, not vmmt_pool_get_stats


def test_log_to_stderr_and_back(no_leaks, capfd):
    vmmt.log_to_stderr()
    try:
        with vmmt.Pool(memory_size=2 << 20, max_slices=1) as pool:
            d = pool.publish(np.zeros(4, np.uint8))
            with pytest.raises(vmmt.PoolFull):
                pool.publish(np.zeros(4, np.uint8))
            pool.cancel(d)
        assert re.search("vmmt warning: pool [0-9a-f]+ is full", capfd.readouterr().err)
    finally:
        vmmt.log_to_logging()


def test_stubs_are_precise():
    text = open(STUB).read()
    consume = text[text.index("    def consume("):text.index("    def ack(")]
    assert "-> Buffer" in consume and "-> _Out" in consume and "Any" not in consume
    assert "ranks: Ranks)" in consume  # required
    for name in ("NoRoom", "TooLarge", "Closed", "Stale", "ProducerGone", "EFULL",
                 "def release_rank", "def poll_deaths", "def check", "consumer_lease_ms",
                 "rank_releases", "released_slices", "consumer_links"):
        assert name in text, name
    assert "class Timeout(Error, TimeoutError)" in text
