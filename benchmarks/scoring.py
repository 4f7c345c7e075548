"""Scoring on the report split: the protocol's reference metric and its strict metrics in one pass.

The program runs once per example; every metric of the protocol scores the same prediction. A program
already scored on the same examples (same program JSON, same example ids) is not run again: in the same
run always, across runs with ``--resume`` (the scores are kept in ``<out>/evals/``).

Example:
    >>> paired_change({"scores": [0.0, 0.5, 1.0]}, {"scores": [1.0, 0.5, 1.0]})["mean"]
    0.3333333333333333
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import threading
from pathlib import Path
from typing import Any

from flowopt.compiler.evaluate import EvalResult, Evaluator, example_key, program_key
from flowopt.io import atomic_write_json

from .datasets import Protocol

#: Normal quantile of the paired-difference interval (95%, two-sided).
_Z = 1.959964


class _Recording:
    """The main metric for the Evaluator; the strict metrics' values of each prediction are kept aside."""

    def __init__(self, proto: Protocol) -> None:
        self.main = proto.metric_fn()
        self.others = {name: fn for name, fn in proto.metric_fns().items() if name != proto.metric}
        self.values: dict[str, dict[str, float]] = {}
        self._lock = threading.Lock()

    def __call__(self, example: Any, pred: Any, trace: Any = None) -> float:
        scores = {name: float(fn(example, pred, trace)) for name, fn in self.others.items()}
        with self._lock:
            self.values[example_key(example)] = scores
        return float(self.main(example, pred, trace))


class TestScorer:
    """Scores programs on the report split with every metric of ``proto``; see the module docstring."""

    __test__ = False  # not a pytest class

    def __init__(self, proto: Protocol, out: Path, *, num_threads: int, quiet: bool, resume: bool,
                 seed: int) -> None:
        self.proto, self.folder, self.resume, self.seed = proto, out / "evals", resume, seed
        self.recording = _Recording(proto)
        self.evaluator = Evaluator(self.recording, num_threads=num_threads, quiet=quiet)
        self._seen: dict[str, dict[str, Any]] = {}

    def score(self, program: Any, examples: list[Any], desc: str) -> dict[str, Any]:
        """``score``, ``ci``, ``n``, ``errors`` (examples the program failed on, e.g. unparseable answers,
        scored 0), ``scores`` (per example) and ``strict`` (the other metrics' ``score`` and ``ci``)."""
        key = self._key(program, examples)
        if key in self._seen:
            return self._seen[key]
        path = self.folder / f"{key}.json"
        if self.resume and path.exists():
            self._seen[key] = json.loads(path.read_text())
            return self._seen[key]
        self.evaluator.forget()  # every example runs, so every strict value below is this program's
        self.recording.values.clear()
        result = self.evaluator.evaluate(program, examples, desc=f"{desc} on {self.proto.report_split}",
                                         max_errors=len(examples))
        strict = {}
        for name in self.recording.others:
            # An example the program failed on never reached the metrics: it scores 0 on each.
            per_example = [self.recording.values.get(example_key(e), {}).get(name, 0.0) for e in examples]
            r = EvalResult.from_scores(per_example)
            strict[name] = {"score": r.score, "ci": list(r.ci), "scores": r.scores}
        row = {"metric": self.proto.metric, "score": result.score, "ci": list(result.ci), "n": result.n,
               "errors": result.errors, "scores": result.scores, "strict": strict}
        atomic_write_json(path, row)
        self._seen[key] = row
        return row

    def _key(self, program: Any, examples: list[Any]) -> str:
        text = program.canonical_json() if hasattr(program, "canonical_json") else program_key(program)
        parts = [text, self.proto.name, *sorted(self.proto.metric_fns()), *(example_key(e) for e in examples)]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def paired_change(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Mean per-example change ``after - before`` on the same examples, with a normal 95% interval.

    Example:
        >>> paired_change({"scores": [0.0, 0.0]}, {"scores": [1.0, 1.0]})
        {'mean': 1.0, 'ci': [1.0, 1.0], 'n': 2}
    """
    diffs = [b - a for a, b in zip(before["scores"], after["scores"], strict=True)]
    if not diffs:
        return {"mean": 0.0, "ci": [0.0, 0.0], "n": 0}
    mean = statistics.fmean(diffs)
    half = _Z * statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0.0
    return {"mean": mean, "ci": [mean - half, mean + half], "n": len(diffs)}
