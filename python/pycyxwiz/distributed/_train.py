"""Data-parallel training: DDP, sampler, batch iterator and the high-level trainer.

    trainer = cx.distributed.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.AdamOptimizer(1e-3))
    config = cx.distributed.DistributedTrainingConfig(); config.epochs = 10; config.batch_size = 64
    history = trainer.fit(X_train, y_train, config)

DistributedDataParallel, DistributedSampler, DistributedBatchIterator and the trainer's
per-batch engine are C++ (csrc/train/). This module holds what is Python by nature: the
epoch loop (one C++ call per batch), the progress bar and log lines (rank 0 only), the
history, and checkpoint files.

Checkpoint file format (version 3): an uncompressed NumPy ``.npz`` archive with
``meta`` (UTF-8 JSON: format, version, epoch and batch position to resume at, partial
epoch sums, history, sampler seed/shuffle, world size), ``model`` (the ``.cyxmodel``
bytes: architecture, parameters, buffers), ``opt.<name>`` (the optimizer's state
arrays; its scalars are in ``meta``) and ``rng.modules`` (uint64, one row per rank: the
generator states of the model's Dropout modules, ``model.get_rng_state()`` on that rank;
absent in files written before it existed, which then resume with the states as they are);
with the PowerSGD communication hook also ``hook.q`` (float32: the warm-start Q of every compressed
matrix, the same on every rank) and ``hook.error`` (float32, one row per rank: that rank's
error-feedback residuals), and the hook's iteration count in ``meta``; and ``manifest.json`` with
the SHA-256 and the place of every member, the zip comment holding the SHA-256 of the rest of the file
(Note [Checkpoints you can trust] in _ckpt_file.py; version 2 files hashed the whole file, version 1 files
had neither).

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

import concurrent.futures
import contextlib
import math
import os
import re
import sys
import time
import warnings
from typing import Any, List, NoReturn, Optional, Tuple

import numpy as np

from .. import _core, _env
from .. import callbacks as _callbacks
from ..data import Dataset
from ..data import NpyDataset as _NpyDataset
from ..data._loader import Prefaulter, Prefetcher, Subset
from . import _ckpt_contents, _ckpt_file, _pg
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
    "DistributedTrainingConfig", "DistributedTrainingHistory", "DistributedTrainer", "NonFiniteError",
]


# A loss, gradient or layer output that is NaN or infinite, named where it arose (a FloatingPointError and a
# DistributedError). DDP's check (DDPConfig.nonfinite = "raise") raises it on every rank at once, naming the step,
# the parameters and the ranks whose own gradient was bad, and fit adds the epoch, the batch and this rank's rows;
# fit's per-step loss check raises it on the rank whose loss was not finite (every other rank then raises
# DistributedConnectionError "rank R failed: NonFiniteError: ..."); model.detect_anomaly names the layer.
NonFiniteError = _core.NonFiniteError


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
                 "shard_optimizer_state", "grad_clip_norm", "grad_clip_value", "nonfinite", "detect_anomaly",
                 "matmul_precision")

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
        # Clip the gradient averaged over ranks before every optimizer step (Note [Clipping the global gradient] in
        # csrc/train/grad_clip.h): its global L2 norm to grad_clip_norm, each element to +-grad_clip_value (values
        # first when both are set); None: no clipping. On either backend.
        self.grad_clip_norm: Optional[float] = None
        self.grad_clip_value: Optional[float] = None
        # A step whose gradient averaged over the ranks holds NaN/inf (Note [Non-finite gradients] in
        # csrc/train/nonfinite.h): "raise" (NonFiniteError on every rank naming the step, epoch, batch,
        # parameters and the ranks whose own gradient was bad), "skip" (the step is not taken, on every rank,
        # counted in history.skipped_steps), "warn" or "off"; None: the trainer's DDPConfig.nonfinite ("raise").
        self.nonfinite: Optional[str] = None
        # Anomaly mode (as torch.autograd.detect_anomaly) during fit: the first layer whose output or gradient
        # went NaN/inf is named (model.detect_anomaly). Costs a read of every activation and gradient.
        self.detect_anomaly: bool = False
        # What the GPU's matrix products round their inputs to: "float32" (none), "tf32" or "bf16" (tensor cores,
        # summed in float32; everything else stays float32: Note [GEMM precision] in csrc/cuda/blas.cpp). For fit
        # and for evaluate/predict after it. GPU backend only; the CPU trainer refuses all but "float32".
        self.matmul_precision: str = "float32"
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
        self.stopped_early: bool = False       # a callback stopped fit (trainer.stop_training) before config.epochs
        self.stop_reason: str = ""             # why (EarlyStopping says which score stopped improving since when)
        self.stopped_epoch: int = 0            # the last epoch trained when it stopped early
        self.skipped_steps: int = 0            # steps not taken: the averaged gradient was not finite
        #                                        (DistributedTrainingConfig.nonfinite = "skip")

    def plot(self, path: Any) -> str:
        """Draws loss and accuracy per epoch (training, and validation where there is some) into an image file.

            history.plot("history.png")            # the format follows the suffix (.png, .pdf, .svg)

        Needs matplotlib (pip install matplotlib); uses no display and leaves pyplot's state alone.
        Returns the path written.
        """
        try:
            from matplotlib.figure import Figure
            from matplotlib.ticker import MaxNLocator
        except ImportError:
            raise ImportError("DistributedTrainingHistory.plot needs matplotlib, which is not installed: "
                              "pip install matplotlib (or pip install 'pycyxwiz[plot]')") from None
        path = os.fspath(path)
        epochs = self.epochs or list(range(1, len(self.train_losses) + 1))
        fig = Figure(figsize=(9.0, 3.6))
        ax_loss, ax_acc = fig.subplots(1, 2)
        for ax, train, val, what in ((ax_loss, self.train_losses, self.val_losses, "loss"),
                                     (ax_acc, self.train_accuracies, self.val_accuracies, "accuracy")):
            ax.plot(epochs[:len(train)], train, marker="o", ms=3, label=f"train {what}")
            if val:
                ax.plot(epochs[:len(val)], val, marker="o", ms=3, label=f"validation {what}")
            if self.stopped_early and self.stopped_epoch:
                ax.axvline(self.stopped_epoch, color="grey", ls=":", lw=1, label="stopped early")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel("epoch")
            ax.set_ylabel(what)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"{len(self.train_losses)} epochs, {self.world_size} rank(s), "
                     f"{self.samples_per_second:,.0f} samples/s", fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        return path

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
    """X as float32 C-contiguous, by the rule model.forward follows too (Note [One rule for input arrays] in
    csrc/bindings/arrays.cpp): any array of real numbers (float16/32/64, integers, bools; a list) is converted as
    np.ascontiguousarray(X, dtype=np.float32) would; complex, object and string data are refused."""
    X = np.asarray(X)
    if X.dtype.kind not in "fiub":
        raise TypeError(f"{who}: expected an array of real numbers of shape (samples, features) (it is converted to "
                        f"float32), got {X.dtype} array of shape {X.shape}")
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


def _dataset_size(ds: Dataset, who: str) -> int:
    try:
        return len(ds)
    except (TypeError, ValueError) as e:  # what len() says of a __len__ returning -1, 2.0, "3"
        raise TypeError(f"{who}: len({_name(ds)}) must be an int >= 0 ({e})") from None


def _name(ds: Dataset) -> str:
    return _name(ds.ds) if isinstance(ds, Subset) else type(ds).__name__


def _dataset_batch(ds: Dataset, idx: np.ndarray, who: str) -> Tuple[np.ndarray, np.ndarray]:
    """ds[idx] checked and converted as fit(X, y) converts arrays (float32 X; int64 labels or float32 targets).
    Runs on the prefetch thread; what it raises comes out of fit or evaluate."""
    out = ds[idx]
    if type(out) is not tuple or len(out) != 2:
        raise TypeError(f"{who}: {_name(ds)}[indices] must return a tuple (X_batch, y_batch), got "
                        f"{type(out).__name__}" + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else ""))
    X, y = np.asarray(out[0]), np.asarray(out[1])
    n = idx.size
    if X.ndim < 2 or X.shape[0] != n or X.dtype.kind not in "fiub" or y.ndim < 1 or y.shape[0] != n:
        what = f"{who}: {_name(ds)}[indices]"
        if X.ndim < 2:
            raise ValueError(f"{what} returned X of shape {X.shape}; X_batch must have shape (batch, features...)")
        if X.dtype.kind not in "fiub":
            raise TypeError(f"{what} returned X of dtype {X.dtype}; X_batch must be numeric")
        if X.shape[0] != n:
            raise ValueError(f"{what} returned {X.shape[0]} rows of X for {n} indices; it must return one row per "
                             f"index")
        raise ValueError(f"{what} returned y of shape {y.shape} for {n} indices; y_batch must have one entry per "
                         f"index")
    if X.dtype != np.float32 or not X.flags.c_contiguous:
        X = np.ascontiguousarray(X, dtype=np.float32)
    if y.dtype != np.int64 or not y.flags.c_contiguous:
        y = _as_targets(y, f"{who}: {_name(ds)}[indices]")
    return X, y


def _split(n: int, fraction: float, seed: int) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """validation_split: (training rows, validation rows), both sorted, the same on every rank; None if no row."""
    n_val = int(round(n * fraction))
    if n_val < 1:
        return None
    perm = np.random.default_rng(seed).permutation(n)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def _write_checkpoint(members: dict, paths: List[str]) -> None:
    _ckpt_file.atomic_write(paths, _ckpt_file.pieces(members))  # Note [Packing without copies]


def _draws_a_bar(stream) -> bool:
    """A bar where stdout is a terminal, or where the launcher shows it on one (CX_PROGRESS_BAR=1:
    Note [Redraws through the launcher] in pycyxwiz/launch.py); CX_PROGRESS_BAR=0: never."""
    wanted = _env.get("CX_PROGRESS_BAR") or ""
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
        # Callbacks (cx.callbacks) of the current (or last) fit, and the states a loaded checkpoint holds for the
        # next fit's callbacks. A callback sets stop_training (and stop_reason) to end fit after this epoch.
        self._callbacks: List[_callbacks.Callback] = []
        self._loaded_callback_states: Optional[Tuple[dict, dict]] = None
        self._epoch_log_keys: Optional[List[str]] = None
        self.stop_training = False
        self.stop_reason = ""
        self._writer: Optional[concurrent.futures.ThreadPoolExecutor] = None  # Note [Checkpoints written in the
        self._writing: Optional[concurrent.futures.Future] = None              # background]
        self._saved_in_background = False
        self._spare: dict = {}  # the arrays of the last checkpoint fit wrote, for the next to reuse (same Note)

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

    @property
    def history(self) -> DistributedTrainingHistory:
        """The history of the current (or last) fit, as far as it got (callbacks read it)."""
        return self._history

    @property
    def epochs_completed(self) -> int:
        """Epochs completed over every fit so far (a resumed run counts those before the restart); the epoch in
        progress is epochs_completed + 1."""
        return self._epoch

    def __repr__(self) -> str:
        return (f"DistributedTrainer(rank={self.get_rank()}, world_size={self.get_world_size()}, "
                f"loss_fn={self.loss_fn!r}, optimizer={self.optimizer!r})")

    # ---- training ------------------------------------------------------------------
    @abort_on_error
    def fit(self, X, y=None, *args, resume_from: Optional[str] = None, scheduler: Any = None,
            callbacks: Any = None) -> DistributedTrainingHistory:
        """fit(X, y, config) or fit(X, y, X_val, y_val, config); fit(dataset, config) or fit(dataset, val_dataset,
        config) with cx.data.Dataset; returns a DistributedTrainingHistory.

            history = trainer.fit(X, y, config)
            history = trainer.fit(X, y, X_val, y_val, config, resume_from="checkpoints/epoch_0004.ckpt")
            history = trainer.fit(X, y, config, scheduler=cx.StepLR(optimizer, step_size=10))
            history = trainer.fit(cx.data.NpyDataset("x.npy", "y.npy"), config,
                                  callbacks=[cx.callbacks.EarlyStopping("loss", patience=2)])

        Each call trains config.epochs more epochs, continuing the epoch count of the calls
        before (history.epochs says which). A scheduler (here or config.scheduler) is stepped
        once per epoch or once per optimizer step, as its `interval` says, and saved in
        checkpoints. Every config.check_every_n_steps steps the ranks' parameters are compared
        (a hash from each); if they differ, every rank warns "Gradients differ across ranks"
        naming the parameters and ranks, or raises with config.on_divergence = "raise".
        `callbacks` (cx.callbacks) are called on every rank at the beginning and end of training,
        of every epoch, and after every step; one may stop fit after an epoch (history.stopped_early).
        A Dataset's batches are read on a background thread while the previous step runs.
        """
        train, val, config = self._fit_arguments(X, y, args)
        self._check_config(config)
        scheduler = self._check_scheduler(scheduler if scheduler is not None else config.scheduler)
        cbs = _callbacks._as_list(callbacks)
        self.config = config
        train, val = self._split_validation(train, val, config)
        n = _dataset_size(train, "fit") if isinstance(train, Dataset) else train[0].shape[0]
        if n == 0:
            raise ValueError("fit: the training set is empty")

        world = self.get_world_size()
        sampler = DistributedSampler(n, shuffle=config.shuffle, seed=config.seed, drop_last=False)
        batches = DistributedBatchIterator(sampler, config.batch_size, drop_last=config.drop_last)
        if batches.num_batches() == 0:
            raise ValueError(f"fit: with drop_last each rank's {sampler.local_size()} samples make no batch of "
                             f"{config.batch_size}; lower batch_size or set drop_last = False")

        self._scheduler = scheduler
        # ZeRO-1 on or off before a checkpoint is loaded, so its state lands sharded (collective).
        self._core.set_shard_optimizer_state(bool(config.shard_optimizer_state))
        self._core.set_grad_clip(float(config.grad_clip_norm or 0.0), float(config.grad_clip_value or 0.0))
        if config.nonfinite is not None:
            self._core.set_nonfinite(config.nonfinite)
        self._core.set_matmul_precision(config.matmul_precision)
        resume_from, resumed_by_itself = self._resume(config, cbs, resume_from)
        self._callbacks = cbs
        if not self._resume_pending:
            # A new fit continues where the last one ended (epoch count, so the shuffle goes on).
            self._fit_start = self._epoch = self._epochs_done()
            self._position, self._partial = 0, (0.0, 0.0, 0.0)
            self._history = DistributedTrainingHistory()
        elif self._loaded_callback_states is not None:
            _callbacks._restore(cbs, *self._loaded_callback_states)
        self._loaded_callback_states = None
        self._resume_pending = False
        history = self._history
        history.effective_batch_size = config.batch_size * world
        history.world_size = world
        self._fit_sampler = sampler
        self.stop_training, self.stop_reason = False, ""
        self._epoch_log_keys = (["epoch", "loss", "accuracy"] + (["val_loss", "val_accuracy"] if val is not None
                                                                 else []) + ["lr", "samples_per_second", "epoch_time"])

        out = _Progress(config.verbose and self.is_master())
        if resumed_by_itself:
            self._say_resumed(out, config, resume_from)
        if self.device:
            out.line(f"training on {self.device}")
        self._train(train, val, config, batches, history, out, world, cbs)
        return history

    def _check_scheduler(self, scheduler: Any) -> Any:
        if scheduler is not None:
            if not isinstance(scheduler, _core.LRScheduler):
                raise TypeError(f"fit: scheduler must be a cx LRScheduler (StepLR, CosineAnnealingLR, "
                                f"LinearWarmupLR), got {type(scheduler).__name__}")
            if scheduler.optimizer is not self.optimizer:
                raise ValueError(f"fit: the scheduler steps {scheduler.optimizer!r}, not the trainer's optimizer "
                                 f"{self.optimizer!r}: make it with the trainer's optimizer")
        return scheduler

    def _resume(self, config: DistributedTrainingConfig, cbs: List[_callbacks.Callback],
                resume_from: Optional[str]) -> Tuple[Optional[str], bool]:
        """Loads the checkpoint fit resumes from, if any: (its path, whether auto_resume found it)."""
        resume_from = resume_from if resume_from is not None else config.resume_from
        if resume_from:
            self.load_checkpoint(resume_from)
            return resume_from, False
        if not self._auto_resumes(config, cbs):
            return None, False
        # checkpoint_dir is fit's own folder: looked at where fit writes there, or where asked to.
        own = config.checkpoint_every_n_epochs > 0 or config.auto_resume is True
        try:
            found = self._resume_newest(config.checkpoint_dir if own else None, cbs)
        except (OSError, ValueError) as e:
            raise type(e)(f"{e} (config.auto_resume found it in checkpoint_dir {config.checkpoint_dir!r}: set "
                          f"config.auto_resume = False, or empty that folder, to start over)") from None
        return found, found is not None

    def _say_resumed(self, out: "_Progress", config: DistributedTrainingConfig, resume_from: Optional[str]) -> None:
        # One line on rank 0 even with verbose = False: a resumed run that has nothing left trains nothing,
        # and should say so.
        end, left = self._fit_start + config.epochs, self._fit_start + config.epochs - self._epoch
        at = f", epoch {self._epoch + 1} from batch {self._position + 1}" if self._position else ""
        what = (f"{left} epoch{'s' if left != 1 else ''} left to train" if left > 0 else
                "nothing left to train (that run finished; raise config.epochs to train more)")
        (out if config.verbose else _Progress(self.is_master())).line(
            f"resuming from {resume_from} ({self._epoch} of {end} epochs done{at}); {what}; "
            f"config.auto_resume = False starts over")

    def _train(self, train, val, config, batches, history, out, world, cbs) -> None:
        """fit's epochs between the callbacks' on_train_begin and on_train_end, the host objects in step."""
        # The model, BatchNorm statistics and optimizer state as the host objects hold them now
        # (GPU training: Note [The model on the GPU]; nothing to do on the CPU).
        self._core.sync_from_host()
        self._in_fit = True
        anomaly = self.model.detect_anomaly
        self.model.detect_anomaly = anomaly or bool(config.detect_anomaly)
        skipped_before = self.ddp.skipped_steps
        try:
            for cb in cbs:
                _callbacks._call(cb, "on_train_begin", self)
            self._fit_epochs(train, val, config, batches, history, out, world, cbs)
        except BaseException:
            # Keep the host objects as far as training got (a later evaluate or save reads them);
            # a broken group may refuse, and the original error is the one to see.
            self._in_fit = False
            try:
                self._saved_in_background = False
                self._close_writer(raise_error=False)
                self._end_averages(cbs)
                self._core.sync_to_host()
            except Exception:
                pass
            raise
        finally:
            self.model.detect_anomaly = anomaly
            history.skipped_steps += self.ddp.skipped_steps - skipped_before
        self._in_fit = False
        self._end_background_saves()
        self._end_averages(cbs)
        self._core.sync_to_host()
        for cb in cbs:
            _callbacks._call(cb, "on_train_end", self)

    def _end_averages(self, cbs: List[_callbacks.Callback]) -> None:
        """The EMAs get the last step's update and are no longer updated (Note [EMA off the critical path])."""
        self._core.settle_ema()
        self._core.clear_ema()
        for cb in cbs:
            if isinstance(cb, _callbacks.EMA):
                cb._detach()

    @staticmethod
    def _fit_arguments(X, y, args) -> Tuple[Any, Any, "DistributedTrainingConfig"]:
        """fit's positional forms as (training data, validation data or None, config): data are (X, y) arrays
        checked and converted, or a cx.data.Dataset."""
        config: Any = None
        if isinstance(X, Dataset):
            rest = ([] if y is None else [y]) + list(args)
            if rest and isinstance(rest[-1], (DistributedTrainingConfig, type(None))):
                config = rest.pop()
            if len(rest) > 1 or (rest and not isinstance(rest[0], Dataset)):
                got = ", ".join(type(r).__name__ for r in rest)
                raise TypeError(f"fit(dataset, ...) takes (dataset, config) or (dataset, val_dataset, config), with "
                                f"cx.data.Dataset for both; got ({type(X).__name__}, {got}, ...)")
            train: Any = X
            val: Any = rest[0] if rest else None
        else:
            if y is None:
                raise TypeError("fit() takes (X, y, config), (X, y, X_val, y_val, config) or, for data that does "
                                "not fit in memory, (dataset, config) with a cx.data.Dataset")
            X_val = y_val = None
            if len(args) == 1:
                config = args[0]
            elif len(args) == 2:
                X_val, y_val = args
            elif len(args) == 3:
                X_val, y_val, config = args
            elif len(args) > 3:
                raise TypeError("fit() takes (X, y, config) or (X, y, X_val, y_val, config)")
            if (X_val is None) != (y_val is None):
                raise ValueError("fit: pass both X_val and y_val, or neither")
            train = _as_data(X, y, "fit")
            val = None if X_val is None else (_as_inputs(X_val, "fit"), _as_targets(y_val, "fit"))
        if config is None:
            config = DistributedTrainingConfig()
        if not isinstance(config, DistributedTrainingConfig):
            raise TypeError(f"fit: config must be a DistributedTrainingConfig, got {type(config).__name__}")
        return train, val, config

    @staticmethod
    def _split_validation(train: Any, val: Any, config: "DistributedTrainingConfig") -> Tuple[Any, Any]:
        """config.validation_split, where no validation data was given: the same rows for arrays and Datasets."""
        if val is not None or config.validation_split <= 0:
            return train, val
        if isinstance(train, Dataset):
            rows = _split(_dataset_size(train, "fit"), config.validation_split, config.seed)
            return (train, None) if rows is None else (Subset(train, rows[0]), Subset(train, rows[1]))
        X, y = train
        rows = _split(X.shape[0], config.validation_split, config.seed)  # the same on every rank
        if rows is None:
            return train, None
        tr, va = rows
        return (np.ascontiguousarray(X[tr]), np.ascontiguousarray(y[tr])), (X[va], y[va])

    def _auto_resumes(self, config: DistributedTrainingConfig, cbs: List[_callbacks.Callback]) -> bool:
        """Note [Restarts] in pycyxwiz/launch.py: only a trainer's first fit looks for a checkpoint (a
        later fit continues what this process trained), and only where fit writes checkpoints."""
        writes = config.checkpoint_every_n_epochs > 0 or bool(self._last_checkpoints(cbs))
        on = config.auto_resume if config.auto_resume is not None else writes
        return bool(on) and not self._resume_pending and self._steps == 0 and self._epochs_done() == 0

    @staticmethod
    def _last_checkpoints(cbs: List[_callbacks.Callback]) -> List[str]:
        """The last.ckpt files that ModelCheckpoint callbacks write (auto_resume looks at them too)."""
        return [cb.last_ckpt for cb in cbs if isinstance(cb, _callbacks.ModelCheckpoint) and cb.save_last]

    def _resume_newest(self, directory: Optional[str], cbs: List[_callbacks.Callback]) -> Optional[str]:
        """Collective: restores the newest checkpoint that loads cleanly, as rank 0 finds it (each file read and
        checked once), and returns its path; None if there is none. The candidates are the epoch_NNNN.ckpt files
        in `directory` and the callbacks' last.ckpt files, newest epoch first. A damaged one is skipped with a
        warning naming what is wrong."""
        path, data = "", b""
        if self.is_master():
            try:
                names = [n for n in os.listdir(directory) if _CKPT_NAME.fullmatch(n)] if directory else []
            except OSError:
                names = []
            candidates: List[Tuple[int, str, Optional[bytes]]] = [
                (int(n[6:-5]), os.path.join(directory, n), None) for n in names]
            for last in self._last_checkpoints(cbs):
                if not os.path.exists(last):
                    continue
                try:
                    with open(last, "rb") as f:
                        raw = f.read()
                    meta = _ckpt_contents.meta_of(_ckpt_file.unpack(raw, last))
                    candidates.append((int(meta["epoch"]), last, raw))
                except (OSError, KeyError, ValueError) as e:
                    warnings.warn(f"auto_resume: skipping {last}: {e}", RuntimeWarning, stacklevel=3)
            for _, candidate, raw in sorted(candidates, key=lambda c: c[0], reverse=True):
                try:
                    if raw is None:
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

    def _from_master(self, data: bytes, err: str = "", others_err: str = "", root: int = 0) -> bytes:
        """Collective: rank 0's (or root's) `data` on every rank. If that rank failed to produce it (`err`), every
        rank raises OSError: that one with `err`, the others with `others_err`."""
        if self.get_world_size() == 1:
            if err:
                raise OSError(err)
            return data
        head = np.array([-1 if err else len(data)], np.int64)
        self._core.broadcast_host(head, root)
        if head[0] < 0:
            raise OSError(err or others_err)
        mine = self.get_rank() == root
        buf = np.frombuffer(data, np.uint8).copy() if mine else np.empty(int(head[0]), np.uint8)
        if buf.size:
            self._core.broadcast_host(buf, root)
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

    # Note [Gathering from a map]
    # An NpyDataset of one shard with float32 X and int64/int32 (or float32) y is, once mapped, two arrays
    # like fit(X, y)'s: the C++ step gathers its rows from the map as it does from arrays in memory (the
    # same copy, the same bits), with no Python per batch. What a Dataset adds is only reading: rows not in
    # the page cache fault in on the step's thread. So a background thread (Prefaulter) reads one float of
    # every page of the next batches' rows, up to 4 batches ahead; the step never waits for it (where it
    # has fallen behind, the step faults the page in itself). Other Datasets (and NpyDatasets of several
    # shards or other dtypes) go through the copying loader (cx.data._loader.Prefetcher), whose thread
    # costs CPU per batch (about 80 us of a 1 ms step measured with one rank here). benchmarks/train_extras.py
    # measures both against arrays.
    def _steps_of(self, train: Any, batches: DistributedBatchIterator, drop_last: bool):
        """One optimizer step per batch left in the epoch, yielding this rank's (loss_sum, correct, count)."""
        if not isinstance(train, Dataset):
            X, y = train
            while batches.has_next():
                yield self._core.train_batch(X, y, batches)
            return
        maps = train._arrays() if isinstance(train, _NpyDataset) else None
        if maps is not None:  # Note [Gathering from a map]
            X, y = maps
            with Prefaulter(X, self._plan(batches, drop_last)) as ahead:
                while batches.has_next():
                    stats = self._core.train_batch(X, y, batches)
                    ahead.advance()
                    yield stats
            return
        with Prefetcher(lambda idx: _dataset_batch(train, idx, "fit"), self._plan(batches, drop_last)) as loaded:
            for Xb, yb in loaded:
                yield self._core.train_rows(Xb, yb)

    def _rows_of(self, done: int, batches: DistributedBatchIterator, drop_last: bool) -> str:
        """This rank's sample rows of batch `done` (from 0 in the epoch), as a message shows them."""
        at = DistributedBatchIterator(batches.sampler, batches.batch_size, drop_last=drop_last)
        at.set_position(done)
        rows = np.sort(self._core.next_indices(at))
        return ", ".join(str(int(i)) for i in rows[:20]) + (f", ... ({rows.size} rows)" if rows.size > 20 else "")

    @contextlib.contextmanager
    def _naming_batch(self, where, batches: DistributedBatchIterator, drop_last: bool):
        """A NonFiniteError from a step (DDP's check, anomaly mode) gets the epoch, the batch and this rank's rows
        (where() gives (epoch, batch index from 0) of the step running)."""
        try:
            yield
        except NonFiniteError as e:
            if getattr(e, "_named", False):
                raise
            epoch, done = where()
            raise NonFiniteError(f"{e} [fit: epoch {epoch + 1}, batch {done + 1}; its sample rows (indices into the "
                                 f"training data) on this rank: [{self._rows_of(done, batches, drop_last)}]]") \
                from None

    def _raise_nonfinite(self, loss_sum: float, epoch: int, done: int, batches: DistributedBatchIterator,
                         drop_last: bool) -> NoReturn:
        """The step of batch `done` (from 0 in the epoch) had a loss that is not finite: name it, with its rows."""
        err = NonFiniteError(self._nonfinite_text(loss_sum, epoch, done, batches, drop_last))
        err._named = True  # _naming_batch leaves it as it is
        raise err

    def _nonfinite_loss(self, loss_sum: float, skipped: int, epoch: int, done: int,
                        batches: DistributedBatchIterator, drop_last: bool) -> Tuple[float, float, float, int]:
        """A step whose loss was not finite: left out of the epoch's figures where the step was skipped
        (nonfinite = "skip") or warned of ("warn"), else NonFiniteError naming the batch. (loss, correct, count,
        skipped steps so far)."""
        if self.ddp.skipped_steps != skipped:  # nonfinite = "skip": not taken, not counted
            return 0.0, 0.0, 0.0, self.ddp.skipped_steps
        if self.ddp.nonfinite == "warn":
            # stacklevel: this, _fit_epochs, _train, fit, and the caller of fit
            warnings.warn(self._nonfinite_text(loss_sum, epoch, done, batches, drop_last), RuntimeWarning,
                          stacklevel=5)
            return 0.0, 0.0, 0.0, skipped
        self._raise_nonfinite(loss_sum, epoch, done, batches, drop_last)

    def _nonfinite_text(self, loss_sum: float, epoch: int, done: int, batches: DistributedBatchIterator,
                        drop_last: bool) -> str:
        shown = self._rows_of(done, batches, drop_last)
        return (
            f"rank {self.get_rank()}: the loss of epoch {epoch + 1}, batch {done + 1} was {loss_sum} (not finite); "
            f"its sample rows (indices into the training data) on this rank: [{shown}]. Look for a NaN or inf in "
            "those rows, or lower the learning rate if the model diverged (the step was taken: restore a "
            "checkpoint before going on)")

    def _plan(self, batches: DistributedBatchIterator, drop_last: bool) -> List[np.ndarray]:
        """The index arrays of the epoch's batches from `batches`' position on, read from a second iterator over
        the same sampler (so `batches` itself is left where it is)."""
        ahead = DistributedBatchIterator(batches.sampler, batches.batch_size, drop_last=drop_last)
        ahead.set_position(batches.position())
        return [self._core.next_indices(ahead) for _ in range(ahead.position(), ahead.num_batches())]

    def _fit_epochs(self, train, val, config, batches, history, out, world, cbs) -> None:
        log_every = max(int(config.log_every_n_batches), 0)
        start = time.perf_counter()
        end = self._fit_start + config.epochs
        self.model.zero_grad()
        on_batch = [cb for cb in cbs if _callbacks._overrides(cb, "on_batch_end")]
        batch_metrics = any(cb.batch_metrics for cb in on_batch)
        for epoch in range(self._epoch, end):
            batches.reset(epoch)
            if self._position:
                batches.set_position(self._position)
            ls, cs, ns = self._partial
            self._epoch = epoch
            for cb in cbs:
                _callbacks._call(cb, "on_epoch_begin", self, epoch + 1)
            t0 = time.perf_counter()
            total = batches.num_batches()
            done = batches.position()
            lr = self.optimizer.lr
            with contextlib.closing(self._steps_of(train, batches, config.drop_last)) as steps, \
                    self._naming_batch(lambda: (epoch, done), batches, config.drop_last):
                skipped = self.ddp.skipped_steps
                for bl, bc, bn in steps:
                    if not math.isfinite(bl):  # one float per step: free next to the step itself
                        bl, bc, bn, skipped = self._nonfinite_loss(bl, skipped, epoch, done, batches,
                                                                   config.drop_last)
                    ls, cs, ns = ls + bl, cs + bc, ns + bn
                    if cbs:
                        lr = self.optimizer.lr  # this step's, before a per-step scheduler moves it
                    self._after_step(config, world)
                    done += 1
                    self._position = done
                    self._partial = (ls, cs, ns)
                    if on_batch:
                        logs = {"epoch": epoch + 1, "batch": done, "step": self._steps, "lr": lr}
                        if batch_metrics:
                            gl, gc, gn = self._core.reduce_stats(ls, cs, ns)
                            logs["loss"], logs["accuracy"] = gl / gn, gc / gn
                        for cb in on_batch:
                            _callbacks._call(cb, "on_batch_end", self, self._steps, logs)
                    if log_every and (done % log_every == 0 or done == total):
                        dt = max(time.perf_counter() - t0, 1e-9)
                        out.update(epoch + 1, end, done, total, ls / max(ns, 1), cs / max(ns, 1), ns * world / dt)
            # Every rank's BatchNorm statistics become rank 0's, so evaluation, checkpoints and the model after fit
            # agree (DDPConfig.broadcast_buffers; Note [Buffers across ranks] in csrc/train/ddp.h).
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
            logs = self._record_epoch(epoch, end, (g_loss, g_correct, g_count), epoch_time, val, config, history,
                                      out, cbs)
            self._epoch, self._position, self._partial = epoch + 1, 0, (0.0, 0.0, 0.0)
            history.epochs_completed = epoch + 1
            if cbs:
                slowest = self._slowest(epoch_time)
                logs.update(lr=lr, samples_per_second=g_count / max(slowest, 1e-9), epoch_time=slowest)
                for cb in cbs:
                    _callbacks._call(cb, "on_epoch_end", self, epoch + 1, logs)
                self._agree_on_stop(history, epoch + 1)
                if self.stop_training:
                    out.line(f"stopped after epoch {epoch + 1}: {self.stop_reason}")
            if config.checkpoint_every_n_epochs and (epoch + 1) % config.checkpoint_every_n_epochs == 0:
                path = os.path.join(config.checkpoint_dir, f"epoch_{epoch + 1:04d}.ckpt")
                self.save_checkpoint(path)
                out.line(f"saved checkpoint {path}")
            if self.stop_training:
                break
        history.total_time_seconds += time.perf_counter() - start
        history.samples_per_second = history.total_samples / max(history.train_time_seconds, 1e-9)

    def _record_epoch(self, epoch: int, end: int, stats: Tuple[float, float, float], epoch_time: float, val: Any,
                      config: DistributedTrainingConfig, history: DistributedTrainingHistory, out: "_Progress",
                      cbs: List[_callbacks.Callback]) -> dict:
        """An epoch's global figures into history and the progress line (validated first, with the EMA's weights
        where an EMA(evaluate=True) asks): the epoch's logs."""
        g_loss, g_correct, g_count = stats
        history.train_time_seconds += epoch_time
        history.total_samples += g_count
        # Every step left out (nonfinite "skip" or "warn" on a diverged model): no figure to average, NaN.
        loss, acc = (g_loss / g_count, g_correct / g_count) if g_count else (math.nan, math.nan)
        history.train_losses.append(loss)
        history.train_accuracies.append(acc)
        history.epochs.append(epoch + 1)
        logs = {"epoch": epoch + 1, "loss": loss, "accuracy": acc}
        msg = f"Epoch {epoch + 1}/{end} - loss {loss:.4f} - acc {acc:.4f}"
        if val is not None:
            with contextlib.ExitStack() as weights:  # EMA(evaluate=True): the averaged weights
                for cb in cbs:
                    if isinstance(cb, _callbacks.EMA):
                        weights.enter_context(cb._evaluation(self))
                vl, va = self._evaluate(val, max(config.batch_size, 256), "fit")
            history.val_losses.append(vl)
            history.val_accuracies.append(va)
            logs["val_loss"], logs["val_accuracy"] = vl, va
            msg += f" - val_loss {vl:.4f} - val_acc {va:.4f}"
        msg += f" - {g_count / max(epoch_time, 1e-9):,.0f} samples/s - {epoch_time:.3f}s"
        out.line(msg)
        return logs

    def _slowest(self, seconds: float) -> float:
        """Collective: the largest of every rank's `seconds` (so the epoch logs are the same everywhere)."""
        world = self.get_world_size()
        if world == 1:
            return seconds
        times = np.empty(world, np.float64)
        self._core.all_gather_host(times, np.array([seconds], np.float64))
        return float(times.max())

    def _agree_on_stop(self, history: DistributedTrainingHistory, epoch: int) -> None:
        """Collective: if a callback set stop_training on any rank, every rank stops after this epoch, with the
        reason of the lowest such rank."""
        mine = (self.stop_reason or f"a callback set trainer.stop_training on rank {self.get_rank()}") \
            if self.stop_training else ""
        root, reason = self._first_report(mine)
        if root < 0:
            return
        self.stop_training, self.stop_reason = True, reason
        history.stopped_early, history.stop_reason, history.stopped_epoch = True, reason, epoch

    def _first_report(self, text: str) -> Tuple[int, str]:
        """Collective: (rank, text) of the lowest rank whose `text` is not empty, or (-1, "") if none has one:
        one all-gather of a byte per rank, and a broadcast of the text where there is one."""
        world = self.get_world_size()
        if world == 1:
            return (0, text) if text else (-1, "")
        flags = np.empty(world, np.uint8)
        self._core.all_gather_host(flags, np.array([bool(text)], np.uint8))
        who = np.flatnonzero(flags)
        if not who.size:
            return -1, ""
        root = int(who[0])
        return root, self._from_master(text.encode() if self.get_rank() == root else b"", root=root).decode()

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
        if c.nonfinite is not None and c.nonfinite not in ("raise", "skip", "warn", "off"):
            raise ValueError(f"DistributedTrainingConfig.nonfinite must be 'raise', 'skip', 'warn', 'off' or None "
                             f"(the DDPConfig's), got {c.nonfinite!r}")
        if c.matmul_precision not in ("float32", "tf32", "bf16"):
            raise ValueError(f"DistributedTrainingConfig.matmul_precision must be 'float32', 'tf32' or 'bf16', got "
                             f"{c.matmul_precision!r}")
        if not isinstance(c.detect_anomaly, bool):
            raise ValueError(f"DistributedTrainingConfig.detect_anomaly must be True or False, got "
                             f"{c.detect_anomaly!r}")
        if c.on_divergence not in ("warn", "raise"):
            raise ValueError(f"DistributedTrainingConfig.on_divergence must be 'warn' or 'raise', got "
                             f"{c.on_divergence!r}")
        for name in ("grad_clip_norm", "grad_clip_value"):
            v = getattr(c, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                  or v <= 0):
                raise ValueError(f"DistributedTrainingConfig.{name} must be a finite number > 0 (None: no "
                                 f"clipping), got {v!r}")

    def evaluate(self, X, y=None, batch_size: int = 256) -> Tuple[float, float]:
        """Collective: (mean loss, accuracy) over all of (X, y), or of a cx.data.Dataset; each rank evaluates a
        shard.

            loss, accuracy = trainer.evaluate(X_test, y_test)
            loss, accuracy = trainer.evaluate(cx.data.NpyDataset("x_test.npy", "y_test.npy"))
        """
        if isinstance(X, Dataset):
            if y is not None:
                raise TypeError("evaluate(dataset) takes no y: the Dataset gives the targets (batch_size= is a "
                                "keyword)")
        elif y is None:
            raise TypeError("evaluate() takes (X, y) arrays or a cx.data.Dataset")
        else:
            X, y = _as_data(X, y, "evaluate")
        if not isinstance(batch_size, (int, np.integer)) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"evaluate: batch_size must be an int >= 1, got {batch_size!r}")
        if not self._in_fit:
            self._core.sync_from_host()  # the model as the host holds it (GPU training)
        return self._evaluate(X if y is None else (X, y), batch_size, "evaluate")

    def _evaluate(self, data: Any, batch_size: int, who: str) -> Tuple[float, float]:
        """Collective: (mean loss, accuracy) of (X, y) arrays or a Dataset. Rank r of p evaluates rows
        [n*r/p, n*(r+1)/p) in chunks of batch_size (as TrainerCore::evaluate_all does for arrays, so both give
        the same numbers)."""
        if not isinstance(data, Dataset):
            X, y = data
            if X.shape[0] == 0:
                raise ValueError(f"{who}: the data set is empty")
            ls, cs, ns = self._core.evaluate(X, y, batch_size)
            return ls / ns, cs / ns
        n = _dataset_size(data, who)
        if n == 0:
            raise ValueError(f"{who}: the data set is empty")
        ls, cs, ns = _pg.abort_on_error(self._evaluate_shard)(data, n, batch_size, who)
        return ls / ns, cs / ns

    def _evaluate_shard(self, ds: Dataset, n: int, batch_size: int, who: str) -> Tuple[float, float, float]:
        """Collective: the global sums over a Dataset. A rank whose Dataset raises tells the others (abort_on_error),
        which would otherwise wait for it in the all-reduce."""
        p, r = self.get_world_size(), self.get_rank()
        begin, end = n * r // p, n * (r + 1) // p
        plan = [np.arange(b, min(b + batch_size, end), dtype=np.int64) for b in range(begin, end, batch_size)]
        ls = cs = ns = 0.0
        with Prefetcher(lambda idx: _dataset_batch(ds, idx, who), plan) as loaded:
            for Xb, yb in loaded:
                bl, bc, bn = self._core.evaluate_rows(Xb, yb, batch_size)
                ls, cs, ns = ls + bl, cs + bc, ns + bn
        return self._core.reduce_stats(ls, cs, ns)

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
        return _ckpt_file.pack(self._checkpoint_members())

    def _checkpoint_members(self, reuse: Optional[dict] = None) -> dict:
        """A checkpoint's members, each array the trainer's own copy (a background writer may pack them while
        training goes on). `reuse`: the members of a checkpoint written already, whose optimizer and callback
        arrays are overwritten where they fit, instead of new ones (Note [Checkpoints written in the
        background])."""
        reuse = reuse or {}
        # The whole state: gathered (collective) under ZeRO-1.
        sd = self._core.optimizer_state_dict({k[4:]: v for k, v in reuse.items() if k.startswith("opt.")})
        scalars = {k: v for k, v in sd.items() if not isinstance(v, np.ndarray)}
        arrays = {f"opt.{k}": v for k, v in sd.items() if isinstance(v, np.ndarray)}
        arrays["rng.modules"] = self._rng_rows()
        hook_arrays, hook_meta = self._hook_arrays()
        arrays.update(hook_arrays)
        cb_meta, cb_arrays = _callbacks._states(self._callbacks, reuse)
        arrays.update(cb_arrays)
        sampler = getattr(self, "_fit_sampler", None)
        meta = {
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
            "callbacks": cb_meta,
        }
        return _ckpt_contents.members(meta, _d._model_to_bytes(self.model), arrays)

    def save_checkpoint(self, path: str) -> Optional[str]:
        """Writes model, optimizer state, epoch, sampler position and history to `path`, atomically.

            trainer.save_checkpoint("model.ckpt")

        Not collective, except with config.shard_optimizer_state (ZeRO-1): then every rank must
        call it (as fit does), since each holds a shard of the optimizer state and the file holds
        it whole. With config.save_on_master_only (the default) only rank 0 writes; otherwise
        rank r > 0 writes `path` + ".rank<r>". Returns the path written, or None.
        """
        return self._save_checkpoints([path])[0]

    def _save_checkpoints(self, paths: List[Any], background: bool = False) -> List[Optional[str]]:
        """save_checkpoint to each of `paths`, the checkpoint made once (ModelCheckpoint's best and last).
        `background`: Note [Checkpoints written in the background]."""
        paths = [os.fspath(p) for p in paths]
        self._saved_in_background |= background  # every rank, writing or not: fit's end waits for the writers
        sharded = self._core.shard_optimizer_state
        if sharded:
            members = self._checkpoint_members()  # collective: gathers the optimizer state's shards
        if self.config.save_on_master_only and not self.is_master():
            return [None] * len(paths)
        if not self.is_master():
            paths = [f"{p}.rank{self.get_rank()}" for p in paths]
        if background:
            self._finish_writes()  # the save before is written: its arrays are free to reuse
        if not sharded:
            self._core.sync_to_host()
            members = self._checkpoint_members(self._spare if background else None)
        if background:
            if self._writer is None:
                self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cx-checkpoint")
            self._writing = self._writer.submit(_write_checkpoint, members, paths)
            # Not touched before _finish_writes says the writer is done with them (sharded: the gather made
            # the members before the writer was waited for, so none are reused).
            self._spare = {} if sharded else members
        else:
            _write_checkpoint(members, paths)
        return list(paths)

    # Note [Checkpoints written in the background]
    # ModelCheckpoint saves after every epoch: 3.3 MB for the MLP benchmark with Adam and an EMA, against epochs
    # of 0.15 s of CPU there. So its saves copy the state out on the trainer's thread (the members are the
    # trainer's own copies, made as for any save, collectively under ZeRO-1) and leave packing and writing to one
    # writer thread: one SHA-256 and zipfile's CRC-32 over the bytes (checkpoint format 3: Note [Checkpoints you
    # can trust] in _ckpt_file.py), the write, with no copy in Python (Note [Packing without copies]), and one
    # file for best.ckpt and last.ckpt when both are due (Note [One file for best.ckpt and last.ckpt]). The
    # writer holds the GIL only for zipfile's bookkeeping: hashing, CRC and writev release it. At most one save
    # is in flight: the next waits for it, and so does the end of fit, which raises its error (fit returns with
    # the files complete, so a fit pays its last save's write and fsync). The files stay atomic (temporary name,
    # fsync, rename).
    # The trainer's part was 6 ms of CPU per save for 3.3 MB whose copies take 0.4 ms: most of it went to page
    # faults, every save's arrays being fresh memory (the allocator gives freed megabytes back to the system).
    # So the optimizer's and the callbacks' arrays are copied into those of the save before, once written (the
    # trainer keeps them between saves of a fit: one checkpoint's worth of memory), and the optimizer state
    # and the model's bytes are handed from C++ to Python without another copy. What remains is mostly the
    # .cyxmodel's FNV-1a checksum (a byte at a time, 0.8 MB: about 0.7 ms).
    def _finish_writes(self, raise_error: bool = True) -> None:
        """Waits for the checkpoint being written in the background, if any; raises its error."""
        pending, self._writing = self._writing, None
        if pending is None:
            return
        try:
            pending.result()
        except Exception:
            if raise_error:
                raise

    def _close_writer(self, raise_error: bool = True) -> None:
        try:
            self._finish_writes(raise_error)
        finally:
            self._spare = {}
            writer, self._writer = self._writer, None
            if writer is not None:
                writer.shutdown(wait=True)

    def _end_background_saves(self) -> None:
        """Collective, at the end of a fit that saved in the background: every rank returns once the files are
        complete, and every rank raises OSError if a writer failed, naming the rank."""
        error = ""
        try:
            self._close_writer()
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        if not self._saved_in_background:
            return
        self._saved_in_background = False
        root, error = self._first_report(error)
        if root >= 0:
            raise OSError(f"fit: rank {root} could not write a checkpoint: {error}")

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
        c = _ckpt_contents.read(data, path)
        meta = c.meta
        _d._model_load_bytes(self.model, c.model, path)
        sd = dict(meta["optimizer"])
        sd.update(c.optimizer)
        if sd.get("type") != self.optimizer.state_dict().get("type"):
            raise ValueError(f"load_checkpoint: {path!r} holds {sd.get('type')} optimizer state but the trainer's "
                             f"optimizer is {self.optimizer!r}")
        self._core.load_optimizer_state_dict(sd)  # under ZeRO-1 each rank keeps its shard
        if c.rng_rows is not None:
            self._restore_rng(c.rng_rows, meta, path)
        self._restore_hook(c.hook, meta, path)
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
        # The next fit hands these to its callbacks (files written before callbacks existed have none).
        self._loaded_callback_states = (meta.get("callbacks") or {}, c.callbacks)
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
