"""The rank process of test_sglang_gpu.py (torch.multiprocessing spawn)."""
import pickle

import gpu_common  # noqa: F401 (sys.path)
import torch

import vmmt.sglang as vs


def rank(conn, device):
    """Rebuilds each proxy on `device` with consumer_count=1 as rank 0 of 1
    and answers with the values on the CPU (or the error)."""
    torch.cuda.set_device(device)
    vs.set_rank_resolver(vs.ParallelLayout(attn_tp_rank=0, attn_tp_size=1))
    try:
        while True:
            wire = conn.recv_bytes()
            if wire == b"stop":
                break
            proxy = pickle.loads(wire)
            t = proxy.reconstruct_on_target_device(device, consumer_count=1)
            torch.cuda.synchronize(device)
            conn.send(("ok", str(t.device), t.cpu()))
    except BaseException as e:
        conn.send(("error", "%s: %s" % (type(e).__name__, e), None))
    finally:
        vs._imported_pool_cache_clear()
