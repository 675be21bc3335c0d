"""Helpers of the vmmt.sglang attack tests that hold rebuilds back and run
calls on other threads: a stalled legacy stream with a watchdog, the count of
consume copies enqueued, and a call on a daemon thread. Every wait is bounded
by DEADLINE."""
import pickle
import threading
import time

import emu_counters
from emu_counters import StalledStream

DEADLINE = 10.0  # seconds; generous bound of every poll


class LegacyStall:
    """emu_counters.StalledStream (a blocking stream, so the legacy default
    stream waits behind it, and with it a rebuild's copy), released by a
    watchdog after `watchdog` seconds at the latest: a test that fails still
    ends well before the emulator's 10 s limit."""

    def __init__(self, watchdog=4.0):
        self._s = StalledStream(0)
        self._timer = threading.Timer(watchdog, self._s.release)
        self._timer.daemon = True
        self._timer.start()

    def release(self):
        self._s.release()

    def close(self):
        self._timer.cancel()
        self._s.__exit__(None, None, None)


def copies():
    return emu_counters.calls("cuMemcpyDtoDAsync")


def wait_copies(before, n=1):
    """Until n more consume copies were enqueued (the rebuild's copy is then
    queued behind the stall)."""
    deadline = time.monotonic() + DEADLINE
    while copies() < before + n:
        assert time.monotonic() < deadline, "no consume copy was enqueued within %ds" % DEADLINE
        time.sleep(0.001)


class Call:
    """f() on a daemon thread, after `start` is set if given; .done(timeout),
    .value, .error, .seconds."""

    def __init__(self, f, start=None):
        self.value = self.error = None
        self.seconds = None
        self._done = threading.Event()

        def run():
            t = time.monotonic()
            try:
                if start is not None:
                    start.wait(DEADLINE)
                self.value = f()
            except BaseException as e:  # noqa: B902 - reported by the test
                self.error = e
            finally:
                self.seconds = time.monotonic() - t
                self._done.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def done(self, timeout):
        return self._done.wait(timeout)


def wire(proxy):
    """The proxy as a rank gets it: pickled and unpickled."""
    return pickle.loads(pickle.dumps(proxy))


def run_threads(threads, seconds, stop):
    """Start `threads`, let them run `seconds`, set `stop`, join each within
    30 s; True when none is left alive (none hung)."""
    try:
        for t in threads:
            t.start()
        time.sleep(seconds)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    return not any(t.is_alive() for t in threads)
