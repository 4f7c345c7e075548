"""The simulated task family of the search benchmarks (``search_generalisation``, ``search_defaults``).

Per seed: train, val and test examples; each example has a hidden difficulty, each training example
a hidden quality as a demo (some help, some hurt). Shapes:

* ``spread``: demo qualities ~ N(0, 0.7); any instruction other than the original has an effect
  ~ N(0, 0.25) (drawn once per text by a hash);
* ``needles``: most demos slightly harmful (N(-0.25, 0.15)), one in eight strongly helpful (1.6);
  instructions as ``spread``;
* ``instructions``: demos ~ N(0, 0.4), instructions matter more (N(0, 0.6));
* ``demos_only``: demos as ``spread``; instructions (and anything else) change nothing: which
  training examples become demos is the only lever.

The fake LM (a DSPy engine, ``flowopt.testing``) answers an example right with probability
``sigmoid(0.2 + demo effect + instruction effect - difficulty)``, decided by a hash of (seed, the
demos shown in order, the instruction, the question): deterministic per (prompt, example), as an LM
at temperature 0. Demo effect: the qualities of the demos shown summed / sqrt(k), plus 0.3 for
showing 4 or more (a demo with a wrong answer counts -0.5). Any other prompt (an instruction
proposer, GEPA's reflection) gets a fresh instruction-like text. A program is scored on a split
without LM calls: its expected accuracy (mean probability) and its realised one (the hash draws).

Example:
    >>> task = Task(0, n_train=6, n_val=4, n_test=4, shape=DEMOS_ONLY)
    >>> task.instruction_effect("Think step by step."), len(task.train), len(task.test)
    (0.0, 6, 4)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import random
import re
import statistics
from collections.abc import Iterator
from typing import Any

import dspy

SHAPES = ("spread", "needles", "instructions")  # search_generalisation rotates these over its seeds
DEMOS_ONLY = "demos_only"
ORIGINAL = "Given the fields `question`, produce the fields `answer`."


def _u(*parts: Any) -> float:
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _norm(text: str) -> str:
    return " ".join(str(text).split())


class Task:
    """One seed's task: examples, hidden qualities and the answer rule."""

    def __init__(self, seed: int, n_train: int = 60, n_val: int = 100, n_test: int = 300,
                 shape: str | None = None) -> None:
        rng = random.Random(seed)
        self.seed, self.shape = seed, shape or SHAPES[seed % len(SHAPES)]
        if self.shape not in (*SHAPES, DEMOS_ONLY):
            raise ValueError(f"unknown task shape {self.shape!r}")
        n = n_train + n_val + n_test
        self.questions = [f"q{seed}-{i}: {rng.choice('abcdefgh')}{rng.randint(100, 999)}" for i in range(n)]
        self.answers = [f"a{_u(seed, 'answer', i):.6f}"[:9] for i in range(n)]
        self.difficulty = [rng.gauss(0.0, 1.0) for _ in range(n)]
        if self.shape == "needles":
            self.quality = [1.6 if rng.random() < 0.125 else rng.gauss(-0.25, 0.15) for _ in range(n_train)]
        else:
            self.quality = [rng.gauss(0.0, 0.4 if self.shape == "instructions" else 0.7) for _ in range(n_train)]
        self.instruction_sd = {"instructions": 0.6, DEMOS_ONLY: 0.0}.get(self.shape, 0.25)
        self.index = {q: i for i, q in enumerate(self.questions)}
        examples = [dspy.Example(question=q, answer=a).with_inputs("question")
                    for q, a in zip(self.questions, self.answers)]
        self.train = examples[:n_train]
        self.val = examples[n_train:n_train + n_val]
        self.test = examples[n_train + n_val:]

    def instruction_effect(self, instruction: str) -> float:
        text = _norm(instruction)
        if not text or text == _norm(ORIGINAL) or not self.instruction_sd:
            return 0.0
        u = min(max(_u(self.seed, "instruction", text), 1e-9), 1 - 1e-9)
        return statistics.NormalDist(0.0, self.instruction_sd).inv_cdf(u)

    def demo_effect(self, demos: list[tuple[str, str]]) -> float:
        effect, k = 0.0, 0
        for question, answer in demos:
            i = self.index.get(question)
            if i is None or i >= len(self.quality):
                continue
            k += 1
            effect += self.quality[i] if answer == self.answers[i] else -0.5
        return (effect / math.sqrt(k) + (0.3 if k >= 4 else 0.0)) if k else 0.0

    def probability(self, demos: list[tuple[str, str]], instruction: str, i: int) -> float:
        logit = 0.2 + self.demo_effect(demos) + self.instruction_effect(instruction) - self.difficulty[i]
        return 1.0 / (1.0 + math.exp(-logit))

    def correct(self, demos: list[tuple[str, str]], instruction: str, i: int) -> bool:
        key = (self.seed, tuple(q for q, _ in demos), _norm(instruction), i)
        return _u(*key) < self.probability(demos, instruction, i)

    # ---------------------------------------------------------------- the fake LM
    def lm(self, latency: float, cache: bool = False) -> dspy.LM:
        """The task's scripted LM; ``cache=True`` lets DSPy's cache answer a request it has seen (with
        :func:`dspy_cache`, a fresh in-memory one): then only the requests that reach it are counted."""
        from flowopt.testing import scripted_lm

        objective = re.compile(r"your objective is:\s*(.*)\Z", re.S)

        def answer(req: Any) -> Any:
            question = req.inputs.get("question")
            if req.output_fields == ["answer"] and question in self.index:
                match = objective.search(req.system)
                instruction = match.group(1) if match else ORIGINAL
                demos = [(str(d.get("question", "")), str(d.get("answer", ""))) for d in req.demos]
                i = self.index[question]
                ok = self.correct(demos, instruction, i)
                return {"answer": self.answers[i] if ok else f"wrong-{i}"}
            # Any other prompt (an instruction proposer, GEPA's reflection): a fresh instruction.
            text = f"Answer the question carefully (variant {_u(self.seed, req.prompt, req.system):.6f})."
            values = {name: text for name in req.output_fields}
            return json.dumps(values) if "JSON" in req.system else values

        return scripted_lm(answer, latency_s=latency, cache=cache, model=f"scripted/sim-{self.seed}")

    # ---------------------------------------------------------------- scoring without LM calls
    def program_parts(self, program: Any) -> tuple[list[tuple[str, str]], str]:
        predictor = program.predictors()[0]
        demos = [(str(d.get("question", "")), str(d.get("answer", ""))) for d in predictor.demos]
        return demos, predictor.signature.instructions

    def score(self, program: Any, split: list[Any]) -> dict[str, float]:
        demos, instruction = self.program_parts(program)
        ids = [self.index[e.question] for e in split]
        return {"expected": statistics.fmean(self.probability(demos, instruction, i) for i in ids),
                "realised": statistics.fmean(float(self.correct(demos, instruction, i)) for i in ids)}


@contextlib.contextmanager
def dspy_cache(on: bool) -> Iterator[None]:
    """Inside the block, DSPy's in-memory cache, fresh and empty (``on``: what a first run with DSPy's cache
    gets, without the disk), or no cache (every scripted call a real, counted one); the caller's after.

    ``dspy.configure_cache`` replaces the process's cache for good; a test that runs a method in-process
    would otherwise leave every later test without one.
    """
    saved = dspy.cache
    dspy.configure_cache(enable_disk_cache=False, enable_memory_cache=on)
    try:
        yield
    finally:
        dspy.cache = saved


def dspy_cache_off() -> contextlib.AbstractContextManager[None]:
    """DSPy's cache off inside the block (:func:`dspy_cache`)."""
    return dspy_cache(False)


def metric(example: Any, pred: Any, trace: Any = None) -> float:
    return float(example.answer == pred.answer)


def mean_ci(values: list[float]) -> list[float]:
    """``[mean, low, high]``: the mean of ``values`` and its 95% t-interval (paired differences, one a seed)."""
    from scipy.stats import t

    mean = statistics.fmean(values)
    if len(values) < 2:
        return [mean, mean, mean]
    half = float(t.ppf(0.975, len(values) - 1)) * statistics.stdev(values) / math.sqrt(len(values))
    return [mean, mean - half, mean + half]
