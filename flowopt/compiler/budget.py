"""The compile budget: limits (:class:`Budget`) and live accounting of what the LMs really did.

Accounting hooks into DSPy itself, so it sees every LM call made by any module, thread or stage:

* a DSPy callback (``on_lm_start``/``on_lm_end``) refuses a call *before* it is sent once a limit is
  reached, and counts every call that returned;
* a usage tracker (``settings.usage_tracker``), which DSPy feeds only for calls that were not
  answered from its cache, counts real calls and their tokens;
* a history recorder (DSPy appends every call's history entry to each calling module) reads the cost.

Cache hits are the calls that returned minus the real ones: they are free and counted apart.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from flowopt.compiler.dspy_hooks import BudgetCallback, HistoryRecorder, UsageForwarder
from flowopt.errors import BudgetExhausted
from flowopt.settings import at_least, check_stage

LIMITS = ("max_lm_calls", "max_tokens", "max_cost_usd", "max_wall_s")


INTERRUPTED = "interrupted"  # the pseudo-limit a stop request (SIGINT, SIGTERM) reads as


@dataclass(frozen=True)
class Budget:
    """Limits shared by every stage of one ``compile()`` call; ``None`` means unlimited.

    ``max_lm_calls`` and ``max_tokens`` are whole numbers; ``max_cost_usd`` (dollars) and
    ``max_wall_s`` (seconds) any finite number >= 0.

    Example:
        >>> from flowopt import Budget
        >>> Budget(max_lm_calls=500, max_wall_s=600).limits()
        {'max_lm_calls': 500, 'max_wall_s': 600}
    """

    max_lm_calls: int | None = None
    max_tokens: int | None = None
    max_cost_usd: float | None = None
    max_wall_s: float | None = None

    def __post_init__(self) -> None:
        check_stage(self, {name: at_least(0) for name in LIMITS})  # NaN and infinity are refused too

    def limits(self) -> dict[str, float]:
        return {k: v for k, v in asdict(self).items() if v is not None}


class BudgetStop(BaseException):
    """Raised inside an LM call that the budget refuses.

    DSPy's callback runner swallows ``Exception``s raised by callbacks, so the refusal has to be a
    ``BaseException`` to abort the call before anything is sent. Code that runs programs converts it
    back into :class:`~flowopt.errors.BudgetExhausted` with :meth:`BudgetTracker.guard`;
    ``StageContext.evaluate`` does so already.
    """

    def __init__(self, error: BudgetExhausted) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass
class Usage:
    """What the LMs did: real (billed) calls, cache hits, tokens, dollars and wall time."""

    lm_calls: int = 0
    cache_hits: int = 0
    tokens: int = 0
    cost_usd: float = 0.0
    wall_s: float = 0.0

    def minus(self, other: Usage) -> Usage:
        return Usage(self.lm_calls - other.lm_calls, self.cache_hits - other.cache_hits,
                     self.tokens - other.tokens, round(self.cost_usd - other.cost_usd, 10),
                     self.wall_s - other.wall_s)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["cost_usd"] = round(self.cost_usd, 10)
        data["wall_s"] = round(self.wall_s, 3)
        return data


class BudgetTracker:
    """Counts LM usage while active and enforces a :class:`Budget` at every LM call.

    ``check()`` raises :class:`~flowopt.errors.BudgetExhausted` when a limit is reached;
    ``exhausted()`` returns the name of that limit (or ``None``); ``usage()`` is a dict of the counts.

    Example:
        >>> import dspy
        >>> from flowopt.compiler import Budget, BudgetTracker
        >>> from flowopt.testing import scripted_lm
        >>> tracker = BudgetTracker(Budget(max_lm_calls=1))
        >>> lm = scripted_lm(lambda req: {"answer": "4"}, cache=False)
        >>> with tracker.activate(), tracker.guard(), dspy.context(lm=lm):
        ...     _ = dspy.Predict("question -> answer")(question="2+2?")
        >>> tracker.exhausted()
        'max_lm_calls'
    """

    def __init__(self, budget: Budget | None = None) -> None:
        self.budget = budget or Budget()
        self._lock = threading.Lock()
        self._calls = 0
        self._returned = 0  # calls that returned without error, cached or not
        self._tokens = 0
        self._cost = 0.0
        self._in_flight = 0
        self._started = time.monotonic()
        self._callback: Any = None
        self._stop_reason: str | None = None

    # ------------------------------------------------------------------ public
    def usage(self) -> dict[str, Any]:
        return self.snapshot().to_dict()

    def snapshot(self) -> Usage:
        with self._lock:
            hits = max(0, self._returned - self._calls)
            return Usage(self._calls, hits, self._tokens, self._cost, time.monotonic() - self._started)

    def exhausted(self) -> str | None:
        """The name of the first limit reached, or ``None``."""
        with self._lock:
            return self._exhausted_locked(pending=0)

    def check(self) -> None:
        """Raise :class:`~flowopt.errors.BudgetExhausted` if any limit is reached."""
        with self._lock:
            limit = self._exhausted_locked(pending=0)
            if limit is not None:
                raise self._error(limit, pending=0)

    def request_stop(self, reason: str) -> None:
        """Refuse every later LM call as a reached limit named ``"interrupted"``, so stages stop at their next
        LM call as they do on an exhausted budget (their checkpoints written). Takes no lock: a signal
        handler calls it, possibly while this thread holds the tracker's lock."""
        self._stop_reason = reason

    @property
    def stop_reason(self) -> str | None:
        """Why :meth:`request_stop` was called (e.g. ``"SIGTERM"``), or ``None``."""
        return self._stop_reason

    def remaining_calls(self) -> int | None:
        if self.budget.max_lm_calls is None:
            return None
        with self._lock:
            return max(0, int(self.budget.max_lm_calls) - self._calls - self._in_flight)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Turn an LM call refused by the budget into :class:`~flowopt.errors.BudgetExhausted`."""
        try:
            yield
        except BudgetStop as stop:
            raise stop.error from None

    @contextlib.contextmanager
    def activate(self) -> Iterator[BudgetTracker]:
        """Install the accounting hooks into ``dspy.context`` for the duration of the block.

        Work started in threads inherits them as long as the threads copy the caller's context
        (``contextvars.copy_context()``, ``flowopt.concurrency.map_in_context``, DSPy's executor).
        """
        import dspy

        settings = dspy.settings
        callback = BudgetCallback(self)
        previous = list(settings.get("callbacks", None) or [])
        recorder = HistoryRecorder(self)
        callers = [recorder, *(settings.get("caller_modules", None) or [])]
        with dspy.context(callbacks=[*previous, callback],
                          usage_tracker=UsageForwarder(self, settings.get("usage_tracker", None)),
                          caller_modules=callers, disable_history=False):
            yield self

    # ------------------------------------------------------------------ hooks (called by DSPy)
    def before_call(self) -> None:
        """An LM call is about to be sent: refuse it (:class:`BudgetStop`) when a limit is reached."""
        with self._lock:
            limit = self._exhausted_locked(pending=self._in_flight)
            if limit is not None:
                raise BudgetStop(self._error(limit, pending=self._in_flight))
            self._in_flight += 1

    def after_call(self, ok: bool) -> None:
        """An LM call returned (``ok``) or failed."""
        with self._lock:
            self._in_flight = max(0, self._in_flight - 1)
            if ok:
                self._returned += 1

    def add_real(self, usage: dict[str, Any]) -> None:
        """A call that reached the model (not DSPy's cache), with its token usage."""
        tokens = usage.get("total_tokens")
        if not isinstance(tokens, int | float):
            tokens = (usage.get("prompt_tokens") or 0) + (usage.get("completion_tokens") or 0)
        with self._lock:
            self._calls += 1
            self._tokens += int(tokens or 0)

    def add_cost(self, cost: float) -> None:
        """The dollar cost of a real call."""
        with self._lock:
            self._cost += float(cost)

    # ------------------------------------------------------------------ internals
    def _exhausted_locked(self, *, pending: int) -> str | None:
        b = self.budget
        if self._stop_reason is not None:
            return INTERRUPTED
        if b.max_lm_calls is not None and self._calls + pending >= b.max_lm_calls:
            return "max_lm_calls"
        if b.max_tokens is not None and self._tokens >= b.max_tokens:
            return "max_tokens"
        if b.max_cost_usd is not None and self._cost >= b.max_cost_usd:
            return "max_cost_usd"
        if b.max_wall_s is not None and time.monotonic() - self._started >= b.max_wall_s:
            return "max_wall_s"
        return None

    def _error(self, limit: str, *, pending: int) -> BudgetExhausted:
        if limit == INTERRUPTED:
            return BudgetExhausted(INTERRUPTED, used=self._calls + pending, allowed=self._calls + pending)
        used = {"max_lm_calls": self._calls + pending, "max_tokens": self._tokens, "max_cost_usd": self._cost,
                "max_wall_s": time.monotonic() - self._started}[limit]
        return BudgetExhausted(limit, used=used, allowed=getattr(self.budget, limit))
