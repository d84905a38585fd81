"""BatchNorm across ranks: DDPConfig.broadcast_buffers keeps every rank's running statistics equal to rank
0's, and SyncBatchNormModule normalises with the statistics of every rank's batch together, exactly as
BatchNorm on one process with the whole batch (checked against a float64 NumPy reference).

Each test body runs in every rank (tests/ranks.py).
"""
import time

import numpy as np
import pytest

import ranks

import pycyxwiz as cx

D = cx.distributed

IN, HID, OUT = 12, 16, 4


def bn_model(bn_cls=cx.BatchNormModule, momentum=0.1):
    m = cx.SequentialModel()
    m.add(cx.LinearModule(IN, HID, seed=1))
    m.add(bn_cls(HID, momentum=momentum))
    m.add(cx.ReLUModule())
    m.add(cx.LinearModule(HID, OUT, seed=2))
    return m


def toy_data(n=240, seed=3):
    rng = np.random.default_rng(seed)
    X = (rng.standard_normal((n, IN)) * 2 + 1).astype(np.float32)
    y = rng.integers(0, OUT, n).astype(np.int64)
    return X, y


def bn_numpy(x, gamma, beta, gy, eps, momentum, running_mean, running_var):
    """Batch normalisation of the whole batch x in float64: output, dL/dx, dL/dgamma, dL/dbeta for the
    upstream gradient gy (loss = sum(y * gy)), and the updated running statistics."""
    n = x.shape[0]
    mean = x.mean(axis=0)
    var = x.var(axis=0)
    invstd = 1 / np.sqrt(var + eps)
    xhat = (x - mean) * invstd
    y = gamma * xhat + beta
    dbeta = gy.sum(axis=0)
    dgamma = (gy * xhat).sum(axis=0)
    dx = gamma * invstd * (gy - dbeta / n - xhat * dgamma / n)
    rm = (1 - momentum) * running_mean + momentum * mean
    rv = (1 - momentum) * running_var + momentum * x.var(axis=0, ddof=1)
    return y, dx, dgamma, dbeta, rm, rv


# ---- broadcast_buffers ----------------------------------------------------------------

def fit_and_report_buffers(broadcast_buffers, bn_name):
    bn_cls = getattr(cx, bn_name)
    model = bn_model(bn_cls)
    cfg = D.DDPConfig()
    cfg.broadcast_buffers = broadcast_buffers
    trainer = D.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.SGDOptimizer(0.05, momentum=0.9), cfg)
    X, y = toy_data()
    trainer.fit(X, y, D.DistributedTrainingConfig(epochs=2, batch_size=16, verbose=False))
    bn = model[1]
    return bn.running_mean.tobytes(), bn.running_var.tobytes(), bn.running_mean


@pytest.mark.parametrize("world", [2, 3])
def test_after_fit_every_rank_holds_the_same_batchnorm_statistics(world):
    res = ranks.run(fit_and_report_buffers, world, args=(True, "BatchNormModule"))
    for mean, var, _ in res:
        assert (mean, var) == res[0][:2]                     # bitwise rank 0's
    assert np.abs(res[0][2]).max() > 0.05                    # and they did move away from their start


@pytest.mark.parametrize("world", [2, 3])
def test_without_broadcast_buffers_the_statistics_drift_apart(world):
    res = ranks.run(fit_and_report_buffers, world, args=(False, "BatchNormModule"))
    drift = max(np.abs(r[2] - res[0][2]).max() for r in res[1:])
    assert drift > 1e-3                                      # each rank's own batches: the drift


def test_sync_batchnorm_statistics_agree_without_any_broadcast():
    # Its statistics are global, so every rank updates its running statistics with the same numbers.
    res = ranks.run(fit_and_report_buffers, 3, args=(False, "SyncBatchNormModule"))
    for mean, var, _ in res:
        assert (mean, var) == res[0][:2]


def ddp_forward_body(broadcast_buffers):
    r = D.get_rank()
    bn = cx.BatchNormModule(3, momentum=0.5)
    model = cx.SequentialModel()
    model.add(bn)
    # Give each rank its own running statistics, before the wrapper (which then must not copy them).
    model.forward(np.arange(12, dtype=np.float32).reshape(4, 3) * (r + 1))
    before = (bn.running_mean.copy(), bn.running_var.copy())
    cfg = D.DDPConfig()
    cfg.broadcast_parameters = False
    cfg.broadcast_buffers = broadcast_buffers
    ddp = D.DistributedDataParallel(model, cfg)
    after_wrap = (bn.running_mean.copy(), bn.running_var.copy())
    # A constant batch: mean 0 and variance 0, so with momentum 0.5 the update halves the statistics the
    # forward starts from, exactly (a power of two): 0.5 * rank 0's if they were copied first.
    ddp.forward(np.zeros((4, 3), np.float32))
    after = (bn.running_mean.copy(), bn.running_var.copy())
    model.eval()
    ddp.forward(np.ones((4, 3), np.float32))                 # eval mode: no broadcast, no update
    after_eval = (bn.running_mean.copy(), bn.running_var.copy())
    return before, after_wrap, after, after_eval


def test_ddp_forward_copies_rank_0s_buffers_first():
    res = ranks.run(ddp_forward_body, 2, args=(True,))
    rank0_before = res[0][0]
    assert not np.array_equal(res[1][0][0], rank0_before[0])  # the ranks did start apart
    for before, after_wrap, after, after_eval in res:
        for k in range(2):
            np.testing.assert_array_equal(after_wrap[k], before[k])            # construction left them
            np.testing.assert_array_equal(after[k], np.float32(0.5) * rank0_before[k])
            np.testing.assert_array_equal(after_eval[k], after[k])


def test_ddp_forward_without_broadcast_buffers_keeps_each_ranks_own():
    for before, _, after, _ in ranks.run(ddp_forward_body, 2, args=(False,)):
        for k in range(2):
            np.testing.assert_array_equal(after[k], np.float32(0.5) * before[k])


# ---- SyncBatchNormModule against one process with the whole batch ----------------------

F = 5
EPS, MOMENTUM = 1e-5, 0.3
ROWS = {2: [6, 6], 3: [5, 3, 4]}  # rows per rank: uneven on 3 ranks


def global_batch(world):
    rng = np.random.default_rng(17)
    n = sum(ROWS[world])
    x = (rng.standard_normal((n, F)) * 1.5 + 4).astype(np.float32)   # far from zero mean on purpose
    gy = rng.standard_normal((n, F)).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, F).astype(np.float32)
    beta = rng.standard_normal(F).astype(np.float32)
    return x, gy, gamma, beta


def sync_bn_step(world):
    r = D.get_rank()
    x, gy, gamma, beta = global_batch(world)
    lo = sum(ROWS[world][:r])
    rows = slice(lo, lo + ROWS[world][r])
    model = cx.SequentialModel()
    model.add(cx.SyncBatchNormModule(F, eps=EPS, momentum=MOMENTUM))
    model.parameters()[0][...] = gamma
    model.parameters()[1][...] = beta
    ddp = D.DistributedDataParallel(model, D.DDPConfig())
    out = ddp.forward(np.ascontiguousarray(x[rows]))
    gx = ddp.backward(np.ascontiguousarray(gy[rows]), input_grad=True)
    grads = ddp.sync_gradients().copy()                      # DDP's average of each rank's gamma/beta grads
    return out, gx, grads, model[0].running_mean, model[0].running_var


@pytest.mark.parametrize("world", [2, 3])
def test_sync_batchnorm_on_n_ranks_equals_batchnorm_on_the_whole_batch(world):
    x, gy, gamma, beta = global_batch(world)
    y, dx, dgamma, dbeta, rm, rv = bn_numpy(x.astype(np.float64), gamma.astype(np.float64),
                                            beta.astype(np.float64), gy.astype(np.float64), EPS, MOMENTUM,
                                            np.zeros(F), np.ones(F))
    res = ranks.run(sync_bn_step, world, args=(world,))
    # float32 activations of size ~1 computed from float64 statistics: a few ulps (1e-7 relative each).
    np.testing.assert_allclose(np.concatenate([o for o, *_ in res]), y, rtol=1e-5, atol=1e-5)
    # dL/dx adds three float32 terms, two of them sums over the batch kept in float32: ~1e-6 absolute.
    np.testing.assert_allclose(np.concatenate([g for _, g, *_ in res]), dx, rtol=1e-4, atol=2e-5)
    for _, _, grads, mean, var in res:
        # The loss is sum(y * gy) over the whole batch, so its gamma/beta gradients are the sums over
        # every rank's rows: world times DDP's average. float32 sums of ~12 terms of size ~1: 1e-5.
        np.testing.assert_allclose(grads * world, np.concatenate([dgamma, dbeta]), rtol=1e-5, atol=1e-5)
        # Running statistics: float64 arithmetic rounded once to float32.
        np.testing.assert_allclose(mean, rm, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(var, rv, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(mean, res[0][3])      # the same numbers on every rank
        np.testing.assert_array_equal(var, res[0][4])


def world_of_one_body():
    x, gy, gamma, beta = global_batch(2)
    outs = []
    for cls in (cx.BatchNormModule, cx.SyncBatchNormModule):
        model = cx.SequentialModel()
        model.add(cls(F, eps=EPS, momentum=MOMENTUM))
        model.parameters()[0][...] = gamma
        model.parameters()[1][...] = beta
        ddp = D.DistributedDataParallel(model, D.DDPConfig())
        out = ddp.forward(x)
        gx = ddp.backward(gy, input_grad=True)
        outs.append((out, gx, ddp.sync_gradients().copy(), model[0].running_mean, model[0].running_var))
    return outs


def test_in_a_world_of_one_sync_batchnorm_is_batchnorm_bit_for_bit():
    (bn, sync), = ranks.run(world_of_one_body, 1)
    for a, b in zip(bn, sync):
        np.testing.assert_array_equal(a, b)


def sync_bn_smallest_batch():
    # One row per rank is a batch of 2 over both ranks: allowed, as torch.nn.SyncBatchNorm allows it.
    model = cx.SequentialModel()
    model.add(cx.SyncBatchNormModule(2))
    ddp = D.DistributedDataParallel(model, D.DDPConfig())
    out = ddp.forward(np.full((1, 2), D.get_rank(), np.float32))
    alone = cx.SequentialModel()
    alone.add(cx.SyncBatchNormModule(2))
    try:
        alone.forward(np.zeros((1, 2), np.float32))
        msg = ""
    except ValueError as e:
        msg = str(e)
    return out, msg


def test_sync_batchnorm_counts_rows_over_every_rank():
    res = ranks.run(sync_bn_smallest_batch, 2)
    np.testing.assert_allclose(res[0][0], [[-1, -1]], atol=1e-4)   # (0 - 0.5) / 0.5
    np.testing.assert_allclose(res[1][0], [[1, 1]], atol=1e-4)
    assert "needs a batch of at least 2" in res[0][1]              # without DDP: its own batch of 1


# ---- eval mode does not communicate ----------------------------------------------------

def eval_alone_body():
    r = D.get_rank()
    model = bn_model(cx.SyncBatchNormModule)
    ddp = D.DistributedDataParallel(model, D.DDPConfig())
    X, _ = toy_data(16)
    ddp.forward(X[r * 8:(r + 1) * 8])                        # one training step's forward: buffers set
    stats = model[1].running_mean.copy()
    model.eval()
    if r == 1:
        # Alone: rank 0 sleeps meanwhile. Any collective here (a buffer broadcast, a statistics sum) would
        # be the next one in the group's sequence, and would meet rank 0's barrier below instead:
        # CollectiveMismatchError on both ranks.
        for _ in range(3):
            out = ddp.forward(X[:5])
            model.backward(np.ones_like(out))                # the model's own: DDP's would reduce gradients
            model.forward(X[5:9])
    else:
        time.sleep(1.0)
    D.barrier()
    return np.array_equal(model[1].running_mean, stats)


def test_eval_mode_does_not_communicate():
    assert ranks.run(eval_alone_body, 2) == [True, True]      # and changes no running statistic


# ---- converting a model, model files -----------------------------------------------------

def convert_and_save_body(path):
    model = bn_model(cx.BatchNormModule, momentum=0.2)
    X, _ = toy_data(8, seed=D.get_rank())
    model.forward(X)                                         # running statistics away from (0, 1)
    model.parameters()[2][...] = np.linspace(0.5, 2, HID)    # gamma, beta away from (1, 0)
    model.parameters()[3][...] = np.linspace(-1, 1, HID)
    old = model[1]
    before = ([p.copy() for p in model.parameters()], old.running_mean, old.running_var)
    converted = cx.SyncBatchNormModule.convert_sync_batchnorm(model)
    new = model[1]
    kept = dict(
        same_object=converted is model and cx.convert_sync_batchnorm(model) is model,
        kinds=[type(m).__name__ for m in model],
        hyper=(new.num_features, new.eps, new.momentum),
        params=all(np.array_equal(a, b) for a, b in zip(before[0], model.parameters())),
        buffers=np.array_equal(new.running_mean, before[1]) and np.array_equal(new.running_var, before[2]),
        old_detached=np.array_equal(old.parameters()[0], before[0][2]),
    )
    old.parameters()[0][...] = 7                             # the replaced module no longer writes into the model
    kept["old_gone"] = np.array_equal(model.parameters()[2], before[0][2])
    # It trains synchronised: a step through the trainer's wrapper.
    trainer = D.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.SGDOptimizer(0.1))
    Xt, yt = toy_data(64)
    trainer.fit(Xt, yt, D.DistributedTrainingConfig(epochs=1, batch_size=8, verbose=False))
    if D.get_rank() == 0:
        model.save(path)
    D.barrier()
    loaded = cx.SequentialModel.load(path)
    model.eval()
    loaded.eval()
    roundtrip = dict(
        repr=repr(loaded) == repr(model),
        kind=type(loaded[1]).__name__,
        params=np.array_equal(loaded.flat_parameters(), model.flat_parameters()),
        buffers=np.array_equal(loaded[1].running_mean, model[1].running_mean)
        and np.array_equal(loaded[1].running_var, model[1].running_var),
        outputs=np.array_equal(loaded.forward(Xt[:10]), model.forward(Xt[:10])),
    )
    return kept, roundtrip


def test_convert_keeps_parameters_and_buffers_and_the_file_round_trips(tmp_path):
    for kept, roundtrip in ranks.run(convert_and_save_body, 2, args=(str(tmp_path / "sync.cyxmodel"),)):
        assert kept == dict(same_object=True, kinds=["LinearModule", "SyncBatchNormModule", "ReLUModule",
                                                      "LinearModule"],
                            hyper=(HID, pytest.approx(1e-5), pytest.approx(0.2)), params=True, buffers=True,
                            old_detached=True, old_gone=True)
        assert roundtrip == dict(repr=True, kind="SyncBatchNormModule", params=True, buffers=True, outputs=True)


# ---- the GPU trainer takes it -------------------------------------------------------------

def gpu_check_body():
    for cls in (cx.BatchNormModule, cx.SyncBatchNormModule):  # both have GPU code (modules_gpu.cpp)
        cx._core.dist._check_model_runs_on_gpu(bn_model(cls))
    return True


def test_the_gpu_trainer_takes_sync_batchnorm():
    # What GpuEngine checks before it opens a GPU (csrc/nn/device_model.h), so it needs none here; the training
    # itself is compared with the CPU's in tests/test_gpu.py.
    assert ranks.run(gpu_check_body, 1) == [True]
