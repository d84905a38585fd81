"""The .pyi stubs describe the module as it is (stubtest), and the guide's code type-checks against them."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("mypy", reason="mypy checks the stubs (pip install '.[test]' installs it)")


def mypy(*args):
    env = dict(os.environ, MYPYPATH=str(ROOT / "python"))
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=600, env=env,
                          cwd=ROOT)


def test_the_stubs_match_the_compiled_module():
    r = mypy("mypy.stubtest", "pycyxwiz", "--allowlist", "tests/stub_check/allowlist.txt", "--mypy-config-file",
             "pyproject.toml")
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_guides_code_type_checks_against_the_stubs():
    r = mypy("mypy", "--ignore-missing-imports", "--no-incremental", "tests/stub_check/stubs_usage.py")
    assert r.returncode == 0, r.stdout + r.stderr
