"""A failing rank tells its peers why, at once; ranks that call different collectives are caught;
every failure says what each rank was last doing.

Each test body runs in every rank (tests/ranks.py). Where a bound on the time to an error is
asserted, it is a correctness bound far below the configured deadline (errors within seconds,
not after the 60 s operation timeout), not a speed measurement.
"""
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import ranks
import pycyxwiz as cx

D = cx.distributed
LONG = {"DISTRIBUTED_TIMEOUT_MS": 60000, "DISTRIBUTED_OPERATION_TIMEOUT_MS": 60000}


def timed(fn):
    t0 = time.monotonic()
    try:
        fn()
        return ("no error", "", "", time.monotonic() - t0)
    except Exception as e:
        return (type(e).__name__, [c.__name__ for c in type(e).__mro__], str(e), time.monotonic() - t0)


# ---- a failing rank tells its peers why ---------------------------------------------------

def fit_fails_on_rank_2_which_stays_alive():
    X, y = cx.datasets.load_digits()
    model = cx.SequentialModel()
    model.add(cx.LinearModule(64, 10, seed=0))
    trainer = D.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.SGDOptimizer(0.1))
    config = D.DistributedTrainingConfig(epochs=50, batch_size=16, verbose=False, seed=1)
    if D.get_rank() == 2:
        try:
            trainer.fit(X, y, X[:10], None, config)  # ValueError: pass both X_val and y_val, or neither
        except ValueError as e:
            time.sleep(12)  # the process stays alive: its peers must not wait for it to exit
            return ("raised", str(e))
    return timed(lambda: trainer.fit(X, y, config))


def test_peers_of_a_rank_whose_fit_raises_name_its_exception_at_once():
    outs = ranks.run(fit_fails_on_rank_2_which_stays_alive, 3, env=LONG, timeout=90)
    assert outs[2] == ("raised", "fit: pass both X_val and y_val, or neither")
    for name, bases, msg, elapsed in outs[:2]:
        assert name == "DistributedConnectionError" and "ConnectionError" in bases, (name, msg)
        assert "rank 2 failed: ValueError: fit: pass both X_val and y_val, or neither" in msg, msg
        assert "stuck" not in msg and "timed out" not in msg, msg
        assert elapsed < 10, elapsed  # not the 60 s operation deadline


SCRIPT = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    import pycyxwiz as cx
    D = cx.distributed
    D.init()
    x = np.ones(1000, np.float32)
    D.all_reduce(x)
    if D.get_rank() == 1:
        raise ValueError("batch 7 has NaN labels")   # escapes the script
    t0 = time.monotonic()
    try:
        for _ in range(100000):
            D.all_reduce(x)
        out = {"type": "no error"}
    except Exception as e:
        out = {"type": type(e).__name__, "msg": str(e)}
    out["elapsed"] = time.monotonic() - t0
    print(json.dumps(out), flush=True)
""")


def test_an_exception_escaping_the_script_reaches_every_peer_with_its_cause(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    port = ranks.free_port()
    procs = []
    for r in range(3):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="3", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OPENBLAS_NUM_THREADS="1", **{k: str(v) for k, v in LONG.items()})
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = [p.communicate(timeout=60) for p in procs]
    assert procs[1].returncode != 0 and "ValueError: batch 7 has NaN labels" in results[1][1]
    for r in (0, 2):
        out = json.loads(results[r][0].strip().splitlines()[-1])
        assert out["type"] == "DistributedConnectionError", out
        assert "rank 1 failed: ValueError: batch 7 has NaN labels" in out["msg"], out
        assert "exited, crashed or was killed" not in out["msg"], out
        assert out["elapsed"] < 10, out


def wrong_world_size_on_rank_2():
    return timed(D.init)


def test_a_rank_with_another_world_size_fails_every_rank_at_once():
    outs = ranks.spawn(wrong_world_size_on_rank_2, 3, env=LONG, per_rank_env={2: {"WORLD_SIZE": "4"}}, init=False,
                       timeout=60)
    assert all(o.ok for o in outs), outs
    for r, (name, bases, msg, elapsed) in enumerate(o.value for o in outs):
        assert "ValueError" in bases, (r, name, msg)
        assert "rank 2 was started with WORLD_SIZE=4 but rank 0 has WORLD_SIZE=3" in msg, (r, msg)
        assert elapsed < 10, (r, elapsed)


def killed_in_init():
    if os.environ["RANK"] == "2":
        # Killed while init() waits for rank 3 (never started): after it joined the store.
        threading.Timer(2.0, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    return timed(D.init)


def test_a_rank_killed_in_init_fails_every_other_rank_at_once_naming_it():
    outs = ranks.spawn(killed_in_init, 3, env=dict(LONG, WORLD_SIZE=4), init=False, timeout=60)
    assert outs[2].exc_type == "Died"
    for o in outs[:2]:
        assert o.ok, o
        name, bases, msg, elapsed = o.value
        assert "ConnectionError" in bases, (o.rank, name, msg)
        assert "rank 2 exited, crashed or was killed" in msg, (o.rank, msg)
        assert elapsed < 10, (o.rank, elapsed)


# ---- ABORT frames are data ------------------------------------------------------------------

HOSTILE = "\x1b[2J\x1b]0;owned\x07" + "A\rB\x00\x7f\u0085" * 200_000 + "\nrank 0 failed: forged"


def hostile_report():
    x = np.ones(8, np.float32)
    if D.get_rank() == 1:
        @D.abort_on_error
        def fail():
            raise ValueError(HOSTILE)
        try:
            fail()
        except ValueError:
            time.sleep(3)
            return None
    return timed(lambda: D.all_reduce(x))


def test_a_peers_report_is_shown_cut_and_without_control_characters():
    assert len(HOSTILE) > 1_000_000
    outs = ranks.run(hostile_report, 2, env=LONG, timeout=60)
    name, bases, msg, elapsed = outs[0]
    assert name == "DistributedConnectionError", (name, msg[:300])
    assert msg.startswith("rank 1 failed: ValueError: "), msg[:300]  # who failed comes from us, not the peer
    assert not any(ord(c) < 0x20 or 0x7f <= ord(c) <= 0x9f for c in msg), repr(msg[:300])
    assert len(msg.encode()) < 4000, len(msg)
    assert "more bytes not shown" in msg and "forged" not in msg, msg[-300:]
    assert elapsed < 10


# ---- divergence -----------------------------------------------------------------------------

def mismatched(kind):
    r, p = D.get_rank(), D.get_world_size()
    odd = r == p // 2  # one rank disagrees
    try:
        if kind == "count":
            D.all_reduce(np.ones(20 if odd else 10, np.float32))
        elif kind == "dtype":
            D.all_reduce(np.ones(10, np.float64 if odd else np.float32))
        elif kind == "op":
            D.all_reduce(np.ones(10, np.float32), op=D.ReduceOp.MAX if odd else D.ReduceOp.SUM)
        elif kind == "collective":
            if odd:
                D.broadcast(np.ones(10, np.float32), src=0)
            else:
                D.all_reduce(np.ones(10, np.float32))
        elif kind == "large":
            D.all_reduce(np.ones((1 << 20) + (7 if odd else 0), np.float32))
        return "no error"
    except ValueError as e:
        return type(e).__name__, str(e)


@pytest.mark.parametrize("kind", ["count", "dtype", "op", "collective", "large"])
@pytest.mark.parametrize("world", [2, 4])
def test_mismatched_collectives_raise_value_error_on_every_rank(kind, world):
    outs = ranks.run(mismatched, world, args=(kind,), env={"DISTRIBUTED_OPERATION_TIMEOUT_MS": 10000}, timeout=60)
    for name, msg in outs:
        assert name == "CollectiveMismatchError"
        assert "mismatched collectives" in msg and " called " in msg and " but rank " in msg, msg
    want = {"count": "count=20", "dtype": "float64", "op": "MAX", "collective": "broadcast",
            "large": f"count={(1 << 20) + 7}"}[kind]
    assert any(want in m for _, m in outs)


def broadcast_from_self():
    x = np.full(4, float(D.get_rank()), np.float32)
    return timed(lambda: D.broadcast(x, src=D.get_rank()))  # every rank believes it is the source


def broadcast_from_self_mid_size():
    x = np.full((256 << 10) // 4, float(D.get_rank()), np.float32)  # from the root to all where pairs copy once
    return timed(lambda: D.broadcast(x, src=D.get_rank()))


def scatter_against_gather():
    r = D.get_rank()
    out = np.zeros(2, np.float32)
    if r < 2:
        return timed(lambda: D.scatter(out, np.arange(6, dtype=np.float32).reshape(3, 2) if r == 0 else None, src=0))
    return timed(lambda: D.gather(out, None, dst=0))


def gather_to_self():
    out = [np.zeros(2, np.float32) for _ in range(D.get_world_size())]
    return timed(lambda: D.gather(np.ones(2, np.float32), out, dst=D.get_rank()))


def reduce_to_self():
    x = np.ones(4, np.float32)
    return timed(lambda: D.reduce(x, dst=D.get_rank()))


ROOT_DISAGREEMENTS = [
    (broadcast_from_self, ["broadcast(count=4, dtype=float32, root={r})"] * 3),
    (broadcast_from_self_mid_size, ["broadcast(count=65536, dtype=float32, root={r})"] * 3),
    (scatter_against_gather, ["scatter(count=2, dtype=float32, root=0)"] * 2 + ["gather(count=2, dtype=float32, root=0)"]),
    (gather_to_self, ["gather(count=2, dtype=float32, root={r})"] * 3),
    (reduce_to_self, ["reduce(count=4, dtype=float32, op=SUM, root={r})"] * 3),
]


@pytest.mark.parametrize("shm", ["1", "0"])
@pytest.mark.parametrize("body, calls, world", [(b, c, w) for b, c in ROOT_DISAGREEMENTS for w in (2, 3)
                                                if not (b is scatter_against_gather and w == 2)])  # rank 2 differs
def test_ranks_disagreeing_on_a_root_fail_at_the_call_naming_each_ranks_call(body, calls, world, shm):
    """Note [Rooted collectives agree on their root]: a broadcast or scatter whose ranks each think themselves
    the root used to return on every rank (named only at a later barrier or finalize), a gather or reduce to
    wait for the operation deadline. Now every rank raises at the call, at once, naming each rank's call;
    through shared memory and over TCP, where the empty frames that carry the check wait to ride along with the
    next frame (Note [Empty frames ride along] in tcp_channel.cpp)."""
    outs = ranks.spawn(body, world, env={**LONG, "CX_SHM": shm}, timeout=60)
    calls = [c.format(r=r) for r, c in enumerate(calls)][:world]
    if body is scatter_against_gather:
        # Rank 1 agrees with the root (rank 0) and has its block before the disagreement of ranks 0 and 2 is
        # found: its scatter succeeds, and its next call (here finalize) raises rank 0's error, naming both calls.
        o = outs[1]
        assert o.ok is False and o.exc_type == "DistributedConnectionError", o
        assert o.message.startswith("finalize() on rank 1: rank 0 failed earlier: mismatched collectives"), o.message
        assert f"rank 0 called {calls[0]}" in o.message and f"rank 2 called {calls[2]}" in o.message, o.message
        outs = [outs[0], None, outs[2]]
    for r, o in enumerate(outs):
        if o is None:
            continue
        assert o.ok, o  # the body caught the error at the call; finalize then sees a failed group and is quiet
        name, bases, msg, elapsed = o.value
        assert name == "CollectiveMismatchError" and "ValueError" in bases, (r, name, msg)
        assert "collective #1" in msg and "finalize()" not in msg, msg
        assert f"rank {r} called {calls[r]}" in msg, msg  # this rank's call, and every other call
        for q, call in enumerate(calls):
            if call != calls[r]:
                assert f"rank {q} called {call}" in msg, (q, msg)
        assert elapsed < 5, elapsed  # not the 10-minute LONG deadline




def unmatched_send():
    if D.get_rank() == 0:
        D.send(np.ones(3, np.float32), dst=1)
    return True


def test_an_unmatched_send_is_an_error_at_finalize_on_both_sides():
    outs = ranks.spawn(unmatched_send, 2, env=LONG, timeout=60)
    for o in outs:
        assert o.exc_type == "CollectiveMismatchError", o
        assert "rank 0 sent 1 message(s) to rank 1 that rank 1 never received" in o.message, o.message


def message_around_a_collective(recv_count: int):
    # Note [Messages out of order]: rank 1's all_reduce reads rank 0's message aside; its recv takes it there
    y = np.full(4, float(D.get_rank() + 1), np.float32)
    if D.get_rank() == 0:
        D.send(np.arange(5, dtype=np.float32), dst=1)
        D.all_reduce(y)
        return y.tolist()
    D.all_reduce(y)
    got = np.zeros(recv_count, np.float32)
    D.recv(got, src=0)
    return y.tolist() + got.tolist()


@pytest.mark.parametrize("shm", ["0", "1"])
def test_a_message_read_aside_by_a_collective_is_received_and_checked_like_any_other(shm):
    out = ranks.run(message_around_a_collective, 2, args=(5,), env={"CX_SHM": shm})
    assert out == [[3.0] * 4, [3.0] * 4 + [0.0, 1.0, 2.0, 3.0, 4.0]]
    # the same message received into 6 floats: a named mismatch on the receiver, the count checked in the stash
    outs = ranks.spawn(message_around_a_collective, 2, args=(6,), env=dict(LONG, CX_SHM=shm), timeout=60)
    o = outs[1]
    assert not o.ok and o.exc_type == "CollectiveMismatchError", o
    assert "send/recv(count=6" in o.message and "send/recv(count=5" in o.message, o.message


def matched_calls():
    x = np.ones(5, np.float32)
    for _ in range(3):
        D.all_reduce(x)
        D.barrier()
    if D.get_rank() == 0:
        D.send(x, dst=1)
    elif D.get_rank() == 1:
        D.recv(x, src=0)
    D.broadcast(x, src=1)
    return x.tolist()


def test_matching_calls_pass_every_check():
    outs = ranks.run(matched_calls, 3, env={"CX_CHECK_INTERVAL": "2"}, timeout=60)
    assert outs == [[27.0] * 5] * 3


# ---- flight recorder, monitored_barrier, CX_DEBUG -------------------------------------------

def timeout_with_a_sleeping_peer():
    x = np.ones(10, np.float32)
    D.all_reduce(x)
    if D.get_rank() == 1:
        time.sleep(3)
    # The late rank may still complete the all_reduce (its partner's data arrived before
    # the partner gave up); it learns of the failure in the barrier at the latest.
    return timed(lambda: (D.all_reduce(x), D.barrier()))


def test_a_timeout_says_what_each_rank_was_last_doing():
    outs = ranks.run(timeout_with_a_sleeping_peer, 2, env={"DISTRIBUTED_OPERATION_TIMEOUT_MS": 1000}, timeout=60)
    name, _, msg, _ = outs[0]
    assert name == "DistributedTimeoutError", msg
    assert "What each rank was last doing" in msg, msg
    assert "[rank 0: all_reduce(count=10, dtype=float32, op=SUM) as collective #1 done" in msg, msg
    assert "all_reduce(count=10, dtype=float32, op=SUM) as collective #2 failed" in msg, msg
    assert "[rank 1: no record" in msg, msg  # asleep in Python: not in a collective
    name1, _, msg1, _ = outs[1]
    assert name1 == "DistributedTimeoutError" and "rank 1: rank 0 aborted the group" in msg1, msg1
    assert "[rank 0: " in msg1 and "#2 failed" in msg1, msg1  # rank 0's record, read from the store


def rank_2_skips_the_barrier():
    if D.get_rank() == 2:
        time.sleep(3)
        return None
    return timed(lambda: D.monitored_barrier(timeout=1.0))


def test_monitored_barrier_names_the_rank_that_did_not_arrive():
    outs = ranks.run(rank_2_skips_the_barrier, 3, env=LONG, timeout=60)
    for name, bases, msg, elapsed in outs[:2]:
        assert name == "DistributedTimeoutError" and "TimeoutError" in bases, msg
        assert "rank(s) 2 did not arrive within 1000 ms" in msg, msg
        assert elapsed < 5


def all_arrive():
    D.monitored_barrier(timeout=10)
    x = np.ones(2, np.float32)
    D.all_reduce(x)
    return x.tolist()


def test_monitored_barrier_passes_when_everyone_arrives():
    assert ranks.run(all_arrive, 3, timeout=60) == [[3.0, 3.0]] * 3


def logged_collective():
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    log = logging.getLogger("pycyxwiz")
    log.addHandler(Keep())
    log.setLevel(logging.DEBUG)
    D.init()
    x = np.ones(6, np.float32)
    D.all_reduce(x)  # LOGGED-CALL
    D.finalize()
    return seen


@pytest.mark.parametrize("level", ["INFO", "DETAIL"])
def test_cx_debug_logs_setup_and_each_collective(level):
    for seen in ranks.run(logged_collective, 2, env={"CX_DEBUG": level}, init=False, timeout=60):
        assert any("init: DistributedConfig(" in m for m in seen), seen
        assert any("group ready" in m and "recursive doubling" in m for m in seen), seen
        want = (f"all_reduce(count=6, dtype=float32, op=SUM) at test_failures.py:{_line_of('LOGGED-CALL')} as "
                "collective #1") if level == "DETAIL" else "all_reduce [(6,)]"
        assert any(want in m for m in seen), seen


def test_cx_debug_with_a_bad_value_names_it():
    env = dict(os.environ, CX_DEBUG="LOUD")
    r = subprocess.run([sys.executable, "-c", "import pycyxwiz"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "CX_DEBUG='LOUD' is not valid: expected INFO, DETAIL or OFF" in r.stderr, r.stderr


EXITS_WITHOUT_FINALIZE = textwrap.dedent("""
    import numpy as np
    import pycyxwiz as cx
    cx.distributed.init()
    if cx.distributed.get_rank() == 0:   # a send nobody receives, and no finalize(): the exit hook checks
        cx.distributed.send(np.zeros(4, np.float32), dst=1)
""")


def test_a_divergence_is_reported_at_exit_without_finalize(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(EXITS_WITHOUT_FINALIZE)
    port = ranks.free_port()
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OPENBLAS_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    errs = [p.communicate(timeout=60)[1] for p in procs]
    assert all("pycyxwiz: finalize at exit: " in e and "rank 0 sent 1 message(s) to rank 1 that rank 1 never received"
               in e for e in errs), errs


def same_shapes_in_another_order():
    a, b = np.ones(4, np.float32), np.full(4, 2.0, np.float32)
    try:
        if D.get_rank() == 0:
            D.all_reduce(a)  # SITE-A
            D.all_reduce(b)
        else:
            D.all_reduce(b)  # SITE-B: the same shape, so every message matches
            D.all_reduce(a)
        return "no error", a.tolist(), b.tolist()
    except D.DistributedError as e:
        return type(e).__name__, str(e), None


def _line_of(marker):
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if marker in line and "_line_of" not in line)


@pytest.mark.parametrize("debug", ["OFF", "DETAIL"])
def test_cx_debug_detail_names_two_same_shape_collectives_called_in_another_order(debug):
    """Note [Call sites in CX_DEBUG=DETAIL]: by default the ranks pair rank 0's `a` with rank 1's `b` (the same
    shape: nothing to tell them apart); with DETAIL the first call raises on both ranks, naming both lines."""
    outs = ranks.run(same_shapes_in_another_order, 2, env={"CX_DEBUG": debug}, init=True, timeout=60)
    here = os.path.basename(__file__)
    site_a, site_b = f"{here}:{_line_of('SITE-A')}", f"{here}:{_line_of('SITE-B')}"
    if debug == "OFF":
        assert all(o[0] == "no error" for o in outs), outs  # silently mixed: a and b are both 3s
        assert outs[0][1] == [3.0] * 4 and outs[0][2] == [3.0] * 4
        return
    for name, msg, _ in outs:
        assert name == "CollectiveMismatchError", msg
        assert f"all_reduce(count=4, dtype=float32, op=SUM) at {site_a} as collective #1" in msg, msg
        assert f"all_reduce(count=4, dtype=float32, op=SUM) at {site_b} as collective #1" in msg, msg


def messages_and_single_copies():
    r, p = D.get_rank(), D.get_world_size()
    got = np.zeros(4, np.float32)
    if r == 0:
        D.send(np.arange(4, dtype=np.float32), dst=1)  # a send and its recv are two call sites by nature
    elif r == 1:
        D.recv(got, src=0)
    n = 1 << 17  # 512 KiB a rank: through shared memory, single copies (REMOTE frames)
    out = np.zeros((p, n), np.float32)
    D.all_gather(out, np.full(n, float(r), np.float32))
    return got.tolist(), [float(out[k].min()) for k in range(p)] + [float(out[k].max()) for k in range(p)]


@pytest.mark.parametrize("shm", ["0", "1"])
def test_cx_debug_detail_raises_nothing_for_a_send_its_recv_and_single_copy_messages(shm):
    # Both raised a false CollectiveMismatchError under DETAIL: the send's and the recv's lines were compared,
    # and a REMOTE frame's call site was not read (Note [Call sites in CX_DEBUG=DETAIL]).
    for r, (got, blocks) in enumerate(ranks.run(messages_and_single_copies, 2, env={"CX_DEBUG": "DETAIL",
                                                                                 "CX_SHM": shm}, timeout=60)):
        assert got == ([0.0, 1.0, 2.0, 3.0] if r == 1 else [0.0] * 4)
        assert blocks == [0.0, 1.0, 0.0, 1.0]

