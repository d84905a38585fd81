"""What the job secret costs: init() of N ranks with a secret and without, side by side.

    python -m benchmarks.auth_setup --world 4 --runs 40
    python -m benchmarks.auth_setup --baseline-python /path/to/other/venv/bin/python   # a build without auth

Each rank runs init() / barrier / finalize() `runs` times (a fresh MASTER_PORT each time) and reports
how long each init() took; the table shows rank 0's median and the ratio to the first column. The
handshake runs at connect time only: collectives are unchanged (python -m benchmarks.allreduce).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys

WORKER = r"""
import json, os, sys, time
import pycyxwiz as cx
base, runs = int(sys.argv[1]), int(sys.argv[2])
times = []
for i in range(runs):
    os.environ["MASTER_PORT"] = str(base + i)
    t0 = time.perf_counter()
    cx.distributed.init()
    times.append(time.perf_counter() - t0)
    cx.distributed.barrier()
    cx.distributed.finalize()
if os.environ["RANK"] == "0":
    print(json.dumps(times), flush=True)
"""


def free_base(runs: int) -> int:
    """`runs` consecutive ports below the kernel's ephemeral range (where the ranks' own sockets go)."""
    while True:
        base = random.randrange(20000, 28000)
        try:
            for p in range(base, base + runs):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue


def measure(python: str, world: int, runs: int, env_extra: dict) -> list:
    base = free_base(runs)
    procs = []
    for r in range(world):
        env = {k: v for k, v in os.environ.items() if k not in ("CX_AUTH_TOKEN", "CX_AUTH_TOKEN_FILE", "CX_AUTH")}
        env.update(env_extra, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", DISTRIBUTED_TIMEOUT_MS="30000", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([python, "-c", WORKER, str(base), str(runs)], env=env,
                                      stdout=subprocess.PIPE, text=True))
    out = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a rank failed: exit codes {[p.returncode for p in procs]}")
    return json.loads(out[0])[1:]  # the first init pays for imports and page faults


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3, help="alternate the columns this many times")
    ap.add_argument("--baseline-python", default=None, help="a Python whose pycyxwiz has no job secret")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    cols = {}
    if a.baseline_python:
        cols["baseline (no auth code)"] = (a.baseline_python, {})
    cols["no secret (loopback)"] = (sys.executable, {})
    cols["with a secret"] = (sys.executable, {"CX_AUTH_TOKEN": "0123456789abcdef" * 4})
    samples = {k: [] for k in cols}
    for _ in range(a.rounds):  # interleaved, so drift on a shared machine hits every column alike
        for name, (py, extra) in cols.items():
            samples[name] += measure(py, a.world, a.runs, extra)
    first = statistics.median(next(iter(samples.values())))
    print(f"init() of {a.world} ranks on 127.0.0.1, rank 0, {a.rounds} x {a.runs - 1} runs each")
    print(f"{'':28} {'median ms':>10} {'p90 ms':>8} {'ratio':>6}")
    for name, xs in samples.items():
        med = statistics.median(xs)
        p90 = sorted(xs)[int(0.9 * (len(xs) - 1))]
        print(f"{name:28} {med * 1e3:10.2f} {p90 * 1e3:8.2f} {med / first:6.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"world": a.world, "runs": a.runs, "samples_s": samples}, f)


if __name__ == "__main__":
    main()
