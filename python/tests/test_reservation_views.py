"""A Reservation's views never outlive its slice (issue 16, item 11): commit,
cancel and the pool's close release the memoryviews memoryview() handed out
(using one afterwards raises ValueError), and while any other view is alive
(a from_dlpack array, a slice or array made from a memoryview) they raise
BufferError and do nothing else."""
import numpy as np
import pytest

import vmmt
from child import run_child

LOCATIONS = ["host", "device"]  # the emulator's device memory is host memory: both have memoryview()


@pytest.mark.parametrize("location", LOCATIONS)
def test_views_used_after_close_raise_instead_of_faulting(location):
    """Failed before the fix: close() unmapped the slice under a live
    from_dlpack array, memoryview and slice of it, and the write through
    them killed the child (SIGSEGV)."""
    out = run_child("""
        import numpy as np, vmmt
        pool = vmmt.Pool(memory_size=4 << 20, memory_location=%r)
        r = pool.reserve(4096)
        arr = np.from_dlpack(r)
        mv = r.memoryview()
        part = mv[8:16]
        try:
            pool.close()
        except BufferError as e:
            print("refused:", e)
        part[0] = 3  # before the fix: a fault here, the slice was unmapped
        assert arr[8] == 3 and not pool.closed  # (NumPy's from_dlpack arrays are read-only)
        try:
            mv[0] = 2
            raise SystemExit("a memoryview outlived close()")
        except ValueError as e:  # released by close(), refused or not
            print("released:", e)
        del arr, part
        pool.close()
    """ % location)
    assert "refused:" in out and "view" in out and "released:" in out, out


@pytest.mark.parametrize("location", LOCATIONS)
def test_commit_and_cancel_refuse_while_views_live(no_leaks, location):
    """A view written after commit changed what consumers read, and after
    cancel a slice that another publish may hold. Failed before the fix:
    commit with a from_dlpack array alive returned a descriptor."""
    with vmmt.Pool(memory_size=4 << 20, memory_location=location) as pool, \
            vmmt.Consumer() as consumer:
        r = pool.reserve(64)
        arr = np.from_dlpack(r)
        with pytest.raises(BufferError, match="view"):
            pool.commit(r)
        with pytest.raises(BufferError, match="view"):
            pool.cancel(r)
        del arr
        mv = r.memoryview()
        mv[:64] = b"abcd" + b"\5" * 60
        d = pool.commit(r, "uint8", (64,))  # the memoryview alone: released by the commit
        with pytest.raises(ValueError, match="released"):
            mv[0] = 0
        got = bytes(np.from_dlpack(consumer.consume(d, ranks=0)))
        assert got == b"abcd" + b"\5" * 60
        # What a memoryview() gave lives on in its slices and arrays.
        r = pool.reserve(64)
        part = r.memoryview()[:8]
        wide = np.frombuffer(r.memoryview(), np.float32)
        with pytest.raises(BufferError, match="view"):
            pool.cancel(r)
        del part
        with pytest.raises(BufferError, match="view"):
            pool.cancel(r)
        del wide
        pool.cancel(r)
        pool.drain(5000)


def test_view_of_a_dropped_reservation_still_holds_close(no_leaks):
    """A view keeps its Reservation alive, so close() sees it even when the
    Reservation itself was dropped."""
    import warnings
    pool = vmmt.Pool(memory_size=4 << 20)
    arr = np.from_dlpack(pool.reserve(64))
    with pytest.raises(BufferError, match="view"):
        pool.close()
    assert arr.sum() >= 0  # still mapped
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        del arr
    pool.close()
