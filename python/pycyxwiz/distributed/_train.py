"""Data-parallel training: DDP, sampler, batch iterator and the high-level trainer.

    trainer = cx.distributed.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.AdamOptimizer(1e-3))
    config = cx.distributed.DistributedTrainingConfig(); config.epochs = 10; config.batch_size = 64
    history = trainer.fit(X_train, y_train, config)

DistributedDataParallel, DistributedSampler, DistributedBatchIterator and the trainer's
per-batch engine are C++ (csrc/train/). This module holds what is Python by nature: the
epoch loop (one C++ call per batch), the progress bar and log lines (rank 0 only), the
history, and checkpoint files.

Checkpoint file format (version 2): an uncompressed NumPy ``.npz`` archive with
``meta`` (UTF-8 JSON: format, version, epoch and batch position to resume at, partial
epoch sums, history, sampler seed/shuffle, world size), ``model`` (the ``.cyxmodel``
bytes: architecture, parameters, buffers), ``opt.<name>`` (the optimizer's state
arrays; its scalars are in ``meta``) and ``rng.modules`` (uint64, one row per rank: the
generator states of the model's Dropout modules, ``model.get_rng_state()`` on that rank;
absent in files written before it existed, which then resume with the states as they are);
with the PowerSGD communication hook also ``hook.q`` (float32: the warm-start Q of every compressed
matrix, the same on every rank) and ``hook.error`` (float32, one row per rank: that rank's
error-feedback residuals), and the hook's iteration count in ``meta``; and ``manifest.json`` with
the SHA-256 of every member, the zip comment holding the SHA-256 of the whole file (Note
[Checkpoints you can trust] in _ckpt_file.py; version 1 files had neither).

Every rank draws its own dropout masks (Note [Dropout across ranks] in csrc/train/ddp.h),
so a checkpoint must hold every rank's generator states although only rank 0 writes it.
fit() all-gathers them at the end of every epoch (a few bytes); a checkpoint holds
rank 0's live states and the other ranks' states from that gather, i.e. it is exact for
the checkpoints fit writes and for any save_checkpoint between fits. PowerSGD's residuals differ on every
rank too and are as large as the compressed matrices, so fit gathers them only where they are needed: at
the end of an epoch that writes a checkpoint and at the end of the fit (so, again, exact for the checkpoints
fit writes and for save_checkpoint between fits). Files are written to a temporary name, fsynced
and renamed, so a reader sees either the old complete file or the new complete file; the
temporary files of writers killed mid-save are removed at the next save.

With config.auto_resume (on by default where checkpoints are written), the first fit() of a
trainer resumes by itself from the newest checkpoint in config.checkpoint_dir that loads
cleanly: a job restarted by `python -m pycyxwiz.launch --max-restarts N` carries on where its
last checkpoint left it (Note [Restarts] in pycyxwiz/launch.py).
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
import warnings
from typing import Any, List, Optional, Tuple

import numpy as np

from .. import _core
from . import _ckpt_file, _pg
from ._pg import abort_on_error

_d = _core.dist

DDPConfig = _d.DDPConfig
PowerSGDConfig = _d.PowerSGDConfig
DistributedDataParallel = _d.DistributedDataParallel
DistributedSampler = _d.DistributedSampler
DistributedBatchIterator = _d.DistributedBatchIterator
ZeroRedundancyOptimizer = _d.ZeroRedundancyOptimizer

__all__ = [
    "DDPConfig", "PowerSGDConfig", "DistributedDataParallel", "DistributedSampler", "DistributedBatchIterator",
    "ZeroRedundancyOptimizer", "join",
    "DistributedTrainingConfig", "DistributedTrainingHistory", "DistributedTrainer",
]


def join(ddp: Any) -> Any:
    """Context manager for uneven inputs, the same as ``ddp.join()`` (torch.distributed.algorithms.Join).

        with cx.distributed.join(ddp):
            for xb, yb in my_batches: out = ddp.forward(xb); ...; ddp.update_parameters(opt)

    A rank whose loop ends first answers its peers' collectives with zeros until every rank's
    loop has ended; gradients are averaged over the ranks still active; on leaving every rank
    holds the parameters of the last ranks active (Note [Join] in csrc/train/ddp.h). Collective.
    """
    if not isinstance(ddp, DistributedDataParallel):
        hint = ("; wrap the model first: ddp = cx.distributed.DistributedDataParallel(model)"
                if isinstance(ddp, _core.SequentialModel) else "")
        raise TypeError(f"join: expects the DistributedDataParallel whose collectives a finished rank answers, "
                        f"got {type(ddp).__name__}{hint}")
    return ddp.join()

_CKPT_FORMAT = "pycyxwiz-checkpoint"
_CKPT_VERSION = 2        # 2: a manifest and a whole-file checksum (Note [Checkpoints you can trust])
_CKPT_READS = (1, 2)
_CKPT_NAME = re.compile(r"epoch_\d{4,}\.ckpt")  # what fit writes into checkpoint_dir


class DistributedTrainingConfig:
    """Options of DistributedTrainer.fit.

        config = cx.distributed.DistributedTrainingConfig()
        config.epochs = 10; config.batch_size = 64          # batch_size is per rank

    `epochs` is how many epochs one fit() trains: a second fit() continues the epoch count
    (and so the sampler's shuffle), as a resumed run does.

    Setting an attribute that does not exist raises AttributeError (a typo never goes unnoticed).
    """

    __slots__ = ("epochs", "batch_size", "shuffle", "seed", "verbose", "log_every_n_batches",
                 "checkpoint_every_n_epochs", "checkpoint_dir", "save_on_master_only", "validation_split",
                 "resume_from", "auto_resume", "drop_last", "scheduler", "check_every_n_steps", "on_divergence",
                 "shard_optimizer_state")

    def __init__(self, **kw: Any) -> None:
        self.epochs: int = 10
        self.batch_size: int = 32                # per rank; the effective batch is batch_size * world_size
        self.shuffle: bool = True
        self.seed: int = 42                      # sampler shuffle and validation split
        self.verbose: bool = True                # rank 0 prints progress and per-epoch summaries
        self.log_every_n_batches: int = 10       # progress update / log line every n batches (0: epoch lines only)
        self.checkpoint_every_n_epochs: int = 0  # 0: never
        self.checkpoint_dir: str = "./checkpoints"
        self.save_on_master_only: bool = True
        self.validation_split: float = 0.0       # fraction of (X, y) held out when no X_val/y_val is given
        self.resume_from: Optional[str] = None   # checkpoint file to continue from
        self.auto_resume: Optional[bool] = None  # first fit resumes from the newest checkpoint in checkpoint_dir
        #                                          (None: when checkpoint_every_n_epochs > 0)
        self.drop_last: bool = False             # drop each rank's last, shorter batch
        self.scheduler: Any = None               # an LRScheduler of the trainer's optimizer (or fit(scheduler=))
        self.check_every_n_steps: int = 200      # compare the ranks' parameters every n steps (0: never)
        self.on_divergence: str = "warn"         # when they differ: "warn" (RuntimeWarning) or "raise"
        # ZeRO-1: each rank keeps and updates 1/world_size of the optimizer state (trainer.optimizer then holds
        # this rank's shard; checkpoints hold it whole). CPU backend only.
        self.shard_optimizer_state: bool = False
        for k, v in kw.items():
            setattr(self, k, v)

    def __repr__(self) -> str:
        return "DistributedTrainingConfig(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__) + ")"


class DistributedTrainingHistory:
    """What fit() measured: global (all-rank, sample-weighted) metrics per epoch, time and throughput.

        history = trainer.fit(X, y, config)
        print(history.train_losses[-1], history.samples_per_second)
    """

    def __init__(self) -> None:
        self.train_losses: List[float] = []
        self.train_accuracies: List[float] = []
        self.val_losses: List[float] = []
        self.val_accuracies: List[float] = []
        self.total_time_seconds: float = 0.0
        self.samples_per_second: float = 0.0   # training samples over all ranks / training time
        self.effective_batch_size: int = 0     # batch_size * world_size
        self.world_size: int = 1
        self.epochs_completed: int = 0
        self.epochs: List[int] = []            # the epoch numbers (from 1, across fits) of the entries above
        self.total_samples: float = 0.0        # training samples processed over all ranks
        self.train_time_seconds: float = 0.0   # time in the training loops (throughput's denominator)

    def _to_json(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def _from_json(cls, d: dict) -> "DistributedTrainingHistory":
        h = cls()
        for k, v in d.items():
            if hasattr(h, k):
                setattr(h, k, v)
        return h

    def __repr__(self) -> str:
        last = lambda xs: f"{xs[-1]:.4f}" if xs else "-"  # noqa: E731
        return (f"DistributedTrainingHistory(epochs={len(self.train_losses)}, train_loss={last(self.train_losses)}, "
                f"train_acc={last(self.train_accuracies)}, val_loss={last(self.val_losses)}, "
                f"val_acc={last(self.val_accuracies)}, samples_per_second={self.samples_per_second:.0f}, "
                f"world_size={self.world_size})")


# The checks of a data set (shapes, dtypes, as many samples in X as in y) are made here, once: _TrainerCore
# (csrc/bindings/trainer.cpp) only converts what these return to pointers, checking what a pointer needs
# (float32 X; int64/int32 labels of shape (samples,) or float32 y; C-contiguous).


def _as_data(X: Any, y: Any, who: str) -> Tuple[np.ndarray, np.ndarray]:
    """(X, y) as float32 inputs and int64 labels / float32 targets with as many samples, or ValueError/TypeError."""
    X = _as_inputs(X, who)
    y = _as_targets(y, who)
    if X.shape[0] != y.shape[0]:
        raise ValueError(f"{who}: X has {X.shape[0]} samples but y has {y.shape[0]}; they must match")
    return X, y


def _as_inputs(X: Any, who: str) -> np.ndarray:
    X = np.asarray(X)
    if X.ndim < 2:
        raise ValueError(f"{who}: X must have shape (samples, features), got shape {X.shape}")
    return np.ascontiguousarray(X, dtype=np.float32)


def _as_targets(y: Any, who: str) -> np.ndarray:
    y = np.asarray(y)
    if y.dtype.kind in "iu":
        return np.ascontiguousarray(y, dtype=np.int64)
    if y.dtype.kind == "f":
        return np.ascontiguousarray(y, dtype=np.float32)
    raise TypeError(f"{who}: y must hold integer class labels or float targets, got dtype {y.dtype}")


def _draws_a_bar(stream) -> bool:
    """A bar where stdout is a terminal, or where the launcher shows it on one (CX_PROGRESS_BAR=1:
    Note [Redraws through the launcher] in pycyxwiz/launch.py); CX_PROGRESS_BAR=0: never."""
    wanted = os.environ.get("CX_PROGRESS_BAR", "")
    if wanted in ("0", "1"):
        return wanted == "1"
    return hasattr(stream, "isatty") and stream.isatty()


class _Progress:
    """Rank 0's output: a redrawn bar on a terminal, plain lines otherwise."""

    def __init__(self, enabled: bool, stream=None) -> None:
        self.stream = stream or sys.stdout
        self.enabled = enabled
        self.tty = enabled and _draws_a_bar(self.stream)

    def update(self, epoch: int, epochs: int, done: int, total: int, loss: float, acc: float, sps: float) -> None:
        if not self.enabled:
            return
        if self.tty:
            width = 24
            fill = int(width * done / max(total, 1))
            bar = "=" * fill + (">" if fill < width else "") + "." * max(width - fill - 1, 0)
            self.stream.write(f"\rEpoch {epoch}/{epochs} [{bar}] {done}/{total} - loss {loss:.4f} - acc {acc:.4f}"
                              f" - {sps:,.0f} samples/s\x1b[K")
        else:
            self.stream.write(f"Epoch {epoch}/{epochs} batch {done}/{total} - loss {loss:.4f} - acc {acc:.4f}"
                              f" - {sps:.0f} samples/s\n")
        self.stream.flush()

    def line(self, text: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r\x1b[K")
        self.stream.write(text + "\n")
        self.stream.flush()


class DistributedTrainer:
    """Trains a SequentialModel data-parallel over the process group of cx.distributed.init().

        trainer = cx.distributed.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.AdamOptimizer(1e-3))
        history = trainer.fit(X_train, y_train, config); loss, acc = trainer.evaluate(X_test, y_test)

    Construction wraps the model in DistributedDataParallel (rank 0's weights are copied to
    every rank), so every rank must create its trainer. fit, evaluate and load_checkpoint are
    collective (every rank calls them); save_checkpoint is not, except with
    config.shard_optimizer_state = True (ZeRO-1: each rank holds and updates 1/world_size of the
    optimizer state, and checkpoints gather it whole, so a resume may change the world size).
    """

    def __init__(self, model, loss_fn, optimizer, ddp_config: Optional[DDPConfig] = None) -> None:
        if not _pg.is_initialized():
            raise RuntimeError("DistributedTrainer: the process group is not initialised; call "
                               "cx.distributed.init() first (without RANK/WORLD_SIZE it is a world of one process)")
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self._core = _d._TrainerCore(model, loss_fn, optimizer, ddp_config or DDPConfig())
        self.ddp: DistributedDataParallel = self._core.ddp
        self.config = DistributedTrainingConfig()
        # Where the current fit stands (saved in checkpoints).
        self._epoch = 0
        self._position = 0
        self._partial = (0.0, 0.0, 0.0)
        self._history = DistributedTrainingHistory()
        # Every rank's model.get_rng_state() at the last epoch end or load (rank 0 only needs it).
        self._rng_by_rank: Optional[np.ndarray] = None
        # Every rank's PowerSGD residuals at the last gather (epochs that checkpoint, fit's end) or load.
        self._hook_errors: Optional[np.ndarray] = None
        self._in_fit = False
        self._fit_start = 0          # the epoch the current (or last) fit started at
        self._steps = 0              # optimizer steps over all fits (check_every_n_steps, per-step schedulers)
        self._resume_pending = False  # load_checkpoint() was called: the next fit continues from it
        self._scheduler: Any = None

    # ---- info ----------------------------------------------------------------------
    def is_master(self) -> bool:
        return self.ddp.is_master()

    def get_rank(self) -> int:
        return self.ddp.get_rank()

    def get_world_size(self) -> int:
        return self.ddp.get_world_size()

    @property
    def device(self) -> str:
        """Where the model trains: "" on the CPU; with BackendType.NCCL the GPU (LOCAL_RANK) and its GEMM."""
        return self._core.device

    def __repr__(self) -> str:
        return (f"DistributedTrainer(rank={self.get_rank()}, world_size={self.get_world_size()}, "
                f"loss_fn={self.loss_fn!r}, optimizer={self.optimizer!r})")

    # ---- training ------------------------------------------------------------------
    @abort_on_error
    def fit(self, X, y, *args, resume_from: Optional[str] = None, scheduler: Any = None) -> DistributedTrainingHistory:
        """fit(X, y, config) or fit(X, y, X_val, y_val, config); returns a DistributedTrainingHistory.

            history = trainer.fit(X, y, config)
            history = trainer.fit(X, y, X_val, y_val, config, resume_from="checkpoints/epoch_0004.ckpt")
            history = trainer.fit(X, y, config, scheduler=cx.StepLR(optimizer, step_size=10))

        Each call trains config.epochs more epochs, continuing the epoch count of the calls
        before (history.epochs says which). A scheduler (here or config.scheduler) is stepped
        once per epoch or once per optimizer step, as its `interval` says, and saved in
        checkpoints. Every config.check_every_n_steps steps the ranks' parameters are compared
        (a hash from each); if they differ, every rank warns "Gradients differ across ranks"
        naming the parameters and ranks, or raises with config.on_divergence = "raise".
        """
        X_val = y_val = None
        config: Optional[DistributedTrainingConfig] = None
        if len(args) == 1:
            config = args[0]
        elif len(args) == 2:
            X_val, y_val = args
        elif len(args) == 3:
            X_val, y_val, config = args
        elif len(args) > 3:
            raise TypeError("fit() takes (X, y, config) or (X, y, X_val, y_val, config)")
        if config is None:
            config = DistributedTrainingConfig()
        if not isinstance(config, DistributedTrainingConfig):
            raise TypeError(f"fit: config must be a DistributedTrainingConfig, got {type(config).__name__}")
        self._check_config(config)
        scheduler = scheduler if scheduler is not None else config.scheduler
        if scheduler is not None:
            if not isinstance(scheduler, _core.LRScheduler):
                raise TypeError(f"fit: scheduler must be a cx LRScheduler (StepLR, CosineAnnealingLR, "
                                f"LinearWarmupLR), got {type(scheduler).__name__}")
            if scheduler.optimizer is not self.optimizer:
                raise ValueError(f"fit: the scheduler steps {scheduler.optimizer!r}, not the trainer's optimizer "
                                 f"{self.optimizer!r}: make it with the trainer's optimizer")
        if (X_val is None) != (y_val is None):
            raise ValueError("fit: pass both X_val and y_val, or neither")
        self.config = config
        X, y = _as_data(X, y, "fit")
        if X_val is None and config.validation_split > 0:
            n_val = int(round(X.shape[0] * config.validation_split))
            if n_val >= 1:
                perm = np.random.default_rng(config.seed).permutation(X.shape[0])  # the same on every rank
                tr, va = np.sort(perm[n_val:]), np.sort(perm[:n_val])
                X_val, y_val, X, y = X[va], y[va], np.ascontiguousarray(X[tr]), np.ascontiguousarray(y[tr])
        if X_val is not None:
            X_val = _as_inputs(X_val, "fit")
            y_val = _as_targets(y_val, "fit")
        if X.shape[0] == 0:
            raise ValueError("fit: the training set is empty")

        world = self.get_world_size()
        sampler = DistributedSampler(X.shape[0], shuffle=config.shuffle, seed=config.seed,
                                     drop_last=False)
        batches = DistributedBatchIterator(sampler, config.batch_size, drop_last=config.drop_last)
        if batches.num_batches() == 0:
            raise ValueError(f"fit: with drop_last each rank's {sampler.local_size()} samples make no batch of "
                             f"{config.batch_size}; lower batch_size or set drop_last = False")

        resume_from = resume_from if resume_from is not None else config.resume_from
        self._scheduler = scheduler
        # ZeRO-1 on or off before a checkpoint is loaded, so its state lands sharded (collective).
        self._core.set_shard_optimizer_state(bool(config.shard_optimizer_state))
        resumed_by_itself = False
        if resume_from:
            self.load_checkpoint(resume_from)
        elif self._auto_resumes(config):
            try:
                resume_from = self._resume_newest(config.checkpoint_dir)
            except (OSError, ValueError) as e:
                raise type(e)(f"{e} (config.auto_resume found it in checkpoint_dir {config.checkpoint_dir!r}: set "
                              f"config.auto_resume = False, or empty that folder, to start over)") from None
            resumed_by_itself = resume_from is not None
        if not self._resume_pending:
            # A new fit continues where the last one ended (epoch count, so the shuffle goes on).
            self._fit_start = self._epoch = self._epochs_done()
            self._position, self._partial = 0, (0.0, 0.0, 0.0)
            self._history = DistributedTrainingHistory()
        self._resume_pending = False
        history = self._history
        history.effective_batch_size = config.batch_size * world
        history.world_size = world
        self._fit_sampler = sampler

        out = _Progress(config.verbose and self.is_master())
        if resumed_by_itself:
            out.line(f"resuming from {resume_from} (epoch {self._epochs_done()}, batch {self._position}; "
                     f"config.auto_resume = False starts over)")
        if self.device:
            out.line(f"training on {self.device}")
        # The model, BatchNorm statistics and optimizer state as the host objects hold them now
        # (GPU training: Note [The model on the GPU]; nothing to do on the CPU).
        self._core.sync_from_host()
        self._in_fit = True
        try:
            self._fit_epochs(X, y, X_val, y_val, config, sampler, batches, history, out, world)
        except BaseException:
            # Keep the host objects as far as training got (a later evaluate or save reads them);
            # a broken group may refuse, and the original error is the one to see.
            self._in_fit = False
            try:
                self._core.sync_to_host()
            except Exception:
                pass
            raise
        self._in_fit = False
        self._core.sync_to_host()
        return history

    def _auto_resumes(self, config: DistributedTrainingConfig) -> bool:
        """Note [Restarts] in pycyxwiz/launch.py: only a trainer's first fit looks for a checkpoint (a
        later fit continues what this process trained), and only where fit writes checkpoints."""
        on = config.auto_resume if config.auto_resume is not None else config.checkpoint_every_n_epochs > 0
        return bool(on) and not self._resume_pending and self._steps == 0 and self._epochs_done() == 0

    def _resume_newest(self, directory: str) -> Optional[str]:
        """Collective: restores the newest epoch_NNNN.ckpt in `directory` that loads cleanly, as rank 0
        finds it (each file read and checked once), and returns its path; None if there is none. A
        damaged newer one is skipped with a warning naming what is wrong."""
        path, data = "", b""
        if self.is_master():
            try:
                names = sorted((n for n in os.listdir(directory) if _CKPT_NAME.fullmatch(n)),
                               key=lambda n: int(n[6:-5]), reverse=True)
            except OSError:
                names = []
            for name in names:
                candidate = os.path.join(directory, name)
                try:
                    with open(candidate, "rb") as f:
                        raw = f.read()
                    _ckpt_file.unpack(raw, candidate)
                except OSError as e:
                    warnings.warn(f"auto_resume: skipping {candidate}: {e}", RuntimeWarning, stacklevel=3)
                    continue
                path, data = candidate, raw
                break
        path = self._from_master(path.encode()).decode()
        if not path:
            return None
        self._restore(self._from_master(data), path)
        return path

    def _from_master(self, data: bytes, err: str = "", others_err: str = "") -> bytes:
        """Collective: rank 0's `data` on every rank. If rank 0 failed to produce it (`err`), every rank
        raises OSError: rank 0 with `err`, the others with `others_err`."""
        if self.get_world_size() == 1:
            if err:
                raise OSError(err)
            return data
        head = np.array([-1 if err else len(data)], np.int64)
        self._core.broadcast_host(head, 0)
        if head[0] < 0:
            raise OSError(err or others_err)
        buf = np.frombuffer(data, np.uint8).copy() if self.is_master() else np.empty(int(head[0]), np.uint8)
        if buf.size:
            self._core.broadcast_host(buf, 0)
        return buf.tobytes()

    def _epochs_done(self) -> int:
        """Epochs completed over every fit so far (the next fit starts there)."""
        return self._epoch if self._position == 0 else self._epoch + 1

    def _after_step(self, config, world: int) -> None:
        self._steps += 1
        if self._scheduler is not None and self._scheduler.interval == "step":
            self._scheduler.step()
        n = config.check_every_n_steps
        if n and world > 1 and self._steps % n == 0:
            report = self._core.parameter_report()  # collective: the same answer on every rank
            if report:
                msg = f"Gradients differ across ranks (rank {self.get_rank()}, after step {self._steps}): {report}"
                if config.on_divergence == "raise":
                    raise _pg.DistributedError(msg)
                warnings.warn(msg, RuntimeWarning, stacklevel=4)

    def _fit_epochs(self, X, y, X_val, y_val, config, sampler, batches, history, out, world) -> None:
        log_every = max(int(config.log_every_n_batches), 0)
        start = time.perf_counter()
        end = self._fit_start + config.epochs
        self.model.zero_grad()
        for epoch in range(self._epoch, end):
            batches.reset(epoch)
            if self._position:
                batches.set_position(self._position)
            ls, cs, ns = self._partial
            self._epoch = epoch
            t0 = time.perf_counter()
            total = batches.num_batches()
            while batches.has_next():
                bl, bc, bn = self._core.train_batch(X, y, batches)
                ls, cs, ns = ls + bl, cs + bc, ns + bn
                self._after_step(config, world)
                self._position = batches.position()
                self._partial = (ls, cs, ns)
                done = batches.position()
                if log_every and (done % log_every == 0 or done == total):
                    dt = max(time.perf_counter() - t0, 1e-9)
                    out.update(epoch + 1, end, done, total, ls / max(ns, 1), cs / max(ns, 1), ns * world / dt)
            # Every rank's BatchNorm statistics become rank 0's, so evaluation, checkpoints and the model
            # after fit agree (DDPConfig.broadcast_buffers; Note [Buffers across ranks] in csrc/train/ddp.h).
            self._core.sync_buffers()
            g_loss, g_correct, g_count = self._core.reduce_stats(ls, cs, ns)
            if self._scheduler is not None and self._scheduler.interval == "epoch":
                self._scheduler.step()
            self._core.sync_to_host()  # checkpoints, the RNG gather and callers read the host objects
            self._rng_by_rank = self._gather_rng_states()
            if epoch + 1 == end or (config.checkpoint_every_n_epochs and
                                    (epoch + 1) % config.checkpoint_every_n_epochs == 0):
                self._hook_errors = self._gather_hook_errors()
            epoch_time = time.perf_counter() - t0
            history.train_time_seconds += epoch_time
            history.total_samples += g_count
            history.train_losses.append(g_loss / g_count)
            history.train_accuracies.append(g_correct / g_count)
            history.epochs.append(epoch + 1)
            msg = (f"Epoch {epoch + 1}/{end} - loss {g_loss / g_count:.4f} - "
                   f"acc {g_correct / g_count:.4f}")
            if X_val is not None:
                vl, va = self.evaluate(X_val, y_val, batch_size=max(config.batch_size, 256))
                history.val_losses.append(vl)
                history.val_accuracies.append(va)
                msg += f" - val_loss {vl:.4f} - val_acc {va:.4f}"
            msg += f" - {g_count / max(epoch_time, 1e-9):,.0f} samples/s - {epoch_time:.3f}s"
            out.line(msg)
            self._epoch, self._position, self._partial = epoch + 1, 0, (0.0, 0.0, 0.0)
            history.epochs_completed = epoch + 1
            if config.checkpoint_every_n_epochs and (epoch + 1) % config.checkpoint_every_n_epochs == 0:
                path = os.path.join(config.checkpoint_dir, f"epoch_{epoch + 1:04d}.ckpt")
                self.save_checkpoint(path)
                out.line(f"saved checkpoint {path}")
        history.total_time_seconds += time.perf_counter() - start
        history.samples_per_second = history.total_samples / max(history.train_time_seconds, 1e-9)

    @staticmethod
    def _check_config(c: DistributedTrainingConfig) -> None:
        if not isinstance(c.epochs, int) or c.epochs < 0:
            raise ValueError(f"DistributedTrainingConfig.epochs must be an int >= 0, got {c.epochs!r}")
        if not isinstance(c.batch_size, int) or c.batch_size < 1:
            raise ValueError(f"DistributedTrainingConfig.batch_size must be an int >= 1, got {c.batch_size!r}")
        if not 0.0 <= c.validation_split < 1.0:
            raise ValueError(f"DistributedTrainingConfig.validation_split must be in [0, 1), got "
                             f"{c.validation_split!r}")
        if c.checkpoint_every_n_epochs < 0 or c.log_every_n_batches < 0:
            raise ValueError("DistributedTrainingConfig.checkpoint_every_n_epochs and log_every_n_batches must "
                             "be >= 0")
        if not isinstance(c.check_every_n_steps, int) or c.check_every_n_steps < 0:
            raise ValueError(f"DistributedTrainingConfig.check_every_n_steps must be an int >= 0 (0: never), got "
                             f"{c.check_every_n_steps!r}")
        if c.auto_resume not in (None, True, False):
            raise ValueError(f"DistributedTrainingConfig.auto_resume must be None, True or False, got "
                             f"{c.auto_resume!r}")
        if c.on_divergence not in ("warn", "raise"):
            raise ValueError(f"DistributedTrainingConfig.on_divergence must be 'warn' or 'raise', got "
                             f"{c.on_divergence!r}")

    def evaluate(self, X, y, batch_size: int = 256) -> Tuple[float, float]:
        """Collective: (mean loss, accuracy) over all of (X, y); each rank evaluates a shard.

            loss, accuracy = trainer.evaluate(X_test, y_test)
        """
        X, y = _as_data(X, y, "evaluate")
        if X.shape[0] == 0:
            raise ValueError("evaluate: the data set is empty")
        if not self._in_fit:
            self._core.sync_from_host()  # the model as the host holds it (GPU training)
        ls, cs, ns = self._core.evaluate(X, y, batch_size)
        return ls / ns, cs / ns

    # ---- checkpoints ---------------------------------------------------------------
    def _gather_rng_states(self) -> np.ndarray:
        """Collective: every rank's model.get_rng_state(), one row per rank (uint64)."""
        mine = np.ascontiguousarray(self.model.get_rng_state(), dtype=np.uint64)
        world = self.get_world_size()
        rows = np.empty((world, mine.size), np.uint64)
        if world == 1 or mine.size == 0:
            rows[:] = mine
        else:
            self._core.all_gather_host(rows, mine)
        return rows

    def _gather_hook_errors(self) -> Optional[np.ndarray]:
        """Collective: every rank's PowerSGD residuals, one row per rank; None without that hook."""
        if self.ddp.comm_hook != "powersgd":
            return None
        mine = np.ascontiguousarray(self.ddp._comm_hook_state()[2], dtype=np.float32)
        world = self.get_world_size()
        rows = np.empty((world, mine.size), np.float32)
        if world == 1 or mine.size == 0:
            rows[:] = mine
        else:
            self._core.all_gather_host(rows, mine)
        return rows

    def _hook_arrays(self) -> Tuple[dict, Optional[dict]]:
        """A checkpoint's PowerSGD arrays and meta entry: this rank's live state, the others' residuals from
        the last gather (zeros where none has been made)."""
        if self.ddp.comm_hook != "powersgd":
            return {}, None
        iteration, q, mine = self.ddp._comm_hook_state()
        rows = self._hook_errors
        if rows is None or rows.shape != (self.get_world_size(), mine.size):
            rows = np.zeros((self.get_world_size(), mine.size), np.float32)
        rows = rows.copy()
        rows[self.get_rank()] = mine
        return {"hook.q": q, "hook.error": rows}, {"name": "powersgd", "iteration": int(iteration)}

    def _rng_rows(self) -> np.ndarray:
        """The rows a checkpoint holds: this rank's live states, the others' from the last gather."""
        mine = np.ascontiguousarray(self.model.get_rng_state(), dtype=np.uint64)
        rows = self._rng_by_rank
        if rows is None or rows.shape != (self.get_world_size(), mine.size):
            rows = mine[None, :]           # nothing gathered yet: only this rank's states are known
        rows = rows.copy()
        if rows.shape[0] > self.get_rank():
            rows[self.get_rank()] = mine
        return rows

    def _checkpoint_bytes(self) -> bytes:
        sd = self._core.optimizer_state_dict()  # the whole state: gathered (collective) under ZeRO-1
        scalars = {k: v for k, v in sd.items() if not isinstance(v, np.ndarray)}
        arrays = {f"opt.{k}": v for k, v in sd.items() if isinstance(v, np.ndarray)}
        arrays["rng.modules"] = self._rng_rows()
        hook_arrays, hook_meta = self._hook_arrays()
        arrays.update(hook_arrays)
        sampler = getattr(self, "_fit_sampler", None)
        meta = {
            "format": _CKPT_FORMAT, "version": _CKPT_VERSION,
            "epoch": self._epoch, "position": self._position, "partial": list(self._partial),
            "fit_start": self._fit_start, "steps": self._steps,
            "world_size": self.get_world_size(),
            "sampler": {"seed": sampler.seed if sampler else self.config.seed,
                        "shuffle": sampler.shuffle if sampler else self.config.shuffle,
                        "epoch": self._epoch, "batch_size": self.config.batch_size},
            # The sampler's order is a pure function of (seed, epoch), so the seed and the epoch
            # restore it exactly; the model's generators (Dropout) are in the rng.modules array.
            "rng": {"sampler_seed": self.config.seed},
            "optimizer": scalars,
            "scheduler": self._scheduler.state_dict() if self._scheduler is not None else None,
            "history": self._history._to_json(),
            "comm_hook": hook_meta,
        }
        return _ckpt_file.pack(dict(meta=np.frombuffer(json.dumps(meta).encode(), np.uint8),
                                    model=np.frombuffer(_d._model_to_bytes(self.model), np.uint8), **arrays))

    def save_checkpoint(self, path: str) -> Optional[str]:
        """Writes model, optimizer state, epoch, sampler position and history to `path`, atomically.

            trainer.save_checkpoint("model.ckpt")

        Not collective, except with config.shard_optimizer_state (ZeRO-1): then every rank must
        call it (as fit does), since each holds a shard of the optimizer state and the file holds
        it whole. With config.save_on_master_only (the default) only rank 0 writes; otherwise
        rank r > 0 writes `path` + ".rank<r>". Returns the path written, or None.
        """
        path = os.fspath(path)
        if self._core.shard_optimizer_state:
            data = self._checkpoint_bytes()  # collective: gathers the optimizer state's shards
            if self.config.save_on_master_only and not self.is_master():
                return None
            if not self.is_master():
                path = f"{path}.rank{self.get_rank()}"
            _ckpt_file.atomic_write(path, data)
            return path
        if self.config.save_on_master_only and not self.is_master():
            return None
        if not self.is_master():
            path = f"{path}.rank{self.get_rank()}"
        self._core.sync_to_host()
        data = self._checkpoint_bytes()
        _ckpt_file.atomic_write(path, data)
        return path

    def load_checkpoint(self, path: str) -> None:
        """Collective: restores a checkpoint written by save_checkpoint on every rank.

            trainer.load_checkpoint("model.ckpt")

        Rank 0 reads the file and sends it to the others, so only rank 0 needs it. The next
        fit(..., resume_from=...) (or fit after this call with the same config) continues at
        the saved epoch and batch.
        """
        path = os.fspath(path)
        data, err = b"", ""
        if self.is_master():
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError as e:
                err = f"load_checkpoint: cannot read {path!r} on rank 0: {e.strerror or e}"
        data = self._from_master(data, err, f"load_checkpoint: cannot read {path!r} on rank 0 (rank 0 reads "
                                            f"checkpoints for every rank; see its error)")
        self._restore(data, path)

    def _restore(self, data: bytes, path: str) -> None:
        z = _ckpt_file.unpack(data, path)  # Note [Checkpoints you can trust]
        try:
            meta = json.loads(z["meta"].tobytes().decode())
            model_bytes = z["model"].tobytes()
        except (KeyError, ValueError, UnicodeDecodeError) as e:
            raise OSError(f"load_checkpoint: {path!r} is not a readable pycyxwiz checkpoint ({e}); it may be "
                          f"truncated or from another program") from None
        arrays = {k[4:]: v for k, v in z.items() if k.startswith("opt.")}
        rng_rows = z.get("rng.modules")
        hook = {k[5:]: v for k, v in z.items() if k.startswith("hook.")}
        if not isinstance(meta, dict) or meta.get("format") != _CKPT_FORMAT or \
                meta.get("version") not in _CKPT_READS:
            raise OSError(f"load_checkpoint: {path!r} is not a pycyxwiz checkpoint of version {_CKPT_VERSION}")
        if meta["version"] >= 2 and not _ckpt_file.is_proven(data):
            raise OSError(f"load_checkpoint: {path!r} is damaged: it says version {meta['version']} but its "
                          f"whole-file checksum is missing")
        _d._model_load_bytes(self.model, model_bytes, path)
        sd = dict(meta["optimizer"])
        sd.update(arrays)
        if sd.get("type") != self.optimizer.state_dict().get("type"):
            raise ValueError(f"load_checkpoint: {path!r} holds {sd.get('type')} optimizer state but the trainer's "
                             f"optimizer is {self.optimizer!r}")
        self._core.load_optimizer_state_dict(sd)  # under ZeRO-1 each rank keeps its shard
        if rng_rows is not None:
            self._restore_rng(rng_rows, meta, path)
        self._restore_hook(hook, meta, path)
        self.model.zero_grad()
        if self._scheduler is not None and meta.get("scheduler"):
            self._scheduler.load_state_dict(meta["scheduler"])
        self._epoch = int(meta["epoch"])
        self._fit_start = int(meta.get("fit_start", 0))
        self._steps = int(meta.get("steps", 0))
        self._resume_pending = True
        self._position = int(meta["position"])
        self._partial = tuple(float(v) for v in meta["partial"])
        self._history = DistributedTrainingHistory._from_json(meta["history"])
        if meta.get("world_size") != self.get_world_size() and self._position:
            raise ValueError(f"load_checkpoint: {path!r} was saved mid-epoch with world_size "
                             f"{meta.get('world_size')}; it can only be resumed with the same world size "
                             f"(this run has {self.get_world_size()})")
        self._core.sync_from_host()


    def _restore_hook(self, hook: dict, meta: dict, path: str) -> None:
        """PowerSGD's state, when both the file and the trainer have that hook. This rank's residuals if the
        world size is the same; otherwise they start at zero (each belongs to one rank of the old world), while
        the iteration count and the warm-start Q (the same on every rank) carry over. A checkpoint without
        PowerSGD state leaves the hook as it is; a trainer without the hook ignores the state."""
        info = meta.get("comm_hook")
        if self.ddp.comm_hook != "powersgd" or not info or "q" not in hook or "error" not in hook:
            self._hook_errors = None
            return
        rows = hook["error"]
        world, rank = self.get_world_size(), self.get_rank()
        if rows.ndim != 2 or rows.dtype != np.float32:
            raise ValueError(f"load_checkpoint: {path!r} holds PowerSGD residuals of shape {rows.shape} "
                             f"({rows.dtype}); expected one float32 row per rank")
        mine = rows[rank] if rows.shape[0] == world else np.zeros(rows.shape[1], np.float32)
        try:
            self.ddp._set_comm_hook_state(int(info["iteration"]), hook["q"], mine)
        except ValueError as e:
            raise ValueError(f"load_checkpoint: {path!r}: {e}") from None
        self._hook_errors = rows.copy() if rows.shape[0] == world else None

    def _restore_rng(self, rows: np.ndarray, meta: dict, path: str) -> None:
        n = int(self.model.get_rng_state().size)
        if rows.dtype != np.uint64 or rows.ndim != 2 or rows.shape[1] != n:
            raise ValueError(f"load_checkpoint: {path!r} holds generator states of shape {rows.shape} but this "
                             f"model has {n} module(s) with a generator (Dropout); build the same architecture")
        rank, world = self.get_rank(), self.get_world_size()
        if rows.shape[0] == world:
            mine = rows[rank]
        else:
            # Saved by another world size (or before any gather): rank 0's states are known,
            # the others start their own streams from them, as at DDP construction.
            mine = np.array([_core.dist._fork_rng_stream(int(s), rank) for s in rows[0]], np.uint64)
        self.model.set_rng_state(mine)
        self._rng_by_rank = rows.copy() if rows.shape[0] == world else None
