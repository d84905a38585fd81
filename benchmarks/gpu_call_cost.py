"""Where a pycyxwiz NCCL call's time goes, from Python: medians of many calls, world size 1, 1 KiB (on a GPU
machine: pycyxwiz's all_reduce blocking and async against CuPy's NCCL on a raw pointer, and the pieces: reading
the array's interface or attributes, a stream synchronize). `python benchmarks/gpu_call_cost.py cpu`: the CPU
backend's all_reduce at world size 1, what every collective pays whatever the device."""
import statistics
import sys
import time

import pycyxwiz as cx
from gpu_check import median_us  # benchmarks/, this script's folder


def med(fn):
    return median_us(fn, 3000, warmup=200)


def enqueue(launch, wait, n=3000):
    ts = []
    for i in range(n + 200):
        t0 = time.perf_counter_ns()
        h = launch()
        t = time.perf_counter_ns() - t0
        wait(h)
        if i >= 200:
            ts.append(t)
    return statistics.median(ts) / 1e3


D = cx.distributed
if sys.argv[1:] == ["cpu"]:
    import numpy as np
    D.init(D.DistributedConfig())
    a = np.ones(256, np.float32)
    for name, us in (("cpu backend numpy all_reduce blocking", med(lambda: D.all_reduce(a))),
                     ("cpu backend numpy all_reduce async+wait", med(lambda: D.all_reduce(a, async_op=True).wait())),
                     ("cpu backend async enqueue",
                      enqueue(lambda: D.all_reduce(a, async_op=True), lambda h: h.wait()))):
        print(f"{name:>48} {us:7.2f} us")
    D.finalize()
    sys.exit(0)
import cupy as cp
from cupy.cuda import nccl
cfg = D.DistributedConfig()
cfg.backend = D.BackendType.NCCL
D.init(cfg)
x = cp.ones(256, cp.float32)
n = x.size
comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
stream = cp.cuda.get_current_stream()
rows = {}
for r in range(2):
    for name, fn in (
            ("cx blocking", lambda: med(lambda: D.all_reduce(x))),
            ("cupy blocking", lambda: med(lambda: (comm.allReduce(x.data.ptr, x.data.ptr, n, nccl.NCCL_FLOAT32,
                                                                  nccl.NCCL_SUM, stream.ptr), stream.synchronize()))),
            ("cx async enqueue", lambda: enqueue(lambda: D.all_reduce(x, async_op=True), lambda h: h.wait())),
            ("cx async+wait", lambda: med(lambda: D.all_reduce(x, async_op=True).wait())),
            ("cupy async enqueue", lambda: enqueue(lambda: comm.allReduce(x.data.ptr, x.data.ptr, n, nccl.NCCL_FLOAT32,
                                                                          nccl.NCCL_SUM, stream.ptr),
                                                   lambda h: stream.synchronize())),
            ("cx blocking, explicit op", lambda: med(lambda: D.all_reduce(x, D.ReduceOp.SUM))),
            ("CAI read", lambda: med(lambda: x.__cuda_array_interface__)),
            ("x.data.ptr", lambda: med(lambda: x.data.ptr)),
            ("x.dtype", lambda: med(lambda: x.dtype)),
            ("x.size", lambda: med(lambda: x.size)),
            ("x.flags.c_contiguous", lambda: med(lambda: x.flags.c_contiguous)),
            ("x._c_contiguous", lambda: med(lambda: getattr(x, "_c_contiguous", None))),
            ("x.shape", lambda: med(lambda: x.shape)),
            ("x.strides", lambda: med(lambda: x.strides)),
            ("get_current_stream().ptr", lambda: med(lambda: cp.cuda.get_current_stream().ptr)),
            ("stream.synchronize() idle", lambda: med(lambda: stream.synchronize())),
            ("x.__dlpack__(stream=1) capsule", lambda: med(lambda: x.__dlpack__(stream=1))),
    ):
        rows[name] = min(rows.get(name, float("inf")), fn())
for k, v in rows.items():
    print(f"{k:>48} {v:7.2f} us")
print("blocking cx/cupy %.2f, enqueue cx/cupy %.2f" % (rows["cx blocking"] / rows["cupy blocking"],
                                                       rows["cx async enqueue"] / rows["cupy async enqueue"]))
print("has _c_contiguous:", hasattr(x, "_c_contiguous"), "CAI:", x.__cuda_array_interface__)
D.finalize()
