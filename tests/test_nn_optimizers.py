"""Optimizers, schedulers and clipping against NumPy implementations of their published formulas."""
import math

import numpy as np
import pytest

import pycyxwiz as cx

STEPS = 6


def make_model():
    model = cx.SequentialModel()
    model.add(cx.LinearModule(7, 5, seed=1))
    model.add(cx.ReLUModule())
    model.add(cx.LinearModule(5, 3, seed=2))
    return model


def run(opt, model, grads):
    """Applies the given gradient sequence through the C++ optimizer; returns params after each step."""
    out = []
    for g in grads:
        model.flat_gradients()[...] = g
        opt.step(model)
        out.append(model.flat_parameters().astype(np.float64))
    return out


def sgd_ref(p, grads, lr, momentum=0.0, nesterov=False, wd=0.0):
    buf = None
    out = []
    for g in grads:
        d = g + wd * p
        if momentum:
            buf = d.copy() if buf is None else momentum * buf + d
            d = d + momentum * buf if nesterov else buf
        p = p - lr * d
        out.append(p)
    return out


def adam_ref(p, grads, lr, b1, b2, eps, wd=0.0, decoupled=False):
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    out = []
    for t, g in enumerate(grads, start=1):
        if decoupled:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        mhat = m / (1 - b1**t)
        vhat = v / (1 - b2**t)
        p = p - lr * mhat / (np.sqrt(vhat) + eps)
        out.append(p)
    return out


def rmsprop_ref(p, grads, lr, alpha, eps, wd=0.0, momentum=0.0):
    v = np.zeros_like(p)
    buf = np.zeros_like(p)
    out = []
    for g in grads:
        g = g + wd * p
        v = alpha * v + (1 - alpha) * g * g
        d = g / (np.sqrt(v) + eps)
        if momentum:
            buf = momentum * buf + d
            d = buf
        p = p - lr * d
        out.append(p)
    return out


CASES = {
    "sgd": (lambda: cx.SGDOptimizer(0.1), lambda p, g: sgd_ref(p, g, 0.1)),
    "sgd_momentum_wd": (lambda: cx.SGDOptimizer(0.05, momentum=0.9, weight_decay=0.01),
                        lambda p, g: sgd_ref(p, g, 0.05, 0.9, False, 0.01)),
    "sgd_nesterov": (lambda: cx.SGDOptimizer(0.05, momentum=0.8, nesterov=True),
                     lambda p, g: sgd_ref(p, g, 0.05, 0.8, True)),
    "adam": (lambda: cx.AdamOptimizer(0.01), lambda p, g: adam_ref(p, g, 0.01, 0.9, 0.999, 1e-8)),
    "adam_l2": (lambda: cx.AdamOptimizer(0.02, 0.8, 0.99, 1e-6, 0.1),
                lambda p, g: adam_ref(p, g, 0.02, 0.8, 0.99, 1e-6, 0.1)),
    "adamw": (lambda: cx.AdamWOptimizer(0.01, weight_decay=0.1),
              lambda p, g: adam_ref(p, g, 0.01, 0.9, 0.999, 1e-8, 0.1, decoupled=True)),
    "rmsprop": (lambda: cx.RMSpropOptimizer(0.01), lambda p, g: rmsprop_ref(p, g, 0.01, 0.99, 1e-8)),
    "rmsprop_momentum_wd": (lambda: cx.RMSpropOptimizer(0.01, alpha=0.9, eps=1e-6, weight_decay=0.05, momentum=0.5),
                            lambda p, g: rmsprop_ref(p, g, 0.01, 0.9, 1e-6, 0.05, 0.5)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_optimizer_matches_published_formula(name):
    make_opt, ref = CASES[name]
    model = make_model()
    rng = np.random.default_rng(0)
    n = model.num_parameters()
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(STEPS)]
    p0 = model.flat_parameters().astype(np.float64)
    got = run(make_opt(), model, grads)
    want = ref(p0, [g.astype(np.float64) for g in grads])
    for step, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6, err_msg=f"{name} step {step + 1}")


@pytest.mark.parametrize("name", sorted(CASES))
def test_state_dict_resumes_exactly(name):
    make_opt, _ = CASES[name]
    rng = np.random.default_rng(1)
    n = make_model().num_parameters()
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(STEPS)]
    full_model, full_opt = make_model(), make_opt()
    run(full_opt, full_model, grads)

    model, opt = make_model(), make_opt()
    run(opt, model, grads[:3])
    state = opt.state_dict()
    assert state["step"] == 3 and isinstance(state["lr"], float)
    resumed = make_opt()
    resumed.load_state_dict(state)
    assert resumed.state_dict().keys() == state.keys()
    run(resumed, model, grads[3:])
    np.testing.assert_array_equal(model.flat_parameters(), full_model.flat_parameters())


def test_load_state_dict_rejects_other_optimizer():
    opt = cx.AdamOptimizer()
    opt.step(make_model())
    with pytest.raises(ValueError, match="Adam optimizer, this is SGD"):
        cx.SGDOptimizer(0.1).load_state_dict(opt.state_dict())


def test_optimizer_bound_to_one_model_size():
    opt = cx.AdamOptimizer()
    opt.step(make_model())
    other = cx.SequentialModel()
    other.add(cx.LinearModule(2, 2))
    with pytest.raises(ValueError, match="built for 58 parameters, this model has 6"):
        opt.step(other)


def test_lr_get_set_and_zero_grad():
    model = make_model()
    opt = cx.SGDOptimizer(0.1)
    opt.lr = 0.5
    assert opt.lr == 0.5
    model.flat_gradients()[...] = 1.0
    opt.zero_grad(model)
    assert not model.flat_gradients().any()
    with pytest.raises(ValueError, match="learning rate"):
        opt.lr = -1.0


def test_step_lr():
    opt = cx.SGDOptimizer(1.0)
    s = cx.StepLR(opt, step_size=2, gamma=0.5)
    lrs = [opt.lr]
    for _ in range(5):
        s.step()
        lrs.append(s.get_last_lr())
    assert lrs == pytest.approx([1, 1, 0.5, 0.5, 0.25, 0.25])


def test_cosine_annealing():
    opt = cx.AdamOptimizer(0.1)
    s = cx.CosineAnnealingLR(opt, T_max=4, eta_min=0.01)
    lrs = [opt.lr]
    for _ in range(6):
        s.step()
        lrs.append(opt.lr)
    want = [0.01 + 0.09 * (1 + math.cos(math.pi * min(e, 4) / 4)) / 2 for e in range(7)]
    assert lrs == pytest.approx(want)


def test_linear_warmup_and_scheduler_resume():
    opt = cx.SGDOptimizer(1.0)
    s = cx.LinearWarmupLR(opt, warmup_steps=4, start_factor=0.2)
    lrs = [opt.lr]
    for _ in range(5):
        s.step()
        lrs.append(opt.lr)
    assert lrs == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0])
    opt2 = cx.SGDOptimizer(123.0)
    s2 = cx.LinearWarmupLR(opt2, warmup_steps=4, start_factor=0.2)
    s2.load_state_dict({"last_epoch": 2, "base_lr": 1.0})
    assert opt2.lr == pytest.approx(0.6)


def test_clip_grad_norm_matches_numpy():
    model = make_model()
    g = np.random.default_rng(3).standard_normal(model.num_parameters()).astype(np.float32)
    model.flat_gradients()[...] = g
    norm = cx.clip_grad_norm(model, 1.0)
    assert norm == pytest.approx(np.linalg.norm(g.astype(np.float64)), rel=1e-6)
    np.testing.assert_allclose(model.flat_gradients(), g * (1.0 / (norm + 1e-6)), rtol=1e-6)
    assert np.linalg.norm(model.flat_gradients()) <= 1.0 + 1e-5
    before = model.flat_gradients().copy()
    cx.clip_grad_norm(model, 10.0)  # below the limit: untouched
    np.testing.assert_array_equal(model.flat_gradients(), before)


def test_vectorised_and_scalar_kernels_agree():
    """The AVX2 paths against the plain scalar reference (CX_NN_SCALAR=1), in a child process."""
    import os
    import subprocess
    import sys

    script = (
        "import numpy as np, pycyxwiz as cx\n"
        "m = cx.SequentialModel(); m.add(cx.LinearModule(37, 29, seed=1))\n"
        "rng = np.random.default_rng(0)\n"
        "for opt in (cx.AdamOptimizer(0.01, weight_decay=0.1), cx.AdamWOptimizer(0.01),\n"
        "            cx.RMSpropOptimizer(0.01, momentum=0.9), cx.SGDOptimizer(0.1, momentum=0.9, nesterov=True)):\n"
        "    for _ in range(4):\n"
        "        m.flat_gradients()[...] = rng.standard_normal(m.num_parameters()).astype(np.float32)\n"
        "        opt.step(m)\n"
        "np.save(__import__('sys').stdout.buffer, m.flat_parameters())\n"
    )
    outs = []
    for scalar in ("0", "1"):
        env = {**os.environ, "CX_NN_SCALAR": scalar}
        r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, check=True, cwd="/")
        import io
        outs.append(np.load(io.BytesIO(r.stdout)))
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)
