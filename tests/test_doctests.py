"""Every example in thinwire's docstrings (``>>>``) runs and prints what it says: they pin semantics a reader
relies on (the CPU quota's periods, a spec's canonical text), so they are tests like any other."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "thinwire"
MODULES = sorted("thinwire." + ".".join(p.relative_to(PKG).with_suffix("").parts)
                 for p in PKG.rglob("*.py") if ">>> " in p.read_text())


def test_the_examples_are_found():
    assert len(MODULES) >= 40 and "thinwire.perf.pipeline" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name.removesuffix(".__init__"))
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (printed above)"
