"""Layers that only point down: every package and top-level module of ``thinwire/`` has a layer, and
imports (at any depth in a function, too) only from layers below its own. So there is no import
cycle between packages, and a change to a high layer (the trainer, the CLI) never ripples down."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "thinwire"

# lowest first; a unit may import only units of strictly lower layers
LAYERS: list[set[str]] = [
    {"errors", "signals", "child"},         # errors and stop signals: what every layer may raise; children's environment
    {"config"},
    {"units", "syncspec", "pipespec", "batch"},  # plain parsers (--sync, --pipeline into typed specs); a batch's tensors
    {"perf"},                               # pure model: imports no other thinwire layer
    {"workloads", "precision", "compress", "pipeline"},  # what runs on a host: models and data, numerics, the wire, stages
    {"cluster"},                            # the one cluster spec, and the emulator of it
    {"measure"},                            # `thinwire profile`: this machine's costs
    {"sim"},                                # pricing inputs and `thinwire simulate`
    {"plan"},                               # the offline planner and plan files
    {"auto"},                               # the online policy
    {"commspec"},                           # --compression parsed once into a typed spec
    {"api"},                                # thinwire.attach
    {"train"},                              # the loop, checkpoints, launching (also onto the emulator)
    {"integrations"},                       # Lightning, accelerate, the HF Trainer (optional extras)
    {"report", "validation", "doctor"},     # read runs back; run simulated configurations for real; doctor
    {"cli"},
    {"__main__", "__init__"},
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def _unit(path: Path) -> str:
    rel = path.relative_to(PKG).parts
    return rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out |= {n.split(".")[1] for n in names if n.startswith("thinwire.") and n.count(".") >= 1}
    return out


FILES = sorted(PKG.rglob("*.py"))


def test_every_unit_has_a_layer():
    units = {_unit(f) for f in FILES}
    assert units <= set(RANK), f"give these a layer in LAYERS: {sorted(units - set(RANK))}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PKG)))
def test_imports_point_down(path):
    me = _unit(path)
    for target in _imports(path) - {me}:
        if target not in RANK:
            continue  # a name imported from a module (thinwire.api.attach), not a unit
        assert RANK[target] < RANK[me], (
            f"{path.relative_to(PKG)} ({me}, layer {RANK[me]}) imports thinwire.{target} (layer {RANK[target]}): "
            "a lower layer must not import a higher one")
