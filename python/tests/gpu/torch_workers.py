"""Process bodies for test_torch.py's torch.multiprocessing test."""
import gpu_common  # noqa: F401 (sys.path)
import torch

import vmmt


def expected(i, device):
    shape = (1 + i % 4, 3 + i % 7)
    dtype = (torch.float32, torch.bfloat16, torch.int64)[i % 3]
    n = shape[0] * shape[1]
    return ((torch.arange(n, dtype=torch.int64) * (i + 3)) % 251).to(dtype).reshape(shape).to(
        device)


def producer(conns, count, result):
    try:
        torch.cuda.set_device(0)
        published = 0
        with vmmt.Pool(memory_size=64 << 20, consumer_count=len(conns)) as pool:
            for i in range(count):
                a = expected(i, "cuda:0")
                descs = pool.publish_many([a, a.t(), a.cpu()])  # CUDA, non-contiguous, CPU
                published += len(descs)
                for c in conns:
                    c.send(descs)
            for c in conns:
                c.send(None)
            for c in conns:
                assert c.recv() == "done"
            pool.drain(30000)
        result.put(("producer", published))
    except BaseException as e:
        result.put(("producer-error", repr(e)))


def consumer(conn, rank, device, result):
    try:
        torch.cuda.set_device(device)
        checked, i = 0, 0
        with vmmt.Consumer() as c:
            while True:
                descs = conn.recv()
                if descs is None:
                    break
                want = expected(i, "cuda:%d" % device)
                for d, w in zip(descs, (want, want.t(), want)):
                    x = torch.from_dlpack(c.consume(d, device=device, ranks=rank))
                    assert x.device.index == device and x.dtype == w.dtype
                    assert torch.equal(x, w.contiguous()), (i, rank)
                    checked += 1
                i += 1
            torch.cuda.synchronize(device)
            conn.send("done")
        result.put(("consumer", checked, rank))
    except BaseException as e:
        result.put(("consumer-error", rank, repr(e)))
