"""How DistributedTrainer reads a Dataset: one background thread loads the next batches while the step runs.

    with Prefetcher(load, plan) as batches:        # load(plan[k]) on the thread, in order, ahead of the step
        for X, y in batches: core.train_rows(X, y)

The step releases the GIL for its C++ work, and NumPy releases it while it copies rows (np.take, also
from a memory map, where the page faults happen), so reading overlaps computing. `plan` is the list of
the batches' index arrays, made up front from the trainer's DistributedBatchIterator, so the order is
the sampler's and only this thread calls the Dataset. An exception in `load` comes out of the
iteration, in the trainer's thread, at the batch that raised it.

Note [Waking the loader seldom]
Waking a sleeping thread costs tens of microseconds of CPU on these VMs (DESIGN.md), about what the
reading of a 64-row batch costs, and with one rank per core that CPU is the training's. So the loader
does not run one batch ahead with a wake-up per batch (queue.Queue(2)): it fills up to `depth` batches
(up to 8, fewer for batches over 4 MiB: at most about 32 MiB waiting) and then sleeps until the trainer
has taken half of them; the trainer sleeps only when nothing is ready. One wake-up per depth/2 batches.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Deque, Iterator, List, Optional, Sequence

import numpy as np

from . import Dataset

_POLL_S = 0.1          # how often a sleeping side looks whether the other one has gone
_CLOSE_S = 60.0        # how long close() waits for a load in progress
_AHEAD_BYTES = 32 << 20  # Note [Waking the loader seldom]
_MAX_AHEAD = 8


def _nbytes(item: Any) -> int:
    try:
        return sum(int(a.nbytes) for a in item)
    except (TypeError, AttributeError):
        return 0


class Subset(Dataset):
    """Rows `indices` of `ds`, in that order (fit's validation_split of a Dataset)."""

    def __init__(self, ds: Dataset, indices: np.ndarray) -> None:
        self.ds = ds
        self.indices = np.ascontiguousarray(indices, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.indices.size)

    def __getitem__(self, indices: np.ndarray) -> Any:
        return self.ds[self.indices[indices]]

    def __repr__(self) -> str:
        return f"{self.ds!r}[{self.indices.size} rows]"


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Prefetcher:
    """Iterates load(plan[0]), load(plan[1]), ... computed ahead on a daemon thread (Note [Waking the loader
    seldom])."""

    def __init__(self, load: Callable[[np.ndarray], Any], plan: Sequence[np.ndarray]) -> None:
        self._load = load
        self._plan: List[np.ndarray] = list(plan)
        self._ready: Deque[Any] = collections.deque()
        self._cond = threading.Condition()
        self._depth = 2               # until the first batch says how large batches are
        self._loader_waits = False    # the loader sleeps until half the batches are taken
        self._trainer_waits = False   # the trainer sleeps until a batch is ready
        self._stop = False
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "Prefetcher":
        if self._plan:
            self._thread = threading.Thread(target=self._run, name="cx-data-prefetch", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _run(self) -> None:
        for k, idx in enumerate(self._plan):
            try:
                item = self._load(idx)
            except BaseException as e:  # handed to the trainer's thread, which raises it
                item = _Failed(e)
            with self._cond:
                if k == 0:
                    self._depth = max(2, min(_MAX_AHEAD, _AHEAD_BYTES // max(_nbytes(item), 1)))
                self._ready.append(item)
                if self._trainer_waits:
                    self._cond.notify()
                while not self._stop and len(self._ready) >= self._depth and k + 1 < len(self._plan):
                    self._loader_waits = True
                    self._cond.wait(_POLL_S)
                self._loader_waits = False
                if self._stop or isinstance(item, _Failed):
                    return

    def __iter__(self) -> Iterator[Any]:
        for _ in range(len(self._plan)):
            item = self._get()
            if isinstance(item, _Failed):
                raise item.exc
            yield item

    def _get(self) -> Any:
        with self._cond:
            while not self._ready:
                # The loader hands over every batch or a failure before it ends; one that has ended with nothing
                # ready was stopped (close()).
                if self._thread is None or not self._thread.is_alive():
                    raise RuntimeError("the data loading thread stopped before the epoch's last batch")
                self._trainer_waits = True
                self._cond.wait(_POLL_S)
            self._trainer_waits = False
            item = self._ready.popleft()
            if self._loader_waits and len(self._ready) <= self._depth // 2:
                self._cond.notify()
            return item

    def close(self) -> None:
        """Stops the thread after the batch it is loading, if any (waiting at most _CLOSE_S for that load:
        a daemon thread stuck in a Dataset's __getitem__ is left behind), and drops what it made."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        t, self._thread = self._thread, None
        if t is not None:
            deadline = time.monotonic() + _CLOSE_S
            while t.is_alive() and time.monotonic() < deadline:
                t.join(_POLL_S)
        self._ready.clear()


class Prefaulter:
    """Faults in the pages of the next batches' rows of a memory-mapped X on a daemon thread, up to `depth`
    batches ahead of the trainer, which gathers the rows itself and never waits for this thread (Note
    [Gathering from a map] in distributed/_train.py).

        with Prefaulter(X, plan) as ahead:
            for ...: core.train_batch(X, y, batches); ahead.advance()

    Note [Prefaulting only what is not in memory]
    Touching a batch's pages costs about 35 us of CPU per 64-row batch here (cache misses, the index
    arithmetic, the thread's wake-ups), 3-4% of the MLP benchmark's step, and buys nothing once the
    file is in the page cache. So the thread times its touches: while they show the pages in memory
    (under _RESIDENT_S per page), it looks at one batch in _SAMPLE only; a slow one (read from disk, or
    mapped for the first time) puts it back to every batch.
    """

    _SAMPLE = 8
    _RESIDENT_S = 1e-6

    def __init__(self, X: np.ndarray, plan: Sequence[np.ndarray], depth: int = 16) -> None:
        self._flat = X.reshape(-1)        # a view: X is C-contiguous
        self._row = int(np.prod(X.shape[1:], dtype=np.int64))
        per_page = max(1, 4096 // max(X.itemsize, 1))
        # One element of every page of a row, and its last. (Rows are read through these offsets in X's flat
        # view: np.take of a strided view of X would copy the whole view, every row, first.)
        self._cols = np.unique(np.r_[np.arange(0, self._row, per_page), self._row - 1]).astype(np.int64)
        self._plan: List[np.ndarray] = list(plan)
        self._depth = depth
        self._cond = threading.Condition()
        self._done = 0                 # batches the trainer has finished
        self._waits = False
        self._next = 0
        self._stop = False
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "Prefaulter":
        if self._plan:
            self._thread = threading.Thread(target=self._run, name="cx-data-prefault", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        t, self._thread = self._thread, None
        if t is not None:
            t.join(_CLOSE_S)

    def advance(self) -> None:
        """The trainer finished a batch. Takes the lock only to wake the thread: the trainer alone writes _done,
        and the thread sets _waits under the lock before it looks at _done, so a wake-up is never lost."""
        self._done += 1
        if self._waits and self._done >= self._next - self._depth // 2:
            with self._cond:
                self._cond.notify()

    def _run(self) -> None:
        resident = False               # Note [Prefaulting only what is not in memory]
        for k, idx in enumerate(self._plan):
            if k >= self._done + self._depth:
                with self._cond:
                    self._next, self._waits = k, True
                    while not self._stop and k >= self._done + self._depth:
                        self._cond.wait(_POLL_S)
                    self._waits = False
            if self._stop:
                return
            if k < self._done or (resident and k % self._SAMPLE):
                continue               # the trainer got there first (it never waits for us), or sampling
            offsets = (idx[:, None] * self._row + self._cols).ravel()
            t0 = time.perf_counter()
            try:
                np.take(self._flat, offsets)
            except Exception:          # the trainer's own gather reads these rows and says what is wrong
                return
            resident = time.perf_counter() - t0 < self._RESIDENT_S * offsets.size
