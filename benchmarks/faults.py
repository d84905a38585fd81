"""Time to error: how long each rank takes to raise a named error after a fault, and what it says.

    python -m benchmarks.faults                 # 5 runs of each fault on 3 ranks; prints a table
    python -m benchmarks.faults --runs 20 --world 4

Faults (each rank records when it raised and what; the faulty rank records when it struck):
  killed        a rank SIGKILLs itself in the middle of a stream of 4 MiB all_reduces
  raises        a rank's DistributedTrainer.fit raises ValueError; its process stays alive
  world_size    a rank is started with another WORLD_SIZE
  silent        a rank sleeps in the middle (the peers wait out a 2 s operation deadline)
Deadlines are 60 s except where a fault is about a deadline, so a figure far below 60 s means the
error came from the fault itself, not from a wait running out. No reference library: PyTorch's
gloo has no counterpart for most rows (a raising rank leaves its peers waiting the whole deadline).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

WORKER = textwrap.dedent("""
    import json, os, signal, sys, time
    import numpy as np, pycyxwiz as cx
    D = cx.distributed
    fault, faulty, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    rank = int(os.environ["RANK"])
    rec = {"rank": rank}
    def note(**kw):
        rec.update(kw)
        with open(f"{out}.{rank}", "w") as f:
            json.dump(rec, f)
    try:
        D.init()
        if fault == "killed" or fault == "silent":
            x = np.ones(1 << 20, np.float32)
            for i in range(1000):
                if rank == faulty and i == 5:
                    note(struck=time.time())
                    if fault == "killed":
                        os.kill(os.getpid(), signal.SIGKILL)
                    time.sleep(30)
                    sys.exit(0)
                D.all_reduce(x)
        elif fault == "raises":
            class Trainer(D.DistributedTrainer):
                def _after_step(self, config, world):
                    super()._after_step(config, world)
                    if rank == faulty and self._steps == 5:
                        note(struck=time.time())
                        raise ValueError("batch 5 has NaN labels")
            X, y = cx.datasets.load_digits()
            m = cx.SequentialModel(); m.add(cx.LinearModule(64, 10, seed=1))
            t = Trainer(m, cx.CrossEntropyLoss(), cx.SGDOptimizer(0.01))
            try:
                t.fit(X, y, D.DistributedTrainingConfig(epochs=50, batch_size=8, verbose=False))
            except ValueError:
                if rank == faulty:
                    time.sleep(10)   # alive: only the abort tells the peers
                raise
        D.finalize()
        note(error=None, time=time.time())
    except BaseException as e:
        note(error=f"{type(e).__name__}: {str(e)[:300]}", time=time.time())
""")

FAULTS = ("killed", "raises", "world_size", "silent")


def run_once(fault: str, world: int, folder: str, port: int) -> list:
    worker = os.path.join(folder, "worker.py")
    with open(worker, "w") as f:
        f.write(WORKER)
    faulty = world - 1
    out = os.path.join(folder, f"{fault}-{port}")
    procs = []
    started = time.time()
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world + 1 if fault == "world_size" and r == faulty
                                                            else world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DISTRIBUTED_TIMEOUT_MS="60000",
                   DISTRIBUTED_OPERATION_TIMEOUT_MS="2000" if fault == "silent" else "60000",
                   OMP_NUM_THREADS="1")
        if fault == "world_size" and r == faulty:
            env["RANK"] = str(r)
        procs.append(subprocess.Popen([sys.executable, worker, fault, str(faulty), out], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    for p in procs:
        try:
            p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
    recs = []
    for r in range(world):
        try:
            with open(f"{out}.{r}") as f:
                recs.append(json.load(f))
        except (OSError, ValueError):
            recs.append({"rank": r})
    struck = next((x["struck"] for x in recs if "struck" in x), started)
    rows = []
    for x in recs:
        if x["rank"] == faulty and fault != "world_size":
            continue
        rows.append((x["rank"], (x["time"] - struck) if "time" in x else None, x.get("error")))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.faults", description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--faults", nargs="+", default=list(FAULTS), choices=FAULTS)
    a = ap.parse_args(argv)
    from ._launch import free_port
    results = {}
    with tempfile.TemporaryDirectory(prefix="cx-faults-") as folder:
        for fault in a.faults:
            seconds, said = [], {}
            for _ in range(a.runs):
                for rank, t, err in run_once(fault, a.world, folder, free_port()):
                    if t is not None:
                        seconds.append(t)
                    said.setdefault(rank, err)
            results[fault] = {"median_s": statistics.median(seconds) if seconds else None,
                              "max_s": max(seconds) if seconds else None, "said": said}
            print(f"{fault:11s} median {results[fault]['median_s']:.3f} s, max {results[fault]['max_s']:.3f} s "
                  f"over {len(seconds)} rank-runs", flush=True)
            for rank, err in sorted(said.items()):
                print(f"    rank {rank}: {err}")
    os.makedirs(os.path.join(os.path.dirname(__file__), "results", "partial"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", "partial", "faults.json"), "w") as f:
        json.dump({"world": a.world, "runs": a.runs, "faults": results}, f, indent=1)


if __name__ == "__main__":
    main()
