# Type stub of cx.distributed: the process group and collectives (_pg.pyi), spawn (_spawn.py) and
# data-parallel training (_train.pyi).

# The names come from the parts' stubs (a stub's `from m import *` re-exports m's __all__); the list below is
# the package's, copied by tests/stub_check/export_lists.py (stubtest reads only a literal __all__).
from ._pg import *
from ._spawn import *
from ._train import *

__all__ = [  # written by tests/stub_check/export_lists.py from pycyxwiz.distributed.__all__
    "ReduceOp", "BackendType", "DistributedConfig", "Work", "DistributedError", "DistributedTimeoutError",
    "DistributedConnectionError", "CollectiveMismatchError", "init", "finalize", "is_initialized", "get_rank",
    "get_world_size", "get_local_rank", "get_config", "is_master", "is_nccl_available", "all_reduce",
    "broadcast", "all_gather", "reduce_scatter", "reduce", "scatter", "gather", "all_to_all", "barrier",
    "send", "recv", "monitored_barrier", "abort_on_error", "spawn", "SpawnError",
    "launch_distributed_training", "DDPConfig", "PowerSGDConfig", "DistributedDataParallel",
    "DistributedSampler", "DistributedBatchIterator", "ZeroRedundancyOptimizer", "join",
    "DistributedTrainingConfig", "DistributedTrainingHistory", "DistributedTrainer", "NonFiniteError",
]
