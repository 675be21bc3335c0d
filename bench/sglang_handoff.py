#!/usr/bin/env python3
"""sglang's call sequence through vmmt.sglang, against the two-process floor
of the same run (BENCHMARKS.md, "From sglang").

Each round trip is what sglang's tokenizer and a rank do for one feature:
CudaVmmMemoryPool.wrap_tensor, pickle the proxy, send it through a
multiprocessing pipe, then in the rank process unpickle it,
reconstruct_on_target_device(0, consumer_count=1), synchronize and answer.
The floor, interleaved block by block: each process copies the same bytes
and synchronizes in turn, no transport at all; and the call sequence alone
(pickle a proxy's state, the pipe both ways, unpickle, no copy), which no
transport can go below. The rank is on the
producer's GPU (tensor-parallel rank 0, the common case); 4 KiB, 1 MiB and
64 MiB; a device pool fed from device memory, and a host pool fed from host
memory (features from a CPU processor). The producer polls the pipe for the
answer (python_bench.py says why a sleeping read adds a virtual machine's
wake-up tail). Also: wrap_tensor alone on the caller's thread (4 KiB, device
pool), the same wrap_tensor where the step before was the call sequence
alone (the rank doing no GPU work: what it adds over the wrap alone is this
process's own state after the pipe, not the GPU), and the time from the
rank's answer (its acknowledgement is written before it) until the pool has
the slice back.

Targets (one H200): device pool p50 <= 1.1x the floor, p99 <= 1.5x its own
p50; host pool >= 10x faster than the floor at 4 KiB; wrap_tensor < 10 us;
recycle < 100 us.

    python3 bench/sglang_handoff.py [--json PATH] [--scale F] [--smoke]

Runs with PyTorch on a GPU; --smoke (or no GPU) runs the same code on the
emulated driver with NumPy to check the script, numbers meaningless.
"""
import argparse
import json
import multiprocessing as mp
import os
import pickle
import statistics
import sys
import time

KiB, MiB = 1 << 10, 1 << 20
SIZES = ((4 * KiB, 1000), (1 * MiB, 400), (64 * MiB, 60))  # bytes, round trips per mode
POOLS = ("device", "host")
PARTS = ("wrap", "unpickle", "reconstruct", "sync")
# What a proxy pickles to (its descriptor and names), for the call sequence
# timed alone: pickle, the pipe both ways, unpickle, the poll; no copy.
PIPE_STATE = {"descriptor": bytes(512), "fabric_handle": None, "consumer_count": 1,
              "posix_socket_path": "vmmt-broker:" + "0" * 32, "allocation_size": 256 * MiB,
              "shape": (1024,), "dtype": "float32"}


class Backend:
    """Tensors, copies and synchronization: PyTorch on CUDA, or NumPy on the emulator."""

    def __init__(self, kind, device=0):
        self.kind, self.device = kind, device
        if kind == "torch":
            import torch
            self.torch = torch
            torch.cuda.set_device(device)
        else:
            import numpy
            self.np = numpy

    def tensor(self, nbytes, fill, on_device):
        if self.kind == "torch":
            where = "cuda:%d" % self.device if on_device else "cpu"
            return self.torch.full((nbytes,), fill, dtype=self.torch.uint8, device=where)
        return self.np.full(nbytes, fill, dtype=self.np.uint8)

    def copy(self, dst, src):
        if self.kind == "torch":
            dst.copy_(src)
        else:
            self.np.copyto(dst, src)

    def sync(self):
        if self.kind == "torch":
            self.torch.cuda.current_stream().synchronize()


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def summary(ns):
    return {"p50_us": pct(ns, 50) / 1e3, "p99_us": pct(ns, 99) / 1e3,
            "mean_us": statistics.mean(ns) / 1e3, "n": len(ns)}


def rank(conn, kind, device):
    """The rank: rebuilds each proxy (or, for the floor, copies) and answers."""
    import vmmt.sglang as vs
    be = Backend(kind, device)
    vs.set_rank_resolver(vs.ParallelLayout(attn_tp_rank=0, attn_tp_size=1))
    bufs = {}
    while True:
        msg = conn.recv_bytes()
        if msg == b"stop":
            break
        if msg.startswith(b"pipe "):
            pickle.loads(msg[5:])  # the call sequence alone: no copy, no transport
        elif msg.startswith(b"floor "):
            n = int(msg.split()[1])
            if n not in bufs:
                bufs[n] = (be.tensor(n, 1, True), be.tensor(n, 0, True))
            be.copy(bufs[n][1], bufs[n][0])
            be.sync()
        else:
            # The rank's parts, sent back with the answer: unpickle and
            # reconstruct (until the call returns), then the synchronize.
            t0 = time.perf_counter_ns()
            proxy = pickle.loads(msg)
            tp = time.perf_counter_ns()
            t = proxy.reconstruct_on_target_device(device, consumer_count=1)
            t1 = time.perf_counter_ns()
            del proxy
            be.sync()
            t2 = time.perf_counter_ns()
            del t
            conn.send_bytes(b"k %d %d %d" % (tp - t0, t1 - tp, t2 - t1))
            continue
        conn.send_bytes(b"k")
    # The rank's buffer cache: a miss is a cuMemAlloc (and later cuMemFree).
    try:
        import vmmt._sglang_proxy as proxies
        hits, misses, _, _ = proxies._consumer().cache_info()
    except (ImportError, AttributeError):
        hits = misses = -1
    conn.send_bytes(b"cache %d %d" % (hits, misses))
    vs._imported_pool_cache_clear()


ANSWER_S = 30  # a round trip is microseconds to milliseconds; a rank this late is stuck


def wait_answer(conn, proc):
    """The rank's answer, polled (see the module's comment); an error, not a
    hang, if the rank died or does not answer."""
    deadline = time.monotonic() + ANSWER_S
    spins = 0
    while not conn.poll(0):
        spins += 1
        if spins % 4096 == 0:
            if not proc.is_alive():
                raise RuntimeError("the rank process died (exit code %s); its stderr says why"
                                   % proc.exitcode)
            if time.monotonic() > deadline:
                raise RuntimeError("the rank did not answer within %d s" % ANSWER_S)
    return conn.recv_bytes()


def run_size(be, conn, proc, pools, nbytes, iters, block):
    clock = time.perf_counter_ns
    src_dev = be.tensor(nbytes, 3, True)
    srcs = {"device": src_dev, "host": be.tensor(nbytes, 3, False)}
    fsrc, fdst = src_dev, be.tensor(nbytes, 0, True)
    t = {m: [] for m in POOLS + ("floor", "pipe")}
    recycle = {m: [] for m in POOLS}
    # Where a round trip's time goes: wrap_tensor, the rank's reconstruct and
    # its synchronize (the rest is pickle, the pipe both ways and the poll).
    parts = {m: {k: [] for k in PARTS} for m in POOLS}
    # wrap_tensor (device pool) where the step before was the call sequence
    # alone: the rank did no GPU work, so what it costs over wrap_alone's
    # number is this process's own state after the pipe (cold caches), not
    # the rank's context on the GPU.
    wrap_after_pipe = []
    floor_msg = b"floor %d" % nbytes
    for rnd in range(iters // block + 1):  # blocks alternate; the first warms up
        for mode in POOLS + ("floor", "pipe"):
            for _ in range(block):
                t0 = clock()
                if mode == "floor":
                    be.copy(fdst, fsrc)
                    be.sync()
                    conn.send_bytes(floor_msg)
                elif mode == "pipe":
                    tw = clock()
                    proxy = pools["device"].wrap_tensor(srcs["device"])
                    t0 = clock()  # the call sequence's time starts after the wrap
                    if rnd:
                        wrap_after_pipe.append(t0 - tw)
                    conn.send_bytes(b"pipe " + pickle.dumps(PIPE_STATE))
                else:
                    proxy = pools[mode].wrap_tensor(srcs[mode])
                    tw = clock()
                    conn.send_bytes(pickle.dumps(proxy))
                    del proxy
                answer = wait_answer(conn, proc)
                t1 = clock()
                if mode == "pipe":
                    pools["device"].cancel_proxy(proxy)
                    del proxy
                    pools["device"]._pool.reclaim()
                if mode in POOLS:
                    pool = pools[mode]._pool
                    while pool.stats()["in_flight"]:  # the recycler's or our reclaim
                        pool.reclaim()
                    t2 = clock()
                if rnd:
                    t[mode].append(t1 - t0)
                    if mode in POOLS:
                        recycle[mode].append(t2 - t1)
                        _, unpickle, recon, sync = answer.split()
                        parts[mode]["wrap"].append(tw - t0)
                        parts[mode]["unpickle"].append(int(unpickle))
                        parts[mode]["reconstruct"].append(int(recon))
                        parts[mode]["sync"].append(int(sync))
    row = {"nbytes": nbytes, "floor": summary(t["floor"]), "pipe": summary(t["pipe"]),
           "wrap_after_pipe": summary(wrap_after_pipe)}
    for mode in POOLS:
        row[mode] = summary(t[mode])
        row[mode]["recycle"] = summary(recycle[mode])
        row[mode]["parts"] = {k: summary(v) for k, v in parts[mode].items()}
        row[mode]["p50_vs_floor"] = row[mode]["p50_us"] / row["floor"]["p50_us"]
        row[mode]["p99_vs_own_p50"] = row[mode]["p99_us"] / row[mode]["p50_us"]
    return row


def wrap_alone(be, pool, n):
    """wrap_tensor's time on the caller's thread, 4 KiB from device memory;
    and, interleaved batch by batch, vmmt.Pool.publish of the same tensor (the
    binding alone: what the adapter adds is the difference)."""
    clock = time.perf_counter_ns
    src = be.tensor(4 * KiB, 5, True)
    times = {"wrap_tensor": [], "publish": []}
    for b in range(12):
        mode = "wrap_tensor" if b % 2 == 0 else "publish"
        made = []
        for _ in range(n):
            t0 = clock()
            if mode == "wrap_tensor":
                made.append(pool.wrap_tensor(src))
            else:
                made.append(pool._pool.publish(src))
            if b >= 2:  # the first two batches warm up
                times[mode].append(clock() - t0)
        be.sync()
        for m in made:
            if mode == "wrap_tensor":
                pool.cancel_proxy(m)
            else:
                pool._pool.cancel(m)
        pool._pool.reclaim()
    return {k: summary(v) for k, v in times.items()}


def main():
    ap = argparse.ArgumentParser(description="sglang's hand-off through vmmt.sglang")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--scale", type=float, default=1.0, help="round trips x this")
    ap.add_argument("--smoke", action="store_true", help="emulated driver, NumPy, few iterations")
    args = ap.parse_args()
    kind = "numpy"
    if not args.smoke:
        try:
            import torch
            if torch.cuda.is_available():
                kind = "torch"
        except ImportError:
            pass
    sizes = SIZES
    if kind == "numpy":
        os.environ["VMMT_DRIVER"] = "emu"
        if not args.smoke:
            print("sglang_handoff: no PyTorch with CUDA; running --smoke on the emulated driver")
        sizes = ((4 * KiB, 40), (1 * MiB, 20))
    import vmmt
    import vmmt.sglang as vs
    be = Backend(kind, 0)
    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "backend": kind,
              "driver": vmmt.driver_name(), "python": sys.version.split()[0], "rows": []}
    if kind == "torch":
        report["device"] = be.torch.cuda.get_device_name(0)
        report["torch"] = be.torch.__version__
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=rank, args=(there, kind, 0))
    proc.start()
    pools = {}
    try:
        for mode in POOLS:
            pools[mode] = vs.CudaVmmMemoryPool(256 * MiB, 0.05, 0, 1, allow_posix_fallback=True,
                                               pool=mode)
        report["wrap_tensor_4k"] = wrap_alone(be, pools["device"], 400 if kind == "torch" else 50)
        for nbytes, iters in sizes:
            iters = max(20, int(iters * args.scale))
            block = max(10, iters // 10)
            report["rows"].append(run_size(be, here, proc, pools, nbytes, iters, block))
        here.send_bytes(b"stop")
        _, hits, misses = wait_answer(here, proc).split()
        report["rank_cache"] = {"hits": int(hits), "misses": int(misses)}
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
        for p in pools.values():
            p.shutdown()

    print("sglang_handoff: %s, %s; rank on the producer's GPU; polling the pipe"
          % (kind, report.get("device", "emu")))
    w = report["wrap_tensor_4k"]
    print("  wrap_tensor alone, 4 KiB device source: p50 %.2f us, p99 %.2f us (target < 10); "
          "vmmt.Pool.publish alone p50 %.2f us"
          % (w["wrap_tensor"]["p50_us"], w["wrap_tensor"]["p99_us"], w["publish"]["p50_us"]))
    print("  round trip, us p50/p99: floor | device pool, x floor, p99/p50 | host pool, "
          "floor / host | recycle p50 device/host (target < 100)")
    for r in report["rows"]:
        d, h, f = r["device"], r["host"], r["floor"]
        print("    %8d B  %8.1f %8.1f | %8.1f %8.1f %5.2fx %5.2f | %8.1f %8.1f %6.1fx | %6.1f %6.1f"
              % (r["nbytes"], f["p50_us"], f["p99_us"], d["p50_us"], d["p99_us"],
                 d["p50_vs_floor"], d["p99_vs_own_p50"], h["p50_us"], h["p99_us"],
                 f["p50_us"] / h["p50_us"], d["recycle"]["p50_us"], h["recycle"]["p50_us"]))
    print("  the call sequence alone (pickle, pipe both ways, unpickle, poll; no copy), "
          "us p50/p99: " + ", ".join("%.1f/%.1f" % (r["pipe"]["p50_us"], r["pipe"]["p99_us"])
                                    for r in report["rows"]))
    print("  parts, us p50: wrap_tensor / the rank's unpickle / reconstruct / synchronize")
    for r in report["rows"]:
        print("    %8d B  device %s | host %s" % (r["nbytes"], " / ".join(
            "%.1f" % r["device"]["parts"][k]["p50_us"] for k in PARTS),
            " / ".join("%.1f" % r["host"]["parts"][k]["p50_us"] for k in PARTS)))
    print("  wrap_tensor (device pool) after the call sequence alone, the rank doing no GPU "
          "work, us p50/p99: " + ", ".join("%.1f/%.1f" % (r["wrap_after_pipe"]["p50_us"],
                                                        r["wrap_after_pipe"]["p99_us"])
                                         for r in report["rows"]))
    c = report.get("rank_cache", {})
    print("  the rank's buffer cache: %s hits, %s misses (a miss: cuMemAlloc, later cuMemFree)"
          % (c.get("hits"), c.get("misses")))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
