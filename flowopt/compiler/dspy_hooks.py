"""The three DSPy hooks behind :class:`~flowopt.compiler.budget.BudgetTracker` (see its module doc)."""

from __future__ import annotations

import copy
from typing import Any, Protocol

from dspy.utils.callback import BaseCallback


class CallCounter(Protocol):
    """What the hooks report to (:class:`~flowopt.compiler.budget.CallCounter`)."""

    def before_call(self) -> None: ...

    def after_call(self, ok: bool) -> None: ...

    def add_real(self, usage: dict[str, Any]) -> None: ...

    def add_cost(self, cost: float) -> None: ...


class BudgetCallback(BaseCallback):
    """Refuses LM calls once a limit is reached; counts calls that returned."""

    def __init__(self, tracker: CallCounter) -> None:
        self.tracker = tracker

    def on_lm_start(self, call_id: str, instance: Any, inputs: dict[str, Any]) -> None:
        self.tracker.before_call()  # raises BudgetStop, which DSPy's callback runner lets through

    def on_lm_end(self, call_id: str, outputs: Any, exception: Exception | None = None) -> None:
        self.tracker.after_call(ok=exception is None)


class UsageForwarder:
    """A DSPy usage tracker: DSPy calls ``add_usage`` only for calls that reached the model.

    Forwards to the tracker that was active before (e.g. the user's ``dspy.track_usage()``).
    """

    def __init__(self, tracker: CallCounter, inner: Any = None) -> None:
        self.tracker = tracker
        self.inner = inner

    def add_usage(self, lm: str, usage_entry: dict[str, Any]) -> None:
        self.tracker.add_real(dict(usage_entry or {}))
        if self.inner is not None:
            self.inner.add_usage(lm, usage_entry)

    def __deepcopy__(self, memo: dict[int, Any]) -> UsageForwarder:
        # DSPy's ParallelExecutor deep-copies the usage tracker for each thread. The budget tracker
        # holds a lock (which cannot be copied) and must stay the one shared count: copy only the
        # user's own tracker, as DSPy intends.
        return UsageForwarder(self.tracker, copy.deepcopy(self.inner, memo))

    def get_total_tokens(self) -> dict[str, Any]:
        return self.inner.get_total_tokens() if self.inner is not None else {}


class _CostList(list):
    """Looks like a module's ``history`` list to DSPy; keeps nothing, reads the cost of real calls."""

    def __init__(self, tracker: CallCounter) -> None:
        super().__init__()
        self.tracker = tracker

    def append(self, entry: Any) -> None:
        # Cache hits keep the original call's cost in their entry but have empty usage: skip them.
        if isinstance(entry, dict) and entry.get("usage") and entry.get("cost"):
            self.tracker.add_cost(entry["cost"])


class HistoryRecorder:
    """Placed first in ``settings.caller_modules`` so that DSPy hands it every history entry."""

    def __init__(self, tracker: CallCounter) -> None:
        self.history = _CostList(tracker)
