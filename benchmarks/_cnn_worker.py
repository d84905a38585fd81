"""The CNN benchmark's network in both libraries, and one rank of its distributed part.

    python -m benchmarks._cnn_worker --lib torch --out DIR --samples-per-rank 1024 --batch 32

ResNet-8-like, as the training guides' CIFAR-10 model in small: a 3x3 stem (3 -> 16), then three
stages of one residual block each (16, 32 and 64 channels; the last two halve the image, with a 1x1
strided convolution and BatchNorm2d as the shortcut), global average pooling and a linear classifier
(8 weight layers; 78 k parameters). Inputs are synthetic 3x32x32 images (Gaussian, labels from a fixed
random teacher), the same on every rank and for both libraries. SGD with momentum 0.9.

Started by benchmarks.cnn through benchmarks._launch (2 ranks, one thread each). The pycyxwiz rank trains
with DistributedTrainer.fit; the torch rank with DistributedDataParallel over gloo in a plain loop, its
ranks taking the same share of the data (every world-th sample of a seeded permutation per epoch). A
warm-up (8 batches per rank) is not timed; the timed region is one epoch between two barriers.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from benchmarks._worker_io import run_rank

WIDTHS = (16, 32, 64)
CLASSES = 10
LR = 0.05
WARMUP_BATCHES = 8


def make_data(n: int, seed: int = 7) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, 3, 32, 32), dtype=np.float32)
    teacher = rng.standard_normal((3 * 32 * 32, CLASSES)).astype(np.float32)
    y = np.argmax(X.reshape(n, -1) @ teacher, axis=1).astype(np.int64)
    return X, y


# ---- the network ------------------------------------------------------------------------------

def cx_resnet8(cx):
    def seq(*mods):
        m = cx.SequentialModel()
        for mod in mods:
            m.add(mod)
        return m

    def block(cin, cout, stride):
        body = seq(cx.Conv2dModule(cin, cout, 3, stride=stride, padding=1, bias=False), cx.BatchNorm2dModule(cout),
                   cx.ReLUModule(), cx.Conv2dModule(cout, cout, 3, padding=1, bias=False), cx.BatchNorm2dModule(cout))
        if stride == 1 and cin == cout:
            return cx.ResidualModule(body)
        return cx.ResidualModule(body, seq(cx.Conv2dModule(cin, cout, 1, stride=stride, bias=False),
                                           cx.BatchNorm2dModule(cout)))

    a, b, c = WIDTHS
    return seq(cx.Conv2dModule(3, a, 3, padding=1, bias=False), cx.BatchNorm2dModule(a), cx.ReLUModule(),
               block(a, a, 1), cx.ReLUModule(), block(a, b, 2), cx.ReLUModule(), block(b, c, 2), cx.ReLUModule(),
               cx.GlobalAvgPool2dModule(), cx.LinearModule(c, CLASSES))


def torch_resnet8(torch):
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                                      nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
            self.shortcut = None if stride == 1 and cin == cout else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            return self.body(x) + (x if self.shortcut is None else self.shortcut(x))

    a, b, c = WIDTHS
    return nn.Sequential(nn.Conv2d(3, a, 3, 1, 1, bias=False), nn.BatchNorm2d(a), nn.ReLU(), Block(a, a, 1), nn.ReLU(),
                         Block(a, b, 2), nn.ReLU(), Block(b, c, 2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(c, CLASSES))


# ---- one rank ---------------------------------------------------------------------------------

def run_cx(comm, X, y, batch: int) -> dict:
    cx = comm.cx
    cx.manual_seed(0)
    model = cx_resnet8(cx)
    trainer = cx.distributed.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.SGDOptimizer(LR, momentum=0.9))

    def fit(Xs, ys):
        config = cx.distributed.DistributedTrainingConfig(epochs=1, batch_size=batch, verbose=False)
        return trainer.fit(Xs, ys, config)

    w = WARMUP_BATCHES * batch * comm.world
    fit(X[:w], y[:w])
    comm.barrier()
    t0 = time.perf_counter()
    history = fit(X, y)
    seconds = time.perf_counter() - t0
    comm.barrier()
    return {"seconds": seconds, "final_loss": float(history.train_losses[-1])}


def run_torch(comm, X, y, batch: int) -> dict:
    torch = comm.torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ddp = DDP(torch_resnet8(torch))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    Xt, yt = torch.from_numpy(X), torch.from_numpy(y)

    def epoch(e: int, limit: int | None = None) -> float:
        idx = np.random.default_rng(42 + e).permutation(len(X))[comm.rank::comm.world]
        nb = len(idx) // batch if limit is None else min(limit, len(idx) // batch)
        loss = None
        for i in range(nb):
            sel = torch.from_numpy(idx[i * batch:(i + 1) * batch])
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(ddp(Xt[sel]), yt[sel])
            loss.backward()
            opt.step()
        return float(loss) if loss is not None else float("nan")

    epoch(-1, WARMUP_BATCHES)
    comm.barrier()
    t0 = time.perf_counter()
    last = epoch(0)
    seconds = time.perf_counter() - t0
    comm.barrier()
    return {"seconds": seconds, "final_loss": last}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True, choices=["pycyxwiz", "torch"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples-per-rank", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32, help="per rank")
    a = ap.parse_args(argv)

    def body(comm, report):
        X, y = make_data(a.samples_per_rank * comm.world)
        step = (run_cx if a.lib == "pycyxwiz" else run_torch)(comm, X, y, a.batch)
        step["samples"] = a.samples_per_rank  # this rank's share
        report.add(step)

    return run_rank(a.out, a.lib, body)


if __name__ == "__main__":
    sys.exit(main())
