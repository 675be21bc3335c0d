#!/usr/bin/env python3
"""Interference on the producer's GPU (issue 12), GPU machine only.

A "rank" process (this one) runs bf16 4096x4096 matmuls back to back on GPU 0
and counts them per second: alone, then while `vmmt demo` publishes 4 KiB
buffers 1,000 times a second to one consumer process through a device pool
(the producer copies on GPU 0), then through a host pool (the producer writes
host memory with the CPU and makes no context). The consumer runs on GPU 0 too
(the demo puts consumer 0 on device 0) and checks every buffer, so both pool
runs carry the same consumer work; what differs is the producer's.

    python3 bench/interference.py --vmmt build/vmmt [--seconds 10] [--json out.json]

Needs torch with CUDA. Prints one line per case and the loss against alone.
"""
import argparse
import json
import subprocess
import sys
import time

import torch


def matmul_rate(seconds, n=4096):
    a = torch.randn(n, n, device="cuda:0", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda:0", dtype=torch.bfloat16)
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    count, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
        count += 10
    return count / (time.monotonic() - t0)


def with_publisher(vmmt, seconds, rate, host):
    count = int(rate * (seconds + 3))
    cmd = [vmmt, "demo", "--driver", "cuda", "--consumers", "1", "--size", "4K",
           "--count", str(count), "--rate", str(rate)]
    if host:
        cmd.append("--host")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(1.5)  # pool created, consumer attached, publishing at the rate
        if proc.poll() is not None:
            sys.exit("vmmt demo ended early:\n" + proc.stdout.read())
        r = matmul_rate(seconds)
        still = proc.poll() is None
    finally:
        out, _ = proc.communicate(timeout=seconds + 60)
    if proc.returncode != 0 or "result: OK" not in out:
        sys.exit("vmmt demo failed:\n" + out)
    if not still:
        print("warning: the publisher finished before the measurement did", file=sys.stderr)
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vmmt", default="build/vmmt")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--json")
    a = ap.parse_args()
    res = {"gpu": torch.cuda.get_device_name(0), "rate_hz": a.rate, "seconds": a.seconds}
    res["alone"] = matmul_rate(a.seconds)
    res["device_pool"] = with_publisher(a.vmmt, a.seconds, a.rate, host=False)
    res["host_pool"] = with_publisher(a.vmmt, a.seconds, a.rate, host=True)
    res["alone_again"] = matmul_rate(a.seconds)
    base = (res["alone"] + res["alone_again"]) / 2
    for k in ("alone", "device_pool", "host_pool", "alone_again"):
        print(f"{k:12s} {res[k]:9.1f} matmuls/s  {100 * (res[k] / base - 1):+6.2f}% vs alone")
    print(f"noise: the two alone runs differ by {100 * abs(res['alone'] / res['alone_again'] - 1):.2f}%")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
