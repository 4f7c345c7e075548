"""The examples in flowopt.lm's docstrings run as written (the style rule asks public classes for a short
example; one that cannot run misleads the reader). Examples marked ``# doctest: +SKIP`` need a real model."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import flowopt.lm

MODULES = sorted(m.name for m in pkgutil.iter_modules(flowopt.lm.__path__, "flowopt.lm."))


@pytest.mark.parametrize("name", MODULES)
def test_the_docstring_examples_run(name):
    if name == "flowopt.lm.quantize":
        pytest.importorskip("torchao")
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name} (run it with -s)"
