"""Writes the export lists of cx.distributed's stubs from the package's own.

cx.distributed's export list is written once: each name in the `__all__` of the module that defines it
(`_pg.py`, `_spawn.py`, `_train.py`), which `distributed/__init__.py` joins. stubtest reads a stub's `__all__`
only as a literal list (an `__all__ += _pg.__all__` stub exports nothing), so the stubs carry copies, and
this script makes them; tests/test_stubs.py fails while a copy differs from what it would write:

    python tests/stub_check/export_lists.py          # rewrite the stubs' lists (after changing an __all__)
"""
import ast
import importlib
import sys
from pathlib import Path
from typing import List

# The stubs whose __all__ this script writes, by the module whose __all__ they copy.
MODULES = ["pycyxwiz.distributed._pg", "pycyxwiz.distributed._train", "pycyxwiz.distributed"]
WIDTH = 110


def stub_path(module: str) -> Path:
    return Path(importlib.import_module(module).__file__).with_suffix(".pyi")


def render(module: str, names: List[str]) -> str:
    """The literal `__all__ = [...]` for `names`, wrapped at WIDTH columns."""
    lines, line = [], "   "
    for name in names:
        item = f' "{name}",'
        if len(line) + len(item) > WIDTH:
            lines.append(line)
            line = "   "
        line += item
    lines.append(line)
    body = "\n".join(lines)
    return f"__all__ = [  # written by tests/stub_check/export_lists.py from {module}.__all__\n{body}\n]"


def expected_stub(module: str) -> str:
    """The stub's text with its `__all__` assignment replaced by the package's list."""
    path = stub_path(module)
    text = path.read_text()
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "__all__":
            lines = text.splitlines(keepends=True)
            start, end = node.lineno - 1, node.end_lineno
            names = list(importlib.import_module(module).__all__)
            return "".join(lines[:start]) + render(module, names) + "\n" + "".join(lines[end:])
    raise SystemExit(f"{path}: no literal __all__ to rewrite (add `__all__ = []` where it belongs)")


def main() -> int:
    for module in MODULES:
        path = stub_path(module)
        new = expected_stub(module)
        if new != path.read_text():
            path.write_text(new)
            print(f"rewrote the export list of {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
