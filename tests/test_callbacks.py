"""cx.callbacks in DistributedTrainer.fit on 2 real ranks: the hooks and their logs, EarlyStopping, ModelCheckpoint,
EMA, CSVLogger, a raising callback, a restart that keeps the best score, and every misuse's message."""
import csv
import os

import numpy as np
import pytest

import digits
import ranks

import pycyxwiz as cx

D = cx.distributed
C = cx.callbacks


def mlp(seed=0, hidden=32, dropout=False):
    m = cx.SequentialModel()
    m.add(cx.LinearModule(64, hidden, seed=seed))
    m.add(cx.ReLUModule())
    if dropout:
        m.add(cx.DropoutModule(0.2, seed=seed + 7))
    m.add(cx.LinearModule(hidden, 10, seed=seed + 1))
    return m


def config(**kw):
    return D.DistributedTrainingConfig(verbose=False, seed=42, **kw)


def data(n_train=512, n_val=128):
    Xtr, ytr, Xte, yte = digits.split()
    return Xtr[:n_train], ytr[:n_train], Xte[:n_val], yte[:n_val]


class Recorder(C.Callback):
    """Every call fit makes, with its arguments (logs copied)."""

    def __init__(self):
        self.calls = []

    def on_train_begin(self, trainer):
        self.calls.append(("train_begin",))

    def on_epoch_begin(self, trainer, epoch):
        self.calls.append(("epoch_begin", epoch))

    def on_batch_end(self, trainer, step, logs):
        self.calls.append(("batch_end", step, dict(logs)))

    def on_epoch_end(self, trainer, epoch, logs):
        self.calls.append(("epoch_end", epoch, dict(logs)))

    def on_train_end(self, trainer):
        self.calls.append(("train_end",))


# ---- the hooks ---------------------------------------------------------------------------------

def hooks_body():
    Xtr, ytr, Xv, yv = data()
    trainer = D.DistributedTrainer(mlp(), cx.CrossEntropyLoss(), cx.AdamOptimizer(2e-3))
    rec = Recorder()
    h = trainer.fit(Xtr, ytr, Xv, yv, config(epochs=2, batch_size=64), callbacks=[rec])
    return rec.calls, h.train_losses, h.train_accuracies, h.val_losses, h.val_accuracies


def test_every_hook_runs_on_every_rank_in_order_with_the_same_global_logs():
    (calls0, losses, accs, vlosses, vaccs), (calls1, *_) = ranks.run(hooks_body, 2)
    # Only timings may differ between ranks' logs; the logs' timings are the slowest rank's, so they agree too.
    assert calls0 == calls1
    kinds = [c[0] for c in calls0]
    per_epoch = 512 // 2 // 64                                   # batches per rank per epoch
    assert kinds == (["train_begin"] + (["epoch_begin"] + ["batch_end"] * per_epoch + ["epoch_end"]) * 2
                     + ["train_end"])
    steps = [c[1] for c in calls0 if c[0] == "batch_end"]
    assert steps == list(range(1, 2 * per_epoch + 1))
    ends = [c for c in calls0 if c[0] == "epoch_end"]
    assert [c[1] for c in ends] == [1, 2]
    for (_, epoch, logs), loss, acc, vl, va in zip(ends, losses, accs, vlosses, vaccs):
        assert list(logs) == ["epoch", "loss", "accuracy", "val_loss", "val_accuracy", "lr", "samples_per_second",
                              "epoch_time"]
        assert (logs["epoch"], logs["loss"], logs["accuracy"], logs["val_loss"], logs["val_accuracy"]) == \
            (epoch, loss, acc, vl, va)
        assert logs["lr"] == 2e-3 and logs["samples_per_second"] > 0 and logs["epoch_time"] > 0
    for epoch in (1, 2):
        batch_logs = [c[2] for c in calls0 if c[0] == "batch_end" and c[2]["epoch"] == epoch]
        assert [b["batch"] for b in batch_logs] == list(range(1, per_epoch + 1))
        # The running mean over every rank's samples: after the last batch it is the epoch's loss.
        assert batch_logs[-1]["loss"] == ends[epoch - 1][2]["loss"]
        assert batch_logs[-1]["accuracy"] == ends[epoch - 1][2]["accuracy"]


# ---- EarlyStopping -------------------------------------------------------------------------------

class StopOnRank(C.Callback):
    """Sets stop_training on one rank only, after `epoch`."""

    def __init__(self, rank, epoch):
        self.rank, self.epoch = rank, epoch

    def on_epoch_end(self, trainer, epoch, logs):
        if trainer.get_rank() == self.rank and epoch == self.epoch:
            trainer.stop_training = True
            trainer.stop_reason = f"rank {self.rank} had enough"


def early_stopping_body(case, patience=2):
    Xtr, ytr, Xv, yv = data()
    model = mlp()
    trainer = D.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.AdamOptimizer(2e-3))
    rec = Recorder()
    if case == "early":
        # val_loss falls every epoch here, so in mode "max" epoch 1 stays the best: with patience 2 the run
        # stops after epoch 3 of 10 (two epochs without improvement, as Keras and Lightning count).
        cbs = [C.EarlyStopping(monitor="val_loss", patience=patience, mode="max"), rec]
    else:
        cbs = [StopOnRank(1, 2), rec]
    h = trainer.fit(Xtr, ytr, Xv, yv, config(epochs=10, batch_size=64), callbacks=cbs)
    return (h.epochs, h.stopped_early, h.stop_reason, h.stopped_epoch, h.val_losses, trainer.stop_training,
            [c[0] for c in rec.calls][-1], model.flat_parameters().copy())


def test_early_stopping_stops_every_rank_after_the_same_epoch():
    outs = ranks.run(early_stopping_body, 2, args=("early",))
    for epochs, stopped, reason, at, vlosses, flag, last_call, _ in outs:
        assert epochs == [1, 2, 3] and stopped and at == 3 and flag
        assert vlosses[0] > vlosses[1] > vlosses[2]               # why epoch 1 stayed the best in mode "max"
        assert reason.startswith("EarlyStopping: val_loss did not improve (mode 'max', min_delta 0) for 2 epochs; "
                                 "the best was ") and reason.endswith("at epoch 1")
        assert last_call == "train_end"
    assert np.array_equal(outs[0][-1], outs[1][-1])


def test_early_stopping_with_patience_one_stops_at_the_first_epoch_without_improvement():
    # Keras's and Lightning's count: patience=1 tolerates no epoch beyond the one that did not improve.
    outs = ranks.run(early_stopping_body, 2, args=("early", 1))
    for epochs, stopped, reason, at, vlosses, flag, _, _ in outs:
        assert epochs == [1, 2] and stopped and at == 2 and flag
        assert vlosses[0] > vlosses[1]
        assert reason.startswith("EarlyStopping: val_loss did not improve (mode 'max', min_delta 0) for 1 epoch; "
                                 "the best was ") and reason.endswith("at epoch 1")


def auto_mode_body():
    Xtr, ytr, Xv, yv = data()
    trainer = D.DistributedTrainer(mlp(), cx.CrossEntropyLoss(), cx.AdamOptimizer(2e-3))
    stop = C.EarlyStopping(monitor="val_accuracy", patience=2)     # no mode: auto, so higher is better
    h = trainer.fit(Xtr, ytr, Xv, yv, config(epochs=6, batch_size=64), callbacks=[stop])
    return stop.mode, h.val_accuracies, h.stopped_early, stop.best_score


def test_early_stopping_on_accuracy_without_a_mode_maximises_it():
    # In mode "min" this run would stop after epoch 3, its best the first epoch's (lowest) accuracy.
    for mode, accs, stopped, best in ranks.run(auto_mode_body, 2):
        assert mode == "max" and best == max(accs)
        assert not stopped or accs.index(best) == len(accs) - 3    # stopped: two epochs after the best
        assert accs[-1] > accs[0]


def test_auto_mode_minimises_a_loss_maximises_an_accuracy_and_asks_for_anything_else():
    assert [C.EarlyStopping(monitor=m).mode for m in ("val_loss", "loss", "val_accuracy", "accuracy", "val_acc")] \
        == ["min", "min", "max", "max", "max"]
    assert C.ModelCheckpoint("d").mode == "min" and C.ModelCheckpoint("d", monitor="val_accuracy").mode == "max"
    assert C.EarlyStopping(monitor="val_accuracy", mode="min").mode == "min"      # said outright: kept
    assert C.ModelCheckpoint("d", monitor="epoch_time", save_best=False).save_last  # nothing compared: no mode needed
    assert C.EarlyStopping(monitor="val_f1").mode == "auto"     # a callback's own key: decided by the first epoch


def own_key_body(mode):
    class F1(C.Callback):       # adds a key to the epoch logs, which the callbacks after it see
        def on_epoch_end(self, trainer, epoch, logs):
            logs["val_f1"] = 0.5 + 0.1 * epoch

    Xtr, ytr, Xv, yv = data(128, 64)
    trainer = D.DistributedTrainer(mlp(), cx.CrossEntropyLoss(), cx.AdamOptimizer(1e-3))
    stop = C.EarlyStopping(monitor="val_f1", patience=1, **({"mode": mode} if mode else {}))
    h = trainer.fit(Xtr, ytr, Xv, yv, config(epochs=3), callbacks=[F1(), stop])
    return h.epochs, stop.best_score


def test_a_callbacks_own_key_needs_a_mode_and_is_asked_for_it_at_the_first_epoch():
    (o,) = ranks.spawn(own_key_body, 1, args=(None,))
    assert o.exc_type == "ValueError" and ("callback EarlyStopping.on_epoch_end: EarlyStopping: mode='auto' cannot "
                                           "tell whether 'val_f1' should fall or rise") in o.message, o.message
    assert ranks.run(own_key_body, 1, args=("max",)) == [([1, 2, 3], 0.5 + 0.1 * 3)]


def test_a_stop_asked_on_one_rank_stops_every_rank_with_its_reason():
    outs = ranks.run(early_stopping_body, 2, args=("one rank",))
    for epochs, stopped, reason, at, _, flag, _, _ in outs:
        assert epochs == [1, 2] and stopped and at == 2 and flag
        assert reason == "rank 1 had enough"


# ---- ModelCheckpoint ------------------------------------------------------------------------------

class ParamsPerEpoch(C.Callback):
    def __init__(self):
        self.seen = {}

    def on_epoch_end(self, trainer, epoch, logs):
        self.seen[epoch] = (logs["val_loss"], trainer.model.flat_parameters().copy())


class MomentumPerEpoch(C.Callback):
    def __init__(self):
        self.seen = {}

    def on_epoch_end(self, trainer, epoch, logs):
        self.seen[epoch] = trainer.optimizer.state_dict()["momentum_buffer"].copy()


def checkpoint_body(directory):
    Xtr, ytr, Xv, yv = data()
    model = mlp(seed=3)
    # SGD with a large step: val_loss goes down, then up and down again, so the best epoch is not the last.
    trainer = D.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.SGDOptimizer(0.9, momentum=0.9))
    ckpt, seen, momentum = C.ModelCheckpoint(directory, monitor="val_loss"), ParamsPerEpoch(), MomentumPerEpoch()
    trainer.fit(Xtr, ytr, Xv, yv, config(epochs=8, batch_size=32), callbacks=[ckpt, seen, momentum])
    fresh = D.DistributedTrainer(mlp(seed=99), cx.CrossEntropyLoss(), cx.SGDOptimizer(0.9, momentum=0.9))
    fresh.load_checkpoint(os.path.join(directory, "best.ckpt"))
    best = fresh.model.flat_parameters().copy(), fresh.optimizer.state_dict()["momentum_buffer"].copy()
    fresh.load_checkpoint(os.path.join(directory, "last.ckpt"))
    last = fresh.model.flat_parameters().copy(), fresh.optimizer.state_dict()["momentum_buffer"].copy()
    return (ckpt.best_score, ckpt.best_epoch, ckpt.best_path, {e: v[0] for e, v in seen.seen.items()},
            seen.seen, momentum.seen, best, last, model.flat_parameters().copy(), sorted(os.listdir(directory)))


def test_best_ckpt_holds_the_parameters_of_the_best_monitored_epoch(tmp_path):
    d = str(tmp_path / "ckpt")
    for score, epoch, path, vlosses, seen, momentum, best, last, final, files in ranks.run(checkpoint_body, 2,
                                                                                           args=(d,)):
        best_epoch = min(vlosses, key=vlosses.get)
        assert 1 < best_epoch < 8, vlosses                       # the test means something: best is neither end
        assert (epoch, score, path) == (best_epoch, vlosses[best_epoch], os.path.join(d, "best.ckpt"))
        assert np.array_equal(best[0], seen[best_epoch][1])
        assert np.array_equal(last[0], final) and np.array_equal(last[0], seen[8][1])
        # The optimizer's state too, although each save copies it into the arrays of the save before (Note
        # [Checkpoints written in the background]): best.ckpt keeps its epoch's.
        assert not np.array_equal(momentum[best_epoch], momentum[8])
        assert np.array_equal(best[1], momentum[best_epoch]) and np.array_equal(last[1], momentum[8])
        assert files == ["best.ckpt", "last.ckpt"]                # rank 0 writes, rank 1 does not add files


def reuse_body():
    Xtr, ytr, _, _ = data(256, 64)
    trainer = D.DistributedTrainer(mlp(seed=4), cx.CrossEntropyLoss(), cx.AdamOptimizer(3e-3))
    ema = C.EMA(0.9)
    trainer.fit(Xtr, ytr, config(epochs=1, batch_size=32), callbacks=[ema])
    trainer._callbacks = [ema]
    before = trainer._checkpoint_members()
    kept = {k: v.copy() for k, v in before.items()}
    trainer.fit(Xtr, ytr, config(epochs=1, batch_size=32), callbacks=[ema])
    trainer._callbacks = [ema]
    fresh = trainer._checkpoint_members()
    again = trainer._checkpoint_members(before)       # the arrays of a checkpoint written already, reused
    reused = [k for k in again if again[k] is before[k]]
    same = all(np.array_equal(again[k], fresh[k]) for k in fresh if k != "meta")
    # Arrays that do not fit (size, dtype) are left alone, and new ones made.
    misfit = {"opt.exp_avg": np.zeros(3, np.float32), "opt.exp_avg_sq": fresh["opt.exp_avg_sq"].astype(np.float64),
              "cb.EMA.shadow": np.zeros(5, np.float32)}
    odd = trainer._checkpoint_members(misfit)
    untouched = not misfit["opt.exp_avg"].any() and not misfit["cb.EMA.shadow"].any()
    odd_ok = all(odd[k] is not misfit[k] and np.array_equal(odd[k], fresh[k]) for k in misfit)
    moved = not np.array_equal(kept["opt.exp_avg"], fresh["opt.exp_avg"])
    return sorted(reused), same, untouched, odd_ok, moved


def test_a_save_reuses_the_arrays_of_the_save_before_where_they_fit():
    (reused, same, untouched, odd_ok, moved), = ranks.run(reuse_body, 1)
    assert reused == ["cb.EMA.shadow", "opt.exp_avg", "opt.exp_avg_sq"]
    assert moved and same and untouched and odd_ok


# ---- EMA ------------------------------------------------------------------------------------------------

class ParamsPerStep(C.Callback):
    batch_metrics = False

    def __init__(self):
        self.first, self.steps, self.ema_val = None, [], []

    def on_train_begin(self, trainer):
        self.first = trainer.model.flat_parameters().copy()

    def on_batch_end(self, trainer, step, logs):
        self.steps.append(trainer.model.flat_parameters().copy())


class EvaluatesWithEma(C.Callback):
    def __init__(self, ema, Xv, yv):
        self.ema, self.Xv, self.yv, self.pairs = ema, Xv, yv, []

    def on_epoch_end(self, trainer, epoch, logs):
        with self.ema.average_parameters(trainer.model):
            here = trainer.evaluate(self.Xv, self.yv, batch_size=256)
        self.pairs.append(((logs["val_loss"], logs["val_accuracy"]), here))


def ema_body(directory, decay):
    Xtr, ytr, Xv, yv = data()
    model = mlp(seed=5, dropout=True)
    trainer = D.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.AdamOptimizer(3e-3))
    ema = C.EMA(decay=decay, evaluate=True)
    seen, check = ParamsPerStep(), EvaluatesWithEma(ema, Xv, yv)
    trainer.fit(Xtr, ytr, Xv, yv, config(epochs=3, batch_size=32),
                callbacks=[seen, ema, check, C.ModelCheckpoint(directory, save_best=False)])
    before = model.flat_parameters().copy()
    with ema.average_parameters(model):
        inside = model.flat_parameters().copy()
    after = model.flat_parameters().copy()
    saved = C.EMA.from_checkpoint(os.path.join(directory, "last.ckpt")).flat_parameters()
    other = mlp(seed=11, dropout=True)
    ema.apply_to(other)
    return (seen.first, seen.steps, ema.flat_parameters(), ema.updates, check.pairs, before, inside, after, saved,
            other.flat_parameters().copy())


def test_ema_is_the_recurrence_of_the_parameters_seen_after_every_step(tmp_path):
    decay = 0.9
    for rank, out in enumerate(ranks.run(ema_body, 2, args=(str(tmp_path / f"c"), decay))):
        first, steps, shadow, updates, pairs, before, inside, after, saved, applied = out
        assert len(steps) == updates == 3 * (512 // 2 // 32)
        ema = first.copy()
        for p in steps:
            ema = np.float32(decay) * ema + np.float32(1 - decay) * p
        assert np.array_equal(shadow, ema)
        assert not np.array_equal(shadow, steps[-1])
        # evaluate=True: fit's val metrics are those of the averaged weights.
        for in_logs, computed in pairs:
            assert in_logs == computed
        assert np.array_equal(inside, shadow) and np.array_equal(before, after) and np.array_equal(after, steps[-1])
        assert np.array_equal(saved, shadow) and np.array_equal(applied, shadow)


OPTIMIZERS = {
    "sgd-nesterov": lambda: cx.SGDOptimizer(0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
    "adam": lambda: cx.AdamOptimizer(3e-3, weight_decay=1e-4),
    "adamw": lambda: cx.AdamWOptimizer(3e-3),
    "rmsprop": lambda: cx.RMSpropOptimizer(1e-3, momentum=0.9),
}


def ema_optimizer_body(optimizer, shard):
    Xtr, ytr, _, _ = data(256, 64)
    out = []
    for with_ema in (False, True):
        # 64*97 + 97 + 97*10 + 10 = 7285 parameters, a tail (5 past a multiple of 8) the kernels take one at a time.
        model = mlp(seed=5, hidden=97)
        trainer = D.DistributedTrainer(model, cx.CrossEntropyLoss(), OPTIMIZERS[optimizer]())
        seen, ema = ParamsPerStep(), C.EMA(decay=0.8)
        trainer.fit(Xtr, ytr, config(epochs=2, batch_size=32, shard_optimizer_state=shard),
                    callbacks=[seen, ema] if with_ema else [seen])
        out.append((model.flat_parameters().copy(), seen.first, seen.steps, ema.flat_parameters()
                    if with_ema else None))
    return out


@pytest.mark.parametrize("optimizer, shard", [("sgd-nesterov", False), ("adam", False), ("adamw", False),
                                              ("rmsprop", False), ("adam", True)])
def test_ema_with_every_optimizer_is_the_recurrence_and_leaves_the_parameters_alone(optimizer, shard):
    # Note [EMA off the critical path]: the update owed by a step is made in the next, after backward.
    for (plain, _, plain_steps, _), (params, first, steps, shadow) in ranks.run(ema_optimizer_body, 2,
                                                                                args=(optimizer, shard)):
        assert params.size == 7285 and len(steps) == 2 * (256 // 2 // 32)
        assert np.array_equal(params, plain)       # the same bits as without an EMA
        assert all(np.array_equal(a, b) for a, b in zip(steps, plain_steps))
        ema = first.copy()
        for p in steps:
            ema = np.float32(0.8) * ema + np.float32(1 - 0.8) * p
        assert np.array_equal(shadow, ema)
        assert not np.array_equal(shadow, params)


# ---- CSVLogger -----------------------------------------------------------------------------------------

def csv_body(path):
    Xtr, ytr, Xv, yv = data()
    trainer = D.DistributedTrainer(mlp(), cx.CrossEntropyLoss(), cx.AdamOptimizer(2e-3))
    h = trainer.fit(Xtr, ytr, Xv, yv, config(epochs=4, batch_size=64), callbacks=[C.CSVLogger(path)])
    return h.train_losses, h.val_accuracies


def test_csv_logger_writes_one_row_per_epoch_with_every_log_key(tmp_path):
    path = str(tmp_path / "log" / "train.csv")
    (losses, vaccs), _ = ranks.run(csv_body, 2, args=(path,))
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["epoch", "loss", "accuracy", "val_loss", "val_accuracy", "lr", "samples_per_second",
                             "epoch_time"]
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3, 4]
    assert [float(r["loss"]) for r in rows] == losses                  # written in full precision
    assert [float(r["val_accuracy"]) for r in rows] == vaccs


# ---- a raising callback ----------------------------------------------------------------------------------

class Boom(C.Callback):
    def __init__(self, rank):
        self.rank = rank

    def on_epoch_end(self, trainer, epoch, logs):
        if epoch == 2 and self.rank in (None, trainer.get_rank()):
            raise ValueError(f"bad epoch {epoch}")


def boom_body(rank):
    Xtr, ytr, _, _ = data()
    trainer = D.DistributedTrainer(mlp(), cx.CrossEntropyLoss(), cx.AdamOptimizer(1e-3))
    trainer.fit(Xtr, ytr, config(epochs=4, batch_size=64), callbacks=[Boom(rank)])


def test_a_raising_callback_fails_every_rank_naming_it():
    outs = ranks.spawn(boom_body, 2, args=(1,), timeout=60)
    assert outs[1].exc_type == "ValueError" and outs[1].message == "callback Boom.on_epoch_end: bad epoch 2"
    assert outs[0].is_a("DistributedError"), (outs[0].exc_type, outs[0].message)
    assert "rank 1 failed: ValueError: callback Boom.on_epoch_end: bad epoch 2" in outs[0].message
    for o in ranks.spawn(boom_body, 2, args=(None,), timeout=60):
        assert not o.ok and "callback Boom.on_epoch_end: bad epoch 2" in o.message, (o.exc_type, o.message)


# ---- a restart keeps the best score --------------------------------------------------------------------

class Crash(C.Callback):
    """The job dies in epoch 4 (every rank fails; nothing of epoch 4 is saved)."""

    def on_epoch_end(self, trainer, epoch, logs):
        if epoch == 4:
            raise RuntimeError("power cut")


def restart_body(directory, crash):
    Xtr, ytr, Xv, yv = data()
    model = mlp(seed=4, dropout=True)
    trainer = D.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.AdamOptimizer(3e-3))
    # mode "max" on a falling val_loss: epoch 1 is the best, and only a best score that survives the restart keeps
    # epoch 4 (the first after it) from taking its place.
    ckpt = C.ModelCheckpoint(os.path.join(directory, "ckpt"), monitor="val_loss", mode="max")
    stop = C.EarlyStopping(monitor="val_accuracy", patience=50, mode="max")
    ema, rec = C.EMA(0.95), Recorder()
    cbs = [stop, ema, rec, C.CSVLogger(os.path.join(directory, "log.csv"))] + ([Crash()] if crash else []) + [ckpt]
    # No epoch_NNNN.ckpt files: auto_resume finds last.ckpt, which ModelCheckpoint writes after every epoch.
    h = trainer.fit(Xtr, ytr, Xv, yv, config(epochs=6, batch_size=32), callbacks=cbs)
    best = D.DistributedTrainer(mlp(seed=4, dropout=True), cx.CrossEntropyLoss(), cx.AdamOptimizer(3e-3))
    best.load_checkpoint(ckpt.best_path)
    return (ckpt.best_score, ckpt.best_epoch, best.model.flat_parameters().copy(), stop.best_score, stop.best_epoch,
            stop.wait, ema.flat_parameters(), model.flat_parameters().copy(), h.epochs, h.val_losses,
            [c[1] for c in rec.calls if c[0] == "epoch_begin"])


def csv_rows(path):
    with open(path, newline="") as f:
        return [(r["epoch"], r["loss"], r["val_loss"], r["val_accuracy"], r["lr"]) for r in csv.DictReader(f)]


def test_a_restarted_job_keeps_the_best_score_and_ends_as_an_uninterrupted_one(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    whole = ranks.run(restart_body, 2, args=(a, False))
    crashed = ranks.spawn(restart_body, 2, args=(b, True), timeout=60)
    assert not any(o.ok for o in crashed)
    assert "callback Crash.on_epoch_end: power cut" in crashed[0].message
    resumed = ranks.run(restart_body, 2, args=(b, False))
    for w, r in zip(whole, resumed):
        assert w[-1] == [1, 2, 3, 4, 5, 6] and r[-1] == [4, 5, 6]   # the restart resumed after epoch 3
        assert w[1] == 1                                          # the best epoch came before the crash
        assert w[:2] == r[:2]                                     # best score and epoch
        assert np.array_equal(w[2], r[2])                         # best.ckpt
        assert w[3:6] == r[3:6]                                   # EarlyStopping's counters
        assert np.array_equal(w[6], r[6]) and np.array_equal(w[7], r[7])   # EMA and the parameters
        assert w[8:10] == r[8:10]                                 # the history, restored and continued
    assert csv_rows(os.path.join(a, "log.csv")) == csv_rows(os.path.join(b, "log.csv"))
    assert len(csv_rows(os.path.join(b, "log.csv"))) == 6


# ---- misuse ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("make, exc, text", [
    (lambda: C.EarlyStopping(mode="minimum"), ValueError,
     "EarlyStopping: mode must be 'auto', 'min' or 'max', got 'minimum'"),
    (lambda: C.ModelCheckpoint("d", mode=None), ValueError, "ModelCheckpoint: mode must be 'auto', 'min' or 'max', "
                                                            "got None"),
    (lambda: C.EarlyStopping(monitor="lr"), ValueError, "EarlyStopping: mode='auto' cannot tell whether 'lr' should "
                                                        "fall or rise (it knows *loss and *accuracy); pass mode='min' "
                                                        "or mode='max'"),
    (lambda: C.ModelCheckpoint("d", monitor="epoch_time"), ValueError, "ModelCheckpoint: mode='auto' cannot tell "
                                                                       "whether 'epoch_time' should fall or rise"),
    (lambda: C.ModelCheckpoint("d", monitor="samples_per_second"), ValueError, "pass mode='min' or mode='max'"),
    (lambda: C.EarlyStopping(patience=-1), ValueError, "EarlyStopping: patience must be an int >= 0"),
    (lambda: C.EarlyStopping(min_delta=-0.1), ValueError, "EarlyStopping: min_delta must be a finite number >= 0"),
    (lambda: C.EarlyStopping(monitor=3), TypeError, "EarlyStopping: monitor must be the name of an epoch log key"),
    (lambda: C.ModelCheckpoint("d", save_best=False, save_last=False), ValueError, "would write nothing"),
    (lambda: C.EMA(decay=1.0), ValueError, "EMA: decay must be a number in (0, 1), got 1.0"),
    (lambda: C.EMA().flat_parameters(), RuntimeError, "EMA: no average yet"),
])
def test_a_bad_callback_argument_is_refused_with_its_name(make, exc, text):
    with pytest.raises(exc) as e:
        make()
    assert text in str(e.value)


def misuse_body(case, directory):
    Xtr, ytr, Xv, yv = data(128, 64)
    trainer = D.DistributedTrainer(mlp(), cx.CrossEntropyLoss(), cx.AdamOptimizer(1e-3))
    if case == "unknown key":
        trainer.fit(Xtr, ytr, Xv, yv, config(epochs=2), callbacks=[C.EarlyStopping(monitor="val_los")])
    elif case == "no validation":
        trainer.fit(Xtr, ytr, config(epochs=2), callbacks=[C.ModelCheckpoint(directory)])
    elif case == "not a callback":
        trainer.fit(Xtr, ytr, config(epochs=2), callbacks=[print])
    elif case == "not a list":
        trainer.fit(Xtr, ytr, config(epochs=2), callbacks=3)
    elif case == "ema state during fit":
        ema = C.EMA()

        class Reload(C.Callback):
            def on_epoch_end(self, trainer, epoch, logs):
                ema.load_state_dict(ema.state_dict())
        trainer.fit(Xtr, ytr, config(epochs=1), callbacks=[ema, Reload()])
    elif case == "state":
        class Odd(C.Callback):
            def state_dict(self):
                return {"f": print}
        trainer.fit(Xtr, ytr, config(epochs=1), callbacks=[Odd()])
        trainer.save_checkpoint(os.path.join(directory, "x.ckpt"))
    elif case == "ema other model":
        ema = C.EMA()
        trainer.fit(Xtr, ytr, config(epochs=1), callbacks=[ema])
        ema.apply_to(mlp(hidden=8))
    elif case == "ema from a plain checkpoint":
        trainer.save_checkpoint(os.path.join(directory, "x.ckpt"))
        C.EMA.from_checkpoint(os.path.join(directory, "x.ckpt"))


@pytest.mark.parametrize("case, exc, text", [
    ("unknown key", "ValueError", "callback EarlyStopping.on_epoch_end: monitor 'val_los' is not in the epoch logs, "
                                  "which hold ['accuracy', 'epoch', 'epoch_time', 'loss', 'lr', 'samples_per_second', "
                                  "'val_accuracy', 'val_loss']"),
    ("no validation", "ValueError", "callback ModelCheckpoint.on_train_begin: monitor 'val_loss' is not in the epoch "
                                    "logs, which hold ['accuracy', 'epoch', 'epoch_time', 'loss', 'lr', "
                                    "'samples_per_second'] (val_ keys need validation data"),
    ("not a callback", "TypeError", "fit: callbacks must be cx.callbacks.Callback instances (subclass it), got "
                                    "builtin_function_or_method"),
    ("not a list", "TypeError", "fit: callbacks must be a list of cx.callbacks.Callback, got int"),
    ("ema state during fit", "RuntimeError", "callback Reload.on_epoch_end: EMA.load_state_dict: not while a fit "
                                             "updates the average"),
    ("state", "TypeError", "callback Odd.state_dict: the checkpoint keeps numbers, strings, lists, dicts and NumPy "
                           "arrays"),
    ("ema other model", "ValueError", "EMA.apply_to: the model has"),
    ("ema from a plain checkpoint", "ValueError", "holds no EMA state; it was written by a fit without the EMA "
                                                  "callback"),
])
def test_misused_callbacks_are_reported(tmp_path, case, exc, text):
    (o,) = ranks.spawn(misuse_body, 1, args=(case, str(tmp_path)))
    assert o.exc_type == exc and text in o.message, (o.exc_type, o.message)


# ---- history.plot ------------------------------------------------------------------------------------------

def plot_body(path):
    Xtr, ytr, Xv, yv = data()
    trainer = D.DistributedTrainer(mlp(), cx.CrossEntropyLoss(), cx.AdamOptimizer(2e-3))
    h = trainer.fit(Xtr, ytr, Xv, yv, config(epochs=3, batch_size=64),
                    callbacks=[C.EarlyStopping(monitor="val_loss", patience=0, mode="max")])
    return h.plot(path) if trainer.is_master() else None


def test_history_plot_draws_loss_and_accuracy_per_epoch(tmp_path):
    pytest.importorskip("matplotlib", reason="history.plot needs matplotlib (the plot and bench extras)")
    path = str(tmp_path / "history.png")
    assert ranks.run(plot_body, 2, args=(path,)) == [path, None]
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 10_000


def test_history_plot_without_matplotlib_says_how_to_install_it(tmp_path):
    import subprocess
    import sys
    code = ("import sys; sys.modules['matplotlib'] = None\n"      # what Python does when it is not installed
            "import pycyxwiz as cx\n"
            "h = cx.distributed.DistributedTrainingHistory(); h.train_losses = [1.0]\n"
            "try:\n    h.plot('h.png')\nexcept ImportError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert r.stdout.strip() == ("DistributedTrainingHistory.plot needs matplotlib, which is not installed: pip install "
                                "matplotlib (or pip install 'pycyxwiz[plot]')"), r.stdout + r.stderr


def stale_folder_body(d_epochs, d_ckpt, write_epochs):
    Xtr, ytr, _, _ = data(256, 64)
    trainer = D.DistributedTrainer(mlp(), cx.CrossEntropyLoss(), cx.AdamOptimizer(1e-3))
    if write_epochs:      # another run, whose epoch_NNNN.ckpt files stay in checkpoint_dir
        return trainer.fit(Xtr, ytr, config(epochs=2, checkpoint_every_n_epochs=1, checkpoint_dir=d_epochs)).epochs
    rec = Recorder()
    h = trainer.fit(Xtr, ytr, config(epochs=3, checkpoint_dir=d_epochs),
                    callbacks=[C.ModelCheckpoint(d_ckpt, monitor="loss"), rec])
    return h.epochs, [c[1] for c in rec.calls if c[0] == "epoch_begin"]


def test_model_checkpoint_resumes_from_its_own_files_not_from_a_checkpoint_dir_fit_does_not_write(tmp_path):
    a, b = str(tmp_path / "epochs"), str(tmp_path / "ckpt")
    assert ranks.run(stale_folder_body, 2, args=(a, b, True))[0] == [1, 2]
    # Not resumed from the other run's epoch_0002.ckpt: trained from epoch 1.
    assert ranks.run(stale_folder_body, 2, args=(a, b, False))[0] == ([1, 2, 3], [1, 2, 3])
    # Resumed from its own last.ckpt, after epoch 3 of 3: nothing left to train.
    assert ranks.run(stale_folder_body, 2, args=(a, b, False))[0] == ([1, 2, 3], [])


def unwritable_body(directory, epochs):
    Xtr, ytr, _, _ = data(256, 64)
    trainer = D.DistributedTrainer(mlp(), cx.CrossEntropyLoss(), cx.AdamOptimizer(1e-3))
    trainer.fit(Xtr, ytr, config(epochs=epochs), callbacks=[C.ModelCheckpoint(directory, monitor="loss",
                                                                                save_last=False)])


@pytest.mark.parametrize("epochs", [1, 3])
def test_a_checkpoint_written_in_the_background_that_fails_fails_every_rank(tmp_path, epochs):
    # best.ckpt is a folder, so the background writer's rename fails: at the end of fit (1 epoch) every rank
    # raises naming rank 0; found at the next save (3 epochs), rank 0's callback raises and the others hear of it.
    os.makedirs(tmp_path / "best.ckpt")
    outs = ranks.spawn(unwritable_body, 2, args=(str(tmp_path), epochs), timeout=60)
    assert not any(o.ok for o in outs)
    if epochs == 1:
        for o in outs:
            assert o.exc_type == "OSError" and "fit: rank 0 could not write a checkpoint: IsADirectoryError" in \
                o.message, (o.exc_type, o.message)
    else:
        assert outs[0].exc_type == "IsADirectoryError", (outs[0].exc_type, outs[0].message)
        assert "callback ModelCheckpoint.on_epoch_end: " in outs[0].message
        assert "rank 0 failed: IsADirectoryError: callback ModelCheckpoint.on_epoch_end" in outs[1].message
