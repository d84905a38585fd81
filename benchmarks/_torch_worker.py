"""One rank of the torch-backend benchmark: torch.distributed over "cyxwiz" against "gloo" and pycyxwiz itself.

    python -m benchmarks._torch_worker --lib cyxwiz --out DIR allreduce --sizes 8 65536
    python -m benchmarks._torch_worker --lib gloo --out DIR ddp --models mlp cnn --steps 30

Started by benchmarks.torch_backend through benchmarks._launch (never by hand). --lib names what runs the
collectives: "cyxwiz" = torch.distributed.init_process_group("cyxwiz") (pycyxwiz.torch), "gloo" = PyTorch's
gloo, "pycyxwiz" = pycyxwiz called directly (cx.distributed.init(), cx.distributed.all_reduce on the same
torch tensors, through DLPack); CX_SHM in the environment picks TCP or shared memory for the two pycyxwiz ones.

allreduce: per size, one correctness check (inputs rank+1, outputs compared with the closed form), warm-up
calls, then timed calls of dist.all_reduce (or cx.distributed.all_reduce) on one float32 torch tensor, each
preceded by the library's barrier. Raw per-call times go to the report; the parent takes the max over ranks
per call, then the median. With --paired (--lib cyxwiz), the same processes also join pycyxwiz's own group
(cx.distributed.init on MASTER_PORT + 1) and every timed dist.all_reduce is followed by a timed
cx.distributed.all_reduce on the same tensor: the backend's cost measured under the same load, call by call.

ddp: PyTorch DistributedDataParallel (defaults: 25 MiB buckets, overlapped with backward) around each of
--models in turn, in the same processes: built after torch.manual_seed(0) (the same initial weights in every
column), cross-entropy, SGD; random data (benchmarks._hooks_worker.make_data, the same on every rank), batch
--batch per rank; --warmup untimed steps, then --steps timed ones between two barriers
(benchmarks._hooks_worker.timed_steps).
One compute thread per rank, as in every benchmark here.
"""
from __future__ import annotations

import argparse
import sys
import time

from benchmarks._hooks_worker import make_data, timed_steps
from benchmarks._worker_io import run_rank

MLP_SIZES = (784, 2048, 2048, 10)
CNN_INPUT = (3, 32, 32)


def iterations(nbytes: int, scale: float = 1.0) -> tuple[int, int]:
    """(warm-up, timed) calls at nbytes: about 512 MiB of traffic, 10 to 400 calls (times `scale`, at least
    5). A pure function of the size, so every rank of every column runs the same schedule."""
    most = max(5, int(400 * scale))
    timed = max(5, min(most, max(10, int(512 * 2**20 * scale / max(nbytes, 1)))))
    warm = 2 if nbytes >= 16 * 2**20 else 10
    return warm, timed


def _all_reduce_call(comm, t):
    """A zero-argument callable running one in-place SUM all-reduce of `t`."""
    if comm.name == "pycyxwiz":
        d = comm.d
        op = d.ReduceOp.SUM
        return lambda: d.all_reduce(t, op)
    dist = comm.dist
    return lambda: dist.all_reduce(t)


def _direct_group(comm):
    """pycyxwiz's own default group next to torch's "cyxwiz" one in the same processes (--paired): its store on
    MASTER_PORT + 1, since torch's TCPStore holds MASTER_PORT."""
    import pycyxwiz as cx

    cfg = cx.distributed.DistributedConfig.from_environment()
    cfg.master_port = cfg.master_port + 1
    cx.distributed.init(cfg)
    return cx.distributed


def run_allreduce(comm, report, a) -> None:
    import torch

    torch.set_num_threads(1)
    d = _direct_group(comm) if a.paired else None
    for nbytes in a.sizes:
        t = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
        calls = [(_all_reduce_call(comm, t), comm.barrier)]
        if d is not None:  # alternate: torch.distributed over cyxwiz, then pycyxwiz directly, call by call
            calls.append((lambda: d.all_reduce(t, d.ReduceOp.SUM), d.barrier))
        # Correctness: rank+1 everywhere, the sum is n(n+1)/2.
        correct = True
        n = comm.world
        idx = torch.tensor(sorted({0, t.numel() // 2, t.numel() - 1}))
        for call, _ in calls:
            t.fill_(comm.rank + 1)
            call()
            correct = correct and bool(torch.all(t[idx] == n * (n + 1) / 2))
        t.zero_()  # timed calls run on zeros: sums never overflow
        warm, timed = iterations(t.numel() * 4, a.iters_scale)
        for _ in range(warm):
            for call, barrier in calls:
                barrier()
                call()
        times = [[] for _ in calls]
        for _ in range(timed):
            for (call, barrier), ts in zip(calls, times):
                barrier()
                t0 = time.perf_counter()
                call()
                ts.append(time.perf_counter() - t0)
        step = {"nominal": nbytes, "bytes": t.numel() * 4, "correct": correct, "times": times[0]}
        if d is not None:
            step["direct_times"] = times[1]
        report.add(step)
        del calls, t
    comm.barrier()
    if d is not None:
        d.barrier()
        d.finalize()


def build_model(torch, name: str):
    """The benchmark's models, the same initial weights in every column (torch.manual_seed(0) first)."""
    torch.manual_seed(0)
    nn = torch.nn
    if name == "mlp":
        layers = []
        for i, (n_in, n_out) in enumerate(zip(MLP_SIZES[:-1], MLP_SIZES[1:])):
            if i:
                layers.append(nn.ReLU())
            layers.append(nn.Linear(n_in, n_out))
        return nn.Sequential(*layers)
    if name == "cnn":  # 3x32x32 -> 32x16x16 -> 64x8x8 -> 64x4x4 -> 10
        return nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 4 * 4, 10),
        )
    raise ValueError(name)


def model_shape(name: str) -> tuple:
    """The input shape of one sample."""
    return (MLP_SIZES[0],) if name == "mlp" else CNN_INPUT


def run_ddp(comm, report, a) -> None:
    torch = comm.torch
    torch.set_num_threads(1)
    for name in a.models:
        report.add(ddp_model(comm, a, name))
        comm.barrier()


def ddp_model(comm, a, name: str) -> dict:
    """Train one model with DDP: warm-up, then the timed steps; this rank's figures."""
    torch = comm.torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    shape = model_shape(name)
    features = 1
    for s in shape:
        features *= s
    X, y = make_data(max(4096, a.batch * comm.world * 4), features, 10)
    model = build_model(torch, name)
    params = sum(p.numel() for p in model.parameters())
    ddp = DDP(model)
    if a.no_comm:
        # The ceiling column: DDP's own work (buckets, hooks, copies) with communication that takes no time,
        # the bucket handed back as it is. No backend can train faster than this (Note [The ceiling of a
        # DDP step] in benchmarks/torch_backend.py); the ranks' weights drift apart, which is expected here.
        def no_comm(state, bucket):
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        ddp.register_comm_hook(None, no_comm)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    losses = []

    def step(x, t):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(torch.from_numpy(x).view(-1, *shape)), torch.from_numpy(t))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))

    seconds, times, _ = timed_steps(comm, a, X, y, step, lambda: 0)
    # Same weights on every rank after training (DDP's whole point): a cheap check, outside the timing.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    probe = flat[:: max(1, flat.numel() // 4096)].clone()
    ref = probe.clone()
    comm.dist.broadcast(ref, 0)
    return {"model": name, "seconds": seconds, "step_times": times, "samples": a.batch * a.steps, "params": params,
            "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
            "in_sync": bool(torch.equal(probe, ref)) or a.no_comm}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    # "cyxwiz-shm" is the column's name for "cyxwiz" with CX_SHM=1 (benchmarks._launch passes it on).
    ap.add_argument("--lib", required=True, choices=["cyxwiz", "cyxwiz-shm", "gloo", "pycyxwiz"])
    ap.add_argument("--out", required=True)
    sub = ap.add_subparsers(dest="part", required=True)
    ar = sub.add_parser("allreduce")
    ar.add_argument("--sizes", type=int, nargs="+", required=True)
    ar.add_argument("--iters-scale", type=float, default=1.0)
    ar.add_argument("--paired", action="store_true", help="with --lib cyxwiz: also pycyxwiz directly on a group of "
                    "its own in the same processes, calls alternated (the backend's cost, under the same load)")
    dp = sub.add_parser("ddp")
    dp.add_argument("--models", nargs="+", choices=["mlp", "cnn"], required=True)
    dp.add_argument("--batch", type=int, default=32)
    dp.add_argument("--steps", type=int, default=20)
    dp.add_argument("--warmup", type=int, default=4)
    dp.add_argument("--no-comm", action="store_true", help="DDP with a comm hook that sends nothing (the ceiling)")
    a = ap.parse_args(argv)
    a.lib = a.lib.removesuffix("-shm")
    if a.part == "ddp" and a.lib == "pycyxwiz":
        ap.error("ddp runs on torch.distributed: --lib cyxwiz or gloo")
    body = run_allreduce if a.part == "allreduce" else run_ddp

    def run(comm, report):
        if comm.name == "pycyxwiz":
            import torch  # the direct column times pycyxwiz on torch tensors

            comm.torch = torch
        body(comm, report, a)

    return run_rank(a.out, a.lib, run)


if __name__ == "__main__":
    sys.exit(main())
