"""Every module's and loss's backward against central finite differences of an
independent float64 NumPy implementation of its forward."""
import math

import numpy as np
import pytest

import pycyxwiz as cx
from refs import numeric_grad

RNG = np.random.default_rng(1234)
_erf = np.vectorize(math.erf)


def away_from_zero(shape, margin=0.05):
    x = RNG.standard_normal(shape)
    return np.where(np.abs(x) < margin, np.sign(x + 1e-12) * margin * 2, x)


def softmax64(z):
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def bn_train64(x, g, b, eps):
    mu = x.mean(axis=0)
    var = x.var(axis=0)
    return (x - mu) / np.sqrt(var + eps) * g + b


def conv2d64(x, w, b=None, stride=1, padding=0):
    """The convolution as one dot product per output pixel: independent of tests/test_image_layers.py's."""
    N, C, H, W = x.shape
    O, _, k, _ = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    OH, OW = (H + 2 * padding - k) // stride + 1, (W + 2 * padding - k) // stride + 1
    y = np.zeros((N, O, OH, OW))
    for i in range(OH):
        for j in range(OW):
            patch = xp[:, :, i * stride:i * stride + k, j * stride:j * stride + k]
            y[:, :, i, j] = np.tensordot(patch, w, axes=([1, 2, 3], [1, 2, 3]))
    return y if b is None else y + b[None, :, None, None]


def pool64(x, k, s, reduce):
    N, C, H, W = x.shape
    OH, OW = (H - k) // s + 1, (W - k) // s + 1
    return np.array([[[[reduce(x[n, c, i * s:i * s + k, j * s:j * s + k]) for j in range(OW)] for i in range(OH)]
                      for c in range(C)] for n in range(N)])


def bn2d_train64(x, g, b, eps):
    mu = x.mean(axis=(0, 2, 3), keepdims=True)
    var = x.var(axis=(0, 2, 3), keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g[None, :, None, None] + b[None, :, None, None]


def residual_model():
    block = cx.SequentialModel()
    block.add(cx.Conv2dModule(2, 3, 3, stride=2, padding=1, seed=4))
    block.add(cx.TanhModule())
    shortcut = cx.SequentialModel()
    shortcut.add(cx.Conv2dModule(2, 3, 1, stride=2, bias=False, seed=5))
    return cx.ResidualModule(block, shortcut)


# name -> (factory, input shape, reference forward f(x, params) in float64)
CASES = {
    "linear": (lambda: cx.LinearModule(5, 3, seed=1), (4, 5), lambda x, p: x @ p[0].T + p[1]),
    "linear_nobias": (lambda: cx.LinearModule(5, 3, bias=False, init="xavier", seed=2), (4, 5), lambda x, p: x @ p[0].T),
    "relu": (cx.ReLUModule, (4, 6), lambda x, p: np.maximum(x, 0)),
    "leaky_relu": (lambda: cx.LeakyReLUModule(0.2), (4, 6), lambda x, p: np.where(x > 0, x, 0.2 * x)),
    "sigmoid": (cx.SigmoidModule, (4, 6), lambda x, p: 1 / (1 + np.exp(-x))),
    "tanh": (cx.TanhModule, (4, 6), lambda x, p: np.tanh(x)),
    "gelu": (cx.GELUModule, (4, 6), lambda x, p: 0.5 * x * (1 + _erf(x / math.sqrt(2)))),
    "softmax": (cx.SoftmaxModule, (4, 6), lambda x, p: softmax64(x)),
    "batchnorm": (lambda: cx.BatchNormModule(5), (6, 5), lambda x, p: bn_train64(x, p[0], p[1], 1e-5)),
    # Outside DistributedDataParallel it is BatchNorm of its own batch (across ranks: test_batchnorm_across_ranks)
    "sync_batchnorm": (lambda: cx.SyncBatchNormModule(5), (6, 5), lambda x, p: bn_train64(x, p[0], p[1], 1e-5)),
    "flatten": (cx.FlattenModule, (3, 2, 4), lambda x, p: x.reshape(x.shape[0], -1)),
    "dropout_eval_like_p0": (lambda: cx.DropoutModule(0.0, seed=3), (4, 6), lambda x, p: x),
    "flatten_images": (cx.FlattenModule, (2, 3, 2, 2), lambda x, p: x.reshape(x.shape[0], -1)),
    "conv2d": (lambda: cx.Conv2dModule(2, 3, 3, padding=1, seed=1), (2, 2, 4, 5),
               lambda x, p: conv2d64(x, p[0], p[1], 1, 1)),
    "conv2d_strided_no_bias": (lambda: cx.Conv2dModule(3, 2, 3, stride=2, bias=False, seed=2), (1, 3, 7, 6),
                               lambda x, p: conv2d64(x, p[0], None, 2, 0)),
    "conv2d_1x1": (lambda: cx.Conv2dModule(3, 2, 1, seed=3), (2, 3, 3, 2), lambda x, p: conv2d64(x, p[0], p[1])),
    "max_pool": (lambda: cx.MaxPool2dModule(2), (2, 2, 4, 5), lambda x, p: pool64(x, 2, 2, np.max)),
    "max_pool_overlapping": (lambda: cx.MaxPool2dModule(3, 2), (1, 2, 5, 6), lambda x, p: pool64(x, 3, 2, np.max)),
    "avg_pool": (lambda: cx.AvgPool2dModule(3, 1), (2, 1, 4, 5), lambda x, p: pool64(x, 3, 1, np.mean)),
    "global_avg_pool": (cx.GlobalAvgPool2dModule, (2, 3, 3, 2), lambda x, p: x.mean(axis=(2, 3))),
    "batchnorm2d": (lambda: cx.BatchNorm2dModule(3), (2, 3, 3, 2), lambda x, p: bn2d_train64(x, p[0], p[1], 1e-5)),
    "sync_batchnorm_images": (lambda: cx.SyncBatchNormModule(3), (3, 3, 2, 2),
                              lambda x, p: bn2d_train64(x, p[0], p[1], 1e-5)),
    "residual": (residual_model, (2, 2, 5, 5),
                 lambda x, p: np.tanh(conv2d64(x, p[0], p[1], 2, 1)) + conv2d64(x, p[2], None, 2, 0)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_module_backward_matches_finite_differences(name):
    factory, shape, ref = CASES[name]
    model = cx.SequentialModel()
    model.add(factory())
    for p in model.parameters():  # non-trivial parameters (e.g. BatchNorm's gamma 1, beta 0)
        p[...] = RNG.standard_normal(p.shape).astype(np.float32)
    x64 = away_from_zero(shape)
    x32 = x64.astype(np.float32)
    x64 = x32.astype(np.float64)
    params64 = [p.astype(np.float64) for p in model.parameters()]

    y = model.forward(x32)
    y_ref = ref(x64, params64)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)

    gy64 = RNG.standard_normal(y_ref.shape)
    gy32 = gy64.astype(np.float32)
    gy64 = gy32.astype(np.float64)
    model.zero_grad()
    gx = model.backward(gy32)

    def loss():
        return float(np.sum(ref(x64, params64) * gy64))

    np.testing.assert_allclose(gx, numeric_grad(loss, x64), rtol=1e-4, atol=1e-5)
    for got, p64 in zip(model.gradients(), params64):
        np.testing.assert_allclose(got, numeric_grad(loss, p64), rtol=1e-4, atol=1e-5)


def test_dropout_masks_scale_and_vanish_in_eval():
    model = cx.SequentialModel()
    model.add(cx.DropoutModule(0.25, seed=7))
    x = np.ones((200, 50), np.float32)
    y = model.forward(x)
    kept = y != 0
    np.testing.assert_allclose(y[kept], 1 / 0.75, rtol=1e-6)
    assert abs(1 - kept.mean() - 0.25) < 0.02
    gy = RNG.standard_normal(y.shape).astype(np.float32)
    np.testing.assert_allclose(model.backward(gy), gy * y, rtol=1e-6)  # gradient uses the same mask
    model.eval()
    np.testing.assert_array_equal(model.forward(x), x)
    np.testing.assert_array_equal(model.backward(gy), gy)


def test_dropout_is_reproducible_from_its_seed():
    outs = []
    for _ in range(2):
        model = cx.SequentialModel()
        model.add(cx.DropoutModule(0.5, seed=11))
        outs.append(model.forward(np.ones((8, 16), np.float32)))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_batchnorm_eval_uses_running_statistics():
    bn = cx.BatchNormModule(3, momentum=0.5)
    model = cx.SequentialModel()
    model.add(bn)
    x = RNG.standard_normal((10, 3)).astype(np.float32) * 2 + 1
    model.forward(x)
    x64 = x.astype(np.float64)
    rm = 0.5 * x64.mean(axis=0)
    rv = 0.5 * 1 + 0.5 * x64.var(axis=0, ddof=1)
    np.testing.assert_allclose(bn.running_mean, rm, rtol=1e-5)
    np.testing.assert_allclose(bn.running_var, rv, rtol=1e-5)
    model.eval()
    x2 = RNG.standard_normal((4, 3)).astype(np.float32)
    np.testing.assert_allclose(model.forward(x2), (x2 - rm) / np.sqrt(rv + 1e-5), rtol=1e-5, atol=1e-6)
    gy = RNG.standard_normal((4, 3)).astype(np.float32)
    np.testing.assert_allclose(model.backward(gy), gy / np.sqrt(rv + 1e-5), rtol=1e-5, atol=1e-6)


def test_deep_model_backward_matches_finite_differences():
    model = cx.SequentialModel()
    for m in [cx.LinearModule(6, 8, seed=1), cx.TanhModule(), cx.LinearModule(8, 7, seed=2), cx.GELUModule(),
              cx.LinearModule(7, 4, seed=3), cx.SigmoidModule()]:
        model.add(m)
    x32 = RNG.standard_normal((5, 6)).astype(np.float32)
    x64 = x32.astype(np.float64)
    p64 = [p.astype(np.float64) for p in model.parameters()]

    def ref():
        h = np.tanh(x64 @ p64[0].T + p64[1])
        h = h @ p64[2].T + p64[3]
        h = 0.5 * h * (1 + _erf(h / math.sqrt(2)))
        return 1 / (1 + np.exp(-(h @ p64[4].T + p64[5])))

    gy = RNG.standard_normal((5, 4))
    model.forward(x32)
    gx = model.backward(gy.astype(np.float32))

    def loss():
        return float(np.sum(ref() * gy))

    np.testing.assert_allclose(gx, numeric_grad(loss, x64), rtol=1e-3, atol=1e-5)
    for got, p in zip(model.gradients(), p64):
        np.testing.assert_allclose(got, numeric_grad(loss, p), rtol=1e-3, atol=1e-5)


def test_standalone_module_forward_backward():
    lin = cx.LinearModule(3, 2, seed=5)
    x = RNG.standard_normal((4, 3)).astype(np.float32)
    y = lin.forward(x)
    w, b = lin.parameters()
    np.testing.assert_allclose(y, x @ w.T + b, rtol=1e-5)
    gy = RNG.standard_normal((4, 2)).astype(np.float32)
    np.testing.assert_allclose(lin.backward(gy), gy @ w, rtol=1e-5)
    np.testing.assert_allclose(lin.gradients()[0], gy.T @ x, rtol=1e-5)


def _phi(x):
    """The standard normal CDF and density, in float64."""
    return 0.5 * (1 + _erf(x / math.sqrt(2))), np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


# name -> (factory, y(x), dL/dx(x, gy)) in float64; the derivative at 0 is the one the layers take (x > 0).
ACTIVATIONS = {
    "relu": (cx.ReLUModule, lambda x: np.where(x > 0, x, 0.0), lambda x, g: np.where(x > 0, g, 0.0)),
    "leaky_relu": (lambda: cx.LeakyReLUModule(0.2), lambda x: np.where(x > 0, x, 0.2 * x),
                   lambda x, g: np.where(x > 0, g, 0.2 * g)),
    "leaky_relu_negative_slope": (lambda: cx.LeakyReLUModule(-1.5), lambda x: np.where(x > 0, x, -1.5 * x),
                                  lambda x, g: np.where(x > 0, g, -1.5 * g)),
    # sigmoid(x) = (1 + tanh(x/2)) / 2: no exp to overflow at x = -1e4, and not the layer's formula
    "sigmoid": (cx.SigmoidModule, lambda x: 0.5 * (1 + np.tanh(x / 2)),
                lambda x, g: g * 0.25 * (1 - np.tanh(x / 2) ** 2)),
    "tanh": (cx.TanhModule, np.tanh, lambda x, g: g * (1 - np.tanh(x) ** 2)),
    "gelu": (cx.GELUModule, lambda x: x * _phi(x)[0], lambda x, g: g * (_phi(x)[0] + x * _phi(x)[1])),
}


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_matches_its_formula_from_saturation_to_zero(name):
    """Forward and backward at once over -1e4..1e4, 0 included: where the sigmoid's and GELU's naive forms
    overflow or cancel, and where the derivatives of ReLU and LeakyReLU change. Both devices compute
    these formulas (csrc/cuda/act_rules.h); tests/test_gpu.py compares the GPU with the CPU."""
    factory, fwd, bwd = ACTIVATIONS[name]
    wide = [0.0, -0.0, 1e-30, -1e-30, 1e-3, -1e-3, 50.0, -50.0, 100.0, -100.0, 1e4, -1e4]
    x32 = np.concatenate([np.linspace(-30, 30, 1199), wide]).astype(np.float32).reshape(-1, 7)
    gy32 = RNG.standard_normal(x32.shape).astype(np.float32)
    x64, gy64 = x32.astype(np.float64), gy32.astype(np.float64)
    model = cx.SequentialModel()
    model.add(factory())
    y = model.forward(x32)
    gx = model.backward(gy32)
    # float32's own rounding; absolute near zero, where the backward's y(1 - y) or 1 - y^2 cancels in float32.
    np.testing.assert_allclose(y, fwd(x64), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(gx, bwd(x64, gy64), rtol=1e-6, atol=1e-6)


def _forward_in_a_child(scalar: str) -> dict:
    """Sigmoid and Tanh forward over a wide range and the special values, in a child process with
    CX_NN_SCALAR=scalar (read once per process)."""
    import io
    import os
    import subprocess
    import sys
    script = (
        "import io, sys, numpy as np, pycyxwiz as cx\n"
        "rng = np.random.default_rng(1)\n"
        "x = np.concatenate([rng.uniform(-1, 1, 20000), rng.uniform(-12, 12, 20000), rng.uniform(-110, 110, 20000),\n"
        "                    np.linspace(-0.7, 0.7, 2001), [0.0, -0.0, np.inf, -np.inf, np.nan, 0.625, -0.625, 87.3,\n"
        "                    -87.3, -87.4, -88.0, -103.0, -104.0, -130.0, 1e-30, -1e-30, 1e-45, 20.0, -20.0]]).astype(np.float32)\n"
        "out = {'x': x}\n"
        "g = rng.standard_normal(x.size).astype(np.float32); out['g'] = g\n"
        "for name, mod in (('sigmoid', cx.SigmoidModule()), ('tanh', cx.TanhModule()), ('gelu', cx.GELUModule())):\n"
        "    m = cx.SequentialModel(); m.add(mod); out[name] = np.asarray(m.forward(x.reshape(1, -1))).ravel()\n"
        "    out[name + '_bwd'] = np.asarray(m.backward(g.reshape(1, -1))).ravel()\n"
        "buf = io.BytesIO(); np.savez(buf, **out); sys.stdout.buffer.write(buf.getvalue())\n"
    )
    r = subprocess.run([sys.executable, "-c", script], env={**os.environ, "CX_NN_SCALAR": scalar},
                       capture_output=True, check=True, cwd="/")
    return dict(np.load(io.BytesIO(r.stdout)))


def test_sigmoid_tanh_and_gelu_on_eight_lanes_are_as_accurate_as_the_rules():
    """Note [Vector exp] (csrc/nn/kernels.cpp): the AVX2 paths against the rules' libm calls (CX_NN_SCALAR=1)
    and float64: Sigmoid and Tanh in ulps of the true value, subnormal results included; GELU forward and
    backward to the rules' bound; NaN, the infinities and -0 as the rules."""
    vec, ref = _forward_in_a_child("0"), _forward_in_a_child("1")
    x = vec["x"].astype(np.float64)
    with np.errstate(over="ignore"):
        exact = {"sigmoid": 1.0 / (1.0 + np.exp(-x)), "tanh": np.tanh(x)}
    for name in ("sigmoid", "tanh"):
        a, b, t = vec[name], ref[name], exact[name]
        nan = np.isnan(t)
        assert np.array_equal(np.isnan(a), nan) and np.array_equal(np.isnan(b), nan), name
        ulp = np.maximum(np.spacing(np.abs(t[~nan]).astype(np.float32)).astype(np.float64), 2.0 ** -149)
        assert np.max(np.abs(a[~nan] - t[~nan]) / ulp) <= 3.0, name
        assert np.max(np.abs(b[~nan] - t[~nan]) / ulp) <= 3.0, name  # the reference is as good
        special = ~nan & (np.isinf(x) | (x == 0))
        np.testing.assert_array_equal(a[special], b[special])
        assert np.array_equal(np.signbit(a[special]), np.signbit(b[special])), name  # tanh(-0) is -0
    # GELU: 1 + erf(x / sqrt 2) is only as good as float32's rounding of 1 on either path, so the bound is
    # absolute near zero and relative elsewhere, as in test_activation_matches_its_formula_from_saturation_to_zero.
    g = vec["g"].astype(np.float64)
    with np.errstate(invalid="ignore"):
        cdf = 0.5 * np.array([1.0 + math.erf(v / math.sqrt(2.0)) if np.isfinite(v) else float(v > 0) for v in x])
        pdf = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
        exact = {"gelu": x * cdf, "gelu_bwd": g * (cdf + x * pdf)}
    for name, t in exact.items():
        a, b = vec[name], ref[name]
        assert np.array_equal(np.isnan(a), np.isnan(b)), name
        ok = np.isfinite(t)
        for got in (a, b):
            np.testing.assert_allclose(got[ok], t[ok], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- losses

def ce64(z, t_onehot):
    m = z.max(axis=1, keepdims=True)
    lse = m + np.log(np.exp(z - m).sum(axis=1, keepdims=True))
    return float(np.mean(np.sum(t_onehot * (lse - z), axis=1)))


@pytest.mark.parametrize("label_dtype", [np.int32, np.int64, "onehot"])
def test_cross_entropy_backward_matches_finite_differences(label_dtype):
    z32 = (RNG.standard_normal((6, 5)) * 3).astype(np.float32)
    z64 = z32.astype(np.float64)
    labels = RNG.integers(0, 5, 6)
    onehot = np.eye(5)[labels]
    target = onehot.astype(np.float32) if label_dtype == "onehot" else labels.astype(label_dtype)
    loss = cx.CrossEntropyLoss()
    value = loss.forward(z32, target)
    assert value == pytest.approx(ce64(z64, onehot), rel=1e-5)
    np.testing.assert_allclose(loss.backward(), numeric_grad(lambda: ce64(z64, onehot), z64), rtol=1e-4, atol=1e-6)
    assert loss.accuracy() == pytest.approx(np.mean(z32.argmax(axis=1) == labels))


def test_cross_entropy_is_stable_for_huge_logits():
    z = np.array([[1000.0, 0.0, -1000.0], [-5e4, 5e4, 0.0]], np.float32)
    loss = cx.CrossEntropyLoss()
    assert loss.forward(z, np.array([0, 1])) == pytest.approx(0.0, abs=1e-6)
    assert np.isfinite(loss.forward(z, np.array([2, 0]))) and loss.forward(z, np.array([2, 0])) > 1e3
    assert np.all(np.isfinite(loss.backward()))


def test_mse_backward_matches_finite_differences():
    o32 = RNG.standard_normal((4, 3)).astype(np.float32)
    t32 = RNG.standard_normal((4, 3)).astype(np.float32)
    o64, t64 = o32.astype(np.float64), t32.astype(np.float64)
    loss = cx.MSELoss()

    def ref():
        return float(np.mean((o64 - t64) ** 2))

    assert loss.forward(o32, t32) == pytest.approx(ref(), rel=1e-5)
    np.testing.assert_allclose(loss.backward(), numeric_grad(ref, o64), rtol=1e-4, atol=1e-6)


def test_bce_with_logits_backward_matches_finite_differences():
    x32 = (RNG.standard_normal((5, 2)) * 4).astype(np.float32)
    t32 = RNG.uniform(0, 1, (5, 2)).astype(np.float32)
    x64, t64 = x32.astype(np.float64), t32.astype(np.float64)
    loss = cx.BCEWithLogitsLoss()

    def ref():
        p = 1 / (1 + np.exp(-x64))
        return float(np.mean(-(t64 * np.log(p) + (1 - t64) * np.log(1 - p))))

    assert loss.forward(x32, t32) == pytest.approx(ref(), rel=1e-5)
    np.testing.assert_allclose(loss.backward(), numeric_grad(ref, x64), rtol=1e-4, atol=1e-6)
    assert np.isfinite(loss.forward(np.array([[100.0, -100.0]], np.float32), np.array([[0.0, 1.0]], np.float32)))
