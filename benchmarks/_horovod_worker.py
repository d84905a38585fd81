"""One rank of benchmarks/horovod.py: Horovod's PyTorch API, or torch.distributed over "cyxwiz".

    python -m benchmarks._horovod_worker --lib horovod --out DIR allreduce --sizes 8 65536
    python -m benchmarks._horovod_worker --lib cyxwiz --out DIR synthetic --models mlp cnn

allreduce: one float32 tensor summed in place (hvd.allreduce_ / dist.all_reduce), each timed call after a
barrier; this rank's call times per size. synthetic: Horovod's own benchmark
(examples/pytorch/pytorch_synthetic_benchmark.py in Horovod's repository) as it is written: one batch of
random data and labels, SGD, `num_warmup_batches` untimed steps, then `num_iters` timings of
`num_batches_per_iter` steps each; img/sec per timing; --fp16-allreduce as the script's. Horovod wraps the optimizer in
hvd.DistributedOptimizer after broadcasting the parameters and the optimizer's state, as that script does;
"cyxwiz" is the same script for a user of torch.distributed: DistributedDataParallel on the "cyxwiz" backend.
"""
from __future__ import annotations

import argparse
import sys
import time
import timeit

from benchmarks._torch_worker import build_model, iterations, model_shape
from benchmarks._worker_io import run_rank


def run_allreduce(comm, report, a) -> None:
    torch = comm.torch
    for size in a.sizes:
        t = torch.zeros(max(1, size // 4), dtype=torch.float32)
        if comm.name == "horovod":
            hvd = comm.hvd

            def call():
                hvd.allreduce_(t, op=hvd.Sum, name="cx_allreduce")
        else:
            def call():
                comm.dist.all_reduce(t)
        # Correctness first: every rank adds rank + 1.
        t.fill_(comm.rank + 1)
        call()
        expect = comm.world * (comm.world + 1) / 2
        if not bool(torch.all(t == expect)):
            raise RuntimeError(f"all_reduce of {size} bytes gave {t[0].item()}, expected {expect}")
        t.zero_()
        warm, timed = iterations(size, a.iters_scale)
        for _ in range(warm):
            call()
        times = []
        for _ in range(timed):
            comm.barrier()
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        report.add({"part": "allreduce", "size": size, "times": times})
    comm.barrier()


def run_synthetic(comm, report, a) -> None:
    torch = comm.torch
    import torch.nn.functional as F

    for name in a.models:
        model = build_model(torch, name)
        data = torch.randn(a.batch_size, *model_shape(name), generator=torch.Generator().manual_seed(comm.rank))
        target = torch.randint(0, 10, (a.batch_size,), generator=torch.Generator().manual_seed(100 + comm.rank))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        if comm.name == "horovod":
            hvd = comm.hvd
            compression = hvd.Compression.fp16 if a.fp16_allreduce else hvd.Compression.none
            optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                                 compression=compression, op=hvd.Average)
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(model)
            if a.fp16_allreduce:  # the torch.distributed user's counterpart of Horovod's Compression.fp16
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

                model.register_comm_hook(None, fp16_compress_hook)

        def benchmark_step():
            optimizer.zero_grad()
            output = model(data)
            loss = F.cross_entropy(output, target)
            loss.backward()
            optimizer.step()

        timeit.timeit(benchmark_step, number=a.num_warmup_batches)
        comm.barrier()
        img_secs = []
        for _ in range(a.num_iters):
            seconds = timeit.timeit(benchmark_step, number=a.num_batches_per_iter)
            img_secs.append(a.batch_size * a.num_batches_per_iter / seconds)
        comm.barrier()
        # The ranks must hold the same weights: the whole point of either library.
        module = model.module if hasattr(model, "module") else model
        flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
        probe = flat[:: max(1, flat.numel() // 4096)].clone()
        ref = probe.clone()
        if comm.name == "horovod":
            ref = comm.hvd.broadcast(ref, root_rank=0, name=f"cx_probe_{name}")
        else:
            comm.dist.broadcast(ref, 0)
        report.add({"part": "synthetic", "model": name, "img_secs": img_secs, "batch_size": a.batch_size,
                    "in_sync": bool(torch.equal(probe, ref))})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    # "cyxwiz-shm" is "cyxwiz" with CX_SHM=1, which benchmarks/horovod.py sets.
    ap.add_argument("--lib", required=True, choices=["horovod", "cyxwiz", "cyxwiz-shm"])
    ap.add_argument("--out", required=True)
    sub = ap.add_subparsers(dest="part", required=True)
    ar = sub.add_parser("allreduce")
    ar.add_argument("--sizes", type=int, nargs="+", required=True)
    ar.add_argument("--iters-scale", type=float, default=1.0)
    sy = sub.add_parser("synthetic")
    sy.add_argument("--models", nargs="+", default=["mlp", "cnn"])
    # Horovod's script's arguments, with its defaults.
    sy.add_argument("--batch-size", type=int, default=32)
    sy.add_argument("--num-warmup-batches", type=int, default=10)
    sy.add_argument("--num-batches-per-iter", type=int, default=10)
    sy.add_argument("--num-iters", type=int, default=10)
    sy.add_argument("--fp16-allreduce", action="store_true", help="gradients all-reduced in float16, as the "
                    "script's flag: Horovod's Compression.fp16, DDP's fp16_compress_hook")
    a = ap.parse_args(argv)
    body = run_allreduce if a.part == "allreduce" else run_synthetic
    return run_rank(a.out, "cyxwiz" if a.lib == "cyxwiz-shm" else a.lib, lambda comm, report: body(comm, report, a))


if __name__ == "__main__":
    sys.exit(main())
