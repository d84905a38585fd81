"""cx.data: data sets the trainer reads a batch at a time, for data that does not fit in memory.

    train = cx.data.NpyDataset("x_train.npy", "y_train.npy")        # memory-mapped, read as needed
    history = trainer.fit(train, config)                              # or fit(train, val, config)
    loss, acc = trainer.evaluate(cx.data.NpyDataset("x_test.npy", "y_test.npy"))

A Dataset has a length and gives the rows of a batch for an array of sample indices:

    class MyData(cx.data.Dataset):
        def __len__(self): return n
        def __getitem__(self, indices): return X_rows, y_rows    # indices: int64 array of the batch

fit reads each batch on a background thread while the previous step runs, in the order of the same
DistributedSampler and batch iterator as for arrays: a Dataset holding arrays (X, y) trains to the
parameters fit(X, y, ...) gives, bit for bit, including resumes (DistributedTrainer checks what
__getitem__ returns: as many rows of X and y as indices, numeric X, integer or float y).
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

__all__ = ["Dataset", "NpyDataset"]

_PathLike = Union[str, "os.PathLike[str]"]


class Dataset:
    """Base class of the data sets fit and evaluate take in place of (X, y) arrays.

        class Squares(cx.data.Dataset):
            def __len__(self): return 1000
            def __getitem__(self, indices): x = indices[:, None].astype(np.float32); return x, x[:, 0] ** 2

    Subclasses define __len__ (the number of samples) and __getitem__(indices), where indices is a
    NumPy int64 array of sample numbers in [0, len): it returns (X_batch, y_batch), X_batch of shape
    (len(indices), features...) and y_batch (len(indices),) class labels or (len(indices), ...) float
    targets. It is called on one background thread at a time, never concurrently.
    """

    def __len__(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} must define __len__ (cx.data.Dataset)")

    def __getitem__(self, indices: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError(f"{type(self).__name__} must define __getitem__(indices) -> (X_batch, y_batch) "
                                  f"(cx.data.Dataset)")

    def __repr__(self) -> str:
        try:
            return f"{type(self).__name__}(samples={len(self)})"
        except Exception:
            return f"{type(self).__name__}()"


def _paths(p: Union[_PathLike, Sequence[_PathLike]], who: str) -> List[str]:
    if isinstance(p, (str, os.PathLike)):
        return [os.fspath(p)]
    try:
        out = [os.fspath(q) for q in p]
    except TypeError:
        raise TypeError(f"NpyDataset: {who} must be a path to a .npy file or a list of them, got "
                        f"{type(p).__name__}") from None
    if not out:
        raise ValueError(f"NpyDataset: {who} is an empty list; give at least one .npy file")
    return out


def _open(path: str) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise type(e)(f"NpyDataset: cannot open {path!r} as a .npy file: {e}") from None


class NpyDataset(Dataset):
    """Samples in .npy files, memory-mapped: only the rows a batch needs are read, by the page cache.

        ds = cx.data.NpyDataset("x.npy", "y.npy")
        ds = cx.data.NpyDataset(["x0.npy", "x1.npy"], ["y0.npy", "y1.npy"])   # shards, in order

    Each x file holds (samples, features...) of a numeric dtype, its y file as many labels (integers)
    or targets (floats). Shards must agree in dtype and feature shape; sample i is row i of the
    shards concatenated. Files are opened read-only; a pickled NpyDataset (sent to another process)
    holds the paths, not the data.
    """

    def __init__(self, x_path: Union[_PathLike, Sequence[_PathLike]],
                 y_path: Union[_PathLike, Sequence[_PathLike]]) -> None:
        self.x_paths = _paths(x_path, "x_path")
        self.y_paths = _paths(y_path, "y_path")
        if len(self.x_paths) != len(self.y_paths):
            raise ValueError(f"NpyDataset: {len(self.x_paths)} x files but {len(self.y_paths)} y files; give one y "
                             f"file per x file")
        self._open()

    def _open(self) -> None:
        xs = [_open(p) for p in self.x_paths]
        ys = [_open(p) for p in self.y_paths]
        x0, y0 = xs[0], ys[0]
        for k, (px, py, x, y) in enumerate(zip(self.x_paths, self.y_paths, xs, ys)):
            if x.ndim < 2:
                raise ValueError(f"NpyDataset: {px!r} holds shape {x.shape}; x files hold (samples, features...)")
            if x.dtype.kind not in "fiub":
                raise TypeError(f"NpyDataset: {px!r} holds dtype {x.dtype}; x must be numeric")
            if y.ndim < 1 or y.dtype.kind not in "iuf":
                raise TypeError(f"NpyDataset: {py!r} holds {y.dtype} of shape {y.shape}; y must be integer labels "
                                f"(samples,) or float targets (samples, ...)")
            if x.shape[0] != y.shape[0]:
                raise ValueError(f"NpyDataset: shard {k}: {px!r} holds {x.shape[0]} samples but {py!r} holds "
                                 f"{y.shape[0]}; they must match")
            if (x.dtype, x.shape[1:]) != (x0.dtype, x0.shape[1:]):
                raise ValueError(f"NpyDataset: {px!r} holds {x.dtype} rows of shape {x.shape[1:]} but "
                                 f"{self.x_paths[0]!r} holds {x0.dtype} rows of shape {x0.shape[1:]}; shards must "
                                 f"agree")
            if (y.dtype, y.shape[1:]) != (y0.dtype, y0.shape[1:]):
                raise ValueError(f"NpyDataset: {py!r} holds {y.dtype} of shape {y.shape[1:]} per sample but "
                                 f"{self.y_paths[0]!r} holds {y0.dtype} of shape {y0.shape[1:]}; shards must agree")
        # Plain ndarray views of the maps (np.memmap's Python-level hooks would run on every batch taken).
        self._xs, self._ys = [np.asarray(x) for x in xs], [np.asarray(y) for y in ys]
        self._starts = np.cumsum([0] + [x.shape[0] for x in xs]).astype(np.int64)

    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def shape(self) -> Tuple[int, ...]:
        """(samples, features...) of X over all shards."""
        return (len(self),) + tuple(self._xs[0].shape[1:])

    def __getitem__(self, indices: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        idx = np.asarray(indices, dtype=np.int64)
        if len(self._xs) == 1:
            return np.take(self._xs[0], idx, axis=0), np.take(self._ys[0], idx, axis=0)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            bad = idx[(idx < 0) | (idx >= len(self))][0]
            raise IndexError(f"NpyDataset: index {bad} is out of range for {len(self)} samples")
        shard = np.searchsorted(self._starts, idx, side="right") - 1
        X = np.empty((idx.size,) + self._xs[0].shape[1:], self._xs[0].dtype)
        y = np.empty((idx.size,) + self._ys[0].shape[1:], self._ys[0].dtype)
        for s in np.unique(shard):
            rows = np.flatnonzero(shard == s)
            local = idx[rows] - self._starts[s]
            X[rows] = np.take(self._xs[s], local, axis=0)
            y[rows] = np.take(self._ys[s], local, axis=0)
        return X, y

    def _arrays(self) -> Optional[Tuple[np.ndarray, np.ndarray]]:
        """(X, y), the maps themselves, where the trainer can gather rows from them as from arrays in memory:
        one shard, float32 X, int64/int32 labels or float32 targets. None otherwise."""
        if len(self._xs) != 1:
            return None
        X, y = self._xs[0], self._ys[0]
        if X.dtype != np.float32 or y.dtype not in (np.int64, np.int32, np.float32):
            return None
        if not (X.flags.c_contiguous and y.flags.c_contiguous):
            return None
        return X, y

    def __getstate__(self) -> dict:
        return {"x_paths": self.x_paths, "y_paths": self.y_paths}

    def __setstate__(self, state: dict) -> None:
        self.x_paths, self.y_paths = state["x_paths"], state["y_paths"]
        self._open()

    def __repr__(self) -> str:
        files = self.x_paths[0] if len(self.x_paths) == 1 else f"{len(self.x_paths)} shards"
        return f"NpyDataset({files!r}, samples={len(self)}, shape={self.shape}, dtype={self._xs[0].dtype})"
