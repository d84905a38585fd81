"""Uneven inputs (ddp.join() / cx.distributed.join): ranks with different numbers of batches finish
together, gradients averaged over the ranks still active; every rank ends with the parameters of a
single-process reference that averages each step's per-rank gradients in NumPy with that shrinking
divisor. BatchNorm's buffer broadcast does not deadlock; misuse is refused with a clear message.
The DistributedTrainer cannot meet uneven inputs: its DistributedSampler pads every rank's share
to the same length (test_sampler.py), so every rank has the same number of batches.
"""
import os
import time

import numpy as np
import pytest

import ranks

import pycyxwiz as cx

D = cx.distributed

IN, HID, OUT, B = 12, 16, 4, 5


def make_model(seed, batchnorm=False):
    m = cx.SequentialModel()
    m.add(cx.LinearModule(IN, HID, seed=seed))
    if batchnorm:
        m.add(cx.BatchNormModule(HID))
    m.add(cx.ReLUModule())
    m.add(cx.LinearModule(HID, OUT, seed=seed + 1))
    return m


def batches_of(rank, count):
    """Rank `rank`'s batches: the same on every process that asks."""
    rng = np.random.default_rng(100 + rank)
    return [(rng.standard_normal((B, IN)).astype(np.float32), rng.integers(0, OUT, B).astype(np.int64))
            for _ in range(count)]


def counts_for(world, base, extra):
    return [base + extra if r == 0 else base for r in range(world)]


def joined_loop(base, extra, use_function, batchnorm):
    r, p = D.get_rank(), D.get_world_size()
    model = make_model(1 + 10 * r, batchnorm)          # different weights: construction broadcasts rank 0's
    ddp = D.DistributedDataParallel(model)
    opt = cx.SGDOptimizer(0.1, momentum=0.9)
    loss_fn = cx.CrossEntropyLoss()
    ctx = D.join(ddp) if use_function else ddp.join()
    with ctx:
        for X, y in batches_of(r, counts_for(p, base, extra)[r]):
            out = ddp.forward(X)
            loss_fn.forward(out, y)
            ddp.backward(loss_fn.backward(), input_grad=False)
            ddp.update_parameters(opt)
    bufs = [model[1].running_mean.copy(), model[1].running_var.copy()] if batchnorm else []
    return model.flat_parameters().copy(), bufs, ddp.joining


def reference_for(counts):
    """One process: each step averages the gradients of the ranks that still have a batch (rank r has
    counts[r] batches)."""
    model = make_model(1)
    opt = cx.SGDOptimizer(0.1, momentum=0.9)
    loss_fn = cx.CrossEntropyLoss()
    data = [batches_of(r, n) for r, n in enumerate(counts)]
    for s in range(max(counts)):
        grads = []
        for r in range(len(counts)):
            if s < counts[r]:
                model.zero_grad()
                X, y = data[r][s]
                loss_fn.forward(model.forward(X), y)
                model.backward(loss_fn.backward())
                grads.append(model.flat_gradients().astype(np.float64).copy())
        model.flat_gradients()[:] = (np.sum(grads, axis=0) / len(grads)).astype(np.float32)
        opt.step(model)
    return model.flat_parameters().copy()


def reference(world, base, extra):
    return reference_for(counts_for(world, base, extra))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("use_function", [False, True])
def test_a_rank_with_3_extra_batches_finishes_with_the_reference_parameters_on_every_rank(world, use_function):
    base, extra = 4, 3
    want = ranks.run(reference, 1, args=(world, base, extra))[0]
    res = ranks.run(joined_loop, world, args=(base, extra, use_function, False))
    for params, _, joining in res:
        np.testing.assert_allclose(params, want, rtol=2e-5, atol=2e-6)
        assert np.array_equal(params, res[0][0])
        assert joining is False


def test_even_inputs_under_join_equal_plain_ddp_steps():
    want = ranks.run(reference, 1, args=(2, 3, 0))[0]
    for params, _, _ in ranks.run(joined_loop, 2, args=(3, 0, False, False)):
        np.testing.assert_allclose(params, want, rtol=2e-5, atol=2e-6)


def test_the_last_rank_may_be_the_one_with_more_batches():
    # The extra batches on rank 0 made rank 0 the last active one; here the early joiner is rank 0.
    want = ranks.run(reference_reversed, 1)[0]
    res = ranks.run(joined_loop_reversed, 3)
    for params in res:
        np.testing.assert_allclose(params, want, rtol=2e-5, atol=2e-6)


REV_COUNTS = [1, 4, 2]


def joined_loop_reversed():
    r = D.get_rank()
    model = make_model(1 + 10 * r)
    ddp = D.DistributedDataParallel(model)
    opt = cx.SGDOptimizer(0.1, momentum=0.9)
    loss_fn = cx.CrossEntropyLoss()
    with ddp.join():
        for X, y in batches_of(r, REV_COUNTS[r]):
            loss_fn.forward(ddp.forward(X), y)
            ddp.backward(loss_fn.backward(), input_grad=False)
            ddp.update_parameters(opt)
    return model.flat_parameters().copy()


def reference_reversed():
    return reference_for(REV_COUNTS)


ACC_COUNTS = [5, 3]   # optimizer steps per rank, two micro-batches each


def joined_accumulation():
    r = D.get_rank()
    model = make_model(1 + 10 * r)
    ddp = D.DistributedDataParallel(model)
    opt = cx.AdamOptimizer(0.01)
    loss_fn = cx.CrossEntropyLoss()
    data = batches_of(r, 2 * ACC_COUNTS[r])
    with ddp.join():
        for s in range(ACC_COUNTS[r]):
            with ddp.no_sync():
                loss_fn.forward(ddp.forward(data[2 * s][0]), data[2 * s][1])
                ddp.backward(loss_fn.backward(0.5), input_grad=False)
            loss_fn.forward(ddp.forward(data[2 * s + 1][0]), data[2 * s + 1][1])
            ddp.backward(loss_fn.backward(0.5), input_grad=False)
            ddp.update_parameters(opt)
    return model.flat_parameters().copy()


def reference_accumulation():
    model = make_model(1)
    opt = cx.AdamOptimizer(0.01)
    loss_fn = cx.CrossEntropyLoss()
    data = [batches_of(r, 2 * ACC_COUNTS[r]) for r in range(2)]
    for s in range(max(ACC_COUNTS)):
        grads = []
        for r in range(2):
            if s < ACC_COUNTS[r]:
                model.zero_grad()
                for X, y in data[r][2 * s:2 * s + 2]:
                    loss_fn.forward(model.forward(X), y)
                    model.backward(loss_fn.backward(0.5))
                grads.append(model.flat_gradients().astype(np.float64).copy())
        model.flat_gradients()[:] = (np.sum(grads, axis=0) / len(grads)).astype(np.float32)
        opt.step(model)
    return model.flat_parameters().copy()


def test_no_sync_accumulation_under_join_averages_the_active_ranks_sums():
    want = ranks.run(reference_accumulation, 1)[0]
    for params in ranks.run(joined_accumulation, 2):
        np.testing.assert_allclose(params, want, rtol=2e-5, atol=2e-6)


def test_batchnorm_buffers_are_broadcast_without_deadlock_and_agree_at_the_end():
    res = ranks.run(joined_loop, 3, args=(3, 3, False, True), timeout=60)
    for params, bufs, _ in res:
        assert np.array_equal(params, res[0][0])
        for b, b0 in zip(bufs, res[0][1]):
            assert np.array_equal(b, b0)


# ---- errors -----------------------------------------------------------------------------------

def join_a_model():
    D.join(make_model(0))


def test_join_without_ddp_says_to_wrap_the_model():
    (o,) = ranks.spawn(join_a_model, 1)
    assert not o.ok and o.exc_type == "TypeError"
    assert "expects the DistributedDataParallel" in o.message and "got SequentialModel" in o.message
    assert "ddp = cx.distributed.DistributedDataParallel(model)" in o.message


def join_with_zero():
    ddp = D.DistributedDataParallel(make_model(0))
    zero = D.ZeroRedundancyOptimizer(ddp, cx.SGDOptimizer(0.1))
    with ddp.join():
        zero.step()


def test_join_with_a_zero_redundancy_optimizer_is_refused():
    for o in ranks.spawn(join_with_zero, 2):
        assert not o.ok and o.exc_type == "ValueError"
        assert f"join (rank {o.rank})" in o.message and "sharded by a ZeroRedundancyOptimizer" in o.message


def join_with_syncbn():
    m = cx.SequentialModel()
    m.add(cx.LinearModule(IN, HID, seed=0))
    m.add(cx.SyncBatchNormModule(HID))
    with D.DistributedDataParallel(m).join():
        pass


def test_join_with_syncbatchnorm_is_refused():
    for o in ranks.spawn(join_with_syncbn, 2):
        assert not o.ok and o.exc_type == "ValueError"
        assert "layer 1 is a SyncBatchNorm" in o.message and "use BatchNorm under join()" in o.message


def mismatched_steps():
    r = D.get_rank()
    model = make_model(0, batchnorm=True)
    ddp = D.DistributedDataParallel(model)
    loss_fn = cx.CrossEntropyLoss()
    X, y = batches_of(0, 1)[0]
    with ddp.join():
        if r == 0:                       # rank 0 steps; rank 1 goes straight to its next forward
            loss_fn.forward(ddp.forward(X), y)
            ddp.backward(loss_fn.backward(), input_grad=False)
            ddp.sync_gradients()
        else:
            loss_fn.forward(ddp.forward(X), y)
            ddp.forward(X)


def test_ranks_that_reach_different_collectives_under_join_fail_with_a_clear_error():
    for o in ranks.spawn(mismatched_steps, 2, timeout=60):
        assert not o.ok and o.is_a("CollectiveMismatchError"), (o.exc_type, o.message)
        assert f"join (rank {o.rank})" in o.message and "reached different collectives" in o.message


def raises_inside_join():
    r = D.get_rank()
    ddp = D.DistributedDataParallel(make_model(0))
    opt = cx.SGDOptimizer(0.1)
    loss_fn = cx.CrossEntropyLoss()
    t0 = time.monotonic()
    try:
        with ddp.join():
            for i, (X, y) in enumerate(batches_of(r, 5)):
                if r == 1 and i == 2:
                    raise ValueError("bad batch 2 on rank 1")
                loss_fn.forward(ddp.forward(X), y)
                ddp.backward(loss_fn.backward(), input_grad=False)
                ddp.update_parameters(opt)
    finally:
        elapsed = time.monotonic() - t0
        open(f"{os.environ['CX_TEST_DIR']}/elapsed{r}", "w").write(str(elapsed))


def test_an_exception_inside_join_fails_every_rank_at_once_naming_it(tmp_path):
    """The raising rank's exception propagates; its peer, shadowing or waiting in a collective, raises
    "rank 1 failed: ValueError: ..." within a second instead of waiting for the operation deadline."""
    outs = ranks.spawn(raises_inside_join, 2, timeout=60,
                       env={"CX_TEST_DIR": str(tmp_path), "DISTRIBUTED_OPERATION_TIMEOUT_MS": "60000"})
    by_rank = {o.rank: o for o in outs}
    assert by_rank[1].is_a("ValueError") and "bad batch 2 on rank 1" in by_rank[1].message
    assert by_rank[0].is_a("DistributedConnectionError"), (by_rank[0].exc_type, by_rank[0].message)
    assert "rank 1 failed: ValueError: bad batch 2 on rank 1" in by_rank[0].message
    assert float((tmp_path / "elapsed0").read_text()) < 5.0
