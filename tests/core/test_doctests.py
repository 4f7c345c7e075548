"""The examples in the docstrings run as written, in every package (the style rule asks public classes for a
short example; one that cannot run misleads the reader). Examples marked ``# doctest: +SKIP`` need a real
model, a server or a GPU."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import flowopt
import flowopt.benchmarks
import flowopt.modules
import flowopt.optimizers

PACKAGES = (flowopt, flowopt.modules, flowopt.optimizers, flowopt.benchmarks)
NEEDS = {"flowopt.lm.quantize": "torchao"}  # optional dependencies a module's examples import


def _modules() -> list[str]:
    names = set()
    for package in PACKAGES:
        names.add(package.__name__)
        names |= {m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")}
    return sorted(names)


@pytest.mark.parametrize("name", _modules())
def test_the_docstring_examples_run(name):
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name} (run it with -s)"
