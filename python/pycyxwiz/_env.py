"""The environment as pycyxwiz's Python reads it: `get`, the renames of older releases, and the job
secret's variables that the launchers hand their ranks.

Every variable pycyxwiz reads is listed in csrc/common/env.cpp (and the README), and Python reads them
through `get`, which refuses a name that table lacks, as the core's env::get does: one table for both.
At import, an old name that is set is copied to its new name (unless that is set too) and a
FutureWarning says to use the new one.
"""
from __future__ import annotations

import os
import secrets
import warnings
from typing import FrozenSet, Optional

_table: Optional[FrozenSet[str]] = None


def get(name: str) -> Optional[str]:
    """The variable's value, None when it is unset or empty (as the core reads it, csrc/common/env.cpp)."""
    global _table
    if _table is None:
        from . import _core

        _table = frozenset(n for n, _, _ in _core._environment_variables())
    if name not in _table:
        raise KeyError(f"internal: environment variable {name} is not in csrc/common/env.cpp's table")
    return os.environ.get(name) or None


def is_set(name: str) -> bool:
    return get(name) is not None

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


def job_secret_env(nnodes: int = 1) -> dict:
    """The job secret for a launcher's ranks (README, "The job secret and the threat model"): a fresh
    CX_AUTH_TOKEN for a job of one node, unless the user gave one (CX_AUTH_TOKEN, CX_AUTH_TOKEN_FILE) or
    CX_AUTH=off. The nodes of a multi-node job must share theirs, so that one is the user's to set on every
    node (a rank on a real interface without one says how)."""
    given = get("CX_AUTH_TOKEN") or get("CX_AUTH_TOKEN_FILE") or get("CX_AUTH") == "off"
    if given or nnodes > 1:
        return {}
    return {"CX_AUTH_TOKEN": secrets.token_hex(32)}
