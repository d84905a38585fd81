"""A plain PyTorch DDP script on pycyxwiz's collectives: the one-word change from gloo.

    ./launch_distributed.sh 2 python examples/torch_ddp_digits.py            # or torchrun --nproc-per-node 2 ...
    ./launch_distributed.sh 2 python examples/torch_ddp_digits.py --backend gloo   # the same on gloo

Trains a torch MLP on the handwritten digits embedded in pycyxwiz, each rank on its shard
(torch's DistributedSampler), gradients averaged by torch's DistributedDataParallel over the
"cyxwiz" backend; rank 0 prints the held-out accuracy. Needs torch (pip install ".[torch]").
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import pycyxwiz.torch  # noqa: F401  registers the backend "cyxwiz"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _data import load_digits, train_test_split  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cyxwiz")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=2e-3)
    args = ap.parse_args()

    dist.init_process_group(args.backend)  # env:// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    X, y = load_digits()
    X_train, y_train, X_test, y_test = train_test_split(X, y, test_fraction=0.2, seed=0)
    train = TensorDataset(torch.from_numpy(X_train), torch.from_numpy(y_train).long())
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
    elapsed = time.perf_counter() - t0

    with torch.no_grad():  # each rank scores half the held-out set; the counts are summed
        Xt, yt = torch.from_numpy(X_test)[rank::world], torch.from_numpy(y_test).long()[rank::world]
        counts = torch.tensor([(model(Xt).argmax(1) == yt).sum().item(), len(yt)], dtype=torch.int64)
    dist.all_reduce(counts)
    if rank == 0:
        print(f"{args.backend}: {world} ranks, {args.epochs} epochs in {elapsed:.2f} s, "
              f"held-out accuracy {counts[0].item() / counts[1].item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
