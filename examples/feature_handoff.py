#!/usr/bin/env python3
"""The shape of a serving engine's multimodal hand-off, with vmmt.

One "processor" process (the tokenizer / multimodal preprocessor) turns
requests into image-feature tensors of varying shapes and publishes them into
a vmmt pool on GPU 0; two "tensor-parallel rank" processes receive each
request's descriptors over a multiprocessing pipe, rebuild the tensors with
from_dlpack on their own GPU, and check them. Every process is started with
`spawn`, as CUDA requires.

    python3 examples/feature_handoff.py [--requests N] [--pool-bytes B]

A process that fails reports its error, and the program stops with it
instead of waiting for reports that will never come.

With PyTorch and a GPU the features are bfloat16 CUDA tensors; without them
(VMMT_DRIVER=emu) the same program runs on the emulated driver with NumPy
float16 arrays, which is how CI runs it.
"""
import argparse
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback

try:  # run from a checkout: the package built by `make test`, or installed
    import vmmt
except ImportError:  # pragma: no cover
    sys.exit("vmmt is not importable: pip install ./python (or set PYTHONPATH)")

RANKS = 2


def backend():
    """'torch' on a GPU, else 'numpy' on the emulated driver."""
    if os.environ.get("VMMT_DRIVER") != "emu":
        try:
            import torch
            if torch.cuda.is_available():
                return "torch"
        except ImportError:
            pass
    os.environ["VMMT_DRIVER"] = "emu"
    return "numpy"


def features(request, kind, device):
    """The image features of one request: (patches, hidden) per image, 1-3 images."""
    shapes = [(16 + (request * 37 + k * 11) % 200, 64) for k in range(1 + request % 3)]
    out = []
    for k, shape in enumerate(shapes):
        n = shape[0] * shape[1]
        seed = request * 7 + k
        if kind == "torch":
            import torch
            x = ((torch.arange(n, dtype=torch.int64, device=device) * 31 + seed) % 127 - 63)
            out.append(x.to(torch.bfloat16).reshape(shape))
        else:
            import numpy as np
            x = (np.arange(n, dtype=np.int64) * 31 + seed) % 127 - 63
            out.append(x.astype(np.float16).reshape(shape))
    return out


def reported(role, fn, report, *args):
    """Run one process's work; an exception goes to the report queue, so the
    main process stops with it instead of waiting for reports that never come."""
    try:
        fn(*args, report)
    except BaseException:
        report.put(("error", role, traceback.format_exc()))
        raise


def processor(pipes, requests, kind, pool_bytes, report):
    device = "cuda:0"
    if kind == "torch":
        import torch
        torch.cuda.set_device(0)
    with vmmt.Pool(device=0, memory_size=pool_bytes, consumer_count=RANKS) as pool:
        full = 0
        for r in range(requests):
            feats = features(r, kind, device)
            try:
                descs = pool.publish_many(feats)  # one slice per request
            except vmmt.PoolFull:  # no room now: wait for the ranks (or fall back)
                full += 1
                pool.drain(10000)
                descs = pool.publish_many(feats)
            for p in pipes:
                p.send((r, descs))
        for p in pipes:
            p.send(None)
        for p in pipes:
            p.recv()
        pool.drain(10000)
        stats = pool.stats()
    report.put(("processor", stats["published"], stats["recycled"], full))


def rank(pipe, rank_id, kind, report):
    device = 0
    if kind == "torch":
        import torch
        device = rank_id % torch.cuda.device_count()
        torch.cuda.set_device(device)
        from_dlpack, equal = torch.from_dlpack, torch.equal
    else:
        import numpy as np
        from_dlpack, equal = np.from_dlpack, np.array_equal
    tensors = 0
    with vmmt.Consumer() as consumer:
        while True:
            msg = pipe.recv()
            if msg is None:
                break
            r, descs = msg
            want = features(r, kind, "cuda:%d" % device)
            got = [from_dlpack(consumer.consume(d, device=device, ranks=rank_id)) for d in descs]
            assert all(equal(g, w) for g, w in zip(got, want)), "request %d differs" % r
            tensors += len(got)
        pipe.send("done")
    report.put(("rank %d" % rank_id, tensors))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--pool-bytes", type=int, default=64 << 20)
    args = ap.parse_args()
    kind = backend()
    ctx = mp.get_context("spawn")
    report = ctx.Queue()
    pipes = [ctx.Pipe() for _ in range(RANKS)]
    procs = [ctx.Process(target=reported, args=("processor", processor, report,
                                                 [p[0] for p in pipes], args.requests, kind,
                                                 args.pool_bytes))]
    procs += [ctx.Process(target=reported, args=("rank %d" % i, rank, report, p[1], i, kind))
              for i, p in enumerate(pipes)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    results, failed = [], None
    deadline = time.monotonic() + 300
    try:
        while len(results) < len(procs) and failed is None:
            try:
                msg = report.get(timeout=0.5)
            except queue.Empty:
                gone = [p for p in procs if p.exitcode not in (None, 0)]
                if gone:
                    failed = "a process exited with status %d without reporting" % \
                        gone[0].exitcode
                elif time.monotonic() > deadline:
                    failed = "no report within 300 s"
                continue
            if msg[0] == "error":
                failed = "%s failed:\n%s" % (msg[1], msg[2])
            else:
                results.append(msg)
    finally:
        for p in procs:
            # A failed peer leaves the others waiting on their pipes: end them.
            p.join(60 if failed is None else 2)
            if p.is_alive():
                p.kill()
                p.join()
    took = time.perf_counter() - t0
    for r in sorted(results):
        print(*r)
    if failed is not None:
        print("feature_handoff: " + failed, file=sys.stderr)
    ok = failed is None and all(p.exitcode == 0 for p in procs) and len(results) == len(procs)
    print("feature_handoff: %s, %d requests, %s, %.2f s" %
          ("ok" if ok else "FAILED", args.requests, "bfloat16 on CUDA" if kind == "torch"
           else "float16 on the emulated driver", took))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
