"""cx.distributed.spawn: start ranks from a script or notebook, no launcher needed.

    def worker(rank, n):
        cx.distributed.init()                 # RANK, WORLD_SIZE, MASTER_* are set for you
        x = np.ones(n, np.float32); cx.distributed.all_reduce(x)
        return x.sum()

    results = cx.distributed.spawn(worker, nprocs=4, args=(10,))   # [40.0, 40.0, 40.0, 40.0]
"""
from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import socket
import time
import traceback
from typing import Any, Callable, List, Optional

__all__ = ["spawn", "SpawnError"]


class SpawnError(RuntimeError):
    """A spawned rank failed; the message holds its traceback."""


def _entry(fn, rank, nprocs, port, secret, args, conn):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
                      MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"), MASTER_PORT=str(port))
    os.environ.update(secret)
    try:
        conn.send(("ok", fn(rank, *args)))
    except BaseException as e:
        conn.send(("err", f"{type(e).__name__}: {e}", traceback.format_exc()))
    finally:
        conn.close()


def spawn(fn: Callable[..., Any], nprocs: int, args: tuple = (), timeout: Optional[float] = None) -> List[Any]:
    """Run fn(rank, *args) in `nprocs` fresh processes and return their results in rank order.

    The ranks get a fresh job secret (CX_AUTH_TOKEN) unless one is set already.
    fn must be importable (a module-level function). If any rank raises or dies, the
    others are stopped and SpawnError names the rank and shows its traceback. With
    `timeout` (seconds) a job still running then is stopped with SpawnError too.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be at least 1, got {nprocs}")
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The job secret (README, "Threat model"): the user's if given, else one for this job.
    given = os.environ.get("CX_AUTH_TOKEN") or os.environ.get("CX_AUTH_TOKEN_FILE") or os.environ.get("CX_AUTH") == "off"
    secret = {} if given else {"CX_AUTH_TOKEN": secrets.token_hex(32)}
    procs, conns = [], []
    for r in range(nprocs):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_entry, args=(fn, r, nprocs, port, secret, args, child), daemon=False)
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    results: List[Any] = [None] * nprocs
    pending = set(range(nprocs))
    deadline = None if timeout is None else time.monotonic() + timeout
    failure = None
    try:
        while pending and failure is None:
            if deadline is not None and time.monotonic() > deadline:
                failure = f"ranks {sorted(pending)} still running after {timeout} s"
                break
            for r in list(pending):
                if conns[r].poll(0.02):
                    try:
                        msg = conns[r].recv()
                    except EOFError:
                        msg = ("err", f"rank {r} died (exit code {procs[r].exitcode})", "")
                    pending.discard(r)
                    if msg[0] == "ok":
                        results[r] = msg[1]
                    else:
                        failure = f"rank {r} failed: {msg[1]}\n{msg[2]}"
                        break
                elif not procs[r].is_alive() and not conns[r].poll(0.05):
                    pending.discard(r)
                    failure = f"rank {r} died with exit code {procs[r].exitcode}"
                    break
    finally:
        for p in procs:
            if failure is not None and p.is_alive():
                p.terminate()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        for c in conns:
            c.close()
    if failure is not None:
        raise SpawnError(failure)
    return results
