r"""Benchmark metrics: each protocol's reference scorer, and flowopt's stricter scorer beside it.

Reference scorers (a protocol's headline number, computed exactly as its reference computes it):

* ``gsm8k_aflow`` (:func:`gsm8k_aflow_metric`): AFlow's ``GSM8KBenchmark``: the last match of
  ``[-+]?\d+(?:,\d{3})*(?:\.\d+)?|\d+\.\d+`` in the whole output (Unicode digits included), commas
  dropped, read as a float and compared with the gold read the same way within ``1e-6``;
* ``gsm8k_dspy`` (:func:`gsm8k_dspy_metric`): DSPy's own ``dspy.datasets.gsm8k.gsm8k_metric``, called
  as it is (the integer in the last number-bearing token of the answer's first line);
* ``hotpot_f1_aflow`` (:func:`hotpot_f1_aflow`): AFlow's ``HotpotQABenchmark`` F1: the official
  normalisation and token F1 without the yes/no/noanswer rule;
* ``hotpot_em_dspy`` (:func:`hotpot_em_dspy`): DSPy's ``dspy.evaluate.answer_exact_match``.

Strict scorers (reported beside them): ``gsm8k_strict`` (:func:`gsm8k_metric`), and the official
``hotpot_evaluate_v1.py`` EM and F1 (``hotpot_em``, ``hotpot_f1``). The strict GSM8K reading follows.

Every metric has the DSPy signature ``metric(example, pred, trace=None) -> float`` and returns a
float in ``[0, 1]``. ``example`` is a :class:`dspy.Example` with a gold ``answer``; ``pred`` is a
:class:`dspy.Prediction` (its ``answer`` field is scored; a plain string is accepted too, and a
missing or ``None`` answer scores as the empty string).

GSM8K number reading (:func:`extract_numbers`), applied to the whole answer text:

* thousands separators: ``1,000`` and ``1,000,000.50`` are one number; a comma that does not start a
  group of exactly three digits separates numbers (``12,34`` is 12 then 34, ``1,2,3`` is 1, 2, 3);
* currency: ``$``, ``€``, ``£``, ``¥`` and ``₹`` before the number are skipped (``$1,200``, ``-$5`` and
  ``$-5`` read as 1200, -5, -5);
* digits: any Unicode decimal digit (full-width ``８``, Arabic-Indic ``٨``) reads as its ASCII digit;
* negatives: a leading ``-``, ``+`` or Unicode minus ``−`` is a sign only when it is not glued to a
  preceding letter, digit or point (``-5`` and ``(-5)`` are -5; ``5-3`` is 5 then 3; ``x-3`` is 3);
* decimals: ``3.5`` and ``.5`` are read exactly (as :class:`~decimal.Decimal`); a sentence-final point
  is not part of the number (``18.`` is 18), so ``18.00`` equals ``18``;
* percent: ``50%`` reads as 50 (GSM8K golds for percentage questions are the bare number);
* fractions: ``a/b`` with integer ``a`` and non-zero integer ``b`` reads as its exact value
  (``3/4`` is 0.75, ``12/4`` is 3), so a fraction only matches a gold number of equal value. A
  chain such as the date ``12/25/2023`` is read as separate numbers (12, 25, 2023), and ``a/0`` as ``a``
  then 0. Mixed numbers are not combined (``2 1/2`` is 2 then 0.5);
* not read: number words (``five``), scientific notation (``1e3`` is 1 then 3), spaces or points as
  thousands separators and decimal commas (``3,5`` is 3 then 5).

HotpotQA scoring follows the official ``hotpot_evaluate_v1.py``: lower-case, drop ASCII punctuation,
drop the articles a/an/the, collapse whitespace; F1 is 0 when either normalised side is ``yes``,
``no`` or ``noanswer`` and the two differ.

Example:
    >>> import dspy
    >>> gsm8k_metric(dspy.Example(answer="1200"), dspy.Prediction(answer="It costs $1,200."))
    1.0
    >>> hotpot_f1(dspy.Example(answer="the Eiffel Tower"), dspy.Prediction(answer="Eiffel Tower, Paris"))
    0.8
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable
from decimal import Decimal
from typing import Any

from flowopt.errors import ConfigError, DataError

__all__ = [
    "AFLOW_NUMBER_RE",
    "AFLOW_TOLERANCE",
    "METRICS",
    "aflow_extract_number",
    "exact_match_score",
    "extract_last_number",
    "extract_numbers",
    "f1_score",
    "get_metric",
    "gsm8k_aflow_metric",
    "gsm8k_dspy_metric",
    "gsm8k_metric",
    "hotpot_em",
    "hotpot_em_dspy",
    "hotpot_f1",
    "hotpot_f1_aflow",
    "normalize_answer",
]

Metric = Callable[..., float]

#: Absolute tolerance of the AFlow GSM8K protocol (AFlow's ``abs(gold - pred) <= 1e-6``, on floats).
AFLOW_TOLERANCE = 1e-6
#: AFlow's GSM8K number pattern (``GSM8KBenchmark.extract_number``), as AFlow writes it.
AFLOW_NUMBER_RE = re.compile(r"[-+]?\d+(?:,\d{3})*(?:\.\d+)?|\d+\.\d+")
_NON_ASCII_DIGIT_RE = re.compile(r"(?![0-9])\d")

_NUMBER_RE = re.compile(
    r"(?:(?<![\w.])(?P<sign>[-+\u2212]))?"  # a sign not glued to a preceding word, digit or point
    r"(?:[$€£¥₹]\s?(?P<sign2>[-+\u2212])?)?"  # currency, possibly followed by the sign ("$-5")
    r"(?P<num>[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])(?:\.[0-9]+)?"  # 1,234,567.89
    r"|[0-9]+(?:\.[0-9]+)?"  # 1234 or 12.5
    r"|(?<![0-9])\.[0-9]+)"  # .5
    r"(?:/(?P<den>[0-9]+))?"  # a fraction's denominator, checked below
)
_PLAIN_INT_RE = re.compile(r"[0-9]+")


def extract_numbers(text: str) -> list[Decimal]:
    """Every number in ``text``, in order, read as described in the module docstring.

    Example:
        >>> [str(n) for n in extract_numbers("He paid $1,200.50, then -3 and 3/4 of 8%.")]
        ['1200.50', '-3', '0.75', '8']
    """
    text = _NON_ASCII_DIGIT_RE.sub(lambda m: str(unicodedata.decimal(m.group())), text)
    numbers: list[Decimal] = []
    pos = 0
    while True:
        match = _NUMBER_RE.search(text, pos)
        if match is None:
            return numbers
        num = match.group("num")
        value = Decimal(num.replace(",", ""))
        end = match.end()
        den = match.group("den")
        if den is not None:
            chained = text[match.start("num") - 1 : match.start("num")] == "/" or text[end : end + 1] == "/"
            if _PLAIN_INT_RE.fullmatch(num) and not chained and int(den) != 0:
                value = value / Decimal(den)
            else:  # not a fraction: the denominator is read as the next number
                end = match.end("num")
        if (match.group("sign") or match.group("sign2") or "") in ("-", "\u2212"):
            value = -value
        numbers.append(value)
        pos = end


def extract_last_number(text: str | None) -> Decimal | None:
    """The last number in ``text`` (see :func:`extract_numbers`), or ``None`` if it has none.

    Example:
        >>> extract_last_number("3 apples and 4 pears make 7 fruits.\\nAnswer: 7")
        Decimal('7')
        >>> extract_last_number("no idea") is None
        True
    """
    numbers = extract_numbers(text or "")
    return numbers[-1] if numbers else None


def _pred_answer(pred: Any) -> str:
    """The answer text of a prediction (a ``dspy.Prediction``, anything with ``.answer``, or a string)."""
    if isinstance(pred, str):
        return pred
    answer = getattr(pred, "answer", None)
    return "" if answer is None else str(answer)


def _gold_number(example: Any) -> Decimal:
    gold = extract_last_number(str(getattr(example, "answer", "")))
    if gold is None:
        raise DataError(
            f"the example's gold answer {getattr(example, 'answer', None)!r} contains no number",
            fix="score GSM8K-style metrics only on examples whose `answer` is a number string",
        )
    return gold


def gsm8k_metric(example: Any, pred: Any, trace: Any = None) -> float:
    """flowopt's strict GSM8K scorer: 1.0 if the last number in ``pred.answer`` equals the gold number.

    Numbers are read as the module docstring describes; equality is exact on the decimal value
    (``18.00`` equals ``18``; ``18.000001`` does not).

    Example:
        >>> import dspy
        >>> gsm8k_metric(dspy.Example(answer="-3"), dspy.Prediction(answer="The change is -3 degrees."))
        1.0
    """
    value = extract_last_number(_pred_answer(pred))
    return 1.0 if value is not None and value == _gold_number(example) else 0.0


def aflow_extract_number(text: Any) -> float | None:
    """AFlow's ``extract_number``: the last pattern match, commas dropped, as a float (``None`` if none).

    Example:
        >>> aflow_extract_number("8-10 apples, so -$1,200.5")
        1200.5
        >>> aflow_extract_number("15/3")
        3.0
    """
    matches = AFLOW_NUMBER_RE.findall(str(text))
    if not matches:
        return None
    try:
        return float(matches[-1].replace(",", ""))
    except ValueError:
        return None


def gsm8k_aflow_metric(example: Any, pred: Any, trace: Any = None) -> float:
    """AFlow's GSM8K scorer: 1.0 if AFlow's last number of the output is within 1e-6 of the gold's.

    Like AFlow, the gold is read with the same pattern (``example.answer``: the final number, or the
    whole GSM8K answer with its ``#### n`` line).

    Example:
        >>> import dspy
        >>> gsm8k_aflow_metric(dspy.Example(answer="2"), dspy.Prediction(answer="2.0000001"))
        1.0
    """
    gold = aflow_extract_number(getattr(example, "answer", ""))
    if gold is None:
        raise DataError(f"the example's gold answer {getattr(example, 'answer', None)!r} contains no number",
                        fix="score GSM8K-style metrics only on examples whose `answer` is a number string")
    value = aflow_extract_number(_pred_answer(pred))
    if value is None:
        return 0.0
    return 1.0 if abs(gold - value) <= AFLOW_TOLERANCE else 0.0


def gsm8k_dspy_metric(example: Any, pred: Any, trace: Any = None) -> float:
    """DSPy's GSM8K scorer: ``dspy.datasets.gsm8k.gsm8k_metric`` itself, as a float.

    Example:
        >>> import dspy
        >>> gsm8k_dspy_metric(dspy.Example(answer="18"), dspy.Prediction(answer="18 dollars\\nthen 5"))
        1.0
    """
    from dspy.datasets.gsm8k import gsm8k_metric as dspy_gsm8k_metric

    return float(dspy_gsm8k_metric(example, _AnswerOf(_pred_answer(pred))))


class _AnswerOf:
    """A prediction carrying only ``answer`` (DSPy's metrics read ``pred.answer``)."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer


_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_SPECIAL_ANSWERS = ("yes", "no", "noanswer")


def normalize_answer(text: str) -> str:
    """Official HotpotQA / SQuAD normalisation: lower-case, no punctuation, no articles, single spaces.

    Example:
        >>> normalize_answer("  The  Eiffel-Tower! ")
        'eiffeltower'
    """
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES_RE.sub(" ", text)
    return " ".join(text.split())


def exact_match_score(prediction: str, ground_truth: str) -> float:
    """1.0 if the two answers are equal after :func:`normalize_answer`, else 0.0.

    Example:
        >>> exact_match_score("The Beatles.", "beatles")
        1.0
    """
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def f1_score(prediction: str, ground_truth: str) -> float:
    """Official HotpotQA answer F1: token-overlap F1 after normalisation, with the yes/no/noanswer rule.

    If either normalised answer is ``yes``, ``no`` or ``noanswer`` and they differ, the score is 0
    (so ``"yes, it is"`` against ``"yes"`` scores 0, not 0.5). No overlap scores 0, and so does an
    answer that normalises to nothing, even against itself: two HotpotQA gold answers, ``"The The"``
    (the band) and ``"!!!"`` (the band), get F1 0 whatever is predicted (their EM still works).

    Example:
        >>> round(f1_score("Paris, France", "Paris"), 3)
        0.667
        >>> f1_score("yes", "yes indeed")
        0.0
    """
    pred_norm = normalize_answer(prediction)
    gold_norm = normalize_answer(ground_truth)
    if (pred_norm in _SPECIAL_ANSWERS or gold_norm in _SPECIAL_ANSWERS) and pred_norm != gold_norm:
        return 0.0
    return _token_f1(pred_norm, gold_norm)


def _token_f1(pred_norm: str, gold_norm: str) -> float:
    """Token-overlap F1 of two normalised answers (0 without overlap)."""
    pred_tokens = pred_norm.split()
    gold_tokens = gold_norm.split()
    num_same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def _golds(example: Any) -> list[str]:
    answer = getattr(example, "answer", None)
    if isinstance(answer, str):
        return [answer]
    if isinstance(answer, Iterable) and answer and all(isinstance(a, str) for a in answer):
        return list(answer)
    raise DataError(
        f"the example's gold answer must be a string or a non-empty list of strings, got {answer!r}",
        fix="load examples with flowopt.benchmarks.datasets.load_split or set example.answer to a string",
    )


def _best_over_golds(example: Any, pred: Any, score: Callable[[str, str], float]) -> float:
    """``score`` of the predicted answer against each gold answer, the best of them."""
    answer = _pred_answer(pred)
    return float(max(score(answer, gold) for gold in _golds(example)))


def hotpot_em(example: Any, pred: Any, trace: Any = None) -> float:
    """HotpotQA answer exact match (best over the gold answers if ``example.answer`` is a list).

    Example:
        >>> import dspy
        >>> hotpot_em(dspy.Example(answer="Chief of Protocol"), dspy.Prediction(answer="chief of protocol."))
        1.0
    """
    return _best_over_golds(example, pred, exact_match_score)


def hotpot_f1(example: Any, pred: Any, trace: Any = None) -> float:
    """HotpotQA answer F1 (best over the gold answers if ``example.answer`` is a list).

    Example:
        >>> import dspy
        >>> hotpot_f1(dspy.Example(answer="yes"), dspy.Prediction(answer="no"))
        0.0
    """
    return _best_over_golds(example, pred, f1_score)


def hotpot_f1_aflow(example: Any, pred: Any, trace: Any = None) -> float:
    """AFlow's HotpotQA F1: official normalisation and token F1, without the yes/no/noanswer rule.

    Example:
        >>> import dspy
        >>> hotpot_f1_aflow(dspy.Example(answer="yes"), dspy.Prediction(answer="Yes, both are American."))
        0.4
    """
    return _best_over_golds(example, pred, lambda answer, gold: _token_f1(normalize_answer(answer),
                                                                          normalize_answer(gold)))


def hotpot_em_dspy(example: Any, pred: Any, trace: Any = None) -> float:
    """DSPy's answer exact match (``dspy.evaluate.answer_exact_match``) itself, as a float.

    Example:
        >>> import dspy
        >>> hotpot_em_dspy(dspy.Example(answer="Chief of Protocol"), dspy.Prediction(answer="chief of protocol."))
        1.0
    """
    from dspy.evaluate import answer_exact_match

    gold = getattr(example, "answer", None)
    return float(answer_exact_match(_AnswerOf(list(gold) if isinstance(gold, tuple) else gold),
                                    _AnswerOf(_pred_answer(pred))))


#: Metrics by the name a :class:`~flowopt.benchmarks.datasets.Protocol` refers to them.
METRICS: dict[str, Metric] = {
    "gsm8k_aflow": gsm8k_aflow_metric,
    "gsm8k_dspy": gsm8k_dspy_metric,
    "gsm8k_strict": gsm8k_metric,
    "hotpot_em": hotpot_em,
    "hotpot_em_dspy": hotpot_em_dspy,
    "hotpot_f1": hotpot_f1,
    "hotpot_f1_aflow": hotpot_f1_aflow,
}


def get_metric(name: str) -> Metric:
    """The metric function registered under ``name`` (see :data:`METRICS`).

    Example:
        >>> get_metric("hotpot_f1") is hotpot_f1
        True
    """
    try:
        return METRICS[name]
    except KeyError:
        raise ConfigError(
            f"unknown benchmark metric {name!r}", fix=f"use one of: {', '.join(sorted(METRICS))}"
        ) from None
