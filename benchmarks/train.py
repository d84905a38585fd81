"""Training throughput: cx.distributed.DistributedTrainer vs PyTorch DDP (gloo).

    python -m benchmarks.train                      # worlds 1 2 4, writes results/partial/train.json and train.png
    python -m benchmarks.train --worlds 1 2 --epochs 2
    python -m benchmarks.train --worlds 2 4 --busy 2         # 2 busy-loop processes beside every run
    python -m benchmarks.train --worlds 2 4 --busy 2 --libs pycyxwiz-shm pycyxwiz-shm-one-session --hidden 4096
    python -m benchmarks.train --worlds 4 --per-host 2 --link 1gbit --libs pycyxwiz-flat pycyxwiz-hier

Same MLP 784-256-10 (--hidden: another width), same synthetic data, batch 64 per rank, Adam(1e-3), one thread per rank
(OMP/OpenBLAS/MKL_NUM_THREADS=1, torch.set_num_threads(1)). Weak scaling: every rank trains on
--samples-per-rank samples per epoch at every world size. Global samples/s = all ranks'
samples / the slowest rank's training time. Scaling efficiency = global samples/s at n ranks
/ (n * the same library's samples/s on 1 rank); on a 2-core machine 4 ranks share 2 cores,
so efficiency there is bounded by about 50%. With --busy N, N busy-loop processes run beside every
run (pinned one per core with --busy-pin; benchmarks._launch.busy_load), and --rounds R runs every
(library, world) R times, libraries alternating in order, keeping each one's median. Columns
pycyxwiz-one-session and pycyxwiz-shm-one-session start the ranks as `launch --one-session` does, in
one session (Note [One session or one per rank] in pycyxwiz/launch.py); the others a session each.
"""
from __future__ import annotations

import argparse
import sys

if __package__ in (None, ""):
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._launch import EXTRA_COLUMNS, run_ranks
from benchmarks._train_worker import HIDDEN
from benchmarks._report import LIB_LABEL, LIB_STYLE, fmt_ratio, format_table, output_dir, plt, write_json

TRAIN_LIBS = ("pycyxwiz", "pycyxwiz-shm", "torch")


def run_column(lib: str, world: int, samples_per_rank: int, epochs: int, timeout_s: float, busy: int = 0,
               busy_pin: bool = False, link: str | None = None, per_host: int = 1, hidden: int = HIDDEN) -> dict:
    args = ["--samples-per-rank", str(samples_per_rank), "--epochs", str(epochs), "--hidden", str(hidden)]
    run = run_ranks(lib, "benchmarks._train_worker", args, world, timeout_s, busy=busy, busy_pin=busy_pin,
                    link=link, per_host=per_host)
    col = {"lib": lib, "world": world, "ok": run.ok, "reason": run.reason, "wall_s": round(run.wall_s, 2),
           "load": run.load, "warning": run.warning}
    steps = [r["steps"][0] for r in run.ranks if r and r.get("steps")] if run.ranks else []
    if run.ok and len(steps) == world:
        seconds = max(s["seconds"] for s in steps)
        col.update({
            "version": run.ranks[0].get("info", {}).get("version", ""),
            "seconds": seconds,
            "global_samples": sum(s["samples"] for s in steps),
            "samples_per_second": sum(s["samples"] for s in steps) / seconds,
            "final_loss": steps[0].get("final_loss"),
            "reported_samples_per_second": steps[0].get("reported_samples_per_second"),
            "peak_rss_per_rank": [s["peak_rss"] for s in steps],
            "rss_base_per_rank": [s["rss_base"] for s in steps],
            "train_growth_per_rank": [s["peak_rss"] - s["rss_base"] for s in steps],
            "data_bytes": steps[0]["data_bytes"],
        })
    return col


def _median_column(cols: list) -> dict:
    """Of several rounds of one (library, world), the round with the median samples/s (failed rounds last)."""
    ok = sorted((c for c in cols if c["ok"]), key=lambda c: c["samples_per_second"])
    if not ok:
        return cols[0]
    kept = dict(ok[(len(ok) - 1) // 2])
    kept["round_samples_per_second"] = [c.get("samples_per_second") for c in cols]
    kept["round_loads"] = [c["load"] for c in cols]
    return kept


def run(worlds: list, libs: list, samples_per_rank: int, epochs: int, timeout_s: float = 300, log=print,
        busy: int = 0, busy_pin: bool = False, rounds: int = 1, link: str | None = None, per_host: int = 1,
        hidden: int = HIDDEN) -> dict:
    columns = []
    for world in worlds:
        raw: dict = {lib: [] for lib in libs}
        for rnd in range(rounds):
            for lib in (libs if rnd % 2 == 0 else libs[::-1]):
                tag = f" (round {rnd + 1}/{rounds})" if rounds > 1 else ""
                log(f"  train world {world}: {lib}{tag} ...", end="", flush=True)
                col = run_column(lib, world, samples_per_rank, epochs, timeout_s, busy, busy_pin, link, per_host,
                                 hidden)
                log(f" {col['wall_s']:.0f}s" + (f"  {col['samples_per_second']:.0f} samples/s" if col["ok"]
                                               else f"  n/a ({col['reason']})") + f"  load {col['load']:.1f}")
                raw[lib].append(col)
        columns += [_median_column(raw[lib]) for lib in libs]
    return {"benchmark": "train", "model": f"MLP 784-{hidden}-10", "optimizer": "Adam(1e-3)", "batch_per_rank": 64,
            "threads_per_rank": 1, "samples_per_rank": samples_per_rank, "epochs": epochs,
            "worlds": worlds, "libs": libs, "columns": columns, "busy": busy, "busy_pin": busy_pin,
            "rounds": rounds, "link": link, "per_host": per_host}


def _sps(payload, lib, world):
    c = next((c for c in payload["columns"] if c["lib"] == lib and c["world"] == world), None)
    return c.get("samples_per_second") if c and c["ok"] else None


def table(payload: dict, markdown: bool = False) -> str:
    libs = payload["libs"]
    headers = ["ranks"] + [f"{lib} samples/s" for lib in libs]
    if "pycyxwiz" in libs and "torch" in libs:
        headers.append("cx/torch")
    if "pycyxwiz-hier" in libs and "pycyxwiz-flat" in libs:
        headers.append("hier/flat")
    sessions = [(one, own) for one, own in (("pycyxwiz-one-session", "pycyxwiz"),
                                             ("pycyxwiz-shm-one-session", "pycyxwiz-shm"))
                if one in libs and own in libs]
    headers += [f"{own} one/own session" for _, own in sessions]
    headers += [f"{lib} speedup (eff.)" for lib in libs]
    rows = []
    for world in payload["worlds"]:
        row = [str(world)]
        for lib in libs:
            s = _sps(payload, lib, world)
            row.append("n/a" if s is None else f"{s:,.0f}")
        if "pycyxwiz" in libs and "torch" in libs:
            cx, th = _sps(payload, "pycyxwiz", world), _sps(payload, "torch", world)
            row.append(fmt_ratio(cx / th if cx and th else None))
        if "pycyxwiz-hier" in libs and "pycyxwiz-flat" in libs:
            hi, fl = _sps(payload, "pycyxwiz-hier", world), _sps(payload, "pycyxwiz-flat", world)
            row.append(fmt_ratio(hi / fl if hi and fl else None))
        for one, own in sessions:
            o, w = _sps(payload, one, world), _sps(payload, own, world)
            row.append(fmt_ratio(o / w if o and w else None))
        for lib in libs:
            s, one = _sps(payload, lib, world), _sps(payload, lib, 1)
            row.append("n/a" if not (s and one) else f"{s / one:.2f}x ({100 * s / (one * world):.0f}%)")
        rows.append(row)
    title = (f"training {payload['model']}, {payload['optimizer']}, batch {payload['batch_per_rank']}/rank, "
             f"1 thread/rank: global samples/s; speedup over the same library on 1 rank (scaling efficiency)")
    if payload.get("busy"):
        title += (f" [{payload['busy']} busy-loop processes beside it, "
                  f"{'pinned one per core' if payload.get('busy_pin') else 'placed by the scheduler'}]")
    text = (f"**{title}**\n\n" if markdown else title + "\n") + format_table(headers, rows, markdown)
    notes = sorted({f"{c['lib']}: n/a ({c['reason']})" for c in payload["columns"] if not c["ok"]})
    notes += sorted({f"{c['lib']} ({c['world']} ranks): warning ({c['warning']})"
                     for c in payload["columns"] if c.get("warning")})
    if payload.get("busy"):
        notes.append("load average (1 min) at the end of each run: " + ", ".join(
            f"{c['lib']}@{c['world']} {c['load']:.1f}" for c in payload["columns"] if "load" in c))
    if notes:
        text += "\n\n" + "\n".join(("- " if markdown else "  ") + n for n in notes)
    return text


def plot(payload: dict, path) -> str | None:
    pyplot = plt()
    if pyplot is None:
        return None
    fig, ax = pyplot.subplots(figsize=(5.2, 3.8))
    worlds = payload["worlds"]
    for lib in payload["libs"]:
        pts = [(w, _sps(payload, lib, w)) for w in worlds if _sps(payload, lib, w)]
        if not pts:
            continue
        xs, ys = zip(*pts)
        ax.plot(xs, ys, label=LIB_LABEL.get(lib, lib), **LIB_STYLE.get(lib, {}))
        one = _sps(payload, lib, 1)
        if one:
            ax.plot(worlds, [one * w for w in worlds], color=LIB_STYLE.get(lib, {}).get("color"),
                    ls=":", lw=1, label=f"{lib}: linear scaling")
    ax.set_xticks(worlds)
    ax.set_xlabel("ranks (processes on one 2-core host)")
    ax.set_ylabel("global samples/s")
    ax.set_title("MLP 784-256-10, Adam, batch 64/rank")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    pyplot.close(fig)
    return str(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--libs", nargs="+", choices=TRAIN_LIBS + EXTRA_COLUMNS, default=list(TRAIN_LIBS))
    ap.add_argument("--samples-per-rank", type=int, default=8192)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300, help="seconds per (library, world) run")
    ap.add_argument("--busy", type=int, default=0, metavar="N", help="N busy-loop processes beside every run")
    ap.add_argument("--busy-pin", action="store_true", help="pin busy process i to core i mod cores")
    ap.add_argument("--rounds", type=int, default=1, help="run every (library, world) this many times; median")
    ap.add_argument("--link", help="each host behind a link of this tc rate (e.g. 1gbit); network namespaces")
    ap.add_argument("--per-host", type=int, default=1, help="with --link: ranks per host (default 1)")
    ap.add_argument("--hidden", type=int, default=HIDDEN,
                    help=f"width of the MLP's hidden layer (default {HIDDEN}); wider: more compute and gradient per step")
    a = ap.parse_args(argv)
    if a.busy < 0 or a.rounds < 1 or a.hidden < 1:
        ap.error("--busy must be >= 0, --rounds >= 1 and --hidden >= 1")
    payload = run(a.worlds, a.libs, a.samples_per_rank, a.epochs, a.timeout, busy=a.busy, busy_pin=a.busy_pin,
                  rounds=a.rounds, link=a.link, per_host=a.per_host, hidden=a.hidden)
    print()
    print(table(payload))
    print(f"\nwrote {write_json('train', payload)}")
    png = plot(payload, output_dir() / "train.png")
    if png:
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
