#!/usr/bin/env python3
"""An independent consumer of vmmt descriptors, written from docs/descriptor.md,
docs/broker.md and docs/design.md alone (no vmmt code): it decodes and checks
the 512-byte record, fetches the pool's fds from the producer's broker,
imports and maps the pool on an emulated (or real) CUDA driver, waits for the
ready word, copies the bytes out and acknowledges them in the control table.

As a program it reads requests on stdin (one JSON line, then for "consume"
512 raw descriptor bytes) and answers one JSON line each on stdout.
"""

import ctypes
import json
import os
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import broker_client as bc  # noqa: E402
import cudrv  # noqa: E402
from desc import (ECLOSED, EINVAL, EPROTO, ESTATE, ETIMEDOUT, F_HOST_TABLE,  # noqa: E402
                  F_STREAM_ORDERED, F_TOKEN, HT_FABRIC, HT_POSIX_FD, Refused,
                  check_pool_record, check_same_pool, check_seal, decode)

F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW = 1, 2, 4
F_GET_SEALS = 1034
PAGE = os.sysconf("SC_PAGESIZE")
M32 = 0xFFFFFFFF


def log(*a):
    if os.environ.get("OUTSIDER_DEBUG"):
        print("[client %d]" % os.getpid(), *a, file=sys.stderr, flush=True)


def host_table_size(d):
    rows = d.table_slots * d.slot_stride
    words = 4 * (d.alloc_size // d.chunk_size) if d.chunk_size else 0
    n = 64 + rows + words
    return (n + PAGE - 1) // PAGE * PAGE


class Import:
    """One imported pool, on one device of this process."""

    def __init__(self, client, d, dev):
        self.c = client
        self.drv = client.drv
        self.dev = dev
        self.first = d
        self.host_table = bool(d.flags & F_HOST_TABLE)
        self.elastic = d.chunk_size != 0
        self.link = None
        self.held = set()  # ranks announced with HOLD on the link
        self.table = None  # host address of the memfd mapping (host tables)
        self.table_size = 0
        self.table_dev = None  # device pointer of the registered memfd
        self.base = None
        self.handle = None
        self.chunks = {}  # elastic: k -> (handle, incarnation mapped)
        self.groups = {}  # (slot, generation) -> state of a packed group
        self.key = None
        fds = []
        try:
            self._import(d, fds)
        except BaseException:
            for fd in fds:
                os.close(fd)
            self.teardown()
            raise

    # ---- import ("Importing the pool", steps 1-6)
    def _import(self, d, fds):
        drv = self.drv
        if d.handle_type == HT_POSIX_FD:
            n = 1 if (self.elastic or not self.host_table) else 2
            got, self.link = bc.fetch_fds(d, d.pool_id, n, hold=True,
                                          timeout_ms=self.c.timeout_ms)
            fds.extend(got)
        gran = drv.granularity(self.dev, d.handle_type)
        self.reserved = (d.alloc_size + gran - 1) // gran * gran
        if self.elastic:
            if d.chunk_size % gran:
                raise Refused(EPROTO, "chunk_size is not a multiple of the granularity")
            table_fd = fds[0]
        else:
            if d.handle_type == HT_FABRIC:
                self.handle = drv.import_fabric(d.fabric)
            else:
                self.handle = drv.import_fd(fds[0])
            table_fd = fds[1] if self.host_table else None
        if self.host_table:
            self._attach_table(table_fd, d)
        for fd in fds:
            os.close(fd)
        fds.clear()
        self.base = drv.reserve(self.reserved)
        if not self.elastic:
            drv.map(self.base, d.alloc_size, self.handle)
            self.mapped = d.alloc_size
            drv.set_access_rw(self.base, d.alloc_size, self.dev)
        if not self.host_table:
            rec = self._dtoh(self.base, 64)
            self.key = check_pool_record(rec, d)

    def _attach_table(self, fd, d):
        st = os.fstat(fd)
        import stat as _st
        if not _st.S_ISREG(st.st_mode):
            raise Refused(EPROTO, "control table is not a regular file")
        want = host_table_size(d)
        if st.st_size != want:
            raise Refused(EPROTO, f"control table is {st.st_size} bytes, not {want}")
        import fcntl
        seals = fcntl.fcntl(fd, F_GET_SEALS)
        need = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL
        if seals & need != need:
            raise Refused(EPROTO, f"control table seals {seals:#x} lack {need:#x}")
        rec = os.pread(fd, 64, 0)
        self.key = check_pool_record(rec, d)
        self.table = cudrv.mmap_shared(fd, want)
        self.table_size = want

    def _dtoh(self, src, n):
        buf = ctypes.create_string_buffer(max(n, 1))
        self.c.with_ctx(self.dev, lambda s: (self.drv.dtoh_async(ctypes.addressof(buf), src,
                                                                 n, s), self.drv.sync(s)))
        return buf.raw[:n]

    # ---- the table's words
    def word_addr(self, slot, i):
        """Host address (host table) or device address (device table) of word i
        (0 ready, 1 + r ack[r]) of a slot."""
        off = self.first.table_offset + slot * self.first.slot_stride + 4 * i
        return (self.table if self.host_table else self.base) + off

    def inc_addr(self, k):
        d = self.first
        return self.table + 64 + d.table_slots * d.slot_stride + 4 * k

    def read_row(self, d):
        n = 1 + self.first.consumer_count
        if self.host_table:
            return [cudrv.load32(self.word_addr(d.slot, i)) for i in range(n)]
        raw = self._dtoh(self.word_addr(d.slot, 0), 4 * n)
        return list(struct.unpack("<%dI" % n, raw))

    def hold(self, first, count):
        new = [r for r in range(first, first + count) if r not in self.held]
        if not new or self.link is None:
            return
        bc.link_send(self.link, bc.LINK_HOLD, first, count)
        self.held.update(range(first, first + count))

    # ---- elastic chunks ("What a reader must verify", step 2)
    def check_chunks(self, d):
        cs = d.chunk_size
        last = (d.offset + max(d.nbytes, 1) - 1) // cs
        if (d.offset + max(d.nbytes, 1) - 1) >= d.alloc_size:
            raise Refused(EPROTO, "buffer ends past the last chunk")
        if last > d.offset // cs:
            self.c.stats["multi_chunk"] += 1
        for k in range(d.offset // cs, last + 1):
            w = cudrv.load32(self.inc_addr(k))
            if w == 0 or (k == d.chunk and w != d.incarnation):
                raise Refused(ESTATE, f"chunk {k} is stale (word {w}, descriptor "
                              f"{d.incarnation if k == d.chunk else '-'})")
            have = self.chunks.get(k)
            if have is not None and have[1] == w:
                continue
            if have is not None:
                self._unmap_chunk(k)
            self._map_chunk(d, k, w)
            w2 = cudrv.load32(self.inc_addr(k))
            if w2 != w:
                # the fd may be another making: keep it, matching no word
                self.chunks[k] = (self.chunks[k][0], None)
                raise Refused(ESTATE, f"chunk {k} was made again during its import")

    def _map_chunk(self, d, k, w):
        fds, _ = bc.fetch_fds(d, bc.chunk_id(d.pool_id, k), 1, hold=False,
                              timeout_ms=self.c.timeout_ms)
        try:
            h = self.drv.import_fd(fds[0])
        finally:
            os.close(fds[0])
        addr = self.base + k * d.chunk_size
        try:
            self.drv.map(addr, d.chunk_size, h)
            self.drv.set_access_rw(addr, d.chunk_size, self.dev)
        except BaseException:
            self.drv.release(h)
            raise
        self.chunks[k] = (h, w)
        self.c.stats["chunk_imports"] += 1

    def _unmap_chunk(self, k):
        h, _ = self.chunks.pop(k)
        self.drv.unmap(self.base + k * self.first.chunk_size, self.first.chunk_size)
        self.drv.release(h)

    def drop_stale_chunks(self):
        # step 4 of "Elastic pools: chunks": let go of chunks whose word moved on
        for k in list(self.chunks):
            if cudrv.load32(self.inc_addr(k)) != self.chunks[k][1]:
                self._unmap_chunk(k)
                self.c.stats["chunk_unmaps"] += 1

    def teardown(self):
        try:
            if self.link is not None:
                try:
                    bc.link_send(self.link, bc.LINK_BYE, 0, 0)
                except OSError:
                    pass
                self.link.close()
                self.link = None
            for k in list(self.chunks):
                self._unmap_chunk(k)
            if self.base is not None:
                if self.handle is not None and getattr(self, "mapped", 0):
                    self.drv.unmap(self.base, self.mapped)
                self.drv.free_range(self.base, self.reserved)
                self.base = None
            if self.handle is not None:
                self.drv.release(self.handle)
                self.handle = None
            if self.table is not None:
                cudrv.munmap(self.table, self.table_size)
                self.table = None
        except Exception as e:  # noqa: BLE001
            log("teardown:", e)


class Client:
    def __init__(self, driver_path, timeout_ms=5000):
        self.drv = cudrv.Driver(driver_path)
        self.timeout_ms = timeout_ms
        self.imports = {}  # (pool_id, dev) -> Import
        self.ctx = {}
        self.streams = {}
        self.stats = dict(chunk_imports=0, chunk_unmaps=0, waits=0, imports=0, multi_chunk=0)

    def with_ctx(self, dev, fn):
        if dev not in self.ctx:
            self.ctx[dev] = self.drv.primary_ctx(self.drv.device(dev))
        self.drv.push(self.ctx[dev])
        try:
            if dev not in self.streams:
                self.streams[dev] = self.drv.stream()
            return fn(self.streams[dev])
        finally:
            self.drv.pop()

    def _import_for(self, d, dev):
        key = (d.pool_id, dev)
        imp = self.imports.get(key)
        if imp is not None:
            return imp, False
        imp = Import(self, d, dev)
        try:
            check_seal(d, imp.key)  # the first descriptor, right after the import
        except Refused:
            imp.teardown()
            raise
        self.imports[key] = imp
        self.stats["imports"] += 1
        return imp, True

    def consume(self, raw, first_rank, count, dev=0, drop=False):
        """Copies the buffer out (returns bytes) or, with drop, acknowledges only."""
        d = decode(raw)
        if d.flags & F_TOKEN:
            raise Refused(EINVAL, "a reservation token is not consumed")
        if count < 1 or first_rank < 0 or first_rank + count > d.consumer_count:
            raise Refused(EINVAL, "ranks out of range")
        imp, fresh = self._import_for(d, dev)
        if not fresh:
            check_seal(d, imp.key)
            check_same_pool(d, imp.first)
        ranks = list(range(first_rank, first_rank + count))
        imp.hold(first_rank, count)
        if imp.elastic:
            imp.drop_stale_chunks()
            if not drop:
                imp.check_chunks(d)
        g = d.generation
        gkey = (d.slot, g)
        grp = imp.groups.get(gkey)
        if grp is not None and grp["ranks"] != (first_rank, count):
            raise Refused(EINVAL, "a packed group's members go to one rank range")
        if grp is not None and d.pack_index in grp["done"]:
            raise Refused(ESTATE, "member consumed already")
        row = imp.read_row(d)
        v = row[0]
        pending = False
        if v == g:
            pass
        elif v == (g - 1) & M32 and (d.flags & F_STREAM_ORDERED):
            pending = True
        elif v == (g - 1) & M32:
            raise Refused(ESTATE, "PENDING on a synchronous descriptor")
        elif v == (g + 2) & M32:
            raise Refused(ECLOSED, "ABANDONED: the producer died")
        else:
            raise Refused(ESTATE, f"slot {d.slot} holds no live occupant {g} (word {v})")
        mine = grp is not None and grp["taken"]
        for r in ranks:
            a = row[1 + r]
            if a == g:
                raise Refused(ESTATE, f"rank {r} acknowledged {g} already")
            if imp.host_table and a == (g - 1) & M32 and not mine:
                raise Refused(ESTATE, f"rank {r} is being consumed by another process")
        taken = []
        if imp.host_table and not mine:
            try:
                for r in ranks:
                    self._take(imp, d, r, row[1 + r])
                    taken.append(r)
            except Refused:
                self._give_back(imp, d, taken)
                raise
        if grp is None:
            grp = dict(ranks=(first_rank, count), done=set(), taken=imp.host_table)
            if d.pack_count > 1:
                imp.groups[gkey] = grp
        try:
            data = None if drop else self._copy(imp, d, pending)
        except BaseException:
            if not grp["done"]:
                self._give_back(imp, d, ranks if imp.host_table else [])
                imp.groups.pop(gkey, None)
            raise
        grp["done"].add(d.pack_index)
        if len(grp["done"]) == d.pack_count:
            imp.groups.pop(gkey, None)
            self._ack(imp, d, ranks, row)
        return data

    def _take(self, imp, d, r, loaded):
        g = d.generation
        addr = imp.word_addr(d.slot, 1 + r)
        while True:
            v = cudrv.load32(imp.word_addr(d.slot, 0))
            if v not in (g, (g - 1) & M32):
                raise Refused(ESTATE, "occupant left while taking its words")
            old = cudrv.cas32(addr, loaded, (g - 1) & M32)
            if old == loaded:
                return
            if old in (g, (g - 1) & M32):
                raise Refused(ESTATE, f"rank {r} taken by another process")
            loaded = old

    def _give_back(self, imp, d, ranks):
        for r in ranks:
            cudrv.cas32(imp.word_addr(d.slot, 1 + r), (d.generation - 1) & M32, 0)

    def _copy(self, imp, d, pending):
        g = d.generation
        buf = ctypes.create_string_buffer(max(d.nbytes, 1))
        drv = self.drv

        def run(s):
            if pending:
                if imp.host_table:
                    v = cudrv.load32(imp.word_addr(d.slot, 0))
                    if v == g:
                        wait_addr = None
                    elif v == (g - 1) & M32:
                        if imp.table_dev is None:
                            imp.table_dev = drv.host_register(imp.table, imp.table_size)
                        wait_addr = imp.table_dev + (imp.word_addr(d.slot, 0) - imp.table)
                    else:
                        raise Refused(ESTATE, f"ready word moved to {v}")
                else:
                    wait_addr = imp.word_addr(d.slot, 0)
                if wait_addr is not None:
                    drv.wait_geq(s, wait_addr, g)
                    self.stats["waits"] += 1
            drv.dtoh_async(ctypes.addressof(buf), imp.base + d.offset, d.nbytes, s)
            try:
                drv.sync(s)
            except cudrv.CudaError as e:
                raise Refused(ETIMEDOUT, f"wait or copy failed: {e}") from e
        self.with_ctx(imp.dev, run)
        if pending:
            v = imp.read_row(d)[0]
            if v == (g + 2) & M32:
                raise Refused(ECLOSED, "ABANDONED after the wait")
        return buf.raw[:d.nbytes]

    def _ack(self, imp, d, ranks, row):
        g = d.generation
        if imp.host_table:
            ready = imp.word_addr(d.slot, 0)
            for r in ranks:
                addr = imp.word_addr(d.slot, 1 + r)
                for _ in range(1000):
                    w = cudrv.load32(addr)
                    if w == g:
                        break
                    if cudrv.load32(ready) != g:
                        log("ack gives up: ready moved on")
                        return
                    if cudrv.cas32(addr, w, g) == w:
                        break
            return
        todo = [r for r in ranks if row[1 + r] != g]

        def run(s):
            for r in todo:
                self.drv.write_value(s, imp.word_addr(d.slot, 1 + r), g)
            self.drv.sync(s)
        self.with_ctx(imp.dev, run)

    def close(self):
        for imp in self.imports.values():
            imp.teardown()
        self.imports.clear()


def expected_bytes(seed, n):
    import hashlib
    return hashlib.shake_256(seed.encode()).digest(n)


def main():
    drv = os.environ.get("OUTSIDER_DRIVER", "build/libvmmt_emu.so")
    cl = Client(drv, timeout_ms=int(os.environ.get("OUTSIDER_TIMEOUT_MS", "5000")))
    inp = sys.stdin.buffer
    out = sys.stdout
    while True:
        line = inp.readline()
        if not line:
            break
        req = json.loads(line)
        op = req["op"]
        if op == "end":
            out.write(json.dumps(dict(ok=True, stats=cl.stats)) + "\n")
            out.flush()
            break
        raw = inp.read(512)
        res = dict(id=req.get("id"))
        if req.get("announce"):  # the producer opens its gate once every reader is here
            out.write(json.dumps(dict(seen=req["id"])) + "\n")
            out.flush()
        waits = cl.stats["waits"]
        try:
            data = cl.consume(raw, req["first"], req["count"], req.get("device", 0),
                              drop=(op == "drop"))
            if op == "consume":
                want = expected_bytes(req["seed"], req["nbytes"])
                if req.get("low_bit"):  # bool buffers hold each byte's low bit
                    want = bytes(b & 1 for b in want)
                if data == want:
                    res.update(ok=True, verified=len(data), waited=cl.stats["waits"] > waits)
                else:
                    bad = next(i for i in range(min(len(data), len(want)))
                               if data[i] != want[i]) if len(data) == len(want) else -1
                    res.update(ok=False, error=f"bytes differ (first at {bad}, "
                               f"got {len(data)} want {len(want)})")
            else:
                res.update(ok=True)
        except Refused as e:
            res.update(ok=False, status=e.status, error=str(e))
        except Exception as e:  # noqa: BLE001
            res.update(ok=False, error=f"{type(e).__name__}: {e}")
        out.write(json.dumps(res) + "\n")
        out.flush()
    cl.close()


if __name__ == "__main__":
    main()
