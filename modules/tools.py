"""The built-in tools: ``calculator`` (arithmetic, parsed, never evaluated as Python) and ``python`` (the sandbox).

Both are registered through the ``flowopt.tools`` entry-point group, so a workflow names them without
holding any code.

Example:
    >>> from flowopt.modules.tools import evaluate_arithmetic
    >>> evaluate_arithmetic("(3 + 4) * 2 / 7")
    '2'
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

from flowopt.errors import SandboxError
from flowopt.modules.sandbox import run_python
from flowopt.tools import Tool, ToolError

MAX_EXPRESSION_CHARS = 300
MAX_NODES = 100
MAX_EXPONENT = 64  # |b| in a ** b
MAX_MAGNITUDE = 1e30  # every intermediate value and the result
_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate_arithmetic(expression: str) -> str:
    """The value of an arithmetic expression: numbers, ``+ - * / // % **`` and parentheses only.

    The text is parsed with :mod:`ast` and walked node by node; names, calls, attributes, strings and
    every other construct are refused, exponents are at most :data:`MAX_EXPONENT` in size and every
    value at most :data:`MAX_MAGNITUDE`, so no input can run code or take long. ``x`` and ``^`` are
    read as ``*`` and ``**`` (how models often write them); thousands separators are dropped.

    Example:
        >>> evaluate_arithmetic("2^10 - 24")
        '1000'
        >>> evaluate_arithmetic("__import__('os')")
        Traceback (most recent call last):
        ...
        flowopt.tools.ToolError: only numbers and + - * / // % ** ( ) are allowed, not Call
    """
    text = str(expression).strip().rstrip("=").strip().replace("^", "**").replace("×", "*").replace("÷", "/")
    text = text.replace(",", "") if "," in text and all(c.isdigit() or c in ",. " for c in text) else text
    if not text:
        raise ToolError("empty expression: pass arithmetic such as 12 * (3 + 4)")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression is {len(text)} characters; at most {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError) as err:
        raise ToolError(f"not an arithmetic expression ({err.msg if isinstance(err, SyntaxError) else err})") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise ToolError(f"expression has more than {MAX_NODES} parts; split it into several calls")
    value = _value(tree.body)
    return _format(value)


def _value(node: ast.expr) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > MAX_EXPONENT or (left == 0 and right < 0)):
            raise ToolError(f"exponent {right:g} is out of range (at most {MAX_EXPONENT} in size, 0 ** negative "
                            "undefined)")
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError(f"result is larger than {MAX_MAGNITUDE:g}") from None
        if isinstance(result, complex):
            raise ToolError("a negative number to a fractional power has no real value")
        return _bounded(result)
    kind = type(node.op).__name__ if isinstance(node, ast.BinOp | ast.UnaryOp) else type(node).__name__
    raise ToolError(f"only numbers and + - * / // % ** ( ) are allowed, not {kind}")


def _bounded(value: float) -> float:
    if (isinstance(value, float) and not math.isfinite(value)) or abs(value) > MAX_MAGNITUDE:
        raise ToolError(f"a value exceeds {MAX_MAGNITUDE:g} in size")
    return value


def _format(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if value.is_integer():
        return str(int(value))
    return f"{value:.10g}"


def _run_sandboxed(code: str) -> str:
    try:
        result = run_python(code, timeout_s=5.0, memory_mb=256)
    except SandboxError as err:  # the boundary cannot be built here: say so, never run the code unisolated
        raise ToolError(str(err)) from None
    if result.timed_out:
        raise ToolError("the program timed out after 5 s")
    if not result.ok:
        raise ToolError(result.stderr.strip()[-800:] or f"the program exited with status {result.returncode}")
    return result.stdout.strip() or "(the program printed nothing; print the value you need)"


calculator = Tool(
    "calculator", "Evaluates an arithmetic expression (numbers, + - * / // % **, parentheses) and returns "
                  "its value.", "expression", evaluate_arithmetic)
python = Tool(
    "python", "Runs a Python 3 program in a sandbox (no network, no files, 5 s) and returns what it prints.",
    "code", _run_sandboxed)
