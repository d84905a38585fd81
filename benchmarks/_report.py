"""Numbers to text: sizes, tables (aligned text and markdown), JSON files, machine facts.

    print(format_table(["size", "gloo"], [["8 B", "250 us"]]))
    write_json("allreduce", payload)        # benchmarks/results/partial/allreduce.json
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time

from pathlib import Path

from benchmarks._launch import PARTIAL, REPO

_output = PARTIAL  # Note [Where results go] in _launch.py


def output_dir() -> Path:
    """Where this run writes its JSON, plots and summary."""
    return _output


def set_output_dir(path: Path) -> None:
    global _output
    _output = Path(path)

_UNITS = [("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)]


def parse_size(text: str) -> int:
    """'8', '256K', '4M', '1G', '64KiB' -> bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def human_size(n: int) -> str:
    for name, unit in _UNITS:
        if n >= unit and n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n} B"


def fmt_ratio(x) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def fmt_time_us(seconds) -> str:
    if seconds is None:
        return "n/a"
    us = seconds * 1e6
    return f"{us:.0f} us" if us >= 100 else f"{us:.1f} us"


def fmt_gbps(x) -> str:
    return "n/a" if x is None else (f"{x:.2f}" if x >= 0.1 else f"{x:.3f}")


def format_table(headers: list, rows: list, markdown: bool = False) -> str:
    """Aligned plain text (first column left, the rest right) or a GitHub markdown table."""
    cells = [[str(c) for c in r] for r in rows]
    if markdown:
        out = ["| " + " | ".join(headers) + " |",
               "|" + "|".join(["---"] + ["---:"] * (len(headers) - 1)) + "|"]
        out += ["| " + " | ".join(r) + " |" for r in cells]
        return "\n".join(out)
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) if cells else len(str(h))
              for i, h in enumerate(headers)]
    def line(r):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line([str(h) for h in headers]), line(["-" * w for w in widths])] + [line(r) for r in cells])


def median(xs: list) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def machine_info() -> dict:
    """Facts that make a result file interpretable later."""
    info = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host_cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
    }
    try:
        info["git"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                     capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open("/proc/cpuinfo") as fh:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), "")
    except OSError:
        pass
    return info


def write_json(name: str, payload: dict) -> str:
    _output.mkdir(parents=True, exist_ok=True)
    path = _output / f"{name}.json"
    payload = {**payload, "machine": machine_info()}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)
    return str(path)


def read_json(name: str) -> dict | None:
    path = _output / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def plt():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot

        return pyplot
    except ImportError:
        return None


LIB_STYLE = {
    "pycyxwiz": dict(color="tab:red", marker="o", lw=2.2),
    "pycyxwiz-shm": dict(color="tab:red", marker="D", ls="--"),
    "pycyxwiz-one-session": dict(color="tab:orange", marker="o"),
    "pycyxwiz-shm-one-session": dict(color="tab:orange", marker="D", ls="--"),
    "gloo": dict(color="tab:blue", marker="s"),
    "torch": dict(color="tab:blue", marker="s"),
    "mpi-tcp": dict(color="tab:green", marker="^"),
    "mpi-default": dict(color="tab:green", marker="v", ls="--"),
}
LIB_LABEL = {
    "pycyxwiz": "pycyxwiz (TCP)",
    "pycyxwiz-shm": "pycyxwiz, shared memory (its default on one host)",
    "pycyxwiz-one-session": "pycyxwiz (TCP), ranks in one session (launch --one-session)",
    "pycyxwiz-shm-one-session": "pycyxwiz, shared memory, ranks in one session (launch --one-session)",
    "gloo": "PyTorch gloo",
    "torch": "PyTorch DDP (gloo)",
    "mpi-tcp": "Open MPI, TCP forced",
    "mpi-default": "Open MPI, default (shared memory)",
}
