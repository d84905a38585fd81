"""What every benchmark worker (one rank) shares: its report file, its library, its memory.

    report = RankReport(out_dir)          # DIR/rank<r>.json, rewritten atomically by save()
    comm = open_comm("gloo")              # .rank .world .barrier() .close() .version
    sys.exit(run_rank(out_dir, lib, body))  # a worker's main: body(comm, report) in that frame
    rss_bytes(), peak_rss_bytes(), reset_peak_rss()

A worker (run_rank) catches everything, records it as report.fail(exc) and exits non-zero: the parent
prints that line as the column's "n/a (reason)".
"""
from __future__ import annotations

import json
import os
import traceback
from pathlib import Path
from typing import Callable


class RankReport:
    """One rank's results; saved after every step so partial progress survives a crash."""

    def __init__(self, out_dir: str):
        self.dir = Path(out_dir)
        self.data: dict = {"rank": None, "steps": [], "info": {}}

    def set_rank(self, rank: int) -> None:
        self.data["rank"] = rank

    def add(self, step: dict) -> None:
        self.data["steps"].append(step)
        self.save()

    def finish(self, comm) -> None:
        """Mark the work complete, then close the library; a failing close is only a warning."""
        self.data["done"] = True
        self.save()
        try:
            comm.close()
        except Exception as exc:  # noqa: BLE001
            self.data["close_error"] = f"{type(exc).__name__}: {exc}"[:300]
            self.save()

    def fail(self, exc: BaseException) -> None:
        msg = f"{type(exc).__name__}: {exc}".strip().splitlines()
        self.data["error"] = (msg[0] if msg else type(exc).__name__)[:300]
        self.data["traceback"] = traceback.format_exc()[-3000:]
        self.save()

    def save(self) -> None:
        rank = self.data["rank"]
        if rank is None:  # failed before we knew our rank: use the launcher's variables
            rank = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
        path = self.dir / f"rank{rank}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        os.replace(tmp, path)


# ---- memory -------------------------------------------------------------------------------

def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{field} not in /proc/self/status")


def rss_bytes() -> int:
    """Resident set size now."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """Peak resident set size (VmHWM) since start or since the last reset_peak_rss()."""
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to clear_refs). False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


# ---- the library of this rank ---------------------------------------------------------------

class Comm:
    """A library's process group reduced to what the harness needs besides the collective."""

    name = ""
    rank = 0
    world = 1
    version = ""

    def barrier(self) -> None: ...
    def close(self) -> None: ...


class CxComm(Comm):
    name = "pycyxwiz"

    def __init__(self):
        import pycyxwiz as cx

        self.cx = cx
        self.d = cx.distributed
        self.d.init()
        self.rank = self.d.get_rank()
        self.world = self.d.get_world_size()
        self.version = getattr(cx, "__version__", "")

    def barrier(self):
        self.d.barrier()

    def close(self):
        self.d.finalize()


class GlooComm(Comm):
    name = "gloo"
    backend = "gloo"  # torch.distributed's backend

    def __init__(self):
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        self.torch, self.dist = torch, dist
        timeout = timedelta(milliseconds=int(os.environ.get("DISTRIBUTED_TIMEOUT_MS", "60000")))
        dist.init_process_group(self.backend, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.version = torch.__version__

    def barrier(self):
        self.dist.barrier()

    def close(self):
        self.dist.destroy_process_group()


class TorchCyxwizComm(GlooComm):
    """torch.distributed over pycyxwiz: the "cyxwiz" backend that `import pycyxwiz.torch` registers."""

    name = "cyxwiz"
    backend = "cyxwiz"

    def __init__(self):
        import pycyxwiz
        import pycyxwiz.torch  # noqa: F401 - registers the backend

        super().__init__()
        self.version = f"torch {self.torch.__version__}, pycyxwiz {getattr(pycyxwiz, '__version__', '')}"


class MpiComm(Comm):
    name = "mpi"

    def __init__(self):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.world = self.comm.Get_size()
        # "Open MPI v4.1.4, package: ..., ident: ..." (NUL-terminated): keep the first field.
        self.version = MPI.Get_library_version().replace("\x00", "").split(",")[0].strip()

    def barrier(self):
        self.comm.Barrier()

    def close(self):
        pass  # mpi4py finalizes at exit


class HorovodComm(Comm):
    """Horovod's PyTorch API (benchmarks/horovod.py): started by mpirun (MPI) or horovodrun (gloo)."""

    name = "horovod"

    def __init__(self):
        import horovod
        import horovod.torch as hvd
        import torch

        torch.set_num_threads(1)
        hvd.init()
        self.torch, self.hvd = torch, hvd
        self.rank, self.world = hvd.rank(), hvd.size()
        ops = "MPI" if hvd.mpi_enabled() and not hvd.gloo_enabled() else "gloo"
        self.version = f"Horovod {horovod.__version__} ({ops}), torch {torch.__version__}"
        self._token = torch.zeros(1)

    def barrier(self):
        # hvd.barrier() exists from 0.23 on; an allreduce of one value is a barrier everywhere.
        self.hvd.allreduce_(self._token, op=self.hvd.Sum, name="cx_barrier")

    def close(self):
        self.hvd.shutdown()


def open_comm(lib: str) -> Comm:
    return {"pycyxwiz": CxComm, "gloo": GlooComm, "torch": GlooComm, "cyxwiz": TorchCyxwizComm,
            "mpi": MpiComm, "horovod": HorovodComm}[lib]()


def run_rank(out_dir: str, lib: str, body: Callable[[Comm, RankReport], None]) -> int:
    """A worker's main, around its own part: opens `lib`, records rank and version, runs
    body(comm, report), then marks the report done and closes. Any failure is recorded with
    report.fail (the column's "n/a (reason)"); returns the process's exit status."""
    report = RankReport(out_dir)
    try:
        comm = open_comm(lib)
        report.set_rank(comm.rank)
        report.data["info"] = {"version": comm.version, "world": comm.world}
        report.save()
        body(comm, report)
        report.finish(comm)
    except BaseException as exc:  # noqa: BLE001 - every failure becomes the column's reason
        report.fail(exc)
        return 1
    return 0
