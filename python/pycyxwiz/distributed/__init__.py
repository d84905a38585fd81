"""cx.distributed: the process group, collectives and data-parallel training.

    cx.distributed.init()                # from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...
    cx.distributed.all_reduce(grads)     # in place, averaged with op=ReduceOp.AVG
"""
from ._pg import *  # noqa: F401,F403
from ._pg import __all__ as _pg_all
from ._spawn import *  # noqa: F401,F403
from ._spawn import __all__ as _spawn_all
from ._train import *  # noqa: F401,F403
from ._train import __all__ as _train_all

__all__ = [*_pg_all, *_spawn_all, *_train_all]
