"""The guide's comprehensive example: DDP, sampler and batch iterator by hand, with the
guide's gradient-accumulation pattern, then the same with no_sync(), a parameter check,
and held-out accuracy on the digits set.

    python examples/distributed_training_example.py
    ./launch_distributed.sh 2 python examples/distributed_training_example.py
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _data import load_digits, train_test_split  # noqa: E402

import pycyxwiz as cx  # noqa: E402


def accuracy(model, X, y):
    return float((model.forward(X).argmax(axis=1) == y).mean())


def main() -> None:
    cx.distributed.init()
    rank, world = cx.distributed.get_rank(), cx.distributed.get_world_size()
    X, y = load_digits()
    X_train, y_train, X_test, y_test = train_test_split(X, y, seed=0)

    model = cx.SequentialModel()
    model.add(cx.LinearModule(64, 128))
    model.add(cx.ReLUModule())
    model.add(cx.LinearModule(128, 10))

    ddp_config = cx.distributed.DDPConfig()
    ddp_config.broadcast_parameters = True   # Sync params from rank 0
    ddp_config.bucket_size_mb = 25           # Gradient bucket size
    ddp_config.find_unused_parameters = False
    ddp = cx.distributed.DistributedDataParallel(model, ddp_config)
    loss_fn = cx.CrossEntropyLoss()

    # Best practice 3: scale the learning rate with the effective batch size.
    batch_size = 16
    base_lr, base_batch_size = 0.001, 64
    accumulation_steps = 4
    effective_batch_size = batch_size * world * accumulation_steps
    optimizer = cx.AdamOptimizer(base_lr * (effective_batch_size / base_batch_size))

    sampler = cx.distributed.DistributedSampler(dataset_size=len(X_train), shuffle=True, seed=42, drop_last=False)
    batch_iter = cx.distributed.DistributedBatchIterator(sampler, batch_size=batch_size)

    for epoch in range(12):
        batch_iter.reset(epoch=epoch)            # Best practice 1: sets the sampler's epoch
        total, n = 0.0, 0
        batches = []
        while batch_iter.has_next():
            batches.append(batch_iter.next())
        if epoch % 2 == 0:
            # Best practice 4, as in the guide: accumulate, then sync and update.
            for i, batch in enumerate(batches):
                output = ddp.forward(X_train[batch])
                loss = loss_fn.forward(output, y_train[batch]) / accumulation_steps
                ddp.backward(loss_fn.backward(1 / accumulation_steps))
                total, n = total + loss * accumulation_steps * len(batch), n + len(batch)
                if (i + 1) % accumulation_steps == 0 or i + 1 == len(batches):
                    ddp.sync_gradients()
                    ddp.update_parameters(optimizer)
        else:
            # The same with no_sync(): inner micro-batches never communicate.
            for start in range(0, len(batches), accumulation_steps):
                group = batches[start:start + accumulation_steps]
                for j, batch in enumerate(group):
                    output = ddp.forward(X_train[batch])
                    loss = loss_fn.forward(output, y_train[batch])
                    total, n = total + loss * len(batch), n + len(batch)
                    if j + 1 < len(group):
                        with ddp.no_sync():
                            ddp.backward(loss_fn.backward(1 / accumulation_steps), input_grad=False)
                    else:
                        ddp.backward(loss_fn.backward(1 / accumulation_steps), input_grad=False)
                ddp.update_parameters(optimizer)
        # Global mean loss, weighted by samples.
        stats = np.array([total, n], np.float64)
        cx.distributed.all_reduce(stats)
        if ddp.is_master():                      # Best practice 2: log on the master only
            print(f"Epoch {epoch}: Loss = {stats[0] / stats[1]:.4f}")

    ddp.check_parameters()   # raises, naming ranks and parameters, if the replicas drifted apart
    acc = accuracy(model, X_test, y_test)
    if ddp.is_master():
        print(f"{world} rank(s), {len(ddp.buckets)} bucket(s), "
              f"{ddp.allreduce_count} bucket all-reduces; held-out accuracy {acc:.4f}")
        model.save("distributed_example.cyxmodel")
    cx.distributed.finalize()


if __name__ == "__main__":
    main()
