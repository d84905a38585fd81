"""Several "hosts" on one machine: Linux network namespaces joined by a bridge, for tests.

    with hosts.Hosts(2) as h:                    # two namespaces, 10.233.x.1 and 10.233.x.2
        p = h.popen(0, [sys.executable, "job.py"], env)   # runs as a process of host 0
        h.cut(1); h.mend(1)                      # host 1's link down, up again

Each host is a network namespace with one interface, `eth0`, plugged into a bridge that lives in
a namespace of its own (the machine's own network is never touched), plus its own hostname and
its own /dev/shm: a process started with `popen` runs under `unshare --uts --mount`, with the
host's name and a tmpfs folder of the host bind-mounted on /dev/shm. So two ranks of one host
share memory (the same host key, the same /dev/shm), and ranks of two hosts cannot (Note
[Same-host pairs] in csrc/distributed/transport/shm/negotiate.cpp), as on real machines.

`available()` says why not where this cannot be done (not root, no `ip`, no namespaces); tests
skip with that reason. `netem()` adds delay or loss with `tc ... netem` where the kernel has it;
`shape()` limits a host's link to a NIC's rate (`tc ... tbf`), both ways. Benchmarks use these
hosts too (benchmarks/_launch.py, `link=`): one implementation of the namespaces for both.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import tempfile
from typing import List, Optional

SUBNET = "10.233.{}.{}"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


_why: Optional[str] = None

_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


def _rate_bits(rate: str) -> int:
    """A tc rate in bits per second: "1gbit" -> 10**9 (decimal units, as tc reads them)."""
    m = re.fullmatch(r"([0-9.]+)([kmgt]?bit)", rate.strip().lower())
    if not m:
        raise ValueError(f"rate {rate!r}: expected a number and bit, kbit, mbit, gbit or tbit (e.g. 1gbit)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def available() -> Optional[str]:
    """None where network namespaces can be made here; otherwise the reason they cannot."""
    global _why
    if _why is not None:
        return _why or None
    if os.geteuid() != 0:
        _why = "needs root to make network namespaces"
    elif not shutil.which("ip") or not shutil.which("unshare"):
        _why = "needs the `ip` and `unshare` commands (iproute2, util-linux)"
    else:
        probe = f"cxprobe{secrets.token_hex(3)}"
        r = _ip("netns", "add", probe, check=False)
        if r.returncode != 0:
            _why = f"cannot make a network namespace: {r.stderr.strip()}"
        else:
            r = _ip("-n", probe, "link", "add", "br0", "type", "bridge", check=False)
            _ip("netns", "del", probe, check=False)
            _why = "" if r.returncode == 0 else f"cannot make a bridge in a namespace: {r.stderr.strip()}"
    return _why or None


class Hosts:
    def __init__(self, n: int) -> None:
        self.n = n
        self.tag = secrets.token_hex(3)
        self.switch = f"cx{self.tag}sw"
        self.names = [f"cx{self.tag}h{i}" for i in range(n)]
        self.net = int(self.tag, 16) % 200 + 20  # 10.233.<net>.0/24: apart from tests running beside
        self.addrs = [SUBNET.format(self.net, i + 1) for i in range(n)]
        self.shm = tempfile.mkdtemp(prefix=f"cx-hosts-{self.tag}-")
        self._made: List[str] = []

    def __enter__(self) -> "Hosts":
        try:
            _ip("netns", "add", self.switch)
            self._made.append(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, ns in enumerate(self.names):
                _ip("netns", "add", ns)
                self._made.append(ns)
                host_end, switch_end = f"cx{self.tag}a{i}", f"cx{self.tag}b{i}"
                _ip("link", "add", host_end, "type", "veth", "peer", "name", switch_end)
                _ip("link", "set", host_end, "netns", ns)
                _ip("link", "set", switch_end, "netns", self.switch)
                _ip("-n", ns, "link", "set", host_end, "name", "eth0")
                _ip("-n", ns, "addr", "add", f"{self.addrs[i]}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", self.switch, "link", "set", switch_end, "master", "br0")
                _ip("-n", self.switch, "link", "set", switch_end, "up")
                os.makedirs(os.path.join(self.shm, str(i)))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for ns in reversed(self._made):  # deleting a namespace deletes its interfaces
            _ip("netns", "del", ns, check=False)
        self._made = []
        shutil.rmtree(self.shm, ignore_errors=True)

    def command(self, i: int, argv: List[str]) -> List[str]:
        """argv as a process of host i: its network, its hostname, its /dev/shm."""
        inner = (f"hostname cx-host-{i} && mount --bind {self.shm}/{i} /dev/shm && exec \"$@\"")
        return ["ip", "netns", "exec", self.names[i], "unshare", "--uts", "--mount", "sh", "-c", inner, "sh", *argv]

    def popen(self, i: int, argv: List[str], env: dict, **kw) -> subprocess.Popen:
        return subprocess.Popen(self.command(i, argv), env=env, **kw)

    def _switch_end(self, i: int) -> str:
        return f"cx{self.tag}b{i}"

    def cut(self, i: int) -> None:
        """Host i's cable pulled: its packets go nowhere, nothing tells either end."""
        _ip("-n", self.switch, "link", "set", self._switch_end(i), "down")

    def mend(self, i: int) -> None:
        _ip("-n", self.switch, "link", "set", self._switch_end(i), "up")

    def shape(self, i: int, rate: str) -> None:
        """Host i's link limited to `rate` (a tc rate: "1gbit", "10gbit", "500mbit") both ways, as a NIC
        of that speed: upload on its `eth0`, download on the switch's end of its cable.

        Note [Shaping with tbf]: a token bucket, not netem (this kernel has no netem). Its queue
        (limit) decides whether TCP reaches the rate: measured at 1gbit, two hosts sending to each
        other at once, a 64 KiB queue let each stream carry 0.016 Gbit/s, 256 KiB 0.96 Gbit/s; we
        keep 10 ms of the rate, at least 1 MiB (a longer queue only adds delay). The burst holds 1 ms
        of the rate, at least 128 KiB: with 10 kB one stream reached 0.93 Gbit/s instead of 0.96.
        The goodput of a 1gbit link is 0.95-0.96 Gbit/s (Ethernet, IP and TCP headers count).
        """
        bits = _rate_bits(rate)
        burst = max(bits // 8 // 1000, 128 << 10)
        limit = max(bits // 8 // 100, 1 << 20)
        spec = ["root", "tbf", "rate", rate, "burst", str(burst), "limit", str(limit)]
        for ns, dev in ((self.names[i], "eth0"), (self.switch, self._switch_end(i))):
            r = subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, *spec],
                               capture_output=True, text=True, timeout=30)
            if r.returncode != 0:
                raise RuntimeError(f"tc qdisc replace dev {dev} {' '.join(spec)} in {ns}: "
                                   f"{r.stderr.strip() or r.returncode}")

    def netem(self, i: int, *spec: str) -> Optional[str]:
        """Adds `tc qdisc ... netem <spec>` on host i's interface; the reason where it cannot."""
        r = subprocess.run(["ip", "netns", "exec", self.names[i], "tc", "qdisc", "add", "dev", "eth0", "root",
                            "netem", *spec], capture_output=True, text=True, timeout=30)
        return None if r.returncode == 0 else f"tc netem: {r.stderr.strip() or r.returncode}"
