"""The TCP congestion control of the ranks' connections (Note [Congestion control between ranks on one host] in
csrc/distributed/net/socket.cpp), read back from the kernel on each rank's own sockets, not from pycyxwiz.

Ranks on one host (127.0.0.1), CX_SHM=0 so that every pair talks TCP; every all_reduce they make on the way is
checked against NumPy.
"""
import os
import socket
import stat

import numpy as np
import pytest

import ranks

import pycyxwiz as cx

D = cx.distributed
CORES = os.sysconf("SC_NPROCESSORS_ONLN")


def machine_cc() -> str:
    with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
        return f.read().strip()


def available() -> set:
    with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
        return set(f.read().split())


def all_reduce_checked(nbytes):
    r, p = D.get_rank(), D.get_world_size()
    n = max(1, nbytes // 4)
    x = np.random.default_rng(r).standard_normal(n).astype(np.float32)
    want = sum(np.random.default_rng(k).standard_normal(n).astype(np.float32).astype(np.float64) for k in range(p))
    D.all_reduce(x)
    assert np.allclose(x, want, rtol=1e-5, atol=1e-4)


def sockets_and_congestion(sizes=(4 << 20,)):
    """This rank's connected TCP sockets as (kind, congestion control) after checked all_reduces of `sizes` bytes
    (0: a barrier): kind "store" for a connection to or from MASTER_PORT, "peer" for the others (the data
    connections between ranks)."""
    for nbytes in sizes:
        if nbytes:
            all_reduce_checked(nbytes)
        else:
            D.barrier()
    master = int(os.environ["MASTER_PORT"])
    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with s:
            if s.family != socket.AF_INET or s.type != socket.SOCK_STREAM:
                continue
            try:
                peer = s.getpeername()
            except OSError:
                continue  # a listening socket
            cc = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0").decode()
            kind = "store" if master in (peer[1], s.getsockname()[1]) else "peer"
            found.append((kind, cc))
    return found


def kinds(outs, kind):
    return {cc for found in outs for k, cc in found if k == kind}


def peer_connections(outs, world):
    # Every rank holds one connection to each other rank.
    assert all(sum(k == "peer" for k, _ in found) >= world - 1 for found in outs), outs


@pytest.mark.skipif(CORES < 2, reason="needs a core for each of 2 ranks")
def test_ranks_of_one_host_that_each_have_a_core_talk_reno_and_the_store_keeps_the_machines(monkeypatch):
    monkeypatch.setenv("CX_SHM", "0")
    monkeypatch.delenv("CX_TCP_CONGESTION", raising=False)
    outs = ranks.run(sockets_and_congestion, 2, args=((256 << 10, 8),))  # reno whatever the sizes
    peer_connections(outs, 2)
    assert kinds(outs, "peer") == {"reno"}
    assert kinds(outs, "store") == {machine_cc()}


@pytest.mark.parametrize("sizes, reno", [
    ((4 << 20,), True),                       # a large operation: reno
    ((4 << 20, 256 << 10), False),            # then a mid-sized one: back to the machine's
    ((4 << 20, 8, 0), True),                  # small ones and a barrier switch nothing
    ((256 << 10, 8, 2 << 20, 0), True),
    ((2 << 20, (2 << 20) - 4, 64 << 10), False),
])
def test_with_more_ranks_than_cores_the_connections_follow_the_operations_size(monkeypatch, sizes, reno):
    monkeypatch.setenv("CX_SHM", "0")
    monkeypatch.delenv("CX_TCP_CONGESTION", raising=False)
    world = CORES + 1
    if world > 8:
        pytest.skip(f"{CORES} cores: more ranks than cores would be {world} processes")
    outs = ranks.run(sockets_and_congestion, world, args=(sizes,))
    peer_connections(outs, world)
    assert kinds(outs, "peer") == {"reno" if reno else machine_cc()}
    assert kinds(outs, "store") == {machine_cc()}


@pytest.mark.skipif(CORES < 2, reason="needs a core for each of 2 ranks")
def test_system_keeps_the_machines_congestion_control_everywhere(monkeypatch):
    monkeypatch.setenv("CX_SHM", "0")
    monkeypatch.setenv("CX_TCP_CONGESTION", "system")
    outs = ranks.run(sockets_and_congestion, 2, args=((4 << 20,),))
    peer_connections(outs, 2)
    assert kinds(outs, "peer") | kinds(outs, "store") == {machine_cc()}


def test_a_named_congestion_control_goes_on_every_connection(monkeypatch):
    # reno is built into every Linux kernel and allowed to every user. Three ranks, so that on a 2-core machine
    # the name overrides the rule for more ranks than cores too, whatever the sizes.
    monkeypatch.setenv("CX_SHM", "0")
    monkeypatch.setenv("CX_TCP_CONGESTION", "reno")
    outs = ranks.run(sockets_and_congestion, 3, args=((4 << 20, 256 << 10),))
    peer_connections(outs, 3)
    assert kinds(outs, "peer") | kinds(outs, "store") == {"reno"}


@pytest.mark.parametrize("name", ["no-such-cc", "a-name-longer-than-the-kernels-16"])
def test_a_congestion_control_the_kernel_refuses_fails_init_naming_the_kernels_choices(monkeypatch, name):
    monkeypatch.setenv("CX_TCP_CONGESTION", name)
    for v in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError) as ei:
        D.DistributedConfig.from_environment()
    msg = str(ei.value)
    assert f"CX_TCP_CONGESTION='{name}' is not valid: the kernel refused it" in msg, msg
    assert "one of the kernel's congestion controls: " in msg and "reno" in msg, msg
    assert all(name in msg for name in available()), msg
