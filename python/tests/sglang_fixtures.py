"""Shared pieces of the vmmt.sglang tests: a pool fixture that leaves nothing
behind, sglang-shaped request items, and the rank process of the two-rank
test (importable by multiprocessing's spawn children)."""
import pickle
import sys
import types

import numpy as np
import pytest

import vmmt
import vmmt.sglang as vs

MiB = 1 << 20


@pytest.fixture
def fast_switch():
    """Thread switches every microsecond: more interleavings per second."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


@pytest.fixture
def clean(no_leaks):
    """Every test ends with the process's consumer closed, the default
    resolver and NUMPY_FEATURES back and the emulator's counters where they
    started."""
    previous = vs.set_rank_resolver(None)
    # NumPy stands in for torch in this suite, also where test_torch_cpu
    # has imported torch into the process.
    numpy_features, vs.NUMPY_FEATURES = vs.NUMPY_FEATURES, True
    yield
    vs.NUMPY_FEATURES = numpy_features
    vs.set_rank_resolver(previous)
    vs._imported_pool_cache_clear()


def make_pool(consumer_count=1, memory_size=4 * MiB, **kw):
    return vs.CudaVmmMemoryPool(memory_size, 60, 0, consumer_count, allow_posix_fallback=True,
                                **kw)


def settle(pool):
    """Recycle what is acknowledged; the library's recycler would within a
    millisecond, reclaim does it now."""
    pool._recycle_chunks()
    return pool.occupied_chunks


def free_bytes(pool):
    return sum(c.size for c in pool.available_chunks)


def item(feature, modality="IMAGE", embeddings=None, **specific):
    """A MultimodalDataItem's fields, as the transport reads them."""
    return types.SimpleNamespace(modality=modality, feature=feature,
                                 precomputed_embeddings=embeddings,
                                 model_specific_data=dict(specific))


def request(*items):
    """A MultimodalProcessorOutput's mm_items."""
    return types.SimpleNamespace(mm_items=list(items))


def rank_process(conn, rank, size):
    """One tensor-parallel rank: reconstructs what arrives with
    consumer_count=1 under its own layout, answers with the values; drops
    ("drop", proxy) requests without copying; stops at None."""
    vs.set_rank_resolver(vs.ParallelLayout(attn_tp_rank=rank, attn_tp_size=size))
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            kind, wire = msg
            proxy = pickle.loads(wire)
            if kind == "drop":
                proxy.release_without_reconstruction(consumer_count=1)
                conn.send(("dropped", None))
                continue
            if isinstance(proxy, list):
                got = [p.reconstruct_on_target_device(rank, consumer_count=1) for p in proxy]
                again = [p.reconstruct_on_target_device(rank, consumer_count=1) for p in proxy]
                shared = all(np.shares_memory(g, proxy[0]._packed_owner.reconstruct_tensor)
                             for g in got)
                conn.send(("packed", ([g.tolist() for g in got],
                                      all(a is g for a, g in zip(again, got)), shared)))
            else:
                t = proxy.reconstruct_on_target_device(rank, consumer_count=1)
                cached = proxy.reconstruct_on_target_device(rank, consumer_count=1) is t
                conn.send(("tensor", (t.tolist(), str(t.dtype), cached)))
    except BaseException as e:  # reported to the test, which fails with it
        conn.send(("error", "%s: %s" % (type(e).__name__, e)))
    finally:
        vs._imported_pool_cache_clear()
        conn.close()


__all__ = ["clean", "make_pool", "settle", "free_bytes", "item", "request", "rank_process",
           "MiB", "vmmt", "vs"]
