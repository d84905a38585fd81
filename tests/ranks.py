"""Run a test body as N real processes talking over 127.0.0.1.

    def body(n):                      # runs in every rank, in its own process
        x = np.full(n, cx.distributed.get_rank(), np.float32)
        cx.distributed.all_reduce(x)
        return x

    results = ranks.run(body, world=4, args=(10,))     # [rank0_result, rank1_result, ...]

Each rank is a fresh interpreter (multiprocessing "spawn") with RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and a free MASTER_PORT set; `init()` is called before
the body and `finalize()` after it unless init=False. The body must be a
module-level function of a test module. Nothing is mocked: the ranks find each
other through the real store and move bytes over real sockets.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Outcome:
    rank: int
    ok: bool
    value: Any = None
    exc_type: str = ""       # e.g. "DistributedConnectionError"
    exc_bases: tuple = ()    # names of every class in the exception's MRO
    message: str = ""
    trace: str = ""
    exitcode: Optional[int] = None

    def is_a(self, name: str) -> bool:
        return name in self.exc_bases


class RankFailure(AssertionError):
    pass


def _child(fn, rank, world, env, args, init, conn):
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ.update({k: str(v) for k, v in env.items()})  # may override the three above
    try:
        import pycyxwiz as cx

        if init:
            cx.distributed.init()
        value = fn(*args)
        if init:
            cx.distributed.finalize()
        conn.send(("ok", value))
    except BaseException as e:  # report everything, including SystemExit
        conn.send(("err", type(e).__name__, tuple(c.__name__ for c in type(e).__mro__), str(e),
                   traceback.format_exc()))
    finally:
        conn.close()


def spawn(fn: Callable, world: int, args: tuple = (), env: Optional[dict] = None, timeout: float = 60.0,
          init: bool = True, per_rank_env: Optional[dict] = None, start_delay: Optional[dict] = None) -> list:
    """Start `world` ranks of fn; return one Outcome per rank (never raises for rank errors).

    A rank still running after `timeout` seconds is killed and reported as hung. start_delay: {rank: seconds
    to wait before starting it, or a threading.Event it waits for}.
    """
    ctx = mp.get_context("spawn")
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port(), "DISTRIBUTED_TIMEOUT_MS": 20000,
            "DISTRIBUTED_OPERATION_TIMEOUT_MS": 20000, "OPENBLAS_NUM_THREADS": 1}
    base.update(env or {})
    procs, conns = [], []
    for r in range(world):
        e = dict(base)
        e.update((per_rank_env or {}).get(r, {}))
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(fn, r, world, e, args, init, child), daemon=True)
        if start_delay and r in start_delay:
            gate = start_delay[r]  # seconds, or an Event: rank r starts once it is set (or after `timeout`)
            if hasattr(gate, "wait"):
                gate.wait(timeout)
            else:
                time.sleep(gate)
        # The child inherits the environment at start: so what it imports before _child runs (the
        # test module, pycyxwiz, OpenBLAS reading OPENBLAS_NUM_THREADS) already sees e.
        saved = {k: os.environ.get(k) for k in e}
        os.environ.update({k: str(v) for k, v in e.items()})
        try:
            p.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        child.close()
        procs.append(p)
        conns.append(parent)
    deadline = time.monotonic() + timeout
    outcomes: list = [None] * world
    pending = set(range(world))
    while pending and time.monotonic() < deadline:
        for r in list(pending):
            c = conns[r]
            if c.poll(0.02):
                try:
                    msg = c.recv()
                except EOFError:
                    msg = None
                procs[r].join(5)
                if msg is None:
                    outcomes[r] = Outcome(r, False, exc_type="Died", message=f"rank {r} died with exit code "
                                          f"{procs[r].exitcode}", exitcode=procs[r].exitcode)
                elif msg[0] == "ok":
                    outcomes[r] = Outcome(r, True, value=msg[1], exitcode=procs[r].exitcode)
                else:
                    outcomes[r] = Outcome(r, False, exc_type=msg[1], exc_bases=msg[2], message=msg[3],
                                          trace=msg[4], exitcode=procs[r].exitcode)
                pending.discard(r)
            elif not procs[r].is_alive():
                procs[r].join()
                if not c.poll(0.05):
                    outcomes[r] = Outcome(r, False, exc_type="Died",
                                          message=f"rank {r} died with exit code {procs[r].exitcode}",
                                          exitcode=procs[r].exitcode)
                    pending.discard(r)
    for r in pending:
        procs[r].kill()
        procs[r].join()
        outcomes[r] = Outcome(r, False, exc_type="Hung", message=f"rank {r} still running after {timeout} s")
    for c in conns:
        c.close()
    return outcomes


def run(fn: Callable, world: int, args: tuple = (), **kw) -> list:
    """Like spawn, but every rank must succeed, and exit cleanly (a rank that aborts while exiting fails its job
    under torchrun or any launcher); returns their values in rank order."""
    outs = spawn(fn, world, args, **kw)
    bad = [o for o in outs if not o.ok]
    lines = [f"rank {o.rank}: {o.exc_type}: {o.message}\n{o.trace}" for o in bad]
    for o in outs:
        if o.ok and o.exitcode not in (0, None):  # None: still exiting after 5 s, not judged here
            bad.append(o)
            lines.append(f"rank {o.rank}: returned its result, then exited with code {o.exitcode} (a crash at exit)")
    if bad:
        raise RankFailure(f"{len(bad)} of {world} ranks failed:\n" + "\n".join(lines))
    return [o.value for o in outs]
