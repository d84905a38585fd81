"""What a rank tells its launcher when it dies of an exception.

The launcher (pycyxwiz.launch) sets CX_ERROR_FILE for every rank. If an exception
escapes the rank's script, this hook writes, before anything else happens at exit
(before atexit closes the connections that tell the peers), when it happened and
what it was. From those files the launcher names the rank that failed first, not
a bystander that died a moment later because its peer was gone: Note [Root cause]
in launch.py.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

from . import _env

ENV = "CX_ERROR_FILE"


def install_from_environment() -> None:
    """Chain a sys.excepthook that records the exception, when the launcher asked for it."""
    path = _env.get(ENV)
    if not path or getattr(sys.excepthook, "_cx_records_to", None):
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        record(path, exc_type, exc, tb)
        previous(exc_type, exc, tb)

    hook._cx_records_to = path  # type: ignore[attr-defined]
    sys.excepthook = hook


def record(path: str, exc_type, exc, tb) -> None:
    report = {
        "time": time.time(),
        "type": exc_type.__name__,
        "bases": [c.__name__ for c in exc_type.__mro__],
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc_type, exc, tb)),
        "pid": os.getpid(),
    }
    try:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(report, f)
        os.replace(tmp, path)
    except OSError:
        pass  # the launcher falls back on exit times


def read(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
