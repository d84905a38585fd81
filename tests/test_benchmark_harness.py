"""The benchmark harness keeps the committed results for complete runs (its timings are never tested
here: speed lives in benchmarks/, run by hand)."""
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
EVERY_STEP = ["loopback", "all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "scatter", "gather",
              "barrier", "pingpong", "train", "train_extras", "cnn", "hooks", "torch_backend", "memory"]


def digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*")) if p.is_file()}


def test_a_partial_run_leaves_the_committed_results_alone():
    before = digest(RESULTS)
    partial = RESULTS / "partial" / "SUMMARY.md"
    partial.unlink(missing_ok=True)
    r = subprocess.run([sys.executable, "-m", "benchmarks", "--skip", *EVERY_STEP], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert digest(RESULTS) == before
    assert partial.exists() and "pycyxwiz benchmark summary" in partial.read_text()
    assert f"a partial run: {RESULTS} is unchanged" in r.stdout


def test_busy_load_runs_n_busy_processes_pinned_one_per_core_and_stops_them():
    sys.path.insert(0, str(ROOT))
    import os

    from benchmarks._launch import busy_load

    cores = sorted(os.sched_getaffinity(0))
    with busy_load(3, pin=True) as procs:
        assert len(procs) == 3 and all(p.poll() is None for p in procs)
        assert [os.sched_getaffinity(p.pid) for p in procs] == [{cores[i % len(cores)]} for i in range(3)]
    assert all(p.poll() is not None for p in procs)
    with busy_load(0) as none:
        assert none == []


def test_the_training_benchmark_refuses_a_hidden_layer_of_no_width():
    r = subprocess.run([sys.executable, "-m", "benchmarks.train", "--hidden", "0"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    assert "--busy must be >= 0, --rounds >= 1 and --hidden >= 1" in r.stderr, r.stderr


def test_the_activations_benchmark_prints_both_libraries_side_by_side():
    pytest.importorskip("torch", reason="PyTorch (the bench or torch extra) is the side it compares with")
    r = subprocess.run([sys.executable, "-m", "benchmarks.activations", "--names", "gelu", "--rounds", "1",
                        "--repeat", "1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    header, row = [line.split() for line in r.stdout.splitlines() if line.split()[:1] in (["activation"], ["gelu"])]
    assert header[1:4] == ["cx_forward_ms", "torch_forward_ms", "forward_ratio"], header
    assert all(float(v) > 0 for v in row[1:]), row  # every column measured, PyTorch's too
    assert "activations.json" in r.stdout


@pytest.mark.parametrize("op", ["all_reduce", "broadcast", "all_gather", "all_to_all", "scatter", "gather", "reduce"])
def test_the_collective_benchmark_checks_the_exchanges_and_rooted_collectives_it_times(op, tmp_path):
    # Its own check (rank-dependent inputs, outputs against the closed form) passes for pycyxwiz and, where
    # PyTorch is installed, gloo, on 3 ranks, at 8 bytes (fewer elements than ranks) and 96 KiB.
    libs = ["pycyxwiz-shm", "pycyxwiz"]
    try:
        import torch  # noqa: F401
        libs.append("gloo")
    except ImportError:
        pass
    out = tmp_path / op
    r = subprocess.run([sys.executable, "-m", "benchmarks.allreduce", "--op", op, "--worlds", "3", "--libs", *libs,
                        "--sizes", "8", "96K", "--iters-scale", "0.1", "--rounds", "1", "--no-loopback", "--name", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    columns = json.loads(out.with_suffix(".json").read_text())["columns"]
    assert sorted(c["lib"] for c in columns) == sorted(libs)
    for c in columns:
        assert c["ok"], c
        assert [(x["nominal"], x["correct"]) for x in c["results"]] == [(8, True), (96 << 10, True)], c


def test_the_horovod_benchmark_runs_its_cyxwiz_columns_and_names_a_missing_horovod(tmp_path):
    # Horovod is no dependency: a horovod package that cannot be imported (put first on the path, so this
    # holds where Horovod is installed too) makes its columns n/a with the reason, while the "cyxwiz" columns
    # run, each checking its sums against the closed form inside the worker.
    pytest.importorskip("torch", reason="the cyxwiz columns are torch.distributed over pycyxwiz.torch")
    fake = tmp_path / "horovod"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('no Horovod in this test')\n")
    env = dict(__import__("os").environ, PYTHONPATH=f"{tmp_path}:{ROOT}")
    r = subprocess.run([sys.executable, "-m", "benchmarks.horovod", "--quick", "--worlds", "2", "--parts", "allreduce"],
                       cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr
    assert re.search(r"horovod-gloo \(round 1/1\) \.\.\. \d+s  n/a \(Horovod not installed", r.stdout), r.stdout
    assert "no Horovod in this test" in r.stdout, r.stdout
    rows = {cells[0]: cells for cells in (re.split(r"\s{2,}", line.strip()) for line in r.stdout.splitlines())
            if cells[0] in ("8 B", "1 MiB")}
    assert set(rows) == {"8 B", "1 MiB"}, r.stdout
    for cells in rows.values():  # size, horovod-gloo, cyxwiz, horovod-mpi, cyxwiz-shm, then the two ratios
        assert cells[1] == cells[3] == cells[5] == cells[6] == "n/a", cells
        assert all(float(c.split()[0]) > 0 and c.split()[1] in ("us", "ms") for c in (cells[2], cells[4])), cells


def test_the_osu_benchmark_runs_omb_py_s_loops_for_pycyxwiz_and_names_what_it_could_not_run(tmp_path):
    # OMB's own programs are no dependency: pointed at a folder without them, their columns are n/a with the
    # reason. pycyxwiz's columns check every collective against NumPy in the worker before timing it (a wrong
    # result would fail the column), and have a figure for every size; Open MPI's have one where mpirun and mpi4py
    # are installed, else they are n/a with the hint to install them.
    from benchmarks._launch import mpi_available

    r = subprocess.run([sys.executable, "-m", "benchmarks.osu", "--quick", "--worlds", "2", "3", "--max-pt2pt", "1024",
                        "--max-coll", "4096", "--omb", str(tmp_path / "no-omb")],
                       cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr
    assert re.search(r"omb-py \(round 1/1\) \.\.\. \d+s  n/a \(latency: no .*no-omb/python/run\.py", r.stdout), r.stdout
    assert re.search(r"omb-c \(round 1/1\) \.\.\. \d+s  n/a \(latency: .*osu_latency not built", r.stdout), r.stdout
    have_mpi, why = mpi_available()
    if not have_mpi:
        assert re.search(r"mpi-tcp \(round 1/1\) \.\.\. \d+s  n/a \(" + re.escape(why), r.stdout), r.stdout
    tables = {}
    for block in r.stdout.split("\n\n"):
        m = re.match(r"osu_(\w+), (\d) ranks", block.strip())
        if m:
            tables[(m.group(1), int(m.group(2)))] = [re.split(r"\s{2,}", ln.strip()) for ln in block.splitlines()[3:]]
    want = {(t, 2) for t in ("latency", "bw", "allreduce", "reduce_scatter", "bcast", "allgather", "barrier")} | \
        {(t, 3) for t in ("allreduce", "bcast", "allgather", "barrier")}  # no power of 2 of floats divides by 3
    assert set(tables) == want, r.stdout
    for (test, world), rows in tables.items():
        sizes = [row[0] for row in rows]
        if test == "latency":
            assert sizes[:2] == ["0 B", "1 B"] and sizes[-1] == "1 KiB", sizes
        elif test == "reduce_scatter":  # where the floats divide by the ranks
            assert sizes[0] == "8 B" and sizes[-1] == "4 KiB", sizes
        for row in rows:  # size, pycyxwiz, mpi-tcp, pycyxwiz-shm, mpi-default, omb-py, omb-c, three ratios
            assert float(row[1].replace(",", "")) > 0 and float(row[3].replace(",", "")) > 0, (test, world, row)
            assert row[5] == row[6] == row[9] == "n/a", row
            if have_mpi:
                assert float(row[2].replace(",", "")) > 0 and float(row[4].replace(",", "")) > 0, (test, world, row)
                assert row[7].endswith("x") and row[8].endswith("x"), row
