"""Times one training step (forward + backward + Adam step) of Linear(784,256)-ReLU-Linear(256,10)
against PyTorch on the CPU, side by side in one run, at the same thread count.

    python benchmarks/bench_model.py                 # 1 thread, batches 64 and 256
    python benchmarks/bench_model.py --threads 2 --iters 2000

Both sides do the same work: cross-entropy loss, parameter gradients (no gradient w.r.t. the
input, which PyTorch skips for an input that does not require grad; we pass input_grad=False),
zero_grad and one Adam step. Reports the median of many timed steps after a warm-up, and writes
the numbers as JSON to benchmarks/results/partial/model.json (--out to choose).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np


def time_steps(step, iters: int, warmup: int) -> list:
    for _ in range(warmup):
        step()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        step()
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


def cx_step_fn(batch: int, x: np.ndarray, y: np.ndarray):
    import pycyxwiz as cx

    model = cx.SequentialModel()
    model.add(cx.LinearModule(784, 256, seed=1))
    model.add(cx.ReLUModule())
    model.add(cx.LinearModule(256, 10, seed=2))
    loss_fn = cx.CrossEntropyLoss()
    opt = cx.AdamOptimizer(1e-3)

    def step():
        loss_fn.forward(model.forward(x), y)
        model.zero_grad()
        model.backward(loss_fn.backward(), input_grad=False)
        opt.step(model)

    return step


def torch_step_fn(batch: int, x: np.ndarray, y: np.ndarray):
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    loss_fn = torch.nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    xt = torch.from_numpy(x)
    yt = torch.from_numpy(y)

    def step():
        opt.zero_grad(set_to_none=False)
        loss = loss_fn(model(xt), yt)
        loss.backward()
        opt.step()

    return step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3, help="alternate the two libraries this many times")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "partial",
                                                  "model.json"))
    args = ap.parse_args()

    import torch

    import pycyxwiz as cx

    cx.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    rows = []
    print(f"forward+backward+Adam step, Linear(784,256)-ReLU-Linear(256,10), {args.threads} thread(s), "
          f"median of {args.rounds}x{args.iters} steps")
    print(f"pycyxwiz BLAS threads={cx.get_num_threads()}  torch {torch.__version__} threads={torch.get_num_threads()}")
    print(f"{'batch':>6} {'pycyxwiz us':>12} {'torch us':>10} {'torch/cx':>9}")
    for batch in args.batches:
        x = rng.random((batch, 784), dtype=np.float32)
        y = rng.integers(0, 10, batch).astype(np.int64)
        cx_step, th_step = cx_step_fn(batch, x, y), torch_step_fn(batch, x, y)
        cx_t, th_t = [], []
        for _ in range(args.rounds):  # interleave, so drift on a noisy VM hits both alike
            cx_t += time_steps(cx_step, args.iters, args.warmup)
            th_t += time_steps(th_step, args.iters, args.warmup)
        c, t = statistics.median(cx_t), statistics.median(th_t)
        rows.append({"batch": batch, "pycyxwiz_us": c, "torch_us": t, "speedup_vs_torch": t / c,
                     "pycyxwiz_p10_us": float(np.percentile(cx_t, 10)), "pycyxwiz_p90_us": float(np.percentile(cx_t, 90)),
                     "torch_p10_us": float(np.percentile(th_t, 10)), "torch_p90_us": float(np.percentile(th_t, 90))})
        print(f"{batch:>6} {c:>12.1f} {t:>10.1f} {t / c:>8.2f}x")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    result = {"benchmark": "model_step", "threads": args.threads, "iters": args.iters, "rounds": args.rounds,
              "torch_version": torch.__version__, "python": sys.version.split()[0], "machine": platform.machine(),
              "cpu_count": os.cpu_count(), "rows": rows}
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
