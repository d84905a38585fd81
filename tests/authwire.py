"""The wire of the job secret's handshake and of rank 0's store, written from their descriptions
(csrc/distributed/store/store.h, csrc/distributed/net/auth.h, Note [Mesh handshake] in
csrc/distributed/transport/mesh_transport.cpp) with Python's own hmac/hashlib, for tests that act as
a stranger (or a faulty rank) with raw sockets.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time

STORE_MAGIC = 0x31535843  # "CXS1"
HELLO, SET, GET, DONE, PROBE, AUTH1, AUTH2 = 1, 2, 3, 4, 5, 6, 7
OK, RETRY, REFUSED = 0, 1, 2
HDR = struct.Struct("<IB3xII")
SERVER_ROLE = b"cx-auth-1 acceptor"
CLIENT_ROLE = b"cx-auth-1 connector"
MESH_MAGIC = 0x32485843  # "CXH2"


def proof(secret: bytes, role: bytes, context: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(secret, role + b"\0" + context + b"\0" + client_nonce + server_nonce, hashlib.sha256).digest()


def frame(cmd: int, key: bytes = b"", value: bytes = b"") -> bytes:
    return HDR.pack(STORE_MAGIC, cmd, len(key), len(value)) + key + value


def hello_value(rank: int, world: int, generation: int = 0) -> bytes:
    """rank, WORLD_SIZE, RESTART_COUNT (the job's generation), little-endian int32s."""
    return struct.pack("<iii", rank, world, generation)


def recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        b = s.recv(n - len(out))
        if not b:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += b
    return out


def read_reply(s: socket.socket):
    magic, status, _, vlen = HDR.unpack(recv_exact(s, HDR.size))
    assert magic == STORE_MAGIC
    return status, recv_exact(s, vlen)


def closed_by_peer(s: socket.socket, timeout: float = 5.0) -> bool:
    """True once the other side has closed (EOF or reset) within `timeout`, reading and dropping the rest."""
    s.settimeout(timeout)
    end = time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            if not s.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False
    return False


def connect(port: int, host: str = "127.0.0.1", timeout: float = 20.0) -> socket.socket:
    """Connects to host:port, retrying until the listener is up (the job is starting)."""
    end = time.monotonic() + timeout
    while True:
        try:
            s = socket.create_connection((host, port), timeout=5)
            s.settimeout(5)
            return s
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.02)


def authenticate(s: socket.socket, secret: bytes, client_nonce: bytes | None = None):
    """AUTH1 then AUTH2 with `secret`; returns (server proof was right, AUTH2 status, AUTH2 text, our proof)."""
    cn = client_nonce or os.urandom(32)
    s.sendall(frame(AUTH1, value=cn))
    status, v = read_reply(s)
    assert status == OK and len(v) == 64, (status, v)
    sn, server_proof = v[:32], v[32:]
    server_ok = hmac.compare_digest(server_proof, proof(secret, SERVER_ROLE, b"store", cn, sn))
    mine = proof(secret, CLIENT_ROLE, b"store", cn, sn)
    s.sendall(frame(AUTH2, value=mine))
    status, text = read_reply(s)
    return server_ok, status, text.decode(errors="replace"), mine


def pid_listening_on(port: int) -> int:
    """The pid of the process with a listening TCP socket on `port` (from /proc)."""
    inode = None
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            parts = line.split()
            if int(parts[1].split(":")[1], 16) == port and parts[3] == "0A":
                inode = parts[9]
    assert inode, f"nothing listens on port {port}"
    target = f"socket:[{inode}]"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    return int(pid)
        except OSError:
            continue
    raise AssertionError(f"no process holds {target}")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def listening_ports() -> set:
    """Local ports with a listening TCP socket on 127.0.0.1 (the ranks' data ports among them)."""
    out = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            parts = line.split()
            ip, port = parts[1].split(":")
            if parts[3] == "0A" and ip == "0100007F":
                out.add(int(port, 16))
    return out
