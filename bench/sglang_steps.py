#!/usr/bin/env python3
"""Each step of sglang's call sequence through vmmt.sglang, timed alone.

bench/sglang_handoff.py times the round trip between two processes and
splits it into four parts; this splits those parts further, in one process
(the rank's steps run on the producer's own pool, imported through its
broker as a rank imports it), so that the Python, the binding and the driver
calls can be told apart. 4 KiB, a device pool from a CUDA tensor and a host
pool from a CPU tensor; batches of 32, the first two batches warm up; p50
and p99 in us. With PyTorch on CUDA (the H200), or --smoke on the emulator
with NumPy.

    python3 bench/sglang_steps.py [--smoke]
"""
import argparse
import os
import pickle
import sys
import time

CLOCK = time.perf_counter_ns
BATCH, BATCHES = 32, 14
KiB = 1024


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] / 1e3


class Steps:
    def __init__(self, vs, consumer, lib, pools, device, on_cuda):
        self.vs, self.consumer, self.lib, self.pools = vs, consumer, lib, pools
        self.device, self.on_cuda = device, on_cuda
        self.rows = []

    def source(self, kind):
        if self.lib == "torch":
            import torch
            where = "cuda:%d" % self.device if kind == "device" else "cpu"
            return torch.full((4 * KiB,), 7, dtype=torch.uint8, device=where)
        import numpy
        return numpy.full(4 * KiB, 7, dtype=numpy.uint8)

    def sync(self):
        if self.on_cuda:
            import torch
            torch.cuda.current_stream().synchronize()

    def timed(self, label, make, step, undo):
        """step(x) timed for each x of a batch that make() gives; undo(x, out) after."""
        xs = []
        for b in range(BATCHES):
            items = [make() for _ in range(BATCH)]
            outs = []
            for x in items:
                t0 = CLOCK()
                outs.append(step(x))
                if b >= 2:
                    xs.append(CLOCK() - t0)
            self.sync()
            for x, out in zip(items, outs):
                undo(x, out)
        self.rows.append((label, pct(xs, 50), pct(xs, 99)))

    def run(self, kind):
        pool = self.pools[kind]
        src = self.source(kind)
        consumer = self.consumer
        dev = self.device

        def cancel(proxy):
            pool.cancel_proxy(proxy)

        def reclaim(*_):
            pool._pool.reclaim()

        def wrapped():
            return pool.wrap_tensor(src)

        def pickled():
            return pickle.dumps(pool.wrap_tensor(src))

        def settle(proxy_or_desc, *_):
            # What a consumed occupant leaves: acknowledged, so the slice frees.
            pool._pool.reclaim()

        self.timed(kind + ": wrap_tensor", lambda: None, lambda _: pool.wrap_tensor(src),
                   lambda _, p: (cancel(p), reclaim()))
        self.timed(kind + ":   of which vmmt.Pool.publish", lambda: None,
                   lambda _: pool._pool.publish(src), lambda _, d: (pool._pool.cancel(d), reclaim()))
        self.timed(kind + ": pickle.dumps(proxy)", wrapped, pickle.dumps,
                   lambda p, _: (cancel(p), reclaim()))
        self.timed(kind + ": pickle.loads (the rank)", pickled, pickle.loads,
                   lambda b, p: (cancel(p), reclaim()))
        self.timed(kind + ": reconstruct_on_target_device", lambda: pickle.loads(pickled()),
                   lambda p: p.reconstruct_on_target_device(dev, consumer_count=1), settle)
        self.timed(kind + ":   of which Consumer.consume", lambda: pool.wrap_tensor(src).descriptor,
                   lambda d: consumer.consume(d, device=dev, ranks=range(0, 1)), settle)
        if self.lib == "torch":
            import torch
            self.timed(kind + ":   of which torch.from_dlpack",
                       lambda: consumer.consume(pool.wrap_tensor(src).descriptor, device=dev,
                                                ranks=range(0, 1)), torch.from_dlpack, settle)
            where = "cuda:%d" % dev if self.on_cuda else "cpu"
            self.timed(kind + ": (torch.empty of 4 KiB)", lambda: None,
                       lambda _: torch.empty(4 * KiB, dtype=torch.uint8, device=where),
                       lambda *_: None)
            self.timed(kind + ": (Consumer.consume(out=torch.empty))",
                       lambda: (pool.wrap_tensor(src).descriptor,
                                torch.empty(4 * KiB, dtype=torch.uint8, device=where)),
                       lambda x: consumer.consume(x[0], device=dev, out=x[1], ranks=range(0, 1)),
                       settle)
            dst = torch.empty(4 * KiB, dtype=torch.uint8, device=where)
            self.timed(kind + ": (torch copy_, one submission)", lambda: None,
                       lambda _: dst.copy_(src, non_blocking=True), lambda *_: None)
        self.timed(kind + ": the rank's synchronize (after a consume)",
                   lambda: pickle.loads(pickled()).reconstruct_on_target_device(
                       dev, consumer_count=1), lambda _: self.sync(), settle)
        self.timed(kind + ": an empty synchronize", lambda: None, lambda _: self.sync(),
                   lambda *_: None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="emulated driver, NumPy")
    args = ap.parse_args()
    lib = "numpy"
    if not args.smoke:
        try:
            import torch
            if torch.cuda.is_available():
                lib = "torch"
        except ImportError:
            pass
    if lib == "numpy":
        os.environ["VMMT_DRIVER"] = "emu"
    import vmmt
    import vmmt.sglang as vs
    import vmmt._sglang_proxy as proxies
    vs.set_rank_resolver(vs.ParallelLayout(attn_tp_rank=0, attn_tp_size=1))
    pools = {k: vs.CudaVmmMemoryPool(64 << 20, 0.05, 0, 1, allow_posix_fallback=True, pool=k)
             for k in ("device", "host")}
    steps = Steps(vs, proxies._consumer(), lib, pools, 0, lib == "torch")
    ways = {}
    try:
        for kind in ("device", "host"):
            steps.run(kind)
            st = pools[kind]._pool.stats()
            ways[kind] = (st.get("kernel_publishes", 0), st["published"])
    finally:
        vs._imported_pool_cache_clear()
        for p in pools.values():
            p.shutdown()
    print("sglang_steps: %s on %s, 4 KiB, one process; us p50 / p99" % (lib, vmmt.driver_name()))
    for label, p50, p99 in steps.rows:
        print("  %-48s %8.2f %8.2f" % (label, p50, p99))
    # How the publishes went to the GPU: one kernel each where the source allowed it.
    print("sglang_steps: publishes as one kernel: " +
          "; ".join("%s pool %d of %d" % (kind, k, n) for kind, (k, n) in ways.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
