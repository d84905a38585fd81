"""Environment variables under the names of older releases, still read, with a warning; and the
job secret's variables that the launchers hand their ranks.

Every variable pycyxwiz reads is listed in csrc/common/env.cpp (and the README); this
module carries the renames: at import, an old name that is set is copied to its new
name (unless that is set too) and a FutureWarning says to use the new one.
"""
from __future__ import annotations

import os
import secrets
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


def job_secret_env(nnodes: int = 1) -> dict:
    """The job secret for a launcher's ranks (README, "The job secret and the threat model"): a fresh
    CX_AUTH_TOKEN for a job of one node, unless the user gave one (CX_AUTH_TOKEN, CX_AUTH_TOKEN_FILE) or
    CX_AUTH=off. The nodes of a multi-node job must share theirs, so that one is the user's to set on every
    node (a rank on a real interface without one says how)."""
    given = os.environ.get("CX_AUTH_TOKEN") or os.environ.get("CX_AUTH_TOKEN_FILE") or os.environ.get("CX_AUTH") == "off"
    if given or nnodes > 1:
        return {}
    return {"CX_AUTH_TOKEN": secrets.token_hex(32)}
