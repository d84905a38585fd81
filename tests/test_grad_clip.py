"""DistributedTrainingConfig.grad_clip_norm / grad_clip_value on 2 real ranks: one SGD step against a NumPy
reference of the gradient averaged over both ranks' batches, ZeRO-1's global norm, and the errors."""
import numpy as np
import pytest

import ranks

import pycyxwiz as cx

D = cx.distributed
N, BATCH = 64, 32            # two ranks, one batch each: one optimizer step on all N samples


def samples():
    X, y = cx.datasets.load_digits()
    return X[:N], y[:N]


def reference_gradient():
    """The mean cross-entropy's gradient over all N samples (what DDP averages) for a zero-initialised
    LinearModule(64, 10), in float64, in the order of model.parameters() (weight (10, 64), bias (10,))."""
    X, y = samples()
    X = X.astype(np.float64)
    p = np.full((N, 10), 0.1)                      # softmax of zero logits
    dz = (p - np.eye(10)[y]) / N
    return np.concatenate([(dz.T @ X).ravel(), dz.sum(0)])


def one_step(clip_norm, clip_value, shard):
    """Parameters after one SGD(lr=1) step from zero: minus the clipped averaged gradient, exactly."""
    X, y = samples()
    model = cx.SequentialModel()
    model.add(cx.LinearModule(64, 10))
    model.flat_parameters()[:] = 0
    trainer = D.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.SGDOptimizer(1.0))
    c = D.DistributedTrainingConfig(epochs=1, batch_size=BATCH, shuffle=False, verbose=False,
                                    grad_clip_norm=clip_norm, grad_clip_value=clip_value,
                                    shard_optimizer_state=shard)
    trainer.fit(X, y, c)
    return -model.flat_parameters().astype(np.float64)


def close(step, expected):
    # float32 forward/backward over 64 features and 32 rows per rank, against float64.
    np.testing.assert_allclose(step, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())


@pytest.mark.parametrize("shard", [False, True], ids=["ddp", "zero1"])
def test_a_clipped_sgd_step_has_at_most_the_bound_in_the_reference_direction(shard):
    g = reference_gradient()
    norm = np.linalg.norm(g)
    bound = 0.25 * norm
    for step in ranks.run(one_step, 2, args=(bound, None, shard)):
        assert np.linalg.norm(step) <= bound
        assert np.linalg.norm(step) > 0.999 * bound
        close(step, g * (bound / (norm + 1e-6)))
    # Under ZeRO-1 each rank holds half the gradient: clipping each half by its own norm would give a step
    # of norm up to sqrt(2) * bound, and a direction that is not the gradient's. The bound above holds only
    # because the norm is the global one.


def test_a_step_below_the_bound_is_not_clipped():
    g = reference_gradient()
    for step in ranks.run(one_step, 2, args=(2 * np.linalg.norm(g), None, False)):
        close(step, g)


@pytest.mark.parametrize("shard", [False, True], ids=["ddp", "zero1"])
def test_value_clipping_clamps_every_element_of_the_averaged_gradient(shard):
    g = reference_gradient()
    v = 0.2 * np.abs(g).max()
    for step in ranks.run(one_step, 2, args=(None, v, shard)):
        assert np.abs(step).max() <= np.float32(v)
        close(step, np.clip(g, -v, v))


def test_both_bounds_together_hold_after_the_step():
    g = reference_gradient()
    v, bound = 0.2 * np.abs(g).max(), 0.1 * np.linalg.norm(g)
    clipped = np.clip(g, -v, v)
    expected = clipped * min(1.0, bound / (np.linalg.norm(clipped) + 1e-6))
    for step in ranks.run(one_step, 2, args=(bound, v, False)):
        assert np.linalg.norm(step) <= bound and np.abs(step).max() <= np.float32(v)
        close(step, expected)


def train_clipped(shard):
    X, y = cx.datasets.load_digits()
    model = cx.SequentialModel()
    model.add(cx.LinearModule(64, 32, seed=1))
    model.add(cx.ReLUModule())
    model.add(cx.LinearModule(32, 10, seed=2))
    trainer = D.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.AdamOptimizer(1e-2))
    h = trainer.fit(X[:600], y[:600], D.DistributedTrainingConfig(epochs=3, batch_size=16, verbose=False,
                                                                  grad_clip_norm=0.05, shard_optimizer_state=shard))
    return model.flat_parameters().copy(), h.train_losses


def test_zero1_trains_as_the_unsharded_optimizer_with_clipping():
    plain = ranks.run(train_clipped, 2, args=(False,))
    sharded = ranks.run(train_clipped, 2, args=(True,))
    for (pa, la), (pb, lb) in zip(plain, sharded):
        # The norm is summed in another order (two shards), so the scale may differ in its last bits.
        np.testing.assert_allclose(pb, pa, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(lb, la, rtol=1e-5)


def nan_body(clip):
    X, y = samples()
    X = X.copy()
    X[5, 3] = np.nan
    model = cx.SequentialModel()
    model.add(cx.LinearModule(64, 10))
    trainer = D.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.SGDOptimizer(0.1))
    # nonfinite="off": the non-finite check (on by default) would name the NaN before clipping sees it.
    trainer.fit(X, y, D.DistributedTrainingConfig(epochs=1, batch_size=BATCH, shuffle=False, verbose=False,
                                                  nonfinite="off", **clip))


@pytest.mark.parametrize("clip, text", [
    ({"grad_clip_norm": 1.0}, "the gradient's norm is nan, so grad_clip_norm cannot clip it"),
    ({"grad_clip_value": 1.0}, "the gradient holds NaN, so grad_clip_value cannot clip it"),
])
def test_a_nan_gradient_is_an_error_on_every_rank(clip, text):
    # One sample of rank 1's batch is NaN; the averaged gradient, the same on both ranks, holds NaN.
    for o in ranks.spawn(nan_body, 2, args=(clip,)):
        assert not o.ok and o.exc_type == "ValueError" and text in o.message, (o.exc_type, o.message)


def bad_clip(value):
    X, y = samples()
    model = cx.SequentialModel()
    model.add(cx.LinearModule(64, 10))
    trainer = D.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.SGDOptimizer(0.1))
    trainer.fit(X, y, D.DistributedTrainingConfig(epochs=1, verbose=False, **value))


@pytest.mark.parametrize("value, text", [
    ({"grad_clip_norm": -1.0}, "DistributedTrainingConfig.grad_clip_norm must be a finite number > 0 (None: no "
                               "clipping), got -1.0"),
    ({"grad_clip_norm": 0}, "grad_clip_norm must be a finite number > 0 (None: no clipping), got 0"),
    ({"grad_clip_value": float("inf")}, "grad_clip_value must be a finite number > 0 (None: no clipping), got inf"),
    ({"grad_clip_value": True}, "grad_clip_value must be a finite number > 0 (None: no clipping), got True"),
    ({"grad_clip_norm": "1"}, "grad_clip_norm must be a finite number > 0 (None: no clipping), got '1'"),
])
def test_a_bad_clip_setting_is_refused_with_its_name(value, text):
    (o,) = ranks.spawn(bad_clip, 1, args=(value,))
    assert o.exc_type == "ValueError" and text in o.message, (o.exc_type, o.message)
