"""DDP communication hooks: pycyxwiz vs PyTorch DDP (gloo), none / fp16 / bf16 / powersgd.

    python -m benchmarks.hooks                          # 2 and 4 ranks, MLP 784-2048-2048-10
    python -m benchmarks.hooks --worlds 4 --hooks none bf16 --steps 10
    python -m benchmarks.hooks --link 1gbit             # each rank a host of its own, 1 Gbit/s links

Both libraries over TCP (pycyxwiz with CX_SHM=0), one thread per rank, batch 32 per rank, SGD,
the same loop (benchmarks/_hooks_worker.py). Per (world, hook, library): bytes sent per step and
rank (pycyxwiz: measured by its transport; PyTorch: computed from the bytes its hooks hand to
all_reduce, as a ring sends them; pycyxwiz sends small all-reduces, such as PowerSGD's P and Q,
by recursive doubling, log2(p) x their size, so on 4 ranks its PowerSGD column counts 2/1.5 of what
a ring would), time per step (the slowest rank's timed steps / steps, and the
median step) and global samples/s. Ratios: each hook against the same library without a hook (its
bytes and its time per step), and pycyxwiz against PyTorch with the same hook. The targets (bf16:
half the bytes and >= 1.5x faster per step than float32; PowerSGD rank 4: <= 1/20 of the bytes) are
for a step that is communication-bound over TCP, on 4 ranks.

Note [Which link is communication-bound]: by default every rank runs on 127.0.0.1, where the
"network" is the kernel copying bytes between processes on the same 2 cores that do the GEMMs: a
float32 step of this model on 4 ranks spends about a quarter of its CPU in GEMM and a fifth in those
TCP copies, so the step is CPU-bound, and halving the bytes saves only part of the copying; it cannot
make the step 1.5x faster. Real multi-node DDP sends over a NIC of fixed bandwidth, and there the
step is communication-bound: float32 DDP on 4 ranks sends 2(p-1)/p x 23.3 MB = 35 MB per rank and step,
about 0.28 s at 1 Gbit/s, against about 0.1 s of compute (4 ranks sharing the 2 cores: the PowerSGD
step, which sends almost nothing, took 0.12-0.14 s). `--link 1gbit` measures that case: each
rank a process of a host of its own (a network namespace, tests/hosts.py), every host's link shaped
to the rate both ways by `tc ... tbf`, so the bytes wait on the link, not on copies by the cores.
Both libraries run over the same shaped links, side by side.
"""
from __future__ import annotations

import argparse
import statistics
import sys

if __package__ in (None, ""):
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._launch import run_ranks
from benchmarks._report import fmt_ratio, format_table, write_json

HOOKS = ("none", "fp16", "bf16", "powersgd")
LIBS = ("pycyxwiz", "torch")
SIZES = [784, 2048, 2048, 10]


def run_column(lib: str, world: int, hook: str, args: list, timeout_s: float, link: str | None = None) -> dict:
    run = run_ranks(lib, "benchmarks._hooks_worker", ["--hook", hook, *args], world, timeout_s, link=link)
    col = {"lib": lib, "world": world, "hook": hook, "ok": run.ok, "reason": run.reason,
           "wall_s": round(run.wall_s, 2), "load": run.load, "warning": run.warning}
    steps = [r["steps"][0] for r in run.ranks if r and r.get("steps")] if run.ranks else []
    if run.ok and len(steps) == world:
        seconds = max(s["seconds"] for s in steps)
        n = len(steps[0]["step_times"])
        col.update({
            "version": run.ranks[0].get("info", {}).get("version", ""),
            "seconds": seconds,
            "step_s": seconds / n,
            "median_step_s": statistics.median(max(s["step_times"][i] for s in steps) for i in range(n)),
            "samples_per_second": sum(s["samples"] for s in steps) / seconds,
            "bytes_per_step": max(s["bytes_per_step"] for s in steps),
            "bytes_how": steps[0]["bytes_how"],
        })
    return col


def run(worlds: list, hooks: list, libs: list, steps: int, batch: int, psgd_rank: int, sizes: list,
        timeout_s: float = 240, log=print, link: str | None = None) -> dict:
    """Every (world, hook, library) column; over 127.0.0.1, or with `link` (a tc rate such as "1gbit")
    each rank on a host of its own behind a link of that rate (Note [Which link is communication-bound])."""
    args = ["--steps", str(steps), "--batch", str(batch), "--psgd-rank", str(psgd_rank),
            "--sizes", *map(str, sizes)]
    columns = []
    for world in worlds:
        for hook in hooks:
            for lib in libs:  # side by side: the two libraries with one hook run back to back
                log(f"  hooks world {world} {hook}: {lib} ...", end="", flush=True)
                col = run_column(lib, world, hook, args, timeout_s, link)
                log(f" {col['wall_s']:.0f}s" + (f"  {1e3 * col['step_s']:.0f} ms/step, "
                                               f"{col['bytes_per_step'] / 2**20:.2f} MiB/step" if col["ok"]
                                               else f"  n/a ({col['reason']})"))
                columns.append(col)
    return {"benchmark": "hooks", "model": "MLP " + "-".join(map(str, sizes)), "optimizer": "SGD(0.01)",
            "batch_per_rank": batch, "steps": steps, "powersgd_rank": psgd_rank, "threads_per_rank": 1,
            "worlds": worlds, "hooks": hooks, "libs": libs, "link": link, "columns": columns}


def _col(payload, lib, world, hook) -> dict:
    return next((c for c in payload["columns"] if c["lib"] == lib and c["world"] == world and c["hook"] == hook
                 and c["ok"]), {})


def json_name(link: str | None) -> str:
    """hooks.json over 127.0.0.1, hooks_link.json over shaped links (the rate is in the payload)."""
    return "hooks_link" if link else "hooks"


def ratios(payload, world, hook) -> dict:
    """bytes / float32 bytes and float32 time / hook time (speed-up) per library, and cx over torch."""
    out = {}
    for lib in payload["libs"]:
        c, base = _col(payload, lib, world, hook), _col(payload, lib, world, "none")
        out[lib] = {
            "bytes_vs_none": (c["bytes_per_step"] / base["bytes_per_step"]
                              if c and base and base["bytes_per_step"] else None),
            "speedup_vs_none": base["step_s"] / c["step_s"] if c and base else None,
        }
    cx, th = _col(payload, "pycyxwiz", world, hook), _col(payload, "torch", world, hook)
    out["cx_vs_torch"] = th["step_s"] / cx["step_s"] if cx and th else None
    return out


def link_words(payload: dict) -> str:
    """How the ranks were connected, for titles."""
    link = payload.get("link")
    return (f"TCP, each rank its own host, links shaped to {link} (tc tbf)" if link
            else "TCP over 127.0.0.1")


def _mib(c):
    return "n/a" if not c else f"{c['bytes_per_step'] / 2**20:.3f}"


def table(payload: dict, markdown: bool = False) -> str:
    libs = payload["libs"]
    headers = ["ranks", "hook"]
    for lib in libs:
        headers += [f"{lib} MiB/step", f"{lib} ms/step", f"{lib} samples/s", f"{lib} bytes vs none",
                    f"{lib} speed-up vs none"]
    if "pycyxwiz" in libs and "torch" in libs:
        headers.append("cx/torch (time)")
    rows = []
    for world in payload["worlds"]:
        for hook in payload["hooks"]:
            r = ratios(payload, world, hook)
            row = [str(world), hook]
            for lib in libs:
                c = _col(payload, lib, world, hook)
                b = r[lib]["bytes_vs_none"]
                row += [_mib(c), "n/a" if not c else f"{1e3 * c['step_s']:.1f}",
                        "n/a" if not c else f"{c['samples_per_second']:,.0f}",
                        "n/a" if b is None else (f"1/{1 / b:.1f}" if b < 0.5 else f"{b:.2f}"),
                        fmt_ratio(r[lib]["speedup_vs_none"])]
            if "pycyxwiz" in libs and "torch" in libs:
                row.append(fmt_ratio(r["cx_vs_torch"]))
            rows.append(row)
    title = (f"communication hooks, {payload['model']}, {payload['optimizer']}, batch {payload['batch_per_rank']}"
             f"/rank, {link_words(payload)}, 1 thread/rank, PowerSGD rank {payload['powersgd_rank']}: bytes sent per step and rank "
             f"(pycyxwiz measured, torch computed), time per step, global samples/s; ratios against the same "
             f"library without a hook; cx/torch > 1 = pycyxwiz faster")
    text = (f"**{title}**\n\n" if markdown else title + "\n") + format_table(headers, rows, markdown)
    notes = sorted({f"{c['lib']} {c['hook']} ({c['world']} ranks): n/a ({c['reason']})"
                    for c in payload["columns"] if not c["ok"]})
    if notes:
        text += "\n\n" + "\n".join(("- " if markdown else "  ") + n for n in notes)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--hooks", nargs="+", choices=HOOKS, default=list(HOOKS))
    ap.add_argument("--libs", nargs="+", choices=LIBS, default=list(LIBS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--psgd-rank", type=int, default=4)
    ap.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    ap.add_argument("--timeout", type=float, default=240, help="seconds per (library, world, hook) run")
    ap.add_argument("--link", metavar="RATE", help="each rank on a host of its own, every link shaped to RATE "
                    "(a tc rate: 1gbit, 10gbit, 500mbit); needs root and iproute2 (default: all on 127.0.0.1)")
    a = ap.parse_args(argv)
    payload = run(a.worlds, a.hooks, a.libs, a.steps, a.batch, a.psgd_rank, a.sizes, a.timeout, link=a.link)
    print()
    print(table(payload))
    print(f"\nwrote {write_json(json_name(a.link), payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
