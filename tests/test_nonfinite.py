"""Non-finite gradients found and named (DDPConfig.nonfinite, Note [Non-finite gradients] in
csrc/train/nonfinite.h): a NaN or inf injected into one rank's own gradient is named on every rank
(the step, the parameter, the rank), "skip" leaves every rank's parameters unchanged and equal, "warn"
warns and steps; with ZeRO-1 and the communication hooks too; the fp16 hook's overflow is named as
such; PowerSGD carries no NaN past the step; anomaly mode names the layer. The check is fused into the
all_reduce (Note [Fused non-finite check] in csrc/distributed/reduce_probe.h): each algorithm, shared memory
and TCP, 2, 3 and 4 ranks, a NaN in every rank's every kind of segment, and two "hosts" (network namespaces);
a bucket reduced twice in the first accumulation cycle blames only the rank that sent the NaN. It is fused into
ZeRO-1's reduce-scatter (every kind of block, the tail, pieces and chunks, ring and hierarchical), into the
fp16/bf16 hooks' casts (ring and recursive doubling; nothing more travels) and into join()'s all-reduce (the
finished ranks take part); ranks that set its private switches differently are named on every rank. Real ranks
over 127.0.0.1.
"""
import os
import pickle
import re
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

import hosts
import models
import ranks

import pycyxwiz as cx

D = cx.distributed

SIZES = (6, 16, 12, 3)  # three Linear layers: parameters 0..5 (weight, bias of each)


def make_model(seed=1):
    cx.set_num_threads(1)
    m = cx.SequentialModel()
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        if i:
            m.add(cx.TanhModule())
        m.add(cx.LinearModule(a, b, seed=seed + 10 * i))
    return m


def param_offset(model, index):
    return int(sum(p.size for p in model.parameters()[:index]))


def inject_body(mode, bad_rank, value, param, hook="none", zero=False, overlap=False, steps=3, at=1,
                by_message=True):
    """Trains `steps` SGD steps; at step `at` rank `bad_rank`'s own gradient of parameter tensor `param`
    gets `value` (after backward, before the reduction: under no_sync, or, with `overlap`, through a
    grad_output whose first element is `value`, so the buckets launched during backward carry it).
    Returns per step: (error text or "", warning texts, parameters after the step), and skipped_steps."""
    r = D.get_rank()
    model = make_model()
    cfg = D.DDPConfig()
    cfg.bucket_size_mb, cfg.first_bucket_mb = 1e-4, 1e-4  # a bucket per parameter tensor
    cfg.nonfinite, cfg.comm_hook = mode, hook
    if hook == "powersgd":
        cfg.powersgd.start_powerSGD_iter = 0
        cfg.powersgd.min_compression_rate = 0.0
    ddp = D.DistributedDataParallel(model, cfg)
    ddp._agree_by_message = by_message is not False  # the two ways ranks agree (Note [Non-finite gradients])
    ddp._fused_check = by_message != "scan"  # "scan": each bucket read before its reduction, not fused
    opt = cx.SGDOptimizer(0.1)
    step_with = D.ZeroRedundancyOptimizer(ddp, opt) if zero else opt
    loss = cx.MSELoss()
    rng = np.random.default_rng(100 + r)
    out = []
    for s in range(steps):
        x = rng.standard_normal((4, SIZES[0])).astype(np.float32)
        t = rng.standard_normal((4, SIZES[-1])).astype(np.float32)
        loss.forward(ddp.forward(x), t)
        g = loss.backward().copy()
        if overlap:
            if s == at and r == bad_rank:
                g[0, 0] = value
            ddp.backward(g, input_grad=False)
        else:
            with ddp.no_sync():
                ddp.backward(g, input_grad=False)
            if s == at and r == bad_rank:
                o = param_offset(model, param)
                model.flat_gradients()[o:o + 1] = value
        err = ""
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            try:
                ddp.update_parameters(step_with)
            except D.NonFiniteError as e:
                assert isinstance(e, FloatingPointError) and isinstance(e, D.DistributedError)
                err = str(e)
                model.zero_grad()
        out.append((err, [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)],
                    model.flat_parameters().copy()))
    return out, ddp.skipped_steps, ddp.nonfinite_steps


def check_equal_params(res, step):
    p0 = res[0][0][step][2]
    for other in res[1:]:
        assert np.array_equal(other[0][step][2], p0)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("value, by_message", [(np.nan, True), (np.inf, True), (np.nan, False), (np.nan, "scan")])
def test_raise_names_the_step_the_parameter_and_the_bad_rank_on_every_rank(world, value, by_message):
    bad = world - 1
    res = ranks.run(inject_body, world, args=("raise", bad, value, 2, "none", False, False, 3, 1, by_message),
                    timeout=120)
    for r, (out, skipped, seen) in enumerate(res):
        err = out[1][0]
        assert err.startswith(f"DistributedDataParallel (rank {r}): step 2: the gradient averaged over the {world} "
                              "ranks is not finite (NaN or inf) in parameters [2 (layer 2 Linear.weight): 1 of "
                              "192 values]"), err
        assert f"The ranks whose own gradient was already not finite: [{bad}]." in err, err
        own = ("This rank's own gradient was not finite in [2 (layer 2 Linear.weight): 1 of 192 values]"
               if r == bad else "This rank's own gradient was finite.")
        assert own in err, err
        assert "The optimizer step was not taken" in err and "'skip'" in err, err
        assert out[0][0] == "" and out[2][0] == ""  # the steps before and after are fine
        assert (skipped, seen) == (0, 1)
        # Not taken: the parameters are those after step 0
        assert np.array_equal(out[1][2], out[0][2])
    for s in range(3):
        check_equal_params(res, s)


@pytest.mark.parametrize("world", [2, 3])
def test_skip_leaves_every_rank_s_parameters_unchanged_and_equal_and_counts_it(world):
    res = ranks.run(inject_body, world, args=("skip", 0, np.nan, 5), timeout=120)
    for out, skipped, seen in res:
        assert [o[0] for o in out] == ["", "", ""] and all(not o[1] for o in out)
        assert np.array_equal(out[1][2], out[0][2])        # step 1 skipped
        assert not np.array_equal(out[2][2], out[1][2])    # step 2 taken
        assert np.isfinite(out[2][2]).all()
        assert (skipped, seen) == (1, 1)
    for s in range(3):
        check_equal_params(res, s)


@pytest.mark.parametrize("world", [2, 3])
def test_warn_warns_on_every_rank_and_takes_the_step(world):
    res = ranks.run(inject_body, world, args=("warn", 1, np.inf, 0, "none", False, False, 2), timeout=120)
    for r, (out, skipped, seen) in enumerate(res):
        assert [o[0] for o in out] == ["", ""]
        assert out[0][1] == []
        (msg,) = out[1][1]
        assert msg.startswith(f"DistributedDataParallel (rank {r}): step 2: ") and "[1]" in msg, msg
        assert "0 (layer 0 Linear.weight): 1 of 96 values" in msg and "The step is taken" in msg, msg
        assert not np.isfinite(out[1][2]).all()  # taken: the inf went into the weights
        assert (skipped, seen) == (0, 1)


def test_gradients_of_buckets_launched_during_backward_are_checked_too():
    """A NaN in rank 1's grad_output spreads to every gradient of that rank during backward; the buckets
    launched while backward runs carry it, and every rank names all six tensors and rank 1."""
    res = ranks.run(overlap_body, 2, timeout=120)
    for r, out in enumerate(res):
        err = out[1][0]
        assert f"(rank {r}): step 2:" in err and "[1]." in err, err
        for i, (layer, name) in enumerate([(0, "weight"), (0, "bias"), (2, "weight"), (2, "bias"), (4, "weight"),
                                           (4, "bias")]):
            assert f"{i} (layer {layer} Linear.{name})" in err, err


def overlap_body():
    return inject_body("raise", 1, np.nan, 0, overlap=True)[0]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_zero1_agrees_on_the_shards_and_names_the_parameter(world, mode):
    res = ranks.run(zero_body, world, args=(mode,), timeout=120)
    for r, (out, skipped, seen) in enumerate(res):
        if mode == "raise":
            err = out[1][0]
            assert err.startswith(f"DistributedDataParallel (rank {r}): step 2: ") and \
                "4 (layer 4 Linear.weight): 1 of 36 values" in err and "[0]." in err, err
        else:
            assert [o[0] for o in out] == ["", "", ""] and skipped == 1
        assert np.array_equal(out[1][2], out[0][2]) and np.isfinite(out[2][2]).all()
    for s in range(3):
        check_equal_params(res, s)


def zero_body(mode):
    return inject_body(mode, 0, np.nan, 4, zero=True)


@pytest.mark.parametrize("hook", ["fp16", "bf16", "powersgd"])
def test_hooks_agree_and_skip_alike(hook):
    res = ranks.run(hook_body, 2, args=(hook,), timeout=120)
    for out, skipped, seen in res:
        assert [o[0] for o in out] == ["", "", ""] and skipped == 1
        assert np.array_equal(out[1][2], out[0][2]) and np.isfinite(out[2][2]).all()
    for s in range(3):
        check_equal_params(res, s)


def hook_body(hook):
    return inject_body("skip", 1, np.nan, 2, hook=hook)


def bad_values_are_refused_by_name():
    cfg = D.DDPConfig()
    errors = []
    for bad in ("Raise!", "ignore"):
        try:
            cfg.nonfinite = bad
        except ValueError as e:
            errors.append(str(e))
    try:
        cfg.nonfinite = 1
    except TypeError as e:
        errors.append(str(e))
    ddp = D.DistributedDataParallel(make_model(), D.DDPConfig())
    try:
        ddp.nonfinite = "sometimes"
    except ValueError as e:
        errors.append(str(e))
    cfg.nonfinite = "SKIP"
    ddp.nonfinite = "warn"
    return errors, D.DistributedDataParallel(make_model(), cfg).nonfinite, ddp.nonfinite, repr(cfg)


def test_bad_values_are_refused_by_name():
    (errors, made, set_, rep), = ranks.run(bad_values_are_refused_by_name, 1)
    assert errors[0].startswith("DDPConfig.nonfinite: unknown value 'Raise!'; choose 'raise'"), errors[0]
    assert "'skip'" in errors[1] and "'warn'" in errors[1] and "'off'" in errors[1], errors[1]
    assert errors[2].startswith("DDPConfig.nonfinite must be a str"), errors[2]
    assert "DistributedDataParallel.nonfinite (rank 0): unknown value 'sometimes'" in errors[3], errors[3]
    assert (made, set_) == ("skip", "warn") and "nonfinite='SKIP'" in rep


# ---- fp16 overflow, PowerSGD state ---------------------------------------------------------------

def fp16_overflow_body(mode):
    """Every rank's gradient holds 1e5 * world in one element: finite in float32, above float16's range after
    the division by world. The average is inf; nobody's own gradient was bad."""
    r, p = D.get_rank(), D.get_world_size()
    model = make_model()
    cfg = D.DDPConfig()
    cfg.comm_hook, cfg.nonfinite = "fp16", mode
    ddp = D.DistributedDataParallel(model, cfg)
    loss = cx.MSELoss()
    x = np.ones((2, SIZES[0]), np.float32)
    loss.forward(ddp.forward(x), np.zeros((2, SIZES[-1]), np.float32))
    with ddp.no_sync():
        ddp.backward(loss.backward(), input_grad=False)
    model.flat_gradients()[0] = 1e5 * p
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        try:
            ddp.update_parameters(cx.SGDOptimizer(0.1))
            return "", [str(x.message) for x in w]
        except D.NonFiniteError as e:
            return str(e), []


@pytest.mark.parametrize("mode", ["raise", "warn"])
def test_fp16_overflow_says_so_and_suggests_bf16(mode):
    for err, warned in ranks.run(fp16_overflow_body, 2, args=(mode,), timeout=120):
        msg = err if mode == "raise" else warned[0]
        assert "0 (layer 0 Linear.weight): 1 of 96 values" in msg, msg
        assert "Every rank's own gradient was finite: the fp16 communication hook overflowed" in msg, msg
        assert "comm_hook = 'bf16'" in msg, msg


def powersgd_state_body(mode):
    """PowerSGD from step 0 with error feedback; rank 1's D gets a NaN at step 1. After that step, and at
    every later one, Q and every rank's residual are finite, and the averaged gradient is finite again."""
    r = D.get_rank()
    model = make_model()
    cfg = D.DDPConfig()
    cfg.comm_hook, cfg.nonfinite = "powersgd", mode
    cfg.powersgd.start_powerSGD_iter = 0
    cfg.powersgd.min_compression_rate = 0.0
    ddp = D.DistributedDataParallel(model, cfg)
    loss = cx.MSELoss()
    rng = np.random.default_rng(7 + r)
    out = []
    warnings.simplefilter("ignore", RuntimeWarning)  # "warn": the step's warning is not what this test checks
    for s in range(4):
        x = rng.standard_normal((4, SIZES[0])).astype(np.float32)
        loss.forward(ddp.forward(x), rng.standard_normal((4, SIZES[-1])).astype(np.float32))
        with ddp.no_sync():
            ddp.backward(loss.backward(), input_grad=False)
        if s == 1 and r == 1:
            model.flat_gradients()[3] = np.nan  # in layer 0's weight, a compressed matrix
        synced = ddp.sync_gradients()
        _, q, err = ddp._comm_hook_state()
        out.append((bool(np.isfinite(synced).all()), bool(np.isfinite(q).all()), bool(np.isfinite(err).all()),
                    float(np.abs(err).sum())))
        model.zero_grad()
    return out


@pytest.mark.parametrize("mode", ["off", "warn"])
def test_powersgd_never_carries_a_non_finite_residual_or_q_past_the_step(mode):
    for r, out in enumerate(ranks.run(powersgd_state_body, 2, args=(mode,), timeout=120)):
        assert out[1][0] is False                     # the NaN step's average is not finite
        for s in range(4):
            assert out[s][1] and out[s][2], (r, s, out)  # Q and residual finite after every step
        assert out[2][0] and out[3][0], out             # later steps are finite again
        assert out[3][3] > 0                            # error feedback is still at work afterwards


# ---- the trainer ---------------------------------------------------------------------------------

def fit_nan_row(mode):
    X, y, m = models.digits_with_a_nan_row()
    cfg = D.DistributedTrainingConfig(epochs=2, batch_size=64, verbose=False, nonfinite=mode)
    t = D.DistributedTrainer(m, cx.CrossEntropyLoss(), cx.SGDOptimizer(0.05))
    h = t.fit(X, y, cfg)
    return h.skipped_steps, bool(np.isfinite(m.flat_parameters()).all())


@pytest.mark.parametrize("world", [2, 3])
def test_fit_raises_on_every_rank_naming_the_step_batch_and_rows(world):
    outs = ranks.spawn(fit_nan_row, world, args=(None,), timeout=180)
    assert all(o.exc_type == "NonFiniteError" for o in outs), [(o.exc_type, o.message[:200]) for o in outs]
    rows = {}
    for o in outs:
        msg = o.message
        m = re.search(r"The ranks whose own gradient was already not finite: \[(\d+)\]", msg)
        assert m, msg
        assert re.search(r"\[fit: epoch 1, batch \d+; its sample rows \(indices into the training data\) on "
                         r"this rank: \[", msg), msg
        rows[o.rank] = msg[msg.rindex("rank: [") + 7:msg.rindex("]]")]
    bad = int(m.group(1))
    assert re.search(r"(^|, )17(,|$)", rows[bad]), rows[bad]
    assert all(not re.search(r"(^|, )17(,|$)", v) for k, v in rows.items() if k != bad)


def test_fit_skip_counts_the_skipped_steps_in_history():
    for skipped, finite in ranks.run(fit_nan_row, 2, args=("skip",), timeout=180):
        assert skipped == 2 and finite  # the NaN row is in one batch per epoch


def test_trainer_config_refuses_bad_values_by_name():
    cfg = D.DistributedTrainingConfig(nonfinite="never")
    with pytest.raises(ValueError, match=r"DistributedTrainingConfig.nonfinite must be 'raise', 'skip', 'warn', "
                                         r"'off' or None .*'never'"):
        D.DistributedTrainer._check_config(cfg)
    with pytest.raises(ValueError, match="detect_anomaly must be True or False, got 'yes'"):
        D.DistributedTrainer._check_config(D.DistributedTrainingConfig(detect_anomaly="yes"))


# ---- anomaly mode --------------------------------------------------------------------------------

def test_anomaly_mode_names_the_layer_whose_forward_output_went_non_finite():
    m = cx.SequentialModel()
    m.add(cx.LinearModule(3, 4, seed=1))
    m.add(cx.TanhModule())
    m.add(cx.LinearModule(4, 2, seed=2))
    w = m.parameters()[2]
    w[0, 0] = np.inf
    x = np.ones((2, 3), np.float32)
    assert not np.isfinite(m.forward(x)).all()  # off: no check
    m.detect_anomaly = True
    with pytest.raises(D.NonFiniteError, match=r"detect_anomaly: layer 2 \(Linear\) produced \d+ non-finite "
                                              r"values \(of 4\) in its forward output from a finite input"):
        m.forward(x)
    x[1, 2] = np.nan
    with pytest.raises(D.NonFiniteError, match=r"the input of layer 0 \(Linear\) in forward holds 1 non-finite"):
        m.forward(x)


def test_anomaly_mode_names_the_layer_whose_gradient_went_non_finite():
    m = cx.SequentialModel()
    m.add(cx.LinearModule(3, 4, seed=1))
    m.add(cx.TanhModule())
    m.add(cx.LinearModule(4, 2, seed=2))
    m.detect_anomaly = True
    x = np.full((2, 3), 1e30, np.float32)  # finite; tanh saturates, so forward stays finite
    m.parameters()[0][...] = 1e-30
    out = m.forward(x)
    assert np.isfinite(out).all()
    g = np.full_like(out, 1e30)  # finite; layer 2's weight gradient (sum of 1e30 * tanh) is finite,
    m.parameters()[2][...] = 1e30  # but layer 2's input gradient 1e30 * 1e30 overflows
    with pytest.raises(D.NonFiniteError, match=r"detect_anomaly: layer 2 \(Linear\) produced 8 non-finite values "
                                              r"\(of 8\) in the gradient of its input in backward"):
        m.backward(g)
    g[0, 0] = np.nan
    with pytest.raises(D.NonFiniteError, match=r"the gradient of the output \(the loss's backward\) holds 1 "
                                              r"non-finite values"):
        m.backward(g)


def fit_anomaly():
    X = np.random.default_rng(0).standard_normal((64, 5)).astype(np.float32)
    y = (np.arange(64) % 3).astype(np.int64)
    m = cx.SequentialModel()
    m.add(cx.LinearModule(5, 8, seed=1))
    m.add(cx.ReLUModule())
    m.add(cx.LinearModule(8, 3, seed=2))
    if D.get_rank() == 1:
        m.parameters()[2][0, 0] = np.nan  # rank 1's layer 2 (broadcast_parameters=False keeps it)
    ddp_cfg = D.DDPConfig()
    ddp_cfg.broadcast_parameters = False
    cfg = D.DistributedTrainingConfig(epochs=1, batch_size=8, verbose=False, detect_anomaly=True)
    t = D.DistributedTrainer(m, cx.CrossEntropyLoss(), cx.SGDOptimizer(0.05), ddp_cfg)
    try:
        t.fit(X, y, cfg)
    finally:
        assert m.detect_anomaly is False  # fit switches it back


def test_fit_with_detect_anomaly_names_the_layer_and_the_batch():
    outs = ranks.spawn(fit_anomaly, 2, timeout=120)
    bad = next(o for o in outs if o.rank == 1)
    assert bad.exc_type == "NonFiniteError", (bad.exc_type, bad.message[:300])
    assert bad.message.startswith("detect_anomaly: layer 2 (Linear) produced"), bad.message
    assert "[fit: epoch 1, batch 1; its sample rows" in bad.message, bad.message
    other = next(o for o in outs if o.rank == 0)
    assert other.exc_type == "DistributedConnectionError" and "rank 1 failed: NonFiniteError: detect_anomaly: " \
        "layer 2 (Linear)" in other.message, other.message[:300]


# ---- the fused check: every algorithm, both transports, each rank's every segment ---------------
# Note [Fused non-finite check] in csrc/distributed/reduce_probe.h: the reduction tests the values it adds.
# One bucket holds a Linear(64, 40)'s weight (elements 0..2559) and bias (2560..2599). In the ring, rank r
# sends segment r of the bucket unread (its right neighbour tests it) and adds into every other segment itself.

FUSED_IN, FUSED_OUT = 64, 40
FUSED_COUNT = FUSED_IN * FUSED_OUT + FUSED_OUT
ALGOS = {
    "recursive_doubling": {"CX_SMALL_ALLREDUCE_BYTES": str(1 << 20)},
    "ring": {"CX_SMALL_ALLREDUCE_BYTES": "0", "CX_HD_MAX_BYTES": "0", "CX_CHUNK_BYTES": "1024"},  # chunks
    "hierarchical": {"CX_ALGORITHM": "hierarchical", "CX_SMALL_ALLREDUCE_BYTES": "0", "CX_HD_MAX_BYTES": "0",
                     "CX_CHUNK_BYTES": "1024"},
    "halving_doubling": {"CX_SMALL_ALLREDUCE_BYTES": "0", "CX_HD_MAX_BYTES": str(1 << 20), "CX_CHUNK_BYTES": "1024"},
}


def ring_segment(count, p, seg):
    base, extra = divmod(count, p)
    return seg * base + min(seg, extra), base + (1 if seg < extra else 0)


def fused_cases(world):
    """Per step, {rank: [(element, value)]}: nothing; then, for each rank, a NaN at the first element of the
    segment it sends unread, and an inf at the last element of one it adds into itself (the last segment's
    last element is the bias); two ranks at once; and every rank's finite 3e38 at one element (the sum overflows)."""
    cases = [{}]
    for r in range(world):
        raw_at, _ = ring_segment(FUSED_COUNT, world, r)
        off, n = ring_segment(FUSED_COUNT, world, (r + 1) % world)
        cases.append({r: [(raw_at, np.nan)]})
        cases.append({r: [(off + n - 1, np.inf)]})
    cases.append({0: [(ring_segment(FUSED_COUNT, world, 0)[0] + 3, np.nan)], world - 1: [(5, -np.inf)]})
    cases.append({r: [(7, 3e38)] for r in range(world)})
    cases.append({})
    return cases


def backward_with(ddp, model, loss, rng, values):
    """A backward of the FUSED_IN -> FUSED_OUT model on random rows, not yet synced, then `values` [(element,
    value)] written into this rank's gradient: the gradient."""
    x = rng.standard_normal((4, FUSED_IN)).astype(np.float32)
    loss.forward(ddp.forward(x), rng.standard_normal((4, FUSED_OUT)).astype(np.float32))
    with ddp.no_sync():
        ddp.backward(loss.backward(), input_grad=False)
    g = model.flat_gradients()
    for at, value in values:
        g[at] = value
    return g


def fused_body(hook=None):
    """Per case of fused_cases (with `hook`, the fp16/bf16 communication hook: all but the overflows, which bf16
    does not reach, and a clean step): (error, this rank's gradient, the synced gradient)."""
    r, p = D.get_rank(), D.get_world_size()
    cx.set_num_threads(1)
    model = cx.SequentialModel()
    model.add(cx.LinearModule(FUSED_IN, FUSED_OUT, seed=3))
    cfg = D.DDPConfig()
    if hook:
        cfg.comm_hook = hook
    ddp = D.DistributedDataParallel(model, cfg)  # one bucket: the model is 10 KiB
    loss = cx.MSELoss()
    rng = np.random.default_rng(50 + r)
    out = []
    for case in (fused_cases(p)[:-2] + [{}] if hook else fused_cases(p)):
        g = backward_with(ddp, model, loss, rng, case.get(r, []))
        local = g.copy()
        err = ""
        try:
            synced = ddp.sync_gradients().copy()
        except D.NonFiniteError as e:
            err, synced = str(e), None
        model.zero_grad()
        out.append((err, local, synced))
    return out


def param_of(element):
    return ("0 (layer 0 Linear.weight)", FUSED_IN * FUSED_OUT) if element < FUSED_IN * FUSED_OUT else \
        ("1 (layer 0 Linear.bias)", FUSED_OUT)


def check_fused(res, world):
    for s, case in enumerate(fused_cases(world)):
        elements = sorted({at for hits in case.values() for at, _ in hits})
        if not case:
            locals_ = [res[r][s][1] for r in range(world)]
            want = np.sum(np.stack(locals_).astype(np.float64), 0) / world  # independent reference
            for r in range(world):
                assert res[r][s][0] == "", res[r][s][0]
                np.testing.assert_allclose(res[r][s][2], want, rtol=1e-5, atol=1e-6)
                assert np.array_equal(res[r][s][2], res[0][s][2])  # the same bits on every rank
            continue
        overflow = all(v == 3e38 for hits in case.values() for _, v in hits)
        for r in range(world):
            err = res[r][s][0]
            assert err.startswith(f"DistributedDataParallel (rank {r}): step {s + 1}: the gradient averaged over the "
                                  f"{world} ranks is not finite"), (s, err)
            names = sorted({param_of(e) for e in elements})
            assert "in parameters [" + ", ".join(f"{n}: {sum(param_of(e) == (n, k) for e in elements)} of {k} values"
                                                 for n, k in names) + "]" in err, (s, err)
            if overflow:
                assert "Every rank's own gradient was finite: their sum overflowed float32." in err, (s, err)
                assert "This rank's own gradient was finite." in err, (s, err)
                continue
            assert f"The ranks whose own gradient was already not finite: {sorted(case)}." in err, (s, err)
            if r in case:
                mine = sorted({param_of(at) for at, _ in case[r]})
                assert "This rank's own gradient was not finite in [" + ", ".join(
                    f"{n}: {sum(param_of(at) == (n, k) for at, _ in case[r])} of {k} values" for n, k in mine) + \
                    "]" in err, (s, r, err)
            else:
                assert "This rank's own gradient was finite." in err, (s, r, err)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("algo", ["recursive_doubling", "ring", "hierarchical"])
@pytest.mark.parametrize("world", [2, 3])
def test_fused_check_names_each_rank_whatever_segment_its_nan_is_in(world, algo, transport):
    env = dict(ALGOS[algo], **({"CX_SHM": "0"} if transport == "tcp" else {}))
    check_fused(ranks.run(fused_body, world, env=env, timeout=180), world)


HOSTS_WORKER = """
import pickle, sys
sys.path.insert(0, sys.argv[2])
import pycyxwiz as cx
import test_nonfinite as t
cx.distributed.init()
res = getattr(t, sys.argv[3])(*pickle.loads(bytes.fromhex(sys.argv[4])))
cx.distributed.finalize()
with open(sys.argv[1], "wb") as f:
    pickle.dump(res, f)
"""


def run_on_two_hosts_of_two_ranks(tmp_path, body, args, algo_env):
    """Ranks 0, 1 on host 0 and 2, 3 on host 1 (network namespaces, tests/hosts.py): shared memory inside a host,
    TCP across. Each rank's result of body(*args)."""
    if hosts.available() is not None:
        pytest.skip(str(hosts.available()))
    tests = os.path.dirname(os.path.abspath(__file__))
    worker = tmp_path / "worker.py"
    worker.write_text(HOSTS_WORKER)
    with hosts.Hosts(2) as h:
        procs = []
        for rank in range(4):
            env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "CX_SHM",
                                                                     "CX_AUTH_TOKEN_FILE")}
            env.update(RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2",
                       MASTER_ADDR=h.addrs[0], MASTER_PORT="29400", CX_AUTH_TOKEN="c0ffee" * 10,
                       DISTRIBUTED_TIMEOUT_MS="60000", OMP_NUM_THREADS="1", **algo_env)
            out = tmp_path / f"rank{rank}.pkl"
            argv = [sys.executable, str(worker), str(out), tests, body.__name__, pickle.dumps(args).hex()]
            procs.append((h.popen(rank // 2, argv, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
                          out))
        res = []
        for p, out in procs:
            try:
                text, _ = p.communicate(timeout=240)
            except subprocess.TimeoutExpired:
                for q, _ in procs:
                    q.kill()
                    q.communicate()
                raise AssertionError("a rank hung past 240 s")
            assert p.returncode == 0, text[-3000:]
            res.append(pickle.loads(out.read_bytes()))
    return res


def test_fused_check_across_two_hosts_of_two_ranks_hierarchical(tmp_path):
    """The hierarchical all_reduce tests each rank's own values in the in-host reduce-scatter and the result after
    the across-host all_reduce of host sums."""
    check_fused(run_on_two_hosts_of_two_ranks(tmp_path, fused_body, (), ALGOS["hierarchical"]), 4)


def test_fused_check_across_two_hosts_of_two_ranks_zero1_hierarchical(tmp_path):
    """ZeRO-1's hierarchical reduce-scatter across two hosts: each in-host reduce-scatter tests the host's ranks' own
    values of the blocks for each host (block i of host j's sum is rank ranks[j][i]'s), adding the other host's sum
    tests the result; every rank names the same ranks and parameters."""
    env = {"CX_ALGORITHM": "hierarchical", "CX_CHUNK_BYTES": "256"}
    check_zero_fused(run_on_two_hosts_of_two_ranks(tmp_path, zero_fused_body, ("raise", 1024), env), 4, "raise")


def test_fused_check_on_four_ranks_halving_doubling_and_ring():
    for algo in ("halving_doubling", "ring"):
        check_fused(ranks.run(fused_body, 4, env=ALGOS[algo], timeout=240), 4)


# ---- Note [A bucket reduced twice]: the first accumulation cycle -------------------------------------

def first_cycle_body(hook, by_message, bad_rank=1):
    """Step 1 of two micro-batches: DDP does not yet know the period, so it reduces after each backward. Rank
    `bad_rank`'s first micro-batch is NaN (through its grad_output, so the buckets launched in backward carry
    it); the second backward adds into the NaN average on every rank. Only `bad_rank` is to blame."""
    r = D.get_rank()
    model = make_model()
    cfg = D.DDPConfig()
    cfg.bucket_size_mb, cfg.first_bucket_mb = 1e-4, 1e-4  # a bucket per parameter tensor
    cfg.comm_hook = hook
    ddp = D.DistributedDataParallel(model, cfg)
    ddp._agree_by_message = by_message
    opt = cx.SGDOptimizer(0.1)
    loss = cx.MSELoss()
    rng = np.random.default_rng(5 + r)
    out = []
    for step in range(2):
        for micro in range(2):
            x = rng.standard_normal((4, SIZES[0])).astype(np.float32)
            loss.forward(ddp.forward(x), rng.standard_normal((4, SIZES[-1])).astype(np.float32))
            g = loss.backward().copy()
            if step == 0 and micro == 0 and r == bad_rank:
                g[0, 0] = np.nan
            ddp.backward(g, input_grad=False)
        try:
            ddp.update_parameters(opt)
            out.append("")
        except D.NonFiniteError as e:
            out.append(str(e))
            model.zero_grad()
    return out, ddp.nonfinite_steps


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("hook, by_message", [("none", True), ("none", False), ("bf16", True)])
def test_a_nan_average_reduced_again_in_the_first_accumulation_cycle_blames_only_the_rank_that_sent_it(
        world, hook, by_message):
    res = ranks.run(first_cycle_body, world, args=(hook, by_message), timeout=120)
    for r, (out, seen) in enumerate(res):
        err = out[0]
        assert f"(rank {r}): step 1: the gradient averaged over the {world} ranks is not finite" in err, err
        assert "The ranks whose own gradient was already not finite: [1]." in err, err
        if r == 1:
            assert "This rank's own gradient was not finite in [" in err, err
        else:
            assert "This rank's own gradient was finite." in err, err
        assert out[1] == "" and seen == 1, out


def bytes_body(hook=None):
    """Bytes this rank sends for one synced step's gradient, with the check off and on (the 10 KiB model of
    fused_body: one bucket), with `hook` the communication hook if given."""
    cx.set_num_threads(1)
    model = cx.SequentialModel()
    model.add(cx.LinearModule(FUSED_IN, FUSED_OUT, seed=3))
    cfg = D.DDPConfig()
    if hook:
        cfg.comm_hook = hook
    ddp = D.DistributedDataParallel(model, cfg)
    loss = cx.MSELoss()
    x = np.ones((4, FUSED_IN), np.float32)
    sent = {}
    for mode in ("off", "raise", "off", "raise"):
        ddp.nonfinite = mode
        loss.forward(ddp.forward(x), np.zeros((4, FUSED_OUT), np.float32))
        with ddp.no_sync():
            ddp.backward(loss.backward(), input_grad=False)
        before = cx._core.dist._bytes_sent()
        ddp.sync_gradients()
        sent.setdefault(mode, []).append(cx._core.dist._bytes_sent() - before)
        model.zero_grad()
    return sent


@pytest.mark.parametrize("world, algo, extra", [(2, "recursive_doubling", 0), (2, "ring", 4), (3, "ring", 8)])
def test_an_all_finite_step_sends_no_message_of_its_own(world, algo, extra):
    """Where the reduction carries the result flags (the ring: a 4-byte word after each all-gather step; recursive
    doubling on a power of two: every rank holds the whole result), the check adds those words and nothing else."""
    for sent in ranks.run(bytes_body, world, env=ALGOS[algo], timeout=120):
        assert sent["off"][0] == sent["off"][1] > 0, sent
        assert sent["raise"] == [sent["off"][0] + extra] * 2, sent


def fit_warn_diverged():
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        X, y, m = models.digits_with_a_nan_row()
        cfg = D.DistributedTrainingConfig(epochs=2, batch_size=64, verbose=False, nonfinite="warn")
        h = D.DistributedTrainer(m, cx.CrossEntropyLoss(), cx.SGDOptimizer(0.05)).fit(X, y, cfg)
    return h.train_losses, h.train_accuracies, sum(issubclass(w.category, RuntimeWarning) for w in caught)


def test_fit_warn_on_a_model_gone_nan_finishes_with_nan_figures():
    """"warn" takes the bad step, so every later loss is NaN and left out: an epoch with no finite step has NaN
    figures (it divided by zero)."""
    for losses, accs, warned in ranks.run(fit_warn_diverged, 2, timeout=180):
        assert len(losses) == 2 and np.isfinite(losses[0]) and np.isnan(losses[1]) and np.isnan(accs[1])
        assert warned >= 2 * 14  # the gradient and the loss, every step of the second epoch (14 per rank)


# ---- the fused check under ZeRO-1 and the fp16/bf16 hooks; the switch every rank must set alike -----------------

def zero_cases(world):
    """Per step, {rank: [(element, value)]} for ZeRO-1's reduce-scatter of FUSED_COUNT elements in blocks of
    q = FUSED_COUNT // world (the tail, FUSED_COUNT % world elements, is all-reduced): for each rank r a NaN in
    block r-1, which it sends unread at step 0 (its right neighbour adds it), an inf at the last element of its
    own block (which it adds at the last step); a NaN in the tail; two ranks at once;
    every rank's finite 3e38 at one element (the sum overflows); then nothing."""
    q = FUSED_COUNT // world
    cases = [{}]
    for r in range(world):
        cases.append({r: [(((r - 1) % world) * q + 1, np.nan)]})
        cases.append({r: [(r * q + q - 1, np.inf)]})
    if FUSED_COUNT % world:
        cases.append({world - 1: [(FUSED_COUNT - 1, np.nan)]})
    cases.append({0: [(q + 3, np.nan)], world - 1: [(5, -np.inf)]})
    cases.append({r: [(7, 3e38)] for r in range(world)})
    cases.append({})
    return cases


def zero_fused_body(mode, chunk):
    """ZeRO-1 over SGD(lr=1): the step subtracts the averaged gradient. A 1 KiB scratch (bucket_size_mb) cuts the
    reduce-scatter into pieces, CX_CHUNK_BYTES its pieces into chunks. Per case: (error, warnings, this rank's own
    gradient, parameters before, parameters after)."""
    r, p = D.get_rank(), D.get_world_size()
    cx.set_num_threads(1)
    model = cx.SequentialModel()
    model.add(cx.LinearModule(FUSED_IN, FUSED_OUT, seed=3))
    cfg = D.DDPConfig()
    cfg.nonfinite = mode
    cfg.bucket_size_mb = chunk / (1 << 20)
    ddp = D.DistributedDataParallel(model, cfg)
    zero = D.ZeroRedundancyOptimizer(ddp, cx.SGDOptimizer(1.0))
    loss = cx.MSELoss()
    rng = np.random.default_rng(70 + r)
    out = []
    for case in zero_cases(p):
        g = backward_with(ddp, model, loss, rng, case.get(r, []))
        local, before = g.copy(), model.flat_parameters().copy()
        err = ""
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            try:
                ddp.update_parameters(zero)
            except D.NonFiniteError as e:
                err = str(e)
                model.zero_grad()
        out.append((err, [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)], local, before,
                    model.flat_parameters().copy()))
        if mode == "warn" and case:
            break  # the step was taken: the parameters are not finite from here on
    return out, ddp.skipped_steps, ddp.nonfinite_steps


def check_verdict_text(text, r, s, world, case, overflow_note):
    elements = sorted({at for hits in case.values() for at, _ in hits})
    assert text.startswith(f"DistributedDataParallel (rank {r}): step {s + 1}: the gradient averaged over the "
                           f"{world} ranks is not finite"), (s, text)
    names = sorted({param_of(e) for e in elements})
    assert "in parameters [" + ", ".join(f"{n}: {sum(param_of(e) == (n, k) for e in elements)} of {k} values"
                                         for n, k in names) + "]" in text, (s, text)
    if all(v == 3e38 for hits in case.values() for _, v in hits):
        assert overflow_note in text and "This rank's own gradient was finite." in text, (s, text)
        return
    assert f"The ranks whose own gradient was already not finite: {sorted(case)}." in text, (s, text)
    if r in case:
        mine = sorted({param_of(at) for at, _ in case[r]})
        assert "This rank's own gradient was not finite in [" + ", ".join(
            f"{n}: {sum(param_of(at) == (n, k) for at, _ in case[r])} of {k} values" for n, k in mine) + "]" in text, \
            (s, r, text)
    else:
        assert "This rank's own gradient was finite." in text, (s, r, text)


@pytest.mark.parametrize("mode, algo", [("raise", "ring"), ("warn", "ring"), ("skip", "ring"),
                                        ("raise", "hierarchical")])
@pytest.mark.parametrize("world", [2, 3])
def test_zero1_reduce_scatter_tests_what_it_adds_and_names_each_rank_and_parameter(world, mode, algo):
    """The fused check inside ZeRO-1's reduce-scatter (Note [Fused non-finite check]): a NaN or inf in each rank's
    every kind of block, in the tail, two ranks at once, an overflow; "raise" names the step, the parameters, the
    ranks and this rank's own part on every rank, "warn" says the same and steps, "skip" steps on no rank; a clean
    step's parameters are the old ones minus the NumPy average of every rank's gradient. (On one host the
    hierarchical reduce-scatter is one in-host reduce-scatter with its blocks mapped to the ranks'.)"""
    env = {"CX_CHUNK_BYTES": "256"} if algo == "ring" else {"CX_ALGORITHM": "hierarchical", "CX_CHUNK_BYTES": "256"}
    check_zero_fused(ranks.run(zero_fused_body, world, args=(mode, 1024), env=env, timeout=180), world, mode)


def check_zero_fused(res, world, mode):
    cases = zero_cases(world)[:len(res[0][0])]
    bad_steps = sum(1 for c in cases if c)
    for r, (out, skipped, seen) in enumerate(res):
        assert seen == bad_steps and skipped == (bad_steps if mode == "skip" else 0), (seen, skipped)
    for s, case in enumerate(cases):
        for r in range(world):
            err, warned, _, before, after = res[r][0][s]
            assert np.array_equal(after, res[0][0][s][4], equal_nan=True)  # the same parameters on every rank
            if not case:
                assert err == "" and warned == [], (err, warned)
                want = before.astype(np.float64) - np.mean(np.stack([res[k][0][s][2] for k in range(world)])
                                                           .astype(np.float64), 0)  # independent reference
                np.testing.assert_allclose(after, want, rtol=1e-5, atol=1e-6)
                continue
            text = err if mode == "raise" else (warned[0] if mode == "warn" else None)
            if mode == "warn":
                assert len(warned) == 1 and "The step is taken" in text and not np.isfinite(after).all()
            else:
                assert err == "" if mode == "skip" else "The optimizer step was not taken" in err
                assert np.array_equal(after, before)  # not taken
            if text is not None:
                check_verdict_text(text, r, s, world, case, "Every rank's own gradient was finite: their sum "
                                                            "overflowed float32.")


@pytest.mark.parametrize("algo", ["recursive_doubling", "ring"])
@pytest.mark.parametrize("hook", ["fp16", "bf16"])
@pytest.mark.parametrize("world", [2, 3])
def test_half_hooks_test_inside_their_casts_and_name_each_rank(world, hook, algo):
    """The fp16/bf16 hooks' casts test our own values as they narrow them and the result as they widen it (the
    ring, chunk by chunk; recursive doubling: the whole-buffer casts around it): each rank's NaN/inf, wherever it
    is, is named on every rank; a clean step is the NumPy average within the 16-bit type's rounding."""
    res = ranks.run(fused_body, world, args=(hook,), env=ALGOS[algo], timeout=180)
    cases = fused_cases(world)[:-2] + [{}]
    for s, case in enumerate(cases):
        for r in range(world):
            err, local, synced = res[r][s]
            if not case:
                want = np.mean(np.stack([res[k][s][1] for k in range(world)]).astype(np.float64), 0)
                assert err == "" and np.array_equal(synced, res[0][s][2])
                np.testing.assert_allclose(synced, want, rtol=0, atol=(world + 1) * 2.0 ** -7 * np.abs(want).max())
                continue
            check_verdict_text(err, r, s, world, case, "")


@pytest.mark.parametrize("world", [2, 3])
def test_the_half_hooks_check_sends_nothing_on_an_all_finite_step(world):
    """Every rank widens every element of the result, so each knows the verdict: no agreement message travels."""
    for sent in ranks.run(bytes_body, world, args=("bf16",), env=ALGOS["ring"], timeout=120):
        assert sent["off"][0] == sent["off"][1] > 0 and sent["raise"] == sent["off"], sent


def switch_body(on_ranks, which):
    model = make_model()
    ddp = D.DistributedDataParallel(model, D.DDPConfig())
    with ddp.join():
        with pytest.raises(ValueError, match=r"cannot change inside join\(\) \(a rank that has finished could not "
                                             r"take part\); set it before join\(\), on every rank"):
            setattr(ddp, which, True)
    try:
        setattr(ddp, which, D.get_rank() in on_ranks)
    except D.CollectiveMismatchError as e:
        return type(e).__name__, str(e)
    return "", ""


@pytest.mark.parametrize("world, on_ranks", [(2, (0,)), (3, (1, 2))])
@pytest.mark.parametrize("which", ["_fused_check", "_agree_by_message"])
def test_ranks_that_set_the_check_path_differently_are_named_on_every_rank(world, on_ranks, which):
    """The switch decides what the gradient collectives carry (the ring's flag words, the agreement message):
    setting it is collective, and a disagreement is a CollectiveMismatchError on every rank, not a stream out of
    step."""
    res = ranks.run(switch_body, world, args=(on_ranks, which), timeout=60)
    off = [r for r in range(world) if r not in on_ranks]
    for r, (kind, msg) in enumerate(res):
        assert kind == "CollectiveMismatchError", (kind, msg)
        assert msg == (f"DistributedDataParallel.{which} (rank {r}): the ranks disagree: True on ranks "
                       f"[{', '.join(map(str, on_ranks))}], False on ranks [{', '.join(map(str, off))}]. It decides "
                       "what the gradient collectives carry (the fused check's flag words and agreement message), "
                       "so every rank must set it alike"), msg
    same = ranks.run(switch_body, world, args=(tuple(range(world)), which), timeout=60)
    assert same == [("", "")] * world


# ---- inside join(): the ranks that have finished take part in the fused check ---------------------------------

def join_counts(world):
    return [3, 2] if world == 2 else [3, 3, 2]  # at step 2 the last rank has joined


def join_body(mode, bad):
    """Uneven inputs under ddp.join(); `bad` {step: rank}: that rank's own gradient of parameter 2 gets a NaN at
    that step (under no_sync, so sync_gradients' probed all-reduce carries it). Per step this rank took: (error,
    warnings, parameters after); and skipped_steps."""
    r, p = D.get_rank(), D.get_world_size()
    model = make_model()
    cfg = D.DDPConfig()
    cfg.nonfinite = mode
    ddp = D.DistributedDataParallel(model, cfg)
    opt = cx.SGDOptimizer(0.1)
    loss = cx.MSELoss()
    rng = np.random.default_rng(300 + r)
    out = []
    try:
        with ddp.join():
            for s in range(join_counts(p)[r]):
                x = rng.standard_normal((4, SIZES[0])).astype(np.float32)
                loss.forward(ddp.forward(x), rng.standard_normal((4, SIZES[-1])).astype(np.float32))
                with ddp.no_sync():
                    ddp.backward(loss.backward(), input_grad=False)
                if bad.get(s) == r:
                    o = param_offset(model, 2)
                    model.flat_gradients()[o:o + 1] = np.nan
                with warnings.catch_warnings(record=True) as w:
                    warnings.simplefilter("always")
                    ddp.update_parameters(opt)
                out.append(("", [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)],
                            model.flat_parameters().copy()))
    except D.NonFiniteError as e:
        out.append((str(e), [], model.flat_parameters().copy()))
    return out, ddp.skipped_steps, model.flat_parameters().copy()


@pytest.mark.parametrize("world", [2, 3])
def test_inside_join_a_finished_rank_takes_part_and_the_bad_rank_is_named(world):
    """At step 2 the last rank has joined (it adds zeros): a NaN from an active rank is still named by rank, with
    "warn" on every active rank; "skip" skips it on every active rank alike (everyone ends with the parameters of
    the last step taken: the first); "raise" with every rank active raises on every rank."""
    late = 0 if world == 2 else 1  # active at step 2
    res = ranks.run(join_body, world, args=("warn", {2: late}), timeout=120)
    for r, (out, skipped, final) in enumerate(res):
        assert len(out) == join_counts(world)[r] and all(o[0] == "" for o in out)
        assert all(o[1] == [] for o in out[:2]), out
        if r == world - 1:
            continue  # joined before step 2: it warns of nothing
        (msg,) = out[2][1]
        active = "1 rank" if world == 2 else f"{world - 1} ranks"  # the last rank has joined: not in the average
        assert msg.startswith(f"DistributedDataParallel (rank {r}): step 3: the gradient averaged over the {active} "
                              "is not finite (NaN or inf) in parameters [2 (layer 2 Linear.weight): 1 of 192 "
                              "values]"), msg
        assert f"The ranks whose own gradient was already not finite: [{late}]." in msg, msg
        assert ("This rank's own gradient was not finite in [2 (layer 2 Linear.weight): 1 of 192 values]" if r == late
                else "This rank's own gradient was finite.") in msg, msg
        assert "The step is taken" in msg, msg

    res = ranks.run(join_body, world, args=("skip", {1: world - 1, 2: late}), timeout=120)
    for r, (out, skipped, final) in enumerate(res):
        assert all(o[0] == "" and o[1] == [] for o in out), out
        assert skipped == (1 if r == world - 1 else 2), (r, skipped)
        assert np.array_equal(final, res[0][0][0][2])  # the parameters after step 0, on every rank
        assert np.isfinite(final).all()

    res = ranks.run(join_body, world, args=("raise", {1: world - 1}), timeout=120)
    for r, (out, skipped, final) in enumerate(res):
        err = out[1][0]
        assert err.startswith(f"DistributedDataParallel (rank {r}): step 2: ") and \
            "2 (layer 2 Linear.weight): 1 of 192 values" in err, err
        assert f"The ranks whose own gradient was already not finite: [{world - 1}]." in err, err
        assert len(out) == 2 and np.array_equal(final, res[0][0][0][2])


@pytest.mark.parametrize("world", [2, 3])
def test_raise_inside_join_reaches_the_finished_rank_at_once(world):
    """With "raise", a NaN from an active rank after the last rank has joined: the active ranks raise at the step,
    and the finished rank, which answered the agreement, raises the same error at once instead of waiting in the
    next join signal for ranks that have left (until the deadline)."""
    late = 0 if world == 2 else 1  # active at step 2, when the last rank has joined
    t0 = time.monotonic()
    res = ranks.run(join_body, world, args=("raise", {2: late}), timeout=120)
    assert time.monotonic() - t0 < 60
    for r, (out, skipped, final) in enumerate(res):
        assert len(out) == 3 and out[0][0] == out[1][0] == "", out
        err = out[2][0]
        active = "1 rank" if world == 2 else f"{world - 1} ranks"  # the last rank has joined: not in the average
        assert err.startswith(f"DistributedDataParallel (rank {r}): step 3: the gradient averaged over the {active} "
                              "is not finite (NaN or inf) in parameters [2 (layer 2 Linear.weight): 1 of 192 "
                              "values]"), err
        assert f"The ranks whose own gradient was already not finite: [{late}]." in err, err
        if r == world - 1:
            assert "This rank had finished its batches inside join(); the ranks still active did not take the " \
                   "step and raise this error too." in err, err
        else:
            assert "The optimizer step was not taken" in err, err
        assert np.array_equal(final, res[0][0][1][2])  # the parameters after step 2, on every rank
