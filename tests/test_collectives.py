"""Every collective x op x dtype x world size against an independent NumPy reference.

Each test body runs in every rank as a separate process (see ranks.py).
"""
import time

import numpy as np
import pytest

import ranks
from refs import BITWISE, OPS, REDUCE_DTYPES, bf16_round, contribution, expected, valid_pair

import pycyxwiz as cx

D = cx.distributed

SMALL_SIZES = [0, 1, 2, 3, 7, 100, 1000, 10000]


@pytest.fixture(autouse=True, params=["shm", "tcp"])
def transport(request, monkeypatch):
    """Every test here runs twice: ranks on one host through shared memory (the default),
    and with CX_SHM=0 over their TCP connections. Spawned ranks inherit the variable."""
    monkeypatch.setenv("CX_SHM", "1" if request.param == "shm" else "0")
    return request.param


# ---- per-rank bodies ------------------------------------------------------------

def all_reduce_matrix(sizes):
    r, p = D.get_rank(), D.get_world_size()
    failures = []
    for dtype in REDUCE_DTYPES:
        for op in OPS:
            if not valid_pair(dtype, op):
                continue
            for n in sizes:
                x = contribution(r, n, dtype, op)
                kw = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
                D.all_reduce(x, op=getattr(D.ReduceOp, op), **kw)
                want = expected(p, n, dtype, op)
                if not np.array_equal(x, want):
                    bad = np.flatnonzero(x != want)[:3]
                    failures.append(f"{dtype} {op} n={n}: at {bad.tolist()} got {x[bad].tolist()} "
                                    f"want {want[bad].tolist()}")
    return failures


def large_all_reduce(n):
    r, p = D.get_rank(), D.get_world_size()
    x = contribution(r, n, "float32", "SUM")
    D.all_reduce(x)
    return np.array_equal(x, expected(p, n, "float32", "SUM")), x[: 4].tolist()


# ---- all_reduce -------------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_all_reduce_matches_numpy_for_every_dtype_op_and_size(world):
    for fails in ranks.run(all_reduce_matrix, world, args=(SMALL_SIZES,)):
        assert fails == []


@pytest.mark.parametrize("world,algorithm", [(2, "ring"), (3, "ring"), (4, "ring"), (4, "halving-doubling"),
                                             (8, "halving-doubling")])
def test_all_reduce_multi_chunk_paths_with_tiny_chunks(world, algorithm):
    # A 24-byte chunk and no small-message shortcut force the chunked, pipelined ring
    # (several chunks per segment, uneven segments) or halving-doubling with
    # messages of a few hundred bytes.
    env = {"CX_CHUNK_BYTES": 24, "CX_SMALL_ALLREDUCE_BYTES": 0,
           "CX_HD_MAX_BYTES": 0 if algorithm == "ring" else 1 << 30}
    for fails in ranks.run(all_reduce_matrix, world, args=([3, 5, 17, 100, 1001],), env=env):
        assert fails == []


def test_all_reduce_world_of_eight_small_messages():
    for fails in ranks.run(all_reduce_matrix, 8, args=([0, 1, 5, 64],), timeout=120):
        assert fails == []


@pytest.mark.parametrize("world", [2, 4])
def test_all_reduce_16_mib(world):
    out = ranks.run(large_all_reduce, world, args=(4 << 20,), timeout=120)
    assert all(ok for ok, _ in out)
    assert all(head == out[0][1] for _, head in out)


def test_all_reduce_mid_size_on_four_ranks_uses_halving_doubling_by_default():
    # 1.2 MiB on 4 ranks: between the small-message and the ring thresholds
    out = ranks.run(large_all_reduce, 4, args=(300_001,), timeout=120)
    assert all(ok for ok, _ in out)
    assert all(head == out[0][1] for _, head in out)


def seed_all_reduce_example():
    # seed 000: rank 0 holds [1, 2, 3], the others zeros; SUM gives [1, 2, 3] everywhere
    if D.get_rank() == 0:
        t = np.array([1.0, 2.0, 3.0], np.float32)
    else:
        t = np.array([0.0, 0.0, 0.0], np.float32)
    D.all_reduce(t, op=D.ReduceOp.SUM)
    return t.tolist()


def test_seed_all_reduce_example_prints_what_the_guide_says():
    assert ranks.run(seed_all_reduce_example, 3) == [[1.0, 2.0, 3.0]] * 3


# ---- broadcast ----------------------------------------------------------------------

def broadcast_body(sizes):
    r, p = D.get_rank(), D.get_world_size()
    fails = []
    for root in range(p):
        for n in sizes:
            want = np.arange(n, dtype=np.float64) * (root + 1) - 7
            x = want.copy() if r == root else np.full(n, -1.0)
            D.broadcast(x, src=root)
            if not np.array_equal(x, want):
                fails.append((root, n))
    # any dtype moves as bytes, e.g. a structured or complex array
    c = np.array([1 + 2j, 3 - 4j]) if r == 0 else np.zeros(2, complex)
    D.broadcast(c, src=0)
    if c.tolist() != [1 + 2j, 3 - 4j]:
        fails.append("complex")
    # seed 000's example
    b = np.array([1.0, 2.0, 3.0], np.float32) if r == 0 else np.zeros(3, np.float32)
    D.broadcast(b, src=0)
    return fails, b.tolist()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_broadcast_from_every_root(world):
    for fails, b in ranks.run(broadcast_body, world, args=([0, 1, 5, 1000, 100000],)):
        assert fails == []
        assert b == [1.0, 2.0, 3.0]


def test_broadcast_pipelined_chain_with_tiny_chunks():
    for fails, _ in ranks.run(broadcast_body, 4, args=([100000],), env={"CX_CHUNK_BYTES": 1000}):
        assert fails == []


# ---- all_gather / reduce_scatter ----------------------------------------------------

def all_gather_body(sizes):
    r, p = D.get_rank(), D.get_world_size()
    fails = []
    for n in sizes:
        mine = np.arange(n, dtype=np.int32) + 1000 * r
        lst = [np.empty_like(mine) for _ in range(p)]
        D.all_gather(lst, mine)
        whole = np.empty((p, n), np.int32)
        D.all_gather(whole, mine)
        in_place = np.zeros((p, n), np.int32)
        in_place[r] = mine
        D.all_gather(in_place, in_place[r])  # the input is this rank's block of the output
        want = np.stack([np.arange(n, dtype=np.int32) + 1000 * k for k in range(p)])
        if not (np.array_equal(np.stack(lst), want) and np.array_equal(whole, want) and
                np.array_equal(in_place, want)):
            fails.append(n)
    return fails


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_all_gather_list_and_array_forms(world):
    # From 4 ranks, blocks up to 8 KiB through shared memory and 128 KiB over TCP go by Bruck's algorithm (Note
    # [Bruck's all_gather] in allgather.cpp; 2048 and 32768 int32), larger ones by the ring; 5 ranks are no power
    # of two.
    for fails in ranks.run(all_gather_body, world, args=([0, 1, 3, 1000, 2048, 2049, 32768, 32769, 70000],)):
        assert fails == []


def test_all_gather_whose_whole_result_passes_the_kept_scratch_is_right(transport):
    # Note [Bruck's all_gather] in allgather.cpp: 33 ranks over TCP with 128 KiB blocks gather 4.125 MiB by Bruck's
    # algorithm, more than the thread keeps (CallScratch in scratch.h allocates for the call).
    if transport == "shm":
        pytest.skip("through shared memory Bruck's blocks are at most 8 KiB: 4 MiB in all would take 513 ranks")
    for fails in ranks.run(all_gather_body, 33, args=([32768],), timeout=240):
        assert fails == []


def test_all_gather_with_tiny_chunks():
    for fails in ranks.run(all_gather_body, 3, args=([1000],), env={"CX_CHUNK_BYTES": 100}):
        assert fails == []


def reduce_scatter_body(sizes):
    r, p = D.get_rank(), D.get_world_size()
    fails = []
    for op in OPS:
        dt = "int32" if op in BITWISE else "float32"
        for n in sizes:
            # block k of rank j: contribution(j * p + k) so every block differs
            blocks = [contribution(r * p + k, n, dt, op) for k in range(p)]
            ins = np.stack(blocks) if blocks else np.empty((p, n), dt)
            keep = ins.copy()
            out = np.empty(n, dt)
            D.reduce_scatter(out, list(blocks), op=getattr(D.ReduceOp, op))
            out2 = np.empty(n, dt)
            D.reduce_scatter(out2, ins, op=getattr(D.ReduceOp, op))
            mine = np.stack([contribution(j * p + r, n, dt, op) for j in range(p)])
            bitwise = {"BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}
            want = ({"SUM": mine.sum(0), "AVG": mine.sum(0) / np.float32(p), "PRODUCT": mine.prod(0),
                     "MIN": mine.min(0), "MAX": mine.max(0)}[op].astype(np.float32) if op not in BITWISE
                    else bitwise[op].reduce(mine, 0).astype(dt))
            if not (np.array_equal(out, want) and np.array_equal(out2, want)):
                fails.append((op, n))
            if not np.array_equal(ins, keep):
                fails.append((op, n, "input modified"))
    return fails


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6, 7, 8])
def test_reduce_scatter_every_op(world):
    # On 4, 6, 7 and 8 ranks blocks up to 16 KiB over TCP and 1 KiB through shared memory go by recursive halving
    # (Note [Reduce-scatter by recursive halving] in allreduce_hd.cpp; 4096 and 256 four-byte elements), 6 and 7
    # folded onto 4 (Note [Reduce-scatter on a world that is not a power of two]); larger ones, and 5 ranks, by
    # the ring.
    for fails in ranks.run(reduce_scatter_body, world, args=([0, 1, 5, 256, 257, 1000, 4096, 4097, 50000],)):
        assert fails == []


def test_reduce_scatter_with_tiny_chunks():
    for fails in ranks.run(reduce_scatter_body, 3, args=([1000],), env={"CX_CHUNK_BYTES": 64}):
        assert fails == []


def reduce_scatter_large(n):
    """Block k of rank j holds (i % 251) + j, so block r's sum is p * (i % 251) + p(p-1)/2, exact in float32."""
    r, p = D.get_rank(), D.get_world_size()
    ins = np.tile((np.arange(n, dtype=np.float32) % 251) + r, (p, 1))
    out = np.empty(n, np.float32)
    D.reduce_scatter(out, ins)
    want = p * (np.arange(n, dtype=np.float32) % 251) + p * (p - 1) // 2
    return bool(np.array_equal(out, want))


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("shm", ["0", "1"])
def test_reduce_scatter_of_blocks_larger_than_the_transport_buffers_completes(world, shm):
    # Note [Reduce-scatter in groups of chunks]: 16 MiB blocks are 32 chunks, more than the slots and the socket or
    # shared-memory buffers hold; the ring deadlocked there until the operation deadline.
    outs = ranks.run(reduce_scatter_large, world, args=(4 << 20,), timeout=120,
                     env={"CX_SHM": shm, "DISTRIBUTED_OPERATION_TIMEOUT_MS": 30000})
    assert outs == [True] * world


# ---- reduce / scatter / gather / all_to_all ------------------------------------------

def rooted_body(n):
    r, p = D.get_rank(), D.get_world_size()
    fails = []
    for root in range(p):
        for op in OPS:
            dt = "int64" if op in BITWISE else "float64"
            x = contribution(r, n, dt, op)
            D.reduce(x, dst=root, op=getattr(D.ReduceOp, op))
            if r == root and not np.array_equal(x, expected(p, n, dt, op)):
                fails.append(("reduce", root, op))
        # scatter: root hands block k to rank k
        src_blocks = [np.full(n, 10 * root + k, np.float32) for k in range(p)] if r == root else None
        out = np.empty(n, np.float32)
        D.scatter(out, src_blocks, src=root)
        if not np.array_equal(out, np.full(n, 10 * root + r, np.float32)):
            fails.append(("scatter", root))
        # gather: every rank's block lands on root
        g = [np.empty(n, np.int64) for _ in range(p)] if r == root else None
        D.gather(np.full(n, r * 3, np.int64), g, dst=root)
        if r == root and not all(np.array_equal(g[k], np.full(n, k * 3)) for k in range(p)):
            fails.append(("gather", root))
    # all_to_all: block k of rank j goes to rank k
    ins = [np.full(n, 100 * r + k, np.int32) for k in range(p)]
    outs = [np.empty(n, np.int32) for _ in range(p)]
    D.all_to_all(outs, ins)
    if not all(np.array_equal(outs[j], np.full(n, 100 * j + r)) for j in range(p)):
        fails.append("all_to_all")
    arr_in = np.stack(ins)
    arr_out = np.empty_like(arr_in)
    D.all_to_all(arr_out, arr_in)
    if not np.array_equal(arr_out, np.stack(outs)):
        fails.append("all_to_all array form")
    # 1-D arrays of world_size elements: one element per rank, as the 2-D form
    one_in = np.array([100 * r + k for k in range(p)], np.float32)
    one_out = np.empty(p, np.float32)
    D.all_to_all(one_out, one_in)
    if not np.array_equal(one_out, np.array([100 * j + r for j in range(p)], np.float32)):
        fails.append(("all_to_all 1-D", one_out.tolist()))
    return fails


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_reduce_scatter_gather_all_to_all_from_every_root(world):
    for fails in ranks.run(rooted_body, world, args=(33,)):
        assert fails == []


def inputs_that_are_outputs():
    """all_to_all(a, a) and reduce_scatter(blocks[r], blocks), 20 times at each size (small ones, and ones that
    copy once through shared memory): how many results differ from NumPy's."""
    r, p = D.get_rank(), D.get_world_size()
    wrong = {"all_to_all": 0, "all_to_all lists": 0, "reduce_scatter": 0}
    for n in (3, 4099, (256 << 10) // 4 + 5):
        for _ in range(20):
            a = np.stack([np.full(n, float(r * p + j), np.float32) for j in range(p)])
            D.all_to_all(a, a)
            want = np.stack([np.full(n, float(j * p + r), np.float32) for j in range(p)])
            wrong["all_to_all"] += not np.array_equal(a, want)
            rows = [np.full(n, float(r * p + j), np.float32) for j in range(p)]  # separate arrays, in and out
            D.all_to_all(rows, rows)
            wrong["all_to_all lists"] += not np.array_equal(np.stack(rows), want)
            blocks = np.stack([np.arange(n, dtype=np.float32) + (r * p + j) for j in range(p)])
            D.reduce_scatter(blocks[r], blocks)
            want = p * np.arange(n, dtype=np.float32) + sum(k * p + r for k in range(p))
            wrong["reduce_scatter"] += not np.array_equal(blocks[r], want)
    return wrong


@pytest.mark.parametrize("world", [2, 4, 6])
def test_all_to_all_and_reduce_scatter_whose_output_is_their_input_reduce_right(world):
    # Note [Inputs that are also outputs] in cpu_backend.cpp: reduce_scatter's result was wrong every time,
    # all_to_all's in some calls.
    for wrong in ranks.run(inputs_that_are_outputs, world, timeout=120):
        assert wrong == {"all_to_all": 0, "all_to_all lists": 0, "reduce_scatter": 0}, wrong


def test_reduce_large_chunked():
    for fails in ranks.run(rooted_body, 3, args=(20000,), env={"CX_CHUNK_BYTES": 4096}):
        assert fails == []


def seed_scatter_example():
    # seed 000: rank 0 scatters [1.0], [2.0], [3.0]; rank k receives k + 1
    if D.get_rank() == 0:
        scatter_list = [np.array([1.0], np.float32), np.array([2.0], np.float32), np.array([3.0], np.float32)]
    else:
        scatter_list = [None]
    t = np.empty(1, np.float32)
    D.scatter(t, scatter_list if D.get_rank() == 0 else None, src=0)
    # and all_gather of the result, as in the guide
    tensor_list = [np.empty_like(t) for _ in range(D.get_world_size())]
    D.all_gather(tensor_list, t)
    return t.tolist(), [x.tolist() for x in tensor_list]


def test_seed_scatter_and_all_gather_examples():
    out = ranks.run(seed_scatter_example, 3)
    assert [t for t, _ in out] == [[1.0], [2.0], [3.0]]
    assert all(g == [[1.0], [2.0], [3.0]] for _, g in out)


# ---- send / recv, barrier ---------------------------------------------------------

def p2p_body():
    r, p = D.get_rank(), D.get_world_size()
    # a ring of messages: each rank sends to the right and receives from the left
    right, left = (r + 1) % p, (r - 1) % p
    out = np.arange(50, dtype=np.float32) + r
    got = np.empty(50, np.float32)
    if r % 2 == 0:
        D.send(out, right)
        D.recv(got, left)
    else:
        D.recv(got, left)
        D.send(out, right)
    # async send/recv pairs with rank 0
    if r == 0:
        hs = [D.recv(np.empty(3, np.int64), k, async_op=True) for k in range(1, p)]
        for h in hs:
            h.wait()
    else:
        D.send(np.array([r, r, r], np.int64), 0)
    for _ in range(3):
        D.barrier()
    return np.array_equal(got, np.arange(50, dtype=np.float32) + left)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_send_recv_ring_and_barrier(world):
    assert all(ranks.run(p2p_body, world))


# ---- async ---------------------------------------------------------------------------

def async_body():
    r, p = D.get_rank(), D.get_world_size()
    xs = [np.full(1000 * (i + 1), float(r + i), np.float32) for i in range(6)]
    works = [D.all_reduce(x, async_op=True) for x in xs]
    b = np.full(10, float(r), np.float64)
    wb = D.broadcast(b, src=p - 1, async_op=True)
    # a blocking call after async ones runs after them, in submission order
    y = np.ones(7, np.float32)
    D.all_reduce(y)
    assert all(w.wait(timeout=30) for w in works)
    wb.wait()
    assert all(w.is_completed() for w in works)
    ok = all(np.all(x == sum(k + i for k in range(p))) for i, x in enumerate(xs))
    return ok and np.all(b == p - 1) and np.all(y == p), repr(works[0])


@pytest.mark.parametrize("world", [1, 2, 4])
def test_async_work_handles_complete_in_submission_order(world):
    for ok, rep in ranks.run(async_body, world):
        assert ok
        assert "completed" in rep


def async_mix_body(order_seed):
    # Async sends and receives of small (sent by the caller at once: Note [Small sends that leave at once]) and
    # large messages, between async collectives, waited for in a shuffled order (a waiter runs what is queued up to
    # its own: Note [A waiter runs what it waits for]). Every message and sum must be what was sent, in order.
    r, p = D.get_rank(), D.get_world_size()
    rng = np.random.default_rng(order_seed + r)
    sizes = [4, 1024, 4096, 4097, 65536, 65537, 3, 300000, 16]
    works, checks = [], []
    for i, n in enumerate(sizes):
        x = np.full(5, float(r + i), np.float64)
        works.append(D.all_reduce(x, async_op=True))
        checks.append((x, np.full(5, float(sum(k + i for k in range(p))))))
        if r == 0:
            for dst in range(1, p):
                msg = (np.arange(n, dtype=np.uint8) + i + dst).astype(np.uint8)
                works.append(D.send(msg, dst, async_op=True))
        else:
            got = np.zeros(n, np.uint8)
            works.append(D.recv(got, 0, async_op=True))
            checks.append((got, (np.arange(n, dtype=np.uint8) + i + r).astype(np.uint8)))
    for k in rng.permutation(len(works)):
        works[k].wait()
    assert all(w.is_completed() for w in works)
    return all(np.array_equal(a, b) for a, b in checks)


@pytest.mark.parametrize("shm", ["0", "1"])
@pytest.mark.parametrize("world", [2, 3])
def test_async_sends_receives_and_collectives_waited_for_in_any_order_arrive_in_order(world, shm):
    for seed in (1, 2):
        assert all(ranks.run(async_mix_body, world, args=(seed,), env={"CX_SHM": shm}))


def small_send_leaves_at_once_body():
    # Rank 1 starts receiving only after rank 0 has looked at its async sends: a small message goes into the ring
    # (or the socket's buffer) at once, so its Work is complete when send returns, and it arrives intact.
    r = D.get_rank()
    go = np.zeros(1, np.int32)
    if r == 0:
        works = [D.send(np.full(64, k, np.int32), 1, async_op=True) for k in range(10)]
        done = [w.is_completed() for w in works]
        D.send(go, 1)
        for w in works:
            w.wait()
        return done
    time.sleep(0.3)  # rank 0's sends are made and answered by now, with nobody receiving
    got = []
    for k in range(10):
        x = np.zeros(64, np.int32)
        D.recv(x, 0)
        got.append(bool(np.all(x == k)))
    D.recv(go, 0)
    return got


@pytest.mark.parametrize("shm", ["0", "1"])
def test_a_small_async_send_is_complete_when_it_returns_and_arrives_intact(shm):
    done, got = ranks.run(small_send_leaves_at_once_body, 2, env={"CX_SHM": shm})
    assert done == [True] * 10
    assert got == [True] * 10


def unwaited_receive_body():
    # A small async receive that nobody waits for (polled with is_completed(), then a blocking call behind it) is
    # still run, by the communication thread (Note [A waiter runs what it waits for]): no hang.
    r = D.get_rank()
    if r == 0:
        time.sleep(0.2)
        D.send(np.arange(8, dtype=np.int64), 1)
        D.send(np.arange(8, dtype=np.int64) * 2, 1)
        D.barrier()
        return True
    first, second = np.zeros(8, np.int64), np.zeros(8, np.int64)
    w1 = D.recv(first, 0, async_op=True)
    w2 = D.recv(second, 0, async_op=True)
    deadline = time.monotonic() + 20
    while not w1.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)
    polled = w1.is_completed()
    D.barrier()  # behind w2: it runs first
    return polled and w2.is_completed() and np.array_equal(first, np.arange(8)) and \
        np.array_equal(second, np.arange(8) * 2)


@pytest.mark.parametrize("shm", ["0", "1"])
def test_a_small_async_receive_nobody_waits_for_completes_on_its_own(shm):
    assert all(ranks.run(unwaited_receive_body, 2, env={"CX_SHM": shm}))


def left_behind_body():
    # A waiter runs the queue up to its own operation and leaves the small message behind it to the next waiter for
    # a while (Note [A waiter runs what it waits for]). When nobody comes (is_completed() only), the communication
    # thread still runs it: a receive behind a waited receive, and a small send behind a waited large one.
    r = D.get_rank()
    deadline = time.monotonic() + 20

    def polled(w):
        while not w.is_completed() and time.monotonic() < deadline:
            time.sleep(0.001)
        return w.is_completed()

    big = np.arange(300000, dtype=np.uint8)
    if r == 0:
        for k in range(3):
            D.send(np.full(8, k, np.int64), 1)
        w_big = D.send(big, 1, async_op=True)
        w_small = D.send(np.full(8, 7, np.int64), 1, async_op=True)  # queued behind the large send
        w_big.wait()
        ok = polled(w_small)
        D.barrier()
        return ok
    got = [np.zeros(8, np.int64) for _ in range(3)]
    works = [D.recv(g, 0, async_op=True) for g in got]
    works[0].wait()
    ok = polled(works[1]) and polled(works[2])
    got_big, got_small = np.zeros_like(big), np.zeros(8, np.int64)
    D.recv(got_big, 0)
    D.recv(got_small, 0)
    D.barrier()
    return ok and all(np.all(g == k) for k, g in enumerate(got)) and np.array_equal(got_big, big) and \
        np.all(got_small == 7)


@pytest.mark.parametrize("shm", ["0", "1"])
def test_a_small_message_left_behind_a_waited_one_completes_with_nobody_waiting(shm):
    assert ranks.run(left_behind_body, 2, env={"CX_SHM": shm}) == [True, True]


def exchange_body(n, order):
    # Every rank sends n bytes to the next rank and receives the previous rank's, in one of the orders programs
    # write: the sends first, async (a halo exchange, torch's batch_isend_irecv) or blocking; or the receive posted
    # first (MPI's safe idiom), then the send async or blocking. Each of these once left every rank waiting for
    # the others: sends larger than the ring or the socket's buffer for receives queued behind the peers' sends
    # (Note [Sends that read while they wait] in mesh_transport.cpp), and a posted receive, at any size, for a
    # send queued behind the peer's receive (Note [Sends before receives] in process_group.cpp).
    r, p = D.get_rank(), D.get_world_size()
    mine = np.random.default_rng(r).integers(0, 256, n, dtype=np.uint8)
    got = np.zeros(n, np.uint8)
    nxt, prv = (r + 1) % p, (r - 1) % p
    for _ in range(2):
        got[:] = 0
        if order == "send-first":
            works = [D.send(mine, nxt, async_op=True), D.recv(got, prv, async_op=True)]
        elif order == "blocking-send-first":
            D.send(mine, nxt)
            works = [D.recv(got, prv, async_op=True)]
        elif order == "recv-first":
            works = [D.recv(got, prv, async_op=True), D.send(mine, nxt, async_op=True)]
        else:  # recv-first, then a blocking send
            works = [D.recv(got, prv, async_op=True)]
            D.send(mine, nxt)
        for w in works:
            w.wait()
        want = np.random.default_rng(prv).integers(0, 256, n, dtype=np.uint8)
        if not np.array_equal(got, want):
            return False
    x = np.full(4, float(r + 1))
    D.all_reduce(x)  # the group goes on as usual after it
    return bool(np.all(x == p * (p + 1) / 2))


@pytest.mark.parametrize("order", ["send-first", "blocking-send-first", "recv-first", "recv-first-blocking-send"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("shm", ["0", "1"])
def test_ranks_exchanging_messages_in_any_order_do_not_wait_for_each_other(shm, world, order):
    # 8 B, and 4 MiB: four times the shared-memory ring; over TCP the socket's buffer is set to its smallest
    # (64 KiB).
    env = {"CX_SHM": shm, "CX_SOCKET_BUFFER_BYTES": "65536", "DISTRIBUTED_OPERATION_TIMEOUT_MS": "30000"}
    for n in (8, 4 << 20):
        assert ranks.run(exchange_body, world, args=(n, order), env=env, timeout=120) == [True] * world, n


def relay_body(n):
    # A chain 0 -> 1 -> 2: rank 1 posts the receive and then the send of that same buffer without waiting in
    # between. A send passes only receives whose memory it does not read (Note [Sends before receives]), so this
    # one still goes after its receive, and rank 2 gets rank 0's bytes.
    r = D.get_rank()
    x = np.zeros(n, np.uint8)
    if r == 0:
        x[:] = np.arange(n) % 251
        D.send(x, 1)
    elif r == 1:
        works = [D.recv(x, 0, async_op=True), D.send(x, 2, async_op=True)]
        for w in works:
            w.wait()
    else:
        D.recv(x, 1)
    return bool(np.array_equal(x, np.arange(n) % 251))


@pytest.mark.parametrize("shm", ["0", "1"])
def test_a_send_of_the_buffer_a_queued_receive_fills_still_goes_after_it(shm):
    for n in (8, 1 << 20):
        assert ranks.run(relay_body, 3, args=(n,), env={"CX_SHM": shm}) == [True] * 3, n


def small_async_sends_to_a_dead_peer():
    # Small async sends leave on the caller's thread (Note [Small sends that leave at once]): the error one of them
    # meets is the Work's, raised by wait() with the peer named, not by send itself (the sends before it return).
    import os

    if D.get_rank() == 1:
        os._exit(3)
    time.sleep(0.5)
    msg = np.zeros(256, np.uint8)
    for k in range(200000):  # until the ring or the socket shows the peer gone
        w = D.send(msg, 1, async_op=True)  # raises only once an earlier Work failed and poisoned the group
        try:
            w.wait()
        except D.DistributedError as e:
            return k, type(e).__name__, str(e)
    return None


@pytest.mark.parametrize("shm", ["0", "1"])
def test_a_small_async_send_to_a_dead_peer_raises_from_wait_naming_it(shm):
    outs = ranks.spawn(small_async_sends_to_a_dead_peer, 2, env={"CX_SHM": shm,
                                                                 "DISTRIBUTED_OPERATION_TIMEOUT_MS": 15000}, timeout=90)
    assert outs[0].ok, outs[0]
    assert outs[0].value is not None, "200000 sends to a dead rank all succeeded"
    k, kind, message = outs[0].value
    assert kind == "DistributedConnectionError", (kind, message)
    assert "rank 1" in message and "send" in message, message


def send_to_a_rank_in_a_collective():
    # Rank 0 sends 64 MiB to rank 2, which is in an all_reduce with rank 1 and never reads it; rank 2's ring frames
    # of that all_reduce lie unread in rank 0's socket (Note [A send whose peer sent something else]).
    r = D.get_rank()
    t0, c0 = time.monotonic(), time.process_time()
    try:
        if r == 0:
            D.send(np.ones(16 << 20, np.float32), 2)
        else:
            D.all_reduce(np.ones(1 << 20, np.float32))
        err = None
    except D.DistributedError as e:
        err = (type(e).__name__, str(e))
    return err, time.monotonic() - t0, time.process_time() - c0


def test_a_send_whose_peer_is_in_a_collective_sleeps_until_its_deadline():
    # Over TCP the send used to wake at once, again and again, for the readable socket: a core spinning until the
    # deadline. Through shared memory it sleeps on its doorbell.
    outs = ranks.spawn(send_to_a_rank_in_a_collective, 3, timeout=90,
                       env={"DISTRIBUTED_OPERATION_TIMEOUT_MS": 3000})
    assert all(o.ok for o in outs), outs
    for r, o in enumerate(outs):
        err, _, _ = o.value
        assert err is not None and err[0] == "DistributedTimeoutError", (r, err)
    err, wall, cpu = outs[0].value
    # its own timeout waiting for rank 2, or rank 2's, which rank 2 sent it
    assert "rank 2" in err[1] and "send/recv(count=16777216, dtype=float32, src=0)" in err[1], err
    assert wall > 2.5, wall
    assert cpu < 0.2 * wall, (cpu, wall)  # asleep, not polling


def send_to_a_rank_that_gave_up():
    # Rank 1 receives int32 where rank 0 sends float32: it raises the mismatch, tells rank 0 (its ABORT frame) and
    # stays on for 6 s, its connections open, as a program that catches the error may.
    r = D.get_rank()
    t0 = time.monotonic()
    try:
        if r == 0:
            D.send(np.ones(16 << 20, np.float32), 1)
        else:
            D.recv(np.ones(16 << 20, np.int32), 0)
        err = None
    except D.DistributedError as e:
        err = (type(e).__name__, str(e))
    wall = time.monotonic() - t0
    if r == 1:
        time.sleep(6)
    return err, wall


def test_a_send_whose_peer_gave_up_raises_its_reason_at_once():
    # Over TCP the send used to find the peer's ABORT frame only once the peer's process had gone (6 s here).
    outs = ranks.spawn(send_to_a_rank_that_gave_up, 2, timeout=90,
                       env={"DISTRIBUTED_OPERATION_TIMEOUT_MS": 30000})
    assert all(o.ok for o in outs), outs
    for r, o in enumerate(outs):
        err, _ = o.value
        assert err is not None and err[0] == "CollectiveMismatchError", (r, err)
        assert "dtype=int32" in err[1] and "dtype=float32" in err[1], (r, err)
    err, wall = outs[0].value
    assert "rank 1 aborted the group" in err[1], err
    assert wall < 4.0, wall


# ---- keyword arguments ---------------------------------------------------------------
# The module's collectives read their keywords before pybind11 does (Note [Keyword arguments before pybind11's
# dispatcher] in csrc/bindings/keywords.h): every form a caller writes must land each value in its parameter.

def keyword_forms_body():
    r, p = D.get_rank(), D.get_world_size()
    total = sum(range(1, p + 1))
    got = {}
    x = np.full(5, float(r + 1), np.float32)
    D.all_reduce(x, op=D.ReduceOp.MAX)
    got["op="] = x.tolist() == [float(p)] * 5
    x = np.full(5, float(r + 1), np.float32)
    w = D.all_reduce(x, async_op=True)  # op left out before a keyword: its default, SUM
    got["async_op= after a gap"] = w.wait() and x.tolist() == [float(total)] * 5
    x = np.full(5, float(r + 1), np.float32)
    w = D.all_reduce(dtype=None, async_op=True, op=D.ReduceOp.MIN, arr=x)  # every one by name, out of order
    got["all by name"] = w.wait() and x.tolist() == [1.0] * 5
    x = np.full(5, float(r + 1), np.float32)
    kw = {"o" + "p": D.ReduceOp.PRODUCT}  # a name made at run time (not the interned string)
    D.all_reduce(x, **kw)
    got["built name"] = x.tolist() == [float(np.prod(np.arange(1, p + 1)))] * 5
    b = np.full(3, float(r), np.float64)
    D.broadcast(b, src=p - 1)
    got["broadcast src="] = b.tolist() == [float(p - 1)] * 3
    b = np.full(3, float(r), np.float64)
    D.reduce(b, op=D.ReduceOp.MAX, dst=p - 1)  # dst after op, by name
    got["reduce dst= op="] = r != p - 1 or b.tolist() == [float(p - 1)] * 3
    out = np.zeros((p, 2), np.int32)
    D.all_gather(arr=np.full(2, r, np.int32), out=out)
    got["all_gather by name"] = out.tolist() == [[k, k] for k in range(p)]
    got["barrier async_op="] = D.barrier(async_op=True).wait()
    errors = []
    for call in (lambda: D.all_reduce(x, opp=D.ReduceOp.SUM),         # an unknown keyword
                 lambda: D.all_reduce(x, D.ReduceOp.SUM, op=D.ReduceOp.SUM),  # op twice
                 lambda: D.all_reduce(op=D.ReduceOp.SUM),             # arr missing
                 lambda: D.all_reduce(x, op="SUM")):                  # op of the wrong type
        try:
            call()
            errors.append("no error")
        except TypeError as e:
            errors.append(str(e))
    return got, errors


@pytest.mark.parametrize("world", [1, 3])
def test_collectives_take_every_keyword_form_and_refuse_bad_ones_by_pybind11s_message(world):
    for got, errors in ranks.run(keyword_forms_body, world):
        assert all(got.values()), got
        assert "opp=" in errors[0] and "all_reduce(): incompatible function arguments" in errors[0], errors
        assert all("all_reduce(): incompatible function arguments" in e for e in errors[1:]), errors
        assert "'SUM'" in errors[3], errors


# ---- the world of one, in this very process ---------------------------------------

def test_plain_process_without_launcher_is_a_world_of_one(monkeypatch):
    for v in ["RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
              "PMI_RANK", "PMI_SIZE"]:
        monkeypatch.delenv(v, raising=False)
    D.init()
    try:
        assert D.is_initialized() and D.get_rank() == 0 and D.get_world_size() == 1 and D.is_master()
        x = np.arange(4, dtype=np.float32)
        D.all_reduce(x, op=D.ReduceOp.AVG)
        assert x.tolist() == [0, 1, 2, 3]
        out = np.empty((1, 4), np.float32)
        D.all_gather(out, x)
        assert out.tolist() == [[0, 1, 2, 3]]
        D.barrier()
    finally:
        D.finalize()
    assert not D.is_initialized()
