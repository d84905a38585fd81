"""Start N ranks of a training script on this machine (torchrun-like).

    python -m pycyxwiz.launch --nproc-per-node 4 train.py --epochs 3
    python -m pycyxwiz.launch --nproc-per-node 2 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 train.py
    ./launch_distributed.sh 4 python train.py          # the same, seed 004's form

Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT. Every line a rank prints is prefixed with "[rank N]"
(--show-ranks 0 keeps only rank 0's). If a rank exits with an error, the others
are stopped and the launcher exits non-zero, saying which rank failed and how.
Ctrl-C stops every rank.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import List, Optional, Sequence

DEFAULT_PORT = 29500


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


def _command(cmd: Sequence[str]) -> List[str]:
    """`train.py args` runs with this Python; `python train.py`, `-m pkg` and any program run as given."""
    cmd = list(cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise SystemExit("launch: no command given (e.g. `python -m pycyxwiz.launch --nproc-per-node 2 train.py`)")
    if cmd[0].endswith(".py") or cmd[0] == "-m":
        cmd = [sys.executable, *cmd]
    return cmd


def _pump(stream, prefix: str, show: bool, out) -> None:
    for raw in iter(stream.readline, b""):
        if show:
            out.write(prefix + raw.decode(errors="replace"))
            out.flush()
    stream.close()


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def run(nproc: int, cmd: Sequence[str], nnodes: int = 1, node_rank: int = 0, master_addr: Optional[str] = None,
        master_port: Optional[int] = None, show_ranks: Optional[set] = None, prefix: bool = True) -> int:
    """Run the ranks of this node; return the exit code the launcher should exit with."""
    if nproc < 1:
        raise SystemExit(f"launch: --nproc-per-node must be at least 1, got {nproc}")
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise SystemExit(f"launch: --node-rank {node_rank} is out of range for --nnodes {nnodes}")
    argv = _command(cmd)
    addr = master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = master_port or (int(os.environ["MASTER_PORT"]) if os.environ.get("MASTER_PORT") else None)
    if port is None:
        port = DEFAULT_PORT
        if nnodes == 1 and not _port_free(addr, port):
            new = _free_port(addr)
            print(f"[launch] port {port} on {addr} is in use; using MASTER_PORT={new}", file=sys.stderr, flush=True)
            port = new
    world = nnodes * nproc
    procs: List[subprocess.Popen] = []
    pumps: List[threading.Thread] = []
    for local in range(nproc):
        rank = node_rank * nproc + local
        env = dict(os.environ)
        env.update(RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(nproc),
                   MASTER_ADDR=addr, MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
        p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)
        show = show_ranks is None or rank in show_ranks
        t = threading.Thread(target=_pump, args=(p.stdout, f"[rank {rank}] " if prefix else "", show, sys.stdout),
                             daemon=True)
        t.start()
        pumps.append(t)

    def stop_all(sig=signal.SIGTERM) -> None:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_signal)
    code = 0
    try:
        remaining = set(range(nproc))
        while remaining:
            for local in list(remaining):
                rc = procs[local].poll()
                if rc is None:
                    continue
                remaining.discard(local)
                if rc != 0:
                    rank = node_rank * nproc + local
                    how = f"was killed by {_signal_name(rc)}" if rc < 0 else f"exited with code {rc}"
                    for t in pumps:
                        t.join(0.5)
                    print(f"[launch] rank {rank} {how}; stopping the other ranks", file=sys.stderr, flush=True)
                    stop_all()
                    code = rc if rc > 0 else 128 - rc
                    remaining.clear()
                    break
            time.sleep(0.05)
    except KeyboardInterrupt:
        print("[launch] interrupted; stopping all ranks", file=sys.stderr, flush=True)
        stop_all(signal.SIGINT)
        code = 130
    finally:
        signal.signal(signal.SIGTERM, old)
    for t in pumps:
        t.join(2)
    return code


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pycyxwiz.launch", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc-per-node", "--nproc_per_node", type=int, required=True, help="ranks on this machine")
    ap.add_argument("--nnodes", type=int, default=1, help="machines in the job (default 1)")
    ap.add_argument("--node-rank", "--node_rank", type=int, default=0, help="this machine's index (default 0)")
    ap.add_argument("--master-addr", "--master_addr", default=None, help="address of rank 0 (default $MASTER_ADDR or 127.0.0.1)")
    ap.add_argument("--master-port", "--master_port", type=int, default=None,
                    help="port of rank 0's store (default $MASTER_PORT or 29500; a free one if 29500 is taken)")
    ap.add_argument("--show-ranks", default=None, help="comma-separated ranks whose output is shown (default: all)")
    ap.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with [rank N]")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="script.py [args] or any command")
    a = ap.parse_args(argv)
    sys.exit(run(a.nproc_per_node, a.command, a.nnodes, a.node_rank, a.master_addr, a.master_port,
                 _parse_ranks(a.show_ranks), not a.no_prefix))


if __name__ == "__main__":
    main()
