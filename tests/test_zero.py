"""ZeRO-1 (ZeroRedundancyOptimizer, DistributedTrainingConfig.shard_optimizer_state): on 2 and 3
ranks it takes the steps of plain DDP (float32 rounding) for SGD with momentum, Adam, AdamW and
RMSprop, each rank holding only its shard's optimizer state (measured), with shards that do not
divide evenly; checkpoints hold the whole state and resume on another world size; misuse errors.
"""
import numpy as np
import pytest

import ranks
from models import IN, OUT, mlp3 as make_model

import pycyxwiz as cx

D = cx.distributed



def make_opt(name):
    return {"sgd": lambda: cx.SGDOptimizer(0.05, momentum=0.9),
            "adam": lambda: cx.AdamOptimizer(0.01, weight_decay=0.01),
            "adamw": lambda: cx.AdamWOptimizer(0.01, weight_decay=0.1),
            "rmsprop": lambda: cx.RMSpropOptimizer(0.005, momentum=0.5)}[name]()


STATE_ARRAYS = {"sgd": 1, "adam": 2, "adamw": 2, "rmsprop": 2}   # momentum / moments per parameter


def train_both(opt_name, steps, b, bucket_mb):
    """Per rank: the same steps with plain DDP and with ZeRO-1, on two copies of one model
    (ranks start from different weights: construction broadcasts rank 0's)."""
    r, p = D.get_rank(), D.get_world_size()
    cfg = D.DDPConfig()
    cfg.bucket_size_mb = bucket_mb
    plain_model, zero_model = make_model(1 + 1000 * r), make_model(1 + 1000 * r)
    plain = D.DistributedDataParallel(plain_model, cfg)
    sharded = D.DistributedDataParallel(zero_model, cfg)
    opt = make_opt(opt_name)
    zero = D.ZeroRedundancyOptimizer(sharded, make_opt(opt_name))
    loss_fn = cx.CrossEntropyLoss()
    rng = np.random.default_rng(7)
    for s in range(steps):
        X = rng.standard_normal((p * b, IN)).astype(np.float32)
        y = rng.integers(0, OUT, p * b).astype(np.int64)
        mine = slice(r * b, (r + 1) * b)
        for ddp in (plain, sharded):
            out = ddp.forward(X[mine])
            loss_fn.forward(out, y[mine])
            ddp.backward(loss_fn.backward(), input_grad=False)
        plain.update_parameters(opt)
        if s % 2:
            sharded.update_parameters(zero)
        else:
            zero.step()
    return (plain_model.flat_parameters().copy(), zero_model.flat_parameters().copy(), zero.shard,
            zero.state_numel, opt.state_numel, zero_model.num_parameters(), zero.optimizer.steps)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("opt_name", ["sgd", "adam", "adamw", "rmsprop"])
def test_zero1_takes_the_steps_of_plain_ddp_and_holds_one_shard_of_the_state(world, opt_name):
    steps = 4
    res = ranks.run(train_both, world, args=(opt_name, steps, 6, 1e-3))   # 1e-3 MiB: several pieces per shard
    n = res[0][5]
    assert n % world != 0
    offset = 0
    for r, (plain, zero, (off, count), zero_state, full_state, _, opt_steps) in enumerate(res):
        # The ranks sum gradients in another order (reduce-scatter vs all-reduce): the tolerance
        # test_ddp.py allows DDP against one process; RMSprop's 1/sqrt(v) amplifies a last-bit difference.
        np.testing.assert_allclose(zero, plain, rtol=2e-5, atol=2e-6)
        assert np.array_equal(zero, res[0][1])                    # replicas stay bit-identical
        assert off == offset and count == (n // world if r < world - 1 else n - (world - 1) * (n // world))
        offset += count
        k = STATE_ARRAYS[opt_name]
        assert zero_state == k * count                             # this rank's shard only
        assert full_state == k * n                                 # plain DDP: the whole state on every rank
        assert opt_steps == steps
    assert offset == n                                             # the shards tile the parameters


def test_one_big_bucket_gives_the_same_result():
    res = ranks.run(train_both, 2, args=("adam", 3, 5, 25.0))
    for plain, zero, *_ in res:
        np.testing.assert_allclose(zero, plain, rtol=2e-5, atol=2e-6)


def zero_state_roundtrip():
    r, p = D.get_rank(), D.get_world_size()
    model = make_model(3)
    ddp = D.DistributedDataParallel(model)
    zero = D.ZeroRedundancyOptimizer(ddp, cx.AdamOptimizer(0.01))
    loss_fn = cx.CrossEntropyLoss()
    rng = np.random.default_rng(r)
    for _ in range(2):
        out = ddp.forward(rng.standard_normal((4, IN)).astype(np.float32))
        loss_fn.forward(out, rng.integers(0, OUT, 4).astype(np.int64))
        ddp.backward(loss_fn.backward(), input_grad=False)
        zero.step()
    whole = zero.state_dict()                                       # collective: gathered
    off, count = zero.shard
    mine = zero.optimizer.state_dict()
    zero.load_state_dict(whole)                                     # each rank keeps its shard again
    again = zero.optimizer.state_dict()
    return ({k: v for k, v in whole.items()}, off, count, mine["exp_avg"], again["exp_avg"], model.num_parameters())


def test_state_dict_gathers_every_shard_and_load_state_dict_keeps_this_rank_s():
    res = ranks.run(zero_state_roundtrip, 3)
    whole = res[0][0]
    for w, off, count, mine, again, n in res:
        assert w["exp_avg"].shape == (n,) and w["exp_avg_sq"].shape == (n,) and w["step"] == 2
        np.testing.assert_array_equal(w["exp_avg"], whole["exp_avg"])
        np.testing.assert_array_equal(w["exp_avg"][off:off + count], mine)
        np.testing.assert_array_equal(mine, again)


# ---- DistributedTrainer: shard_optimizer_state and checkpoints ------------------------------

def trainer_data():
    X, y = cx.datasets.load_digits()
    return X[:600], y[:600]     # 600 = 50 global batches of 12, no padding on 1, 2 or 3 ranks


def mlp(seed=4):
    m = cx.SequentialModel()
    m.add(cx.LinearModule(64, 32, seed=seed))
    m.add(cx.ReLUModule())
    m.add(cx.LinearModule(32, 10, seed=seed + 1))
    return m


def fit_sharded(ckpt_dir, epochs, resume_from, shard):
    X, y = trainer_data()
    model = mlp()
    opt = cx.AdamOptimizer(2e-3)
    trainer = D.DistributedTrainer(model, cx.CrossEntropyLoss(), opt)
    world = D.get_world_size()
    c = D.DistributedTrainingConfig(verbose=False, seed=3, epochs=epochs, batch_size=12 // world,
                                    checkpoint_every_n_epochs=1 if ckpt_dir else 0, checkpoint_dir=ckpt_dir or ".",
                                    shard_optimizer_state=shard)
    h = trainer.fit(X, y, c, resume_from=resume_from)
    zero = trainer._core.zero
    return (model.flat_parameters().copy(), h.train_losses, opt.state_numel, model.num_parameters(),
            zero.shard if zero is not None else None)


def test_the_trainer_with_sharded_state_equals_the_unsharded_trainer():
    plain = ranks.run(fit_sharded, 2, args=(None, 2, None, False))
    sharded = ranks.run(fit_sharded, 2, args=(None, 2, None, True))
    for (wp, lp, sp, n, _), (ws, ls, ss, _, (off, count)) in zip(plain, sharded):
        np.testing.assert_allclose(ws, wp, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ls, lp, rtol=1e-5)
        assert sp == 2 * n and ss == 2 * count                      # Adam: two arrays, of the shard only


@pytest.mark.parametrize("world_after,shard_after", [(3, True), (1, False)])
def test_a_sharded_checkpoint_of_2_ranks_resumes_on_another_world_size(tmp_path, world_after, shard_after):
    full = ranks.run(fit_sharded, 2, args=(str(tmp_path / "a"), 4, None, True))
    ckpt = str(tmp_path / "a" / "epoch_0002.ckpt")
    with np.load(ckpt) as z:
        assert z["opt.exp_avg"].shape == (full[0][3],)             # the whole state, not rank 0's shard
    resumed = ranks.run(fit_sharded, world_after, args=(str(tmp_path / "b"), 4, ckpt, shard_after))
    for w, losses, *_ in resumed:
        np.testing.assert_allclose(w, full[0][0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(losses, full[0][1], rtol=1e-4)


# ---- errors -----------------------------------------------------------------------------------

def tiny_model_zero_vs_plain(opt_name):
    """2 parameters on 3 ranks: ranks 0 and 1 own empty shards, rank 2 owns both."""
    r, p = D.get_rank(), D.get_world_size()

    def tiny(seed):
        m = cx.SequentialModel()
        m.add(cx.LinearModule(1, 1, seed=seed))
        return m
    plain_model, zero_model = tiny(1 + r), tiny(1 + r)
    plain, sharded = D.DistributedDataParallel(plain_model), D.DistributedDataParallel(zero_model)
    opt, zero = make_opt(opt_name), D.ZeroRedundancyOptimizer(sharded, make_opt(opt_name))
    loss_fn = cx.MSELoss()
    rng = np.random.default_rng(5)
    for _ in range(3):
        X = rng.standard_normal((p * 4, 1)).astype(np.float32)
        y = (2 * X + 1).astype(np.float32)
        mine = slice(r * 4, (r + 1) * 4)
        for ddp in (plain, sharded):
            loss_fn.forward(ddp.forward(X[mine]), y[mine])
            ddp.backward(loss_fn.backward(), input_grad=False)
        plain.update_parameters(opt)
        zero.step()
    whole = {k: np.array(v, copy=True) for k, v in zero.state_dict().items() if isinstance(v, np.ndarray)}
    full = {k: np.array(v, copy=True) for k, v in opt.state_dict().items() if isinstance(v, np.ndarray)}
    return plain_model.flat_parameters().copy(), zero_model.flat_parameters().copy(), zero.shard, whole, full


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_a_model_with_fewer_parameters_than_ranks_trains_with_empty_shards(opt_name):
    res = ranks.run(tiny_model_zero_vs_plain, 3, args=(opt_name,))
    for r, (plain, zero, shard, whole, full) in enumerate(res):
        np.testing.assert_allclose(zero, plain, rtol=2e-6, atol=1e-7)
        assert np.array_equal(zero, res[0][1])
        assert tuple(shard) == ((0, 0) if r < 2 else (0, 2))
        assert whole.keys() == full.keys() and whole
        for k in full:
            np.testing.assert_allclose(whole[k], full[k], rtol=2e-6, atol=1e-7)


def step_inner_optimizer():
    model = make_model(0)
    ddp = D.DistributedDataParallel(model)
    opt = cx.AdamOptimizer(0.01)
    zero = D.ZeroRedundancyOptimizer(ddp, opt)
    out = ddp.forward(np.ones((2, IN), np.float32))
    ddp.backward(np.ones_like(out), input_grad=False)
    errors = []
    try:
        ddp.update_parameters(opt)
    except ValueError as e:
        errors.append(str(e))
    try:
        D.ZeroRedundancyOptimizer(ddp, cx.AdamOptimizer(0.01))
    except ValueError as e:
        errors.append(str(e))
    zero.step()
    return errors


def test_stepping_the_wrapped_optimizer_directly_or_wrapping_twice_is_refused():
    for errors in ranks.run(step_inner_optimizer, 2):
        assert len(errors) == 2
        assert "optimizer state is sharded by a ZeroRedundancyOptimizer" in errors[0]
        assert "ddp.update_parameters(zero) or zero.step()" in errors[0]
        assert "already sharded by another ZeroRedundancyOptimizer" in errors[1]


def load_partial_state():
    model = make_model(0)
    zero = D.ZeroRedundancyOptimizer(D.DistributedDataParallel(model), cx.AdamOptimizer(0.01))
    sd = {"type": "Adam", "lr": 0.01, "step": 1, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0,
          "exp_avg": np.zeros(10, np.float32), "exp_avg_sq": np.zeros(10, np.float32)}
    zero.load_state_dict(sd)


def test_loading_a_shard_instead_of_a_whole_state_is_refused():
    for o in ranks.spawn(load_partial_state, 2):
        assert not o.ok and o.exc_type == "ValueError"
        assert "'exp_avg' holds 10 floats but the model has 3605 parameters" in o.message


def hook_with_zero_or_join():
    errors = []
    cfg = D.DDPConfig()
    cfg.comm_hook = "bf16"
    try:                                           # a hooked DDP, then ZeRO
        D.ZeroRedundancyOptimizer(D.DistributedDataParallel(make_model(0), cfg), cx.AdamOptimizer(0.01))
    except ValueError as e:
        errors.append(str(e))
    ddp = D.DistributedDataParallel(make_model(0))
    zero = D.ZeroRedundancyOptimizer(ddp, cx.AdamOptimizer(0.01))  # shards while it lives
    try:                                           # ZeRO, then a hook
        ddp.register_comm_hook("fp16")
    except ValueError as e:
        errors.append(str(e))
    del zero
    hooked = D.DistributedDataParallel(make_model(0), cfg)
    try:                                           # a hook, then join
        with hooked.join():
            pass
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_a_communication_hook_is_refused_with_zero_and_inside_join():
    for errors in ranks.run(hook_with_zero_or_join, 2):
        assert len(errors) == 3, errors
        assert "has the 'bf16' communication hook" in errors[0] and "ZeRO-1 reduce-scatters" in errors[0]
        assert "hook 'fp16' compresses all-reduces" in errors[1] and "ZeroRedundancyOptimizer" in errors[1]
        assert "has the 'bf16' communication hook" in errors[2] and "join" in errors[2]
