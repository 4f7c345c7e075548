"""The lockstep batching policy of GRPO rollouts: concurrent blocking calls served as one round.

Each thread of a DSPy program makes its own blocking LM call. Evaluation threads meet in the LocalLM's
continuous batch (:mod:`flowopt.lm.continuous`: rows join and leave a running batch). GRPO rollouts
need more: B x G copies of a program run at once, and a seeded step must repeat bit for bit, so
:class:`LockstepBatcher` runs a round when every rollout still running is waiting (however late one
is), sorted by rollout, on the thread that called ``serve``; only calls from unknown threads are served
after a timeout. Each caller gets its own result or the round's exception (:func:`_deliver`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


def _deliver(run: Callable[[list[Any]], Sequence[Any]], jobs: Sequence[Any]) -> BaseException | None:
    """Run ``jobs`` (each with ``item`` and ``future``) as one batch; every caller gets its own result, or
    the batch's exception (returned too). The serving thread lives on either way."""
    try:
        results = list(run([job.item for job in jobs]))
        if len(results) != len(jobs):
            raise RuntimeError(f"run_batch returned {len(results)} results for {len(jobs)} items")
    except BaseException as exc:
        logger.debug("batch of %d failed: %r", len(jobs), exc)
        for job in jobs:
            job.future.set_exception(exc)
        return exc
    for job, result in zip(jobs, results):
        job.future.set_result(result)
    return None


_UNKNOWN = 1 << 30  # a call from an unknown thread sorts after every rollout's (key (_UNKNOWN, arrival))


@dataclass(order=True)
class _Slot:
    key: tuple[int, int]
    item: Any = field(compare=False)
    # Each caller waits on its own future: with one shared condition every arrival would wake every
    # earlier caller (B x G threads, quadratic wake-ups fighting for the GIL).
    future: Future = field(default_factory=Future, compare=False)

    @property
    def unknown(self) -> bool:
        return self.key[0] == _UNKNOWN


class LockstepBatcher(Generic[T, R]):
    """Serve ``submit(key, item)`` calls from ``live`` rollout threads with ``run_batch(items) -> results``.

    Rollout threads call :meth:`submit` (blocking) with their rollout's ``key`` and :meth:`finished`
    once when they end (also when they fail); one thread calls :meth:`serve`, which runs every batch
    and returns when every rollout has finished. All model work happens on the serving thread (many
    threads touching torch each start their own OpenMP pool, which on a small CPU costs more than the work).

    A batch runs when every live rollout waits (has a call pending), its rows sorted by ``key``, so its
    composition and order depend only on what the program does, never on thread timing, and a seeded
    run repeats (the seeded stream's draws are shared out over the batch's rows). A rollout that is
    late (a loaded machine, slow non-LM work) is waited for, however long; one that ends without a call
    frees the others through :meth:`finished`. A rollout whose program calls from several threads at once
    (a Workflow's parallel nodes, which carry the rollout's key) counts as waiting once one of its calls
    is pending; its other calls join that batch only if they arrived in time, so such programs are
    reproducible only as far as their own threads are.

    Calls with ``key=None`` (a thread the batcher cannot attribute to a rollout, e.g. one a program
    started without copying its context) could otherwise dead-lock a rollout waiting on them: once
    no call has arrived and no rollout has finished for ``timeout_s``, the waiting unknown calls run
    as a batch of their own (known rollouts' calls keep waiting for their full batch).

    A rollout that never calls nor ends (a hung program) cannot be cut out: the step needs its result
    and Python cannot stop a thread. Instead of hanging silently, the batcher logs a warning after
    ``warn_after_s`` without progress (and again after every further ``warn_after_s``) naming how
    many rollouts it waits for. :meth:`submit` from the serving thread (a call made inside ``run_batch``)
    or after :meth:`serve` has returned raises ``RuntimeError`` instead of blocking forever.

    Example:
        >>> import threading
        >>> batcher = LockstepBatcher(lambda xs: [x * 2 for x in xs], live=1)
        >>> out = []
        >>> worker = threading.Thread(target=lambda: (out.append(batcher.submit((0, 0), 21)), batcher.finished()))
        >>> worker.start(); batcher.serve(); worker.join(); out
        [42]
    """

    def __init__(self, run_batch: Callable[[list[T]], Sequence[R]], *, live: int, max_batch_size: int = 1024,
                 timeout_s: float = 0.5, warn_after_s: float = 60.0) -> None:
        if live < 0:
            raise ValueError(f"live must be >= 0, got {live}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if not timeout_s > 0 or not warn_after_s > 0:
            raise ValueError(f"timeout_s and warn_after_s must be > 0, got {timeout_s} and {warn_after_s}")
        self._run_batch = run_batch
        self._live = live
        self._max = max_batch_size
        self._timeout = timeout_s
        self._warn_after = warn_after_s
        self._pending: list[_Slot] = []
        self._cond = threading.Condition()
        self._counter = 0
        self._last_event = time.monotonic()  # the last call, finish or batch: the clock of timeouts and warnings
        self._server: int | None = None  # ident of the thread in serve()
        self._closed = False
        self.batch_sizes: list[int] = []
        self.errors: list[BaseException] = []  # failures of run_batch (the model's, not the program's)

    def submit(self, key: tuple[int, int] | None, item: T) -> R:
        """Run ``item`` in the batch of the current round and return its result (blocks the caller)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("LockstepBatcher.submit after serve() returned: a thread outlived its rollout")
            if self._server == threading.get_ident():
                raise RuntimeError("LockstepBatcher.submit from the serving thread (inside run_batch) would "
                                   "wait on itself")
            if key is None:  # unknown caller: order after the known ones, by arrival
                self._counter += 1
                key = (_UNKNOWN, self._counter)
            slot = _Slot(key, item)
            self._pending.append(slot)
            self._last_event = time.monotonic()
            self._cond.notify()  # only the serving thread waits on the condition
        return slot.future.result()

    def finished(self) -> None:
        """One rollout thread ended; a batch may now be complete."""
        with self._cond:
            self._live -= 1
            self._last_event = time.monotonic()
            self._cond.notify()

    def serve(self) -> None:
        """Run batches on this thread until every rollout has finished."""
        with self._cond:
            self._server = threading.get_ident()
        try:
            while (calls := self._next_round()) is not None:
                for start in range(0, len(calls), self._max):  # cut at max_batch_size, in key order
                    batch = calls[start:start + self._max]
                    self.batch_sizes.append(len(batch))
                    error = _deliver(self._run_batch, batch)
                    if error is not None:
                        self.errors.append(error)
                with self._cond:
                    self._last_event = time.monotonic()
        finally:
            with self._cond:
                self._closed, self._server = True, None
                left, self._pending = self._pending, []
            for slot in left:  # only when serve() itself was interrupted (e.g. KeyboardInterrupt)
                slot.future.set_exception(RuntimeError("LockstepBatcher stopped serving before this call ran"))

    def _next_round(self) -> list[_Slot] | None:
        """The calls to run next, sorted: every pending call once each live rollout waits, or the unknown
        threads' calls after ``timeout_s`` without progress; None when every rollout has finished."""
        with self._cond:
            warnings = 0
            while True:
                if not self._pending and self._live <= 0:
                    return None
                waiting = {slot.key for slot in self._pending if not slot.unknown}
                if self._pending and len(waiting) >= self._live:
                    return self._take(self._pending)
                quiet = time.monotonic() - self._last_event
                unknown = [slot for slot in self._pending if slot.unknown]
                if unknown and quiet >= self._timeout:
                    return self._take(unknown)
                if quiet < self._warn_after:
                    warnings = 0
                elif quiet >= self._warn_after * (warnings + 1):
                    warnings += 1
                    logger.warning(
                        "GRPO rollouts: %d of %d running rollouts wait for the model and %d have neither called "
                        "it nor finished for %.0f s (a slow or hung program?); the batch waits for them so that "
                        "a seeded run repeats", len(waiting), self._live, self._live - len(waiting), quiet)
                wake = self._last_event + self._warn_after * (warnings + 1)
                if unknown:
                    wake = min(wake, self._last_event + self._timeout)
                self._cond.wait(timeout=max(wake - time.monotonic(), 0.001))

    def _take(self, slots: list[_Slot]) -> list[_Slot]:
        taken = sorted(slots)
        chosen = {id(slot) for slot in taken}
        self._pending = [slot for slot in self._pending if id(slot) not in chosen]
        return taken
