"""get_device_allocation_handle_type, sglang's handle-type probe, on vmmt.probe.

vmmt's probe already does what sglang's does, by a real allocation of one
granularity unit per candidate (FABRIC, then POSIX_FD, then NONE), and keeps
each candidate's cause; this turns its answer into sglang's: the first
candidate whose allocation works, as the CUDA enum value, cached per device,
or RuntimeError("no supported CUDA VMM allocation handle type: ...") naming
every candidate's cause.
"""
import enum
import threading

import vmmt


class HandleType(enum.IntEnum):
    """CUmemAllocationHandleType's values: equal to the ints (and to the enum
    of cuda.bindings) that sglang compares them with."""
    NONE = 0
    POSIX_FD = 1
    FABRIC = 8


_NAMES = {"fabric": HandleType.FABRIC, "posix_fd": HandleType.POSIX_FD, "none": HandleType.NONE}
_cache = {}
_lock = threading.Lock()


def _device_entry(device_id):
    info = vmmt.probe(device_id)
    if info.get("driver") is None:
        raise RuntimeError("no supported CUDA VMM allocation handle type: no CUDA driver: %s"
                           % info.get("error"))
    return info["devices"][0]


def probe_device(device_id):
    """(handle type, {name: granularity}) of a device, cached (sglang's @cache)."""
    device_id = int(device_id)
    with _lock:
        hit = _cache.get(device_id)
    if hit is not None:
        return hit
    entry = _device_entry(device_id)
    granularity = {c["type"]: c["granularity_recommended"] for c in entry["handle_types"]}
    causes = []
    for candidate in entry["handle_types"]:  # FABRIC, POSIX_FD, NONE: the probe's order
        if candidate["works"]:
            hit = (_NAMES[candidate["type"]], granularity)
            with _lock:
                _cache[device_id] = hit
            return hit
        causes.append("%s: %s" % (candidate["type"].upper(), candidate["cause"]))
    # Not cached, as sglang's functools.cache keeps no exception: a driver
    # fixed meanwhile (an IMEX channel made) is seen at the next call.
    raise RuntimeError("no supported CUDA VMM allocation handle type on device %d: %s"
                       % (device_id, "; ".join(causes)))


def get_device_allocation_handle_type(device_id):
    """The best VMM handle type device `device_id` really supports, probed by
    allocation once per device: HandleType.FABRIC, POSIX_FD or NONE."""
    return probe_device(device_id)[0]


def cache_clear():
    with _lock:
        _cache.clear()


get_device_allocation_handle_type.cache_clear = cache_clear  # as functools.cache's
