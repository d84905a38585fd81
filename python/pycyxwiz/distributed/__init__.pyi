# Type stub of cx.distributed: the process group and collectives (_pg.pyi), spawn (_spawn.py) and
# data-parallel training (_train.pyi).

from ._pg import (
    BackendType as BackendType,
    CollectiveMismatchError as CollectiveMismatchError,
    DistributedConfig as DistributedConfig,
    DistributedConnectionError as DistributedConnectionError,
    DistributedError as DistributedError,
    DistributedTimeoutError as DistributedTimeoutError,
    ReduceOp as ReduceOp,
    Work as Work,
    abort_on_error as abort_on_error,
    all_gather as all_gather,
    all_reduce as all_reduce,
    all_to_all as all_to_all,
    barrier as barrier,
    broadcast as broadcast,
    finalize as finalize,
    gather as gather,
    get_config as get_config,
    get_local_rank as get_local_rank,
    get_rank as get_rank,
    get_world_size as get_world_size,
    init as init,
    is_initialized as is_initialized,
    is_master as is_master,
    is_nccl_available as is_nccl_available,
    monitored_barrier as monitored_barrier,
    recv as recv,
    reduce as reduce,
    reduce_scatter as reduce_scatter,
    scatter as scatter,
    send as send,
)
from ._spawn import SpawnError as SpawnError, launch_distributed_training as launch_distributed_training, spawn as spawn
from ._train import (
    DDPConfig as DDPConfig,
    PowerSGDConfig as PowerSGDConfig,
    DistributedBatchIterator as DistributedBatchIterator,
    DistributedDataParallel as DistributedDataParallel,
    DistributedSampler as DistributedSampler,
    DistributedTrainer as DistributedTrainer,
    DistributedTrainingConfig as DistributedTrainingConfig,
    DistributedTrainingHistory as DistributedTrainingHistory,
    NonFiniteError as NonFiniteError,
    ZeroRedundancyOptimizer as ZeroRedundancyOptimizer,
    join as join,
)


__all__ = [
    "ReduceOp", "BackendType", "DistributedConfig", "Work",
    "DistributedError", "DistributedTimeoutError", "DistributedConnectionError", "CollectiveMismatchError",
    "init", "finalize", "is_initialized", "get_rank", "get_world_size", "get_local_rank", "get_config",
    "is_master", "is_nccl_available",
    "all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce", "scatter", "gather",
    "all_to_all", "barrier", "send", "recv", "monitored_barrier", "abort_on_error",
    "spawn", "SpawnError", "launch_distributed_training",
    "DDPConfig", "PowerSGDConfig", "DistributedDataParallel", "DistributedSampler", "DistributedBatchIterator",
    "ZeroRedundancyOptimizer", "join",
    "DistributedTrainingConfig", "DistributedTrainingHistory", "DistributedTrainer", "NonFiniteError",
]
