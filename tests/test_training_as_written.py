"""The guide's training patterns do what they say: gradient accumulation gives the big batch's
gradients, synced gradients can be kept, fit() continues the epoch count and steps a scheduler, and a
divergence between the ranks' parameters is reported on every rank."""
import warnings

import numpy as np
import pytest

import ranks

import pycyxwiz as cx

D = cx.distributed


def mlp(seed=3):
    cx.manual_seed(seed)
    m = cx.SequentialModel()
    m.add(cx.LinearModule(12, 16))
    m.add(cx.ReLUModule())
    m.add(cx.LinearModule(16, 5))
    return m


def data(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 12)).astype(np.float32), rng.integers(0, 5, n).astype(np.int64)


# ---- gradient accumulation, as the guide writes it ---------------------------------------------

def accumulate(k, m):
    r, w = D.get_rank(), D.get_world_size()
    X, y = data(w * k * m)
    model = mlp()
    ddp = D.DistributedDataParallel(model)
    optimizer = cx.SGDOptimizer(0.1)
    loss_fn = cx.CrossEntropyLoss()
    accumulation_steps = k
    for i in range(k):  # rank r's micro-batches are rows [(r*k + i)*m, ...)
        rows = slice((r * k + i) * m, (r * k + i + 1) * m)
        output = ddp.forward(X[rows])
        loss = loss_fn.forward(output, y[rows]) / accumulation_steps  # noqa: F841 (as the guide writes it)
        ddp.backward(loss_fn.backward(1 / accumulation_steps))
        if (i + 1) % accumulation_steps == 0:
            ddp.sync_gradients()
            ddp.update_parameters(optimizer)
    # The reference: one process, one step on the whole batch of every rank's micro-batches.
    ref = mlp()
    ref_loss = cx.CrossEntropyLoss()
    out = ref.forward(X)
    ref_loss.forward(out, y)
    ref.zero_grad()
    ref.backward(ref_loss.backward())
    cx.SGDOptimizer(0.1).step(ref)
    return model.flat_parameters().copy(), ref.flat_parameters().copy()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_accumulating_with_the_loss_scaled_gives_the_big_batch_step(world):
    for mine, ref in ranks.run(accumulate, world, args=(4, 6)):
        np.testing.assert_allclose(mine, ref, rtol=2e-5, atol=2e-6)  # float32 sums in another order


def test_the_loss_backward_takes_a_scale_by_name_or_position():
    loss = cx.MSELoss()
    out, t = np.arange(6, dtype=np.float32).reshape(2, 3), np.zeros((2, 3), np.float32)
    loss.forward(out, t)
    g = loss.backward()
    np.testing.assert_array_equal(g, (np.float32(2) / np.float32(out.size)) * out)  # MSELoss: 2/n * (out - t)
    np.testing.assert_array_equal(loss.backward(0.25), g * np.float32(0.25))
    np.testing.assert_array_equal(loss.backward(scale=3.0), g * np.float32(3.0))
    assert loss.backward() is not g  # a new array each time: the loss keeps its own


# ---- synced gradients are values to keep --------------------------------------------------------

def synced_then_update():
    X, y = data(8, seed=D.get_rank())
    model = mlp()
    ddp = D.DistributedDataParallel(model)
    loss_fn, optimizer = cx.CrossEntropyLoss(), cx.SGDOptimizer(0.1)
    loss_fn.forward(ddp.forward(X), y)
    ddp.backward(loss_fn.backward())
    synced_grads = ddp.sync_gradients()
    before = synced_grads.copy()
    ddp.update_parameters(optimizer)
    return synced_grads, before, model.flat_gradients().copy()


def test_synced_gradients_outlive_the_update():
    outs = ranks.run(synced_then_update, 2)
    for synced, before, live in outs:
        assert np.any(synced != 0)
        np.testing.assert_array_equal(synced, before)  # the update zeroed the buffer, not this copy
        assert not np.any(live)
    np.testing.assert_array_equal(outs[0][0], outs[1][0])  # the average, the same on both ranks


# ---- fit() continues the epoch count ------------------------------------------------------------

def fits(calls, epochs_each):
    X, y = data(96, seed=1)
    model = mlp()
    trainer = D.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.AdamOptimizer(1e-2))
    config = D.DistributedTrainingConfig(epochs=epochs_each, batch_size=8, verbose=False)
    covered = []
    for _ in range(calls):
        covered.append(trainer.fit(X, y, config).epochs)
    return covered, model.flat_parameters().copy()


def test_fit_called_again_continues_the_epochs_and_their_shuffle():
    (one_covered, one_params), _ = ranks.run(fits, 2, args=(1, 3))
    (three_covered, three_params), _ = ranks.run(fits, 2, args=(3, 1))
    assert one_covered == [[1, 2, 3]]
    assert three_covered == [[1], [2], [3]]
    # Three fits of one epoch train exactly as one fit of three: the same shuffles, the same Adam steps.
    np.testing.assert_array_equal(one_params, three_params)


# ---- schedulers ------------------------------------------------------------------------------

def with_scheduler(kind, tmp):
    X, y = data(64, seed=2)
    model = mlp()
    opt = cx.SGDOptimizer(0.1)
    trainer = D.DistributedTrainer(model, cx.CrossEntropyLoss(), opt)
    config = D.DistributedTrainingConfig(epochs=3, batch_size=8, verbose=False)  # 4 steps per epoch per rank
    if kind == "epoch":
        sched = cx.StepLR(opt, step_size=1, gamma=0.5)
        trainer.fit(X, y, config, scheduler=sched)
        return sched.interval, sched.last_epoch, opt.lr
    if kind == "step":
        sched = cx.LinearWarmupLR(opt, warmup_steps=100)
        config.scheduler = sched
        trainer.fit(X, y, config)
        return sched.interval, sched.last_epoch, opt.lr
    if kind == "resume":
        sched = cx.StepLR(opt, step_size=1, gamma=0.5)
        config.checkpoint_every_n_epochs, config.checkpoint_dir = 1, tmp
        trainer.fit(X, y, config, scheduler=sched)
        model2 = mlp()
        opt2 = cx.SGDOptimizer(0.1)
        sched2 = cx.StepLR(opt2, step_size=1, gamma=0.5)
        t2 = D.DistributedTrainer(model2, cx.CrossEntropyLoss(), opt2)
        t2.fit(X, y, config, resume_from=f"{tmp}/epoch_0002.ckpt", scheduler=sched2)
        return sched2.last_epoch, opt2.lr, np.array_equal(model.flat_parameters(), model2.flat_parameters())
    other = cx.SGDOptimizer(0.1)
    try:
        trainer.fit(X, y, config, scheduler=cx.StepLR(other, step_size=1))
    except ValueError as e:
        return str(e)


def test_fit_steps_a_scheduler_per_epoch_or_per_step_and_checkpoints_it(tmp_path):
    for interval, steps, lr in ranks.run(with_scheduler, 2, args=("epoch", "")):
        assert (interval, steps) == ("epoch", 3) and lr == pytest.approx(0.1 * 0.5 ** 3)
    for interval, steps, lr in ranks.run(with_scheduler, 2, args=("step", "")):
        assert (interval, steps) == ("step", 12) and lr == pytest.approx(0.1 * (0.1 + 0.9 * 12 / 100))
    for steps, lr, same in ranks.run(with_scheduler, 2, args=("resume", str(tmp_path))):
        assert steps == 3 and lr == pytest.approx(0.1 * 0.5 ** 3) and same
    for msg in ranks.run(with_scheduler, 1, args=("wrong", "")):
        assert "not the trainer's optimizer" in msg


def test_a_scheduler_says_how_often_it_is_stepped():
    opt = cx.SGDOptimizer(0.1)
    assert cx.StepLR(opt, 2).interval == "epoch" and cx.CosineAnnealingLR(opt, 5).interval == "epoch"
    s = cx.LinearWarmupLR(opt, 10)
    assert s.interval == "step"
    s.interval = "epoch"
    assert s.interval == "epoch"
    with pytest.raises(ValueError, match="'epoch' or 'step'"):
        s.interval = "batch"


# ---- the ranks' parameters drifting apart is reported -------------------------------------------

def drift(on_divergence, every):
    X, y = data(64, seed=3)
    model = mlp()
    trainer = D.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.SGDOptimizer(0.05))
    config = D.DistributedTrainingConfig(epochs=1, batch_size=8, verbose=False, check_every_n_steps=every,
                                         on_divergence=on_divergence)
    trainer.fit(X, y, config)  # in step: no report
    if D.get_rank() == 1:
        model.flat_parameters()[3] += 1e-3  # something changed one rank's weights outside the optimizer
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            trainer.fit(X, y, config)
        except D.DistributedError as e:
            return "raised", str(e)
    return "warned", [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]


def test_parameters_that_differ_across_ranks_are_reported_on_every_rank():
    for kind, msgs in ranks.run(drift, 2, args=("warn", 2)):
        assert kind == "warned" and len(msgs) == 2, msgs  # steps 2 and 4 of the second fit's 4 per rank
        assert msgs[0].startswith("Gradients differ across ranks") and "after step 6" in msgs[0], msgs[0]
        assert "differs from rank 0's on ranks [1]" in msgs[0] and "Likely causes" in msgs[0], msgs[0]
    for kind, msg in ranks.run(drift, 2, args=("raise", 1)):
        assert kind == "raised" and "Gradients differ across ranks" in msg and "after step 5" in msg, msg
    for kind, msgs in ranks.run(drift, 2, args=("warn", 0)):
        assert kind == "warned" and msgs == []  # 0: never checked


def misconfigured(case):
    X, y = data(16)
    opt = cx.SGDOptimizer(0.1)
    trainer = D.DistributedTrainer(mlp(), cx.CrossEntropyLoss(), opt)
    config = D.DistributedTrainingConfig(epochs=1, batch_size=8, verbose=False)
    kw = {}
    if case == "every":
        config.check_every_n_steps = -1
    elif case == "divergence":
        config.on_divergence = "ignore"
    else:
        kw["scheduler"] = opt  # an optimizer where a scheduler belongs
    try:
        trainer.fit(X, y, config, **kw)
    except (ValueError, TypeError) as e:
        return type(e).__name__, str(e)


@pytest.mark.parametrize("case,exc,text", [
    ("every", "ValueError", "check_every_n_steps must be an int >= 0 (0: never), got -1"),
    ("divergence", "ValueError", "on_divergence must be 'warn' or 'raise', got 'ignore'"),
    ("scheduler", "TypeError", "scheduler must be a cx LRScheduler"),
])
def test_misconfigured_checks_and_schedulers_are_named(case, exc, text):
    (err,) = ranks.run(misconfigured, 1, args=(case,))
    assert err is not None and err[0] == exc and text in err[1], err
