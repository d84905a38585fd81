"""One rank of a small DistributedTrainer run, for tests/test_gpu.py (not collected by pytest).

    RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 DISTRIBUTED_BACKEND=nccl \\
        python tests/gpu_train_worker.py CASE OUT.npz

Builds the model of CASE with fixed seeds, trains it for two epochs on fixed data and writes
the per-epoch losses, the evaluation, the final parameters (flat), the optimizer state, the
BatchNorm statistics and the trainer's device to OUT.npz. Run once with the CPU backend and
once with NCCL, the two files must agree (the same model, the same data order and dropout masks).
"""
import os
import sys

import numpy as np

import pycyxwiz as cx


BN: list = []  # the BatchNorm modules of the model built last


def add(model, *modules) -> None:
    for m in modules:
        model.add(m)


def build(case: str):
    cx.manual_seed(7)
    sync = os.environ.get("CX_TEST_SYNC_BN") == "1"  # SyncBatchNormModule for every BatchNorm
    bn1d = cx.SyncBatchNormModule if sync else cx.BatchNormModule
    bn2d = cx.SyncBatchNormModule if sync else cx.BatchNorm2dModule
    BN[:] = [bn1d(32)]
    m = cx.SequentialModel()
    rng = np.random.default_rng(3)
    if case == "mlp_ce":  # every layer kind the digits example uses, plus BatchNorm and GELU
        # No bias before BatchNorm, as in real models: BatchNorm subtracts the batch mean, so that bias's
        # gradient is zero in exact arithmetic and rounding noise in float32. Adam-like optimizers divide
        # by sqrt(v), turning the noise into full-size steps of random sign: a 1e-7 change of the inputs
        # moved that bias by 1e-2 on the CPU alone (AdamW, RMSprop), 8e-4 of the whole parameter vector.
        add(m, cx.LinearModule(20, 64), cx.ReLUModule(), cx.DropoutModule(0.2),
            cx.LinearModule(64, 32, bias=False), BN[0], cx.GELUModule(), cx.LinearModule(32, 5))
        X = rng.standard_normal((200, 20)).astype(np.float32)
        y = (X[:, :5].argmax(1)).astype(np.int64)
        return m, cx.CrossEntropyLoss(), X, y
    if case == "mse":
        add(m, cx.LinearModule(12, 48), cx.TanhModule(), cx.LinearModule(48, 3), cx.SigmoidModule())
        X = rng.standard_normal((150, 12)).astype(np.float32)
        y = (1 / (1 + np.exp(-X[:, :3]))).astype(np.float32)
        return m, cx.MSELoss(), X, y
    if case == "bce":
        add(m, cx.LinearModule(10, 40), cx.LeakyReLUModule(0.1), cx.LinearModule(40, 4))
        X = rng.standard_normal((160, 10)).astype(np.float32)
        y = (X[:, :4] > 0).astype(np.float32)
        return m, cx.BCEWithLogitsLoss(), X, y
    if case == "softmax_dense":  # Flatten of (batch, 4, 5), Softmax in the middle, CE on soft targets
        add(m, cx.FlattenModule(), cx.LinearModule(20, 30), cx.SoftmaxModule(), cx.LinearModule(30, 6))
        X = rng.standard_normal((120, 4, 5)).astype(np.float32)
        t = rng.random((120, 6)).astype(np.float32)
        return m, cx.CrossEntropyLoss(), X, t / t.sum(1, keepdims=True)
    if case == "cnn":  # every image layer: Conv2d (padded, strided, 1x1), BatchNorm2d, both Residual forms, pools
        # No bias before BatchNorm2d (see mlp_ce).
        BN[:] = [bn2d(6), bn2d(6), bn2d(8)]
        block = cx.SequentialModel()
        add(block, cx.Conv2dModule(6, 6, 3, padding=1, bias=False), BN[1], cx.ReLUModule(),
            cx.Conv2dModule(6, 6, 3, padding=1))
        down, side = cx.SequentialModel(), cx.SequentialModel()
        add(down, cx.Conv2dModule(6, 8, 3, stride=2, padding=1), cx.ReLUModule())
        add(side, cx.Conv2dModule(6, 8, 1, stride=2, bias=False), BN[2])
        add(m, cx.Conv2dModule(2, 6, 3, padding=1, bias=False), BN[0], cx.ReLUModule(), cx.MaxPool2dModule(2),
            cx.ResidualModule(block), cx.ResidualModule(down, side), cx.AvgPool2dModule(2, stride=1),
            cx.GlobalAvgPool2dModule(), cx.LinearModule(8, 4))
        X = rng.standard_normal((96, 2, 8, 8)).astype(np.float32)
        y = (X[:, 0].mean((1, 2)) > 0).astype(np.int64) + 2 * (X[:, 1, :4].mean((1, 2)) > 0)
        return m, cx.CrossEntropyLoss(), X, y
    if case == "cnn_groups":  # grouped and dilated, overlapping windows, the 1x1 convolution's direct path
        add(m, cx.Conv2dModule(4, 8, 3, padding=2, dilation=2, groups=2), cx.ReLUModule(),
            cx.MaxPool2dModule(3, stride=2), cx.Conv2dModule(8, 8, 1), cx.AvgPool2dModule(3, stride=1),
            cx.FlattenModule(), cx.LinearModule(32, 3))
        X = rng.standard_normal((80, 4, 9, 9)).astype(np.float32)
        y = (X[:, :3].mean((2, 3))).argmax(1).astype(np.int64)
        return m, cx.CrossEntropyLoss(), X, y
    raise SystemExit(f"unknown case {case}")


OPTIMIZERS = {
    "sgd": lambda: cx.SGDOptimizer(0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
    "adam": lambda: cx.AdamOptimizer(1e-3, weight_decay=1e-4),
    "adamw": lambda: cx.AdamWOptimizer(1e-3),
    "rmsprop": lambda: cx.RMSpropOptimizer(1e-3, momentum=0.5),
}


def main() -> None:
    case, opt_name, out = sys.argv[1], sys.argv[2], sys.argv[3]
    # Optional: CX_TEST_COMM_HOOK (DDPConfig.comm_hook), CX_TEST_CLIP_NORM / CX_TEST_CLIP_VALUE (the clip bounds),
    # CX_TEST_EMA (an EMA of that decay, evaluating the validation set, X again, with its weights),
    # CX_TEST_SYNC_BN=1 (SyncBatchNormModule for BatchNorm; the float64 all-reduces' sizes are saved),
    # CX_TEST_ZERO=1 (shard_optimizer_state; then a checkpoint's optimizer arrays, and one more epoch unsharded).
    cx.distributed.init()
    model, loss, X, y = build(case)
    opt = OPTIMIZERS[opt_name]()
    ddp = cx.distributed.DDPConfig()
    ddp.comm_hook = os.environ.get("CX_TEST_COMM_HOOK", "none")
    trainer = cx.distributed.DistributedTrainer(model, loss, opt, ddp)
    cfg = cx.distributed.DistributedTrainingConfig()
    cfg.epochs, cfg.batch_size, cfg.seed, cfg.verbose = 2, 16, 11, False
    cfg.grad_clip_norm = float(os.environ["CX_TEST_CLIP_NORM"]) if "CX_TEST_CLIP_NORM" in os.environ else None
    cfg.grad_clip_value = float(os.environ["CX_TEST_CLIP_VALUE"]) if "CX_TEST_CLIP_VALUE" in os.environ else None
    zero = os.environ.get("CX_TEST_ZERO") == "1"
    cfg.shard_optimizer_state = zero
    extra = {}
    if "CX_TEST_EMA" in os.environ:
        ema = cx.callbacks.EMA(float(os.environ["CX_TEST_EMA"]), evaluate=True)
        h = trainer.fit(X, y, X, y, cfg, callbacks=[ema])
        extra = {"ema": ema.flat_parameters(), "val_losses": np.array(h.val_losses)}
    else:
        h = trainer.fit(X, y, cfg)
    ev = trainer.evaluate(X, y, batch_size=64)
    params = np.array(model.flat_parameters())
    sd = opt.state_dict()
    arrays = {f"opt_{k}": v for k, v in sd.items() if isinstance(v, np.ndarray)}
    if zero:  # the state gathered whole into a checkpoint, then ZeRO off (gathered again) for one more epoch
        from pycyxwiz.distributed import _ckpt_file
        trainer.save_checkpoint(out + ".ckpt")
        with open(out + ".ckpt", "rb") as f:
            z = _ckpt_file.unpack(f.read(), out + ".ckpt")
        extra.update({f"ckpt_{k[4:]}": np.asarray(z[k]) for k in z if k.startswith("opt.")})
        cfg.shard_optimizer_state, cfg.epochs = False, 1
        trainer.fit(X, y, cfg)
        extra["params_after"] = np.array(model.flat_parameters())
        extra.update({f"after_{k}": v for k, v in opt.state_dict().items() if isinstance(v, np.ndarray)})
    if os.environ.get("CX_TEST_SYNC_BN") == "1":
        extra["f64_counts"] = np.array([e["count"] for e in cx._core.dist._flight_record()
                                        if e["op"] == "all_reduce" and e["dtype"] == "float64"], np.int64)
    bn = [np.asarray(a) for b in BN for a in (b.running_mean, b.running_var)] if case in ("mlp_ce", "cnn") else []
    np.savez(out, losses=np.array(h.train_losses), accs=np.array(h.train_accuracies), eval=np.array(ev),
             params=params,
             step=np.array(sd["step"]), device=np.array(trainer.device),
             rng=np.asarray(model.get_rng_state(), np.uint64),
             **{f"bn{i}": b for i, b in enumerate(bn)}, **arrays, **extra)
    cx.distributed.finalize()


if __name__ == "__main__":
    main()
