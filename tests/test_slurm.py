"""Under Slurm: srun's tasks form a world with rank 0's address and port taken from the job, and a
plain `python train.py` in the batch script or an salloc shell is told to use srun instead of
waiting for peers that never come (Note [Slurm] in csrc/distributed/config.cpp). No real Slurm:
its variables are set as Slurm sets them (src/common/env.c)."""
import os
import socket
import time

import pytest

import ranks

import pycyxwiz as cx

D = cx.distributed

LAUNCH_VARIABLES = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_RANK",
                    "PMI_SIZE", "MPI_LOCALRANKID"]
SLURM_VARIABLES = ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_STEP_ID",
                   "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST"]


@pytest.fixture
def slurm(monkeypatch):
    """A clean environment with no launcher's variables; returns a function that sets Slurm's."""
    for v in LAUNCH_VARIABLES + SLURM_VARIABLES:
        monkeypatch.delenv(v, raising=False)

    def set_env(**values):
        for k, v in values.items():
            monkeypatch.setenv(k, str(v))
    return set_env


def srun_task(procid, ntasks, nodelist, job_id=4242, localid=None):
    """What srun gives each task: SLURM_PROCID/LOCALID, the step's SLURM_NTASKS, SLURM_STEP_ID."""
    return {"SLURM_PROCID": procid, "SLURM_NTASKS": ntasks, "SLURM_LOCALID": procid if localid is None else localid,
            "SLURM_JOB_ID": job_id, "SLURM_STEP_ID": 0, "SLURM_JOB_NODELIST": nodelist}


# ---- the first host of a hostlist --------------------------------------------------------

@pytest.mark.parametrize("nodelist,first", [
    ("node[01-04,07],gpu5", "node01"),
    ("node[07,01-04]", "node07"),
    ("a-[1-2]b", "a-1b"),
    ("a-[1-2]b,c", "a-1b"),
    ("host1,host2", "host1"),
    ("gpu5", "gpu5"),
    ("rack[2-3]-n[005-010]", "rack2-n005"),
    ("n[0001-0100]", "n0001"),
    ("node-x.cluster.org,node-y", "node-x.cluster.org"),
])
def test_master_addr_is_the_first_host_of_the_nodelist(slurm, nodelist, first):
    slurm(**srun_task(1, 4, nodelist))
    c = D.DistributedConfig.from_environment()
    assert (c.rank, c.world_size, c.local_rank, c.master_addr) == (1, 4, 1, first)


@pytest.mark.parametrize("nodelist", ["node[01-04", "node]01", "node[a-b]", "node[]", "node[04-01]", ",node1",
                                      "node[1-2,]"])
def test_a_nodelist_that_cannot_be_read_names_the_variable(slurm, nodelist):
    slurm(**srun_task(1, 4, nodelist))
    with pytest.raises(ValueError, match=r"SLURM_JOB_NODELIST='.*' is not valid: expected a Slurm hostlist"):
        D.DistributedConfig.from_environment()


def test_the_steps_own_nodes_win_over_the_jobs(slurm):
    # srun -N2 -w node03,node04 inside a job of node[01-04]: task 0 runs on node03
    slurm(**srun_task(2, 4, "node[01-04]"), SLURM_STEP_NODELIST="node[03-04]")
    assert D.DistributedConfig.from_environment().master_addr == "node03"


def test_master_port_is_the_same_for_every_task_of_a_job(slurm):
    ports = set()
    for procid in range(4):
        slurm(**srun_task(procid, 4, "node[1-2]", job_id=1234567))
        ports.add(D.DistributedConfig.from_environment().master_port)
    assert ports == {10000 + 1234567 % 20000}
    slurm(SLURM_JOB_ID=1234568)
    assert D.DistributedConfig.from_environment().master_port == 10000 + 1234568 % 20000


def test_explicit_master_addr_and_port_win(slurm):
    slurm(**srun_task(1, 4, "node[01-04]"), MASTER_ADDR="10.1.2.3", MASTER_PORT=23456)
    c = D.DistributedConfig.from_environment()
    assert (c.master_addr, c.master_port) == ("10.1.2.3", 23456)


def test_a_single_task_needs_no_master(slurm):
    slurm(**srun_task(0, 1, "node[01-04"))  # not even read: a world of one has no store
    c = D.DistributedConfig.from_environment()
    assert (c.world_size, c.master_addr, c.master_port) == (1, "127.0.0.1", 29500)


# ---- srun forms a world ---------------------------------------------------------------------

def free_port_of_a_job():
    """A job id whose port (10000 + id % 20000) is free here."""
    for _ in range(200):
        port = 10000 + int.from_bytes(os.urandom(2), "little") % 20000
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return 7 * 20000 + (port - 10000), port
    pytest.skip("no free port in 10000..29999")


def as_srun_task(job_id, nodelist, ntasks):
    # ranks.spawn numbers the processes in RANK and sets MASTER_*; srun sets none of them
    task = srun_task(int(os.environ["RANK"]), ntasks, nodelist, job_id=job_id)
    for v in LAUNCH_VARIABLES:
        os.environ.pop(v, None)
    os.environ.update({k: str(v) for k, v in task.items()})
    import numpy as np
    c = D.DistributedConfig.from_environment()
    D.init()
    x = np.full(3, D.get_rank() + 1.0, np.float32)
    D.all_reduce(x)
    out = (D.get_rank(), D.get_world_size(), D.get_local_rank(), c.master_addr, c.master_port, x.tolist())
    D.finalize()
    return out


def test_srun_tasks_form_a_world_at_the_first_host_and_the_jobs_port():
    job_id, port = free_port_of_a_job()
    nodelist = "localhost,node[02-03]"  # the first host must be this machine: rank 0's store listens there
    outs = ranks.run(as_srun_task, 3, args=(job_id, nodelist, 3), init=False, timeout=90)
    assert outs == [(r, 3, r, "localhost", port, [6.0, 6.0, 6.0]) for r in range(3)]


# ---- not started by srun -----------------------------------------------------------------------

@pytest.mark.parametrize("where", ["batch script", "salloc shell"])
def test_python_in_an_allocation_without_srun_is_told_to_use_srun(slurm, where):
    # sbatch -n 4: the batch script is task 0 of the job's "batch" step (SLURM_PROCID=0, no
    # SLURM_STEP_ID); salloc -n 4: a shell with neither.
    slurm(SLURM_JOB_ID=777, SLURM_NTASKS=4, SLURM_JOB_NODELIST="node[01-02]")
    if where == "batch script":
        slurm(SLURM_PROCID=0, SLURM_LOCALID=0)
    for call in (D.DistributedConfig.from_environment, D.init):
        t0 = time.monotonic()
        with pytest.raises(ValueError) as ei:
            call()
        assert time.monotonic() - t0 < 5  # at once, not after waiting for peers
        msg = str(ei.value)
        assert "this looks like a Slurm allocation of 4 tasks" in msg, msg
        assert "not started by srun" in msg and "`srun python train.py`" in msg, msg
        assert "set RANK and WORLD_SIZE yourself" in msg, msg
    assert not D.is_initialized()


def test_explicit_rank_and_world_size_win_in_an_allocation(slurm):
    slurm(SLURM_JOB_ID=777, SLURM_NTASKS=4, SLURM_PROCID=0, SLURM_LOCALID=0, RANK=1, WORLD_SIZE=2)
    c = D.DistributedConfig.from_environment()
    assert (c.rank, c.world_size, c.master_addr, c.master_port) == (1, 2, "127.0.0.1", 29500)


def test_a_one_task_allocation_runs_as_a_world_of_one(slurm):
    slurm(SLURM_JOB_ID=777, SLURM_NTASKS=1, SLURM_PROCID=0, SLURM_LOCALID=0, SLURM_JOB_NODELIST="node01")
    D.init()
    try:
        assert (D.get_rank(), D.get_world_size()) == (0, 1)
    finally:
        D.finalize()
