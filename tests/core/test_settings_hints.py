"""flowopt.settings resolves the owners' annotations with typing.get_type_hints, one by one when one fails."""

from __future__ import annotations

import sys
import textwrap
import types
from typing import Any

import pytest

from flowopt.errors import ConfigError
from flowopt.settings import check_settings, type_hints


@pytest.fixture
def two_modules():
    """``hints_base`` declares ``Base`` (an annotation naming its own ``Budget``); ``hints_child`` subclasses it
    with an annotation naming a class imported only for type checkers."""
    base, child = types.ModuleType("hints_base"), types.ModuleType("hints_child")
    try:
        sys.modules.update(hints_base=base, hints_child=child)
        exec(textwrap.dedent("""
            from __future__ import annotations
            class Budget: ...
            class Base:
                budget: Budget | None
                rounds: int
        """), base.__dict__)
        exec(textwrap.dedent("""
            from __future__ import annotations
            from typing import TYPE_CHECKING
            from hints_base import Base
            if TYPE_CHECKING:
                from torch import Tensor
            class Child(Base):
                weights: Tensor
                scale: float
        """), child.__dict__)
        yield base, child
    finally:
        for name in ("hints_base", "hints_child"):
            sys.modules.pop(name, None)


def test_an_unresolvable_annotation_is_any_and_the_others_keep_their_types(two_modules):
    base, child = two_modules
    hints = type_hints(child.Child)
    assert hints["weights"] is Any  # Tensor exists only for type checkers
    assert hints["scale"] is float
    assert hints["rounds"] is int
    # The base's annotation resolves in the base's own module, where Budget lives.
    assert hints["budget"] == base.Budget | None


def test_check_settings_uses_the_resolved_types(two_modules):
    _, child = two_modules
    check_settings("Child", {"weights": object(), "scale": 0.5, "rounds": 3}, hints=child.Child)
    with pytest.raises(ConfigError, match="Child rounds must be"):
        check_settings("Child", {"rounds": "three"}, hints=child.Child)
    with pytest.raises(ConfigError, match="Child budget must be"):
        check_settings("Child", {"budget": 7}, hints=child.Child)


def test_a_function_resolves_in_its_own_globals():
    namespace: dict[str, Any] = {}
    exec(textwrap.dedent("""
        from __future__ import annotations
        from typing import TYPE_CHECKING
        class Retriever: ...
        if TYPE_CHECKING:
            from torch import Tensor
        def build(k: int, retriever: Retriever, cache: Tensor | None = None) -> None: ...
    """), namespace)
    hints = type_hints(namespace["build"])
    assert hints["k"] is int and hints["retriever"] is namespace["Retriever"] and hints["cache"] is Any


def test_a_text_format_is_checked_and_described_with_a_sample():
    from pathlib import Path

    from flowopt.settings import matches

    name = matches(r"^[a-z]+$", meaning="lower-case letters", sample="abc")
    check_settings("Thing", {"tag": "abc", "folder": Path("abc")}, hints={"tag": str, "folder": Path},
                   bounds={"tag": name, "folder": name})
    with pytest.raises(ConfigError) as err:
        check_settings("Thing", {"tag": "ab1"}, hints={"tag": str}, bounds={"tag": name})
    assert str(err.value) == "Thing tag must be lower-case letters, got 'ab1' (str). Fix: pass tag='abc'"
    with pytest.raises(ConfigError, match=r"Thing folder must be lower-case letters, got PosixPath\('A'\)"):
        check_settings("Thing", {"folder": Path("A")}, hints={"folder": Path}, bounds={"folder": name})
    with pytest.raises(ConfigError, match="got 3 \\(int\\)"):  # the type is checked first
        check_settings("Thing", {"tag": 3}, hints={"tag": str}, bounds={"tag": name})
