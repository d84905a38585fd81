"""One command for a GPU machine: build pycyxwiz there, check the NCCL backend against CuPy,
and time all-reduce through pycyxwiz against NCCL driven directly through cupy.cuda.nccl.

    python benchmarks/gpu_check.py                 # build (pip install --no-build-isolation -e .), check, bench
    python benchmarks/gpu_check.py --no-build      # use the installed build
    python benchmarks/gpu_check.py --max-mib 256   # smaller bandwidth sweep

Needs: an NVIDIA GPU, CuPy, libnccl.so.2 (the nvidia-nccl-cu12/-cu13 wheel or the system's),
and to build: cmake, nvcc, pybind11, scikit-build-core, scipy-openblas32 (no internet needed).

1. Correctness at world size 1 (the machine may have one GPU; NCCL refuses two ranks on one
   GPU): all_reduce with every ReduceOp and dtype, async handles, arrays on a non-default
   stream, broadcast, all_gather (list and one array), reduce_scatter, reduce, scatter,
   gather, all_to_all, barrier, the errors for NumPy arrays and bad LOCAL_RANK; every result
   compared with a CuPy reference. With 2+ GPUs, all_reduce/broadcast/send/recv also run on
   every GPU as separate ranks.
2. All-reduce time and bandwidth, 1 MiB .. 1 GiB of float32, pycyxwiz (blocking call, which
   returns once the result is in the array) against cupy.cuda.nccl's allReduce followed by a
   stream synchronize (the same amount of waiting), medians of many calls, side by side.
   busbw = algbw * 2(n-1)/n is 0 at n = 1, so at world size 1 algbw is what is compared.

3. The model on the GPU: `pytest tests/test_gpu.py` (DistributedTrainer with NCCL against the CPU
   for four models and every optimizer, cuBLAS against the tiled GEMM), then
   benchmarks/gpu_train.py (training samples/s against PyTorch on the same GPU). --no-train skips.
Writes the numbers as JSON to benchmarks/results/gpu_check.json (and gpu_train.json).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build() -> None:
    print("== building pycyxwiz (pip install --no-build-isolation -e .)", flush=True)
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-e", ROOT],
                   check=True)
    print(f"   built in {time.time() - t0:.0f} s", flush=True)


# ---- correctness ---------------------------------------------------------------------------

RESULTS: list = []


def check(name: str, fn) -> None:
    try:
        fn()
        RESULTS.append((name, "ok", ""))
        print(f"  ok    {name}", flush=True)
    except Exception as e:  # report every failure, keep going
        RESULTS.append((name, "FAIL", f"{type(e).__name__}: {e}"))
        print(f"  FAIL  {name}: {type(e).__name__}: {e}", flush=True)
        traceback.print_exc()


def correctness_world1() -> None:
    import cupy as cp
    import numpy as np

    import pycyxwiz as cx

    D = cx.distributed
    print("== NCCL collectives at world size 1 against CuPy", flush=True)
    print(f"   kernels built: {cx._core.dist._cuda_kernels_built()}, NCCL: {cx._core.dist._nccl_library()}", flush=True)
    cfg = D.DistributedConfig()
    cfg.backend = D.BackendType.NCCL
    cfg.timeout_ms = 60000
    D.init(cfg)
    ops = [D.ReduceOp.SUM, D.ReduceOp.AVG, D.ReduceOp.PRODUCT, D.ReduceOp.MIN, D.ReduceOp.MAX]
    dtypes = [cp.float32, cp.float64, cp.float16, cp.int32, cp.int64, cp.uint8]

    def all_reduce_every_op_and_dtype():
        for dt in dtypes:
            for op in ops:
                if op == D.ReduceOp.AVG and cp.dtype(dt).kind in "iu":
                    continue  # AVG of integers is refused, as on the CPU backend
                for n in (0, 1, 1000, 1 << 20):
                    x = (cp.arange(n) % 7).astype(dt)
                    ref = x.copy()
                    D.all_reduce(x, op=op)
                    assert cp.array_equal(x, ref), (dt, op, n)

    def async_handles_and_streams():
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            x = cp.ones(1 << 22, cp.float32)
            for _ in range(20):
                x *= 2  # queued on s; the collective must wait for all of it
            w = D.all_reduce(x, async_op=True)
        assert w.wait() and w.is_completed()
        assert float(x[0]) == 2.0 ** 20 and float(x[-1]) == 2.0 ** 20
        works = [D.all_reduce(cp.full(1000, i, cp.int64), async_op=True) for i in range(8)]
        for w in works:
            w.wait()
        # Five async collectives in flight, then a blocking one: it runs behind them (Note [Collectives that
        # are launches]), so when it returns every one of them is complete.
        xs = [cp.full(1 << 20, i, cp.float32) for i in range(6)]
        outs = [cp.zeros(1 << 20, cp.float32) for _ in range(6)]
        works = [D.all_gather(outs[i], xs[i], async_op=True) for i in range(5)]
        D.all_gather(outs[5], xs[5])
        assert all(w.is_completed() for w in works)
        assert all(cp.array_equal(o, x) for o, x in zip(outs, xs))

    def data_movement():
        x = cp.arange(1000, dtype=cp.float32)
        D.broadcast(x, src=0)
        assert cp.array_equal(x, cp.arange(1000, dtype=cp.float32))
        out = [cp.zeros(1000, cp.float32)]
        D.all_gather(out, x)
        assert cp.array_equal(out[0], x)
        whole = cp.zeros(1000, cp.float32)
        D.all_gather(whole, x)
        assert cp.array_equal(whole, x)
        o = cp.zeros(1000, cp.float32)
        D.reduce_scatter(o, [x])
        assert cp.array_equal(o, x)
        D.reduce_scatter(o, x, op=D.ReduceOp.AVG)
        assert cp.array_equal(o, x)
        y = x.copy()
        D.reduce(y, dst=0, op=D.ReduceOp.MAX)
        assert cp.array_equal(y, x)
        s = cp.zeros(1000, cp.float32)
        D.scatter(s, [x], src=0)
        assert cp.array_equal(s, x)
        g = [cp.zeros(1000, cp.float32)]
        D.gather(x, g, dst=0)
        assert cp.array_equal(g[0], x)
        a = cp.zeros((1, 1000), cp.float32)
        D.all_to_all(a, x.reshape(1, 1000))
        assert cp.array_equal(a[0], x)
        D.barrier()
        D.barrier(async_op=True).wait()

    def errors_are_clear():
        try:
            D.all_reduce(np.ones(3, np.float32))
            raise AssertionError("a NumPy array was accepted by the NCCL backend")
        except TypeError as e:
            assert "NumPy array" in str(e), e
        try:
            D.all_reduce(cp.ones((4, 4), cp.float32).T)
            raise AssertionError("a non-contiguous array was accepted")
        except ValueError as e:
            assert "C-contiguous" in str(e), e

    check("all_reduce: every ReduceOp x dtype x size", all_reduce_every_op_and_dtype)
    check("async handles, non-default stream ordering", async_handles_and_streams)
    check("broadcast/all_gather/reduce_scatter/reduce/scatter/gather/all_to_all/barrier", data_movement)
    check("errors: NumPy array, non-contiguous array", errors_are_clear)
    D.finalize()

    def local_rank_beyond_devices():
        n = cp.cuda.runtime.getDeviceCount()
        c = D.DistributedConfig()
        c.backend, c.local_rank = D.BackendType.NCCL, n
        try:
            D.init(c)
            raise AssertionError("LOCAL_RANK beyond the device count was accepted")
        except ValueError as e:
            assert f"LOCAL_RANK={n}" in str(e), e

    check("error: LOCAL_RANK beyond the device count", local_rank_beyond_devices)


def _rank_body(rank: int, world: int, port: int, q) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DISTRIBUTED_BACKEND="nccl")
    try:
        import cupy as cp

        import pycyxwiz as cx

        D = cx.distributed
        cp.cuda.Device(rank).use()
        D.init()
        x = cp.full(1 << 20, rank + 1, cp.float32)
        D.all_reduce(x)
        assert float(x[0]) == world * (world + 1) / 2
        y = cp.full(10, rank, cp.int64)
        D.broadcast(y, src=world - 1)
        assert int(y[0]) == world - 1
        if rank == 0:
            D.send(cp.arange(5, dtype=cp.float64), dst=1)
        elif rank == 1:
            z = cp.zeros(5, cp.float64)
            D.recv(z, src=0)
            assert cp.array_equal(z, cp.arange(5, dtype=cp.float64))
        D.finalize()
        q.put((rank, "ok"))
    except Exception as e:
        q.put((rank, f"{type(e).__name__}: {e}"))


def correctness_multi_gpu() -> None:
    import multiprocessing as mp
    import socket

    import cupy as cp

    n = cp.cuda.runtime.getDeviceCount()
    if n < 2:
        print(f"== {n} GPU: multi-rank checks skipped (NCCL needs one GPU per rank)", flush=True)
        return

    def run():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        ps = [ctx.Process(target=_rank_body, args=(r, n, port, q)) for r in range(n)]
        for p in ps:
            p.start()
        outs = dict(q.get(timeout=120) for _ in ps)
        for p in ps:
            p.join(30)
        bad = {r: v for r, v in outs.items() if v != "ok"}
        assert not bad, bad

    print(f"== {n} ranks, one per GPU", flush=True)
    check(f"all_reduce/broadcast/send/recv on {n} GPUs", run)


# ---- bandwidth -------------------------------------------------------------------------------

def median_us(fn, iters: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        ts.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(ts)


def call_overhead() -> dict:
    """What one small all-reduce (1 KiB) costs the caller, world size 1: blocking (returns once the
    result is in the array; CuPy: allReduce + stream synchronize) and async enqueue (the time for the
    call to return; the wait is outside the timing; CuPy: allReduce alone). Medians of 2000 calls,
    alternating the two libraries in rounds."""
    import cupy as cp
    from cupy.cuda import nccl

    import pycyxwiz as cx

    D = cx.distributed
    cfg = D.DistributedConfig()
    cfg.backend = D.BackendType.NCCL
    D.init(cfg)
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    stream = cp.cuda.get_current_stream()
    x = cp.ones(256, cp.float32)
    n = x.size

    def cx_block():
        D.all_reduce(x)

    def cupy_block():
        comm.allReduce(x.data.ptr, x.data.ptr, n, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
        stream.synchronize()

    def enqueue_us(launch, wait, iters=2000):
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter_ns()
            h = launch()
            ts.append((time.perf_counter_ns() - t0) / 1e3)
            wait(h)
        return statistics.median(ts)

    def cx_async():
        return D.all_reduce(x, async_op=True)

    def cupy_async():
        comm.allReduce(x.data.ptr, x.data.ptr, n, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)

    rows = {}
    for r in range(2):
        for name, fn in (("cx blocking", lambda: median_us(cx_block, 2000)),
                         ("cupy blocking", lambda: median_us(cupy_block, 2000)),
                         ("cx async enqueue", lambda: enqueue_us(cx_async, lambda h: h.wait())),
                         ("cupy async enqueue", lambda: enqueue_us(cupy_async, lambda h: stream.synchronize()))):
            rows[name] = min(rows.get(name, float("inf")), fn())
    t0 = time.perf_counter_ns()
    for _ in range(2000):
        x.__cuda_array_interface__
    rows["cupy __cuda_array_interface__ read"] = (time.perf_counter_ns() - t0) / 2000 / 1e3
    D.finalize()
    print("== one 1 KiB all-reduce, world size 1, median us (target: blocking <= 1.2x CuPy, enqueue <= 1.5x)")
    for k, v in rows.items():
        print(f"  {k:>36} {v:8.2f}")
    print(f"  {'blocking cx/cupy':>36} {rows['cx blocking'] / rows['cupy blocking']:8.2f}")
    print(f"  {'async enqueue cx/cupy':>36} {rows['cx async enqueue'] / rows['cupy async enqueue']:8.2f}", flush=True)
    return rows


def bandwidth(max_mib: int) -> list:
    import cupy as cp
    from cupy.cuda import nccl

    import pycyxwiz as cx

    D = cx.distributed
    print("== all-reduce (SUM, float32), world size 1: pycyxwiz vs cupy.cuda.nccl", flush=True)
    cfg = D.DistributedConfig()
    cfg.backend = D.BackendType.NCCL
    D.init(cfg)
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    stream = cp.cuda.get_current_stream()
    rows = []
    print(f"{'size':>9} {'cx us':>10} {'cupy us':>10} {'cx algbw':>10} {'cupy algbw':>11} {'cx/cupy':>8}")
    mib = 1
    while mib <= max_mib:
        n = mib * (1 << 20) // 4
        x = cp.ones(n, cp.float32)
        iters = max(10, min(200, 2000 // mib))

        def cx_call():
            D.all_reduce(x)

        def cupy_call():
            comm.allReduce(x.data.ptr, x.data.ptr, n, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
            stream.synchronize()

        # alternate to spread drift over both
        a1, b1 = median_us(cx_call, iters), median_us(cupy_call, iters)
        a2, b2 = median_us(cx_call, iters), median_us(cupy_call, iters)
        cx_us, cp_us = min(a1, a2), min(b1, b2)
        nbytes = n * 4
        row = dict(bytes=nbytes, cx_us=cx_us, cupy_us=cp_us, cx_algbw_gbs=nbytes / cx_us / 1e3,
                   cupy_algbw_gbs=nbytes / cp_us / 1e3, ratio=cx_us / cp_us)
        rows.append(row)
        print(f"{mib:>6} MiB {cx_us:>10.1f} {cp_us:>10.1f} {row['cx_algbw_gbs']:>9.1f}G {row['cupy_algbw_gbs']:>10.1f}G "
              f"{row['ratio']:>8.2f}", flush=True)
        del x
        mib *= 4
    D.finalize()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-build", action="store_true", help="use the pycyxwiz already installed")
    ap.add_argument("--max-mib", type=int, default=1024)
    ap.add_argument("--no-train", action="store_true", help="skip the model-on-the-GPU tests and timing")
    ap.add_argument("--stage", choices=["all", "run"], default="all", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stage == "all":
        if not args.no_build:
            build()
        # a fresh interpreter imports the fresh build
        cmd = [sys.executable, os.path.abspath(__file__), "--stage", "run", "--max-mib", str(args.max_mib)]
        rc = subprocess.run(cmd).returncode
        if not args.no_train:
            print("== the model on the GPU: pytest tests/test_gpu.py", flush=True)
            rc |= subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                  os.path.join(ROOT, "tests", "test_gpu.py")], cwd=ROOT).returncode
            rc |= subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_train.py"),
                                  "--samples", "30000"], cwd=ROOT).returncode
        return rc

    import cupy as cp

    dev = cp.cuda.runtime.getDeviceProperties(0)
    print(f"== {dev['name'].decode()} x{cp.cuda.runtime.getDeviceCount()}, CUDA runtime "
          f"{cp.cuda.runtime.runtimeGetVersion()}, driver {cp.cuda.runtime.driverGetVersion()}, CuPy {cp.__version__}")
    correctness_world1()
    correctness_multi_gpu()
    rows = []
    overhead = {}
    try:
        overhead = call_overhead()
    except Exception as e:
        RESULTS.append(("call overhead", "FAIL", f"{type(e).__name__}: {e}"))
        traceback.print_exc()
    try:
        rows = bandwidth(args.max_mib)
    except Exception as e:
        RESULTS.append(("bandwidth", "FAIL", f"{type(e).__name__}: {e}"))
        traceback.print_exc()
    failed = [r for r in RESULTS if r[1] != "ok"]
    print(f"== {len(RESULTS) - len(failed)} of {len(RESULTS)} checks passed")
    out = dict(machine=platform.node(), gpu=dev["name"].decode(), checks=RESULTS, allreduce=rows, call_overhead_us=overhead,
               note="world size 1: busbw is 0 by definition, algbw compared")
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "results", "gpu_check.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
