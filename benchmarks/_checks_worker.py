"""One rank of the checks-cost benchmark (benchmarks.checks): the same trainer, the same data, fit with
the non-finite gradient check off (twice: "off" and "off2", whose ratio shows the noise), on ("raise":
tested inside the buckets' reductions and agreed by a small all-reduce, the default), on with each bucket
read before its reduction instead ("scan", the unfused check) and on with each rank reading the average
("read"), in turn, in one process.

    python -m benchmarks._checks_worker --lib pycyxwiz --out DIR --model mlp --rounds 6 --samples-per-rank 4096

The MLP and the CNN are benchmarks.train's and benchmarks.cnn's (784-256-10 with Adam, batch 64; the
ResNet-8-like network with SGD, batch 32). One untimed warm-up epoch, then `rounds` rounds of one epoch
per setting, the order rotating each round (so no setting always runs first); each epoch is timed between
two barriers (wall time, and this process's CPU time: every thread, the comm thread's spinning included) and
the parent takes the slowest rank's wall time and the sum of the ranks' CPU times.

With --steps N, instead: N training steps of the model through DistributedDataParallel directly (forward,
loss, backward, update_parameters), the setting of each step drawn at random from off, raise, off2, scan
and read (the same sequence on every rank) and each step timed (wall and CPU): a load that drifts over seconds, as on a shared
machine, then falls on every setting alike, and the medians of thousands of steps are compared. --variant zero
steps through a ZeroRedundancyOptimizer (the check inside its reduce-scatter), --variant fp16 with the fp16
communication hook (the check inside its casts); "scan" is then the check reading the gradients first, as it
did on those paths before the fused check reached them.

With --collective, instead: `calls` all_reduces of 8 floats (and of 256 KiB) through cx.distributed, the
cost of CX_DEBUG=DETAIL's call-site comparison (the parent runs this job with CX_DEBUG off and DETAIL,
alternating).
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from benchmarks._worker_io import run_rank


MODES = ("off", "raise", "off2", "scan", "read")


def build(cx, which: str):
    if which == "mlp":
        from benchmarks import _train_worker as w
        model = cx.SequentialModel()
        model.add(cx.LinearModule(w.IN, w.HIDDEN))
        model.add(cx.ReLUModule())
        model.add(cx.LinearModule(w.HIDDEN, w.OUT))
        return model, cx.AdamOptimizer(w.LR), w.BATCH, w.make_data
    from benchmarks import _cnn_worker as c
    cx.manual_seed(0)
    return c.cx_resnet8(cx), cx.SGDOptimizer(c.LR, momentum=0.9), 32, c.make_data


def set_path(ddp, mode: str, last: list) -> None:
    """The check's path for `mode`. Setting a switch is a collective (every rank must agree on it: a tiny
    all_reduce), so with `last` they are set only when they change (the same sequence on every rank); with
    `last` None, both every time: per-step timing then follows the same two collectives before every step,
    whatever its setting (a step right after a collective finds the comm thread awake, and would otherwise
    favour the settings that changed the switches)."""
    want = (mode != "scan", mode != "read")
    if last is None or not last or last[0][0] != want[0]:
        ddp._fused_check = want[0]
    if last is None or not last or last[0][1] != want[1]:
        ddp._agree_by_message = want[1]
    if last is not None:
        last[:] = [want]


def run_checks(comm, which: str, rounds: int, samples_per_rank: int) -> dict:
    cx = comm.cx
    model, opt, batch, make_data = build(cx, which)
    X, y = make_data(samples_per_rank * comm.world)
    trainer = cx.distributed.DistributedTrainer(model, cx.CrossEntropyLoss(), opt)
    last: list = []

    def epoch(mode: str) -> tuple:
        set_path(trainer.ddp, mode, last)
        config = cx.distributed.DistributedTrainingConfig(epochs=1, batch_size=batch, verbose=False,
                                                          nonfinite="off" if mode.startswith("off") else "raise",
                                                          check_every_n_steps=0)
        comm.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        trainer.fit(X, y, config)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        comm.barrier()
        return seconds, cpu

    epoch("off")  # warm-up
    modes = MODES
    times: dict = {m: [] for m in modes}
    cpu: dict = {m: [] for m in modes}
    for r in range(rounds):
        k = r % len(modes)
        for mode in modes[k:] + modes[:k]:  # each setting first, second, ... in turn
            wall, c = epoch(mode)
            times[mode].append(wall)
            cpu[mode].append(c)
    return {"times": times, "cpu": cpu, "batch": batch, "samples": samples_per_rank}


STEP_MODES = ("off", "raise", "off2", "scan", "read")


VARIANT_MODES = {"plain": STEP_MODES, "zero": ("off", "raise", "off2", "scan"), "fp16": ("off", "raise", "off2", "scan")}


def run_steps(comm, which: str, steps: int, variant: str = "plain", only: str = "") -> dict:
    """variant: "plain" (DDP's default path), "zero" (a ZeroRedundancyOptimizer: the check inside its
    reduce-scatter, or, "scan", DDP reading the gradients first) or "fp16" (the fp16 hook: the check inside its
    casts, or "scan")."""
    cx = comm.cx
    model, opt, batch, make_data = build(cx, which)
    X, y = make_data(batch * 64)
    cfg = cx.distributed.DDPConfig()
    if variant == "fp16":
        cfg.comm_hook = "fp16"
    ddp = cx.distributed.DistributedDataParallel(model, cfg)
    if variant == "zero":
        opt = cx.distributed.ZeroRedundancyOptimizer(ddp, opt)
    loss = cx.CrossEntropyLoss()
    modes = tuple(only.split(",")) if only else VARIANT_MODES[variant]
    wall: dict = {m: [] for m in modes}
    cpu: dict = {m: [] for m in modes}
    # Where every setting has the same switches (--modes off,raise,off2: an A/B of two builds), they are set
    # once; otherwise before every step alike (set_path).
    last = [] if {m != "scan" for m in modes} == {True} and {m != "read" for m in modes} == {True} else None
    # The setting of each step is drawn (the same sequence on every rank), not cycled: a step's time also
    # carries what the step before left (a rank behind, a peer asleep), so each setting must follow every
    # setting equally often, or "off" against "off2" is not an A/A comparison.
    order = np.random.default_rng(0).integers(0, len(modes), steps + 40)
    for s in range(steps + 40):  # the first 40: warm-up
        mode = modes[order[s]]
        ddp.nonfinite = "off" if mode.startswith("off") else "raise"
        set_path(ddp, mode, last)
        b = s % 64
        xb, yb = X[b * batch:(b + 1) * batch], y[b * batch:(b + 1) * batch]
        t0, c0 = time.perf_counter(), time.process_time()
        loss.forward(ddp.forward(xb), yb)
        ddp.backward(loss.backward(), input_grad=False)
        ddp.update_parameters(opt)
        t1, c1 = time.perf_counter(), time.process_time()
        if s >= 40:
            wall[mode].append(t1 - t0)
            cpu[mode].append(c1 - c0)
    return {"wall": wall, "cpu": cpu, "batch": batch}


def run_collective(comm, calls: int) -> dict:
    cx = comm.cx
    out = {}
    for name, n in (("8 floats", 8), ("256 KiB", 65536)):
        x = np.ones(n, np.float32)
        for _ in range(50):
            cx.distributed.all_reduce(x)
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            cx.distributed.all_reduce(x)
        out[name] = (time.perf_counter() - t0) / calls
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True, choices=["pycyxwiz"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--samples-per-rank", type=int, default=4096)
    ap.add_argument("--collective", action="store_true")
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--variant", choices=["plain", "zero", "fp16"], default="plain")
    ap.add_argument("--modes", default="", help="per-step settings to draw from (default: the variant's)")
    ap.add_argument("--calls", type=int, default=2000)
    a = ap.parse_args(argv)

    def body(comm, report):
        if a.collective:
            report.add(run_collective(comm, a.calls))
        elif a.steps:
            report.add(run_steps(comm, a.model, a.steps, a.variant, a.modes))
        else:
            report.add(run_checks(comm, a.model, a.rounds, a.samples_per_rank))

    return run_rank(a.out, a.lib, body)


if __name__ == "__main__":
    sys.exit(main())
