"""bench/sglang_handoff.py and bench/sglang_steps.py run end to end on the
emulated driver (their GPU runs are tests/gpu/run's): a broken script fails
here first."""
import json
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _env():
    return dict(os.environ, VMMT_DRIVER="emu",
                PYTHONPATH=os.path.dirname(os.path.dirname(__import__("vmmt").__file__)))


def test_sglang_steps_bench_smoke():
    out = subprocess.run([sys.executable, "bench/sglang_steps.py", "--smoke"],
                         capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("  ")]
    # Every step of both pools was timed (NumPy: no torch-only steps).
    assert len(rows) == 16 and all(float(r.split()[-2]) > 0 for r in rows), out.stdout
    # How the publishes went: NumPy sources are host memory, which no kernel reads.
    assert "publishes as one kernel: device pool 0 of " in out.stdout, out.stdout


def test_sglang_handoff_bench_smoke(tmp_path):
    path = tmp_path / "sglang.json"
    env = _env()
    out = subprocess.run([sys.executable, "bench/sglang_handoff.py", "--smoke", "--json",
                          str(path)], capture_output=True, text=True, timeout=300, env=env,
                         cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(path.read_text())
    rows = report["rows"]
    assert [r["nbytes"] for r in rows] == [4096, 1 << 20]
    assert all(r["pipe"]["n"] > 0 and r["floor"]["n"] > 0 for r in rows)
    # wrap_tensor was timed after the call sequence alone, as often as that was.
    assert all(r["wrap_after_pipe"]["n"] == r["pipe"]["n"] for r in rows)
    # The rank's buffer cache answered (a miss per new size and pool kind at most).
    assert report["rank_cache"]["hits"] > 0 and 0 <= report["rank_cache"]["misses"] <= 4
    assert all(r[p]["n"] > 0 and r[p]["recycle"]["n"] > 0 for r in rows for p in ("device", "host"))
    assert all(r[p]["parts"][k]["n"] > 0 for r in rows for p in ("device", "host")
               for k in ("wrap", "unpickle", "reconstruct", "sync"))
