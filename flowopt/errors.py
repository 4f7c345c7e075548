"""flowopt's exceptions: one base class, messages that name the problem and the fix.

Every error a user can cause (bad IR, bad settings, bad data, an exhausted budget) is a
:class:`FlowoptError`, so ``except flowopt.FlowoptError`` catches all of them.
"""

from __future__ import annotations

from collections.abc import Iterator


class FlowoptError(Exception):
    """Base class of every flowopt error.

    The message always says what is wrong, where (node, field, setting) and how to fix it.

    Example:
        >>> try:
        ...     raise ConfigError("max_rounds must be >= 1, got 0", fix="pass max_rounds=1 or more")
        ... except FlowoptError as err:
        ...     print(err)
        max_rounds must be >= 1, got 0. Fix: pass max_rounds=1 or more
    """

    def __init__(self, problem: str, *, fix: str | None = None) -> None:
        problem, fix = _clip(problem), None if fix is None else _clip(fix)
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem}. Fix: {fix}" if fix else problem)


class WorkflowError(FlowoptError):
    """A workflow graph is invalid: names the node and the field involved."""

    def __init__(self, problem: str, *, node: str | None = None, field: str | None = None,
                 fix: str | None = None) -> None:
        self.node = node
        self.field = field
        where = []
        if node is not None:
            where.append(f"node '{node}'")
        if field is not None:
            where.append(f"field '{field}'")
        prefix = f"{', '.join(where)}: " if where else ""
        super().__init__(f"{prefix}{problem}", fix=fix)


class SchemaError(WorkflowError):
    """A workflow JSON document is malformed or of an unsupported schema version."""


class UnknownOperatorError(WorkflowError):
    """A node names an operator that is not registered."""


class ConfigError(FlowoptError):
    """A setting (stage, budget, operator, LM) has a bad value."""


class DataError(FlowoptError):
    """A dataset, example or benchmark file is missing, malformed or fails its checksum."""


class MetricError(FlowoptError):
    """The user's metric raised or returned something that is not a number."""


class BudgetExhausted(FlowoptError):
    """The shared compile budget ran out; ``limit`` names which one (e.g. ``max_lm_calls``)."""

    def __init__(self, limit: str, *, used: float, allowed: float) -> None:
        self.limit = limit
        self.used = used
        self.allowed = allowed
        super().__init__(
            f"budget exhausted: {limit} used {used:g} of {allowed:g}",
            fix=f"raise Budget({limit}=...) or resume later with resume=True",
        )


class SandboxError(FlowoptError):
    """Generated code failed in, or was stopped by, the Programmer sandbox."""


class DiskFullError(FlowoptError, OSError):
    """A write failed for lack of space (a full disk, a quota, or a file-size limit).

    Raised by flowopt's atomic writers instead of a bare ``OSError``; it is still an ``OSError``. The
    message names the file, the space it needed and what was free; the file's previous version, if
    any, is intact (writes go to a temporary name first).

    Example:
        >>> err = DiskFullError("could not write run/report.json", path="run/report.json", needed=2048)
        >>> isinstance(err, OSError), err.needed
        (True, 2048)
    """

    def __init__(self, problem: str, *, path: str, needed: int | None = None, free: int | None = None,
                 fix: str | None = None) -> None:
        self.path = path
        self.needed = needed
        self.free = free
        super().__init__(problem, fix=fix)


class OutOfMemoryError(FlowoptError):
    """A weights stage ran out of memory (CPU or GPU) for its batch; ``settings`` are the ones to lower.

    Example:
        >>> err = OutOfMemoryError("finetune ran out of memory", settings={"micro_batch_size": 8})
        >>> err.settings
        {'micro_batch_size': 8}
    """

    def __init__(self, problem: str, *, settings: dict[str, object], fix: str | None = None) -> None:
        self.settings = dict(settings)
        super().__init__(problem, fix=fix)


class NonFiniteGradientError(FlowoptError):
    """A weights stage's gradient norm was NaN or infinite on ``steps`` consecutive steps, each skipped.

    The weights are those of the last finite step; ``settings`` are the ones to change.

    Example:
        >>> err = NonFiniteGradientError("grpo: NaN gradient norm 3 times", steps=3, settings={"learning_rate": 5e-5})
        >>> err.steps, err.settings
        (3, {'learning_rate': 5e-05})
    """

    def __init__(self, problem: str, *, steps: int, settings: dict[str, object], fix: str | None = None) -> None:
        self.steps = steps
        self.settings = dict(settings)
        super().__init__(problem, fix=fix)


class Interrupted(FlowoptError):
    """SIGINT or SIGTERM stopped a run at a safe point; ``exit_code`` is the shell's ``128 + signal``.

    Example:
        >>> err = Interrupted("compile stopped by SIGTERM", signal="SIGTERM", number=15)
        >>> err.exit_code
        143
    """

    def __init__(self, problem: str, *, signal: str, number: int, fix: str | None = None) -> None:
        self.signal = signal
        self.exit_code = 128 + number
        super().__init__(problem, fix=fix)


class LMError(FlowoptError):
    """A language model could not be loaded or called."""


MAX_MESSAGE_CHARS = 2000


def _clip(text: str) -> str:
    """Keep a message readable when it quotes a huge value (a 10 MB name, a long repr)."""
    if len(text) <= MAX_MESSAGE_CHARS:
        return text
    return f"{text[:MAX_MESSAGE_CHARS]}... ({len(text) - MAX_MESSAGE_CHARS:,} more characters)"


def exception_chain(err: BaseException, limit: int = 8) -> Iterator[BaseException]:
    """``err`` and what caused it, outermost first (at most ``limit``): libraries wrap the error that says why
    (optuna's ``StorageInternalError`` around SQLAlchemy's, around SQLite's).

    Example:
        >>> try:
        ...     try:
        ...         raise OSError(28, "No space left on device")
        ...     except OSError as inner:
        ...         raise RuntimeError("commit failed") from inner
        ... except RuntimeError as outer:
        ...     [type(e).__name__ for e in exception_chain(outer)]
        ['RuntimeError', 'OSError']
    """
    seen: BaseException | None = err
    for _ in range(limit):
        if seen is None:
            return
        yield seen
        seen = seen.__cause__ or seen.__context__
