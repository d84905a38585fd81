"""One rank of the training benchmark: MLP 784-256-10, Adam, batch 64 per rank, one thread.

    python -m benchmarks._train_worker --lib torch --out DIR --samples-per-rank 8192 --epochs 3

Started by benchmarks.train / benchmarks.memory through benchmarks._launch. Both libraries get
the same synthetic data (Gaussian inputs, labels from a fixed random linear teacher, so the
loss can fall), the same per-rank share (samples_per_rank, i.e. weak scaling: every rank does
the same work at every world size), the same batch, optimizer and learning rate. A short
warm-up run (16 batches per rank) comes first and is not timed. The timed region is the
training call(s) only, between two barriers; the parent takes the max over ranks.

Memory: RSS once the data is built is the baseline; the peak (VmHWM, reset at the baseline)
at the end, minus the baseline, is what the model, optimizer, library and training added.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from benchmarks._worker_io import peak_rss_bytes, reset_peak_rss, rss_bytes, run_rank

IN, HIDDEN, OUT = 784, 256, 10
BATCH = 64
LR = 1e-3
WARMUP_BATCHES = 16


def make_data(n: int, seed: int = 1234) -> tuple[np.ndarray, np.ndarray]:
    """The same dataset on every rank and for every library (deterministic in n and seed)."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, IN), dtype=np.float32)
    teacher = rng.standard_normal((IN, OUT)).astype(np.float32)
    y = np.argmax(X @ teacher, axis=1).astype(np.int64)
    return X, y


# ---- pycyxwiz: its DistributedTrainer -------------------------------------------------------

def _cx_fit(comm, X, y, epochs: int, hidden: int = HIDDEN):
    cx = comm.cx
    model = cx.SequentialModel()
    model.add(cx.LinearModule(IN, hidden))
    model.add(cx.ReLUModule())
    model.add(cx.LinearModule(hidden, OUT))
    trainer = cx.distributed.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.AdamOptimizer(LR))

    def fit(Xs, ys, n_epochs):
        config = cx.distributed.DistributedTrainingConfig()
        config.epochs = n_epochs
        config.batch_size = BATCH
        config.verbose = False
        if hasattr(config, "validation_split"):
            config.validation_split = 0.0
        return trainer.fit(Xs, ys, config)

    return fit


def run_cx(comm, X, y, epochs: int, hidden: int = HIDDEN) -> dict:
    fit = _cx_fit(comm, X, y, epochs, hidden)
    w = WARMUP_BATCHES * BATCH * comm.world
    fit(X[:w], y[:w], 1)
    comm.barrier()
    t0 = time.perf_counter()
    history = fit(X, y, epochs)
    seconds = time.perf_counter() - t0
    comm.barrier()
    losses = list(getattr(history, "train_losses", []) or [])
    return {"seconds": seconds, "final_loss": float(losses[-1]) if losses else None,
            "reported_samples_per_second": float(getattr(history, "samples_per_second", 0.0) or 0.0)}


# ---- PyTorch DDP over gloo -------------------------------------------------------------------

def run_torch(comm, X, y, epochs: int, hidden: int = HIDDEN) -> dict:
    torch = comm.torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(IN, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, OUT))
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=LR)
    loss_fn = torch.nn.CrossEntropyLoss()
    Xt, yt = torch.from_numpy(X), torch.from_numpy(y)

    def epoch(e: int, limit: int | None = None) -> float:
        # DistributedSampler's split: shuffle with a seed shared by all ranks, take rank::world.
        idx = np.random.default_rng(42 + e).permutation(len(X))[comm.rank::comm.world]
        nb = len(idx) // BATCH if limit is None else min(limit, len(idx) // BATCH)
        loss = None
        for b in range(nb):
            sel = torch.from_numpy(idx[b * BATCH:(b + 1) * BATCH])
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(ddp(Xt[sel]), yt[sel])
            loss.backward()
            opt.step()
        return float(loss) if loss is not None else float("nan")

    epoch(-1, WARMUP_BATCHES)
    comm.barrier()
    t0 = time.perf_counter()
    last = float("nan")
    for e in range(epochs):
        last = epoch(e)
    seconds = time.perf_counter() - t0
    comm.barrier()
    return {"seconds": seconds, "final_loss": last}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True, choices=["pycyxwiz", "torch"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples-per-rank", type=int, default=8192)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=HIDDEN, help="width of the hidden layer")
    a = ap.parse_args(argv)

    def body(comm, report):
        X, y = make_data(a.samples_per_rank * comm.world)
        base = rss_bytes()
        reset_peak_rss()
        step = (run_cx if a.lib == "pycyxwiz" else run_torch)(comm, X, y, a.epochs, a.hidden)
        step["samples"] = a.samples_per_rank * a.epochs  # this rank's share
        step["data_bytes"] = X.nbytes + y.nbytes
        step["rss_base"], step["peak_rss"] = base, peak_rss_bytes()
        report.add(step)

    return run_rank(a.out, a.lib, body)


if __name__ == "__main__":
    sys.exit(main())
