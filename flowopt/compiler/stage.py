"""The stage interface: one object, one method, settings in a frozen dataclass.

A stage improves a program: ``run(program, ctx)`` gets the best program so far (a private copy it may
change) and returns a program. Settings are the fields of a frozen dataclass, checked in
``__post_init__`` by :func:`~flowopt.settings.check_stage`: the types come from the annotations, the
bounds are declared beside them, and a bad value raises :class:`~flowopt.errors.ConfigError` naming
the setting and the fix. The simplest way is to make the stage class itself that dataclass::

    @dataclass(frozen=True)
    class MyStage(Stage):
        # What it does, and an example (the class docstring).

        name: ClassVar[str] = "mine"
        rounds: int = 3  # each setting documented where it is declared

        def __post_init__(self) -> None:
            check_stage(self, {"rounds": at_least(1)})   # rounds=0 or rounds=2.5: a ConfigError

        def run(self, program: dspy.Module, ctx: StageContext) -> dspy.Module:
            ...
            ctx.outcome.candidates_tried = 3
            return program

A stage says how its run went in ``ctx.outcome`` (a :class:`~flowopt.compiler.context.StageOutcome`:
``candidates_tried``, ``stop_reason``, ``best_candidate``) and records other JSON-able facts with
``ctx.record(...)``; both go into its report row. A stage that hits the budget catches
:class:`~flowopt.errors.BudgetExhausted`, returns its best program so far and sets
``ctx.outcome.stop_reason = "budget: max_lm_calls"``. ``flowopt.testing.check_stage_contract`` checks
a stage against this contract.

A stage that shares its work among launched processes (``accelerate launch``, ``torchrun``) says so
with ``multi_process = True``; compile refuses the others there, since every process would repeat them.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import dspy

    from flowopt.compiler.context import StageContext


class Stage(abc.ABC):
    """Base class of compile stages (``demos``, ``search``, ``structure``, ``finetune``...).

    Example:
        >>> from dataclasses import dataclass
        >>> from typing import ClassVar
        >>> from flowopt.compiler import Stage
        >>> @dataclass(frozen=True)
        ... class Identity(Stage):
        ...     name: ClassVar[str] = "identity"
        ...     def run(self, program, ctx):
        ...         return program
        >>> Identity().settings()
        {}
    """

    name: ClassVar[str] = ""
    multi_process: ClassVar[bool] = False  # splits its work among launched processes (the weights stages)
    # Settings that trade time for memory without changing what the stage computes (a weights stage's
    # micro-batch size): a resumed run may change them, e.g. after running out of memory.
    memory_settings: ClassVar[tuple[str, ...]] = ()

    @abc.abstractmethod
    def run(self, program: dspy.Module, ctx: StageContext) -> dspy.Module:
        """Return an improved program (may modify and return ``program``, which is a private copy)."""

    def scores_its_start(self) -> bool:
        """Whether this stage, run first, scores the program it starts from on the whole valset itself
        and leaves those scores in ``ctx.evaluator``; the compiler then scores the baseline after the
        stage, from that memo. A search shared by workers does: the worker that scores the incumbent
        shares the scores through the study, so no worker scores the baseline on its own."""
        return False

    def settings(self) -> dict[str, Any]:
        """The stage's settings as JSON-able data (dataclass fields), recorded in the report and
        compared on resume."""
        if dataclasses.is_dataclass(self):
            out = {}
            for f in dataclasses.fields(self):
                value = getattr(self, f.name)
                out[f.name] = _jsonable(value)
            return out
        return {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.settings().items())
        return f"{type(self).__name__}({args})"


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # e.g. LoraSettings: every field counts
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    model = getattr(value, "model", None)  # an LM: its name is its identity here
    if isinstance(model, str):
        return {"lm": model}
    return type(value).__name__
