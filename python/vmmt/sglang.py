"""sglang's CUDA VMM feature transport, on vmmt, behind sglang's own names.

A drop-in for ``sglang.srt.utils.cuda_vmm_transport_utils`` (the tokenizer's
CudaVmmFeatureTransport, its CudaVmmMemoryPool and the proxies a request
carries to the ranks) and for ``get_device_allocation_handle_type`` of
``sglang.srt.utils.cuda_vmm_utils``. Pure Python over the binding; imports
without sglang and without torch (NumPy arrays then stand in for tensors;
where torch is imported, NumPy features stay inline as in sglang, unless
``NUMPY_FEATURES`` says otherwise).

Put it in sglang's place either way:

- ``vmmt.sglang.install()`` before sglang imports its transport (see its
  docstring for the limits), or
- the one-line edit, in sglang's tokenizer manager::

      from vmmt.sglang import CudaVmmFeatureTransport

  in place of the import from ``sglang.srt.utils.cuda_vmm_transport_utils``.

The same calls, the same return values and fallbacks, and the same error
messages where sglang's are sound. Where vmmt's semantics differ, they are
the safer ones:

- **Stream-ordered hand-off.** A device tensor's publish enqueues its copy
  on the caller's current stream and returns at once (no synchronize; the
  pool keeps the source alive until the copy has run); a rank's copy waits
  for the producer's ready flag on its own stream. sglang synchronizes the
  producer's stream in every publish (so it moved publication to an
  executor thread). Host tensors are still copied before the wrap returns,
  so the caller may reuse them at once. Where the driver refuses a wait on
  imported memory, the library synchronizes instead, by itself.
- **Recycling on demand.** A slice is free once its last acknowledgement is
  written and the library's recycler (every millisecond) or a publish that
  finds no room has seen it: ``recycle_interval`` is accepted and means at
  most that long, never the 50 ms poll sglang's recycler waits.
- **No stale acknowledgement.** Acknowledgements are generation-tagged: a
  late or repeated one can never release a newer occupant of the slice, and
  consuming a descriptor twice for one rank is refused (``vmmt.Error``).
- **Dead ranks.** A rank process that dies holding proxies no longer pins
  their slices: the library releases them for the ranks only it served.
- **An authenticated broker.** The POSIX fd is served by the library's
  broker on an unguessable abstract socket that checks its peer's
  credentials; ``posix_socket_path`` only names it (``vmmt-broker:<pool
  id>``), and ``fabric_handle`` is the pool's id (each proxy's descriptor
  carries the exported handle itself).
- **No borrowed views.** ``borrow_on_target_device`` returns None: a view of
  recyclable pool memory could change under its reader once the slice is
  recycled. sglang's VMM proxies do the same.
- **A failed rebuild releases, and says so.** A reconstruction whose copy
  fails, or whose tensor cannot be allocated, acknowledges the slice (so a
  request that will never use it does not hold it) and the proxy refuses a
  retry ("already released"), as in sglang; where even that acknowledgement
  cannot be written, the error says the slice is still held and the call
  may be retried (sglang would raise the cleanup's error). A proxy whose
  shape is not one (a negative or non-int dimension) or whose shape or
  dtype was changed to another size is refused before anything is copied,
  and releases; one changed to the same size rebuilds the published bytes
  as that shape and dtype, as sglang's would.
- **A rebuilt tensor is the rank's own.** It is allocated with the proxy's
  shape and dtype by the producer's array library where the rank has it
  (PyTorch's caching allocator, on its current stream), else by NumPy, and
  the copy lands in it: it stays valid after the pool is gone.
- **A proxy is checked as it is unpickled.** Its descriptor is validated,
  and the names it reports beside it (``data_nbytes``, ``control_offset``,
  ``consumer_count``, ``posix_socket_path``, ``fabric_handle``) must be the
  descriptor's, or the pickle is refused (ValueError); a packed member must
  carry its owner's descriptor at its index. Members of one request are
  pickled together (one owner); a member pickled alone gets an owner of
  its own and is refused (``vmmt.Stale``) once its group was consumed
  through another.
- **What a wrap takes.** A PyTorch tensor's lazy negation or conjugation is
  resolved (a copy) and one that requires grad is detached before it is
  published, so the bytes are the values it reads; bool tensors go as
  their bytes; an empty tensor is returned as it is (``tensor.cpu()``, no
  warning) and ``wrap_tensors`` with one returns None. Meta, sparse and
  quantized tensors raise.
- **Packed members release together.** Acknowledging or releasing any member
  of a packed publish releases the whole slice for those ranks (the library
  counts one acknowledgement per group); the other members then refuse to
  rebuild. A packed publish holds at most 64 tensors; ``wrap_tensors`` of
  more returns None (the caller falls back to one wrap per tensor).
- **Bounded shutdown.** ``shutdown()`` waits for publishers still inside a
  wrap and for queued copies at most the pool's ``timeout_ms`` (5 s), then
  raises; the pool takes no new wraps and ``shutdown()`` again finishes.
- **Ranks from the engine.** ``consumer_count`` (1, the attention-TP size, or
  all) selects ranks from the layout that ``set_rank_resolver`` gives, or
  from sglang's parallel context where sglang is importable; sglang's newer
  keywords ``consumer_rank`` and ``acknowledge_ranks`` (ranks named
  outright) are honoured, and any other keyword is a TypeError rather than
  silently ignored (an acknowledgement dropped would hold a slice for good).
  An ``acknowledge_ranks`` list is one call of the library, done for all
  its ranks or none, and a proxy acknowledges each named rank once: asked
  again for others it acknowledges those, where sglang's proxy would answer
  done and acknowledge nothing (its newer CUDA IPC proxies raise ValueError
  then, and take a list only with ``consumer_count=1`` and the reader's own
  rank in it: rules vmmt does not enforce yet).

sglang's own test helpers that reach into its internals (the pool's raw
``memory_pool`` tensor and its acknowledgement words, ``tensor_from_pointer``,
a publish stream's ``synchronize`` inside a device-source wrap) find nothing
to reach: those are the library's now. ``occupied_chunks``,
``available_chunks``, ``_recycle_chunks``, ``_merge_chunks`` and
``_publish_stream`` are kept, as summaries, for the tests that only read them,
with ``_lock`` (reentrant: those tests hold it around them), the proxies'
``_resolve_consumer_count`` and ``_acknowledgement_range``, and the name
``torch`` (tests patch ``torch.cuda.Stream`` through it). python/README.md
says which of sglang's own tests should hold.

Choose the pool with ``pool=`` ("device", sglang's fixed pool, the default;
"elastic": device memory only while slices are in flight; "host": pinned
host memory, no device memory and no GPU work in the producer), or with
``VMMT_SGLANG_POOL`` for a pool that sglang's own code constructs; when each
wins: docs/integration.md.
"""
import asyncio
import logging
import os
import sys

from . import _sglang_arrays as _arrays
from ._sglang_pool import (POOL_KINDS, CudaVmmMemoryPool, _CudaVmmMemoryChunk,  # noqa: F401
                           _PosixFdBroker)
from ._sglang_probe import HandleType, get_device_allocation_handle_type
from ._sglang_proxy import (CudaVmmPackedTensorTransportProxy,  # noqa: F401
                            CudaVmmTensorTransportProxy, _CudaVmmPackedTransportOwner,
                            _imported_pool_cache_clear)
from ._sglang_ranks import ParallelLayout, set_rank_resolver

__all__ = ["CudaVmmFeatureTransport", "CudaVmmMemoryPool", "CudaVmmTensorTransportProxy",
           "CudaVmmPackedTensorTransportProxy", "get_device_allocation_handle_type",
           "get_vmm_feature_consumer_count", "get_mm_feature_pool_size_per_worker",
           "HandleType", "ParallelLayout", "set_rank_resolver", "install", "uninstall",
           "POOL_KINDS"]

logger = logging.getLogger("vmmt.sglang")

# sglang's marker for features one rank consumes alone, later: never packed.
DEFER_CUDA_IPC_FEATURE_RECONSTRUCTION_KEY = "_sglang_defer_cuda_ipc_feature_reconstruction"

# sglang's settings, read where sglang reads them (its environment variables).
MM_FEATURE_CACHE_SIZE = int(os.environ.get("SGLANG_MM_FEATURE_CACHE_MB", "1024")) << 20
MM_ITEM_MEMORY_POOL_RECYCLE_INTERVAL = float(
    os.environ.get("SGLANG_MM_ITEM_MEM_POOL_RECYCLE_INTERVAL_SEC", "0.05"))

_PACKED_MODALITIES = ("IMAGE", "VIDEO")

# Whether the transport takes NumPy arrays as features. sglang's takes torch
# tensors only, and leaves anything else in the request's pickle; None (the
# default) does the same where torch is imported, and publishes NumPy arrays
# only where torch is absent (they stand in for tensors there). True or
# False to say outright. The pool's own wrap_tensor takes either always.
NUMPY_FEATURES = None


def __getattr__(name):
    # sglang's transport module imports torch at its top, and sglang's tests
    # patch through that name (".cuda_vmm_transport_utils.torch.cuda.Stream");
    # this module imports without torch, so it imports it only when asked.
    if name == "torch":
        import torch
        return torch
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


def get_mm_feature_pool_size_per_worker(total_pool_size, tokenizer_worker_num):
    """Each tokenizer worker's pool: the budget split, never exceeded."""
    if total_pool_size <= 0:
        raise ValueError("total_pool_size must be positive")
    if tokenizer_worker_num <= 0:
        raise ValueError("tokenizer_worker_num must be positive")
    return total_pool_size // tokenizer_worker_num


def _sglang_parallel():
    try:
        from sglang.srt.runtime_context import get_parallel
        return get_parallel()
    except Exception:  # no sglang, or its context not published yet: server_args say
        return None


def get_vmm_feature_consumer_count(server_args=None):
    """The ranks that consume every feature: the TP size, or one attention
    group's under DP attention. From sglang's parallel context where it is
    importable, else from `server_args` (tp_size, dp_size,
    enable_dp_attention)."""
    source = _sglang_parallel()
    if source is not None:
        config = getattr(source, "config", source)
    elif server_args is not None:
        config = server_args
    else:
        raise RuntimeError("the consumer count comes from sglang's parallel context or from "
                           "server_args (tp_size, dp_size, enable_dp_attention); neither is here")
    tp = int(getattr(config, "tp_size", 1))
    if getattr(config, "enable_dp_attention", False):
        return tp // int(getattr(config, "dp_size", 1))
    return tp


def _transport_mode(server_args):
    try:
        from sglang.srt.runtime_context import get_mm
        return get_mm().mm_feature_transport
    except Exception:  # no sglang (or none with that context): the caller's arguments say
        return getattr(server_args, "mm_feature_transport", "cuda_vmm")


def _modality_name(item):
    modality = getattr(item, "modality", None)
    return getattr(modality, "name", modality)


def _is_feature(value):
    """Whether the transport publishes `value`: a torch tensor, or a NumPy
    array as NUMPY_FEATURES says."""
    lib = _arrays.library(value)
    if lib != _arrays.NUMPY:
        return lib is not None
    # sys.modules["torch"] = None (a test's "no torch here") is no torch.
    return sys.modules.get("torch") is None if NUMPY_FEATURES is None else bool(NUMPY_FEATURES)


def _contains_tensor_container(value):
    return isinstance(value, (list, tuple)) and any(
        _is_feature(v) or _contains_tensor_container(v) for v in value)


def _is_proxy(x):
    return isinstance(x, CudaVmmTensorTransportProxy)


class CudaVmmFeatureTransport:
    """The tokenizer's transport (sglang's name): wraps each request's feature
    tensors into proxies before dispatch, and takes them back when a request
    is not dispatched after all."""

    # Until a host tensor first needs one (prepare_for_dispatch_async); a
    # class default, for sglang's tests that build a bare transport.
    _publisher_executor = None

    def __init__(self, server_args, mm_processor, *, pool=None):
        self.pool = None
        if _transport_mode(server_args) != "cuda_vmm":
            return
        if mm_processor is None:
            raise RuntimeError("A CUDA VMM-enabled model must provide a multimodal processor")
        self.pool = CudaVmmMemoryPool(
            memory_size=get_mm_feature_pool_size_per_worker(
                MM_FEATURE_CACHE_SIZE, getattr(server_args, "tokenizer_worker_num", 1)),
            recycle_interval=MM_ITEM_MEMORY_POOL_RECYCLE_INTERVAL,
            base_gpu_id=getattr(server_args, "base_gpu_id", 0),
            consumer_count=get_vmm_feature_consumer_count(server_args),
            allow_posix_fallback=getattr(server_args, "nnodes", 1) == 1,
            **({} if pool is None else {"pool": pool}))

    def prepare_for_dispatch(self, mm_inputs_batch):
        """Wrap every request of the batch; the items wrapped, flattened. A
        failure takes back every request wrapped before it, then raises."""
        if self.pool is None:
            return []
        prepared, complete = [], False
        try:
            for mm_inputs in mm_inputs_batch:
                if mm_inputs is None or not mm_inputs.mm_items:
                    continue
                self.wrap_items(mm_inputs.mm_items)
                prepared.extend(mm_inputs.mm_items)
            complete = True
            return prepared
        finally:
            if not complete:
                self.cancel_for_dispatch(prepared)

    def _inline(self, batch):
        """Whether a batch wraps on the caller's thread: when every tensor in
        it is in device memory, a wrap only enqueues (microseconds); host
        tensors are copied inside the wrap, so those go to the executor."""
        found = False
        for mm_inputs in batch:
            for item in getattr(mm_inputs, "mm_items", None) or ():
                for field in ("feature", "precomputed_embeddings"):
                    value = getattr(item, field, None)
                    if value is None or _is_proxy(value):
                        continue
                    if not _arrays.is_device(value):
                        return False
                    found = True
        return found

    def _executor(self):
        if self._publisher_executor is None:
            import concurrent.futures
            self._publisher_executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="vmmt-sglang-publish")
        return self._publisher_executor

    async def prepare_for_dispatch_async(self, mm_inputs_batch):
        """prepare_for_dispatch without blocking the event loop: on the loop's
        thread when the batch has device tensors only, else on a one-thread
        executor. A request cancelled while its wrap runs there has its
        proxies taken back once the wrap returns."""
        batch = list(mm_inputs_batch)
        if self.pool is None or not any(m is not None and m.mm_items for m in batch):
            return []
        if self._inline(batch):
            return self.prepare_for_dispatch(batch)
        future = self._executor().submit(self.prepare_for_dispatch, batch)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # A wrap already running cannot be stopped: what it publishes is
            # never dispatched, so take it back when it finishes (on the
            # executor's thread: this loop may be gone by then).
            future.add_done_callback(self._cancel_abandoned)
            raise

    def _cancel_abandoned(self, future):
        if future.cancelled() or future.exception() is not None:
            return  # never ran, or rolled itself back
        try:
            self.cancel_for_dispatch(future.result())
        except Exception:
            logger.exception("vmmt.sglang: taking back an abandoned request's proxies failed")

    def wrap_items(self, mm_items):
        """Replace each item's tensors with proxies: the image and video
        features of a request packed in one slice where two or more are,
        each other tensor on its own. On any failure every proxy made here is
        taken back and every tensor put back, then the error is raised."""
        if self.pool is None:
            return
        updates = []
        try:
            candidates = [
                (item, item.feature) for item in mm_items
                if _modality_name(item) in _PACKED_MODALITIES and
                _is_feature(item.feature) and _arrays.numel(item.feature) > 0 and
                not (getattr(item, "model_specific_data", None) or {}).get(
                    DEFER_CUDA_IPC_FEATURE_RECONSTRUCTION_KEY, False)]
            # One slice holds one library's tensors: a group that mixes torch
            # and NumPy goes one feature at a time.
            if len(candidates) >= 2 and len({_arrays.library(t) for _, t in candidates}) == 1:
                packed = self.pool.wrap_tensors([t for _, t in candidates])
                if packed is not None:
                    for (item, tensor), proxy in zip(candidates, packed):
                        item.feature = proxy
                        updates.append((item, "feature", tensor, proxy))
            for item in mm_items:
                for field in ("feature", "precomputed_embeddings"):
                    value = getattr(item, field, None)
                    if _contains_tensor_container(value):
                        raise TypeError("CUDA VMM feature transport requires each feature field "
                                        "to contain a single tensor")
                    if not _is_feature(value):
                        continue
                    wrapped = self.pool.wrap_tensor(value)
                    setattr(item, field, wrapped)
                    updates.append((item, field, value, wrapped))
        except BaseException as error:
            failed = []
            for item, field, tensor, wrapped in reversed(updates):
                try:
                    if _is_proxy(wrapped):
                        self.pool.cancel_proxy(wrapped)
                except BaseException as rollback_error:
                    failed.append(rollback_error)
                finally:
                    setattr(item, field, tensor)
            if failed:
                if hasattr(error, "add_note"):
                    error.add_note("vmmt.sglang: %d proxy cancel(s) of the rollback failed too"
                                   % len(failed))
                raise error from failed[0]
            raise

    def cancel_for_dispatch(self, mm_items):
        """Take back the proxies of items that were not dispatched; their
        fields become None. Every proxy is tried; the first failure is raised
        after."""
        if self.pool is None or not mm_items:
            return
        errors = []
        for item in mm_items:
            for field in ("feature", "precomputed_embeddings"):
                proxy = getattr(item, field, None)
                if not _is_proxy(proxy):
                    continue
                try:
                    self.pool.cancel_proxy(proxy)
                except BaseException as error:
                    errors.append(error)
                finally:
                    setattr(item, field, None)
        if errors:
            raise RuntimeError("taking back %d CUDA VMM proxy slice(s) failed" % len(errors)) \
                from errors[0]

    def shutdown(self):
        """Shut the pool down (retryable: a failed shutdown can be called
        again); the transport keeps its pool object."""
        if self.pool is None:
            return
        executor, self._publisher_executor = self._publisher_executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        self.pool.shutdown()


# ----------------------------------------------------------------- install

TRANSPORT_MODULE = "sglang.srt.utils.cuda_vmm_transport_utils"
UTILS_MODULE = "sglang.srt.utils.cuda_vmm_utils"


class _ProbePatcher:
    """A meta path finder that lets sglang's cuda_vmm_utils load as it is
    (its group registration and allocators are still its own) and then puts
    vmmt's probe in place of its get_device_allocation_handle_type."""

    def find_spec(self, name, path=None, target=None):
        if name != UTILS_MODULE:
            return None
        import importlib.machinery
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            _patch_probe(module)

        spec.loader.exec_module = exec_then_patch
        return spec


_patcher = None


def _patch_probe(module):
    module.get_device_allocation_handle_type = get_device_allocation_handle_type


def install():
    """Make sglang's transport names resolve to this module, in this process.

    After it, ``import sglang.srt.utils.cuda_vmm_transport_utils`` gives
    vmmt.sglang, and ``sglang.srt.utils.cuda_vmm_utils`` (loaded as it is)
    has vmmt's get_device_allocation_handle_type. Limits:

    - Call it before sglang imports them: a name that sglang bound earlier
      (``from ... import CudaVmmFeatureTransport``) keeps sglang's object.
      install() raises RuntimeError if sglang's transport module is loaded.
    - It acts in this process only. sglang starts its schedulers with
      multiprocessing's spawn, which imports the launching script again in
      each child: call install() at module level of that script (not under
      ``if __name__ == "__main__"``), or from a ``sitecustomize``. The ranks
      rebuild proxies without it (a proxy's class unpickles from vmmt), but
      sglang's own isinstance checks there then see vmmt's class only
      through sglang's CUDA IPC proxy base, which vmmt's proxies subclass
      where sglang is importable.
    - Where sglang is installed, importing vmmt.sglang imports sglang's CUDA
      IPC proxy module (its proxies' base class); should that ever import
      sglang's transport module too, install() says so and raises.
    - Helpers that only sglang's tests use (the pool's raw memory, its broker
      thread) are not reproduced (see the module's docstring).

    Idempotent; uninstall() undoes it.
    """
    global _patcher
    current = sys.modules.get(TRANSPORT_MODULE)
    if current is not None and current is not sys.modules[__name__]:
        raise RuntimeError("vmmt.sglang.install(): sglang's %s is already imported, so names "
                           "bound from it stay sglang's; call install() before importing sglang"
                           % TRANSPORT_MODULE)
    sys.modules[TRANSPORT_MODULE] = sys.modules[__name__]
    if UTILS_MODULE in sys.modules:
        _patch_probe(sys.modules[UTILS_MODULE])
    elif _patcher is None:
        _patcher = _ProbePatcher()
        sys.meta_path.insert(0, _patcher)


def uninstall():
    """Undo install() for modules imported from now on (tests)."""
    global _patcher
    if sys.modules.get(TRANSPORT_MODULE) is sys.modules[__name__]:
        del sys.modules[TRANSPORT_MODULE]
    if _patcher is not None:
        sys.meta_path.remove(_patcher)
        _patcher = None
