"""Start the ranks of one library column as real OS processes, and never hang.

    run = run_ranks("pycyxwiz", "benchmarks._collective_worker", ["--op", "all_reduce"], world=2, timeout_s=60)
    run.ok, run.reason, run.ranks   # per-rank JSON payloads written by the worker

Every rank is a separate interpreter on 127.0.0.1. pycyxwiz and torch ranks get
RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT in the environment (a fresh free port per
run); Open MPI ranks are started by `mpirun`. A worker reports through a JSON file per rank
in a private directory, rewritten after every finished step, so a column that dies or hangs
half way still yields the steps it finished. When one rank fails, the others get a short
grace period and are then killed with their whole process group; a run that passes its
timeout is killed the same way. The failure becomes `reason`, which the tables print as
"n/a (reason)".

    run = run_ranks("torch", "benchmarks._hooks_worker", [...], world=4, timeout_s=240, link="1gbit")

With `link` (a tc rate), every rank runs as a process of a host of its own instead (tests/hosts.py:
network namespaces joined by a bridge), each host's link shaped to that rate both ways, as on
machines with a NIC of that speed: TCP between the ranks goes through the shaped links, not
through 127.0.0.1. MASTER_ADDR is host 0's address, the job gets a fresh secret (CX_AUTH_TOKEN:
pycyxwiz refuses a non-loopback MASTER_ADDR without one) and gloo the interface `eth0`. The
namespaces are deleted however the run ends (finished, failed, timed out, Ctrl-C or SIGTERM).
Where they cannot be made (not root, no `ip`), the column is n/a with the reason; Open MPI
columns do not take a link.

    run = run_ranks("pycyxwiz", ..., world=2, timeout_s=60, busy=2, busy_pin=True)

With `busy` N, N busy-loop processes (another job, a data loader) run beside the ranks for the
whole run, each pinned to core i mod cores with `busy_pin`, else placed by the scheduler
(busy_load).
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Note [Where results go]: benchmarks/results/ is committed and holds complete runs of the suite
# only (python -m benchmarks with its defaults, run to the end: staged, then moved in at once).
# Everything else, a partial suite (--quick, --skip, ...), one benchmark on its own or a run that
# was interrupted, writes benchmarks/results/partial/, which git ignores.
RESULTS = REPO / "benchmarks" / "results"
PARTIAL = RESULTS / "partial"

MPI_INSTALL_HINT = (
    "Open MPI not found: apt-get install -y openmpi-bin libopenmpi-dev, "
    "then pip install --force-reinstall --no-binary mpi4py mpi4py"
)

# The library columns. "pycyxwiz" is pycyxwiz over TCP (CX_SHM=0), the transport of gloo
# and "mpi-tcp", which forces Open MPI onto TCP: the fair comparisons, and what the targets are about.
# "pycyxwiz-shm" is pycyxwiz as it runs by default with every rank on one host, through
# shared memory; "mpi-default" lets Open MPI pick shared memory (vader) likewise.
LIBRARIES = ("pycyxwiz", "pycyxwiz-shm", "gloo", "mpi-tcp", "mpi-default")
# Columns for ranks on several hosts (`link` with `per_host` > 1), not run by default: pycyxwiz with
# shared memory inside a host and its collectives forced flat or hierarchical (CX_ALGORITHM);
# "pycyxwiz-hier-seq" is hierarchical in one slice: its phases one after the other, not pipelined
# (Note [Pipelined hierarchical all_reduce]).
ALGORITHM_COLUMNS = ("pycyxwiz-flat", "pycyxwiz-hier", "pycyxwiz-hier-seq")
# pycyxwiz with its ranks in one session, as `launch --one-session` starts them (Note [One session or
# one per rank] in pycyxwiz/launch.py), not run by default: every other column's ranks get a session
# each, as pycyxwiz's launcher and torchrun give them, except Open MPI's, which mpirun keeps in its one.
SESSION_COLUMNS = ("pycyxwiz-one-session", "pycyxwiz-shm-one-session")
# pycyxwiz through shared memory with large messages copied twice, through the rings, as before single copies
# (CX_SHM_SINGLE_COPY=0; Note [Single-copy large messages] in csrc/distributed/transport/shm/shm.h).
COPY_COLUMNS = ("pycyxwiz-shm-two-copies",)
# pycyxwiz over TCP with the machine's congestion control on every connection (CX_TCP_CONGESTION=system), as
# before reno between ranks on one host (Note [Congestion control between ranks on one host] in
# csrc/distributed/net/socket.cpp).
CC_COLUMNS = ("pycyxwiz-system-cc",)
EXTRA_COLUMNS = ALGORITHM_COLUMNS + SESSION_COLUMNS + COPY_COLUMNS + CC_COLUMNS
LIB_ENV = {"pycyxwiz": {"CX_SHM": "0"}, "pycyxwiz-shm": {"CX_SHM": "1"},
           "pycyxwiz-one-session": {"CX_SHM": "0"}, "pycyxwiz-shm-one-session": {"CX_SHM": "1"},
           "pycyxwiz-shm-two-copies": {"CX_SHM": "1", "CX_SHM_SINGLE_COPY": "0"},
           "pycyxwiz-system-cc": {"CX_SHM": "0", "CX_TCP_CONGESTION": "system"},
           "pycyxwiz-flat": {"CX_SHM": "1", "CX_ALGORITHM": "flat"},
           "pycyxwiz-hier": {"CX_SHM": "1", "CX_ALGORITHM": "hierarchical"},
           "pycyxwiz-hier-seq": {"CX_SHM": "1", "CX_ALGORITHM": "hierarchical", "CX_HIER_SLICE_BYTES": str(1 << 40)},
           "horovod-mpi": {"HOROVOD_CPU_OPERATIONS": "MPI"}, "horovod-gloo": {"HOROVOD_CPU_OPERATIONS": "gloo"}}
MPI_MCA = {
    "mpi-tcp": ["--mca", "pml", "ob1", "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo"],
    "mpi-default": [],
    "horovod-mpi": [],
}
# Horovod (benchmarks/horovod.py only; not a dependency): "horovod-mpi" is Horovod started by mpirun, its
# collectives Open MPI's (shared memory between ranks on one host); "horovod-gloo" is Horovod started by
# horovodrun --gloo, its collectives gloo's over TCP.
HOROVOD_COLUMNS = ("horovod-mpi", "horovod-gloo")
HOROVOD_INSTALL_HINT = (
    "Horovod not installed: see benchmarks/README.md, \"Against Horovod\", for the build that works with this torch")


def horovod_available() -> tuple[bool, str]:
    """(True, "") when horovod.torch imports in this interpreter, else (False, why)."""
    try:
        out = subprocess.run([sys.executable, "-c", "import horovod.torch"], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"{HOROVOD_INSTALL_HINT} ({exc})"
    if out.returncode:
        last = (out.stderr.strip().splitlines() or ["import failed"])[-1]
        return False, f"{HOROVOD_INSTALL_HINT} ({last[:200]})"
    return True, ""
# The port of the store with `link`: each run has hosts (namespaces) of its own, where every port is free.
_LINK_PORT = 29500
# Grace period for the surviving ranks after one rank failed: they usually fail on their own
# with a better message (the peer that died), which we prefer to a bare "killed".
_GRACE_S = 3.0
# Set by run_all: a monotonic time by which the whole suite must be done. Every column's
# timeout is clipped to it (but given at least _MIN_TIMEOUT_S), so one hung library cannot
# push the suite far past its budget.
suite_deadline: float | None = None
_MIN_TIMEOUT_S = 30.0


@dataclass
class RunResult:
    """What one column (one library, one world size) produced."""

    lib: str
    world: int
    ok: bool
    reason: str = ""  # empty when ok; else why the column (or its last steps) is n/a
    ranks: list = field(default_factory=list)  # per-rank payloads, rank order; None where missing
    wall_s: float = 0.0
    load: float = 0.0  # 1-minute load average when the run ended: high = other work competed for the CPUs
    warning: str = ""  # trouble after every rank had finished its work (e.g. a crash at exit)


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it; we release it at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_thread_env() -> dict:
    """One compute thread per rank for every library and BLAS that reads the environment."""
    return {
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }


def mpi_available() -> tuple[bool, str]:
    """(True, "") when mpirun and mpi4py are both usable, else (False, how to install)."""
    if shutil.which("mpirun") is None:
        return False, MPI_INSTALL_HINT
    probe = subprocess.run(
        [sys.executable, "-c", "import mpi4py"], capture_output=True, text=True, timeout=60
    )
    if probe.returncode != 0:
        return False, "mpi4py not importable: pip install mpi4py (after installing Open MPI)"
    return True, ""


def mpirun_command(lib: str, world: int) -> list:
    """mpirun's part of the command line of an Open MPI column (`lib` a key of MPI_MCA): `world` ranks on this
    host, unbound (as every other column's), one compute thread each, the transport the column names."""
    cmd = ["mpirun", "-n", str(world), "--oversubscribe", "--bind-to", "none"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += MPI_MCA[lib]
    for key in one_thread_env():
        cmd += ["-x", key]
    return cmd


def _base_env() -> dict:
    env = dict(os.environ)
    env.update(one_thread_env())
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo otherwise resolves the hostname to pick an interface
    return env


@functools.lru_cache(maxsize=None)
def _hosts_module():
    """tests/hosts.py, loaded by its path. The benchmarks and the tests use one implementation of the
    "hosts" (network namespaces, a bridge, tc shaping); tests/ is no package, hence not an import."""
    spec = importlib.util.spec_from_file_location("_cx_test_hosts", REPO / "tests" / "hosts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def link_available() -> str:
    """"" where `run_ranks(..., link=...)` can make its hosts here, else why not."""
    return _hosts_module().available() or ""


@contextlib.contextmanager
def _shaped_hosts(world: int, link: str):
    """`world` hosts, every link shaped to `link`; deleted on the way out, however it is taken.
    SIGTERM (a CI job cancelled, `timeout`) is turned into SystemExit for the while, so that it
    too unwinds through Hosts.__exit__ instead of leaving the namespaces behind."""
    hosts = _hosts_module()

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    main = threading.current_thread() is threading.main_thread()  # signal.signal works there only
    old = signal.signal(signal.SIGTERM, on_term) if main else None
    try:
        with hosts.Hosts(world) as h:
            for i in range(world):
                h.shape(i, link)
            yield h
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


# What a busy process runs: a loop that never sleeps nor makes a system call, as a CPU-bound job does.
_BUSY_LOOP = "while True: pass"


@contextlib.contextmanager
def busy_load(n: int, pin: bool = False):
    """N busy-loop processes for the duration of the block (none for n = 0). With `pin`, process i is
    bound to core i mod (cores this process may use), so that each core has its own; without, the
    scheduler places them (and moves them about) as it places the ranks."""
    procs = []
    try:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        for i in range(n):
            p = subprocess.Popen([sys.executable, "-c", _BUSY_LOOP], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, start_new_session=True)
            procs.append(p)
            if pin and cores:
                os.sched_setaffinity(p.pid, {cores[i % len(cores)]})
        yield procs
    finally:
        _kill(procs)


def _kill(procs: list) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 2.0
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the group: mpirun's ranks, torch's helpers
        except ProcessLookupError:
            pass
        p.wait()


def _load() -> float:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return 0.0


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


def _reason_from_stderr(text: str) -> str:
    """The most telling line of a crashed rank's stderr: the exception line if there is one."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ("Error" in ln or "Exception" in ln) and not ln.startswith("File "):
            return ln[:200]
    return lines[-1][:200] if lines else ""


def _watch(procs: list, timeout_s: float) -> tuple[str, int]:
    """Wait for all processes; return (failure reason or "", index of first failing proc)."""
    start = time.monotonic()
    failed_at = None
    first_bad = -1
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
        now = time.monotonic()
        if bad and failed_at is None:
            failed_at, first_bad = now, bad[0]
        if failed_at is not None and now - failed_at > _GRACE_S:
            _kill(procs)
            break
        if now - start > timeout_s:
            _kill(procs)
            return f"timed out after {timeout_s:.0f}s (killed)", -1
        time.sleep(0.02)
    codes = [p.returncode for p in procs]
    if first_bad < 0:
        first_bad = next((i for i, c in enumerate(codes) if c != 0), -1)
    if first_bad < 0:
        return "", -1
    return f"exit code {codes[first_bad]}", first_bad


def _collect(out_dir: Path, world: int) -> list:
    ranks = []
    for r in range(world):
        f = out_dir / f"rank{r}.json"
        try:
            ranks.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            ranks.append(None)
    return ranks


def run_ranks(lib: str, module: str, args: list, world: int, timeout_s: float,
              extra_env: dict | None = None, link: str | None = None, busy: int = 0,
              busy_pin: bool = False, per_host: int = 1) -> RunResult:
    """Run `python -m module args --lib ... --out DIR` on `world` ranks of library column `lib`.

    The worker must write DIR/rank<r>.json; see _worker_io.RankReport. With `link` (a tc rate such
    as "1gbit"), each rank on a host of its own behind a link of that rate (the module docstring).
    With `busy`, that many busy-loop processes run beside the ranks (busy_load). With `link` and
    `per_host` k, the ranks share hosts k at a time (rank r on host r // k, sharing its memory with the
    others there) instead of one host each.
    """
    t0 = time.monotonic()
    if suite_deadline is not None:
        timeout_s = min(timeout_s, max(_MIN_TIMEOUT_S, suite_deadline - t0))
    if per_host < 1 or world % per_host:
        raise ValueError(f"per_host={per_host} does not divide world={world}")
    if link is not None:
        if lib.startswith("mpi") or lib in HOROVOD_COLUMNS:
            return RunResult(lib, world, False, "link runs cover pycyxwiz and torch")
        why = link_available()
        if why:
            return RunResult(lib, world, False, why)
    with contextlib.ExitStack() as stack:
        out_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"cxbench-{lib}-")))
        stack.enter_context(busy_load(busy, busy_pin))
        hosts = None
        if link is not None:
            try:
                hosts = stack.enter_context(_shaped_hosts(world // per_host, link))
            except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as exc:
                detail = (getattr(exc, "stderr", None) or "").strip()
                return RunResult(lib, world, False, f"cannot make {world} hosts behind {link} links: {exc}"
                                 + (f" ({detail})" if detail else ""))
        env = _base_env()
        env.update(LIB_ENV.get(lib, {}))
        if hosts is not None:
            env.pop("CX_AUTH_TOKEN_FILE", None)
            env.update(CX_AUTH_TOKEN=secrets.token_hex(32), GLOO_SOCKET_IFNAME="eth0", LOCAL_WORLD_SIZE=str(per_host))
        env.update(extra_env or {})
        worker_lib = ("mpi" if lib.startswith("mpi") else "pycyxwiz" if lib.startswith("pycyxwiz")
                      else "horovod" if lib in HOROVOD_COLUMNS else lib)
        cmd = [sys.executable, "-m", module, "--lib", worker_lib, "--out", str(out_dir), *args]
        procs, logs = [], []
        if lib in HOROVOD_COLUMNS:
            ok, why = horovod_available()
            if not ok:
                return RunResult(lib, world, False, why)
        if lib == "horovod-gloo":
            # horovodrun's rendezvous (an HTTP server in this child) and its gloo ranks, all on this host.
            run = [sys.executable, "-m", "horovod.runner.launch", "-np", str(world), "-H", f"localhost:{world}",
                   "--gloo", "--start-timeout", str(int(min(timeout_s, 60)))]
            log = out_dir / "horovodrun.stderr"
            logs.append(log)
            with open(log, "w") as fh:
                procs.append(subprocess.Popen(run + cmd, env=env, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        elif lib.startswith("mpi") or lib == "horovod-mpi":
            ok, why = mpi_available()
            if not ok:
                return RunResult(lib, world, False, why)
            log = out_dir / "mpirun.stderr"
            logs.append(log)
            with open(log, "w") as fh:
                procs.append(subprocess.Popen(mpirun_command(lib, world) + cmd, env=env, cwd=REPO,
                                              stdout=subprocess.DEVNULL, stderr=fh, start_new_session=True))
        else:
            port = _LINK_PORT if hosts is not None else free_port()
            master = hosts.addrs[0] if hosts is not None else "127.0.0.1"
            if lib in SESSION_COLUMNS:
                from pycyxwiz.launch import rank_placement  # as `launch --one-session` places them
                placement = rank_placement(True)
            else:
                placement = dict(start_new_session=True)
            for r in range(world):
                renv = dict(env, RANK=str(r), WORLD_SIZE=str(world),
                            LOCAL_RANK=str(r % per_host if hosts is not None else r),
                            MASTER_ADDR=master, MASTER_PORT=str(port))
                renv.setdefault("DISTRIBUTED_TIMEOUT_MS", str(int(min(timeout_s, 60) * 1000)))
                log = out_dir / f"rank{r}.stderr"
                logs.append(log)
                argv = hosts.command(r // per_host, cmd) if hosts is not None else cmd
                with open(log, "w") as fh:
                    procs.append(subprocess.Popen(argv, env=renv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=fh,
                                                  **placement))
        try:
            reason, bad = _watch(procs, timeout_s)
        finally:
            _kill(procs)
        ranks = _collect(out_dir, world)
        if all(r and r.get("done") for r in ranks):
            # Every rank finished and saved its results: a crash in teardown (seen with gloo:
            # "terminate called without an active exception") does not void the numbers.
            notes = [r["close_error"] for r in ranks if r.get("close_error")]
            if reason:
                stderr = _reason_from_stderr(_tail(logs[min(bad, len(logs) - 1)])) if bad >= 0 else ""
                notes.append(stderr or reason)
            warning = ("after finishing: " + notes[0]) if notes else ""
            return RunResult(lib, world, True, "", ranks, time.monotonic() - t0, _load(), warning)
        # Prefer the error a worker wrote itself (it names the exception), then its stderr.
        errors = [r.get("error") for r in ranks if r and r.get("error")]
        if errors:
            reason = errors[0]
        elif reason and bad >= 0:
            reason = _reason_from_stderr(_tail(logs[min(bad, len(logs) - 1)])) or reason
        elif not reason and any(r is None for r in ranks):
            reason = "a rank wrote no result: " + (_reason_from_stderr(_tail(logs[0])) or "no output")
        return RunResult(lib, world, not reason, reason, ranks, time.monotonic() - t0, _load())
