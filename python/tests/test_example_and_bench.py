"""The example and the Python bench run end to end on the emulated driver
(their GPU runs are tests/gpu/run's): a broken script fails here first."""
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def run(args, timeout=300):
    env = dict(os.environ, VMMT_DRIVER="emu",
               PYTHONPATH=os.path.dirname(os.path.dirname(__import__("vmmt").__file__)))
    return subprocess.run([sys.executable] + args, capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def test_feature_handoff_example():
    out = run(["examples/feature_handoff.py", "--requests", "30"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "feature_handoff: ok, 30 requests" in out.stdout


def test_python_bench_smoke(tmp_path):
    path = tmp_path / "bench.json"
    out = run(["bench/python_bench.py", "--smoke", "--iters", "100", "--json", str(path)])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "added" in out.stdout and path.exists()


def test_feature_handoff_stops_with_the_processors_error():
    """Issue 17, item 9: a processor that cannot create its pool used to leave
    the main process waiting 300 s on the report queue. Now it stops with the
    processor's own error (the subprocess bound is far below those 300 s)."""
    out = run(["examples/feature_handoff.py", "--requests", "3", "--pool-bytes", "4096"],
              timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "processor failed" in out.stderr, out.stderr
    assert "memory_size=4096" in out.stderr, out.stderr


def test_rank_restart_example():
    """python/README.md's "Deaths" recipe as a program: a producer and two ranks,
    rank 1 SIGKILLed after 100 of 400 requests and restarted; the pool keeps working."""
    out = run(["examples/rank_restart.py", "--requests", "400", "--kill-at", "100"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rank_restart: ok, 400 requests, 1 restart(s)" in out.stdout, out.stdout
    # Whichever saw the death first (the pool: a record naming it; the program: the
    # process's exit), the rank was released and said so.
    assert "released rank(s) 1" in out.stderr, out.stderr
