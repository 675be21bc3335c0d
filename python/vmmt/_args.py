"""Argument checks: every bad argument is a TypeError (wrong kind) or a
ValueError (out of range) naming the argument and what it accepts, raised
before anything is copied, allocated or consumed."""
import operator
import os

from . import _vmmt

U32 = (1 << 32) - 1
U64 = (1 << 64) - 1
I32 = (1 << 31) - 1

ALL_RANKS = "all"  # vmmt.ALL_RANKS: consume or acknowledge for every rank of the pool


def integer(name, value, low, high, unit=""):
    """`value` as an int in [low, high]; a bool, a float or a str is a TypeError."""
    if isinstance(value, bool) or isinstance(value, float):
        raise TypeError("%s=%r: give an int of %d..%d%s" % (name, value, low, high, unit))
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError("%s=%r (%s): give an int of %d..%d%s"
                        % (name, value, type(value).__name__, low, high, unit)) from None
    if not low <= v <= high:
        raise ValueError("%s=%d is out of range: give an int of %d..%d%s"
                         % (name, v, low, high, unit))
    return v


def flag(name, value):
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise TypeError("%s=%r: give True or False" % (name, value))


def choice(name, value, choices):
    if not isinstance(value, str) or value not in choices:
        raise ValueError("%s=%r: give one of %s" % (name, value, ", ".join(map(repr, choices))))
    return value


def _size_text(n):
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return "%.1f %s" % (n / (1 << shift), unit)
    return "%d bytes" % n


_known_devices = 0


def device(value, name="device"):
    """A device number the driver has (checked where a driver loads; the call
    that follows says why when none does)."""
    global _known_devices
    if type(value) is int and 0 <= value < _known_devices:
        return value  # the hot path: a consume's device, checked before
    d = integer(name, value, 0, I32)
    try:
        driver, _, count = _vmmt.driver_info()
    except _vmmt.Error:
        return d
    _known_devices = count  # cannot change once the driver is loaded
    if d >= count:
        raise ValueError("%s=%d does not exist: the %s driver reports %d device(s); give one of "
                         "0..%d" % (name, d, driver, count, count - 1) if count else
                         "%s=%d: the %s driver reports no device" % (name, d, driver))
    return d


def memory_size(value, dev, location, elastic):
    """memory_size against what holds it: the device's memory for a device
    pool, the machine's for a host pool (an elastic pool's is only its
    limit, and reserves address space alone)."""
    size = integer("memory_size", value, 1, U64, " bytes")
    if elastic:
        return size
    if location == "host":
        try:
            have, what = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "host memory"
        except (ValueError, OSError):
            return size
    else:
        try:
            have, what = _vmmt.device_total_memory(dev), "device %d's memory" % dev
        except _vmmt.Error:
            return size  # no driver: the create says why
    if size > have:
        raise ValueError("memory_size=%d (%s) is more than %s, %d bytes (%s); give a smaller "
                         "memory_size" % (size, _size_text(size), what, have, _size_text(have)))
    return size


def _rank(value, ranks):
    """One rank as an int: an int or anything with __index__ (numpy.int64),
    never a bool (ranks=True would be rank 1)."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError("ranks=%r: give a rank (an int 0..255), ranks (a range, or a list, tuple "
                    "or set of ints), or vmmt.ALL_RANKS" % (ranks,))


def _short(value, limit=60):
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 4] + " ..."


def ranks(value):
    """(rank_first, rank_count, rank_list) from a rank, ranks, or ALL_RANKS.

    Consecutive ranks in order are the run (first, count) with rank_list
    None; any other ranks (distinct, in any order: a list, tuple, set, or
    any iterable of ints but bytes) are rank_list, a tuple the binding hands
    to vmmt_consume_ranks, which takes or acknowledges all of them or none.

    There is no default: a rank that forgot ranks= would acknowledge for
    every rank, and the next rank's consume fail with a message pointing
    elsewhere. A negative rank would reach the C API as VMMT_ALL_RANKS (-1):
    refused too."""
    if isinstance(value, str):
        if value == ALL_RANKS:
            return _vmmt.ALL_RANKS, 0, None
        raise ValueError("ranks=%r: give a rank, ranks (a range, list, tuple or set), or "
                         "vmmt.ALL_RANKS ('all')" % (value,))
    if value is None:
        raise TypeError("ranks=None: say which rank(s) this consume or ack is for (ranks=r, "
                        "ranks=range(a, b), ranks=[a, c]), or ranks=vmmt.ALL_RANKS for every "
                        "rank of the pool")
    # A range is the common case (vmmt.sglang's rebuilds ask one): no list made.
    if type(value) is range and value.step == 1 and 0 <= value.start < value.stop <= 256:
        return value.start, value.stop - value.start, None
    # Bytes iterate as ints, so b"\x02" would be rank 2: what was meant is unknowable.
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError("ranks=%s: bytes are not ranks; give a rank, ranks (a range, list, "
                        "tuple or set of ints), or vmmt.ALL_RANKS" % _short(value))
    # An integer first, even one that iterates (a NumPy 0-d array has __index__ and
    # __iter__; a 1-d one has both too, and its __index__ refuses).
    first = None
    if not isinstance(value, bool):
        try:
            first = operator.index(value)
        except TypeError:
            pass
    if first is not None or not hasattr(value, "__iter__"):
        first = _rank(value, value) if first is None else first
        if not 0 <= first <= 255:
            raise ValueError("ranks=%d is out of range: give a rank of 0..255, or "
                             "vmmt.ALL_RANKS" % first)
        return first, 1, None
    rs = [_rank(r, value) for r in value]
    if not rs:
        raise ValueError("ranks=%s: give at least one rank, or vmmt.ALL_RANKS" % _short(value))
    outside = [r for r in rs if not 0 <= r <= 255]
    if outside:
        raise ValueError("ranks=%s: rank %d (entry %d) is out of range: give ranks of 0..255, "
                         "or vmmt.ALL_RANKS" % (_short(rs), outside[0], rs.index(outside[0])))
    if len(set(rs)) != len(rs):
        twice = next(r for i, r in enumerate(rs) if r in rs[:i])
        raise ValueError("ranks=%s: rank %d is listed twice; give each rank once"
                         % (_short(rs), twice))
    if rs == list(range(rs[0], rs[0] + len(rs))):
        return rs[0], len(rs), None
    return 0, 0, tuple(rs)
