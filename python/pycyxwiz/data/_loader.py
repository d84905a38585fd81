"""How DistributedTrainer reads a Dataset: one background thread loads the next batches while the step runs.

    with Prefetcher(load, plan) as batches:        # load(plan[k]) on the thread, in order, 2 ahead
        for X, y in batches: core.train_rows(X, y)

The step releases the GIL for its C++ work, and NumPy releases it while it copies rows (np.take, also
from a memory map, where the page faults happen), so reading overlaps computing. `plan` is the list of
the batches' index arrays, made up front from the trainer's DistributedBatchIterator, so the order is
the sampler's and only this thread calls the Dataset. An exception in `load` comes out of the
iteration, in the trainer's thread, at the batch that raised it.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Iterator, List, Optional, Sequence

import numpy as np

from . import Dataset

_POLL_S = 0.1  # how often a blocked side looks whether the other one has gone
_CLOSE_S = 60.0  # how long close() waits for a load in progress


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
    """Iterates load(plan[0]), load(plan[1]), ... computed `depth` batches ahead on a daemon thread."""

    def __init__(self, load: Callable[[np.ndarray], Any], plan: Sequence[np.ndarray], depth: int = 2) -> None:
        self._load = load
        self._plan: List[np.ndarray] = list(plan)
        self._q: "queue.Queue[Any]" = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "Prefetcher":
        if self._plan:
            self._thread = threading.Thread(target=self._run, name="cx-data-prefetch", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        for idx in self._plan:
            if self._stop.is_set():
                return
            try:
                item = self._load(idx)
            except BaseException as e:  # handed to the trainer's thread, which raises it
                self._put(_Failed(e))
                return
            if not self._put(item):
                return

    def __iter__(self) -> Iterator[Any]:
        for _ in range(len(self._plan)):
            item = self._get()
            if isinstance(item, _Failed):
                raise item.exc
            yield item

    def _get(self) -> Any:
        while True:
            try:
                return self._q.get(timeout=_POLL_S)
            except queue.Empty:
                # The thread puts every batch or a failure before it ends; one that has ended with nothing
                # queued has been stopped (close()).
                if self._thread is None or (not self._thread.is_alive() and self._q.empty()):
                    raise RuntimeError("the data loading thread stopped before the epoch's last batch") from None

    def close(self) -> None:
        """Stops the thread after the batch it is loading, if any (waiting at most _CLOSE_S for that load:
        a daemon thread stuck in a Dataset's __getitem__ is left behind), and drops what it queued."""
        self._stop.set()
        t, self._thread = self._thread, None
        if t is None:
            return
        deadline = time.monotonic() + _CLOSE_S
        while t.is_alive() and time.monotonic() < deadline:
            t.join(_POLL_S)
        while True:
            try:
                self._q.get_nowait()
            except queue.Empty:
                return
