"""One rank of the memory benchmark: how much RSS a collective adds above its own arrays.

    python -m benchmarks._memory_worker --lib mpi --out DIR --op all_reduce --sizes 1048576 268435456

Per size (ascending): allocate and touch the input/output arrays, note RSS, reset the peak
(VmHWM) to it, run the collective three times, read the peak. peak - RSS-with-arrays is the
library's scratch for that message (plus anything it keeps around from earlier calls). A
library whose scratch is a few pipeline chunks shows the same small growth at 1 MiB and at
256 MiB; one that copies the message shows growth proportional to size.
"""
from __future__ import annotations

import argparse
import sys

from benchmarks._collective_worker import OPS, Case
from benchmarks._worker_io import peak_rss_bytes, reset_peak_rss, rss_bytes, run_rank

CALLS = 3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--op", choices=OPS, default="all_reduce")
    ap.add_argument("--sizes", type=int, nargs="+", required=True)
    a = ap.parse_args(argv)

    def body(comm, report):
        report.data["info"]["rss_after_init"] = rss_bytes()
        report.save()
        comm.barrier()
        for nbytes in sorted(a.sizes):
            before = rss_bytes()
            case = Case(comm, a.op, nbytes)
            case.inp.fill(1)  # np.zeros is lazily mapped: touch every page
            if case.out is not case.inp:
                case.out.fill(1)
            comm.barrier()
            with_arrays = rss_bytes()
            reset_ok = reset_peak_rss()
            for _ in range(CALLS):
                case.call()
            comm.barrier()
            peak = peak_rss_bytes()
            report.add({"nominal": nbytes, "bytes": case.bytes,
                        "array_bytes": case.inp.nbytes + (0 if case.out is case.inp else case.out.nbytes),
                        "rss_before": before, "rss_with_arrays": with_arrays, "peak": peak,
                        "growth": peak - with_arrays if reset_ok else None, "peak_reset": reset_ok})
            del case

    return run_rank(a.out, a.lib, body)


if __name__ == "__main__":
    sys.exit(main())
