"""A thread-safe dynamic batcher: concurrent callers are collected briefly and served by one batch call.

DSPy evaluates with threads, and each thread makes its own blocking LM call. Running those calls one by
one leaves a local model mostly idle (one token per weight read); running them as one padded batch
reuses each weight read for every caller. The batcher sits between the two: ``submit`` blocks the
calling thread while one worker thread gathers whatever arrived within ``wait_ms`` (or until
``max_batch_size``), calls ``run_batch`` once, and hands each caller its own result or exception.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class _Job(Generic[T, R]):
    item: T
    group: Hashable
    future: Future = field(default_factory=Future)


class DynamicBatcher(Generic[T, R]):
    """Collect concurrent ``submit`` calls into batches for ``run_batch(group, items) -> results``.

    Items of different ``group`` keys (e.g. different LoRA adapters) are never mixed in one batch.
    ``run_batch`` must return one result per item, in order; if it raises, every caller of that batch
    gets the exception.

    Example:
        >>> batcher = DynamicBatcher(lambda group, xs: [x * 2 for x in xs], wait_ms=1)
        >>> batcher.submit(21)
        42
        >>> batcher.close()
    """

    def __init__(self, run_batch: Callable[[Any, list[T]], Sequence[R]], *, max_batch_size: int = 16,
                 wait_ms: float = 10.0, name: str = "flowopt-batcher") -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if wait_ms < 0:
            raise ValueError(f"wait_ms must be >= 0, got {wait_ms}")
        self._run_batch = run_batch
        self.max_batch_size = max_batch_size
        self.wait_s = wait_ms / 1000.0
        self._name = name
        self._queue: queue.Queue[_Job[T, R] | None] = queue.Queue()
        self._pending: list[_Job[T, R]] = []  # taken from the queue but left for a later batch (other group)
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self._closed = False
        self.batch_sizes: list[int] = []  # sizes of the batches run so far (for tests and benchmarks)

    def submit(self, item: T, group: Hashable = None) -> R:
        """Run ``item`` in the next batch of its group and return its result (blocks the caller)."""
        return self.submit_async(item, group).result()

    def submit_async(self, item: T, group: Hashable = None) -> Future:
        """Queue ``item``; the returned future resolves to its result."""
        job: _Job[T, R] = _Job(item, group)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name} is closed")
            if self._worker is None or not self._worker.is_alive():
                # Started lazily so that an unused LocalLM costs no thread.
                self._worker = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._worker.start()
            self._queue.put(job)
        return job.future

    def close(self) -> None:
        """Stop the worker after the queued jobs are served."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            worker = self._worker
            self._queue.put(None)
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout=60)

    # -- worker ------------------------------------------------------------------------------------

    def _next_batch(self) -> list[_Job[T, R]] | None:
        """Block for a first job, then gather same-group jobs until the wait elapses or the batch is full."""
        first = self._pending.pop(0) if self._pending else self._queue.get()
        if first is None:
            return None
        batch = [first]
        keep = []
        for job in self._pending:
            if job.group == first.group and len(batch) < self.max_batch_size:
                batch.append(job)
            else:
                keep.append(job)
        self._pending = keep
        deadline = time.monotonic() + self.wait_s
        while len(batch) < self.max_batch_size:
            timeout = deadline - time.monotonic()
            try:
                item = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:  # close() while collecting: serve this batch, then stop
                self._queue.put(None)
                break
            if item.group == first.group:
                batch.append(item)
            else:
                self._pending.append(item)
        return batch

    def _loop(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                for job in self._pending:
                    job.future.set_exception(RuntimeError(f"{self._name} closed before serving the request"))
                return
            self.batch_sizes.append(len(batch))
            try:
                results = list(self._run_batch(batch[0].group, [job.item for job in batch]))
                if len(results) != len(batch):
                    raise RuntimeError(f"run_batch returned {len(results)} results for {len(batch)} items")
            except BaseException as exc:  # every caller of the batch sees the failure, the worker lives on
                logger.debug("batch of %d failed: %r", len(batch), exc)
                for job in batch:
                    job.future.set_exception(exc)
                continue
            for job, result in zip(batch, results):
                job.future.set_result(result)

    def __repr__(self) -> str:
        return f"DynamicBatcher(max_batch_size={self.max_batch_size}, wait_ms={self.wait_s * 1000:g})"
