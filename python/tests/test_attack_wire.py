"""Attacks on vmmt.sglang's proxy wire (1d6b4db), written from the docs and
public behaviour only: the compact pickle of CudaVmmTensorTransportProxy,
reconstruct_on_target_device's copy into a fresh array of the proxy's shape
and dtype, and wrap_tensor's path for contiguous torch tensors that need no
publish stream (torch CPU tensors on the emulated driver).

Tests of behaviour that holds are plain; the ones that expose a defect are
strict xfails, each saying what goes wrong."""
import collections
import copy
import copyreg
import gc
import logging
import pickle
import threading

import numpy as np
import pytest

import emu_counters
from child import run_child
from sglang_fixtures import MiB, clean, fast_switch, make_pool, settle, vmmt, vs  # noqa: F401

FIELDS = ("fabric_handle", "posix_socket_path", "allocation_size", "data_offset", "data_nbytes",
          "control_offset", "consumer_count", "shape", "dtype")
# The positional arguments of the compact wire, as __reduce__ shows them.
WIRE = ("desc", "library", "fabric_handle", "posix_socket_path", "allocation_size",
        "data_offset", "data_nbytes", "control_offset", "consumer_count", "shape", "dtype")


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


@pytest.fixture
def pool(clean):
    p = make_pool()
    yield p
    settle(p)
    p.shutdown()


def in_flight(pool):
    settle(pool)
    return pool.stats()["in_flight"]


def outcome(fn):
    """What a call did, as text (an exception's traceback would keep the
    consumed buffer alive past the leak check)."""
    try:
        r = fn()
    except Exception as e:  # reported by the caller
        return "raised %s: %s" % (type(e).__name__, e)
    return r


def values(t):
    return t.tolist()


def wire_of(proxy, **change):
    """The compact wire's function and arguments, some replaced."""
    fn, args = proxy.__reduce__()
    assert len(args) == len(WIRE), args
    fields = dict(zip(WIRE, args))
    fields.update(change)
    return fn, [fields[n] for n in WIRE]


def take_back(pool, *proxies):
    for p in proxies:
        try:
            pool.cancel_proxy(p)
        except Exception:  # consumed or cancelled already
            pass
    settle(pool)


class Forged:
    """Pickles as the reduce tuple given: a pickle crafted by hand."""

    def __init__(self, *reduce):
        self.reduce = reduce

    def __reduce__(self):
        return self.reduce


# ----------------------------------------------------------- the wire itself

@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_every_attribute_survives_every_protocol(pool, protocol, library):
    if library == "torch":
        torch = pytest.importorskip("torch")
        src = torch.arange(24, dtype=torch.int16).reshape(2, 3, 4)
    else:
        src = np.arange(24, dtype=np.int16).reshape(2, 3, 4)
    proxy = pool.wrap_tensor(src)
    back = pickle.loads(pickle.dumps(proxy, protocol))
    assert type(back) is vs.CudaVmmTensorTransportProxy
    assert {f: getattr(back, f) for f in FIELDS} == {f: getattr(proxy, f) for f in FIELDS}
    assert type(back.shape) is tuple and back.shape == (2, 3, 4)
    assert type(back.dtype) is type(proxy.dtype)
    assert type(back.descriptor) is vmmt.Descriptor
    assert bytes(back.descriptor) == bytes(proxy.descriptor)
    assert back.total_consumer_count == proxy.total_consumer_count == 1
    assert back.reconstruct_tensor is None
    t = back.reconstruct_on_target_device(0)
    assert type(t) is type(src) and values(t) == values(src) and t.dtype == src.dtype
    assert in_flight(pool) == 0


def test_the_wire_carries_no_rebuilt_tensor_and_copies_are_fresh(pool):
    src = np.arange(1000, dtype=np.float64)
    proxy = pool.wrap_tensor(src)
    before = pickle.dumps(proxy)
    shallow, deep = copy.copy(proxy), copy.deepcopy(proxy)
    for c in (shallow, deep):
        assert c is not proxy and type(c) is type(proxy)
        assert {f: getattr(c, f) for f in FIELDS} == {f: getattr(proxy, f) for f in FIELDS}
        assert bytes(c.descriptor) == bytes(proxy.descriptor) and c.reconstruct_tensor is None
    t = proxy.reconstruct_on_target_device(0)
    assert (t == src).all()
    after = pickle.dumps(proxy)
    assert len(after) == len(before) < 1000  # 8000 bytes of tensor never ride along
    again = copy.copy(proxy)
    assert again.reconstruct_tensor is None
    # A copy is another holder of the same descriptor: consuming it again is refused.
    for c in (shallow, deep, again):
        with pytest.raises(vmmt.Error):
            c.reconstruct_on_target_device(0)
    assert in_flight(pool) == 0


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_packed_members_pickled_together_share_an_owner(pool, protocol):
    sources = [np.arange(12, dtype=np.float32).reshape(3, 4), np.arange(5, dtype=np.int8),
               np.array([True, False, True])]
    proxies = pool.wrap_tensors(sources)
    for back in (pickle.loads(pickle.dumps(proxies, protocol)), copy.deepcopy(proxies)):
        assert [type(p) for p in back] == [vs.CudaVmmPackedTensorTransportProxy] * 3
        assert back[0]._packed_owner is back[1]._packed_owner is back[2]._packed_owner
        assert [p.shape for p in back] == [(3, 4), (5,), (3,)]
    back = pickle.loads(pickle.dumps(proxies, protocol))
    got = [p.reconstruct_on_target_device(0) for p in reversed(back)][::-1]
    for g, s in zip(got, sources):
        assert g.dtype == s.dtype and g.shape == s.shape and (g == s).all()
    assert in_flight(pool) == 0


def test_a_packed_member_pickled_alone_is_refused_after_its_group_was_consumed(pool):
    proxies = pool.wrap_tensors([np.arange(4.0), np.arange(3.0)])
    first, second = pickle.loads(pickle.dumps(proxies[0])), pickle.loads(pickle.dumps(proxies[1]))
    assert first._packed_owner is not second._packed_owner  # pickled apart: owners apart
    assert values(first.reconstruct_on_target_device(0)) == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(vmmt.Stale):
        second.reconstruct_on_target_device(0)
    assert in_flight(pool) == 0


@pytest.mark.parametrize("change", [
    {"shape": (12,)}, {"shape": (0,)}, {"shape": (2, 3, 2)}, {"dtype": np.dtype(np.float64)},
    {"dtype": np.dtype(object), "shape": (1,)}, {"data_nbytes": 24, "shape": (12,)},
    {"shape": (2 ** 62, 4)},
], ids=["flat-12", "empty", "3-d", "float64", "object", "nbytes+shape", "huge"])
@pytest.mark.parametrize("pickled", [False, True], ids=["live", "pickled"])
def test_another_size_is_refused_and_released(pool, change, pickled):
    proxy = pool.wrap_tensor(np.arange(6, dtype=np.int16).reshape(2, 3))
    for name, value in change.items():
        setattr(proxy, name, value)
    if pickled and "data_nbytes" in change:
        # A report that contradicts the descriptor is refused as it is unpickled.
        with pytest.raises(ValueError, match="data_nbytes do\\(es\\) not match its descriptor"):
            pickle.loads(pickle.dumps(proxy))
        proxy.release_without_reconstruction()
        assert in_flight(pool) == 0
        return
    if pickled:
        proxy = pickle.loads(pickle.dumps(proxy))
    with pytest.raises(RuntimeError, match="holds [0-9]+ bytes, but the published tensor has 12"):
        proxy.reconstruct_on_target_device(0)
    assert in_flight(pool) == 0
    with pytest.raises(RuntimeError, match="already released"):
        proxy.reconstruct_on_target_device(0)


@pytest.mark.parametrize("pickled", [False, True], ids=["live", "pickled"])
def test_same_size_changes_reinterpret_the_published_bytes(pool, pickled):
    """sglang rebuilds the proxy's shape and dtype; of the same size, those
    are the published bytes seen another way (little-endian here)."""
    src = np.arange(6, dtype=np.int16).reshape(2, 3)
    for change, expected in (({"shape": (3, 2)}, src.reshape(3, 2)),
                             ({"shape": [6]}, src.ravel()),
                             ({"dtype": np.dtype(np.uint8), "shape": (12,)},
                              src.view(np.uint8).ravel()),
                             ({"dtype": np.dtype(np.float16)}, src.view(np.float16))):
        proxy = pool.wrap_tensor(src)
        for name, value in change.items():
            setattr(proxy, name, value)
        if pickled:
            proxy = pickle.loads(pickle.dumps(proxy))
        t = proxy.reconstruct_on_target_device(0)
        assert t.dtype == expected.dtype and t.shape == expected.shape
        assert t.tobytes() == expected.tobytes()
    assert in_flight(pool) == 0


@pytest.mark.parametrize("pickled", [False, True], ids=["live", "pickled"])
def test_informational_fields_do_not_steer_the_copy(pool, pickled):
    """data_nbytes, data_offset, control_offset, allocation_size and the
    handle fields are reports: the descriptor says what is copied. Pickled,
    those a descriptor can contradict are checked against it and refused."""
    checked = {"data_nbytes", "control_offset", "fabric_handle", "posix_socket_path"}
    src = np.arange(6, dtype=np.int16).reshape(2, 3)
    neighbour = pool.wrap_tensor(np.full(64, 7, np.int16))
    for change in ({"data_nbytes": 6}, {"data_nbytes": 0}, {"data_nbytes": 1 << 20},
                   {"data_offset": 64}, {"control_offset": neighbour.control_offset},
                   {"allocation_size": -1}, {"fabric_handle": b"x" * 64},
                   {"posix_socket_path": "/tmp/elsewhere"}):
        proxy = pool.wrap_tensor(src)
        for name, value in change.items():
            setattr(proxy, name, value)
        if pickled and checked & set(change):
            with pytest.raises(ValueError, match="not match its descriptor"):
                pickle.loads(pickle.dumps(proxy))
        elif pickled:
            proxy = pickle.loads(pickle.dumps(proxy))
            assert {n: getattr(proxy, n) for n in change} == change
        t = proxy.reconstruct_on_target_device(0)
        assert t.shape == (2, 3) and (t == src).all(), change
    assert values(neighbour.reconstruct_on_target_device(0)) == [7] * 64
    assert in_flight(pool) == 0


def test_cancel_goes_by_the_descriptor_not_a_changed_control_offset(pool):
    a, b = pool.wrap_tensor(np.arange(4.0)), pool.wrap_tensor(np.arange(5.0))
    a.control_offset = b.control_offset
    pool.cancel_proxy(a)
    assert values(b.reconstruct_on_target_device(0)) == [0.0, 1.0, 2.0, 3.0, 4.0]
    with pytest.raises(ValueError, match="control_offset"):
        pickle.loads(pickle.dumps(a))  # its report contradicts its descriptor
    with pytest.raises(vmmt.Stale):
        a.reconstruct_on_target_device(0)
    other = make_pool()
    try:
        foreign = other.wrap_tensor(np.arange(3.0))
        with pytest.raises(vmmt.Error, match="not from this pool"):
            pool.cancel_proxy(foreign)
        assert values(foreign.reconstruct_on_target_device(0)) == [0.0, 1.0, 2.0]
    finally:
        settle(other)
        other.shutdown()
    assert in_flight(pool) == 0


def test_the_descriptor_cannot_be_replaced(pool):
    a, b = pool.wrap_tensor(np.arange(4.0)), pool.wrap_tensor(np.full(4, 9.0))
    for value in (b.descriptor, bytes(b.descriptor)):
        with pytest.raises(AttributeError):
            a.descriptor = value
    assert values(pickle.loads(pickle.dumps(a)).reconstruct_on_target_device(0)) == [0, 1, 2, 3]
    assert values(b.reconstruct_on_target_device(0)) == [9.0] * 4
    assert in_flight(pool) == 0


def test_crafted_wires_of_the_wrong_arity_or_types_are_refused(pool):
    proxy = pool.wrap_tensor(np.arange(6, dtype=np.int16).reshape(2, 3))
    fn, args = wire_of(proxy)
    desc = args[0]
    forged = [(args[:-1], TypeError), (args + [0], TypeError), ((), TypeError)]
    for name, value, error in (("desc", "x" * 512, TypeError), ("desc", 5, ValueError),
                               ("desc", desc[:511], ValueError),
                               ("desc", desc + b"\0", ValueError),
                               ("desc", b"\0" * 512, ValueError),
                               ("dtype", "bogus", TypeError), ("dtype", "bfloat16", TypeError),
                               ("dtype", 3, TypeError)):
        forged.append((wire_of(proxy, **{name: value})[1], error))
    for a, error in forged:
        with pytest.raises(error):
            pickle.loads(pickle.dumps(Forged(fn, tuple(a))))
    # No descriptor at all: it loads, and says what it lacks.
    bare = pickle.loads(pickle.dumps(Forged(fn, tuple(wire_of(proxy, desc=None)[1]))))
    with pytest.raises(RuntimeError, match="no vmmt descriptor"):
        bare.reconstruct_on_target_device(0)
    # Nothing of the above consumed anything: the genuine proxy still rebuilds.
    t = pickle.loads(pickle.dumps(Forged(fn, tuple(args)))).reconstruct_on_target_device(0)
    assert values(t) == [[0, 1, 2], [3, 4, 5]]
    assert in_flight(pool) == 0


def test_every_single_bit_flip_of_the_descriptor_is_refused(pool):
    """Each of the 512 bytes, its lowest and highest bit: refused as the
    pickle loads (a field the format forbids) or as it is consumed (the
    seal, the pool id, the broker name); never a tensor."""
    src = np.arange(6, dtype=np.int16).reshape(2, 3)
    rebuilt, refusals = [], collections.Counter()
    for pos in range(512):
        for bit in (0x01, 0x80):
            proxy = pool.wrap_tensor(src)
            fn, args = wire_of(proxy)
            raw = bytearray(args[0])
            raw[pos] ^= bit
            args[0] = bytes(raw)
            try:
                forged = pickle.loads(pickle.dumps(Forged(fn, tuple(args))))
            except ValueError:
                refusals["load"] += 1
            else:
                r = outcome(lambda: values(forged.reconstruct_on_target_device(0)))
                if isinstance(r, str) and r.startswith("raised "):
                    refusals["consume"] += 1
                else:
                    rebuilt.append((pos, bit, r))
                forged = None
            take_back(pool, proxy)
    assert rebuilt == [], rebuilt[:8]
    assert refusals["load"] + refusals["consume"] == 1024 and refusals["consume"] > 100, refusals
    assert in_flight(pool) == 0


@pytest.mark.parametrize("name,src,shape", [
    ("O", np.arange(3, dtype=np.int64), (3,)), ("object", np.arange(3, dtype=np.int64), (3,)),
    ("M8[ns]", np.arange(3, dtype=np.int64), (3,)), ("V12", np.arange(6, dtype=np.int16), (1,)),
    ("S4", np.arange(6, dtype=np.int16), (3,)), ("U1", np.arange(6, dtype=np.int16), (3,)),
    ("i2,i2,i2", np.arange(6, dtype=np.int16), (2,)), (">i2", np.arange(6, dtype=np.int16), (6,)),
    ("float128", np.arange(2, dtype=np.int64), (1,)),
], ids=["O", "object", "datetime", "void", "bytes", "unicode", "struct", "big-endian", "f128"])
def test_crafted_dtype_names_of_the_right_size_never_rebuild(pool, name, src, shape):
    """Object, datetime, void, string, structured, byte-swapped and padded
    dtypes of the published size: refused, never a NumPy array filled from
    the slice (an object array of its bytes would be pointers)."""
    assert np.dtype(name).itemsize * int(np.prod(shape)) == src.nbytes
    proxy = pool.wrap_tensor(src)
    fn, args = wire_of(proxy, dtype=name, shape=shape)
    r = outcome(lambda: values(pickle.loads(pickle.dumps(Forged(fn, tuple(args))))
                               .reconstruct_on_target_device(0)))
    assert isinstance(r, str) and r.startswith("raised "), r
    take_back(pool, proxy)
    assert in_flight(pool) == 0


def test_a_descriptor_of_another_pool_is_refused(pool):
    other = make_pool()
    try:
        mine = pool.wrap_tensor(np.arange(6, dtype=np.int16))
        theirs = other.wrap_tensor(np.full(6, 7, np.int16))
        fn, args = wire_of(mine, desc=bytes(theirs.descriptor))
        # Refused as it is unpickled: its names are pool A's, its descriptor pool B's.
        with pytest.raises(ValueError, match="posix_socket_path do.es. not match its descriptor"):
            pickle.loads(pickle.dumps(Forged(fn, tuple(args))))
        take_back(pool, mine)
        take_back(other, theirs)
    finally:
        settle(other)
        other.shutdown()


@pytest.mark.parametrize("forge", ["index", "descriptor", "owner"])
def test_a_crafted_packed_member_cannot_take_another_members_bytes(pool, forge):
    proxies = pool.wrap_tensors([np.arange(4, dtype=np.float32),
                                 np.full(4, 9, dtype=np.float32), np.zeros(3, np.int8)])
    others = pool.wrap_tensors([np.full(4, 5, np.float32), np.ones(2)])
    expected = (proxies[0] if forge != "descriptor" else proxies[1]).descriptor
    reduce = proxies[0].__reduce_ex__(4)
    state = dict(reduce[2])
    if forge == "index":
        state["index"] = 1
    elif forge == "descriptor":
        state["descriptor"] = proxies[1].descriptor
    else:
        state["owner"] = others[0]._packed_owner
    assert reduce[1] == (vs.CudaVmmPackedTensorTransportProxy,) and expected is not None
    # Refused as it is unpickled: the owner's descriptor at that index is not the one it carries.
    with pytest.raises(ValueError, match="does not carry its owner's descriptor at that index"):
        pickle.loads(pickle.dumps(Forged(copyreg._reconstructor, (
            vs.CudaVmmPackedTensorTransportProxy, object, None), state)))
    state = reduce = None
    take_back(pool, *proxies, *others)


# ------------------------------------------------------------- reconstruct

NUMPY_SOURCES = {
    "bool-2d": np.array([[True, False, True], [False, False, True]]),
    "float16-3d": np.arange(24, dtype=np.float16).reshape(2, 3, 4),
    "int8": np.arange(-5, 5, dtype=np.int8),
    "uint64": np.array([0, 2 ** 64 - 1], dtype=np.uint64),
    "complex64": np.array([1 + 2j, -3.5j], dtype=np.complex64),
    "complex128-2d": np.arange(6, dtype=np.complex128).reshape(3, 2) * (1 - 1j),
    "8-dims": np.arange(256, dtype=np.int32).reshape((2,) * 8),
    "ones-dims": np.ones((1, 1, 3, 1), dtype=np.float32),
    "fortran": np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4)),
}


@pytest.mark.parametrize("name", list(NUMPY_SOURCES))
def test_numpy_dtypes_and_shapes_rebuild_into_arrays_of_their_own(pool, name):
    src = NUMPY_SOURCES[name]
    t = pickle.loads(pickle.dumps(pool.wrap_tensor(src))).reconstruct_on_target_device(0)
    assert type(t) is np.ndarray and t.dtype == src.dtype and t.shape == src.shape
    assert np.array_equal(t, src)
    assert t.flags.owndata and t.flags.writeable and t.flags.c_contiguous
    assert in_flight(pool) == 0


def test_a_numpy_0d_array_rebuilds_0d(pool):
    proxy = pool.wrap_tensor(np.array(3.5))
    t = proxy.reconstruct_on_target_device(0)
    got = (tuple(proxy.shape), t.shape, t.tolist())
    del t, proxy
    assert got == ((), (), 3.5)


def _torch_sources(torch):
    return {
        "float16": torch.arange(12, dtype=torch.float16).reshape(3, 4),
        "bfloat16": torch.arange(12, dtype=torch.bfloat16).reshape(4, 3) / 3,
        "int8": torch.arange(-6, 6, dtype=torch.int8),
        "uint8": torch.arange(250, 256, dtype=torch.uint8),
        "int64": torch.tensor([-2 ** 63, 2 ** 63 - 1]),
        "complex64": torch.tensor([1 + 2j, -3.5j], dtype=torch.complex64),
        "complex128": torch.tensor([[1 - 1j, 2j, -3.0], [0.5, -1j, 7 + 7j]]),
        "0-d": torch.tensor(3.5),
        "0-d-bfloat16": torch.tensor(-1.25, dtype=torch.bfloat16),
        "8-dims": torch.arange(256, dtype=torch.float32).reshape((2,) * 8),
        "transposed": torch.arange(12.0).reshape(3, 4).t(),
        "expanded": torch.arange(3.0).expand(4, 3),
        "storage-offset": torch.arange(10.0)[3:],
        "channels-last": torch.arange(16.0).reshape(1, 2, 2, 4).to(
            memory_format=torch.channels_last),
    }


@pytest.mark.parametrize("name", ["float16", "bfloat16", "int8", "uint8", "int64", "complex64",
                                  "complex128", "0-d", "0-d-bfloat16", "8-dims", "transposed",
                                  "expanded", "storage-offset", "channels-last"])
def test_torch_dtypes_and_shapes_rebuild_into_tensors_of_their_own(pool, torch, name):
    src = _torch_sources(torch)[name]
    proxy = pickle.loads(pickle.dumps(pool.wrap_tensor(src)))
    assert proxy.dtype == src.dtype and tuple(proxy.shape) == tuple(src.shape)
    t = proxy.reconstruct_on_target_device(0)
    assert type(t) is torch.Tensor and t.dtype == src.dtype and t.shape == src.shape
    assert t.device.type == "cpu" and torch.equal(t, src)
    assert t._base is None and t.is_contiguous() and not t.requires_grad
    assert t.storage().size() == src.numel()  # exactly its own bytes, no view into more
    assert in_flight(pool) == 0


def test_a_torch_bool_tensor_round_trips(pool, torch):
    src = torch.tensor([[True, False, True], [False, False, True]])
    r = outcome(lambda: values(pool.wrap_tensor(src).reconstruct_on_target_device(0)))
    assert r == values(src), r


def test_torch_size_mismatch_raises_naming_it_and_releases(pool, torch):
    for change in ({"shape": (12,)}, {"dtype": torch.float64}, {"shape": (0, 6)}):
        proxy = pool.wrap_tensor(torch.arange(6, dtype=torch.int16).reshape(2, 3))
        for name, value in change.items():
            setattr(proxy, name, value)
        proxy = pickle.loads(pickle.dumps(proxy))
        with pytest.raises(RuntimeError, match="holds [0-9]+ bytes, but the published tensor "
                                               "has 12; the pool slice is released"):
            proxy.reconstruct_on_target_device(0)
        assert in_flight(pool) == 0
        with pytest.raises(RuntimeError, match="already released"):
            proxy.reconstruct_on_target_device(0)


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_negative_dimensions_are_refused_and_released(pool, library):
    if library == "torch":
        torch = pytest.importorskip("torch")
        src = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    else:
        src = np.arange(6, dtype=np.int16).reshape(2, 3)
    proxy = pool.wrap_tensor(src)
    proxy.shape = (-2, -3)
    first = outcome(lambda: proxy.reconstruct_on_target_device(0))
    held = in_flight(pool)
    retry = outcome(lambda: proxy.reconstruct_on_target_device(0))
    if held:
        proxy.release_without_reconstruction()
    assert first.startswith("raised RuntimeError") and "(-2, -3)" in first, first
    assert held == 0 and "already released" in retry, (held, retry)


@pytest.mark.parametrize("change", ["shape-none", "shape-float", "shape-str", "torch-dtype"])
def test_an_unusable_shape_or_dtype_releases_the_slice(pool, change):
    proxy = pool.wrap_tensor(np.arange(6, dtype=np.int16).reshape(2, 3))
    if change == "shape-none":
        proxy.shape = None
    elif change == "shape-float":
        proxy.shape = (2.0, 3)
    elif change == "shape-str":
        proxy.shape = ("a", "b")
        proxy = pickle.loads(pickle.dumps(proxy))
    else:
        torch = pytest.importorskip("torch")
        proxy.dtype = torch.int16
    first = outcome(lambda: proxy.reconstruct_on_target_device(0))
    held = in_flight(pool)
    if held:
        proxy.release_without_reconstruction()
    assert first.startswith("raised ")
    assert held == 0 or "held" in first, first


def test_cached_then_refused_after_acknowledge_or_release(pool):
    src = np.arange(8, dtype=np.float32)
    proxy = pickle.loads(pickle.dumps(pool.wrap_tensor(src)))
    t = proxy.reconstruct_on_target_device(0, consumer_count=1)
    assert proxy.reconstruct_on_target_device(0, consumer_count=1) is t
    assert proxy.reconstruct_on_target_device(0) is t and proxy.reconstruct_tensor is t
    with pytest.raises(RuntimeError, match="already released"):
        proxy.reconstruct_on_target_device(1)
    proxy.acknowledge_consumption(1)  # once per proxy
    for end in ("acknowledge_consumption", "release_without_reconstruction"):
        other = pickle.loads(pickle.dumps(pool.wrap_tensor(src)))
        getattr(other, end)(1)
        getattr(other, end)(1)  # idempotent
        with pytest.raises(RuntimeError, match="already released"):
            other.reconstruct_on_target_device(0)
        assert other.reconstruct_tensor is None
    assert in_flight(pool) == 0


def test_concurrent_reconstructs_of_one_proxy_share_one_copy(pool, fast_switch):
    torch = None
    try:
        import torch
    except ImportError:
        pass
    bad = []
    for i in range(60):
        srcs = [np.arange(64, dtype=np.float64) + i]
        if torch is not None:
            srcs.append(torch.arange(64, dtype=torch.float32) + i)
        for src in srcs:
            proxy = pickle.loads(pickle.dumps(pool.wrap_tensor(src)))
            barrier, out = threading.Barrier(6), [None] * 6

            def rebuild(k):
                barrier.wait()
                out[k] = outcome(lambda: proxy.reconstruct_on_target_device(0, consumer_count=1))

            threads = [threading.Thread(target=rebuild, args=(k,)) for k in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            if any(o is not out[0] for o in out) or isinstance(out[0], str) or \
                    values(out[0]) != values(src):
                bad.append([o if isinstance(o, str) else id(o) for o in out])
        packed = pickle.loads(pickle.dumps(pool.wrap_tensors([np.arange(8.0), np.ones(3)])))
        barrier, out = threading.Barrier(4), [None] * 4

        def member(k):
            barrier.wait()
            out[k] = outcome(lambda: packed[k % 2].reconstruct_on_target_device(0))

        threads = [threading.Thread(target=member, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        if out[0] is not out[2] or out[1] is not out[3] or isinstance(out[0], str) or \
                isinstance(out[1], str):
            bad.append(["packed"] + [o if isinstance(o, str) else id(o) for o in out])
    assert bad == [], bad[:3]
    assert in_flight(pool) == 0


def test_reconstruct_racing_acknowledge_never_gives_a_wrong_tensor(pool, fast_switch):
    for i in range(100):
        src = np.arange(16.0) + i
        proxy = pickle.loads(pickle.dumps(pool.wrap_tensor(src)))
        barrier, out = threading.Barrier(2), {}

        def rebuild():
            barrier.wait()
            r = outcome(lambda: proxy.reconstruct_on_target_device(0, consumer_count=1))
            out["r"] = r if isinstance(r, str) else values(r) == values(src)

        def ack():
            barrier.wait()
            out["a"] = outcome(lambda: proxy.acknowledge_consumption(1))

        threads = [threading.Thread(target=rebuild), threading.Thread(target=ack)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert out["a"] is None, out
        assert out["r"] is True or "already released" in out["r"], out
        assert in_flight(pool) == 0


_CHILD = """
import os, pickle
import numpy as np
import emu_counters, vmmt, vmmt.sglang as vs

def emu_fail(rules):
    os.environ["VMMT_EMU_FAIL"] = rules
    emu_counters._LIB.vmmt__emu_configure()

pool = vs.CudaVmmMemoryPool(4 << 20, 60, 0, 1, allow_posix_fallback=True)
sources = [np.arange(8.0)]
try:
    import torch
    sources.append(torch.arange(8.0))
except ImportError:
    pass
print("sources", len(sources))
"""


def test_a_failed_consumer_copy_releases_and_refuses_a_retry():
    """Both copies a CPU destination takes on the emulator (pool to a device
    buffer, that buffer to the array) and the synchronize after them."""
    out = run_child(_CHILD, """
        for rule in ("cuMemcpyDtoDAsync:1:CUDA_ERROR_ILLEGAL_ADDRESS",
                     "cuMemcpyAsync:1:CUDA_ERROR_ILLEGAL_ADDRESS",
                     "cuStreamSynchronize:1:CUDA_ERROR_ILLEGAL_ADDRESS"):
            for src in sources:
                proxy = pickle.loads(pickle.dumps(pool.wrap_tensor(src)))
                emu_fail(rule)
                try:
                    proxy.reconstruct_on_target_device(0, consumer_count=1)
                except vmmt.Error as e:
                    pass
                else:
                    raise AssertionError("a failed copy gave a tensor: %s" % rule)
                finally:
                    emu_fail("")
                pool._recycle_chunks()
                assert pool.stats()["in_flight"] == 0, (rule, pool.stats()["in_flight"])
                try:
                    proxy.reconstruct_on_target_device(0, consumer_count=1)
                except RuntimeError as e:
                    assert "already released" in str(e), e
                else:
                    raise AssertionError("a retry was allowed: %s" % rule)
                assert proxy.reconstruct_tensor is None
                again = pool.wrap_tensor(src).reconstruct_on_target_device(0)
                assert again.tolist() == src.tolist()
                print("released", rule.split(":")[0], type(src).__module__)
        pool._recycle_chunks()
        vs._imported_pool_cache_clear()
        pool.shutdown()
        print("ok")
        """)
    sources = int(out.split("sources ")[1].split()[0])
    assert out.rstrip().endswith("ok") and out.count("released") == 3 * sources, out


def test_rebuilt_arrays_own_their_memory(clean):
    torch = None
    try:
        import torch
    except ImportError:
        pass
    pool = make_pool()
    kept = []
    try:
        kept.append((np.arange(6.0).reshape(2, 3), pickle.loads(pickle.dumps(
            pool.wrap_tensor(np.arange(6.0).reshape(2, 3)))).reconstruct_on_target_device(0)))
        sources = [np.arange(3.0), np.arange(4, dtype=np.int32)]
        for s, p in zip(sources, pickle.loads(pickle.dumps(pool.wrap_tensors(sources)))):
            kept.append((s, p.reconstruct_on_target_device(0)))
        if torch is not None:
            src = torch.arange(6.0).reshape(2, 3)
            kept.append((src, pickle.loads(pickle.dumps(pool.wrap_tensor(src)))
                         .reconstruct_on_target_device(0)))
            sources = [torch.arange(3.0), torch.arange(4, dtype=torch.int32)]
            for s, p in zip(sources, pickle.loads(pickle.dumps(pool.wrap_tensors(sources)))):
                kept.append((s, p.reconstruct_on_target_device(0)))
        settle(pool)
    finally:
        pool.shutdown()
    vs._imported_pool_cache_clear()
    gc.collect()
    # New pools and consumes reuse whatever memory was given back.
    scribble = make_pool()
    try:
        for _ in range(8):
            scribble.wrap_tensor(np.full(4096, -1.0)).reconstruct_on_target_device(0)
            settle(scribble)
    finally:
        scribble.shutdown()
    vs._imported_pool_cache_clear()
    for src, got in kept:
        assert values(got) == values(src)
        got += 1  # writable, and only its own
        assert values(got) == values(src + 1)


def test_no_fd_object_or_driver_leaks_over_many_round_trips(pool):
    try:
        import torch
    except ImportError:
        torch = None

    def rounds(n):
        for i in range(n):
            t = pickle.loads(pickle.dumps(pool.wrap_tensor(np.arange(16, dtype=np.int32))))
            t.reconstruct_on_target_device(0)
            if torch is not None:
                t = pickle.loads(pickle.dumps(pool.wrap_tensor(torch.arange(16.0))))
                t.reconstruct_on_target_device(0)
            for p in pickle.loads(pickle.dumps(pool.wrap_tensors([np.ones(3), np.zeros(2)]))):
                p.reconstruct_on_target_device(0)
            pickle.loads(pickle.dumps(pool.wrap_tensor(np.ones(4)))) \
                .release_without_reconstruction()
            bad = pool.wrap_tensor(np.ones(1, np.float32))
            bad.shape = (2,)
            outcome(lambda: bad.reconstruct_on_target_device(0))
            settle(pool)

    rounds(30)
    gc.collect()
    objects, fds, live = len(gc.get_objects()), emu_counters.open_fds(), emu_counters.live()
    rounds(300)
    gc.collect()
    grown = len(gc.get_objects()) - objects
    assert grown < 100, "%d objects more after 300 rounds" % grown
    assert emu_counters.open_fds() == fds and emu_counters.live() == live
    assert in_flight(pool) == 0


# ------------------------------------------------------- wrap_tensor (torch)

@pytest.mark.parametrize("how", ["imag", "neg-view", "packed"])
def test_a_negative_bit_tensor_is_published_with_its_values(pool, torch, how):
    if how == "neg-view":
        src = torch._neg_view(torch.tensor([1.0, 2.0, 3.0]))
    else:
        src = torch.tensor([1 + 2j]).conj().imag
    assert src.is_neg() and src.is_contiguous()
    expected = values(src)
    if how == "packed":
        got = values(pool.wrap_tensors([src, torch.ones(2)])[0].reconstruct_on_target_device(0))
    else:
        got = values(pool.wrap_tensor(src).reconstruct_on_target_device(0))
    assert got == expected


def test_a_noncontiguous_negative_bit_tensor_is_right(pool, torch):
    src = torch.tensor([1 + 2j, 3 - 4j]).conj().imag
    assert src.is_neg() and not src.is_contiguous()
    assert values(pool.wrap_tensor(src).reconstruct_on_target_device(0)) == [-2.0, 4.0]
    src = torch.tensor([[1 + 2j, 3j], [1, 2]]).conj().t()  # conjugate bit, not contiguous
    assert values(pool.wrap_tensor(src).reconstruct_on_target_device(0)) == values(
        src.resolve_conj())


def test_a_contiguous_conjugate_tensor_wraps(pool, torch):
    src = torch.tensor([[1 + 2j, 3j], [1, 2]]).conj()
    r = outcome(lambda: values(pool.wrap_tensor(src).reconstruct_on_target_device(0)))
    assert r == values(src.resolve_conj()), r


@pytest.mark.parametrize("how", ["leaf", "parameter", "non-leaf", "transposed", "packed",
                                 "pool-full"])
def test_a_tensor_that_requires_grad_wraps(pool, torch, how):
    base = torch.arange(6.0).reshape(2, 3)
    if how == "pool-full":  # no slice free now: tensor.cpu() is promised
        held = pool.wrap_tensor(torch.zeros(3 * MiB, dtype=torch.uint8))
        src = torch.ones(MiB // 2, dtype=torch.float32, requires_grad=True)
        r = outcome(lambda: pool.wrap_tensor(src))
        held.release_without_reconstruction()
        assert r is src, r
        return
    src = {"leaf": lambda: base.clone().requires_grad_(),
           "parameter": lambda: torch.nn.Parameter(base.clone()),
           "non-leaf": lambda: base.clone().requires_grad_() * 1,
           "transposed": lambda: base.clone().requires_grad_().t(),
           "packed": lambda: base.clone().requires_grad_()}[how]()
    if how == "packed":
        r = outcome(lambda: values(pool.wrap_tensors([src, base])[0]
                                   .reconstruct_on_target_device(0)))
    else:
        r = outcome(lambda: values(pool.wrap_tensor(src).reconstruct_on_target_device(0)))
    assert r == values(src.detach()), r


@pytest.mark.parametrize("how", ["torch", "numpy", "packed"])
def test_an_empty_tensor_wraps_or_falls_back(pool, how):
    if how == "numpy":
        src = np.ones((0, 3))
    else:
        torch = pytest.importorskip("torch")
        src = torch.empty(0, 3)
    if how == "packed":
        r = outcome(lambda: pool.wrap_tensors([src, src]))
        assert r is None or (isinstance(r, list) and len(r) == 2), r
        return
    r = outcome(lambda: pool.wrap_tensor(src))
    if isinstance(r, vs.CudaVmmTensorTransportProxy):
        r = r.reconstruct_on_target_device(0)
    assert not isinstance(r, str) and tuple(r.shape) == (0, 3), r


def test_unpublishable_layouts_raise_and_hold_nothing(pool, torch):
    for src, error in ((torch.empty(4, device="meta"), NotImplementedError),
                       (torch.arange(4.0).to_sparse(), RuntimeError),
                       (torch.quantize_per_tensor(torch.arange(4.0), 0.1, 0, torch.qint8),
                        RuntimeError),
                       (torch.arange(512.0).reshape((2,) * 9), ValueError)):
        with pytest.raises(error):
            pool.wrap_tensor(src)
    assert in_flight(pool) == 0 and pool.stats()["full"] == 0


def test_subclasses_and_inference_tensors_round_trip(pool, torch):
    class Feature(torch.Tensor):
        pass

    with torch.inference_mode():
        inference = torch.arange(5.0)
    for src in (torch.arange(4.0).as_subclass(Feature), inference,
                torch.arange(8.0).reshape(2, 4)[:, 1:3], torch.tensor([7.0]).expand(1)):
        t = pickle.loads(pickle.dumps(pool.wrap_tensor(src))).reconstruct_on_target_device(0)
        assert type(t) is torch.Tensor and values(t) == values(src)
    assert in_flight(pool) == 0


def test_the_source_may_be_reused_as_soon_as_the_wrap_returns(pool, torch):
    for src in (torch.arange(64.0), torch.arange(64.0).reshape(8, 8).t()):
        expected = values(src)
        proxy = pool.wrap_tensor(src)
        src.fill_(-1)
        del src
        gc.collect()
        assert values(proxy.reconstruct_on_target_device(0)) == expected
    assert in_flight(pool) == 0


def test_pool_full_returns_the_tensor_and_warns_once(pool, torch, caplog):
    first = pool.wrap_tensor(torch.zeros(3 * MiB, dtype=torch.uint8))
    sources = [torch.ones(3 * MiB, dtype=torch.uint8),
               torch.ones(3 * MiB, dtype=torch.uint8).reshape(1024, 3072).t()]
    with caplog.at_level(logging.WARNING, logger="vmmt.sglang"):
        for src in sources * 2:
            back = pool.wrap_tensor(src)
            assert back is src or (type(back) is torch.Tensor and back.device.type == "cpu"
                                   and torch.equal(back, src))
        assert pool.wrap_tensors(sources) is None
    assert sum(r.name == "vmmt.sglang" and "no slice" in r.getMessage()
               for r in caplog.records) == 1
    first.reconstruct_on_target_device(0)
    assert in_flight(pool) == 0
    assert isinstance(pool.wrap_tensor(sources[0]), vs.CudaVmmTensorTransportProxy)


def test_every_wrap_after_shutdown_raises(clean, torch):
    pool = make_pool()
    pool.shutdown()
    for src in (torch.ones(3), torch.ones(4, 4).t(), torch.ones(8 * MiB, dtype=torch.uint8),
                np.ones(3)):
        with pytest.raises(RuntimeError, match="closing"):
            pool.wrap_tensor(src)
    with pytest.raises(RuntimeError, match="closing"):
        pool.wrap_tensors([torch.ones(3), torch.ones(2)])
    pool.shutdown()  # idempotent


def test_concurrent_torch_wraps_with_shutdown(clean, torch, fast_switch):
    """Four threads wrap and rebuild contiguous CPU tensors until the pool is
    shut down under them (after 100 round trips, counted, not timed): each
    wrap gives a proxy whose bytes come back right or raises the pool's
    RuntimeError; a rebuild after shutdown is refused by vmmt; nothing is
    left counted."""
    for _ in range(4):
        pool = make_pool(memory_size=16 * MiB)
        outcomes, bad = collections.Counter(), []
        lock, going = threading.Lock(), threading.Event()

        def wrapper(tid):
            for i in range(1, 1 << 30):
                src = torch.full((64,), float(tid * 1000000 + i))
                try:
                    proxy = pool.wrap_tensor(src)
                except RuntimeError as e:
                    if "closing" not in str(e):
                        bad.append(repr(e))
                    return
                except Exception as e:  # reported below
                    bad.append(repr(e))
                    return
                if not isinstance(proxy, vs.CudaVmmTensorTransportProxy):
                    with lock:
                        outcomes["inline"] += 1
                    continue
                try:
                    t = proxy.reconstruct_on_target_device(0, consumer_count=1)
                except vmmt.Error:
                    with lock:
                        outcomes["refused"] += 1
                    continue
                except Exception as e:
                    bad.append("rebuild: %r" % e)
                    return
                if not torch.equal(t, src):
                    bad.append("wrong bytes at %d/%d" % (tid, i))
                with lock:
                    outcomes["ok"] += 1
                    if outcomes["ok"] >= 100:
                        going.set()

        threads = [threading.Thread(target=wrapper, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        try:
            assert going.wait(60)
            pool.shutdown()
        finally:
            going.set()
            for t in threads:
                t.join(60)
            pool.shutdown()
        vs._imported_pool_cache_clear()
        assert not any(t.is_alive() for t in threads)
        assert bad == [] and outcomes["ok"] >= 100, (bad[:3], outcomes)
        with pytest.raises(RuntimeError, match="closing"):
            pool.wrap_tensor(torch.ones(2))
