#!/usr/bin/env python3
"""A producer and two tensor-parallel ranks that survive a rank killed mid-way.

The producer publishes each request's tensor into one pool for both ranks
and waits for both answers. Part-way through, rank 1 is SIGKILLed (a crash,
an OOM kill). The producer learns which rank of which pool died
(Pool.poll_deaths, or the rank's process exit; a WARNING record of the
logger "vmmt" names the pool too), restarts it with the recipe of
python/README.md ("Deaths"), and publishes the interrupted request again:

    old.kill(); old.join()  # gone and reaped: none of its copies can still run
    pool.release_rank(r)    # what it held, and what was published for it since
    start the new process for rank r

    python3 examples/rank_restart.py [--requests N] [--kill-at K]

Runs on the emulated driver without a GPU (VMMT_DRIVER=emu, how CI runs it)
and on real GPUs alike, with NumPy arrays.
"""
import argparse
import logging
import multiprocessing as mp
import os
import signal
import sys
import time

import numpy as np

try:
    import vmmt
except ImportError:  # pragma: no cover
    sys.exit("vmmt is not importable: pip install ./python (or set PYTHONPATH)")

RANKS = 2


def payload(i):
    return np.arange(1024, dtype=np.float32) + i


def rank_main(conn, rank):
    """One rank: consume each descriptor for its own rank, check it, answer."""
    with vmmt.Consumer() as consumer:
        while True:
            msg = conn.recv()
            if msg is None:
                return
            i, desc = msg
            x = np.from_dlpack(consumer.consume(desc, ranks=rank))
            conn.send((i, bool(np.array_equal(x, payload(i)))))


class Rank:
    def __init__(self, ctx, rank):
        self.rank = rank
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=rank_main, args=(child, rank), daemon=True)
        self.proc.start()
        child.close()

    def dead(self):
        return self.proc.exitcode is not None


def answers(ranks, i, deadline_s=60):
    """Wait for every rank's answer to request i; the ranks that died instead."""
    waiting, dead = set(range(len(ranks))), set()
    deadline = time.monotonic() + deadline_s
    while waiting:
        for r in sorted(waiting):
            try:
                if ranks[r].conn.poll(0.005):
                    got = ranks[r].conn.recv()
                    assert got == (i, True), "rank %d answered %r for request %d" % (r, got, i)
                    waiting.discard(r)
                elif ranks[r].dead():
                    waiting.discard(r)
                    dead.add(r)
            except (EOFError, ConnectionError):
                waiting.discard(r)
                dead.add(r)
        if time.monotonic() > deadline:
            raise SystemExit("rank(s) %s gave no answer to request %d" % (sorted(waiting), i))
    return dead


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--kill-at", type=int, default=100)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s: %(message)s")
    ctx = mp.get_context("spawn")
    restarts = 0
    with vmmt.Pool(memory_size=4 << 20, consumer_count=RANKS, max_slices=64) as pool:
        ranks = [Rank(ctx, r) for r in range(RANKS)]
        i = 0
        while i < args.requests:
            if i == args.kill_at and restarts == 0:
                os.kill(ranks[1].proc.pid, signal.SIGKILL)  # the fault this demo survives
            desc = pool.publish(payload(i))
            for r in ranks:
                try:
                    r.conn.send((i, desc))
                except (BrokenPipeError, ConnectionError):
                    pass  # dead: found below
            dead = answers(ranks, i) | set(pool.poll_deaths())
            for r in sorted(dead):
                # The recipe: make sure it is gone and reap it (a rank released for
                # consumer_lease_ms may still run), release the rank, start anew.
                ranks[r].proc.kill()
                ranks[r].proc.join()
                pool.release_rank(r)
                ranks[r] = Rank(ctx, r)
                restarts += 1
            if not dead:
                i += 1  # else request i again, for every rank
        for r in ranks:
            r.conn.send(None)
            r.proc.join(30)
        pool.drain(10000)
        s = pool.stats()
    ok = restarts >= 1 and s["in_flight"] == 0
    print("rank_restart: %s, %d requests, %d restart(s), rank_releases=%d released_slices=%d"
          % ("ok" if ok else "FAILED", args.requests, restarts, s["rank_releases"],
             s["released_slices"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
