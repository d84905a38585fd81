"""One rank of the ZeRO-1 memory benchmark: Adam on an MLP 784-H-H-10 with and without sharded state.

    python -m benchmarks._zero_worker --lib torch --out DIR --zero 1 --hidden 2048 --steps 4

Started by benchmarks.memory (--zero) through benchmarks._launch. pycyxwiz: DistributedDataParallel
with AdamOptimizer, or with cx.distributed.ZeroRedundancyOptimizer around it; torch (gloo):
DistributedDataParallel with torch.optim.Adam, or torch.distributed.optim.ZeroRedundancyOptimizer.
Both get the same model shape, batch (64 per rank), learning rate and steps.

Per rank: RSS once the model, its DDP wrapper and the batch exist, before the optimizer is
made, is the baseline; the peak (VmHWM, reset at the baseline) after the steps minus it is what
the optimizer and training added: the optimizer state, the ZeRO wrapper's scratch, activations,
gradient buckets and the library's buffers. The optimizer state is also counted exactly (elements held
by this rank's optimizer, times 4 bytes).
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from benchmarks._worker_io import peak_rss_bytes, reset_peak_rss, rss_bytes, run_rank

IN, OUT, BATCH, LR = 784, 10, 64, 1e-3


def _batch(rank: int):
    rng = np.random.default_rng(100 + rank)
    return rng.standard_normal((BATCH, IN), dtype=np.float32), rng.integers(0, OUT, BATCH).astype(np.int64)


def _cx(comm, hidden: int, zero: bool, steps: int) -> dict:
    cx = comm.cx
    model = cx.SequentialModel()
    model.add(cx.LinearModule(IN, hidden, seed=1))
    model.add(cx.ReLUModule())
    model.add(cx.LinearModule(hidden, hidden, seed=2))
    model.add(cx.ReLUModule())
    model.add(cx.LinearModule(hidden, OUT, seed=3))
    ddp = cx.distributed.DistributedDataParallel(model)
    loss_fn = cx.CrossEntropyLoss()
    X, y = _batch(comm.rank)
    comm.barrier()
    base = rss_bytes()
    reset_ok = reset_peak_rss()
    opt = cx.AdamOptimizer(LR)
    stepper = cx.distributed.ZeroRedundancyOptimizer(ddp, opt) if zero else opt
    for _ in range(steps):
        loss_fn.forward(ddp.forward(X), y)
        ddp.backward(loss_fn.backward(), input_grad=False)
        ddp.update_parameters(stepper)
    comm.barrier()
    return {"params": model.num_parameters(), "state_bytes": 4 * opt.state_numel, "rss_base": base,
            "peak": peak_rss_bytes(), "peak_reset": reset_ok}


def _torch(comm, hidden: int, zero: bool, steps: int) -> dict:
    torch = comm.torch
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(IN, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                                torch.nn.ReLU(), torch.nn.Linear(hidden, OUT))
    ddp = DistributedDataParallel(model)
    loss_fn = torch.nn.CrossEntropyLoss()
    Xn, yn = _batch(comm.rank)
    X, y = torch.from_numpy(Xn), torch.from_numpy(yn)
    comm.barrier()
    base = rss_bytes()
    reset_ok = reset_peak_rss()
    if zero:
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
        local = opt.optim
    else:
        opt = local = torch.optim.Adam(ddp.parameters(), lr=LR)
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(ddp(X), y).backward()
        opt.step()
    comm.barrier()
    state = sum(t.numel() * t.element_size() for s in local.state.values() for t in s.values()
                if torch.is_tensor(t) and t.dim() > 0)   # exp_avg, exp_avg_sq (not the scalar step)
    return {"params": sum(p.numel() for p in model.parameters()), "state_bytes": state, "rss_base": base,
            "peak": peak_rss_bytes(), "peak_reset": reset_ok}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--zero", type=int, choices=[0, 1], required=True)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args(argv)

    def body(comm, report):
        run = _cx if a.lib == "pycyxwiz" else _torch
        step = run(comm, a.hidden, bool(a.zero), a.steps)
        step["zero"] = bool(a.zero)
        report.add(step)

    return run_rank(a.out, a.lib, body)


if __name__ == "__main__":
    sys.exit(main())
