"""The operator registry: maps the ``op`` names of the IR to :class:`~flowopt.operator.Operator` classes.

Built-in operators (in ``flowopt.modules``) and third-party ones are found through the
``flowopt.operators`` entry-point group, so the core never imports a higher layer; users can also
call :func:`register_operator` on their own class.
"""

from __future__ import annotations

from typing import TypeVar

from flowopt.errors import ConfigError, UnknownOperatorError
from flowopt.operator import Operator
from flowopt.plugins import Registry

OpT = TypeVar("OpT", bound=type[Operator])


def _operator_name(cls: object) -> str:
    if not (isinstance(cls, type) and issubclass(cls, Operator)):
        raise ConfigError(f"{cls!r} is not an Operator subclass", fix="subclass flowopt.Operator")
    name = cls.op_name or cls.__name__
    cls.op_name = name
    return name


OPERATORS: Registry[type[Operator]] = Registry(
    "operator", "flowopt.operators", _operator_name, how_to_add="register yours with flowopt.register_operator")


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
    OPERATORS.register(cls)
    return cls


def get_operator(name: str, *, node: str | None = None) -> type[Operator]:
    """Return the operator class registered as ``name``; raises :class:`UnknownOperatorError`."""

    def unknown(problem: str, *, fix: str) -> UnknownOperatorError:
        return UnknownOperatorError(problem, node=node, fix=fix)

    return OPERATORS.get(name, error=unknown)


def operator_names() -> list[str]:
    """Every registered or declared operator name, sorted."""
    return sorted(OPERATORS.names())
