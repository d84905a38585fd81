"""The launchers: launch_distributed.sh, python -m pycyxwiz.launch, cx.distributed.spawn, mpirun."""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import ranks

import pycyxwiz as cx

ROOT = Path(__file__).resolve().parents[1]
SH = ROOT / "launch_distributed.sh"

ALLREDUCE = textwrap.dedent("""
    import numpy as np, pycyxwiz as cx
    cx.distributed.init()
    x = np.full(4, cx.distributed.get_rank() + 1.0, np.float32)
    cx.distributed.all_reduce(x)
    print(f"sum {x[0]} world {cx.distributed.get_world_size()}", flush=True)
    cx.distributed.finalize()
""")

ONE_FAILS = textwrap.dedent("""
    import os, sys, time, pycyxwiz as cx
    cx.distributed.init()
    open(os.path.join(sys.argv[1], f"pid{cx.distributed.get_rank()}"), "w").write(str(os.getpid()))
    if cx.distributed.get_rank() == 1:
        print("rank one fails now", flush=True)
        sys.exit(7)
    time.sleep(60)  # the launcher must stop us long before this
""")


def script(tmp_path, text, name="job.py"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def env_without_rendezvous(**extra):
    env = dict(os.environ)
    for v in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR"]:
        env.pop(v, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_shell_launcher_runs_four_ranks_and_prefixes_their_output(tmp_path):
    job = script(tmp_path, ALLREDUCE)
    r = subprocess.run([str(SH), "4", sys.executable, job], capture_output=True, text=True, timeout=120,
                       env=env_without_rendezvous(MASTER_PORT=ranks.free_port()))
    assert r.returncode == 0, r.stderr
    lines = sorted(r.stdout.splitlines())
    assert lines == [f"[rank {k}] sum 10.0 world 4" for k in range(4)]


def test_shell_launcher_usage_error():
    r = subprocess.run([str(SH), "four", "python", "x.py"], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr


def test_python_launcher_show_ranks_keeps_only_the_chosen_output(tmp_path):
    job = script(tmp_path, ALLREDUCE)
    r = subprocess.run([sys.executable, "-m", "pycyxwiz.launch", "--nproc-per-node", "3", "--show-ranks", "0,2",
                        job], capture_output=True, text=True, timeout=120,
                       env=env_without_rendezvous(MASTER_PORT=ranks.free_port()))
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == ["[rank 0] sum 6.0 world 3", "[rank 2] sum 6.0 world 3"]


@pytest.mark.parametrize("launcher", ["sh", "python"])
def test_a_failing_rank_stops_the_others_and_the_launcher_names_it(tmp_path, launcher):
    job = script(tmp_path, ONE_FAILS)
    if launcher == "sh":
        cmd = [str(SH), "3", sys.executable, job, str(tmp_path)]
    else:
        cmd = [sys.executable, "-m", "pycyxwiz.launch", "--nproc-per-node", "3", job, str(tmp_path)]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                       env=env_without_rendezvous(MASTER_PORT=ranks.free_port()))
    assert time.monotonic() - t0 < 30
    assert r.returncode == 7
    assert "rank 1 exited with code 7" in r.stderr and "stopping the other ranks" in r.stderr
    assert "[rank 1] rank one fails now" in r.stdout
    pids = [int((tmp_path / f"pid{k}").read_text()) for k in (0, 2)]
    assert not any(alive(p) for p in pids)


def test_ctrl_c_stops_every_rank(tmp_path):
    job = script(tmp_path, ONE_FAILS.replace("== 1", "== 99"))  # nobody fails: all sleep
    p = subprocess.Popen([sys.executable, "-m", "pycyxwiz.launch", "--nproc-per-node", "2", job, str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env_without_rendezvous(MASTER_PORT=ranks.free_port()))
    deadline = time.monotonic() + 30
    while not all((tmp_path / f"pid{k}").exists() for k in (0, 1)):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 130 and "interrupted" in err
    assert not any(alive(int((tmp_path / f"pid{k}").read_text())) for k in (0, 1))


def test_busy_default_port_makes_the_launcher_pick_a_free_one(tmp_path):
    job = script(tmp_path, ALLREDUCE)
    blocker = socket.socket()
    try:
        blocker.bind(("127.0.0.1", 29500))
        blocker.listen()
    except OSError:
        pass  # already taken by someone else: just as good for this test
    try:
        r = subprocess.run([sys.executable, "-m", "pycyxwiz.launch", "--nproc-per-node", "2", job],
                           capture_output=True, text=True, timeout=120, env=env_without_rendezvous())
    finally:
        blocker.close()
    assert r.returncode == 0, r.stderr
    assert "port 29500 on 127.0.0.1 is in use; using MASTER_PORT=" in r.stderr


def test_two_nodes_on_one_machine_form_one_world(tmp_path):
    job = script(tmp_path, ALLREDUCE)
    port = ranks.free_port()
    cmd = [sys.executable, "-m", "pycyxwiz.launch", "--nproc-per-node", "2", "--nnodes", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(port)]
    nodes = [subprocess.Popen(cmd + ["--node-rank", str(k), job], stdout=subprocess.PIPE, text=True,
                              env=env_without_rendezvous()) for k in (1, 0)]
    outs = [n.communicate(timeout=120)[0] for n in nodes]
    assert all(n.returncode == 0 for n in nodes)
    lines = sorted("".join(outs).splitlines())
    assert lines == [f"[rank {k}] sum 10.0 world 4" for k in range(4)]


# ---- cx.distributed.spawn -------------------------------------------------------------

def spawned(rank, n):
    import numpy as np
    cx.distributed.init()
    x = np.full(n, rank + 1.0, np.float32)
    cx.distributed.all_reduce(x)
    cx.distributed.finalize()
    return float(x.sum())


def spawned_fails(rank):
    if rank == 1:
        raise RuntimeError("boom in rank one")
    time.sleep(30)


def test_spawn_returns_every_ranks_result():
    assert cx.distributed.spawn(spawned, 3, args=(5,)) == [30.0, 30.0, 30.0]


def test_spawn_reports_the_failing_rank_and_stops_the_rest():
    t0 = time.monotonic()
    with pytest.raises(cx.distributed.SpawnError, match="rank 1 failed: RuntimeError: boom in rank one"):
        cx.distributed.spawn(spawned_fails, 3)
    assert time.monotonic() - t0 < 20


# ---- mpirun (Open MPI) ---------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed "
                    "(apt-get install openmpi-bin)")
def test_mpirun_sets_rank_and_world_size_without_extra_variables(tmp_path):
    job = script(tmp_path, ALLREDUCE)
    port = ranks.free_port()
    r = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "3",
                        "-x", f"MASTER_PORT={port}", "-x", "PATH", "-x", "PYTHONPATH",
                        sys.executable, job], capture_output=True, text=True, timeout=120,
                       env=env_without_rendezvous())
    assert r.returncode == 0, r.stdout + r.stderr
    # Open MPI forwards each rank's output through its own I/O channel and may glue two ranks'
    # lines together ("sum 6.0 world 3sum 6.0 world 3"), so count the reports, not the lines.
    assert re.findall(r"sum \S+ world \S+?(?=sum|\s|$)", r.stdout) == ["sum 6.0 world 3"] * 3, r.stdout
