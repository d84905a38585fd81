"""The layers of csrc/ depend only downward (README "Design"). CMake checks calls (each layer links on
its own with only the layers below it); this checks includes, which a header-only use would slip past."""
import re
from pathlib import Path

CSRC = Path(__file__).resolve().parents[1] / "csrc"

BELOW = {
    "common": {"common"},
    "cuda": {"common", "cuda"},
    "nn": {"common", "cuda", "nn"},
    "distributed": {"common", "cuda", "distributed"},
    "train": {"common", "cuda", "nn", "distributed", "train"},
    "bindings": {"common", "cuda", "nn", "distributed", "train", "bindings"},
}


def includes(path):
    return re.findall(r'^#include "([^"]+)"', path.read_text(), re.M)


def test_every_layer_includes_only_itself_and_the_layers_below():
    wrong = []
    for layer, allowed in BELOW.items():
        for p in sorted((CSRC / layer).rglob("*")):
            if p.suffix not in (".h", ".cpp", ".cu"):
                continue
            wrong += [f"{p.relative_to(CSRC)} includes {inc}" for inc in includes(p)
                      if inc.split("/")[0] not in allowed]
    assert wrong == []


def test_algorithms_see_the_transport_interface_not_a_transport():
    wrong = []
    for p in sorted((CSRC / "distributed" / "algorithms").glob("*")):
        for inc in includes(p):
            if inc.startswith("distributed/") and not inc.startswith("distributed/algorithms/") and \
                    inc not in ("distributed/transport/transport.h", "distributed/types.h",
                                "distributed/reduce_probe.h"):  # plain data, as types.h
                wrong.append(f"{p.name} includes {inc}")
    assert wrong == []


def test_the_store_knows_nothing_of_the_transports_or_backends():
    wrong = [f"{p.name} includes {inc}" for p in sorted((CSRC / "distributed" / "store").glob("*"))
             for inc in includes(p) if inc.startswith(("distributed/transport/", "distributed/backend/"))]
    assert wrong == []
