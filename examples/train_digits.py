"""Train an MLP on the handwritten digits data-parallel and report held-out accuracy.

    python examples/train_digits.py                            # one process
    ./launch_distributed.sh 2 python examples/train_digits.py  # two ranks over loopback

Every rank loads the same data and the same held-out split; each trains on its shard of
the training set per epoch (DistributedSampler inside the trainer), gradients are averaged
by DistributedDataParallel, and evaluate() reports the global accuracy on the test set.
Rank 0 saves the trained model (digits.cyxmodel; --save PATH, --save "" to skip); load it
back with cx.SequentialModel.load(path).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _data import load_digits, train_test_split  # noqa: E402

import pycyxwiz as cx  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--checkpoint-dir", default=None, help="checkpoint every 10 epochs into this folder")
    ap.add_argument("--resume-from", default=None)
    ap.add_argument("--save", default="digits.cyxmodel", help="where rank 0 saves the trained model ('' to skip)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()

    cx.distributed.init()
    X, y = load_digits()
    X_train, y_train, X_test, y_test = train_test_split(X, y, test_fraction=0.2, seed=0)

    cx.manual_seed(0)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    model = cx.SequentialModel()
    model.add(cx.LinearModule(64, args.hidden))
    model.add(cx.ReLUModule())
    model.add(cx.LinearModule(args.hidden, args.hidden))
    model.add(cx.ReLUModule())
    model.add(cx.LinearModule(args.hidden, 10))

    trainer = cx.distributed.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.AdamOptimizer(args.lr))
    config = cx.distributed.DistributedTrainingConfig()
    config.epochs = args.epochs
    config.batch_size = args.batch_size
    config.seed = 42
    config.verbose = not args.quiet
    config.log_every_n_batches = 0 if not sys.stdout.isatty() else 5
    config.validation_split = 0.1
    if args.checkpoint_dir:
        config.checkpoint_every_n_epochs = 10
        config.checkpoint_dir = args.checkpoint_dir
    config.resume_from = args.resume_from

    history = trainer.fit(X_train, y_train, config)
    test_loss, test_acc = trainer.evaluate(X_test, y_test)
    if trainer.is_master():
        print(f"world_size {history.world_size}, effective batch {history.effective_batch_size}, "
              f"{history.samples_per_second:,.0f} samples/s, {history.total_time_seconds:.1f} s")
        print(f"held-out test: loss {test_loss:.4f}, accuracy {test_acc:.4f} ({len(X_test)} digits)")
        if args.save:
            model.save(args.save)
            print(f"saved the model to {os.path.abspath(args.save)} (cx.SequentialModel.load(path) reads it back)")
    cx.distributed.finalize()


if __name__ == "__main__":
    main()
