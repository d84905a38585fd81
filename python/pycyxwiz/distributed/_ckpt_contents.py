"""What a DistributedTrainer checkpoint holds, to and from the members of its file (_ckpt_file.py packs
them into one verified file: Note [Checkpoints you can trust]).

Members: "meta" (JSON: format, version, where the fit stands, scalars of the optimizer, scheduler, history,
the PowerSGD hook's and the callbacks' entries), "model" (the model file's bytes), and arrays by prefix:
"opt." the optimizer's state, "rng.modules" every rank's generator states, "hook." PowerSGD's state,
"cb." the callbacks' arrays. The trainer decides what goes in (_train.py); this module only names and
checks it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import numpy as np

from . import _ckpt_file

FORMAT = "pycyxwiz-checkpoint"
VERSION = 3        # 2: a manifest and a whole-file checksum; 3: that checksum skips the members' bytes, which
READS = (1, 2, 3)  # the manifest's prove (Note [Checkpoints you can trust])


def members(meta: Dict[str, Any], model_bytes: Any, arrays: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """The members of a checkpoint file: `meta` under this format and version, the model (its .cyxmodel bytes: bytes
    or a uint8 array, not copied), the arrays."""
    meta = {"format": FORMAT, "version": VERSION, **meta}
    return dict(meta=np.frombuffer(json.dumps(meta).encode(), np.uint8),
                model=np.frombuffer(model_bytes, np.uint8), **arrays)


def meta_of(z: Dict[str, np.ndarray]) -> Dict[str, Any]:
    """The meta entry of unpacked members (KeyError, ValueError or UnicodeDecodeError if there is none)."""
    return json.loads(z["meta"].tobytes().decode())


@dataclass
class Contents:
    meta: Dict[str, Any]
    model: bytes
    optimizer: Dict[str, np.ndarray]             # "opt." arrays, without the prefix
    rng_rows: Optional[np.ndarray]               # one row of generator states per rank
    hook: Dict[str, np.ndarray] = field(default_factory=dict)       # "hook." arrays, without the prefix
    callbacks: Dict[str, np.ndarray] = field(default_factory=dict)  # "cb." arrays, with it


def read(data: bytes, path: str) -> Contents:
    """A checkpoint file's contents, checked (OSError naming `path` for a file that is not one of ours, of a
    version this release does not read, or damaged)."""
    z = _ckpt_file.unpack(data, path)  # Note [Checkpoints you can trust]
    try:
        meta = meta_of(z)
        model = z["model"].tobytes()
    except (KeyError, ValueError, UnicodeDecodeError) as e:
        raise OSError(f"load_checkpoint: {path!r} is not a readable pycyxwiz checkpoint ({e}); it may be "
                      f"truncated or from another program") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") not in READS:
        raise OSError(f"load_checkpoint: {path!r} is not a pycyxwiz checkpoint of version {VERSION}")
    if meta["version"] >= 2 and not _ckpt_file.is_proven(data):
        raise OSError(f"load_checkpoint: {path!r} is damaged: it says version {meta['version']} but its "
                      f"whole-file checksum is missing")
    return Contents(meta=meta, model=model,
                    optimizer={k[4:]: v for k, v in z.items() if k.startswith("opt.")},
                    rng_rows=z.get("rng.modules"),
                    hook={k[5:]: v for k, v in z.items() if k.startswith("hook.")},
                    callbacks={k: v for k, v in z.items() if k.startswith("cb.")})
