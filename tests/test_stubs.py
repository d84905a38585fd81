"""The .pyi stubs describe the module as it is (stubtest), and the guide's code type-checks against them."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]



def stub_all(path: Path) -> list:
    """The export list a .pyi stub writes (a literal: stubtest reads no other form)."""
    import ast
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "__all__":
            return list(ast.literal_eval(node.value))
    return []


@pytest.mark.parametrize("module", ["pycyxwiz.distributed", "pycyxwiz.distributed._pg", "pycyxwiz.distributed._train"])
def test_the_stubs_export_lists_are_the_packages(module):
    # cx.distributed's list stands in _pg.py, _pg.pyi and __init__.pyi (stubtest reads a stub's __all__ only as
    # a literal list): this keeps the copies equal to the package's, in order.
    import importlib
    mod = importlib.import_module(module)
    stub = Path(mod.__file__).with_suffix(".pyi")
    assert stub_all(stub) == list(mod.__all__), module


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
