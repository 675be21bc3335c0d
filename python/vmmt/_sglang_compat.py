"""vmmt.sglang's shims over the two shapes of the binding it must run on.

The binding is changing under this adapter: consume and ack will require an
explicit ``ranks`` argument, "no room" becomes a family (``vmmt.NoRoom``,
with ``PoolFull`` for "full now" and ``TooLarge`` for "never fits"), and
``publish_many`` will raise instead of returning None. Every difference is
absorbed here, in one place, so that deleting this file's fallbacks is all
it takes once the new binding is the only one.
"""
import vmmt

# Status codes of include/vmmt.h that the old binding reports as a plain
# vmmt.Error (it has no subclass for them).
_EFULL = -7
_EFAILED = -9
_ETOOBIG = -15

# The new binding's family; the old one has PoolFull only (and reports
# "never fits" as a plain Error with status -15).
NoRoom = getattr(vmmt, "NoRoom", vmmt.PoolFull)


def is_no_room(exc):
    """Whether a publish failed only for lack of room (now, or ever)."""
    if isinstance(exc, NoRoom):
        return True
    return isinstance(exc, vmmt.Error) and getattr(exc, "status", None) in (_EFULL, _ETOOBIG)


def is_quarantined(exc):
    """Whether the pool refused because an uncertain failure quarantined it."""
    return isinstance(exc, vmmt.Error) and getattr(exc, "status", None) == _EFAILED


def publish(pool, arrays, stream):
    """Descriptors for `arrays` (one: a plain publish; several: packed in
    one slice), or None when the pool has no room for them, now or ever."""
    try:
        if len(arrays) == 1:
            return [pool.publish(arrays[0], stream=stream)]
        return pool.publish_many(arrays, stream=stream)  # None from the old binding: full
    except vmmt.Error as e:
        if is_no_room(e):
            return None
        raise


def ranks(first, count):
    """The ranks argument for [first, first + count), spelled so that both
    bindings take it: consecutive ints (the new one wants ranks given
    explicitly; the old one reads None as "every rank" and refuses
    ALL_RANKS, a negative number)."""
    return range(first, first + count)
