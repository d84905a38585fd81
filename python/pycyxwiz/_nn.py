"""The model stack: modules, Sequential model, losses, optimizers, schedulers.

    model = cx.SequentialModel(); model.add(cx.LinearModule(64, 10))
    loss = cx.CrossEntropyLoss(); opt = cx.AdamOptimizer(1e-3)

Everything here is implemented in C++ (csrc/nn/); this module only re-exports it.
"""
from ._core import (
    BatchNormModule,
    BCEWithLogitsLoss,
    CosineAnnealingLR,
    CrossEntropyLoss,
    DropoutModule,
    FlattenModule,
    GELUModule,
    LeakyReLUModule,
    LinearModule,
    LinearWarmupLR,
    LRScheduler,
    Module,
    MSELoss,
    Optimizer,
    ReLUModule,
    SequentialModel,
    SigmoidModule,
    SoftmaxModule,
    StepLR,
    SyncBatchNormModule,
    TanhModule,
    AdamOptimizer,
    AdamWOptimizer,
    RMSpropOptimizer,
    SGDOptimizer,
    clip_grad_norm,
    convert_sync_batchnorm,
    get_num_threads,
    manual_seed,
    set_num_threads,
)
