"""Environment variables under the names of older releases, still read, with a warning.

Every variable pycyxwiz reads is listed in csrc/common/env.cpp (and the README); this
module only carries the renames: at import, an old name that is set is copied to its new
name (unless that is set too) and a FutureWarning says to use the new one.
"""
from __future__ import annotations

import os
import warnings

RENAMED = {
    "PYCYXWIZ_NN_SCALAR": "CX_NN_SCALAR",
}


def apply_renames() -> None:
    for old, new in RENAMED.items():
        value = os.environ.get(old)
        if value is None:
            continue
        warnings.warn(f"the environment variable {old} is deprecated: set {new} instead (it means the same)",
                      FutureWarning, stacklevel=3)
        os.environ.setdefault(new, value)
