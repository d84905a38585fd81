"""Training throughput with the model on the GPU: pycyxwiz's DistributedTrainer with
BackendType.NCCL (world size 1, the model on cuda:0) against PyTorch on the same GPU and
against pycyxwiz on the CPU, side by side in one run.

    python benchmarks/gpu_train.py                # after pip install . on a GPU machine
    python benchmarks/gpu_train.py --epochs 2 --samples 30000
    python benchmarks/gpu_train.py --checks       # the non-finite check's cost: nonfinite "raise" vs "off"
    python benchmarks/gpu_train.py --precision bf16   # bf16 GEMMs: matmul_precision against torch's autocast

Same MLP, data, batch size and optimizer (Adam 1e-3) for all three; every loop copies each
batch from host memory to the device once (PyTorch: x[idx].to('cuda') with a pinned-free
index, as a DataLoader without workers would). Prints global samples/s and the ratios
pycyxwiz-GPU / PyTorch-GPU and pycyxwiz-GPU / pycyxwiz-CPU. Writes
benchmarks/results/partial/gpu_train.json.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def data(n: int, d: int, classes: int):
    rng = np.random.default_rng(0)
    X = rng.standard_normal((n, d), dtype=np.float32)
    y = rng.integers(0, classes, n).astype(np.int64)
    return X, y


def build_cx(cx, sizes):
    cx.manual_seed(0)
    m = cx.SequentialModel()
    if sizes == "cnn":
        return build_cx_cnn(cx, m)
    for i in range(len(sizes) - 1):
        m.add(cx.LinearModule(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            m.add(cx.ReLUModule())
    return m


def run_cx(backend: str, sizes, X, y, batch: int, epochs: int, nonfinite: str = "raise",
           precision: str = "float32") -> float:
    import pycyxwiz as cx

    D = cx.distributed
    cfg = D.DistributedConfig()
    cfg.backend = D.BackendType.NCCL if backend == "nccl" else D.BackendType.CPU
    D.init(cfg)
    try:
        model = build_cx(cx, sizes)
        tr = D.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.AdamOptimizer(1e-3))
        c = D.DistributedTrainingConfig()
        c.batch_size, c.verbose, c.shuffle, c.nonfinite = batch, False, True, nonfinite
        c.matmul_precision = precision
        c.epochs = 1
        tr.fit(X[: batch * 20], y[: batch * 20], c)  # warm-up: allocations, cuBLAS handles, NCCL
        c.epochs = epochs
        h = tr.fit(X, y, c)
        return h.samples_per_second
    finally:
        D.finalize()


# --cnn: a small ResNet on 3x32x32 images (CIFAR's size): a stem, one residual block, a downsampling
# convolution, global average pooling and a linear head; every convolution without bias before BatchNorm.
SYNC_BN = False  # --sync-bn: SyncBatchNormModule in place of BatchNorm2dModule (its cost at world size 1)


def build_cx_cnn(cx, m):
    def conv_bn(seq, cin, cout, stride=1):
        seq.add(cx.Conv2dModule(cin, cout, 3, stride=stride, padding=1, bias=False))
        seq.add(cx.SyncBatchNormModule(cout) if SYNC_BN else cx.BatchNorm2dModule(cout))

    conv_bn(m, 3, 32)
    m.add(cx.ReLUModule())
    block = cx.SequentialModel()
    conv_bn(block, 32, 32)
    block.add(cx.ReLUModule())
    conv_bn(block, 32, 32)
    m.add(cx.ResidualModule(block))
    m.add(cx.ReLUModule())
    conv_bn(m, 32, 64, stride=2)
    m.add(cx.ReLUModule())
    m.add(cx.GlobalAvgPool2dModule())
    m.add(cx.LinearModule(64, 10))
    return m


def build_torch_cnn(torch):
    nn = torch.nn

    def conv_bn(cin, cout, stride=1):
        return [nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout)]

    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Sequential(*conv_bn(32, 32), nn.ReLU(), *conv_bn(32, 32))

        def forward(self, x):
            return self.block(x) + x

    return nn.Sequential(*conv_bn(3, 32), nn.ReLU(), Residual(), nn.ReLU(), *conv_bn(32, 64, 2), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)).cuda()


def build_torch(torch, sizes):
    """build_cx's MLP in PyTorch, on the GPU."""
    torch.manual_seed(0)
    if sizes == "cnn":
        return build_torch_cnn(torch)
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(torch.nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers).cuda()


def run_torch(sizes, X, y, batch: int, epochs: int, precision: str = "float32", cudnn_default: bool = False) -> float:
    """PyTorch's loop; `precision` as pycyxwiz's matmul_precision: float32 GEMMs, TF32 GEMMs
    (allow_tf32), or bf16: the forward and loss under torch.autocast(dtype=torch.bfloat16). cuDNN's
    convolutions follow `precision` too (torch.backends.cudnn.allow_tf32), unless `cudnn_default`: then
    PyTorch's default, TF32 convolutions even under float32."""
    import contextlib

    import torch

    model = build_torch(torch, sizes)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    Xt, yt = torch.from_numpy(X), torch.from_numpy(y)
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = cudnn_default or precision == "tf32"
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if precision == "bf16" else contextlib.nullcontext

    def epoch(n_rows):
        perm = torch.randperm(n_rows)
        tot_loss = 0.0
        for b in range(0, n_rows, batch):
            idx = perm[b:b + batch]
            xb, yb = Xt[idx].cuda(non_blocking=False), yt[idx].cuda(non_blocking=False)
            with autocast():
                out = model(xb)
                loss = loss_fn(out, yb)
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
            tot_loss += loss.item() * len(idx)  # one host sync per batch, as pycyxwiz reads its loss
        return tot_loss

    epoch(min(batch * 20, len(X)))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(epochs):
        epoch(len(X))
    torch.cuda.synchronize()
    return epochs * len(X) / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=60000)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--no-cpu", action="store_true", help="skip pycyxwiz on the CPU (slow for the big model)")
    ap.add_argument("--checks", action="store_true",
                    help="only the GPU trainer with nonfinite='raise' against 'off', alternating (--rounds each)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--precision", choices=["float32", "tf32", "bf16"], default="float32",
                    help="pycyxwiz's matmul_precision, and the same in PyTorch (bf16: autocast)")
    ap.add_argument("--sync-bn", action="store_true",
                    help="with --cnn: also train ours with SyncBatchNormModule (world size 1) beside BatchNorm2d")
    ap.add_argument("--cnn", action="store_true",
                    help="a small ResNet on 3x32x32 images instead of the MLPs (no CPU column)")
    ap.add_argument("--batches", default="32,128,512", help="with --cnn: the batch sizes")
    args = ap.parse_args()
    if args.cnn:
        return cnn_rows(args)
    X, y = data(args.samples, 784, 10)
    if args.checks:
        return checks(X, y, args.epochs, args.rounds)
    rows = []
    print(f"== training throughput, global samples/s (world size 1, Adam, CrossEntropy, GEMMs {args.precision})",
          flush=True)
    print(f"{'model':>22} {'batch':>6} {'cx GPU':>10} {'torch GPU':>10} {'cx CPU':>10} {'cx/torch':>9} {'GPU/CPU':>8}")
    for sizes in ([784, 256, 10], [784, 2048, 2048, 10]):
        for batch in (64, 512, 4096):
            g = run_cx("nccl", sizes, X, y, batch, args.epochs, precision=args.precision)
            try:
                t = run_torch(sizes, X, y, batch, args.epochs, args.precision)
            except ImportError:
                t = float("nan")
            big = sizes[1] > 1024
            c = float("nan") if args.no_cpu or args.precision != "float32" or (big and batch < 4096) else run_cx("cpu", sizes, X[:8192], y[:8192],
                                                                                batch, 1)
            row = dict(model="-".join(map(str, sizes)), batch=batch, precision=args.precision, cx_gpu=g, torch_gpu=t,
                       cx_cpu=c,
                       cx_over_torch=g / t, gpu_over_cpu=g / c)
            rows.append(row)
            print(f"{row['model']:>22} {batch:>6} {g:>10.0f} {t:>10.0f} {c:>10.0f} {g / t:>9.2f} {g / c:>8.1f}",
                  flush=True)
    os.makedirs(os.path.join(ROOT, "benchmarks", "results", "partial"), exist_ok=True)
    name = "gpu_train.json" if args.precision == "float32" else f"gpu_train_{args.precision}.json"
    with open(os.path.join(ROOT, "benchmarks", "results", "partial", name), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


def cnn_rows(args) -> int:
    X, y = data(args.samples, 3 * 32 * 32, 10)
    X = X.reshape(-1, 3, 32, 32)
    print(f"== training throughput, small ResNet on 3x32x32, global samples/s (world size 1, Adam, GEMMs "
          f"{args.precision})", flush=True)
    global SYNC_BN
    # PyTorch's default runs cuDNN's convolutions in TF32 even under float32: with float32 GEMMs, the last two
    # columns time it so too (against our float32), beside the like-for-like columns.
    default_too = args.precision == "float32"
    print(f"{'batch':>6} {'cx GPU':>10} {'torch GPU':>10} {'cx/torch':>9}"
          + (f" {'torch dflt':>10} {'cx/dflt':>8}" if default_too else "")
          + (f" {'cx SyncBN':>10} {'sync/bn':>8}" if args.sync_bn else ""))
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        SYNC_BN = False
        g = run_cx("nccl", "cnn", X, y, batch, args.epochs, precision=args.precision)
        t = run_torch("cnn", X, y, batch, args.epochs, args.precision)
        row = dict(model="resnet-small", batch=batch, precision=args.precision, cx_gpu=g, torch_gpu=t,
                   cx_over_torch=g / t)
        line = f"{batch:>6} {g:>10.0f} {t:>10.0f} {g / t:>9.2f}"
        if default_too:
            td = run_torch("cnn", X, y, batch, args.epochs, args.precision, cudnn_default=True)
            row["torch_gpu_cudnn_tf32"] = td
            line += f" {td:>10.0f} {g / td:>8.2f}"
        if args.sync_bn:
            SYNC_BN = True
            sb = run_cx("nccl", "cnn", X, y, batch, args.epochs, precision=args.precision)
            row["cx_gpu_sync_bn"] = sb
            line += f" {sb:>10.0f} {sb / g:>8.2f}"
        rows.append(row)
        print(line, flush=True)
    os.makedirs(os.path.join(ROOT, "benchmarks", "results", "partial"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "results", "partial", f"gpu_train_cnn_{args.precision}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


def checks(X, y, epochs: int, rounds: int) -> int:
    """The cost of the GPU trainer's non-finite check (Note [Non-finite gradients on the GPU]): the same fit with
    nonfinite "raise" and "off", alternating, best of `rounds` each; ratio of samples/s (1.00x: free)."""
    print(f"== non-finite check on the GPU: samples/s, best of {rounds} alternating rounds (world size 1, Adam)")
    print(f"{'model':>22} {'batch':>6} {'off':>10} {'raise':>10} {'raise/off':>10} {'rounds raise/off':>28}")
    rows = []
    for sizes in ([784, 256, 10], [784, 2048, 2048, 10]):
        for batch in (64, 512, 4096):
            off, on = [], []
            for _ in range(rounds):
                off.append(run_cx("nccl", sizes, X, y, batch, epochs, "off"))
                on.append(run_cx("nccl", sizes, X, y, batch, epochs, "raise"))
            per = ", ".join(f"{a / b:.3f}" for a, b in zip(on, off))
            row = dict(model="-".join(map(str, sizes)), batch=batch, off=max(off), raise_=max(on),
                       ratio=max(on) / max(off), rounds=[a / b for a, b in zip(on, off)])
            rows.append(row)
            print(f"{row['model']:>22} {batch:>6} {max(off):>10.0f} {max(on):>10.0f} {row['ratio']:>9.3f}x "
                  f"{per:>28}", flush=True)
    os.makedirs(os.path.join(ROOT, "benchmarks", "results", "partial"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "results", "partial", "gpu_checks.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
