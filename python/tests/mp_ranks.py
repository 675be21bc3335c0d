"""Rank processes for test_rank_restart.py (started with spawn: importable).

A rank consumes each descriptor it is sent for its own rank, checks the
values and answers with the request number. ("hold",) makes it stop reading
its pipe (a rank stuck or about to die, holding what it was sent)."""
import time

import numpy as np

import vmmt


def payload(i):
    return np.arange(256, dtype=np.int32) * 3 + i


def rank_main(conn, rank):
    with vmmt.Consumer() as consumer:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            if msg[0] == "hold":
                conn.send(("holding", rank))
                while True:  # until killed
                    time.sleep(1)
            i, desc = msg
            got = np.from_dlpack(consumer.consume(desc, ranks=rank))
            conn.send((i, bool(np.array_equal(got, payload(i)))))
