"""The model math on several threads (Note [One pool for the model math] in csrc/nn/parallel.h): the same
results as on one thread, GEMMs split over the pool against NumPy, and a pool that survives fork() and two
Python threads at once."""
import multiprocessing as mp
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import ranks

import pycyxwiz as cx


@pytest.fixture
def threads():
    """Sets the model math's threads for a test and restores them after it."""
    before = cx.get_num_threads()
    yield cx.set_num_threads
    cx.set_num_threads(before)


def image_model(seed=0):
    cx.manual_seed(seed)
    block = cx.SequentialModel()
    for m in (cx.Conv2dModule(16, 32, 3, 2, padding=1, bias=False), cx.BatchNorm2dModule(32), cx.ReLUModule(),
              cx.Conv2dModule(32, 32, 3, padding=1, bias=True), cx.BatchNorm2dModule(32)):
        block.add(m)
    short = cx.SequentialModel()
    short.add(cx.Conv2dModule(16, 32, 1, 2, bias=False))
    short.add(cx.BatchNorm2dModule(32))
    model = cx.SequentialModel()
    for m in (cx.Conv2dModule(3, 16, 3, padding=1), cx.BatchNorm2dModule(16), cx.ReLUModule(),
              cx.MaxPool2dModule(2), cx.ResidualModule(block, short), cx.ReLUModule(), cx.AvgPool2dModule(2),
              cx.Conv2dModule(32, 16, 5, padding=2), cx.GlobalAvgPool2dModule(), cx.LinearModule(16, 10)):
        model.add(m)
    return model


def one_step(model, x, gy):
    """Output, input gradient and parameter gradient of one forward and backward in training mode."""
    model.train()
    y = model.forward(x).copy()
    model.zero_grad()
    gx = model.backward(gy).copy()
    return y, gx, model.flat_gradients().copy()


@pytest.mark.parametrize("direct", [True, False])
def test_an_image_model_gives_the_same_outputs_and_input_gradients_on_one_thread_and_on_three(threads, direct):
    # Parts of the batch, the channels or the elements: what a part computes is what one thread computes, bit for
    # bit. Only sums over parts (a convolution's weight gradient) may round differently, so they are compared with
    # a tolerance, and against float64 below.
    rng = np.random.default_rng(1)
    x = rng.standard_normal((24, 3, 32, 32)).astype(np.float32)
    gy = rng.standard_normal((24, 10)).astype(np.float32)
    cx._core._conv2d_direct(direct)
    try:
        results = {}
        for n in (1, 3):
            threads(n)
            results[n] = one_step(image_model(), x, gy)
    finally:
        cx._core._conv2d_direct(True)
    (y1, gx1, g1), (y3, gx3, g3) = results[1], results[3]
    assert np.array_equal(y1, y3)
    assert np.array_equal(gx1, gx3)
    np.testing.assert_allclose(g3, g1, rtol=1e-4, atol=1e-5 * np.abs(g1).max())


@pytest.mark.parametrize("batch, n_in, n_out", [(256, 512, 384), (16, 256, 4096), (4096, 256, 8)])
def test_a_linear_layer_whose_gemms_are_split_over_threads_matches_numpy(threads, batch, n_in, n_out):
    # Large enough that gemm() cuts each product into blocks of C (Note [GEMM on the pool]): by columns where C is
    # wider than tall, by rows where it is taller.
    threads(3)
    rng = np.random.default_rng(2)
    layer = cx.LinearModule(n_in, n_out, seed=3)
    model = cx.SequentialModel()
    model.add(layer)
    x = rng.standard_normal((batch, n_in)).astype(np.float32)
    gy = rng.standard_normal((batch, n_out)).astype(np.float32)
    y = model.forward(x)
    model.zero_grad()
    gx = model.backward(gy)
    w, b = layer.weight.astype(np.float64), layer.bias.astype(np.float64)
    x64, gy64 = x.astype(np.float64), gy.astype(np.float64)
    np.testing.assert_allclose(y, x64 @ w.T + b, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gx, gy64 @ w, rtol=1e-4, atol=1e-4)
    dw, db = model.gradients()
    np.testing.assert_allclose(dw, gy64.T @ x64, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(db, gy64.sum(0), rtol=1e-4, atol=1e-3)


def optimizer_steps(opt_name, n):
    cx.set_num_threads(n)
    rng = np.random.default_rng(4)
    layer = cx.LinearModule(1024, 300, seed=5)
    model = cx.SequentialModel()
    model.add(layer)
    opt = {"adam": lambda: cx.AdamOptimizer(1e-3), "sgd": lambda: cx.SGDOptimizer(0.1, momentum=0.9, nesterov=True),
           "rmsprop": lambda: cx.RMSpropOptimizer(1e-3, momentum=0.5)}[opt_name]()
    for _ in range(3):
        model.forward(rng.standard_normal((8, 1024)).astype(np.float32))
        model.zero_grad()
        model.backward(rng.standard_normal((8, 300)).astype(np.float32), input_grad=False)
        opt.step(model)
    return model.flat_parameters().copy()


@pytest.mark.parametrize("opt_name", ["adam", "sgd", "rmsprop"])
def test_an_optimizer_step_split_over_threads_gives_the_same_parameters(threads, opt_name):
    # 300k parameters: the update runs in parts of whole vectors, so each element takes the path it takes on one
    # thread. The GEMMs (8 x 1024 x 300) are below the split, so the gradients are the same too.
    assert np.array_equal(optimizer_steps(opt_name, 1), optimizer_steps(opt_name, 3))


def forward_in_child(q):
    try:
        x = np.random.default_rng(5).standard_normal((16, 3, 32, 32)).astype(np.float32)
        model = image_model()
        model.eval()
        q.put((cx.get_num_threads(), model.forward(x).copy()))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        q.put(repr(e))


def test_a_forked_child_runs_the_model_math_on_threads_of_its_own(threads):
    # The parent's pool has threads that fork() does not copy; the child makes a pool of its own.
    threads(2)
    x = np.random.default_rng(5).standard_normal((16, 3, 32, 32)).astype(np.float32)
    model = image_model()
    model.eval()
    want = model.forward(x).copy()        # the parent's pool is up and its workers spin or sleep
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=forward_in_child, args=(q,))
    p.start()
    try:
        got = q.get(timeout=60)
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
    assert not isinstance(got, str), got
    assert got[0] == 2 and np.array_equal(got[1], want)


def test_two_python_threads_running_models_at_once_each_get_their_own_results(threads):
    # One of them runs its parts on the pool, the other (finding it busy) on its own thread; neither waits for
    # the other, and each result is what one thread computes alone.
    threads(2)
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal((16, 3, 32, 32)).astype(np.float32) for _ in range(2)]
    models = [image_model(seed) for seed in (7, 8)]
    for m in models:
        m.eval()
    want = [m.forward(x).copy() for m, x in zip(models, xs)]
    got, errors = [[], []], []

    def run(i):
        try:
            for _ in range(20):
                got[i].append(models[i].forward(xs[i]).copy())
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errors and all(not t.is_alive() for t in ts)
    for i in range(2):
        assert len(got[i]) == 20 and all(np.array_equal(g, want[i]) for g in got[i])


def test_the_default_is_every_cpu_this_process_may_use():
    code = "import pycyxwiz as cx; print(cx.get_num_threads())"
    clean = {k: v for k, v in os.environ.items()
             if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "LOCAL_WORLD_SIZE", "WORLD_SIZE")}

    def run(env):
        return int(subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                                  check=True, cwd="/").stdout)

    assert run({}) == len(os.sched_getaffinity(0))
    assert run({"OMP_NUM_THREADS": "3"}) == 3
    assert run({"OMP_NUM_THREADS": "3", "OPENBLAS_NUM_THREADS": "5"}) == 5
    assert run({"OMP_NUM_THREADS": "3,1"}) == 3                       # an OpenMP list: its outer level
    assert run({"OMP_NUM_THREADS": "many"}) == len(os.sched_getaffinity(0))   # not a count: ignored, as OpenBLAS does


def ema_on_threads_body():
    from pycyxwiz import callbacks as C
    from pycyxwiz.distributed import DistributedTrainer, DistributedTrainingConfig

    cx.set_num_threads(3)
    rng = np.random.default_rng(9)
    X = rng.standard_normal((256, 64)).astype(np.float32)
    y = rng.integers(0, 10, 256)
    model = cx.SequentialModel()
    model.add(cx.LinearModule(64, 1024, seed=1))   # 77k parameters: the update runs in parts
    model.add(cx.ReLUModule())
    model.add(cx.LinearModule(1024, 10, seed=2))

    class Seen(C.Callback):
        batch_metrics = False

        def __init__(self):
            self.first, self.steps = None, []

        def on_train_begin(self, trainer):
            self.first = trainer.model.flat_parameters().copy()

        def on_batch_end(self, trainer, step, logs):
            self.steps.append(trainer.model.flat_parameters().copy())

    seen, ema = Seen(), C.EMA(decay=0.9)
    trainer = DistributedTrainer(model, cx.CrossEntropyLoss(), cx.AdamOptimizer(1e-3))
    trainer.fit(X, y, DistributedTrainingConfig(epochs=2, batch_size=32, verbose=False), callbacks=[seen, ema])
    return seen.first, seen.steps, ema.flat_parameters()


def test_the_ema_of_a_process_on_three_threads_is_the_recurrence():
    ((first, steps, shadow),) = ranks.run(ema_on_threads_body, 1)
    assert first.size > 2 * 16 * 1024 and len(steps) == 16
    want = first.copy()
    for p in steps:
        want = np.float32(0.9) * want + np.float32(0.1) * p
    assert np.array_equal(shadow, want)


def conv_reference(x, w, b, padding):
    """float64 cross-correlation, stride 1: (N, C, H, W) x (O, C, k, k) -> (N, O, H', W')."""
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    k = w.shape[-1]
    oh, ow = xp.shape[2] - k + 1, xp.shape[3] - k + 1
    out = np.zeros((x.shape[0], w.shape[0], oh, ow))
    for i in range(k):
        for j in range(k):
            out += np.einsum("nchw,oc->nohw", xp[:, :, i:i + oh, j:j + ow], w[:, :, i, j].astype(np.float64))
    return out + b.astype(np.float64)[None, :, None, None]


@pytest.mark.parametrize("n", [1, 3])
def test_layers_whose_padded_images_have_one_shape_but_other_borders_share_scratch_correctly(threads, n):
    # Note [Scratch per thread]: a thread's padded sample is shared by every convolution. A 3x3 convolution padded by
    # 1 on 32x32 and a 5x5 one padded by 2 on 30x30 both pad to 34x34, with different borders: the buffer must be
    # zeroed again between them (through the GEMMs, whose padding goes through that buffer).
    threads(n)
    rng = np.random.default_rng(10)
    a, b = cx.Conv2dModule(4, 6, 3, padding=1, seed=1), cx.Conv2dModule(4, 6, 5, padding=2, seed=2)
    xa = rng.standard_normal((8, 4, 32, 32)).astype(np.float32)
    xb = rng.standard_normal((8, 4, 30, 30)).astype(np.float32)
    cx._core._conv2d_direct(False)
    try:
        outs = [(m.forward(x).copy(), m, x, p) for _ in range(2) for m, x, p in ((a, xa, 1), (b, xb, 2))]
    finally:
        cx._core._conv2d_direct(True)
    for y, m, x, p in outs:
        np.testing.assert_allclose(y, conv_reference(x, m.weight, m.bias, p), rtol=1e-4, atol=1e-4)
