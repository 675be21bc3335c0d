"""A producer process and two consumer processes (multiprocessing, spawn):
descriptors travel pickled through pipes, consumers rebuild NumPy arrays."""
import multiprocessing as mp

import pytest

import mp_workers

ZERO = {"allocations": 0, "reservations": 0, "mappings": 0, "streams": 0, "events": 0,
        "blocks": 0}


@pytest.mark.parametrize("packed", [False, True])
def test_producer_and_two_consumers(packed):
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    pipes = [ctx.Pipe() for _ in range(2)]
    count = 40
    procs = [ctx.Process(target=mp_workers.producer,
                         args=([p[0] for p in pipes], count, packed, result))]
    procs += [ctx.Process(target=mp_workers.consumer, args=(p[1], rank, result))
              for rank, p in enumerate(pipes)]
    for p in procs:
        p.start()
    try:
        reports = [result.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    errors = [r for r in reports if r[0].endswith("error")]
    assert not errors, errors
    per = 2 if packed else 1
    for r in reports:
        if r[0] == "producer":
            assert r[1] == count * per and r[2] == count
        else:
            assert r[2] == count * per
        # Each process closed what it opened: nothing alive in its emulated driver.
        # (The consumer's device-0 and device-1 contexts are not counted.)
        assert r[-1] == ZERO, r
    assert all(p.exitcode == 0 for p in procs)
