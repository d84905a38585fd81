"""Against MPI on its own benchmark: the OSU Micro-Benchmarks (OMB), mpi4py and pycyxwiz side by side.

    python -m benchmarks.osu                                  # every test, 2 and 4 ranks, OMB's default sizes
    python -m benchmarks.osu --tests latency allreduce --worlds 2 --rounds 3
    python -m benchmarks.osu --omb /path/to/osu-micro-benchmarks-7.2   # and OMB's own programs, as references
    python -m benchmarks.osu --quick                          # smoke run

MPI's users measure an MPI with the OSU Micro-Benchmarks; their Python tests (OMB-Py, in OMB's python/ folder)
time mpi4py. benchmarks/_osu_worker.py runs OMB-Py's loops (its docstring says exactly what they do) for mpi4py
and for pycyxwiz, each library making its own call on the same buffers, side by side in one run:
  pycyxwiz      pycyxwiz over TCP (CX_SHM=0)                 against  mpi-tcp      Open MPI forced onto TCP
  pycyxwiz-shm  pycyxwiz through shared memory (its default)  against  mpi-default  Open MPI's pick (shared memory)
Tests: latency and bw (2 ranks), allreduce, reduce_scatter, bcast, allgather, barrier; sizes and iteration counts
OMB-Py's (latency 0 B .. 4 MiB, bw 1 B .. 4 MiB, collectives up to 1 MiB; --max-pt2pt, --max-coll).

With --omb DIR (an OMB source tree, configured and built with Open MPI's mpicc: benchmarks/README.md, "Against
MPI on its own benchmark"), two reference columns run OMB's own programs, unchanged, with mpirun's default
transport: omb-py (python/run.py --buffer numpy: what our mpi-default column reimplements; OMB-Py 7.2's allreduce
and reduce_scatter pass a float count, which mpi4py 4 refuses, so those two cells read n/a there) and omb-c (the C
programs, floats for the reductions: MPI without Python, a floor no Python call reaches). Without --omb they are
not run.

Figures as OMB prints them: latency in us (mean over ranks of each rank's time per call), bw in MB/s (10^6 B/s,
rank 0's). Ratios are speed, above 1 = pycyxwiz faster: pycyxwiz against mpi-tcp, pycyxwiz-shm against
mpi-default (and against omb-c where it ran). Every column runs --rounds times, the order reversed every other
round; each cell keeps its best round. Writes benchmarks/results/partial/osu.json.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._launch import _base_env, mpi_available, mpirun_command, run_ranks
from benchmarks._osu_worker import PT2PT, TESTS, WINDOW, runs, sizes_of
from benchmarks._report import format_table, human_size, write_json

WORKER = "benchmarks._osu_worker"
COLUMNS = ("pycyxwiz", "mpi-tcp", "pycyxwiz-shm", "mpi-default")
REFS = ("omb-py", "omb-c")
PAIRS = (("pycyxwiz", "mpi-tcp"), ("pycyxwiz-shm", "mpi-default"), ("pycyxwiz-shm", "omb-c"))
C_PROGRAMS = {"latency": "pt2pt/standard/osu_latency", "bw": "pt2pt/standard/osu_bw",
              "allreduce": "collective/blocking/osu_allreduce",
              "reduce_scatter": "collective/blocking/osu_reduce_scatter",
              "bcast": "collective/blocking/osu_bcast", "allgather": "collective/blocking/osu_allgather",
              "barrier": "collective/blocking/osu_barrier"}
REDUCING = ("allreduce", "reduce_scatter")


def figure(test: str, seconds: float, iterations: int, size: int) -> float:
    """OMB's figure for one rank's timed block: us per call (per one-way message for latency), or MB/s for bw."""
    if test == "bw":
        return size / 1e6 * iterations * WINDOW / seconds
    return seconds * 1e6 / (iterations * (2 if test == "latency" else 1))


def lib_column(col: str, world: int, tests: list, max_pt2pt: int, max_coll: int, scale: float,
               timeout_s: float) -> dict:
    """{test: {size: figure}} of one library column (mean over ranks, or rank 0's bandwidth)."""
    run = run_ranks(col, WORKER, ["--tests", *tests, "--max-pt2pt", str(max_pt2pt), "--max-coll", str(max_coll),
                                  "--scale", str(scale)], world, timeout_s)
    cells: dict = {}
    if run.ranks and all(run.ranks):
        steps = [r["steps"] for r in run.ranks]
        for i, step in enumerate(steps[0]):
            if not all(i < len(s) for s in steps):
                break
            test, size = step["test"], step["size"]
            if test == "bw":
                value = figure(test, step["seconds"], step["iterations"], size)
            else:
                each = [figure(test, s[i]["seconds"], s[i]["iterations"], size) for s in steps[:2 if test in PT2PT
                                                                                                else world]]
                value = sum(each) / len(each)
            cells.setdefault(test, {})[size] = value
    return {"ok": run.ok, "reason": run.reason, "wall_s": run.wall_s, "cells": cells,
            "version": (run.ranks[0] or {}).get("info", {}).get("version", "") if run.ranks else ""}


def parse_omb(text: str) -> dict:
    """{size: figure} from an OMB program's output: its lines of numbers ("size value", or "value" for barrier)."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        try:
            nums = [float(p) for p in parts]
        except ValueError:
            continue
        if len(nums) == 2:
            out[int(nums[0])] = nums[1]
        elif len(nums) == 1:
            out[0] = nums[0]
    return out


def ref_command(ref: str, omb: Path, test: str, world: int, max_pt2pt: int, max_coll: int) -> tuple:
    """(argv, cwd) of OMB's own program for `test` on `world` ranks, or (None, why not)."""
    top = max_pt2pt if test in PT2PT else max_coll
    if ref == "omb-py":
        run_py = omb / "python" / "run.py"
        if not run_py.is_file():
            return None, f"no {run_py}"
        args = [sys.executable, "run.py", "--benchmark", test, "--buffer", "numpy"]
        return mpirun_command("mpi-default", world) + args + ([] if test == "barrier" else ["--max", str(top)]), \
            str(omb / "python")
    prog = omb / "c" / "mpi" / C_PROGRAMS[test]
    if not os.access(prog, os.X_OK):
        return None, f"{prog} not built (./configure CC=mpicc CXX=mpicxx && make, in {omb})"
    args = [str(prog)] + ([] if test == "barrier" else ["-m", f"{0 if test == 'latency' else 1}:{top}"])
    if test in REDUCING:
        args += ["-T", "mpi_float"]
    return mpirun_command("mpi-default", world) + args, str(omb)


def _why(out: subprocess.CompletedProcess) -> str:
    """The line that says why an OMB program failed: the last exception of its stderr, else its last line."""
    lines = [ln.strip() for ln in out.stderr.splitlines() if ln.strip() and not ln.startswith("-")]
    errors = [ln for ln in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", ln)]
    return ((errors or lines or [f"exit status {out.returncode}, no output"])[-1])[:200]


def ref_column(ref: str, omb: Path, world: int, tests: list, max_pt2pt: int, max_coll: int,
               timeout_s: float) -> dict:
    """OMB's own programs, one per test, under mpirun; a test that fails is n/a with its reason."""
    t0 = time.monotonic()
    ok, why = mpi_available()
    cells: dict = {}
    reasons: dict = {}
    env = _base_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(omb / "python"), env.get("PYTHONPATH", "")) if p)
    for test in tests:
        if test in PT2PT and world != 2:
            continue
        argv, cwd = ref_command(ref, omb, test, world, max_pt2pt, max_coll)
        if argv is not None and not ok:  # the program is there, mpirun or mpi4py is not
            argv, cwd = None, why
        if argv is None:
            reasons[test] = cwd
            continue
        try:
            out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            reasons[test] = f"timed out after {timeout_s:.0f} s"
            continue
        got = parse_omb(out.stdout)
        if out.returncode or not got:
            reasons[test] = _why(out)
        cells[test] = {s: v for s, v in got.items() if runs(test, s, world)}
    reason = "; ".join(f"{t}: {r}" for t, r in reasons.items())
    return {"ok": not reasons, "reason": reason, "wall_s": time.monotonic() - t0, "cells": cells,
            "version": "OMB " + ref}


def best(results: list, test: str, size: int) -> float | None:
    vals = [r["cells"][test][size] for r in results if size in r["cells"].get(test, {})]
    if not vals:
        return None
    return max(vals) if test == "bw" else min(vals)


def fmt(test: str, v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"{v:,.0f}" if test == "bw" and v >= 100 else f"{v:.2f}"


def speed(test: str, ours: float | None, theirs: float | None) -> float | None:
    if not ours or not theirs:
        return None
    return ours / theirs if test == "bw" else theirs / ours


def table(raw: dict, cols: list, world: int, test: str, max_pt2pt: int, max_coll: int,
          markdown: bool = False) -> str:
    pairs = [(a, b) for a, b in PAIRS if a in cols and b in cols]
    rows = []
    for size in [s for s in sizes_of(test, max_pt2pt, max_coll) if runs(test, s, world)]:
        v = {c: best(raw.get((world, c), []), test, size) for c in cols}
        ratios = [speed(test, v[a], v[b]) for a, b in pairs]
        rows.append([human_size(size) if test != "barrier" else "-"] + [fmt(test, v[c]) for c in cols]
                    + [f"{r:.2f}x" if r else "n/a" for r in ratios])
    unit = "MB/s" if test == "bw" else "us"
    heads = ["size", *cols] + [f"{a}/{b}" for a, b in pairs]
    return (f"osu_{test}, {world} ranks: {unit} (ratios: speed, above 1 = pycyxwiz faster)\n"
            + format_table(heads, rows, markdown))


def summary(raw: dict, cols: list, worlds: list, tests: list, max_pt2pt: int, max_coll: int) -> str:
    """Per test and ranks, each pair's worst and median speed ratio over the sizes, and where the worst is."""
    pairs = [(a, b) for a, b in PAIRS if a in cols and b in cols]
    rows = []
    for world in worlds:
        for test in tests:
            sizes = [s for s in sizes_of(test, max_pt2pt, max_coll) if runs(test, s, world)]
            if not sizes:
                continue
            row = [test, str(world)]
            for a, b in pairs:
                ours, theirs = raw.get((world, a), []), raw.get((world, b), [])
                pairs_at = [(speed(test, best(ours, test, s), best(theirs, test, s)), s) for s in sizes]
                rs = [(r, s) for r, s in pairs_at if r is not None]
                if not rs:
                    row.append("n/a")
                    continue
                worst = min(rs)
                mid = sorted(r for r, _ in rs)[len(rs) // 2]
                at = human_size(worst[1]) if test != "barrier" else "-"
                row.append(f"{worst[0]:.2f}x at {at} (median {mid:.2f}x)")
            rows.append(row)
    heads = ["test", "ranks"] + [f"{a}/{b}: worst (median)" for a, b in pairs]
    return "Summary: speed ratios over the sizes of each test\n" + format_table(heads, rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tests", nargs="+", choices=TESTS, default=list(TESTS))
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-pt2pt", type=int, default=1 << 22, help="largest latency/bw message (OMB-Py: 4 MiB)")
    ap.add_argument("--max-coll", type=int, default=1 << 20, help="largest collective message (OMB-Py: 1 MiB)")
    ap.add_argument("--omb", type=Path, default=None, help="an OMB 7.x source tree, built: its own programs as "
                    "reference columns (omb-py, omb-c)")
    ap.add_argument("--quick", action="store_true", help="smoke run: up to 64 KiB, a tenth of the iterations, "
                    "one round")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per column")
    a = ap.parse_args(argv)
    if a.quick:
        a.max_pt2pt, a.max_coll = min(a.max_pt2pt, 1 << 16), min(a.max_coll, 1 << 16)
    rounds, scale = (1, 0.1) if a.quick else (a.rounds, 1.0)
    cols = list(COLUMNS) + (list(REFS) if a.omb else [])
    raw: dict = {}
    for rnd in range(rounds):
        for world in a.worlds:
            for col in (cols if rnd % 2 == 0 else cols[::-1]):
                print(f"  osu world {world}: {col} (round {rnd + 1}/{rounds}) ...", end="", flush=True)
                if col in REFS:
                    res = ref_column(col, a.omb.resolve(), world, a.tests, a.max_pt2pt, a.max_coll, a.timeout)
                else:
                    res = lib_column(col, world, a.tests, a.max_pt2pt, a.max_coll, scale, a.timeout)
                print(f" {res['wall_s']:.0f}s" + ("" if res["ok"] else f"  n/a ({res['reason']})"), flush=True)
                raw.setdefault((world, col), []).append(res)
    out = []
    for world in a.worlds:
        for test in a.tests:
            if any(runs(test, s, world) for s in sizes_of(test, a.max_pt2pt, a.max_coll)):
                out.append(table(raw, cols, world, test, a.max_pt2pt, a.max_coll))
    out.append(summary(raw, cols, a.worlds, a.tests, a.max_pt2pt, a.max_coll))
    print()
    print("\n\n".join(out))
    payload = {"columns": cols, "worlds": a.worlds, "tests": a.tests, "max_pt2pt": a.max_pt2pt,
               "max_coll": a.max_coll, "runs": {f"{w}/{c}": v for (w, c), v in raw.items()}}
    print(f"\nwrote {write_json('osu', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
