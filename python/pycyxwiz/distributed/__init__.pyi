# Type stub of cx.distributed: the process group and collectives (_pg.pyi), spawn (_spawn.py) and
# data-parallel training (_train.pyi).

from . import _pg, _spawn, _train
from ._pg import *
from ._spawn import *
from ._train import *

# Each part's export list, written once there (tests/test_stubs.py checks the stubs' lists against the package's).
__all__ = []
__all__ += _pg.__all__
__all__ += _spawn.__all__
__all__ += _train.__all__
