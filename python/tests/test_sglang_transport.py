"""vmmt.sglang's CudaVmmFeatureTransport as sglang's tokenizer drives it
(wrap, dispatch, cancel, the async path), and install() putting the module
in sglang's place (against a stand-in sglang package, in a child)."""
import asyncio
import pickle
import threading
import types

import numpy as np
import pytest

from child import run_child
from sglang_fixtures import MiB, clean, free_bytes, item, request, settle, vs  # noqa: F401

ARGS = types.SimpleNamespace(mm_feature_transport="cuda_vmm", tokenizer_worker_num=256,
                             base_gpu_id=0, tp_size=1, nnodes=1)


@pytest.fixture
def transport(clean):
    t = vs.CudaVmmFeatureTransport(ARGS, mm_processor=object())
    yield t
    t.shutdown()


def test_pool_from_the_server_args(transport):
    pool = transport.pool
    assert pool.allocation_size == 4 * MiB  # 1 GiB budget / 256 workers
    assert pool.consumer_count == 1 and pool.device_index == 0 and not pool.use_fabric


def test_disabled_or_without_a_processor(clean):
    off = vs.CudaVmmFeatureTransport(types.SimpleNamespace(mm_feature_transport="cpu"), None)
    assert off.pool is None and off.prepare_for_dispatch([None]) == []
    assert asyncio.run(off.prepare_for_dispatch_async([None])) == []
    off.cancel_for_dispatch([])
    off.shutdown()
    with pytest.raises(RuntimeError, match="multimodal processor"):
        vs.CudaVmmFeatureTransport(ARGS, None)


def test_images_of_a_request_are_packed_and_round_trip(transport):
    images = [np.arange(6, dtype=np.float32), np.arange(6, 12, dtype=np.float32)]
    embedding = np.ones(3, np.int64)
    req = request(item(images[0], embeddings=embedding), item(images[1], modality="VIDEO"),
                  item(np.ones(2), modality="AUDIO"))
    prepared = transport.prepare_for_dispatch([None, request(), req])
    assert prepared == req.mm_items
    a, b, c = req.mm_items
    assert isinstance(a.feature, vs.CudaVmmPackedTensorTransportProxy)
    assert a.feature._packed_owner is b.feature._packed_owner
    assert isinstance(a.precomputed_embeddings, vs.CudaVmmTensorTransportProxy)
    assert type(c.feature) is vs.CudaVmmTensorTransportProxy  # audio: wrapped alone
    rank_side = pickle.loads(pickle.dumps(req))  # what the scheduler receives
    got = [i.feature.reconstruct_on_target_device(0) for i in rank_side.mm_items]
    assert (got[0] == images[0]).all() and (got[1] == images[1]).all()
    assert (rank_side.mm_items[0].precomputed_embeddings.reconstruct_on_target_device(0) ==
            embedding).all()
    assert settle(transport.pool) == []


def test_deferred_features_are_not_packed(transport):
    req = request(*(item(np.ones(4), **{vs.DEFER_CUDA_IPC_FEATURE_RECONSTRUCTION_KEY: True})
                    for _ in range(2)))
    transport.wrap_items(req.mm_items)
    assert all(type(i.feature) is vs.CudaVmmTensorTransportProxy for i in req.mm_items)


def test_a_failure_half_way_cancels_every_proxy_and_restores_the_tensors(transport):
    features = [np.ones(4), np.ones(4)]
    embedding = np.ones(2)
    bad = item([np.ones(2), np.ones(2)], modality="AUDIO")
    req = request(item(features[0], embeddings=embedding), item(features[1]), bad)
    with pytest.raises(TypeError, match="single tensor"):
        transport.wrap_items(req.mm_items)
    assert [i.feature for i in req.mm_items[:2]] == features
    assert req.mm_items[0].precomputed_embeddings is embedding
    pool = transport.pool
    assert pool.occupied_chunks == [] and free_bytes(pool) == pool.allocation_size


def test_a_failed_request_in_a_batch_cancels_the_earlier_ones(transport):
    good = request(item(np.ones(4)))
    bad = request(item((np.ones(1),)))
    with pytest.raises(TypeError):
        transport.prepare_for_dispatch([good, bad])
    assert good.mm_items[0].feature is None  # cancelled: never dispatched
    assert transport.pool.occupied_chunks == []


def test_full_pool_sends_tensors_inline(transport):
    big = np.zeros(3 * MiB, np.uint8)
    req = request(item(big), item(big))  # two images: no slice holds both packed
    transport.wrap_items(req.mm_items)
    kinds = [type(i.feature) for i in req.mm_items]
    assert kinds == [vs.CudaVmmTensorTransportProxy, np.ndarray], kinds
    transport.cancel_for_dispatch(req.mm_items)
    assert settle(transport.pool) == []


def test_async_prepare_keeps_the_loop_and_returns_the_items(transport):
    req = request(item(np.arange(3.0)))

    async def run():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        tick = asyncio.create_task(ticker())
        try:
            return await transport.prepare_for_dispatch_async((req,)), ticks
        finally:
            tick.cancel()

    prepared, _ = asyncio.run(run())
    assert prepared == req.mm_items and isinstance(req.mm_items[0].feature,
                                                   vs.CudaVmmTensorTransportProxy)
    assert asyncio.run(transport.prepare_for_dispatch_async([None, request()])) == []
    transport.cancel_for_dispatch(prepared)
    assert settle(transport.pool) == []


def test_cancelled_async_prepare_takes_back_what_it_published(transport):
    pool = transport.pool
    started, release = threading.Event(), threading.Event()
    real = pool.wrap_tensor

    def slow_wrap(tensor):
        started.set()
        assert release.wait(30)
        return real(tensor)

    pool.wrap_tensor = slow_wrap
    req = request(item(np.ones(8)))

    async def run():
        task = asyncio.create_task(transport.prepare_for_dispatch_async([req]))
        while not started.is_set():
            await asyncio.sleep(0.001)
        task.cancel()
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(run())
    finally:
        release.set()
        transport._publisher_executor.shutdown(wait=True)
    assert req.mm_items[0].feature is None and settle(pool) == []


def test_transport_shutdown_is_retryable(transport):
    transport.shutdown()
    transport.shutdown()
    assert transport.pool._closed


_STAND_IN = {
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/utils/__init__.py": "",
    "sglang/srt/utils/cuda_vmm_utils.py": (
        "def get_device_allocation_handle_type(device_id):\n"
        "    return 'the seed'\n"
        "def make_prop():\n"
        "    return get_device_allocation_handle_type(0)\n"),
    "sglang/srt/utils/cuda_vmm_transport_utils.py": "SEED = True\n",
}


def test_install_puts_vmmt_in_sglangs_place(tmp_path):
    for name, text in _STAND_IN.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    out = run_child("""
        import sys
        sys.path.insert(0, %r)
        import vmmt.sglang as vs
        vs.install()
        vs.install()  # idempotent
        from sglang.srt.utils.cuda_vmm_transport_utils import CudaVmmFeatureTransport
        from sglang.srt.utils import cuda_vmm_transport_utils as seed, cuda_vmm_utils
        assert CudaVmmFeatureTransport is vs.CudaVmmFeatureTransport and seed is vs
        assert cuda_vmm_utils.get_device_allocation_handle_type is \\
            vs.get_device_allocation_handle_type
        assert cuda_vmm_utils.make_prop() == vs.HandleType.POSIX_FD  # its own callers too
        assert not hasattr(vs, "SEED")
        vs.uninstall()
        import sglang.srt.utils.cuda_vmm_transport_utils as again
        print("after uninstall: the seed", again.SEED)
        try:
            vs.install()
        except RuntimeError as e:
            print("late:", e)
        """ % str(tmp_path))
    assert "after uninstall: the seed True" in out and "late:" in out and \
        "already imported" in out, out


def test_sglang_style_doubles_take_sglangs_internal_paths(monkeypatch):
    """sglang's CPU tests build pools, owners and proxies with object.__new__
    and mocks; the paths they assert on stay: a hand-built owner cancels by
    its control offset, a packed member releases through its owner."""
    from unittest.mock import MagicMock
    monkeypatch.setattr(vs, "NUMPY_FEATURES", True)  # NumPy features stand in for torch's
    owner = object.__new__(vs._CudaVmmPackedTransportOwner)
    owner.control_offset, owner._producer_cancelled = 64, False
    proxies = [object.__new__(vs.CudaVmmPackedTensorTransportProxy) for _ in range(2)]
    for p in proxies:
        p._packed_owner = owner
    pool = object.__new__(vs.CudaVmmMemoryPool)
    pool.wrap_tensors = MagicMock(return_value=proxies)
    pool.wrap_tensor = MagicMock(side_effect=RuntimeError("copy failed"))
    pool._cancel_control_offset = MagicMock()
    transport = object.__new__(vs.CudaVmmFeatureTransport)
    transport.pool = pool
    features = [np.arange(4), np.arange(4, 8)]
    embedding = np.arange(2)
    items = [item(features[0], embeddings=embedding), item(features[1])]
    with pytest.raises(RuntimeError, match="copy failed"):
        transport.wrap_items(items)
    assert [i.feature for i in items] == features and items[0].precomputed_embeddings is embedding
    pool._cancel_control_offset.assert_called_once_with(64)

    member = object.__new__(vs.CudaVmmPackedTensorTransportProxy)
    member._packed_owner, member._consumer_acknowledged = MagicMock(), False
    member.release_without_reconstruction(consumer_count=2)
    member._packed_owner.acknowledge_consumption.assert_called_once_with(2)
    assert member._consumer_acknowledged


def test_numpy_features_go_inline_where_torch_is_loaded(transport, monkeypatch):
    """sglang's transport takes torch tensors only: in a process that has
    torch, a NumPy feature (or a list of them) is left for the request's
    pickle, and only the torch features of an image group are packed
    (vmmt.sglang.NUMPY_FEATURES: None, the default, means NumPy stands in
    for torch only where torch is not imported)."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(vs, "NUMPY_FEATURES", None)
    listed = [np.ones(2), np.ones(2)]
    images = [torch.arange(6, dtype=torch.float32), np.arange(6, dtype=np.float32),
              torch.ones(3)]
    req = request(item(images[0]), item(images[1], embeddings=np.ones(2)),
                  item(images[2], modality="VIDEO"), item(listed, modality="AUDIO"))
    transport.wrap_items(req.mm_items)
    a, b, c, d = req.mm_items
    assert isinstance(a.feature, vs.CudaVmmPackedTensorTransportProxy)
    assert a.feature._packed_owner is c.feature._packed_owner
    assert b.feature is images[1] and isinstance(b.precomputed_embeddings, np.ndarray)
    assert d.feature is listed
    rank_side = pickle.loads(pickle.dumps(req))
    assert torch.equal(rank_side.mm_items[0].feature.reconstruct_on_target_device(0), images[0])
    assert torch.equal(rank_side.mm_items[2].feature.reconstruct_on_target_device(0), images[2])
    assert (rank_side.mm_items[1].feature == images[1]).all()
    assert settle(transport.pool) == []


def test_numpy_features_on_pack_apart_from_torch_ones(transport, monkeypatch):
    """With NUMPY_FEATURES on (this suite's stand-in), an image group that
    mixes torch and NumPy is wrapped one feature at a time, not refused."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(vs, "NUMPY_FEATURES", True)
    images = [torch.arange(4, dtype=torch.float32), np.arange(4, dtype=np.float32)]
    req = request(item(images[0]), item(images[1]))
    transport.wrap_items(req.mm_items)
    assert all(type(i.feature) is vs.CudaVmmTensorTransportProxy for i in req.mm_items)
    rank_side = pickle.loads(pickle.dumps(req))
    assert torch.equal(rank_side.mm_items[0].feature.reconstruct_on_target_device(0), images[0])
    assert (rank_side.mm_items[1].feature.reconstruct_on_target_device(0) == images[1]).all()
    assert settle(transport.pool) == []
