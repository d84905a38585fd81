# The compiled core (csrc/bindings/). Private: its public names are re-exported, with their
# types, by pycyxwiz._nn, pycyxwiz.distributed._pg and pycyxwiz.distributed._train, whose
# stubs are the typed API. Everything else here is an implementation detail.
from typing import Any

from ._nn import *

# The metaclass of every class the bindings define (pybind11's), named for the stubs.
class _pybind11_type(type): ...

dist: Any

def __getattr__(name: str) -> Any: ...
