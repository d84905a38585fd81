"""Convolutional networks on the CPU: pycyxwiz against PyTorch, side by side in one run.

    python -m benchmarks.cnn                     # the three parts, ~1.5 minutes on 2 vCPUs
    python -m benchmarks.cnn --quick             # a smoke run
    python -m benchmarks.cnn --skip ddp          # parts: step, ddp, conv, threads
    python -m benchmarks.cnn --threads 8         # the threads part on 8 threads (default: every CPU)

1. step: one process, one thread (torch.set_num_threads(1), one OpenBLAS thread), training samples/s
   of the ResNet-8-like network of benchmarks/_cnn_worker.py on synthetic 3x32x32 images at batch 32
   and 128: forward, cross-entropy, backward (no gradient for the input), SGD step, zero_grad. Where the
   direct convolution kernels run (an AVX-512 CPU), the same model with them off too ("pycyxwiz (GEMMs)").
2. ddp: 2 ranks, one thread each: DistributedTrainer (pycyxwiz over TCP, and through shared memory,
   its default on one host) against PyTorch DDP over gloo, batch 32 per rank, 1024 samples per rank:
   global samples/s.
3. conv: one 3x3 convolution (stride 1, padding 1, no bias), forward and backward (dx and dW), at 16
   channels on 32x32 images and 64 channels on 8x8 (the network's first and last stages), batch 32, 8 rounds:
   time against PyTorch's, and pycyxwiz's GFLOP/s (3 GEMMs of 2*B*C_out*C_in*9*H*W flops) as a
   fraction of this core's FMA peak, measured in the same run by fma_peak.c.
4. threads: one process on every CPU of the machine (or --threads N), both libraries on N threads: the step of
   part 1 at batch 32 and 128, and each library on 1 thread in the same rounds, for how each scales. Where a rank
   has the machine to itself (one process, or fewer ranks than cores) its model math runs on several threads.

Timing: warm-up steps first; then rounds in which the two libraries alternate, each timing a number of
steps; a library's figure is its best round's median (other work on a shared machine comes in bursts).
Targets (README): one process >= 1.0x PyTorch at batch 32 and 128, on 1 thread and on N; 2 ranks >= 1.5x
PyTorch DDP; the 3x3 convolution at 64 channels >= 60% of the FMA peak. Reported, never asserted. Writes
results/partial/cnn.json (results/cnn.json in a complete suite run).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from benchmarks import _cnn_worker as net  # noqa: E402
from benchmarks._launch import one_thread_env, run_ranks  # noqa: E402
from benchmarks._report import fmt_ratio, format_table, output_dir, write_json  # noqa: E402

PARTS = ("step", "ddp", "conv", "threads")
DDP_LIBS = ("pycyxwiz", "pycyxwiz-shm", "torch")
CONVS = [(16, 32), (64, 8)]  # (channels, image side)


def in_child(part: str, quick: bool, timeout_s: float, threads: int = 1) -> dict:
    """Runs the in-process part `part` (step, conv, threads) in a fresh interpreter with `threads` compute threads,
    so that neither library is loaded into (or leaves threads in) the caller: {"ok", "reason", "rows"...}."""
    env = dict(os.environ, **one_thread_env())
    if threads > 1:
        env.update({k: str(threads) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")})
    cmd = [sys.executable, "-m", "benchmarks.cnn", "--child", part, "--threads", str(threads)] + \
        (["--quick"] if quick else [])
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env,
                           cwd=Path(__file__).resolve().parent.parent)
    except subprocess.TimeoutExpired:
        return {"ok": False, "reason": f"timed out after {timeout_s:.0f} s"}
    if r.returncode != 0:
        lines = (r.stderr.strip() or r.stdout.strip() or f"exit status {r.returncode}").splitlines()
        return {"ok": False, "reason": lines[-1][:300]}
    sys.stderr.write(r.stderr)
    return {"ok": True, **json.loads(r.stdout.splitlines()[-1])}


def _libs(threads: int = 1):
    import torch

    import pycyxwiz as cx

    torch.set_num_threads(threads)
    cx.set_num_threads(threads)
    return cx, torch


def time_rounds(fns: dict, rounds: int, iters: int, warmup: int) -> dict:
    """{name: {"best_median_s", "round_medians_s", "fastest_s"}}: the libraries alternate within every round.
    best_median_s (the best round's median) is the figure; fastest_s, the fastest call of all, is what a call
    takes when nothing else wants the core."""
    for f in fns.values():
        for _ in range(warmup):
            f()
    medians = {name: [] for name in fns}
    fastest = {name: float("inf") for name in fns}
    for r in range(rounds):
        order = list(fns) if r % 2 == 0 else list(fns)[::-1]
        for name in order:
            ts = []
            for _ in range(iters):
                t0 = time.perf_counter()
                fns[name]()
                ts.append(time.perf_counter() - t0)
            medians[name].append(statistics.median(ts))
            fastest[name] = min(fastest[name], min(ts))
    return {name: {"best_median_s": min(m), "round_medians_s": m, "fastest_s": fastest[name]}
            for name, m in medians.items()}


# ---- 1. one process -------------------------------------------------------------------------------

def step_fns(batch: int, threads: int = 1):
    cx, torch = _libs(threads)
    X, y = net.make_data(batch)
    cx.manual_seed(0)
    model, loss_fn, opt = net.cx_resnet8(cx), cx.CrossEntropyLoss(), cx.SGDOptimizer(net.LR, momentum=0.9)

    def cx_step():
        loss_fn.forward(model.forward(X), y)
        model.zero_grad()
        model.backward(loss_fn.backward(), input_grad=False)
        opt.step(model)

    torch.manual_seed(0)
    tmodel = net.torch_resnet8(torch)
    tloss, topt = torch.nn.CrossEntropyLoss(), torch.optim.SGD(tmodel.parameters(), lr=net.LR, momentum=0.9)
    Xt, yt = torch.from_numpy(X), torch.from_numpy(y)

    def torch_step():
        topt.zero_grad(set_to_none=True)
        tloss(tmodel(Xt), yt).backward()
        topt.step()

    fns = {"pycyxwiz": cx_step, "torch": torch_step}
    if threads > 1:  # each on one thread too, in the same rounds
        def on_one(lib, step):
            def one():
                lib.set_num_threads(1)
                try:
                    step()
                finally:
                    lib.set_num_threads(threads)
            return one

        fns.update({"pycyxwiz-1": on_one(cx, cx_step), "torch-1": on_one(torch, torch_step)})
        return fns, model.num_parameters()
    if cx._core._conv2d_direct_available():
        def gemm_step():  # the same model with Note [Direct convolution]'s kernels off: every convolution a GEMM
            cx._core._conv2d_direct(False)
            try:
                cx_step()
            finally:
                cx._core._conv2d_direct(True)

        fns["pycyxwiz-gemm"] = gemm_step
    return fns, model.num_parameters()


def run_step(batches, rounds: int, log=print, threads: int = 1) -> list:
    rows = []
    for batch in batches:
        fns, params = step_fns(batch, threads)
        iters = max(3, 320 // batch)
        t = time_rounds(fns, rounds, iters, warmup=2)
        row = {"batch": batch, "parameters": params, "iters": iters, "threads": threads}
        for lib, r in t.items():
            row[lib] = {**r, "samples_per_second": batch / r["best_median_s"]}
        row["ratio"] = t["torch"]["best_median_s"] / t["pycyxwiz"]["best_median_s"]
        if threads > 1:
            row["cx_scaling"] = t["pycyxwiz-1"]["best_median_s"] / t["pycyxwiz"]["best_median_s"]
            row["torch_scaling"] = t["torch-1"]["best_median_s"] / t["torch"]["best_median_s"]
            log(f"  {threads} threads, batch {batch}: pycyxwiz {row['pycyxwiz']['samples_per_second']:.0f} samples/s"
                f", torch {row['torch']['samples_per_second']:.0f}: {row['ratio']:.2f}x; over 1 thread: pycyxwiz "
                f"{row['cx_scaling']:.2f}x, torch {row['torch_scaling']:.2f}x")
            rows.append(row)
            continue
        if "pycyxwiz-gemm" in t:
            row["direct_vs_gemm"] = t["pycyxwiz-gemm"]["best_median_s"] / t["pycyxwiz"]["best_median_s"]
        log(f"  step batch {batch}: pycyxwiz {row['pycyxwiz']['samples_per_second']:.0f} samples/s, "
            f"torch {row['torch']['samples_per_second']:.0f}: {row['ratio']:.2f}x"
            + (f"; pycyxwiz through the GEMMs {row['pycyxwiz-gemm']['samples_per_second']:.0f}"
               if "pycyxwiz-gemm" in row else ""))
        rows.append(row)
    return rows


# ---- 2. two ranks ---------------------------------------------------------------------------------

def run_ddp(world: int, libs, samples_per_rank: int, batch: int, rounds: int, timeout_s: float, log=print) -> list:
    columns = {lib: [] for lib in libs}
    for r in range(rounds):
        for lib in (libs if r % 2 == 0 else libs[::-1]):
            run = run_ranks(lib, "benchmarks._cnn_worker", ["--samples-per-rank", str(samples_per_rank),
                                                            "--batch", str(batch)], world, timeout_s)
            steps = [x["steps"][0] for x in run.ranks if x and x.get("steps")] if run.ranks else []
            col = {"ok": run.ok and len(steps) == world, "reason": run.reason, "load": run.load}
            if col["ok"]:
                seconds = max(s["seconds"] for s in steps)
                col.update(seconds=seconds, samples_per_second=sum(s["samples"] for s in steps) / seconds,
                           final_loss=steps[0]["final_loss"])
            columns[lib].append(col)
            log(f"  ddp {world} ranks, {lib}, round {r + 1}: " + (f"{col['samples_per_second']:.0f} samples/s"
                                                                   if col["ok"] else f"n/a ({col['reason']})"))
    out = []
    for lib, cols in columns.items():
        good = [c for c in cols if c["ok"]]
        best = max(good, key=lambda c: c["samples_per_second"]) if good else cols[-1]
        out.append({"lib": lib, "world": world, "rounds": cols, **{k: best.get(k) for k in
                                                                   ("ok", "reason", "samples_per_second")}})
    return out


# ---- 3. one convolution -----------------------------------------------------------------------------

def fma_peak_gflops() -> float | None:
    """This core's FMA peak (fma_peak.c, compiled once into the temp dir); None without a C compiler."""
    src = Path(__file__).with_name("fma_peak.c")
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None
    exe = Path(tempfile.gettempdir()) / f"cxbench-fma-peak-{hashlib.sha1(src.read_bytes()).hexdigest()[:12]}"
    if not exe.exists():
        tmp = exe.with_suffix(".tmp")
        if subprocess.run([cc, "-O2", "-o", str(tmp), str(src)], capture_output=True).returncode != 0:
            return None
        tmp.replace(exe)
    value = float(subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, check=True).stdout)
    return value or None


def conv_fns(channels: int, side: int, batch: int):
    cx, torch = _libs()
    x = np.random.default_rng(1).standard_normal((batch, channels, side, side)).astype(np.float32)
    conv = cx.Conv2dModule(channels, channels, 3, padding=1, bias=False, seed=1)
    model = cx.SequentialModel()
    model.add(conv)
    gy = np.random.default_rng(2).standard_normal(x.shape).astype(np.float32)

    def cx_conv():
        model.forward(x)
        model.backward(gy)  # dx too: a layer inside a network computes it

    tconv = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
    xt, gyt = torch.from_numpy(x).requires_grad_(True), torch.from_numpy(gy)

    def torch_conv():
        tconv(xt).backward(gyt)

    return {"pycyxwiz": cx_conv, "torch": torch_conv}


def run_conv(batch: int, rounds: int, log=print) -> dict:
    peak = fma_peak_gflops()
    rows = []
    for channels, side in CONVS:
        t = time_rounds(conv_fns(channels, side, batch), rounds, iters=8, warmup=2)
        flops = 3 * 2.0 * batch * channels * channels * 9 * side * side
        row = {"channels": channels, "side": side, "batch": batch, "gflop": flops / 1e9}
        for lib, r in t.items():
            row[lib] = {**r, "gflops": flops / r["best_median_s"] / 1e9}
        row["ratio"] = t["torch"]["best_median_s"] / t["pycyxwiz"]["best_median_s"]
        row["fraction_of_peak"] = row["pycyxwiz"]["gflops"] / peak if peak else None
        row["fastest_fraction_of_peak"] = flops / t["pycyxwiz"]["fastest_s"] / 1e9 / peak if peak else None
        row["torch_fraction_of_peak"] = row["torch"]["gflops"] / peak if peak else None
        log(f"  conv {channels} channels {side}x{side}: pycyxwiz {row['pycyxwiz']['best_median_s'] * 1e3:.2f} ms "
            f"({row['pycyxwiz']['gflops']:.1f} GFLOP/s), torch {row['torch']['best_median_s'] * 1e3:.2f} ms: "
            f"{row['ratio']:.2f}x")
        rows.append(row)
    return {"fma_peak_gflops": peak, "rows": rows}


# ---- report -------------------------------------------------------------------------------------------

def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def _shown(value: float, goal: float, fmt: str) -> str:
    """fmt of value, two decimals rounded away from the goal where plain rounding would cross it (a miss of
    1.4996x against >= 1.5x shows as 1.49x), as the suite's targets table does."""
    shown = round(value, 2)
    if (shown >= goal) != (value >= goal):
        shown = math.floor(value * 100) / 100 if value < goal else math.ceil(value * 100) / 100
    return fmt.format(shown)


def targets(payload: dict) -> list:
    """[target, ranks, measured, goal, met] rows (the suite's targets table)."""
    rows = []
    for r in payload.get("step") or []:
        rows.append([f"CNN (ResNet-8-like), batch {r['batch']}: samples/s vs PyTorch CPU", "1",
                     _shown(r["ratio"], 1.0, "{:.2f}x"), ">= 1.0x", "yes" if r["ratio"] >= 1.0 else "**no**"])
    ddp = {c["lib"]: c for c in payload.get("ddp") or []}
    cx2, th2 = (ddp.get(k, {}).get("samples_per_second") for k in ("pycyxwiz", "torch"))
    if ddp:
        v = cx2 / th2 if cx2 and th2 else None
        rows.append(["CNN: DistributedTrainer (TCP) vs PyTorch DDP-gloo", "2",
                     "n/a" if v is None else _shown(v, 1.5, "{:.2f}x"), ">= 1.5x",
                     "n/a" if v is None else "yes" if v >= 1.5 else "**no**"])
    for r in payload.get("threads") or []:
        rows.append([f"CNN (ResNet-8-like), batch {r['batch']}, {r['threads']} threads: samples/s vs PyTorch CPU on as "
                     "many", "1", _shown(r["ratio"], 1.0, "{:.2f}x"), ">= 1.0x",
                     "yes" if r["ratio"] >= 1.0 else "**no**"])
    for r in (payload.get("conv") or {}).get("rows", []):
        if r["channels"] == 64:
            f = r["fraction_of_peak"]
            rows.append(["3x3 conv, 64 channels, forward + backward: fraction of the FMA peak", "1",
                         "n/a" if f is None else _shown(100 * f, 60, "{:.0f}%") if abs(100 * f - 60) >= 0.5
                         else f"{100 * f:.1f}%", ">= 60%", "n/a" if f is None else "yes" if f >= 0.6 else "**no**"])
    return rows


def tables(payload: dict, markdown: bool = False) -> str:
    out = []

    def add(title, headers, rows):
        out.append((f"**{title}**\n\n" if markdown else title + "\n") + format_table(headers, rows, markdown))

    if payload.get("step"):
        gemm = all("pycyxwiz-gemm" in r for r in payload["step"])
        add(f"ResNet-8-like ({payload['step'][0]['parameters']:,} parameters), 3x32x32, one process, 1 thread: "
            "training samples/s" + ("; pycyxwiz (GEMMs): the same with the direct convolution kernels off" if gemm
                                    else ""),
            ["batch", "pycyxwiz", "PyTorch", "cx/torch"] + (["pycyxwiz (GEMMs)", "direct/GEMMs"] if gemm else []),
            [[r["batch"], f"{r['pycyxwiz']['samples_per_second']:.0f}", f"{r['torch']['samples_per_second']:.0f}",
              fmt_ratio(r["ratio"])]
             + ([f"{r['pycyxwiz-gemm']['samples_per_second']:.0f}", fmt_ratio(r["direct_vs_gemm"])] if gemm else [])
             for r in payload["step"]])
    if payload.get("ddp"):
        ddp = {c["lib"]: c for c in payload["ddp"]}
        th = ddp.get("torch", {}).get("samples_per_second")
        add(f"the same, {payload['ddp'][0]['world']} ranks, batch {payload['ddp_batch']} per rank, 1 thread per rank: "
            "global samples/s",
            ["library", "samples/s", "vs PyTorch DDP-gloo"],
            [[lib, f"{c['samples_per_second']:.0f}" if c.get("ok") else f"n/a ({c.get('reason')})",
              fmt_ratio(c["samples_per_second"] / th) if c.get("ok") and th else "n/a"] for lib, c in ddp.items()])
    if payload.get("threads"):
        n = payload["threads"][0]["threads"]
        add(f"the same, one process on {n} threads (both libraries), and each on 1 thread in the same rounds: "
            "training samples/s",
            ["batch", f"pycyxwiz ({n})", f"PyTorch ({n})", "cx/torch", "pycyxwiz (1)", "PyTorch (1)",
             f"pycyxwiz {n}/1", f"PyTorch {n}/1"],
            [[r["batch"], f"{r['pycyxwiz']['samples_per_second']:.0f}", f"{r['torch']['samples_per_second']:.0f}",
              fmt_ratio(r["ratio"]), f"{r['pycyxwiz-1']['samples_per_second']:.0f}",
              f"{r['torch-1']['samples_per_second']:.0f}", fmt_ratio(r["cx_scaling"]), fmt_ratio(r["torch_scaling"])]
             for r in payload["threads"]])
    conv = payload.get("conv")
    if conv:
        peak = conv["fma_peak_gflops"]
        add(f"one 3x3 convolution, forward + backward (dx, dW), batch {conv['rows'][0]['batch']}, 1 thread; "
            + (f"FMA peak {peak:.1f} GFLOP/s" if peak else "FMA peak n/a (no C compiler)"),
            ["channels", "image", "pycyxwiz ms", "PyTorch ms", "cx/torch", "pycyxwiz GFLOP/s", "of peak",
             "of peak, fastest call", "PyTorch of peak"],
            [[r["channels"], f"{r['side']}x{r['side']}", f"{r['pycyxwiz']['best_median_s'] * 1e3:.2f}",
              f"{r['torch']['best_median_s'] * 1e3:.2f}", fmt_ratio(r["ratio"]), f"{r['pycyxwiz']['gflops']:.1f}",
              _pct(r["fraction_of_peak"]), _pct(r.get("fastest_fraction_of_peak")), _pct(r["torch_fraction_of_peak"])]
             for r in conv["rows"]])
    rows = targets(payload)
    if rows:
        add("targets", ["target", "ranks", "measured", "goal", "met"], rows)
    notes = [f"{part}: n/a ({payload[part + '_failed']})" for part in ("step", "conv", "threads")
             if payload.get(part + "_failed")]
    if notes:
        out.append("\n".join(("- " if markdown else "  ") + n for n in notes))
    return "\n\n".join(out)


def child_part(part: str, quick: bool, threads: int = 1) -> dict:
    """The in-process parts, as a child runs them (in_child)."""
    rounds = 1 if quick else 3
    log = lambda *a, **k: print(*a, file=sys.stderr, **k)  # noqa: E731 - stdout carries the result
    if part in ("step", "threads"):
        return {"rows": run_step([32] if quick else [32, 128], rounds, log, threads if part == "threads" else 1)}
    # A round of one convolution is ~0.2 s: more of them, for a quiet window between the bursts of other work.
    return run_conv(32, 2 if quick else 8, log)


def cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def run(parts=PARTS, quick: bool = False, log=print, timeout_s: float = 300, threads: int | None = None) -> dict:
    payload = {"benchmark": "cnn", "model": "ResNet-8-like 16/32/64", "threads_per_rank": 1, "ddp_batch": 32}
    if "step" in parts:
        log("  cnn: one process ...", flush=True)
        r = in_child("step", quick, timeout_s)
        payload["step"] = r["rows"] if r["ok"] else []
        if not r["ok"]:
            payload["step_failed"] = r["reason"]
    if "ddp" in parts:
        payload["ddp"] = run_ddp(2, list(DDP_LIBS), 256 if quick else 1024, 32, 1 if quick else 2, timeout_s, log)
    if "conv" in parts:
        log("  cnn: one convolution ...", flush=True)
        r = in_child("conv", quick, timeout_s)
        payload["conv"] = {k: v for k, v in r.items() if k != "ok"} if r["ok"] else None
        if not r["ok"]:
            payload["conv_failed"] = r["reason"]
    n = threads or cpus()
    if "threads" in parts and n > 1:
        log(f"  cnn: one process, {n} threads ...", flush=True)
        r = in_child("threads", quick, timeout_s, n)
        payload["threads"] = r["rows"] if r["ok"] else []
        if not r["ok"]:
            payload["threads_failed"] = r["reason"]
    return payload


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip", nargs="*", choices=PARTS, default=[])
    ap.add_argument("--threads", type=int, default=None, help="threads for the threads part (default: every CPU)")
    ap.add_argument("--child", choices=["step", "conv", "threads"], help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child_part(a.child, a.quick, a.threads or 1)))
        return 0
    payload = run([p for p in PARTS if p not in a.skip], a.quick, threads=a.threads)
    print()
    print(tables(payload))
    print(f"\nwrote {write_json('cnn', payload)} (in {output_dir()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
