"""An outside attack on the binding's rank lists: Consumer.consume(...,
ranks=[...]) / ack(..., ranks=[...]) (vmmt_consume_ranks and
vmmt_consumer_ack_ranks: every rank listed, or, where any is done already,
none) and vmmt.sglang's acknowledge_ranks=, written from python/README.md
("API", "Errors", "From sglang") and include/vmmt.h alone.

Every case checks what a refusal left: each rank of the pool that the call
did not do can still be acknowledged exactly once, and the pool drains.

Findings (each fixed 2026-12-07, in the session that ordered the attack; the
tests below now hold the fix):
1. test_finding_list_errors_name_the_c_function: a refused list names
   vmmt_consume_ranks / vmmt_consumer_ack_ranks; README "Errors" says the
   message names the Python method (a run's does: "Consumer.consume(): ...").
2. test_finding_out_of_range_list_message_blames_every_rank: ranks=[0, 256]
   is "ranks [0, 256] are out of range" (rank 0 is not), and a list of 300
   ranks is a 1,454-character message; the library's own message names the
   entry ("rank 5 (entry 1 of the list)").
3. test_finding_zero_d_numpy_integer_refused: ranks=numpy.array(2), an
   __index__ integer, is a TypeError with NumPy's "iteration over a 0-d
   array", which names no argument; README: "any __index__ integer".
4. test_finding_bytes_taken_as_a_rank_list: ranks=b"\\x02" acknowledges rank
   2 (bytes iterate as ints), while ranks="2" is refused; README: "a range,
   or a list, tuple or set".
5. test_finding_proxy_second_acknowledge_ranks_dropped (and ..._threads):
   a proxy that acknowledged (or rebuilt) for one acknowledge_ranks list
   answers a second call naming other ranks with success and acknowledges
   none of them: the slice is never freed. README: a list is "done for
   every rank it names or, where any of them is done already, for none
   (the call raises Stale ...)".
6. test_finding_acknowledge_ranks_int_message: acknowledge_ranks=2 raises
   TypeError "'int' object is not iterable", naming no argument.
"""
import pickle
import threading

import numpy as np
import pytest

import vmmt
import vmmt.sglang as vs
from sglang_fixtures import clean  # noqa: F401

DEADLINE = 10.0


def both_at_once(run, first, second):
    """run(*first) and run(*second) on two threads, joined within DEADLINE;
    True when neither is left alive."""
    ts = [threading.Thread(target=run, args=first), threading.Thread(target=run, args=second)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(DEADLINE)
    return not any(t.is_alive() for t in ts)


def owed(consumer, desc, count):
    """The ranks that can still acknowledge desc, each acknowledged by this
    probe (so afterwards every rank is done)."""
    left = []
    for r in range(count):
        try:
            consumer.ack(desc, ranks=r)
            left.append(r)
        except vmmt.Stale:
            pass
    return left


def drained(pool):
    pool.drain(5000)
    return pool.stats()["in_flight"] == 0


@pytest.fixture
def pool4(no_leaks):
    with vmmt.Pool(memory_size=8 << 20, max_slices=64, consumer_count=4) as p:
        yield p


@pytest.fixture
def cons(no_leaks):
    with vmmt.Consumer() as c:
        yield c


class Idx:
    def __init__(self, v):
        self.v = v

    def __index__(self):
        return self.v


class RankList(list):
    pass


FORMS = [
    ("list", lambda: [2, 0]),
    ("tuple", lambda: (0, 2)),
    ("set", lambda: {2, 0}),
    ("frozenset", lambda: frozenset({0, 2})),
    ("stepped range", lambda: range(0, 4, 2)),
    ("reversed stepped range", lambda: range(2, -1, -2)),
    ("numpy ints", lambda: [np.int64(2), np.int8(0)]),
    ("list subclass", lambda: RankList([0, 2])),
    ("__index__ objects", lambda: [Idx(2), Idx(0)]),
]


@pytest.mark.parametrize("name,make", FORMS, ids=[f[0] for f in FORMS])
def test_list_forms_consume_exactly_the_named_ranks(pool4, cons, name, make):
    a = np.arange(32, dtype=np.int32) * 3
    d = pool4.publish(a)
    np.testing.assert_array_equal(np.from_dlpack(cons.consume(d, ranks=make())), a)
    assert owed(cons, d, 4) == [1, 3]
    assert drained(pool4)
    d = pool4.publish(a)
    cons.ack(d, ranks=make())
    assert owed(cons, d, 4) == [1, 3]
    assert drained(pool4)


def test_ranges_that_are_not_runs(pool4, cons):
    """A range with a step or going down is the set it yields, not the run
    [start, start + len)."""
    for r, left in ((range(3, -1, -1), []), (range(3, 1, -1), [0, 1]), (range(1, 4, 2), [0, 2]),
                    (range(3, 0, -3), [0, 1, 2])):
        a = np.arange(8, dtype=np.float32) + len(r)
        d = pool4.publish(a)
        np.testing.assert_array_equal(np.from_dlpack(cons.consume(d, ranks=r)), a)
        assert owed(cons, d, 4) == left, r
    assert drained(pool4)


def test_list_of_every_rank_is_all_ranks(pool4, cons):
    a = np.arange(10, dtype=np.int16)
    d = pool4.publish(a)
    np.testing.assert_array_equal(np.from_dlpack(cons.consume(d, ranks=[3, 1, 0, 2])), a)
    for ranks in (vmmt.ALL_RANKS, "all", 0, [1], {2, 3}):
        with pytest.raises(vmmt.Stale):
            cons.ack(d, ranks=ranks)
    assert drained(pool4)
    d = pool4.publish(a)
    cons.ack(d, ranks=vmmt.ALL_RANKS)
    with pytest.raises(vmmt.Stale):
        cons.consume(d, ranks={0, 1, 2, 3})
    assert drained(pool4)


def test_list_of_one_is_that_rank(pool4, cons):
    d = pool4.publish(np.ones(4))
    cons.ack(d, ranks=[2])
    for ranks in (2, (2,), {2}, range(2, 3), [0, 2]):
        with pytest.raises(vmmt.Stale):
            cons.ack(d, ranks=ranks)
    assert owed(cons, d, 4) == [0, 1, 3]
    assert drained(pool4)


def _raising_gen():
    yield 0
    raise KeyError("the generator broke")


class BadIndex:
    def __index__(self):
        raise ZeroDivisionError("no index")


BAD = [
    ([True, 2], (TypeError, ValueError)),
    ([False], (TypeError, ValueError)),
    ([1, 1], ValueError),
    ([2, 0, 2], ValueError),
    ([[0, 1]], TypeError),
    ([-1], ValueError),
    (["all"], (TypeError, ValueError)),
    ([vmmt.ALL_RANKS, 0], (TypeError, ValueError)),
    ([1.0], TypeError),
    ([2 ** 64, 0], ValueError),
    ([0, 4], ValueError),
    ([], ValueError),
    ((), ValueError),
    (set(), ValueError),
    (range(2, 2), ValueError),
    (list(range(300)), ValueError),
    (range(0, 257), ValueError),
    ([0, 1, 2, 3, 0], ValueError),
    ([None], TypeError),
    ("02", (TypeError, ValueError)),
]


@pytest.mark.parametrize("ranks,exc", BAD, ids=[repr(b[0])[:24] for b in BAD])
def test_bad_lists_take_nothing(pool4, cons, ranks, exc):
    a = np.arange(16, dtype=np.int32)
    d = pool4.publish(a)
    out = np.full(16, -1, np.int32)
    with pytest.raises(exc):
        cons.consume(d, out=out, ranks=ranks)
    assert (out == -1).all()
    with pytest.raises(exc):
        cons.ack(d, ranks=ranks)
    np.testing.assert_array_equal(np.from_dlpack(cons.consume(d, ranks=[0, 2])), a)
    assert owed(cons, d, 4) == [1, 3]
    assert drained(pool4)


def test_exceptions_while_reading_the_list_take_nothing(pool4, cons):
    d = pool4.publish(np.arange(4.0))
    with pytest.raises(KeyError):
        cons.consume(d, ranks=_raising_gen())
    with pytest.raises(ZeroDivisionError):
        cons.ack(d, ranks=[0, BadIndex()])
    assert owed(cons, d, 4) == [0, 1, 2, 3]
    assert drained(pool4)


def test_list_mutated_while_read(pool4, cons):
    """An __index__ that empties or grows the list being read: no crash, and
    the call does some set of ranks (or none) exactly once."""
    for grow in (False, True):
        d = pool4.publish(np.arange(4.0))
        lst = [0, 1]

        class Evil:
            def __index__(self):
                if grow:
                    lst.extend(range(10, 400))
                else:
                    lst.clear()
                return 3

        lst.insert(0, Evil())
        try:
            cons.ack(d, ranks=lst)
            raised = False
        except (TypeError, ValueError):
            raised = True
        left = owed(cons, d, 4)
        if raised:
            assert left == [0, 1, 2, 3]
        assert drained(pool4)


def test_refused_list_leaves_out_and_ranks(pool4, cons):
    a = np.arange(16, dtype=np.int32)
    d = pool4.publish(a)
    cons.ack(d, ranks={2})
    out = np.full(16, -1, np.int32)
    with pytest.raises(vmmt.Stale, match="rank 2"):
        cons.consume(d, out=out, ranks=[0, 2])
    assert (out == -1).all()
    assert cons.consume(d, out=out, ranks=(0,)) is out
    np.testing.assert_array_equal(out, a)
    assert owed(cons, d, 4) == [1, 3]
    assert drained(pool4)


def test_packed_list_and_range_are_one_set(pool4, cons):
    arrays = [np.arange(4, dtype=np.int32), np.arange(5, dtype=np.float64), np.ones(3, np.uint8)]
    ds = pool4.publish_many(arrays)
    np.testing.assert_array_equal(np.from_dlpack(cons.consume(ds[0], ranks=[1, 0])), arrays[0])
    with pytest.raises(ValueError):
        cons.consume(ds[1], ranks=[1, 2])  # another set sharing rank 1
    with pytest.raises(ValueError):
        cons.consume(ds[1], ranks=1)
    np.testing.assert_array_equal(np.from_dlpack(cons.consume(ds[1], ranks=range(0, 2))),
                                  arrays[1])
    np.testing.assert_array_equal(np.from_dlpack(cons.consume(ds[2], ranks={0, 1})), arrays[2])
    for d in ds:
        cons.ack(d, ranks=[3, 2])
    assert drained(pool4)

    ds = pool4.publish_many(arrays)
    np.testing.assert_array_equal(np.from_dlpack(cons.consume(ds[0], ranks={0, 2})), arrays[0])
    cons.ack(ds[0], ranks=range(3, 0, -2))  # {3, 1}: a second set, disjoint
    cons.ack(ds[1], ranks=[2, 0])
    cons.ack(ds[1], ranks=(1, 3))
    np.testing.assert_array_equal(np.from_dlpack(cons.consume(ds[2], ranks=range(0, 4, 2))),
                                  arrays[2])
    with pytest.raises(vmmt.Timeout):
        pool4.drain(50)  # member 2 for {1, 3} still owed
    assert pool4.stats()["in_flight"] == 1
    cons.ack(ds[2], ranks=[3, 1])
    assert drained(pool4)


def test_two_consumers_race_lists_overlapping_by_one_rank(pool4, no_leaks):
    """Two consumers (two processes of the binding's view) race {0, 1} and
    {2, 1}: exactly one wins rank 1 with the descriptor's bytes; the loser's
    own rank is left for a third."""
    with vmmt.Consumer() as a, vmmt.Consumer() as b, vmmt.Consumer() as third:
        wins = [0, 0]
        for n in range(40):
            src = np.arange(256, dtype=np.int32) + n
            d = pool4.publish(src)
            go = threading.Barrier(2)
            got = [None, None]

            def run(i, c, ranks):
                go.wait(DEADLINE)
                try:
                    got[i] = np.from_dlpack(c.consume(d, ranks=ranks)).copy()
                except vmmt.Error as e:
                    got[i] = e

            assert both_at_once(run, (0, a, [0, 1]), (1, b, [2, 1]))
            ok = [isinstance(g, np.ndarray) for g in got]
            assert ok.count(True) == 1, "round %d: %r" % (n, got)
            loser = ok.index(False)
            assert isinstance(got[loser], vmmt.Stale), got[loser]
            np.testing.assert_array_equal(got[ok.index(True)], src)
            wins[ok.index(True)] += 1
            assert owed(third, d, 4) == ([2, 3] if ok[0] else [0, 3])
            assert drained(pool4)


@pytest.mark.parametrize("kind", ["host", "elastic", "device_table"])
def test_lists_on_other_pool_kinds(no_leaks, kind):
    opts = {"host": dict(memory_location="host"), "elastic": dict(elastic=True),
            "device_table": dict(device_control_table=True)}[kind]
    with vmmt.Pool(memory_size=8 << 20, max_slices=8, consumer_count=4, **opts) as p, \
            vmmt.Consumer() as c:
        a = np.arange(100, dtype=np.float32)
        d = p.publish(a)
        np.testing.assert_array_equal(np.from_dlpack(c.consume(d, ranks={2, 0})), a)
        c.flush()
        with pytest.raises(vmmt.Stale):
            c.ack(d, ranks=[1, 2])
        c.ack(d, ranks=(3, 1))
        assert drained(p)
        ds = p.publish_many([a, a[:7]])
        np.testing.assert_array_equal(np.from_dlpack(c.consume(ds[0], ranks=[3, 0])), a)
        c.ack(ds[0], ranks=range(1, 3))
        c.ack(ds[1], ranks=[2, 1])
        np.testing.assert_array_equal(np.from_dlpack(c.consume(ds[1], ranks={0, 3})), a[:7])
        c.flush()
        assert drained(p)


# ------------------------------------------------------------------ findings


def test_finding_list_errors_name_the_c_function(pool4, cons):
    d = pool4.publish(np.arange(4.0))
    cons.ack(d, ranks=2)
    messages = []
    for call in (lambda: cons.consume(d, ranks=[0, 2]), lambda: cons.ack(d, ranks=[2, 0]),
                 lambda: cons.ack(d, ranks=[0, 9])):
        with pytest.raises((vmmt.Stale, ValueError)) as e:  # ValueError: the out-of-pool rank
            call()
        messages.append(str(e.value))
    cons.ack(d, ranks=[0, 1, 3])
    assert drained(pool4)
    for m in messages:
        assert "vmmt_consume" not in m, m
        assert m.startswith("Consumer.consume()") or m.startswith("Consumer.ack()"), m


def test_finding_out_of_range_list_message_blames_every_rank(pool4, cons):
    d = pool4.publish(np.arange(4.0))
    with pytest.raises(ValueError) as small:
        cons.ack(d, ranks=[0, 256])
    with pytest.raises(ValueError) as big:
        cons.ack(d, ranks=list(range(300)))
    assert owed(cons, d, 4) == [0, 1, 2, 3]
    assert drained(pool4)
    assert "256" in str(small.value) and "[0, 256] are out of range" not in str(small.value)
    assert len(str(big.value)) < 400, len(str(big.value))


def test_finding_zero_d_numpy_integer_refused(pool4, cons):
    d = pool4.publish(np.arange(4.0))
    try:
        cons.ack(d, ranks=np.array(2))
    finally:
        left = owed(cons, d, 4)
        assert drained(pool4)
    assert left == [0, 1, 3]


def test_finding_bytes_taken_as_a_rank_list(pool4, cons):
    d = pool4.publish(np.arange(4.0))
    try:
        with pytest.raises(TypeError):
            cons.ack(d, ranks=b"\x02")
    finally:
        left = owed(cons, d, 4)
        assert drained(pool4)
    assert left == [0, 1, 2, 3]


# -------------------------------------------------------------------- sglang


def _sg_pool(kind):
    return vs.CudaVmmMemoryPool(4 << 20, 60, 0, 4, allow_posix_fallback=True, pool=kind)


def _wire(p):
    return pickle.loads(pickle.dumps(p))


def _sg_owed(pool, proxy):
    left = []
    for r in range(4):
        try:
            _wire(proxy).acknowledge_consumption(acknowledge_ranks=[r])
            left.append(r)
        except vmmt.Stale:
            pass
    pool._recycle_chunks()
    return left, len(pool.occupied_chunks)


@pytest.mark.parametrize("kind", ["device", "host"])
def test_sglang_acknowledge_ranks_forms(clean, kind):  # noqa: F811
    pool = _sg_pool(kind)
    try:
        for ar, left in (({3, 1}, [0, 2]), (range(0, 4, 2), [1, 3]), ((3, 2, 0), [1]),
                         (np.array([1, 3]), [0, 2]), ([np.int64(0)], [1, 2, 3])):
            proxy = pool.wrap_tensor(np.arange(6.0))
            _wire(proxy).acknowledge_consumption(acknowledge_ranks=ar)
            assert _sg_owed(pool, proxy) == (left, 0), ar
        proxy = pool.wrap_tensor(np.arange(6.0))
        t = _wire(proxy).reconstruct_on_target_device(0, consumer_rank=1,
                                                      acknowledge_ranks=range(1, 4, 2))
        assert t.tolist() == list(np.arange(6.0))
        assert _sg_owed(pool, proxy) == ([0, 2], 0)
    finally:
        pool.shutdown()


@pytest.mark.parametrize("kind", ["device", "host"])
def test_sglang_two_rebuilding_threads_overlapping_lists(clean, kind):  # noqa: F811
    """Two threads rebuild their own unpickled copies of one proxy with
    acknowledge_ranks [0, 1] and [2, 1]: exactly one gets the tensor, the
    other Stale; the loser's own rank is still owed."""
    pool = _sg_pool(kind)
    try:
        for n in range(30):
            src = np.arange(64.0) + n
            proxy = pool.wrap_tensor(src)
            copies = [_wire(proxy), _wire(proxy)]
            go = threading.Barrier(2)
            got = [None, None]

            def run(i, rank, ar):
                go.wait(DEADLINE)
                try:
                    got[i] = copies[i].reconstruct_on_target_device(0, consumer_rank=rank,
                                                                    acknowledge_ranks=ar)
                except vmmt.Error as e:
                    got[i] = e

            both_at_once(run, (0, 0, [0, 1]), (1, 2, [2, 1]))
            ok = [not isinstance(g, BaseException) for g in got]
            assert ok.count(True) == 1, "round %d: %r" % (n, got)
            assert isinstance(got[ok.index(False)], vmmt.Stale)
            np.testing.assert_array_equal(got[ok.index(True)], src)
            assert _sg_owed(pool, proxy) == ([2, 3] if ok[0] else [0, 3], 0)
    finally:
        pool.shutdown()


@pytest.mark.parametrize("kind", ["device", "host"])
def test_sglang_packed_copies_race_overlapping_lists(clean, kind):  # noqa: F811
    """The same with a packed proxy: each thread rebuilds every member of its
    own copy; one wins the group, the loser's first member is Stale and its
    own rank is still owed for every member."""
    pool = _sg_pool(kind)

    def owed(packed):
        left = []
        for r in range(4):
            try:
                for m in _wire(packed):
                    m.acknowledge_consumption(acknowledge_ranks=[r])
                left.append(r)
            except vmmt.Stale:
                pass
        pool._recycle_chunks()
        return left, len(pool.occupied_chunks)

    try:
        for n in range(20):
            arrays = [np.arange(5.0) + n, np.arange(7, dtype=np.int32) + n]
            packed = pool.wrap_tensors(arrays)
            copies = [_wire(packed), _wire(packed)]
            go = threading.Barrier(2)
            got = [None, None]

            def run(i, ar):
                go.wait(DEADLINE)
                try:
                    got[i] = [m.reconstruct_on_target_device(0, acknowledge_ranks=ar)
                              for m in copies[i]]
                except vmmt.Error as e:
                    got[i] = e

            both_at_once(run, (0, [0, 1]), (1, [2, 1]))
            ok = [not isinstance(g, BaseException) for g in got]
            assert ok.count(True) == 1, "round %d: %r" % (n, got)
            assert isinstance(got[ok.index(False)], vmmt.Stale)
            for g, a in zip(got[ok.index(True)], arrays):
                np.testing.assert_array_equal(g, a)
            assert owed(packed) == ([2, 3] if ok[0] else [0, 3], 0)
    finally:
        pool.shutdown()


def _second_list_cases():
    return [
        ("ack then ack", lambda w: w.acknowledge_consumption(acknowledge_ranks=[0, 1]),
         lambda w: w.acknowledge_consumption(acknowledge_ranks=[2, 3])),
        ("rebuild then ack", lambda w: w.reconstruct_on_target_device(0, acknowledge_ranks=[0, 1]),
         lambda w: w.acknowledge_consumption(acknowledge_ranks=[2, 3])),
        ("rebuild then rebuild",
         lambda w: w.reconstruct_on_target_device(0, acknowledge_ranks=[0, 1]),
         lambda w: w.reconstruct_on_target_device(0, acknowledge_ranks=[3, 2])),
        ("rebuild then drop",
         lambda w: w.reconstruct_on_target_device(0, acknowledge_ranks=[2, 0]),
         lambda w: w.release_without_reconstruction(acknowledge_ranks=[3, 1])),
        ("drop then drop", lambda w: w.release_without_reconstruction(acknowledge_ranks=[1, 0]),
         lambda w: w.release_without_reconstruction(acknowledge_ranks=[2, 3])),
    ]


@pytest.mark.parametrize("kind", ["device", "host"])
def test_finding_proxy_second_acknowledge_ranks_dropped(clean, kind):  # noqa: F811
    pool = _sg_pool(kind)
    problems = []
    try:
        for label, first, second in _second_list_cases():
            proxy = pool.wrap_tensor(np.arange(4.0))
            w = _wire(proxy)
            first(w)
            try:
                second(w)
                raised = None
            except (vmmt.Error, RuntimeError, ValueError) as e:
                raised = e
            left = _sg_owed(pool, proxy)
            if raised is None and left[0] != []:
                problems.append("%s: the second list returned, ranks %r never acknowledged" %
                                (label, left[0]))
        # Overlapping: [1, 2] after [0, 1] must be Stale (rank 1 is done) and leave rank 2.
        proxy = pool.wrap_tensor(np.arange(4.0))
        w = _wire(proxy)
        w.acknowledge_consumption(acknowledge_ranks=[0, 1])
        try:
            w.acknowledge_consumption(acknowledge_ranks=[1, 2])
            problems.append("[1, 2] after [0, 1] on one proxy did not raise Stale")
        except vmmt.Stale:
            pass
        _sg_owed(pool, proxy)
    finally:
        pool.shutdown()
    assert not problems, "; ".join(problems)


def test_finding_proxy_second_acknowledge_ranks_dropped_threads(clean):  # noqa: F811
    pool = _sg_pool("device")
    problems = []
    try:
        for n in range(10):
            src = np.arange(16.0) + n
            proxy = pool.wrap_tensor(src)
            w = _wire(proxy)
            go = threading.Barrier(2)
            got = [None, None]

            def run(i, ar):
                go.wait(DEADLINE)
                try:
                    got[i] = w.reconstruct_on_target_device(0, acknowledge_ranks=ar)
                except BaseException as e:  # noqa: B902 - reported below
                    got[i] = e

            both_at_once(run, (0, [0, 1]), (1, [3, 2]))
            left = _sg_owed(pool, proxy)
            both = all(not isinstance(g, BaseException) for g in got)
            if both and left[0]:
                problems.append("round %d: both rebuilds returned, ranks %r never acknowledged"
                                % (n, left[0]))
    finally:
        pool.shutdown()
    assert not problems, "; ".join(problems[:3])


def test_finding_acknowledge_ranks_int_message(clean):  # noqa: F811
    pool = _sg_pool("host")
    try:
        proxy = pool.wrap_tensor(np.arange(4.0))
        with pytest.raises((TypeError, ValueError)) as e:
            _wire(proxy).acknowledge_consumption(acknowledge_ranks=2)
        assert _sg_owed(pool, proxy) == ([0, 1, 2, 3], 0)
    finally:
        pool.shutdown()
    assert "acknowledge_ranks" in str(e.value), str(e.value)
