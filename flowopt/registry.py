"""The operator registry: maps the ``op`` names of the IR to :class:`~flowopt.operator.Operator` classes.

Built-in operators (in ``flowopt.modules``) and third-party ones are found through the
``flowopt.operators`` entry-point group, so the core never imports a higher layer; users can also
call :func:`register_operator` on their own class.
"""

from __future__ import annotations

import logging
import threading
from importlib.metadata import entry_points
from typing import TypeVar

from flowopt.errors import ConfigError, UnknownOperatorError
from flowopt.operator import Operator

logger = logging.getLogger(__name__)

_REGISTRY: dict[str, type[Operator]] = {}
_LOCK = threading.Lock()
_ENTRY_POINTS_LOADED = False

OpT = TypeVar("OpT", bound=type[Operator])


def register_operator(cls: OpT) -> OpT:
    """Register an operator class under its ``op_name`` (or class name). Usable as a decorator.

    Example:
        >>> from flowopt import Operator, register_operator
        >>> @register_operator
        ... class Echo(Operator):
        ...     op_name = "Echo"
        >>> from flowopt.registry import get_operator
        >>> get_operator("Echo") is Echo
        True
    """
    if not (isinstance(cls, type) and issubclass(cls, Operator)):
        raise ConfigError(f"{cls!r} is not an Operator subclass", fix="subclass flowopt.Operator")
    name = cls.op_name or cls.__name__
    cls.op_name = name
    with _LOCK:
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not cls and existing.__qualname__ != cls.__qualname__:
            logger.warning("operator %r re-registered: %s replaces %s", name, cls, existing)
        _REGISTRY[name] = cls
    return cls


def _load_entry_points() -> None:
    global _ENTRY_POINTS_LOADED
    if _ENTRY_POINTS_LOADED:
        return
    for ep in entry_points(group="flowopt.operators"):
        if ep.name in _REGISTRY:
            continue
        cls = ep.load()  # importing the module registers the class
        if ep.name not in _REGISTRY:
            register_operator(cls)
    _ENTRY_POINTS_LOADED = True


def get_operator(name: str, *, node: str | None = None) -> type[Operator]:
    """Return the operator class registered as ``name``; raises :class:`UnknownOperatorError`."""
    if name not in _REGISTRY:
        _load_entry_points()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownOperatorError(
            f"unknown operator {name!r}", node=node,
            fix=f"use one of {sorted(_REGISTRY)} or register yours with flowopt.register_operator",
        ) from None


def operator_names() -> list[str]:
    _load_entry_points()
    return sorted(_REGISTRY)
