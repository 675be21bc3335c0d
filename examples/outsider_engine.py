"""An engine-shaped hand-off written from the docs alone, by a new user.

A launcher starts a processor process; the processor makes a device pool
for two ranks, starts the two rank processes (all with `spawn`) and
publishes NumPy arrays to them over pipes.  It meets, each on purpose, the
cases an engine must handle:

  1. a full pool         -> vmmt.PoolFull: send the array itself
  2. an oversized array  -> vmmt.TooLarge: send the array itself
  3. a closed pool       -> vmmt.Closed
  4. a stale descriptor  -> vmmt.Stale (consumed twice; cancelled;
                            a dead rank's old descriptor after release_rank)
  5. a dead rank         -> SIGKILL rank 1, the "Deaths" recipe, keep going
  6. a dead producer     -> the launcher SIGKILLs the processor; the ranks
                            get vmmt.ProducerGone and exit 0

Every byte a rank receives (through the pool or the fallback) is compared
with what the processor made.  Every wait has a deadline.

Run from a checkout without a GPU:

    cd python && python3 setup.py build --build-lib /tmp/vmmt-lib && cd ..
    VMMT_DRIVER=emu PYTHONPATH=/tmp/vmmt-lib /usr/bin/python3 examples/outsider_engine.py
"""

import ctypes
import multiprocessing as mp
import os
import signal
import sys
import time

import numpy as np

RANKS = 2
WAIT_S = 20.0          # any single wait for a peer
POOL_BYTES = 2 << 20
REQUEST_BYTES = 256 << 10
PHASE5_REQUESTS = 60
KILL_AT = 20
HOLD_COUNT = 12        # descriptors the ranks hold when the producer dies


def log(who, msg):
    print(f"[{who}] {msg}", flush=True)


def payload(rid, nbytes):
    """The request's bytes, reproducible in every process from its id."""
    raw = np.random.default_rng(rid).integers(0, 256, nbytes, dtype=np.uint8)
    if nbytes % 16 == 0:
        return raw.view(np.float32).reshape(-1, 4)
    return raw


def same_bytes(got, rid, nbytes):
    want = payload(rid, nbytes)
    got = np.asarray(got)
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"dtype/shape {got.dtype}{got.shape} != {want.dtype}{want.shape}"
    if not np.array_equal(got.view(np.uint8).reshape(-1), want.view(np.uint8).reshape(-1)):
        return "bytes differ"
    return None


def recv(conn, timeout=WAIT_S):
    if not conn.poll(timeout):
        raise TimeoutError(f"no message within {timeout} s")
    return conn.recv()


# ---------------------------------------------------------------- rank side

def rank_main(rank, conn):
    import vmmt
    if os.environ.get("VMMT_DRIVER") == "emu":
        vmmt.select_driver("emu")
    consumer = vmmt.Consumer(timeout_ms=5000)
    who = f"rank {rank}"
    try:
        while True:
            try:
                msg = recv(conn, 60.0)
            except (EOFError, OSError):
                log(who, "processor gone while idle; exiting")
                return 0
            kind = msg[0]
            if kind == "stop":
                return 0
            if kind == "data":
                _, rid, nbytes, desc, fallback, mode = msg
                conn.send(handle(consumer, rank, rid, nbytes, desc, fallback, mode))
            elif kind == "hold":
                return hold(consumer, rank, conn, msg[1])
    finally:
        consumer.close()


def handle(consumer, rank, rid, nbytes, desc, fallback, mode):
    import vmmt
    if desc is None:                       # the fallback: the array came itself
        bad = same_bytes(fallback, rid, nbytes)
        return ("bad", rid, f"fallback: {bad}") if bad else ("ok", rid, "fallback")
    desc = vmmt.Descriptor(desc)
    if mode == "expect_stale":
        try:
            consumer.consume(desc, device=rank, ranks=rank)
        except vmmt.Stale as e:
            return ("ok", rid, f"Stale as documented ({str(e)[:60]}...)")
        return ("bad", rid, "a stale descriptor was accepted")
    if mode == "out":
        out = np.empty(desc.shape, dtype=desc.dtype)
        got = consumer.consume(desc, device=rank, out=out, ranks=rank)
    else:
        got = np.from_dlpack(consumer.consume(desc, device=rank, ranks=rank))
    bad = same_bytes(got, rid, nbytes)
    if bad:
        return ("bad", rid, bad)
    if mode == "twice":
        try:
            consumer.consume(desc, device=rank, ranks=rank)
            return ("bad", rid, "consumed twice without Stale")
        except vmmt.Stale:
            return ("ok", rid, "second consume: Stale")
    return ("ok", rid, "pool")


def hold(consumer, rank, conn, held):
    """Hold descriptors until the producer dies, then consume them."""
    import vmmt
    who = f"rank {rank}"
    conn.send(("holding", len(held)))
    try:
        while not conn.poll(60.0):
            log(who, "producer still alive after 60 s")
            return 4
        conn.recv()
        log(who, "unexpected message while holding")
        return 5
    except (EOFError, OSError):
        pass
    gone = delivered = 0
    for rid, nbytes, desc in held:
        try:
            buf = consumer.consume(vmmt.Descriptor(desc), device=rank, ranks=rank)
        except vmmt.ProducerGone:
            gone += 1
            continue
        buf.synchronize()
        try:
            consumer.check(desc)
        except vmmt.ProducerGone:
            gone += 1
            continue
        bad = same_bytes(np.from_dlpack(buf), rid, nbytes)
        if bad:
            log(who, f"request {rid} after the producer's death: {bad}")
            return 6
        delivered += 1
        time.sleep(0.1)  # give the consumer's watch time to see the death
    log(who, f"producer dead: {gone} ProducerGone, {delivered} complete and checked")
    return 0 if gone > 0 else 7


def rank_entry(rank, conn):
    sys.exit(rank_main(rank, conn))


# ----------------------------------------------------------- processor side

class Processor:
    def __init__(self, ctx, pool):
        self.ctx, self.pool = ctx, pool
        self.procs, self.conns = [None] * RANKS, [None] * RANKS
        self.counts = {"pool": 0, "fallback": 0, "stale": 0, "restarts": 0}
        for r in range(RANKS):
            self.start_rank(r)

    def start_rank(self, r):
        ours, theirs = self.ctx.Pipe()
        p = self.ctx.Process(target=rank_entry, args=(r, theirs), name=f"rank{r}")
        p.start()
        theirs.close()
        self.procs[r], self.conns[r] = p, ours

    def send_all(self, msg, ranks=range(RANKS)):
        for r in ranks:
            self.conns[r].send(msg)

    def answers(self, rids, ranks=range(RANKS)):
        """Wait for each rank's answer to each request; raise on a bad one."""
        for r in ranks:
            for rid in rids:
                ans = recv(self.conns[r])
                if ans[0] != "ok" or ans[1] != rid:
                    raise RuntimeError(f"rank {r}, request {rid}: {ans}")
                self.tally(ans[2])

    def tally(self, note):
        key = {"pool": "pool", "fallback": "fallback"}.get(note, "stale")
        self.counts[key] += 1

    def publish_or_fallback(self, rid, nbytes):
        import vmmt
        arr = payload(rid, nbytes)
        try:
            return self.pool.publish(arr), None, None
        except vmmt.NoRoom as e:             # PoolFull or TooLarge: send the array
            return None, arr, e


def phase_full(proc):
    """(1) Publish without anyone consuming until the pool is full."""
    import vmmt
    held, rid, fallback_at = [], 1000, None
    while fallback_at is None:
        desc, arr, err = proc.publish_or_fallback(rid, REQUEST_BYTES)
        if err is not None:
            if not isinstance(err, vmmt.PoolFull):
                raise RuntimeError(f"expected PoolFull, got {err!r}")
            fallback_at = rid
        held.append((rid, desc, arr))
        rid += 1
        if rid > 1000 + 4096:
            raise RuntimeError("the pool never filled")
    for i, (rid, desc, arr) in enumerate(held):
        proc.send_all(("data", rid, REQUEST_BYTES, desc, arr, "out" if i % 2 else "buf"))
    proc.answers([h[0] for h in held])
    log("processor", f"(1) full pool: {len(held) - 1} published, request {fallback_at} "
        f"PoolFull (status {vmmt.EFULL}) -> sent itself; ranks checked all bytes")


def phase_too_large(proc):
    """(2) An array the pool can never hold."""
    import vmmt
    nbytes = proc.pool.data_bytes + 16
    desc, arr, err = proc.publish_or_fallback(2000, nbytes)
    if not isinstance(err, vmmt.TooLarge):
        raise RuntimeError(f"expected TooLarge, got {err!r}")
    proc.send_all(("data", 2000, nbytes, None, arr, "buf"))
    proc.answers([2000])
    log("processor", f"(2) oversized: {nbytes} bytes > data_bytes {proc.pool.data_bytes}: "
        "TooLarge -> sent itself; checked")


def phase_closed():
    """(3) Publish into a pool after close."""
    import vmmt
    scratch = vmmt.Pool(device=0, memory_size=POOL_BYTES, consumer_count=RANKS, round_up=True)
    scratch.close()
    try:
        scratch.publish(payload(3000, 64))
    except vmmt.Closed as e:
        log("processor", f"(3) publish after close: Closed (status {e.status}): {str(e)[:70]}")
        return
    raise RuntimeError("publish after close was accepted")


def phase_stale(proc):
    """(4) Consumed twice; cancelled before it was sent."""
    desc, _, _ = proc.publish_or_fallback(4000, 4096)
    proc.send_all(("data", 4000, 4096, desc, None, "twice"))
    proc.answers([4000])
    desc, _, _ = proc.publish_or_fallback(4001, 4096)
    proc.pool.cancel(desc)
    proc.send_all(("data", 4001, 4096, desc, None, "expect_stale"))
    proc.answers([4001])
    log("processor", "(4) stale: second consume and a cancelled descriptor both Stale")


def phase_dead_rank(proc):
    """(5) SIGKILL rank 1 mid-way; restart it with the documented recipe."""
    rid, done, old_desc = 5000, 0, None
    while done < PHASE5_REQUESTS:
        if done == KILL_AT and proc.counts["restarts"] == 0:
            os.kill(proc.procs[1].pid, signal.SIGKILL)
            log("processor", f"(5) SIGKILLed rank 1 (pid {proc.procs[1].pid}) at request {done}")
        desc, arr, _ = proc.publish_or_fallback(rid, REQUEST_BYTES)
        proc.send_all_safe(("data", rid, REQUEST_BYTES, desc, arr, "buf"))
        dead = proc.collect(rid)
        if not dead:
            rid, done = rid + 1, done + 1
            continue
        # The documented recipe (python/README.md, "Deaths").
        found = set(proc.pool.poll_deaths())
        dead |= found | {r for r, p in enumerate(proc.procs) if p.exitcode is not None}
        for r in sorted(dead):
            proc.procs[r].kill()
            proc.procs[r].join(WAIT_S)
            if proc.procs[r].exitcode is None:
                raise RuntimeError(f"rank {r} did not die")
            proc.pool.release_rank(r)
            proc.conns[r].close()
            proc.start_rank(r)
            proc.counts["restarts"] += 1
        log("processor", f"(5) dead {sorted(dead)} (poll_deaths said {sorted(found)}); "
            "released and restarted")
        old_desc = desc
        # Its old descriptor must now be refused.
        if old_desc is not None:
            proc.send_all(("data", rid, REQUEST_BYTES, old_desc, None, "expect_stale"), [1])
            proc.answers([rid], [1])
        # The unanswered request, published again for every rank.
        rid += 1
    log("processor", f"(5) {PHASE5_REQUESTS} requests through a rank death; "
        f"old descriptor Stale after release_rank")


def send_all_safe(self, msg):
    for r in range(RANKS):
        try:
            self.conns[r].send(msg)
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass


def collect(self, rid):
    """Each rank's answer to rid; the ranks that did not answer (dead)."""
    dead = set()
    for r in range(RANKS):
        try:
            ans = recv(self.conns[r], 5.0)
        except (EOFError, OSError, TimeoutError):
            dead.add(r)
            continue
        if ans[0] != "ok" or ans[1] != rid:
            raise RuntimeError(f"rank {r}, request {rid}: {ans}")
        self.tally(ans[2])
    return dead


Processor.send_all_safe = send_all_safe
Processor.collect = collect


def phase_hold(proc, launcher):
    """(6) Hand the ranks descriptors, then let the launcher kill us."""
    held = []
    for i in range(HOLD_COUNT):
        rid = 6000 + i
        desc, _, _ = proc.publish_or_fallback(rid, 4096)
        if desc is None:
            raise RuntimeError("pool unexpectedly full before phase 6")
        held.append((rid, 4096, bytes(desc)))
    proc.send_all(("hold", held))
    for r in range(RANKS):
        ans = recv(proc.conns[r])
        if ans != ("holding", HOLD_COUNT):
            raise RuntimeError(f"rank {r}: {ans}")
    launcher.send(("kill me", [p.pid for p in proc.procs]))
    log("processor", f"(6) {HOLD_COUNT} descriptors held by each rank; waiting to be killed")
    time.sleep(60)
    return 1


def processor_entry(launcher):
    import vmmt
    if os.environ.get("VMMT_DRIVER") == "emu":
        vmmt.select_driver("emu")
    ctx = mp.get_context("spawn")
    pool = vmmt.Pool(device=0, memory_size=POOL_BYTES, consumer_count=RANKS, round_up=True,
                     timeout_ms=5000)
    log("processor", f"{vmmt.driver_name()} driver, {vmmt.device_count()} devices, {pool!r}")
    proc = Processor(ctx, pool)
    try:
        phase_full(proc)
        phase_too_large(proc)
        phase_closed()
        phase_stale(proc)
        phase_dead_rank(proc)
        later = pool.poll_deaths()
        if later:
            raise RuntimeError(f"poll_deaths reported {later} after release_rank")
        st = pool.stats()
        log("processor", f"answers: {proc.counts}; stats full={st['full']} "
            f"rank_releases={st['rank_releases']} in_flight={st['in_flight']}")
        sys.exit(phase_hold(proc, launcher))
    except BaseException as e:
        if not isinstance(e, SystemExit):
            log("processor", f"FAILED: {e!r}")
            launcher.send(("failed", repr(e)))
            for p in proc.procs:
                p.kill()
        raise


# ------------------------------------------------------------------ launcher

def reap(pids, deadline):
    """Wait (bounded) for orphaned ranks, which this subreaper inherits."""
    codes = {}
    while len(codes) < len(pids) and time.monotonic() < deadline:
        for pid in pids:
            if pid in codes:
                continue
            try:
                got, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                codes[pid] = "not our child"
                continue
            if got:
                codes[pid] = os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    return codes


def main():
    os.environ.setdefault("VMMT_DRIVER", "emu")
    # Orphans (the ranks, once the processor is killed) come to us.
    PR_SET_CHILD_SUBREAPER = 36
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print("prctl(PR_SET_CHILD_SUBREAPER) failed", file=sys.stderr)
        return 2
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    processor = ctx.Process(target=processor_entry, args=(theirs,), name="processor")
    processor.start()
    theirs.close()
    try:
        msg = recv(ours, 120.0)
    except (EOFError, TimeoutError) as e:
        processor.kill()
        processor.join(WAIT_S)
        log("launcher", f"FAILED: processor said nothing ({e!r}), exit {processor.exitcode}")
        return 1
    if msg[0] != "kill me":
        processor.join(WAIT_S)
        log("launcher", f"FAILED: {msg}")
        return 1
    rank_pids = msg[1]
    os.kill(processor.pid, signal.SIGKILL)
    processor.join(WAIT_S)
    log("launcher", f"(6) SIGKILLed the processor (pid {processor.pid}, exit "
        f"{processor.exitcode}); waiting for ranks {rank_pids}")
    codes = reap(rank_pids, time.monotonic() + 60.0)
    for pid in rank_pids:
        if pid not in codes:
            os.kill(pid, signal.SIGKILL)
            codes[pid] = "hung, killed"
    ok = all(c == 0 for c in codes.values())
    log("launcher", f"ranks' exit codes {codes}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
