#!/usr/bin/env python3
"""Runs the outsider consumer (client.py, written from the docs alone) against
the real library's producer on every pool kind the docs describe, and prints
"outsider: N of M buffers verified on K pool kinds".

usage: tests/outsider/run_outsider.py [--buffers N] [--seed S] [--only a,b]
Needs: build/libvmmt_emu.so (make), and the Python binding built into
VMMT_PYLIB (default /tmp/vmmt-lib-outsider: cd python && python3 setup.py
build --build-lib /tmp/vmmt-lib-outsider). Runs with /usr/bin/python3 (NumPy).
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# scenario -> pool kind
KINDS = {
    "fixed-host-table": "fixed, host control table",
    "fixed-host-table-path": "fixed, host control table",
    "fixed-device-table": "fixed, device control table",
    "elastic": "elastic",
    "host": "host pool",
    "fabric": "FABRIC (device table)",
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--buffers", type=int, default=120, help="buffers per scenario")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    pylib = os.environ.get("VMMT_PYLIB", "/tmp/vmmt-lib-outsider")
    emu = os.path.join(ROOT, "build", "libvmmt_emu.so")
    if not os.path.exists(emu):
        sys.exit(f"{emu} missing: run make first")
    if not os.path.exists(os.path.join(pylib, "vmmt")):
        sys.exit(f"no vmmt binding under {pylib}: cd python && python3 setup.py build "
                 f"--build-lib {pylib}")
    env = dict(os.environ, PYTHONPATH=pylib, VMMT_DRIVER="emu", OUTSIDER_DRIVER=emu)
    names = [n for n in KINDS if not args.only or n in args.only.split(",")]
    total = ok = 0
    kinds_ok = set()
    failed = False
    for i, name in enumerate(names):
        p = subprocess.run([sys.executable, os.path.join(HERE, "producer.py"), name,
                            str(args.buffers), str(args.seed + i)],
                           env=env, capture_output=True, text=True, timeout=300)
        line = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
        try:
            s = json.loads(line)
        except ValueError:
            print(f"{name}: producer failed (rc {p.returncode})\n{p.stdout}\n{p.stderr}")
            failed = True
            continue
        good = (s["buffers_verified"] == s["buffers"] and s["in_flight"] == 0
                and s["recycled"] == s["slices"] + (s["death"] or {}).get("extra_slices", 0)
                and s["failure_count"] == 0
                and s["refusals_ok"] == s["refusals_expected"]
                and all(rc == 0 for rc in s["client_rc"]))
        dth = s.get("death")
        if dth is not None:
            good = good and dth["first_consume_ok"] and dth["in_flight_after"] == 0 \
                and dth["released_slices"] == 3 and dth["dead_ranks"] == [0]
        total += s["buffers"]
        ok += s["buffers_verified"]
        if good:
            kinds_ok.add(KINDS[name])
        else:
            failed = True
        print(f"{name:24s} {s['buffers_verified']:4d}/{s['buffers']:<4d} buffers "
              f"({s['consumes_verified']} consumes in {s['consumer_processes']} process(es)), "
              f"{s['slices']} slices ({s['packed_groups']} packed), "
              f"{s['pending_slices']} gated PENDING ({s['consumes_that_waited']} waits), "
              f"recycled {s['recycled']}, in_flight {s['in_flight']}, "
              f"refusals {s['refusals_ok']}/{s['refusals_expected']}, "
              f"table {'host' if s['host_control_table'] else 'device'}, "
              f"{s['handle_type']}, {s['memory_location']}, links {s['consumer_links_seen']}"
              + (f", chunks made {s['chunks_made']} released {s['chunks_released']}"
                 f" imported {sum(c['chunk_imports'] for c in s['client_stats'] if c)}"
                 f", {sum(c['multi_chunk'] for c in s['client_stats'] if c)} buffers"
                 f" spanning chunks" if s["chunks_made"] else "")
              + ("" if good else "  FAILED"))
        if dth is not None:
            print(f"{'':24s} killed consumer: {dth}")
        print(f"{'':24s} publishes that found the pool full and waited for the "
              f"outsiders' acks: {s['full_waits']}")
        if s["failures"]:
            for f in s["failures"]:
                print("   ", f)
        if p.stderr.strip():
            for ln in p.stderr.strip().splitlines()[:5]:
                print("    stderr:", ln)
    print(f"outsider: {ok} of {total} buffers verified on {len(kinds_ok)} pool kinds")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
