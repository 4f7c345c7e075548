"""A batcher for rollouts that move in lockstep: a batch runs once every live rollout is waiting.

GRPO runs B x G copies of the same program at once, each in its own thread. Each copy blocks in its
LM call; the batcher holds the calls until every rollout still running is either waiting here or
finished, then the serving thread (the one that called :meth:`LockstepBatcher.serve`, always the
same) runs them as one batched generation. Batches are thus as large as the program allows, their
composition (sorted by rollout index) does not depend on thread timing, so a seeded run repeats, and
all model work happens on one thread (many threads touching torch each start their own OpenMP pool,
which on a small CPU costs more than the work). A short timeout serves whatever waits, so LM calls
from threads the batcher does not know about never dead-lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


@dataclass(order=True)
class _Slot:
    key: tuple[int, int]
    item: Any = field(compare=False)
    # Each caller waits on its own event: with one shared condition every arrival would wake every
    # earlier caller (B x G threads, quadratic wake-ups fighting for the GIL).
    done: threading.Event = field(default_factory=threading.Event, compare=False)
    result: Any = field(default=None, compare=False)
    error: BaseException | None = field(default=None, compare=False)


class LockstepBatcher(Generic[T, R]):
    """Serve ``submit(key, item)`` calls from ``live`` threads with ``run_batch(items) -> results``.

    Rollout threads call :meth:`submit` (blocking) and :meth:`finished` when they end; one thread
    calls :meth:`serve`, which returns when every rollout has finished.

    Example:
        >>> import threading
        >>> batcher = LockstepBatcher(lambda xs: [x * 2 for x in xs], live=1)
        >>> out = []
        >>> worker = threading.Thread(target=lambda: (out.append(batcher.submit((0, 0), 21)), batcher.finished()))
        >>> worker.start(); batcher.serve(); worker.join(); out
        [42]
    """

    def __init__(self, run_batch: Callable[[list[T]], Sequence[R]], *, live: int, max_batch_size: int = 1024,
                 timeout_s: float = 0.5) -> None:
        self._run_batch = run_batch
        self._live = live
        self._max = max_batch_size
        self._timeout = timeout_s
        self._pending: list[_Slot] = []
        self._cond = threading.Condition()
        self._counter = 0
        self._drain = False  # calls left over from a batch cut at max_batch_size: serve them next
        self.batch_sizes: list[int] = []

    def submit(self, key: tuple[int, int] | None, item: T) -> R:
        with self._cond:
            if key is None:  # unknown caller: order after the known ones, by arrival
                self._counter += 1
                key = (1 << 30, self._counter)
            slot = _Slot(key, item)
            self._pending.append(slot)
            self._cond.notify()  # only the serving thread waits on the condition
        slot.done.wait()
        if slot.error is not None:
            raise slot.error
        return slot.result

    def finished(self) -> None:
        """One rollout thread ended; a batch may now be complete."""
        with self._cond:
            self._live -= 1
            self._cond.notify()

    def serve(self) -> None:
        """Run batches on this thread until every rollout has finished."""
        while True:
            with self._cond:
                while not (self._pending and (self._drain or len(self._pending) >= self._live)) and self._live > 0:
                    if not self._cond.wait(timeout=self._timeout) and self._pending:
                        break  # nobody else came in time: serve what waits
                if not self._pending:
                    if self._live <= 0:
                        return
                    continue
                batch = sorted(self._pending)[: self._max]
                taken = {id(s) for s in batch}
                self._pending = [s for s in self._pending if id(s) not in taken]
                self._drain = bool(self._pending)
            self.batch_sizes.append(len(batch))
            try:
                results = list(self._run_batch([s.item for s in batch]))
                if len(results) != len(batch):
                    raise RuntimeError(f"run_batch returned {len(results)} results for {len(batch)} items")
                for slot, result in zip(batch, results):
                    slot.result = result
            except Exception as err:
                for slot in batch:
                    slot.error = err
            for slot in batch:
                slot.done.set()
