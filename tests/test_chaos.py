"""Chaos: over 20 seeded runs of a 4-rank training job under the launcher, one random rank is killed (SIGKILL),
stopped (SIGSTOP) or made slower than the operation deadline at a random step. Every run must end with a named
error on every survivor within the deadline plus 2 s of the fault, leave no process behind, and leave a checkpoint
that loads."""
import glob
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import ranks

import pycyxwiz as cx

DEADLINE_MS = 3000
JOB = textwrap.dedent("""
    import json, os, signal, sys, time
    import numpy as np, pycyxwiz as cx
    from pycyxwiz.datasets import load_digits
    out, victim, action, at_step = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    D = cx.distributed
    D.init()
    r = D.get_rank()
    with open(f"{out}/pid{r}", "w") as f:
        f.write(str(os.getpid()))

    class Fault(cx.callbacks.Callback):
        batch_metrics = False

        def on_batch_end(self, trainer, step, logs):
            if r == victim and step == at_step:
                with open(f"{out}/fault", "w") as f:
                    f.write(str(time.time()))
                if action == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif action == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                else:
                    time.sleep(60)  # slower than the operation deadline

    X, y = load_digits()
    m = cx.SequentialModel()
    m.add(cx.LinearModule(64, 32, seed=1)); m.add(cx.ReLUModule()); m.add(cx.LinearModule(32, 10, seed=2))
    cfg = D.DistributedTrainingConfig()
    cfg.epochs, cfg.batch_size, cfg.verbose = 40, 64, False
    cfg.checkpoint_every_n_epochs, cfg.checkpoint_dir = 1, f"{out}/ckpt"
    try:
        D.DistributedTrainer(m, cx.CrossEntropyLoss(), cx.SGDOptimizer(0.05)).fit(X, y, cfg, callbacks=[Fault()])
        result = {"error": None}
    except Exception as e:
        result = {"error": type(e).__name__, "message": str(e)[:2000]}
    result["t"] = time.time()
    with open(f"{out}/rank{r}.json", "w") as f:
        json.dump(result, f)
    sys.exit(1 if result["error"] else 0)
""")


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def plan(seed):
    rng = random.Random(seed)
    return rng.randrange(4), ("kill", "stop", "slow")[seed % 3], rng.randrange(12, 40)  # 7 steps an epoch


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(20))
def test_a_rank_killed_stopped_or_slowed_at_random_is_named_on_every_survivor(tmp_path, seed):
    victim, action, step = plan(seed)
    job = tmp_path / "job.py"
    job.write_text(JOB)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK")}
    env.update(MASTER_PORT=str(ranks.free_port()), DISTRIBUTED_OPERATION_TIMEOUT_MS=str(DEADLINE_MS),
               OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "pycyxwiz.launch", "--nproc-per-node", "4", str(job), str(tmp_path),
                        str(victim), action, str(step)], capture_output=True, text=True, timeout=180, env=env)
    assert p.returncode != 0, p.stderr
    fault = float((tmp_path / "fault").read_text())
    for r in range(4):
        if r == victim:
            continue
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert res["error"] in ("DistributedConnectionError", "DistributedTimeoutError"), (r, res)
        assert f"rank {victim}" in res["message"], (r, victim, action, res["message"][:500])
        assert res["t"] - fault < DEADLINE_MS / 1000 + 2, (r, action, res["t"] - fault, res["message"][:300])
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(4)]
    assert not any(alive(q) for q in pids), (action, [q for q in pids if alive(q)])
    ckpts = sorted(glob.glob(str(tmp_path / "ckpt" / "*.ckpt")))
    assert ckpts, os.listdir(tmp_path)
    cx.distributed.init(cx.distributed.DistributedConfig())  # a world of one, in this process
    try:
        m = cx.SequentialModel()
        m.add(cx.LinearModule(64, 32))
        m.add(cx.ReLUModule())
        m.add(cx.LinearModule(32, 10))
        tr = cx.distributed.DistributedTrainer(m, cx.CrossEntropyLoss(), cx.SGDOptimizer(0.05))
        tr.load_checkpoint(ckpts[-1])
        assert np.isfinite(m.flat_parameters()).all() and np.abs(m.flat_parameters()).sum() > 0
    finally:
        cx.distributed.finalize()
