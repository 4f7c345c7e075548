"""What the decode loop did: rows per step over time, compile costs, and GPU utilisation where torch reports it.

A scoring run reads :meth:`DecodeStats.summary` (``local.decode_stats.summary()``) to say how full its
batches were; the timeline keeps one sample per ``every_s`` seconds (the rows of the step that crossed
the mark, and ``torch.cuda.utilization()`` on CUDA when the NVML bindings are installed).

Example:
    >>> stats = DecodeStats(every_s=0.0)
    >>> stats.record_step(3); stats.record_step(5); stats.summary()["steps_by_rows"]
    {3: 1, 5: 1}
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from typing import Any


class DecodeStats:
    """Counters of one LocalLM's decode loop (thread-safe; kept small: a counter and bounded deques)."""

    def __init__(self, *, every_s: float = 1.0, cuda: bool = False, keep: int = 4096) -> None:
        self.every_s = every_s
        self.cuda = cuda
        self.steps_by_rows: Counter[int] = Counter()
        self.recent: deque[int] = deque(maxlen=keep)  # rows of the latest steps
        self.timeline: deque[tuple[float, int, int | None]] = deque(maxlen=keep)  # (s, rows, GPU %)
        self.compile_seconds: dict[str, float] = {}
        self.eager_reason: str | None = None  # why the decode step runs eagerly although compiling was asked
        self.decode_path: str | None = None  # which weights decode, when quantizing was asked
        self._began = time.monotonic()
        self._next = 0.0
        self._lock = threading.Lock()

    def record_step(self, rows: int) -> None:
        """One decode step of ``rows`` running rows."""
        with self._lock:
            self.steps_by_rows[rows] += 1
            self.recent.append(rows)
            now = time.monotonic() - self._began
            if now >= self._next:
                self._next = now + self.every_s
                self.timeline.append((round(now, 3), rows, self._gpu_utilisation()))

    def _gpu_utilisation(self) -> int | None:
        if not self.cuda:
            return None
        try:
            import torch

            return int(torch.cuda.utilization())
        except Exception:  # no NVML bindings (pynvml) or no driver query: the figure is unknown, not zero
            self.cuda = False
            return None

    def summary(self) -> dict[str, Any]:
        """JSON data: steps per batch size, mean rows per step, the timeline, compile seconds."""
        with self._lock:
            steps = sum(self.steps_by_rows.values())
            rows = sum(k * v for k, v in self.steps_by_rows.items())
            return {"steps": steps, "mean_rows_per_step": round(rows / steps, 2) if steps else 0.0,
                    "steps_by_rows": dict(sorted(self.steps_by_rows.items())),
                    "timeline": [list(t) for t in self.timeline],
                    "compile_seconds": dict(self.compile_seconds), "eager_reason": self.eager_reason,
                    "decode_path": self.decode_path}
