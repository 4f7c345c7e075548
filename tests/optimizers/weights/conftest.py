"""Fixtures for the weights stages: a tiny random model on a learnable cue -> word task.

The task: the input names a colour (``cue``) among two noise words; the right output is the animal
that colour stands for. A fresh tiny model gets it right about one time in 40 (its vocabulary size);
a LoRA can learn it in a few dozen steps on a CPU.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import dspy
import pytest

COLORS = ["red", "blue", "green", "black", "white", "pink", "gold", "gray"]
ANIMALS = ["cat", "dog", "cow", "pig", "owl", "fox", "bee", "ant"]
NOISE = ["sun", "moon", "star", "tree", "rock", "lake", "hill", "road"]
# The completion adapter's labels, so prompts are whole words for the word-level tokenizer.
LABELS = ["Noise:", "Cue:", "Word:", "---", "Given", "fields", "produce", "`noise`,", "`cue`,", "`word`."]


def make_examples(n: int, seed: int) -> list[dspy.Example]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randrange(len(COLORS))
        out.append(dspy.Example(noise=" ".join(rng.sample(NOISE, 2)), cue=COLORS[k], word=ANIMALS[k])
                   .with_inputs("noise", "cue"))
    return out


def first_word_metric(example: Any, prediction: Any, trace: Any = None) -> float:
    words = str(getattr(prediction, "word", "") or "").split()
    return float(bool(words) and words[0] == example.word)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny models run fastest on one thread, and a shared 2-core machine is not oversubscribed."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tiny_local():
    """A LocalLM over a fresh tiny random model (in memory)."""
    from flowopt.lm.local import LocalLM
    from flowopt.optimizers.weights.tiny import tiny_causal_lm

    model, tokenizer = tiny_causal_lm(COLORS + ANIMALS + NOISE + LABELS, seed=0)
    local = LocalLM.from_model(model, tokenizer, name="tiny", max_new_tokens=4)
    yield local
    local.close()


@pytest.fixture
def make_tiny_local():
    """Build more LocalLMs over the same tiny weights (seed 0), e.g. to repeat a run from scratch."""
    from flowopt.lm.local import LocalLM
    from flowopt.optimizers.weights.tiny import tiny_causal_lm

    made = []

    def make():
        model, tokenizer = tiny_causal_lm(COLORS + ANIMALS + NOISE + LABELS, seed=0)
        made.append(LocalLM.from_model(model, tokenizer, name="tiny", max_new_tokens=4))
        return made[-1]

    yield make
    for local in made:
        local.close()


@pytest.fixture
def tiny_saved_local(tmp_path: Path):
    """A LocalLM loaded from a folder, so its spec (the workflow's LM entry) can be written."""
    from flowopt.lm.local import LocalLM
    from flowopt.optimizers.weights.tiny import tiny_causal_lm

    model, tokenizer = tiny_causal_lm(COLORS + ANIMALS + NOISE + LABELS, seed=0)
    folder = tmp_path / "tiny-model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    local = LocalLM(str(folder), name="tiny", device="cpu", max_new_tokens=4, progress=False)
    yield local
    local.close()


def make_ctx(trainset: list[Any], valset: list[Any], *, run_dir: Path | None = None, seed: int = 0,
             resume: bool = False, budget: Any = None, stage_name: str = "grpo") -> Any:
    from flowopt.compiler.budget import BudgetTracker
    from flowopt.compiler.context import StageContext

    return StageContext(trainset=trainset, valset=valset, metric=first_word_metric, budget=budget or BudgetTracker(),
                        seed=seed, rng=random.Random(seed), run_dir=run_dir, resume=resume, num_threads=4,
                        stage_name=stage_name)


class Task:
    """What the tests need of the cue -> word task, handed out by the ``task`` fixture."""

    colors, animals, noise = COLORS, ANIMALS, NOISE
    examples = staticmethod(make_examples)
    metric = staticmethod(first_word_metric)
    ctx = staticmethod(make_ctx)


@pytest.fixture
def task() -> type[Task]:
    return Task
