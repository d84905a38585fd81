"""The checkpoint container: named arrays in a zip, with a manifest that proves every byte.

    data = pack({"meta": meta_bytes, "model": model_bytes, "opt.exp_avg": m})
    arrays = unpack(data, "ckpt/epoch_0003.ckpt")        # OSError naming what is wrong

Note [Checkpoints you can trust]
A checkpoint is an uncompressed zip of ``.npy`` members (``np.load`` still opens it). A bit
flipped in a member's *name* used to load without error: ``opt.exp_avg`` became
``opt.exp_avf``, the optimizer found no ``exp_avg`` and started Adam from zeros. So (version 2):
  - ``manifest.json`` lists every member with the SHA-256 of its bytes: a member that is missing,
    extra (a renamed one is both) or altered is an OSError that names it;
  - the zip's comment holds ``cx-sha256:`` and the SHA-256 of every byte of the file before the
    digest itself (directory, headers, manifest): what the manifest cannot see, a flip in the zip
    directory, is caught too. Every single-bit flip is an error (tests/test_restarts.py tries
    every bit of a small checkpoint).
Files of version 1 (no manifest, no comment) still load. A file whose comment is missing but whose
meta says version 2 is refused, so deleting the proof does not make a file "version 1".
SHA-256 costs about 2 ms per MiB here, next to the fsync that every save already pays.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import time
import zipfile
from typing import Dict

import numpy as np

MANIFEST = "manifest.json"
_TAG = b"cx-sha256:"
_HEX = 64  # hex digits of a SHA-256


def pack(members: Dict[str, np.ndarray]) -> bytes:
    """The file's bytes: every array as ``name.npy``, the manifest, and the whole-file digest."""
    digests = {}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, arr in members.items():
            one = io.BytesIO()
            np.lib.format.write_array(one, np.ascontiguousarray(arr), allow_pickle=False)
            raw = one.getvalue()
            z.writestr(name + ".npy", raw)
            digests[name] = hashlib.sha256(raw).hexdigest()
        z.writestr(MANIFEST, json.dumps({"algorithm": "sha256", "members": digests}, sort_keys=True))
        z.comment = _TAG + b"0" * _HEX
    data = buf.getvalue()
    body = data[:-_HEX]
    return body + hashlib.sha256(body).hexdigest().encode()


def is_proven(data: bytes) -> bool:
    """Whether the file carries the whole-file digest (version 2), right or wrong."""
    return len(data) > _HEX + len(_TAG) and data[-_HEX - len(_TAG):-_HEX] == _TAG


def unpack(data: bytes, path: str) -> Dict[str, np.ndarray]:
    """The arrays of a checkpoint, each checked against the manifest and the whole-file digest.

    Raises OSError naming the member that is missing, extra or altered, or saying that the file
    is damaged outside its members. A file without the digest is read as version 1 (unchecked)."""
    where = f"load_checkpoint: {path!r}"
    try:
        z = zipfile.ZipFile(io.BytesIO(data))
    except Exception as e:  # BadZipFile, NotImplementedError (a "zip version 8.4"), UnicodeDecodeError, ...
        raise OSError(f"{where} is not a readable pycyxwiz checkpoint ({e}); it may be truncated or from "
                      f"another program") from None
    with z:
        names = z.namelist()
        if not is_proven(data):
            if MANIFEST in names:
                raise OSError(f"{where} is damaged: it has a manifest but its whole-file checksum is missing")
            return {n[:-4] if n.endswith(".npy") else n: _read(z, n, where) for n in names}  # version 1
        if MANIFEST not in names:
            raise OSError(f"{where} is damaged: its member {MANIFEST!r} (the list of members and their "
                          f"checksums) is missing")
        try:
            manifest = json.loads(_member(z, MANIFEST, where).decode())
            expected = dict(manifest["members"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise OSError(f"{where} is damaged: its member {MANIFEST!r} cannot be read") from None
        present = {n[:-4] if n.endswith(".npy") else n for n in names if n != MANIFEST}
        for name in sorted(set(expected) - present):
            raise OSError(f"{where} is damaged: its member {name!r} is missing")
        for name in sorted(present - set(expected)):
            raise OSError(f"{where} is damaged: it holds a member {name!r} that its manifest does not list")
        out = {}
        for name, digest in expected.items():
            raw = _member(z, name + ".npy", where)
            if hashlib.sha256(raw).hexdigest() != digest:
                raise OSError(f"{where} is damaged: its member {name!r} does not match its checksum")
            out[name] = _array(raw, name, where)
        body = data[:-_HEX]
        if hashlib.sha256(body).hexdigest().encode() != data[-_HEX:]:
            raise OSError(f"{where} is damaged: every member matches its checksum but the file's checksum does "
                          f"not (the zip directory or headers changed)")
        return out


def _member(z: zipfile.ZipFile, name: str, where: str) -> bytes:
    try:
        return z.read(name)
    except Exception as e:  # BadZipFile (a CRC), KeyError, NotImplementedError, zlib.error, ...
        raise OSError(f"{where} is damaged: its member {name!r} cannot be read ({e})") from None


def _array(raw: bytes, name: str, where: str) -> np.ndarray:
    try:
        return np.lib.format.read_array(io.BytesIO(raw), allow_pickle=False)
    except Exception as e:  # ValueError, EOFError, SyntaxError (a header's dict), ...
        raise OSError(f"{where} is damaged: its member {name!r} is not an array ({e})") from None


def _read(z: zipfile.ZipFile, name: str, where: str) -> np.ndarray:
    return _array(_member(z, name, where), name, where)


# ---- writing -------------------------------------------------------------------------------------

# Note [Temporary files of dead writers]
# A save writes `.tmp-<host>-<pid>-<n>.ckpt` beside the target, fsyncs and renames it. A writer
# killed before the rename leaves its temporary file (one checkpoint's size each: 824 MiB after
# 20 kills of a large model). Each save first removes the temporary files of writers that are
# gone: those named with this host and a process id that no longer exists. Another host's (a
# shared file system) are left to that host. Files of the older unnamed form (`.tmp-XXXXXXXX.ckpt`)
# whose writer cannot be known are removed once they are an hour old.
_TMP_PREFIX = ".tmp-"
_LEGACY_AGE_S = 3600.0


def _host() -> str:
    return socket.gethostname().replace("-", "_") or "host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(directory: str) -> None:
    """Removes the temporary files of dead writers in `directory` (Note [Temporary files of dead writers])."""
    host = _host()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for e in entries:
        if not (e.name.startswith(_TMP_PREFIX) and e.name.endswith(".ckpt")):
            continue
        parts = e.name[len(_TMP_PREFIX):-len(".ckpt")].split("-")
        try:
            if len(parts) == 3:
                if parts[0] != host or not parts[1].isdigit() or _alive(int(parts[1])):
                    continue
            elif time.time() - e.stat().st_mtime < _LEGACY_AGE_S:
                continue
            os.unlink(e.path)
        except OSError:
            pass  # another rank or a racing save removed it first


_counter = 0


def atomic_write(path: str, data: bytes) -> None:
    """Temporary file in the same directory, fsync, rename, fsync the directory."""
    global _counter
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    remove_stale_temporaries(d)
    _counter += 1
    tmp = os.path.join(d, f"{_TMP_PREFIX}{_host()}-{os.getpid()}-{_counter}.ckpt")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass
