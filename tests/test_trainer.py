"""DistributedTrainer: digits accuracy on 1, 2 and 4 ranks, evaluate against NumPy,
resume-from-checkpoint equality, a killed rank, printing, and every user-facing error.
"""
import contextlib
import io
import json
import os
import threading
import time

import numpy as np
import pytest

import digits
import models
import ranks
from models import mlp_with_dropout

import pycyxwiz as cx

D = cx.distributed


def mlp(seed=0, hidden=64):
    m = cx.SequentialModel()
    m.add(cx.LinearModule(64, hidden, seed=seed))
    m.add(cx.ReLUModule())
    m.add(cx.LinearModule(hidden, 10, seed=seed + 1))
    return m


def config(**kw):
    c = D.DistributedTrainingConfig(verbose=False, seed=42, **kw)
    return c


# ---- accuracy ----------------------------------------------------------------------

def fit_digits(epochs, batch):
    Xtr, ytr, Xte, yte = digits.split()
    model = mlp()
    trainer = D.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.AdamOptimizer(3e-3))
    h = trainer.fit(Xtr, ytr, Xte, yte, config(epochs=epochs, batch_size=batch))
    loss, acc = trainer.evaluate(Xte, yte)
    return acc, h.val_accuracies, h.world_size, h.effective_batch_size, h.samples_per_second, h.train_losses


def test_digits_on_2_and_4_ranks_reach_the_single_process_accuracy():
    (single,) = ranks.run(fit_digits, 1, args=(12, 32))
    assert single[0] > 0.93
    for world in (2, 4):
        res = ranks.run(fit_digits, world, args=(12, 32 // world), timeout=120)
        acc, val_accs, ws, eff, sps, losses = res[0]
        assert all(r[0] == acc for r in res)                 # every rank reports the same global numbers
        assert ws == world and eff == (32 // world) * world and sps > 0
        assert acc >= single[0] - 0.03, (world, acc, single[0])
        assert val_accs[-1] == acc and losses[-1] < losses[0]


# ---- evaluate vs NumPy ---------------------------------------------------------------

def evaluate_body(n):
    X, y = cx.datasets.load_digits()
    X, y = X[:n], y[:n]
    model = mlp(seed=5)
    trainer = D.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.SGDOptimizer(0.1))
    loss, acc = trainer.evaluate(X, y, batch_size=37)
    return loss, acc, [p.copy() for p in model.parameters()]


@pytest.mark.parametrize("world", [1, 3])
def test_evaluate_matches_numpy(world):
    n = 301                                                   # not a multiple of 3 or of the batch
    X, y = cx.datasets.load_digits()
    X, y = X[:n].astype(np.float64), y[:n]
    for loss, acc, (W1, b1, W2, b2) in ranks.run(evaluate_body, world, args=(n,)):
        h = np.maximum(X @ W1.T.astype(np.float64) + b1, 0)
        z = h @ W2.T.astype(np.float64) + b2
        z -= z.max(axis=1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        assert loss == pytest.approx(-logp[np.arange(n), y].mean(), rel=1e-5)
        assert acc == pytest.approx((z.argmax(axis=1) == y).mean(), abs=1e-12)


# ---- checkpoints -------------------------------------------------------------------

def fit_with_checkpoints(ckpt_dir, epochs, resume_from):
    Xtr, ytr, _, _ = digits.split()
    model = mlp(seed=9)
    trainer = D.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.AdamOptimizer(2e-3))
    c = config(epochs=epochs, batch_size=16, checkpoint_every_n_epochs=1, checkpoint_dir=ckpt_dir,
               validation_split=0.1)
    h = trainer.fit(Xtr, ytr, c, resume_from=resume_from)
    return model.flat_parameters().copy(), h.train_losses, h.val_accuracies


def test_resume_from_checkpoint_gives_the_weights_of_an_uninterrupted_run(tmp_path):
    full = ranks.run(fit_with_checkpoints, 2, args=(str(tmp_path / "a"), 4, None))
    assert sorted(os.listdir(tmp_path / "a")) == [f"epoch_{e:04d}.ckpt" for e in (1, 2, 3, 4)]
    resumed = ranks.run(fit_with_checkpoints, 2, args=(str(tmp_path / "b"), 4, str(tmp_path / "a" / "epoch_0002.ckpt")))
    for (wa, la, va), (wb, lb, vb) in zip(full, resumed):
        assert np.array_equal(wa, wb)
        assert la == lb and va == vb                         # the history continues too
    assert sorted(os.listdir(tmp_path / "b")) == ["epoch_0003.ckpt", "epoch_0004.ckpt"]


def fit_dropout_with_checkpoints(ckpt_dir, epochs, resume_from):
    Xtr, ytr, _, _ = digits.split()
    model = mlp_with_dropout(9, 64)
    initial_rng = model.get_rng_state().copy()
    trainer = D.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.AdamOptimizer(2e-3))
    forked_rng = model.get_rng_state().copy()
    c = config(epochs=epochs, batch_size=16, checkpoint_every_n_epochs=1, checkpoint_dir=ckpt_dir)
    h = trainer.fit(Xtr, ytr, c, resume_from=resume_from)
    return model.flat_parameters().copy(), h.train_losses, initial_rng, forked_rng, model.get_rng_state().copy()


def drop_rng_from_checkpoint(src, dst):
    """The file as version 1 wrote it before it held generator states (no manifest either)."""
    with np.load(src) as z:
        arrays = {k: z[k] for k in z.files if k not in ("rng.modules", "manifest.json")}
        assert "rng.modules" in z.files and z["rng.modules"].shape == (2, 1)   # one row per rank, one Dropout
    meta = json.loads(arrays["meta"].tobytes().decode())
    meta["version"] = 1
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    with open(dst, "wb") as f:                               # a file object: savez adds no ".npz"
        np.savez(f, **arrays)


def test_resume_with_dropout_draws_the_masks_of_an_uninterrupted_run_on_every_rank(tmp_path):
    full = ranks.run(fit_dropout_with_checkpoints, 2, args=(str(tmp_path / "a"), 3, None))
    (w0, l0, init0, fork0, end0), (w1, l1, init1, fork1, end1) = full
    # Every rank builds the same model, then DDP gives each rank its own dropout stream;
    # rank 0 keeps the model's own, so a world of one trains like the bare model.
    assert np.array_equal(init0, init1) and np.array_equal(fork0, init0)
    assert not np.array_equal(fork1, init1) and not np.array_equal(end0, end1)
    ckpt = str(tmp_path / "a" / "epoch_0001.ckpt")
    resumed = ranks.run(fit_dropout_with_checkpoints, 2, args=(str(tmp_path / "b"), 3, ckpt))
    for (wa, la, *_, ea), (wb, lb, *_, eb) in zip(full, resumed):
        assert np.array_equal(wa, wb)                        # bit-identical weights on every rank
        assert la == lb and np.array_equal(ea, eb)
    # Control: the same checkpoint without the generator states resumes with other masks.
    stale = str(tmp_path / "stale.ckpt")
    drop_rng_from_checkpoint(ckpt, stale)
    blind = ranks.run(fit_dropout_with_checkpoints, 2, args=(str(tmp_path / "c"), 3, stale))
    assert not np.array_equal(blind[0][0], full[0][0])


def die_after_first_checkpoint(ckpt_dir):
    if D.get_rank() == 2:
        def killer():
            while not os.path.exists(os.path.join(ckpt_dir, "epoch_0001.ckpt")):
                time.sleep(0.005)
            os._exit(3)
        threading.Thread(target=killer, daemon=True).start()
    Xtr, ytr, _, _ = digits.split()
    trainer = D.DistributedTrainer(mlp(), cx.CrossEntropyLoss(), cx.AdamOptimizer(1e-3))
    trainer.fit(Xtr, ytr, config(epochs=500, batch_size=8, checkpoint_every_n_epochs=1, checkpoint_dir=ckpt_dir))


def load_last(path):
    trainer = D.DistributedTrainer(mlp(), cx.CrossEntropyLoss(), cx.AdamOptimizer(1e-3))
    trainer.load_checkpoint(path)
    _, _, Xte, yte = digits.split()
    return trainer._epoch, trainer.evaluate(Xte, yte)[1]


def test_a_killed_rank_ends_every_rank_with_a_clear_error_and_the_checkpoint_stays_loadable(tmp_path):
    d = str(tmp_path)
    t0 = time.monotonic()
    outs = ranks.spawn(die_after_first_checkpoint, 3, args=(d,), timeout=90)
    assert time.monotonic() - t0 < 60                        # no hang: the survivors fail fast
    assert outs[2].exc_type == "Died" and outs[2].exitcode == 3
    for o in outs[:2]:
        assert not o.ok and o.is_a("DistributedError"), (o.exc_type, o.message)
        assert "rank 2" in o.message, o.message
    ckpts = sorted(f for f in os.listdir(d) if f.endswith(".ckpt") and f.startswith("epoch_"))
    assert ckpts and not any(f.startswith(".tmp") for f in os.listdir(d))   # no half-written file
    epoch, acc = ranks.run(load_last, 1, args=(os.path.join(d, ckpts[-1]),))[0]
    assert epoch == int(ckpts[-1][6:10]) and acc > 0.5


# ---- printing --------------------------------------------------------------------------

class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def fit_printing(tty):
    Xtr, ytr, _, _ = digits.split()
    trainer = D.DistributedTrainer(mlp(), cx.CrossEntropyLoss(), cx.AdamOptimizer(1e-3))
    buf = FakeTTY() if tty else io.StringIO()
    with contextlib.redirect_stdout(buf):
        trainer.fit(Xtr, ytr, D.DistributedTrainingConfig(epochs=2, batch_size=64, verbose=True,
                                                           log_every_n_batches=5))
    return buf.getvalue()


def test_only_rank_0_prints_plain_lines_without_a_terminal():
    out0, out1 = ranks.run(fit_printing, 2, args=(False,))
    assert out1 == ""
    assert "\r" not in out0 and "\x1b" not in out0
    lines = out0.splitlines()
    assert [l for l in lines if " - loss " in l and "batch" not in l][0].startswith("Epoch 1/2 - loss ")
    assert any(l.startswith("Epoch 2/2 batch 5/") and "samples/s" in l for l in lines)


def test_a_terminal_gets_a_progress_bar():
    out0, out1 = ranks.run(fit_printing, 2, args=(True,))
    assert out1 == "" and "\rEpoch 1/2 [" in out0 and "samples/s" in out0


# ---- errors ------------------------------------------------------------------------------

def trainer_without_init():
    D.DistributedTrainer(mlp(), cx.CrossEntropyLoss(), cx.AdamOptimizer())


def test_trainer_before_init_says_to_call_init():
    (o,) = ranks.spawn(trainer_without_init, 1, init=False)
    assert o.exc_type == "RuntimeError" and "call cx.distributed.init() first" in o.message


def misuse(case, path=""):
    Xtr, ytr, _, _ = digits.split()
    trainer = D.DistributedTrainer(mlp(), cx.CrossEntropyLoss(), cx.AdamOptimizer())
    if case == "batch":
        trainer.fit(Xtr, ytr, config(batch_size=0))
    elif case == "lengths":
        trainer.fit(Xtr, ytr[:-1], config())
    elif case == "split":
        trainer.fit(Xtr, ytr, config(validation_split=1.5))
    elif case == "typo":
        D.DistributedTrainingConfig().epoch = 3
    elif case == "loss":
        D.DistributedTrainer(mlp(), "mse", cx.AdamOptimizer())
    elif case == "labels":
        trainer.fit(Xtr, ytr.astype(np.float32)[:, None] * 0 + 20, config(epochs=1))
    elif case == "missing":
        trainer.load_checkpoint(path)
    elif case == "corrupt":
        with open(path, "wb") as f:
            f.write(b"not a checkpoint")
        trainer.load_checkpoint(path)
    elif case == "arch":
        trainer.save_checkpoint(path)
        other = D.DistributedTrainer(mlp(hidden=32), cx.CrossEntropyLoss(), cx.AdamOptimizer())
        other.load_checkpoint(path)
    elif case == "optimizer":
        trainer.save_checkpoint(path)
        D.DistributedTrainer(mlp(), cx.CrossEntropyLoss(), cx.SGDOptimizer()).load_checkpoint(path)


@pytest.mark.parametrize("case, exc, text", [
    ("batch", "ValueError", "DistributedTrainingConfig.batch_size must be an int >= 1, got 0"),
    ("lengths", "ValueError", "fit: X has 1437 samples but y has 1436; they must match"),
    ("split", "ValueError", "validation_split must be in [0, 1), got 1.5"),
    ("typo", "AttributeError", "epoch"),
    ("loss", "TypeError", "loss_fn must be cx.CrossEntropyLoss, cx.MSELoss or cx.BCEWithLogitsLoss, got a str"),
    ("labels", "ValueError", "CrossEntropyLoss: target must have the output's shape (32, 10), got (32, 1)"),
])
def test_misuse_is_reported(case, exc, text):
    (o,) = ranks.spawn(misuse, 1, args=(case,))
    assert o.exc_type == exc and text in o.message, (o.exc_type, o.message)


def fit_with_matmul_precision(precision):
    X, y, _, _ = digits.split()
    tr = D.DistributedTrainer(mlp(), cx.CrossEntropyLoss(), cx.SGDOptimizer(0.1))
    return tr.fit(X[:64], y[:64], config(epochs=1, batch_size=16, matmul_precision=precision)).train_losses


def test_matmul_precision_other_than_float32_is_refused_by_the_cpu_trainer_on_every_rank():
    outs = ranks.spawn(fit_with_matmul_precision, 2, args=("bf16",), timeout=60)
    for o in outs:
        assert o.exc_type == "ValueError", (o.exc_type, o.message)
        assert (f"DistributedTrainer (rank {o.rank}): matmul_precision='bf16' rounds the inputs of the GPU's matrix "
                "products (cuBLAS, BackendType.NCCL); the CPU trainer's are float32 only") in o.message, o.message
    # float32, the default, trains as ever
    (losses,) = ranks.run(fit_with_matmul_precision, 1, args=("float32",))
    assert len(losses) == 1 and np.isfinite(losses[0])


def test_a_matmul_precision_that_does_not_exist_is_refused_before_fit_starts():
    for bad in ("fp16", "bfloat16", None):
        with pytest.raises(ValueError, match=r"DistributedTrainingConfig.matmul_precision must be 'float32', 'tf32' "
                                             r"or 'bf16', got " + repr(repr(bad))[1:-1]):
            D.DistributedTrainer._check_config(config(matmul_precision=bad))


@pytest.mark.parametrize("case, exc, text", [
    ("missing", "OSError", "load_checkpoint: cannot read"),
    ("corrupt", "OSError", "is not a readable pycyxwiz checkpoint"),
    ("arch", "ValueError", "holds a model with 3 layers and 4810 parameters, but this trainer's model has 3 layers "
                           "and 2410 parameters"),
    ("optimizer", "ValueError", "holds Adam optimizer state but the trainer's optimizer is"),
])
@pytest.mark.parametrize("world", [1, 2])
def test_bad_checkpoints_are_reported_on_every_rank(tmp_path, case, exc, text, world):
    outs = ranks.spawn(misuse, world, args=(case, str(tmp_path / "x.ckpt")))
    for o in outs:
        assert not o.ok and text in o.message, (o.exc_type, o.message)
        assert o.exc_type == exc or o.is_a(exc)


# ---- the examples, launched by hand as the seed shows (RANK=... python script.py) ----------

def run_script(args, world, cwd):
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ranks.free_port()), WORLD_SIZE=str(world),
               OPENBLAS_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, os.path.join(root, "examples", args[0]), *args[1:]], cwd=cwd,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * world, outs
    return outs


def test_train_digits_example_on_two_ranks_reports_held_out_accuracy(tmp_path):
    out0, out1 = run_script(["train_digits.py", "--epochs", "8"], 2, tmp_path)
    assert out1 == ""
    line = [l for l in out0.splitlines() if l.startswith("held-out test:")][0]
    acc = float(line.split("accuracy ")[1].split()[0])
    assert acc > 0.93
    # The main job saves what it trained, and says where.
    saved = tmp_path / "digits.cyxmodel"
    assert f"saved the model to {saved}" in out0
    model = cx.SequentialModel.load(str(saved))
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from _data import load_digits, train_test_split
    X, y = load_digits()
    _, _, X_test, y_test = train_test_split(X, y, test_fraction=0.2, seed=0)
    model.eval()
    assert abs(float(np.mean(model.forward(X_test).argmax(1) == y_test)) - acc) < 1e-3


def test_train_cnn_digits_example_on_two_ranks_reaches_97_percent_held_out(tmp_path):
    out0, out1 = run_script(["train_cnn_digits.py", "--quiet"], 2, tmp_path)
    assert out1 == ""
    line = [l for l in out0.splitlines() if l.startswith("held-out test:")][0]
    acc = float(line.split("accuracy ")[1].split()[0])
    assert acc >= 0.97, out0
    saved = tmp_path / "cnn_digits.cyxmodel"
    assert f"saved the model to {saved}" in out0
    model = cx.SequentialModel.load(str(saved))
    assert "SyncBatchNorm" in repr(model[3]) and type(model[5]).__name__ == "ResidualModule"
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from _data import load_digits, train_test_split
    X, y = load_digits()
    _, _, X_test, y_test = train_test_split(X.reshape(-1, 1, 8, 8), y, test_fraction=0.2, seed=0)
    model.eval()
    assert abs(float(np.mean(model.forward(X_test).argmax(1) == y_test)) - acc) < 1e-3


def test_quickstart_runs_as_a_plain_script(tmp_path):
    (out,) = run_script(["quickstart.py"], 1, tmp_path)
    assert "Epoch 10/10" in out and (tmp_path / "model.cyxmodel").exists()


# ---- the trainer's own host collectives (RNG gather, checkpoint broadcast) --------------------

def host_collectives_body():
    r, w = D.get_rank(), D.get_world_size()
    core = D.DistributedTrainer(mlp(), cx.CrossEntropyLoss(), cx.AdamOptimizer(1e-3))._core
    mine = np.array([r * 10 + 1, r * 10 + 2], np.uint64)
    rows = np.zeros((w, 2), np.uint64)
    core.all_gather_host(rows, mine)
    buf = np.arange(5, dtype=np.int64) * (7 if r == 1 else 0)
    core.broadcast_host(buf, 1)
    errors = []
    for call in (lambda: core.all_gather_host(np.zeros((w + 1, 2), np.uint64), mine),
                 lambda: core.all_gather_host(np.zeros((2, w), np.uint64).T, mine),
                 lambda: core.broadcast_host(np.arange(6)[::2], 0)):
        try:
            call()
            errors.append("no error")
        except ValueError as e:
            errors.append(str(e))
    return rows.tolist(), buf.tolist(), errors


def test_trainer_host_collectives_gather_broadcast_and_check_their_arrays():
    for rows, buf, errors in ranks.run(host_collectives_body, 2):
        assert rows == [[1, 2], [11, 12]]
        assert buf == [0, 7, 14, 21, 28]
        assert "world_size times" in errors[0]
        assert "C-contiguous" in errors[1] and "C-contiguous" in errors[2]


def fit_with_a_nan_row():
    X, y, m = models.digits_with_a_nan_row()
    cfg = cx.distributed.DistributedTrainingConfig()
    cfg.epochs, cfg.batch_size, cfg.verbose = 2, 64, False
    cfg.nonfinite = "off"  # the gradient check would name it first, on every rank (tests/test_nonfinite.py)
    cx.distributed.DistributedTrainer(m, cx.CrossEntropyLoss(), cx.SGDOptimizer(0.05)).fit(X, y, cfg)


def test_a_nan_in_one_input_row_is_named_at_its_step_with_its_rows():
    """fit used to finish with a finite loss (ReLU made the NaN 0); now, with the gradient check off, the rank
    whose batch held row 17 raises NonFiniteError at that step (fit's per-step loss check), naming the epoch, the
    batch and its rows, and the other rank names it."""
    import re
    outs = ranks.spawn(fit_with_a_nan_row, 2, timeout=120)
    bad = [o for o in outs if o.exc_type == "NonFiniteError"]
    assert len(bad) == 1, [(o.rank, o.exc_type, o.message[:200]) for o in outs]
    msg = bad[0].message
    assert msg.startswith(f"rank {bad[0].rank}: the loss of epoch 1, batch ") and "was nan (not finite)" in msg, msg
    rows = msg[msg.index("[") + 1:msg.index("]")]
    assert re.search(r"(^|, )17(,|$)", rows), rows
    other = next(o for o in outs if o is not bad[0])
    assert other.exc_type == "DistributedConnectionError", (other.exc_type, other.message[:300])
    assert f"rank {bad[0].rank} failed: NonFiniteError: " in other.message, other.message[:300]
