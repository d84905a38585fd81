"""Jobs that survive faults: checkpoints that prove their bytes, stale temporary files removed,
the trainer resuming by itself, and the launcher restarting a failed group (--max-restarts)."""
import io
import json
import os
import subprocess
import sys
import textwrap
import time
import zipfile

import numpy as np
import pytest

import digits
import ranks
from models import mlp_with_dropout

import pycyxwiz as cx
from pycyxwiz.distributed import _ckpt_file

D = cx.distributed


def config(**kw):
    return D.DistributedTrainingConfig(verbose=False, seed=42, **kw)


# ---- checkpoints you can trust ---------------------------------------------------------

def small_checkpoint(path):
    Xtr, ytr, _, _ = digits.split()
    trainer = D.DistributedTrainer(mlp_with_dropout(3, 8), cx.CrossEntropyLoss(), cx.AdamOptimizer(1e-3))
    trainer.fit(Xtr[:64], ytr[:64], config(epochs=1, batch_size=32))
    trainer.save_checkpoint(path)
    with open(path, "rb") as f:
        return f.read()


def test_every_single_bit_flip_of_a_checkpoint_is_an_error(tmp_path):
    (data,) = ranks.run(small_checkpoint, 1, args=(str(tmp_path / "c.ckpt"),))
    members = _ckpt_file.unpack(data, "c.ckpt")
    assert {"meta", "model", "opt.exp_avg", "opt.exp_avg_sq", "rng.modules"} <= set(members)
    # The zip's structure (local headers with their names, the directory, the manifest, the
    # comment) bit by bit; the members' contents at a stride.
    z = zipfile.ZipFile(io.BytesIO(data))
    structure = set()
    for info in z.infolist():
        structure |= set(range(info.header_offset, info.header_offset + 30 + len(info.filename)))
    structure |= set(range(z.getinfo(_ckpt_file.MANIFEST).header_offset, len(data)))  # written last
    positions = sorted(structure | set(range(0, len(data), 61)))
    missed = []
    for byte in positions:
        for bit in range(8):
            bad = bytearray(data)
            bad[byte] ^= 1 << bit
            try:
                _ckpt_file.unpack(bytes(bad), "c.ckpt")
            except OSError as e:
                assert "c.ckpt" in str(e)
                continue
            missed.append((byte, bit))
    assert missed == [], f"{len(missed)} of {8 * len(positions)} flips loaded without error"
    assert 8 * len(positions) > 8000


def rename_member(data, old, new):
    """The flip the issue found: a member's name changed in the zip's directory and header."""
    assert len(old) == len(new)
    return data.replace(old.encode(), new.encode())


@pytest.mark.parametrize("damage, named", [
    ("rename", "'opt.exp_avg'"),
    ("drop", "'rng.modules'"),
    ("alter", "'model'"),
])
def test_a_missing_renamed_or_altered_member_is_an_oserror_naming_it(tmp_path, damage, named):
    (data,) = ranks.run(small_checkpoint, 1, args=(str(tmp_path / "c.ckpt"),))
    if damage == "rename":
        bad = rename_member(data, "opt.exp_avg.npy", "opt.exp_avf.npy")
    elif damage == "drop":
        src = zipfile.ZipFile(io.BytesIO(data))
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w") as z:
            for info in src.infolist():
                if info.filename != "rng.modules.npy":
                    z.writestr(info.filename, src.read(info.filename))
            z.comment = src.comment
        bad = out.getvalue()
    else:
        src = zipfile.ZipFile(io.BytesIO(data))
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w") as z:   # a consistent zip (CRCs right) whose model bytes changed
            for info in src.infolist():
                raw = src.read(info.filename)
                if info.filename == "model.npy":
                    raw = raw[:-1] + bytes([raw[-1] ^ 1])
                z.writestr(info.filename, raw)
            z.comment = src.comment
        bad = out.getvalue()
    with pytest.raises(OSError, match="is damaged") as e:
        _ckpt_file.unpack(bad, "c.ckpt")
    assert named in str(e.value)


def load_damaged(path):
    trainer = D.DistributedTrainer(mlp_with_dropout(3, 8), cx.CrossEntropyLoss(), cx.AdamOptimizer(1e-3))
    trainer.load_checkpoint(path)


def test_loading_a_damaged_checkpoint_fails_on_every_rank(tmp_path):
    (data,) = ranks.run(small_checkpoint, 1, args=(str(tmp_path / "c.ckpt"),))
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(rename_member(data, "opt.exp_avg.npy", "opt.exp_avf.npy"))
    outs = ranks.spawn(load_damaged, 2, args=(str(bad),))
    for o in outs:
        assert not o.ok and o.exc_type == "OSError", o.trace
        assert "is damaged" in o.message and "'opt.exp_avg'" in o.message


def test_a_version_1_file_still_loads_but_a_stripped_version_2_or_3_does_not(tmp_path):
    (data,) = ranks.run(small_checkpoint, 1, args=(str(tmp_path / "c.ckpt"),))
    members = _ckpt_file.unpack(data, "c.ckpt")
    meta = json.loads(members["meta"].tobytes().decode())
    old = tmp_path / "v1.ckpt"
    with open(old, "wb") as f:       # what version 1 wrote: np.savez, no manifest, no comment
        meta["version"] = 1
        np.savez(f, **{**members, "meta": np.frombuffer(json.dumps(meta).encode(), np.uint8)})
    ranks.run(load_damaged, 1, args=(str(old),))
    for version in (2, 3):
        stripped = tmp_path / f"v{version}-stripped.ckpt"
        with open(stripped, "wb") as f:  # the proof removed from a version 2 or 3 file
            meta["version"] = version
            np.savez(f, **{**members, "meta": np.frombuffer(json.dumps(meta).encode(), np.uint8)})
        (o,) = ranks.spawn(load_damaged, 1, args=(str(stripped),))
        assert not o.ok and o.exc_type == "OSError" and "whole-file checksum is missing" in o.message, o.trace


def save_into(directory):
    trainer = D.DistributedTrainer(mlp_with_dropout(3, 8), cx.CrossEntropyLoss(), cx.AdamOptimizer(1e-3))
    trainer.config = config()
    trainer.save_checkpoint(os.path.join(directory, "model.ckpt"))
    return sorted(os.listdir(directory))


def test_temporary_files_of_dead_writers_are_removed_at_the_next_save(tmp_path):
    host = _ckpt_file._host()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = os.getpid()                                     # this test process: a writer still running
    names = {
        "dead": f".tmp-{host}-{dead.pid}-1.ckpt",
        "live": f".tmp-{host}-{alive}-1.ckpt",
        "other host": f".tmp-elsewhere-{dead.pid}-1.ckpt",  # a shared file system: that host's business
        "old unnamed": ".tmp-abcd1234.ckpt",
        "new unnamed": ".tmp-efgh5678.ckpt",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"x" * 1000)
    hour_ago = time.time() - 2 * 3600
    os.utime(tmp_path / names["old unnamed"], (hour_ago, hour_ago))
    (left,) = ranks.run(save_into, 1, args=(str(tmp_path),))
    assert sorted(left) == sorted([names["live"], names["other host"], names["new unnamed"], "model.ckpt"])


def writer_killed_mid_save(directory):
    """Saves a large checkpoint in a child that is killed while writing: what a kill leaves."""
    code = textwrap.dedent(f"""
        import os, signal, threading
        from pycyxwiz.distributed import _ckpt_file
        real = os.fsync
        def die(fd):                    # the bytes are written, the rename has not happened
            os.kill(os.getpid(), signal.SIGKILL)
        os.fsync = die
        _ckpt_file.atomic_write({os.path.join(directory, "big.ckpt")!r}, b"y" * (8 << 20))
    """)
    r = subprocess.run([sys.executable, "-c", code], timeout=60)
    return r.returncode, sorted(os.listdir(directory))


def test_a_save_killed_mid_write_leaves_a_file_the_next_save_removes(tmp_path):
    rc, left = writer_killed_mid_save(str(tmp_path))
    assert rc == -9 and len(left) == 1 and left[0].startswith(".tmp-")   # what the issue found piling up
    (after,) = ranks.run(save_into, 1, args=(str(tmp_path),))
    assert after == ["model.ckpt"]


# ---- the trainer resumes by itself ------------------------------------------------------

def fit_in(directory, epochs, auto_resume=None, verbose=True):
    Xtr, ytr, _, _ = digits.split()
    trainer = D.DistributedTrainer(mlp_with_dropout(3, 24), cx.CrossEntropyLoss(), cx.AdamOptimizer(2e-3))
    c = config(epochs=epochs, batch_size=16, checkpoint_every_n_epochs=1, checkpoint_dir=directory,
               auto_resume=auto_resume)
    out = io.StringIO()
    import contextlib
    with contextlib.redirect_stdout(out):
        c.verbose = verbose
        h = trainer.fit(Xtr, ytr, c)
    return trainer.model.flat_parameters().copy(), h.epochs, out.getvalue()


def test_the_first_fit_resumes_from_the_newest_checkpoint_by_itself(tmp_path):
    full = ranks.run(fit_in, 2, args=(str(tmp_path / "full"), 4))
    part = str(tmp_path / "part")
    ranks.run(fit_in, 2, args=(part, 2))                      # a job that stopped after epoch 2
    resumed = ranks.run(fit_in, 2, args=(part, 4))
    for (wf, ef, _), (wr, er, text) in zip(full, resumed):
        assert np.array_equal(wf, wr)
        assert ef == [1, 2, 3, 4] and er == [1, 2, 3, 4]      # the history comes back with the checkpoint
    assert f"resuming from {os.path.join(part, 'epoch_0002.ckpt')}" in resumed[0][2]
    # auto_resume=False starts over: the same as a fresh run of 4 epochs.
    again = ranks.run(fit_in, 2, args=(part, 4, False))
    assert np.array_equal(again[0][0], full[0][0]) and "resuming" not in again[0][2]


def test_a_fit_resumed_after_a_finished_run_says_there_is_nothing_left_even_quietly(tmp_path):
    d = str(tmp_path / "c")
    first = ranks.run(fit_in, 2, args=(d, 2))
    again = ranks.run(fit_in, 2, args=(d, 2, None, False))  # the same job started again, verbose=False
    for (w1, e1, _), (w2, e2, _) in zip(first, again):
        assert np.array_equal(w1, w2) and e1 == e2 == [1, 2]  # nothing trained
    assert again[0][2] == (f"resuming from {os.path.join(d, 'epoch_0002.ckpt')} (2 of 2 epochs done); nothing left "
                           "to train (that run finished; raise config.epochs to train more); config.auto_resume = "
                           "False starts over\n")
    assert again[1][2] == ""  # rank 1 says nothing
    more = ranks.run(fit_in, 2, args=(d, 3, None, False))  # asked for more: says how much is left
    assert "(2 of 3 epochs done); 1 epoch left to train;" in more[0][2] and more[0][1] == [1, 2, 3]


def skip_damaged(directory):
    import warnings
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        w, epochs, text = fit_in(directory, 3)
    return [str(x.message) for x in seen], text


def test_auto_resume_falls_back_to_the_last_good_checkpoint(tmp_path):
    d = str(tmp_path / "c")
    ranks.run(fit_in, 2, args=(d, 3))
    with open(os.path.join(d, "epoch_0003.ckpt"), "r+b") as f:
        f.seek(300)
        b = f.read(1)
        f.seek(300)
        f.write(bytes([b[0] ^ 1]))
    (w0, t0), _ = ranks.run(skip_damaged, 2, args=(d,))
    assert any("epoch_0003.ckpt" in m for m in w0)
    assert f"resuming from {os.path.join(d, 'epoch_0002.ckpt')}" in t0


# ---- the launcher restarts the group ----------------------------------------------------

TRAIN = textwrap.dedent("""
    import os, signal, sys
    import numpy as np, pycyxwiz as cx
    D = cx.distributed
    out, kills = sys.argv[1], sys.argv[2]        # kills: "restart:rank:step,..." (steps count from 1)
    plan = {int(a): (int(b), int(c)) for a, b, c in (k.split(":") for k in kills.split(",") if k)}
    restart = int(os.environ.get("RESTART_COUNT", "0"))
    D.init()

    class Trainer(D.DistributedTrainer):
        def _after_step(self, config, world):
            super()._after_step(config, world)
            who, step = plan.get(restart, (-1, -1))
            if D.get_rank() == who and self._steps == step:
                print(f"killing rank {who} at step {step} of start {restart}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    X, y = cx.datasets.load_digits()
    m = cx.SequentialModel()
    m.add(cx.LinearModule(64, 32, seed=1)); m.add(cx.ReLUModule())
    m.add(cx.DropoutModule(0.25, seed=5)); m.add(cx.LinearModule(32, 10, seed=2))
    trainer = Trainer(m, cx.CrossEntropyLoss(), cx.AdamOptimizer(2e-3))
    c = D.DistributedTrainingConfig(epochs=4, batch_size=32, verbose=False, seed=7,
                                    checkpoint_every_n_epochs=1, checkpoint_dir=os.path.join(out, "ckpt"))
    trainer.fit(X, y, c)
    np.save(os.path.join(out, f"final{D.get_rank()}.npy"), m.flat_parameters())
    D.finalize()
""")


def launch(tmp_path, *args, env=None):
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT",
                                                           "MASTER_ADDR", "CX_MAX_RESTARTS")}
    e.update(MASTER_PORT=str(ranks.free_port()), DISTRIBUTED_TIMEOUT_MS="20000",
             DISTRIBUTED_OPERATION_TIMEOUT_MS="20000")
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "pycyxwiz.launch", *map(str, args)], capture_output=True,
                          text=True, timeout=240, env=e)


def test_a_job_whose_ranks_are_killed_twice_ends_with_the_parameters_of_an_uninterrupted_run(tmp_path):
    job = tmp_path / "train.py"
    job.write_text(TRAIN)
    ref, hit = tmp_path / "ref", tmp_path / "hit"
    ref.mkdir()
    hit.mkdir()
    r = launch(tmp_path, "--nproc-per-node", 2, job, ref, "")
    assert r.returncode == 0, r.stderr
    # 1797 samples, 2 ranks of batch 32: 29 steps an epoch. Rank 1 dies in epoch 2, then (after
    # resuming from epoch 1's checkpoint) rank 0 dies in epoch 3; random steps, fixed seed.
    rng = np.random.default_rng(int(os.environ.get("CX_TEST_SEED", "2026")))
    first, second = int(rng.integers(30, 58)), int(rng.integers(60, 87))
    kills = f"0:1:{first},1:0:{second}"  # steps count across starts: a checkpoint holds the count
    r = launch(tmp_path, "--nproc-per-node", 2, "--max-restarts", 3, job, hit, kills)
    assert r.returncode == 0, r.stderr + r.stdout
    assert r.stdout.count("killing rank") == 2, r.stdout
    assert "restarting every rank of this node (1 of at most 3 restarts, RESTART_COUNT=1)" in r.stderr
    assert "RESTART_COUNT=2" in r.stderr and "RESTART_COUNT=3" not in r.stderr
    for rank in (0, 1):
        assert np.array_equal(np.load(ref / f"final{rank}.npy"), np.load(hit / f"final{rank}.npy")), rank


FAILS = textwrap.dedent("""
    import os, sys
    print("start", os.environ["RESTART_COUNT"], flush=True)
    sys.exit(3 if os.environ["RANK"] == "1" else 0)
""")


def test_the_launcher_gives_up_after_max_restarts_with_the_ranks_exit_code(tmp_path):
    job = tmp_path / "fails.py"
    job.write_text(FAILS)
    r = launch(tmp_path, "--nproc-per-node", 2, job, env={"CX_MAX_RESTARTS": "2"})
    assert r.returncode == 3
    starts = sorted(line.split()[-1] for line in r.stdout.splitlines() if line.startswith("[rank 1] start"))
    assert starts == ["0", "1", "2"]
    assert r.stderr.count("[launch] rank 1 failed first: it exited with code 3") == 3
    assert "giving up after 2 restart(s)" in r.stderr


@pytest.mark.parametrize("value, text", [
    (("--max-restarts", "-1"), "--max-restarts must be >= 0, got -1"),
    ({"CX_MAX_RESTARTS": "two"}, "CX_MAX_RESTARTS='two' is not valid"),
])
def test_a_bad_restart_count_is_refused(tmp_path, value, text):
    job = tmp_path / "fails.py"
    job.write_text(FAILS)
    if isinstance(value, dict):
        r = launch(tmp_path, "--nproc-per-node", 2, job, env=value)
    else:
        r = launch(tmp_path, *value, "--nproc-per-node", 2, job)
    assert r.returncode != 0 and text in r.stderr


def join_with_generation():
    return D.get_world_size()


def test_a_rank_of_another_start_is_refused_by_name():
    outs = ranks.spawn(join_with_generation, 2, per_rank_env={1: {"RESTART_COUNT": "0"}, 0: {"RESTART_COUNT": "1"}},
                       env={"DISTRIBUTED_TIMEOUT_MS": 8000})
    assert not outs[1].ok and outs[1].exc_type == "ValueError", outs[1].trace
    assert "rank 1 (RESTART_COUNT=0) and rank 0 (RESTART_COUNT=1) belong to different starts" in outs[1].message
    assert "this rank is left over from an earlier start" in outs[1].message
    assert not outs[0].ok   # rank 0 waits for a rank 1 that never joins, then says so


def resume_other_architecture(directory, case):
    Xtr, ytr, _, _ = digits.split()
    hidden = 24 if case == "saved" else 40
    trainer = D.DistributedTrainer(mlp_with_dropout(3, hidden), cx.CrossEntropyLoss(), cx.AdamOptimizer(2e-3))
    c = config(epochs=1, batch_size=64, checkpoint_every_n_epochs=1, checkpoint_dir=directory)
    if case == "bad value":
        c.auto_resume = "yes"
    trainer.fit(Xtr, ytr, c)


@pytest.mark.parametrize("case, exc, text", [
    ("other model", "ValueError", "config.auto_resume found it in checkpoint_dir"),
    ("bad value", "ValueError", "auto_resume must be None, True or False, got 'yes'"),
])
def test_auto_resume_errors_say_what_to_do(tmp_path, case, exc, text):
    d = str(tmp_path / "c")
    ranks.run(resume_other_architecture, 2, args=(d, "saved"))     # a checkpoint of a 24-wide model
    for o in ranks.spawn(resume_other_architecture, 2, args=(d, case)):
        assert not o.ok and o.exc_type == exc, o.trace
        assert text in o.message
        if case == "other model":
            assert "set config.auto_resume = False, or empty that folder" in o.message
