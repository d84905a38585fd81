# The compiled core (csrc/bindings/). Private: its public names are re-exported, with their
# types, by pycyxwiz._nn, pycyxwiz.distributed._pg and pycyxwiz.distributed._train, whose
# stubs are the typed API. Everything else here is an implementation detail.
from typing import Any

from ._nn import (
    BatchNormModule as BatchNormModule,
    BCEWithLogitsLoss as BCEWithLogitsLoss,
    CosineAnnealingLR as CosineAnnealingLR,
    CrossEntropyLoss as CrossEntropyLoss,
    DropoutModule as DropoutModule,
    FlattenModule as FlattenModule,
    GELUModule as GELUModule,
    LeakyReLUModule as LeakyReLUModule,
    LinearModule as LinearModule,
    LinearWarmupLR as LinearWarmupLR,
    LRScheduler as LRScheduler,
    Module as Module,
    MSELoss as MSELoss,
    Optimizer as Optimizer,
    ReLUModule as ReLUModule,
    SequentialModel as SequentialModel,
    SigmoidModule as SigmoidModule,
    SoftmaxModule as SoftmaxModule,
    StepLR as StepLR,
    SyncBatchNormModule as SyncBatchNormModule,
    TanhModule as TanhModule,
    AdamOptimizer as AdamOptimizer,
    AdamWOptimizer as AdamWOptimizer,
    RMSpropOptimizer as RMSpropOptimizer,
    SGDOptimizer as SGDOptimizer,
    clip_grad_norm as clip_grad_norm,
    convert_sync_batchnorm as convert_sync_batchnorm,
    get_num_threads as get_num_threads,
    manual_seed as manual_seed,
    set_num_threads as set_num_threads,
)

# The metaclass of every class the bindings define (pybind11's), named for the stubs.
class _pybind11_type(type): ...

dist: Any

def __getattr__(name: str) -> Any: ...
