"""The process group and its collectives.

    import numpy as np, pycyxwiz as cx
    cx.distributed.init()                      # from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...
    x = np.ones(4, np.float32)
    cx.distributed.all_reduce(x)               # x == world_size on every rank, in place

Every collective works in place on C-contiguous NumPy arrays (with
BackendType.NCCL: CuPy arrays, or anything with ``__cuda_array_interface__``,
ordered after the array's stream), releases the GIL, and takes
``async_op=True`` to return a :class:`Work` handle instead of blocking.
The implementation is C++ (``pycyxwiz._core.dist``); this module adds the
Python-only conveniences: ``init()`` without arguments, ``is_master()``, cleanup
at interpreter exit, telling the peers when this rank's program fails
(:func:`abort_on_error`, and an exception that escapes the script), and the
``CX_DEBUG`` logs (logger ``"pycyxwiz"``).
"""
from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
import time
from typing import Any, Callable, Optional, TypeVar

from .. import _core, _env
from . import _gpu

_d = _core.dist

ReduceOp = _d.ReduceOp
BackendType = _d.BackendType
DistributedConfig = _d.DistributedConfig
Work = _d.Work
DistributedError = _core.DistributedError
DistributedTimeoutError = _core.DistributedTimeoutError
DistributedConnectionError = _core.DistributedConnectionError
CollectiveMismatchError = _core.CollectiveMismatchError

is_initialized = _d.is_initialized
get_rank = _d.get_rank
get_world_size = _d.get_world_size
get_local_rank = _d.get_local_rank
get_config = _d.get_config
finalize = _d.finalize

monitored_barrier = _d.monitored_barrier

logger = logging.getLogger("pycyxwiz")
_DEBUG = ""
_DETAIL = False

_F = TypeVar("_F", bound=Callable[..., Any])


def _logged(fn: _F) -> _F:
    """With CX_DEBUG=INFO|DETAIL: one log line per call of the collective `fn`."""
    name = fn.__name__

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        if _DETAIL:  # Note [Call sites in CX_DEBUG=DETAIL]: compared across ranks with the call
            caller = sys._getframe(1)
            _d._set_call_site(f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}")
        try:
            return fn(*args, **kwargs)
        finally:
            if _DETAIL:
                _d._set_call_site("")
            ms = (time.perf_counter() - t0) * 1e3
            if _DETAIL and is_initialized():
                # The flight record is built whole (a dict per entry, about 1 ms): only for a line that is shown.
                if logger.isEnabledFor(logging.DEBUG):
                    rec = _d._flight_record()
                    what = rec[-1]["describe"] if rec else name
                    logger.debug("rank %d: %s: %s, %.3f ms", get_rank(), name, what, ms)
            else:
                shapes = [getattr(a, "shape", None) for a in args]
                logger.info("rank %s: %s %s %.3f ms", get_rank() if is_initialized() else "?", name,
                            [s for s in shapes if s is not None], ms)

    return call  # type: ignore[return-value]


all_reduce = _d.all_reduce
broadcast = _d.broadcast
all_gather = _d.all_gather
reduce_scatter = _d.reduce_scatter
reduce = _d.reduce
scatter = _d.scatter
gather = _d.gather
all_to_all = _d.all_to_all
barrier = _d.barrier
send = _d.send
recv = _d.recv
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce", "scatter", "gather",
                "all_to_all", "barrier", "send", "recv")


def _configure_debug() -> None:
    """Reads CX_DEBUG (at import and at every init()): with INFO or DETAIL, the collectives of
    cx.distributed log each call (no wrapper, so no cost, when it is off)."""
    global _DEBUG, _DETAIL
    raw = _env.get("CX_DEBUG") or ""
    level = raw.strip().upper()
    if level not in ("", "OFF", "INFO", "DETAIL"):
        raise ValueError(f"environment variable CX_DEBUG='{raw}' is not valid: expected INFO, DETAIL or OFF")
    _DEBUG, _DETAIL = level, level == "DETAIL"
    on = level in ("INFO", "DETAIL")
    package = sys.modules.get(__name__.rpartition(".")[0])
    for name in _COLLECTIVES:
        fn = _logged(getattr(_d, name)) if on else getattr(_d, name)
        globals()[name] = fn
        if package is not None and hasattr(package, name):
            setattr(package, name, fn)


_configure_debug()

__all__ = [
    "ReduceOp", "BackendType", "DistributedConfig", "Work",
    "DistributedError", "DistributedTimeoutError", "DistributedConnectionError", "CollectiveMismatchError",
    "init", "finalize", "is_initialized", "get_rank", "get_world_size", "get_local_rank", "get_config",
    "is_master", "is_nccl_available",
    "all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce", "scatter", "gather",
    "all_to_all", "barrier", "send", "recv", "monitored_barrier", "abort_on_error",
]


def init(config: Optional[DistributedConfig] = None) -> None:
    """Join the process group; blocks until every rank has joined (or timeout_ms passes).

        cx.distributed.init()                      # RANK, WORLD_SIZE, ... from the environment
        cx.distributed.init(cfg)                   # an explicit DistributedConfig

    With no RANK/WORLD_SIZE in the environment this is a world of one process,
    so the same script runs under a launcher or as plain ``python train.py``.
    """
    _configure_debug()
    if config is None:
        config = DistributedConfig.from_environment()
    if config.backend == BackendType.NCCL:
        _gpu.prepare()
    if _DEBUG in ("INFO", "DETAIL"):
        logger.info("rank %d: init: %r", config.rank, config)
    _d.init(config)
    if _DEBUG in ("INFO", "DETAIL"):
        logger.info("rank %d: group ready: %s", config.rank, _d._describe_setup())


is_nccl_available = _gpu.is_nccl_available


def is_master() -> bool:
    """True on rank 0 (the process that should log and save)."""
    return get_rank() == 0


def _tell_peers(exc: BaseException) -> None:
    """This rank's program failed with `exc`: every peer raises "rank R failed: <type>: <message>"."""
    if not is_initialized():
        return
    why = f"{type(exc).__name__}: {exc}"
    if _DEBUG in ("INFO", "DETAIL"):
        logger.error("rank %d failed, aborting the group: %s", get_rank(), why)
        if _DETAIL:
            for e in _d._flight_record():
                logger.debug("rank %d flight record: %s %s", get_rank(), e["describe"], e["state"])
    try:
        _d._abort(why)
    except Exception:  # never hide the exception that is on its way out
        pass


def abort_on_error(fn: _F) -> _F:
    """Decorate a function whose exception must fail the whole group at once, naming the cause.

        @cx.distributed.abort_on_error
        def train(): ...          # a ValueError here: every peer raises "rank 2 failed: ValueError: ..."

    DistributedTrainer.fit is decorated so; an exception escaping the script does the same.
    """
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BaseException as e:
            _tell_peers(e)
            raise

    return call  # type: ignore[return-value]


def _install_excepthook() -> None:
    previous = sys.excepthook
    if getattr(previous, "_cx_tells_peers", False):
        return

    def hook(exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is not None:
            _tell_peers(exc)
        previous(exc_type, exc, tb)

    hook._cx_tells_peers = True  # type: ignore[attr-defined]
    sys.excepthook = hook


_install_excepthook()


def _finalize_at_exit() -> None:
    # Close connections gracefully so that peers still reading see end-of-stream,
    # not a reset that could discard data in flight.
    try:
        if is_initialized():
            _d._finalize_at_exit()  # compares with the peers, but waits at most a second for them
    except DistributedError as e:  # a divergence found at exit: say so (the exit status is already set)
        print(f"pycyxwiz: finalize at exit: {e}", file=sys.stderr, flush=True)
    except Exception:
        pass


atexit.register(_finalize_at_exit)
