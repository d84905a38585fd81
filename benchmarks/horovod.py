"""Against Horovod on its own benchmark: a PyTorch user's choice between Horovod and torch.distributed over "cyxwiz".

    python -m benchmarks.horovod                      # all_reduce and the synthetic benchmark, 2 and 4 ranks
    python -m benchmarks.horovod --parts synthetic --worlds 2 --rounds 3
    python -m benchmarks.horovod --quick              # smoke run
    python -m benchmarks.horovod --parts synthetic --fp16-allreduce   # the script's float16 gradients

Horovod is not a dependency of pycyxwiz and is not installed by any extra: its last release (0.28.1) builds
against this torch only with a one-line patch (benchmarks/README.md, "Against Horovod"). Without it every
Horovod column reads "n/a (Horovod not installed: ...)".

Columns, each its own set of processes (benchmarks._launch), side by side in one run, like with like:
  horovod-gloo  Horovod started by horovodrun --gloo: its collectives gloo's, over TCP
  cyxwiz        the same PyTorch script on torch.distributed's "cyxwiz" backend over TCP (CX_SHM=0)
  horovod-mpi   Horovod started by mpirun: its collectives Open MPI's, shared memory between the ranks
  cyxwiz-shm    "cyxwiz" through shared memory (CX_SHM=1, its default with every rank on one host)

all_reduce: one float32 tensor summed in place (hvd.allreduce_ against dist.all_reduce), 8 B .. 64 MiB, each
call timed after a barrier, the max over ranks, the median over calls. Horovod runs every collective through
its background thread, which takes up requests once per cycle (HOROVOD_CYCLE_TIME, 1 ms by default here):
that is most of its time at small sizes, and its defaults are what its users get.

synthetic: Horovod's own benchmark (pytorch_synthetic_benchmark.py: random data, SGD, 10 warm-up batches, then
10 timings of 10 batches each, img/sec; batch 32 per rank), on torch_backend.py's models (the MLP
784-2048-2048-10, communication-heavy, and the small CNN on 3x32x32), since torchvision's ResNet-50 at
224x224 takes tens of seconds a step on a 2-core machine. Horovod's figure is its script's: the mean img/sec
of rank 0 times the ranks. Each rank checks that it ends with rank 0's weights.

Ratios are speed, above 1 = pycyxwiz faster: cyxwiz against horovod-gloo, cyxwiz-shm against horovod-mpi.
Every column runs --rounds times (order reversed on every other round); each cell keeps its best round.
Writes benchmarks/results/partial/horovod.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys

if __package__ in (None, ""):
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._launch import run_ranks
from benchmarks._report import format_table, human_size, median, parse_size, write_json

WORKER = "benchmarks._horovod_worker"
COLUMNS = ("horovod-gloo", "cyxwiz", "horovod-mpi", "cyxwiz-shm")
PAIRS = (("cyxwiz", "horovod-gloo"), ("cyxwiz-shm", "horovod-mpi"))
SIZES = [8, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
ENV = {"cyxwiz": {"CX_SHM": "0"}, "cyxwiz-shm": {"CX_SHM": "1"}}


def _launch(col: str, world: int, args: list, timeout_s: float):
    return run_ranks(col, WORKER, args, world, timeout_s, extra_env=ENV.get(col))


def ar_column(col: str, world: int, sizes: list, scale: float, timeout_s: float) -> dict:
    run = _launch(col, world, ["allreduce", "--iters-scale", str(scale), "--sizes", *map(str, sizes)], timeout_s)
    cells = {}
    if run.ranks and all(run.ranks):
        for i, step in enumerate(run.ranks[0]["steps"]):
            per_rank = [r["steps"][i]["times"] for r in run.ranks if i < len(r["steps"])]
            if len(per_rank) == world:
                cells[step["size"]] = median([max(ts) for ts in zip(*per_rank)])
    return {"ok": run.ok, "reason": run.reason, "wall_s": run.wall_s, "seconds": cells,
            "version": (run.ranks[0] or {}).get("info", {}).get("version", "") if run.ranks else ""}


def sy_column(col: str, world: int, models: list, batch: int, iters: int, timeout_s: float,
              fp16: bool = False) -> dict:
    run = _launch(col, world, ["synthetic", "--models", *models, "--batch-size", str(batch), "--num-iters",
                               str(iters)] + (["--fp16-allreduce"] if fp16 else []), timeout_s)
    cells = {}
    if run.ranks and run.ranks[0]:
        for step in run.ranks[0]["steps"]:
            secs = step["img_secs"]
            synced = all(r and any(s.get("model") == step["model"] and s["in_sync"] for s in r["steps"])
                         for r in run.ranks)
            cells[step["model"]] = {"total": world * statistics.mean(secs), "mean": statistics.mean(secs),
                                    "conf": 1.96 * statistics.pstdev(secs), "in_sync": synced}
    return {"ok": run.ok, "reason": run.reason, "wall_s": run.wall_s, "cells": cells}


def rounds_of(label: str, worlds: list, cols: list, rounds: int, column) -> dict:
    """{(world, col): [round results]}, the order of the columns reversed on every other round."""
    out: dict = {}
    for rnd in range(rounds):
        for world in worlds:
            for col in (cols if rnd % 2 == 0 else cols[::-1]):
                print(f"  {label} world {world}: {col} (round {rnd + 1}/{rounds}) ...", end="", flush=True)
                res = column(col, world)
                print(f" {res['wall_s']:.0f}s" + ("" if res["ok"] else f"  n/a ({res['reason']})"), flush=True)
                out.setdefault((world, col), []).append(res)
    return out


def best_time(results: list, size: int) -> float | None:
    ts = [r["seconds"][size] for r in results if size in r["seconds"]]
    return min(ts) if ts else None


def best_rate(results: list, model: str) -> float | None:
    xs = [r["cells"][model]["total"] for r in results if model in r["cells"]]
    return max(xs) if xs else None


def fmt_time(s: float | None) -> str:
    if s is None:
        return "n/a"
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def ar_table(raw: dict, world: int, sizes: list, markdown: bool = False) -> str:
    rows = []
    for size in sizes:
        t = {c: best_time(raw.get((world, c), []), size) for c in COLUMNS}
        ratios = [f"{t[b] / t[a]:.2f}x" if t[a] and t[b] else "n/a" for a, b in PAIRS]
        rows.append([human_size(size)] + [fmt_time(t[c]) for c in COLUMNS] + ratios)
    heads = ["size", *COLUMNS] + [f"{a}/{b}" for a, b in PAIRS]
    return f"all_reduce, world {world}: time per call (speed ratios: above 1 = pycyxwiz faster)\n" + \
        format_table(heads, rows, markdown)


def sy_table(raw: dict, world: int, models: list, markdown: bool = False, fp16: bool = False) -> str:
    rows = []
    for model in models:
        v = {c: best_rate(raw.get((world, c), []), model) for c in COLUMNS}
        cells = [f"{v[c]:,.0f}" if v[c] else "n/a" for c in COLUMNS]  # why: in the progress lines above
        ratios = [f"{v[a] / v[b]:.2f}x" if v[a] and v[b] else "n/a" for a, b in PAIRS]
        rows.append([model] + cells + ratios)
    heads = ["model", *COLUMNS] + [f"{a}/{b}" for a, b in PAIRS]
    return (f"Horovod's synthetic benchmark, world {world}: total img/sec (its figure: rank 0's mean x ranks), "
            "batch 32 per rank" + (", gradients all-reduced in float16" if fp16 else "") + "\n"
            + format_table(heads, rows, markdown))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", nargs="+", choices=["allreduce", "synthetic"], default=["allreduce", "synthetic"])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sizes", nargs="+", default=None, help="all_reduce sizes (8, 64K, 1M, ...)")
    ap.add_argument("--models", nargs="+", choices=["mlp", "cnn"], default=["mlp", "cnn"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-iters", type=int, default=10, help="the synthetic benchmark's timings (Horovod's: 10)")
    ap.add_argument("--fp16-allreduce", action="store_true", help="the synthetic benchmark's flag: Horovod's "
                    "Compression.fp16 against DDP's fp16_compress_hook on \"cyxwiz\"")
    ap.add_argument("--quick", action="store_true", help="smoke run: two sizes, 3 timings, one round")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per column")
    a = ap.parse_args(argv)
    sizes = [parse_size(s) for s in a.sizes] if a.sizes else ([8, 1 << 20] if a.quick else SIZES)
    rounds, iters, scale = (1, 3, 0.1) if a.quick else (a.rounds, a.num_iters, 1.0)
    payload: dict = {"columns": list(COLUMNS), "worlds": a.worlds}
    out = []
    if "allreduce" in a.parts:
        raw = rounds_of("all_reduce", a.worlds, list(COLUMNS), rounds,
                        lambda c, w: ar_column(c, w, sizes, scale, a.timeout))
        payload["allreduce"] = {f"{w}/{c}": v for (w, c), v in raw.items()}
        out += [ar_table(raw, w, sizes) for w in a.worlds]
    if "synthetic" in a.parts:
        raw = rounds_of("synthetic", a.worlds, list(COLUMNS), rounds,
                        lambda c, w: sy_column(c, w, a.models, 32, iters, a.timeout, a.fp16_allreduce))
        payload["synthetic"] = {f"{w}/{c}": v for (w, c), v in raw.items()}
        unsynced = [f"{c} world {w} {m}" for (w, c), rs in raw.items() for r in rs for m, cell in r["cells"].items()
                    if not cell["in_sync"]]
        out += [sy_table(raw, w, a.models, fp16=a.fp16_allreduce) for w in a.worlds]
        if unsynced:
            out.append("ranks ended with different weights: " + ", ".join(unsynced))
    print()
    print("\n\n".join(out))
    print(f"\nwrote {write_json('horovod', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
