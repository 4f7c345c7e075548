"""One validator for every operator and stage setting: the declared type, then the declared bounds.

Types come from the annotations that the operator's ``__init__`` or the stage's dataclass already
declare (``int``, ``float | None``, ``tuple[int, ...]``, ``Mapping[str, ...]``...); bounds are declared
next to them with :func:`between`, :func:`at_least`, :func:`above`, :func:`one_of` and (for a text's
format) :func:`matches`. A bad value
raises :class:`~flowopt.errors.ConfigError` naming the owner, the setting, the value and the fix.
``bool`` is never accepted as a number, an ``int`` setting refuses ``2.5``, and a ``float`` setting
refuses NaN and infinity.

Example:
    >>> from flowopt.settings import at_least, check_settings
    >>> check_settings("Refine", {"max_rounds": 2}, hints={"max_rounds": int},
    ...                bounds={"max_rounds": at_least(1)})
    >>> check_settings("Refine", {"max_rounds": 2.5}, hints={"max_rounds": int},
    ...                bounds={"max_rounds": at_least(1)})
    Traceback (most recent call last):
    ...
    flowopt.errors.ConfigError: Refine max_rounds must be an int >= 1, got 2.5 (float). Fix: pass max_rounds=1
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import math
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from flowopt.errors import ConfigError

_MAX_REPR = 80


@dataclass(frozen=True)
class Bound:
    """Allowed values of one setting: a closed or half-open numeric range, or a set of choices."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple[Any, ...] | None = None
    high_open: bool = False
    pattern: str | None = None  # a text (or path) setting's format, for re.search
    meaning: str | None = None  # what the pattern asks for, in words
    sample: Any = None  # a value that fits, for the fix

    def allows(self, value: Any) -> bool:
        if value is None:  # None passed the type check, so the annotation allows it
            return True
        if self.choices is not None:
            return value in self.choices
        if self.pattern is not None:
            return not isinstance(value, str | os.PathLike) or re.search(self.pattern, os.fspath(value)) is not None
        if isinstance(value, bool) or not isinstance(value, int | float):
            return True  # a range only constrains numbers (sequence elements are checked one by one)
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or value < self.high or (value == self.high and not self.high_open)

    def describe(self) -> str:
        if self.meaning is not None:
            return self.meaning
        if self.choices is not None:
            return f"one of {list(self.choices)}"
        low = "" if self.low is None else f"{'>' if self.low_open else '>='} {self.low:g}"
        high = "" if self.high is None else f"{'<' if self.high_open else '<='} {self.high:g}"
        return " and ".join(p for p in (low, high) if p)

    def example(self) -> Any:
        if self.sample is not None:
            return self.sample
        if self.choices is not None:
            return self.choices[0]
        if self.low is None:
            return self.high if not self.high_open or self.high is None else self.high - 1
        return self.low if not self.low_open else (self.high if self.high is not None else self.low + 1)


def between(low: float, high: float) -> Bound:
    """``low <= value <= high``."""
    return Bound(low=low, high=high)


def at_least(low: float) -> Bound:
    """``value >= low``."""
    return Bound(low=low)


def above(low: float, high: float | None = None) -> Bound:
    """``value > low`` (and ``<= high`` when given)."""
    return Bound(low=low, high=high, low_open=True)


def below(high: float, low: float | None = None) -> Bound:
    """``value < high`` (and ``>= low`` when given).

    Example:
        >>> below(1.0, 0.0).allows(0.5), below(1.0, 0.0).allows(1.0), below(1.0, 0.0).describe()
        (True, False, '>= 0 and < 1')
    """
    return Bound(low=low, high=high, high_open=True)


def one_of(*choices: Any) -> Bound:
    """``value`` is one of ``choices``."""
    return Bound(choices=choices)


def matches(pattern: str, *, meaning: str, sample: str) -> Bound:
    """A text or path setting in which ``re.search(pattern)`` finds a match: ``meaning`` says what that
    is in words, ``sample`` is a value that fits (the fix shows it).

    Example:
        >>> url = matches(r"^https?://[^\\s/]+", meaning="an http(s):// URL", sample="http://127.0.0.1:8000/v1")
        >>> url.allows("http://localhost:8000/v1"), url.allows("localhost:8000"), url.describe()
        (True, False, 'an http(s):// URL')
    """
    return Bound(pattern=pattern, meaning=meaning, sample=sample)


def check_settings(owner: str, values: Mapping[str, Any], *, hints: Mapping[str, Any] | Callable[..., Any],
                   bounds: Mapping[str, Bound] | None = None) -> None:
    """Check ``values`` against the declared types (``hints``: a mapping, or a function/class whose
    annotations declare them) and ``bounds``; raise :class:`ConfigError` on the first bad one."""
    declared = hints if isinstance(hints, Mapping) else type_hints(hints)
    bounds = bounds or {}
    for name, value in values.items():
        annotation = declared.get(name, Any)
        bound = bounds.get(name)
        items = value if isinstance(value, list | tuple) and bound is not None and bound.choices is None else (value,)
        finite = not (isinstance(value, float) and not math.isfinite(value))
        if not (finite and _matches(value, annotation) and all(bound is None or bound.allows(i) for i in items)):
            wanted = _describe(annotation, bound)
            example = bound.example() if bound is not None else _EXAMPLES.get(_base(annotation))
            if example is not None and bound is not None and isinstance(value, list | tuple):
                example = (example,)
            fix = f"pass {name}={example!r}" if example is not None else f"pass {name} as {wanted}"
            raise ConfigError(f"{owner} {name} must be {wanted}, got {_short(value)} ({type(value).__name__})",
                              fix=fix + ("" if finite else " (NaN and infinity are refused)"))


def check_stage(stage: Any, bounds: Mapping[str, Bound] | None = None) -> None:
    """Check every field of a stage dataclass (call it from ``__post_init__``)."""
    values = {f.name: getattr(stage, f.name) for f in dataclasses.fields(stage)}
    check_settings(type(stage).__name__, values, hints=type(stage), bounds=bounds)


@functools.cache
def type_hints(owner: Callable[..., Any]) -> dict[str, Any]:
    """The resolved annotations of a class or function; one that cannot be resolved counts as ``Any``.

    ``typing.get_type_hints`` resolves them all at once; when one fails (a name the owner's module imports
    only under ``TYPE_CHECKING``), each annotation is resolved alone by ``get_type_hints`` in the namespace
    of the module that declares it, so one unresolvable annotation does not hide the others' types.

    Example:
        >>> def owner(rounds: "int", model: "Tensor | None" = None) -> None: ...
        >>> type_hints(owner)["rounds"], type_hints(owner)["model"]
        (<class 'int'>, typing.Any)
    """
    try:
        return typing.get_type_hints(owner)
    except (NameError, AttributeError, TypeError):  # resolved one by one below
        pass
    resolved: dict[str, Any] = {}
    for declarer in reversed(getattr(owner, "__mro__", (owner,))):
        module = sys.modules.get(getattr(declarer, "__module__", None) or "")
        namespace = getattr(declarer, "__globals__", None) or (dict(vars(module)) if module is not None else {})
        for name, annotation in getattr(declarer, "__annotations__", {}).items():
            resolved[name] = _resolve(annotation, namespace)
    return resolved


def _resolve(annotation: Any, namespace: dict[str, Any]) -> Any:
    """One annotation resolved by ``typing.get_type_hints`` in ``namespace``; ``Any`` when it cannot be."""
    holder = type("OneAnnotation", (), {"__annotations__": {"value": annotation}})
    try:
        return typing.get_type_hints(holder, globalns=namespace, localns={})["value"]
    except (NameError, AttributeError, TypeError):  # unresolvable: the owner's own checks apply to this setting
        return Any


def _matches(value: Any, annotation: Any) -> bool:
    if annotation is Any or annotation is object:
        return True
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return any(_matches(value, a) for a in args)
    if annotation is None or annotation is type(None):
        return value is None
    if origin is typing.ClassVar:
        return True
    if origin is typing.Literal:
        return value in args
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if annotation is str:
        return isinstance(value, str)
    if origin in (list, tuple, collections.abc.Sequence):
        if not isinstance(value, list | tuple):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(args) == len(value) and all(_matches(v, a) for v, a in zip(value, args))
        return not args or all(_matches(v, args[0]) for v in value)
    if origin in (dict, collections.abc.Mapping):
        if not isinstance(value, Mapping):
            return False
        if len(args) != 2:
            return True
        return all(_matches(k, args[0]) and _matches(v, args[1]) for k, v in value.items())
    if origin is collections.abc.Callable or annotation is collections.abc.Callable:
        return callable(value)
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return True  # an annotation this checker does not model: the owner's own checks apply


_NAMES: dict[Any, tuple[str, str]] = {int: ("an int", "ints"), float: ("a number", "numbers"),
                                      str: ("a string", "strings"), bool: ("a bool", "bools")}
_EXAMPLES: dict[Any, Any] = {int: 1, float: 1.0, bool: True}


def _base(annotation: Any) -> Any:
    """The annotation without ``| None``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return annotation


def _describe(annotation: Any, bound: Bound | None) -> str:
    """``an int >= 1 or None``, ``a list of finite numbers each >= 0 and <= 2``..."""
    optional = annotation is not _base(annotation) or annotation is type(None)
    base = _base(annotation)
    origin, args = typing.get_origin(base), typing.get_args(base)
    if bound is not None and (bound.choices is not None or bound.pattern is not None):
        text = bound.describe()
    elif origin in (list, tuple, collections.abc.Sequence):
        item = _NAMES.get(args[0] if args else Any, (None, "values"))[1]
        text = f"a list of {item}" + (f" each {bound.describe()}" if bound is not None else "")
    elif origin in (dict, collections.abc.Mapping):
        text = "an object" + (f" whose values are each {_describe(args[1], None)}" if len(args) == 2 else "")
    elif origin is collections.abc.Callable or base is collections.abc.Callable:
        text = "a function"
    elif base in _NAMES:
        text = _NAMES[base][0] + (f" {bound.describe()}" if bound is not None else "")
    elif isinstance(base, type):
        text = f"a {base.__name__}"
    else:
        text = str(base).replace("typing.", "").replace("collections.abc.", "")
    return f"{text} or None" if optional else text


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_REPR else f"{text[:_MAX_REPR]}... ({len(text)} characters)"


# The sampling temperature every LM-calling operator accepts (None: the LM's own default).
TEMPERATURE: dict[str, Bound] = {"temperature": between(0.0, 2.0)}
