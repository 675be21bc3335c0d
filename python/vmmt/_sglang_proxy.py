"""vmmt.sglang's proxies: what a request carries in place of a feature tensor.

A proxy is a vmmt Descriptor (512 bytes, validated when unpickled) plus the
tensor's shape and dtype, under the attributes sglang's proxies have. A rank
process rebuilds the tensor with reconstruct_on_target_device, which
consumes the descriptor into new memory on that device and acknowledges it
for the ranks that ``consumer_count`` selects (_sglang_ranks.py); or it
drops the request with acknowledge_consumption / release_without_
reconstruction. Each process has one vmmt.Consumer for all proxies, made on
first use; _imported_pool_cache_clear closes it.

Packed proxies (one per tensor of a request, in one slice) share an owner
that consumes every member into one flat buffer on first use, so that the
members are views of one allocation, as sglang's are.
"""
import contextlib
import copyreg
import operator
import threading
from functools import reduce

import vmmt

from . import _sglang_arrays as arrays
from ._sglang_ranks import resolve as rank_resolve
from ._sglang_ranks import chosen as rank_chosen


def _proxy_base():
    """sglang's CUDA IPC proxy class where sglang is importable: its scheduler
    recognises feature proxies by isinstance against it. Its __init__ is
    never called; every method sglang calls is defined here."""
    import importlib.util
    try:
        if importlib.util.find_spec("sglang") is None:
            return object
    except (ImportError, ValueError):
        return object
    for name in ("sglang.srt.multimodal.transport.cuda_ipc",
                 "sglang.srt.utils.cuda_ipc_transport_utils"):
        try:
            module = importlib.import_module(name)
        except Exception:  # an sglang too old or too new for this name: try the next
            continue
        base = getattr(module, "CudaIpcTensorTransportProxy", None)
        if isinstance(base, type):
            return base
    return object


_Base = _proxy_base()

# The process's consumer, made on first use, is guarded by this lock, held
# only briefly. A rebuild holds its own proxy's lock instead (_own_lock), so
# that a consume and the flags it sets happen together for that proxy while
# other threads' rebuilds, acknowledgements and recycling go on: with one
# lock for every proxy (as sglang has), another thread's _recycle_chunks of
# any pool waited for a rebuild that waited for its stream
# (test_attack_sglang_flush, finding 2).
_lock = threading.RLock()
_consumer_obj = None


def _own_lock(obj):
    """obj's rebuild lock (a packed member uses its owner's), made on first
    use: proxies are also made by __new__ and unpickled, and none pickles it."""
    lock = obj.__dict__.get("_rebuild_lock")
    if lock is None:
        with _lock:
            lock = obj.__dict__.setdefault("_rebuild_lock", threading.RLock())
    return lock


def _consumer():
    global _consumer_obj
    with _lock:
        if _consumer_obj is None or _consumer_obj.closed:
            _consumer_obj = vmmt.Consumer()
        return _consumer_obj


def _flush_acknowledgements():
    """Write now the acknowledgements of this process's rebuilds whose copies
    have completed (vmmt.Consumer.flush; the consumer's thread does within
    tens of microseconds otherwise): a pool of this process that recycles
    right after a synchronize then finds them, as sglang's tests expect."""
    with _lock:
        consumer = _consumer_obj
        if consumer is not None and not consumer.closed:
            consumer.flush()


# Consumers that rebuilds are using: id -> [consumer, rebuilds, closing]. A
# rebuild uses one consumer from its first consume to its last
# acknowledgement: a packed group's members taken by one consumer can be
# acknowledged by that consumer only, so a cache clear that closed it between
# two members left the group's words taken and its slice held for good
# (test_attack_sglang_threads). The clear closes a consumer in use once its
# last rebuild is done.
_leases = {}


@contextlib.contextmanager
def _leased_consumer():
    """The process's consumer, not closed before the block ends."""
    with _lock:
        consumer = _consumer()
        entry = _leases.setdefault(id(consumer), [consumer, 0, False])
        entry[1] += 1
    try:
        yield consumer
    finally:
        with _lock:
            entry[1] -= 1
            close = entry[1] == 0 and entry[2]
            if entry[1] == 0:
                del _leases[id(consumer)]
        if close:
            consumer.close()


def _imported_pool_cache_clear():
    """Let go of every imported pool of this process (sglang's name): closes
    the process's vmmt.Consumer (one a rebuild is using, once that rebuild
    is done); the next proxy makes a new one. Tensors already rebuilt own
    their memory and stay valid."""
    global _consumer_obj
    with _lock:
        consumer, _consumer_obj = _consumer_obj, None
        entry = _leases.get(id(consumer)) if consumer is not None else None
        if entry is not None:
            entry[2] = True
            consumer = None
    if consumer is not None:
        consumer.close()


def _on_device():
    """Whether consumed memory is CUDA device memory (not the emulator's)."""
    try:
        return vmmt.driver_name() == "cuda"
    except vmmt.Error:
        return False


def _elements(shape):
    """The element count of a shape, or -1 when it is not one (a dimension
    that is not a non-negative int): a caller may have set any shape."""
    try:
        dims = tuple(shape)
    except TypeError:
        return -1
    for d in dims:
        if isinstance(d, bool) or not hasattr(d, "__index__") or operator.index(d) < 0:
            return -1
    return reduce(operator.mul, (operator.index(d) for d in dims), 1)


def _release(desc, device, ranks, error, consumer=None):
    """After a failed rebuild: acknowledge, so that the slice is not held by a
    request that will never use it. True when the slice is released for these
    ranks (acknowledged now, or already: the consume acknowledged before it
    failed, or the slot holds another occupant); False when an
    acknowledgement failed too (a retry may work), noted on `error`. A set
    refused whole because some of its ranks are done already is then
    acknowledged rank by rank: the rebuild is abandoned, so whatever it
    still owes is given back. (Not a packed member's: its group is taken
    for one set, and the refusal forgot it.)"""
    consumer = consumer or _consumer()
    try:
        consumer.ack(desc, device=device, ranks=ranks)
        return True
    except vmmt.Stale:
        if len(ranks) == 1 or desc.pack_count > 1:
            return True  # nothing to release
    except vmmt.Error as ack_error:
        return _not_released(error, ack_error)
    released = True
    for r in ranks:
        try:
            consumer.ack(desc, device=device, ranks=r)
        except vmmt.Stale:
            pass
        except vmmt.Error as ack_error:
            released = _not_released(error, ack_error)
    return released


def _owed(obj, ranks):
    """Of `ranks`, what proxy (or packed owner) `obj` has yet to acknowledge:
    all of them; None when it acknowledged each one already (asked again,
    nothing to do); Stale when it acknowledged some of them, which leaves
    the others as they were (a list is done whole or not at all: an outside
    attack found a second acknowledge_ranks list on one proxy answered as
    done and acknowledged nothing, its slice held for good)."""
    want = frozenset(ranks)
    done = want & getattr(obj, "_acked", frozenset())
    if not done:
        return ranks
    if done == want:
        return None
    rest = sorted(want - done)
    error = vmmt.Stale("CUDA VMM proxy: rank(s) %s were acknowledged by this proxy already and "
                       "%s not; nothing was acknowledged: ask for %s alone"
                       % (sorted(done), rest, rest))
    error.status = -14  # VMMT_ESTATE, as the library's own
    raise error


def _mark(obj, ranks, done=True):
    """`obj` acknowledged `ranks` (or gave them back after a failure)."""
    if done:
        obj._acked = getattr(obj, "_acked", frozenset()) | frozenset(ranks)
        obj._consumer_acknowledged = True


def _ack_rest(obj, descriptors, ranks, device=None):
    """Acknowledge, without a copy, the ranks of `ranks` that `obj` has not:
    a rebuild asked again for other ranks of a tensor it has, or a drop."""
    owed = _owed(obj, ranks)
    if owed is None:
        return
    with _leased_consumer() as consumer:
        for d in descriptors:
            consumer.ack(d, device=device, ranks=owed)
    _mark(obj, owed)


def _rebuild_for(obj, descriptors, device, consumer_count, consumer_rank, acknowledge_ranks):
    """What a rebuild of proxy (or packed owner) `obj` on `device` is to do:
    (tensor, None), return obj's tensor; (None, ranks), consume for those.
    sglang's proxies rebuild once and keep the tensor; with the ranks named
    outright, each is acknowledged once, so asking again for others
    acknowledges those (and for some done, some not, is Stale)."""
    cached = obj.reconstruct_tensor is not None and obj._device == device
    if acknowledge_ranks is None:
        if cached:
            return obj.reconstruct_tensor, None
        if obj._consumer_acknowledged:
            raise RuntimeError("CUDA VMM tensor has already released its pool slice")
    ranks = rank_chosen(consumer_count, obj.consumer_count, consumer_rank, acknowledge_ranks)
    if acknowledge_ranks is None:
        return None, ranks
    if cached:
        _ack_rest(obj, descriptors, ranks, device)
        return obj.reconstruct_tensor, None
    owed = _owed(obj, ranks)
    if owed is None:
        raise RuntimeError("CUDA VMM tensor has already released its pool slice for ranks %r"
                           % (sorted(ranks),))
    return None, owed


def _not_released(error, ack_error):
    if hasattr(error, "add_note"):  # Python 3.11 and newer
        error.add_note("vmmt.sglang: the acknowledgement after the failed reconstruction also "
                       "failed (%s); the slice is still held and the call may be retried"
                       % ack_error)
    return False


class CudaVmmTensorTransportProxy(_Base):
    """One published tensor (sglang's name); picklable."""

    # A fresh proxy's state (_fresh), as class attributes: wrap_tensor's proxy
    # (_published) then sets only what is its own.
    data_offset = 0
    reconstruct_tensor = None
    _device = None
    _consumer_acknowledged = False
    _acked = frozenset()

    def __init__(self, *, descriptor=None, fabric_handle=None, posix_socket_path=None,
                 allocation_size=0, data_offset=0, data_nbytes=None, control_offset=None,
                 consumer_count=None, shape=None, dtype=None, library=arrays.NUMPY):
        # Always decoded again from the bytes: a caller's Descriptor may carry
        # altered decoded fields (test_attack_sglang_hot); wrap_tensor's own
        # proxies are made by _published.
        desc = descriptor if descriptor is None else vmmt.Descriptor(descriptor)
        self._desc = desc
        self._lib = library
        self.fabric_handle = fabric_handle
        self.posix_socket_path = posix_socket_path
        self.allocation_size = allocation_size
        self.data_offset = data_offset
        self.data_nbytes = desc.nbytes if data_nbytes is None and desc is not None else data_nbytes
        self.control_offset = desc.slot if control_offset is None and desc is not None \
            else control_offset
        self.consumer_count = desc.consumer_count if consumer_count is None and \
            desc is not None else consumer_count
        self.shape = tuple(desc.shape) if shape is None and desc is not None else shape
        self.dtype = arrays.dtype_of(desc.dtype, library) if dtype is None and \
            desc is not None else dtype
        self._fresh()

    @classmethod
    def _published(cls, desc, names, dtype, library):
        """wrap_tensor's proxy of `desc`, which the library has just written
        (its fields decoded already): `names` is the pool's (fabric_handle,
        posix_socket_path, allocation_size)."""
        self = cls.__new__(cls)
        self._desc, self._lib = desc, library
        self.fabric_handle, self.posix_socket_path, self.allocation_size = names
        # The fields C decoded as it made the descriptor, read at once rather
        # than through four properties.
        fields = desc._decoded()
        self.data_nbytes, self.control_offset = fields[6], fields[4]
        self.consumer_count, self.shape, self.dtype = fields[3], fields[8], dtype
        return self

    def _fresh(self):
        self.reconstruct_tensor = None
        self._device = None
        self._consumer_acknowledged = False
        self._acked = frozenset()  # ranks this proxy acknowledged

    # sglang's CUDA IPC proxies name the count so; its scheduler reads it.
    @property
    def total_consumer_count(self):
        return self.consumer_count

    # sglang's own names for the rank selection (its unit tests ask a bare
    # proxy): the ranks that acknowledgements take, as a half-open range.
    def _resolve_consumer_count(self, consumer_count):
        return 1 if consumer_count is None else consumer_count

    def _acknowledgement_range(self, consumer_count=None):
        first, count = rank_resolve(consumer_count, self.consumer_count)
        return first, first + count

    @property
    def descriptor(self):
        """The vmmt.Descriptor this proxy carries."""
        return self._desc

    def _wire(self):
        return {"descriptor": self._desc, "library": self._lib, "fabric_handle": self.fabric_handle,
                "posix_socket_path": self.posix_socket_path,
                "allocation_size": self.allocation_size, "data_offset": self.data_offset,
                "data_nbytes": self.data_nbytes, "control_offset": self.control_offset,
                "consumer_count": self.consumer_count, "shape": tuple(self.shape),
                "dtype": arrays.dtype_name(self.dtype)}

    def __getstate__(self):
        # What crosses the process boundary: never the rebuilt tensor or the
        # acknowledgement state, which are the receiving process's own.
        return self._wire()

    def __reduce__(self):
        # The wire as one flat tuple, rebuilt by _proxy_from_wire: half the
        # time of the state dict through __setstate__ each way, on every
        # request (sglang_steps.py). Pickles of the dict form still load.
        # A subclass keeps the dict form (its own __getstate__).
        if type(self) is not CudaVmmTensorTransportProxy:
            return copyreg.__newobj__, (type(self),), self.__getstate__()
        desc = self._desc
        return _proxy_from_wire, (None if desc is None else bytes(desc), self._lib,
                                  self.fabric_handle, self.posix_socket_path,
                                  self.allocation_size, self.data_offset, self.data_nbytes,
                                  self.control_offset, self.consumer_count, tuple(self.shape),
                                  arrays.dtype_name(self.dtype))

    def __setstate__(self, state):
        state = dict(state)
        self._desc = state.pop("descriptor")  # a Descriptor: validated as it was unpickled
        self._lib = state.pop("library")
        name = state.pop("dtype")
        for k, v in state.items():
            setattr(self, k, v)
        self.dtype = arrays.dtype_of(name, self._lib)
        self._fresh()

    def _need_descriptor(self):
        if self._desc is None:
            raise RuntimeError("this CUDA VMM proxy carries no vmmt descriptor: make proxies with "
                               "CudaVmmMemoryPool.wrap_tensor")
        return self._desc

    def reconstruct_on_target_device(self, rebuild_device_idx, consumer_count=None,
                                     consumer_rank=None, *, acknowledge_ranks=None):
        """The tensor on device `rebuild_device_idx`, copied out of the pool and
        acknowledged for the ranks `consumer_count` selects (or, named outright,
        `acknowledge_ranks`); the same tensor again when called again for that
        device."""
        device = int(rebuild_device_idx)
        with _own_lock(self):
            desc = self._need_descriptor()
            kept, ranks = _rebuild_for(self, (desc,), device, consumer_count, consumer_rank,
                                       acknowledge_ranks)
            if kept is not None:
                return kept
            nbytes = desc._decoded()[6]
            elements = _elements(self.shape)
            if elements < 0:
                error = RuntimeError(
                    "CUDA VMM proxy shape %r is not a shape (dimensions must be non-negative "
                    "ints); the pool slice is released and the proxy cannot be reconstructed"
                    % (self.shape,))
                _mark(self, ranks, _release(desc, device, ranks, error))
                raise error
            try:
                want = elements * arrays.itemsize(self.dtype)
            except Exception as error:  # a dtype this rank's library does not know
                _mark(self, ranks, _release(desc, device, ranks, error))
                raise
            if want != nbytes:
                error = RuntimeError(
                    "CUDA VMM proxy shape %r of %s holds %d bytes, but the published tensor has "
                    "%d; the pool slice is released and the proxy cannot be reconstructed"
                    % (tuple(self.shape), arrays.dtype_name(self.dtype), want, nbytes))
                _mark(self, ranks, _release(desc, device, ranks, error))
                raise error
            try:
                # Into a tensor of the proxy's shape and dtype from the library's
                # own allocator (PyTorch's caching allocator on its current
                # stream): no DLPack import, view or reshape after the copy, and
                # the memory is counted where the engine counts its own. A
                # failure here (no memory, a dtype of the other library)
                # releases the slice like a failed copy.
                tensor = arrays.empty_typed(self.shape, self.dtype, device,
                                            arrays.consumer_library(self._lib), _on_device())
            except Exception as error:
                _mark(self, ranks, _release(desc, device, ranks, error))
                raise
            with _leased_consumer() as consumer:
                try:
                    consumer.consume(desc, device=device, out=tensor, ranks=ranks)
                except vmmt.Stale:
                    # Refused whole (vmmt_consume_ranks): nothing was taken,
                    # so nothing is given back, and another set may be asked.
                    raise
                except Exception as error:
                    _mark(self, ranks, _release(desc, device, ranks, error, consumer))
                    raise
            _mark(self, ranks)
            self.reconstruct_tensor, self._device = tensor, device
            return tensor

    def acknowledge_consumption(self, consumer_count=None, consumer_rank=None, *,
                                acknowledge_ranks=None):
        """Release the slice without copying (a request dropped or served from
        a cache), for the ranks `consumer_count` selects; once per proxy (ranks
        named in `acknowledge_ranks`: once per rank)."""
        with _own_lock(self):
            if acknowledge_ranks is None and self._consumer_acknowledged:
                return
            _ack_rest(self, (self._need_descriptor(),),
                      rank_chosen(consumer_count, self.consumer_count, consumer_rank,
                                  acknowledge_ranks))

    def release_without_reconstruction(self, consumer_count=1, consumer_rank=None, *,
                                       acknowledge_ranks=None):
        """sglang's name for a request that abandons this proxy."""
        self.acknowledge_consumption(consumer_count, consumer_rank,
                                     acknowledge_ranks=acknowledge_ranks)

    def borrow_on_target_device(self, rebuild_device_idx, *_args, **_kwargs):
        """None, always: a borrowed view of recyclable pool memory could be
        overwritten once the slice is recycled (sglang refuses it for its VMM
        proxies too); reconstruct_on_target_device makes a copy that is yours."""
        return None

    def release_borrowed_on_current_stream(self, consumer_count=1, consumer_rank=None):
        """Nothing, always: nothing is ever borrowed (borrow_on_target_device
        returns None), so there is no view to let go. Defined here so that
        sglang's own version, inherited where sglang is importable, is never
        reached: it reads a borrow's state that these proxies do not have."""
        return None

    def __repr__(self):
        return "%s(%r, shape=%r, dtype=%s)" % (type(self).__name__, self._desc,
                                              tuple(self.shape or ()), self.dtype)


def _check_names(desc, fabric_handle, posix_socket_path, data_nbytes, control_offset,
                 consumer_count):
    """The fields a proxy reports beside its descriptor must be the
    descriptor's own: a pickle that pairs one pool's names with another's
    descriptor is refused, not believed (test_attack_wire). The descriptor
    alone decides what is copied; this keeps what the proxy says true."""
    f = desc._decoded()
    pool_id = f[0]
    wrong = [name for name, ok in (
        ("fabric_handle", fabric_handle is None or fabric_handle == pool_id),
        ("posix_socket_path", posix_socket_path is None or
         posix_socket_path == "vmmt-broker:" + pool_id.hex()),
        ("data_nbytes", data_nbytes is None or data_nbytes == f[6]),
        ("control_offset", control_offset is None or control_offset == f[4]),
        ("consumer_count", consumer_count is None or consumer_count == f[3])) if not ok]
    if wrong:
        raise ValueError("CUDA VMM proxy: %s do(es) not match its descriptor (pool %s, slot %d, "
                         "%d bytes): the pickle was altered or put together from two proxies"
                         % (", ".join(wrong), pool_id.hex(), f[4], f[6]))


def _proxy_from_wire(desc, library, fabric_handle, posix_socket_path, allocation_size,
                     data_offset, data_nbytes, control_offset, consumer_count, shape, dtype):
    """A proxy unpickled (CudaVmmTensorTransportProxy.__reduce__): its
    descriptor validated as vmmt.Descriptor, its dtype the library's own."""
    self = CudaVmmTensorTransportProxy.__new__(CudaVmmTensorTransportProxy)
    self._desc = None if desc is None else vmmt.Descriptor(desc)
    if self._desc is not None:
        _check_names(self._desc, fabric_handle, posix_socket_path, data_nbytes, control_offset,
                     consumer_count)
    self._lib = library
    self.fabric_handle, self.posix_socket_path = fabric_handle, posix_socket_path
    self.allocation_size, self.data_offset, self.data_nbytes = (allocation_size, data_offset,
                                                                data_nbytes)
    self.control_offset, self.consumer_count, self.shape = control_offset, consumer_count, shape
    self.dtype = arrays.dtype_of(dtype, library)
    return self


def _align_up(value, alignment):
    return (value + alignment - 1) // alignment * alignment


def _member_layout(descs):
    """(offsets, total): each member aligned to its element size in one flat
    buffer, as sglang lays a packed slice out."""
    offsets, next_offset = [], 0
    for d in descs:
        size = max(1, d.dl_dtype[1] // 8) if d.dl_dtype[1] else 1
        next_offset = _align_up(next_offset, size)
        offsets.append(next_offset)
        next_offset += d.nbytes
    return offsets, next_offset


def _owner_from_wire(state):
    return _CudaVmmPackedTransportOwner(**state)


class _CudaVmmPackedTransportOwner:
    """The shared slice of a packed publish: consumes every member at once."""

    def __init__(self, *, descriptors, consumer_count, fabric_handle=None, posix_socket_path=None,
                 allocation_size=0):
        self.descriptors = [vmmt.Descriptor(d) for d in descriptors]
        self.offsets, self.data_nbytes = _member_layout(self.descriptors)
        self.consumer_count = consumer_count
        self.control_offset = self.descriptors[0].slot
        self.fabric_handle, self.posix_socket_path = fabric_handle, posix_socket_path
        self.allocation_size = allocation_size
        self.data_offset = 0
        self.reconstruct_tensor = None
        self._device = None
        self._consumer_acknowledged = False
        self._acked = frozenset()
        self._producer_cancelled = False

    def __reduce__(self):
        # Members pickled together (one request) share one owner through
        # pickle's memo; members unpickled apart get owners of their own, as
        # two ranks served by one process must (each acknowledges for itself).
        return (_owner_from_wire, ({"descriptors": [bytes(d) for d in self.descriptors],
                                    "consumer_count": self.consumer_count,
                                    "fabric_handle": self.fabric_handle,
                                    "posix_socket_path": self.posix_socket_path,
                                    "allocation_size": self.allocation_size},))

    def cancel_from_pool(self, pool):
        if self._producer_cancelled:
            return
        descriptors = getattr(self, "descriptors", None)
        if descriptors:
            # By descriptor: its generation makes sure that a slot reused
            # meanwhile is never taken from its new occupant. The library
            # cancels the whole group.
            pool._cancel_descriptor(descriptors[0])
        else:  # an owner built by hand (sglang's tests): by its slot, as sglang does
            pool._cancel_control_offset(self.control_offset)
        self._producer_cancelled = True

    def reconstruct_on_target_device(self, rebuild_device_idx, consumer_count=None,
                                     consumer_rank=None, library=arrays.NUMPY,
                                     acknowledge_ranks=None):
        """Every member, consumed into one flat uint8 buffer on the device."""
        device = int(rebuild_device_idx)
        with _own_lock(self):
            kept, ranks = _rebuild_for(self, self.descriptors, device, consumer_count,
                                       consumer_rank, acknowledge_ranks)
            if kept is not None:
                return kept
            flat = arrays.empty_bytes(max(1, self.data_nbytes), device,
                                      arrays.consumer_library(library), _on_device())
            with _leased_consumer() as consumer:
                done = 0
                try:
                    for d, off in zip(self.descriptors, self.offsets):
                        consumer.consume(d, device=device, out=flat[off:off + d.nbytes],
                                         ranks=ranks)
                        done += 1
                except vmmt.Stale:
                    if done == 0:  # refused whole: nothing taken, another set may be asked
                        raise
                    _mark(self, ranks, self._drop_from(done, device, ranks, consumer))
                    raise
                except Exception as error:
                    _mark(self, ranks, self._drop_from(done, device, ranks, consumer, error))
                    raise
            _mark(self, ranks)
            self.reconstruct_tensor, self._device = flat, device
            return flat

    def _drop_from(self, done, device, ranks, consumer, error=None):
        """The group is acknowledged once every member is consumed or
        dropped: drop the members from `done` on, by the consumer that took
        the group, so that the slice is not held for good."""
        released = True
        for d in self.descriptors[done:]:
            released = _release(d, device, ranks, error, consumer) and released
        return released

    def acknowledge_consumption(self, consumer_count=None, consumer_rank=None,
                                acknowledge_ranks=None):
        with _own_lock(self):
            if acknowledge_ranks is None and self._consumer_acknowledged:
                return
            _ack_rest(self, self.descriptors,
                      rank_chosen(consumer_count, self.consumer_count, consumer_rank,
                                  acknowledge_ranks))


class CudaVmmPackedTensorTransportProxy(CudaVmmTensorTransportProxy):
    """One tensor of a packed publish (sglang's name): a typed view of its
    owner's buffer; rebuilding one member copies and acknowledges them all."""

    def __init__(self, *, owner, index, shape=None, dtype=None, library=arrays.NUMPY):
        desc = owner.descriptors[index]
        super().__init__(descriptor=desc, fabric_handle=owner.fabric_handle,
                         posix_socket_path=owner.posix_socket_path,
                         allocation_size=owner.allocation_size,
                         data_offset=owner.offsets[index], consumer_count=owner.consumer_count,
                         shape=shape, dtype=dtype, library=library)
        self._packed_owner = owner
        self._packed_index = index
        self._packed_relative_offset = owner.offsets[index]

    def __getstate__(self):
        state = self._wire()
        state.update(owner=self._packed_owner, index=self._packed_index)
        return state

    def __setstate__(self, state):
        state = dict(state)
        owner, index = state.pop("owner"), state.pop("index")
        # The member rebuilds from its owner's descriptor at `index`: that must
        # be the one it carries, or it would hand out another member's bytes
        # under its own name (test_attack_wire).
        descriptors = getattr(owner, "descriptors", None)
        if isinstance(index, bool) or not isinstance(index, int) or not descriptors or \
                not 0 <= index < len(descriptors) or \
                bytes(descriptors[index]) != bytes(state.get("descriptor") or b""):
            raise ValueError("CUDA VMM packed proxy: member %r does not carry its owner's "
                             "descriptor at that index: the pickle was altered" % (index,))
        self._packed_owner, self._packed_index = owner, index
        self._packed_relative_offset = owner.offsets[index]
        super().__setstate__(state)

    def reconstruct_on_target_device(self, rebuild_device_idx, consumer_count=None,
                                     consumer_rank=None, *, acknowledge_ranks=None):
        device = int(rebuild_device_idx)
        with _own_lock(self._packed_owner):
            cached = self.reconstruct_tensor is not None and self._device == device
            if acknowledge_ranks is None:
                if cached:
                    return self.reconstruct_tensor
                if self._consumer_acknowledged:
                    raise RuntimeError("CUDA VMM tensor has already released its pool slice")
            elif cached:  # the ranks named are the owner's to acknowledge, once each
                self._packed_owner.reconstruct_on_target_device(
                    device, consumer_count=consumer_count, consumer_rank=consumer_rank,
                    library=self._lib, acknowledge_ranks=acknowledge_ranks)
                return self.reconstruct_tensor
            elements = _elements(self.shape)
            want = elements * arrays.itemsize(self.dtype) if elements >= 0 else -1
            if want != self._desc.nbytes:
                error = RuntimeError(
                    "CUDA VMM packed proxy shape %r of %s holds %d bytes, but the published "
                    "tensor has %d; the packed slice is released and the proxy cannot be "
                    "reconstructed" % (tuple(self.shape), arrays.dtype_name(self.dtype), want,
                                       self._desc.nbytes))
                self.release_without_reconstruction(consumer_count, consumer_rank,
                                                    acknowledge_ranks=acknowledge_ranks)
                raise error
            flat = self._packed_owner.reconstruct_on_target_device(
                device, consumer_count=consumer_count, consumer_rank=consumer_rank,
                library=self._lib, acknowledge_ranks=acknowledge_ranks)
            tensor = arrays.typed_view(flat, self._packed_relative_offset, self._desc.nbytes,
                                       self.dtype, self.shape)
            self._consumer_acknowledged = True
            self.reconstruct_tensor, self._device = tensor, device
            return tensor

    def acknowledge_consumption(self, consumer_count=None, consumer_rank=None, *,
                                acknowledge_ranks=None):
        """Releases the whole packed slice for these ranks (every member's
        acknowledgement at once); the other members then refuse to rebuild."""
        self.release_without_reconstruction(consumer_count, consumer_rank,
                                            acknowledge_ranks=acknowledge_ranks)

    def release_without_reconstruction(self, consumer_count=1, consumer_rank=None, *,
                                       acknowledge_ranks=None):
        with _own_lock(self._packed_owner):
            if acknowledge_ranks is None and self._consumer_acknowledged:
                return
            named = {k: v for k, v in (("consumer_rank", consumer_rank),
                                       ("acknowledge_ranks", acknowledge_ranks)) if v is not None}
            self._packed_owner.acknowledge_consumption(consumer_count, **named)
            self._consumer_acknowledged = True
