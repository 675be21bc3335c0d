"""vmmt.sglang's CudaVmmMemoryPool and proxies through sglang's call sequence,
in one process, on the emulated driver with NumPy arrays standing in for
torch tensors (torch-only cases at the end skip without torch)."""
import pickle
import threading

import numpy as np
import pytest

from sglang_fixtures import MiB, clean, free_bytes, make_pool, settle, vmmt, vs  # noqa: F401


def test_constructor_checks_and_the_seeds_errors(clean):
    for args, message in (((0, 60, 0, 1), "memory_size must be positive"),
                          ((4 * MiB, 60, 0, 0), "consumer_count must be positive"),
                          ((4 * MiB, 0, 0, 1), "recycle_interval must be positive")):
        with pytest.raises(ValueError, match=message):
            vs.CudaVmmMemoryPool(*args, allow_posix_fallback=True)
    with pytest.raises(ValueError, match="memory_size=4096 is smaller than CUDA VMM "
                                         "granularity=2097152"):
        vs.CudaVmmMemoryPool(4096, 60, 0, 1, allow_posix_fallback=True)
    # The emulated node has no IMEX channel: FABRIC fails, POSIX_FD is selected.
    with pytest.raises(RuntimeError, match="selected POSIX_FD, but this pool requires FABRIC"):
        vs.CudaVmmMemoryPool(4 * MiB, 60, 0, 1)
    with pytest.raises(ValueError, match="pool='gpu'"):
        make_pool(pool="gpu")


def test_properties_and_rounding_down(clean):
    pool = make_pool(consumer_count=2, memory_size=5 * MiB)  # rounded down, as sglang does
    try:
        assert pool.allocation_size == 4 * MiB and pool.consumer_count == 2
        assert pool.device_index == 0 and not pool.use_fabric and pool.fabric_handle is None
        assert pool.handle_type == vs.HandleType.POSIX_FD == 1
        assert pool.posix_socket_path.startswith("vmmt-broker:")
        assert pool.occupied_chunks == [] and free_bytes(pool) == pool.allocation_size
    finally:
        pool.shutdown()
    assert pool.occupied_chunks == [] and pool.available_chunks == []


def test_handle_type_probe_is_cached(clean):
    first = vs.get_device_allocation_handle_type(0)
    assert first == vs.HandleType.POSIX_FD
    assert vs.get_device_allocation_handle_type(0) is first


def test_round_trip_pickle_cache_and_release(clean):
    pool = make_pool()
    try:
        src = np.arange(35, dtype=np.float32).reshape(5, 7)
        proxy = pool.wrap_tensor(src)
        assert isinstance(proxy, vs.CudaVmmTensorTransportProxy)
        assert [c.start for c in pool.occupied_chunks] == [proxy.control_offset]
        wire = pickle.loads(pickle.dumps(proxy))
        assert wire.shape == (5, 7) and wire.dtype == np.float32 and wire.data_nbytes == 140
        t = wire.reconstruct_on_target_device(0, consumer_count=1)
        assert (t == src).all() and t.dtype == src.dtype
        assert wire.reconstruct_on_target_device(0, consumer_count=1) is t  # cached
        with pytest.raises(RuntimeError, match="already released"):
            wire.reconstruct_on_target_device(1, consumer_count=1)  # acknowledged already
        wire.acknowledge_consumption(1)  # once per proxy: a no-op now
        assert settle(pool) == [] and free_bytes(pool) == pool.allocation_size
        assert wire.borrow_on_target_device(0) is None
    finally:
        pool.shutdown()


def test_recycling_under_the_pools_own_lock(clean):
    # sglang's own tests hold the pool's lock while they recycle and read the
    # chunks (``with pool._lock: pool._recycle_chunks(); ...``): each of those
    # takes the lock again, so a lock that is not reentrant hangs them.
    pool = make_pool()
    seen, done = [], threading.Event()

    def sglangs_sequence():
        proxy = pool.wrap_tensor(np.ones(16, np.float32))
        pickle.loads(pickle.dumps(proxy)).reconstruct_on_target_device(0, consumer_count=1)
        with pool._lock:
            pool._recycle_chunks()
            pool._merge_chunks()
            seen.append((pool.occupied_chunks, free_bytes(pool)))
        done.set()

    worker = threading.Thread(target=sglangs_sequence, daemon=True)
    try:
        worker.start()
        assert done.wait(10), "recycling under pool._lock hung: the lock is not reentrant"
        assert seen == [([], pool.allocation_size)]
    finally:
        worker.join(10)
        if not worker.is_alive():
            pool.shutdown()


def test_the_wire_keeps_every_field_and_old_pickles_load(clean):
    pool = make_pool()
    try:
        src = np.arange(6, dtype=np.int16).reshape(2, 3)
        proxy = pool.wrap_tensor(src)
        fields = ("fabric_handle", "posix_socket_path", "allocation_size", "data_offset",
                  "data_nbytes", "control_offset", "consumer_count", "shape", "dtype")
        wire = pickle.loads(pickle.dumps(proxy))
        assert type(wire) is vs.CudaVmmTensorTransportProxy
        assert {f: getattr(wire, f) for f in fields} == {f: getattr(proxy, f) for f in fields}
        assert type(wire.descriptor) is vmmt.Descriptor and wire.descriptor == proxy.descriptor
        assert wire.reconstruct_tensor is None and not wire._consumer_acknowledged
        # A pickle of the dict form (vmmt before the flat wire) still loads.
        old = vs.CudaVmmTensorTransportProxy.__new__(vs.CudaVmmTensorTransportProxy)
        old.__setstate__(proxy.__getstate__())
        assert {f: getattr(old, f) for f in fields} == {f: getattr(proxy, f) for f in fields}
        # The descriptor is validated as it is unpickled: an altered field is refused there
        # (one the format allows is refused by the seal, when it is consumed).
        fn, args = proxy.__reduce__()
        forged = bytearray(args[0])
        forged[100] ^= 1
        with pytest.raises(ValueError, match="descriptor field fabric"):
            fn(bytes(forged), *args[1:])
        # A proxy made by hand, with no descriptor, crosses too and says what it lacks.
        bare = pickle.loads(pickle.dumps(vs.CudaVmmTensorTransportProxy(shape=(4,),
                                                                        dtype=np.float32)))
        assert bare.descriptor is None and bare.shape == (4,) and bare.dtype == np.float32
        with pytest.raises(RuntimeError, match="carries no vmmt descriptor"):
            bare.reconstruct_on_target_device(0)
        assert (wire.reconstruct_on_target_device(0, consumer_count=1) == src).all()
        assert settle(pool) == []
    finally:
        pool.shutdown()


def test_acknowledgements_select_ranks_by_the_layout(clean):
    pool = make_pool(consumer_count=4)
    try:
        proxy = pool.wrap_tensor(np.ones(8, np.int32))
        # Two attention groups of two: rank 1 of group 1 is consumer 3.
        for tp_rank in (0, 1):
            vs.set_rank_resolver(vs.ParallelLayout(attn_tp_rank=tp_rank, attn_tp_size=2,
                                                   attn_cp_rank=1))
            pickle.loads(pickle.dumps(proxy)).acknowledge_consumption(1)
        assert settle(pool), "ranks 0 and 1 have not acknowledged: the slice is still theirs"
        vs.set_rank_resolver(lambda: vs.ParallelLayout(attn_tp_rank=0, attn_tp_size=2))
        pickle.loads(pickle.dumps(proxy)).acknowledge_consumption(2)  # the whole group 0
        assert settle(pool) == []
        again = pickle.loads(pickle.dumps(proxy))
        with pytest.raises(vmmt.Error):
            again.reconstruct_on_target_device(0, consumer_count=4)  # recycled: refused
        with pytest.raises(ValueError, match="consumer_count must be 1, the attention TP size"):
            pool.wrap_tensor(np.ones(2)).acknowledge_consumption(3)
    finally:
        pool.shutdown()


def test_acknowledge_ranks_named_outright(clean):
    """sglang's newer proxies name the ranks (any order, not only a run)."""
    pool = make_pool(consumer_count=4)
    try:
        proxy = pool.wrap_tensor(np.arange(4.0))
        pickle.loads(pickle.dumps(proxy)).acknowledge_consumption(acknowledge_ranks=(2, 0, 3))
        assert settle(pool), "rank 1 has not acknowledged"
        pickle.loads(pickle.dumps(proxy)).release_without_reconstruction(acknowledge_ranks=[1])
        assert settle(pool) == []
        proxy = pool.wrap_tensor(np.arange(4.0))
        t = pickle.loads(pickle.dumps(proxy)).reconstruct_on_target_device(
            0, consumer_rank=2, acknowledge_ranks=(3, 2, 0, 1))
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0] and settle(pool) == []
        packed = pickle.loads(pickle.dumps(pool.wrap_tensors([np.ones(2), np.zeros(3)])))
        packed[1].reconstruct_on_target_device(0, acknowledge_ranks=(0, 1, 3, 2))
        assert settle(pool) == []
        for bad in ((), (0, 0), (4,), (True,)):
            with pytest.raises(ValueError, match="acknowledge_ranks"):
                pool.wrap_tensor(np.ones(1)).acknowledge_consumption(acknowledge_ranks=bad)
        with pytest.raises(TypeError):
            proxy.acknowledge_consumption(1, ranks=0)  # no silently ignored arguments
    finally:
        pool.shutdown()


def test_without_a_layout_only_all_ranks_resolve(clean):
    pool = make_pool(consumer_count=2)
    try:
        proxy = pool.wrap_tensor(np.ones(4))
        with pytest.raises(RuntimeError, match="set_rank_resolver"):
            proxy.acknowledge_consumption(1)
        proxy.acknowledge_consumption(2)
        assert settle(pool) == []
    finally:
        pool.shutdown()


def test_pool_full_falls_back_to_cpu_once_warned_then_recycles(clean, caplog):
    pool = make_pool()
    try:
        first = pool.wrap_tensor(np.zeros(3 * MiB, np.uint8))
        src = np.ones(3 * MiB, np.uint8)
        with caplog.at_level("WARNING", logger="vmmt.sglang"):
            fallback = pool.wrap_tensor(src)
            pool.wrap_tensor(src)
        assert isinstance(fallback, np.ndarray) and (fallback == 1).all()
        assert sum("no slice" in r.getMessage() for r in caplog.records) == 1
        first.reconstruct_on_target_device(0)
        settle(pool)
        assert isinstance(pool.wrap_tensor(src), vs.CudaVmmTensorTransportProxy)
    finally:
        pool.shutdown()


def test_oversized_tensor_falls_back_and_packs_refuse(clean):
    pool = make_pool()
    try:
        src = np.empty(pool.allocation_size + 1, np.uint8)
        assert isinstance(pool.wrap_tensor(src), np.ndarray)
        assert pool.wrap_tensors([src]) is None
        assert pool.wrap_tensors([np.ones(1)] * 65) is None  # more than one slice holds
        assert pool.wrap_tensors([]) == []
        assert settle(pool) == [] and free_bytes(pool) == pool.allocation_size
    finally:
        pool.shutdown()


def test_packed_round_trip_shares_one_buffer(clean):
    pool = make_pool()
    try:
        sources = [np.arange(24, dtype=np.float32).reshape(4, 6).T,
                   np.arange(7, dtype=np.int16), np.arange(5, dtype=np.int64)]
        proxies = pool.wrap_tensors(sources)
        assert all(isinstance(p, vs.CudaVmmPackedTensorTransportProxy) for p in proxies)
        assert len(pool.occupied_chunks) == 1 and len({p.control_offset for p in proxies}) == 1
        proxies = pickle.loads(pickle.dumps(proxies))
        assert proxies[0]._packed_owner is proxies[-1]._packed_owner
        got = [p.reconstruct_on_target_device(0, consumer_count=1) for p in proxies]
        for g, s in zip(got, sources):
            assert g.dtype == s.dtype and g.shape == s.shape and (g == s).all()
        flat = proxies[0]._packed_owner.reconstruct_tensor
        assert all(np.shares_memory(g, flat) for g in got)
        assert settle(pool) == []
    finally:
        pool.shutdown()


def test_packed_release_without_reconstruction_releases_the_group(clean):
    pool = make_pool(consumer_count=2)
    try:
        proxies = pool.wrap_tensors([np.ones(8, np.float32), np.zeros(3, np.int64)])
        for rank in (0, 1):
            mine = pickle.loads(pickle.dumps(proxies))  # each rank: an owner of its own
            vs.set_rank_resolver(vs.ParallelLayout(attn_tp_rank=rank, attn_tp_size=2))
            mine[0].release_without_reconstruction(consumer_count=1)
            mine[0].release_without_reconstruction(consumer_count=1)  # idempotent
            with pytest.raises(RuntimeError, match="already released"):
                mine[1].reconstruct_on_target_device(rank, consumer_count=1)
        assert settle(pool) == []
    finally:
        pool.shutdown()


def test_packed_cancel_is_shared_and_idempotent(clean):
    pool = make_pool()
    try:
        proxies = pool.wrap_tensors([np.ones(8, np.float32), np.ones(8, np.float32)])
        pool.cancel_proxy(proxies[0])
        pool.cancel_proxy(proxies[1])
        pool.cancel_proxy(proxies[0])
        assert pool.occupied_chunks == [] and free_bytes(pool) == pool.allocation_size
        with pytest.raises(vmmt.Error):
            pickle.loads(pickle.dumps(proxies))[0].reconstruct_on_target_device(0)
    finally:
        pool.shutdown()


def test_undispatched_proxy_can_be_cancelled_at_once(clean):
    pool = make_pool()
    try:
        proxy = pool.wrap_tensor(np.ones(16, np.float32))
        pool.cancel_proxy(proxy)
        # Refused at once, not after the recycler's next pass.
        with pytest.raises(vmmt.Error, match="no live occupant"):
            pickle.loads(pickle.dumps(proxy)).reconstruct_on_target_device(0)
        assert pool.occupied_chunks == [] and free_bytes(pool) == pool.allocation_size
        with pytest.raises(RuntimeError, match="no occupied slice at control offset"):
            pool._cancel_control_offset(proxy.control_offset)
    finally:
        pool.shutdown()


def test_changed_shape_releases_the_slice_and_refuses_a_retry(clean):
    """sglang's "consumer copy failure" case: a proxy whose shape no longer
    matches the bytes published."""
    pool = make_pool()
    try:
        proxy = pool.wrap_tensor(np.ones(1, np.float32))
        proxy.shape = (2,)
        with pytest.raises(RuntimeError, match="holds 8 bytes, but the published tensor has 4"):
            proxy.reconstruct_on_target_device(0, consumer_count=1)
        assert settle(pool) == []
        with pytest.raises(RuntimeError, match="already released"):
            proxy.reconstruct_on_target_device(0, consumer_count=1)
    finally:
        pool.shutdown()


def test_shutdown_waits_for_an_active_publisher(clean):
    pool = make_pool()
    entered, release, done = threading.Event(), threading.Event(), threading.Event()
    errors, proxies = [], []

    def blocked_synchronize():  # the host-source publish's wait for its copy
        entered.set()
        if not release.wait(30):
            raise TimeoutError("the publisher was never released")

    pool._publish_stream.synchronize = blocked_synchronize

    def publish():
        try:
            proxies.append(pool.wrap_tensor(np.ones(16, np.float32)))
        except Exception as e:  # reported below
            errors.append(e)

    def shutdown():
        try:
            pool.shutdown(timeout_ms=30000)
        except Exception as e:
            errors.append(e)
        finally:
            done.set()

    publisher = threading.Thread(target=publish)
    closer = threading.Thread(target=shutdown)
    try:
        publisher.start()
        assert entered.wait(30)
        closer.start()
        # Whatever the scheduling, shutdown cannot finish under a publisher.
        assert not done.wait(0.2)
        with pytest.raises(RuntimeError, match="is closing"):
            pool.wrap_tensor(np.ones(1))
    finally:
        release.set()
        publisher.join(30)
        closer.join(30)
    assert not errors and done.is_set() and pool._closed
    assert isinstance(proxies[0], vs.CudaVmmTensorTransportProxy)
    pool.shutdown()  # idempotent


def test_shutdown_is_bounded_and_retryable(clean):
    pool = make_pool()
    entered, release = threading.Event(), threading.Event()

    def blocked_synchronize():
        entered.set()
        release.wait(30)

    pool._publish_stream.synchronize = blocked_synchronize
    publisher = threading.Thread(target=pool.wrap_tensor, args=(np.ones(4),))
    publisher.start()
    try:
        assert entered.wait(30)
        with pytest.raises(RuntimeError, match="still inside wrap_tensor"):
            pool.shutdown(timeout_ms=50)
    finally:
        release.set()
        publisher.join(30)
    pool.shutdown()
    assert pool._closed


@pytest.mark.parametrize("kind", ["device", "elastic", "host"])
def test_each_pool_kind_round_trips(clean, kind):
    pool = make_pool(pool=kind)
    try:
        assert pool.pool_kind == kind and pool.stats()["memory_location"] == (
            "host" if kind == "host" else "device")
        src = np.arange(1000, dtype=np.float64)
        t = pickle.loads(pickle.dumps(pool.wrap_tensor(src))).reconstruct_on_target_device(1)
        assert (t == src).all()
        assert settle(pool) == []
    finally:
        pool.shutdown()


def test_pool_kind_from_the_environment(clean, monkeypatch):
    monkeypatch.setenv("VMMT_SGLANG_POOL", "host")
    pool = make_pool()
    try:
        assert pool.pool_kind == "host" and pool.stats()["memory_location"] == "host"
    finally:
        pool.shutdown()


def test_a_proxy_without_a_descriptor_says_so(clean):
    proxy = vs.CudaVmmTensorTransportProxy(shape=(2,), dtype=np.dtype("float32"),
                                           consumer_count=1)
    with pytest.raises(RuntimeError, match="no vmmt descriptor"):
        proxy.reconstruct_on_target_device(0)


def test_release_borrowed_without_a_borrow_does_nothing(clean):
    # sglang's newer scheduler calls it after borrow_on_target_device; the
    # version vmmt's proxies inherited from sglang, where it is installed,
    # read a borrow's state they never have (AttributeError).
    pool = make_pool()
    try:
        proxy = pool.wrap_tensor(np.ones(4, np.float32))
        assert proxy.borrow_on_target_device(0) is None
        assert proxy.release_borrowed_on_current_stream(1, 0) is None
        assert proxy.release_borrowed_on_current_stream() is None
        assert (proxy.reconstruct_on_target_device(0) == 1).all()
        assert settle(pool) == []
    finally:
        pool.shutdown()


def test_a_tensor_of_the_whole_pool_falls_back_as_in_sglang(clean):
    # sglang's slice holds its control block besides the bytes, so a tensor
    # of allocation_size bytes never fits there; its GPU tests expect the CPU
    # fallback for one (test_oversized_tensor_falls_back_to_cpu) and None
    # from a packed publish (test_packed_reservation_failure_returns_
    # fallback_signal). vmmt's pool keeps its table apart and would hold it.
    pool = make_pool()
    try:
        whole = np.zeros(pool.allocation_size, np.uint8)
        assert pool.wrap_tensor(whole) is whole
        assert pool.wrap_tensors([whole]) is None
        halves = [np.zeros(pool.allocation_size // 2, np.uint8) for _ in range(2)]
        assert pool.wrap_tensors(halves) is None
        assert pool.occupied_chunks == [] and free_bytes(pool) == pool.allocation_size
        nearly = np.zeros(pool.allocation_size - 4096, np.uint8)
        proxy = pool.wrap_tensor(nearly)
        assert isinstance(proxy, vs.CudaVmmTensorTransportProxy)
        pool.cancel_proxy(proxy)
        torch = pytest.importorskip("torch")
        big = torch.zeros(pool.allocation_size, dtype=torch.uint8)
        assert pool.wrap_tensor(big) is big
        assert pool.wrap_tensors([big[:16], big[16:]]) is None
        assert pool.occupied_chunks == [] and free_bytes(pool) == pool.allocation_size
    finally:
        pool.shutdown()


def test_torch_tensors_round_trip(clean):
    torch = pytest.importorskip("torch")
    pool = make_pool()
    try:
        src = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        proxy = pickle.loads(pickle.dumps(pool.wrap_tensor(src)))
        assert proxy.dtype == torch.float32
        t = proxy.reconstruct_on_target_device(0)
        assert isinstance(t, torch.Tensor) and torch.equal(t, src)
        got = [p.reconstruct_on_target_device(0) for p in
               pickle.loads(pickle.dumps(pool.wrap_tensors([src, src[0]])))]
        assert torch.equal(got[0], src) and torch.equal(got[1], src[0])
        storage = [getattr(g, "untyped_storage", g.storage)().data_ptr() for g in got]
        assert storage[0] == storage[1]  # (untyped_storage: torch 2; storage: Debian's 1.13)
        with pytest.raises(NotImplementedError, match="meta tensor"):
            pool.wrap_tensor(torch.ones(16, device="meta"))
        big = torch.zeros(pool.allocation_size + 1, dtype=torch.uint8)
        assert pool.wrap_tensor(big).device.type == "cpu"
        assert settle(pool) == []
    finally:
        pool.shutdown()


def test_the_module_names_torch_as_sglangs_does(clean):
    # sglang's module imports torch, and its tests patch through that name
    # ("...cuda_vmm_transport_utils.torch.cuda.Stream"); this one imports
    # without torch, so it looks the name up only when asked.
    from unittest import mock

    torch = pytest.importorskip("torch")
    assert vs.torch is torch
    with mock.patch("vmmt.sglang.torch.cuda.Stream") as stream:
        assert torch.cuda.Stream is stream
    with pytest.raises(AttributeError, match="tensor_from_pointer"):
        vs.tensor_from_pointer


def test_sglangs_own_rank_selection_names(clean):
    # sglang's unit tests ask a bare proxy (object.__new__, consumer_count
    # set) which ranks a consumer_count selects, by these names; the answer
    # is the selection that acknowledgements use (half-open ranges).
    vs.set_rank_resolver(vs.ParallelLayout(attn_tp_rank=1, attn_tp_size=2, attn_cp_rank=1))
    for cls in (vs.CudaVmmTensorTransportProxy, vs.CudaVmmPackedTensorTransportProxy):
        proxy = object.__new__(cls)
        proxy.consumer_count = 4
        assert proxy._resolve_consumer_count(None) == 1 and proxy._resolve_consumer_count(2) == 2
        assert [proxy._acknowledgement_range(n) for n in (None, 1, 2, 4)] == \
            [(3, 4), (3, 4), (2, 4), (0, 4)]
        with pytest.raises(ValueError, match="consumer_count must be 1, the attention TP size"):
            proxy._acknowledgement_range(3)


def test_a_bare_transport_shuts_down(clean):
    # sglang's tests build the transport with object.__new__ and set only
    # its pool; shutdown and the async dispatch must not need the rest.
    class Pool:
        calls = 0

        def shutdown(self):
            Pool.calls += 1

    transport = object.__new__(vs.CudaVmmFeatureTransport)
    transport.pool = Pool()
    transport.shutdown()
    transport.shutdown()
    assert Pool.calls == 2
