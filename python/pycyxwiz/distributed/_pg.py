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
at interpreter exit.
"""
from __future__ import annotations

import atexit
from typing import Optional

from .. import _core
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

__all__ = [
    "ReduceOp", "BackendType", "DistributedConfig", "Work",
    "DistributedError", "DistributedTimeoutError", "DistributedConnectionError", "CollectiveMismatchError",
    "init", "finalize", "is_initialized", "get_rank", "get_world_size", "get_local_rank", "get_config",
    "is_master", "is_nccl_available",
    "all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce", "scatter", "gather",
    "all_to_all", "barrier", "send", "recv",
]


def init(config: Optional[DistributedConfig] = None) -> None:
    """Join the process group; blocks until every rank has joined (or timeout_ms passes).

        cx.distributed.init()                      # RANK, WORLD_SIZE, ... from the environment
        cx.distributed.init(cfg)                   # an explicit DistributedConfig

    With no RANK/WORLD_SIZE in the environment this is a world of one process,
    so the same script runs under a launcher or as plain ``python train.py``.
    """
    if config is None:
        config = DistributedConfig.from_environment()
    if config.backend == BackendType.NCCL:
        _gpu.prepare()
    _d.init(config)


is_nccl_available = _gpu.is_nccl_available


def is_master() -> bool:
    """True on rank 0 (the process that should log and save)."""
    return get_rank() == 0


def _finalize_at_exit() -> None:
    # Close connections gracefully so that peers still reading see end-of-stream,
    # not a reset that could discard data in flight.
    try:
        if is_initialized():
            finalize()
    except Exception:
        pass


atexit.register(_finalize_at_exit)
