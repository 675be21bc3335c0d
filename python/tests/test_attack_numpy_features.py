"""Attacks on vmmt.sglang.NUMPY_FEATURES and the transport's wrap_items /
prepare_for_dispatch / cancel_for_dispatch, from python/README.md ("From
sglang") and the module docstring only:

- NUMPY_FEATURES None (the default): NumPy arrays are features only where
  torch is not imported; True / False say so outright;
- where torch is imported (and NUMPY_FEATURES is not on), a NumPy feature, or
  a list of them, stays inline in the request's pickle;
- an image group mixing torch and NumPy is wrapped one feature at a time
  (NUMPY_FEATURES on), or only its torch members are packed (off);
- a list/tuple holding a torch tensor in a feature field is a TypeError
  ("single tensor") that rolls back every proxy of the request;
- the pool's wrap_tensor takes NumPy arrays always.

One finding, fixed: sys.modules["torch"] = None counted as torch imported
(the comment above the two tests that found it)."""
import asyncio
import pickle
import types
import warnings

import numpy as np
import pytest

from child import run_child
from sglang_fixtures import MiB, clean, free_bytes, item, request, settle, vs  # noqa: F401

pytestmark = pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")

ARGS = types.SimpleNamespace(mm_feature_transport="cuda_vmm", tokenizer_worker_num=256,
                             base_gpu_id=0, tp_size=1, nnodes=1)

SINGLE = vs.CudaVmmTensorTransportProxy
PACKED = vs.CudaVmmPackedTensorTransportProxy


@pytest.fixture
def transport(clean):
    t = vs.CudaVmmFeatureTransport(ARGS, mm_processor=object())
    yield t
    t.shutdown()


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def _all_free(pool):
    return settle(pool) == [] and free_bytes(pool) == pool.allocation_size


def _snapshot(req):
    return [(i.feature, i.precomputed_embeddings) for i in req.mm_items]


def _same_objects(req, snap):
    return all(i.feature is f and i.precomputed_embeddings is e
               for i, (f, e) in zip(req.mm_items, snap))


# ----------------------------------------------------------- child processes
# A process that has not imported torch: torch is made unimportable by a
# finder (sys.modules has no "torch" entry at all), as on a machine without it.

_NO_TORCH = """
import importlib.abc

class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError("No module named 'torch' (blocked by the test)")
        return None

sys.meta_path.insert(0, _NoTorch())
"""

_CHILD_SETUP = """
import pickle, types
import numpy as np
import vmmt.sglang as vs
from sglang_fixtures import item, request, settle, free_bytes
ARGS = types.SimpleNamespace(mm_feature_transport="cuda_vmm", tokenizer_worker_num=256,
                             base_gpu_id=0, tp_size=1, nnodes=1)
SINGLE, PACKED = vs.CudaVmmTensorTransportProxy, vs.CudaVmmPackedTensorTransportProxy
transport = vs.CudaVmmFeatureTransport(ARGS, mm_processor=object())
pool = transport.pool
"""

_CHILD_TEARDOWN = """
assert settle(pool) == [] and free_bytes(pool) == pool.allocation_size, pool.occupied_chunks
transport.shutdown()
print("CHILD-OK")
"""


def _child(*body):
    out = run_child(*body, _CHILD_TEARDOWN, timeout=120)
    assert "CHILD-OK" in out, out
    return out


def test_numpy_features_default_is_none_and_import_does_not_load_torch():
    """The documented default is None, and importing vmmt.sglang does not
    import torch itself (else 'where torch is not imported' could never
    hold on a machine that has it)."""
    out = run_child("""
        import vmmt.sglang as vs
        print("default", repr(vs.NUMPY_FEATURES))
        print("torch loaded", "torch" in sys.modules)
        """)
    assert "default None" in out and "torch loaded False" in out, out


def test_numpy_features_none_without_torch_publishes_numpy():
    """No torch in the process, NUMPY_FEATURES None: NumPy arrays are the
    features; an image group is packed, audio and embeddings are wrapped
    alone, a list of arrays is the 'single tensor' TypeError, and the
    rebuilt arrays carry the values."""
    _child(_NO_TORCH, _CHILD_SETUP, """
        assert vs.NUMPY_FEATURES is None and "torch" not in sys.modules
        a, b = np.arange(6, dtype=np.float32), np.arange(6, 12, dtype=np.float32)
        emb, audio = np.ones(3, np.int64), np.arange(4, dtype=np.int16)
        req = request(item(a, embeddings=emb), item(b), item(audio, modality="AUDIO"))
        transport.wrap_items(req.mm_items)
        x, y, z = req.mm_items
        assert isinstance(x.feature, PACKED) and isinstance(y.feature, PACKED), req
        assert x.feature._packed_owner is y.feature._packed_owner
        assert type(z.feature) is SINGLE and isinstance(x.precomputed_embeddings, SINGLE)
        rank = pickle.loads(pickle.dumps(req))
        got = [i.feature.reconstruct_on_target_device(0) for i in rank.mm_items]
        assert all(type(g) is np.ndarray for g in got), [type(g) for g in got]
        assert (got[0] == a).all() and (got[1] == b).all() and (got[2] == audio).all()
        e = rank.mm_items[0].precomputed_embeddings.reconstruct_on_target_device(0)
        assert (e == emb).all() and e.dtype == np.int64

        listed = [np.ones(2), np.ones(2)]
        good = np.ones(4)
        bad = request(item(good), item(listed, modality="AUDIO"))
        try:
            transport.wrap_items(bad.mm_items)
        except TypeError as e:
            assert "single tensor" in str(e), e
        else:
            raise AssertionError("a list of NumPy features was accepted: %r" % bad)
        assert bad.mm_items[0].feature is good and bad.mm_items[1].feature is listed
        """)


def test_numpy_features_false_without_torch_keeps_numpy_inline():
    """NUMPY_FEATURES False says outright that NumPy arrays are not
    features, also where torch is absent: they (and lists of them) stay
    inline, nothing is published; the pool's own wrap_tensor still takes
    them."""
    _child(_NO_TORCH, _CHILD_SETUP, """
        vs.NUMPY_FEATURES = False
        a, b, emb = np.arange(6.0), np.arange(3.0), np.ones(2)
        listed = [np.ones(2), np.ones(2)]
        req = request(item(a, embeddings=emb), item(b), item(listed, modality="AUDIO"))
        assert transport.prepare_for_dispatch([req]) == req.mm_items
        x, y, z = req.mm_items
        assert x.feature is a and y.feature is b and z.feature is listed, req
        assert x.precomputed_embeddings is emb
        assert pool.occupied_chunks == []
        transport.cancel_for_dispatch(req.mm_items)
        assert x.feature is a and z.feature is listed
        proxy = pool.wrap_tensor(np.arange(5, dtype=np.int32))
        assert isinstance(proxy, SINGLE), proxy
        got = pickle.loads(pickle.dumps(proxy)).reconstruct_on_target_device(0)
        assert (got == np.arange(5)).all() and got.dtype == np.int32
        """)


@pytest.mark.parametrize("literal", ["0", "''", "np.False_"], ids=["zero", "empty-str",
                                                                  "np-False"])
def test_numpy_features_falsy_non_bool_means_off(literal):
    """A falsy value that is not None (0, "", numpy.False_) is not 'None, the
    default': it should say off, like False, even where torch is absent."""
    _child(_NO_TORCH, _CHILD_SETUP, """
        vs.NUMPY_FEATURES = %s
        a = np.arange(4.0)
        req = request(item(a))
        transport.wrap_items(req.mm_items)
        got = req.mm_items[0].feature
        if got is not a:
            transport.cancel_for_dispatch(req.mm_items)
        assert got is a, "published under %%r: %%r" %% (vs.NUMPY_FEATURES, got)
        """ % literal)


def test_numpy_features_default_follows_a_later_torch_import():
    """'Published only where torch is not imported': a process that imports
    torch after vmmt.sglang (and after a first wrap) keeps NumPy features
    inline from then on."""
    try:
        import importlib.util
        if importlib.util.find_spec("torch") is None:
            pytest.skip("torch is not installed")
    except (ImportError, ValueError):
        pytest.skip("torch is not installed")
    _child(_CHILD_SETUP, """
        assert vs.NUMPY_FEATURES is None and "torch" not in sys.modules
        first = request(item(np.arange(4.0)))
        transport.wrap_items(first.mm_items)
        assert isinstance(first.mm_items[0].feature, SINGLE), first
        import torch
        a = np.arange(4.0)
        second = request(item(a), item(torch.ones(2)))
        transport.wrap_items(second.mm_items)
        assert second.mm_items[0].feature is a, second
        assert type(second.mm_items[1].feature) is SINGLE, second
        transport.cancel_for_dispatch(first.mm_items + second.mm_items)
        assert first.mm_items[0].feature is None and second.mm_items[0].feature is a
        """)


# -------------------------------------------- torch imported: NumPy stays inline

def _memmap(tmp_path):
    m = np.memmap(str(tmp_path / "feature.bin"), dtype=np.float32, mode="w+", shape=(8,))
    m[:] = np.arange(8)
    return m


_INLINE_VALUES = {
    "empty": lambda tmp: np.empty((0, 3), np.float32),
    "zero-d": lambda tmp: np.array(2.5),
    "matrix": lambda tmp: np.matrix([[1, 2], [3, 4]]),
    "memmap": _memmap,
    "masked": lambda tmp: np.ma.masked_array([1.0, 2.0, 3.0], mask=[0, 1, 0]),
    "strided": lambda tmp: np.arange(20.0).reshape(4, 5)[:, ::2],
    "fortran": lambda tmp: np.asfortranarray(np.arange(6).reshape(2, 3)),
    "bool": lambda tmp: np.array([True, False]),
    "list": lambda tmp: [np.ones(2), np.zeros(3)],
    "tuple": lambda tmp: (np.ones(2), np.zeros(3)),
    "nested-list": lambda tmp: [[np.ones(2)], (np.zeros(1),)],
    "empty-list": lambda tmp: [],
}


@pytest.mark.parametrize("setting", [None, False], ids=["none", "false"])
@pytest.mark.parametrize("kind", sorted(_INLINE_VALUES))
def test_numpy_features_inline_where_torch_is_loaded(transport, torch, monkeypatch, tmp_path,
                                                     kind, setting):
    """Every NumPy flavour (subclasses, empty, 0-d, views, containers of
    arrays) in the feature or embedding field, alone or in the middle of a
    torch image group, stays the same object; the torch images around it
    are packed together; the request pickles and the torch members rebuild
    right; nothing is left in the pool."""
    monkeypatch.setattr(vs, "NUMPY_FEATURES", setting)
    value = _INLINE_VALUES[kind](tmp_path)
    emb = _INLINE_VALUES[kind](tmp_path)
    images = [torch.arange(6, dtype=torch.float32), torch.arange(4, dtype=torch.int64)]
    req = request(item(images[0]), item(value, embeddings=emb), item(images[1]),
                  item(value, modality="AUDIO"), item(value, modality="VIDEO"))
    assert transport.prepare_for_dispatch([req]) == req.mm_items
    a, b, c, d, e = req.mm_items
    assert b.feature is value and b.precomputed_embeddings is emb
    assert d.feature is value and e.feature is value
    assert isinstance(a.feature, PACKED) and isinstance(c.feature, PACKED)
    assert a.feature._packed_owner is c.feature._packed_owner
    rank = pickle.loads(pickle.dumps(req))
    got = [rank.mm_items[i].feature.reconstruct_on_target_device(0) for i in (0, 2)]
    assert all(isinstance(g, torch.Tensor) for g in got)
    assert torch.equal(got[0], images[0]) and torch.equal(got[1], images[1])
    assert got[1].dtype == torch.int64
    assert _all_free(transport.pool)
    del rank, got
    if kind == "memmap":
        del value, emb, req, b, d, e


@pytest.mark.parametrize("setting", [None, False], ids=["none", "false"])
def test_numpy_features_group_of_three_numpy_in_the_middle(transport, torch, monkeypatch,
                                                           setting):
    """Three images, the middle one NumPy: the outer two torch images are
    packed in one slice (not refused, not wrapped apart), the middle one is
    left as it is; the rank rebuilds both torch ones."""
    monkeypatch.setattr(vs, "NUMPY_FEATURES", setting)
    t0 = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    mid = np.arange(5, dtype=np.float64)
    t2 = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    req = request(item(t0), item(mid), item(t2))
    transport.wrap_items(req.mm_items)
    a, b, c = req.mm_items
    assert isinstance(a.feature, PACKED) and isinstance(c.feature, PACKED)
    assert a.feature._packed_owner is c.feature._packed_owner
    assert b.feature is mid
    rank = pickle.loads(pickle.dumps(req))
    r0 = rank.mm_items[0].feature.reconstruct_on_target_device(0)
    r2 = rank.mm_items[2].feature.reconstruct_on_target_device(0)
    assert torch.equal(r0, t0) and r0.shape == (3, 4) and torch.equal(r2, t2)
    assert r2.dtype == torch.int32
    assert (rank.mm_items[1].feature == mid).all()
    assert _all_free(transport.pool)


def test_numpy_features_true_group_of_three_wrapped_apart(transport, torch, monkeypatch):
    """NUMPY_FEATURES True: a group [torch, NumPy, torch] is wrapped one
    feature at a time; each rebuilds in its producer's library with its
    values."""
    monkeypatch.setattr(vs, "NUMPY_FEATURES", True)
    t0, mid, t2 = torch.arange(4, dtype=torch.float32), np.arange(3, dtype=np.int16), \
        torch.ones(2, 2, dtype=torch.float64)
    req = request(item(t0), item(mid), item(t2))
    transport.wrap_items(req.mm_items)
    assert [type(i.feature) for i in req.mm_items] == [SINGLE] * 3, req
    rank = pickle.loads(pickle.dumps(req))
    g0, g1, g2 = (i.feature.reconstruct_on_target_device(0) for i in rank.mm_items)
    assert isinstance(g0, torch.Tensor) and torch.equal(g0, t0)
    assert type(g1) is np.ndarray and g1.dtype == np.int16 and (g1 == mid).all()
    assert isinstance(g2, torch.Tensor) and torch.equal(g2, t2)
    assert _all_free(transport.pool)


def test_numpy_features_true_numpy_only_group_is_packed(transport, torch, monkeypatch):
    """NUMPY_FEATURES True with torch loaded: an all-NumPy image group is
    packed like an all-torch one; rebuilt as NumPy arrays."""
    monkeypatch.setattr(vs, "NUMPY_FEATURES", True)
    imgs = [np.arange(4, dtype=np.float32), np.arange(7, dtype=np.uint8)]
    req = request(item(imgs[0]), item(imgs[1], modality="VIDEO"))
    transport.wrap_items(req.mm_items)
    assert all(isinstance(i.feature, PACKED) for i in req.mm_items), req
    rank = pickle.loads(pickle.dumps(req))
    got = [i.feature.reconstruct_on_target_device(0) for i in rank.mm_items]
    assert all(type(g) is np.ndarray for g in got)
    assert (got[0] == imgs[0]).all() and (got[1] == imgs[1]).all()
    assert got[1].dtype == np.uint8
    assert _all_free(transport.pool)


@pytest.mark.parametrize("value", [1, np.True_, "yes"], ids=["one", "np-True", "str"])
def test_numpy_features_truthy_non_bool_means_on(transport, torch, monkeypatch, value):
    """A truthy value other than True (1, numpy.True_, a non-empty str) is
    not None: with torch loaded it should publish NumPy features as True
    does."""
    monkeypatch.setattr(vs, "NUMPY_FEATURES", value)
    a = np.arange(4.0)
    req = request(item(a), item(torch.ones(3), modality="AUDIO"))
    transport.wrap_items(req.mm_items)
    assert type(req.mm_items[0].feature) is SINGLE, req.mm_items[0].feature
    transport.cancel_for_dispatch(req.mm_items)
    assert _all_free(transport.pool)


@pytest.mark.parametrize("setting", [None, False, True], ids=["none", "false", "true"])
def test_numpy_features_embeddings_mixed_with_torch(transport, torch, monkeypatch, setting):
    """precomputed_embeddings in NumPy beside a torch feature, and the other
    way round: torch is always published, NumPy only where the setting is
    on; the rank gets the values."""
    monkeypatch.setattr(vs, "NUMPY_FEATURES", setting)
    tf, ne = torch.arange(5, dtype=torch.float32), np.arange(3, dtype=np.int64)
    nf, te = np.arange(4, dtype=np.float32), torch.arange(2, dtype=torch.int64)
    req = request(item(tf, embeddings=ne), item(nf, embeddings=te))
    transport.wrap_items(req.mm_items)
    a, b = req.mm_items
    assert isinstance(a.feature, SINGLE) and isinstance(b.precomputed_embeddings, SINGLE)
    if setting:
        assert isinstance(a.precomputed_embeddings, SINGLE) and isinstance(b.feature, SINGLE)
    else:
        assert a.precomputed_embeddings is ne and b.feature is nf
    rank = pickle.loads(pickle.dumps(req))
    ra, rb = rank.mm_items
    assert torch.equal(ra.feature.reconstruct_on_target_device(0), tf)
    assert torch.equal(rb.precomputed_embeddings.reconstruct_on_target_device(0), te)
    gne = ra.precomputed_embeddings
    gnf = rb.feature
    if setting:
        gne, gnf = gne.reconstruct_on_target_device(0), gnf.reconstruct_on_target_device(0)
    assert type(gne) is np.ndarray and (gne == ne).all()
    assert type(gnf) is np.ndarray and (gnf == nf).all()
    assert _all_free(transport.pool)


def test_numpy_features_empty_and_zero_d_torch_in_a_group(transport, torch, monkeypatch):
    """An empty torch image is returned as it is (tensor.cpu(): itself for a
    CPU tensor) and not packed; a 0-d torch image is a member like the
    others and rebuilds with shape ()."""
    monkeypatch.setattr(vs, "NUMPY_FEATURES", None)
    t0, empty, scalar, np_mid = (torch.arange(3, dtype=torch.float32),
                                 torch.empty(0, 4), torch.tensor(7.5), np.ones(2))
    req = request(item(t0), item(empty), item(np_mid), item(scalar))
    transport.wrap_items(req.mm_items)
    a, b, c, d = req.mm_items
    assert b.feature is empty and c.feature is np_mid
    assert isinstance(a.feature, PACKED) and isinstance(d.feature, PACKED)
    rank = pickle.loads(pickle.dumps(req))
    g = rank.mm_items[3].feature.reconstruct_on_target_device(0)
    assert tuple(g.shape) == () and float(g) == 7.5
    assert torch.equal(rank.mm_items[0].feature.reconstruct_on_target_device(0), t0)
    assert tuple(rank.mm_items[1].feature.shape) == (0, 4)
    assert _all_free(transport.pool)


@pytest.mark.parametrize("kind", ["zero-d", "empty", "matrix", "memmap", "strided", "bool"])
def test_numpy_features_true_numpy_flavours_round_trip(transport, torch, monkeypatch, tmp_path,
                                                       kind):
    """NUMPY_FEATURES True with torch loaded: a NumPy flavour alone is
    published (an empty one returned as it is) and rebuilds as a NumPy array
    of its shape, dtype and values."""
    monkeypatch.setattr(vs, "NUMPY_FEATURES", True)
    value = _INLINE_VALUES[kind](tmp_path)
    expect = np.array(value)
    req = request(item(value, modality="AUDIO"))
    transport.wrap_items(req.mm_items)
    f = req.mm_items[0].feature
    if expect.size == 0:
        assert f is value
    else:
        assert type(f) is SINGLE, f
        got = pickle.loads(pickle.dumps(f)).reconstruct_on_target_device(0)
        assert isinstance(got, np.ndarray) and got.shape == expect.shape
        assert got.dtype == expect.dtype and (got == expect).all()
    assert _all_free(transport.pool)
    del f, req, value


# ------------------------------------------------ containers holding torch raise

def _bad_values(torch):
    return {
        "list-of-torch": lambda: [torch.ones(2), torch.ones(2)],
        "tuple-of-torch": lambda: (torch.ones(2),),
        "numpy-then-torch": lambda: [np.ones(2), torch.ones(2)],
        "nested-torch": lambda: [[np.ones(1)], [torch.ones(1)]],
        "nested-tuple-torch": lambda: ([], (torch.ones(1),)),
    }


_BAD_KINDS = ["list-of-torch", "tuple-of-torch", "numpy-then-torch", "nested-torch",
              "nested-tuple-torch"]


@pytest.mark.parametrize("field", ["feature", "embeddings"])
@pytest.mark.parametrize("setting", [None, False, True], ids=["none", "false", "true"])
@pytest.mark.parametrize("kind", _BAD_KINDS)
def test_numpy_features_torch_container_rolls_the_request_back(transport, torch, monkeypatch,
                                                                kind, setting, field):
    """A later item whose feature (or embedding) field is a list/tuple with a
    torch tensor in it, at any depth, is the 'single tensor' TypeError; every
    earlier item gets its original objects back (packed torch images, a
    single torch audio, inline and published NumPy alike) and no slice is
    left."""
    monkeypatch.setattr(vs, "NUMPY_FEATURES", setting)
    bad_value = _bad_values(torch)[kind]()
    bad = (item(torch.ones(1), modality="AUDIO", embeddings=bad_value) if field == "embeddings"
           else item(bad_value, modality="AUDIO"))
    req = request(item(torch.arange(4.0)), item(np.arange(3.0), embeddings=torch.ones(2)),
                  item(torch.arange(5.0), embeddings=np.ones(2)),
                  item(torch.ones(3), modality="AUDIO"), item(np.ones(4), modality="AUDIO"),
                  bad)
    snap = _snapshot(req)
    with pytest.raises(TypeError, match="single tensor"):
        transport.wrap_items(req.mm_items)
    assert _same_objects(req, snap), [(type(i.feature), type(i.precomputed_embeddings))
                                      for i in req.mm_items]
    pool = transport.pool
    assert pool.occupied_chunks == [] and free_bytes(pool) == pool.allocation_size
    # The same items wrap cleanly once the bad one is gone.
    req.mm_items.pop()
    transport.wrap_items(req.mm_items)
    transport.cancel_for_dispatch(req.mm_items)
    assert _all_free(pool)


def test_numpy_features_bad_item_first_rolls_back_the_pack(transport, torch, monkeypatch):
    """sglang packs the image group before it walks the fields: a bad first
    item must still roll back the packed slice of the images after it."""
    monkeypatch.setattr(vs, "NUMPY_FEATURES", None)
    bad = [torch.ones(2), torch.ones(2)]
    req = request(item(bad, modality="AUDIO"), item(torch.arange(3.0)), item(np.ones(2)),
                  item(torch.arange(4.0)))
    snap = _snapshot(req)
    with pytest.raises(TypeError, match="single tensor"):
        transport.wrap_items(req.mm_items)
    assert _same_objects(req, snap)
    assert _all_free(transport.pool)


def test_numpy_features_true_numpy_list_rolls_back_inline_and_published(transport, torch,
                                                                         monkeypatch):
    """NUMPY_FEATURES True: a list of NumPy arrays is a 'single tensor'
    TypeError too, and the mixed torch/NumPy group before it (wrapped one
    at a time) is rolled back."""
    monkeypatch.setattr(vs, "NUMPY_FEATURES", True)
    req = request(item(torch.ones(3)), item(np.ones(3)), item(torch.ones(2)),
                  item([np.ones(1), np.ones(1)], modality="AUDIO"))
    snap = _snapshot(req)
    with pytest.raises(TypeError, match="single tensor"):
        transport.wrap_items(req.mm_items)
    assert _same_objects(req, snap)
    assert _all_free(transport.pool)


def test_numpy_features_failed_batch_cancels_earlier_requests(transport, torch, monkeypatch):
    """prepare_for_dispatch of [good, bad]: the TypeError of the second
    request cancels the first one's proxies (their fields become None, as
    cancel_for_dispatch does) and leaves its inline NumPy arrays."""
    monkeypatch.setattr(vs, "NUMPY_FEATURES", None)
    inline, listed, emb = np.ones(3), [np.ones(1), np.ones(2)], np.zeros(2)
    good = request(item(torch.ones(2)), item(inline, embeddings=emb), item(torch.ones(3)),
                   item(listed, modality="AUDIO"))
    bad_req = request(item([torch.ones(1)], modality="AUDIO"))
    with pytest.raises(TypeError, match="single tensor"):
        transport.prepare_for_dispatch([good, None, bad_req])
    g = good.mm_items
    assert g[0].feature is None and g[2].feature is None
    assert g[1].feature is inline and g[1].precomputed_embeddings is emb
    assert g[3].feature is listed
    assert _all_free(transport.pool)


# ------------------------------------------------------------------ cancelling

def test_numpy_features_cancel_leaves_inline_arrays(transport, torch, monkeypatch):
    """cancel_for_dispatch of a request with inline NumPy features (and a
    request that only has those) does not fail, leaves the arrays, sets the
    proxies' fields to None, and may be repeated."""
    monkeypatch.setattr(vs, "NUMPY_FEATURES", None)
    inline, listed, emb = np.arange(3.0), [np.ones(2)], np.ones(1)
    req = request(item(torch.ones(2)), item(inline, embeddings=emb),
                  item(listed, modality="AUDIO"), item(torch.ones(2), modality="VIDEO"))
    transport.wrap_items(req.mm_items)
    transport.cancel_for_dispatch(req.mm_items)
    a, b, c, d = req.mm_items
    assert a.feature is None and d.feature is None
    assert b.feature is inline and b.precomputed_embeddings is emb and c.feature is listed
    transport.cancel_for_dispatch(req.mm_items)
    only_numpy = request(item(np.ones(2)), item([np.ones(1)], modality="AUDIO"))
    snap = _snapshot(only_numpy)
    transport.cancel_for_dispatch(only_numpy.mm_items)  # never wrapped
    transport.wrap_items(only_numpy.mm_items)
    assert _same_objects(only_numpy, snap)
    transport.cancel_for_dispatch(only_numpy.mm_items)
    assert _same_objects(only_numpy, snap)
    assert _all_free(transport.pool)


def test_numpy_features_cancel_after_the_switch_flips(transport, torch, monkeypatch):
    """NumPy features published under True are still cancelled after the
    switch is turned back to None (cancel goes by the proxies, not by what
    counts as a feature now)."""
    monkeypatch.setattr(vs, "NUMPY_FEATURES", True)
    req = request(item(np.ones(4)), item(np.ones(5)), item(np.ones(2), modality="AUDIO",
                                                          embeddings=np.ones(3)))
    transport.wrap_items(req.mm_items)
    assert all(isinstance(i.feature, SINGLE) for i in req.mm_items)
    monkeypatch.setattr(vs, "NUMPY_FEATURES", None)
    transport.cancel_for_dispatch(req.mm_items)
    assert all(i.feature is None for i in req.mm_items)
    assert req.mm_items[2].precomputed_embeddings is None
    assert _all_free(transport.pool)


def test_numpy_features_published_then_switched_off_still_rebuild_as_numpy(transport, torch,
                                                                          monkeypatch):
    """A NumPy feature published under True rebuilds on a rank, after the
    switch went off and with torch loaded, as a NumPy array (the producer's
    library)."""
    monkeypatch.setattr(vs, "NUMPY_FEATURES", True)
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    req = request(item(a))
    transport.wrap_items(req.mm_items)
    wire = pickle.dumps(req)
    monkeypatch.setattr(vs, "NUMPY_FEATURES", False)
    got = pickle.loads(wire).mm_items[0].feature.reconstruct_on_target_device(0)
    assert type(got) is np.ndarray and got.shape == (2, 3) and (got == a).all()
    assert _all_free(transport.pool)


# ------------------------------------------------------------ the pool itself

@pytest.mark.parametrize("setting", [None, False, True], ids=["none", "false", "true"])
def test_numpy_features_pool_wrap_tensor_takes_numpy_always(transport, torch, monkeypatch,
                                                             setting):
    """The pool's wrap_tensor takes a NumPy array whatever NUMPY_FEATURES
    says, with torch loaded; it rebuilds as NumPy; cancel_proxy frees it."""
    monkeypatch.setattr(vs, "NUMPY_FEATURES", setting)
    pool = transport.pool
    a = np.arange(10, dtype=np.float32)
    p = pool.wrap_tensor(a)
    assert isinstance(p, SINGLE), p
    got = pickle.loads(pickle.dumps(p)).reconstruct_on_target_device(0)
    assert type(got) is np.ndarray and (got == a).all()
    q = pool.wrap_tensor(np.ones((2, 2), np.int8))
    assert isinstance(q, SINGLE)
    pool.cancel_proxy(q)
    t = pool.wrap_tensor(torch.arange(3))
    assert isinstance(t, SINGLE)
    assert torch.equal(pickle.loads(pickle.dumps(t)).reconstruct_on_target_device(0),
                       torch.arange(3))
    assert _all_free(pool)


# ----------------------------------------------------------------- async path

def test_numpy_features_async_prepare_keeps_numpy_inline(transport, torch, monkeypatch):
    """prepare_for_dispatch_async follows the same rule: torch features are
    published (the group packed), NumPy ones stay inline."""
    monkeypatch.setattr(vs, "NUMPY_FEATURES", None)
    inline, listed = np.ones(3), [np.ones(2)]
    req = request(item(torch.ones(2)), item(inline), item(torch.ones(4)),
                  item(listed, modality="AUDIO"))
    prepared = asyncio.run(transport.prepare_for_dispatch_async([req]))
    assert prepared == req.mm_items
    a, b, c, d = req.mm_items
    assert isinstance(a.feature, PACKED) and isinstance(c.feature, PACKED)
    assert b.feature is inline and d.feature is listed
    rank = pickle.loads(pickle.dumps(req))
    assert torch.equal(rank.mm_items[2].feature.reconstruct_on_target_device(0), torch.ones(4))
    assert torch.equal(rank.mm_items[0].feature.reconstruct_on_target_device(0), torch.ones(2))
    assert _all_free(transport.pool)


def test_numpy_features_async_failure_rolls_back(transport, torch, monkeypatch):
    """The async path's TypeError for a list of torch tensors rolls the
    request back like the synchronous one."""
    monkeypatch.setattr(vs, "NUMPY_FEATURES", None)
    req = request(item(torch.ones(2)), item(np.ones(2)), item(torch.ones(3)),
                  item([torch.ones(1)], modality="AUDIO"))
    snap = _snapshot(req)
    with pytest.raises(TypeError, match="single tensor"):
        asyncio.run(transport.prepare_for_dispatch_async([req]))
    # prepare cancels what it had prepared; the failing request itself is
    # rolled back by wrap_items to its original objects.
    assert _same_objects(req, snap)
    assert _all_free(transport.pool)


# ------------------------------------------------------- more edges, more failures

# Found by this attack (fixed in vmmt.sglang._is_feature, both tests failed first): with
# sys.modules['torch'] = None (import torch raises ImportError) NUMPY_FEATURES=None treated
# torch as imported, so NumPy features stayed inline and a list of them was accepted.


def test_numpy_features_none_where_torch_is_marked_unimportable():
    """sys.modules["torch"] = None is Python's own way of saying 'import
    torch fails' (importing it raises ImportError): torch is not imported,
    so with NUMPY_FEATURES None NumPy arrays are the features (an image pair
    is packed)."""
    _child("""
        sys.modules["torch"] = None
        try:
            import torch
        except ImportError:
            pass
        else:
            raise AssertionError("torch imported")
        """, _CHILD_SETUP, """
        assert vs.NUMPY_FEATURES is None
        a, b = np.ones(2), np.ones(3)
        req = request(item(a), item(b))
        transport.wrap_items(req.mm_items)
        kinds = [type(i.feature).__name__ for i in req.mm_items]
        transport.cancel_for_dispatch(req.mm_items)
        assert kinds == ["CudaVmmPackedTensorTransportProxy"] * 2, kinds
        """)


def test_numpy_features_none_where_torch_is_marked_unimportable_list_raises():
    """Same process state: a list of NumPy features is refused ('single
    tensor'), as anywhere NumPy arrays are the features."""
    _child("""
        sys.modules["torch"] = None
        """, _CHILD_SETUP, """
        listed = [np.ones(1), np.ones(1)]
        req = request(item(listed, modality="AUDIO"))
        try:
            transport.wrap_items(req.mm_items)
        except TypeError as e:
            assert "single tensor" in str(e)
        else:
            raise AssertionError("a list of NumPy features was left inline where "
                                 "torch is not imported")
        """)


@pytest.mark.parametrize("order", ["t-t-np", "np-np-t", "np-t-np"])
def test_numpy_features_true_any_mixed_group_is_wrapped_apart(transport, torch, monkeypatch,
                                                              order):
    """NUMPY_FEATURES True: whichever way torch and NumPy are mixed in an
    image group, the group is wrapped one feature at a time (no packed
    member); all rebuild right."""
    monkeypatch.setattr(vs, "NUMPY_FEATURES", True)
    make = {"t": lambda i: torch.arange(3 + i, dtype=torch.float32),
            "np": lambda i: np.arange(3 + i, dtype=np.float32)}
    values = [make[k](i) for i, k in enumerate(order.split("-"))]
    req = request(*(item(v) for v in values))
    transport.wrap_items(req.mm_items)
    assert [type(i.feature) for i in req.mm_items] == [SINGLE] * 3, req
    rank = pickle.loads(pickle.dumps(req))
    for v, i in zip(values, rank.mm_items):
        g = i.feature.reconstruct_on_target_device(0)
        assert type(g) is type(v) and (np.asarray(g) == np.asarray(v)).all()
    assert _all_free(transport.pool)


def test_numpy_features_full_pool_mixed_group(transport, torch, monkeypatch):
    """Two 3 MiB torch images and a NumPy one between them, in a 4 MiB pool:
    no pack fits, so the torch images are wrapped apart (the second sent
    inline as tensor.cpu(), i.e. itself), the NumPy one is left as it is."""
    monkeypatch.setattr(vs, "NUMPY_FEATURES", None)
    big0 = torch.zeros(3 * MiB, dtype=torch.uint8)
    big1 = torch.ones(3 * MiB, dtype=torch.uint8)
    mid = np.ones(8)
    req = request(item(big0), item(mid), item(big1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transport.wrap_items(req.mm_items)
    a, b, c = req.mm_items
    assert type(a.feature) is SINGLE and b.feature is mid and c.feature is big1
    rank = pickle.loads(pickle.dumps(req))
    assert torch.equal(rank.mm_items[0].feature.reconstruct_on_target_device(0), big0)
    assert _all_free(transport.pool)


def test_numpy_features_object_array_stays_inline_where_torch_is_loaded(transport, torch,
                                                                         monkeypatch):
    """An object-dtype NumPy array (no bytes to publish) is only a NumPy
    feature: with torch loaded and the setting None it is left inline, it
    does not raise."""
    monkeypatch.setattr(vs, "NUMPY_FEATURES", None)
    odd = np.array([1, "a", None], dtype=object)
    req = request(item(torch.ones(2)), item(odd), item(torch.ones(3)))
    transport.wrap_items(req.mm_items)
    assert req.mm_items[1].feature is odd
    transport.cancel_for_dispatch(req.mm_items)
    assert req.mm_items[1].feature is odd
    assert _all_free(transport.pool)


def _meta(torch):
    return torch.empty(2, device="meta")


@pytest.mark.parametrize("failure", ["meta-audio", "meta-image", "sparse-image",
                                     "object-numpy-on"])
def test_numpy_features_later_wrap_failure_restores_everything(transport, torch, monkeypatch,
                                                               failure):
    """A later item whose wrap raises (a meta or sparse tensor, or, with
    NUMPY_FEATURES on, an object-dtype array) rolls the whole request back:
    every earlier item's original objects (packed and single torch, inline
    or published NumPy, embeddings) are back, no slice is held."""
    monkeypatch.setattr(vs, "NUMPY_FEATURES", True if failure == "object-numpy-on" else None)
    bad = {"meta-audio": lambda: item(_meta(torch), modality="AUDIO"),
           "meta-image": lambda: item(_meta(torch)),
           "sparse-image": lambda: item(torch.eye(3).to_sparse()),
           "object-numpy-on": lambda: item(np.array([1, "a"], dtype=object),
                                           modality="AUDIO")}[failure]()
    req = request(item(torch.arange(4.0), embeddings=np.ones(2)), item(np.arange(3.0)),
                  item(torch.arange(5.0)), item(torch.ones(3), modality="AUDIO",
                                                embeddings=torch.ones(1)),
                  item(np.ones(2), modality="AUDIO"), bad)
    snap = _snapshot(req)
    with pytest.raises(Exception) as info:
        transport.wrap_items(req.mm_items)
    assert not isinstance(info.value, AssertionError)
    assert _same_objects(req, snap), [(type(i.feature).__name__,
                                       type(i.precomputed_embeddings).__name__)
                                      for i in req.mm_items]
    assert _all_free(transport.pool)


def test_numpy_features_grad_and_strided_torch_around_numpy(transport, torch, monkeypatch):
    """A torch image that requires grad and a non-contiguous one, packed
    around a NumPy image: the rank rebuilds their values; the NumPy image is
    left as it is."""
    monkeypatch.setattr(vs, "NUMPY_FEATURES", None)
    g = torch.arange(4.0, requires_grad=True)
    s = torch.arange(20, dtype=torch.int32).reshape(4, 5)[:, ::2]
    mid = np.arange(2.0)
    req = request(item(g), item(mid), item(s))
    transport.wrap_items(req.mm_items)
    assert isinstance(req.mm_items[0].feature, PACKED) and req.mm_items[1].feature is mid
    rank = pickle.loads(pickle.dumps(req))
    rg = rank.mm_items[0].feature.reconstruct_on_target_device(0)
    rs = rank.mm_items[2].feature.reconstruct_on_target_device(0)
    assert torch.equal(rg, g.detach()) and not rg.requires_grad
    assert torch.equal(rs, s) and tuple(rs.shape) == (4, 3)
    assert _all_free(transport.pool)
