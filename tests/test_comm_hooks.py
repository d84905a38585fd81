"""Communication hooks of DistributedDataParallel (DDPConfig.comm_hook, register_comm_hook):
fp16/bf16 give the float32 average within the type's rounding, PowerSGD at full rank gives plain
DDP's average, PowerSGD at rank 1-4 trains the digits MLP as well as plain DDP (held-out accuracy
within 1%), its error-feedback state survives a checkpoint, and misuse is named. Real ranks over
127.0.0.1; references computed here in NumPy from every rank's local gradient.
"""
import numpy as np
import pytest

import digits
import ranks
import refs

import pycyxwiz as cx

D = cx.distributed

IN, HID, OUT = 20, 48, 5

# Unit roundoff (half an ulp at 1, relative) of each 16-bit type, and half its smallest subnormal.
UNIT = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
TINY = {"fp16": 2.0 ** -25, "bf16": 0.0}  # bfloat16 has float32's range: nothing that small here
NP16 = {"fp16": np.float16}


def make_model(seed, sizes=(IN, HID, HID, OUT)):
    # tests/ranks.py sets OPENBLAS_NUM_THREADS=1 after this module (and so OpenBLAS) was loaded in the
    # rank's process, too late; two ranks each running two BLAS threads on two busy cores crawl.
    cx.set_num_threads(1)
    m = cx.SequentialModel()
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        if i:
            m.add(cx.TanhModule())
        m.add(cx.LinearModule(a, b, seed=seed + 100 * i))
    return m


def data(total, features=IN, classes=OUT, seed=5):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((total, features)).astype(np.float32)
    y = rng.integers(0, classes, total).astype(np.int64)
    return X, y


def local_and_synced(hook, options, steps, accum=1, sizes=(IN, HID, HID, OUT), bucket_mb=1e-3):
    """Per rank, for each of `steps` SGD steps: this rank's own gradient (computed by the model alone,
    nothing reduced), the gradient DDP left after sync, and the bucket reductions launched. With accum > 1
    the first accum-1 micro-batches run under no_sync()."""
    r, p = D.get_rank(), D.get_world_size()
    model = make_model(3, sizes)
    cfg = D.DDPConfig()
    cfg.bucket_size_mb = bucket_mb
    cfg.first_bucket_mb = min(bucket_mb, 1.0)
    cfg.comm_hook = hook
    for k, v in options.items():
        setattr(cfg.powersgd, k, v)
    ddp = D.DistributedDataParallel(model, cfg)
    loss_fn = cx.CrossEntropyLoss()
    opt = cx.SGDOptimizer(0.05)
    b = 8
    X, y = data(steps * accum * p * b, sizes[0], sizes[-1], seed=11)
    out = []
    for s in range(steps):
        micro = []
        for a in range(accum):
            lo = ((s * accum + a) * p + r) * b
            micro.append((X[lo:lo + b], y[lo:lo + b]))
        model.zero_grad()
        for x, t in micro:  # the local gradient: the model alone, no DDP call
            loss_fn.forward(model.forward(x), t)
            model.backward(loss_fn.backward(), input_grad=False)
        local = model.flat_gradients().copy()
        model.zero_grad()
        before = ddp.allreduce_count
        for i, (x, t) in enumerate(micro):
            loss_fn.forward(ddp.forward(x), t)
            if i < accum - 1:
                with ddp.no_sync():
                    ddp.backward(loss_fn.backward(), input_grad=False)
            else:
                ddp.backward(loss_fn.backward(), input_grad=False)
        synced = ddp.sync_gradients()
        ddp.update_parameters(opt)
        out.append((local, synced, ddp.allreduce_count - before))
    return out, len(ddp.buckets), ddp._comm_hook_state()


def gathered(res, step):
    """(every rank's local gradient stacked, every rank's synced gradient) at one step."""
    return np.stack([r[0][step][0] for r in res]), [r[0][step][1] for r in res]


def half_bound(hook, locals_):
    """Per element: how far the fp16/bf16 hook's result may be from the float32 mean.

    The hook sends y_r = fl16(g_r / N) and the ranks add them in the 16-bit type, rounding after each of
    the N-1 additions, in whatever order the algorithm takes. Each cast errs by at most u|g_r/N| (plus
    half the smallest subnormal for fp16), each addition by at most u times the partial sum, which is at
    most sum_r |y_r|; so |result - mean| <= u*mean|g| + (N-1)*u*mean|g|*(1+u)^N + N*tiny. (N+1)*u*mean|g|
    + (N+1)*tiny covers it, with room for the float32 rounding of g_r * (1/N).
    """
    n = locals_.shape[0]
    mean_abs = np.mean(np.abs(locals_.astype(np.float64)), axis=0)
    return (n + 1) * UNIT[hook] * mean_abs + (n + 1) * TINY[hook]


def representable(x, hook):
    """x (float32) holds only values of the 16-bit type: the hook's cast back is a widening."""
    if hook == "fp16":
        return np.array_equal(x.astype(np.float16).astype(np.float32), x)
    bits = x.view(np.uint32)
    return bool(np.all(bits & 0xFFFF == 0))


# ---- fp16 / bf16 ------------------------------------------------------------------------------

@pytest.mark.parametrize("hook", ["fp16", "bf16"])
@pytest.mark.parametrize("world", [2, 3])
def test_half_precision_hooks_equal_the_float32_average_within_the_type_s_rounding(world, hook):
    res = ranks.run(local_and_synced, world, args=(hook, {}, 2))
    nb = res[0][1]
    for step in range(2):
        locals_, synced = gathered(res, step)
        want = np.mean(locals_.astype(np.float64), axis=0)
        bound = half_bound(hook, locals_)
        for s in synced:
            assert np.array_equal(s, synced[0])                  # every rank gets the same bits
            assert representable(s, hook)                         # the result went through the 16-bit type
            assert np.all(np.abs(s - want) <= bound), np.max(np.abs(s - want) - bound)
        # and it is not simply the float32 average: the rounding is visible
        assert np.max(np.abs(synced[0] - want)) > 0
    assert all(c == nb for r in res for (_, _, c) in r[0])         # one reduction per bucket per step


def narrow16(x, hook):
    """float32 -> the 16-bit type's bits (uint16), round to nearest even (NumPy's float16 cast;
    refs.bf16_round)."""
    return x.astype(np.float16).view(np.uint16) if hook == "fp16" else refs.bf16_round(x)


def widen16(u, hook):
    return u.view(np.float16).astype(np.float32) if hook == "fp16" else refs.bf16_to_f32(u)


def by_three_passes(local, buckets, hook):
    """What the hook must give, done by hand: this rank's gradient times 1/N narrowed here in NumPy, a
    plain 16-bit all_reduce per bucket, widened here."""
    scale = np.float32(1.0 / D.get_world_size())
    out = np.empty_like(local)
    for _, _, off, n in buckets:
        wire = narrow16(local[off:off + n] * scale, hook)
        if hook == "fp16":
            D.all_reduce(wire.view(np.float16))
        else:
            D.all_reduce(wire, dtype="bfloat16")
        out[off:off + n] = widen16(wire, hook)
    return out


def tricky_gradient(n, hook, seed):
    """Finite float32 values of every exponent the type can carry (for float16 down to its subnormals),
    a quarter of them exactly halfway between two 16-bit values or one float32 ulp either side."""
    rng = np.random.default_rng(seed)
    lo, hi = (-30, 14) if hook == "fp16" else (-120, 120)
    g = (rng.uniform(1, 2, n) * 2.0 ** rng.integers(lo, hi, n) * rng.choice([-1, 1], n)).astype(np.float32)
    bits = g.view(np.uint32)
    low = 0x8000 if hook == "bf16" else 0x1000  # the halfway point of the bits the cast drops (normal range)
    k = rng.random(n) < 0.25
    bits[k] = (bits[k] & ~np.uint32(0xFFFF if hook == "bf16" else 0x1FFF)) | (low + rng.integers(-1, 2, k.sum()))
    return g


def hook_and_three_passes(hook):
    """The hook's result on the model's own gradients, and by_three_passes of them."""
    res, _, _ = local_and_synced(hook, {}, 1, sizes=(IN, 96, 96, OUT), bucket_mb=0.02)
    local, synced, _ = res[0]
    cfg = D.DDPConfig()  # a DDP only for its buckets: the same sizes as the hook's
    cfg.bucket_size_mb, cfg.first_bucket_mb = 0.02, 0.02
    buckets = D.DistributedDataParallel(make_model(3, (IN, 96, 96, OUT)), cfg).buckets
    return local, synced, by_three_passes(local, buckets, hook), len(buckets)


def crafted_hook_and_three_passes(hook, n=3001):
    """The same with gradients chosen here: a Linear(1, n) fed x = 1 and handed dL/dout = g has weight
    and bias gradients g, so the hook carries tricky_gradient's values."""
    model = cx.SequentialModel()
    model.add(cx.LinearModule(1, n, seed=1))
    cfg = D.DDPConfig()
    cfg.comm_hook = hook
    ddp = D.DistributedDataParallel(model, cfg)
    g = tricky_gradient(n, hook, seed=D.get_rank())
    ddp.forward(np.ones((1, 1), np.float32))
    ddp.backward(g[None, :], input_grad=False)
    synced = ddp.sync_gradients().copy()
    local = np.concatenate([g, g])
    return local, synced, by_three_passes(local, ddp.buckets, hook), len(ddp.buckets)


SIZES_16 = (7, 1003, 65541)


def sum_random_bits(hook):
    out = []
    for n in SIZES_16:
        bits = np.random.default_rng([D.get_rank(), n]).integers(0, 1 << 16, n, dtype=np.uint16)
        x = bits.copy()
        if hook == "fp16":
            D.all_reduce(x.view(np.float16))
        else:
            D.all_reduce(x, dtype="bfloat16")
        out.append((bits, x))
    return out


@pytest.mark.parametrize("hook", ["fp16", "bf16"])
def test_16_bit_sums_round_every_bit_pattern_like_numpy(hook):
    # Every class of value (zeros, subnormals, normals, infinities, NaNs) from random bit patterns; sizes
    # that leave tails after the 8-lane loops; two ranks, so each result is one float32 addition rounded.
    r0, r1 = ranks.run(sum_random_bits, 2, args=(hook,))
    for n, (a, got), (b, _) in zip(SIZES_16, r0, r1):
        with np.errstate(invalid="ignore", over="ignore"):
            total = widen16(a, hook) + widen16(b, hook)
            want = narrow16(total, hook)
        nan = np.isnan(total)
        assert n < 65536 or (nan.any() and np.isinf(widen16(want, hook)).any())
        assert np.all(np.isnan(widen16(got, hook)[nan]))
        assert np.array_equal(got[~nan], want[~nan]), np.flatnonzero(got[~nan] != want[~nan])[:5]


@pytest.mark.parametrize("hook", ["fp16", "bf16"])
@pytest.mark.parametrize("world,shm", [(2, "0"), (3, "0"), (4, "1")])
def test_the_casts_ride_in_the_ring_with_the_bits_of_three_passes(world, shm, hook):
    # Every bucket through the ring (no small-message algorithm), cut into chunks of 1000 bytes: 500
    # elements, not a multiple of the kernels' 8 lanes, so every vector loop has a tail.
    env = {"CX_SMALL_ALLREDUCE_BYTES": 0, "CX_HD_MAX_BYTES": 0, "CX_CHUNK_BYTES": 1000, "CX_SHM": shm}
    for fn in (hook_and_three_passes, crafted_hook_and_three_passes):
        res = ranks.run(fn, world, args=(hook,), env=env)
        locals_ = np.stack([r[0] for r in res])
        want = np.mean(locals_.astype(np.float64), axis=0)
        assert fn is crafted_hook_and_three_passes or res[0][3] >= 2
        for _, synced, by_hand, _ in res:
            assert np.array_equal(synced.view(np.uint32), by_hand.view(np.uint32))  # bit for bit
            assert np.array_equal(synced.view(np.uint32), res[0][1].view(np.uint32))  # and on every rank
            assert np.all(np.abs(synced - want) <= half_bound(hook, locals_))


@pytest.mark.parametrize("hook", ["fp16", "bf16"])
def test_half_precision_hooks_under_no_sync_reduce_the_accumulated_sum_once(hook):
    res = ranks.run(local_and_synced, 2, args=(hook, {}, 2, 3))
    nb = res[0][1]
    for step in range(2):
        locals_, synced = gathered(res, step)  # locals: the sum over the 3 micro-batches of each rank
        want = np.mean(locals_.astype(np.float64), axis=0)
        for s in synced:
            assert np.all(np.abs(s - want) <= half_bound(hook, locals_))
    assert all(c == nb for r in res for (_, _, c) in r[0])


def test_fp16_divides_before_summing_so_large_gradients_do_not_overflow():
    # Gradients near float16's maximum (65504): their SUM over ranks would overflow, their average does not.
    res = ranks.run(big_gradients_fp16, 2)
    for got, want in res:
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, rtol=3 * UNIT["fp16"])


def big_gradients_fp16():
    r = D.get_rank()
    model = make_model(3, (4, 3))
    cfg = D.DDPConfig()
    cfg.comm_hook = "fp16"
    ddp = D.DistributedDataParallel(model, cfg)
    x = np.full((1, 4), 1.0, np.float32)
    ddp.forward(x)
    g = np.full((1, 3), 60000.0 if r == 0 else 50000.0, np.float32)  # dL/dout: weight grads 6e4 and 5e4
    ddp.backward(g, input_grad=False)
    return ddp.sync_gradients().copy(), np.full(15, 55000.0, np.float32)


# ---- PowerSGD -------------------------------------------------------------------------------

FULL = {"matrix_approximation_rank": 1000, "start_powerSGD_iter": 0, "min_compression_rate": 0.0}


@pytest.mark.parametrize("world", [2, 3])
def test_powersgd_at_full_rank_equals_plain_ddp_s_average(world):
    # rank 1000 is clipped to min(n, m) for every matrix; min_compression_rate 0 compresses every one.
    res = ranks.run(local_and_synced, world, args=("powersgd", FULL, 3))
    for step in range(3):
        locals_, synced = gathered(res, step)
        want = np.mean(locals_.astype(np.float64), axis=0)
        # float32 rounding of GEMMs of depth <= 48 over the step's gradients and the residuals
        scale = np.max(np.abs(want))
        for s in synced:
            assert np.array_equal(s, synced[0])
            np.testing.assert_allclose(s, want, rtol=1e-4, atol=2e-5 * scale)
    it, q, err = res[0][2]
    assert it == 3 and q.size == IN * IN + HID * HID + HID * OUT  # every matrix compressed; Q is m x min(n, m)


def test_powersgd_at_rank_1_approximates_and_keeps_the_residual():
    opts = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 0}
    res = ranks.run(local_and_synced, 2, args=("powersgd", opts, 2))
    locals_, synced = gathered(res, 0)
    want = np.mean(locals_.astype(np.float64), axis=0)
    assert np.max(np.abs(synced[0] - want)) > 1e-3 * np.max(np.abs(want))  # really compressed
    _, _, err0 = res[0][2]
    _, _, err1 = res[1][2]
    assert err0.size == HID * HID + IN * HID + HID * OUT and np.any(err0 != 0) and not np.array_equal(err0, err1)


def test_powersgd_before_start_iter_is_plain_ddp():
    opts = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}
    res = ranks.run(local_and_synced, 2, args=("powersgd", opts, 3))
    for step, exact in ((0, True), (1, True), (2, False)):
        locals_, synced = gathered(res, step)
        want = np.mean(locals_.astype(np.float64), axis=0)
        close = np.allclose(synced[0], want, rtol=1e-5, atol=1e-7)
        assert close == exact, step


def test_powersgd_full_rank_under_no_sync_equals_the_accumulated_average():
    res = ranks.run(local_and_synced, 2, args=("powersgd", FULL, 2, 3))
    nb = res[0][1]
    for step in range(2):
        locals_, synced = gathered(res, step)
        want = np.mean(locals_.astype(np.float64), axis=0)
        np.testing.assert_allclose(synced[0], want, rtol=1e-4, atol=2e-5 * np.max(np.abs(want)))
    assert all(c == nb for r in res for (_, _, c) in r[0])  # inner micro-batches send nothing


def digits_accuracies(configs, epochs):
    """Held-out accuracy of the digits MLP (as examples/train_digits.py) for each (hook, options)."""
    Xtr, ytr, Xte, yte = digits.split()
    out = []
    for hook, opts in configs:
        cx.manual_seed(0)
        cx.set_num_threads(1)  # as in make_model
        model = cx.SequentialModel()
        model.add(cx.LinearModule(64, 128))
        model.add(cx.ReLUModule())
        model.add(cx.LinearModule(128, 128))
        model.add(cx.ReLUModule())
        model.add(cx.LinearModule(128, 10))
        cfg = D.DDPConfig()
        cfg.comm_hook = hook
        for k, v in opts.items():
            setattr(cfg.powersgd, k, v)
        trainer = D.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.AdamOptimizer(2e-3), cfg)
        config = D.DistributedTrainingConfig(epochs=epochs, batch_size=32, seed=42, verbose=False)
        trainer.fit(Xtr, ytr, config)
        out.append(trainer.evaluate(Xte, yte)[1])
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_powersgd_rank_1_to_4_trains_digits_within_1pct_of_plain_ddp(world):
    configs = [("none", {})] + [("powersgd", {"matrix_approximation_rank": r, "start_powerSGD_iter": 10})
                                for r in (1, 2, 3, 4)]
    res = ranks.run(digits_accuracies, world, args=(configs, 20), timeout=240)
    assert all(r == res[0] for r in res)  # evaluate is global: the same answer on every rank
    plain, *compressed = res[0]
    assert plain > 0.9
    for rank, acc in zip((1, 2, 3, 4), compressed):
        assert acc >= plain - 0.01, (rank, acc, plain)


def resume_body(tmp, hook_opts, zero_residuals):
    """Trains 2 epochs straight (checkpointing after each), then again from the epoch-1 checkpoint."""
    import os

    def trainer():
        cx.manual_seed(0)
        model = make_model(7, (IN, 32, 32, OUT))
        cfg = D.DDPConfig()
        cfg.comm_hook = "powersgd"
        for k, v in hook_opts.items():
            setattr(cfg.powersgd, k, v)
        return D.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.SGDOptimizer(0.05, momentum=0.9), cfg)

    X, y = data(256, seed=3)
    config = D.DistributedTrainingConfig(epochs=2, batch_size=16, verbose=False, checkpoint_every_n_epochs=1,
                                         checkpoint_dir=os.path.join(tmp, "a"), check_every_n_steps=0)
    t = trainer()
    t.fit(X, y, config)
    straight = t.model.flat_parameters().copy()
    state = t.ddp._comm_hook_state()
    ckpt = os.path.join(tmp, "a", "epoch_0001.ckpt")
    if zero_residuals and D.get_rank() == 0:
        from pycyxwiz.distributed import _ckpt_file     # rewritten as a valid file, residuals zeroed
        with open(ckpt, "rb") as f:
            arrays = _ckpt_file.unpack(f.read(), ckpt)
        arrays["hook.error"] = np.zeros_like(arrays["hook.error"])
        with open(ckpt, "wb") as f:
            f.write(_ckpt_file.pack(arrays))
    D.barrier()
    t2 = trainer()
    config.checkpoint_dir = os.path.join(tmp, "b")
    t2.fit(X, y, config, resume_from=ckpt)
    with np.load(ckpt) as z:
        saved_err = z["hook.error"].copy()
    return straight, t2.model.flat_parameters().copy(), state, saved_err


def test_powersgd_error_feedback_survives_a_checkpoint(tmp_path):
    opts = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 3}
    res = ranks.run(resume_body, 2, args=(str(tmp_path), opts, False))
    for r, (straight, resumed, state, saved_err) in enumerate(res):
        assert np.array_equal(resumed, straight)            # the resumed run is the uninterrupted one
        assert saved_err.shape[0] == 2 and np.any(saved_err[r] != 0)  # each rank's own residuals were saved
        assert not np.array_equal(saved_err[0], saved_err[1])
        assert state[0] == 16                                 # 8 steps per epoch per rank, 2 epochs


def test_resuming_without_the_residuals_gives_another_run(tmp_path):
    # The control of the test above: the residuals matter, so restoring them is what makes it exact.
    opts = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 3}
    res = ranks.run(resume_body, 2, args=(str(tmp_path), opts, True))
    straight, resumed, _, _ = res[0]
    assert not np.array_equal(resumed, straight)


# ---- misuse ---------------------------------------------------------------------------------

def misuse(case):
    model = make_model(3)
    cfg = D.DDPConfig()
    if case == "config_name":
        cfg.comm_hook = "fp8"
        D.DistributedDataParallel(model, cfg)
    elif case == "config_type":
        cfg.comm_hook = 16
    elif case == "config_rank":
        cfg.comm_hook = "powersgd"
        cfg.powersgd.matrix_approximation_rank = 0
        D.DistributedDataParallel(model, cfg)
    elif case == "register_name":
        D.DistributedDataParallel(model, cfg).register_comm_hook("int8")
    elif case == "register_rank":
        D.DistributedDataParallel(model, cfg).register_comm_hook("powersgd", matrix_approximation_rank=-2)
    elif case == "register_start":
        D.DistributedDataParallel(model, cfg).register_comm_hook("powersgd", start_powerSGD_iter=-1)
    elif case == "register_rate":
        D.DistributedDataParallel(model, cfg).register_comm_hook("powersgd", min_compression_rate=-1.0)
    elif case == "register_mid_step":
        ddp = D.DistributedDataParallel(model, cfg)
        X, _ = data(4)
        ddp.forward(X)
        with ddp.no_sync():
            ddp.backward(np.ones((4, OUT), np.float32), input_grad=False)
        ddp.register_comm_hook("bf16")
    elif case == "state_size":
        cfg.comm_hook = "powersgd"
        ddp = D.DistributedDataParallel(model, cfg)
        ddp._set_comm_hook_state(0, np.zeros(3, np.float32), np.zeros(0, np.float32))
    elif case == "state_without_hook":
        D.DistributedDataParallel(model, cfg)._set_comm_hook_state(0, np.zeros(3, np.float32),
                                                                  np.zeros(0, np.float32))
    return None


@pytest.mark.parametrize("case, exc, words", [
    ("config_name", "ValueError", ["DDPConfig.comm_hook", "unknown communication hook 'fp8'", "'bf16'",
                                   "'powersgd'", "rank 0"]),
    ("config_type", "TypeError", ["DDPConfig.comm_hook must be a str", "got int"]),
    ("config_rank", "ValueError", ["matrix_approximation_rank must be >= 1", "got 0", "rank 0"]),
    ("register_name", "ValueError", ["register_comm_hook", "unknown communication hook 'int8'", "'fp16'"]),
    ("register_rank", "ValueError", ["register_comm_hook", "matrix_approximation_rank must be >= 1", "got -2"]),
    ("register_start", "ValueError", ["start_powerSGD_iter must be >= 0", "got -1"]),
    ("register_rate", "ValueError", ["min_compression_rate must be a finite number >= 0", "got -1"]),
    ("register_mid_step", "ValueError", ["1 backward(s) are waiting to be reduced", "between steps"]),
    ("state_size", "ValueError", ["3 values of Q", "same PowerSGD options"]),
    ("state_without_hook", "ValueError", ["PowerSGD state given but the comm hook is 'none'"]),
])
def test_misuse_is_named(case, exc, words):
    (o,) = ranks.spawn(misuse, 1, args=(case,))
    assert not o.ok and o.is_a(exc), (o.exc_type, o.message)
    for w in words:
        assert w in o.message, (w, o.message)


def config_repr():
    cfg = D.DDPConfig()
    assert cfg.comm_hook == "none" and "comm_hook='none'" in repr(cfg)
    cfg.comm_hook = None
    assert cfg.comm_hook == "none"
    cfg.comm_hook = "PowerSGD"
    ddp = D.DistributedDataParallel(make_model(3), cfg)
    assert ddp.comm_hook == "powersgd" and ddp.config.powersgd.start_powerSGD_iter == 1000
    ddp.register_comm_hook("bf16")
    assert ddp.comm_hook == "bf16" and "comm_hook='bf16'" in repr(ddp.config)
    return repr(D.PowerSGDConfig())


def test_hook_names_are_normalised_and_shown():
    (o,) = ranks.spawn(config_repr, 1)
    assert o.ok, o.trace
    assert o.value == ("PowerSGDConfig(matrix_approximation_rank=1, start_powerSGD_iter=1000, "
                       "min_compression_rate=2, use_error_feedback=True, warm_start=True, seed=0)")
