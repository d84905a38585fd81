"""Collectives side by side: pycyxwiz vs PyTorch gloo vs Open MPI (TCP forced, and default).

    python -m benchmarks.allreduce                              # all_reduce, worlds 2 and 4, 8 B .. 256 MiB
    python -m benchmarks.allreduce --op all_gather --worlds 2 3 --sizes 8 4M 64M
    python -m benchmarks.allreduce --libs gloo mpi-tcp --quick
    python -m benchmarks.allreduce --busy 2 --busy-pin          # 2 busy-loop processes beside every column
    python -m benchmarks.allreduce --worlds 4 --per-host 2 --link 1gbit --libs pycyxwiz-flat pycyxwiz-hier

Each (library, world) column is its own set of OS processes on 127.0.0.1, started by
benchmarks._launch with a timeout; a library that is missing, crashes or hangs shows as
"n/a (reason)" and the others still run. Per size: barrier, time one call, repeat (5..100
calls, fewer at large sizes); the time of a call is the max over ranks, the figure is the
median over calls. float32 SUM.

busbw follows nccl-tests (algbw = size / time, size as defined there):
    all_reduce      busbw = algbw * 2(n-1)/n
    all_gather      busbw = algbw * (n-1)/n      size = the gathered output
    reduce_scatter  busbw = algbw * (n-1)/n      size = the input
    broadcast       busbw = algbw
For a ring this is what each rank puts on the wire per second (and takes off it), so from 64 MiB
up it is compared with the TCP ceiling at that world size (benchmarks.loopback.tcp_ceiling:
loopback TCP both ways on data in memory, the cores shared out among the ranks); column
"cx/ceiling". Sizes below 64 KiB are shown as
latency (us per call). Ratios are pycyxwiz's speed over the other's (busbw ratio = inverse
time ratio): above 1 means pycyxwiz is faster.

With --busy N, N busy-loop processes (another job, a data loader: a loop that never sleeps), each in a
session of its own as another job's would be, run beside every column, pinned one per core with --busy-pin, else placed by the scheduler; the
figures then say what each library loses when its cores are wanted by someone else. The
1-minute load average at the end of each column is in the JSON (`load`) and the table's notes.

With --link RATE every host is a network namespace behind a link shaped to RATE (benchmarks._launch),
--per-host K ranks on each (shared memory inside a host); columns pycyxwiz-flat and pycyxwiz-hier force
CX_ALGORITHM=flat / hierarchical (ratio hier/flat); pycyxwiz-hier-seq is hierarchical in one slice, its
phases one after the other (ratio seq/flat).

Columns pycyxwiz-one-session and pycyxwiz-shm-one-session start pycyxwiz's ranks in one session, as
`launch --one-session` does (Note [One session or one per rank] in pycyxwiz/launch.py; ratio "one/own
session" against the same transport with a session per rank, as every other column but Open MPI's has).
Column pycyxwiz-shm-two-copies is pycyxwiz-shm with CX_SHM_SINGLE_COPY=0 (ratio "one/two copies").
Column pycyxwiz-system-cc is pycyxwiz (TCP) with CX_TCP_CONGESTION=system, the machine's congestion control
on every connection (ratio "cx/system-cc"; Note [Congestion control between ranks on one host]).

Writes benchmarks/results/partial/<name>.json and <name>.png (name defaults to the op's short name).
"""
from __future__ import annotations

import argparse
import sys

if __package__ in (None, ""):  # `python benchmarks/allreduce.py` works too
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._collective_worker import OPS
from benchmarks._launch import EXTRA_COLUMNS, LIBRARIES, run_ranks
from benchmarks.loopback import tcp_ceiling
from benchmarks._report import (LIB_LABEL, LIB_STYLE, fmt_gbps, fmt_ratio, fmt_time_us, format_table,
                                human_size, median, output_dir, parse_size, plt, write_json)

DEFAULT_SIZES = [8, 64, 512, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
QUICK_SIZES = [8, 4 << 10, 256 << 10, 4 << 20, 64 << 20]
LATENCY_BELOW = 64 << 10
CEILING_FROM = 64 << 20  # from here on data streams from memory, the TCP ceiling applies
SHORT_NAME = {"all_reduce": "allreduce", "broadcast": "broadcast", "all_gather": "allgather",
              "reduce_scatter": "reducescatter", "all_to_all": "alltoall", "scatter": "scatter", "gather": "gather",
              "reduce": "reduce", "barrier": "barrier", "pingpong": "pingpong"}


def bus_factor(op: str, n: int) -> float:
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
            "reduce_scatter": (n - 1) / n, "all_to_all": (n - 1) / n,
            "scatter": (n - 1) / n, "gather": (n - 1) / n, "broadcast": 1.0, "reduce": 1.0, "barrier": 0.0,
            "pingpong": 0.0}[op]


def run_column(lib: str, op: str, world: int, sizes: list, iters_scale: float, timeout_s: float,
               busy: int = 0, busy_pin: bool = False, link: str | None = None, per_host: int = 1) -> dict:
    """Run one library at one world size over all sizes; aggregate max-over-ranks medians."""
    args = ["--op", op, "--iters-scale", str(iters_scale), "--sizes", *map(str, sizes)]
    run = run_ranks(lib, "benchmarks._collective_worker", args, world, timeout_s, busy=busy, busy_pin=busy_pin,
                    link=link, per_host=per_host)
    col = {"lib": lib, "world": world, "ok": run.ok, "reason": run.reason,
           "wall_s": round(run.wall_s, 2), "load": run.load, "warning": run.warning,
           "results": [], "version": ""}
    ranks = run.ranks if run.ranks and all(r is not None for r in run.ranks) else []
    if ranks:
        col["version"] = ranks[0].get("info", {}).get("version", "")
        steps = min(len(r["steps"]) for r in ranks)
        for i in range(steps):
            per_rank = [r["steps"][i] for r in ranks]
            calls = [max(ts) for ts in zip(*(s["times"] for s in per_rank))]
            t = median(calls)
            nbytes = per_rank[0]["bytes"]
            algbw = nbytes / t / 1e9 if t > 0 and nbytes else None
            col["results"].append({
                "nominal": per_rank[0]["nominal"], "bytes": nbytes, "iters": len(calls),
                "median_s": t, "min_s": min(calls), "p90_s": sorted(calls)[int(0.9 * (len(calls) - 1))],
                "algbw_GBps": algbw,
                "busbw_GBps": algbw * bus_factor(op, world) if algbw is not None else None,
                "correct": all(s["correct"] for s in per_rank),
            })
    done = {r["nominal"] for r in col["results"]}
    col["missing"] = [s for s in sizes if s not in done]
    if col["missing"] and not col["reason"]:
        col["reason"] = "no result for some sizes"
    return col


def merge_rounds(cols: list) -> dict:
    """One column from several rounds of the same (library, world): per size, the round with the
    lowest median. Contention from other work on a shared machine comes in bursts of seconds;
    best-of-rounds keeps a burst from landing on one library only."""
    kept: dict = {}
    medians: dict = {}
    for c in cols:
        for r in c["results"]:
            k = r["nominal"]
            medians.setdefault(k, []).append(r["median_s"])
            if k not in kept or r["median_s"] < kept[k]["median_s"]:
                kept[k] = r
    merged = dict(cols[0])
    merged["results"] = [dict(kept[k], round_medians_s=medians[k]) for k in sorted(kept)]
    merged["rounds"] = len(cols)
    merged["wall_s"] = round(sum(c["wall_s"] for c in cols), 2)
    merged["load"] = max(c.get("load", 0) for c in cols)
    merged["missing"] = [s for s in cols[0]["missing"] if s not in kept]
    failures = [c["reason"] for c in cols if c["reason"]]
    merged["ok"] = bool(kept) and not merged["missing"]
    merged["reason"] = "" if merged["ok"] else (failures[0] if failures else "no result")
    warnings = [c["warning"] for c in cols if c.get("warning")]
    if merged["ok"] and failures:
        warnings.insert(0, f"failed in {len(failures)} of {len(cols)} rounds: {failures[0]}")
    merged["warning"] = warnings[0] if warnings else ""
    return merged


def run(op: str, worlds: list, libs: list, sizes: list, iters_scale: float = 1.0,
        timeout_s: float = 180, loopback: dict | None = None, rounds: int = 1, log=print, busy: int = 0,
        busy_pin: bool = False, link: str | None = None, per_host: int = 1) -> dict:
    """All columns of one collective; returns the JSON payload (also what the tables read).

    With rounds > 1 every column runs again (libraries in reverse order on odd rounds) and
    each size keeps its best round: see merge_rounds.
    """
    columns = run_rounds(op, worlds, libs, rounds,
                         lambda lib, world: run_column(lib, op, world, sizes, iters_scale, timeout_s, busy,
                                                       busy_pin, link, per_host), log)
    return {"benchmark": "collective", "op": op, "dtype": "float32", "reduce_op": "SUM",
            "busy": busy, "busy_pin": busy_pin, "link": link, "per_host": per_host,
            "sizes": sizes, "worlds": worlds, "libs": libs, "loopback": loopback or {}, "rounds": rounds,
            "latency_below_bytes": LATENCY_BELOW, "columns": columns}


def run_rounds(label: str, worlds: list, libs: list, rounds: int, column, log=print) -> list:
    """column(lib, world) for every world and library, `rounds` times (libraries in reverse order on odd
    rounds), logging each; returns one column per (world, lib), each size's best round kept (merge_rounds)."""
    raw: dict = {}
    for rnd in range(rounds):
        for world in worlds:
            for lib in (libs if rnd % 2 == 0 else libs[::-1]):
                tag = f" (round {rnd + 1}/{rounds})" if rounds > 1 else ""
                log(f"  {label} world {world}: {lib}{tag} ...", end="", flush=True)
                col = column(lib, world)
                log(f" {col['wall_s']:.0f}s" + ("" if col["ok"] else f"  n/a ({col['reason']})"))
                raw.setdefault((world, lib), []).append(col)
    return [merge_rounds(raw[(world, lib)]) for world in worlds for lib in libs]


def _cell(col: dict | None, nominal: int):
    if col is None:
        return None
    return next((r for r in col["results"] if r["nominal"] == nominal), None)


def tables(payload: dict, markdown: bool = False) -> str:
    """One table per world size: a column per library, then pycyxwiz's ratios."""
    op, libs = payload["op"], payload["libs"]
    lb = payload.get("loopback") or {}
    out = []
    for world in payload["worlds"]:
        cols = {c["lib"]: c for c in payload["columns"] if c["world"] == world}
        # pycyxwiz over TCP against the TCP columns; pycyxwiz over shared memory against Open MPI's.
        has_cx = "pycyxwiz" in libs
        pairs = [("pycyxwiz", lib, f"cx/{lib}") for lib in libs if has_cx and lib in ("gloo", "mpi-tcp")]
        if "pycyxwiz-hier" in libs and "pycyxwiz-flat" in libs:
            pairs.append(("pycyxwiz-hier", "pycyxwiz-flat", "hier/flat"))
        if "pycyxwiz-hier-seq" in libs and "pycyxwiz-flat" in libs:
            pairs.append(("pycyxwiz-hier-seq", "pycyxwiz-flat", "seq/flat"))
        for one, own in (("pycyxwiz-one-session", "pycyxwiz"), ("pycyxwiz-shm-one-session", "pycyxwiz-shm")):
            if one in libs and own in libs:
                pairs.append((one, own, f"{'shm ' if 'shm' in own else ''}one/own session"))
        if "pycyxwiz-shm-two-copies" in libs and "pycyxwiz-shm" in libs:
            pairs.append(("pycyxwiz-shm", "pycyxwiz-shm-two-copies", "one/two copies"))
        if "pycyxwiz-system-cc" in libs and has_cx:
            pairs.append(("pycyxwiz", "pycyxwiz-system-cc", "cx/system-cc"))
        if "mpi-default" in libs:
            if "pycyxwiz-shm-one-session" in libs:
                pairs.append(("pycyxwiz-shm-one-session", "mpi-default", "shm one session/mpi-default"))
            if "pycyxwiz-shm" in libs:
                pairs.append(("pycyxwiz-shm", "mpi-default", "shm/mpi-default"))
            elif has_cx:
                pairs.append(("pycyxwiz", "mpi-default", "cx/mpi-default"))
        ceiling = tcp_ceiling(lb, world) if op not in ("barrier", "pingpong") and has_cx else None
        headers = ["size"] + [lib for lib in libs] + [name for _, _, name in pairs]
        if ceiling:
            headers.append("cx/ceiling")
        rows = []
        for nominal in payload["sizes"]:
            row = [human_size(nominal)]
            small = nominal < LATENCY_BELOW or op in ("barrier", "pingpong")
            cells = {lib: _cell(cols.get(lib), nominal) for lib in libs}
            for lib in libs:
                c = cells[lib]
                if c is None:
                    row.append("n/a")
                else:
                    text = fmt_time_us(c["median_s"]) if small else fmt_gbps(c["busbw_GBps"])
                    row.append(text + ("" if c["correct"] else " (WRONG)"))
            for mine, lib, _ in pairs:
                a, o = cells[mine], cells[lib]
                ratio = o["median_s"] / a["median_s"] if a and o and a["median_s"] > 0 else None
                row.append(fmt_ratio(ratio))
            if ceiling:
                cx = cells["pycyxwiz"]
                big = nominal >= CEILING_FROM and cx and cx["busbw_GBps"]
                row.append(f"{100 * cx['busbw_GBps'] / ceiling:.0f}%" if big else "")
            rows.append(row)
        load = ""
        if payload.get("link"):
            load += (f" [{world // payload.get('per_host', 1)} hosts of {payload.get('per_host', 1)} ranks, "
                     f"links shaped to {payload['link']}]")
        if payload.get("busy"):
            load += (f" [{payload['busy']} busy-loop processes beside it, "
                    f"{'pinned one per core' if payload.get('busy_pin') else 'placed by the scheduler'}]")
        title = (f"{op}, world {world}{load}: busbw GB/s (sizes >= {human_size(LATENCY_BELOW)}), "
                 f"time per call (smaller sizes); cx/X = pycyxwiz (TCP) speed / X speed, "
                 f"shm/X = pycyxwiz (shared memory) speed / X speed")
        if markdown:
            out.append(f"**{title}**\n\n" + format_table(headers, rows, markdown=True))
        else:
            out.append(title + "\n" + format_table(headers, rows))
        notes = [f"{lib}: n/a ({c['reason']})" for lib, c in cols.items() if c["reason"]]
        if payload.get("busy"):
            notes.append("load average (1 min) at the end of each column: "
                         + ", ".join(f"{lib} {c.get('load', 0):.1f}" for lib, c in cols.items()))
        notes += [f"{lib}: warning ({c['warning']})" for lib, c in cols.items() if c.get("warning")]
        if notes:
            out.append("\n".join(("- " if markdown else "  ") + n for n in notes))
    ceilings = {w: tcp_ceiling(lb, w) for w in payload["worlds"]}
    if op not in ("barrier", "pingpong") and all(ceilings.values()):
        out.append("cx/ceiling = pycyxwiz busbw / the TCP ceiling for a large message at that world size: "
                   + ", ".join(f"{c:.2f} GB/s on {w} ranks" for w, c in ceilings.items())
                   + f" (loopback TCP both ways on data in memory, {lb['two_way_cold_each_GBps']:.2f} GB/s, "
                   f"times min(1, {lb['cores']} cores / ranks); benchmarks/loopback.py). Above 100% means part "
                   "of the data was still in cache.")
    return "\n\n".join(out)


def plot(payload: dict, path) -> str | None:
    pyplot = plt()
    if pyplot is None:
        return None
    worlds = payload["worlds"]
    fig, axes = pyplot.subplots(1, len(worlds), figsize=(5.2 * len(worlds), 3.8), squeeze=False, sharey=True)
    lb = payload.get("loopback") or {}
    for ax, world in zip(axes[0], worlds):
        for col in payload["columns"]:
            if col["world"] != world or not col["results"]:
                continue
            pts = [(r["bytes"], r["busbw_GBps"]) for r in col["results"] if r["busbw_GBps"]]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, label=LIB_LABEL.get(col["lib"], col["lib"]), ms=4, **LIB_STYLE.get(col["lib"], {}))
        ceiling = tcp_ceiling(lb, world) if payload["op"] not in ("barrier", "pingpong") else None
        top = max(payload["sizes"])
        if ceiling and top >= CEILING_FROM:
            ax.hlines(ceiling, CEILING_FROM / 2, top * 2, color="gray", ls=":", lw=1.5,
                      label="TCP ceiling (64 MiB and up)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{payload['op']} float32, {world} ranks")
        ax.set_xlabel("message size (bytes)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("busbw (GB/s)")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    pyplot.close(fig)
    return str(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", choices=OPS, default="all_reduce")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--libs", nargs="+", choices=LIBRARIES + EXTRA_COLUMNS, default=list(LIBRARIES))
    ap.add_argument("--sizes", type=parse_size, nargs="+", help="e.g. 8 256K 4M 256M (default 8 B .. 256 MiB)")
    ap.add_argument("--quick", action="store_true", help="5 sizes and a third of the calls")
    ap.add_argument("--iters-scale", type=float, default=1.0, help="multiply the number of timed calls")
    ap.add_argument("--timeout", type=float, default=180, help="seconds per (library, world) column")
    ap.add_argument("--rounds", type=int, default=2, help="run every column this many times, keep the best")
    ap.add_argument("--no-loopback", action="store_true", help="skip measuring the loopback TCP limit")
    ap.add_argument("--name", help="output name under benchmarks/results (default: the op)")
    ap.add_argument("--busy", type=int, default=0, metavar="N", help="N busy-loop processes beside every column")
    ap.add_argument("--busy-pin", action="store_true", help="pin busy process i to core i mod cores")
    ap.add_argument("--link", help="each host behind a link of this tc rate (e.g. 1gbit); network namespaces")
    ap.add_argument("--per-host", type=int, default=1, help="with --link: ranks per host (default 1)")
    a = ap.parse_args(argv)
    sizes = sorted(a.sizes or (QUICK_SIZES if a.quick else DEFAULT_SIZES))
    if a.op == "barrier":
        sizes = [0]
    elif a.op == "pingpong" and not a.sizes:
        sizes = [8]
    scale = a.iters_scale * (0.34 if a.quick else 1.0)
    loopback = None
    if not a.no_loopback and a.op not in ("barrier", "pingpong"):
        from benchmarks import loopback as lbm

        print("measuring loopback TCP ...", flush=True)
        loopback = lbm.measure(1 << 30 if a.quick else 2 << 30)
    if a.busy < 0:
        ap.error(f"--busy {a.busy}: the number of busy processes cannot be negative")
    payload = run(a.op, a.worlds, a.libs, sizes, scale, a.timeout, loopback, a.rounds, busy=a.busy,
                  busy_pin=a.busy_pin, link=a.link, per_host=a.per_host)
    name = a.name or SHORT_NAME[a.op]
    print()
    print(tables(payload))
    print(f"\nwrote {write_json(name, payload)}")
    png = plot(payload, output_dir() / f"{name}.png") if a.op not in ("barrier", "pingpong") else None
    if png:
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
