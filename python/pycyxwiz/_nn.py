"""The model stack: modules, Sequential model, losses, optimizers, schedulers.

    model = cx.SequentialModel(); model.add(cx.LinearModule(64, 10))
    loss = cx.CrossEntropyLoss(); opt = cx.AdamOptimizer(1e-3)

Everything here is implemented in C++ (csrc/nn/) and typed in _nn.pyi. This module binds, from the compiled
core, the names of pycyxwiz.__all__ (the package's one export list) that the core defines, and nothing else.
"""
import sys as _sys

from . import _core

globals().update({name: getattr(_core, name) for name in _sys.modules[__package__].__all__ if hasattr(_core, name)})
