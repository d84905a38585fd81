"""cx.distributed.spawn: start ranks from a script or notebook, no launcher needed; and the training-engine
guide's launch_distributed_training(train_fn, world_size, **kwargs), which also joins the group for you.

    def worker(rank, n):
        cx.distributed.init()                 # RANK, WORLD_SIZE, MASTER_* are set for you
        x = np.ones(n, np.float32); cx.distributed.all_reduce(x)
        return x.sum()

    results = cx.distributed.spawn(worker, nprocs=4, args=(10,))   # [40.0, 40.0, 40.0, 40.0]
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import traceback
import warnings
from typing import Any, Callable, Dict, List, Optional

from .. import _env
from .._env import job_secret_env

__all__ = ["spawn", "SpawnError", "launch_distributed_training"]


class SpawnError(RuntimeError):
    """A spawned rank failed; the message holds its traceback."""


def _entry(fn, rank, nprocs, port, secret, args, conn):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
                      MASTER_ADDR=_env.get("MASTER_ADDR") or "127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(secret)
    try:
        conn.send(("ok", fn(rank, *args)))
    except BaseException as e:
        conn.send(("err", f"{type(e).__name__}: {e}", traceback.format_exc()))
    finally:
        conn.close()


def spawn(fn: Callable[..., Any], nprocs: int, args: tuple = (), timeout: Optional[float] = None) -> List[Any]:
    """Run fn(rank, *args) in `nprocs` fresh processes and return their results in rank order.

    The ranks get a fresh job secret (CX_AUTH_TOKEN) unless one is set already.
    fn must be importable (a module-level function). If any rank raises or dies, the
    others are stopped and SpawnError names the rank and shows its traceback. With
    `timeout` (seconds) a job still running then is stopped with SpawnError too.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be at least 1, got {nprocs}")
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    secret = job_secret_env()  # the user's if given, else one for this job
    procs, conns = [], []
    for r in range(nprocs):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_entry, args=(fn, r, nprocs, port, secret, args, child), daemon=False)
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    results: List[Any] = [None] * nprocs
    pending = set(range(nprocs))
    deadline = None if timeout is None else time.monotonic() + timeout
    failure = None
    try:
        while pending and failure is None:
            if deadline is not None and time.monotonic() > deadline:
                failure = f"ranks {sorted(pending)} still running after {timeout} s"
                break
            for r in list(pending):
                if conns[r].poll(0.02):
                    try:
                        msg = conns[r].recv()
                    except EOFError:
                        msg = ("err", f"rank {r} died (exit code {procs[r].exitcode})", "")
                    pending.discard(r)
                    if msg[0] == "ok":
                        results[r] = msg[1]
                    else:
                        failure = f"rank {r} failed: {msg[1]}\n{msg[2]}"
                        break
                elif not procs[r].is_alive() and not conns[r].poll(0.05):
                    pending.discard(r)
                    failure = f"rank {r} died with exit code {procs[r].exitcode}"
                    break
    finally:
        for p in procs:
            if failure is not None and p.is_alive():
                p.terminate()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        for c in conns:
            c.close()
    if failure is not None:
        raise SpawnError(failure)
    return results


class _SetupFailed:
    """What a rank of launch_distributed_training returns when init() failed (so the parent may fall back)."""

    def __init__(self, why: str) -> None:
        self.why = why


def _train_entry(rank: int, train_fn: Callable[..., Any], world_size: int, backend: Optional[str],
                 kwargs: Dict[str, Any]) -> Any:
    from . import _pg
    if backend is not None:
        os.environ["DISTRIBUTED_BACKEND"] = backend
    try:
        _pg.init()
    except Exception as e:
        return _SetupFailed(f"rank {rank}: {type(e).__name__}: {e}")
    try:
        return train_fn(rank, world_size, **kwargs)
    finally:
        if _pg.is_initialized():
            _pg.finalize()


def _train_here(train_fn: Callable[..., Any], backend: Optional[str], kwargs: Dict[str, Any]) -> Any:
    """train_fn(0, 1, **kwargs) in this process, in a world of one on 127.0.0.1."""
    from . import _pg
    if _pg.is_initialized():
        raise RuntimeError("launch_distributed_training: cannot fall back to training in this process: it already "
                           "belongs to a process group (call cx.distributed.finalize() first)")
    config = _pg.DistributedConfig()
    config.rank, config.world_size, config.local_rank = 0, 1, 0
    config.master_addr = "127.0.0.1"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        config.master_port = s.getsockname()[1]
    if backend is not None:
        config.backend = _pg.BackendType.NCCL if backend.lower() == "nccl" else _pg.BackendType.CPU
    _pg.init(config)
    try:
        return train_fn(0, 1, **kwargs)
    finally:
        if _pg.is_initialized():
            _pg.finalize()


def launch_distributed_training(train_fn: Callable[..., Any], world_size: int, backend: Optional[str] = None,
                                fallback: bool = False, timeout: Optional[float] = None, **kwargs: Any) -> List[Any]:
    """Runs train_fn(rank, world_size, **kwargs) in `world_size` processes that have joined one process group
    (cx.distributed.init() is done for you, finalize() after); returns their results in rank order.

        def train(rank, world_size, epochs):
            trainer = cx.distributed.DistributedTrainer(model(), cx.CrossEntropyLoss(), cx.AdamOptimizer(1e-3))
            return trainer.fit(X, y, cx.distributed.DistributedTrainingConfig(epochs=epochs)).train_losses
        results = cx.distributed.launch_distributed_training(train, world_size=4, epochs=10)

    The training-engine guide's helper (its distributed_train_worker is your train_fn). `backend`: "cpu" or
    "nccl" (DISTRIBUTED_BACKEND otherwise). train_fn must be importable (a module-level function), and kwargs
    picklable. If a rank raises, the others are stopped and SpawnError shows its traceback.
    With fallback=True, if the group cannot be set up (init() fails: e.g. NCCL refuses, a wrong MASTER_ADDR),
    train_fn(0, 1, **kwargs) runs in this process instead, in a world of one, with a warning saying why;
    without it (the default) that failure is a SpawnError: a job never shrinks to one process unasked.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"launch_distributed_training: world_size must be an int >= 1, got {world_size!r}")
    if backend is not None and backend.lower() not in ("cpu", "nccl"):
        raise ValueError(f"launch_distributed_training: backend must be 'cpu' or 'nccl', got {backend!r}")
    results = spawn(_train_entry, world_size, args=(train_fn, world_size, backend, kwargs), timeout=timeout)
    failed = [r.why for r in results if isinstance(r, _SetupFailed)]
    if not failed:
        return results
    why = "; ".join(failed)
    if not fallback:
        raise SpawnError(f"launch_distributed_training: the group of {world_size} processes could not be set up: "
                         f"{why} (fallback=True trains in this process instead)")
    warnings.warn(f"launch_distributed_training: the group of {world_size} processes could not be set up ({why}); "
                  f"fallback=True: training in this process, in a world of one", RuntimeWarning, stacklevel=2)
    return [_train_here(train_fn, backend, kwargs)]
