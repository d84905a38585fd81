"""pycyxwiz: collective communication and data-parallel training.

    import pycyxwiz as cx
    cx.distributed.init()                       # RANK/WORLD_SIZE/MASTER_ADDR/... from the environment
    cx.distributed.all_reduce(arr)              # in place, on every rank
"""
from ._blas import preload as _preload_blas
from ._env import apply_renames as _apply_renamed_environment_variables
from ._failure import install_from_environment as _record_failures_for_the_launcher

_apply_renamed_environment_variables()
_preload_blas()

# The package's one export list. The model stack's names among them are bound from the compiled core by
# _nn.py (typed in _nn.pyi, which _core.pyi re-exports): a new layer is one name here and its stub there.
__all__ = [
    "callbacks",
    "data",
    "datasets",
    "distributed",
    "__version__",
    "Module",
    "SequentialModel",
    "LinearModule",
    "ReLUModule",
    "LeakyReLUModule",
    "SigmoidModule",
    "TanhModule",
    "GELUModule",
    "SoftmaxModule",
    "DropoutModule",
    "BatchNormModule",
    "SyncBatchNormModule",
    "convert_sync_batchnorm",
    "FlattenModule",
    "Conv2dModule",
    "MaxPool2dModule",
    "AvgPool2dModule",
    "GlobalAvgPool2dModule",
    "BatchNorm2dModule",
    "ResidualModule",
    "CrossEntropyLoss",
    "MSELoss",
    "BCEWithLogitsLoss",
    "Optimizer",
    "SGDOptimizer",
    "AdamOptimizer",
    "AdamWOptimizer",
    "RMSpropOptimizer",
    "LRScheduler",
    "StepLR",
    "CosineAnnealingLR",
    "LinearWarmupLR",
    "clip_grad_norm",
    "set_num_threads",
    "get_num_threads",
    "manual_seed",
]
__version__ = "0.1.0"

from . import _core  # noqa: E402
from ._nn import *  # noqa: E402,F401,F403
from . import callbacks, data, datasets, distributed  # noqa: E402

# After distributed/ chained its hook (an escaping exception tells the peers), so
# that this one, outermost, records the exception for the launcher first.
_record_failures_for_the_launcher()
