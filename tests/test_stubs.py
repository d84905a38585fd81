"""The .pyi stubs describe the module as it is (stubtest), and the guide's code type-checks against them."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]



sys.path.insert(0, str(ROOT / "tests" / "stub_check"))
import export_lists  # noqa: E402


@pytest.mark.parametrize("module", export_lists.MODULES)
def test_the_stubs_export_lists_are_the_packages(module):
    # cx.distributed's list is written once, in the modules that define the names (_pg.py, _spawn.py, _train.py);
    # the stubs carry literal copies (stubtest reads no other form), written by tests/stub_check/export_lists.py.
    stub = export_lists.stub_path(module)
    assert stub.read_text() == export_lists.expected_stub(module), (
        f"{stub}: its __all__ is not {module}.__all__; run python tests/stub_check/export_lists.py")


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
