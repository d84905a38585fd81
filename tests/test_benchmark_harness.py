"""The benchmark harness keeps the committed results for complete runs (its timings are never tested
here: speed lives in benchmarks/, run by hand)."""
import hashlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
EVERY_STEP = ["loopback", "all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier", "pingpong",
              "train", "train_extras", "cnn", "hooks", "torch_backend", "memory"]


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
