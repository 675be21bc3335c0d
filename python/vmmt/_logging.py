"""The library's log lines as records of the ``logging`` logger "vmmt", and
the records that name a pool whose ranks were found dead.

The C side (python/src/log_bridge.c) queues each line and has the
interpreter's main thread deliver it here, so no library thread ever waits
for the GIL. Routing is on from import; ``vmmt.log_to_stderr()`` gives the
lines back to the library's own writer (stderr, filtered by VMMT_LOG), as
does the interpreter's exit.
"""
import atexit
import logging
import weakref

from . import _vmmt

logger = logging.getLogger("vmmt")

# vmmt_log_level -> logging level
_LEVELS = (logging.ERROR, logging.WARNING, logging.INFO, logging.DEBUG)

# Pools whose deaths a line may announce (Pool.__init__ adds itself).
_pools = weakref.WeakSet()

# The library's lines that follow a rank found dead (release.c).
_DEATH_WORDS = ("died holding", "consumer_lease_ms")


def _dispatch(level, message):
    logger.log(_LEVELS[level] if 0 <= level < len(_LEVELS) else logging.WARNING, "%s", message)
    if any(w in message for w in _DEATH_WORDS):
        for pool in list(_pools):
            pool._note_deaths()


def route():
    """Send the library's log lines to the logger "vmmt" (the default from import)."""
    _vmmt._log_route(_dispatch)


def to_stderr():
    """Give the library's log lines back to its own writer (stderr, VMMT_LOG's level)."""
    _vmmt._log_route(None)


def drain():
    """Deliver the lines queued so far, on this thread."""
    _vmmt._log_drain()


route()
atexit.register(to_stderr)
