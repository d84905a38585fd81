"""cx.callbacks: hooks into DistributedTrainer.fit, and the ones users of Keras or Lightning expect.

    cb = [cx.callbacks.EarlyStopping(monitor="val_loss", patience=3),
          cx.callbacks.ModelCheckpoint("ckpt"), cx.callbacks.EMA(0.999), cx.callbacks.CSVLogger("log.csv")]
    history = trainer.fit(X, y, X_val, y_val, config, callbacks=cb)

A callback is an object whose methods fit calls (every rank calls them, with the same arguments):

    on_train_begin(trainer)             after a resume, before the first epoch this fit trains
    on_epoch_begin(trainer, epoch)      epoch counts from 1 across fits, as history.epochs
    on_batch_end(trainer, step, logs)   after every optimizer step; step counts them across fits
    on_epoch_end(trainer, epoch, logs)  logs: the epoch's global metrics (below)
    on_train_end(trainer)               after the last epoch, also when one stopped the run early

Epoch logs hold `epoch`, `loss` and `accuracy` (the epoch's training means over all ranks' samples),
`val_loss` and `val_accuracy` (with validation data), `lr` (the learning rate of the epoch's last
step), `samples_per_second` (all ranks' samples over the slowest rank's time) and `epoch_time`
(seconds): the same numbers on every rank. Batch logs hold `epoch`, `batch` (from 1 in the epoch),
`step` and `lr`, and, where a callback that overrides on_batch_end keeps `batch_metrics = True` (the
default), `loss` and `accuracy`: the epoch's running means over all ranks, which cost one all-reduce
of three float64s per step (the built-in callbacks do not ask for them).

A callback that raises fails fit on every rank: its own with the exception's type and a message that
names the callback and the hook, the others with DistributedConnectionError "rank R failed: ...".
Setting ``trainer.stop_training = True`` (and ``trainer.stop_reason``) in any hook ends fit after the
current epoch; ranks agree on it at every epoch's end, so all stop after the same epoch.
ModelCheckpoint callbacks run after the others in each hook (as in Lightning), so the checkpoints they
write hold every other callback's state of that epoch. A callback's state (state_dict /
load_state_dict) is saved in the trainer's checkpoints and restored when fit resumes from one.
"""
from __future__ import annotations

import contextlib
import csv
import json
import math
import os
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

__all__ = ["Callback", "EarlyStopping", "ModelCheckpoint", "EMA", "CSVLogger"]

_MODES = ("auto", "min", "max")


class Callback:
    """Base class of fit's callbacks: override the hooks you need (every one does nothing here).

        class PrintLoss(cx.callbacks.Callback):
            def on_epoch_end(self, trainer, epoch, logs): print(epoch, logs["loss"])

    `batch_metrics`: whether on_batch_end reads logs["loss"] / logs["accuracy"]; set it False in a
    callback that overrides on_batch_end without reading them, to save their all-reduce.
    state_dict() / load_state_dict(): what a checkpoint keeps of the callback (numbers, strings, lists,
    dicts and NumPy arrays), restored when fit resumes from that checkpoint.
    """

    batch_metrics: bool = True

    def on_train_begin(self, trainer: Any) -> None:
        pass

    def on_epoch_begin(self, trainer: Any, epoch: int) -> None:
        pass

    def on_batch_end(self, trainer: Any, step: int, logs: Dict[str, Any]) -> None:
        pass

    def on_epoch_end(self, trainer: Any, epoch: int, logs: Dict[str, Any]) -> None:
        pass

    def on_train_end(self, trainer: Any) -> None:
        pass

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


# The epoch log keys that are neither a loss nor an accuracy: mode "auto" cannot tell which way is better.
_UNDIRECTED = ("epoch", "lr", "samples_per_second", "epoch_time")


def _check_mode(who: str, mode: Any, monitor: str) -> str:
    """"min" or "max": the mode given, or for "auto" (Keras's default) the one the monitor's name says: a loss goes
    down, an accuracy up. Still "auto" for a key fit does not log (a callback's own, or a typo): the first epoch's
    logs say which (_Best.improves asks for the mode then, rather than guess)."""
    if mode not in _MODES:
        raise ValueError(f"{who}: mode must be 'auto', 'min' or 'max', got {mode!r}")
    if mode != "auto":
        return mode
    if monitor.endswith("loss"):
        return "min"
    if monitor.endswith(("accuracy", "acc")):
        return "max"
    if monitor in _UNDIRECTED:
        raise _undirected(who, monitor)
    return mode


def _undirected(who: str, monitor: str) -> ValueError:
    return ValueError(f"{who}: mode='auto' cannot tell whether {monitor!r} should fall or rise (it knows *loss and "
                      f"*accuracy); pass mode='min' or mode='max'")


def _check_monitor(who: str, monitor: Any) -> str:
    if not isinstance(monitor, str) or not monitor:
        raise TypeError(f"{who}: monitor must be the name of an epoch log key (e.g. 'val_loss'), got {monitor!r}")
    return monitor


def _monitored(monitor: str, logs: Dict[str, Any]) -> float:
    """logs[monitor] as a float, or ValueError naming the keys there are."""
    if monitor not in logs:
        hint = (" (val_ keys need validation data: fit(X, y, X_val, y_val, config) or config.validation_split)"
                if monitor.startswith("val_") else "")
        raise ValueError(f"monitor {monitor!r} is not in the epoch logs, which hold {sorted(logs)}{hint}")
    return float(logs[monitor])


def _check_monitor_at_start(monitor: str, trainer: Any) -> None:
    """A val_ key the trainer will never log (no validation data): said before the first epoch, not after it."""
    keys = getattr(trainer, "_epoch_log_keys", None)
    if keys is not None and monitor in ("val_loss", "val_accuracy") and monitor not in keys:
        _monitored(monitor, dict.fromkeys(keys))


class _Best:
    """Whether a score improves on the best so far, for a mode and a min_delta."""

    def __init__(self, who: str, monitor: str, mode: str, min_delta: float = 0.0) -> None:
        self.who, self.monitor, self.mode, self.min_delta = who, monitor, mode, min_delta

    def improves(self, score: float, best: Optional[float]) -> bool:
        if self.mode == "auto":  # a key of the logs that is neither a loss nor an accuracy (_check_mode)
            raise _undirected(self.who, self.monitor)
        if math.isnan(score):
            return False
        if best is None:
            return True
        return score < best - self.min_delta if self.mode == "min" else score > best + self.min_delta


class EarlyStopping(Callback):
    """Stops fit when `monitor` has not improved (by more than min_delta) for `patience` epochs in a row.

        stop = cx.callbacks.EarlyStopping(monitor="val_loss", patience=3)
        history = trainer.fit(X, y, X_val, y_val, config, callbacks=[stop])   # history.stopped_early

    As in Keras and Lightning: with patience=3 and the best score at epoch 1, fit stops after epoch 4;
    patience 0 and 1 both stop at the first epoch that does not improve. mode="auto" (the default)
    minimises a *loss and maximises an *accuracy; any other key needs mode="min" or "max".
    Every rank sees the same logs, so every rank stops after the same epoch; history.stop_reason
    says why. A NaN score counts as no improvement. Its counters are saved in checkpoints, so a
    resumed run stops where the uninterrupted one would.
    """

    batch_metrics = False

    def __init__(self, monitor: str = "val_loss", patience: int = 0, min_delta: float = 0.0,
                 mode: str = "auto") -> None:
        self.monitor = _check_monitor("EarlyStopping", monitor)
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise ValueError(f"EarlyStopping: patience must be an int >= 0 (epochs without improvement), got "
                             f"{patience!r}")
        if not isinstance(min_delta, (int, float)) or not math.isfinite(min_delta) or min_delta < 0:
            raise ValueError(f"EarlyStopping: min_delta must be a finite number >= 0, got {min_delta!r}")
        self.patience = patience
        self.min_delta = float(min_delta)
        self.mode = _check_mode("EarlyStopping", mode, self.monitor)
        self._best = _Best("EarlyStopping", self.monitor, self.mode, self.min_delta)
        self.best_score: Optional[float] = None
        self.best_epoch = 0
        self.wait = 0
        self.stopped_epoch = 0

    def on_train_begin(self, trainer: Any) -> None:
        _check_monitor_at_start(self.monitor, trainer)

    def on_epoch_end(self, trainer: Any, epoch: int, logs: Dict[str, Any]) -> None:
        score = _monitored(self.monitor, logs)
        if self._best.improves(score, self.best_score):
            self.best_score, self.best_epoch, self.wait = score, epoch, 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            self.stopped_epoch = epoch
            trainer.stop_training = True
            best = "none yet (every score was NaN)" if self.best_score is None else \
                f"{self.best_score:.6g} at epoch {self.best_epoch}"
            trainer.stop_reason = (f"EarlyStopping: {self.monitor} did not improve (mode {self.mode!r}, min_delta "
                                   f"{self.min_delta:g}) for {self.wait} epoch{'s' if self.wait > 1 else ''}; the best was {best}")

    def state_dict(self) -> Dict[str, Any]:
        return {"monitor": self.monitor, "mode": self.mode, "best_score": self.best_score,
                "best_epoch": self.best_epoch, "wait": self.wait, "stopped_epoch": self.stopped_epoch}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("monitor") != self.monitor or state.get("mode") != self.mode:
            return  # it watched something else: start counting afresh
        self.best_score = state["best_score"]
        self.best_epoch, self.wait = int(state["best_epoch"]), int(state["wait"])
        self.stopped_epoch = int(state.get("stopped_epoch", 0))

    def __repr__(self) -> str:
        return (f"EarlyStopping(monitor={self.monitor!r}, patience={self.patience}, min_delta={self.min_delta}, "
                f"mode={self.mode!r}, best_score={self.best_score}, wait={self.wait})")


class ModelCheckpoint(Callback):
    """Writes `dirpath`/best.ckpt whenever `monitor` improves and `dirpath`/last.ckpt after every epoch.

        ckpt = cx.callbacks.ModelCheckpoint("checkpoints", monitor="val_loss", mode="min")
        trainer.fit(X, y, X_val, y_val, config, callbacks=[ckpt]); trainer.load_checkpoint(ckpt.best_path)

    Both are trainer checkpoints (trainer.load_checkpoint reads them; written atomically, by rank 0
    unless config.save_on_master_only is False, packed and written on a background thread: complete
    by the next epoch's save and when fit returns; an epoch that writes both writes the file once, and
    best.ckpt and last.ckpt are two names of it until last.ckpt is next replaced). With save_last,
    fit's auto_resume (on by default where fit writes checkpoints) resumes from last.ckpt when it is
    the newest checkpoint, and the best score so far is part of every checkpoint, so a restarted job
    keeps comparing against it.
    Runs after the other callbacks, so its files hold their state of the same epoch. mode="auto" (the
    default) minimises a *loss and maximises an *accuracy; any other key needs mode="min" or "max".
    """

    batch_metrics = False
    BEST = "best.ckpt"
    LAST = "last.ckpt"

    def __init__(self, dirpath: Any, monitor: str = "val_loss", mode: str = "auto", save_best: bool = True,
                 save_last: bool = True) -> None:
        self.dirpath = os.fspath(dirpath)
        self.monitor = _check_monitor("ModelCheckpoint", monitor)
        if not save_best and not save_last:
            raise ValueError("ModelCheckpoint: save_best and save_last are both False, so it would write nothing")
        # Without save_best nothing is compared: an unknown monitor in auto mode is no reason to refuse.
        self.mode = _check_mode("ModelCheckpoint", mode, self.monitor if save_best else "loss")
        self.save_best, self.save_last = bool(save_best), bool(save_last)
        self._best = _Best("ModelCheckpoint", self.monitor, self.mode)
        self.best_score: Optional[float] = None
        self.best_epoch = 0
        self.best_path: Optional[str] = None
        self.last_path: Optional[str] = None

    @property
    def last_ckpt(self) -> str:
        return os.path.join(self.dirpath, self.LAST)

    def on_train_begin(self, trainer: Any) -> None:
        if self.save_best:
            _check_monitor_at_start(self.monitor, trainer)
        os.makedirs(self.dirpath, exist_ok=True)

    def on_epoch_end(self, trainer: Any, epoch: int, logs: Dict[str, Any]) -> None:
        paths = []
        if self.save_best:
            score = _monitored(self.monitor, logs)
            if self._best.improves(score, self.best_score):
                self.best_score, self.best_epoch = score, epoch
                self.best_path = os.path.join(self.dirpath, self.BEST)
                paths.append(self.best_path)     # the file holds this best score too
        if self.save_last:
            paths.append(self.last_ckpt)
            self.last_path = self.last_ckpt
        if paths:   # one checkpoint made, written to each in the background (fit returns with them complete)
            trainer._save_checkpoints(paths, background=True)

    def state_dict(self) -> Dict[str, Any]:
        return {"monitor": self.monitor, "mode": self.mode, "best_score": self.best_score,
                "best_epoch": self.best_epoch, "best_path": self.best_path}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("monitor") != self.monitor or state.get("mode") != self.mode:
            return
        self.best_score = state["best_score"]
        self.best_epoch = int(state["best_epoch"])
        self.best_path = state["best_path"]

    def __repr__(self) -> str:
        return (f"ModelCheckpoint({self.dirpath!r}, monitor={self.monitor!r}, mode={self.mode!r}, "
                f"best_score={self.best_score}, best_path={self.best_path!r})")


class EMA(Callback):
    """An exponential moving average of the parameters: after every optimizer step,
    ema = decay * ema + (1 - decay) * params, starting from the parameters at the start of fit.

        ema = cx.callbacks.EMA(decay=0.999)
        trainer.fit(X, y, config, callbacks=[ema])
        with ema.average_parameters(model):            # evaluate with the averaged weights
            loss, acc = trainer.evaluate(X_test, y_test)

    The update is one float32 pass over the flat parameters in C++ (exactly NumPy's
    np.float32(decay) * ema + np.float32(1 - decay) * params), made by the trainer's engine where it
    costs least: in the next step, while the gradients are being all-reduced (Note [EMA off the
    critical path] in csrc/train/ema.h); on the GPU trainer, a kernel after every step, the average
    kept on the device (Note [EMA on the GPU] in csrc/train/gpu_engine.cpp). Reading the average
    settles it first. `evaluate=True`: fit's validation (val_loss, val_accuracy, so what
    EarlyStopping and ModelCheckpoint see) uses the averaged weights. The average is saved in the
    trainer's checkpoints and restored on resume (EMA.from_checkpoint(path) reads it from a file).
    """

    batch_metrics = False

    def __init__(self, decay: float = 0.999, evaluate: bool = False) -> None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay < 1.0:
            raise ValueError(f"EMA: decay must be a number in (0, 1), got {decay!r}")
        self.decay = float(decay)
        self.evaluate = bool(evaluate)
        self._shadow: Optional[np.ndarray] = None
        self._restored = False
        self._trainer: Any = None     # the trainer of the fit that updates the average (set at its start)
        self._steps_at_start = 0
        self._updates = 0             # updates before that fit

    @classmethod
    def from_checkpoint(cls, path: Any) -> "EMA":
        """The EMA a trainer checkpoint holds (the first one, if fit had several).

            ema = cx.callbacks.EMA.from_checkpoint("checkpoints/best.ckpt"); ema.apply_to(model)
        """
        from .distributed import _ckpt_file
        path = os.fspath(path)
        with open(path, "rb") as f:
            z = _ckpt_file.unpack(f.read(), path)
        meta = json.loads(z["meta"].tobytes().decode())
        for key, state in (meta.get("callbacks") or {}).items():
            if state.get("class") == "EMA":
                ema = cls(state["decay"])
                ema.load_state_dict(dict(state, shadow=z[f"cb.{key}.shadow"]))
                return ema
        raise ValueError(f"EMA.from_checkpoint: {path!r} holds no EMA state; it was written by a fit without the "
                         f"EMA callback")

    @property
    def updates(self) -> int:
        """Optimizer steps averaged in so far."""
        if self._trainer is None:
            return self._updates
        return self._updates + self._trainer._steps - self._steps_at_start

    def _settled(self) -> np.ndarray:
        if self._shadow is None:
            raise RuntimeError("EMA: no average yet; it starts at the beginning of fit(..., callbacks=[ema])")
        if self._trainer is not None:
            self._trainer._core.settle_ema()
        return self._shadow

    def flat_parameters(self) -> np.ndarray:
        """The averaged parameters, one float32 array in the layout of model.flat_parameters() (a copy)."""
        return self._settled().copy()

    def apply_to(self, model: Any) -> None:
        """Copies the averaged parameters into model (of the architecture trained)."""
        src = self._settled()
        dst = model.flat_parameters()
        if dst.size != src.size:
            raise ValueError(f"EMA.apply_to: the model has {dst.size} parameters but the average holds {src.size}; "
                             f"pass the model that was trained")
        dst[...] = src

    @contextlib.contextmanager
    def average_parameters(self, model: Any) -> Iterator[Any]:
        """Within the block, model holds the averaged parameters; its own come back after it."""
        self._settled()
        dst = model.flat_parameters()
        saved = dst.copy()
        self.apply_to(model)
        try:
            yield model
        finally:
            dst[...] = saved

    def on_train_begin(self, trainer: Any) -> None:
        params = trainer.model.flat_parameters()
        if not (self._restored and self._shadow is not None and self._shadow.size == params.size):
            self._shadow, self._updates = params.copy(), 0   # not resumed from a checkpoint holding the average
        self._restored = False
        self._trainer, self._steps_at_start = trainer, trainer._steps
        trainer._core.add_ema(self._shadow, self.decay)      # the trainer clears it when fit ends

    def _detach(self) -> None:
        """fit has ended (the trainer settled the last update and stopped updating the average)."""
        self._updates, self._trainer = self.updates, None

    def _evaluation(self, trainer: Any) -> Any:
        """What fit evaluates under (evaluate=True: the averaged weights)."""
        if not self.evaluate:
            return contextlib.nullcontext()
        return self._on_the_device(trainer) if trainer.device else self.average_parameters(trainer.model)

    @contextlib.contextmanager
    def _on_the_device(self, trainer: Any) -> Iterator[Any]:
        """average_parameters for the GPU trainer, whose model lives on the device during fit: the host gets the
        device's state, then the averaged weights go to the device for the block, and the trained ones after it."""
        trainer._core.sync_to_host()
        try:
            with self.average_parameters(trainer.model):
                trainer._core.sync_from_host()
                yield trainer.model
        finally:
            trainer._core.sync_from_host()

    def state_dict(self) -> Dict[str, Any]:
        state: Dict[str, Any] = {"decay": self.decay, "updates": self.updates}
        if self._shadow is not None:
            state["shadow"] = self._settled()
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        shadow = state.get("shadow")
        if shadow is None:
            return
        if self._trainer is not None:
            raise RuntimeError("EMA.load_state_dict: not while a fit updates the average")
        self._shadow = np.ascontiguousarray(shadow, dtype=np.float32).copy()
        self._updates = int(state.get("updates", 0))
        self._restored = True

    def __repr__(self) -> str:
        return f"EMA(decay={self.decay}, evaluate={self.evaluate}, updates={self.updates})"


class CSVLogger(Callback):
    """Writes one row per epoch to `path`: every key of the epoch logs (rank 0 writes).

        trainer.fit(X, y, X_val, y_val, config, callbacks=[cx.callbacks.CSVLogger("train_log.csv")])

    The columns are the first epoch's keys, `epoch` first; a row is flushed as soon as it is
    written. A fit that starts from epoch 0 starts a new file; one that continues (a resumed or a
    second fit) keeps the rows of the epochs before its first and appends, so after restarts the
    file still has exactly one row per epoch.
    """

    batch_metrics = False

    def __init__(self, path: Any, separator: str = ",") -> None:
        self.path = os.fspath(path)
        self.separator = separator
        self._keys: Optional[List[str]] = None
        self._master = False

    def on_train_begin(self, trainer: Any) -> None:
        self._master = trainer.is_master()
        self._keys = None
        if not self._master:
            return
        kept: List[List[str]] = []
        start = trainer.epochs_completed
        if start > 0 and os.path.exists(self.path):
            with open(self.path, newline="") as f:
                rows = list(csv.reader(f, delimiter=self.separator))
            if rows and rows[0] and rows[0][0] == "epoch":
                self._keys = rows[0]
                kept = [r for r in rows[1:] if r and r[0].isdigit() and int(r[0]) <= start]
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        with open(self.path, "w", newline="") as f:
            if self._keys is not None:
                csv.writer(f, delimiter=self.separator).writerows([self._keys, *kept])

    def on_epoch_end(self, trainer: Any, epoch: int, logs: Dict[str, Any]) -> None:
        if not self._master:
            return
        row = dict(logs, epoch=epoch)
        with open(self.path, "a", newline="") as f:
            w = csv.writer(f, delimiter=self.separator)
            if self._keys is None:
                self._keys = ["epoch"] + [k for k in row if k != "epoch"]
                w.writerow(self._keys)
            w.writerow([_cell(row.get(k, "")) for k in self._keys])

    def __repr__(self) -> str:
        return f"CSVLogger({self.path!r})"


def _cell(v: Any) -> str:
    return repr(v) if isinstance(v, float) else str(v)


# ---- what fit does with them (DistributedTrainer in distributed/_train.py calls these) -------------------

def _as_list(callbacks: Any) -> List[Callback]:
    """fit's `callbacks` argument as a list, ModelCheckpoints last (their files then hold the others' state)."""
    if callbacks is None:
        return []
    if isinstance(callbacks, Callback):
        callbacks = [callbacks]
    try:
        cbs = list(callbacks)
    except TypeError:
        raise TypeError(f"fit: callbacks must be a list of cx.callbacks.Callback, got {type(callbacks).__name__}") \
            from None
    for cb in cbs:
        if not isinstance(cb, Callback):
            raise TypeError(f"fit: callbacks must be cx.callbacks.Callback instances (subclass it), got "
                            f"{type(cb).__name__}")
    return sorted(cbs, key=lambda cb: isinstance(cb, ModelCheckpoint))


def _keys(cbs: List[Callback]) -> List[str]:
    """Each callback's name in checkpoints: its class name, then _1, _2 ... for repeats."""
    seen: Dict[str, int] = {}
    out = []
    for cb in cbs:
        name = type(cb).__name__
        k = seen.get(name, 0)
        seen[name] = k + 1
        out.append(name if k == 0 else f"{name}_{k}")
    return out


def _states(cbs: List[Callback], reuse: Optional[Dict[str, np.ndarray]] = None
            ) -> Tuple[Dict[str, Any], Dict[str, np.ndarray]]:
    """(meta entry, arrays) of the callbacks' states for a checkpoint. `reuse`: arrays of a checkpoint written
    already, overwritten where name, shape and dtype match instead of new copies."""
    meta: Dict[str, Any] = {}
    arrays: Dict[str, np.ndarray] = {}
    reuse = reuse or {}
    for key, cb in zip(_keys(cbs), cbs):
        state = cb.state_dict()
        if not state:
            continue
        entry: Dict[str, Any] = {"class": type(cb).__name__}
        for name, value in state.items():
            if isinstance(value, np.ndarray):
                # The trainer's own copy: the callback's array may change after the save.
                member = f"cb.{key}.{name}"
                old = reuse.get(member)
                if old is not None and old.shape == value.shape and old.dtype == value.dtype:
                    np.copyto(old, value)
                    arrays[member] = old
                else:
                    arrays[member] = value.copy()
            else:
                entry[name] = value
        try:
            json.dumps(entry)
        except (TypeError, ValueError) as e:
            raise TypeError(f"callback {type(cb).__name__}.state_dict: the checkpoint keeps numbers, strings, lists, "
                            f"dicts and NumPy arrays ({e})") from None
        meta[key] = entry
    return meta, arrays


def _restore(cbs: List[Callback], meta: Dict[str, Any], arrays: Dict[str, np.ndarray]) -> None:
    """Hands each callback its state from a checkpoint (matched by name and class)."""
    for key, cb in zip(_keys(cbs), cbs):
        entry = meta.get(key)
        if not entry or entry.get("class") != type(cb).__name__:
            continue
        state = {k: v for k, v in entry.items() if k != "class"}
        prefix = f"cb.{key}."
        state.update({k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)})
        cb.load_state_dict(state)


def _call(cb: Callback, hook: str, *args: Any) -> None:
    """cb.hook(*args); an exception comes out of the same type, its message naming the callback and hook."""
    try:
        getattr(cb, hook)(*args)
    except Exception as e:
        where = f"callback {type(cb).__name__}.{hook}"
        if str(e).startswith(where):
            raise
        try:
            named = type(e)(f"{where}: {e}")
        except Exception:
            named = RuntimeError(f"{where}: {type(e).__name__}: {e}")
        raise named.with_traceback(e.__traceback__) from e


def _overrides(cb: Callback, hook: str) -> bool:
    return getattr(type(cb), hook) is not getattr(Callback, hook)

