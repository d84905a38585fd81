"""One rank of a collective benchmark: time one collective at every size, for one library.

    python -m benchmarks._collective_worker --lib gloo --out DIR --op all_reduce --sizes 8 1048576

Started by benchmarks.allreduce through benchmarks._launch (never by hand). Per size:
a correctness check (inputs rank+1, a few outputs compared with the closed form), warm-up
calls, then `iters` timed calls, each preceded by a barrier. Raw per-call times go to the
rank's report; the parent takes the max over ranks per call, then the median.

Sizes follow nccl-tests: all_reduce and broadcast move a buffer of `size` bytes; all_gather's
`size` is the gathered output (each rank contributes size/n); reduce_scatter's `size` is the
input (each rank keeps size/n); all_to_all's is each rank's input and output (size/n to and
from each rank); scatter's is the root's input and gather's the root's output (size/n per
rank), root 0. float32 SUM throughout. "pingpong" is the library's own
point-to-point round trip (rank 0 sends `size` bytes to rank 1, which sends them back; other
ranks idle): the transport's round trip, the yardstick for barrier and tiny all-reduce cost.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from benchmarks._worker_io import run_rank

OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "scatter", "gather", "reduce",
       "barrier", "pingpong")


def iterations(nbytes: int, scale: float = 1.0) -> tuple[int, int]:
    """(warm-up, timed) calls for a message of nbytes: ~256 MiB of traffic, 5..100 calls.

    A pure function of the size, so every rank of every library runs the same schedule.
    """
    most = max(5, int(100 * scale))
    timed = max(5, min(most, int(256 * 2**20 * scale / max(nbytes, 1))))
    warm = 1 if nbytes >= 64 * 2**20 else 3
    return warm, timed


def _counts(op: str, nbytes: int, world: int) -> tuple[int, int]:
    """(input elements, output elements) per rank for a nominal size in bytes."""
    n = max(1, nbytes // 4)
    if op in ("all_reduce", "broadcast", "reduce", "pingpong"):
        return n, n
    per_rank = max(1, n // world)
    if op in ("all_gather", "gather"):
        return per_rank, per_rank * world
    if op in ("reduce_scatter", "scatter"):
        return per_rank * world, per_rank
    if op == "all_to_all":
        return per_rank * world, per_rank * world
    return 0, 0


class Case:
    """Buffers for one (op, size) and a zero-argument callable running the collective once."""

    def __init__(self, comm, op: str, nbytes: int):
        self.op, self.comm = op, comm
        n_in, n_out = _counts(op, nbytes, comm.world)
        self.inp = np.zeros(n_in, np.float32)
        self.out = self.inp if op in ("all_reduce", "broadcast", "reduce", "pingpong") else np.zeros(n_out, np.float32)
        self.bytes = (n_in if op not in ("all_gather", "gather") else n_out) * 4
        self.call = self._bind()

    def _bind(self):
        name, op = self.comm.name, self.op
        inp, out = self.inp, self.out
        if op == "barrier":
            return self.comm.barrier
        if op == "pingpong":
            return self._pingpong()
        w, root = self.comm.world, self.comm.rank == 0
        if name == "pycyxwiz":
            d = self.comm.d
            # Block views made once, as every other library's buffers are: not a reshape per timed call.
            inp2 = inp.reshape(w, -1) if op in ("all_to_all", "scatter") else None
            out2 = out.reshape(w, -1) if op in ("all_to_all", "gather") else None
            return {
                "scatter": lambda: d.scatter(out, inp2 if root else None, src=0),
                "gather": lambda: d.gather(inp, out2 if root else None, dst=0),
                "all_reduce": lambda: d.all_reduce(inp, op=d.ReduceOp.SUM),
                "broadcast": lambda: d.broadcast(inp, src=0),
                "reduce": lambda: d.reduce(inp, dst=0, op=d.ReduceOp.SUM),
                "all_gather": lambda: d.all_gather(out, inp),
                "reduce_scatter": lambda: d.reduce_scatter(out, inp),
                "all_to_all": lambda: d.all_to_all(out2, inp2),
            }[op]
        if name == "gloo":
            torch, dist = self.comm.torch, self.comm.dist
            ti, to = torch.from_numpy(inp), torch.from_numpy(out)  # shares memory, no copies
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            blocks = list(torch.from_numpy(out if op == "gather" else inp).chunk(w))
            return {
                "scatter": lambda: dist.scatter(to, blocks if root else None, src=0),
                "gather": lambda: dist.gather(ti, blocks if root else None, dst=0),
                "all_reduce": lambda: dist.all_reduce(ti),
                "broadcast": lambda: dist.broadcast(ti, 0),
                "reduce": lambda: dist.reduce(ti, 0),
                "all_gather": lambda: gather(to, ti),
                "reduce_scatter": lambda: scatter(to, ti),
                "all_to_all": lambda: dist.all_to_all_single(to, ti),
            }[op]
        if name == "mpi":
            MPI, comm = self.comm.MPI, self.comm.comm
            return {
                "scatter": lambda: comm.Scatter(inp, out, root=0),
                "gather": lambda: comm.Gather(inp, out, root=0),
                "all_reduce": lambda: comm.Allreduce(MPI.IN_PLACE, inp, op=MPI.SUM),
                "broadcast": lambda: comm.Bcast(inp, root=0),
                "reduce": lambda: comm.Reduce(MPI.IN_PLACE if root else inp, inp if root else None, op=MPI.SUM,
                                              root=0),
                "all_gather": lambda: comm.Allgather(inp, out),
                "reduce_scatter": lambda: comm.Reduce_scatter_block(inp, out, op=MPI.SUM),
                "all_to_all": lambda: comm.Alltoall(inp, out),
            }[op]
        raise ValueError(name)

    def _pingpong(self):
        name, buf, rank = self.comm.name, self.inp, self.comm.rank
        if name == "pycyxwiz":
            send, recv = (lambda p: self.comm.d.send(buf, p)), (lambda p: self.comm.d.recv(buf, p))
        elif name == "gloo":
            t = self.comm.torch.from_numpy(buf)
            send, recv = (lambda p: self.comm.dist.send(t, p)), (lambda p: self.comm.dist.recv(t, p))
        else:
            send, recv = (lambda p: self.comm.comm.Send(buf, p)), (lambda p: self.comm.comm.Recv(buf, p))
        if rank == 0:
            return lambda: (send(1), recv(1))
        if rank == 1:
            return lambda: (recv(0), send(0))
        return lambda: None

    def check(self) -> bool:
        """Run once on rank-dependent inputs and compare a few outputs with the closed form."""
        if self.op in ("barrier", "pingpong"):
            self.call()
            return True
        r, n = self.comm.rank, self.comm.world
        self.inp.fill(r + 1)
        if self.out is not self.inp:
            self.out.fill(-1)
        self.call()
        idx = np.unique(np.array([0, self.out.size // 2, self.out.size - 1]))
        got = self.out[idx]
        if self.op in ("all_reduce", "reduce_scatter") or self.op == "reduce" and r == 0:
            ok = np.all(got == n * (n + 1) / 2)
        elif self.op == "reduce":
            ok = True  # off the root the buffer is the library's scratch
        elif self.op in ("broadcast", "scatter"):  # the root's buffer, all ones
            ok = np.all(got == 1)
        elif self.op == "gather" and r != 0:
            ok = np.all(got == -1)  # untouched off the root
        else:  # all_gather, all_to_all, gather at the root: segment k holds k+1 (rank k's)
            ok = np.all(got == idx // (self.out.size // n) + 1)
        self.inp.fill(0)  # timed calls run on zeros: sums never overflow to inf
        if self.out is not self.inp:
            self.out.fill(0)
        return bool(ok)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--op", choices=OPS, default="all_reduce")
    ap.add_argument("--sizes", type=int, nargs="+", required=True)
    ap.add_argument("--iters-scale", type=float, default=1.0)
    a = ap.parse_args(argv)

    def body(comm, report):
        for nbytes in a.sizes:
            case = Case(comm, a.op, nbytes)
            correct = case.check()
            warm, timed = iterations(case.bytes, a.iters_scale)
            for _ in range(warm):
                comm.barrier()
                case.call()
            times = []
            for _ in range(timed):
                comm.barrier()
                t0 = time.perf_counter()
                case.call()
                times.append(time.perf_counter() - t0)
            report.add({"nominal": nbytes, "bytes": case.bytes, "correct": correct, "times": times})
            del case
        comm.barrier()

    return run_rank(a.out, a.lib, body)


if __name__ == "__main__":
    sys.exit(main())
