"""Hierarchical collectives (Note [Hierarchical collectives] in csrc/distributed/algorithms/hierarchical.cpp):
ranks on several "hosts" (network namespaces, tests/hosts.py: shared memory inside a host, TCP between hosts).
The same job forced hierarchical (CX_ALGORITHM=hierarchical) and forced flat gives, for every collective, op
and dtype, the NumPy reference (tests/refs.py) and the same bits; CX_ALGORITHM=auto picks hierarchical only
where more than one host has more than one rank; a rank killed on one host is named on every rank of both.
Skipped, with the reason, where namespaces cannot be made (not root, no iproute2)."""
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

import hosts
from refs import OPS, REDUCE_DTYPES, valid_pair

pytestmark = pytest.mark.skipif(hosts.available() is not None, reason=str(hosts.available()))

TESTS = os.path.dirname(os.path.abspath(__file__))

WORKER = textwrap.dedent("""
    import hashlib, json, logging, os, sys, time
    sys.path.insert(0, sys.argv[3])
    import numpy as np, pycyxwiz as cx
    from refs import OPS, REDUCE_DTYPES, contribution, expected, valid_pair
    D = cx.distributed
    mode, out = sys.argv[1], sys.argv[2]
    setup = []

    class Keep(logging.Handler):
        def emit(self, record):
            setup.append(record.getMessage())

    logging.getLogger("pycyxwiz").addHandler(Keep())
    logging.getLogger("pycyxwiz").setLevel(logging.INFO)
    SIZES = (0, 1, 2, 3, 7, 1000, 30001)

    def collectives():
        r, p = D.get_rank(), D.get_world_size()
        bad, digest = [], hashlib.sha256()
        for dtype in REDUCE_DTYPES:
            kw = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
            for op in OPS:
                if not valid_pair(dtype, op):
                    continue
                for n in SIZES:
                    x = contribution(r, n, dtype, op)
                    D.all_reduce(x, op=getattr(D.ReduceOp, op), **kw)
                    if not np.array_equal(x, expected(p, n, dtype, op)):
                        bad.append(f"all_reduce {dtype} {op} n={n}")
                    digest.update(x.tobytes())
                    if dtype == "bfloat16":
                        continue
                    # reduce_scatter: block k of rank j is contribution(j * p + k), so every block differs
                    blocks = np.stack([contribution(r * p + k, n, dtype, op) for k in range(p)])
                    got = np.empty(n, dtype)
                    D.reduce_scatter(got, blocks, op=getattr(D.ReduceOp, op))
                    mine = [contribution(j * p + r, n, dtype, op) for j in range(p)]
                    want = {"SUM": lambda a: a.sum(0, dtype=dtype), "PRODUCT": lambda a: a.prod(0, dtype=dtype),
                            "MIN": lambda a: a.min(0), "MAX": lambda a: a.max(0),
                            "BAND": lambda a: np.bitwise_and.reduce(a, 0), "BOR": lambda a: np.bitwise_or.reduce(a, 0),
                            "BXOR": lambda a: np.bitwise_xor.reduce(a, 0),
                            "AVG": lambda a: (a.astype(np.float32).sum(0) / np.float32(p)).astype(dtype)
                            if dtype == "float16" else (a.sum(0, dtype=dtype) / p).astype(dtype)}[op](np.stack(mine))
                    if not np.array_equal(got, want):
                        bad.append(f"reduce_scatter {dtype} {op} n={n}")
                    digest.update(got.tobytes())
                    for root in (0, p - 1):  # reduce: the root's result (the others' buffers are scratch)
                        x = contribution(r, n, dtype, op)
                        D.reduce(x, dst=root, op=getattr(D.ReduceOp, op))
                        if r == root:
                            if not np.array_equal(x, expected(p, n, dtype, op)):
                                bad.append(f"reduce {dtype} {op} n={n} root={root}")
                            digest.update(x.tobytes())
            for n in SIZES:
                if dtype == "bfloat16":
                    continue
                g = np.empty((p, n), dtype)
                D.all_gather(g, contribution(r, n, dtype, "SUM"))
                if not np.array_equal(g, np.stack([contribution(k, n, dtype, "SUM") for k in range(p)])):
                    bad.append(f"all_gather {dtype} n={n}")
                for root in range(p):
                    y = contribution(root, n, dtype, "MAX") if r == root else np.zeros(n, dtype)
                    D.broadcast(y, src=root)
                    if not np.array_equal(y, contribution(root, n, dtype, "MAX")):
                        bad.append(f"broadcast {dtype} n={n} root={root}")
        return {"bad": bad, "digest": digest.hexdigest()}

    def all_reduces():
        # all_reduce alone, every dtype and op, at the sizes in CX_TEST_SIZES; a digest per call
        r, p = D.get_rank(), D.get_world_size()
        bad, digests = [], {}
        for n in map(int, os.environ["CX_TEST_SIZES"].split(",")):
            for dtype in REDUCE_DTYPES:
                kw = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
                for op in OPS:
                    if not valid_pair(dtype, op):
                        continue
                    x = contribution(r, n, dtype, op)
                    D.all_reduce(x, op=getattr(D.ReduceOp, op), **kw)
                    if not np.array_equal(x, expected(p, n, dtype, op)):
                        bad.append(f"all_reduce {dtype} {op} n={n}")
                    digests[f"{dtype} {op} n={n}"] = hashlib.sha256(x.tobytes()).hexdigest()
        return {"bad": bad, "digests": digests}

    def loop():
        # All-reduces of 1 MiB; the last rank dies in the middle of them.
        r, p = D.get_rank(), D.get_world_size()
        x = np.ones(1 << 18, np.float32)
        for i in range(100000):
            if r == p - 1 and i == 20:
                with open(out + ".died", "w") as f:
                    f.write(str(time.time()))
                os._exit(3)
            D.all_reduce(x)
            x[:] = 1
        return {}

    try:
        D.init()
        res = {"ok": True, **globals()[mode]()}
        D.finalize()
    except Exception as e:
        res = {"ok": False, "type": type(e).__name__, "message": str(e), "time": time.time()}
    res["host"] = os.uname().nodename
    res["setup"] = [m for m in setup if "all_reduce" in m or "hierarchical" in m][:3]
    with open(out, "w") as f:
        json.dump(res, f)
    sys.exit(0 if res["ok"] else 1)
""")

SECRET = "c0ffee" * 10  # a job on a real interface needs its secret (README, "The job secret")


def run_job(h, tmp_path, mode, per_host, tag, timeout=300, world=None, **extra):
    """`per_host` ranks on each host of `h` (rank = host * per_host + local; `world` fewer leaves the last
    host short); their result dicts."""
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    world = world or h.n * per_host
    procs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                                 "MASTER_PORT", "CX_SHM", "CX_AUTH_TOKEN_FILE")}
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_host),
                   LOCAL_WORLD_SIZE=str(per_host), MASTER_ADDR=h.addrs[0], MASTER_PORT="29400",
                   CX_AUTH_TOKEN=SECRET, DISTRIBUTED_TIMEOUT_MS="60000", DISTRIBUTED_OPERATION_TIMEOUT_MS="60000",
                   OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CX_DEBUG="INFO")
        env.update({k: str(v) for k, v in extra.items()})
        out = tmp_path / f"{tag}{rank}.json"
        procs.append((h.popen(rank // per_host, [sys.executable, str(worker), mode, str(out), TESTS], env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out))
    results = []
    for p, out in procs:
        try:
            text, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q, _ in procs:
                q.kill()
                q.communicate()
            raise AssertionError(f"a rank of {mode} hung past {timeout} s")
        results.append(json.loads(out.read_text()) if out.exists() else {"ok": False, "output": text[-2000:]})
    return results


@pytest.mark.parametrize("n_hosts,per_host", [(2, 2), (3, 1), (2, 3), (2, 4)])
def test_hierarchical_and_flat_give_numpy_results_and_the_same_bits(tmp_path, n_hosts, per_host):
    # 2 x 4: inside a host 4 ranks run Bruck's all_gather and the reduce-scatter by recursive halving at small
    # blocks, by the thresholds of the rings there (hierarchical.cpp's in_host_options); 8 ranks flat, at those
    # of sockets.
    with hosts.Hosts(n_hosts) as h:
        hier = run_job(h, tmp_path, "collectives", per_host, "hier", CX_ALGORITHM="hierarchical",
                       CX_CHUNK_BYTES=4096)
        flat = run_job(h, tmp_path, "collectives", per_host, "flat", CX_ALGORITHM="flat", CX_CHUNK_BYTES=4096)
    for rank, (a, b) in enumerate(zip(hier, flat)):
        assert a["ok"] and a["bad"] == [], a
        assert b["ok"] and b["bad"] == [], b
        assert a["host"] == b["host"] == f"cx-host-{rank // per_host}"
        assert a["digest"] == b["digest"]  # every output, bit for bit (reduce_scatter differs by rank)
        assert any(f"hierarchical across {n_hosts} hosts of {per_host} ranks" in m for m in a["setup"]), a["setup"]
        assert not any("hierarchical" in m for m in b["setup"]), b["setup"]


# Slices of the pipelined all_reduce (Note [Pipelined hierarchical all_reduce]): 1000 bytes cut every size
# here into many slices of unequal lengths (1000 is no multiple of 8 or 6), and parts of 1 element; the
# model's slices (no CX_HIER_SLICE_BYTES) cut 262147 float64 (2 MiB) into 3 on 2x2 and 4 on 2x3.
SLICED_SIZES = "1,5,6,7,13,1000,4097,30001"
MODEL_SIZES = "4097,262147"


@pytest.mark.parametrize("n_hosts,per_host", [(2, 2), (2, 3), (3, 2)])
def test_pipelined_all_reduce_gives_numpy_results_and_the_flat_bits(tmp_path, n_hosts, per_host):
    with hosts.Hosts(n_hosts) as h:
        sliced = run_job(h, tmp_path, "all_reduces", per_host, "sliced", CX_ALGORITHM="hierarchical",
                         CX_HIER_SLICE_BYTES=1000, CX_CHUNK_BYTES=256, CX_TEST_SIZES=SLICED_SIZES)
        model = run_job(h, tmp_path, "all_reduces", per_host, "model", CX_ALGORITHM="hierarchical",
                        CX_TEST_SIZES=MODEL_SIZES)
        flat = run_job(h, tmp_path, "all_reduces", per_host, "flat", CX_ALGORITHM="flat",
                       CX_TEST_SIZES=SLICED_SIZES + "," + MODEL_SIZES)
    for a, b, c in zip(sliced, model, flat):
        for r in (a, b, c):
            assert r["ok"] and r["bad"] == [], r
        pairs = sum(valid_pair(d, op) for d in REDUCE_DTYPES for op in OPS)
        assert len(a["digests"]) == 8 * pairs and len(b["digests"]) == 2 * pairs
        assert a["digests"] == {k: c["digests"][k] for k in a["digests"]}
        assert b["digests"] == {k: c["digests"][k] for k in b["digests"]}
        assert any("slices of 1000 bytes" in m for m in a["setup"]), a["setup"]
        assert any("slices from the cost model" in m for m in b["setup"]), b["setup"]


@pytest.mark.parametrize("n_hosts,per_host,picked", [(2, 2, True), (3, 1, False)])
def test_auto_goes_hierarchical_only_where_hosts_have_several_ranks(tmp_path, n_hosts, per_host, picked):
    with hosts.Hosts(n_hosts) as h:
        res = run_job(h, tmp_path, "collectives", per_host, "auto")
    for r in res:
        assert r["ok"] and r["bad"] == [], r
        assert any("hierarchical" in m for m in r["setup"]) == picked, r["setup"]


def test_hierarchical_is_refused_by_name_where_hosts_hold_different_numbers_of_ranks(tmp_path):
    with hosts.Hosts(2) as h:  # 2 ranks on host 0, 1 on host 1
        forced = run_job(h, tmp_path, "collectives", 2, "forced", world=3, CX_ALGORITHM="hierarchical")
        auto = run_job(h, tmp_path, "collectives", 2, "auto", world=3)
    for r in forced:
        assert not r["ok"] and r["type"] == "ValueError", r
        assert "CX_ALGORITHM=hierarchical cannot be used here" in r["message"], r["message"]
        assert "the same number of ranks (2, 1)" in r["message"], r["message"]
    for r in auto:  # flat, and right
        assert r["ok"] and r["bad"] == [], r
        assert not any("hierarchical" in m for m in r["setup"]), r["setup"]


def test_a_rank_killed_on_one_host_is_named_on_every_rank_of_both_hosts(tmp_path):
    with hosts.Hosts(2) as h:
        res = run_job(h, tmp_path, "loop", 2, "kill", timeout=120, CX_ALGORITHM="hierarchical",
                      DISTRIBUTED_OPERATION_TIMEOUT_MS=20000)
    died = float((tmp_path / "kill3.json.died").read_text())
    for rank in range(3):
        r = res[rank]
        assert not r["ok"], r
        assert r["type"] in ("DistributedConnectionError", "DistributedError"), r
        assert "rank 3" in r["message"], (rank, r["message"][:500])
        assert r["time"] - died < 10, (rank, r["time"] - died)  # its connection's end, not the 20 s deadline
