"""The one registry behind operators, tools, stages and pruners: names, entry points, clear errors."""

import logging
from importlib.metadata import EntryPoint

import pytest

import flowopt.plugins
from flowopt.errors import ConfigError, UnknownOperatorError
from flowopt.plugins import Registry


def positive(item: object) -> str:
    if not isinstance(item, int) or item <= 0:
        raise ConfigError(f"{item!r} is not a positive int", fix="register a positive int")
    return f"n{item}"


def declaring(monkeypatch, *points: tuple[str, str]) -> None:
    eps = [EntryPoint(name, value, "test.numbers") for name, value in points]
    monkeypatch.setattr(flowopt.plugins, "entry_points", lambda group: [ep for ep in eps if ep.group == group])


def test_registered_and_declared_names_resolve_and_list(monkeypatch):
    declaring(monkeypatch, ("pi", "math:pi"), ("tau", "math:tau"))
    numbers: Registry[object] = Registry("number", "test.numbers", lambda item: "pi" if item == 3.141592653589793
                                         else "tau", how_to_add="add one")
    assert numbers.names() == ["pi", "tau"]
    import math

    assert numbers.get("tau") == math.tau
    assert numbers.names() == ["tau", "pi"]  # loaded ones first, in order, then the declared rest


def test_an_unknown_name_names_itself_the_known_ones_and_the_fix(monkeypatch):
    declaring(monkeypatch)
    numbers: Registry[int] = Registry("number", "test.numbers", positive, how_to_add="register yours with add()")
    numbers.register(2)
    with pytest.raises(ConfigError) as err:
        numbers.get("n3")
    assert str(err.value) == "unknown number 'n3'. Fix: use one of ['n2'] or register yours with add()"
    with pytest.raises(UnknownOperatorError, match="unknown number 'n3'") as specific:
        numbers.get("n3", error=lambda problem, fix: UnknownOperatorError(problem, node="solve", fix=fix))
    assert specific.value.node == "solve"


def test_a_bad_plugin_is_refused_by_its_check(monkeypatch):
    declaring(monkeypatch, ("broken", "no_such_module_anywhere:thing"), ("wrong", "math:pi"))
    numbers: Registry[int] = Registry("number", "test.numbers", positive, how_to_add="add one")
    with pytest.raises(ConfigError, match="-1 is not a positive int"):
        numbers.register(-1)
    with pytest.raises(ConfigError, match=r"number 'broken' is declared \(no_such_module_anywhere:thing\) but "
                                          "cannot be loaded"):
        numbers.get("broken")
    with pytest.raises(ConfigError, match=r"entry point math:pi for number 'wrong': 3.14\S* is not a positive int"):
        numbers.get("wrong")
    assert numbers.names() == ["broken", "wrong"]  # declared, never registered


def test_replacing_a_name_warns_unless_it_is_the_same_definition(monkeypatch, caplog):
    declaring(monkeypatch)
    numbers: Registry[int] = Registry("number", "test.numbers", lambda item: "one", how_to_add="add one")
    with caplog.at_level(logging.WARNING, logger="flowopt.plugins"):
        numbers.register(1)
        numbers.register(1)
        assert caplog.records == []
        numbers.register(2)
    assert numbers.get("one") == 2
    assert [r.getMessage() for r in caplog.records] == ["number 'one' re-registered: 2 replaces 1"]


def test_every_extension_point_uses_it():
    from flowopt.compiler.stages import STAGES
    from flowopt.optimizers.search.pruners import PRUNERS
    from flowopt.registry import OPERATORS
    from flowopt.tools import TOOLS

    assert {r.group for r in (OPERATORS, TOOLS, STAGES, PRUNERS)} == {
        "flowopt.operators", "flowopt.tools", "flowopt.stages", "flowopt.pruners"}
    assert {"Predict", "ReAct"} <= set(OPERATORS.names()) and "calculator" in TOOLS.names()
    assert "grpo" in STAGES.names() and PRUNERS.names()[0] == "confidence"
