"""Fixtures for the weights stages: a tiny random model on the cue -> word task.

The task (``flowopt.benchmarks.cue_word``): the input names a colour (``cue``) among two noise words;
the right output is the animal that colour stands for. A fresh tiny model gets it right about one time
in 40 (its vocabulary size); a LoRA can learn it in a few dozen steps on a CPU.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from flowopt.benchmarks import cue_word

# The completion adapter's labels, so prompts are whole words for the word-level tokenizer.
LABELS = ["Noise:", "Cue:", "Word:", "---", "Given", "fields", "produce", "`noise`,", "`cue`,", "`word`."]
WORDS = [*cue_word.COLORS, *cue_word.ANIMALS, *cue_word.NOISE, *LABELS]


@pytest.fixture(autouse=True)
def _adapters_in_the_test_folder(monkeypatch, tmp_path_factory):
    """A stage run without a run_dir saves its adapter under tempfile's folder and keeps it (the compiled
    program loads it from there): point that folder into pytest's temporary tree, which pytest prunes,
    instead of leaving a ``flowopt-{stage}-*`` folder in /tmp per test."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path_factory.mktemp("tempfile")))


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny models run fastest on one thread, and a shared 2-core machine is not oversubscribed."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def save_word_model(folder: Path, words: list[str] = WORDS) -> Path:
    """The tiny word-level model over ``words`` (seed 0), saved to ``folder`` for code that loads a folder
    (a served model, a LocalLM with a spec)."""
    from flowopt.optimizers.weights.tiny import tiny_causal_lm

    model, tokenizer = tiny_causal_lm(words, seed=0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def tiny_local():
    """A LocalLM over a fresh tiny random model (in memory)."""
    from flowopt.lm.local import LocalLM
    from flowopt.optimizers.weights.tiny import tiny_causal_lm

    model, tokenizer = tiny_causal_lm(WORDS, seed=0)
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
        model, tokenizer = tiny_causal_lm(WORDS, seed=0)
        made.append(LocalLM.from_model(model, tokenizer, name="tiny", max_new_tokens=4))
        return made[-1]

    yield make
    for local in made:
        local.close()


@pytest.fixture
def tiny_saved_local(tmp_path: Path):
    """A LocalLM loaded from a folder, so its spec (the workflow's LM entry) can be written."""
    from flowopt.lm.local import LocalLM

    folder = save_word_model(tmp_path / "tiny-model")
    local = LocalLM(str(folder), name="tiny", device="cpu", max_new_tokens=4, progress=False)
    yield local
    local.close()


def make_ctx(trainset: list[Any], valset: list[Any], *, run_dir: Path | None = None, seed: int = 0,
             resume: bool = False, budget: Any = None, stage_name: str = "grpo") -> Any:
    from flowopt.compiler.budget import BudgetTracker
    from flowopt.compiler.context import StageContext

    return StageContext(trainset=trainset, valset=valset, metric=cue_word.metric, budget=budget or BudgetTracker(),
                        seed=seed, rng=random.Random(seed), run_dir=run_dir, resume=resume, num_threads=4,
                        stage_name=stage_name)


class Task:
    """What the tests need of the cue -> word task, handed out by the ``task`` fixture."""

    colors, animals, noise = cue_word.COLORS, cue_word.ANIMALS, cue_word.NOISE
    examples = staticmethod(cue_word.make_examples)
    metric = staticmethod(cue_word.metric)
    oracle = staticmethod(cue_word.oracle)
    ctx = staticmethod(make_ctx)


@pytest.fixture
def task() -> type[Task]:
    return Task
