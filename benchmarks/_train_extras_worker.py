"""One rank of benchmarks.train_extras: the MLP training benchmark (benchmarks._train_worker: MLP 784-256-10,
Adam(1e-3), batch 64 per rank, one thread) fitted in several variants side by side, in rounds.

    python -m benchmarks._train_extras_worker --lib pycyxwiz --out DIR --samples-per-rank 8192 --epochs 3 --rounds 5

Variants (each a fresh model, the same data, the same epochs):
  arrays      fit(X, y), no callbacks: the baseline
  callbacks   fit(X, y, callbacks=[EarlyStopping, ModelCheckpoint, EMA, CSVLogger]) (best.ckpt and last.ckpt
              written after every epoch; EarlyStopping watches the loss with a patience it never runs out of)
  no-files    the same but ModelCheckpoint: what the callbacks cost besides writing 2 checkpoints per epoch
  ema         fit(X, y, callbacks=[EMA]): the per-step part of the callbacks alone
  checkpoint  fit(X, y, callbacks=[ModelCheckpoint]): the per-epoch writes alone
  logging     fit(X, y, callbacks=[EarlyStopping, CSVLogger]): what the epoch-end hooks and the ranks' agreement
              on stopping cost
  dataset     fit(dataset) with a plain cx.data.Dataset over the arrays in memory: the copying loader thread
              every Dataset but a one-file float32 NpyDataset goes through
  npy-warm    fit(NpyDataset) over the same arrays saved as .npy files, in the page cache
  npy-cold    the same after every rank evicted both files from the page cache (posix_fadvise DONTNEED, which
              needs no privilege; the files are fsynced first, so their pages are clean and do go)
Each round runs every variant once, the order rotating from round to round; a short warm-up fit of every
variant comes first, untimed. The timed region is the fit call, between two barriers; the parent takes the
slowest rank. The CPU time of each rank's process over the fit (every thread: the trainer's, the
communication thread, a loader thread) is recorded too.

--costs (one rank, for benchmarks.train_extras --costs): where each variant's time goes, in CPU time of the
threads that spend it, which other programs on the machine disturb far less than wall time: the trainer's
thread over the fit, the part of it spent in the callbacks' hooks, and the checkpoint writer thread's. Then
(variant "ema-steps") fits of the baseline during which the EMA is switched on and off every 16 steps (through
the trainer's core, as the EMA callback does), each step timed: the EMA's cost per step, from thousands of
steps interleaved with steps without it, which the load's drifts hit alike.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from benchmarks._train_worker import BATCH, HIDDEN, IN, LR, OUT, WARMUP_BATCHES, make_data
from benchmarks._worker_io import run_rank

VARIANTS = ("arrays", "callbacks", "no-files", "ema", "checkpoint", "logging", "dataset", "npy-warm", "npy-cold")


class InMemory:
    """A plain Dataset over arrays (made a cx.data.Dataset subclass at run time, after the import)."""

    def __init__(self, X, y):
        self.X, self.y = X, y

    def __len__(self):
        return len(self.X)

    def __getitem__(self, indices):
        return self.X[indices], self.y[indices]


def evict(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class EmaToggle:
    """A callback (made a cx.callbacks.Callback subclass at run time) timing every step, wall and CPU, with the
    trainer's EMA on for 16 steps, off for 16, and so on; the first step after each switch is not counted."""

    batch_metrics = False
    BLOCK = 16

    def __init__(self):
        self.k, self.on, self.last, self.shadow = 0, False, None, None
        self.times = {True: [], False: []}

    def on_train_begin(self, trainer):   # a new trainer: no EMA yet
        self.k, self.on, self.last = 0, False, None

    def on_batch_end(self, trainer, step, logs):
        now = (time.perf_counter(), time.thread_time())
        if self.last is not None and self.k % self.BLOCK:
            self.times[self.on].append((now[0] - self.last[0], now[1] - self.last[1]))
        self.k += 1
        if self.k % self.BLOCK == 0:
            if self.on:
                trainer._core.clear_ema()
            else:
                self.shadow = trainer.model.flat_parameters().copy()
                trainer._core.add_ema(self.shadow, 0.999)
            self.on = not self.on
        self.last = (time.perf_counter(), time.thread_time())


def instrument(costs: dict) -> None:
    """Counts into `costs` the trainer thread's CPU seconds in callback hooks and the writer thread's in
    checkpoint writes (wrapping the two functions fit calls for them)."""
    from pycyxwiz import callbacks
    from pycyxwiz.distributed import _train

    call, write = callbacks._call, _train._write_checkpoint

    def timed_call(*args):
        c0 = time.thread_time()
        try:
            return call(*args)
        finally:
            costs["hooks"] += time.thread_time() - c0

    def timed_write(*args):
        c0 = time.thread_time()
        try:
            return write(*args)
        finally:
            costs["writer"] += time.thread_time() - c0
            costs["saves"] += 1

    callbacks._call, _train._write_checkpoint = timed_call, timed_write


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True, choices=["pycyxwiz"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples-per-rank", type=int, default=8192)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--costs", action="store_true", help="record the CPU time of the trainer's thread, the hooks "
                    "and the checkpoint writer per fit")
    a = ap.parse_args(argv)

    def body(comm, report):
        cx = comm.cx
        costs = {"hooks": 0.0, "writer": 0.0, "saves": 0}
        if a.costs:
            instrument(costs)
        X, y = make_data(a.samples_per_rank * comm.world)
        work = tempfile.mkdtemp(prefix=f"cx-extras-r{comm.rank}-")
        shared = os.path.join(tempfile.gettempdir(), f"cx-extras-{os.environ.get('MASTER_PORT', '0')}")
        xp, yp = os.path.join(shared, "x.npy"), os.path.join(shared, "y.npy")
        if comm.rank == 0:
            os.makedirs(shared, exist_ok=True)
            for path, arr in ((xp, X), (yp, y)):
                with open(path, "wb") as f:
                    np.save(f, arr)
                    f.flush()
                    os.fsync(f.fileno())
        comm.barrier()

        def fit(variant, n_samples, epochs):
            model = cx.SequentialModel()
            model.add(cx.LinearModule(IN, HIDDEN))
            model.add(cx.ReLUModule())
            model.add(cx.LinearModule(HIDDEN, OUT))
            trainer = cx.distributed.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.AdamOptimizer(LR))
            config = cx.distributed.DistributedTrainingConfig(epochs=epochs, batch_size=BATCH, verbose=False)
            C = cx.callbacks
            cbs = []
            if variant == "callbacks":
                run_dir = tempfile.mkdtemp(dir=work)   # a fresh one: auto_resume must find nothing to resume
                cbs = [C.EarlyStopping(monitor="loss", patience=10**6), C.EMA(0.999),
                       C.CSVLogger(os.path.join(run_dir, "log.csv")), C.ModelCheckpoint(run_dir, monitor="loss")]
            elif variant == "no-files":
                cbs = [C.EarlyStopping(monitor="loss", patience=10**6), C.EMA(0.999),
                       C.CSVLogger(os.path.join(tempfile.mkdtemp(dir=work), "log.csv"))]
            elif variant == "ema":
                cbs = [C.EMA(0.999)]
            elif variant == "checkpoint":
                cbs = [C.ModelCheckpoint(tempfile.mkdtemp(dir=work), monitor="loss")]
            elif variant == "logging":
                cbs = [C.EarlyStopping(monitor="loss", patience=10**6),
                       C.CSVLogger(os.path.join(tempfile.mkdtemp(dir=work), "log.csv"))]
            if variant == "dataset":
                ds = type("InMemoryDataset", (InMemory, cx.data.Dataset), {})(X[:n_samples], y[:n_samples])
                args = (ds, config)
            elif variant.startswith("npy"):
                ds = cx.data.NpyDataset(xp, yp)
                if n_samples < len(X):
                    from pycyxwiz.data._loader import Subset
                    ds = Subset(ds, np.arange(n_samples))
                args = (ds, config)
            else:
                args = (X[:n_samples], y[:n_samples], config)
            if variant == "npy-cold":
                evict([xp, yp])
            comm.barrier()
            costs.update(hooks=0.0, writer=0.0, saves=0)
            t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
            history = trainer.fit(*args, callbacks=cbs)
            seconds, cpu, mine = time.perf_counter() - t0, time.process_time() - c0, time.thread_time() - m0
            comm.barrier()
            return seconds, cpu, history.train_losses[-1], dict(costs, thread=mine, steps=trainer._steps)

        warm = WARMUP_BATCHES * BATCH * comm.world
        for v in a.variants:
            fit(v, warm, 1)
        if a.costs:   # the EMA per step, toggled within fits of the baseline
            toggle = type("EmaToggleCallback", (EmaToggle, cx.callbacks.Callback), {})()
            for r in range(max(a.rounds // 3, 1)):
                model = cx.SequentialModel()
                model.add(cx.LinearModule(IN, HIDDEN))
                model.add(cx.ReLUModule())
                model.add(cx.LinearModule(HIDDEN, OUT))
                trainer = cx.distributed.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.AdamOptimizer(LR))
                trainer.fit(X, y, cx.distributed.DistributedTrainingConfig(epochs=a.epochs, batch_size=BATCH,
                                                                           verbose=False), callbacks=[toggle])
            report.add({"round": 0, "variant": "ema-steps", "with": toggle.times[True], "without": toggle.times[False],
                        "parameters": int(model.flat_parameters().size)})
        for r in range(a.rounds):
            order = a.variants[r % len(a.variants):] + a.variants[:r % len(a.variants)]
            for v in order:
                seconds, cpu, loss, spent = fit(v, len(X), a.epochs)
                report.add({"round": r, "variant": v, "seconds": seconds, "cpu_seconds": cpu, "final_loss": float(loss),
                            "samples": a.samples_per_rank * a.epochs, "epochs": a.epochs, **(
                                {"costs": spent} if a.costs else {})})
        comm.barrier()
        shutil.rmtree(work, ignore_errors=True)
        if comm.rank == 0:
            shutil.rmtree(shared, ignore_errors=True)

    return run_rank(a.out, a.lib, body)


if __name__ == "__main__":
    sys.exit(main())
