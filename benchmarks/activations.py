"""The activations on the CPU, side by side with PyTorch's (one thread each): forward and backward of a
(4096, 1024) float32 batch, best of --repeat calls, alternating the two libraries in --rounds rounds. pycyxwiz's
layer runs in a one-layer SequentialModel (its forward and backward as a user calls them); PyTorch's is the
function and torch.autograd.grad through it.

    python -m benchmarks.activations                  # every activation
    python -m benchmarks.activations --rounds 5 --names gelu sigmoid

Prints milliseconds and the ratio PyTorch/pycyxwiz (above 1: pycyxwiz is faster). CX_NN_SCALAR=1 in the
environment measures pycyxwiz's scalar reference paths instead of its 8-lane ones (Note [Vector exp] in
csrc/nn/kernels.cpp). Writes results/partial/activations.json.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

if __package__ in (None, ""):
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import format_table, write_json

NAMES = ("relu", "leaky_relu", "sigmoid", "tanh", "gelu")


def best_ms(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def ours(name: str, x: np.ndarray, g: np.ndarray):
    import pycyxwiz as cx

    make = {"relu": cx.ReLUModule, "leaky_relu": lambda: cx.LeakyReLUModule(0.1), "sigmoid": cx.SigmoidModule,
            "tanh": cx.TanhModule, "gelu": cx.GELUModule}[name]
    m = cx.SequentialModel()
    m.add(make())
    m.forward(x)
    return (lambda: m.forward(x)), (lambda: m.backward(g))


def theirs(name: str, x: np.ndarray, g: np.ndarray):
    import torch

    torch.set_num_threads(1)
    f = {"relu": torch.relu, "leaky_relu": lambda t: torch.nn.functional.leaky_relu(t, 0.1),
         "sigmoid": torch.sigmoid, "tanh": torch.tanh, "gelu": torch.nn.functional.gelu}[name]
    xt = torch.from_numpy(x).requires_grad_(True)
    gt = torch.from_numpy(g)
    y = f(xt)

    def backward():
        xt.grad = None
        torch.autograd.grad(y, xt, gt, retain_graph=True)

    return (lambda: f(xt.detach())), backward


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--names", nargs="+", choices=NAMES, default=list(NAMES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4096, 1024)).astype(np.float32)
    g = rng.standard_normal(x.shape).astype(np.float32)
    rows = []
    for name in args.names:
        fns = {"pycyxwiz": ours(name, x, g)}
        try:
            fns["torch"] = theirs(name, x, g)
        except ImportError:
            pass
        best = {k: [float("inf"), float("inf")] for k in fns}
        for _ in range(args.rounds):
            for k, (fwd, bwd) in fns.items():
                best[k][0] = min(best[k][0], best_ms(fwd, args.repeat))
                best[k][1] = min(best[k][1], best_ms(bwd, args.repeat))
        row = {"activation": name, "cx_forward_ms": best["pycyxwiz"][0], "cx_backward_ms": best["pycyxwiz"][1]}
        if "torch" in best:
            row.update(torch_forward_ms=best["torch"][0], torch_backward_ms=best["torch"][1],
                       forward_ratio=best["torch"][0] / best["pycyxwiz"][0],
                       backward_ratio=best["torch"][1] / best["pycyxwiz"][1])
        rows.append(row)
    cols = ["activation", "cx_forward_ms", "torch_forward_ms", "forward_ratio", "cx_backward_ms", "torch_backward_ms",
            "backward_ratio"]
    print("activations on a (4096, 1024) float32 batch, one thread, best of", args.repeat, "calls x", args.rounds,
          "rounds; ratio = torch ms / pycyxwiz ms")
    print(format_table(cols, [[r["activation"]] + [f"{r.get(c, float('nan')):.2f}" for c in cols[1:]] for r in rows]))
    print("wrote", write_json("activations", {"rows": rows, "rounds": args.rounds, "repeat": args.repeat}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
