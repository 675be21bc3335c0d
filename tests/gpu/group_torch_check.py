"""GPU check of the torch.distributed group adapter (python/vmmt/group_torch.py).

Two ranks (subprocesses of this script; torch.distributed over gloo with a
file store, so no network is needed) allocate tensors with PyTorch's
expandable segments (CUDA VMM), register them, and read each other's through
the returned pointers (wrapped with __cuda_array_interface__). One tensor is
large enough to cross several of the allocator's segments. Prints the time
to register 64 tensors. Needs torch with CUDA and the vmmt package on the
path (python/tests/gpu/run builds it and calls this when torch imports).

    PYTHONPATH=<built package> python3 tests/gpu/group_torch_check.py [--spread]
"""

import os
import subprocess
import sys
import tempfile
import time

WORLD = 2


class DeviceView:
    """A raw device pointer as something torch.as_tensor takes."""

    def __init__(self, ptr, n):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3}


def rank_main(rank, store, spread):
    import torch
    import torch.distributed as dist

    dev = rank % torch.cuda.device_count() if spread else 0
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    from vmmt.group_torch import TorchGroup

    g = TorchGroup(device=dev, timeout_ms=60000)
    small = torch.full((4096,), rank + 1, dtype=torch.uint8, device="cuda")
    big = torch.full((96 << 20,), rank + 11, dtype=torch.uint8, device="cuda")  # many segments
    torch.cuda.synchronize()
    ptrs = g.register([small, big])
    ok = True
    for i, (t, base) in enumerate(((small, 1), (big, 11))):
        for r in range(WORLD):
            v = torch.as_tensor(DeviceView(ptrs[i][r], t.numel()), device="cuda")
            if not bool((v == r + base).all()):
                print(f"rank {rank}: rank {r}'s tensor {i} is wrong", flush=True)
                ok = False
    many = [torch.full((1 << 20,), rank, dtype=torch.uint8, device="cuda") for _ in range(64)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    g.register(many)
    ms = (time.perf_counter() - t0) * 1e3
    print(f"rank {rank}: device {dev}, {g.handle_type}: read peers' tensors "
          f"{'correctly' if ok else 'WRONG'}; registered 64 tensors in {ms:.1f} ms", flush=True)
    g.close()
    dist.destroy_process_group()
    return 0 if ok else 1


def main():
    spread = "--spread" in sys.argv
    if os.environ.get("GROUP_TORCH_RANK") is not None:
        return rank_main(int(os.environ["GROUP_TORCH_RANK"]), os.environ["GROUP_TORCH_STORE"],
                         spread)
    store = tempfile.mktemp(prefix="vmmt-torch-store-")
    procs = []
    for r in range(WORLD):
        env = dict(os.environ, GROUP_TORCH_RANK=str(r), GROUP_TORCH_STORE=store,
                   PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
        procs.append(subprocess.Popen([sys.executable, __file__] + sys.argv[1:], env=env))
    rc = 0
    for p in procs:
        try:
            rc = rc or p.wait(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = 1
    print("group_torch_check:", "ok" if rc == 0 else "FAILED")
    return rc


if __name__ == "__main__":
    sys.exit(main())
