"""What the safety checks cost: the non-finite gradient check (DDPConfig.nonfinite, Note [Non-finite
gradients] in csrc/train/nonfinite.h) on the MLP and CNN training benchmarks, and CX_DEBUG=DETAIL's
call-site comparison on a loop of all_reduces.

    python -m benchmarks.checks                       # 2 ranks; MLP and CNN; 6 rounds each
    python -m benchmarks.checks --rounds 10 --skip-cnn --steps 8000
    python -m benchmarks.checks --rounds 0 --skip-cnn --debug-rounds 0 --variants zero,fp16   # per-step only

Training: one job per model; in it the same trainer fits one epoch with the check off, one with it on
(tested inside the buckets' reductions, agreed by a small all-reduce: the default), one off again (the
off-vs-off row is the noise floor), one on with each bucket read before its reduction (the unfused check)
and one on where each rank reads the average, in turn, the order rotating each round
(benchmarks/_checks_worker.py). The ratio against "off" is taken per round, of the slowest rank's epoch
wall time and of the ranks' summed CPU time (every thread: the comm thread's spinning too); the table gives
the median and the range of the per-round ratios. Then per-step alternation (--steps): training steps through
DDP directly, the setting changing every step, each timed; ratios of the medians (a load that drifts over
seconds falls on every setting alike); for DDP's default path, under ZeRO-1 (the check inside its
reduce-scatter; "scan": reading the gradients first, as before) and with the fp16 hook (inside its casts). CX_DEBUG: jobs with
CX_DEBUG off and DETAIL alternate (`--debug-rounds` pairs), each timing a loop of all_reduces; the ratio
is per pair. Ratios only: the machine is shared and absolute times move 10-30% from run to run.
"""
from __future__ import annotations

import argparse
import statistics
import sys

if __package__ in (None, ""):
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._launch import run_ranks
from benchmarks._report import format_table, write_json


def train_ratios(model: str, world: int, rounds: int, samples: int, timeout_s: float) -> dict:
    run = run_ranks("pycyxwiz", "benchmarks._checks_worker",
                    ["--model", model, "--rounds", str(rounds), "--samples-per-rank", str(samples)], world, timeout_s)
    if not run.ok:
        return {"model": model, "ok": False, "reason": run.reason}
    per_rank = [r["steps"][0]["times"] for r in run.ranks]
    cpu_rank = [r["steps"][0]["cpu"] for r in run.ranks]
    out = {"model": model, "ok": True, "load": run.load}
    off = [max(t["off"][i] for t in per_rank) for i in range(rounds)]
    off_cpu = [sum(t["off"][i] for t in cpu_rank) for i in range(rounds)]
    out["off_s"], out["off_cpu_s"] = off, off_cpu
    for mode in MODES:
        on = [max(t[mode][i] for t in per_rank) for i in range(rounds)]
        on_cpu = [sum(t[mode][i] for t in cpu_rank) for i in range(rounds)]
        ratios = [b / a for a, b in zip(off, on)]
        cpu_ratios = [b / a for a, b in zip(off_cpu, on_cpu)]
        out[mode] = {"on_s": on, "cpu_s": on_cpu, "ratios": ratios, "median_ratio": statistics.median(ratios),
                     "best_ratio": min(on) / min(off), "cpu_ratios": cpu_ratios,
                     "median_cpu_ratio": statistics.median(cpu_ratios), "best_cpu_ratio": min(on_cpu) / min(off_cpu)}
    return out


VARIANT = {"zero": "ZeRO-1", "fp16": "fp16 hook"}
MODES = ("off2", "raise", "scan", "read")
WHAT = {"off2": "'off' again vs 'off' (noise)", "raise": "'raise' (fused, the default) vs 'off'",
        "scan": "'raise', each bucket read first, vs 'off'", "read": "'raise', each rank reading, vs 'off'"}


def step_ratios(model: str, world: int, steps: int, timeout_s: float, variant: str = "plain") -> dict:
    """Per-step alternation (benchmarks/_checks_worker.py --steps): each step's wall time is the slowest
    rank's, its CPU time the ranks' sum; medians per setting, ratios of medians against "off"."""
    run = run_ranks("pycyxwiz", "benchmarks._checks_worker",
                    ["--model", model, "--steps", str(steps), "--variant", variant], world, timeout_s)
    if not run.ok:
        return {"model": model, "ok": False, "reason": run.reason}
    res = [r["steps"][0] for r in run.ranks]
    out = {"model": model, "variant": variant, "ok": True, "load": run.load}
    med = {}
    for mode in res[0]["wall"]:
        n = len(res[0]["wall"][mode])
        wall = [max(r["wall"][mode][i] for r in res) for i in range(n)]
        cpu = [sum(r["cpu"][mode][i] for r in res) for i in range(n)]
        med[mode] = (statistics.median(wall), statistics.median(cpu))
        out[mode] = {"median_wall_s": med[mode][0], "median_cpu_s": med[mode][1], "steps": n}
    for mode in med:
        out[mode]["wall_ratio"] = med[mode][0] / med["off"][0]
        out[mode]["cpu_ratio"] = med[mode][1] / med["off"][1]
    return out


def debug_ratios(world: int, pairs: int, calls: int, timeout_s: float) -> dict:
    rows = []
    for _ in range(pairs):
        pair = {}
        for level in ("OFF", "DETAIL"):
            run = run_ranks("pycyxwiz", "benchmarks._checks_worker", ["--collective", "--calls", str(calls)], world,
                            timeout_s, extra_env={"CX_DEBUG": level})
            if not run.ok:
                return {"ok": False, "reason": run.reason}
            pair[level] = {k: max(r["steps"][0][k] for r in run.ranks) for k in run.ranks[0]["steps"][0]}
        rows.append(pair)
    out = {"ok": True, "pairs": rows}
    for size in rows[0]["OFF"]:
        off = [p["OFF"][size] for p in rows]
        det = [p["DETAIL"][size] for p in rows]
        out[size] = {"off_us": statistics.median(off) * 1e6, "detail_us": statistics.median(det) * 1e6,
                     "median_ratio": statistics.median(d / o for o, d in zip(off, det)),
                     "extra_us": statistics.median(d - o for o, d in zip(off, det)) * 1e6}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6, help="epochs per setting, per model (0: none)")
    ap.add_argument("--mlp-samples", type=int, default=4096)
    ap.add_argument("--cnn-samples", type=int, default=256)
    ap.add_argument("--skip-cnn", action="store_true")
    ap.add_argument("--skip-train", action="store_true", help="only the CX_DEBUG part")
    ap.add_argument("--steps", type=int, default=4000,
                    help="training steps alternating the setting every step, per model (0: none)")
    ap.add_argument("--variants", default="plain,zero,fp16",
                    help="per-step rows: DDP's default path, ZeRO-1 (ZeroRedundancyOptimizer), the fp16 hook")
    ap.add_argument("--debug-rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=2000)
    a = ap.parse_args(argv)
    payload: dict = {"benchmark": "checks", "world": a.world, "rounds": a.rounds, "train": [], "debug": None}
    rows = []
    for model, samples in (("mlp", a.mlp_samples), ("cnn", a.cnn_samples)):
        if a.skip_train or not a.rounds or (model == "cnn" and a.skip_cnn):
            continue
        print(f"  {model}: {a.rounds} rounds of one epoch in each of off, raise, off2, scan, read ...", flush=True)
        r = train_ratios(model, a.world, a.rounds, samples, 1800)
        payload["train"].append(r)
        if r["ok"]:
            for mode in MODES:
                m = r[mode]
                rows.append([f"{model} fit, {WHAT[mode]}", f"{m['median_ratio']:.3f}",
                             f"{min(m['ratios']):.3f} - {max(m['ratios']):.3f}", f"{m['best_ratio']:.3f}",
                             f"{m['median_cpu_ratio']:.3f}",
                             f"{min(m['cpu_ratios']):.3f} - {max(m['cpu_ratios']):.3f}"])
        else:
            rows.append([model, "n/a", r["reason"], "", "", ""])
    for model in ("mlp", "cnn"):
        for variant in a.variants.split(","):
            if a.skip_train or not a.steps or (model == "cnn" and a.skip_cnn):
                continue
            steps = a.steps if model == "mlp" else max(4, a.steps // 8)
            print(f"  {model} ({variant}): {steps} steps, the setting changing every step ...", flush=True)
            r = step_ratios(model, a.world, steps, 1800, variant)
            payload.setdefault("per_step", []).append(r)
            name = model if variant == "plain" else f"{model} {VARIANT[variant]}"
            if r["ok"]:
                for mode in ("off2", "raise", "scan", "read"):
                    if mode not in r:
                        continue
                    m = r[mode]
                    rows.append([f"{name} steps, {WHAT[mode]}", f"{m['wall_ratio']:.3f}",
                                 f"{m['steps']} steps, median {m['median_wall_s'] * 1e3:.2f} ms", "",
                                 f"{m['cpu_ratio']:.3f}", ""])
            else:
                rows.append([f"{name} steps", "n/a", r["reason"], "", "", ""])
    if a.debug_rounds:
        print(f"  CX_DEBUG off / DETAIL: {a.debug_rounds} pairs of jobs ...", flush=True)
        d = debug_ratios(a.world, a.debug_rounds, a.calls, 600)
        payload["debug"] = d
        if d["ok"]:
            for size in ("8 floats", "256 KiB"):
                rows.append([f"all_reduce {size}, CX_DEBUG=DETAIL vs off", f"{d[size]['median_ratio']:.3f}",
                             f"+{d[size]['extra_us']:.1f} us a call", "", "", ""])
    print(format_table([f"what ({a.world} ranks)", "wall: median ratio", "range / extra", "best/best",
                        "CPU: median ratio", "range"], rows))
    write_json("checks", payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
