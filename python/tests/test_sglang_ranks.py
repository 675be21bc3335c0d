"""vmmt.sglang across processes: proxies pickled through pipes to two rank
processes (spawn), each reconstructing with consumer_count=1 under its own
layout; and driver failures injected into the producer's and a consumer's
copy (in child processes: they reconfigure the emulated driver)."""
import multiprocessing as mp
import pickle
import time

import numpy as np

from child import run_child
from sglang_fixtures import make_pool, rank_process, settle


def _wait_recycled(pool, timeout=30):
    """The slices come back once both ranks acknowledged; bounded, not timed."""
    deadline = time.monotonic() + timeout
    while settle(pool):
        assert time.monotonic() < deadline, "slices still in flight: %r" % pool.occupied_chunks
        time.sleep(0.01)


def test_two_rank_processes_reconstruct_acknowledge_and_recycle():
    # (No fd check: spawn's first use starts multiprocessing's resource
    # tracker, whose pipe stays open in this process for good.)
    ctx = mp.get_context("spawn")
    pool = make_pool(consumer_count=2)
    pipes = [ctx.Pipe() for _ in range(2)]
    ranks = [ctx.Process(target=rank_process, args=(child, r, 2))
             for r, (_, child) in enumerate(pipes)]
    for p in ranks:
        p.start()
    for _, child in pipes:
        child.close()  # the ranks hold theirs
    try:
        ends = [parent for parent, _ in pipes]

        def ask(message):
            for end in ends:
                end.send(message)
            answers = []
            for end in ends:
                assert end.poll(60), "a rank did not answer within 60 s"
                answers.append(end.recv())
            assert all(a[0] != "error" for a in answers), answers
            return answers

        src = np.arange(35, dtype=np.float32).reshape(5, 7)
        for _ in range(3):  # the same slice again once recycled
            wire = pickle.dumps(pool.wrap_tensor(src))
            for kind, (values, dtype, cached) in ask(("tensor", wire)):
                assert values == src.tolist() and dtype == "float32" and cached
            _wait_recycled(pool)
        sources = [np.arange(6, dtype=np.int32), np.arange(4, dtype=np.float64)]
        for kind, (values, cached, shared) in ask(("tensor", pickle.dumps(
                pool.wrap_tensors(sources)))):
            assert values == [s.tolist() for s in sources] and cached and shared
        _wait_recycled(pool)
        ask(("drop", pickle.dumps(pool.wrap_tensor(src))))  # a request dropped on both ranks
        _wait_recycled(pool)
        assert pool.stats()["in_flight"] == 0
        for end in ends:
            end.send(None)
    finally:
        for p in ranks:
            p.join(30)
            if p.is_alive():
                p.kill()
            p.join(10)
        codes = [p.exitcode for p in ranks]
        for p in ranks:
            p.close()
        for parent, _ in pipes:
            parent.close()
        pool.shutdown()
    assert codes == [0, 0]


_PRELUDE = """
import os, pickle
import numpy as np
import emu_counters, vmmt, vmmt.sglang as vs

def emu_fail(rules):
    os.environ["VMMT_EMU_FAIL"] = rules
    emu_counters._LIB.vmmt__emu_configure()

pool = vs.CudaVmmMemoryPool(4 << 20, 60, 0, 1, allow_posix_fallback=True)
"""


def test_failed_producer_copy_rolls_back_the_reservation():
    out = run_child(_PRELUDE, """
        emu_fail("cuMemcpyHtoDAsync:*:CUDA_ERROR_ILLEGAL_ADDRESS")
        try:
            pool.wrap_tensor(np.ones(16, np.float32))
        except vmmt.Error as e:
            print("refused:", e)
        else:
            raise AssertionError("the failed copy published")
        try:
            pool.wrap_tensors([np.ones(4), np.ones(4)])
        except vmmt.Error as e:
            print("packed refused")
        else:
            raise AssertionError("the failed packed copy published")
        emu_fail("")
        assert pool.occupied_chunks == [] and pool.stats()["in_flight"] == 0
        assert sum(c.size for c in pool.available_chunks) == pool.allocation_size
        t = pool.wrap_tensor(np.arange(4.0)).reconstruct_on_target_device(0)
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
        pool.shutdown()
        print("ok")
        """)
    assert "refused:" in out and out.rstrip().endswith("ok"), out


def test_consumer_copy_failure_releases_the_slice_and_refuses_a_retry():
    out = run_child(_PRELUDE, """
        proxy = pickle.loads(pickle.dumps(pool.wrap_tensor(np.ones(8, np.float32))))
        emu_fail("cuMemcpyDtoDAsync:1:CUDA_ERROR_ILLEGAL_ADDRESS")
        try:
            proxy.reconstruct_on_target_device(0, consumer_count=1)
        except vmmt.Error as e:
            print("copy failed:", e)
        else:
            raise AssertionError("the failed copy gave a tensor")
        emu_fail("")
        pool._recycle_chunks()
        assert pool.occupied_chunks == [], pool.occupied_chunks
        try:
            proxy.reconstruct_on_target_device(0, consumer_count=1)
        except RuntimeError as e:
            assert "already released" in str(e), e
        else:
            raise AssertionError("a retry was allowed")
        # The packed path drops the members after a failed one.
        packed = pickle.loads(pickle.dumps(pool.wrap_tensors([np.ones(4), np.zeros(2)])))
        emu_fail("cuMemcpyDtoDAsync:1:CUDA_ERROR_ILLEGAL_ADDRESS")
        try:
            packed[1].reconstruct_on_target_device(0)
        except vmmt.Error:
            pass
        emu_fail("")
        pool._recycle_chunks()
        assert pool.occupied_chunks == [], pool.occupied_chunks
        vs._imported_pool_cache_clear()
        pool.shutdown()
        print("ok")
        """)
    assert "copy failed:" in out and out.rstrip().endswith("ok"), out


def test_no_handle_type_names_every_cause():
    out = run_child("""
        import vmmt.sglang as vs
        try:
            vs.get_device_allocation_handle_type(0)
        except RuntimeError as e:
            print(e)
        """, VMMT_EMU_FAIL="cuMemCreate:*:CUDA_ERROR_OUT_OF_MEMORY")
    assert "no supported CUDA VMM allocation handle type" in out, out
    for name in ("FABRIC:", "POSIX_FD:", "NONE:"):
        assert name in out, out


def test_a_host_pool_producer_makes_no_cuda_context():
    out = run_child("""
        import numpy as np
        import emu_counters, vmmt.sglang as vs
        pool = vs.CudaVmmMemoryPool(4 << 20, 0.05, 0, 1, allow_posix_fallback=True, pool="host")
        proxies = [pool.wrap_tensor(np.ones(64)), *pool.wrap_tensors([np.ones(2), np.ones(3)])]
        for p in proxies:
            pool.cancel_proxy(p)
        print("contexts", emu_counters.live_contexts())
        pool.shutdown()
        """)
    assert "contexts 0" in out, out
