#!/usr/bin/env python3
"""Interference on the producer's GPU, with the rank as the consumer (issue 12).

`bench/interference.py` runs `vmmt demo`, whose consumer is a second process
on GPU 0 that copies every buffer back to the host to check it: both pool
runs then carry a second GPU context, which time-slices the GPU whatever the
producer does. In an engine the consumer is the tensor-parallel rank itself.
Here the rank (this process) runs bf16 4096x4096 matmuls on GPU 0 and, after
every 10 of them, consumes on its own stream (``out=``) what a producer
process published meanwhile; the producer publishes 4 KiB 1,000 times a
second through a device pool (a torch tensor on GPU 0: the producer copies on
the GPU) or through a host pool (a NumPy array: the producer writes host
memory with the CPU and never makes a CUDA context). The rank's consume work
is the same in both. Phases alternate (alone, device pool, host pool, ...)
for --rounds rounds; the noise is the spread of the alone phases.

    PYTHONPATH=<vmmt package> python3 bench/interference_rank.py [--seconds 4] [--rounds 3]

Needs torch with CUDA and the vmmt Python package.
"""
import argparse
import json
import multiprocessing as mp
import statistics
import time


def producer(kind, rate, conn, ready):
    import numpy as np

    import vmmt

    loc = "host" if kind == "host" else "device"
    pool = vmmt.Pool(memory_size=64 << 20, memory_location=loc)
    if kind == "host":
        src = np.arange(1024, dtype=np.float32)  # no torch.cuda call: no context
    else:
        import torch

        src = torch.arange(1024, dtype=torch.float32, device="cuda:0")
    ready.set()
    period, t_next, sent, full = 1.0 / rate, time.monotonic(), 0, 0
    while not conn.poll():
        try:
            conn.send_bytes(bytes(pool.publish(src)))
            sent += 1
        except vmmt.PoolFull:
            full += 1
        t_next += period
        pause = t_next - time.monotonic()
        if pause > 0:
            time.sleep(pause)
    conn.recv()
    # Descriptors are 512 bytes; the counts end the stream as a longer JSON message.
    conn.send_bytes(json.dumps({"sent": sent, "full": full, "pad": " " * 600}).encode())
    pool.drain(5000)
    pool.close()


def rank_phase(seconds, conn, consumer, out, a, b):
    import torch

    count, consumed, t0 = 0, 0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        for _ in range(10):
            a @ b
        while conn is not None and conn.poll():
            consumer.consume(conn.recv_bytes(), out=out, ranks=0)
            consumed += 1
        torch.cuda.synchronize()
        count += 10
    return count / (time.monotonic() - t0), consumed


def main():
    import torch

    import vmmt

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    n = 4096
    a = torch.randn(n, n, device="cuda:0", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda:0", dtype=torch.bfloat16)
    out = torch.empty(1024, dtype=torch.float32, device="cuda:0")
    consumer = vmmt.Consumer()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    rates = {"alone": [], "device": [], "host": []}
    for r in range(args.rounds + 1):
        rates["alone"].append(rank_phase(args.seconds, None, consumer, out, a, b)[0])
        if r == args.rounds:
            break
        for kind in ("device", "host"):
            mine, theirs = ctx.Pipe()
            ready = ctx.Event()
            p = ctx.Process(target=producer, args=(kind, args.rate, theirs, ready))
            p.start()
            ready.wait(60)
            time.sleep(0.5)
            rate, consumed = rank_phase(args.seconds, mine, consumer, out, a, b)
            mine.send("stop")
            while True:  # what is still in the pipe, then the producer's counts
                buf = mine.recv_bytes()
                if len(buf) != 512:
                    msg = json.loads(buf)
                    break
                consumer.consume(buf, out=out, ranks=0)
            p.join(30)
            torch.cuda.synchronize()
            rates[kind].append(rate)
            print(f"round {r}: {kind:6s} pool {rate:8.1f} matmuls/s, {consumed} consumed "
                  f"({msg['sent']} published, {msg['full']} refused full)", flush=True)
    consumer.close()
    alone = statistics.mean(rates["alone"])
    spread = (max(rates["alone"]) - min(rates["alone"])) / alone
    print(f"alone        {alone:9.1f} matmuls/s (mean of {len(rates['alone'])} phases; "
          f"spread {100 * spread:.2f}%)")
    res = {"gpu": torch.cuda.get_device_name(0), "rate_hz": args.rate, "seconds": args.seconds,
           "rates": rates, "alone_spread": spread}
    for kind in ("device", "host"):
        m = statistics.mean(rates[kind])
        res[kind] = m / alone - 1
        print(f"{kind:6s} pool  {m:9.1f} matmuls/s  {100 * (m / alone - 1):+6.2f}% vs alone "
              f"(phases {', '.join(f'{x:.1f}' for x in rates[kind])})")
    print(f"noise: the alone phases span {100 * spread:.2f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
