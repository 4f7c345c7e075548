"""The cue -> word toy task: each colour is the code name of one animal ("red" -> "cat", ...).

The input names a colour (``cue``) beside two noise words; the right output (``word``) is the animal
that colour stands for. The code book is arbitrary, so no model knows it beforehand: a base model
answers at about chance (1/8 when told the eight animals), a fresh tiny random model about one time in
its vocabulary size, and a LoRA learns it in a few dozen steps on a CPU. The weights tests, the GRPO
throughput benchmark and the Gemma weights demonstration all use this one definition.

Example:
    >>> import dspy
    >>> from flowopt.benchmarks import cue_word
    >>> example = cue_word.make_examples(1, seed=0)[0]
    >>> example.word == cue_word.answer_for(example.cue)
    True
    >>> cue_word.metric(example, dspy.Prediction(word=example.word + " and more"))
    1.0
    >>> cue_word.loose_metric(example, dspy.Prediction(word=example.word.capitalize() + "."))
    1.0
"""

from __future__ import annotations

import random
from typing import Any

import dspy

COLORS = ("red", "blue", "green", "black", "white", "pink", "gold", "gray")
ANIMALS = ("cat", "dog", "cow", "pig", "owl", "fox", "bee", "ant")
NOISE = ("sun", "moon", "star", "tree", "rock", "lake", "hill", "road")
# Four more noise words, for a wider input distribution where the vocabulary is not a concern (real models).
MORE_NOISE = ("milk", "salt", "rain", "sand")
INSTRUCTIONS = ("Each colour is the code name of one animal. Answer with the animal only, one of: "
                + ", ".join(ANIMALS) + ".")


def answer_for(cue: str) -> str:
    """The animal that colour ``cue`` stands for."""
    return ANIMALS[COLORS.index(cue)]


def make_examples(n: int, seed: int, *, noise: tuple[str, ...] = NOISE) -> list[dspy.Example]:
    """``n`` examples with inputs ``noise`` (two of ``noise``) and ``cue``, label ``word``; seeded."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randrange(len(COLORS))
        out.append(dspy.Example(noise=" ".join(rng.sample(noise, 2)), cue=COLORS[k], word=ANIMALS[k])
                   .with_inputs("noise", "cue"))
    return out


def first_word(text: str, *, loose: bool = False) -> str:
    """The first whitespace-separated word of ``text`` ("" if none). ``loose``: lower-cased, and "." and ","
    count as spaces, for real models that write "Cat." where a word-level tiny model writes "cat"."""
    if loose:
        text = text.lower().replace(".", " ").replace(",", " ")
    words = text.split()
    return words[0] if words else ""


def metric(example: Any, prediction: Any, trace: Any = None) -> float:
    """1.0 when the prediction's ``word`` starts with the right animal, exactly."""
    return float(first_word(str(getattr(prediction, "word", "") or "")) == example.word)


def loose_metric(example: Any, prediction: Any, trace: Any = None) -> float:
    """:func:`metric`, ignoring case and full stops/commas (see :func:`first_word`)."""
    return float(first_word(str(getattr(prediction, "word", "") or ""), loose=True) == example.word)


def oracle(request: Any) -> dict[str, str]:
    """A scripted teacher's answer (``flowopt.testing.scripted_lm(oracle)``): always the right animal."""
    return {"word": answer_for(request.inputs["cue"])}
