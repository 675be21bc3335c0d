"""vmmt.sglang with real CUDA tensors (tests/gpu/run): sglang's call sequence
on the GPU machine, kept simple (written without a GPU to try it on).

wrap_tensor of CUDA and CPU tensors into device, elastic and host pools, the
proxy pickled, reconstruct_on_target_device in this process and in a rank
process (spawn) on the last GPU, packed members sharing one CUDA buffer, the
pool-full fallback to the CPU, cancel, a closed pool's refusal, and the
slices recycled."""
import pickle

from gpu_common import need_real_driver, run_module

try:
    import torch
except ImportError:  # pragma: no cover - the GPU machine has it
    torch = None

import vmmt
import vmmt.sglang as vs

MiB = 1 << 20


def need_gpu():
    need_real_driver(torch if torch is not None and torch.cuda.is_available() else None,
                     "needs PyTorch with CUDA")


def pool(kind="device", consumers=1, size=64 * MiB):
    return vs.CudaVmmMemoryPool(size, 0.05, 0, consumers, allow_posix_fallback=True, pool=kind)


def drained(p):
    p._recycle_chunks()
    return p.stats()["in_flight"] == 0


def test_round_trip_each_pool_and_source():
    need_gpu()
    vs.set_rank_resolver(vs.ParallelLayout())
    try:
        for kind in ("device", "elastic", "host"):
            p = pool(kind)
            try:
                for where in ("cuda:0", "cpu"):
                    for dtype in (torch.float32, torch.bfloat16, torch.int64):
                        src = (torch.arange(577 * 33) % 251).to(dtype).reshape(577, 33).to(where)
                        proxy = pickle.loads(pickle.dumps(p.wrap_tensor(src)))
                        t = proxy.reconstruct_on_target_device(0, consumer_count=1)
                        assert t.device == torch.device("cuda", 0), t.device
                        assert proxy.reconstruct_on_target_device(0, consumer_count=1) is t
                        torch.cuda.synchronize(0)
                        assert t.dtype == dtype and torch.equal(t.cpu(), src.cpu()), kind
                assert drained(p), p.stats()
            finally:
                p.shutdown()
    finally:
        vs.set_rank_resolver(None)
        vs._imported_pool_cache_clear()


def test_packed_members_share_one_cuda_buffer():
    need_gpu()
    p = pool()
    try:
        sources = [torch.arange(24, dtype=torch.float32, device="cuda").reshape(4, 6).t(),
                   torch.arange(7, dtype=torch.bfloat16, device="cuda"),
                   torch.arange(5, dtype=torch.int64)]
        proxies = pickle.loads(pickle.dumps(p.wrap_tensors(sources)))
        got = [x.reconstruct_on_target_device(0, consumer_count=1) for x in proxies]
        torch.cuda.synchronize(0)
        for g, s in zip(got, sources):
            assert torch.equal(g.cpu(), s.cpu().contiguous())
        ptr = proxies[0]._packed_owner.reconstruct_tensor.untyped_storage().data_ptr()
        assert all(g.untyped_storage().data_ptr() == ptr for g in got)
        assert drained(p)
    finally:
        p.shutdown()
        vs._imported_pool_cache_clear()


def test_acknowledge_ranks_lists_all_or_nothing():
    """acknowledge_ranks names ranks that are not consecutive: one consume for
    all of them (vmmt_consume_ranks), or, one of them done already, none, and
    the rank may then rebuild alone; single and packed, device and host pools."""
    need_gpu()
    for kind in ("device", "host"):
        p = pool(kind, consumers=4)
        try:
            src = torch.arange(4096, dtype=torch.int32, device="cuda")
            proxy = pickle.loads(pickle.dumps(p.wrap_tensor(src)))
            proxy.acknowledge_consumption(acknowledge_ranks=[3])
            wire = pickle.loads(pickle.dumps(proxy))
            try:
                wire.reconstruct_on_target_device(0, consumer_rank=0, acknowledge_ranks=[3, 0])
            except vmmt.Stale:
                pass
            else:
                raise AssertionError("a list with a done rank was consumed")
            t = wire.reconstruct_on_target_device(0, consumer_rank=0, acknowledge_ranks=[2, 0])
            torch.cuda.synchronize(0)
            assert torch.equal(t, src), kind
            assert not drained(p)
            # Asked again for another rank: the same tensor, acknowledged for it too.
            assert wire.reconstruct_on_target_device(0, acknowledge_ranks=[1]) is t
            assert drained(p), (kind, p.stats())
            sources = [torch.arange(9, dtype=torch.float32, device="cuda"),
                       torch.arange(5, dtype=torch.int64, device="cuda")]
            members = pickle.loads(pickle.dumps(p.wrap_tensors(sources)))
            got = [m.reconstruct_on_target_device(0, consumer_rank=1, acknowledge_ranks=[3, 1])
                   for m in members]
            torch.cuda.synchronize(0)
            assert all(torch.equal(g, s) for g, s in zip(got, sources)), kind
            pickle.loads(pickle.dumps(members[0])).release_without_reconstruction(
                acknowledge_ranks=[0, 2])
            assert drained(p), (kind, p.stats())
        finally:
            p.shutdown()
            vs._imported_pool_cache_clear()


def test_full_pool_falls_back_to_cpu_and_cancel_frees():
    need_gpu()
    p = pool(size=4 * MiB)
    try:
        big = torch.ones(3 * MiB, dtype=torch.uint8, device="cuda")
        first = p.wrap_tensor(big)
        fallback = p.wrap_tensor(big)
        assert fallback.device.type == "cpu" and torch.equal(fallback, big.cpu())
        assert p.wrap_tensors([big, big]) is None
        p.cancel_proxy(first)
        assert drained(p)
        try:
            pickle.loads(pickle.dumps(first)).reconstruct_on_target_device(0)
        except vmmt.Error:
            pass
        else:
            raise AssertionError("a cancelled proxy was reconstructed")
    finally:
        p.shutdown()
        vs._imported_pool_cache_clear()


def test_wrap_of_a_cuda_tensor_after_shutdown_is_refused():
    """wrap_tensor's inlined path for contiguous CUDA tensors keeps the
    refusal of the general one: a closed pool raises, nothing published."""
    need_gpu()
    p = pool()
    src = torch.arange(64, dtype=torch.float32, device="cuda")
    proxy = p.wrap_tensor(src)
    assert proxy.control_offset == proxy.descriptor.slot and proxy.shape == (64,)
    assert proxy.data_nbytes == 256 and proxy.dtype == torch.float32
    p.shutdown()
    try:
        p.wrap_tensor(src)
    except RuntimeError as e:
        assert "closing" in str(e), e
    else:
        raise AssertionError("a closed pool published")
    assert p._publishers == []
    vs._imported_pool_cache_clear()


def test_sglangs_own_lock_and_stream_failure_sequences():
    """Two of sglang's own tests' sequences: recycling and reading the chunks
    while holding the pool's lock, and a publish stream that cannot be made
    (patched through the transport module's torch, as sglang's test does),
    which must release the pool and the broker once each."""
    from unittest import mock

    need_gpu()
    p = pool()
    try:
        proxy = pickle.loads(pickle.dumps(p.wrap_tensor(torch.ones(1024, device="cuda"))))
        proxy.reconstruct_on_target_device(0, consumer_count=1)
        with p._lock:
            p._recycle_chunks()
            p._merge_chunks()
            assert p.occupied_chunks == [], p.occupied_chunks
    finally:
        p.shutdown()
        vs._imported_pool_cache_clear()
    release, close = vs.CudaVmmMemoryPool._release_allocation, vs._PosixFdBroker.close
    with mock.patch("vmmt.sglang.torch.cuda.Stream",
                    side_effect=RuntimeError("forced stream failure")), \
            mock.patch.object(vs.CudaVmmMemoryPool, "_release_allocation", autospec=True,
                              side_effect=release) as released, \
            mock.patch.object(vs._PosixFdBroker, "close", autospec=True,
                              side_effect=close) as closed:
        try:
            pool()
        except RuntimeError as e:
            assert "forced stream failure" in str(e), e
        else:
            raise AssertionError("a pool was made without its publish stream")
    failed = released.call_args[0][0]
    assert released.call_count == 1 and failed._pool.closed
    assert closed.call_count == (0 if failed.use_fabric else 1)


def test_lazy_bits_and_grad_are_published_as_values():
    """A CUDA tensor's negative or conjugate bit, or its autograd state, does
    not change what the rank rebuilds (test_attack_wire found the sign of a
    negative view lost on the emulator's path)."""
    need_gpu()
    p = pool()
    try:
        base = torch.tensor([1 + 2j, -3 + 0.5j], device="cuda")
        for src in (torch._neg_view(torch.arange(6.0, device="cuda")), base.conj(),
                    base.conj().imag, torch.arange(4.0, device="cuda").requires_grad_(),
                    torch.tensor([True, False, True], device="cuda")):
            want = src.detach().resolve_conj().resolve_neg()
            t = pickle.loads(pickle.dumps(p.wrap_tensor(src))).reconstruct_on_target_device(
                0, consumer_count=1)
            assert t.dtype == want.dtype and torch.equal(t, want), (t, want)
        assert drained(p)
    finally:
        p.shutdown()
        vs._imported_pool_cache_clear()


def test_rank_process_on_the_last_gpu():
    need_gpu()
    import torch.multiprocessing as tmp
    import sglang_gpu_workers
    device = torch.cuda.device_count() - 1
    ctx = tmp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=sglang_gpu_workers.rank, args=(there, device))
    proc.start()
    p = pool()
    try:
        for src in (torch.arange(35, dtype=torch.float32, device="cuda").reshape(5, 7),
                    torch.full((1 << 20,), 7, dtype=torch.uint8, device="cuda")):
            here.send_bytes(pickle.dumps(p.wrap_tensor(src)))
            assert here.poll(120), "the rank did not answer"
            status, where, values = here.recv()
            assert status == "ok", where
            assert where == "cuda:%d" % device and torch.equal(values, src.cpu())
        here.send_bytes(b"stop")
        proc.join(60)
        assert proc.exitcode == 0
        assert drained(p)
    finally:
        if proc.is_alive():
            proc.kill()
        p.shutdown()


if __name__ == "__main__":
    import sys
    run_module(sys.modules[__name__])
