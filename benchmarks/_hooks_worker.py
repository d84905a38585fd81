"""One rank of the communication-hook benchmark: DDP steps of an MLP with a gradient hook.

    python -m benchmarks._hooks_worker --lib torch --out DIR --hook bf16 --sizes 784 2048 2048 10

Started by benchmarks.hooks through benchmarks._launch. Both libraries run the same loop on
the same synthetic data: forward, cross-entropy, backward (bucket reductions overlapped, 25 MiB
buckets with a 1 MiB first one in both), SGD step; one thread per rank. Hooks: "none" (float32
all-reduce), "fp16", "bf16", "powersgd" (rank --psgd-rank, compressing from step 2: PyTorch's
earliest with error feedback and warm start, and ours is set the same). --warmup steps are not
timed; the timed steps lie between two barriers.

Bytes: pycyxwiz counts the payload bytes it hands its transport (cx.distributed._bytes_sent(),
the difference over the timed steps): measured. PyTorch has no counter, so its column is computed:
the bytes each step hands to all_reduce (the hooks' calls are counted through torch.distributed.
all_reduce; without a hook, every gradient once) times 2(p-1)/p, what a ring all-reduce sends per
rank. PyTorch's bf16_compress_hook refuses gloo (it requires NCCL), so the torch bf16 column runs
the same steps as a hook written here (bf16_hook).
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from benchmarks._worker_io import run_rank

START_ITER = 2


def make_data(n: int, features: int, classes: int, seed: int = 1234):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, features), dtype=np.float32)
    teacher = rng.standard_normal((features, classes)).astype(np.float32)
    return X, np.argmax(X @ teacher, axis=1).astype(np.int64)


def batches(comm, X, y, batch, steps):
    for s in range(steps):
        lo = ((s * comm.world + comm.rank) * batch) % (len(X) - batch + 1)
        yield X[lo:lo + batch], y[lo:lo + batch]


def timed_steps(comm, a, X, y, step, counter):
    """--warmup untimed steps, then --steps timed ones between two barriers: (seconds in all, each
    step's seconds, how much counter() grew over the timed steps)."""
    for x, t in batches(comm, X, y, a.batch, a.warmup):
        step(x, t)
    comm.barrier()
    c0 = counter()
    times = []
    t_all = time.perf_counter()
    for x, t in batches(comm, X, y, a.batch, a.steps):
        t0 = time.perf_counter()
        step(x, t)
        times.append(time.perf_counter() - t0)
    seconds = time.perf_counter() - t_all
    grown = counter() - c0
    comm.barrier()
    return seconds, times, grown


def run_cx(comm, a, X, y) -> dict:
    cx, d = comm.cx, comm.d
    cx.manual_seed(0)
    model = cx.SequentialModel()
    for i, (n_in, n_out) in enumerate(zip(a.sizes[:-1], a.sizes[1:])):
        if i:
            model.add(cx.ReLUModule())
        model.add(cx.LinearModule(n_in, n_out))
    cfg = d.DDPConfig()
    cfg.comm_hook = a.hook
    cfg.powersgd.matrix_approximation_rank = a.psgd_rank
    cfg.powersgd.start_powerSGD_iter = START_ITER
    ddp = d.DistributedDataParallel(model, cfg)
    loss_fn = cx.CrossEntropyLoss()
    opt = cx.SGDOptimizer(0.01)

    def step(x, t):
        loss_fn.forward(ddp.forward(x), t)
        ddp.backward(loss_fn.backward(), input_grad=False)
        ddp.update_parameters(opt)

    seconds, times, sent = timed_steps(comm, a, X, y, step, cx._core.dist._bytes_sent)
    return {"seconds": seconds, "step_times": times, "bytes_per_step": sent / a.steps, "bytes_how": "measured"}


def bf16_hook(torch, dist):
    """default_hooks.bf16_compress_hook where PyTorch allows it (NCCL); on gloo, which that hook refuses
    ("requires CUDA 11+ and NCCL 2.10+"), the same steps written out: cast, divide, all-reduce, cast back."""
    def hook(state, bucket):
        world = dist.get_world_size()
        buffer = bucket.buffer()
        compressed = buffer.to(torch.bfloat16).div_(world)
        fut = dist.all_reduce(compressed, async_op=True).get_future()

        def decompress(f):
            buffer.copy_(f.value()[0])
            return buffer

        return fut.then(decompress)

    return hook


def run_torch(comm, a, X, y) -> dict:
    torch, dist = comm.torch, comm.dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    layers = []
    for i, (n_in, n_out) in enumerate(zip(a.sizes[:-1], a.sizes[1:])):
        if i:
            layers.append(torch.nn.ReLU())
        layers.append(torch.nn.Linear(n_in, n_out))
    model = torch.nn.Sequential(*layers)
    # PowerSGD's hook chains its all-reduces in future callbacks; with several buckets gloo then pairs
    # them in different orders on different ranks ("Received data size doesn't match expected size",
    # seen with torch 2.13), so PyTorch's PowerSGD column uses one bucket.
    ddp = DDP(model, bucket_cap_mb=100) if a.hook == "powersgd" else DDP(model)
    if a.hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif a.hook == "bf16":
        ddp.register_comm_hook(None, bf16_hook(torch, dist))
    elif a.hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=a.psgd_rank,
                                            start_powerSGD_iter=START_ITER)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()

    handed = [0]
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kw):
        handed[0] += tensor.numel() * tensor.element_size()
        return real_all_reduce(tensor, *args, **kw)

    dist.all_reduce = counting_all_reduce  # the hooks call torch.distributed.all_reduce

    def step(x, t):
        opt.zero_grad(set_to_none=True)
        loss_fn(ddp(torch.from_numpy(x)), torch.from_numpy(t)).backward()
        opt.step()

    seconds, times, handed_total = timed_steps(comm, a, X, y, step, lambda: handed[0])
    dist.all_reduce = real_all_reduce
    per_step = handed_total / a.steps
    if a.hook == "none":
        per_step = sum(p.numel() * 4 for p in model.parameters())
    ring = 2 * (comm.world - 1) / comm.world
    return {"seconds": seconds, "step_times": times, "bytes_per_step": per_step * ring,
            "bytes_how": "computed: bytes handed to all_reduce x 2(p-1)/p"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True, choices=["pycyxwiz", "torch"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--hook", required=True, choices=["none", "fp16", "bf16", "powersgd"])
    ap.add_argument("--psgd-rank", type=int, default=4)
    ap.add_argument("--sizes", type=int, nargs="+", default=[784, 2048, 2048, 10])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    a = ap.parse_args(argv)

    def body(comm, report):
        X, y = make_data(max(4096, a.batch * comm.world * 4), a.sizes[0], a.sizes[-1])
        step = (run_cx if a.lib == "pycyxwiz" else run_torch)(comm, a, X, y)
        step["samples"] = a.batch * a.steps  # this rank's
        report.add(step)

    return run_rank(a.out, a.lib, body)


if __name__ == "__main__":
    sys.exit(main())
