"""Every failure a user can cause ends in a clear error on every rank, never a hang."""
import os
import socket
import threading
import time

import numpy as np
import pytest

import ranks

import pycyxwiz as cx

D = cx.distributed


def names(outcome):
    return outcome.exc_bases


@pytest.fixture(autouse=True, params=["shm", "tcp"])
def transport(request, monkeypatch):
    """Every error path here is provoked twice: with ranks talking through shared memory (the
    default on one host) and with CX_SHM=0 over TCP. A dead peer, an abort or a timeout must
    read the same either way."""
    monkeypatch.setenv("CX_SHM", "1" if request.param == "shm" else "0")
    return request.param


# ---- a peer dies ------------------------------------------------------------------------

def die_mid_collective():
    r = D.get_rank()
    x = np.ones(1 << 20, np.float32)
    D.all_reduce(x)  # one good round first
    if r == 2:
        os._exit(3)  # killed, no cleanup
    t0 = time.monotonic()
    try:
        for _ in range(50):
            D.all_reduce(x)
    finally:
        elapsed = time.monotonic() - t0
    return elapsed


@pytest.mark.parametrize("world", [3, 4])
def test_dead_peer_is_named_on_every_surviving_rank(world):
    outs = ranks.spawn(die_mid_collective, world, env={"DISTRIBUTED_OPERATION_TIMEOUT_MS": 15000}, timeout=60)
    assert outs[2].exc_type == "Died"
    for o in outs:
        if o.rank == 2:
            continue
        assert not o.ok, f"rank {o.rank} did not notice"
        assert o.is_a("DistributedConnectionError") and o.is_a("ConnectionError"), o
        assert "rank 2" in o.message, o.message
        assert "all_reduce" in o.message


def slow_rank_times_out():
    r = D.get_rank()
    x = np.ones(10, np.float32)
    if r == 1:
        time.sleep(2.5)
    t0 = time.monotonic()
    try:
        # The late rank may still complete this call (its partner's data had
        # arrived before the partner gave up); it must fail on the next one.
        D.all_reduce(x)
        D.barrier()
        return "no error"
    except D.DistributedTimeoutError as e:
        elapsed = time.monotonic() - t0
        if r == 0:
            time.sleep(2.5)  # stay alive while rank 1 catches up (a process that exits is reported as gone)
        return ("timeout", str(e), elapsed)


def test_timeout_names_this_rank_the_peer_the_operation_and_the_deadline():
    outs = ranks.spawn(slow_rank_times_out, 2, env={"DISTRIBUTED_OPERATION_TIMEOUT_MS": 1000}, timeout=60)
    o0 = outs[0]
    assert o0.ok and o0.value[0] == "timeout", o0
    msg, elapsed = o0.value[1], o0.value[2]
    assert "rank 0" in msg and "rank 1" in msg and "all_reduce" in msg and "1000 ms" in msg, msg
    assert "DISTRIBUTED_OPERATION_TIMEOUT_MS" in msg, msg
    assert elapsed < 2.4
    # the late rank is told why instead of waiting for a partner that gave up
    o1 = outs[1]
    assert o1.ok and o1.value[0] == "timeout", o1
    assert "rank 0" in o1.value[1]


def recv_from_the_wrong_rank():
    # Rank 0 sends to rank 1, which receives from rank 2 by mistake; rank 2 sends nothing.
    r = D.get_rank()
    if r == 0:
        D.send(np.arange(10, dtype=np.float32), 1)
    elif r == 1:
        try:
            D.recv(np.zeros(10, np.float32), 2)
        except D.DistributedTimeoutError as e:
            return str(e)
    time.sleep(2.5)  # the others stay until rank 1 has timed out
    return None


def test_a_receive_that_times_out_names_the_message_it_left_unreceived():
    # Note [A receive that timed out names the messages nobody took]
    outs = ranks.spawn(recv_from_the_wrong_rank, 3, env={"DISTRIBUTED_OPERATION_TIMEOUT_MS": 1000}, timeout=60)
    msg = outs[1].value
    assert outs[1].ok and msg is not None, outs[1]
    assert "src=2) as message #1 between the pair timed out after 1000 ms waiting for rank 2" in msg, msg
    assert "no receive has taken: from rank 0, 10 x float32, tag 0. This receive names src=2, tag 0" in msg, msg


def busy_rank_0_between_collectives():
    x = np.full(3, D.get_rank() + 1.0, np.float32)
    D.all_reduce(x)
    if D.get_rank() == 0:
        time.sleep(2.5)  # evaluating, saving a checkpoint ...: longer than the setup deadline
    D.all_reduce(x)
    return x.tolist()


def test_setup_and_operation_deadlines_are_separate():
    # A setup deadline of 1 s does not bound a collective: rank 0 may be busy for longer.
    outs = ranks.run(busy_rank_0_between_collectives, 2,
                     env={"DISTRIBUTED_TIMEOUT_MS": 1000, "DISTRIBUTED_OPERATION_TIMEOUT_MS": 20000})
    assert outs == [[6.0] * 3] * 2
    # An operation deadline of 1 s does not bound init(): a rank may start later than that.
    outs = ranks.run(busy_rank_0_between_collectives, 2, start_delay={1: 2.5},
                     env={"DISTRIBUTED_TIMEOUT_MS": 20000, "DISTRIBUTED_OPERATION_TIMEOUT_MS": 5000})
    assert outs == [[6.0] * 3] * 2


def poisoned_group_then_restart():
    r = D.get_rank()
    x = np.ones(10, np.float32)
    if r == 1:
        time.sleep(1.5)

    def error_of(fn, *a):
        try:
            fn(*a)
        except D.DistributedError as e:
            return type(e).__name__, str(e)
        return None

    first = error_of(D.all_reduce, x)
    second = error_of(D.barrier)
    D.finalize()
    cfg = D.DistributedConfig.from_environment()
    cfg.operation_timeout_ms = 20000
    D.init(cfg)  # a fresh group on the same port works
    y = np.full(3, r + 1.0, np.float32)
    D.all_reduce(y)
    return first, second, y.tolist()


def test_group_is_poisoned_after_a_timeout_and_can_be_restarted():
    outs = ranks.run(poisoned_group_then_restart, 2, env={"DISTRIBUTED_OPERATION_TIMEOUT_MS": 800}, timeout=60)
    (first0, second0, y0), (first1, second1, y1) = outs
    assert first0[0] == "DistributedTimeoutError"
    assert second0[0] == "DistributedTimeoutError"  # the same error again ...
    assert "failed earlier" in second0[1] and "finalize()" in second0[1]  # ... saying what to do
    assert second1 is not None  # the late rank learns the group is gone
    assert y0 == y1 == [3.0, 3.0, 3.0]


# ---- bad arrays: refused before any byte is sent, group stays usable ----------------------

def bad_arrays():
    errs = []

    def expect(exc, fn, *a, **kw):
        try:
            fn(*a, **kw)
            errs.append(f"{fn.__name__}{a}: no error")
        except exc as e:
            errs.append((exc.__name__, str(e)))

    x = np.ones((4, 4), np.float32)
    expect(ValueError, D.all_reduce, x[:, 1])                      # non-contiguous
    ro = np.ones(4, np.float32)
    ro.setflags(write=False)
    expect(ValueError, D.all_reduce, ro)                           # read-only
    expect(TypeError, D.all_reduce, [1.0, 2.0])                    # not an array
    expect(TypeError, D.all_reduce, np.ones(3, np.complex64))      # not reducible
    expect(TypeError, D.all_reduce, np.ones(3, np.uint16))         # uint16 without dtype='bfloat16'
    expect(ValueError, D.all_reduce, np.ones(3, np.int32), op=D.ReduceOp.AVG)
    expect(ValueError, D.all_reduce, np.ones(3, np.float64), op=D.ReduceOp.BAND)  # bitwise: integers and bool
    expect(ValueError, D.broadcast, np.ones(3), src=7)
    expect(ValueError, D.all_gather, [np.ones(3)], np.ones(3))     # wrong number of outputs
    expect(ValueError, D.all_gather, [np.ones(3), np.ones(4)], np.ones(3))
    expect(ValueError, D.send, np.ones(3), D.get_rank())
    # the group still works
    y = np.ones(5, np.float32)
    D.all_reduce(y)
    return errs, y.tolist()


def test_bad_arrays_are_refused_with_clear_errors_and_the_group_survives():
    for errs, y in ranks.run(bad_arrays, 2):
        kinds = [e[0] if isinstance(e, tuple) else e for e in errs]
        assert kinds == ["ValueError", "ValueError", "TypeError", "TypeError", "TypeError", "ValueError",
                         "ValueError", "ValueError", "ValueError", "ValueError", "ValueError"], errs
        msgs = [e[1] for e in errs]
        assert "C-contiguous" in msgs[0]
        assert "read-only" in msgs[1]
        assert "must be a NumPy array" in msgs[2] and msgs[2].endswith("got list")
        assert "complex64" in msgs[3] and "cannot be reduced" in msgs[3]
        assert "uint16" in msgs[4]
        assert "AVG" in msgs[5] and "int32" in msgs[5]
        assert msgs[6].startswith("ReduceOp.BAND is defined for integer and bool arrays") and "float64" in msgs[6]
        assert "src=7" in msgs[7]
        assert "world size is 2" in msgs[8]
        assert "[1]" in msgs[9]
        assert "itself" in msgs[10]
        assert y == [2.0] * 5


def arrays_that_cannot_travel():
    """Object arrays hold pointers (the receiver used to crash reading them); a non-native byte
    order was reduced as if native (1 + 2 came back inf). Both are refused on every rank before a
    byte is sent, and the group stays usable."""
    errs = []
    r = D.get_rank()
    for fn, args in [
        (D.broadcast, (np.array([{"a": r}, "x"], dtype=object),)),
        (D.all_gather, ([np.empty(2, object), np.empty(2, object)], np.array([r, None], dtype=object))),
        (D.broadcast, (np.zeros(2, dtype=[("name", object), ("v", "f4")]),)),
        (D.all_reduce, (np.full(3, r + 1, ">f8"),)),
        (D.broadcast, (np.full(3, r + 1, ">i4"),)),
        (D.all_reduce, (np.zeros(2, dtype=[("a", ">f4")]),)),
    ]:
        try:
            fn(*args)
            errs.append(f"{fn.__name__}: no error")
        except TypeError as e:
            errs.append(str(e))
    y = np.full(3, r + 1.0)
    D.all_reduce(y)
    return errs, y.tolist()


def test_object_arrays_and_foreign_byte_order_are_refused_on_every_rank():
    for errs, y in ranks.run(arrays_that_cannot_travel, 2):
        assert len(errs) == 6, errs
        for m in errs[:3]:
            assert "pointers to Python objects" in m and "pickle" in m, m
        for m in errs[3:]:
            assert "byte order" in m and "arr.astype(arr.dtype.newbyteorder('='))" in m, m
        assert ">f8" in errs[3] and ">i4" in errs[4]
        assert y == [3.0, 3.0, 3.0]


def buffer_protocol_objects():
    import array
    r = D.get_rank()
    a = array.array("d", [r + 1.0] * 4)                    # array.array: reduced in place
    D.all_reduce(a)
    m = memoryview(bytearray(np.full(3, r + 1, np.int32).tobytes())).cast("i")
    D.all_reduce(m)                                         # a memoryview of a bytearray
    b = bytearray(b"hello" if r == 0 else b"xxxxx")
    D.broadcast(b, src=0)                                   # bytes moved into a bytearray
    out = bytearray(4)
    D.all_gather(out, memoryview(bytes([r, r])))            # read-only input is fine
    w = D.all_reduce(array.array("f", [1.0, 2.0]), async_op=True)
    w.wait()
    errs = []
    for fn, args in [(D.all_reduce, (b"read-only",)), (D.all_reduce, (np.arange(3.0).tolist(),))]:
        try:
            fn(*args)
        except (TypeError, ValueError) as e:
            errs.append(f"{type(e).__name__}: {e}")

    class ArrayOnly:  # __array__ only: NumPy may be handed a copy, where a result written in place would be lost
        def __array__(self, dtype=None, copy=None):
            return np.zeros(3, np.float32)
    try:
        D.all_reduce(ArrayOnly())
    except TypeError as e:
        errs.append(f"TypeError: {e}")
    return list(a), list(m), bytes(b), bytes(out), errs


def root_broadcasts_a_read_only_array():
    r = D.get_rank()
    a = np.arange(5, dtype=np.float64) * (r + 1)
    if r == 1:
        a.flags.writeable = False  # the root only reads it
    D.broadcast(a, src=1)
    b = bytes(range(4)) if r == 0 else bytearray(4)  # bytes are read-only: fine at the root
    D.broadcast(b, src=0)
    errs = []
    try:
        D.broadcast(_read_only(3), src=(r + 1) % 2)  # each rank a receiver: refused on both, nothing sent
    except ValueError as e:
        errs.append(str(e))
    return a.tolist(), bytes(b), errs


def _read_only(n):
    a = np.zeros(n)
    a.flags.writeable = False
    return a


def test_the_root_of_a_broadcast_may_pass_a_read_only_array():
    """The root only reads its array; a receiving rank's array must be writable, and is refused by name."""
    for r, (a, b, errs) in enumerate(ranks.run(root_broadcasts_a_read_only_array, 2)):
        assert a == [0.0, 2.0, 4.0, 6.0, 8.0]
        assert b == bytes(range(4))
        assert len(errs) == 1 and "read-only" in errs[0], errs  # each rank receives from the other: refused


def test_buffer_protocol_objects_are_used_in_place():
    for a, m, b, out, errs in ranks.run(buffer_protocol_objects, 2):
        assert a == [3.0] * 4
        assert m == [3, 3, 3]
        assert b == b"hello"
        assert out == bytes([0, 0, 1, 1])
        assert errs[0].startswith("ValueError") and "read-only" in errs[0], errs
        assert errs[1].startswith("TypeError") and "got list" in errs[1] and "buffer protocol" in errs[1], errs
        assert errs[2].startswith("TypeError") and "got ArrayOnly" in errs[2] and "__dlpack__" in errs[2], errs


# ---- misuse of the API, in this process ----------------------------------------------------

def _two_rank_config(rank: int) -> "D.DistributedConfig":
    cfg = D.DistributedConfig()
    cfg.rank, cfg.world_size, cfg.timeout_ms = rank, 2, 5000
    return cfg


def test_a_group_over_an_object_that_is_no_store_is_refused_by_name():
    class NotAStore:
        def set(self, key, value): ...

    with pytest.raises(TypeError, match=r"set\(key, value\), check\(keys\) and get\(key\).*NotAStore has no check"):
        cx._core.dist.Group(_two_rank_config(1), NotAStore(), "127.0.0.1", "")


def test_a_store_that_fails_fails_the_group_naming_the_store_in_seconds():
    class DeadStore:  # what torch's TCPStore does once the rank that held it is gone
        def set(self, key, value): raise RuntimeError("Connection reset by peer")
        def check(self, keys): raise RuntimeError("Connection reset by peer")
        def get(self, key): raise RuntimeError("Connection reset by peer")

    t0 = time.monotonic()
    with pytest.raises(D.DistributedConnectionError,
                       match=r"the process group's store failed in get\(\): .*Connection reset by peer"):
        cx._core.dist.Group(_two_rank_config(1), DeadStore(), "127.0.0.1", "")
    assert time.monotonic() - t0 < 3


def test_a_store_where_rank_0_never_comes_times_out_at_the_groups_deadline():
    class EmptyStore:  # a live store that rank 0 never writes to
        def set(self, key, value): ...
        def check(self, keys): return False
        def get(self, key): raise KeyError(key)

    cfg = _two_rank_config(1)
    cfg.timeout_ms = 500
    t0 = time.monotonic()
    with pytest.raises(D.DistributedTimeoutError, match="rank 0 did not start the group"):
        cx._core.dist.Group(cfg, EmptyStore(), "127.0.0.1", "")
    assert 0.4 < time.monotonic() - t0 < 5


def test_collective_before_init_says_to_call_init():
    assert not D.is_initialized()
    with pytest.raises(D.DistributedError, match=r"call cx.distributed.init\(\) first"):
        D.all_reduce(np.ones(3, np.float32))
    with pytest.raises(D.DistributedError, match="not initialized"):
        D.get_rank()


def test_a_wrapper_that_outlives_its_group_says_it_was_finalized(monkeypatch):
    # DistributedDataParallel keeps the group it was made with; after finalize() its next
    # collective must raise, not touch a torn-down backend.
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    D.init()
    m = cx.SequentialModel()
    m.add(cx.LinearModule(4, 2))
    ddp = D.DistributedDataParallel(m)
    D.finalize()
    out = ddp.forward(np.ones((3, 4), np.float32))
    with pytest.raises(D.DistributedError, match="the process group has been finalized"):
        ddp.backward(np.ones_like(out))
        ddp.sync_gradients()


def test_init_twice_is_refused(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    D.init()
    try:
        with pytest.raises(D.DistributedError, match=r"already called.*finalize\(\)"):
            D.init()
    finally:
        D.finalize()


@pytest.mark.parametrize("env,needle", [
    ({"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE='abc'"),
    ({"RANK": "x1", "WORLD_SIZE": "2"}, "RANK='x1'"),
    ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK=4 is out of range for WORLD_SIZE=4"),
    ({"RANK": "-1", "WORLD_SIZE": "4"}, "RANK='-1'"),
    ({"RANK": "1"}, "WORLD_SIZE is not"),
    ({"WORLD_SIZE": "2"}, "RANK is not"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "MASTER_PORT='70000'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"}, "MASTER_PORT='http'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "DISTRIBUTED_BACKEND": "gloo"}, "DISTRIBUTED_BACKEND='gloo'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "DISTRIBUTED_TIMEOUT_MS": "0"}, "DISTRIBUTED_TIMEOUT_MS='0'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "DISTRIBUTED_OPERATION_TIMEOUT_MS": "10s"},
     "DISTRIBUTED_OPERATION_TIMEOUT_MS='10s'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "gpu0"}, "LOCAL_RANK='gpu0'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "CX_CHUNK_BYTES": "1M"}, "CX_CHUNK_BYTES='1M'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "CX_HD_MAX_BYTES": "-5"}, "CX_HD_MAX_BYTES='-5'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "CX_SPIN_US": "fast"}, "CX_SPIN_US='fast'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "CX_HIER_SLICE_BYTES": "0"},
     "CX_HIER_SLICE_BYTES='0' is not valid: expected bytes (1 .. 2^40)"),
    ({"RANK": "0", "WORLD_SIZE": "2", "CX_ALGORITHM": "tree"},
     "CX_ALGORITHM='tree' is not valid: expected 'auto', 'flat' or 'hierarchical'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "CX_SHM": "yes"}, "CX_SHM='yes' is not valid: expected 0 (TCP only) or 1"),
    ({"RANK": "0", "WORLD_SIZE": "2", "CX_SHM_RING_BYTES": "100"}, "CX_SHM_RING_BYTES='100'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "CX_SHM_SINGLE_COPY": "on"},
     "CX_SHM_SINGLE_COPY='on' is not valid: expected 0 (large messages copied through the rings) or 1"),
    ({"RANK": "0", "WORLD_SIZE": "2", "CX_SOCKET_BUFFER_BYTES": "4096"},
     "CX_SOCKET_BUFFER_BYTES='4096' is not valid: expected bytes, 65536 (64 KiB) .. 1073741824 (1 GiB)"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE='0' is not valid: expected a positive"),
])
def test_invalid_environment_names_the_variable_and_value(monkeypatch, env, needle):
    for v in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "DISTRIBUTED_BACKEND", "DISTRIBUTED_TIMEOUT_MS",
              "DISTRIBUTED_OPERATION_TIMEOUT_MS", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "CX_CHUNK_BYTES",
              "CX_HD_MAX_BYTES", "CX_SPIN_US", "CX_SHM", "CX_SHM_RING_BYTES", "CX_SHM_SINGLE_COPY",
              "CX_SOCKET_BUFFER_BYTES", "LOCAL_WORLD_SIZE", "CX_ALGORITHM", "CX_HIER_SLICE_BYTES"]:
        monkeypatch.delenv(v, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError) as ei:
        D.DistributedConfig.from_environment()
    assert needle in str(ei.value)
    with pytest.raises(ValueError):
        D.init()
    assert not D.is_initialized()


def test_environment_defaults_match_the_guide(monkeypatch):
    for v in ["LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DISTRIBUTED_BACKEND", "DISTRIBUTED_TIMEOUT_MS",
              "DISTRIBUTED_OPERATION_TIMEOUT_MS"]:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    c = D.DistributedConfig.from_environment()
    assert (c.rank, c.world_size, c.local_rank, c.master_addr, c.master_port, c.backend) == \
        (3, 4, 3, "127.0.0.1", 29500, D.BackendType.CPU)
    # Deadlines a real job survives (Note [Two deadlines] in config.h): init() waits 10 minutes for
    # every rank, a collective 30 minutes for its peers.
    assert (c.timeout_ms, c.operation_timeout_ms) == (600000, 1800000)
    monkeypatch.setenv("DISTRIBUTED_BACKEND", "NCCL")
    assert D.DistributedConfig.from_environment().backend == D.BackendType.NCCL


def test_mpirun_and_slurm_variables_are_understood(monkeypatch):
    for v in ["RANK", "WORLD_SIZE", "LOCAL_RANK"]:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    c = D.DistributedConfig.from_environment()
    assert (c.rank, c.world_size, c.local_rank) == (2, 3, 1)
    for v in ["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"]:
        monkeypatch.delenv(v)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    c = D.DistributedConfig.from_environment()
    assert (c.rank, c.world_size, c.local_rank) == (5, 8, 1)


def test_explicit_config_is_validated():
    c = D.DistributedConfig()
    c.rank, c.world_size = 2, 2
    with pytest.raises(ValueError, match="rank 2 is out of range for world_size 2"):
        D.init(c)
    c.rank, c.master_port = 0, 0
    with pytest.raises(ValueError, match="master_port 0"):
        D.init(c)


# ---- ports and rendezvous ----------------------------------------------------------------

def test_master_port_in_use_is_a_clear_message():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        c = D.DistributedConfig()
        c.rank, c.world_size, c.master_port, c.timeout_ms = 0, 2, port, 2000
        with pytest.raises(D.DistributedConnectionError) as ei:
            D.init(c)
    msg = str(ei.value)
    assert f"MASTER_PORT {port}" in msg and "already in use" in msg
    assert not D.is_initialized()


def test_missing_rank_is_reported_by_rank_0_within_the_timeout():
    c = D.DistributedConfig()
    c.rank, c.world_size, c.master_port, c.timeout_ms = 0, 3, ranks.free_port(), 1500
    t0 = time.monotonic()
    with pytest.raises(D.DistributedTimeoutError) as ei:
        D.init(c)
    assert time.monotonic() - t0 < 5
    assert "Timeout waiting for peers" in str(ei.value)


def test_worker_without_rank_0_times_out_naming_the_store():
    c = D.DistributedConfig()
    c.rank, c.world_size, c.master_port, c.timeout_ms = 1, 2, ranks.free_port(), 1000
    with pytest.raises(D.DistributedTimeoutError) as ei:
        D.init(c)
    msg = str(ei.value)
    assert "Timeout waiting for peers" in msg and f"127.0.0.1:{c.master_port}" in msg and "Connection refused" in msg


def test_foreign_server_on_master_port_is_detected():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]

    def answer():
        conn, _ = srv.accept()
        conn.recv(100)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        time.sleep(1)
        conn.close()

    th = threading.Thread(target=answer, daemon=True)
    th.start()
    c = D.DistributedConfig()
    c.rank, c.world_size, c.master_port, c.timeout_ms = 1, 2, port, 3000
    with pytest.raises(D.DistributedConnectionError, match="not a pycyxwiz store"):
        D.init(c)
    srv.close()


def late_starter():
    x = np.full(3, D.get_rank() + 1.0, np.float32)
    D.all_reduce(x)
    return x.tolist()


def test_ranks_may_start_in_any_order_and_late():
    # rank 0 (the store) starts last, a second after the others
    outs = ranks.run(late_starter, 3, start_delay={0: 1.0})
    assert outs == [[6.0, 6.0, 6.0]] * 3


def duplicate():
    return D.get_rank()


def test_two_processes_with_the_same_rank_are_refused():
    outs = ranks.spawn(duplicate, 3, per_rank_env={2: {"RANK": "1"}}, env={"DISTRIBUTED_TIMEOUT_MS": 3000},
                       timeout=30)
    refused = [o for o in outs if not o.ok and "RANK=1 is already taken" in o.message]
    assert refused and refused[0].is_a("ValueError"), outs
    assert all(not o.ok for o in outs)  # the others are told, or time out waiting for rank 2


def init_and_say_how_long():
    t0 = time.monotonic()
    try:
        D.init()
    except Exception as e:
        return type(e).__name__, [c.__name__ for c in type(e).__mro__], str(e), time.monotonic() - t0
    D.finalize()
    return "ok", [], "", time.monotonic() - t0


def test_a_second_rank_0_is_told_rank_0_is_taken_and_rank_0_says_who_came():
    # The second process was meant to be rank 1 but was given RANK=0 too. Whichever binds
    # MASTER_PORT second asks what holds it (Note [Who holds MASTER_PORT]): this job's store.
    port = ranks.free_port()
    outs = ranks.run(init_and_say_how_long, 2, init=False, timeout=60,
                     env={"MASTER_PORT": port, "DISTRIBUTED_TIMEOUT_MS": 4000},
                     per_rank_env={1: {"RANK": "0", "LOCAL_RANK": "0"}})
    refused = [o for o in outs if o[0] == "ValueError"]
    waited = [o for o in outs if o[0] == "DistributedTimeoutError"]
    assert len(refused) == 1 and len(waited) == 1, outs
    _, bases, msg, elapsed = refused[0]
    assert msg.startswith(f"RANK=0 is already taken by another process of this job (127.0.0.1:{port} answers "
                          "as its store"), msg
    assert "two processes were started with RANK=0" in msg and "already in use" not in msg, msg
    assert elapsed < 3, elapsed  # told at once, not after the 4 s deadline
    # The real rank 0 keeps its group (nothing was claimed in it), and when rank 1 never comes it
    # says that a second RANK=0 came and went.
    _, bases, msg, elapsed = waited[0]
    assert "TimeoutError" in bases and "for rank(s) 1 to connect" in msg, msg
    assert f"another process started with RANK=0 found this rank's store on 127.0.0.1:{port}" in msg, msg


def hold_store_until(up_file, done_file):
    # rank 0's store is up (init returned); it stays up until the test is done probing it
    if D.get_rank() == 0:
        open(up_file, "w").close()
    deadline = time.monotonic() + 30
    while not os.path.exists(done_file) and time.monotonic() < deadline:
        time.sleep(0.05)
    D.barrier()
    return True


def test_master_port_held_by_another_jobs_store_names_that_job(tmp_path):
    port = ranks.free_port()
    up_file, done_file = str(tmp_path / "up"), str(tmp_path / "done")
    result = {}

    def other_job():
        result["outs"] = ranks.run(hold_store_until, 2, args=(up_file, done_file), env={"MASTER_PORT": port},
                                   timeout=60)

    th = threading.Thread(target=other_job)
    th.start()
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(up_file) and time.monotonic() < deadline:
            time.sleep(0.05)
        c = D.DistributedConfig()
        c.rank, c.world_size, c.master_port, c.timeout_ms = 0, 3, port, 3000
        with pytest.raises(D.DistributedConnectionError) as ei:
            D.init(c)
    finally:
        open(done_file, "w").close()
        th.join()
    msg = str(ei.value)
    assert f"MASTER_PORT {port} on 127.0.0.1 is already in use by another pycyxwiz job" in msg, msg
    assert "WORLD_SIZE=2 where this process has WORLD_SIZE=3" in msg, msg
    assert not D.is_initialized()
    assert result["outs"] == [True, True]  # and the other job went on undisturbed


def wrong_world():
    return D.get_world_size()


def test_ranks_disagreeing_on_world_size_are_refused():
    outs = ranks.spawn(wrong_world, 2, env={"DISTRIBUTED_TIMEOUT_MS": 3000}, per_rank_env={1: {"WORLD_SIZE": "3"}},
                       timeout=30)
    assert not outs[1].ok
    assert "WORLD_SIZE=3" in outs[1].message and "WORLD_SIZE=2" in outs[1].message, outs[1]


# ---- nothing from the network is trusted -----------------------------------------------

def hold_group(port_file):
    # rank 0 publishes its store port, then waits for the test's hostile client
    if D.get_rank() == 0:
        with open(port_file, "w") as f:
            f.write(os.environ["MASTER_PORT"])
    time.sleep(1.5)
    x = np.ones(3, np.float32)
    D.all_reduce(x)
    return x.tolist()


def test_store_refuses_an_oversized_frame_without_allocating(tmp_path):
    import struct
    port_file = str(tmp_path / "port")
    result = {}

    def hostile():
        deadline = time.monotonic() + 20
        while not os.path.exists(port_file) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        with open(port_file) as f:
            port = int(f.read())
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            # a well-formed header announcing a 2 GiB value
            s.sendall(struct.pack("<I4BII", 0x31535843, 2, 0, 0, 0, 4, 2 << 30) + b"key!")
            s.settimeout(5)
            try:
                result["reply"] = s.recv(16)  # b"" = the store closed the connection
            except OSError as e:
                result["reply"] = repr(e)

    th = threading.Thread(target=hostile)
    th.start()
    outs = ranks.run(hold_group, 2, args=(port_file,), timeout=60)
    th.join()
    assert result["reply"] == b""
    assert outs == [[2.0, 2.0, 2.0]] * 2  # and the group works regardless


def length_disagreement():
    try:
        D.all_reduce(np.ones(1 << 16, np.float32))
        return "no error"
    except ValueError as e:
        return str(e)


def test_a_frame_longer_than_the_receive_posted_is_an_error():
    # ranks configured with different chunk sizes cut the same message differently
    outs = ranks.run(length_disagreement, 2, per_rank_env={0: {"CX_CHUNK_BYTES": 4096},
                                                          1: {"CX_CHUNK_BYTES": 8192}}, timeout=60)
    assert all("bytes where" in m and "expected" in m for m in outs), outs


def wait_for_peer(port_file):
    if D.get_rank() == 0:
        with open(port_file, "w") as f:
            f.write(os.environ["MASTER_PORT"])
    D.barrier()
    time.sleep(1.0)  # keep the store up while the test probes it
    return True


def test_store_listens_only_on_master_addr(tmp_path):
    port_file = str(tmp_path / "port")
    probe = {}

    def prober():
        deadline = time.monotonic() + 20
        while not os.path.exists(port_file) and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(port_file) as f:
            port = int(f.read())
        for addr in ("127.0.0.1", "127.0.0.2"):  # both are this machine; only MASTER_ADDR is served
            try:
                socket.create_connection((addr, port), timeout=2).close()
                probe[addr] = "accepted"
            except OSError as e:
                probe[addr] = type(e).__name__

    th = threading.Thread(target=prober)
    th.start()
    assert ranks.run(wait_for_peer, 2, args=(port_file,), timeout=60) == [True, True]
    th.join()
    assert probe == {"127.0.0.1": "accepted", "127.0.0.2": "ConnectionRefusedError"}


# ---- a group used from a forked child -------------------------------------------------------------

def fork_after_init():
    x = np.ones(4, np.float32)
    D.all_reduce(x)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its parent's group must not be used, nor closed
        try:
            os.close(r)
            try:
                D.all_reduce(np.ones(4, np.float32))
                msg = "no error"
            except Exception as e:
                msg = f"{type(e).__name__}: {e}"
            D.finalize()  # forgets the parent's group; closing it would end the parent's job
            os.environ.update(RANK="0", WORLD_SIZE="1")
            D.init()  # a group of its own
            y = np.full(3, 5.0, np.float32)
            D.all_reduce(y)
            D.finalize()
            os.write(w, f"{msg}|{float(y[0])}".encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 4096):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    z = np.full(4, D.get_rank() + 1.0, np.float32)
    D.all_reduce(z)  # the parent's group still works
    return os.getpid(), pid, data.decode(), z.tolist()


def test_a_forked_child_cannot_use_its_parents_group_and_may_init_its_own():
    for parent, child, msg, z in ranks.run(fork_after_init, 2):
        err, child_sum = msg.split("|")
        assert err.startswith("DistributedError: "), err
        assert f"this process (pid {child}) was made by fork() from process {parent}" in err, err
        assert "Call cx.distributed.init() in the child" in err, err
        assert float(child_sum) == 5.0
        assert z == [3.0] * 4
