"""Peak memory per rank: a collective's scratch must not grow with the message.

    python -m benchmarks.memory                        # all_reduce 1 MiB .. 256 MiB on 2 ranks, and training
    python -m benchmarks.memory --worlds 2 4 --no-train

Collectives: for each library and size, "growth" = peak RSS (VmHWM, reset once the arrays are
allocated and touched) - RSS with the arrays: the memory the library itself added while
running three calls. Max over ranks. Flat across sizes = scratch independent of message
size; proportional = the library copies the message.

Training: per rank, RSS after building the data, and the peak during training (the model,
optimizer state, gradient buckets, the library's buffers): the same run as benchmarks.train
at 2 ranks, one epoch.

ZeRO-1 (also alone: python -m benchmarks.memory --zero): Adam on an MLP 784-2048-2048-10 (5.8M
parameters) for a few steps, per rank, with and without a sharded optimizer state, pycyxwiz
(cx.distributed.ZeroRedundancyOptimizer) side by side with PyTorch's
torch.distributed.optim.ZeroRedundancyOptimizer over gloo: the optimizer state each rank holds
(counted exactly) and the peak RSS training added above the model (benchmarks/_zero_worker.py).
Target: the state per rank falls to 1/world of it, and the peak by about that, plus a bucket.
"""
from __future__ import annotations

import argparse
import sys

if __package__ in (None, ""):
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import train as train_bench
from benchmarks._launch import LIBRARIES, run_ranks
from benchmarks._report import format_table, human_size, parse_size, write_json

DEFAULT_SIZES = [1 << 20, 16 << 20, 64 << 20, 256 << 20]
MiB = 2**20


def run_collective(libs: list, worlds: list, sizes: list, op: str, timeout_s: float, log=print) -> list:
    columns = []
    for world in worlds:
        for lib in libs:
            log(f"  memory {op} world {world}: {lib} ...", end="", flush=True)
            args = ["--op", op, "--sizes", *map(str, sizes)]
            run = run_ranks(lib, "benchmarks._memory_worker", args, world, timeout_s)
            col = {"lib": lib, "world": world, "ok": run.ok, "reason": run.reason, "warning": run.warning,
                   "results": []}
            ranks = run.ranks if run.ranks and all(r is not None for r in run.ranks) else []
            if ranks:
                for i in range(min(len(r["steps"]) for r in ranks)):
                    steps = [r["steps"][i] for r in ranks]
                    growth = [s["growth"] for s in steps]
                    col["results"].append({
                        "nominal": steps[0]["nominal"], "bytes": steps[0]["bytes"],
                        "array_bytes": steps[0]["array_bytes"],
                        "max_growth": None if None in growth else max(growth),
                        "growth_per_rank": growth,
                        "max_peak": max(s["peak"] for s in steps),
                        "peak_per_rank": [s["peak"] for s in steps],
                    })
            if not col["reason"] and len(col["results"]) < len(sizes):
                col["reason"] = "no result for some sizes"
            log(f" {run.wall_s:.0f}s" + ("" if not col["reason"] else f"  n/a ({col['reason']})"))
            columns.append(col)
    return columns


def run_train(worlds: list, timeout_s: float, log=print) -> list:
    out = []
    for world in worlds:
        for lib in train_bench.TRAIN_LIBS:
            log(f"  memory train world {world}: {lib} ...", end="", flush=True)
            col = train_bench.run_column(lib, world, samples_per_rank=4096, epochs=1, timeout_s=timeout_s)
            log(f" {col['wall_s']:.0f}s" + ("" if col["ok"] else f"  n/a ({col['reason']})"))
            out.append(col)
    return out


ZERO_LIBS = ("pycyxwiz", "torch")
ZERO_HIDDEN = 2048


def run_zero(worlds: list, timeout_s: float, hidden: int = ZERO_HIDDEN, steps: int = 4, log=print) -> list:
    out = []
    for world in worlds:
        for lib in ZERO_LIBS:
            for zero in (0, 1):
                log(f"  memory zero world {world}: {lib} {'ZeRO-1' if zero else 'plain'} ...", end="", flush=True)
                args = ["--zero", str(zero), "--hidden", str(hidden), "--steps", str(steps)]
                run = run_ranks(lib, "benchmarks._zero_worker", args, world, timeout_s)
                col = {"lib": lib, "world": world, "zero": bool(zero), "ok": run.ok, "reason": run.reason,
                       "warning": run.warning, "hidden": hidden, "steps": steps}
                got = [r["steps"][0] for r in run.ranks if r and r.get("steps")] if run.ranks else []
                if run.ok and len(got) == world:
                    col.update({
                        "version": run.ranks[0].get("info", {}).get("version", ""),
                        "params": got[0]["params"],
                        "state_bytes_per_rank": [g["state_bytes"] for g in got],
                        "train_growth_per_rank": [g["peak"] - g["rss_base"] if g["peak_reset"] else None
                                                  for g in got],
                        "peak_rss_per_rank": [g["peak"] for g in got],
                    })
                log(f" {run.wall_s:.0f}s" + ("" if col["ok"] else f"  n/a ({col['reason']})"))
                out.append(col)
    return out


def _zero_col(cols: list, lib: str, world: int, zero: bool) -> dict:
    return next((c for c in cols if c["lib"] == lib and c["world"] == world and c["zero"] == zero
                 and c["ok"]), {})


def zero_ratios(cols: list, lib: str, world: int) -> dict:
    """ZeRO-1 over plain, max over ranks: {"state": ..., "growth": ...} (None where n/a)."""
    a, b = _zero_col(cols, lib, world, False), _zero_col(cols, lib, world, True)
    out = {}
    for key, field in (("state", "state_bytes_per_rank"), ("growth", "train_growth_per_rank")):
        x, y = a.get(field), b.get(field)
        ok = x and y and None not in x and None not in y and max(x) > 0
        out[key] = max(y) / max(x) if ok else None
    return out


def zero_table(cols: list, markdown: bool = False) -> str:
    headers = ["library", "ranks", "optimizer state plain (MiB)", "ZeRO-1 (MiB)", "ratio",
               "training peak plain (MiB)", "ZeRO-1 (MiB)", "ratio"]
    rows, notes = [], []
    worlds = sorted({c["world"] for c in cols})
    for world in worlds:
        for lib in ZERO_LIBS:
            a, b = _zero_col(cols, lib, world, False), _zero_col(cols, lib, world, True)
            r = zero_ratios(cols, lib, world)
            mx = lambda c, f: max(c[f]) if c.get(f) and None not in c[f] else None  # noqa: E731
            rows.append([lib, str(world), _mib(mx(a, "state_bytes_per_rank")), _mib(mx(b, "state_bytes_per_rank")),
                         "n/a" if r["state"] is None else f"{r['state']:.2f}",
                         _mib(mx(a, "train_growth_per_rank")), _mib(mx(b, "train_growth_per_rank")),
                         "n/a" if r["growth"] is None else f"{r['growth']:.2f}"])
        for c in cols:
            if c["world"] == world and not c["ok"]:
                notes.append(f"{c['lib']} {'ZeRO-1' if c['zero'] else 'plain'}: n/a ({c['reason']})")
    hidden = cols[0]["hidden"] if cols else ZERO_HIDDEN
    steps = cols[0]["steps"] if cols else 4
    title = (f"ZeRO-1 memory per rank (max over ranks): MLP 784-{hidden}-{hidden}-10, Adam, batch 64; "
             f"training peak = peak RSS added by making the optimizer and {steps} steps, above the model and its DDP")
    text = (f"**{title}**\n\n" if markdown else title + "\n") + format_table(headers, rows, markdown)
    if notes:
        text += "\n\n" + "\n".join(("- " if markdown else "  ") + n for n in notes)
    return text


def _mib(x) -> str:
    return "n/a" if x is None else f"{x / MiB:.1f}"


def tables(payload: dict, markdown: bool = False) -> str:
    out = []
    sizes = payload["sizes"]
    for world in (payload["worlds"] if payload.get("collective") else []):
        headers = ["library"] + [f"{human_size(s)}" for s in sizes] + [f"peak RSS @ {human_size(sizes[-1])}"]
        rows, notes = [], []
        for col in (c for c in payload["collective"] if c["world"] == world):
            by = {r["nominal"]: r for r in col["results"]}
            row = [col["lib"]] + [_mib(by[s]["max_growth"]) if s in by else "n/a" for s in sizes]
            row.append(_mib(by[sizes[-1]]["max_peak"]) if sizes[-1] in by else "n/a")
            rows.append(row)
            if col["reason"]:
                notes.append(f"{col['lib']}: n/a ({col['reason']})")
        title = (f"{payload['op']} memory, world {world}: MiB added above the message's own arrays "
                 f"(peak - RSS with arrays, max over ranks), by message size")
        text = (f"**{title}**\n\n" if markdown else title + "\n") + format_table(headers, rows, markdown)
        if notes:
            text += "\n\n" + "\n".join(("- " if markdown else "  ") + n for n in notes)
        out.append(text)
    if payload.get("train"):
        headers = ["library", "ranks", "RSS with data (MiB)", "peak in training (MiB)", "added by training (MiB)"]
        rows, notes = [], []
        for c in payload["train"]:
            if c["ok"]:
                rows.append([c["lib"], str(c["world"]), _mib(max(c["rss_base_per_rank"])),
                             _mib(max(c["peak_rss_per_rank"])), _mib(max(c["train_growth_per_rank"]))])
            else:
                rows.append([c["lib"], str(c["world"]), "n/a", "n/a", "n/a"])
                notes.append(f"{c['lib']}: n/a ({c['reason']})")
        title = "training memory per rank (max over ranks): MLP 784-256-10, Adam, batch 64"
        text = (f"**{title}**\n\n" if markdown else title + "\n") + format_table(headers, rows, markdown)
        if notes:
            text += "\n\n" + "\n".join(("- " if markdown else "  ") + n for n in sorted(set(notes)))
        out.append(text)
    if payload.get("zero"):
        out.append(zero_table(payload["zero"], markdown))
    return "\n\n".join(out)


def run(libs, worlds, sizes, op="all_reduce", train=True, timeout_s=180, log=print, zero=True,
        collective=True) -> dict:
    return {"benchmark": "memory", "op": op, "sizes": sizes, "worlds": worlds, "libs": libs,
            "collective": run_collective(libs, worlds, sizes, op, timeout_s, log) if collective else [],
            "train": run_train([2], timeout_s, log) if train else [],
            "zero": run_zero(worlds, timeout_s, log=log) if zero else []}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2])
    ap.add_argument("--libs", nargs="+", choices=LIBRARIES, default=list(LIBRARIES))
    ap.add_argument("--sizes", type=parse_size, nargs="+")
    ap.add_argument("--op", default="all_reduce", choices=["all_reduce", "broadcast", "all_gather", "reduce_scatter"])
    ap.add_argument("--no-train", action="store_true")
    ap.add_argument("--zero", action="store_true", help="only the ZeRO-1 section (optimizer state per rank)")
    ap.add_argument("--no-zero", action="store_true")
    ap.add_argument("--timeout", type=float, default=180)
    a = ap.parse_args(argv)
    payload = run(a.libs, a.worlds, sorted(a.sizes or DEFAULT_SIZES), a.op, not (a.no_train or a.zero), a.timeout,
                  zero=not a.no_zero, collective=not a.zero)
    print()
    print(tables(payload))
    print(f"\nwrote {write_json('memory', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
