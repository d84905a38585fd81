"""What the trainer's extras cost: callbacks against none, and a memory-mapped NpyDataset against arrays in memory.

    python -m benchmarks.train_extras                  # 2 ranks, 9 rounds: writes results/partial/train_extras.json
    python -m benchmarks.train_extras --worlds 1 2 --rounds 3
    python -m benchmarks.train_extras --costs --rounds 15     # one rank: CPU time per callback (costs table)

The MLP training benchmark (benchmarks.train: MLP 784-256-10, Adam(1e-3), batch 64 per rank, 8192 samples per
rank and epoch, 3 epochs, one thread per rank), fitted in the variants of benchmarks/_train_extras_worker.py
side by side in one set of processes, in rounds with the order rotating. Samples/s of a fit = all ranks'
samples / the slowest rank's time; each variant's figure is the median over rounds, and its ratio is the median
over rounds of its samples/s over the arrays baseline's in the same round (each round's ratio is shown too: the
spread is the noise). "CPU: vs arrays" is the same ratio of samples per CPU-second of all ranks' processes:
what a variant costs, less disturbed by other programs on the machine than the wall time. Targets (issue 24): all callbacks on cost at
most 2% (ratio >= 0.98); NpyDataset with a warm page cache >= 0.95x the arrays; with a cold cache reported.

--costs: one rank, the same fits, and where the time goes in CPU time of the threads that spend it (which the
other programs on a busy machine disturb far less than wall time): the trainer thread's CPU time over the
baseline's in the same round, the part of it spent in the callbacks' hooks, the checkpoint writer thread's CPU
time, and all of that as a share of the baseline fit's CPU time.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

if __package__ in (None, ""):
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._launch import run_ranks
from benchmarks._report import format_table, write_json
from benchmarks._train_extras_worker import VARIANTS

TARGETS = {"callbacks": 0.98, "npy-warm": 0.95}
WHAT = {
    "arrays": "fit(X, y), no callbacks (baseline)",
    "callbacks": "EarlyStopping + ModelCheckpoint + EMA + CSVLogger",
    "no-files": "EarlyStopping + EMA + CSVLogger (no checkpoint files)",
    "ema": "EMA alone",
    "checkpoint": "ModelCheckpoint alone (best.ckpt and last.ckpt every epoch)",
    "logging": "EarlyStopping + CSVLogger",
    "dataset": "a Dataset over the arrays (the loader thread)",
    "npy-warm": "NpyDataset, warm page cache",
    "npy-cold": "NpyDataset, cold page cache (fadvise DONTNEED)",
}


def run(worlds: list, samples_per_rank: int, epochs: int, rounds: int, timeout_s: float = 600, log=print,
        variants: tuple = VARIANTS) -> dict:
    columns = []
    for world in worlds:
        log(f"  train_extras world {world} ...", end="", flush=True)
        args = ["--samples-per-rank", str(samples_per_rank), "--epochs", str(epochs), "--rounds", str(rounds),
                "--variants", *variants]
        res = run_ranks("pycyxwiz", "benchmarks._train_extras_worker", args, world, timeout_s)
        col = {"world": world, "ok": res.ok, "reason": res.reason, "wall_s": round(res.wall_s, 2), "load": res.load,
               "variants": {}}
        steps = [r["steps"] for r in res.ranks if r and r.get("steps")] if res.ranks else []
        if res.ok and len(steps) == world:
            for v in VARIANTS:
                per_round = []
                for i, s0 in enumerate(steps[0]):
                    if s0["variant"] != v:
                        continue
                    seconds = max(s[i]["seconds"] for s in steps)
                    cpu = sum(s[i]["cpu_seconds"] for s in steps)
                    per_round.append({"round": s0["round"], "seconds": seconds, "cpu_seconds": cpu,
                                      "samples_per_second": s0["samples"] * world / seconds,
                                      "samples_per_cpu_second": s0["samples"] * world / cpu,
                                      "final_loss": s0["final_loss"]})
                if per_round:
                    col["variants"][v] = {"rounds": per_round, "samples_per_second": statistics.median(
                        p["samples_per_second"] for p in per_round)}
        log(f" {col['wall_s']:.0f}s" + ("" if res.ok else f"  n/a ({res.reason})"))
        columns.append(col)
    return {"benchmark": "train_extras", "model": "MLP 784-256-10", "optimizer": "Adam(1e-3)", "batch_per_rank": 64,
            "threads_per_rank": 1, "samples_per_rank": samples_per_rank, "epochs": epochs, "rounds": rounds,
            "worlds": worlds, "targets": TARGETS, "columns": columns}


def run_costs(samples_per_rank: int, epochs: int, rounds: int, timeout_s: float = 600,
              variants: tuple = ("arrays", "callbacks", "ema", "checkpoint", "logging")) -> dict:
    """One rank with --costs: each variant's CPU time, per round, beside the baseline's."""
    args = ["--samples-per-rank", str(samples_per_rank), "--epochs", str(epochs), "--rounds", str(rounds),
            "--costs", "--variants", *variants]
    res = run_ranks("pycyxwiz", "benchmarks._train_extras_worker", args, 1, timeout_s)
    rows = res.ranks[0]["steps"] if res.ok and res.ranks and res.ranks[0] else []
    return {"benchmark": "train_extras_costs", "ok": res.ok, "reason": res.reason, "load": res.load,
            "samples_per_rank": samples_per_rank, "epochs": epochs, "rounds": rounds, "fits": rows}


def costs_table(payload: dict, markdown: bool = False) -> str:
    """Medians over rounds of each variant's CPU time against the baseline's in the same round."""
    if not payload["ok"]:
        return f"costs: n/a ({payload['reason']})"
    toggled = [f for f in payload["fits"] if f["variant"] == "ema-steps"]
    base = {f["round"]: f for f in payload["fits"] if f["variant"] == "arrays"}
    med = statistics.median
    headers = ["variant", "trainer thread, more than none", "of it in hooks", "writer thread", "extra CPU, all",
               "by round"]
    rows = []
    for v in VARIANTS:
        fits = [f for f in payload["fits"] if f["variant"] == v and f["round"] in base and v != "arrays"]
        if not fits:
            continue
        b = [base[f["round"]]["costs"] for f in fits]
        c = [f["costs"] for f in fits]
        epochs = fits[0]["epochs"]
        extra = [x["thread"] - y["thread"] for x, y in zip(c, b)]
        share = [(e + x["writer"]) / y["thread"] for e, x, y in zip(extra, c, b)]
        per_step = med(e / max(x["steps"], 1) for e, x in zip(extra, c)) * 1e6
        step = "" if c[0]["saves"] else f" ({per_step:.1f} us/step)"
        rows.append([WHAT[v], f"{med(extra) / epochs * 1e3:.2f} ms/epoch{step}",
                     f"{med(x['hooks'] for x in c) / epochs * 1e3:.2f} ms/epoch",
                     f"{med(x['writer'] / max(x['saves'], 1) for x in c) * 1e3:.2f} ms/save" if c[0]["saves"] else "",
                     f"{med(share) * 100:+.1f}%", " ".join(f"{x * 100:+.1f}" for x in share)])
    for t in toggled:   # the EMA switched on and off every 16 steps within fits of the baseline
        on, off = np.median(np.array(t["with"]), axis=0), np.median(np.array(t["without"]), axis=0)  # (wall, CPU)
        rows.append([f"EMA per step, on and off every 16 steps ({len(t['with'])} and {len(t['without'])} steps; "
                     f"a step without: {off[1] * 1e6:.0f} us CPU)",
                     f"{(on[1] - off[1]) * 1e6:+.1f} us/step CPU ({(on[0] - off[0]) * 1e6:+.1f} us wall)", "", "",
                     f"{(on[1] / off[1] - 1) * 100:+.1f}% (wall {(on[0] / off[0] - 1) * 100:+.1f}%)", "medians of steps"])
    base_fit = med(f["costs"]["thread"] for f in base.values()) / payload["epochs"]
    title = (f"trainer extras, where the CPU time goes: 1 rank, {payload['samples_per_rank']} samples/epoch "
             f"({base_fit * 1e3:.0f} ms of CPU per epoch with no callbacks), {payload['epochs']} epochs per fit, "
             f"{payload['rounds']} rounds: medians over rounds of each fit against the baseline's in its round")
    return (f"**{title}**\n\n" if markdown else title + "\n") + format_table(headers, rows, markdown)


def ratios(col: dict, variant: str, key: str = "samples_per_second"):
    """(the median over rounds of the variant's samples/s over the baseline's in the same round, those per-round
    ratios), or (None, []). A round runs every variant once, back to back, so other load on the machine hits a
    round's variants alike more than it hits the medians of separate rounds. key="samples_per_cpu_second":
    the same of samples per second of CPU time of all ranks' processes (what the variant costs, which other
    programs on the machine disturb less than they disturb the wall time)."""
    base, mine = col["variants"].get("arrays"), col["variants"].get(variant)
    if not base or not mine:
        return None, []
    by_round = {p["round"]: p[key] for p in base["rounds"]}
    per = [p[key] / by_round[p["round"]] for p in mine["rounds"] if p["round"] in by_round]
    return (statistics.median(per) if per else None), per


def table(payload: dict, markdown: bool = False) -> str:
    headers = ["ranks", "variant", "samples/s", "vs arrays", "by round", "target", "CPU: vs arrays"]
    rows = []
    for col in payload["columns"]:
        if not col["ok"]:
            rows.append([str(col["world"]), "n/a", col["reason"], "", "", "", ""])
            continue
        for v in VARIANTS:
            if v not in col["variants"]:
                continue
            r, per = ratios(col, v)
            target = TARGETS.get(v)
            met = "" if target is None or r is None else (f">= {target:.2f}x: " + ("yes" if r >= target else "**no**"))
            rc, _ = ratios(col, v, "samples_per_cpu_second")
            rows.append([str(col["world"]), WHAT[v], f"{col['variants'][v]['samples_per_second']:,.0f}",
                         "1.00x" if v == "arrays" else f"{r:.3f}x", " ".join(f"{x:.3f}" for x in per), met,
                         "1.00x" if v == "arrays" else f"{rc:.3f}x"])
    title = (f"trainer extras: {payload['model']}, {payload['optimizer']}, batch {payload['batch_per_rank']}/rank, "
             f"{payload['samples_per_rank']} samples/rank/epoch, {payload['epochs']} epochs per fit, {payload['rounds']} "
             f"rounds: medians, and the ratio in each round")
    return (f"**{title}**\n\n" if markdown else title + "\n") + format_table(headers, rows, markdown)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2])
    ap.add_argument("--samples-per-rank", type=int, default=8192)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per world size")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=None,
                    help="which to run (arrays, the baseline, always)")
    ap.add_argument("--costs", action="store_true", help="one rank: where the CPU time goes (see above)")
    a = ap.parse_args(argv)
    if a.costs:
        chosen = a.variants or ["callbacks", "ema", "checkpoint", "logging"]
        payload = run_costs(a.samples_per_rank, a.epochs, a.rounds, a.timeout,
                            tuple(["arrays"] + [v for v in chosen if v != "arrays"]))
        print(costs_table(payload))
        print(f"\nwrote {write_json('train_extras_costs', payload)}")
        return 0
    variants = tuple(["arrays"] + [v for v in (a.variants or VARIANTS) if v != "arrays"])
    payload = run(a.worlds, a.samples_per_rank, a.epochs, a.rounds, a.timeout, variants=variants)
    print()
    print(table(payload))
    print(f"\nwrote {write_json('train_extras', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
