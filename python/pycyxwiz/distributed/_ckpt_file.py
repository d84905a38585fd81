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
Version 3 (written now) hashes each member's bytes once, not twice: the manifest also gives each
member's place in the file (``spans``: offset and length of its ``.npy`` bytes), and the comment's
digest, tagged ``cx-sha256-3:``, covers that list of places and every byte outside them (local
headers, manifest, directory, comment), so every byte is proven once, by the file's digest or by
its member's; the member's digest is in the manifest, which the file's digest proves. Listing the
places inside the digest (not only in the manifest) means a damaged manifest cannot move a place
without changing what is hashed. Writing a checkpoint hashed its members' bytes twice before (a
third of the writer's CPU for the MLP benchmark's 3.3 MB, 7.2 -> 4.9 ms); zipfile's CRC-32 stays (np.load and
zipfile check it).
Files of version 1 (no manifest, no comment) and 2 still load. A file whose comment is missing but
whose meta says version 2 or 3 is refused, so deleting the proof does not make a file "version 1".
SHA-256 costs about 0.7 ms per MiB here (SHA-NI), CRC-32 about 0.4 ms per MiB.
"""
from __future__ import annotations

import bisect
import hashlib
import io
import json
import os
import socket
import struct
import time
import zipfile
from typing import Any, Dict, List, Sequence, Union, cast

import numpy as np

MANIFEST = "manifest.json"
_TAG = b"cx-sha256-3:"   # version 3: the file's digest skips the members' bytes (Note [Checkpoints you can trust])
_TAG_V2 = b"cx-sha256:"  # version 2: the file's digest covers every byte before it
_HEX = 64  # hex digits of a SHA-256


def pack(members: Dict[str, np.ndarray]) -> bytes:
    """The file's bytes: every array as ``name.npy``, the manifest, and the whole-file digest."""
    return b"".join(pieces(members))


# Note [Packing without copies]
# A checkpoint is written after every epoch by ModelCheckpoint, on a writer thread while training goes on
# (Note [Checkpoints written in the background] in _train.py). Packing it through io.BytesIO copied every
# byte four times with the GIL held (the .npy bytes, the zip, the body without its digest, the body with
# it), and each such copy of a few MB keeps the training thread from taking the GIL back after its step.
# So pieces() lets zipfile lay the file out over a list of buffers (_Pieces): an array's bytes are a view
# of the array itself, never copied in Python; zipfile's own CRC-32 and our SHA-256s run on those views
# and release the GIL, and os.writev hands the list to the kernel in one call. The bytes are the same as
# zipfile.writestr of each member's np.save output (tests/test_checkpoint_writer.py compares with that).
def pieces(members: Dict[str, np.ndarray]) -> List[memoryview]:
    """The file's bytes as a list of buffers (the arrays' own memory among them: keep them unchanged until
    the pieces are written). b"".join(pieces(m)) == pack(m)."""
    digests, spans = {}, {}
    out = _Pieces()
    with zipfile.ZipFile(cast(Any, out), "w", zipfile.ZIP_STORED) as z:
        for name, arr in members.items():
            arr = np.ascontiguousarray(arr)
            header = _npy_header(arr)
            body = arr.reshape(-1).view(np.uint8).data   # the array's memory, not a copy
            info = zipfile.ZipInfo(name + ".npy", date_time=time.localtime(time.time())[:6])
            info.compress_type = zipfile.ZIP_STORED
            info.external_attr = 0o600 << 16
            info.file_size = len(header) + body.nbytes
            with z.open(info, "w") as dest:
                spans[name] = [out.tell(), info.file_size]   # the local header is written: the .npy bytes start
                dest.write(header)
                dest.write(body)
            h = hashlib.sha256(header)
            h.update(body)
            digests[name] = h.hexdigest()
        z.writestr(MANIFEST, json.dumps({"algorithm": "sha256", "members": digests, "spans": spans},
                                        sort_keys=True))
        z.comment = _TAG + b"0" * _HEX
    parts = out.parts
    if parts[-1].nbytes < _HEX:   # zipfile writes the comment last, in one piece; if not, join the pieces
        parts = [memoryview(b"".join(parts))]
    last = parts[-1]
    h = _outside_digest(parts[:-1] + [last[:-_HEX]], sorted(spans.values()))
    parts[-1] = memoryview(bytes(last[:-_HEX]) + h.hexdigest().encode())  # the digest over the placeholder
    return parts


def _outside_digest(parts: Sequence[memoryview], spans: List[List[int]]) -> Any:
    """The SHA-256 of version 3's file digest: the places of the members' bytes (`spans`, sorted [offset, length]
    pairs), then every byte of `parts` (the file before its digest, in pieces) outside them."""
    h = hashlib.sha256(struct.pack("<Q", len(spans)))
    for start, length in spans:
        h.update(struct.pack("<QQ", start, length))
    i, pos = 0, 0   # the next span; the offset of the part
    for part in parts:
        end, at = pos + part.nbytes, pos
        while at < end:
            while i < len(spans) and spans[i][0] + spans[i][1] <= at:
                i += 1
            if i == len(spans) or spans[i][0] >= end:
                h.update(part[at - pos:])
                break
            h.update(part[at - pos:max(spans[i][0], at) - pos])
            at = min(spans[i][0] + spans[i][1], end)
        pos = end
    return h


def _npy_header(arr: np.ndarray) -> bytes:
    """The header np.save writes before arr's bytes (version 1.0 unless it would exceed 65535 bytes)."""
    d = np.lib.format.header_data_from_array_1_0(arr)
    head = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(head, d)
    except ValueError:
        head = io.BytesIO()
        np.lib.format.write_array_header_2_0(head, d)
    return head.getvalue()


def _bytes_of(data: Any) -> memoryview:
    """A flat byte view of any buffer (bytes, a memoryview of an array's memory), no copy."""
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class _Pieces:
    """A seekable file for zipfile's writer that keeps what it is given as a list of buffers, by reference.
    zipfile appends, and once per member goes back to rewrite the member's local header (same length) with its
    CRC; such a rewrite replaces that piece. Any other overwrite (not seen from zipfile) flattens the list."""

    def __init__(self) -> None:
        self.parts: List[memoryview] = []
        self._starts: List[int] = []
        self._size = 0
        self._pos = 0

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = pos if whence == 0 else (self._pos + pos if whence == 1 else self._size + pos)
        return self._pos

    def flush(self) -> None:
        pass

    def write(self, data: Any) -> int:
        view = _bytes_of(data)
        n = view.nbytes
        if self._pos == self._size:
            if n:
                self.parts.append(view)
                self._starts.append(self._size)
                self._size += n
        else:
            i = bisect.bisect_left(self._starts, self._pos)
            if i < len(self.parts) and self._starts[i] == self._pos and self.parts[i].nbytes == n:
                self.parts[i] = memoryview(bytes(view))
            else:
                flat = bytearray(b"".join(self.parts))
                end = self._pos + n
                if end > len(flat):
                    flat.extend(bytes(end - len(flat)))
                flat[self._pos:end] = view
                self.parts, self._starts, self._size = [memoryview(flat)], [0], len(flat)
        self._pos += n
        return n


def _version(data: bytes) -> int:
    """3 or 2 where the file ends with that version's tagged digest (right or wrong), else 1."""
    for tag, version in ((_TAG, 3), (_TAG_V2, 2)):
        if len(data) > _HEX + len(tag) and data[-_HEX - len(tag):-_HEX] == tag:
            return version
    return 1


def is_proven(data: bytes) -> bool:
    """Whether the file carries a whole-file digest (version 2 or 3), right or wrong."""
    return _version(data) > 1


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
        version = _version(data)
        if version == 1:
            if MANIFEST in names:
                raise OSError(f"{where} is damaged: it has a manifest but its whole-file checksum is missing")
            return {n[:-4] if n.endswith(".npy") else n: _read(z, n, where) for n in names}  # version 1
        if MANIFEST not in names:
            raise OSError(f"{where} is damaged: its member {MANIFEST!r} (the list of members and their "
                          f"checksums) is missing")
        try:
            manifest = json.loads(_member(z, MANIFEST, where).decode())
            expected = dict(manifest["members"])
            spans = _spans(manifest, expected, len(data)) if version == 3 else None
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
        body = memoryview(data)[:-_HEX]
        h = hashlib.sha256(body) if spans is None else _outside_digest([body], spans)
        if h.hexdigest().encode() != data[-_HEX:]:
            raise OSError(f"{where} is damaged: every member matches its checksum but the file's checksum does "
                          f"not (the zip directory or headers changed)")
        return out


def _spans(manifest: Dict[str, Any], expected: Dict[str, str], size: int) -> List[List[int]]:
    """Version 3's places of the members' bytes, sorted; ValueError unless they are one per member, in the file
    and apart (a damaged manifest; its digest then fails too, but these would not be safe to hash around)."""
    by_name = manifest["spans"]
    if not isinstance(by_name, dict) or set(by_name) != set(expected):
        raise ValueError("spans")
    spans = sorted([int(v[0]), int(v[1])] for v in by_name.values() if type(v) is list and len(v) == 2)
    end = 0
    for start, length in spans:
        if start < end or length < 0:
            raise ValueError("spans")
        end = start + length
    if len(spans) != len(by_name) or end > size - _HEX:
        raise ValueError("spans")
    return spans


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
_IOV = 512  # buffers per os.writev call (IOV_MAX is 1024 on Linux)


def atomic_write(path: Union[str, Sequence[str]], data: Union[bytes, Sequence[Any]]) -> None:
    """Writes `data` (bytes, or a list of buffers such as pieces() returns) to `path`, or to each of several
    paths, atomically: a temporary file in the same directory, fsync, rename, fsync the directory. Several
    paths in one directory get the file once: it is written and fsynced once and hard-linked to each name
    (Note [One file for best.ckpt and last.ckpt]); where links are refused, each name is written in turn."""
    paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    parts = [data] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)
    written: Dict[str, str] = {}  # directory -> a name there that holds the data (the first written)
    for p in paths:
        d = os.path.dirname(os.path.abspath(p))
        if d in written and _link_into(written[d], p):
            continue
        _write_one(p, parts)
        written.setdefault(d, p)


# Note [One file for best.ckpt and last.ckpt]
# When the monitored score improves, ModelCheckpoint writes the same checkpoint to best.ckpt and last.ckpt.
# Writing it twice cost a second write and fsync of the whole file. Since a checkpoint file is never changed
# in place (every save renames a new file over the old name), the two names can share one inode: the second
# is a hard link made under a temporary name and renamed over the target, so each name still changes
# atomically from its old complete file to its new one. The next save of last.ckpt alone replaces only
# that name; best.ckpt keeps the inode. File systems without hard links get a second copy.
def _temporary(d: str) -> str:
    """A fresh temporary name in folder d (remove_stale_temporaries knows the prefix)."""
    global _counter
    _counter += 1
    return os.path.join(d, f"{_TMP_PREFIX}{_host()}-{os.getpid()}-{_counter}.ckpt")


def _replace_or_unlink(tmp: str, path: str) -> None:
    """Renames tmp over path atomically; on any failure tmp is removed and the error raised."""
    try:
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _link_into(src: str, path: str) -> bool:
    d = os.path.dirname(os.path.abspath(path))
    tmp = _temporary(d)
    try:
        os.link(src, tmp)
    except OSError:
        return False
    _replace_or_unlink(tmp, path)
    _fsync_dir(d)
    return True


def _write_one(path: str, parts: List[Any]) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    remove_stale_temporaries(d)
    tmp = _temporary(d)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            _write_all(fd, parts)
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _replace_or_unlink(tmp, path)
    _fsync_dir(d)


def _write_all(fd: int, parts: List[Any]) -> None:
    """Every byte of parts to fd: os.writev (the GIL released, no copy), resuming after short writes; os.write
    of each where there is no writev (Windows)."""
    views = [v for v in map(_bytes_of, parts) if v.nbytes]
    writev = getattr(os, "writev", None)
    i = 0
    while i < len(views):
        batch = views[i:i + _IOV]
        n = writev(fd, batch) if writev is not None else os.write(fd, batch[0])
        for v in batch:
            if n >= v.nbytes:
                n -= v.nbytes
                i += 1
                continue
            views[i] = v[n:]  # a short write: go on from there
            break


def _fsync_dir(d: str) -> None:
    try:
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass
