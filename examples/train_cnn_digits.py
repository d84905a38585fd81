"""Train a small ResNet on the handwritten digits (8x8 images) data-parallel and report held-out accuracy.

    python examples/train_cnn_digits.py                            # one process
    ./launch_distributed.sh 2 python examples/train_cnn_digits.py  # two ranks over loopback

The digits are scikit-learn's 8x8 images, reshaped to (N, 1, 8, 8). The network is a ResNet in
miniature: a 3x3 stem, two residual blocks (the second halves the image and doubles the channels,
with a 1x1 strided shortcut), global average pooling and a linear classifier; BatchNorm2d after
every convolution, synchronized across ranks (SyncBatchNorm) so that 2 ranks normalise as one
process with the whole batch would, on the CPU backend and, with DISTRIBUTED_BACKEND=nccl, on the
GPUs (its statistics all-reduced by NCCL). Every rank loads the same data and held-out split; the trainer gives each rank its shard per epoch and averages the
gradients. Rank 0 saves the trained model
(cnn_digits.cyxmodel; --save PATH, --save "" to skip); cx.SequentialModel.load(path) reads it back.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _data import load_digits, train_test_split  # noqa: E402

import pycyxwiz as cx  # noqa: E402


def sequential(*modules):
    model = cx.SequentialModel()
    for m in modules:
        model.add(m)
    return model


def residual_block(cin, cout, stride):
    """conv-bn-relu-conv-bn, plus the input (through a 1x1 conv and bn when the shape changes)."""
    block = sequential(cx.Conv2dModule(cin, cout, 3, stride=stride, padding=1, bias=False), cx.BatchNorm2dModule(cout),
                       cx.ReLUModule(), cx.Conv2dModule(cout, cout, 3, padding=1, bias=False),
                       cx.BatchNorm2dModule(cout))
    if stride == 1 and cin == cout:
        return cx.ResidualModule(block)
    shortcut = sequential(cx.Conv2dModule(cin, cout, 1, stride=stride, bias=False), cx.BatchNorm2dModule(cout))
    return cx.ResidualModule(block, shortcut)


def small_resnet(width):
    return sequential(
        cx.Conv2dModule(1, width, 3, padding=1, bias=False), cx.BatchNorm2dModule(width), cx.ReLUModule(),
        residual_block(width, width, 1), cx.ReLUModule(),          # (N, w, 8, 8)
        residual_block(width, 2 * width, 2), cx.ReLUModule(),      # (N, 2w, 4, 4)
        cx.GlobalAvgPool2dModule(),                                # (N, 2w)
        cx.LinearModule(2 * width, 10))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--width", type=int, default=16, help="channels of the first stage")
    ap.add_argument("--checkpoint-dir", default=None, help="checkpoint every 5 epochs into this folder")
    ap.add_argument("--save", default="cnn_digits.cyxmodel", help="where rank 0 saves the trained model ('' to skip)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()

    cx.distributed.init()
    X, y = load_digits()
    X = X.reshape(-1, 1, 8, 8)  # images, NCHW
    X_train, y_train, X_test, y_test = train_test_split(X, y, test_fraction=0.2, seed=0)

    cx.manual_seed(0)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    model = small_resnet(args.width)
    model = cx.convert_sync_batchnorm(model)
    opt = cx.AdamOptimizer(args.lr)
    trainer = cx.distributed.DistributedTrainer(model, cx.CrossEntropyLoss(), opt)
    config = cx.distributed.DistributedTrainingConfig()
    config.epochs = args.epochs
    config.batch_size = args.batch_size
    config.seed = 42
    config.verbose = not args.quiet
    config.log_every_n_batches = 0 if not sys.stdout.isatty() else 5
    config.validation_split = 0.1
    config.scheduler = cx.CosineAnnealingLR(opt, T_max=args.epochs)
    if args.checkpoint_dir:
        config.checkpoint_every_n_epochs = 5
        config.checkpoint_dir = args.checkpoint_dir

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
