"""Ranks on one host move data through shared memory (Note [Same-host pairs] in
csrc/distributed/transport/shm/negotiate.cpp); these tests check that they do, that the rings
carry every byte right when messages wrap around a tiny ring, that a pair falls back to TCP
when either side cannot or will not share memory, and that nothing is left in /dev/shm.

The collectives and error suites (test_collectives.py, test_errors.py) run in full over both
transports; this file covers what only shared memory has.
"""
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import ranks
from refs import contribution, expected

import pycyxwiz as cx

D = cx.distributed


def mapped_segments():
    """Shared-memory segments this process has mapped (their files are already unlinked)."""
    with open("/proc/self/maps") as f:
        return sorted({line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
                       for line in f if "/dev/shm/cx-" in line})


def segments_after_one_all_reduce():
    x = np.ones(1000, np.float32)
    D.all_reduce(x)
    return mapped_segments(), float(x[0])


def left_behind(names):
    """Which of these segment files (a job's own, as its ranks mapped them) are still in /dev/shm.
    Only the job's own: tests running beside this one (pytest -n) have files of their own."""
    return [n for n in names if os.path.exists(n)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ranks_on_one_host_map_each_others_rings_by_default(world, monkeypatch):
    monkeypatch.delenv("CX_SHM", raising=False)
    for segs, total in ranks.run(segments_after_one_all_reduce, world):
        assert total == world
        assert len(segs) == world, segs  # its own segment and one per peer


def test_cx_shm_0_keeps_every_pair_on_tcp(monkeypatch):
    monkeypatch.setenv("CX_SHM", "0")
    for segs, total in ranks.run(segments_after_one_all_reduce, 3):
        assert total == 3
        assert segs == []


def test_a_rank_that_opts_out_talks_tcp_with_everyone_and_the_others_still_share(monkeypatch):
    monkeypatch.delenv("CX_SHM", raising=False)
    outs = ranks.run(segments_after_one_all_reduce, 3, per_rank_env={1: {"CX_SHM": "0"}})
    assert [t for _, t in outs] == [3.0, 3.0, 3.0]
    assert len(outs[0][0]) == 2 and len(outs[2][0]) == 2  # own + each other's
    assert outs[1][0] == []


def test_ring_sizes_that_differ_fall_back_to_tcp_for_those_pairs(monkeypatch):
    monkeypatch.delenv("CX_SHM", raising=False)
    outs = ranks.run(segments_after_one_all_reduce, 3, per_rank_env={0: {"CX_SHM_RING_BYTES": "8192"}})
    assert [t for _, t in outs] == [3.0, 3.0, 3.0]
    # Rank 0 made its segment with another size: nobody maps it and it maps nobody's.
    assert outs[0][0] == []
    assert len(outs[1][0]) == 2 and len(outs[2][0]) == 2


def tiny_ring_body(sizes):
    r, p = D.get_rank(), D.get_world_size()
    bad = []
    for n in sizes:
        x = contribution(r, n, "float32", "SUM")
        D.all_reduce(x)
        if not np.array_equal(x, expected(p, n, "float32", "SUM")):
            bad.append(f"all_reduce n={n}")
        y = np.arange(n, dtype=np.float64) * (r + 1) if r == 1 else np.zeros(n, np.float64)
        D.broadcast(y, src=1)
        if not np.array_equal(y, np.arange(n, dtype=np.float64) * 2):
            bad.append(f"broadcast n={n}")
        mine = np.full(n, r, np.int32)
        out = np.empty((p, n), np.int32)
        D.all_gather(out, mine)
        if not np.array_equal(out, np.repeat(np.arange(p, dtype=np.int32), n).reshape(p, n)):
            bad.append(f"all_gather n={n}")
    return bad, len(mapped_segments())


@pytest.mark.parametrize("world", [2, 3])
def test_messages_much_larger_than_the_ring_wrap_around_it_intact(world, monkeypatch):
    # A 4 KiB ring: 40-byte headers and odd payloads split across its end all the time.
    monkeypatch.delenv("CX_SHM", raising=False)
    sizes = [0, 1, 7, 1001, 4099, 100003, 1 << 20]
    for bad, nsegs in ranks.run(tiny_ring_body, world, args=(sizes,), env={"CX_SHM_RING_BYTES": "4096",
                                                                            "CX_CHUNK_BYTES": "3000"}):
        assert bad == []
        assert nsegs == world


def test_nothing_is_left_in_dev_shm_after_a_run_or_a_crash(monkeypatch, tmp_path):
    monkeypatch.delenv("CX_SHM", raising=False)
    names = sorted({n for segs, _ in ranks.run(segments_after_one_all_reduce, 3) for n in segs})
    assert len(names) == 3 and all(n.startswith("/dev/shm/cx-") for n in names), names
    assert left_behind(names) == []
    # A rank killed mid-collective: the files were unlinked at init, so still nothing.
    outs = ranks.spawn(die_after_setup, 3, args=(str(tmp_path),), timeout=60)
    assert outs[1].exc_type == "Died"
    assert all(o.is_a("DistributedConnectionError") for o in outs if o.rank != 1), outs
    names = sorted({n for f in tmp_path.iterdir() for n in f.read_text().split()})
    assert len(names) == 3, names
    assert left_behind(names) == []


def die_after_setup(folder):
    x = np.ones(1 << 18, np.float32)
    D.all_reduce(x)
    with open(os.path.join(folder, f"segments{D.get_rank()}"), "w") as f:
        f.write(" ".join(mapped_segments()))
    if D.get_rank() == 1:
        os._exit(9)
    for _ in range(20):
        D.all_reduce(x)


def gather_then_leave():
    r = D.get_rank()
    if r == 0:
        time.sleep(0.1)
    if r == 2:
        time.sleep(0.3)
    x = np.full(1000, r, np.float32)
    out = np.empty((3, 1000), np.float32) if r == 1 else None
    D.gather(x, out, dst=1)
    return None if out is None else out[:, 0].tolist()


def test_a_peer_that_finished_and_left_is_not_taken_for_dead(monkeypatch):
    # Rank 0 writes its block into rank 1's ring and finalizes at once, closing its socket,
    # while rank 1 still waits for rank 2 over TCP (CX_SHM=0 there): rank 1 sees rank 0's
    # socket close before it has read rank 0's bytes, and must read them, not fail.
    monkeypatch.delenv("CX_SHM", raising=False)
    outs = ranks.run(gather_then_leave, 3, per_rank_env={2: {"CX_SHM": "0"}})
    assert outs[1] == [0.0, 1.0, 2.0]


def die_and_time_the_others():
    r = D.get_rank()
    x = np.ones(1 << 16, np.float32)
    D.all_reduce(x)
    if r == 1:
        time.sleep(0.5)  # the others are asleep on their doorbells by now
        os._exit(9)
    t0 = time.monotonic()
    try:
        D.all_reduce(x)
    except cx.distributed.DistributedConnectionError as e:
        return time.monotonic() - t0, str(e)
    return None


def test_a_peer_killed_while_the_others_sleep_on_shared_memory_is_noticed_at_once(monkeypatch):
    # Noticed through its closed socket within a sleep slice (20 ms), not at the 30 s deadline.
    monkeypatch.delenv("CX_SHM", raising=False)
    outs = ranks.spawn(die_and_time_the_others, 3, env={"DISTRIBUTED_OPERATION_TIMEOUT_MS": 30000}, timeout=60)
    assert outs[1].exc_type == "Died"
    for o in (outs[0], outs[2]):
        assert o.ok and o.value is not None, o
        waited, message = o.value
        assert waited < 2.5, waited  # 0.5 s of it is the sleep; measured 0.51 s
        assert "rank 1" in message and "all_reduce" in message, message


def test_segment_files_of_ranks_killed_during_init_are_removed_at_the_next_init(monkeypatch):
    # A rank killed between making its segment and its peers mapping it leaves the file
    # (Note [Segments of dead ranks] in csrc/distributed/transport/shm/shm.cpp). Planted here:
    monkeypatch.delenv("CX_SHM", raising=False)
    ns = os.stat("/proc/self/ns/pid").st_ino
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    tag = f"{os.getpid() & 0xffff:04x}"
    files = {
        "dead maker": f"/dev/shm/cx-{tag}00000000dead-1-{ns}-{gone.pid}",
        "live maker": f"/dev/shm/cx-{tag}00000000a11e-0-{ns}-{os.getpid()}",
        "another namespace": f"/dev/shm/cx-{tag}0000000f0e1-0-{ns + 1}-{gone.pid}",
        "another namespace, old": f"/dev/shm/cx-{tag}00000000010d-0-{ns + 1}-{gone.pid}",
    }
    try:
        for path in files.values():
            with open(path, "wb") as f:
                f.write(b"\0" * 4096)
        old = time.time() - 2 * 3600
        os.utime(files["another namespace, old"], (old, old))
        for segs, total in ranks.run(segments_after_one_all_reduce, 2):
            assert total == 2 and len(segs) == 2
        left = {what for what, path in files.items() if os.path.exists(path)}
        assert left == {"live maker", "another namespace"}
    finally:
        for path in files.values():
            if os.path.exists(path):
                os.unlink(path)


# ---- single copies of large messages (Note [Single-copy large messages] in shm/shm.h) ----------------------

def _single_copy_allowed() -> bool:
    """What the transport will find: Yama (where the kernel has it) lets a process read a sibling's memory with
    process_vm_readv only at ptrace_scope 0, unless it runs as root (CAP_SYS_PTRACE)."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = int(f.read())
    except OSError:
        return True
    return scope == 0 or (os.geteuid() == 0 and scope < 3)


def large_collectives():
    r, p = D.get_rank(), D.get_world_size()
    n = (3 << 20) // 4 + 5  # 3 MiB of float32 and a little: past the single-copy threshold, not a multiple of p
    x = contribution(r, n, "float32", "SUM")
    D.all_reduce(x)
    ok = {"all_reduce": np.array_equal(x, expected(p, n, "float32", "SUM"))}
    b = np.arange(n, dtype=np.float64) * (r + 1)
    D.broadcast(b, src=p - 1)
    ok["broadcast"] = np.array_equal(b, np.arange(n, dtype=np.float64) * p)
    m = (1 << 20) + 3
    out = np.zeros((p, m), np.float32)
    D.all_gather(out, np.full(m, float(r), np.float32))
    ok["all_gather"] = np.array_equal(out, np.repeat(np.arange(p, dtype=np.float32)[:, None], m, 1))
    mine = np.zeros(m, np.float32)
    D.reduce_scatter(mine, np.stack([np.full(m, float(r * p + j), np.float32) for j in range(p)]))
    ok["reduce_scatter"] = np.array_equal(mine, np.full(m, float(sum(k * p + r for k in range(p))), np.float32))
    y = contribution(r, n, "float32", "MAX")
    D.reduce(y, dst=p - 1, op=D.ReduceOp.MAX)
    ok["reduce"] = r != p - 1 or np.array_equal(y, expected(p, n, "float32", "MAX"))
    got = np.zeros(m, np.float32)
    D.scatter(got, [np.full(m, float(j), np.float32) for j in range(p)] if r == 0 else None, src=0)
    ok["scatter"] = np.array_equal(got, np.full(m, float(r), np.float32))
    outs = [np.zeros(m, np.float32) for _ in range(p)] if r == p - 1 else None
    D.gather(np.full(m, float(r), np.float32), outs, dst=p - 1)
    ok["gather"] = r != p - 1 or all(np.array_equal(o, np.full(m, float(j), np.float32)) for j, o in enumerate(outs))
    a2a = np.zeros((p, m), np.float32)
    D.all_to_all(a2a, np.stack([np.full(m, float(r * p + j), np.float32) for j in range(p)]))
    ok["all_to_all"] = np.array_equal(a2a, np.stack([np.full(m, float(j * p + r), np.float32) for j in range(p)]))
    z = np.full(n, float(r), np.float32)
    if r == 0:
        D.send(z, 1)
    elif r == 1:
        D.recv(z, 0)
    ok["send/recv"] = r != 1 or np.array_equal(z, np.zeros(n, np.float32))
    if p == 4:  # 2 MiB on 4 ranks: halving-doubling, at the threshold
        h = contribution(r, (2 << 20) // 4, "float32", "SUM")
        D.all_reduce(h)
        ok["halving-doubling"] = np.array_equal(h, expected(p, (2 << 20) // 4, "float32", "SUM"))
    return ok, int(cx._core.dist._single_copies())


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("single_copy", ["default", "0"])
def test_large_messages_are_copied_once_where_the_kernel_allows_and_arrive_intact_either_way(world, single_copy,
                                                                                             monkeypatch):
    monkeypatch.delenv("CX_SHM", raising=False)
    env, copied = _single_copy_setting(single_copy)
    for ok, copies in ranks.run(large_collectives, world, env=env, timeout=120):
        assert all(ok.values()), ok
        assert (copies > 0) == copied, (copies, copied)


def _single_copy_setting(single_copy: str) -> tuple[dict, bool]:
    """The ranks' environment for a test's CX_SHM_SINGLE_COPY setting ("default" or "0"), and whether their large
    messages will be copied once under it."""
    if single_copy == "default":
        return {}, _single_copy_allowed()
    return {"CX_SHM_SINGLE_COPY": single_copy}, False


def _copies_now() -> int:
    return int(cx._core.dist._single_copies())


def mid_size_collectives():
    """Each collective once at a size below 2 MiB, with messages of 64 KiB or more: its values, and how many
    single copies this rank made in it."""
    r, p = D.get_rank(), D.get_world_size()
    m = (256 << 10) // 4 + 7  # a block of 256 KiB and a little, per rank
    got = {}

    def run(name, call, check):
        before = _copies_now()
        call()
        got[name] = (bool(check()), _copies_now() - before)

    out = np.zeros((p, m), np.float32)
    run("all_gather", lambda: D.all_gather(out, np.full(m, float(r), np.float32)),
        lambda: np.array_equal(out, np.repeat(np.arange(p, dtype=np.float32)[:, None], m, 1)))
    mine = np.zeros(m, np.float32)
    blocks = np.stack([np.full(m, float(r * p + j), np.float32) for j in range(p)])
    run("reduce_scatter", lambda: D.reduce_scatter(mine, blocks),
        lambda: np.array_equal(mine, np.full(m, float(sum(k * p + r for k in range(p))), np.float32)))
    a2a = np.zeros((p, m), np.float32)
    run("all_to_all", lambda: D.all_to_all(a2a, blocks),
        lambda: np.array_equal(a2a, np.stack([np.full(m, float(j * p + r), np.float32) for j in range(p)])))
    part = np.zeros(m, np.float32)
    run("scatter", lambda: D.scatter(part, blocks if r == 0 else None, src=0),
        lambda: np.array_equal(part, np.full(m, float(r), np.float32)))
    outs = np.zeros((p, m), np.float32) if r == p - 1 else None
    run("gather", lambda: D.gather(np.full(m, float(r), np.float32), outs, dst=p - 1),
        lambda: r != p - 1 or np.array_equal(outs, np.repeat(np.arange(p, dtype=np.float32)[:, None], m, 1)))
    n = (1 << 20) // 4 + 3  # 1 MiB and a little
    b = np.arange(n, dtype=np.float32) * (r + 1)
    run("broadcast", lambda: D.broadcast(b, src=p - 1), lambda: np.array_equal(b, np.arange(n, dtype=np.float32) * p))
    x = contribution(r, n, "float32", "SUM")
    run("all_reduce", lambda: D.all_reduce(x), lambda: np.array_equal(x, expected(p, n, "float32", "SUM")))
    z = np.full(n, float(r), np.float32)
    run("send/recv", lambda: D.send(z, 1) if r == 0 else D.recv(z, 0) if r == 1 else None,
        lambda: r != 1 or np.array_equal(z, np.zeros(n, np.float32)))
    k = (16 << 10) // 4 + 1  # 16 KiB and a little: single copies only where every rank has a core
    small = np.zeros((p, k), np.float32)
    run("small all_gather", lambda: D.all_gather(small, np.full(k, float(r), np.float32)),
        lambda: np.array_equal(small, np.repeat(np.arange(p, dtype=np.float32)[:, None], k, 1)))
    c = np.arange(k, dtype=np.float32) * (r + 1)
    run("small broadcast", lambda: D.broadcast(c, src=0), lambda: np.array_equal(c, np.arange(k, dtype=np.float32)))
    return got


@pytest.mark.parametrize("world", [2, 3, 4])
def test_below_2_mib_gathers_reduce_scatters_all_to_alls_and_scatters_copy_once_and_broadcasts_mostly(world,
                                                                                                     monkeypatch):
    # From 64 KiB messages; from 8 KiB where every rank on the host has a core.
    # Note [Single-copy large messages] in shm.h: which collectives take single copies below 2 MiB, and that what
    # they move arrives intact either way. The 1 MiB broadcast on 4 ranks goes from the root to all, in single
    # copies wherever the ranks run (Note [Broadcast from the root to all] in broadcast.cpp; on 3 ranks not from
    # 768 KiB to 4 MiB).
    monkeypatch.delenv("CX_SHM", raising=False)
    allowed = _single_copy_allowed()
    core_each = world <= os.sysconf("SC_NPROCESSORS_ONLN")
    # Gathers keep two copies (the root would copy every block itself, one after the other).
    want = {"all_gather": allowed, "reduce_scatter": allowed, "all_to_all": allowed, "scatter": allowed,
            "gather": False, "broadcast": allowed and (core_each or world == 4),
            "all_reduce": False, "send/recv": False, "small all_gather": allowed and core_each,
            "small broadcast": allowed and core_each}
    got = ranks.run(mid_size_collectives, world, timeout=120)
    for name, copied in want.items():
        assert all(g[name][0] for g in got), (name, [g[name] for g in got])
        copies = sum(g[name][1] for g in got)
        assert (copies > 0) == copied, (name, copies, copied, world)


# ---- the broadcast from the root to all (Note [Broadcast from the root to all] in broadcast.cpp) -------------------

STAR_SIZES = (64 << 10, (64 << 10) + 4, (768 << 10) - 4, 768 << 10, (2 << 20) - 4, 2 << 20, (4 << 20) - 4, 4 << 20)


def broadcasts_from_every_root():
    """Broadcasts around the bounds of the root-to-all broadcast, from every root: whether each arrived intact,
    and how many single copies this rank made in it; and the setup as the group describes it."""
    r, p = D.get_rank(), D.get_world_size()
    rows = []
    for nbytes in STAR_SIZES:
        want = np.arange(nbytes // 4, dtype=np.float32)
        for root in range(p):
            b = want * (r + 1)
            before = _copies_now()
            D.broadcast(b, src=root)
            rows.append((nbytes, root, bool(np.array_equal(b, want * (root + 1))), _copies_now() - before))
    return rows, cx._core.dist._describe_setup()


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("single_copy", ["default", "0"])
def test_broadcasts_on_more_than_two_ranks_go_from_the_root_to_all_in_one_copy_each(world, single_copy,
                                                                                    monkeypatch):
    # Above 64 KiB (but not from 768 KiB to 4 MiB on 3 ranks), where every pair copies once: each receiver reads
    # the root's buffer once, from whichever root; elsewhere, and with CX_SHM_SINGLE_COPY=0, the tree or the chain.
    monkeypatch.delenv("CX_SHM", raising=False)
    env, allowed = _single_copy_setting(single_copy)
    core_each = world <= os.sysconf("SC_NPROCESSORS_ONLN")
    for rank, (rows, setup) in enumerate(ranks.run(broadcasts_from_every_root, world, env=env, timeout=120)):
        assert ("else from the root to every rank at once (single copies)" in setup) == allowed, setup
        assert ("a pipelined chain from 786432 to 4194304 bytes" in setup) == (allowed and world == 3), setup
        assert len(rows) == len(STAR_SIZES) * world
        for nbytes, root, ok, copies in rows:
            assert ok, (rank, nbytes, root)
            star = allowed and nbytes > (64 << 10) and not (world == 3 and (768 << 10) <= nbytes < (4 << 20))
            if rank == root:
                assert copies == 0, (rank, nbytes, root, copies)
            elif star:
                assert copies == 1, (rank, nbytes, root, copies)
            elif not (allowed and core_each and nbytes < (2 << 20)):  # else the size rule's single copies
                assert copies == 0, (rank, nbytes, root, copies)


# ---- ranks that share cores with other programs (Note [Ranks that share cores with other programs]) -------------

def all_reduces_beside_busy_programs():
    r, p = D.get_rank(), D.get_world_size()
    before = int(cx._core.dist._slept_for_others())
    ok = True
    for n in (2, 1000, (64 << 10) + 3):
        for _ in range(30):
            x = contribution(r, n, "float32", "SUM")
            D.all_reduce(x)
            ok = ok and bool(np.array_equal(x, expected(p, n, "float32", "SUM")))
    return ok, int(cx._core.dist._slept_for_others()) - before


@pytest.mark.skipif(os.sysconf("SC_NPROCESSORS_ONLN") >= 4,
                    reason="needs more ranks (4) than cores on this host")
def test_ranks_sharing_cores_with_busy_programs_sleep_without_spinning_and_still_reduce_right(monkeypatch):
    monkeypatch.delenv("CX_SHM", raising=False)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(2)]
    try:
        got = ranks.run(all_reduces_beside_busy_programs, 4, timeout=120)
    finally:
        for b in busy:
            b.kill()
            b.wait()
    assert all(ok for ok, _ in got), got
    assert sum(slept for _, slept in got) > 0, got


def die_around_a_large_message(how):
    D.init()  # not the harness's: its finalize would raise the loss of rank 1 again, over our result
    r = D.get_rank()
    x = np.ones(4 << 20, np.float32)  # 16 MiB: every message is a single copy where allowed
    D.all_reduce(x)
    if r == 1:
        if how == "left its buffer's address":
            w = D.send(x, 0, async_op=True)  # noqa: F841  kept: dropping an unfinished Work waits for it
            time.sleep(0.05)  # the address is on its way to rank 0, which reads it after we are gone
        else:
            time.sleep(0.3)  # the others' sends to us wait for our acknowledgement by now
        os._exit(9)
    t0 = time.monotonic()
    try:
        if how == "left its buffer's address":
            if r == 0:
                time.sleep(0.5)
                D.recv(x, 1)
            else:
                return None
        else:
            D.all_reduce(x)
    except cx.distributed.DistributedConnectionError as e:
        return time.monotonic() - t0, str(e)
    return "no error"


@pytest.mark.parametrize("how", ["left its buffer's address", "died while the others send to it"])
def test_a_peer_that_dies_around_a_single_copy_is_named_on_the_others(how, monkeypatch):
    monkeypatch.delenv("CX_SHM", raising=False)
    outs = ranks.spawn(die_around_a_large_message, 3, args=(how,), env={"DISTRIBUTED_OPERATION_TIMEOUT_MS": 30000},
                       timeout=60, init=False)
    assert outs[1].exc_type == "Died"
    for o in (outs[0], outs[2]) if how != "left its buffer's address" else (outs[0],):
        assert o.ok and isinstance(o.value, tuple), o
        waited, message = o.value
        assert waited < 5, waited
        assert "rank 1" in message and ("exited, crashed or was killed" in message or "lost" in message), message


def fit_a_wide_model():
    import digits

    Xtr, ytr, _, _ = digits.split()
    m = cx.SequentialModel()  # 64-1024-1024-10: 1.1 M parameters, 4.5 MB of gradients: single copies
    m.add(cx.LinearModule(64, 1024, seed=3))
    m.add(cx.ReLUModule())
    m.add(cx.LinearModule(1024, 1024, seed=4))
    m.add(cx.ReLUModule())
    m.add(cx.LinearModule(1024, 10, seed=5))
    trainer = D.DistributedTrainer(m, cx.CrossEntropyLoss(), cx.AdamOptimizer(1e-3))
    trainer.fit(Xtr[:512], ytr[:512], D.DistributedTrainingConfig(epochs=1, batch_size=64, verbose=False, seed=1))
    return m.flat_parameters().copy(), int(cx._core.dist._single_copies())


def test_training_with_single_copies_is_bitwise_the_training_with_two(monkeypatch):
    # The trainer's gradient all-reduce (buckets with the fused non-finite check) over the same path: a single
    # copy moves the same bytes, so the parameters must not differ by a bit.
    monkeypatch.delenv("CX_SHM", raising=False)
    one = ranks.run(fit_a_wide_model, 2, timeout=120)
    two = ranks.run(fit_a_wide_model, 2, env={"CX_SHM_SINGLE_COPY": "0"}, timeout=120)
    assert all(c == 0 for _, c in two)
    assert all((c > 0) == _single_copy_allowed() for _, c in one), [c for _, c in one]
    for (p1, _), (p2, _) in zip(one, two):
        assert np.array_equal(p1, p2)
    assert np.array_equal(one[0][0], one[1][0])
