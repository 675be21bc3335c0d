"""vmmt.Group (python/src/group.c) used as a careless user or an attacker
would: bad arguments, an all-gather that raises or lies, calls after close,
calls from inside the all-gather, a forked child, groups dropped or caught in
a reference cycle. Every case is an exception naming the mistake, and
nothing is left behind (the emulator's live objects and this process's fds
are counted around each test).

Before the C type, the group was a ctypes mirror (group_torch.py): Group did
not exist; the mirror took any value ctypes could convert (rank="0" was a
ctypes error, a float device was truncated), and nothing refused a call
after close but a NULL handle passed to C.
"""
import ctypes
import gc
import os
import threading
import weakref

import pytest

import vmmt
from vmmt import group_torch

GRAN = 2 << 20  # the emulator's default granularity


def one(data):
    """The all-gather of a world of one rank."""
    return [data]


def test_group_is_exported():
    assert vmmt.Group is vmmt._vmmt.Group


def test_world_of_one_round_trip(no_leaks):
    with vmmt.Group(0, 1, one) as g:
        assert (g.rank, g.world_size, g.device, g.handle_type) == (0, 1, 0, "posix_fd")
        ptr = g.alloc(3 * GRAN, chunks=3)
        ctypes.memset(ptr, 7, 3 * GRAN)  # the emulator's device memory is host memory
        ptrs = g.register([(ptr + 100, 3 * GRAN - 200)])
        assert ptrs == [[ptr + 100]]
        assert g.counts == {"buffers": 1, "peer_allocations": 0}
        assert "rank 0 of 1 on device 0, posix_fd handles, Python all-gather, 1 buffer(s)" in repr(g)
        g.free(ptr)
    assert g.closed and repr(g) == "<vmmt.Group closed>"


@pytest.mark.parametrize("args, kw, exc, message", [
    ((2, 2, one), {}, ValueError, "Group: rank=2 is outside 0..1"),
    ((-1, 2, one), {}, ValueError, "Group: rank=-1 is outside 0..1"),
    ((0, 0, one), {}, ValueError, "Group: world_size=0 is outside 1..4096"),
    ((0, 5000, one), {}, ValueError, "Group: world_size=5000 is outside 1..4096"),
    ((0, 2 ** 70, one), {}, ValueError, "Group: world_size=1180591620717411303424 is outside"),
    (("0", 1, one), {}, TypeError, "Group: rank must be an int, not str"),
    ((0, 1.0, one), {}, TypeError, "Group: world_size must be an int, not float"),
    ((True, 1, one), {}, TypeError, "Group: rank must be an int, not bool"),
    ((0, 1, one), {"device": -1}, ValueError, "Group: device=-1 is outside 0..4095"),
    ((0, 1, one), {"device": 0.5}, TypeError, "Group: device must be an int, not float"),
    ((0, 1, one), {"timeout_ms": 0}, ValueError, "Group: timeout_ms=0 is outside 1..2147483647"),
    ((0, 1, one), {"max_allocations": 0}, ValueError, "Group: max_allocations=0 is outside"),
    ((0, 1, one), {"handle_type": "nvlink"}, ValueError,
     "Group: handle_type='nvlink'; use 'auto', 'fabric' or 'posix_fd'"),
    ((0, 1, one), {"handle_type": 1}, TypeError, "Group: handle_type must be 'auto', 'fabric' or"),
    ((0, 1, "gather"), {}, TypeError, "Group: all_gather must be callable, not str"),
    ((0, 1), {}, TypeError, "give all_gather (a collective"),
    ((0, 1, one), {"job": "j"}, TypeError, "not both or neither"),
    ((0, 1), {"job": 5}, TypeError, "Group: job must be a str or None, not int"),
    ((0, 1, one), {"socket_dir": b"/tmp"}, TypeError, "Group: socket_dir must be a str or None"),
    ((0, 1, one), {"socket_dir": "/" + "d" * 90}, ValueError, "is longer than 80 bytes"),
    ((0, 1), {"job": "j" * 86}, ValueError, "85"),
])
def test_bad_arguments(no_leaks, args, kw, exc, message):
    with pytest.raises(exc) as e:
        vmmt.Group(*args, **kw)
    assert message in str(e.value)


def test_bad_device_names_it(no_leaks):
    """A device that does not exist: the error names it (the library's probe)."""
    with pytest.raises(vmmt.Error) as e:
        vmmt.Group(0, 1, one, device=7)
    assert "device 7" in str(e.value)


@pytest.mark.parametrize("buffers, exc, message", [
    (5, TypeError, "Group.register: buffers must be a sequence of (device pointer, bytes) pairs"),
    ([5], TypeError, "Group.register: buffers[0] must be a (device pointer, bytes) pair"),
    (["ab"], TypeError, "buffers[0] must be a (device pointer, bytes) pair"),
    ([(1, 2, 3)], TypeError, "buffers[0] must be a (device pointer, bytes) pair"),
    ([(0, 10)], ValueError, "Group.register: buffers[0][0] (pointer)=0 is outside 1.."),
    ([(-4, 10)], ValueError, "buffers[0][0] (pointer)=-4 is outside"),
    ([(4096, 0)], ValueError, "Group.register: buffers[0][1] (bytes)=0 is outside 1.."),
    ([(4096, 1.5)], TypeError, "buffers[0][1] (bytes) must be an int, not float"),
    ([(4096, 2 ** 64)], ValueError, "buffers[0][1] (bytes)=18446744073709551616 is outside"),
    ([(4096, 10)] * 65537, ValueError, "Group.register: 65537 buffers; at most 65536 a call"),
])
def test_register_bad_buffers(no_leaks, buffers, exc, message):
    with vmmt.Group(0, 1, one) as g:
        with pytest.raises(exc) as e:
            g.register(buffers)
        assert message in str(e.value)
        # Refused before the collective: the group is still usable.
        assert g.register([]) == []


def test_register_memory_that_is_no_vmm_allocation(no_leaks):
    with vmmt.Group(0, 1, one) as g:
        buf = ctypes.create_string_buffer(4096)
        with pytest.raises(vmmt.Error) as e:
            g.register([(ctypes.addressof(buf), 4096)])
        assert "buffer 0" in str(e.value)


def test_alloc_and_free_bad(no_leaks):
    with vmmt.Group(0, 1, one) as g:
        with pytest.raises(ValueError, match=r"Group.alloc: nbytes=0 is outside 1\.\."):
            g.alloc(0)
        with pytest.raises(ValueError, match=r"nbytes=-1 is outside"):
            g.alloc(-1)
        with pytest.raises(TypeError, match="Group.alloc: nbytes must be an int, not str"):
            g.alloc("1M")
        with pytest.raises(ValueError, match=r"Group: chunks=0 is outside 1\.\.1024"):
            g.alloc(GRAN, chunks=0)
        with pytest.raises(ValueError, match=r"Group.free: ptr=0 is outside"):
            g.free(0)
        with pytest.raises(ValueError):  # not an allocation of this group: the library says so
            g.free(4096)
        p = g.alloc(GRAN)
        g.free(p)
        with pytest.raises(ValueError):  # freed twice
            g.free(p)


def test_use_after_close(no_leaks):
    g = vmmt.Group(0, 1, one)
    p = g.alloc(GRAN)
    g.close()
    g.close()  # idempotent
    for call in (lambda: g.register([]), lambda: g.alloc(GRAN), lambda: g.free(p),
                 lambda: g.rank, lambda: g.world_size, lambda: g.device, lambda: g.handle_type,
                 lambda: g.counts):
        with pytest.raises(vmmt.Error) as e:
            call()
        assert e.value.status == -10 and "closed" in str(e.value)
    assert g.closed
    with pytest.raises(RuntimeError, match="called twice"):
        g.__init__(0, 1, one)


def test_init_twice_refused(no_leaks):
    with vmmt.Group(0, 1, one) as g:
        with pytest.raises(RuntimeError, match="Group.__init__ called twice"):
            g.__init__(0, 1, one)
        assert g.register([]) == []


class Liar:
    """An all-gather that answers wrong once asked `after` times."""

    def __init__(self, answer, after=0):
        self.answer, self.after, self.calls = answer, after, 0

    def __call__(self, data):
        self.calls += 1
        if self.calls > self.after:
            return self.answer(data)
        return [data]


@pytest.mark.parametrize("answer, cause, message", [
    (lambda d: 1 / 0, ZeroDivisionError, "raised ZeroDivisionError: division by zero"),
    (lambda d: [d, d], ValueError, "all_gather returned 2 blocks; the group has 1 ranks"),
    (lambda d: [], ValueError, "all_gather returned 0 blocks"),
    (lambda d: [d[:-1]], ValueError, "block 0 is %d bytes; every block must be the"),
    (lambda d: [d + b"x"], ValueError, "every block must be the"),
    (lambda d: 7, TypeError, "all_gather's result must be a sequence of bytes, one per rank, not "
                             "int"),
    (lambda d: d, TypeError, "not bytes"),
    (lambda d: [7], TypeError, "cannot convert 'int' object to bytes"),
    (lambda d: None, TypeError, "not NoneType"),
])
def test_all_gather_misbehaves_at_creation(no_leaks, answer, cause, message):
    liar = Liar(answer)
    with pytest.raises(vmmt.Error) as e:
        vmmt.Group(0, 1, liar)
    text = str(e.value)
    assert "vmmt_group_create(rank=0, world_size=1)" in text and "all-gather" in text
    assert message.split("%d")[0] in text, text
    # The all-gather's own exception is the cause, with its traceback.
    assert isinstance(e.value.__cause__, cause)
    # The failed group let go of its all-gather.
    ref = weakref.ref(liar)
    del liar, e
    gc.collect()
    assert ref() is None


def test_all_gather_misbehaves_at_register(no_leaks):
    liar = Liar(lambda d: [d, d], after=1)  # the hello is right, registration's exchange is not
    g = vmmt.Group(0, 1, liar)
    p = g.alloc(GRAN)
    with pytest.raises(vmmt.Error) as e:
        g.register([(p, GRAN)])
    assert isinstance(e.value.__cause__, ValueError)
    assert "all_gather returned 2 blocks" in str(e.value)
    # The ranks may be out of step now: every later collective says so.
    with pytest.raises(vmmt.Error, match="an earlier collective"):
        g.register([(p, GRAN)])
    g.close()


def test_call_from_inside_the_all_gather(no_leaks):
    """A group is not thread-safe: a call while one runs is refused, not interleaved."""
    holder = []

    def gather(data):
        if holder:
            holder[0].alloc(GRAN)
        return [data]

    g = vmmt.Group(0, 1, gather)
    holder.append(g)
    with pytest.raises(vmmt.Error) as e:
        g.register([])
    assert isinstance(e.value.__cause__, vmmt.Error)
    assert "another call on this group is running" in str(e.value.__cause__)
    g.close()
    holder.clear()


def test_call_from_another_thread_is_refused(no_leaks):
    """register() waits in the all-gather without the GIL held by the library:
    another thread's call is refused, and its close() waits for register()."""
    entered, release, armed, done = threading.Event(), threading.Event(), [], []

    def gather(data):
        if armed:
            entered.set()
            release.wait(30)  # a bound, not a timing assumption
        return [data]

    g = vmmt.Group(0, 1, gather)
    p = g.alloc(GRAN)
    armed.append(1)
    t = threading.Thread(target=lambda: done.append(g.register([(p, GRAN)])))
    t.start()
    assert entered.wait(30)
    with pytest.raises(vmmt.Error, match="another call on this group is running"):
        g.alloc(GRAN)
    g.close()  # deferred until register() returns
    assert g.closed
    release.set()
    t.join(30)
    assert not t.is_alive() and done == [[[p]]]
    with pytest.raises(vmmt.Error, match="closed"):
        g.register([])


def test_close_inside_all_gather_waits_for_the_call(no_leaks):
    box = {}

    def gather(data):
        if "g" in box:
            box["g"].close()
            assert box["g"].closed
        return [data]

    g = vmmt.Group(0, 1, gather)
    box["g"] = g
    assert g.register([]) == []  # the call finishes, then the group is destroyed
    assert g.closed
    with pytest.raises(vmmt.Error, match="closed"):
        g.alloc(GRAN)
    box.clear()


def test_dropped_without_close(no_leaks):
    g = vmmt.Group(0, 1, one)
    p = g.alloc(4 * GRAN, chunks=4)
    g.register([(p, 4 * GRAN)])
    del g  # the finalizer gives back the allocation, its mappings and handles


def test_cycle_through_the_all_gather_is_collected(no_leaks):
    """The all-gather holds the group (a bound method of its owner): the GC
    breaks the cycle and the group is destroyed."""

    class Owner:
        def __init__(self):
            self.group = vmmt.Group(0, 1, self.gather)
            self.ptr = self.group.alloc(GRAN)

        def gather(self, data):
            return [data]

    o = Owner()
    ref = weakref.ref(o)
    del o
    gc.collect()
    assert ref() is None


def test_forked_child_cannot_use_it(no_leaks):
    g = vmmt.Group(0, 1, one)
    p = g.alloc(GRAN)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its copy is the parent's, refused
        code = 0
        try:
            g.alloc(GRAN)
            code = 1
        except vmmt.Error as e:
            code = 0 if "belongs to process %d" % os.getppid() in str(e) else 2
        os.write(w, bytes([code]))
        os._exit(code)
    os.close(w)
    code = os.read(r, 1)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert code == b"\0" and os.waitstatus_to_exitcode(status) == 0
    # The parent's group is untouched by the child.
    ctypes.memset(p, 1, GRAN)
    assert g.register([(p, GRAN)]) == [[p]]
    g.close()


def test_bytes_group_adapter(no_leaks):
    """vmmt.group_torch over the C type: tensors (data_ptr) and pairs, close, repr."""

    class FakeTensor:
        def __init__(self, ptr, n):
            self.ptr, self.n = ptr, n

        def data_ptr(self):
            return self.ptr

        def numel(self):
            return self.n

        def element_size(self):
            return 4

    with group_torch.BytesGroup(0, 1, one) as g:
        p = g.alloc(GRAN)
        assert g.register([FakeTensor(p, GRAN // 4), (p, 64)]) == [[p], [p]]
        assert repr(g).startswith("<BytesGroup rank 0 of 1")
        assert g.handle_type == "posix_fd" and not g.closed
    assert g.closed
    with pytest.raises(vmmt.Error, match="closed"):
        g.register([])
    assert group_torch.Error is vmmt.Error
