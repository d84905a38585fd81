"""The ceiling: what plain loopback TCP carries between two processes on this machine.

    python -m benchmarks.loopback            # prints one-way and two-way GB/s, writes results/loopback.json

A ring all-reduce on 2 ranks sends and receives at once on every rank, so it cannot beat the
two-way figure (bytes per second each way while both directions run). busbw of a ring
all-reduce equals what each rank sends per second, so "pycyxwiz busbw / two-way" is the
fraction of the wire the library achieves.

Two real processes, plain blocking sockets, 1 MiB send/recv calls (the kernel does the work;
Python's per-call overhead is noise at that size):
  one-way   A sends, B receives, one connection
  two-way   A and B each send and receive at once (a sender thread and a receiver thread in
            each process; socket calls release the GIL), one connection per direction, like a
            ring's left and right neighbours
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time

CHUNK = 1 << 20


def _send(sock: socket.socket, total: int) -> None:
    buf = memoryview(bytearray(CHUNK))
    left = total
    while left > 0:
        n = min(left, CHUNK)
        sock.sendall(buf[:n])
        left -= n


def _recv(sock: socket.socket, total: int, result: dict) -> None:
    buf = memoryview(bytearray(CHUNK))
    got = 0
    t0 = None
    while got < total:
        n = sock.recv_into(buf, min(CHUNK, total - got))
        if n == 0:
            raise ConnectionError("peer closed early")
        if t0 is None:
            t0 = time.perf_counter()
        got += n
    result["seconds"] = time.perf_counter() - t0
    result["bytes"] = got


def _connect(port: int) -> socket.socket:
    deadline = time.monotonic() + 10
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port))
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _peer(mode: str, port: int, total: int) -> None:
    """The child process: connects to the parent's listener(s) and plays its role."""
    if mode == "one":
        with _connect(port) as s:
            _send(s, total)
            s.recv(1)  # wait for the receiver's ack so the socket is drained before close
        return
    out, inn = _connect(port), _connect(port + 1)
    res: dict = {}
    t = threading.Thread(target=_recv, args=(inn, total, res))
    t.start()
    _send(out, total)
    t.join()
    print(json.dumps(res), flush=True)
    out.close()
    inn.close()


def _listen() -> tuple[socket.socket, socket.socket, int]:
    """Two listeners on consecutive ports (for the two directions)."""
    for _ in range(50):
        a = socket.socket()
        a.bind(("127.0.0.1", 0))
        port = a.getsockname()[1]
        b = socket.socket()
        try:
            b.bind(("127.0.0.1", port + 1))
        except OSError:
            a.close()
            b.close()
            continue
        a.listen(1)
        b.listen(1)
        return a, b, port
    raise OSError("no two consecutive free ports")


def measure_once(mode: str, total: int) -> float:
    """GB/s (1e9 bytes/s) in one direction; for two-way, the mean of the two directions."""
    la, lb, port = _listen()
    child = subprocess.Popen([sys.executable, "-m", "benchmarks.loopback", "--peer", mode,
                              "--port", str(port), "--bytes", str(total)],
                             stdout=subprocess.PIPE, text=True, cwd=_repo())
    try:
        if mode == "one":
            conn, _ = la.accept()
            res: dict = {}
            _recv(conn, total, res)
            conn.sendall(b"k")
            conn.close()
            child.wait(timeout=60)
            return res["bytes"] / res["seconds"] / 1e9
        inn, _ = la.accept()   # child's outgoing
        out, _ = lb.accept()   # child's incoming
        res = {}
        t = threading.Thread(target=_recv, args=(inn, total, res))
        t.start()
        _send(out, total)
        t.join()
        theirs = json.loads(child.communicate(timeout=60)[0].strip().splitlines()[-1])
        inn.close()
        out.close()
        return (res["bytes"] / res["seconds"] + theirs["bytes"] / theirs["seconds"]) / 2 / 1e9
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        la.close()
        lb.close()


def _repo() -> str:
    from pathlib import Path

    return str(Path(__file__).resolve().parent.parent)


def measure(total_bytes: int = 2 << 30, repeats: int = 3) -> dict:
    """Median over `repeats` of one-way and two-way loopback throughput, GB/s per direction."""
    one = sorted(measure_once("one", total_bytes) for _ in range(repeats))
    two = sorted(measure_once("two", total_bytes) for _ in range(repeats))
    return {
        "one_way_GBps": one[len(one) // 2],
        "two_way_each_GBps": two[len(two) // 2],
        "one_way_all": one,
        "two_way_all": two,
        "bytes_per_run": total_bytes,
        "chunk": CHUNK,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=2 << 30, help="bytes per direction per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peer", choices=["one", "two"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--no-save", action="store_true")
    a = ap.parse_args(argv)
    if a.peer:
        _peer(a.peer, a.port, a.bytes)
        return 0
    res = measure(a.bytes, a.repeats)
    print(f"loopback TCP, one stream one way:        {res['one_way_GBps']:.2f} GB/s")
    print(f"loopback TCP, both directions at once:   {res['two_way_each_GBps']:.2f} GB/s each way")
    if not a.no_save:
        from benchmarks._report import write_json

        write_json("loopback", {"benchmark": "loopback", **res})
    return 0


if __name__ == "__main__":
    if __package__ in (None, ""):
        sys.path.insert(0, _repo())
    sys.exit(main())
