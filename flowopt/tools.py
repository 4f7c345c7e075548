"""Tools a tool-using node may call, registered by name, and the record of every call.

A workflow file names its tools (``"tools": ["calculator", "python"]``); it never holds their code.
Names resolve through this registry: built-ins and third-party tools come from the ``flowopt.tools``
entry-point group (as operators come from ``flowopt.operators``), and :func:`register_tool` adds one in
process. An unknown name is a :class:`~flowopt.errors.ConfigError` naming it and the registered ones.

A tool takes one string argument (an expression, a program) and returns a string, or raises
:class:`ToolError` with a message the LM sees. Each call is a :class:`ToolCall` (name, argument, result
or error, status); while a :func:`tool_log` is open in the calling context every call is appended to
it, with the index of the LM call that chose it (GRPO credits per-transition rewards that way).

Example:
    >>> from flowopt.tools import Tool, register_tool, get_tool
    >>> _ = register_tool(Tool("shout", "Upper-cases its text.", "text", str.upper))
    >>> get_tool("shout")("hi")
    ToolCall(tool='shout', argument='hi', result='HI', error=None, status='ok', transition=None)
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from flowopt.errors import ConfigError, FlowoptError
from flowopt.plugins import Registry

logger = logging.getLogger(__name__)

ToolStatus = Literal["ok", "error", "unknown_tool"]
#: Every status a :class:`ToolCall` can have: the tool ran; it refused or failed; the LM named no such tool.
TOOL_STATUSES: tuple[str, ...] = ("ok", "error", "unknown_tool")
MAX_RESULT_CHARS = 2000  # what the LM is shown of one result or error


class ToolError(FlowoptError):
    """A tool refused its argument or failed; the message is shown to the LM as the call's error."""


@dataclass(frozen=True)
class Tool:
    """A named function of one string argument that a tool-using node may call.

    ``argument`` names that argument for the LM (``"expression"``); ``fn`` returns the result as text
    or raises :class:`ToolError`.

    Example:
        >>> Tool("echo", "Returns its text.", "text", lambda s: s)("x").result
        'x'
    """

    name: str
    description: str
    argument: str
    fn: Callable[[str], str]

    def __call__(self, argument: str) -> ToolCall:
        """Run the tool; failures become a call with ``status="error"`` (never raised)."""
        try:
            result = str(self.fn(str(argument)))
        except ToolError as err:
            return ToolCall(self.name, str(argument), None, _clip(err.problem), "error")
        except Exception as err:  # a third-party tool's bug is the LM's observation, not the program's crash
            logger.debug("tool %s raised", self.name, exc_info=True)
            return ToolCall(self.name, str(argument), None, _clip(f"{type(err).__name__}: {err}"), "error")
        return ToolCall(self.name, str(argument), _clip(result), None, "ok")


@dataclass
class ToolCall:
    """One call: the tool's name, its argument, the result or the error, and the status.

    ``transition`` is the index (in its rollout) of the LM call that chose this tool, when recorded
    inside a :func:`tool_log` that counts LM calls; else ``None``.
    """

    tool: str
    argument: str
    result: str | None
    error: str | None
    status: ToolStatus
    transition: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def observation(self) -> str:
        """What the LM sees after the call."""
        return self.result if self.status == "ok" and self.result is not None else f"Error: {self.error}"


def _clip(text: str) -> str:
    return text if len(text) <= MAX_RESULT_CHARS else text[:MAX_RESULT_CHARS] + " ...(truncated)"


# -- the registry --------------------------------------------------------------------------------------------

def _tool_name(tool: object) -> str:
    if not isinstance(tool, Tool):
        raise ConfigError(f"{tool!r} is not a flowopt.tools.Tool", fix="wrap the function as Tool(name, ...)")
    return tool.name


TOOLS: Registry[Tool] = Registry("tool", "flowopt.tools", _tool_name,
                                 how_to_add="register yours with flowopt.tools.register_tool or the "
                                            "'flowopt.tools' entry-point group")


def register_tool(tool: Tool) -> Tool:
    """Register ``tool`` under its name (replacing one of the same name)."""
    return TOOLS.register(tool)


def tool_names() -> list[str]:
    """Every registered tool name."""
    return sorted(TOOLS.names())


def get_tool(name: str) -> Tool:
    """The tool registered as ``name``; an unknown name raises :class:`ConfigError` listing the known ones."""
    return TOOLS.get(name)


# -- the call log --------------------------------------------------------------------------------------------


@dataclass
class ToolLog:
    """Tool calls made in one context (a rollout). ``lm_calls`` counts the LM calls made so far, so
    each call is filed under the LM call that chose it."""

    lm_calls: Callable[[], int] | None = None
    calls: list[ToolCall] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, call: ToolCall) -> None:
        if self.lm_calls is not None:
            call.transition = max(0, self.lm_calls() - 1)
        with self.lock:
            self.calls.append(call)


_LOG: contextvars.ContextVar[ToolLog | None] = contextvars.ContextVar("flowopt_tool_log", default=None)


@contextlib.contextmanager
def tool_log(lm_calls: Callable[[], int] | None = None) -> Iterator[ToolLog]:
    """Collect every tool call made in this context (and in contexts copied from it) until exit.

    Example:
        >>> with tool_log() as log:
        ...     record_tool_call(ToolCall("calculator", "1+1", "2", None, "ok"))
        >>> [c.result for c in log.calls]
        ['2']
    """
    log = ToolLog(lm_calls)
    token = _LOG.set(log)
    try:
        yield log
    finally:
        _LOG.reset(token)


def record_tool_call(call: ToolCall) -> None:
    """File ``call`` in the open :func:`tool_log`, if any (tool-using operators call this)."""
    log = _LOG.get()
    if log is not None:
        log.add(call)
