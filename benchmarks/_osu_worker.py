"""One rank of benchmarks/osu.py: the OSU Micro-Benchmarks' Python tests (OMB-Py), their loops as OMB-Py runs
them, for pycyxwiz or for mpi4py.

    python -m benchmarks._osu_worker --lib mpi --out DIR --tests latency allreduce --max-pt2pt 4194304 ...

Started by benchmarks.osu through benchmarks._launch (never by hand). What OMB-Py 7.2 does (python/mpi/ of the
OSU Micro-Benchmarks), per test and message size, powers of two:
  - latency (2 ranks): rank 0 sends `size` bytes to rank 1 and receives them back, `iterations` round trips
    after `skip` warm-ups, timed as one block; each rank's latency is its block's time / (2 iterations), and the
    figure is the mean over the ranks (util.avg_lat). Sizes from 0 B.
  - bw (2 ranks): rank 0 posts a window of 64 non-blocking sends of `size` bytes, waits for them all, and
    receives a 4-byte answer, which rank 1 sends after its 64 non-blocking receives completed; the figure is
    rank 0's size x 64 x iterations / time, in MB/s (10^6 bytes). Defaults there: 100 iterations (30 above
    8 KiB), 10 warm-ups (3).
  - allreduce, reduce_scatter (float32 sum, `size` bytes in), bcast, allgather (bytes; allgather's `size` is
    each rank's part), barrier: a barrier, then `iterations` calls back to back after `skip` warm-ups, timed
    as one block, then a barrier; the figure is the mean over ranks of block time / iterations.
  Iterations: 10000 after 1000 warm-ups up to 8 KiB, 100 after 10 above (OMB-Py's defaults).

Each library makes its own call on the same buffers: mpi4py the call OMB-Py makes (comm.Allreduce(s_msg, r_msg),
out of place), pycyxwiz its own (cx.distributed.all_reduce in place on the receive buffer, its only form). Before
the timed loops every collective runs once on rank-dependent data, checked against NumPy (a wrong result is the
column's error, never a figure). reduce_scatter runs where the float32 count divides by the ranks (OMB-Py spreads
a remainder over the first ranks, which pycyxwiz's equal blocks do not take).
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from benchmarks._worker_io import run_rank

TESTS = ("latency", "bw", "allreduce", "reduce_scatter", "bcast", "allgather", "barrier")
PT2PT = ("latency", "bw")
LARGE = 8192    # OMB's large_message_size: above it, the large iteration counts
WINDOW = 64     # osu_bw's window


def sizes_of(test: str, max_pt2pt: int, max_coll: int) -> list:
    """OMB-Py's sizes (util.message_sizes with its per-test minimum): powers of two up to the maximum."""
    if test == "barrier":
        return [0]
    top = max_pt2pt if test in PT2PT else max_coll
    low = {"latency": 0, "allreduce": 4, "reduce_scatter": 4}.get(test, 1)
    sizes = [1 << i for i in range(max(low, 1).bit_length() - 1, top.bit_length()) if (1 << i) <= top]
    return ([0] if low == 0 else []) + sizes


def iterations_of(test: str, size: int, scale: float) -> tuple:
    """(skip, iterations) as OMB-Py's Options, scaled (--quick) but at least 2 timed calls."""
    if test == "bw":
        skip, iters = (3, 30) if size > LARGE else (10, 100)
    else:
        skip, iters = (10, 100) if size > LARGE else (1000, 10000)
    return max(1, int(skip * scale)), max(2, int(iters * scale))


class Calls:
    """The library's calls on preallocated buffers, as zero-argument callables per (test, size)."""

    def __init__(self, comm, max_pt2pt: int, max_coll: int):
        self.comm = comm
        self.mpi = comm.name == "mpi"
        w = comm.world
        big = max(max_pt2pt, max_coll, 4)
        self.s_buf = np.zeros(big, np.uint8)
        self.r_buf = np.zeros(big * max(w, 2), np.uint8)
        self.ack = np.zeros(4, np.uint8)

    def _floats(self, buf: np.ndarray, n: int) -> np.ndarray:
        return buf[:4 * n].view(np.float32)

    def collective(self, test: str, size: int):
        c, w = self.comm, self.comm.world
        s, r = self.s_buf, self.r_buf
        n = size // 4
        if self.mpi:
            MPI, comm = c.MPI, c.comm
            return {
                "allreduce": lambda: comm.Allreduce([s, n, MPI.FLOAT], [r, n, MPI.FLOAT], op=MPI.SUM),
                "reduce_scatter": lambda: comm.Reduce_scatter([s, n, MPI.FLOAT], [r, n // w, MPI.FLOAT],
                                                              recvcounts=[n // w] * w, op=MPI.SUM),
                "bcast": lambda: comm.Bcast([s, size, MPI.BYTE], 0),
                "allgather": lambda: comm.Allgather([s, size, MPI.BYTE], [r, size, MPI.BYTE]),
                "barrier": comm.Barrier,
            }[test]
        d = c.d
        fs, fr = self._floats(s, n), self._floats(r, n)
        fr_part = self._floats(r, n // w) if test == "reduce_scatter" else None
        s_part, gathered = s[:size], r[:size * w]
        return {
            "allreduce": lambda: d.all_reduce(fr, op=d.ReduceOp.SUM),
            "reduce_scatter": lambda: d.reduce_scatter(fr_part, fs),
            "bcast": lambda: d.broadcast(s_part, src=0),
            "allgather": lambda: d.all_gather(gathered, s_part),
            "barrier": d.barrier,
        }[test]

    def pingpong(self, size: int):
        """One round trip of `size` bytes (rank 0 sends first), osu_latency's loop body."""
        c, s, r = self.comm, self.s_buf[:size], self.r_buf[:size]
        if self.mpi:
            MPI, comm = c.MPI, c.comm
            sm, rm = [self.s_buf, size, MPI.BYTE], [self.r_buf, size, MPI.BYTE]
            if c.rank == 0:
                return lambda: (comm.Send(sm, 1, 1), comm.Recv(rm, 1, 1))
            return lambda: (comm.Recv(rm, 0, 1), comm.Send(sm, 0, 1))
        d = c.d
        if c.rank == 0:
            return lambda: (d.send(s, 1), d.recv(r, 1))
        return lambda: (d.recv(r, 0), d.send(s, 0))

    def window(self, size: int):
        """One window of osu_bw: 64 non-blocking sends (rank 0) or receives (rank 1), then the 4-byte answer."""
        c, s, r, ack = self.comm, self.s_buf[:size], self.r_buf[:size], self.ack
        if self.mpi:
            MPI, comm = c.MPI, c.comm
            am = [ack, 4, MPI.BYTE]
            if c.rank == 0:
                sm = [self.s_buf, size, MPI.BYTE]

                def mpi_send_window():
                    MPI.Request.Waitall([comm.Isend(sm, 1, 100) for _ in range(WINDOW)])
                    comm.Recv(am, 1, 101)
                return mpi_send_window
            rm = [self.r_buf, size, MPI.BYTE]

            def mpi_recv_window():
                MPI.Request.Waitall([comm.Irecv(rm, 0, 100) for _ in range(WINDOW)])
                comm.Send(am, 0, 101)
            return mpi_recv_window
        d = c.d
        if c.rank == 0:
            def send_window():
                for work in [d.send(s, 1, async_op=True) for _ in range(WINDOW)]:
                    work.wait()
                d.recv(ack, 1)
            return send_window

        def recv_window():
            for work in [d.recv(r, 0, async_op=True) for _ in range(WINDOW)]:
                work.wait()
            d.send(ack, 0)
        return recv_window

    def check(self, test: str, size: int) -> None:
        """The collective once on rank-dependent data, against NumPy."""
        if test == "barrier":
            return
        c, w, rank = self.comm, self.comm.world, self.comm.rank
        n = size // 4
        rng = np.random.default_rng(1000 + rank)
        mine = rng.integers(0, 100, self.s_buf.size, dtype=np.uint8)
        every = [np.random.default_rng(1000 + k).integers(0, 100, self.s_buf.size, dtype=np.uint8) for k in range(w)]
        self.s_buf[:] = mine
        self.r_buf[:] = 0
        if test in ("allreduce", "reduce_scatter"):
            self._floats(self.s_buf, n)[:] = np.arange(n, dtype=np.float32) % 97 + rank
            if not self.mpi and test == "allreduce":
                self._floats(self.r_buf, n)[:] = self._floats(self.s_buf, n)  # in place
            want: np.ndarray = np.zeros(n, np.float32)
            for k in range(w):
                want += np.arange(n, dtype=np.float32) % 97 + k
        self.collective(test, size)()
        if test == "allreduce":
            ok = np.array_equal(self._floats(self.r_buf, n), want)
        elif test == "reduce_scatter":
            part = n // w
            ok = np.array_equal(self._floats(self.r_buf, part), want[rank * part:(rank + 1) * part])
        elif test == "bcast":
            ok = np.array_equal(self.s_buf[:size], every[0][:size])
        else:  # allgather
            ok = np.array_equal(self.r_buf[:size * w], np.concatenate([e[:size] for e in every]))
        self.s_buf[:] = 0
        self.r_buf[:] = 0
        if not ok:
            raise AssertionError(f"{c.name}: {test} of {size} B on rank {rank} differs from NumPy's result")


def runs(test: str, size: int, world: int) -> bool:
    if test in PT2PT:
        return world == 2
    if test == "reduce_scatter":
        return size // 4 > 0 and (size // 4) % world == 0
    return True


def body(comm, report, tests: list, max_pt2pt: int, max_coll: int, scale: float) -> None:
    calls = Calls(comm, max_pt2pt, max_coll)
    for test in tests:
        todo = [s for s in sizes_of(test, max_pt2pt, max_coll) if runs(test, s, comm.world)]
        if todo and test not in PT2PT:
            calls.check(test, todo[-1])
        for size in todo:
            skip, iters = iterations_of(test, size, scale)
            if test == "latency":   # on 2 ranks only (runs)
                call = calls.pingpong(size)
            elif test == "bw":
                call = calls.window(size)
            else:
                call = calls.collective(test, size)
            comm.barrier()
            t_start = time.perf_counter()
            for i in range(skip + iters):
                if i == skip:
                    t_start = time.perf_counter()
                call()
            t_end = time.perf_counter()
            if test not in PT2PT:
                comm.barrier()
            report.add({"test": test, "size": size, "seconds": t_end - t_start, "iterations": iters})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True, choices=["pycyxwiz", "mpi"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tests", nargs="+", choices=TESTS, default=list(TESTS))
    ap.add_argument("--max-pt2pt", type=int, default=1 << 22)
    ap.add_argument("--max-coll", type=int, default=1 << 20)
    ap.add_argument("--scale", type=float, default=1.0)
    a = ap.parse_args(argv)
    return run_rank(a.out, a.lib, lambda comm, report: body(comm, report, a.tests, a.max_pt2pt, a.max_coll, a.scale))


if __name__ == "__main__":
    sys.exit(main())
