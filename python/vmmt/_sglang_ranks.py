"""Which ranks a proxy's ``consumer_count`` argument acknowledges for.

sglang's proxies take a count, not ranks: the pool's whole consumer count
(one process acknowledging for every rank), 1 (this rank alone), or the
attention tensor-parallel size (this rank's attention group). Which ranks
those are follows from the engine's parallel layout, which a rank process
knows and a proxy does not: the engine says it through a resolver
(set_rank_resolver), and where sglang is importable its own parallel
context (sglang.srt.runtime_context.get_parallel) is the default.
"""
import operator
import threading

_resolver = None
_lock = threading.Lock()


def _index(name, value):
    """value as an int: any integer type (NumPy's and torch's too, through
    __index__, as the binding's ranks= takes them), never a bool; else a
    ValueError that says an int was wanted and what came."""
    if not isinstance(value, bool) and hasattr(type(value), "__index__"):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise ValueError("%s must be an int; got %r (%s)" % (name, value, type(value).__name__))


class ParallelLayout:
    """The attention layout of one rank, as sglang's parallel context has it:
    the rank's place in its attention tensor-parallel group, the group's
    size, and which context-parallel group it is (each group's ranks are
    consecutive, group after group)."""

    __slots__ = ("attn_tp_rank", "attn_tp_size", "attn_cp_rank")

    def __init__(self, attn_tp_rank=0, attn_tp_size=1, attn_cp_rank=0):
        for name, value, low in (("attn_tp_rank", attn_tp_rank, 0),
                                 ("attn_tp_size", attn_tp_size, 1),
                                 ("attn_cp_rank", attn_cp_rank, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError("%s=%r; give an int of at least %d" % (name, value, low))
        if attn_tp_rank >= attn_tp_size:
            raise ValueError("attn_tp_rank=%d is outside an attention group of %d ranks"
                             % (attn_tp_rank, attn_tp_size))
        self.attn_tp_rank, self.attn_tp_size, self.attn_cp_rank = (attn_tp_rank, attn_tp_size,
                                                                   attn_cp_rank)

    def __repr__(self):
        return "ParallelLayout(attn_tp_rank=%d, attn_tp_size=%d, attn_cp_rank=%d)" % (
            self.attn_tp_rank, self.attn_tp_size, self.attn_cp_rank)


def set_rank_resolver(resolver):
    """Say how this process's ranks are found; returns the previous resolver.

    resolver: a ParallelLayout (or any object with attn_tp_rank,
    attn_tp_size and attn_cp_rank), a callable returning one (asked at every
    acknowledgement, so a process serving several ranks in turn can answer
    for the current one), or None for the default (sglang's parallel
    context where sglang is importable).
    """
    global _resolver
    if resolver is not None and not callable(resolver) and not _is_layout(resolver):
        raise TypeError("resolver must be a ParallelLayout, an object with attn_tp_rank, "
                        "attn_tp_size and attn_cp_rank, a callable returning one, or None; "
                        "got %r" % type(resolver).__name__)
    with _lock:
        previous, _resolver = _resolver, resolver
    return previous


def _is_layout(x):
    return all(hasattr(x, n) for n in ParallelLayout.__slots__)


def _sglang_layout():
    try:
        from sglang.srt.runtime_context import get_parallel
    except Exception as e:  # not installed, or an sglang without a parallel context
        raise RuntimeError(
            "consumer_count selects ranks by the engine's parallel layout, and none is known: "
            "call vmmt.sglang.set_rank_resolver(vmmt.sglang.ParallelLayout(attn_tp_rank=..., "
            "attn_tp_size=...)) in each rank process, or pass consumer_count equal to the "
            "pool's consumer count (sglang's parallel context is not importable: %s)" % e) from e
    return get_parallel()


def _layout():
    resolver = _resolver
    if resolver is None:
        return _sglang_layout()
    return resolver() if callable(resolver) and not _is_layout(resolver) else resolver


def resolve(consumer_count, total, consumer_rank=None):
    """(first, count): the ranks that `consumer_count` selects among `total`.

    Like sglang's proxies: None means 1; `total` means every rank; 1 means
    this rank (`consumer_rank` when given, else the layout's); the attention
    group's size means this rank's group. Anything else is a ValueError,
    and so is a group that does not fit in `total`.
    """
    consumer_count = 1 if consumer_count is None else _index("consumer_count", consumer_count)
    if consumer_count <= 0:
        raise ValueError("consumer_count must be positive; got %d" % consumer_count)
    if consumer_count == total:
        return 0, total
    if consumer_count == 1 and consumer_rank is not None:
        consumer_rank = _index("consumer_rank", consumer_rank)
        if not 0 <= consumer_rank < total:
            raise ValueError("consumer_rank=%d is outside consumer_count=%d"
                             % (consumer_rank, total))
        return consumer_rank, 1
    layout = _layout()
    start = layout.attn_cp_rank * layout.attn_tp_size
    end = start + layout.attn_tp_size
    if not 0 <= start < end <= total:
        raise ValueError("attention group range [%d, %d) is outside consumer_count=%d"
                         % (start, end, total))
    if consumer_count == 1:
        return start + layout.attn_tp_rank, 1
    if consumer_count == layout.attn_tp_size:
        return start, layout.attn_tp_size
    raise ValueError("consumer_count must be 1, the attention TP size (%d), or the full consumer "
                     "count (%d); got %d" % (layout.attn_tp_size, total, consumer_count))


def chosen(consumer_count, total, consumer_rank=None, acknowledge_ranks=None):
    """The ranks a call consumes or acknowledges for, as the binding's ranks=
    takes them: `acknowledge_ranks` when given (sglang's newer proxies name
    the ranks outright; any order, each once, each below `total`), as a
    tuple, which the binding takes or acknowledges whole or not at all
    (vmmt_consume_ranks); else the range that `consumer_count` selects
    (resolve)."""
    if acknowledge_ranks is None:
        first, count = resolve(consumer_count, total, consumer_rank)
        return range(first, first + count)
    if isinstance(acknowledge_ranks, (str, bytes, bytearray, memoryview)) or \
            not hasattr(acknowledge_ranks, "__iter__"):
        raise ValueError("acknowledge_ranks must be a list of ranks (ints); got %r (%s)"
                         % (acknowledge_ranks, type(acknowledge_ranks).__name__))
    given = [_index("each of acknowledge_ranks", r) for r in acknowledge_ranks]
    if not given or len(set(given)) != len(given) or any(not 0 <= r < total for r in given):
        raise ValueError("acknowledge_ranks=%r: give distinct ranks 0..%d"
                         % (acknowledge_ranks, total - 1))
    if consumer_rank is not None:
        _index("consumer_rank", consumer_rank)
    return tuple(given)
