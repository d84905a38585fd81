"""Type-checks the .pyi stubs against seed 004's usage (not a pytest module; nothing here runs).

    pip install mypy && MYPYPATH=python python -m mypy --ignore-missing-imports tests/stub_check/stubs_usage.py

The reveal-free asserts below are for mypy only: each line must type-check, and the
`# type: ignore[...]` lines must be errors (warn_unused_ignores makes mypy say so if not).
"""
# mypy: warn-unused-ignores
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

import pycyxwiz as cx

D = cx.distributed


def quick_start(X_train: np.ndarray, y_train: np.ndarray) -> None:
    D.init()
    model = cx.SequentialModel()
    model.add(cx.LinearModule(784, 256))
    model.add(cx.ReLUModule())
    model.add(cx.DropoutModule(0.1))
    model.add(cx.LinearModule(256, 10))
    trainer = D.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.AdamOptimizer(0.001))
    config = D.DistributedTrainingConfig()
    config.epochs = 10
    config.batch_size = 64
    history: D.DistributedTrainingHistory = trainer.fit(X_train, y_train, config)
    losses: List[float] = history.train_losses
    n: int = history.effective_batch_size
    history = trainer.fit(X_train, y_train, X_train, y_train, config, resume_from="ckpt")
    loss, acc = trainer.evaluate(X_train, y_train)
    pair: Tuple[float, float] = (loss, acc)
    written: Optional[str] = trainer.save_checkpoint("model.ckpt")
    trainer.load_checkpoint("model.ckpt")
    if trainer.is_master():
        model.save("model.cyxmodel")
    rng = model.get_rng_state()
    model.set_rng_state(rng)
    config.epochs = "ten"  # type: ignore[assignment]
    D.finalize()


def config_and_collectives() -> None:
    config = D.DistributedConfig()
    config.rank = 0
    config.world_size = 4
    config.master_addr = "127.0.0.1"
    config.master_port = 29500
    config.backend = D.BackendType.CPU
    config.timeout_ms = 30000
    config = D.DistributedConfig.from_environment()
    D.init(config)
    rank: int = D.get_rank() + D.get_world_size() + D.get_local_rank()
    ok: bool = D.is_initialized() and D.is_master()
    x = np.ones(8, np.float32)
    D.all_reduce(x)
    D.all_reduce(x, op=D.ReduceOp.AVG)
    work: D.Work = D.all_reduce(x, D.ReduceOp.MAX, async_op=True)
    done: bool = work.is_completed() or work.wait(timeout=1.0)
    none: None = D.broadcast(x, src=0)
    out = np.empty((D.get_world_size(), 8), np.float32)
    D.all_gather(out, x)
    D.reduce_scatter(x[:2], out)
    D.barrier()
    D.send(x, dst=1)
    D.recv(x, src=0)
    w2: D.Work = D.barrier(async_op=True)
    bad: D.Work = D.all_reduce(x)  # type: ignore[assignment]
    D.broadcast(x, source=0)  # type: ignore[call-overload]
    try:
        D.barrier()
    except D.DistributedTimeoutError:
        pass
    except D.DistributedError:
        pass


def ddp_and_sampler(model: cx.SequentialModel, opt: cx.Optimizer, X: np.ndarray) -> None:
    ddp_config = D.DDPConfig()
    ddp_config.broadcast_parameters = True
    ddp_config.bucket_size_mb = 25
    ddp_config.find_unused_parameters = False
    ddp_config.broadcast_buffers = True
    model = cx.SyncBatchNormModule.convert_sync_batchnorm(model)
    model = cx.convert_sync_batchnorm(model)
    sync_bn: cx.BatchNormModule = cx.SyncBatchNormModule(256, eps=1e-5, momentum=0.1)
    ddp = D.DistributedDataParallel(model, ddp_config)
    output = ddp.forward(X)
    grad_in = ddp.backward(output)
    grads = ddp.sync_gradients()
    ddp.update_parameters(opt)
    with ddp.no_sync():
        ddp.backward(output, input_grad=False)
    m: cx.SequentialModel = ddp.get_model()
    sampler = D.DistributedSampler(dataset_size=10000, shuffle=True, seed=42, drop_last=False)
    sampler.set_epoch(1)
    indices: List[int] = sampler.get_indices()
    sizes: int = sampler.local_size() + sampler.total_size() + sampler.padded_size()
    batch_iter = D.DistributedBatchIterator(sampler, batch_size=64)
    while batch_iter.has_next():
        idx: List[int] = batch_iter.next()
    batch_iter.reset(epoch=1)
    nb: int = batch_iter.num_batches()
    for idx in batch_iter:
        pass
    D.DistributedSampler("many")  # type: ignore[arg-type]


class Squares(cx.data.Dataset):
    def __len__(self) -> int:
        return 100

    def __getitem__(self, indices: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        x = indices[:, None].astype(np.float32)
        return x, x[:, 0] ** 2


class PrintLoss(cx.callbacks.Callback):
    def on_epoch_end(self, trainer: D.DistributedTrainer, epoch: int, logs: Dict[str, Any]) -> None:
        print(epoch, logs["loss"])
        trainer.stop_training = True


def callbacks_clipping_and_data(trainer: D.DistributedTrainer, X: np.ndarray, y: np.ndarray) -> None:
    config = D.DistributedTrainingConfig()
    config.grad_clip_norm = 1.0
    config.grad_clip_value = None
    ema = cx.callbacks.EMA(decay=0.999, evaluate=True)
    ckpt = cx.callbacks.ModelCheckpoint("ckpt", monitor="val_loss", mode="min", save_best=True, save_last=True)
    cbs: List[cx.callbacks.Callback] = [
        cx.callbacks.EarlyStopping(monitor="val_loss", patience=3, min_delta=0.0, mode="min"), ckpt, ema,
        cx.callbacks.CSVLogger("log.csv"), PrintLoss()]
    history = trainer.fit(X, y, X, y, config, callbacks=cbs)
    stopped: bool = history.stopped_early
    why: str = history.stop_reason
    png: str = history.plot("history.png")
    best: Optional[float] = ckpt.best_score
    where: Optional[str] = ckpt.best_path
    flat: np.ndarray = ema.flat_parameters()
    ema.apply_to(trainer.model)
    with ema.average_parameters(trainer.model):
        trainer.evaluate(X, y)
    train = cx.data.NpyDataset("x.npy", "y.npy")
    shards = cx.data.NpyDataset(["x0.npy", "x1.npy"], ["y0.npy", "y1.npy"])
    history = trainer.fit(train, config)
    history = trainer.fit(train, Squares(), config, callbacks=[ema])
    loss, acc = trainer.evaluate(shards, batch_size=512)
    results: List[Any] = D.launch_distributed_training(print, 2, backend="cpu", fallback=False, epochs=3)
    cx.callbacks.EarlyStopping(patience="3")  # type: ignore[arg-type]
