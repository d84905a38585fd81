"""Where a training step's GPU time goes: pycyxwiz's DistributedTrainer (NCCL, world size 1) and
PyTorch's loop from benchmarks/gpu_train.py, each under torch.profiler with CPU and CUDA activities
(CUPTI sees every kernel and copy in the process, pycyxwiz's driver-API launches included).

    python benchmarks/gpu_profile.py --sizes 784,2048,2048,10 --batch 4096
    python benchmarks/gpu_profile.py --sizes cnn --batch 512     (gpu_train.py --cnn's small ResNet)

Prints, for each, the step time and the kernels and copies sorted by total GPU time.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import gpu_train


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="784,2048,2048,10")
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rows", type=int, default=18)
    args = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    import pycyxwiz as cx

    n = args.batch * args.steps
    if args.sizes == "cnn":
        sizes = "cnn"
        X, y = gpu_train.data(n, 3 * 32 * 32, 10)
        X = X.reshape(-1, 3, 32, 32)
    else:
        sizes = [int(s) for s in args.sizes.split(",")]
        X, y = gpu_train.data(n, sizes[0], sizes[-1])
    D = cx.distributed
    cfg = D.DistributedConfig()
    cfg.backend = D.BackendType.NCCL
    D.init(cfg)
    model = gpu_train.build_cx(cx, sizes)
    tr = D.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.AdamOptimizer(1e-3))
    c = D.DistributedTrainingConfig()
    c.batch_size, c.verbose, c.shuffle, c.epochs = args.batch, False, True, 1
    tr.fit(X, y, c)  # warm-up
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        tr.fit(X, y, c)
        dt = time.perf_counter() - t0
    print(f"== pycyxwiz {args.sizes} batch {args.batch}: {dt / args.steps * 1e3:.2f} ms/step (fit of {args.steps} "
          f"steps, {n / dt:.0f} samples/s)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))
    D.finalize()

    m = gpu_train.build_torch(torch, sizes)
    opt = torch.optim.Adam(m.parameters(), 1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    Xt, yt = torch.from_numpy(X), torch.from_numpy(y)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # float32, as ours

    def epoch():
        perm = torch.randperm(n)
        for b in range(0, n, args.batch):
            idx = perm[b:b + args.batch]
            xb, yb = Xt[idx].cuda(), yt[idx].cuda()
            loss = loss_fn(m(xb), yb)
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
            loss.item()

    epoch()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        epoch()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    print(f"== PyTorch: {dt / args.steps * 1e3:.2f} ms/step ({n / dt:.0f} samples/s)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
