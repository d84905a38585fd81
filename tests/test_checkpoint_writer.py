"""The checkpoint file writer (pycyxwiz/distributed/_ckpt_file.py): pieces() lays out the same bytes as the plain
zipfile + np.save packing it replaced (Note [Packing without copies]), and atomic_write gives best.ckpt and
last.ckpt one file when both are saved together (Note [One file for best.ckpt and last.ckpt])."""
import hashlib
import io
import json
import os
import struct
import time
import zipfile

import numpy as np
import pytest

from pycyxwiz.distributed import _ckpt_file


def reference_pack(members, version=3):
    """What the writer does, the plain way: each member np.save'd into memory, zipfile.writestr, then the digest:
    version 3's over the members' places and every byte outside them, version 2's over every byte."""
    digests, spans = {}, {}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, arr in members.items():
            one = io.BytesIO()
            np.lib.format.write_array(one, np.ascontiguousarray(arr), allow_pickle=False)
            raw = one.getvalue()
            z.writestr(name + ".npy", raw)
            spans[name] = [buf.tell() - len(raw), len(raw)]   # writestr leaves the position after the bytes
            digests[name] = hashlib.sha256(raw).hexdigest()
        manifest = {"algorithm": "sha256", "members": digests}
        if version == 3:
            manifest["spans"] = spans
        z.writestr(_ckpt_file.MANIFEST, json.dumps(manifest, sort_keys=True))
        z.comment = (b"cx-sha256-3:" if version == 3 else b"cx-sha256:") + b"0" * 64
    body = buf.getvalue()[:-64]
    if version == 2:
        return body + hashlib.sha256(body).hexdigest().encode()
    places = sorted(spans.values())
    proof = struct.pack("<Q", len(places)) + b"".join(struct.pack("<QQ", s, n) for s, n in places)
    outside, at = [], 0
    for start, n in places:
        outside.append(body[at:start])
        at = start + n
    outside.append(body[at:])
    return body + hashlib.sha256(proof + b"".join(outside)).hexdigest().encode()


def members():
    rng = np.random.default_rng(7)
    return {"meta": np.frombuffer(json.dumps({"epoch": 3}).encode(), np.uint8),
            "model": rng.integers(0, 256, 5000, dtype=np.uint8),
            "opt.exp_avg": rng.standard_normal((300, 7)).astype(np.float32),
            "opt.empty": np.zeros((0, 4), np.float32),
            "rng.modules": np.arange(6, dtype=np.uint64).reshape(2, 3),
            "big_endian": np.arange(10, dtype=">i4"),
            "fortran_order": np.asfortranarray(rng.standard_normal((4, 5))),
            "flags": np.array([True, False, True])}


def test_pieces_are_the_bytes_of_the_plain_packing(monkeypatch):
    monkeypatch.setattr(time, "time", lambda: 1_800_000_000.0)   # zipfile stamps members with the time
    m = members()
    expected = reference_pack(m)
    parts = _ckpt_file.pieces(m)
    assert b"".join(parts) == expected
    assert _ckpt_file.pack(m) == expected
    # The arrays' bytes are views of the arrays, not copies.
    assert any(np.shares_memory(np.frombuffer(p, np.uint8), m["opt.exp_avg"]) for p in parts)
    out = _ckpt_file.unpack(expected, "c.ckpt")
    for name, arr in m.items():
        assert out[name].dtype == arr.dtype and np.array_equal(out[name], arr), name


def test_a_version_2_file_still_loads_and_its_flips_are_caught(monkeypatch):
    monkeypatch.setattr(time, "time", lambda: 1_800_000_000.0)
    m = members()
    data = reference_pack(m, version=2)      # what the writer wrote before version 3
    out = _ckpt_file.unpack(data, "v2.ckpt")
    for name, arr in m.items():
        assert out[name].dtype == arr.dtype and np.array_equal(out[name], arr), name
    # In version 2 the file's digest covers the members too: a consistent zip whose member changed is caught by it.
    z = zipfile.ZipFile(io.BytesIO(data))
    start = z.getinfo("model.npy").header_offset
    for byte in (start + 10, len(data) - 100, len(data) - 1):
        bad = bytearray(data)
        bad[byte] ^= 4
        with pytest.raises(OSError, match="is damaged|not a readable"):
            _ckpt_file.unpack(bytes(bad), "v2.ckpt")


def test_the_file_digest_skips_the_members_bytes_but_proves_where_they_are(monkeypatch):
    monkeypatch.setattr(time, "time", lambda: 1_800_000_000.0)
    m = members()
    data = _ckpt_file.pack(m)
    manifest = json.loads(zipfile.ZipFile(io.BytesIO(data)).read(_ckpt_file.MANIFEST))
    start, n = manifest["spans"]["opt.exp_avg"]
    one = io.BytesIO()
    np.lib.format.write_array(one, m["opt.exp_avg"], allow_pickle=False)
    assert data[start:start + n] == one.getvalue()          # the place of the member's .npy bytes
    # A member's bytes changed and its CRC and manifest digest changed to match: the manifest is outside the
    # members, so the file's digest sees it.
    raw = bytearray(data[start:start + n])
    raw[-1] ^= 1
    src = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for info in src.infolist():
            if info.filename == "opt.exp_avg.npy":
                z.writestr(info, bytes(raw))
            elif info.filename == _ckpt_file.MANIFEST:
                manifest["members"]["opt.exp_avg"] = hashlib.sha256(raw).hexdigest()
                z.writestr(info, json.dumps(manifest, sort_keys=True))
            else:
                z.writestr(info, src.read(info.filename))
        z.comment = src.comment
    with pytest.raises(OSError, match="file's checksum does not"):
        _ckpt_file.unpack(out.getvalue(), "c.ckpt")


def load(path):
    with open(path, "rb") as f:
        return _ckpt_file.unpack(f.read(), path)


def test_best_and_last_saved_together_are_one_file_written_once(tmp_path):
    best, last = str(tmp_path / "best.ckpt"), str(tmp_path / "last.ckpt")
    m = members()
    _ckpt_file.atomic_write([best, last], _ckpt_file.pieces(m))
    assert os.stat(best).st_ino == os.stat(last).st_ino
    assert np.array_equal(load(best)["opt.exp_avg"], m["opt.exp_avg"])
    # The next epoch did not improve: last.ckpt alone is replaced, best.ckpt keeps the file it had.
    newer = dict(m, **{"opt.exp_avg": m["opt.exp_avg"] + 1})
    _ckpt_file.atomic_write(last, _ckpt_file.pieces(newer))
    assert os.stat(best).st_ino != os.stat(last).st_ino
    assert np.array_equal(load(best)["opt.exp_avg"], m["opt.exp_avg"])
    assert np.array_equal(load(last)["opt.exp_avg"], newer["opt.exp_avg"])
    assert sorted(os.listdir(tmp_path)) == ["best.ckpt", "last.ckpt"]   # no temporary file left


def test_where_hard_links_are_refused_each_name_gets_its_own_copy(tmp_path, monkeypatch):
    def refuse(src, dst):
        raise PermissionError(1, "Operation not permitted", dst)

    monkeypatch.setattr(os, "link", refuse)   # as on a file system without hard links (FAT, some network mounts)
    best, last = str(tmp_path / "best.ckpt"), str(tmp_path / "last.ckpt")
    data = _ckpt_file.pack(members())
    _ckpt_file.atomic_write([best, last], [data])
    assert os.stat(best).st_ino != os.stat(last).st_ino
    for p in (best, last):
        with open(p, "rb") as f:
            assert f.read() == data
    assert sorted(os.listdir(tmp_path)) == ["best.ckpt", "last.ckpt"]


def test_names_in_different_folders_are_each_written(tmp_path):
    a, b = str(tmp_path / "a" / "x.ckpt"), str(tmp_path / "b" / "x.ckpt")
    data = _ckpt_file.pack(members())
    _ckpt_file.atomic_write([a, b], _ckpt_file.pieces(members()))
    for p in (a, b):
        with open(p, "rb") as f:
            assert _ckpt_file.unpack(f.read(), p).keys() == _ckpt_file.unpack(data, p).keys()


def test_short_writes_are_resumed_to_the_last_byte(tmp_path, monkeypatch):
    real = os.writev

    def at_most_1000_bytes(fd, buffers):   # what a pipe or a signal can do to a write
        out, left = [], 1000
        for b in buffers:
            v = memoryview(b)[:left]
            out.append(v)
            left -= v.nbytes
            if not left:
                break
        return real(fd, out)

    monkeypatch.setattr(os, "writev", at_most_1000_bytes)
    path = str(tmp_path / "c.ckpt")
    m = members()
    _ckpt_file.atomic_write(path, _ckpt_file.pieces(m))
    out = load(path)
    for name, arr in m.items():
        assert np.array_equal(out[name], arr), name


def test_a_failed_rename_leaves_no_temporary_file(tmp_path):
    os.makedirs(tmp_path / "last.ckpt")   # a folder where the file should go
    with pytest.raises(IsADirectoryError):
        _ckpt_file.atomic_write([str(tmp_path / "best.ckpt"), str(tmp_path / "last.ckpt")],
                                _ckpt_file.pieces(members()))
    assert sorted(os.listdir(tmp_path)) == ["best.ckpt", "last.ckpt"]
    assert os.path.isdir(tmp_path / "last.ckpt")


def test_without_writev_the_pieces_are_written_one_by_one(tmp_path, monkeypatch):
    monkeypatch.delattr(os, "writev")     # as on Windows
    path = str(tmp_path / "c.ckpt")
    m = members()
    _ckpt_file.atomic_write(path, _ckpt_file.pieces(m))
    out = load(path)
    for name, arr in m.items():
        assert np.array_equal(out[name], arr), name
