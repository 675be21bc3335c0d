"""CudaVmmMemoryPool, sglang's producer pool, on one vmmt.Pool.

sglang's pool is a Python slice allocator over one exported allocation, a
POSIX fd broker thread and a recycler that polls acknowledgement words every
recycle_interval; here all three are the library's (slab, broker and
recycler in C). What stays in Python is sglang's face: the constructor's
checks and errors, the FABRIC-then-POSIX_FD choice, wrap_tensor's fallback to
the CPU when no slice fits, packed publishes, cancel, and a shutdown that
waits, boundedly, for publishers still inside a wrap.
"""
import logging
import os
import sys
import threading
import time

import numpy

import vmmt

from . import _sglang_arrays as arrays
from ._sglang_probe import HandleType, probe_device
from ._sglang_proxy import (CudaVmmPackedTensorTransportProxy, CudaVmmTensorTransportProxy,
                            _CudaVmmPackedTransportOwner)
from ._sglang_proxy import _flush_acknowledgements as flush_acknowledgements

logger = logging.getLogger("vmmt.sglang")

POOL_KINDS = ("device", "elastic", "host")
_MAX_PACK = 64  # members of one packed publish (the library's limit)
_RECYCLE_US = 1000  # the library's recycler period: never slower than this


class _CudaVmmMemoryChunk:
    """An in-flight slice, as sglang's tests look at them: `start` is the
    slice's control slot (its proxies' control_offset), `end` - `start` its
    size in bytes is not kept: vmmt's slab holds the real map."""

    __slots__ = ("start", "end", "descriptor")

    def __init__(self, start, end, descriptor=None):
        self.start, self.end, self.descriptor = start, end, descriptor

    @property
    def size(self):
        return self.end - self.start

    def __eq__(self, other):
        return isinstance(other, _CudaVmmMemoryChunk) and (self.start, self.end) == (other.start,
                                                                                     other.end)

    def __repr__(self):
        return "_CudaVmmMemoryChunk(start=%d, end=%d)" % (self.start, self.end)


class _HostStream:
    """The publish stream where none is needed: a host pool (the CPU copies)
    or NumPy sources (pageable: the library copies them before it returns)."""
    handle = None

    def synchronize(self):
        pass

    def wait_current(self):
        pass


class _TorchStream:
    """A dedicated CUDA stream for host-source copies, as sglang has one."""

    def __init__(self, torch, device):
        self._torch, self._device = torch, device
        self.handle = torch.cuda.Stream(device=device)

    def synchronize(self):
        self.handle.synchronize()

    def wait_current(self):
        self.handle.wait_stream(self._torch.cuda.current_stream(self._device))


class _PosixFdBroker:
    """sglang's broker object, for code that looks for one: vmmt's broker is
    the library's (a thread in C, an unguessable abstract socket, peer
    credentials checked) and closes with the pool; this only names it."""

    def __init__(self, socket_path):
        self.socket_path = socket_path

    def raise_if_failed(self):
        pass

    def close(self):
        pass


class CudaVmmMemoryPool:
    """A bounded VMM pool shared with the ranks through FABRIC or a POSIX fd."""

    def __init__(self, memory_size, recycle_interval, base_gpu_id, consumer_count,
                 allow_posix_fallback=False, *, pool=None, timeout_ms=5000):
        if memory_size <= 0:
            raise ValueError("memory_size must be positive")
        if consumer_count <= 0:
            raise ValueError("consumer_count must be positive")
        if recycle_interval <= 0:
            raise ValueError("recycle_interval must be positive")
        kind = pool if pool is not None else os.environ.get("VMMT_SGLANG_POOL", "device")
        if kind not in POOL_KINDS:
            raise ValueError("pool=%r (or VMMT_SGLANG_POOL); use one of %s"
                             % (kind, ", ".join(POOL_KINDS)))
        self.pool_kind = kind
        self.device_index = int(base_gpu_id)
        self.consumer_count = int(consumer_count)
        self._recycle_interval = float(recycle_interval)
        self._timeout_ms = int(timeout_ms)
        # Reentrant: sglang's tests hold it while they call _recycle_chunks
        # and read occupied_chunks, which take it too.
        self._lock = threading.RLock()
        self._shutdown_lock = threading.Lock()
        # One entry per thread inside a publish: list.append and list.pop are
        # atomic under the GIL, so a wrap takes no lock (shutdown polls it).
        self._publishers = []
        self._closing = False
        self._closed = False
        self._pool_full_warned = False
        self._pool_error = None
        self._live = {}  # control slot -> Descriptor of this pool's last publish there
        self._pool = None
        self._fd_broker = None
        self._publish_stream = None
        self._no_publish_stream = False
        self.allocation_size = 0
        self.posix_socket_path = None
        self.memory_pool = None  # vmmt lends no raw view of the pool's memory

        if kind == "host":
            # Host memory is shared by fd only, and the probe would make a CUDA
            # context, which a host pool's producer never needs.
            self.handle_type, self._granularity = HandleType.POSIX_FD, {}
        else:
            self.handle_type, self._granularity = probe_device(self.device_index)
        if self.handle_type == HandleType.NONE:
            raise RuntimeError("CUDA VMM multimodal transport found no shareable handle type on "
                               "device %d: only NONE works, whose allocations cannot be shared "
                               "between processes" % self.device_index)
        if self.handle_type == HandleType.POSIX_FD and not allow_posix_fallback:
            raise RuntimeError("CUDA VMM multimodal transport selected POSIX_FD, but this pool "
                               "requires FABRIC")
        if kind == "elastic" and self.handle_type == HandleType.FABRIC:
            if not allow_posix_fallback:
                raise ValueError("pool='elastic' needs POSIX_FD handles, and this pool requires "
                                 "FABRIC (consumers on other nodes): use pool='device'")
            self.handle_type = HandleType.POSIX_FD
        self.use_fabric = self.handle_type == HandleType.FABRIC
        try:
            self._allocate(memory_size)
        except RuntimeError as error:
            if not allow_posix_fallback or not self.use_fabric:
                raise
            logger.warning("vmmt.sglang: a FABRIC pool could not be made on device %d (%s); "
                           "using a POSIX fd pool, for consumers on this node only",
                           self.device_index, error)
            self.handle_type, self.use_fabric = HandleType.POSIX_FD, False
            self._allocate(memory_size)
        try:
            if not self.use_fabric:
                self._fd_broker = _PosixFdBroker(self.posix_socket_path)
            self._publish_stream = self._new_publish_stream()
            self._no_publish_stream = type(self._publish_stream) is _HostStream
        except BaseException:
            if self._fd_broker is not None:
                self._fd_broker.close()
            self._release_allocation()
            raise

    # ------------------------------------------------------------ setup

    def _allocate(self, memory_size):
        name = "fabric" if self.use_fabric else "posix_fd"
        # (A host pool has no probe: 2 MiB, the host-NUMA granularity of the
        # H200 and the emulator; the library checks it again.)
        granularity = self._granularity.get(name, 2 << 20)
        allocation_size = memory_size // granularity * granularity
        if allocation_size == 0:
            raise ValueError("memory_size=%d is smaller than CUDA VMM granularity=%d; use at least "
                             "%d bytes (%d MiB)" % (memory_size, granularity, granularity,
                                                    granularity >> 20))
        # "At most recycle_interval": the library frees a slice on demand (a
        # publish that finds no room reclaims first) and its recycler polls
        # the acknowledgements every millisecond, never slower than asked.
        recycle_us = max(1, min(_RECYCLE_US, int(self._recycle_interval * 1e6)))
        extra = {}
        if self.pool_kind == "elastic":
            # Chunks of four units (the library's default) where the pool holds
            # as many; a smaller pool grows one unit at a time.
            chunk = granularity * max(1, min(4, allocation_size // granularity))
            allocation_size = allocation_size // chunk * chunk
            extra = {"elastic": True, "chunk_size": chunk}
        pool = vmmt.Pool(device=self.device_index, memory_size=allocation_size,
                         consumer_count=self.consumer_count, handle_type=name, allow_posix_fallback=False,
                         timeout_ms=self._timeout_ms, recycle_interval_us=recycle_us,
                         memory_location="host" if self.pool_kind == "host" else "device",
                         **extra)
        try:
            # The pool's identity, read off a descriptor taken back at once: it
            # names the pool in the properties sglang's code reads.
            probe = pool.publish(numpy.zeros(1, dtype=numpy.uint8))
            pool_id = probe.pool_id
            pool.cancel(probe)
            pool.reclaim()
        except BaseException:
            pool.close()
            raise
        self._pool, self.allocation_size, self._pool_id = pool, allocation_size, pool_id
        self.posix_socket_path = None if self.use_fabric else "vmmt-broker:" + pool_id.hex()
        # What every proxy of this pool names (CudaVmmTensorTransportProxy._published).
        self._proxy_names = (pool_id if self.use_fabric else None, self.posix_socket_path,
                             allocation_size)
        logger.info("vmmt.sglang: %s pool of %d bytes, %s handles, on device %d", self.pool_kind,
                    allocation_size, name.upper(), self.device_index)

    def _new_publish_stream(self):
        torch = arrays._torch()
        if self.pool_kind == "host" or torch is None or vmmt.driver_name() != "cuda" or \
                not torch.cuda.is_available():
            return _HostStream()
        return _TorchStream(torch, self.device_index)

    def _release_allocation(self):
        if self._pool is not None and not self._pool.closed:
            self._pool.close()

    # ------------------------------------------------------ properties

    @property
    def fabric_handle(self):
        """For a FABRIC pool, the pool's 16-byte id (every proxy carries the
        exported handle in its descriptor); None for a POSIX fd pool."""
        return self._pool_id if self.use_fabric else None

    @property
    def shareable_handle(self):
        return self.fabric_handle if self.use_fabric else self.posix_socket_path

    @property
    def control_size(self):
        return 0  # the control table is the library's, apart from the slices

    def stats(self):
        """vmmt's statistics of the pool (vmmt.Pool.stats)."""
        return self._pool.stats()

    @property
    def occupied_chunks(self):
        """This pool's publishes still in flight (sglang's tests read it): one
        entry per control slot, dropped once the library has recycled it."""
        with self._lock:
            self._prune()
            return [_CudaVmmMemoryChunk(slot, slot + 1, desc) for slot, desc in self._live.items()]

    @property
    def available_chunks(self):
        """One summary chunk of the bytes free now (the slab has the map)."""
        with self._lock:
            if self._pool is None or self._pool.closed:
                return []
            free = self.allocation_size - self._pool.stats()["in_flight_bytes"]
        return [_CudaVmmMemoryChunk(0, free)] if free > 0 else []

    def _prune(self):
        # A slot's entry is replaced by each publish into it; all entries go
        # once nothing is in flight. (The library tells counts, not which.)
        if self._live and (self._pool is None or self._pool.closed or
                           self._pool.stats()["in_flight"] == 0):
            self._live.clear()

    def _track(self, desc, slot=None):
        # Under the lock: occupied_chunks iterates the dict, and cancel and
        # prune read before they delete (an outside attack: test_attack_sglang_hot).
        if slot is None:
            slot = desc.slot
        with self._lock:
            self._live[slot] = desc

    def _recycle_chunks(self):
        """Recycle every acknowledged slice now (the library's recycler also
        does it on its own, every millisecond), with the acknowledgements of
        this process's own completed rebuilds written first."""
        flush_acknowledgements()
        if self._pool is not None and not self._pool.closed:
            self._pool.reclaim()
        with self._lock:
            self._prune()

    def _merge_chunks(self):
        pass  # the slab merges free neighbours itself

    # --------------------------------------------------------- publish

    def _raise_if_failed(self):
        if self._pool_error is not None:
            raise RuntimeError("CUDA VMM multimodal pool failed: %s" % self._pool_error) \
                from self._pool_error

    def _publish(self, tensors, on_device):
        """_publish_now, counted as a publisher (shutdown waits for it), unless
        the pool is closing or failed."""
        self._publishers.append(None)
        try:
            if self._closing or self._closed or self._pool_error is not None:
                self._raise_if_failed()
                raise RuntimeError("CUDA VMM multimodal pool is closing")
            return self._publish_now(tensors, on_device)
        finally:
            self._publishers.pop()

    def _checked(self, tensors):
        lib = None
        for t in tensors:
            kind = arrays.library(t)
            if kind is None:
                raise TypeError("vmmt.sglang publishes torch tensors or NumPy arrays; got %s"
                                % type(t).__name__)
            if arrays.is_meta(t):
                raise NotImplementedError("cannot publish a meta tensor: it has no data to copy")
            if lib not in (None, kind):
                raise TypeError("a packed publish takes tensors of one library, torch or NumPy")
            lib = kind
        return lib, [arrays.contiguous(t) for t in tensors]

    def _publish_now(self, tensors, on_device):
        """Descriptors, or None when no slice fits. Device sources are copied
        on the caller's current stream and not waited for (the pool keeps
        them alive until their copy has run); host sources on the publish
        stream, which is synchronized, so the caller may reuse them at once.
        As in sglang, whose slice holds its control block besides the bytes,
        tensors of the pool's whole size together never fit (its tests expect
        the fallback for them; vmmt's table is kept apart)."""
        if sum(arrays.nbytes(t) for t in tensors) >= self.allocation_size:
            return None
        stream = None
        if not on_device:
            stream = self._publish_stream.handle
            self._publish_stream.wait_current()  # device members were made on the current stream
        try:
            if len(tensors) == 1:
                descs = [self._pool.publish(tensors[0], stream=stream)]
            else:
                descs = self._pool.publish_many(tensors, stream=stream)
        except vmmt.NoRoom:
            descs = None  # full now, or never fits: sglang's caller sends the tensor itself
        except vmmt.Error as e:
            self._publish_failed(e)
            raise
        if descs is not None and not on_device:
            try:
                self._publish_stream.synchronize()
            except BaseException as e:
                # The copies were queued and the library keeps their sources
                # until they have run, so taking the slice back is safe; the
                # stream's failure leaves the device in doubt: quarantine.
                self._pool_error = e
                self._pool.cancel(descs[0])
                raise
        return descs

    def _publish_failed(self, error):
        if error.status == vmmt.EFAILED:  # an uncertain failure quarantined the pool
            self._pool_error = error

    def wrap_tensor(self, tensor):
        """A picklable proxy of `tensor` in the pool, or the tensor in host
        memory (tensor.cpu()) when no slice fits, now or ever (warned once),
        or when it is empty (nothing to publish; no warning)."""
        # sglang's tokenizer calls this for every feature, on its event loop:
        # a CUDA tensor goes to vmmt.Pool.publish, which checks it in C, with
        # no lock taken here and the proxy made without a second validation
        # of the descriptor the library just wrote (BENCHMARKS.md, "From
        # sglang": each step below costs 0.1-1 us of Python).
        torch = sys.modules.get("torch")
        if torch is not None and type(tensor) is torch.Tensor and tensor.is_contiguous() and \
                (tensor.is_cuda or (tensor.is_cpu and self._no_publish_stream)):
            # _publish inlined for one tensor that needs no publish stream (on
            # the caller's stream, or host memory the library copies before it
            # returns): the calls and lists it saves are a tenth of the wrap
            # (sglang_steps.py).
            publishers = self._publishers
            publishers.append(None)
            try:
                if self._closing or self._closed or self._pool_error is not None:
                    self._raise_if_failed()
                    raise RuntimeError("CUDA VMM multimodal pool is closing")
                if tensor.numel() * tensor.element_size() >= self.allocation_size:
                    desc = None  # never fits, as in sglang (_publish_now)
                else:
                    desc = self._pool.publish(tensor)
            except vmmt.NoRoom:
                desc = None
            except vmmt.Error as e:
                self._publish_failed(e)
                raise
            except ValueError:
                if tensor.numel() == 0:  # nothing to publish: it goes inline (below)
                    return tensor.cpu()
                raise
            finally:
                publishers.pop()
            if desc is None:
                self._warn_pool_full_once(arrays.nbytes(tensor))
                return tensor.cpu()
            lib = arrays.TORCH
        else:
            lib, (tensor,) = self._checked([tensor])
            if arrays.numel(tensor) == 0:
                # The library publishes no empty buffer; sglang's callers send
                # such a tensor inline, as when no slice fits (no warning).
                return arrays.to_cpu(tensor)
            descs = self._publish([tensor], arrays.is_device(tensor))
            if descs is None:
                self._warn_pool_full_once(arrays.nbytes(tensor))
                return arrays.to_cpu(tensor)
            desc = descs[0]
        proxy = CudaVmmTensorTransportProxy._published(desc, self._proxy_names, tensor.dtype, lib)
        self._track(desc, proxy.control_offset)
        return proxy

    def wrap_tensors(self, tensors):
        """One packed proxy per tensor, all in one slice; None when no slice
        fits them together (nothing is published: send them another way),
        when there are more than 64 (the library's limit for one slice), or
        when one is empty."""
        self._raise_if_failed()
        tensors = list(tensors)
        if not tensors:
            return []
        lib, tensors = self._checked(tensors)
        if len(tensors) > _MAX_PACK or any(arrays.numel(t) == 0 for t in tensors):
            return None  # more than a slice holds, or an empty member the library refuses
        descs = self._publish(tensors, all(arrays.is_device(t) for t in tensors))
        if descs is None:
            return None
        self._track(descs[0])
        owner = _CudaVmmPackedTransportOwner(
            descriptors=descs, consumer_count=self.consumer_count,
            fabric_handle=self.fabric_handle, posix_socket_path=self.posix_socket_path,
            allocation_size=self.allocation_size)
        return [CudaVmmPackedTensorTransportProxy(owner=owner, index=i, shape=tuple(t.shape),
                                                  dtype=t.dtype, library=lib)
                for i, t in enumerate(tensors)]

    # ---------------------------------------------------------- cancel

    def _cancel_descriptor(self, desc):
        # Refused by every consumer once cancel returns (vmmt.h); the reclaim
        # frees its slice now rather than at the recycler's next pass, so
        # sglang's "free once cancelled" holds for the next wrap. After
        # shutdown every slice is back already: nothing to cancel.
        if self._pool is None or self._pool.closed:
            return
        self._pool.cancel(desc)
        self._pool.reclaim()
        with self._lock:
            live = self._live.get(desc.slot)
            if live is not None and live.generation == desc.generation:
                del self._live[desc.slot]

    def _cancel_control_offset(self, control_offset):
        with self._lock:
            live = self._live.get(control_offset)
        if live is None:
            raise RuntimeError("CUDA VMM pool has no occupied slice at control offset %s"
                               % (control_offset,))
        self._cancel_descriptor(live)

    def cancel_proxy(self, proxy):
        """Take back the slice of a proxy whose request was never dispatched
        (idempotent; for a packed proxy, the whole packed slice; after
        shutdown, nothing: every slice is back)."""
        if isinstance(proxy, CudaVmmPackedTensorTransportProxy):
            proxy._packed_owner.cancel_from_pool(self)
            return
        desc = proxy.descriptor
        if desc is None:
            raise RuntimeError("this CUDA VMM proxy carries no vmmt descriptor")
        self._cancel_descriptor(desc)

    def _warn_pool_full_once(self, nbytes):
        if self._pool_full_warned:
            return
        self._pool_full_warned = True
        logger.warning("vmmt.sglang: no slice of the %.2f MiB pool holds a %.2f MiB tensor now; "
                       "it goes inline through the CPU path (warned once; a larger "
                       "SGLANG_MM_FEATURE_CACHE_MB, or pool='elastic', makes this rarer)",
                       self.allocation_size / 1048576, nbytes / 1048576)

    # -------------------------------------------------------- shutdown

    def shutdown(self, timeout_ms=None):
        """Wait for publishers still inside a wrap, then close the pool
        (idempotent). Bounded by timeout_ms (default: the pool's): past it,
        RuntimeError, the pool refuses new wraps, and shutdown() again
        finishes."""
        timeout = (self._timeout_ms if timeout_ms is None else timeout_ms) / 1000.0
        deadline = time.monotonic() + timeout
        with self._shutdown_lock:
            if self._closed:
                return
            self._closing = True
            # Publishers hold no lock (_publish): poll for the last one
            # to leave, each wait short, the whole bounded by the timeout.
            while self._publishers:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(
                        "CUDA VMM pool shutdown: %d publisher(s) still inside wrap_tensor "
                        "after %.0f ms; the pool takes no new wraps; call shutdown() again "
                        "once they return" % (len(self._publishers), timeout * 1000))
                time.sleep(min(left, 0.0005))
            if self._fd_broker is not None:
                self._fd_broker.close()
                self._fd_broker = None
            left_ms = max(1, int((deadline - time.monotonic()) * 1000))
            self._pool.close(left_ms)  # vmmt.Timeout (a RuntimeError) past it: call again
            self._closed = True
            self._live.clear()
