"""Continuous batching: concurrent calls join a running batch between decode steps and leave when they end.

Each thread of a DSPy program (or each request of ``flowopt serve``) makes its own blocking call. One
worker thread serves them all with a :class:`~flowopt.lm.decoder.Decoder`: a call that arrives while a
batch is decoding is prefilled and joins it before the next step; a row that ends (EOS, a stop string,
its token limit, a cancel from its ``on_tokens`` callback) leaves at once and frees its slot, so no
caller waits for the batch's longest row. Calls of different ``group`` keys (LoRA adapters) never share
a batch: while another group waits, the running batch admits no more rows, drains, and the next group
runs. When no batch runs, the first call waits ``wait_ms`` for others (a quiet window, each arrival
extending it, at most ``max_wait_factor`` x ``wait_ms``), so callers released together start together.

``on_tokens(ids)`` runs on the worker thread after each step with the row's new token ids (the first
from the prefill); it must be quick and must not call the model. Returning ``False`` cancels the row:
it leaves the batch at once and its call returns what was decoded, with ``finish_reason="cancelled"``.
An exception from it fails that call only, with that exception.

Example:
    >>> batcher = ContinuousBatcher(make_decoder, local.using_adapter, max_batch_size=lambda: 32)  # doctest: +SKIP
    >>> batcher.submit([2, 5, 6], RowSettings(max_new_tokens=8)).result().text  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from flowopt.lm.decode import OnTokens, Row
from flowopt.lm.decoder import Decoder, DecodeRun
from flowopt.lm.settings import RowSettings

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Job:
    row: Row
    group: Hashable
    future: Future = field(default_factory=Future)


class ContinuousBatcher:
    """Serve :meth:`submit` calls from one worker thread, rows joining and leaving a running batch.

    ``make_decoder()`` builds the :class:`~flowopt.lm.decoder.Decoder` on first use; ``apply(group)`` is a
    context manager entered around each step (the LocalLM's lock and adapter); ``max_batch_size()`` gives
    the rows one batch may hold; ``budget()`` the bytes its KV cache may take (None: no limit).
    """

    def __init__(self, make_decoder: Callable[[], Decoder], apply: Callable[[Any], AbstractContextManager[Any]], *,
                 max_batch_size: Callable[[], int], budget: Callable[[], int | None] = lambda: None,
                 wait_ms: float = 10.0, max_wait_factor: float = 10.0, name: str = "flowopt-decode") -> None:
        if wait_ms < 0:
            raise ValueError(f"wait_ms must be >= 0, got {wait_ms}")
        self._make_decoder, self._apply = make_decoder, apply
        self._cap, self._budget = max_batch_size, budget
        self.wait_s = wait_ms / 1000.0
        self.max_wait_s = self.wait_s * max_wait_factor
        self._name = name
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._pending: list[_Job] = []  # taken from the queue, waiting for their group's turn
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self._closed = self._closing = False
        self._decoder: Decoder | None = None

    def submit(self, prompt: list[int], settings: RowSettings, *, group: Hashable = None,
               on_tokens: OnTokens | None = None) -> Future:
        """Queue one completion; the future resolves to its :class:`~flowopt.lm.settings.Sample`."""
        job = _Job(Row(list(prompt), settings, on_tokens=on_tokens), group)
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
        """Stop the worker after the queued calls are served."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            worker = self._worker
            self._queue.put(None)
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout=60)

    # -- worker ------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            if self._pending:
                first: _Job | None = self._pending.pop(0)
            else:
                first = None if self._closing else self._queue.get()
            if first is None:
                return
            waiting = [first, *self._gather(first)]
            if self._decoder is None:
                try:
                    self._decoder = self._make_decoder()
                except BaseException as exc:
                    self._fail(waiting, exc)
                    continue
            self._pending.extend(self._serve(self._decoder, first.group, waiting))

    def _take(self, job: _Job | None, group: Hashable, into: list[_Job]) -> None:
        if job is None:
            self._closing = True
        elif job.group == group:
            into.append(job)
        else:
            self._pending.append(job)

    def _gather(self, first: _Job) -> list[_Job]:
        """Same-group calls already pending, then arrivals until the queue stays quiet for the wait."""
        batch = [job for job in self._pending if job.group == first.group]
        self._pending = [job for job in self._pending if job.group != first.group]
        started = time.monotonic()
        deadline = started + self.wait_s
        while not self._closing and len(batch) + 1 < self._cap():
            timeout = deadline - time.monotonic()
            try:
                job = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            self._take(job, first.group, batch)
            deadline = min(time.monotonic() + self.wait_s, started + self.max_wait_s)
        return batch

    def _arrivals(self, group: Hashable) -> list[_Job]:
        out: list[_Job] = []
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return out
            self._take(job, group, out)

    def _serve(self, decoder: Decoder, group: Hashable, waiting: list[_Job]) -> list[_Job]:
        """Decode ``group``'s rows until none runs and none of its calls waits while it may still join;
        returns the calls left waiting (another group's turn came)."""
        run = DecodeRun()
        jobs: dict[Row, _Job] = {}
        while True:
            waiting += self._arrivals(group)
            others_wait = any(job.group != group for job in self._pending)
            room = max(0, self._cap() - len(run.rows))
            joining = [] if (others_wait and run.rows) else waiting[:room]
            try:
                with self._apply(group):
                    if joining and decoder.admit(run, [job.row for job in joining], budget=self._budget()):
                        jobs.update((job.row, job) for job in joining)
                        waiting = waiting[len(joining):]
                    self._finish(decoder, jobs, decoder.harvest(run))
                    decoder.step(run)
                    self._finish(decoder, jobs, decoder.harvest(run))
            except BaseException as exc:  # the model failed: every row of this batch gets the error
                logger.debug("decode batch of %d failed: %r", len(run.rows), exc)
                self._fail([*jobs.values(), *(job for job in joining if job.row not in jobs)], exc)
                waiting = [job for job in waiting if job not in joining]
                return waiting
            if not run.rows and (not waiting or others_wait):
                return waiting

    def _finish(self, decoder: Decoder, jobs: dict[Row, _Job], rows: list[Row]) -> None:
        for row in rows:
            job = jobs.pop(row)
            if row.error is not None:
                job.future.set_exception(row.error)
            else:
                job.future.set_result(row.sample(decoder.tokenizer, decoder.eos))

    @staticmethod
    def _fail(jobs: list[_Job], exc: BaseException) -> None:
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(exc)

    def __repr__(self) -> str:
        return f"ContinuousBatcher(wait_ms={self.wait_s * 1000:g})"
