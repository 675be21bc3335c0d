#!/usr/bin/env python3
"""The producer side of the outsider test: the real library (the vmmt Python
binding) publishes buffers of known contents; client.py processes, started
here without the binding on their path, consume them. Prints one JSON line.

usage: producer.py SCENARIO BUFFERS SEED
"""

import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

vmmt = None  # imported in main, after the scenario's emulator settings

HERE = os.path.dirname(os.path.abspath(__file__))

DTYPES = [np.uint8, np.int8, np.int16, np.uint16, np.int32, np.float32, np.float64,
          np.int64, np.float16, np.bool_]

SCENARIOS = {
    # pool kwargs, consumer processes as (first rank, count, device), packed share
    "fixed-host-table": dict(pool=dict(memory_size=4 << 20, consumer_count=2),
                             consumers=[(0, 1, 0), (1, 1, 1)], packed=0.3, pending=0.1),
    "fixed-host-table-path": dict(pool=dict(memory_size=4 << 20, consumer_count=1,
                                            broker_path="@TMP@/broker.sock"),
                                  consumers=[(0, 1, 0)], packed=0.3, pending=0.1,
                                  kill_one=True),
    "fixed-device-table": dict(pool=dict(memory_size=4 << 20, consumer_count=2,
                                         device_control_table=True),
                               consumers=[(0, 1, 1), (1, 1, 0)], packed=0.3,
                               pending=0.1),
    "elastic": dict(pool=dict(memory_size=64 << 20, consumer_count=2, elastic=True,
                              idle_release_ms=20),
                    consumers=[(0, 2, 0)], packed=0.3, big=True, pending=0.1),
    "host": dict(pool=dict(memory_size=4 << 20, consumer_count=2,
                           memory_location="host"),
                 consumers=[(0, 1, 0), (1, 1, 1)], packed=0.3),
    "fabric": dict(pool=dict(memory_size=4 << 20, consumer_count=1, handle_type="fabric",
                             allow_posix_fallback=False),
                   consumers=[(0, 1, 0)], packed=0.3, pending=0.1,
                   env=dict(VMMT_EMU_HANDLES="posix_fd,fabric")),
}


def expected_bytes(seed, n):
    return hashlib.shake_256(seed.encode()).digest(n)


def make_array(rng, seed, big):
    dt = np.dtype(rng.choice(DTYPES))
    kind = rng.random()
    if big and kind < 0.25:
        n = rng.randint(1 << 20, 12 << 20) // dt.itemsize  # spans elastic chunks
    elif kind < 0.1:
        n = rng.randint(1, 3)
    elif kind < 0.7:
        n = rng.randint(1, 5000)
    else:
        n = rng.randint(5000, 300_000 // dt.itemsize)
    if rng.random() < 0.4 and n >= 6 and n % 2 == 0:
        shape = (2, n // 2)
    else:
        shape = (n,)
    nbytes = n * dt.itemsize
    raw = expected_bytes(seed, nbytes)
    if dt == np.bool_:
        # bool arrays must hold 0/1; the expected bytes follow the values
        raw = bytes(b & 1 for b in raw)
    a = np.frombuffer(raw, dtype=dt).reshape(shape).copy()
    return a, raw


class ClientProc:
    on_seen = None

    def __init__(self, first, count, device, env):
        self.first, self.count, self.device = first, count, device
        self.p = subprocess.Popen([sys.executable, os.path.join(HERE, "client.py")],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.results = []
        self.lock = threading.Lock()
        self.final = None
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self):
        for line in self.p.stdout:
            r = json.loads(line)
            if "seen" in r:
                ClientProc.on_seen(r["seen"])
                continue
            with self.lock:
                if "stats" in r:
                    self.final = r
                else:
                    self.results.append(r)

    def send(self, req, raw=None):
        self.p.stdin.write((json.dumps(req) + "\n").encode())
        if raw is not None:
            assert len(raw) == 512
            self.p.stdin.write(bytes(raw))
        self.p.stdin.flush()


class Gate:
    """A stream of the producer's held shut by a wait on a pinned host word, so
    that a publish on it leaves its slot PENDING until the gate opens: the
    consumer then meets a PENDING word and must wait as the docs prescribe.
    Uses the very emulator instance the binding loaded (same file, one dlopen)."""

    def __init__(self):
        import ctypes
        self.ct = ctypes
        lib = ctypes.CDLL(os.path.join(os.path.dirname(vmmt.__file__), "libvmmt_emu.so"))
        self.lib = lib
        assert lib.cuInit(0) == 0
        self.ctx = ctypes.c_void_p()
        assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), 0) == 0
        assert lib.cuCtxPushCurrent(self.ctx) == 0
        self.stream = ctypes.c_void_p()
        assert lib.cuStreamCreate(ctypes.byref(self.stream), 1) == 0
        self.word = self._pinned(4096)
        ctypes.memset(self.word, 0, 4096)
        self.token = 0
        self.blocks = []
        self.lock = threading.Lock()
        self.timers = []

    def _pinned(self, n):
        p = self.ct.c_void_p()
        assert self.lib.cuMemAllocHost(self.ct.byref(p), self.ct.c_size_t(max(n, 1))) == 0
        return p.value

    def pinned_copy(self, a):
        """The array's bytes in page-locked memory: published stream-ordered."""
        p = self._pinned(a.nbytes)
        self.blocks.append(p)
        buf = (self.ct.c_uint8 * max(a.nbytes, 1)).from_address(p)
        out = np.frombuffer(buf, dtype=np.uint8, count=a.nbytes).view(a.dtype).reshape(a.shape)
        out[...] = a
        return out

    def close_gate(self):
        self.token += 1
        assert self.token < 1024
        # wait(word[token] >= 1) on the publishing stream: one word per gate, so
        # opening one (a publish that found the pool full) opens no other
        rc = self.lib.cuStreamWaitValue32(self.stream,
                                          self.ct.c_uint64(self.word + 4 * self.token),
                                          self.ct.c_uint32(1), 0)
        assert rc == 0, rc
        return self.token

    def open_later(self, token, delay):
        def op():
            self.ct.c_uint32.from_address(self.word + 4 * token).value = 1
        t = threading.Timer(delay, op)
        t.start()
        self.timers.append(t)

    def finish(self):
        for t in self.timers:
            t.join()
        assert self.lib.cuStreamSynchronize(self.stream) == 0
        for p in self.blocks:
            self.lib.cuMemFreeHost(self.ct.c_void_p(p))
        self.blocks.clear()


def forge(raw, rng):
    """A copy with one bit flipped in a field a consumer would act on."""
    b = bytearray(raw)
    off = rng.choice([288, 264, 268, 296, 304, 224, 232])  # offset, slot, gen, ...
    b[off] ^= 1 << rng.randint(0, 7)
    return bytes(b)


def dead_consumer(pool, env, name, seed, rng):
    """The liveness link: a client that consumed once (so it sent HOLD for rank
    0) is killed while 3 slices wait for it; the pool must release them."""
    import signal
    c = ClientProc(0, 1, 0, env)
    s = f"{name}/{seed}/death"
    a, raw = make_array(rng, s, False)
    d = pool.publish(a)
    c.send(dict(op="consume", id=s, first=0, count=1, device=0, seed=s, nbytes=len(raw),
                low_bit=a.dtype == np.bool_), d)
    deadline = time.monotonic() + 10
    while not c.results and time.monotonic() < deadline:
        time.sleep(0.005)
    first_ok = bool(c.results and c.results[0].get("ok"))
    for j in range(3):
        pool.publish(np.arange(100 + j, dtype=np.int32))
    before = pool.stats()
    c.p.send_signal(signal.SIGKILL)
    c.p.wait(timeout=10)
    deadline = time.monotonic() + 10
    while True:
        pool.reclaim()
        st = pool.stats()
        if (st["in_flight"] == 0 and st["rank_releases"] > before["rank_releases"]) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.005)
    return dict(extra_slices=4, first_consume_ok=first_ok, in_flight_before_kill=before["in_flight"],
                in_flight_after=st["in_flight"], rank_releases=st["rank_releases"],
                released_slices=st["released_slices"], dead_ranks=pool.poll_deaths())


def main():
    global vmmt
    name, nbuf, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    sc = SCENARIOS[name]
    os.environ.update(sc.get("env", {}))
    import vmmt as _v
    vmmt = _v
    rng = random.Random(seed)
    tmp = tempfile.mkdtemp(prefix="vmmt-outsider-")
    os.chmod(tmp, 0o700)
    kw = dict(sc["pool"])
    if "broker_path" in kw:
        kw["broker_path"] = kw["broker_path"].replace("@TMP@", tmp)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VMMT_DRIVER")}
    pool = vmmt.Pool(**kw)
    gate = Gate() if sc.get("pending") else None
    seen = {}
    gate_of = {}  # id of a gated slice's first member -> its gate token
    seen_lock = threading.Lock()

    def on_seen(bid):
        with seen_lock:
            seen[bid] = seen.get(bid, 0) + 1
            if seen[bid] == len(sc["consumers"]) and bid in gate_of:
                gate.open_later(gate_of[bid], 0.02)
    ClientProc.on_seen = on_seen
    clients = [ClientProc(f, c, dv, env) for (f, c, dv) in sc["consumers"]]
    sent = 0  # buffers handed to every consumer process
    published = 0
    full_waits = 0
    groups = 0
    pending_slices = 0
    forged = 0
    max_links = 0
    refusals_expected = []  # (id, wanted status)
    t0 = time.monotonic()
    i = 0
    first_desc = None
    while i < nbuf:
        k = 1
        if rng.random() < sc["packed"]:
            k = min(rng.randint(2, 6), nbuf - i)
        gated = gate is not None and rng.random() < sc.get("pending", 0)
        arrays, raws, seeds = [], [], []
        for j in range(k):
            s = f"{name}/{seed}/{i + j}"
            a, raw = make_array(rng, s, sc.get("big", False))
            is_bool = a.dtype == np.bool_
            if gated and is_bool:
                a = a.view(np.uint8)  # NumPy 1.24 exports no bool through DLPack
            if gated:
                a = gate.pinned_copy(a)
            arrays.append(a)
            raws.append((raw, is_bool))
            seeds.append(s)
        deadline = time.monotonic() + 20
        while True:
            try:
                token = gate.close_gate() if gated else None
                stream = gate.stream.value if gated else None
                if k > 1:
                    descs = pool.publish_many(arrays, stream=stream)
                else:
                    descs = [pool.publish(arrays[0], stream=stream)]
                break
            except vmmt.PoolFull:
                if gated:
                    gate.open_later(token, 0)  # let the stream move on
                full_waits += 1
                if time.monotonic() > deadline:
                    raise
                pool.reclaim()
                time.sleep(0.001)
        if gated:
            pending_slices += 1
            with seen_lock:
                gate_of[seeds[0]] = token
        if k > 1:
            groups += 1
        published += 1
        if published % 8 == 0:
            max_links = max(max_links, pool.stats()["consumer_links"])
        for d, (raw, is_bool), s in zip(descs, raws, seeds):
            if first_desc is None:
                first_desc = (bytes(d), s)
            for c in clients:
                if sent % 17 == 3:  # a forged copy first: refused, nothing written
                    fid = s + "/forged"
                    c.send(dict(op="consume", id=fid, first=c.first, count=c.count,
                                device=c.device, seed=s, nbytes=len(raw)), forge(d, rng))
                    refusals_expected.append((fid, -11))
                    forged += 1
                c.send(dict(op="consume", id=s, first=c.first, count=c.count,
                            device=c.device, seed=s, nbytes=len(raw), low_bit=is_bool,
                            announce=gated and s == seeds[0]), d)
            sent += 1
        i += k
    # a replay of the first descriptor: consumed already, refused
    for c in clients:
        fid = first_desc[1] + "/replay"
        c.send(dict(op="consume", id=fid, first=c.first, count=c.count, device=c.device,
                    seed=first_desc[1], nbytes=0), first_desc[0])
        refusals_expected.append((fid, -14))
    for c in clients:
        c.send(dict(op="end"))
    for c in clients:
        c.p.stdin.close()
        c.p.wait(timeout=120)
        c.t.join(timeout=10)
    if gate is not None:
        gate.finish()
    death = None
    if sc.get("kill_one"):
        death = dead_consumer(pool, env, name, seed, rng)
    # every slice must come back: the recycler sees the outsiders' acks
    deadline = time.monotonic() + 10
    while True:
        pool.reclaim()
        st = pool.stats()
        if st["in_flight"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.005)
    all_results = [r for c in clients for r in c.results]
    want_refused = dict(refusals_expected)
    results = [r for r in all_results if r["id"] not in want_refused]
    refusals = [r for r in all_results if r["id"] in want_refused]
    refusals_ok = sum(1 for r in refusals if not r.get("ok")
                      and r.get("status") == want_refused[r["id"]])
    verified = sum(1 for r in results if r.get("ok") and "verified" in r)
    waited = sum(1 for r in results if r.get("waited"))
    failures = [r for r in results if not r.get("ok")]
    failures += [r for r in refusals if r.get("ok") or r.get("status") != want_refused[r["id"]]]
    # a buffer counts as verified when every consumer process verified it
    per_buffer = {}
    for r in results:
        per_buffer.setdefault(r["id"], []).append(bool(r.get("ok")))
    buffers_ok = sum(1 for v in per_buffer.values() if len(v) == len(clients) and all(v))
    summary = dict(scenario=name, buffers=sent, buffers_verified=buffers_ok,
                   consumes=len(results), consumes_verified=verified,
                   refusals_expected=len(refusals), refusals_ok=refusals_ok,
                   consumer_processes=len(clients), slices=published, packed_groups=groups,
                   pending_slices=pending_slices, consumes_that_waited=waited,
                   full_waits=full_waits,
                   in_flight=st["in_flight"],
                   published=st["published"], recycled=st["recycled"],
                   chunks_made=st["chunks_made"], chunks_released=st["chunks_released"],
                   host_control_table=st["host_control_table"],
                   handle_type=st["handle_type"], memory_location=st["memory_location"],
                   handoff=st["handoff"], consumer_links_seen=max_links,
                   consumer_links_end=st["consumer_links"],
                   client_stats=[c.final and c.final["stats"] for c in clients],
                   client_rc=[c.p.returncode for c in clients],
                   death=death,
                   seconds=round(time.monotonic() - t0, 2),
                   failures=failures[:10], failure_count=len(failures))
    pool.close()
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
