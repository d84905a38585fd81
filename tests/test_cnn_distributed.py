"""Convolutional models through the whole training stack, each rank a real process over 127.0.0.1: the
DistributedTrainer on 2 ranks takes the steps of one process on the whole batch (SyncBatchNorm inside
ResidualModule blocks included), ZeRO-1 and the communication hooks work with 4-D weights, checkpoints
resume, no_sync accumulates, join() takes uneven inputs, and the replicas stay identical throughout."""
import numpy as np
import pytest

import ranks

import pycyxwiz as cx

D = cx.distributed


def seq(*mods):
    m = cx.SequentialModel()
    for mod in mods:
        m.add(mod)
    return m


def small_cnn(seed=0, batchnorm=True, sync=False):
    """A ResNet in miniature on (N, 1, 8, 8): a stem, an identity block, a strided block with a 1x1 shortcut."""
    bn = (lambda c: cx.BatchNorm2dModule(c)) if batchnorm else (lambda c: cx.TanhModule())
    s = seed * 100
    block1 = seq(cx.Conv2dModule(4, 4, 3, padding=1, bias=False, seed=s + 2), bn(4), cx.ReLUModule(),
                 cx.Conv2dModule(4, 4, 3, padding=1, bias=not batchnorm, seed=s + 3), bn(4))
    block2 = seq(cx.Conv2dModule(4, 6, 3, stride=2, padding=1, bias=False, seed=s + 4), bn(6), cx.ReLUModule(),
                 cx.Conv2dModule(6, 6, 3, padding=1, seed=s + 5))
    short2 = seq(cx.Conv2dModule(4, 6, 1, stride=2, bias=False, seed=s + 6), bn(6))
    # A convolution's bias before a batch norm is removed by it (its gradient is rounding noise, which Adam
    # would turn into steps): none there, as in ResNets.
    model = seq(cx.Conv2dModule(1, 4, 3, padding=1, bias=not batchnorm, seed=s + 1), bn(4), cx.ReLUModule(),
                cx.ResidualModule(block1), cx.ReLUModule(), cx.ResidualModule(block2, short2), cx.ReLUModule(),
                cx.MaxPool2dModule(2), cx.FlattenModule(), cx.LinearModule(24, 10, seed=s + 7))
    if sync:
        cx.convert_sync_batchnorm(model)
    return model


def data(n=192, seed=3):
    """Digits-like: 10 classes of noisy 8x8 templates."""
    rng = np.random.default_rng(seed)
    templates = rng.standard_normal((10, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, n).astype(np.int64)
    X = (templates[y] + 0.5 * rng.standard_normal((n, 1, 8, 8))).astype(np.float32)
    return X, y


def config(**kw):
    return D.DistributedTrainingConfig(verbose=False, seed=7, shuffle=False, **kw)


# ---- 2 ranks take the steps of one process on the whole batch --------------------------------------

def fit_body(batch, sync, epochs):
    X, y = data()
    model = small_cnn(seed=1, sync=sync)
    trainer = D.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.SGDOptimizer(0.05, momentum=0.9))
    h = trainer.fit(X, y, config(epochs=epochs, batch_size=batch))
    bn = [b for m in (model[3].block, model[5].block, model[5].shortcut) for b in m if hasattr(b, "running_mean")]
    return (model.flat_parameters().copy(), h.train_losses, [b.running_mean.copy() for b in bn],
            [b.running_var.copy() for b in bn])


def test_two_ranks_with_sync_batchnorm_train_as_one_process_on_the_whole_batch():
    # Without shuffling, rank r's batch s is positions r, r+2, ... of the global batch s of one process with
    # twice the batch (Note [Sampler layout]); SyncBatchNorm's statistics are the whole batch's, and DDP
    # averages the gradients: the same steps, up to float32 rounding in another order.
    (ref,) = ranks.run(fit_body, 1, args=(32, False, 2))
    two = ranks.run(fit_body, 2, args=(16, True, 2), timeout=120)
    assert np.array_equal(two[0][0], two[1][0])  # the replicas stay bit-identical
    np.testing.assert_allclose(two[0][0], ref[0], rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(two[0][1], ref[1], rtol=1e-4)
    for a, b in zip(two[0][2] + two[0][3], ref[2] + ref[3]):  # running statistics: the global batch's too
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert ref[1][-1] < 0.7 * ref[1][0]


def test_plain_batchnorm2d_buffers_are_rank_0s_on_every_rank():
    two = ranks.run(fit_body, 2, args=(16, False, 1), timeout=120)
    for a, b in zip(two[0][2] + two[0][3], two[1][2] + two[1][3]):
        np.testing.assert_array_equal(a, b)
    assert np.array_equal(two[0][0], two[1][0])


# ---- ZeRO-1 and the communication hooks ---------------------------------------------------------------

def zero_or_hook_body(shard, hook):
    X, y = data(128)
    cfg = D.DDPConfig()
    cfg.bucket_size_mb = cfg.first_bucket_mb = 0.001  # several buckets, some inside a residual block
    cfg.comm_hook = hook
    model = small_cnn(seed=2 + D.get_rank())  # different on each rank: construction broadcasts rank 0's
    trainer = D.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.AdamOptimizer(3e-3), ddp_config=cfg)
    h = trainer.fit(X, y, config(epochs=2, batch_size=16, shard_optimizer_state=shard))
    return model.flat_parameters().copy(), h.train_losses, len(trainer.ddp.buckets)


def test_zero1_takes_the_steps_of_plain_ddp_with_a_cnn():
    plain = ranks.run(zero_or_hook_body, 2, args=(False, "none"), timeout=120)
    zero = ranks.run(zero_or_hook_body, 2, args=(True, "none"), timeout=120)
    assert plain[0][2] > 2
    assert np.array_equal(zero[0][0], zero[1][0])
    np.testing.assert_allclose(zero[0][0], plain[0][0], rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(zero[0][1], plain[0][1], rtol=1e-5)


@pytest.mark.parametrize("hook", ["fp16", "powersgd"])
def test_compressing_hooks_train_a_cnn_and_keep_the_replicas_equal(hook):
    plain = ranks.run(zero_or_hook_body, 2, args=(False, "none"), timeout=120)
    hooked = ranks.run(zero_or_hook_body, 2, args=(False, hook), timeout=120)
    assert np.array_equal(hooked[0][0], hooked[1][0])
    losses = hooked[0][1]
    assert losses[-1] < 0.8 * losses[0]
    assert losses[-1] < 1.5 * plain[0][1][-1]
    if hook == "fp16":  # a rounding of the gradients, not another algorithm
        np.testing.assert_allclose(hooked[0][0], plain[0][0], rtol=0, atol=5e-3)


# ---- checkpoints resume; auto-resume -------------------------------------------------------------------

def fit_with_checkpoints(ckpt_dir, epochs, resume_from):
    X, y = data(96)
    model = small_cnn(seed=4)
    trainer = D.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.AdamOptimizer(2e-3))
    h = trainer.fit(X, y, config(epochs=epochs, batch_size=8, checkpoint_every_n_epochs=1, checkpoint_dir=ckpt_dir),
                    resume_from=resume_from)
    bn = model[5].shortcut[1]
    return model.flat_parameters().copy(), h.train_losses, bn.running_mean.copy(), h.epochs_completed


def test_resume_from_a_checkpoint_gives_the_weights_and_statistics_of_an_uninterrupted_run(tmp_path):
    full = ranks.run(fit_with_checkpoints, 2, args=(str(tmp_path / "a"), 3, None), timeout=120)
    resumed = ranks.run(fit_with_checkpoints, 2, args=(str(tmp_path / "b"), 3, str(tmp_path / "a" / "epoch_0001.ckpt")),
                        timeout=120)
    for (wa, la, ma, _), (wb, lb, mb, _) in zip(full, resumed):
        assert np.array_equal(wa, wb) and np.array_equal(ma, mb)
        assert la == lb
    # auto-resume: the same folder again continues from its last checkpoint (epoch 3: nothing left to do)
    again = ranks.run(fit_with_checkpoints, 2, args=(str(tmp_path / "a"), 3, None), timeout=120)
    assert np.array_equal(again[0][0], full[0][0]) and again[0][3] == 3


# ---- DistributedDataParallel by hand: no_sync accumulation, join with uneven inputs -----------------------

def no_sync_body():
    X, y = data(64)
    r = D.get_rank()
    loss = cx.CrossEntropyLoss()
    results = []
    for accumulate in (True, False):
        model = small_cnn(seed=6, batchnorm=False)
        ddp = D.DistributedDataParallel(model)
        opt = cx.SGDOptimizer(0.1)
        model.zero_grad()
        if accumulate:  # two micro-batches of 8 per rank, the first without communication
            for half in range(2):
                rows = slice(32 * r + 16 * half, 32 * r + 16 * half + 16)
                with ddp.no_sync() if half == 0 else _null():
                    loss.forward(ddp.forward(X[rows]), y[rows])
                    ddp.backward(loss.backward(0.5))
        else:           # one batch of 32 per rank
            rows = slice(32 * r, 32 * r + 32)
            loss.forward(ddp.forward(X[rows]), y[rows])
            ddp.backward(loss.backward())
        ddp.update_parameters(opt)
        results.append(model.flat_parameters().copy())
    return results


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_no_sync_accumulation_equals_one_big_batch_with_a_cnn():
    for accumulated, big in ranks.run(no_sync_body, 2, timeout=120):
        np.testing.assert_allclose(accumulated, big, rtol=1e-5, atol=1e-6)


def joined_body(extra):
    X, y = data(160)
    r = D.get_rank()
    model = small_cnn(seed=8)  # BatchNorm2d: buffers broadcast while a rank has finished
    ddp = D.DistributedDataParallel(model)
    opt, loss = cx.SGDOptimizer(0.05), cx.CrossEntropyLoss()
    steps = 3 + (extra if r == 1 else 0)
    with ddp.join():
        for s in range(steps):
            rows = slice(16 * (2 * s + r), 16 * (2 * s + r) + 16)
            loss.forward(ddp.forward(X[rows]), y[rows])
            model.zero_grad()
            ddp.backward(loss.backward())
            ddp.update_parameters(opt)
    return model.flat_parameters().copy()


def test_join_takes_uneven_inputs_with_a_cnn():
    a, b = ranks.run(joined_body, 2, args=(2,), timeout=120)
    assert np.array_equal(a, b)


def join_with_nested_syncbn():
    model = small_cnn(seed=9, sync=True)
    with D.DistributedDataParallel(model).join():
        pass


def test_join_refuses_a_sync_batchnorm_inside_a_residual_block():
    for o in ranks.spawn(join_with_nested_syncbn, 2):
        assert not o.ok
        assert "layer 1 is a SyncBatchNorm" in o.message, o.message  # the stem's, before the residual's


def join_with_syncbn_only_in_a_block():
    model = small_cnn(seed=9)
    cx.convert_sync_batchnorm(model[3].block)
    with D.DistributedDataParallel(model).join():
        pass


def test_join_names_the_residual_that_holds_a_sync_batchnorm():
    for o in ranks.spawn(join_with_syncbn_only_in_a_block, 2):
        assert not o.ok
        assert "layer 3 holds a SyncBatchNorm" in o.message and "use BatchNorm under join()" in o.message, o.message
