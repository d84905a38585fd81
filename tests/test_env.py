"""Every environment variable is read in one place (csrc/common/env.cpp), listed there and in the
README, under one prefix for pycyxwiz's own (CX_); the old names still work, with a warning."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pycyxwiz as cx

ROOT = Path(__file__).resolve().parents[1]
TABLE = {name for name, _, _ in cx._core._environment_variables()}


def sources(folder, *suffixes):
    for p in sorted((ROOT / folder).rglob("*")):
        if p.suffix in suffixes:
            yield p, p.read_text()


def test_nothing_in_the_core_calls_getenv_but_the_one_reader():
    callers = [str(p.relative_to(ROOT)) for p, text in sources("csrc", ".cpp", ".h", ".cu")
               if "getenv(" in text and p.name != "env.cpp"]
    assert callers == []


def test_every_variable_the_code_reads_is_in_the_table():
    read = set()
    for _, text in sources("csrc", ".cpp", ".h"):
        read |= set(re.findall(r'env::(?:get|integer)\("([A-Z0-9_]+)"', text))
        for group in re.findall(r"env::first_of\(\{([^}]*)\}", text):
            read |= set(re.findall(r'"([A-Z0-9_]+)"', group))
    for _, text in sources("python/pycyxwiz", ".py"):
        read |= set(re.findall(r'os\.environ(?:\.get\(|\[)"([A-Z0-9_]+)"', text))
        read |= set(re.findall(r'(?:_env\.)?(?:get|is_set)\("([A-Z0-9_]+)"', text))
        read |= {n for n in re.findall(r'"(CX_[A-Z0-9_]+)"', text)}
    read -= {"PYCYXWIZ_NN_SCALAR"}  # an old name (pycyxwiz/_env.py), not read by the core
    assert len(read) > 25
    assert read <= TABLE, sorted(read - TABLE)


def test_python_reads_the_environment_through_one_module():
    # pycyxwiz/_env.get, checked against the core's table like env::get; writes (a child's environment) are
    # not reads.
    readers = [str(p.relative_to(ROOT)) for p, text in sources("python/pycyxwiz", ".py")
               if p.name != "_env.py" and re.search(r"os\.environ\.get\(|os\.getenv\(|in os\.environ\b", text)]
    assert readers == []
    from pycyxwiz import _env
    try:
        _env.get("CX_NOT_A_VARIABLE")
    except KeyError as e:
        assert "CX_NOT_A_VARIABLE is not in csrc/common/env.cpp's table" in str(e)
    else:
        raise AssertionError("_env.get read a variable the table lacks")


def test_pycyxwiz_own_variables_have_one_prefix():
    launch = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "RESTART_COUNT"}
    theirs = {n for n in TABLE if n.startswith(("OMPI_", "PMI_", "MPI_", "SLURM_", "DISTRIBUTED_"))}
    assert sorted(n for n in TABLE - launch - theirs if not n.startswith("CX_")) == []


def test_the_readme_lists_every_variable():
    readme = (ROOT / "README.md").read_text()
    missing = [n for n in sorted(TABLE) if f"`{n}`" not in readme]
    assert missing == []


def test_an_old_name_still_works_and_says_the_new_one():
    env = {k: v for k, v in os.environ.items() if k != "CX_NN_SCALAR"}
    env["PYCYXWIZ_NN_SCALAR"] = "1"
    r = subprocess.run([sys.executable, "-c", "import os, pycyxwiz; print(os.environ['CX_NN_SCALAR'])"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "1"
    assert "FutureWarning: the environment variable PYCYXWIZ_NN_SCALAR is deprecated: set CX_NN_SCALAR" in r.stderr


def test_a_variable_missing_from_the_table_is_an_error_not_a_silent_read():
    # The reader refuses names it does not list, so the table cannot fall behind the code.
    import pytest
    with pytest.raises(cx.distributed.DistributedError, match="not in common/env.cpp's table"):
        cx._core._env_get("CX_NO_SUCH_VARIABLE")
