#!/usr/bin/env python3
"""What a second CUDA context on the same GPU costs a publish (H200 only).

sglang's rank sits on the producer's GPU, so the producer's publishes are
submitted while another process holds a context there. This times, on the
caller's thread, 4 KiB from device memory: PyTorch's own non-blocking copy
(one driver submission: the floor of any publish), vmmt.Pool.publish (two:
the copy and the ready word), and vmmt.sglang's wrap_tensor and its pool's
publish; first alone, then with a second process holding an idle context on
the GPU. Ten batches of 200, the first two warm-up; p50 and p99 in us.

    python3 bench/publish_contexts.py
"""
import subprocess
import sys
import time

import torch

import vmmt
import vmmt.sglang as vs

CLOCK = time.perf_counter_ns


def timed(label, call, undo=None, reclaim=None, x=None):
    xs = []
    for _ in range(10):
        made = []
        for _ in range(200):
            t0 = CLOCK()
            made.append(call(x))
            xs.append(CLOCK() - t0)
        torch.cuda.synchronize()
        for m in made if undo else ():
            undo(m)
        if reclaim:
            reclaim()
    xs = sorted(xs[400:])
    print("  %-34s p50 %6.2f us  p99 %6.2f us" % (label, xs[len(xs) // 2] / 1e3,
                                               xs[int(len(xs) * 0.99)] / 1e3), flush=True)


def runs(x):
    y = torch.empty_like(x)
    timed("torch copy_(non_blocking)", lambda src: y.copy_(src, non_blocking=True), x=x)
    p = vmmt.Pool(device=0, memory_size=256 << 20, consumer_count=1)
    timed("vmmt.Pool.publish", p.publish, p.cancel, p.reclaim, x)
    p.close()
    sp = vs.CudaVmmMemoryPool(256 << 20, 0.05, 0, 1, allow_posix_fallback=True)
    timed("vmmt.sglang wrap_tensor", sp.wrap_tensor, sp.cancel_proxy, sp._pool.reclaim, x)
    timed("its pool's vmmt.Pool.publish", sp._pool.publish, sp._pool.cancel, sp._pool.reclaim, x)
    sp.shutdown()


def main():
    if not torch.cuda.is_available():
        print("publish_contexts: needs PyTorch with CUDA")
        return 0
    x = torch.full((1024,), 5.0, device="cuda")
    print("publish_contexts: %s, 4 KiB from device memory, on the caller's thread"
          % torch.cuda.get_device_name(0))
    print(" alone on the GPU:")
    runs(x)
    other = subprocess.Popen(
        [sys.executable, "-c", "import torch, time; torch.ones(4, device='cuda'); "
         "torch.cuda.synchronize(); print('ready', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE)
    try:
        other.stdout.readline()
        print(" another process holding an idle context on the same GPU:")
        runs(x)
    finally:
        other.kill()
        other.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
