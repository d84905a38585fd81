"""SequentialModel: flat buffers, views, re-layout, the gradient-ready hook, modes, digits training."""
import time

import numpy as np
import pytest

import pycyxwiz as cx
from pycyxwiz.datasets import load_digits


def mlp(*sizes, seed=0):
    model = cx.SequentialModel()
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        if i:
            model.add(cx.ReLUModule())
        model.add(cx.LinearModule(a, b, seed=seed + i))
    return model


def test_seed_004_model_building_lines_run(tmp_path):
    model = cx.SequentialModel()
    model.add(cx.LinearModule(784, 256))
    model.add(cx.ReLUModule())
    model.add(cx.LinearModule(256, 10))
    loss_fn, opt = cx.CrossEntropyLoss(), cx.AdamOptimizer(0.001)
    x = np.random.default_rng(0).random((8, 784), dtype=np.float32)
    y = np.arange(8) % 10
    loss_fn.forward(model.forward(x), y)
    model.backward(loss_fn.backward())
    opt.step(model)
    model.save(str(tmp_path / "model.cyxmodel"))
    assert (tmp_path / "model.cyxmodel").exists()


def test_parameters_are_views_into_flat_buffers_in_layer_order():
    model = mlp(4, 3, 2)
    slices = model.param_slices()
    assert slices == [(0, 12), (12, 3), (15, 6), (21, 2)]
    assert model.num_parameters() == 23
    flat = model.flat_parameters()
    shapes = [p.shape for p in model.parameters()]
    assert shapes == [(3, 4), (3,), (2, 3), (2,)]
    for p, (off, cnt) in zip(model.parameters(), slices):
        np.testing.assert_array_equal(p.ravel(), flat[off:off + cnt])
    model.parameters()[2][...] = 7.0  # writes go into the model
    assert np.all(flat[15:21] == 7.0)
    assert np.all(model[2].weight == 7.0)
    model.flat_gradients()[...] = 1.0
    assert all(np.all(g == 1.0) for g in model.gradients())
    model.zero_grad()
    assert not model.flat_gradients().any()


def test_add_after_buffers_exist_relays_out_values():
    model = cx.SequentialModel()
    first = cx.LinearModule(3, 2, seed=1)
    w_before = first.weight.copy()
    model.add(first)
    model.flat_parameters()[...] = np.arange(8, dtype=np.float32)
    model.flat_gradients()[...] = -np.arange(8, dtype=np.float32)
    model.add(cx.TanhModule())
    second = cx.LinearModule(2, 4, seed=2)
    w2 = second.weight.copy()
    model.add(second)
    assert model.num_parameters() == 8 + 12
    np.testing.assert_array_equal(model.flat_parameters()[:8], np.arange(8))
    np.testing.assert_array_equal(model.flat_gradients()[:8], -np.arange(8))
    np.testing.assert_array_equal(model.parameters()[2], w2)
    assert not np.array_equal(w_before.ravel(), np.arange(6))
    np.testing.assert_array_equal(first.weight.ravel(), np.arange(6))  # module views follow the model


def test_module_belongs_to_one_model():
    lin = cx.LinearModule(2, 2)
    cx.SequentialModel().add(lin)
    with pytest.raises(ValueError, match="already belongs to a model"):
        cx.SequentialModel().add(lin)


def test_grad_ready_hook_fires_once_per_parameter_in_reverse_order():
    model = mlp(5, 4, 3, 2)
    model.add(cx.BatchNormModule(2))
    seen = []
    grads_at_call = {}

    def hook(i):
        seen.append(i)
        off, cnt = model.param_slices()[i]
        grads_at_call[i] = model.flat_gradients()[off:off + cnt].copy()

    model._set_grad_ready_hook(hook)
    x = np.random.default_rng(0).random((6, 5), dtype=np.float32)
    model.forward(x)
    model.backward(np.ones((6, 2), np.float32))
    assert seen == list(range(len(model.param_slices())))[::-1]
    for i, g in grads_at_call.items():  # final when announced
        off, cnt = model.param_slices()[i]
        np.testing.assert_array_equal(g, model.flat_gradients()[off:off + cnt])
    seen.clear()
    model.backward(np.ones((6, 2), np.float32), input_grad=False)
    assert seen == list(range(8))[::-1]
    model._set_grad_ready_hook(None)
    model.backward(np.ones((6, 2), np.float32))
    assert seen == list(range(8))[::-1]


def test_backward_accumulates_and_input_grad_can_be_skipped():
    model = mlp(3, 4, 2)
    x = np.random.default_rng(1).random((5, 3), dtype=np.float32)
    gy = np.random.default_rng(2).random((5, 2), dtype=np.float32)
    model.forward(x)
    gx = model.backward(gy)
    once = model.flat_gradients().copy()
    assert model.backward(gy, input_grad=False) is None
    np.testing.assert_allclose(model.flat_gradients(), 2 * once, rtol=1e-6)
    assert gx.shape == x.shape


def test_forward_keeps_its_input_alive_for_backward():
    model = mlp(3, 4, 2)
    model.forward(np.random.default_rng(1).random((5, 3), dtype=np.float32))  # temporary array
    for _ in range(3):
        np.empty((5, 3), np.float32).fill(1e30)  # would overwrite freed memory
    gx = model.backward(np.ones((5, 2), np.float32))
    assert np.all(np.isfinite(gx)) and np.all(np.isfinite(model.flat_gradients()))


def test_train_eval_modes_and_repr():
    model = mlp(3, 2)
    model.add(cx.DropoutModule(0.5))
    assert model.training
    assert model.eval() is model and not model.training
    model.train()
    assert model.training
    text = repr(model)
    assert "Linear(3, 2)" in text and "Dropout(p=0.5)" in text
    summary = model.summary()
    assert "total parameters: 8" in summary
    assert len(model) == 2 and repr(model[-1]) == "Dropout(p=0.5)"


def test_linear_init_is_seeded_and_scaled():
    a = cx.LinearModule(100, 50, seed=3)
    b = cx.LinearModule(100, 50, seed=3)
    np.testing.assert_array_equal(a.weight, b.weight)
    assert np.abs(a.weight).max() <= np.sqrt(6 / 100)
    assert a.weight.std() == pytest.approx(np.sqrt(6 / 100) / np.sqrt(3), rel=0.05)
    x = cx.LinearModule(100, 50, init="xavier", seed=3)
    assert np.abs(x.weight).max() <= np.sqrt(6 / 150)
    assert not np.any(a.bias)
    cx.manual_seed(42)
    c = cx.LinearModule(4, 4)
    cx.manual_seed(42)
    np.testing.assert_array_equal(c.weight, cx.LinearModule(4, 4).weight)


def test_set_num_threads():
    old = cx.get_num_threads()
    cx.set_num_threads(1)
    assert cx.get_num_threads() == 1
    cx.set_num_threads(old)
    with pytest.raises(ValueError, match="n >= 1"):
        cx.set_num_threads(0)
    with pytest.raises(ValueError, match="set_num_threads: at most 1024 threads, got 100000"):
        cx.set_num_threads(100000)
    assert cx.get_num_threads() == old


def test_mlp_learns_digits_to_95_percent():
    X, y = load_digits()
    assert X.shape == (1797, 64) and X.dtype == np.float32 and y.dtype == np.int64
    rng = np.random.default_rng(0)
    order = rng.permutation(len(X))
    train, test = order[:1400], order[1400:]
    model = cx.SequentialModel()
    model.add(cx.LinearModule(64, 128, seed=1))
    model.add(cx.ReLUModule())
    model.add(cx.DropoutModule(0.1, seed=2))
    model.add(cx.LinearModule(128, 10, seed=3))
    loss_fn = cx.CrossEntropyLoss()
    opt = cx.AdamOptimizer(2e-3)
    sched = cx.CosineAnnealingLR(opt, T_max=30)
    start = time.perf_counter()
    for epoch in range(30):
        rng.shuffle(train)
        for i in range(0, len(train), 32):
            idx = train[i:i + 32]
            loss_fn.forward(model.forward(X[idx]), y[idx])
            model.zero_grad()
            model.backward(loss_fn.backward(), input_grad=False)
            opt.step(model)
        sched.step()
    model.eval()
    loss_fn.forward(model.forward(X[test]), y[test])
    assert loss_fn.accuracy() >= 0.95, f"held-out accuracy {loss_fn.accuracy():.3f}"
    assert time.perf_counter() - start < 60


def _threads_in_child(env):
    import os
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items()
             if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "LOCAL_WORLD_SIZE", "WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-c", "import pycyxwiz as cx; print(cx.get_num_threads())"],
                         env={**clean, **env}, capture_output=True, text=True, check=True, cwd="/")
    return int(out.stdout.strip())


@pytest.mark.parametrize("env,expect_one", [({"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}, True),
                                             ({"WORLD_SIZE": "4"}, True),
                                             ({"LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "4"}, False)])
def test_default_blas_threads_are_one_per_rank_when_ranks_share_a_host(env, expect_one):
    import os

    n = _threads_in_child(env)
    if expect_one:
        assert n == 1
    else:  # one rank on this host: OpenBLAS's all-cores default, as for a plain process
        single = _threads_in_child({})
        assert n == single
        assert single >= min(2, os.cpu_count())


def test_dropout_rng_state_round_trips_and_replays_the_same_masks():
    model = cx.SequentialModel()
    model.add(cx.DropoutModule(0.5, seed=3))
    model.add(cx.LinearModule(8, 8, seed=1))
    model.add(cx.DropoutModule(0.5, seed=4))
    x = np.ones((4, 8), np.float32)
    state = model.get_rng_state()
    assert state.dtype == np.uint64 and state.shape == (2,)
    first = model.forward(x)
    assert not np.array_equal(model.get_rng_state(), state)  # drawing advanced the streams
    assert not np.array_equal(model.forward(x), first)
    model.set_rng_state(state)
    assert np.array_equal(model.forward(x), first)           # the same masks again
    drop = model[0]
    s = drop.get_rng_state()
    a = drop.forward(x)
    drop.set_rng_state(s)
    assert isinstance(s, int) and np.array_equal(drop.forward(x), a)
    model.eval()
    before = model.get_rng_state()
    model.forward(x)
    assert np.array_equal(model.get_rng_state(), before)     # eval mode draws nothing
    with pytest.raises(ValueError, match="has 2 module\\(s\\) with a random-number generator .* got 1"):
        model.set_rng_state(np.zeros(1, np.uint64))
    assert cx.SequentialModel().get_rng_state().shape == (0,)


@pytest.mark.parametrize("make", [cx.ReLUModule, lambda: cx.LeakyReLUModule(0.1), cx.SigmoidModule, cx.TanhModule,
                                  cx.GELUModule])
def test_every_activation_keeps_a_nan_a_nan_as_numpy_does(make):
    """A NaN in an input row used to become 0 in ReLU (x > 0 ? x : 0), so fit reported a finite loss and said
    nothing; np.maximum(x, 0) and torch.relu keep it NaN, and so does every activation here."""
    m = cx.SequentialModel()
    m.add(make())
    x = np.array([[np.nan, -1.0, 0.0, 2.0]], np.float32)
    y = np.asarray(m.forward(x))
    assert np.isnan(y[0, 0]), y
    assert np.isfinite(y[0, 1:]).all(), y
