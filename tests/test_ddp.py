"""DistributedDataParallel: N ranks with per-rank batch b take the same steps as one
process with batch N*b (float32 tolerance), for tiny buckets (one per tensor) and one big
bucket, with no_sync/accumulation, plus bucket assignment and the parameter check.
"""
import numpy as np
import pytest

import ranks
from models import IN, OUT, mlp3 as make_model

import pycyxwiz as cx

D = cx.distributed



def data(total, seed=5):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((total, IN)).astype(np.float32)
    y = rng.integers(0, OUT, total).astype(np.int64)
    return X, y


def ddp_steps(world_total, b, steps, bucket_mb, accum, mode, opt_name):
    """Per rank: `steps` optimizer steps; step s uses rows of block s (world_total*b*accum rows),
    this rank's share being `accum` micro-batches of b rows. Ranks start from different
    weights (seed = rank): construction must broadcast rank 0's."""
    r, p = D.get_rank(), D.get_world_size()
    model = make_model(seed=1 + 1000 * r)
    cfg = D.DDPConfig()
    cfg.bucket_size_mb = bucket_mb
    cfg.first_bucket_mb = min(bucket_mb, 1.0)
    ddp = D.DistributedDataParallel(model, cfg)
    loss_fn = cx.CrossEntropyLoss()
    opt = cx.SGDOptimizer(0.1, momentum=0.9) if opt_name == "sgd" else cx.AdamOptimizer(0.01)
    per_step = world_total * b * accum
    X, y = data(per_step * steps)
    counts = []
    for s in range(steps):
        block = slice(s * per_step, (s + 1) * per_step)
        Xs, ys = X[block], y[block]
        mine = np.arange(per_step).reshape(p, accum * b)[r] if p > 1 else np.arange(per_step)
        micro = np.array_split(mine, accum)
        before = ddp.allreduce_count
        for i, idx in enumerate(micro):
            out = ddp.forward(np.ascontiguousarray(Xs[idx]))
            loss_fn.forward(out, np.ascontiguousarray(ys[idx]))
            g = (loss_fn.backward() / accum).astype(np.float32)
            if mode == "no_sync" and i < accum - 1:
                with ddp.no_sync():
                    ddp.backward(g, input_grad=False)
            else:
                ddp.backward(g, input_grad=False)
        if mode == "seed":
            ddp.sync_gradients()
        ddp.update_parameters(opt)
        counts.append(ddp.allreduce_count - before)
    return model.flat_parameters().copy(), counts, len(ddp.buckets)


def reference(world_total, b, steps, accum, opt_name):
    return ranks.run(ddp_steps, 1, args=(world_total, b, steps, 25.0, 1, "plain", opt_name))[0][0]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("bucket_mb", [1e-4, 25.0])
def test_n_ranks_with_batch_b_equal_one_process_with_batch_nb(world, bucket_mb):
    b, steps = 6, 4
    want = reference(world, b, steps, 1, "sgd")
    res = ranks.run(ddp_steps, world, args=(world, b, steps, bucket_mb, 1, "plain", "sgd"))
    for params, counts, nb in res:
        np.testing.assert_allclose(params, want, rtol=2e-5, atol=2e-6)
        assert np.array_equal(params, res[0][0])          # replicas stay bit-identical
        assert nb == (6 if bucket_mb < 1 else 1)            # tiny buckets: one per tensor
        assert counts == [nb] * steps                       # each bucket reduced once per step


def test_adam_equivalence_on_two_ranks():
    want = reference(2, 8, 3, 1, "adam")
    for params, _, _ in ranks.run(ddp_steps, 2, args=(2, 8, 3, 1e-4, 1, "plain", "adam")):
        np.testing.assert_allclose(params, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("mode", ["no_sync", "seed"])
@pytest.mark.parametrize("world", [2, 3])
def test_gradient_accumulation_equals_a_larger_batch(world, mode):
    b, steps, accum = 4, 3, 3
    want = ranks.run(ddp_steps, 1, args=(world * accum, b, steps, 25.0, 1, "plain", "sgd"))[0][0]
    res = ranks.run(ddp_steps, world, args=(world, b, steps, 1e-4, accum, mode, "sgd"))
    for params, counts, nb in res:
        np.testing.assert_allclose(params, want, rtol=2e-5, atol=2e-6)
        if mode == "no_sync":
            assert counts == [nb] * steps                   # inner micro-steps do not communicate
        else:
            # the seed's pattern is learned after the first cycle: then one reduction per bucket
            assert counts[1:] == [nb] * (steps - 1) and counts[0] >= nb


def sync_is_the_mean_of_local_gradients():
    r = D.get_rank()
    model = make_model(seed=3)
    cfg = D.DDPConfig()
    cfg.bucket_size_mb = 1e-3
    ddp = D.DistributedDataParallel(model, cfg)
    X, y = data(8 * D.get_world_size(), seed=11)
    x, t = X[r * 8:(r + 1) * 8], y[r * 8:(r + 1) * 8]
    loss_fn = cx.CrossEntropyLoss()
    # the local gradient, computed by the model alone (no DDP call: nothing is reduced)
    loss_fn.forward(model.forward(x), t)
    model.backward(loss_fn.backward(), input_grad=False)
    local = model.flat_gradients().copy()
    model.zero_grad()
    loss_fn.forward(ddp.forward(x), t)
    ddp.backward(loss_fn.backward())
    synced = ddp.sync_gradients().copy()
    gathered = [np.empty_like(local) for _ in range(D.get_world_size())]
    D.all_gather(gathered, local)
    return synced, gathered


@pytest.mark.parametrize("world", [2, 4])
def test_sync_gradients_returns_the_average_of_every_rank_s_gradient(world):
    for synced, gathered in ranks.run(sync_is_the_mean_of_local_gradients, world):
        want = np.mean(np.stack(gathered).astype(np.float64), axis=0)
        np.testing.assert_allclose(synced, want, rtol=1e-5, atol=1e-7)


# ---- bucket assignment ------------------------------------------------------------

def test_buckets_are_reverse_order_contiguous_slices_within_the_caps():
    counts = [300, 10, 5000, 50, 1, 0, 700, 7]
    first, cap = 40, 4000
    buckets = cx._core.dist._assign_buckets(counts, 4, first, cap)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    expect_param = len(counts) - 1
    for i, (lo, hi, off, n) in enumerate(buckets):
        assert hi == expect_param                              # reverse layer order, no gaps
        expect_param = lo - 1
        assert off == offsets[lo] and n == offsets[hi + 1] - offsets[lo]   # one slice of the flat buffer
        limit = first if i == 0 else cap
        assert n * 4 <= limit or lo == hi                       # over the cap only for a lone tensor
    assert expect_param == -1
    assert buckets[0] == (7, 7, offsets[7], 7)             # the small first bucket
    assert buckets[1] == (3, 6, offsets[3], 751)           # 3004 bytes; the empty tensor joins its neighbours
    assert buckets[2] == (2, 2, offsets[2], 5000)          # alone: bigger than the cap
    # the first bucket is capped at 1 MiB (the 1.2 MB tensor starts the next); 25 MiB holds the rest
    assert cx._core.dist._assign_buckets([10, 10, 300_000, 5], 4, 1 << 20, 25 << 20) == \
        [(3, 3, 300_020, 5), (0, 2, 0, 300_020)]


# ---- parameter check ----------------------------------------------------------------

def check_body(broadcast, poke):
    r = D.get_rank()
    cfg = D.DDPConfig()
    cfg.broadcast_parameters = broadcast
    model = make_model(seed=1 + r)
    ddp = D.DistributedDataParallel(model, cfg)
    if poke and r == 1:
        model.parameters()[2][0, 0] += 1e-3
    report = ddp.check_parameters(raise_on_mismatch=False)
    try:
        ddp.check_parameters()
        msg = ""
    except D.CollectiveMismatchError as e:
        msg = str(e)
    return report, msg


def test_parameters_are_identical_after_construction():
    for report, msg in ranks.run(check_body, 3, args=(True, False)):
        assert report == [] and msg == ""


def test_check_parameters_names_the_ranks_and_parameters_that_differ():
    for report, msg in ranks.run(check_body, 3, args=(True, True)):
        assert report == [(2, [1])]
        assert "parameter 2 (layer 2 Linear.weight) differs from rank 0's on ranks [1]" in msg
    for report, msg in ranks.run(check_body, 3, args=(False, False)):
        assert report == [(i, [1, 2]) for i in (0, 2, 4)]    # weights differ; biases start at zero
        assert "broadcast_parameters = False" in msg


# ---- errors -------------------------------------------------------------------------

def ddp_without_init():
    D.DistributedDataParallel(make_model(0), D.DDPConfig())


def test_ddp_before_init_says_to_call_init():
    (o,) = ranks.spawn(ddp_without_init, 1, init=False)
    assert not o.ok and o.is_a("DistributedError")
    assert "DistributedDataParallel: the process group is not initialized: call cx.distributed.init() first" \
        in o.message


def bad_config(field, value):
    cfg = D.DDPConfig()
    setattr(cfg, field, value)
    D.DistributedDataParallel(make_model(0), cfg)


def test_bad_bucket_size_is_rejected():
    (o,) = ranks.spawn(bad_config, 1, args=("bucket_size_mb", 0.0))
    assert o.exc_type == "ValueError" and "DDPConfig.bucket_size_mb must be > 0, got 0" in o.message


def backward_wrong_shape():
    ddp = D.DistributedDataParallel(make_model(0))
    ddp.forward(np.zeros((4, IN), np.float32))
    ddp.backward(np.zeros((4, OUT + 1), np.float32))


def test_backward_with_a_wrong_gradient_shape_is_named():
    (o,) = ranks.spawn(backward_wrong_shape, 1)
    assert not o.ok and "(4, 6)" in o.message, o.message


# ---- wrapping a model twice (Note [Unused parameters] in csrc/train/ddp.h) -----------

def rewrap_steps(steps):
    """A model wrapped, wrapped again, and the first wrapper dropped (as `trainer = DistributedTrainer(model, ...)`
    run twice does): the newest wrapper keeps its gradient hook and trains like a single wrapper; the stale
    one refuses to run instead of leaving buckets unreduced."""
    import gc
    r = D.get_rank()
    model = make_model(seed=1)
    old = D.DistributedDataParallel(model, D.DDPConfig())
    cfg = D.DDPConfig()
    cfg.bucket_size_mb = 1e-4                                 # one bucket per tensor: every hook matters
    cfg.first_bucket_mb = 1e-4
    new = D.DistributedDataParallel(model, cfg)
    loss_fn = cx.CrossEntropyLoss()
    X, y = data(2 * 6 * steps)
    loss_fn.forward(old.forward(X[:6]), y[:6])
    try:
        old.backward(loss_fn.backward().astype(np.float32), input_grad=False)
        stale = ""
    except ValueError as e:
        stale = str(e)
    model.zero_grad()
    del old
    gc.collect()                                              # the old wrapper's destructor runs here
    opt = cx.SGDOptimizer(0.1, momentum=0.9)
    for s in range(steps):
        rows = slice((2 * s + r) * 6, (2 * s + r + 1) * 6)
        out = new.forward(np.ascontiguousarray(X[rows]))
        loss_fn.forward(out, np.ascontiguousarray(y[rows]))
        new.backward(loss_fn.backward().astype(np.float32), input_grad=False)
        new.update_parameters(opt)
    return model.flat_parameters().copy(), stale


def test_rewrapping_a_model_keeps_the_newest_wrapper_working_and_the_stale_one_says_so():
    steps = 3
    want = ranks.run(ddp_steps, 1, args=(2, 6, steps, 25.0, 1, "plain", "sgd"))[0][0]
    for got, stale in ranks.run(rewrap_steps, 2, args=(steps,)):
        assert "wrapped by another DistributedDataParallel" in stale and "use the newest one" in stale, stale
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
