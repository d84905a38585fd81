"""Start N ranks of a training script on this machine (torchrun-like).

    python -m pycyxwiz.launch --nproc-per-node 4 train.py --epochs 3
    python -m pycyxwiz.launch --nproc-per-node 2 -m mypackage.train        # a module, as python -m
    python -m pycyxwiz.launch --nproc-per-node 2 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 train.py
    ./launch_distributed.sh 4 python train.py          # the same, through the shell launcher

Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
and, unless set already, OMP_NUM_THREADS (this node's CPUs shared among its ranks) and,
for a job of one node, a fresh job secret CX_AUTH_TOKEN (the nodes of a multi-node job
share one the user sets: README, "The job secret and the threat model").
Every line a rank prints is prefixed with "[rank N]", its stdout on stdout and its
stderr on stderr (--show-ranks 0 keeps only rank 0's; --log-dir writes them to files).
On a terminal, the rank shown first may draw DistributedTrainer's progress bar, which
the launcher redraws in place (Note [Redraws through the launcher]).
If a rank fails, the others are stopped and the launcher exits with its exit code,
naming the rank that failed first, with the last lines of its stderr; with --max-restarts N
it starts them all again instead, up to N times, with RESTART_COUNT set (Note [Restarts]).
Ctrl-C stops every rank, and so does the launcher's own death (even by SIGKILL).
Each rank runs in a session of its own, as torchrun's do; --one-session keeps them in the
launcher's, which on a machine shared with other jobs makes small models and small messages
faster and large computations slower (Note [One session or one per rank]).
"""
from __future__ import annotations

import argparse
import codecs
import collections
import ctypes
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Deque, Dict, IO, List, Optional, Sequence

from . import _env, _failure
from ._env import job_secret_env

DEFAULT_PORT = 29500
BAR_ENV = "CX_PROGRESS_BAR"  # the rank may draw a progress bar: Note [Redraws through the launcher]
TAIL_LINES = 12  # lines of the failing rank's stderr shown in the launcher's report
REPORT_CHARS = 300  # of an error the console has shown in full already
STOP_GRACE_S = 1.0  # after a rank fails, how long the others may take to exit before they are stopped
RESTART_PAUSE_S = 1.0  # between a failed group's end and the next start: sockets and ports are released


def _port_free(addr: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
            return True
        except OSError:
            return False


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _parse_ranks(text: Optional[str]) -> Optional[set]:
    if text is None:
        return None
    try:
        return {int(t) for t in text.split(",") if t.strip()}
    except ValueError:
        raise SystemExit(f"launch: --show-ranks expects a comma-separated list of ranks, got {text!r}")


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def nproc_from(text: str) -> int:
    """--nproc-per-node: a number, or as torchrun: 'gpu' (GPUs visible), 'cpu' (CPUs), 'auto'
    (GPUs with DISTRIBUTED_BACKEND=nccl, CPUs otherwise)."""
    if text.isdigit():
        return int(text)
    if text not in ("auto", "cpu", "gpu"):
        raise SystemExit(f"launch: --nproc-per-node expects a number, 'auto', 'cpu' or 'gpu', got {text!r}")
    gpu = text == "gpu" or (text == "auto" and (_env.get("DISTRIBUTED_BACKEND") or "").lower() == "nccl")
    if not gpu:
        return _cpus()
    from . import _core

    n = _core.dist._cuda_device_count()
    if n < 1:
        raise SystemExit(f"launch: --nproc-per-node {text} counts GPUs, and none is visible here")
    return n


def _command(cmd: Sequence[str], module: bool = False) -> List[str]:
    """`train.py args` runs with this Python, `-m pkg` as python -m; any other program runs as given."""
    cmd = list(cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise SystemExit("launch: no command given (e.g. `python -m pycyxwiz.launch --nproc-per-node 2 train.py`)")
    if module:
        return [sys.executable, "-m", *cmd]
    if cmd[0] == "-m":
        return [sys.executable, *cmd]
    if cmd[0].endswith(".py"):
        cmd = [sys.executable, *cmd]
    if len(cmd) > 1 and cmd[1].endswith(".py") and Path(cmd[0]).name.startswith("python") and \
            not Path(cmd[1]).is_file():
        raise SystemExit(f"launch: {cmd[1]}: no such file")
    return cmd


def _die_with_launcher(parent: int):
    """A preexec_fn: the rank gets SIGTERM when the launcher dies, even by SIGKILL."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    prctl = getattr(libc, "prctl", None)
    if prctl is None:  # not Linux
        return None

    def arm() -> None:
        prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(1)

    return arm


# Note [One session or one per rank]
# Linux's scheduler (with autogroup, its default where the processes are not in a cgroup of their
# own, as on this project's VMs) shares the CPU out among sessions first, then among the processes
# of a session. A rank in a session of its own (the default, as torchrun starts its ranks) is one
# share; --one-session keeps the ranks in the launcher's session, each in its own process group
# (the terminal's Ctrl-C reaches the launcher alone, which stops them with killpg, as before), so
# the job is one share. On a quiet machine the two are level within the noise (training 0.89-1.10x;
# all_reduce 0.84-1.38x by size, 4 ranks on 2 cores gaining most). Beside processes of other
# sessions they differ, and neither wins everywhere (2 vCPUs, one busy-loop process per core, each
# in its own session, as `benchmarks.allreduce --busy 2` and `benchmarks.train --busy 2` start
# them; one session against one each, benchmarks/README.md, "Busy machines"):
# - In one session, a rank that waits for a peer on its own core hands the core to that peer
#   (sched_yield and sleeping hand over within a session, not between sessions), and the job's
#   share goes to the cores where its ranks have work. 8 B and 4 KiB all_reduce on 4 ranks through
#   shared memory: 17 and 23 us against 104 and 108 (Open MPI, whose mpirun keeps its ranks in one
#   session: 14 and 52); the training benchmark (MLP 784-256-10, about 1 ms of compute per step):
#   1.3-2.0x the samples/s.
# - In a session each, a job of N ranks gets N shares against one for each other job, and whatever
#   keeps every rank computing needs that CPU: 64 MiB all_reduce 1.4-1.8x the bandwidth, an MLP
#   784-4096-10 1.3-1.8x the samples/s.
# The ranks of `cx.distributed.launch_distributed_training` (multiprocessing) share the caller's
# session, as with --one-session. In one session a rank's stdin is /dev/null: a background process
# group that read the terminal would be stopped (SIGTTIN) for good.
def rank_placement(one_session: bool, preexec=None) -> dict:
    """subprocess.Popen arguments placing a rank (Note [One session or one per rank]): a session of its
    own, or with one_session its own process group in the caller's session; preexec runs in the child."""
    if not one_session:
        return dict(start_new_session=True, preexec_fn=preexec)

    def own_group() -> None:
        os.setpgid(0, 0)
        if preexec is not None:
            preexec()

    return dict(preexec_fn=own_group, stdin=subprocess.DEVNULL)


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _how(rc: Optional[int]) -> str:
    if rc is None:
        return "is still running"
    return f"was killed by {_signal_name(rc)}" if rc < 0 else f"exited with code {rc}"


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen
    error_file: str
    tail: Deque[str] = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    rc: Optional[int] = None
    exit_time: float = 0.0
    signalled: bool = False  # the launcher sent it a signal (it was still running after another rank failed)
    report: Optional[dict] = None  # its uncaught exception (pycyxwiz._failure), read once it has exited
    shown: bool = False  # its stderr was passed to the console as it came

    @property
    def stopped(self) -> bool:
        """It died of the launcher's signal (not of its own error a moment before the signal came)."""
        return self.signalled and self.rc is not None and self.rc < 0


def _is_tty(stream: Optional[IO[str]]) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


class _Console:
    """What the pumps write to the launcher's stdout and stderr, and the one redrawn line there.

    Note [Redraws through the launcher]: a rank's stdout is a pipe, so the rank cannot see that the
    launcher shows its output on a terminal, and DistributedTrainer would print plain lines. So when
    the launcher's own stdout is a terminal, it tells the rank whose output it shows first (rank 0,
    or the first of --show-ranks) with CX_PROGRESS_BAR=1 that it may draw its bar, and that rank's
    pump passes redraws through (_pump_redraws): it reads what arrives, not lines, and a carriage
    return starts the line again, behind the rank's prefix, so the next redraw overwrites the last
    ("\r[rank 0] Epoch 1/3 [=====>....] ..."). That line stays the last one on the screen: a line
    from any other pump (another rank, a stderr) first clears it, is written, and the line is drawn
    again below it. Nothing of this happens where the launcher's stdout is not a terminal: no rank
    is told, every pump reads whole lines, and logs hold no carriage returns. --log-dir files of
    the redrawing rank get each redraw as a plain line.
    """

    def __init__(self, stdout: IO[str]) -> None:
        self.stdout = stdout
        self._lock = threading.Lock()
        self._open = ""        # the redrawn line as the screen shows it (prefix included); "" if none
        self._restart = False  # a carriage return came: the next text starts that line again

    def line(self, out: IO[str], text: str) -> None:
        """Writes a whole line (text ends with a newline) to out, keeping the redrawn line below it."""
        with self._lock:
            shared = self._open and (out is self.stdout or _is_tty(out))
            if shared:
                self.stdout.write("\r\x1b[K")
                self.stdout.flush()
            out.write(text)
            out.flush()
            if shared:
                self.stdout.write(self._open)
                self.stdout.flush()

    def redraw(self, prefix: str, text: str) -> None:
        """Writes what a redrawing rank printed (any piece of it) to stdout, passing carriage returns."""
        with self._lock:
            for piece in _PIECES.split(text):
                if piece == "\n":
                    self.stdout.write(("" if self._open else prefix) + "\n")
                    self._open, self._restart = "", False
                elif piece == "\r":
                    self._restart = True
                elif piece:
                    if self._restart or not self._open:
                        self.stdout.write(("\r" if self._restart else "") + prefix + piece)
                        self._open, self._restart = prefix + piece, False
                    else:
                        self.stdout.write(piece)
                        self._open += piece
            self.stdout.flush()

    def end(self) -> None:
        """Ends a line left open by a redraw, so what the launcher says next starts on its own line."""
        with self._lock:
            if self._open:
                self.stdout.write("\n")
                self.stdout.flush()
            self._open, self._restart = "", False


_PIECES = re.compile(r"(\r|\n)")
_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # a terminal's control sequences (\x1b[K: erase to the end)


def _pump(stream: IO[bytes], prefix: str, out: Optional[IO[str]], screen: _Console, log: Optional[IO[bytes]],
          tail: Optional[Deque[str]]) -> None:
    """Copies a rank's stream line by line to out (prefixed), its log file and its tail."""
    for raw in iter(stream.readline, b""):
        if log is not None:
            log.write(raw)
            log.flush()
        line = raw.decode(errors="replace")
        if tail is not None:
            tail.append(line.rstrip("\n"))
        if out is not None:
            screen.line(out, prefix + line)
    stream.close()
    if log is not None:
        log.close()


def _pump_redraws(stream: IO[bytes], prefix: str, screen: _Console, log: Optional[IO[bytes]]) -> None:
    """The stdout of the rank told it may redraw: Note [Redraws through the launcher]."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    record = ""  # for the log: the text since the last carriage return or newline
    fd = stream.fileno()
    while True:
        data = os.read(fd, 1 << 16)
        text = decoder.decode(data, final=not data)
        if text:
            screen.redraw(prefix, text)
        if log is not None:
            *done, record = _PIECES.split(record + text)
            lines = [_ESCAPES.sub("", t) for t in done if t not in ("\r", "\n")]
            if not data:
                lines.append(_ESCAPES.sub("", record))
            lines = [t for t in lines if t]
            if lines:
                log.write("".join(t + "\n" for t in lines).encode())
                log.flush()
        if not data:
            break
    stream.close()
    if log is not None:
        log.close()


def _root_cause(failed: List[_Rank]) -> _Rank:
    """Note [Root cause]: when one rank fails, its peers fail too a few milliseconds later, as
    they find its connections closed; and the launcher may well see a bystander's exit first.
    So the rank named is the one that failed first: by the time its uncaught exception was
    recorded (pycyxwiz._failure, written before the process starts to close its connections),
    else by its exit. A rank whose exception is a lost connection to a peer is named only when
    every failed rank has one (say, a network that went down for all)."""
    def when(r: _Rank) -> float:
        return r.report["time"] if r.report else r.exit_time

    def consequence(r: _Rank) -> bool:
        return r.report is not None and "DistributedConnectionError" in r.report.get("bases", [])

    first_hand = [r for r in failed if not consequence(r)]
    return min(first_hand or failed, key=when)


class _Terminated(Exception):
    """The launcher got SIGTERM (its handler raises this in the main thread)."""


def _report(cause: _Rank, others: List[_Rank], out: IO[str]) -> None:
    rep = cause.report
    what = f"{rep['type']}: {rep['message']}" if rep else ""
    how = _how(cause.rc)
    if cause.stopped:
        how = f"raised and was then stopped by the launcher ({_how(cause.rc)})" if rep else how
    if cause.shown and len(what) > REPORT_CHARS:  # in full just above, in the rank's own traceback
        what = what[:REPORT_CHARS] + f"... ({len(what) - REPORT_CHARS} more characters in rank {cause.rank}'s " \
                                     "traceback above)"
    lines = [f"[launch] rank {cause.rank} failed first: it {how}" + (f": {what}" if what else "")]
    if cause.tail and not cause.shown:  # its stderr went to a log file or was hidden (--show-ranks)
        lines.append(f"[launch] the last lines of rank {cause.rank}'s stderr:")
        lines += [f"[launch]   {t}" for t in cause.tail if t.strip() != what]  # the error line is given above
    if others:
        def fate(r: _Rank) -> str:
            if r.report:
                return f"rank {r.rank} raised {r.report['type']}"
            return f"rank {r.rank} was stopped by the launcher" if r.stopped else f"rank {r.rank} {_how(r.rc)}"

        lines.append("[launch] the other ranks stopped because of it: " + "; ".join(fate(r) for r in others))
    out.write("\n".join(lines) + "\n")
    out.flush()


def run(nproc: int, cmd: Sequence[str], nnodes: int = 1, node_rank: int = 0, master_addr: Optional[str] = None,
        master_port: Optional[int] = None, show_ranks: Optional[set] = None, prefix: bool = True,
        module: bool = False, log_dir: Optional[str] = None, tee: bool = False,
        max_restarts: Optional[int] = None, one_session: Optional[bool] = None) -> int:
    """Run the ranks of this node; return the exit code the launcher should exit with.

    With max_restarts (default $CX_MAX_RESTARTS, else 0) a failed group is started again, up to
    that many times (Note [Restarts]); with one_session (default $CX_ONE_SESSION, else False) the ranks
    stay in the launcher's session (Note [One session or one per rank])."""
    if nproc < 1:
        raise SystemExit(f"launch: --nproc-per-node must be at least 1, got {nproc}")
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise SystemExit(f"launch: --node-rank {node_rank} is out of range for --nnodes {nnodes}")
    if tee and not log_dir:
        raise SystemExit("launch: --tee shows the output that --log-dir writes to files; give --log-dir too")
    argv = _command(cmd, module)
    addr = master_addr or _env.get("MASTER_ADDR") or "127.0.0.1"
    given_port = _env.get("MASTER_PORT")
    port = master_port or (int(given_port) if given_port else None)
    if port is None:
        port = DEFAULT_PORT
        if nnodes == 1 and not _port_free(addr, port):
            new = _free_port(addr)
            print(f"[launch] port {port} on {addr} is in use; using MASTER_PORT={new}", file=sys.stderr, flush=True)
            port = new
    threads_env = {}
    if not _env.is_set("OMP_NUM_THREADS") and nproc > 1:
        n = max(1, _cpus() // nproc)
        threads_env["OMP_NUM_THREADS"] = str(n)
    if max_restarts is None:
        max_restarts = _max_restarts_from_env()
    if max_restarts < 0:
        raise SystemExit(f"launch: --max-restarts must be >= 0, got {max_restarts}")
    if one_session is None:
        one_session = _one_session_from_env()
    secret_env = job_secret_env(nnodes)  # one per job: every start of it shares it
    job = _Job(argv, nproc, nnodes, node_rank, addr, port, threads_env, secret_env, show_ranks, prefix, log_dir, tee,
               one_session)
    for restart in range(max_restarts + 1):
        code, failed = _Group(job, restart).run()
        if not failed or restart == max_restarts:
            if failed and max_restarts:
                print(f"[launch] giving up after {max_restarts} restart(s)", file=sys.stderr, flush=True)
            return code
        print(f"[launch] restarting every rank of this node ({restart + 1} of at most {max_restarts} restarts, "
              f"RESTART_COUNT={restart + 1})", file=sys.stderr, flush=True)
        time.sleep(RESTART_PAUSE_S)
    return code


# Note [Restarts]
# With --max-restarts N (or CX_MAX_RESTARTS=N, which the shell launcher passes on), a rank that
# fails does not end the job: once the launcher has stopped the others and named the cause, it
# starts every rank of its node again, with RESTART_COUNT=1, 2, ... up to N; a clean exit or a
# Ctrl-C ends it. DistributedTrainer then resumes by itself from the newest checkpoint that loads
# cleanly (DistributedTrainingConfig.auto_resume, on where fit writes checkpoints), so a job with
# checkpoints loses at most the work since the last one, and with the same data order, dropout
# masks and optimizer state ends where an uninterrupted run ends (tests/test_restarts.py).
# Several nodes: a rank's failure fails every rank of the job within a second (they find it gone),
# so every node's launcher restarts its ranks, each with the next RESTART_COUNT, and the group meets
# again at rank 0's new store. The count is the group's generation: rank 0's store refuses a rank
# of another one by name (Config::generation in csrc/distributed/config.h), so a rank left over
# from an earlier start, or a node that restarted once more than the others, fails at init instead
# of joining a group it does not belong to.
def _max_restarts_from_env() -> int:
    text = (_env.get("CX_MAX_RESTARTS") or "").strip()
    if not text:
        return 0
    if not text.isdigit():
        raise SystemExit(f"launch: CX_MAX_RESTARTS={text!r} is not valid: expected a number of restarts >= 0")
    return int(text)


def _one_session_from_env() -> bool:
    text = (_env.get("CX_ONE_SESSION") or "0").strip()
    if text not in ("0", "1"):
        raise SystemExit(f"launch: CX_ONE_SESSION={text!r} is not valid: expected 1 (the ranks in the launcher's "
                         "session) or 0 (a session per rank)")
    return text == "1"


@dataclass
class _Job:
    """What every start of this node's ranks shares (run()'s arguments, resolved)."""
    argv: List[str]
    nproc: int
    nnodes: int
    node_rank: int
    addr: str
    port: int
    threads_env: Dict[str, str]
    secret_env: Dict[str, str]
    show_ranks: Optional[set]
    prefix: bool
    log_dir: Optional[str]
    tee: bool
    one_session: bool = False


class _Group:
    """One start of this node's ranks: start() them, watch() until they end or one fails, stop() the
    rest, report() the cause. run() makes one per start (Note [Restarts])."""

    def __init__(self, job: _Job, restart: int):
        self.job, self.restart = job, restart
        self.scratch = tempfile.TemporaryDirectory(prefix="cx-launch-")
        logs = Path(job.log_dir) if job.log_dir else None
        if logs is not None and restart:
            logs = logs / f"restart_{restart}"  # each start's output apart
        self.logs = logs
        self.console = logs is None or job.tee
        self.screen = _Console(sys.stdout)
        first = job.node_rank * job.nproc
        shown = [first + local for local in range(job.nproc) if job.show_ranks is None or first + local in job.show_ranks]
        # Note [Redraws through the launcher]: the rank shown first may draw a progress bar.
        self.redrawing = shown[0] if self.console and shown and _is_tty(sys.stdout) else None
        self.ranks: List[_Rank] = []
        self.pumps: List[threading.Thread] = []
        self.exits: "queue.Queue[_Rank]" = queue.Queue()

    def run(self) -> tuple:
        """Returns (exit code, whether a rank failed and the user did not stop the job)."""
        try:
            self.start()
            code, failed, interrupted = self.watch()
            drained = time.monotonic() + 2  # a rank's child may hold its pipes open: do not wait for it long
            for t in self.pumps:
                t.join(max(0.0, drained - time.monotonic()))
            self.screen.end()
            if failed:
                code = self.report()
            return code, failed and not interrupted
        finally:
            self.scratch.cleanup()

    def _env(self, rank: int, local: int, error_file: str) -> Dict[str, str]:
        job = self.job
        env = dict(os.environ)
        env.update(job.threads_env)
        env.update(job.secret_env)
        env.update(RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(job.nnodes * job.nproc),
                   LOCAL_WORLD_SIZE=str(job.nproc), MASTER_ADDR=job.addr, MASTER_PORT=str(job.port),
                   PYTHONUNBUFFERED="1", RESTART_COUNT=str(self.restart))
        env[_failure.ENV] = error_file
        if rank == self.redrawing:
            env.setdefault(BAR_ENV, "1")  # unless the user chose (CX_PROGRESS_BAR=0: plain lines)
        return env

    def start(self) -> None:
        """Starts every rank, then the threads that pass on their output and wait for their exits."""
        job = self.job
        # Every rank is started before any thread is: the preexec_fn runs between fork and exec,
        # where another thread's lock could be held.
        arm = _die_with_launcher(os.getpid())
        for local in range(job.nproc):
            rank = job.node_rank * job.nproc + local
            folder = self.logs / f"rank_{rank}" if self.logs else Path(self.scratch.name)
            folder.mkdir(parents=True, exist_ok=True)
            error_file = str(folder / ("error.json" if self.logs else f"error_{rank}.json"))
            try:
                os.unlink(error_file)  # a report of an earlier run in the same --log-dir
            except FileNotFoundError:
                pass
            try:
                p = subprocess.Popen(job.argv, env=self._env(rank, local, error_file), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, **rank_placement(job.one_session, arm))
            except OSError as e:
                for r in self.ranks:
                    os.killpg(r.proc.pid, signal.SIGKILL)
                    r.proc.wait()
                raise SystemExit(f"launch: cannot start {job.argv[0]!r}: {e.strerror}"
                                 + (" (not found on PATH)" if isinstance(e, FileNotFoundError) else ""))
            self.ranks.append(_Rank(rank, p, error_file))
        if job.threads_env and self.restart == 0:
            print(f"[launch] OMP_NUM_THREADS={job.threads_env['OMP_NUM_THREADS']} for each rank ({_cpus()} CPUs, "
                  f"{job.nproc} ranks on this node); set OMP_NUM_THREADS to choose another value", file=sys.stderr,
                  flush=True)
        for r in self.ranks:
            self._follow(r)

    def _follow(self, r: _Rank) -> None:
        show = self.console and (self.job.show_ranks is None or r.rank in self.job.show_ranks)
        r.shown = bool(show)
        pre = f"[rank {r.rank}] " if self.job.prefix else ""
        for stream, out, name, tail in ((r.proc.stdout, sys.stdout, "stdout", None),
                                        (r.proc.stderr, sys.stderr, "stderr", r.tail)):
            log = open(self.logs / f"rank_{r.rank}" / f"{name}.log", "wb") if self.logs else None
            if r.rank == self.redrawing and name == "stdout":
                t = threading.Thread(target=_pump_redraws, args=(stream, pre, self.screen, log), daemon=True)
            else:
                t = threading.Thread(target=_pump, args=(stream, pre, out if show else None, self.screen, log, tail),
                                     daemon=True)
            t.start()
            self.pumps.append(t)
        threading.Thread(target=self._wait, args=(r,), daemon=True).start()

    def _wait(self, r: _Rank) -> None:
        r.rc = r.proc.wait()
        r.exit_time = time.time()
        self.exits.put(r)

    def watch(self) -> tuple:
        """Waits for the ranks; on the first failure, a grace period, then stop() the rest.
        Returns (exit code, a rank failed, the user or a scheduler stopped the job)."""
        old = signal.signal(signal.SIGTERM, _on_sigterm)
        failed = False
        try:
            running = len(self.ranks)
            while running:
                try:
                    r = self.exits.get(timeout=0.5)
                except queue.Empty:
                    continue
                running -= 1
                if r.rc != 0:
                    # The others fail too within milliseconds once they find this rank gone (and the
                    # rank that caused it may still be exiting): a moment for them to finish on their
                    # own, so their exit codes and reports are their own; then stop whoever is left.
                    failed = True
                    grace = time.monotonic() + STOP_GRACE_S
                    while running and time.monotonic() < grace:
                        try:
                            self.exits.get(timeout=max(0.0, grace - time.monotonic()))
                            running -= 1
                        except queue.Empty:
                            break
                    self.stop()
                    return 0, True, False
            return 0, False, False
        except KeyboardInterrupt:
            self.screen.line(sys.stderr, "[launch] interrupted; stopping all ranks\n")
            self.stop(signal.SIGINT)
            return 130, failed, True  # 128 + SIGINT, as a shell reports Ctrl-C; the user's stop: never restarted
        except _Terminated:
            # A scheduler or `kill` stopping the job: the ranks get SIGTERM too (a grace period, then
            # SIGKILL), and the launcher exits as a process killed by SIGTERM would be reported.
            self.screen.line(sys.stderr, "[launch] terminated (SIGTERM); stopping all ranks\n")
            self.stop(signal.SIGTERM)
            return 128 + signal.SIGTERM, failed, True
        finally:
            signal.signal(signal.SIGTERM, old)

    def stop(self, sig=signal.SIGTERM) -> None:
        """Signals every rank still running, and SIGKILLs those still there 5 s later."""
        for r in self.ranks:
            if r.proc.poll() is None:
                r.signalled = True
                try:
                    os.killpg(r.proc.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        for r in self.ranks:
            try:
                r.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(r.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                r.proc.wait()

    def report(self) -> int:
        """Names the rank that failed first, and what became of the others; returns the exit code."""
        for r in self.ranks:  # the waiter threads record rc and exit time; the stopped ones have exited by now
            if r.rc is None:
                r.rc = r.proc.wait()
                r.exit_time = r.exit_time or time.time()
            r.report = _failure.read(r.error_file)
        bad = [r for r in self.ranks if r.rc != 0]
        cause = _root_cause([r for r in bad if not r.stopped or r.report] or bad)
        _report(cause, [r for r in bad if r is not cause], sys.stderr)
        return cause.rc if cause.rc and cause.rc > 0 else 128 - (cause.rc or -1)


def _on_sigterm(signum, frame):
    raise _Terminated


def main(argv: Optional[Sequence[str]] = None) -> None:
    invoked = Path(sys.argv[0]).name
    prog = invoked if invoked.startswith("cyxwiz-launch") else "python -m pycyxwiz.launch"
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc-per-node", "--nproc_per_node", default="1",
                    help="ranks on this machine: a number, 'gpu', 'cpu' or 'auto' (default 1)")
    ap.add_argument("--nnodes", type=int, default=1, help="machines in the job (default 1)")
    ap.add_argument("--node-rank", "--node_rank", type=int, default=0, help="this machine's index (default 0)")
    ap.add_argument("--master-addr", "--master_addr", default=None, help="address of rank 0 (default $MASTER_ADDR or 127.0.0.1)")
    ap.add_argument("--master-port", "--master_port", type=int, default=None,
                    help="port of rank 0's store (default $MASTER_PORT or 29500; a free one if 29500 is taken)")
    ap.add_argument("--show-ranks", default=None, help="comma-separated ranks whose output is shown (default: all)")
    ap.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with [rank N]")
    ap.add_argument("--log-dir", "--log_dir", default=None,
                    help="write each rank's output to DIR/rank_N/stdout.log and stderr.log instead of the console")
    ap.add_argument("--tee", action="store_true", help="with --log-dir: show the output on the console too")
    ap.add_argument("--max-restarts", "--max_restarts", type=int, default=None,
                    help="when a rank fails, stop the others and start every rank again, up to N times "
                         "(default $CX_MAX_RESTARTS or 0); each start gets RESTART_COUNT")
    ap.add_argument("--one-session", action="store_true", default=None,
                    help="keep the ranks in the launcher's session (each in its own process group; stdin /dev/null), "
                         "so that the scheduler weighs the job as one: faster for small models and messages on a "
                         "machine shared with other jobs, slower for large computations there (default "
                         "$CX_ONE_SESSION, else a session per rank, as torchrun)")
    ap.add_argument("-m", "--module", action="store_true", help="run the command as a Python module (python -m)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="script.py [args], a module with -m, or any command")
    a = ap.parse_args(argv)
    sys.exit(run(nproc_from(a.nproc_per_node), a.command, a.nnodes, a.node_rank, a.master_addr, a.master_port,
                 _parse_ranks(a.show_ranks), not a.no_prefix, a.module, a.log_dir, a.tee, a.max_restarts,
                 a.one_session))


if __name__ == "__main__":
    main()
