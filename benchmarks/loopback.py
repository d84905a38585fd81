"""The ceiling: what plain loopback TCP carries between two processes on this machine.

    python -m benchmarks.loopback            # prints the figures below, writes results/partial/loopback.json

Every figure is bytes per second in one direction (GB/s = 1e9 B/s), between two real processes,
1 MiB send/recv calls, measured by loopback.c (compiled on first use; Python sockets, the code
below, where no C compiler is found), with the kernel's default socket buffers and with 4 MiB
ones, each with the machine's congestion control and with reno (what pycyxwiz's connections on
one host use); each figure is the best of the four:
  one-way        A sends, B receives, one connection
  two-way (hot)  A and B each send and receive at once, one connection per direction, like a
                 ring's left and right neighbours; the better of two programs: a sender thread and
                 a receiver thread per process (blocking sockets), and one thread per process
                 driving both non-blocking sockets (how a collective library does it). The calls
                 reuse one 1 MiB buffer, so the data stays in cache.
  two-way (cold) the same, the calls walking through 64 MiB buffers, so every byte comes from and
                 goes to memory, as in a large all-reduce
  rtt            8-byte ping-pong, blocking sockets, TCP_NODELAY

The TCP ceiling for all_reduce (`tcp_ceiling`). busbw of an all_reduce (nccl-tests convention)
is what each rank sends per second, and every rank receives as much: the two-way test's work
per rank. Loopback TCP is CPU-bound (the kernel copies each byte into and out of a socket
buffer), so with more ranks than cores the cores are shared:
    ceiling(world) = two-way (cold) * min(1, cores / world)
The cold figure is the one that holds for large messages (64 MiB and up); smaller messages fit
in cache and in the socket buffers, and a library can beat a streaming figure there.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time

CHUNK = 1 << 20
# Socket buffer sizes tried: the kernel's default (autotuned) and 4 MiB, what a tuned library
# sets (pycyxwiz's TCP transport does). Congestion controls tried: the machine's, and reno, which
# pycyxwiz's connections between ranks on one host use (Note [Congestion control between ranks on
# one host] in csrc/distributed/net/socket.cpp: with BBR, the default on many machines, loopback
# carries about half as much). The limit reported is the best of them.
BUFFERS = (0, 4 << 20)
CONGESTION = ("", "reno")
_sockbuf = 0
_cc = ""


def _tune(sock: socket.socket) -> socket.socket:
    if _cc:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, _cc.encode())
    if _sockbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _sockbuf)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _sockbuf)
    return sock


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


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("peer closed early")
        data += chunk
    return data


def measure_rtt(rounds: int = 2000) -> float:
    """Median 8-byte round trip in microseconds between two processes."""
    la, lb, port = _listen()
    lb.close()
    child = subprocess.Popen([sys.executable, "-m", "benchmarks.loopback", "--peer", "rtt",
                              "--port", str(port), "--bytes", str(rounds)], cwd=_repo())
    try:
        conn, _ = la.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            conn.sendall(b"q" * 8)
            _recv_exact(conn, 8)
            times.append(time.perf_counter() - t0)
        conn.close()
        child.wait(timeout=60)
        times.sort()
        return times[len(times) // 2] * 1e6
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        la.close()


def _connect(port: int) -> socket.socket:
    deadline = time.monotonic() + 10
    while True:
        try:
            s = _tune(socket.socket())
            s.connect(("127.0.0.1", port))
            return s
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _peer(mode: str, port: int, total: int) -> None:
    """The child process: connects to the parent's listener(s) and plays its role."""
    if mode == "rtt":
        with _connect(port) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(total):
                _recv_exact(s, 8)
                s.sendall(b"p" * 8)
        return
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
        a = _tune(socket.socket())
        a.bind(("127.0.0.1", 0))
        port = a.getsockname()[1]
        b = _tune(socket.socket())
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
                              "--port", str(port), "--bytes", str(total), "--sockbuf", str(_sockbuf),
                              "--cc", _cc],
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


def _c_binary() -> str | None:
    """Compile loopback.c once into the temp dir (keyed by its hash); None without a compiler."""
    import hashlib
    import shutil
    import tempfile
    from pathlib import Path

    src = Path(__file__).with_name("loopback.c")
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None or not src.exists():
        return None
    tag = hashlib.sha1(src.read_bytes()).hexdigest()[:12]
    exe = Path(tempfile.gettempdir()) / f"cxbench-loopback-{tag}"
    if not exe.exists():
        tmp = exe.with_suffix(".tmp")
        r = subprocess.run([cc, "-O2", "-pthread", "-o", str(tmp), str(src)], capture_output=True, text=True)
        if r.returncode != 0:
            return None
        tmp.replace(exe)
    return str(exe)


def _c_run(exe: str, mode: str, n: int, buf: int, span: int = CHUNK) -> float:
    out = subprocess.run([exe, mode, str(n), str(buf), str(span)], capture_output=True, text=True, timeout=120,
                         check=True, env={**os.environ, "LOOPBACK_CC": _cc})
    return float(out.stdout.strip())


COLD_SPAN = 64 << 20


def _machine_cc() -> str | None:
    """The machine's TCP congestion control (net.ipv4.tcp_congestion_control), None where unknown."""
    try:
        with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
            return f.read().strip() or None
    except OSError:
        return None


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def tcp_ceiling(lb: dict | None, world: int) -> float | None:
    """busbw (GB/s) no TCP all_reduce of a large message can beat at this world size here, or None."""
    cold = (lb or {}).get("two_way_cold_each_GBps")
    if not cold:
        return None
    return cold * min(1.0, (lb.get("cores") or cores()) / world)


def measure(total_bytes: int = 2 << 30, repeats: int = 3, use_c: bool = True) -> dict:
    """Median over `repeats` of each figure (GB/s per direction) for each socket buffer size in
    BUFFERS and congestion control in CONGESTION, the best of them as the limit, and the 8-byte
    RTT. Uses the C program (loopback.c) when a compiler is found, Python sockets otherwise (hot
    figures only)."""
    global _sockbuf, _cc
    exe = _c_binary() if use_c else None

    def med(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2], xs

    by_buf = {}
    for cc, buf in ((cc, buf) for cc in CONGESTION for buf in BUFFERS):
        _sockbuf, _cc = buf, cc
        v = {}
        if exe:
            for key, mode, span in (("one_way", "one", CHUNK), ("two_way_threads", "two", CHUNK),
                                    ("two_way_one_thread", "duplex", CHUNK),
                                    ("two_way_cold_threads", "two", COLD_SPAN),
                                    ("two_way_cold_one_thread", "duplex", COLD_SPAN)):
                v[key + "_GBps"], v[key + "_all"] = med(_c_run(exe, mode, total_bytes, buf, span)
                                                        for _ in range(repeats))
        else:
            v["one_way_GBps"], v["one_way_all"] = med(measure_once("one", total_bytes) for _ in range(repeats))
            v["two_way_threads_GBps"], v["two_way_threads_all"] = med(measure_once("two", total_bytes)
                                                                      for _ in range(repeats))
        by_buf[("default" if buf == 0 else f"{buf >> 20}MiB") + (f", {cc}" if cc else "")] = v
    _sockbuf, _cc = 0, ""

    def best(*keys):
        vals = [v[k] for v in by_buf.values() for k in keys if v.get(k)]
        return max(vals) if vals else None

    return {
        "method": "C (loopback.c)" if exe else "Python sockets",
        "one_way_GBps": best("one_way_GBps"),
        "two_way_each_GBps": best("two_way_threads_GBps", "two_way_one_thread_GBps"),
        "two_way_cold_each_GBps": best("two_way_cold_threads_GBps", "two_way_cold_one_thread_GBps"),
        "cores": cores(),
        "rtt_8B_us": _c_run(exe, "rtt", 5000, 0) if exe else measure_rtt(),
        "congestion_control": _machine_cc(),
        "by_socket_buffer": by_buf,
        "bytes_per_run": total_bytes,
        "chunk": CHUNK,
        "cold_span": COLD_SPAN,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=2 << 30, help="bytes per direction per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peer", choices=["one", "two", "rtt"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--sockbuf", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--cc", default="", help=argparse.SUPPRESS)
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--python", action="store_true", help="measure with Python sockets, not loopback.c")
    a = ap.parse_args(argv)
    if a.peer:
        global _sockbuf, _cc
        _sockbuf, _cc = a.sockbuf, a.cc
        _peer(a.peer, a.port, a.bytes)
        return 0
    res = measure(a.bytes, a.repeats, use_c=not a.python)
    print(f"method: {res['method']}; the machine's TCP congestion control: {res['congestion_control']}")
    print(f"loopback TCP, one stream one way:              {res['one_way_GBps']:.2f} GB/s")
    print(f"loopback TCP, both directions at once (hot):   {res['two_way_each_GBps']:.2f} GB/s each way")
    if res.get("two_way_cold_each_GBps"):
        print(f"loopback TCP, both directions at once (cold):  {res['two_way_cold_each_GBps']:.2f} GB/s each way")
    for name, v in res["by_socket_buffer"].items():
        print(f"  socket buffers {name:>13}: " + ", ".join(f"{k[:-5]} {x:.2f}" for k, x in v.items()
                                                          if k.endswith("_GBps")))
    print(f"loopback TCP, 8-byte round trip:               {res['rtt_8B_us']:.1f} us (blocking sockets)")
    for world in (2, 4):
        c = tcp_ceiling(res, world)
        if c:
            print(f"TCP ceiling for a large all_reduce on {world} ranks ({res['cores']} cores): {c:.2f} GB/s busbw")
    if not a.no_save:
        from benchmarks._report import write_json

        write_json("loopback", {"benchmark": "loopback", **res})
    return 0


if __name__ == "__main__":
    if __package__ in (None, ""):
        sys.path.insert(0, _repo())
    sys.exit(main())
