"""The binding with PyTorch on a real GPU: float32, bfloat16 and int64; up to
8 dimensions; non-contiguous; CUDA, CPU and pinned CPU sources; the
current-stream default (a busy consumer stream shows that nothing waits on
the host); a producer and two consumers in torch.multiprocessing spawn."""
import time

from gpu_common import need_real_driver, run_module, skip

try:
    import torch
except ImportError:  # pragma: no cover - the GPU machine has it
    torch = None

import vmmt

DTYPES = ("float32", "bfloat16", "int64")


def need_gpu():
    need_real_driver(torch if torch is not None and torch.cuda.is_available() else None,
                     "needs PyTorch with CUDA")


def make(shape, dtype, device="cuda", seed=0):
    n = 1
    for s in shape:
        n *= s
    x = (torch.arange(n, device="cpu", dtype=torch.int64) * 7 + seed) % 251
    return x.to(getattr(torch, dtype)).reshape(shape).to(device)


def roundtrip(pool, consumer, a, device=0):
    d = pool.publish(a)
    x = torch.from_dlpack(consumer.consume(d, device=device, ranks=0))
    assert x.device == torch.device("cuda", device), x.device
    assert x.dtype == a.dtype and tuple(x.shape) == tuple(a.shape), (x.dtype, x.shape)
    torch.cuda.synchronize(device)
    assert torch.equal(x.cpu(), a.cpu().contiguous())
    return d


def test_dtypes_dims_and_sources():
    need_gpu()
    with vmmt.Pool(memory_size=64 << 20) as pool, vmmt.Consumer() as consumer:
        for dtype in DTYPES:
            for ndim in range(0, 9):
                shape = tuple([3, 2, 2, 1, 2, 2, 1, 2][:ndim])
                for source in ("cuda", "cpu", "pinned"):
                    a = make(shape, dtype, "cpu" if source != "cuda" else "cuda", ndim)
                    if source == "pinned":
                        a = a.pin_memory()
                    d = roundtrip(pool, consumer, a)
                    assert d.dtype == dtype and d.shape == shape
        pool.drain(10000)


def test_non_contiguous():
    need_gpu()
    with vmmt.Pool(memory_size=64 << 20) as pool, vmmt.Consumer() as consumer:
        for device in ("cuda", "cpu"):
            base = make((6, 8, 5), "float32", device)
            for view in (base.transpose(0, 2), base[:, ::2], base.permute(2, 0, 1)[1:],
                         make((16, 16), "bfloat16", device).t()):
                assert not view.is_contiguous()
                roundtrip(pool, consumer, view)


def test_packed_and_out():
    need_gpu()
    with vmmt.Pool(memory_size=64 << 20) as pool, vmmt.Consumer() as consumer:
        arrays = [make((i + 1, 33), dtype, seed=i) for i, dtype in enumerate(DTYPES)]
        descs = pool.publish_many(arrays)
        for d, a in zip(descs, arrays):
            out = torch.empty_like(a)
            assert consumer.consume(d, out=out, ranks=0) is out
            torch.cuda.synchronize()
            assert torch.equal(out, a)
        a = make((1000,), "int64")
        cpu_out = torch.zeros(1000, dtype=torch.int64)
        consumer.consume(pool.publish(a), out=cpu_out, ranks=0)
        assert torch.equal(cpu_out, a.cpu())


def test_other_device():
    need_gpu()
    if torch.cuda.device_count() < 2:
        skip("needs two GPUs")
    with vmmt.Pool(memory_size=64 << 20) as pool, vmmt.Consumer() as consumer:
        roundtrip(pool, consumer, make((64, 64), "bfloat16"), device=1)


def test_out_refusals():
    """consume(out=) refuses, before consuming, a conjugate or negative view
    (the hot path) and a tensor on another device than device= (both paths);
    the emulated tests drive these with a stand-in for torch."""
    need_gpu()
    with vmmt.Pool(memory_size=64 << 20) as pool, vmmt.Consumer() as consumer:
        a = make((8,), "float32")
        d = pool.publish(a)
        c = torch.zeros(4, dtype=torch.complex64, device="cuda")
        for out in (c.conj(), torch._neg_view(torch.zeros(8, device="cuda"))):
            assert out.is_conj() or out.is_neg()
            try:
                consumer.consume(d, out=out, ranks=0)
            except ValueError as e:
                assert "conjugate or negative" in str(e), e
            else:
                raise AssertionError("a conjugate or negative view was filled")
        if torch.cuda.device_count() >= 2:
            other = torch.zeros(8, device="cuda:1")
            for stream in (None, torch.cuda.current_stream(0)):
                try:
                    consumer.consume(d, device=0, out=other, stream=stream, ranks=0)
                except ValueError as e:
                    assert "device 1" in str(e), e
                else:
                    raise AssertionError("an out on device 1 was filled on device 0")
        out = torch.empty_like(a)
        assert consumer.consume(d, out=out, ranks=0) is out  # the descriptor was never consumed
        torch.cuda.synchronize()
        assert torch.equal(out, a)
        pool.drain(10000)


def test_stream_object_names_the_device():
    """A torch.cuda.Stream of device 1 picks device 1 for consume and ack
    (device= left out) and refuses device=0."""
    need_gpu()
    if torch.cuda.device_count() < 2:
        skip("needs two GPUs")
    with vmmt.Pool(memory_size=64 << 20) as pool, vmmt.Consumer() as consumer:
        a = make((64,), "float32")
        s1 = torch.cuda.Stream(device=1)
        d = pool.publish(a)
        try:
            consumer.consume(d, device=0, stream=s1, ranks=0)
        except ValueError as e:
            assert "device 1" in str(e), e
        else:
            raise AssertionError("device=0 with a stream of device 1 was taken")
        x = torch.from_dlpack(consumer.consume(d, stream=s1, ranks=0))
        assert x.device == torch.device("cuda", 1), x.device
        s1.synchronize()
        assert torch.equal(x.cpu(), a.cpu())
        consumer.ack(pool.publish(a), stream=s1, ranks=0)
        pool.drain(10000)


def test_current_stream_honoured_with_busy_consumer_stream():
    """The consume and from_dlpack enqueue on the current stream and return at
    once; the data is right once that (busy) stream gets to it."""
    need_gpu()
    with vmmt.Pool(memory_size=64 << 20) as pool, vmmt.Consumer() as consumer:
        a = make((512, 512), "float32")
        d = pool.publish(a)
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            torch.cuda._sleep(200_000_000)  # keeps s busy for tens of milliseconds
            t0 = time.perf_counter()
            buf = consumer.consume(d, ranks=0)  # default: the current stream, s
            x = torch.from_dlpack(buf)
            y = x.clone()
            took = time.perf_counter() - t0
            assert buf.stream == s.cuda_stream
            assert not s.query(), "the stream finished early: the sleep was too short to tell"
        assert took < 0.010, "consume waited on the host (%.1f ms)" % (took * 1e3)
        s.synchronize()
        assert torch.equal(y, a)


def test_consumer_on_another_stream_is_ordered():
    """Consumed on a busy stream s1, used on s2: s2 waits for s1's copy (an event)."""
    need_gpu()
    with vmmt.Pool(memory_size=64 << 20) as pool, vmmt.Consumer() as consumer:
        a = make((256, 256), "bfloat16")
        d = pool.publish(a)
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(s1):
            torch.cuda._sleep(100_000_000)
        buf = consumer.consume(d, stream=s1, ranks=0)
        with torch.cuda.stream(s2):
            x = torch.from_dlpack(buf)  # torch passes s2 to __dlpack__
            y = x.clone()
        s2.synchronize()
        assert torch.equal(y, a)


def test_producer_stream_and_source_kept_alive():
    """Publishing on a busy stream returns at once, and the source may be
    dropped right away: the pool keeps it until its copy ran. Without that,
    PyTorch would hand the tensor's block to the next allocation on its own
    (idle) stream, which overwrites it before the busy stream copies it."""
    need_gpu()
    with vmmt.Pool(memory_size=64 << 20) as pool, vmmt.Consumer() as consumer:
        busy = torch.cuda.Stream()
        for _ in range(3):
            a = torch.full((1 << 20,), 7.0, dtype=torch.float32, device="cuda")
            with torch.cuda.stream(busy):
                torch.cuda._sleep(100_000_000)
            t0 = time.perf_counter()
            d = pool.publish(a, stream=busy)  # the copy waits behind the sleep
            took = time.perf_counter() - t0
            del a
            junk = torch.empty(1 << 20, dtype=torch.float32, device="cuda")  # a's block, if free
            junk.fill_(-1.0)
            assert took < 0.010, "publish waited on the host (%.1f ms)" % (took * 1e3)
            x = torch.from_dlpack(consumer.consume(d, ranks=0))
            torch.cuda.synchronize()
            assert bool((x == 7.0).all()), "the source was overwritten before its copy"
            del junk, x


def test_repeated_no_leak():
    need_gpu()
    with vmmt.Pool(memory_size=64 << 20) as pool, vmmt.Consumer() as consumer:
        a = make((1024,), "float32")
        for _ in range(50):
            torch.from_dlpack(consumer.consume(pool.publish(a), ranks=0))
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        for _ in range(2000):
            x = torch.from_dlpack(consumer.consume(pool.publish(a), ranks=0))
            del x
        torch.cuda.synchronize()
        free1 = torch.cuda.mem_get_info()[0]
        assert free0 - free1 < (8 << 20), "device memory fell by %d bytes" % (free0 - free1)
        pool.drain(10000)


def test_reserve_commit_device_pool():
    """Writing in place: a kernel fills the reserved slice on the current stream."""
    need_gpu()
    with vmmt.Pool(memory_size=64 << 20) as pool, vmmt.Consumer() as consumer:
        for i in range(20):
            a = make((64, 33), "bfloat16", seed=i)
            r = pool.reserve(a.numel() * a.element_size())
            view = torch.from_dlpack(r)
            assert view.is_cuda and view.dtype == torch.uint8
            view[: a.numel() * 2].view(torch.bfloat16).view(a.shape).copy_(a)
            del view  # commit refuses while a view of the slice lives
            d = pool.commit(r, like=a)
            assert d.dtype == "bfloat16" and d.shape == (64, 33)
            x = torch.from_dlpack(consumer.consume(d, ranks=0))
            torch.cuda.synchronize()
            assert torch.equal(x, a)
        pool.cancel(pool.reserve(4096))
        pool.drain(10000)


def test_host_pool_and_elastic_pool():
    need_gpu()
    for kw in ({"memory_location": "host"}, {"elastic": True, "idle_release_ms": 50}):
        with vmmt.Pool(memory_size=64 << 20, **kw) as pool, vmmt.Consumer() as consumer:
            for source in ("cpu", "cuda"):
                a = make((1000,), "float32", source, 3)
                roundtrip(pool, consumer, a)
            s = pool.stats()
            if "memory_location" in kw:
                assert s["memory_location"] == "host" and s["device_bytes"] == 0, s
            else:
                assert s["chunks_made"] >= 1, s
            pool.drain(10000)


def test_consume_cache_reuses_buffers():
    """Same-size consumes on one stream reuse the freed buffer."""
    need_gpu()
    with vmmt.Pool(memory_size=64 << 20) as pool, vmmt.Consumer() as consumer:
        a = make((1024,), "float32")
        for i in range(100):
            x = torch.from_dlpack(consumer.consume(pool.publish(a), ranks=0))
            if i % 10 == 0:
                torch.cuda.synchronize()
                assert torch.equal(x, a)
            del x
        hits, misses, blocks, _ = consumer.cache_info()
        assert misses <= 2 and hits >= 98, consumer.cache_info()
        pool.drain(10000)


def test_multiprocessing_producer_and_two_consumers():
    need_gpu()
    import torch.multiprocessing as tmp
    import torch_workers
    ctx = tmp.get_context("spawn")
    result = ctx.Queue()
    pipes = [ctx.Pipe() for _ in range(2)]
    devices = [0, 1 if torch.cuda.device_count() > 1 else 0]
    procs = [ctx.Process(target=torch_workers.producer, args=([p[0] for p in pipes], 64, result))]
    procs += [ctx.Process(target=torch_workers.consumer, args=(p[1], r, devices[r], result))
              for r, p in enumerate(pipes)]
    for p in procs:
        p.start()
    try:
        reports = [result.get(timeout=300) for _ in procs]
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    assert not [r for r in reports if "error" in r[0]], reports
    assert sorted(r[0] for r in reports) == ["consumer", "consumer", "producer"], reports
    for r in reports:
        assert r[1] == 64 * 3, r


if __name__ == "__main__":
    import sys
    run_module(sys.modules[__name__])
