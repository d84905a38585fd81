"""The image layers (csrc/nn/layers/): Conv2d, MaxPool2d, AvgPool2d, GlobalAvgPool2d, BatchNorm2d and the
Residual container, each against an independent float64 NumPy implementation of its forward and backward
written here; a whole small ResNet's gradients against central finite differences; every error they raise.
(Their backward against finite differences of these references, layer by layer: test_nn_gradients.py.)"""
import itertools

import numpy as np
import pytest

import pycyxwiz as cx
from refs import numeric_grad

RNG = np.random.default_rng(2024)
D = cx.distributed


# ---- float64 references ------------------------------------------------------------------------

def out_size(n, k, s, p, d=1):
    return (n + 2 * p - d * (k - 1) - 1) // s + 1


def conv2d_ref(x, w, b=None, stride=1, padding=0, dilation=1, groups=1):
    """y[n, o, i, j] = sum over c, u, v of x_padded[n, c, i*s + u*d, j*s + v*d] * w[o, c, u, v] (+ b[o])."""
    N, C, H, W = x.shape
    O, Cg, k, _ = w.shape
    s, p, d = stride, padding, dilation
    OH, OW = out_size(H, k, s, p, d), out_size(W, k, s, p, d)
    xp = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))
    y = np.zeros((N, O, OH, OW))
    Og = O // groups
    for g in range(groups):
        for u, v in itertools.product(range(k), range(k)):
            patch = xp[:, g * Cg:(g + 1) * Cg, u * d:u * d + s * (OH - 1) + 1:s, v * d:v * d + s * (OW - 1) + 1:s]
            y[:, g * Og:(g + 1) * Og] += np.einsum("nchw,oc->nohw", patch, w[g * Og:(g + 1) * Og, :, u, v])
    if b is not None:
        y += b[None, :, None, None]
    return y


def conv2d_backward_ref(x, w, gy, stride=1, padding=0, dilation=1, groups=1):
    """(dx, dw, db) of sum(conv2d_ref(x, w, b) * gy): each kernel offset's patch, scattered back."""
    N, C, H, W = x.shape
    O, Cg, k, _ = w.shape
    s, p, d = stride, padding, dilation
    OH, OW = gy.shape[2:]
    xp = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))
    dxp = np.zeros_like(xp)
    dw = np.zeros_like(w)
    Og = O // groups
    for g in range(groups):
        gyg = gy[:, g * Og:(g + 1) * Og]
        for u, v in itertools.product(range(k), range(k)):
            rows = slice(u * d, u * d + s * (OH - 1) + 1, s)
            cols = slice(v * d, v * d + s * (OW - 1) + 1, s)
            patch = xp[:, g * Cg:(g + 1) * Cg, rows, cols]
            dw[g * Og:(g + 1) * Og, :, u, v] = np.einsum("nohw,nchw->oc", gyg, patch)
            dxp[:, g * Cg:(g + 1) * Cg, rows, cols] += np.einsum("nohw,oc->nchw", gyg, w[g * Og:(g + 1) * Og, :, u, v])
    return dxp[:, :, p:p + H, p:p + W], dw, gy.sum(axis=(0, 2, 3))


def windows(x, k, s):
    """(N, C, OH, OW, k*k): every pooling window's values, row-major within the window."""
    N, C, H, W = x.shape
    OH, OW = (H - k) // s + 1, (W - k) // s + 1
    out = np.empty((N, C, OH, OW, k * k))
    for u, v in itertools.product(range(k), range(k)):
        out[..., u * k + v] = x[:, :, u:u + s * (OH - 1) + 1:s, v:v + s * (OW - 1) + 1:s]
    return out


def pool_backward_ref(x, k, s, gy, kind):
    """dx of sum(pool(x) * gy): to each window's first maximum (max), or spread evenly (avg)."""
    N, C, H, W = x.shape
    win = windows(x, k, s)
    OH, OW = win.shape[2:4]
    share = np.zeros_like(win)
    if kind == "max":
        idx = win.argmax(axis=-1)
        np.put_along_axis(share, idx[..., None], 1.0, axis=-1)
    else:
        share[...] = 1.0 / (k * k)
    dx = np.zeros_like(x)
    for u, v in itertools.product(range(k), range(k)):
        dx[:, :, u:u + s * (OH - 1) + 1:s, v:v + s * (OW - 1) + 1:s] += gy * share[..., u * k + v]
    return dx


def bn2d_ref(x, g, b, eps=1e-5):
    mu = x.mean(axis=(0, 2, 3), keepdims=True)
    var = x.var(axis=(0, 2, 3), keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g[None, :, None, None] + b[None, :, None, None]


def bn2d_backward_ref(x, g, gy, eps=1e-5):
    """(dx, dgamma, dbeta) of sum(bn2d_ref(x, g, b) * gy), the textbook formula over m = N*H*W values."""
    m = x.shape[0] * x.shape[2] * x.shape[3]
    mu = x.mean(axis=(0, 2, 3), keepdims=True)
    inv = 1 / np.sqrt(x.var(axis=(0, 2, 3), keepdims=True) + eps)
    xh = (x - mu) * inv
    dbeta = gy.sum(axis=(0, 2, 3))
    dgamma = (gy * xh).sum(axis=(0, 2, 3))
    dx = g[None, :, None, None] * inv / m * (m * gy - dbeta[None, :, None, None] - xh * dgamma[None, :, None, None])
    return dx, dgamma, dbeta


def model_of(*modules):
    m = cx.SequentialModel()
    for mod in modules:
        m.add(mod)
    return m


def run(module, x, gy=None, training=True):
    """Forward (and backward with gy) of a one-layer model: (y, dx, [parameter gradients])."""
    model = model_of(module)
    model.train(training)
    y = model.forward(x.astype(np.float32))
    if gy is None:
        return y, None, None
    model.zero_grad()
    dx = model.backward(gy.astype(np.float32))
    return y, dx, [g.copy() for g in model.gradients()]


def f32(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


# ---- Conv2d --------------------------------------------------------------------------------------

CONV_CASES = [
    # (N, C, H, W), out, k, stride, padding, dilation, groups, bias
    ((2, 3, 7, 7), 4, 3, 1, 1, 1, 1, True),     # "same" 3x3
    ((2, 3, 8, 6), 5, 3, 2, 1, 1, 1, True),     # strided, even and odd sides
    ((1, 2, 9, 7), 3, 5, 2, 0, 1, 1, False),    # batch 1, kernel larger than stride, no padding
    ((3, 4, 5, 5), 6, 1, 1, 0, 1, 1, True),     # 1x1: no unfolding
    ((2, 4, 7, 9), 8, 1, 2, 0, 1, 1, False),    # 1x1 strided: the ResNet shortcut
    ((2, 3, 6, 6), 2, 3, 3, 2, 1, 1, True),     # stride = kernel, padding 2
    ((1, 2, 4, 4), 3, 4, 1, 1, 1, 1, True),     # kernel as large as the image
    ((2, 2, 9, 8), 3, 3, 1, 2, 2, 1, True),     # dilation 2
    ((2, 4, 6, 5), 6, 3, 1, 1, 1, 2, True),     # groups 2
    ((2, 6, 5, 5), 6, 3, 2, 1, 1, 6, False),    # depthwise
    ((2, 16, 9, 9), 32, 3, 1, 1, 1, 1, True),   # wider: GEMMs of useful size
    # the widths the unfolding has compiled-in row copies for: 8, 16, 32 (stride 1), 8, 16 (stride 2)
    ((2, 3, 8, 8), 4, 3, 1, 1, 1, 1, True),
    ((1, 2, 16, 16), 3, 3, 1, 1, 1, 1, False),
    ((1, 2, 32, 32), 2, 3, 1, 1, 1, 1, True),
    ((2, 3, 16, 16), 4, 3, 2, 1, 1, 1, False),
    ((1, 2, 32, 31), 3, 3, 2, 1, 1, 1, True),
    ((2, 4, 16, 16), 4, 1, 2, 0, 1, 1, False),
]


@pytest.mark.parametrize("shape,out,k,stride,padding,dilation,groups,bias", CONV_CASES)
def test_conv2d_forward_and_backward_match_numpy(shape, out, k, stride, padding, dilation, groups, bias):
    conv = cx.Conv2dModule(shape[1], out, k, stride=stride, padding=padding, bias=bias, dilation=dilation,
                           groups=groups, seed=3)
    w = conv.weight.astype(np.float64)
    if bias:
        conv.bias[...] = f32(out)
    b = conv.bias.astype(np.float64) if bias else None
    x = f32(*shape)
    ref = conv2d_ref(x.astype(np.float64), w, b, stride, padding, dilation, groups)
    gy = f32(*ref.shape)
    y, dx, grads = run(conv, x, gy)
    assert y.shape == ref.shape
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)
    rdx, rdw, rdb = conv2d_backward_ref(x.astype(np.float64), w, gy.astype(np.float64), stride, padding, dilation,
                                        groups)
    np.testing.assert_allclose(dx, rdx, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(grads[0], rdw, rtol=1e-4, atol=1e-3)
    if bias:
        np.testing.assert_allclose(grads[1], rdb, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", [0, 1, 2, 7, 8, 9, 11, 13, 14])
def test_conv2d_unfolded_a_few_rows_at_a_time_computes_the_same(case):
    # Note [Unfolding in chunks]: force pieces of one to a few output rows on small images
    shape, out, k, stride, padding, dilation, groups, bias = CONV_CASES[case]
    x = f32(*shape)
    gy = f32(shape[0], out, out_size(shape[2], k, stride, padding, dilation), out_size(shape[3], k, stride, padding,
                                                                                         dilation))
    results = []
    for limit in (0, 1, 3 * shape[1] * k * k * shape[3]):
        previous = cx._core._conv2d_unfold_floats(limit)
        try:
            conv = cx.Conv2dModule(shape[1], out, k, stride=stride, padding=padding, bias=bias, dilation=dilation,
                                   groups=groups, seed=5)
            results.append(run(conv, x, gy))
        finally:
            cx._core._conv2d_unfold_floats(previous)
    for y, dx, grads in results[1:]:
        np.testing.assert_allclose(y, results[0][0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dx, results[0][1], rtol=1e-5, atol=1e-5)
        for g, g0 in zip(grads, results[0][2]):
            np.testing.assert_allclose(g, g0, rtol=1e-5, atol=1e-4)


# Note [Direct convolution] (csrc/nn/layers/conv2d_direct.cpp): on an AVX-512 core (the batch split over the BLAS's
# threads), a stride-1 or stride-2 convolution (kernel > 1) whose output is 16 wide (or 8 wide and an even number of
# rows high) runs forward without unfolding, the weight gradient too (8 wide: where the output channels are 16, 32,
# 48 or 64), and dx where the stride is 1, the input so wide and padding <= kernel - 1. Cases through every part,
# alone and mixed:
DIRECT_CASES = [
    # (N, C, H, W), out, k, stride, padding, bias
    ((10, 3, 32, 32), 16, 3, 1, 1, False),  # the ResNet stem: 64 vectors of pixels, 20 blocks of 3 and 2 of 2
    ((9, 16, 16, 16), 16, 3, 1, 1, True),   # 16 vectors: 4 blocks of 3 and 2 of 2; 9 samples in parts of 4 and 5
    ((2, 5, 16, 16), 11, 3, 1, 1, True),    # output channels not a multiple of 8 (the last block of 3), odd inputs
    ((1, 7, 18, 18), 9, 3, 1, 0, False),    # no padding: dx pads dy by 2
    ((2, 4, 16, 16), 8, 5, 1, 2, True),     # 5x5: the weight gradient's columns as 3 + 2
    ((2, 6, 16, 16), 13, 3, 1, 2, True),    # output 18 wide: the GEMMs forward, the direct dx (dy unpadded)
    ((1, 3, 14, 14), 5, 3, 1, 2, False),    # output 16 wide from a 14-wide input: direct forward, GEMM dx
    ((2, 3, 3, 18), 4, 3, 1, 0, True),      # one output row of one vector
    ((2, 2, 16, 48), 3, 3, 1, 1, True),     # 3 vectors a row: blocks of one row each
    ((8, 16, 8, 8), 16, 3, 1, 1, True),     # 8 wide: two output rows a vector, forward and dx; the weight gradient
    #                                         with output channels in the vector (16: one vector x 24 weights)
    ((8, 5, 8, 8), 64, 3, 1, 1, False),     # 64 channels: 4 vectors x 6 weights, 45 weights (a last block of 3)
    ((4, 3, 16, 16), 48, 3, 2, 1, True),    # stride 2 to 8 x 8, 48 channels: 3 vectors x 8 weights, 27 weights
    ((2, 2, 8, 8), 32, 3, 1, 1, True),      # 32 channels: 2 vectors x 12 weights, 18 weights
    ((4, 32, 8, 8), 16, 3, 1, 1, False),    # dx of 32 channels 8 wide with the channels in the vector
    ((1, 3, 6, 6), 5, 3, 1, 2, False),      # output 8 x 8 from 6 x 6: two rows a vector forward only
    ((2, 3, 7, 8), 4, 3, 1, 1, True),       # 8 wide, 7 rows high: the GEMMs
    ((2, 16, 32, 32), 32, 3, 2, 1, True),   # stride 2: the image split into even and odd columns, 16 wide output
    ((12, 8, 16, 16), 16, 3, 2, 1, False),  # stride 2 to 8 x 8: two rows a vector; 3 parts of 4
    ((2, 3, 31, 31), 4, 3, 2, 1, True),     # stride 2, odd padded width (17 even columns, 16 odd)
    ((1, 2, 32, 32), 3, 5, 2, 2, False),    # stride 2, 5x5: columns 0, 2, 4 even and 1, 3 odd
    ((2, 3, 33, 33), 4, 3, 2, 0, True),     # stride 2, no padding
    ((1, 2, 28, 28), 3, 3, 2, 3, False),    # stride 2, padding 3: a vector of columns all right padding
    ((1, 2, 30, 64), 3, 3, 2, 1, True),     # stride 2, rows of 66 padded columns: 3 vectors of each half
    ((2, 4, 14, 14), 6, 1, 1, 1, False),    # 1x1 (with padding): the GEMMs
]


@pytest.mark.skipif(not cx._core._conv2d_direct_available(),
                    reason="the direct kernels do not run here (no AVX-512F, or CX_NN_SCALAR=1)")
@pytest.mark.parametrize("threads", [1, 3])  # 3: batches of 8 and more split over threads (parts of 4 at least)
@pytest.mark.parametrize("shape,out,k,stride,padding,bias", DIRECT_CASES)
def test_conv2d_direct_kernels_match_numpy(shape, out, k, stride, padding, bias, threads):
    before = cx.get_num_threads()
    cx.set_num_threads(threads)
    try:
        conv = cx.Conv2dModule(shape[1], out, k, stride=stride, padding=padding, bias=bias, seed=7)
        if bias:
            conv.bias[...] = f32(out)
        w, b = conv.weight.astype(np.float64), conv.bias.astype(np.float64) if bias else None
        x = f32(*shape)
        ref = conv2d_ref(x.astype(np.float64), w, b, stride, padding)
        gy = f32(*ref.shape)
        model = model_of(conv)
        y = model.forward(x)
        model.zero_grad()
        dx = model.backward(gy)
        once = [g.copy() for g in model.gradients()]
        model.forward(x)
        model.backward(gy)  # gradients add up over backward calls
        twice = [g.copy() for g in model.gradients()]
        previous = cx._core._conv2d_direct(False)  # the GEMMs on the same layer: the same numbers
        try:
            y_gemm = model.forward(x)
            model.zero_grad()
            dx_gemm = model.backward(gy)
            grads_gemm = [g.copy() for g in model.gradients()]
        finally:
            cx._core._conv2d_direct(previous)
    finally:
        cx.set_num_threads(before)
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)
    rdx, rdw, rdb = conv2d_backward_ref(x.astype(np.float64), w, gy.astype(np.float64), stride, padding)
    np.testing.assert_allclose(dx, rdx, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(once[0], rdw, rtol=1e-4, atol=1e-3)
    if bias:
        np.testing.assert_allclose(once[1], rdb, rtol=1e-4, atol=1e-4)
    for g2, g1 in zip(twice, once):  # the GEMMs add sample by sample into the gradient: float32 roundings
        np.testing.assert_allclose(g2, 2 * g1, rtol=1e-5, atol=1e-5 * np.abs(g1).max())
    np.testing.assert_allclose(y_gemm, y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx_gemm, dx, rtol=1e-5, atol=1e-5)
    for g, g0 in zip(grads_gemm, once):
        np.testing.assert_allclose(g, g0, rtol=1e-5, atol=1e-4)


def test_conv2d_parameters_init_and_properties():
    conv = cx.Conv2dModule(4, 6, 3, stride=2, padding=1, groups=2, seed=11)
    w, b = conv.parameters()
    assert w.shape == (6, 2, 3, 3) and b.shape == (6,)
    bound = np.sqrt(6 / (2 * 3 * 3))  # Kaiming-uniform over fan_in = in/groups * k * k
    assert np.all(np.abs(w) <= bound) and np.abs(w).max() > 0.8 * bound and np.all(b == 0)
    np.testing.assert_array_equal(cx.Conv2dModule(4, 6, 3, stride=2, padding=1, groups=2, seed=11).weight, w)
    assert (conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding, conv.dilation,
            conv.groups) == (4, 6, 3, 2, 1, 1, 2)
    assert repr(conv) == "Conv2d(4, 6, kernel_size=3, stride=2, padding=1, groups=2)"
    assert repr(cx.Conv2dModule(3, 8, 1, bias=False)) == "Conv2d(3, 8, kernel_size=1, bias=False)"
    assert cx.Conv2dModule(3, 8, 1, bias=False).bias is None
    conv.reset_parameters(seed=11)
    np.testing.assert_array_equal(conv.weight, w)


def test_conv2d_accumulates_gradients_over_backward_calls():
    conv = cx.Conv2dModule(2, 3, 3, padding=1, seed=1)
    model = model_of(conv)
    x, gy = f32(2, 2, 5, 5), f32(2, 3, 5, 5)
    model.forward(x)
    model.zero_grad()
    model.backward(gy)
    once = [g.copy() for g in model.gradients()]
    model.forward(x)
    model.backward(gy)
    for g, g1 in zip(model.gradients(), once):
        np.testing.assert_allclose(g, 2 * g1, rtol=1e-6)


# ---- pooling -------------------------------------------------------------------------------------

POOL_CASES = [
    # (N, C, H, W), kernel, stride (None: the kernel)
    ((2, 3, 8, 8), 2, None),
    ((1, 2, 7, 9), 3, 2),   # overlapping windows, odd sides, batch 1
    ((2, 2, 7, 7), 2, None),  # the last row and column are dropped (floor)
    ((2, 1, 5, 6), 3, 1),
    ((1, 1, 4, 4), 4, None),  # one window
]


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("shape,k,stride", POOL_CASES)
def test_pooling_forward_and_backward_match_numpy(kind, shape, k, stride):
    cls = cx.MaxPool2dModule if kind == "max" else cx.AvgPool2dModule
    pool = cls(k, stride)
    s = k if stride is None else stride
    assert (pool.kernel_size, pool.stride) == (k, s)
    x = f32(*shape)
    win = windows(x.astype(np.float64), k, s)
    ref = win.max(axis=-1) if kind == "max" else win.mean(axis=-1)
    gy = f32(*ref.shape)
    y, dx, _ = run(pool, x, gy)
    np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dx, pool_backward_ref(x.astype(np.float64), k, s, gy.astype(np.float64), kind),
                               rtol=1e-5, atol=1e-6)


def test_max_pool_gives_a_tied_window_gradient_to_its_first_maximum_and_keeps_nan():
    x = np.array([[[[1, 5, 5, 0], [5, 2, np.nan, 3]]]], np.float32)
    y, dx, _ = run(cx.MaxPool2dModule(2), x, np.ones((1, 1, 1, 2), np.float32))
    assert y[0, 0, 0, 0] == 5 and np.isnan(y[0, 0, 0, 1])
    np.testing.assert_array_equal(dx, [[[[0, 1, 0, 0], [0, 0, 1, 0]]]])


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (1, 1, 1, 1), (3, 2, 7, 7)])
def test_global_avg_pool_forward_and_backward_match_numpy(shape):
    x = f32(*shape)
    gy = f32(*shape[:2])
    y, dx, _ = run(cx.GlobalAvgPool2dModule(), x, gy)
    np.testing.assert_allclose(y, x.astype(np.float64).mean(axis=(2, 3)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dx, np.broadcast_to(gy[:, :, None, None] / (shape[2] * shape[3]), shape), rtol=1e-6)


def test_flatten_turns_images_into_rows():
    x = f32(2, 3, 4, 5)
    y, dx, _ = run(cx.FlattenModule(), x, np.arange(120, dtype=np.float32).reshape(2, 60))
    np.testing.assert_array_equal(y, x.reshape(2, 60))
    np.testing.assert_array_equal(dx, np.arange(120, dtype=np.float32).reshape(2, 3, 4, 5))


# ---- BatchNorm2d ---------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(4, 3, 5, 5), (1, 2, 3, 7), (8, 4, 1, 1), (2, 16, 8, 8)])
def test_batchnorm2d_training_forward_and_backward_match_numpy(shape):
    bn = cx.BatchNorm2dModule(shape[1], momentum=0.3)
    model = model_of(bn)
    g, b = (f32(shape[1]) for _ in range(2))
    model.parameters()[0][...] = g
    model.parameters()[1][...] = b
    x = f32(*shape, scale=2.0) + 3.0  # far from zero mean
    x64 = x.astype(np.float64)
    y = model.forward(x)
    np.testing.assert_allclose(y, bn2d_ref(x64, g.astype(np.float64), b.astype(np.float64)), rtol=1e-4, atol=1e-4)
    gy = f32(*shape)
    model.zero_grad()
    dx = model.backward(gy)
    rdx, rdg, rdb = bn2d_backward_ref(x64, g.astype(np.float64), gy.astype(np.float64))
    np.testing.assert_allclose(dx, rdx, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(model.gradients()[0], rdg, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(model.gradients()[1], rdb, rtol=1e-4, atol=1e-4)
    # running statistics: momentum 0.3, unbiased variance over N*H*W values per channel
    m = shape[0] * shape[2] * shape[3]
    np.testing.assert_allclose(bn.running_mean, 0.3 * x64.mean(axis=(0, 2, 3)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bn.running_var, 0.7 + 0.3 * x64.var(axis=(0, 2, 3)) * m / (m - 1), rtol=1e-5)


def test_batchnorm2d_eval_uses_running_statistics():
    bn = cx.BatchNorm2dModule(3, eps=1e-3, momentum=1.0)  # momentum 1: the running statistics are the last batch's
    model = model_of(bn)
    x0 = f32(4, 3, 3, 3, scale=2.0) + 1.0
    model.forward(x0)
    mean, var = x0.astype(np.float64).mean(axis=(0, 2, 3)), x0.astype(np.float64).var(axis=(0, 2, 3), ddof=1)
    np.testing.assert_allclose(bn.running_mean, mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bn.running_var, var, rtol=1e-5)
    g, b = np.array([2.0, 1.0, -1.0]), np.array([0.0, 0.5, 1.0])
    model.parameters()[0][...] = g
    model.parameters()[1][...] = b
    model.eval()
    x, gy = f32(2, 3, 4, 4), f32(2, 3, 4, 4)
    scale = (g / np.sqrt(var + 1e-3))[None, :, None, None]
    np.testing.assert_allclose(model.forward(x), (x - mean[None, :, None, None]) * scale + b[None, :, None, None],
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(model.backward(gy), gy * scale, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bn.running_mean, mean, rtol=1e-5, atol=1e-6)  # eval mode leaves them


def test_sync_batchnorm_takes_images_and_alone_is_batchnorm2d():
    x, gy = f32(3, 4, 5, 5), f32(3, 4, 5, 5)
    outs = []
    for cls in (cx.BatchNorm2dModule, cx.SyncBatchNormModule):
        y, dx, grads = run(cls(4), x, gy)
        outs.append((y, dx, grads))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])
    for a, b in zip(outs[0][2], outs[1][2]):
        np.testing.assert_array_equal(a, b)


def test_convert_sync_batchnorm_reaches_batchnorm2d_inside_residual_blocks():
    block = model_of(cx.Conv2dModule(2, 2, 3, padding=1, seed=1), cx.BatchNorm2dModule(2), cx.ReLUModule())
    shortcut = model_of(cx.Conv2dModule(2, 2, 1, seed=2), cx.BatchNorm2dModule(2, momentum=0.5))
    model = model_of(cx.BatchNorm2dModule(2), cx.ResidualModule(block, shortcut), cx.GlobalAvgPool2dModule(),
                     cx.BatchNormModule(2))
    model.forward(f32(4, 2, 5, 5, scale=3.0))  # running statistics away from (0, 1)
    before = model.flat_parameters().copy()
    stats = model[1].shortcut[1].running_var.copy()
    assert cx.convert_sync_batchnorm(model) is model
    kinds = [type(m).__name__ for m in model]
    assert kinds == ["SyncBatchNormModule", "ResidualModule", "GlobalAvgPool2dModule", "SyncBatchNormModule"]
    assert [type(m).__name__ for m in model[1].block] == ["Conv2dModule", "SyncBatchNormModule", "ReLUModule"]
    assert type(model[1].shortcut[1]).__name__ == "SyncBatchNormModule"
    assert model[1].shortcut[1].momentum == pytest.approx(0.5)
    assert not np.allclose(stats, 1.0)
    np.testing.assert_array_equal(model[1].shortcut[1].running_var, stats)
    np.testing.assert_array_equal(model.flat_parameters(), before)
    x = f32(4, 2, 5, 5)
    assert model.forward(x).shape == (4, 2)


# ---- Residual ------------------------------------------------------------------------------------

def test_residual_adds_the_block_and_the_shortcut_and_their_gradients():
    c1, c2 = cx.Conv2dModule(3, 4, 3, stride=2, padding=1, seed=1), cx.Conv2dModule(4, 4, 3, padding=1, seed=2)
    s1 = cx.Conv2dModule(3, 4, 1, stride=2, bias=False, seed=3)
    res = cx.ResidualModule(model_of(c1, cx.ReLUModule(), c2), model_of(s1))
    model = model_of(res)
    # block's parameters first, then the shortcut's, named as their layers hold them
    assert [p.shape for p in model.parameters()] == [(4, 3, 3, 3), (4,), (4, 4, 3, 3), (4,), (4, 3, 1, 1)]
    for p in model.parameters():
        p[...] = f32(*p.shape)
    w1, b1, w2, b2, ws = (p.astype(np.float64) for p in model.parameters())
    x = f32(2, 3, 7, 7)
    x64 = x.astype(np.float64)
    h = conv2d_ref(x64, w1, b1, 2, 1)
    a = np.maximum(h, 0)
    ref = conv2d_ref(a, w2, b2, 1, 1) + conv2d_ref(x64, ws, None, 2, 0)
    y = model.forward(x)
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)
    gy = f32(*ref.shape)
    gy64 = gy.astype(np.float64)
    model.zero_grad()
    dx = model.backward(gy)
    da, dw2, db2 = conv2d_backward_ref(a, w2, gy64, 1, 1)
    dh = da * (h > 0)
    dx1, dw1, db1 = conv2d_backward_ref(x64, w1, dh, 2, 1)
    dxs, dws, _ = conv2d_backward_ref(x64, ws, gy64, 2, 0)
    for got, want in zip(model.gradients(), [dw1, db1, dw2, db2, dws]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(dx, dx1 + dxs, rtol=1e-4, atol=1e-3)
    # the modules see the same values: the container's parameters are theirs
    np.testing.assert_array_equal(res.block[2].weight, model.parameters()[2])
    np.testing.assert_array_equal(res.shortcut[0].weight, model.parameters()[4])


def test_identity_residual_passes_the_gradient_straight_through():
    block = model_of(cx.Conv2dModule(2, 2, 3, padding=1, seed=4), cx.TanhModule())
    model = model_of(cx.ResidualModule(block))
    w, b = (p.astype(np.float64) for p in model.parameters())
    x, gy = f32(1, 2, 5, 4), f32(1, 2, 5, 4)
    h = conv2d_ref(x.astype(np.float64), w, b, 1, 1)
    np.testing.assert_allclose(model.forward(x), np.tanh(h) + x, rtol=1e-5, atol=1e-5)
    dx1, _, _ = conv2d_backward_ref(x.astype(np.float64), w, gy * (1 - np.tanh(h) ** 2), 1, 1)
    np.testing.assert_allclose(model.backward(gy), dx1 + gy, rtol=1e-4, atol=1e-4)


def gradient_order_body():
    """The order in which DDP's hook sees parameters become final: strictly decreasing, each once."""
    block = model_of(cx.Conv2dModule(2, 3, 3, padding=1, seed=1), cx.BatchNorm2dModule(3), cx.ReLUModule())
    inner = cx.ResidualModule(model_of(cx.Conv2dModule(3, 3, 3, padding=1, bias=False, seed=2)))
    block.add(inner)
    model = model_of(cx.Conv2dModule(1, 2, 3, padding=1, seed=3),
                     cx.ResidualModule(block, model_of(cx.Conv2dModule(2, 3, 1, seed=4))),
                     cx.GlobalAvgPool2dModule(), cx.LinearModule(3, 2, seed=5))
    return model


def test_nested_residuals_lay_their_parameters_out_in_layer_order():
    model = gradient_order_body()
    shapes = [p.shape for p in model.parameters()]
    assert shapes == [(2, 1, 3, 3), (2,),                       # conv
                      (3, 2, 3, 3), (3,), (3,), (3,), (3, 3, 3, 3),  # block: conv, bn, inner residual's conv
                      (3, 2, 1, 1), (3,),                       # shortcut conv
                      (2, 3), (2,)]                             # linear
    slices = model.param_slices()
    assert [o for o, _ in slices] == list(np.cumsum([0] + [c for _, c in slices])[:-1])
    assert sum(c for _, c in slices) == model.num_parameters()
    # every module's view is the model's flat buffer
    flat = model.flat_parameters()
    flat[...] = np.arange(flat.size, dtype=np.float32)
    inner_w = model[1].block[3].block[0].weight
    off = slices[6][0]
    np.testing.assert_array_equal(inner_w.ravel(), np.arange(off, off + 81, dtype=np.float32))


def test_a_model_with_residuals_trains_and_zero_grad_reaches_the_blocks():
    model = gradient_order_body()
    # Data of its own, whatever the tests before drew from RNG, and learnable: each class's images brighter or
    # darker (with labels drawn at random 4 images apart, the loss halved in 30 steps in 8 of 20 draws).
    y = np.array([0, 1, 1, 0])
    x = (np.random.default_rng(11).standard_normal((4, 1, 6, 6)) + (2 * y - 1)[:, None, None, None]).astype(np.float32)
    loss, opt = cx.CrossEntropyLoss(), cx.SGDOptimizer(0.1)
    first = None
    for _ in range(30):
        value = loss.forward(model.forward(x), y)
        first = value if first is None else first
        model.zero_grad()
        model.backward(loss.backward())
        opt.step(model)
    assert value < 0.5 * first
    model.zero_grad()
    assert not model.flat_gradients().any()
    assert not model[1].block[0].gradients()[0].any()


# ---- a whole small ResNet against finite differences ------------------------------------------------

def small_resnet():
    stem = [cx.Conv2dModule(1, 2, 3, padding=1, seed=1), cx.BatchNorm2dModule(2), cx.ReLUModule()]
    block1 = model_of(cx.Conv2dModule(2, 2, 3, padding=1, bias=False, seed=2), cx.BatchNorm2dModule(2),
                      cx.ReLUModule(), cx.Conv2dModule(2, 2, 3, padding=1, bias=False, seed=3), cx.BatchNorm2dModule(2))
    block2 = model_of(cx.Conv2dModule(2, 3, 3, stride=2, padding=1, bias=False, seed=4), cx.BatchNorm2dModule(3),
                      cx.ReLUModule(), cx.Conv2dModule(3, 3, 3, padding=1, bias=False, seed=5), cx.BatchNorm2dModule(3))
    short2 = model_of(cx.Conv2dModule(2, 3, 1, stride=2, bias=False, seed=6), cx.BatchNorm2dModule(3))
    return model_of(*stem, cx.ResidualModule(block1), cx.ReLUModule(), cx.ResidualModule(block2, short2),
                    cx.ReLUModule(), cx.AvgPool2dModule(2), cx.FlattenModule(), cx.LinearModule(3, 4, seed=7))


def small_resnet_ref(x, p):
    """small_resnet() in float64, parameters in the model's flat order."""
    p = iter(p)
    relu = lambda z: np.maximum(z, 0)  # noqa: E731

    def bn(z):
        g, b = next(p), next(p)
        return bn2d_ref(z, g, b)

    h = relu(bn(conv2d_ref(x, next(p), next(p), 1, 1)))
    r = bn(conv2d_ref(relu(bn(conv2d_ref(h, next(p), None, 1, 1))), next(p), None, 1, 1))
    h = relu(r + h)
    r = bn(conv2d_ref(relu(bn(conv2d_ref(h, next(p), None, 2, 1))), next(p), None, 1, 1))
    s = bn(conv2d_ref(h, next(p), None, 2, 0))
    h = relu(r + s)
    h = windows(h, 2, 2).mean(axis=-1).reshape(h.shape[0], -1)
    w, b = next(p), next(p)
    return h @ w.T + b


def test_small_resnet_gradients_match_finite_differences():
    model = small_resnet()
    for prm in model.parameters():  # BatchNorm's gamma and beta away from 1 and 0 too
        prm[...] = (RNG.standard_normal(prm.shape) * 0.7 + (0.5 if prm.ndim == 1 else 0)).astype(np.float32)
    x32 = f32(3, 1, 6, 6)
    x64 = x32.astype(np.float64)
    p64 = [prm.astype(np.float64) for prm in model.parameters()]
    y = model.forward(x32)
    np.testing.assert_allclose(y, small_resnet_ref(x64, p64), rtol=1e-4, atol=1e-4)
    gy = RNG.standard_normal(y.shape)
    model.zero_grad()
    gx = model.backward(gy.astype(np.float32))

    def loss():
        return float(np.sum(small_resnet_ref(x64, p64) * gy))

    np.testing.assert_allclose(gx, numeric_grad(loss, x64), rtol=1e-3, atol=1e-4)
    for got, prm in zip(model.gradients(), p64):
        np.testing.assert_allclose(got, numeric_grad(loss, prm), rtol=1e-3, atol=1e-4)


# ---- errors a user can make ----------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,text", [
    (dict(kernel_size=0), "kernel_size must be >= 1, got 0"),
    (dict(stride=0), "stride must be >= 1, got 0"),
    (dict(padding=-1), "padding must be >= 0, got -1"),
    (dict(dilation=0), "dilation must be >= 1, got 0"),
    (dict(groups=0), "groups must be >= 1, got 0"),
    (dict(groups=2), r"in_channels \(3\) and out_channels \(4\) must both be divisible by groups \(2\)"),
    (dict(in_channels=0), "in_channels must be >= 1, got 0"),
    (dict(out_channels=-2), "out_channels must be >= 1, got -2"),
    (dict(kernel_size=1 << 21), "kernel_size must be at most 1048576"),
])
def test_conv2d_refuses_bad_arguments(kwargs, text):
    args = dict(in_channels=3, out_channels=4, kernel_size=3)
    args.update(kwargs)
    with pytest.raises(ValueError, match="Conv2dModule: " + text):
        cx.Conv2dModule(**args)


@pytest.mark.parametrize("shape,text", [
    ((2, 3, 8), r" expects input of shape \(batch, 3, height, width\), got \(2, 3, 8\)"),
    ((2, 5, 8, 8), r" expects 3 input channels \(input of shape \(batch, 3, height, width\)\), got \(2, 5, 8, 8\)"),
    ((2, 3, 8, 0), r": the kernel \(3 x 3\) is larger than the input padded to 10 x 2 \(input \(2, 3, 8, 0\)\)"),
])
def test_conv2d_refuses_inputs_it_cannot_take(shape, text):
    model = model_of(cx.Conv2dModule(3, 4, 3, padding=1))
    with pytest.raises(ValueError, match=r"SequentialModel.forward: layer 0: Conv2d\(3, 4, kernel_size=3, padding=1\)"
                                         + text):
        model.forward(np.zeros(shape, np.float32))


def test_conv2d_names_a_kernel_larger_than_the_padded_image():
    model = model_of(cx.Conv2dModule(1, 1, 5, padding=1, dilation=1), cx.ReLUModule())
    with pytest.raises(ValueError, match=r"layer 0: Conv2d\(1, 1, kernel_size=5, padding=1\): the kernel \(5 x 5\) "
                                         r"is larger than the input padded to 4 x 6 \(input \(1, 1, 2, 4\)\)"):
        model.forward(np.zeros((1, 1, 2, 4), np.float32))
    with pytest.raises(ValueError, match=r"the kernel \(5 x 5 dilated\) is larger than the input padded to 4 x 4"):
        model_of(cx.Conv2dModule(1, 1, 3, dilation=2)).forward(np.zeros((1, 1, 4, 4), np.float32))


@pytest.mark.parametrize("cls", [cx.MaxPool2dModule, cx.AvgPool2dModule])
def test_pooling_refuses_bad_windows_and_inputs(cls):
    name = cls.__name__
    with pytest.raises(ValueError, match=f"{name}: kernel_size must be in \\[1, 65536\\], got 0"):
        cls(0)
    with pytest.raises(ValueError, match=f"{name}: stride must be in \\[1, 65536\\], got 0"):
        cls(2, 0)
    with pytest.raises(ValueError, match=f"{name}: stride must be in \\[1, 65536\\], got -1"):
        cls(2, stride=-1)
    model = model_of(cls(3, 2))
    short = name[:-len("Module")]
    with pytest.raises(ValueError, match=rf"layer 0: {short}\(kernel_size=3, stride=2\): the window \(3 x 3\) is "
                                         r"larger than the input image \(2 x 5, input \(1, 4, 2, 5\)\)"):
        model.forward(np.zeros((1, 4, 2, 5), np.float32))
    with pytest.raises(ValueError, match=rf"{short}\(kernel_size=3, stride=2\) expects input of shape \(batch, "
                                         r"channels, height, width\), got \(1, 16\)"):
        model.forward(np.zeros((1, 16), np.float32))


def test_global_avg_pool_and_batchnorm2d_refuse_rows():
    with pytest.raises(ValueError, match=r"GlobalAvgPool2d\(\) expects input of shape \(batch, channels, height, "
                                         r"width\), got \(2, 8\)"):
        model_of(cx.GlobalAvgPool2dModule()).forward(np.zeros((2, 8), np.float32))
    bn = model_of(cx.BatchNorm2dModule(8))
    with pytest.raises(ValueError, match=r"BatchNorm2d\(8, eps=1e-05, momentum=0.1\) expects input of shape "
                                         r"\(batch, 8, height, width\), got \(2, 8\)"):
        bn.forward(np.zeros((2, 8), np.float32))
    with pytest.raises(ValueError, match=r"expects input of shape \(batch, 8, height, width\), got \(2, 4, 3, 3\)"):
        bn.forward(np.zeros((2, 4, 3, 3), np.float32))
    with pytest.raises(ValueError, match=r"BatchNorm2d\(8.*needs more than one value per channel \(batch x height x "
                                         r"width\) in training mode, got input \(1, 8, 1, 1\)"):
        bn.forward(np.zeros((1, 8, 1, 1), np.float32))
    bn.eval()
    assert bn.forward(np.zeros((1, 8, 1, 1), np.float32)).shape == (1, 8, 1, 1)  # eval mode: running statistics
    with pytest.raises(ValueError, match="BatchNorm2dModule: features must be >= 1, got 0"):
        cx.BatchNorm2dModule(0)
    with pytest.raises(ValueError, match=r"BatchNorm\(8, eps=1e-05, momentum=0.1\) expects input of shape "
                                         r"\(batch, 8\), got \(2, 8, 3, 3\)"):
        model_of(cx.BatchNormModule(8)).forward(np.zeros((2, 8, 3, 3), np.float32))
    with pytest.raises(ValueError, match=r"SyncBatchNorm\(8, .*\) expects input of shape \(batch, 8\) or \(batch, 8, "
                                         r"height, width\), got \(2, 8, 3\)"):
        model_of(cx.SyncBatchNormModule(8)).forward(np.zeros((2, 8, 3), np.float32))


def test_residual_refuses_what_it_cannot_hold():
    conv = lambda: cx.Conv2dModule(2, 2, 3, padding=1)  # noqa: E731
    with pytest.raises(ValueError, match="ResidualModule: the block has no modules; add\\(\\) them first"):
        cx.ResidualModule(cx.SequentialModel())
    with pytest.raises(ValueError, match="the shortcut has no modules; add\\(\\) them first \\(or pass shortcut=None "
                                         "for the identity\\)"):
        cx.ResidualModule(model_of(conv()), cx.SequentialModel())
    with pytest.raises(ValueError, match="ResidualModule: block is None; give it a SequentialModel"):
        cx.ResidualModule(None)
    same = model_of(conv())
    with pytest.raises(ValueError, match="block and shortcut are the same model"):
        cx.ResidualModule(same, same)
    with pytest.raises(ValueError, match=r"layer 1 of the block \(Dropout\(p=0.5\)\) draws random numbers.*put it "
                                         r"before or after the ResidualModule"):
        cx.ResidualModule(model_of(conv(), cx.DropoutModule(0.5)))
    block = model_of(conv())
    held = cx.ResidualModule(block)  # noqa: F841  (while it lives, it holds the block)
    with pytest.raises(ValueError, match="the block already belongs to a ResidualModule; build a new model for each"):
        cx.ResidualModule(block)
    with pytest.raises(ValueError, match=r"SequentialModel.add: this model is the block or shortcut of a "
                                         r"ResidualModule now; add\(\) every module before making the ResidualModule"):
        block.add(cx.ReLUModule())


def test_residual_names_shapes_that_do_not_add_up():
    x = np.zeros((2, 2, 6, 6), np.float32)
    strided = model_of(cx.ResidualModule(model_of(cx.Conv2dModule(2, 4, 3, stride=2, padding=1))))
    with pytest.raises(ValueError, match=r"layer 0: Residual: for input \(2, 2, 6, 6\) the block gives \(2, 4, 3, 3\), "
                                         r"to which the identity shortcut cannot add its input; give a shortcut"):
        strided.forward(x)
    wrong = model_of(cx.ResidualModule(model_of(cx.Conv2dModule(2, 4, 3, stride=2, padding=1)),
                                       model_of(cx.Conv2dModule(2, 4, 1))))
    with pytest.raises(ValueError, match=r"the block gives \(2, 4, 3, 3\) but the shortcut gives \(2, 4, 6, 6\); they "
                                         r"must match"):
        wrong.forward(x)
    inner = model_of(cx.ResidualModule(model_of(cx.ReLUModule(), cx.Conv2dModule(3, 2, 3, padding=1))))
    with pytest.raises(ValueError, match=r"SequentialModel.forward: layer 0: Residual block, layer 1: Conv2d\(3, 2, "
                                         r"kernel_size=3, padding=1\) expects 3 input channels"):
        inner.forward(x)
    short = model_of(cx.ResidualModule(model_of(cx.ReLUModule()), model_of(cx.MaxPool2dModule(8))))
    with pytest.raises(ValueError, match=r"layer 0: Residual shortcut, layer 0: MaxPool2d\(kernel_size=8\): the "
                                         r"window"):
        short.forward(x)


def test_a_residual_let_go_frees_its_models():
    block = model_of(cx.Conv2dModule(2, 2, 3, padding=1, seed=9))
    w = block.parameters()[0].copy()
    res = cx.ResidualModule(block)
    del res
    import gc
    gc.collect()
    block.add(cx.ReLUModule())  # no longer held
    np.testing.assert_array_equal(block.parameters()[0], w)
    assert block.forward(np.ones((1, 2, 4, 4), np.float32)).shape == (1, 2, 4, 4)


# ---- the GPU trainer takes them (their device code: csrc/nn/layers/layers_gpu.cpp; test_gpu.py trains them) --------

@pytest.mark.parametrize("module", [
    lambda: cx.Conv2dModule(2, 2, 3, padding=1), lambda: cx.MaxPool2dModule(2), lambda: cx.AvgPool2dModule(2),
    cx.GlobalAvgPool2dModule, lambda: cx.BatchNorm2dModule(2), lambda: cx.SyncBatchNormModule(2),
    lambda: cx.ResidualModule(model_of(cx.ReLUModule())),
    lambda: cx.ResidualModule(model_of(cx.Conv2dModule(2, 2, 3, padding=1), cx.SyncBatchNormModule(2))),
])
def test_the_gpu_trainer_takes_image_layers(module):
    # What GpuEngine checks before it opens a GPU (csrc/nn/device_model.h), so it needs none here.
    cx._core.dist._check_model_runs_on_gpu(model_of(cx.ReLUModule(), module()))


