"""``StageContext``: everything a stage gets besides the program it improves."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowopt.compiler.budget import BudgetTracker
from flowopt.compiler.evaluate import EvalResult, Evaluator
from flowopt.io import atomic_write_json

logger = logging.getLogger("flowopt.compiler")


@dataclass
class StageOutcome:
    """What a stage says about its own run, typed: the compiler puts it in the stage's report row.

    ``candidates_tried``: programs the stage scored (the report's "candidates" column);
    ``stop_reason``: why it stopped (``"done"`` when unset; ``"budget: max_lm_calls"`` when the budget
    stopped it); ``best_candidate``: the number of the candidate it returned, for stages that number them.

    Example:
        >>> StageOutcome(candidates_tried=3, stop_reason="budget: max_lm_calls").stop_reason
        'budget: max_lm_calls'
    """

    candidates_tried: int | None = None
    stop_reason: str | None = None
    best_candidate: int | None = None


#: The facts ``StageContext.record`` routes into :class:`StageOutcome` instead of ``info``.
OUTCOME_FIELDS = ("candidates_tried", "stop_reason", "best_candidate")


@dataclass
class StageContext:
    """The shared compile state handed to :meth:`Stage.run`.

    ``budget`` is shared by all stages; ``rng`` is seeded per stage from ``seed``; ``run_dir`` is the
    stage's own folder (``None`` when compiling without a run folder); ``resume`` says whether the
    stage should pick up its checkpoints. ``shared`` is an in-process dict that stages may use to
    hand artefacts to later stages (e.g. the bootstrapped demo pool); it is not persisted. A stage
    says how its run went in ``outcome`` (a :class:`StageOutcome`) and adds any other JSON-able facts
    to ``info`` (:meth:`record`); both go into its report row.

    Example:
        >>> import random
        >>> from flowopt.compiler import BudgetTracker, StageContext
        >>> ctx = StageContext(trainset=[], valset=[], metric=lambda ex, pred, trace=None: 1.0,
        ...                    budget=BudgetTracker(), seed=0, rng=random.Random(0))
        >>> ctx.record(candidates_tried=3, pruned=1)
        >>> ctx.outcome.candidates_tried, ctx.info
        (3, {'pruned': 1})
    """

    trainset: list[Any]
    valset: list[Any]
    metric: Callable[..., Any]
    budget: BudgetTracker
    seed: int
    rng: random.Random
    run_dir: Path | None = None
    resume: bool = False
    logger: logging.Logger = logger
    quiet: bool = True
    num_threads: int = 8
    stage_name: str = ""
    shared: dict[str, Any] = field(default_factory=dict)
    evaluator: Evaluator | None = None
    info: dict[str, Any] = field(default_factory=dict)
    outcome: StageOutcome = field(default_factory=StageOutcome)

    def __post_init__(self) -> None:
        if self.evaluator is None:
            self.evaluator = Evaluator(self.metric, num_threads=self.num_threads, quiet=self.quiet)

    def evaluate(self, program: Any, examples: Sequence[Any], *, desc: str | None = None,
                 max_errors: int | None = None) -> EvalResult:
        """Score ``program`` on ``examples`` in parallel (memoised); raises ``BudgetExhausted``."""
        assert self.evaluator is not None
        with self.budget.guard():
            return self.evaluator.evaluate(program, examples, desc=desc, max_errors=max_errors)

    def evaluate_many(self, jobs: Sequence[tuple[Any, Sequence[Any]]], *, desc: str | None = None,
                      max_errors: int | None = None) -> list[EvalResult]:
        """Score several ``(program, examples)`` pairs on one shared thread pool (memoised); raises
        ``BudgetExhausted``."""
        assert self.evaluator is not None
        with self.budget.guard():
            return self.evaluator.evaluate_many(jobs, desc=desc, max_errors=max_errors)

    def record(self, **info: Any) -> None:
        """Add JSON-able facts to this stage's report entry; ``candidates_tried``, ``stop_reason`` and
        ``best_candidate`` set the typed :attr:`outcome`, the rest go to :attr:`info`."""
        for name in OUTCOME_FIELDS:
            if name in info:
                setattr(self.outcome, name, info.pop(name))
        self.info.update(info)

    def save_checkpoint(self, name: str, data: dict[str, Any]) -> None:
        """Write ``run_dir/<name>.json`` atomically; a no-op without a run folder."""
        if self.run_dir is None:
            return
        atomic_write_json(self.run_dir / f"{_safe(name)}.json", data)

    def load_checkpoint(self, name: str) -> dict[str, Any] | None:
        """The data saved under ``name`` if resuming and it exists, else ``None``."""
        if self.run_dir is None or not self.resume:
            return None
        path = self.run_dir / f"{_safe(name)}.json"
        if not path.exists():
            return None
        import json

        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            self.logger.warning("ignoring unreadable checkpoint %s: %s", path, err)
            return None

    def progress(self, total: int | None = None, desc: str | None = None, **kwargs: Any) -> Any:
        """A tqdm progress bar that respects ``quiet``."""
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc or self.stage_name, disable=self.quiet, leave=False, **kwargs)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
