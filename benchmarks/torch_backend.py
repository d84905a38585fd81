"""torch.distributed over pycyxwiz ("cyxwiz", pycyxwiz.torch) against gloo and against pycyxwiz called directly.

    python -m benchmarks.torch_backend               # all_reduce and DDP, 2 and 4 ranks, 127.0.0.1 and 1gbit links
    python -m benchmarks.torch_backend --quick       # smoke run: fewer sizes, calls and steps, one round
    python -m benchmarks.torch_backend --parts allreduce --worlds 2
    python -m benchmarks.torch_backend --parts allreduce --columns paired --sizes 8 64K   # the backend's cost
    python -m benchmarks.torch_backend --no-link     # DDP over 127.0.0.1 only

Two parts, every column its own set of processes (benchmarks._launch), side by side in one run:

all_reduce: `dist.all_reduce` of one float32 torch tensor (8 B .. 64 MiB) with torch.distributed over
"cyxwiz" and over "gloo", and `cx.distributed.all_reduce` on the same kind of torch tensor, pycyxwiz
called directly (through DLPack, no torch.distributed in between): what the backend costs on top of
the library. Like with like: all three over TCP (CX_SHM=0 for both pycyxwiz columns, as gloo uses TCP);
"cyxwiz-shm" and "direct-shm" are the same two through shared memory (CX_SHM=1, pycyxwiz's default
with every rank on one host). "paired" measures the backend's cost again within the same processes,
which join both torch's "cyxwiz" group and pycyxwiz's own (on MASTER_PORT + 1): each timed dist.all_reduce
is followed by a timed cx.distributed.all_reduce on the same tensor, so both see the same load (separate
columns on a busy 2-core machine differ by tens of microseconds at small sizes from the load alone).
Per size: a correctness check, warm-up calls, then 10..400 timed calls (about 512 MiB of traffic), each
after a barrier; the time of a call is the max over ranks, the figure the median over calls; each column
runs --rounds times (libraries in reverse order on every other round) and each size keeps its best round
(benchmarks.allreduce.merge_rounds).

DDP: PyTorch DistributedDataParallel training samples/s, backend "cyxwiz" against "gloo" (and
"cyxwiz-shm" on 127.0.0.1), an MLP 784-2048-2048-10 (5.8 M parameters, 23 MB of gradients a step:
communication-heavy) and a small CNN (3 conv layers + a linear on 3x32x32, 67 k parameters:
compute-heavy), batch 32 per rank, SGD, the same seeded initial weights in every column, warm-up steps
not timed; a "ceiling" column runs the same DDP with communication that takes no time (Note [The ceiling
of a DDP step]). On 127.0.0.1, and with --link (default 1gbit) each rank a host of its own behind a link of
that rate (network namespaces, root and iproute2; n/a with the reason elsewhere): Note [Which link is
communication-bound] in benchmarks/hooks.py.

Every rank runs one compute thread. Ratios: cyxwiz/gloo is speed (gloo's time / cyxwiz's, or samples/s
over samples/s), above 1 = cyxwiz faster; cyxwiz/direct is time (cyxwiz's / direct's), above 1 = the
backend costs that much on top of pycyxwiz; "extra" is the difference in time. The targets (the
constants AR_VS_GLOO .. DDP_CNN below) are printed next to the figures as PASS/MISS, never asserted.

Writes benchmarks/results/partial/torch_backend.json (Note [Where results go] in _launch.py).
"""
from __future__ import annotations

import argparse
import math
import re
import statistics
import sys

if __package__ in (None, ""):
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _launch
from benchmarks._launch import run_ranks
from benchmarks._report import format_table, human_size, median, parse_size, write_json
from benchmarks.allreduce import bus_factor, run_rounds

WORKER = "benchmarks._torch_worker"
SIZES = [8, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [8, 64 << 10, 16 << 20]
# column -> (library as run_ranks knows it, environment). "direct" is pycyxwiz called directly.
AR_COLUMNS = {
    "cyxwiz": ("cyxwiz", {"CX_SHM": "0"}),
    "gloo": ("gloo", {}),
    "direct": ("pycyxwiz", {"CX_SHM": "0"}),
    "cyxwiz-shm": ("cyxwiz-shm", {"CX_SHM": "1"}),
    "direct-shm": ("pycyxwiz-shm", {"CX_SHM": "1"}),
    # Both in the same processes, calls alternated (_torch_worker --paired), TCP: the backend's cost under the
    # same load, which separate columns on a busy 2-core machine measure only to within tens of microseconds.
    "paired": ("cyxwiz", {"CX_SHM": "0"}),
}
DDP_COLUMNS = {
    "cyxwiz": ("cyxwiz", {"CX_SHM": "0"}),
    "gloo": ("gloo", {}),
    "cyxwiz-shm": ("cyxwiz-shm", {"CX_SHM": "1"}),
    "ceiling": ("gloo", {}),  # with --no-comm: Note [The ceiling of a DDP step]
}
DDP_ARGS = {"ceiling": ["--no-comm"]}
LABEL = {
    "cyxwiz": "torch.distributed over cyxwiz, TCP (CX_SHM=0)",
    "gloo": "torch.distributed over gloo (TCP)",
    "direct": "pycyxwiz called directly (cx.distributed.all_reduce on the torch tensor), TCP (CX_SHM=0)",
    "cyxwiz-shm": "torch.distributed over cyxwiz, shared memory (CX_SHM=1)",
    "direct-shm": "pycyxwiz called directly, shared memory (CX_SHM=1)",
    "paired": "cyxwiz and direct in the same processes (pycyxwiz's own group on MASTER_PORT+1), calls "
              "alternated, TCP: the time shown is cyxwiz's",
    "ceiling": "DDP whose communication takes no time (a comm hook that hands the bucket back)",
}
MODELS = {"mlp": "MLP 784-2048-2048-10",
          "cnn": "CNN 3x32x32: conv3x3(32)-pool, conv3x3(64)-pool, conv3x3(64)-pool, linear(1024,10)"}
LINK = "1gbit"

# The targets, reported next to the figures, never asserted.
AR_VS_GLOO = 1.5        # dist.all_reduce over cyxwiz: >= 1.5x gloo's speed, every size and rank count
OVERHEAD_FROM = 64 << 10
OVERHEAD_RATIO = 1.15   # ... within 15% of pycyxwiz called directly from 64 KiB up
OVERHEAD_8B_US = 10.0   # ... and at most 10 us more at 8 B
DDP_MLP_LOOPBACK = 1.3  # DDP samples/s vs gloo, MLP, 127.0.0.1
DDP_MLP_LINK = 1.5      # ... over shaped links
DDP_CNN = 1.0           # CNN: never below gloo

# Note [The ceiling of a DDP step]
# No backend makes a DDP step shorter than the step whose communication takes no time: the same DDP (buckets,
# copies, hooks) with a comm hook that hands each bucket back at once, the "ceiling" column. Over a link, a
# step also cannot be shorter than the time the link needs for the bytes a ring all_reduce must send from each
# rank, 2(p-1)/p x the gradient bytes (no all_reduce sends fewer without changing the numbers), at the link's
# payload rate: tc's rate counts whole frames, and a full 1514-byte frame carries 1448 bytes of TCP payload.
# So the most any backend can reach is gloo's step time over max(ceiling step, link time): printed as
# "ceiling/gloo" next to each target. A target above it cannot be met by communicating faster, only by
# sending fewer bytes (a compression hook, which gloo has too) or by computing faster.
PAYLOAD_PER_FRAME = 1448 / 1514


def link_bytes_per_second(rate: str) -> float | None:
    """A tc rate ("1gbit", "500mbit") as payload bytes per second (Note [The ceiling of a DDP step])."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if not m:
        return None
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)] / 8 * PAYLOAD_PER_FRAME


def verdict(ok) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "MISS")


def shown(value: float, met, digits: int = 2) -> float:
    """value rounded to `digits`, away from the goal where plain rounding would cross it (a 1.4996x miss of
    ">= 1.5x" shows as 1.49x, not as the goal itself), as benchmarks.run_all's targets do."""
    r = round(value, digits)
    if met(r) != met(value):
        f = 10 ** digits
        r = next(x for x in (math.floor(value * f) / f, math.ceil(value * f) / f) if met(x) == met(value))
    return r


def ratio_text(value, met=None) -> str:
    """"1.62x", with " PASS"/" MISS" when `met` (a test of the value) is given."""
    if value is None:
        return "n/a"
    if met is None:
        return f"{value:.2f}x"
    return f"{shown(value, met):.2f}x {verdict(met(value))}"


# ---- all_reduce ---------------------------------------------------------------------------

def ar_column(col: str, world: int, sizes: list, scale: float, timeout_s: float) -> dict:
    lib, env = AR_COLUMNS[col]
    args = ["allreduce", "--iters-scale", str(scale), "--sizes", *map(str, sizes)]
    if col == "paired":
        args.append("--paired")
    run = run_ranks(lib, WORKER, args, world, timeout_s, extra_env=env)
    out = {"lib": col, "world": world, "ok": run.ok, "reason": run.reason, "wall_s": round(run.wall_s, 2),
           "load": run.load, "warning": run.warning, "results": [], "version": ""}
    ranks = run.ranks if run.ranks and all(r is not None for r in run.ranks) else []
    if ranks:
        out["version"] = ranks[0].get("info", {}).get("version", "")
        for i in range(min(len(r["steps"]) for r in ranks)):
            per_rank = [r["steps"][i] for r in ranks]
            calls = [max(ts) for ts in zip(*(s["times"] for s in per_rank))]
            t = median(calls)
            nbytes = per_rank[0]["bytes"]
            algbw = nbytes / t / 1e9 if t > 0 else None
            res = {"nominal": per_rank[0]["nominal"], "bytes": nbytes, "iters": len(calls), "median_s": t,
                   "min_s": min(calls), "p90_s": sorted(calls)[int(0.9 * (len(calls) - 1))],
                   "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor("all_reduce", world) if algbw else None,
                   "correct": all(s["correct"] for s in per_rank)}
            if all("direct_times" in s for s in per_rank):  # --paired: the direct call after each one
                direct = [max(ts) for ts in zip(*(s["direct_times"] for s in per_rank))]
                res.update({"direct_median_s": median(direct), "direct_min_s": min(direct),
                            "diff_median_s": median([x - y for x, y in zip(calls, direct)])})
            out["results"].append(res)
    done = {r["nominal"] for r in out["results"]}
    out["missing"] = [s for s in sizes if s not in done]
    if out["missing"] and not out["reason"]:
        out["reason"] = "no result for some sizes"
    return out


def run_allreduce(worlds: list, cols: list, sizes: list, scale: float, rounds: int, timeout_s: float = 180,
                  log=print) -> dict:
    columns = run_rounds("all_reduce", worlds, cols, rounds,
                         lambda col, world: ar_column(col, world, sizes, scale, timeout_s), log)
    return {"op": "all_reduce", "dtype": "float32", "reduce_op": "SUM", "sizes": sizes, "worlds": worlds,
            "libs": cols, "rounds": rounds, "iters_scale": scale, "columns": columns}


def _ar_cell(ar: dict, col: str, world: int, size: int) -> dict:
    c = next((c for c in ar["columns"] if c["lib"] == col and c["world"] == world), None)
    return next((r for r in (c or {}).get("results", []) if r["nominal"] == size), {})


def ar_ratios(ar: dict, world: int, size: int, suffix: str = "") -> dict:
    """speed vs gloo (gloo's time / cyxwiz's), time vs direct (cyxwiz's / direct's), extra seconds."""
    cx, gl, di = (_ar_cell(ar, c + s, world, size).get("median_s")
                  for c, s in (("cyxwiz", suffix), ("gloo", ""), ("direct", suffix)))
    return {"vs_gloo": gl / cx if cx and gl else None,
            "vs_direct": cx / di if cx and di else None,
            "extra_s": cx - di if cx and di else None}


def paired_ratios(ar: dict, world: int, size: int) -> dict:
    """From the paired column: cyxwiz's time over direct's, and the median of the call-by-call differences."""
    c = _ar_cell(ar, "paired", world, size)
    cx, di = c.get("median_s"), c.get("direct_median_s")
    return {"vs_direct": cx / di if cx and di else None, "extra_s": c.get("diff_median_s")}


def by_round(ar: dict, num: str, den: str, world: int, size: int) -> str:
    """num's median over den's, round by round (the rounds ran side by side): how much of a margin is noise."""
    a = _ar_cell(ar, num, world, size).get("round_medians_s") or []
    b = _ar_cell(ar, den, world, size).get("round_medians_s") or []
    if len(a) < 2 or len(a) != len(b):
        return ""
    return " (by round: " + ", ".join(f"{x / y:.2f}x" for x, y in zip(a, b) if y > 0) + ")"


def fmt_t(seconds) -> str:
    if seconds is None:
        return "n/a"
    us = seconds * 1e6
    return f"{us:.1f} us" if us < 100 else f"{us:.0f} us" if us < 1000 else f"{us / 1e3:.2f} ms"


def fmt_extra(seconds, met_us=None) -> str:
    """The difference in time, "+12.3 us" or "-1.46 ms"; with `met_us` (a test of microseconds), its verdict."""
    if seconds is None:
        return "n/a"
    if met_us is not None:
        return f"{shown(seconds * 1e6, met_us, 1):+.1f} us {verdict(met_us(seconds * 1e6))}"
    return f"{seconds * 1e6:+.1f} us" if abs(seconds) < 1e-3 else f"{seconds * 1e3:+.2f} ms"


def _vs_gloo(v):
    return v >= AR_VS_GLOO


def _vs_direct(v):
    return v <= OVERHEAD_RATIO


def _extra_us(us):
    return us <= OVERHEAD_8B_US


def ar_tables(ar: dict, markdown: bool = False) -> str:
    out = []
    libs = ar["libs"]
    timed = [c for c in libs if c != "paired"]
    shm = "cyxwiz-shm" in libs and "direct-shm" in libs
    paired = "paired" in libs
    for world in ar["worlds"]:
        headers = ["size"] + timed + ["cyxwiz/gloo", "cyxwiz/direct", "extra"]
        if paired:
            headers += ["paired: cyxwiz/direct", "paired: extra"]
        if shm:
            headers += ["shm: cyxwiz/gloo", "shm: cyxwiz/direct", "shm: extra"]
        rows = []
        for size in ar["sizes"]:
            row = [human_size(size)]
            for col in timed:
                c = _ar_cell(ar, col, world, size)
                row.append(fmt_t(c.get("median_s")) + ("" if not c or c["correct"] else " (WRONG)"))
            cells = [ar_ratios(ar, world, size)]
            if paired:
                cells.append(paired_ratios(ar, world, size))
            for i, r in enumerate(cells):
                if i == 0:
                    g = r["vs_gloo"]
                    row.append(ratio_text(g, _vs_gloo))
                d, e = r["vs_direct"], r["extra_s"]
                row.append(ratio_text(d, _vs_direct if size >= OVERHEAD_FROM else None))
                row.append(fmt_extra(e, _extra_us if size == 8 else None))
            if shm:
                rs = ar_ratios(ar, world, size, "-shm")
                row += [ratio_text(rs["vs_gloo"]), ratio_text(rs["vs_direct"]), fmt_extra(rs["extra_s"])]
            rows.append(row)
        title = (f"dist.all_reduce float32, {world} ranks on 127.0.0.1: median time per call (max over ranks), "
                 f"best of {ar['rounds']} round(s). cyxwiz/gloo = speed (above 1: cyxwiz faster; target >= "
                 f"{AR_VS_GLOO}x), cyxwiz/direct = time (above 1: what the torch backend costs over pycyxwiz called "
                 f"directly; target <= {OVERHEAD_RATIO}x from {human_size(OVERHEAD_FROM)} up), extra = the "
                 f"difference (target at 8 B: <= {OVERHEAD_8B_US:.0f} us)")
        out.append((f"**{title}**\n\n" if markdown else title + "\n") + format_table(headers, rows, markdown))
        cols = [c for c in ar["columns"] if c["world"] == world]
        notes = [f"{c['lib']}: n/a ({c['reason']})" for c in cols if c["reason"]]
        notes += [f"{c['lib']}: warning ({c['warning']})" for c in cols if c.get("warning")]
        if notes:
            out.append("\n".join(("- " if markdown else "  ") + n for n in notes))
    legend = [f"{k} = {LABEL[k]}" for k in timed]
    if paired:
        legend.append("paired: " + LABEL["paired"] + "; its extra is the median of the call-by-call differences")
    legend.append("shm: the same ratios for cyxwiz-shm, direct-shm")
    out.append("\n".join(("- " if markdown else "  ") + n for n in legend))
    return "\n\n".join(out)


# ---- DDP ----------------------------------------------------------------------------------

def ddp_columns(col: str, models: list, world: int, steps: int, warmup: int, batch: int, timeout_s: float,
                link: str | None) -> list:
    """One launch of `world` ranks training every model in turn: a column per model."""
    lib, env = DDP_COLUMNS[col]
    args = ["ddp", "--models", *models, "--steps", str(steps), "--warmup", str(warmup), "--batch", str(batch),
            *DDP_ARGS.get(col, [])]
    run = run_ranks(lib, WORKER, args, world, timeout_s, extra_env=env, link=link)
    out = []
    for i, model in enumerate(models):
        c = {"lib": col, "model": model, "world": world, "link": link, "ok": False, "reason": run.reason,
             "wall_s": round(run.wall_s, 2), "load": run.load, "warning": run.warning}
        st = [r["steps"][i] for r in run.ranks if r and len(r.get("steps", [])) > i] if run.ranks else []
        if len(st) == world:
            seconds = max(s["seconds"] for s in st)
            n = len(st[0]["step_times"])
            median_step = statistics.median(max(s["step_times"][j] for s in st) for j in range(n))
            c.update({
                "ok": True, "reason": "",
                "version": run.ranks[0].get("info", {}).get("version", ""),
                "seconds": seconds, "step_s": seconds / n, "median_step_s": median_step,
                "samples_per_second": sum(s["samples"] for s in st) / seconds,
                "samples_per_second_median_step": batch * world / median_step,
                "params": st[0]["params"], "first_loss": st[0]["first_loss"], "last_loss": st[0]["last_loss"],
                "in_sync": all(s["in_sync"] for s in st),
            })
            if not c["in_sync"]:
                c["warning"] = "weights differ between ranks after training"
        elif not c["reason"]:
            c["reason"] = "no result"
        out.append(c)
    return out


def _best(cols: list) -> dict:
    """Of several rounds of one column, the one with the most samples/s (every round's figure kept)."""
    ok = [c for c in cols if c["ok"]]
    if not ok:
        return dict(cols[-1], round_sps=[], rounds=len(cols))
    best = max(ok, key=lambda c: c["samples_per_second"])
    return dict(best, round_sps=[c.get("samples_per_second") for c in cols], rounds=len(cols))


def run_ddp(models: list, worlds: list, cols: list, steps: int, warmup: int, batch: int, rounds: int,
            link: str | None = None, timeout_s: float = 300, log=print) -> dict:
    """Every (world, column), each launch training every model; with `link`, each rank on a host of its own
    behind links of that rate (no shared memory there: the -shm column is left out)."""
    if link:
        cols = [c for c in cols if not c.endswith("-shm")]
    raw: dict = {}
    for rnd in range(rounds):
        for world in worlds:
            for col in (cols if rnd % 2 == 0 else cols[::-1]):
                tag = f" (round {rnd + 1}/{rounds})" if rounds > 1 else ""
                where = f", {link} links" if link else ""
                log(f"  DDP world {world}{where}: {col}{tag} ...", end="", flush=True)
                got = ddp_columns(col, models, world, steps, warmup, batch, timeout_s, link)
                log(f" {got[0]['wall_s']:.0f}s  " + ", ".join(
                    f"{c['model']} {c['samples_per_second']:,.0f} samples/s" if c["ok"] else
                    f"{c['model']} n/a ({c['reason']})" for c in got))
                for c in got:
                    raw.setdefault((c["model"], world, col), []).append(c)
    columns = [_best(raw[k]) for k in raw]
    return {"models": {m: MODELS[m] for m in models}, "worlds": worlds, "libs": cols, "link": link,
            "batch_per_rank": batch, "steps": steps, "warmup": warmup, "rounds": rounds, "optimizer": "SGD(0.01)",
            "threads_per_rank": 1, "columns": columns}


def _ddp_col(dp: dict, col: str, model: str, world: int) -> dict:
    return next((c for c in dp["columns"] if c["lib"] == col and c["model"] == model and c["world"] == world
                 and c["ok"]), {})


def ddp_ratio(dp: dict, model: str, world: int, col: str = "cyxwiz") -> float | None:
    a, b = _ddp_col(dp, col, model, world), _ddp_col(dp, "gloo", model, world)
    return a["samples_per_second"] / b["samples_per_second"] if a and b else None


def ddp_ceiling(dp: dict, model: str, world: int) -> float | None:
    """The most any backend can reach, as a multiple of gloo's samples/s (Note [The ceiling of a DDP step])."""
    c, g = _ddp_col(dp, "ceiling", model, world), _ddp_col(dp, "gloo", model, world)
    if not c or not g:
        return None
    bound = c["step_s"]
    rate = link_bytes_per_second(dp["link"]) if dp["link"] else None
    if rate:
        bound = max(bound, 4 * c["params"] * 2 * (world - 1) / world / rate)
    return g["step_s"] / bound


def ddp_round_ratios(dp: dict, model: str, world: int, col: str = "cyxwiz") -> list:
    """cyxwiz's samples/s over gloo's, round by round (the rounds ran side by side)."""
    a, b = _ddp_col(dp, col, model, world), _ddp_col(dp, "gloo", model, world)
    xs, ys = (a or {}).get("round_sps") or [], (b or {}).get("round_sps") or []
    return [f"{x / y:.2f}x" if x and y else "n/a" for x, y in zip(xs, ys)]


def ddp_goal(model: str, link: str | None) -> float:
    if model == "cnn":
        return DDP_CNN
    return DDP_MLP_LINK if link else DDP_MLP_LOOPBACK


def ddp_table(dp: dict, markdown: bool = False) -> str:
    libs = dp["libs"]
    where = f"each rank its own host, links shaped to {dp['link']} (tc tbf)" if dp["link"] else "127.0.0.1"
    headers = ["model", "ranks"] + [f"{c} samples/s" for c in libs] + [f"{c} ms/step" for c in libs]
    headers.append("cyxwiz/gloo (target)")
    if "cyxwiz-shm" in libs:
        headers.append("cyxwiz-shm/gloo")
    if "ceiling" in libs:
        headers.append("ceiling/gloo")
    rows = []
    for model in dp["models"]:
        for world in dp["worlds"]:
            cells = {c: _ddp_col(dp, c, model, world) for c in libs}
            row = [model, str(world)]
            row += [f"{cells[c]['samples_per_second']:,.0f}" if cells[c] else "n/a" for c in libs]
            row += [f"{1e3 * cells[c]['step_s']:.1f}" if cells[c] else "n/a" for c in libs]
            r, goal = ddp_ratio(dp, model, world), ddp_goal(model, dp["link"])
            row.append(ratio_text(r, lambda v, g=goal: v >= g) + ("" if r is None else f" (>= {goal}x)"))
            if "cyxwiz-shm" in libs:
                row.append(ratio_text(ddp_ratio(dp, model, world, "cyxwiz-shm")))
            if "ceiling" in libs:
                row.append(ratio_text(ddp_ceiling(dp, model, world)))
            rows.append(row)
    title = (f"PyTorch DDP training, {where}: global samples/s (best of {dp['rounds']} round(s)) and time per step, "
             f"batch {dp['batch_per_rank']}/rank, {dp['optimizer']}, 1 thread/rank, "
             f"{dp['steps']} timed steps after {dp['warmup']} warm-up; "
             f"cyxwiz/gloo = samples/s ratio")
    text = (f"**{title}**\n\n" if markdown else title + "\n") + format_table(headers, rows, markdown)
    notes = sorted({f"{c['lib']} {c['model']} ({c['world']} ranks): n/a ({c['reason']})"
                    for c in dp["columns"] if not c["ok"]}
                   | {f"{c['lib']} {c['model']} ({c['world']} ranks): warning ({c['warning']})"
                      for c in dp["columns"] if c.get("warning")})
    notes.append("models: " + "; ".join(f"{k} = {v}" for k, v in dp["models"].items()))
    if "ceiling" in libs:
        notes.append("ceiling/gloo: the most any backend can reach, gloo's step time over the step without "
                     "communication" + (f" or the {dp['link']} link's time for 2(p-1)/p x the gradient bytes, "
                                        "whichever is longer" if dp["link"] else "")
                     + " (Note [The ceiling of a DDP step])")
    return text + "\n\n" + "\n".join(("- " if markdown else "  ") + n for n in notes)


# ---- targets ------------------------------------------------------------------------------

def targets(payload: dict) -> list:
    """Rows [target, ranks, measured, goal, PASS/MISS/n/a]."""
    rows = []
    ar = payload.get("allreduce")
    for world in (ar or {}).get("worlds", []):
        g = {s: ar_ratios(ar, world, s)["vs_gloo"] for s in ar["sizes"]}
        g = {s: v for s, v in g.items() if v is not None}
        worst = min(g, key=g.get) if g else None
        rows.append(["dist.all_reduce, cyxwiz vs gloo speed, every size (worst)", str(world),
                     f"{shown(g[worst], _vs_gloo):.2f}x at {human_size(worst)}"
                     + by_round(ar, "gloo", "cyxwiz", world, worst) if g else "n/a", f">= {AR_VS_GLOO}x",
                     verdict(_vs_gloo(g[worst]) if g else None)])
        d = {s: ar_ratios(ar, world, s)["vs_direct"] for s in ar["sizes"] if s >= OVERHEAD_FROM}
        d = {s: v for s, v in d.items() if v is not None}
        worst = max(d, key=d.get) if d else None
        rows.append([f"dist.all_reduce over cyxwiz / pycyxwiz direct, time, >= {human_size(OVERHEAD_FROM)} (worst)",
                     str(world),
                     f"{shown(d[worst], _vs_direct):.2f}x at {human_size(worst)}"
                     + by_round(ar, "cyxwiz", "direct", world, worst) if d else "n/a",
                     f"<= {OVERHEAD_RATIO}x", verdict(_vs_direct(d[worst]) if d else None)])
        if "paired" in ar["libs"]:
            p = {s: paired_ratios(ar, world, s)["vs_direct"] for s in ar["sizes"] if s >= OVERHEAD_FROM}
            p = {s: v for s, v in p.items() if v is not None}
            worst = max(p, key=p.get) if p else None
            rows.append(["... the same, paired (same processes, calls alternated)", str(world),
                         f"{shown(p[worst], _vs_direct):.2f}x at {human_size(worst)}" if p else "n/a",
                         f"<= {OVERHEAD_RATIO}x", verdict(_vs_direct(p[worst]) if p else None)])
        e = ar_ratios(ar, world, 8)["extra_s"] if 8 in ar["sizes"] else None
        rows.append(["dist.all_reduce over cyxwiz, extra time over pycyxwiz direct at 8 B", str(world),
                     fmt_extra(e, _extra_us).split(" us")[0] + " us" if e is not None else "n/a",
                     f"<= {OVERHEAD_8B_US:.0f} us", verdict(None if e is None else _extra_us(e * 1e6))])
        if "paired" in ar["libs"]:
            e = paired_ratios(ar, world, 8)["extra_s"] if 8 in ar["sizes"] else None
            rows.append(["... the same, paired (median call-by-call difference)", str(world),
                         fmt_extra(e, _extra_us).split(" us")[0] + " us" if e is not None else "n/a",
                         f"<= {OVERHEAD_8B_US:.0f} us", verdict(None if e is None else _extra_us(e * 1e6))])
    for key in ("ddp", "ddp_link"):
        dp = payload.get(key)
        if not dp:
            continue
        where = f"{dp['link']} links" if dp["link"] else "127.0.0.1"
        for model in dp["models"]:
            for world in dp["worlds"]:
                goal, top = ddp_goal(model, dp["link"]), ddp_ceiling(dp, model, world)
                met = (lambda v, g=goal: v >= g)
                # Like with like (TCP, as gloo), then what "cyxwiz" does by default with every rank on one
                # host (shared memory), where that column ran.
                for col, what in (("cyxwiz", "cyxwiz (TCP)"), ("cyxwiz-shm", "cyxwiz (shared memory: its default)")):
                    if col != "cyxwiz" and not any(c["lib"] == col for c in dp["columns"]):
                        continue
                    r = ddp_ratio(dp, model, world, col)
                    rows.append([f"DDP samples/s, {what} vs gloo, {model}, {where}", str(world),
                                 "n/a" if r is None else f"{shown(r, met):.2f}x" + (
                                     f" (rounds: {', '.join(ddp_round_ratios(dp, model, world, col))})"
                                     if dp["rounds"] > 1 else "") + ("" if top is None else f", ceiling {top:.2f}x"),
                                 f">= {goal}x", verdict(None if r is None else met(r))])
    if payload.get("ddp_link_skipped"):
        rows.append([f"DDP over {payload.get('link') or LINK} links", "-", "n/a", "-",
                     f"n/a ({payload['ddp_link_skipped']})"])
    return rows


def targets_table(payload: dict, markdown: bool = False) -> str:
    title = "targets (measured in this run, never asserted)"
    return ((f"**{title}**\n\n" if markdown else title + "\n")
            + format_table(["target", "ranks", "measured", "goal", "met"], targets(payload), markdown))


def tables(payload: dict, markdown: bool = False) -> str:
    parts = []
    if payload.get("allreduce"):
        parts.append(ar_tables(payload["allreduce"], markdown))
    if payload.get("ddp"):
        parts.append(ddp_table(payload["ddp"], markdown))
    if payload.get("ddp_link"):
        parts.append(ddp_table(payload["ddp_link"], markdown))
    elif payload.get("ddp_link_skipped"):
        parts.append(f"DDP over shaped links: n/a ({payload['ddp_link_skipped']})")
    parts.append(targets_table(payload, markdown))
    return "\n\n".join(parts)


# ---- the run ------------------------------------------------------------------------------

def run(worlds=(2, 4), sizes=None, quick: bool = False, parts=("allreduce", "ddp"), link: str | None = LINK,
        rounds: int | None = None, ar_cols=None, ddp_cols=None, models=("mlp", "cnn"), log=print) -> dict:
    """The whole benchmark; the JSON payload (what the tables read)."""
    worlds = list(worlds)
    rounds = rounds or (1 if quick else 2)
    payload: dict = {"benchmark": "torch_backend", "quick": quick, "worlds": worlds, "link": link}
    if "allreduce" in parts:
        payload["allreduce"] = run_allreduce(worlds, list(ar_cols or AR_COLUMNS),
                                             list(sizes or (QUICK_SIZES if quick else SIZES)),
                                             0.25 if quick else 1.0, rounds, log=log)
    if "ddp" in parts:
        warmup = 2 if quick else 4
        cols = list(ddp_cols or DDP_COLUMNS)
        payload["ddp"] = run_ddp(list(models), worlds, cols, 6 if quick else 30, warmup, 32, rounds, log=log)
        if link:
            why = _launch.link_available()
            if why:
                log(f"  DDP over {link} links: n/a ({why})")
                payload["ddp_link_skipped"] = why
            else:
                # One round: a shaped link's spread is small, and each step waits on it.
                payload["ddp_link"] = run_ddp(list(models), worlds, cols, 4 if quick else 10, warmup, 32, 1, link=link,
                                              log=log)
    return payload


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: sizes 8 B, 64 KiB, 16 MiB, fewer calls and "
                    "steps, one round")
    ap.add_argument("--parts", nargs="+", choices=["allreduce", "ddp"], default=["allreduce", "ddp"])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sizes", nargs="+", help="all_reduce sizes (8, 64K, 1M, ...; default 8 B .. 64 MiB)")
    ap.add_argument("--rounds", type=int, help="rounds per column, best kept (default 2; 1 with --quick)")
    ap.add_argument("--columns", nargs="+", choices=list(AR_COLUMNS), help="all_reduce columns to run (default: "
                    "all; e.g. --columns paired for the backend's cost alone)")
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--link", metavar="RATE", default=LINK, help=f"DDP again with each rank on a host of its own "
                    f"behind links shaped to RATE (default {LINK}; root and iproute2)")
    ap.add_argument("--no-link", action="store_true", help="DDP over 127.0.0.1 only")
    a = ap.parse_args(argv)
    sizes = [parse_size(s) for s in a.sizes] if a.sizes else None
    payload = run(a.worlds, sizes, a.quick, a.parts, None if a.no_link else a.link, a.rounds, ar_cols=a.columns,
                  models=a.models)
    print()
    print(tables(payload))
    print(f"\nwrote {write_json('torch_backend', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
