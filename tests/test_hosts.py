"""Several hosts: each rank in a network namespace of its own "host" (tests/hosts.py), with its own
address, hostname and /dev/shm. The collectives and training across hosts (TCP between hosts,
shared memory only within one), and faults on the wire: a cable pulled in the middle of an
all_reduce, the job restarted by its launchers once the cable is back, delay and loss, a link
shaped to a NIC's rate (checked by what tc lists; its speed is measured in benchmarks/, never here).
Skipped, with the reason, where namespaces cannot be made (not root, no iproute2)."""
import json
import os
import secrets
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import hosts
import ranks

pytestmark = pytest.mark.skipif(hosts.available() is not None, reason=str(hosts.available()))

WORKER = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np, pycyxwiz as cx
    D = cx.distributed
    mode, out = sys.argv[1], sys.argv[2]

    def segments():
        with open("/proc/self/maps") as f:
            return len({l.split()[5] for l in f if "/dev/shm/cx-" in l})

    def collectives():
        D.init()
        r, p = D.get_rank(), D.get_world_size()
        bad = []
        for n in (1, 1000, 300_001):
            x = np.arange(n, dtype=np.float32) * (r + 1)
            D.all_reduce(x)
            if not np.array_equal(x, np.arange(n, dtype=np.float32) * (p * (p + 1) // 2)):
                bad.append(f"all_reduce {n}")
            y = np.arange(n, dtype=np.float64) + 7 if r == p - 1 else np.zeros(n)
            D.broadcast(y, src=p - 1)
            if not np.array_equal(y, np.arange(n, dtype=np.float64) + 7):
                bad.append(f"broadcast {n}")
            g = np.empty((p, n), np.int32)
            D.all_gather(g, np.full(n, r, np.int32))
            if not np.array_equal(g, np.repeat(np.arange(p, dtype=np.int32), n).reshape(p, n)):
                bad.append(f"all_gather {n}")
            rs = np.empty(n, np.float32)
            D.reduce_scatter(rs, np.tile(np.arange(n, dtype=np.float32), p) + r)
            if not np.array_equal(rs, np.arange(n, dtype=np.float32) * p + p * (p - 1) // 2):
                bad.append(f"reduce_scatter {n}")
        D.barrier()
        result = {"bad": bad, "segments": segments(), "host": os.uname().nodename}
        D.finalize()
        return result

    def congestion():
        # After a checked all_reduce, this rank's TCP connections to the other ranks (not the store's, on
        # MASTER_PORT): the two ends' addresses and the congestion control the kernel says each runs.
        import socket, stat
        D.init()
        r, p = D.get_rank(), D.get_world_size()
        x = np.arange(300_001, dtype=np.float32) * (r + 1)
        D.all_reduce(x)
        ok = bool(np.array_equal(x, np.arange(300_001, dtype=np.float32) * (p * (p + 1) // 2)))
        master = int(os.environ["MASTER_PORT"])
        conns = []
        for name in os.listdir("/proc/self/fd"):
            try:
                if not stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                    continue
                s = socket.socket(fileno=os.dup(int(name)))
            except OSError:
                continue
            with s:
                try:
                    peer, own = s.getpeername(), s.getsockname()
                except OSError:
                    continue
                if s.family != socket.AF_INET or master in (peer[1], own[1]):
                    continue
                cc = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\\0").decode()
                conns.append({"own": own[0], "peer": peer[0], "cc": cc})
        D.barrier()
        with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
            machine = f.read().strip()
        D.finalize()
        return {"sum_ok": ok, "conns": conns, "machine": machine}

    def link():
        # all_reduce across hosts on both sides of each of its choices (Note [Choosing by the link] in
        # csrc/distributed/algorithms/allreduce.cpp), checked against NumPy, and the setup every rank logs.
        D.init()
        r, p = D.get_rank(), D.get_world_size()
        bad = []
        for n in (2, 1000, 1100, 16_384, 150_001, 600_000):
            for dt in (np.float32, np.float64, np.int32):
                base = (np.arange(n) % 97).astype(dt)
                x = base * (r + 1)
                D.all_reduce(x)
                if not np.array_equal(x, base * (p * (p + 1) // 2)):
                    bad.append(f"all_reduce {n} {np.dtype(dt).name}")
        # broadcast above the tree's threshold: the tree or the chain by the link, the chain in chunks of the link's
        # (Notes [Broadcast between hosts], [The chain's chunk between hosts] in broadcast.cpp; behind 1 Gbit/s the
        # chain in chunks of 16 KiB and more, the last one short: 65,537 bytes end in a chunk of one)
        for n, dt in ((65_537, np.uint8), (100_000, np.float32), (700_000, np.float32)):
            for root in (0, p - 1):
                want = (np.arange(n) % 89 + root).astype(dt)
                x = want.copy() if r == root else np.zeros(n, dt)
                D.broadcast(x, src=root)
                if not np.array_equal(x, want):
                    bad.append(f"broadcast {n} from {root}")
        # reduce above the tree's threshold: the chain in the link's chunks (Note [Reduce between hosts] in
        # reduce.cpp), every op's result at the root against NumPy's
        for n, dt in ((65_537, np.uint8), (100_000, np.float32), (300_001, np.float64), (700_000, np.int32)):
            for root in (0, p - 1):
                for op in (D.ReduceOp.SUM, D.ReduceOp.MAX, D.ReduceOp.AVG):
                    if op == D.ReduceOp.AVG and np.dtype(dt).kind != "f":
                        continue
                    mine = lambda q: ((np.arange(n) * (q + 3)) % 61 + q).astype(dt)  # noqa: E731
                    x = mine(r)
                    D.reduce(x, dst=root, op=op)
                    every = np.stack([mine(q) for q in range(p)]).astype(np.float64)
                    want = {D.ReduceOp.SUM: every.sum(0), D.ReduceOp.MAX: every.max(0),
                            D.ReduceOp.AVG: every.sum(0) / p}[op]
                    if dt == np.uint8 and op == D.ReduceOp.SUM:
                        want = want % 256
                    if r == root and not np.allclose(x.astype(np.float64), want, rtol=1e-6, atol=0):
                        bad.append(f"reduce {n} {np.dtype(dt).name} {op} to {root}")
        # all_gather on both sides of Bruck's bound by the link (Note [Bruck's all_gather between hosts] in
        # allgather.cpp; 16 KiB blocks by Bruck's on 4 hosts or more behind 1 Gbit/s, 64 KiB by the ring)
        for n in (4096, 16_384):
            out = np.empty((p, n), np.int32)
            D.all_gather(out, np.arange(n, dtype=np.int32) + 1000 * r)
            if not np.array_equal(out, np.arange(n, dtype=np.int32) + 1000 * np.arange(p, dtype=np.int32)[:, None]):
                bad.append(f"all_gather {n}")
        setup = cx._core.dist._describe_setup()
        D.finalize()
        return {"bad": bad, "setup": setup}

    def torch_ddp():
        # PyTorch's own DDP over the "cyxwiz" backend, init_process_group from the environment as torchrun sets
        # it: the backend finds its peers' addresses from MASTER_ADDR's route (pycyxwiz.torch._peer_address).
        import torch, torch.distributed as dist, pycyxwiz.torch  # noqa: F401
        torch.set_num_threads(1)
        dist.init_process_group("cyxwiz")
        r, w = dist.get_rank(), dist.get_world_size()
        bad = []
        for n in (3, 5000, 200_001):
            t = torch.arange(n, dtype=torch.float32) * (r + 1)
            dist.all_reduce(t)
            if not torch.equal(t, torch.arange(n, dtype=torch.float32) * (w * (w + 1) // 2)):
                bad.append(f"all_reduce {n}")
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        X, y = torch.randn(24, 8, generator=g), torch.randint(0, 3, (24,), generator=g)
        share = 24 // w
        for _ in range(5):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(X[r * share:(r + 1) * share]),
                                              y[r * share:(r + 1) * share]).backward()
            opt.step()
        params = [p.detach().numpy().ravel().tolist() for p in model.module.parameters()]
        dist.destroy_process_group()
        return {"bad": bad, "params": params}

    def train():
        D.init()
        X, y = cx.datasets.load_digits()
        m = cx.SequentialModel()
        m.add(cx.LinearModule(64, 32, seed=1)); m.add(cx.ReLUModule()); m.add(cx.LinearModule(32, 10, seed=2))
        t = D.DistributedTrainer(m, cx.CrossEntropyLoss(), cx.AdamOptimizer(3e-3))
        t.fit(X, y, D.DistributedTrainingConfig(epochs=3, batch_size=32, verbose=False, seed=3))
        loss, acc = t.evaluate(X, y)
        np.save(out + ".npy", m.flat_parameters())
        D.finalize()
        return {"acc": acc}

    def loop():
        # All-reduces of 8 MiB until told to stop; prints each one (the test cuts the link mid-way).
        D.init()
        restart = int(os.environ.get("RESTART_COUNT", "0"))
        x = np.ones(2 << 20, np.float32)
        for i in range(3 if restart else 100000):
            x[:] = D.get_rank() + 1
            D.all_reduce(x)
            assert x[0] == 3 and x[-1] == 3
            print(f"iteration {i} of start {restart}", flush=True)
        D.finalize()
        return {"restart": restart}

    try:
        res = {"ok": True, **globals()[mode]()}
    except Exception as e:
        res = {"ok": False, "type": type(e).__name__, "bases": [c.__name__ for c in type(e).__mro__],
               "message": str(e), "time": time.time()}
    with open(out, "w") as f:
        json.dump(res, f)
    sys.exit(0 if res["ok"] else 1)
""")


SECRET = secrets.token_hex(32)  # a job on a real interface needs its secret (README, "The job secret")


def rank_env(rank, world, local, nlocal, master, port, **extra):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "CX_SHM", "RESTART_COUNT", "CX_AUTH",
                                                             "CX_AUTH_TOKEN_FILE")}
    env["CX_AUTH_TOKEN"] = SECRET
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(nlocal),
               MASTER_ADDR=master, MASTER_PORT=str(port), DISTRIBUTED_TIMEOUT_MS="30000",
               DISTRIBUTED_OPERATION_TIMEOUT_MS="30000", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_on_hosts(h, tmp_path, mode, per_host, timeout=120, per_rank=None, **extra):
    """Starts `per_host` ranks on each host (rank = host * per_host + local); returns their results."""
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    world = h.n * per_host
    procs = []
    for rank in range(world):
        env = rank_env(rank, world, rank % per_host, per_host, h.addrs[0], 29400,
                       **{**extra, **(per_rank or {}).get(rank, {})})
        out = tmp_path / f"{mode}{rank}.json"
        procs.append((h.popen(rank // per_host, [sys.executable, str(worker), mode, str(out)], env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out))
    results = []
    for p, out in procs:
        try:
            text, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q, _ in procs:
                q.kill()
            raise AssertionError(f"a rank of {mode} hung past {timeout} s")
        assert out.exists(), text
        results.append(json.loads(out.read_text()))
    return results


@pytest.mark.parametrize("per_host", [1, 2])
def test_collectives_across_hosts_match_numpy_and_share_memory_only_within_a_host(tmp_path, per_host):
    with hosts.Hosts(2) as h:
        res = run_on_hosts(h, tmp_path, "collectives", per_host)
    for rank, r in enumerate(res):
        assert r["ok"] and r["bad"] == [], r
        assert r["host"] == f"cx-host-{rank // per_host}"
        # Alone on its host: no peer to share memory with. Two on a host: its own segment and its
        # neighbour's, and none of the other host's (TCP between hosts).
        assert r["segments"] == (0 if per_host == 1 else 2), r


@pytest.mark.skipif(os.sysconf("SC_NPROCESSORS_ONLN") < 2, reason="needs a core for each of a host's 2 ranks")
def test_tcp_between_ranks_of_one_host_runs_reno_and_across_hosts_the_machines_congestion_control(tmp_path):
    # Note [Congestion control between ranks on one host]: 2 hosts of 2 ranks, all over TCP (CX_SHM=0).
    with hosts.Hosts(2) as h:
        res = run_on_hosts(h, tmp_path, "congestion", 2, CX_SHM="0")
    for rank, r in enumerate(res):
        assert r["ok"] and r["sum_ok"], r
        same = [c["cc"] for c in r["conns"] if c["peer"] == c["own"]]
        other = [c["cc"] for c in r["conns"] if c["peer"] != c["own"]]
        assert len(same) == 1 and len(other) == 2, r  # one connection to each other rank
        assert same == ["reno"], r
        assert set(other) == {r["machine"]}, r


def _link_part(setup):
    """The part of a rank's setup line that says what it measured between hosts ("" if nothing)."""
    at = setup.find("between hosts")
    return setup[at:] if at >= 0 else ""


@pytest.mark.parametrize("n_hosts,per_host", [(3, 1), (4, 1), (3, 2), (7, 1)])
def test_three_hosts_or_more_measure_the_link_and_every_rank_takes_the_same_numbers(tmp_path, n_hosts, per_host):
    with hosts.Hosts(n_hosts) as h:
        for i in range(n_hosts):
            h.shape(i, "1gbit")
        res = run_on_hosts(h, tmp_path, "link", per_host, timeout=240)
    for r in res:
        assert r["ok"] and r["bad"] == [], r
    parts = {_link_part(r["setup"]) for r in res}
    assert len(parts) == 1, parts  # rank 0's measurement everywhere: every rank chooses alike
    (part,) = parts
    assert part.startswith("between hosts ") and "MB/s measured at init" in part, res[0]["setup"]


@pytest.mark.parametrize("n_hosts,extra", [(2, {}), (3, {"CX_SMALL_ALLREDUCE_BYTES": "524288"})])
def test_two_hosts_or_a_threshold_set_by_the_user_measure_nothing(tmp_path, n_hosts, extra):
    with hosts.Hosts(n_hosts) as h:
        res = run_on_hosts(h, tmp_path, "link", 1, **extra)
    for r in res:
        assert r["ok"] and r["bad"] == [], r
        assert _link_part(r["setup"]) == "", r["setup"]


def test_pytorch_ddp_over_cyxwiz_across_three_hosts_equals_one_process_on_the_whole_batch(tmp_path):
    torch = pytest.importorskip("torch")
    with hosts.Hosts(3) as h:
        res = run_on_hosts(h, tmp_path, "torch_ddp", 1, timeout=240)
    for r in res:
        assert r["ok"] and r["bad"] == [], r
    for other in res[1:]:
        assert other["params"] == res[0]["params"], "the ranks' parameters differ"
    # The reference: one process, the whole batch of 24 (each rank's mean loss over 8 rows, averaged by DDP).
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(24, 8, generator=g), torch.randint(0, 3, (24,), generator=g)
    for _ in range(5):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(X), y).backward()
        opt.step()
    for got, want in zip(res[0]["params"], model.parameters()):
        np.testing.assert_allclose(got, want.detach().numpy().ravel(), rtol=1e-5, atol=1e-6)


def test_a_rank_on_another_host_without_the_jobs_secret_is_refused(tmp_path):
    with hosts.Hosts(2) as h:
        res = run_on_hosts(h, tmp_path, "collectives", 1, per_rank={1: {"CX_AUTH_TOKEN": "not-the-secret"}},
                           DISTRIBUTED_TIMEOUT_MS=6000)
    assert not res[1]["ok"] and "authentication failed" in res[1]["message"], res[1]
    assert "CX_AUTH_TOKEN" in res[1]["message"]
    assert not res[0]["ok"] and "DistributedTimeoutError" in res[0]["bases"], res[0]
    assert "handshake" in res[0]["message"], res[0]["message"]   # rank 0 says someone failed to prove it


def test_training_across_hosts_gives_the_parameters_of_training_on_one_host(tmp_path):
    with hosts.Hosts(2) as h:
        res = run_on_hosts(h, tmp_path, "train", 1)
    assert all(r["ok"] for r in res), res
    assert res[0]["acc"] > 0.9 and res[0]["acc"] == res[1]["acc"]
    across = [np.load(tmp_path / f"train{r}.json.npy") for r in (0, 1)]
    assert np.array_equal(across[0], across[1])
    # The same job with both ranks on this machine (loopback TCP): the same numbers, bit for bit.
    worker = tmp_path / "worker.py"
    port = ranks.free_port()
    procs = [subprocess.Popen([sys.executable, str(worker), "train", str(tmp_path / f"local{r}.json")],
                              env=rank_env(r, 2, r, 2, "127.0.0.1", port, CX_SHM=0)) for r in (0, 1)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert np.array_equal(np.load(tmp_path / "local0.json.npy"), across[0])


class Lines:
    """Collects a process's output lines on a thread, so a test can wait for one."""

    def __init__(self, stream):
        self.lines = []
        self._t = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._t.start()

    def _read(self, stream):
        for line in iter(stream.readline, ""):
            self.lines.append(line.rstrip("\n"))
        stream.close()

    def join(self):
        self._t.join(10)

    def wait_for(self, text, timeout):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if any(text in line for line in self.lines):
                return True
            time.sleep(0.05)
        return False

    def text(self):
        return "\n".join(self.lines)


OPERATION_TIMEOUT_S = 4


def test_a_cable_pulled_mid_all_reduce_fails_every_rank_with_a_named_error_within_the_deadline(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    with hosts.Hosts(2) as h:
        procs = []
        for rank in (0, 1):
            env = rank_env(rank, 2, 0, 1, h.addrs[0], 29400,
                           DISTRIBUTED_OPERATION_TIMEOUT_MS=OPERATION_TIMEOUT_S * 1000)
            p = h.popen(rank, [sys.executable, str(worker), "loop", str(tmp_path / f"loop{rank}.json")], env,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            procs.append((p, Lines(p.stdout)))
        try:
            assert all(lines.wait_for("iteration 3 ", 60) for _, lines in procs), [l.text() for _, l in procs]
            cut_at = time.time()
            h.cut(1)
            codes = [p.wait(timeout=OPERATION_TIMEOUT_S + 30) for p, _ in procs]
        finally:
            for p, lines in procs:
                p.kill()
                p.wait()
                lines.join()
    assert codes == [1, 1]
    for rank in (0, 1):
        r = json.loads((tmp_path / f"loop{rank}.json").read_text())
        assert not r["ok"]
        # A pulled cable sends nothing: the peer is silent, not gone, so the deadline names it.
        assert "DistributedTimeoutError" in r["bases"] or "DistributedConnectionError" in r["bases"], r
        assert f"rank {1 - rank}" in r["message"] and "all_reduce" in r["message"], r["message"]
        took = r["time"] - cut_at
        print(f"rank {rank}: {r['type']} {took:.2f} s after the cable was pulled")
        assert took < OPERATION_TIMEOUT_S + 15, took


def test_the_launchers_restart_the_job_once_the_cable_is_back(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    with hosts.Hosts(2) as h:
        launchers = []
        for node in (0, 1):
            env = rank_env(0, 2, 0, 1, h.addrs[0], 29400, DISTRIBUTED_OPERATION_TIMEOUT_MS=OPERATION_TIMEOUT_S * 1000)
            for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
                env.pop(v)
            argv = [sys.executable, "-m", "pycyxwiz.launch", "--nnodes", "2", "--node-rank", str(node),
                    "--nproc-per-node", "1", "--master-addr", h.addrs[0], "--master-port", "29400",
                    "--max-restarts", "1", str(worker), "loop", str(tmp_path / f"node{node}.json")]
            p = h.popen(node, argv, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            launchers.append((p, Lines(p.stdout)))
        try:
            assert all(lines.wait_for("iteration 3 of start 0", 60) for _, lines in launchers)
            h.cut(1)
            for _, lines in launchers:  # each launcher sees its rank fail and starts it again
                assert lines.wait_for("RESTART_COUNT=1", OPERATION_TIMEOUT_S + 30), lines.text()
            h.mend(1)
            codes = [p.wait(timeout=90) for p, _ in launchers]
        finally:
            for p, lines in launchers:
                p.kill()
                p.wait()
                lines.join()
        texts = [lines.text() for _, lines in launchers]
    assert codes == [0, 0], texts
    for node in (0, 1):
        assert json.loads((tmp_path / f"node{node}.json").read_text()) == {"ok": True, "restart": 1}
        assert "iteration 2 of start 1" in texts[node]


def tc_qdiscs(ns, dev):
    return subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True,
                          check=True, timeout=30).stdout


def test_shape_puts_a_token_bucket_of_the_rate_on_both_ends_of_a_hosts_link_and_no_other():
    with hosts.Hosts(2) as h:
        h.shape(1, "1gbit")
        upload, download = tc_qdiscs(h.names[1], "eth0"), tc_qdiscs(h.switch, h._switch_end(1))
        untouched = tc_qdiscs(h.names[0], "eth0") + tc_qdiscs(h.switch, h._switch_end(0))
        h.shape(1, "250mbit")  # again: replaces the first, as a NIC has one speed
        again = tc_qdiscs(h.names[1], "eth0")
    for shown in (upload, download):
        assert "qdisc tbf" in shown and "rate 1Gbit" in shown, shown
    assert "tbf" not in untouched, untouched
    assert again.count("qdisc tbf") == 1 and "rate 250Mbit" in again, again
    with pytest.raises(ValueError, match="1gbit"):
        hosts._rate_bits("fast")


@pytest.mark.parametrize("spec", [("delay", "50ms"), ("loss", "1%")])
def test_collectives_stay_right_under_delay_and_loss(tmp_path, spec):
    with hosts.Hosts(2) as h:
        why = h.netem(1, *spec)
        if why:
            pytest.skip(f"the kernel here cannot shape traffic ({why})")
        res = run_on_hosts(h, tmp_path, "collectives", 1, timeout=300)
    assert all(r["ok"] and r["bad"] == [] for r in res), res
