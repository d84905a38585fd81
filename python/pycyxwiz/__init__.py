"""pycyxwiz: collective communication and data-parallel training.

    import pycyxwiz as cx
    cx.distributed.init()                       # RANK/WORLD_SIZE/MASTER_ADDR/... from the environment
    cx.distributed.all_reduce(arr)              # in place, on every rank
"""
from ._blas import preload as _preload_blas

_preload_blas()

from . import _core  # noqa: E402
from ._nn import *  # noqa: E402,F401,F403
from ._nn import __all__ as _nn_all  # noqa: E402
from . import datasets, distributed  # noqa: E402

__version__ = "0.1.0"
__all__ = ["datasets", "distributed", "__version__", *_nn_all]
