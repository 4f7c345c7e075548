"""Benchmark loaders: the four evaluation protocols and their splits, from the packaged data files.

Protocols are kept apart: each names its own files, splits, metric and input fields.

``gsm8k-dspy`` (DSPy's GSM8K protocol)
    ``train`` 200 and ``val`` 300 are ``[:200]`` and ``[200:500]`` of the official train set after
    DSPy's own shuffle (``random.Random(0).shuffle``, exactly as ``dspy.datasets.gsm8k.GSM8K`` does it),
    so they are the examples DSPy's ``GSM8K().train`` / ``.dev`` hold. ``test`` is the official test
    set (1319, the report split), in DSPy's ``GSM8K().test`` order (the same seed-0 shuffle).
    ``train_all`` is the whole official train set (7473) in file order. Metric ``gsm8k_dspy`` (DSPy's
    own ``gsm8k_metric``; flowopt's ``gsm8k_strict`` also reported).
``gsm8k-aflow`` (AFlow's GSM8K protocol)
    ``val`` is AFlow's validate split (264, the search split) and ``test`` its test split (1055,
    the report split); together they are the official test set. Metric ``gsm8k_aflow`` (AFlow's
    scorer; ``gsm8k_strict`` also reported).
``hotpotqa-aflow`` (AFlow's HotpotQA protocol, distractor setting)
    ``val`` is AFlow's validate split (200), ``test`` its test split (800, the report split). Inputs
    are ``question`` and ``context``: the record's paragraphs (normally 10, two of them gold) exactly as
    AFlow gives them to the model, each its sentences joined by one space, without titles (AFlow's prompt
    is ``"\\n".join(context)``; the titles are kept in ``titles``). Metric ``hotpot_f1_aflow`` (AFlow's F1;
    the official ``hotpot_f1`` and ``hotpot_em`` also reported).
``hotpotqa-closedbook`` (open-domain / closed-book HotpotQA)
    The official dev questions (7405) without context. There is no other HotpotQA data here (the
    official train set is not shipped), so the train and search examples are taken from dev itself:
    a fixed partition, made by shuffling the dev positions with ``random.Random(20180925)`` and taking
    the first 200 as ``train``, the next 300 as ``val`` and the remaining 6905 as ``test``, the report
    split. ``train``/``val`` never overlap ``test``. ``dev`` is all 7405 questions; it overlaps
    ``train``/``val``, so use it only for programs not compiled on this protocol (e.g. a zero-shot
    baseline compared with published full-dev numbers). The AFlow distractor-1000 records are not
    used as train data because they are dev questions too. Each split is in dev-file order. Metric
    ``hotpot_em_dspy`` (DSPy's ``answer_exact_match``; the official ``hotpot_em``/``hotpot_f1`` also reported).

Examples are :class:`dspy.Example` objects with the protocol's input fields set and these fields:
GSM8K: ``id``, ``question``, ``answer`` (the final number with thousands commas removed, e.g.
``"1200"`` for ``#### 1,200``), ``solution`` (the worked solution before the ``#### `` line, with its
``<<calc>>`` annotations). HotpotQA: ``id`` (the official ``_id``; closed-book: ``hotpot-dev-<n>``),
``question``, ``answer``, ``type``, and for ``hotpotqa-aflow`` also ``context``, ``titles``,
``supporting_facts`` and ``level``; closed-book examples carry ``dev_index`` (their 0-based position in the dev file).

Every data file is checked against the SHA-256 in the packaged ``data/SHA256SUMS`` the first time a
process reads it (again only if its size or modification time changes); a mismatch raises
:class:`flowopt.errors.DataError`. ``FLOWOPT_DATA_DIR`` points the loaders at another copy of the
data folder; the expected checksums still come from the package.

Example:
    >>> from flowopt.benchmarks.datasets import get_protocol, load_split
    >>> proto = get_protocol("gsm8k-aflow")
    >>> proto.report_split, proto.metric
    ('test', 'gsm8k_aflow')
    >>> dev = load_split("gsm8k-aflow", "val", limit=3, seed=0)
    >>> len(dev), sorted(dev[0].inputs().keys())
    (3, ['question'])
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from flowopt.errors import ConfigError, DataError

from .data_files import CHECKSUMS_FILE, DATA_DIR_ENV, data_dir, read_jsonl, verify_file
from .metrics import Metric, get_metric

if TYPE_CHECKING:
    import dspy

__all__ = [
    "CHECKSUMS_FILE",
    "DATA_DIR_ENV",
    "PROTOCOLS",
    "Protocol",
    "aflow_paragraph",
    "data_dir",
    "get_protocol",
    "list_protocols",
    "load_split",
    "verify_file",
]

logger = logging.getLogger(__name__)


# The closed-book partition of the dev set (see the module docstring). Changing these changes the splits.
_CLOSEDBOOK_SEED = 20180925
_CLOSEDBOOK_TRAIN = 200
_CLOSEDBOOK_VAL = 300
# DSPy's GSM8K loader: random.Random(0).shuffle of the official train and test lists.
_DSPY_GSM8K_SEED = 0


# ------------------------------------------------------------------------------------- records


def _gsm8k_final(answer: str) -> str:
    return answer.strip().replace(",", "")


def _gsm8k_official(which: str) -> list[dict[str, Any]]:
    records = []
    for n, rec in enumerate(read_jsonl(f"gsm8k/{which}.jsonl")):
        solution, sep, final = rec["answer"].rpartition("\n#### ")
        if not sep:
            raise DataError(
                f"gsm8k/{which}.jsonl record {n} has no '#### <answer>' line",
                fix="restore the original data file",
            )
        records.append({"id": f"gsm8k-{which}-{n}", "question": rec["question"],
                        "answer": _gsm8k_final(final), "solution": solution})
    return records


def _dspy_shuffled(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    shuffled = list(records)
    random.Random(_DSPY_GSM8K_SEED).shuffle(shuffled)
    return shuffled


def _load_gsm8k_dspy(split: str) -> list[dict[str, Any]]:
    if split == "test":
        return _dspy_shuffled(_gsm8k_official("test"))
    train = _gsm8k_official("train")
    if split == "train_all":
        return train
    shuffled = _dspy_shuffled(train)
    return shuffled[:200] if split == "train" else shuffled[200:500]


def _load_gsm8k_aflow(split: str) -> list[dict[str, Any]]:
    name = "validate" if split == "val" else "test"
    return [
        {"id": rec["id"], "question": rec["question"], "answer": _gsm8k_final(rec["answer"]),
         "solution": rec["cot"]}
        for rec in read_jsonl(f"aflow_splits/gsm8k_{name}.jsonl")
    ]


def aflow_paragraph(sentences: list[str]) -> str:
    """One HotpotQA context paragraph as AFlow renders it: ``" ".join(sentences)``, no title.

    Example:
        >>> aflow_paragraph(["Edward Wood was a filmmaker.", " He was American."])
        'Edward Wood was a filmmaker.  He was American.'
    """
    return " ".join(sentences)


def _official_hotpot_ids() -> dict[tuple[str, str], str]:
    return {(r["question"], r["answer"]): r["_id"] for r in read_jsonl("hotpotqa/dev_distractor_1000.jsonl")}


def _load_hotpotqa_aflow(split: str) -> list[dict[str, Any]]:
    name = "validate" if split == "val" else "test"
    raw = read_jsonl(f"aflow_splits/hotpotqa_{name}.jsonl")
    # AFlow's copy has 19 integer _ids (the dev position); the distractor-1000 file has the official ids.
    official = _official_hotpot_ids() if any(not isinstance(r["_id"], str) for r in raw) else {}
    records = []
    for rec in raw:
        rid = rec["_id"] if isinstance(rec["_id"], str) else official[(rec["question"], rec["answer"])]
        records.append({
            "id": rid,
            "question": rec["question"],
            "answer": rec["answer"],
            # AFlow: [item[1] for item in problem["context"] if isinstance(item[1], list)], each " ".join-ed.
            "context": tuple(aflow_paragraph(sents) for _, sents in rec["context"] if isinstance(sents, list)),
            "titles": tuple(title for title, sents in rec["context"] if isinstance(sents, list)),
            "supporting_facts": tuple((title, idx) for title, idx in rec["supporting_facts"]),
            "type": rec["type"],
            "level": rec["level"],
        })
    return records


def _closedbook_partition(n: int) -> dict[str, list[int]]:
    order = list(range(n))
    random.Random(_CLOSEDBOOK_SEED).shuffle(order)
    cut = _CLOSEDBOOK_TRAIN + _CLOSEDBOOK_VAL
    return {
        "train": sorted(order[:_CLOSEDBOOK_TRAIN]),
        "val": sorted(order[_CLOSEDBOOK_TRAIN:cut]),
        "test": sorted(order[cut:]),
        "dev": list(range(n)),
    }


def _load_hotpotqa_closedbook(split: str) -> list[dict[str, Any]]:
    dev = [
        {"id": f"hotpot-dev-{n}", "dev_index": n, "question": rec["question"], "answer": rec["answer"],
         "type": rec["type"]}
        for n, rec in enumerate(read_jsonl("hotpotqa/dev_simplified_react.jsonl"))
    ]
    return [dev[i] for i in _closedbook_partition(len(dev))[split]]


# ------------------------------------------------------------------------------------ protocols


@dataclass(frozen=True)
class Protocol:
    """One evaluation protocol: its data splits, which split is for what, and how it is scored.

    Attributes:
        name: registry name, e.g. ``"gsm8k-dspy"``.
        description: one line for ``flowopt bench --list``.
        train_split: split to draw demos / training examples from.
        search_split: split that compilers score candidates on (may equal ``train_split``).
        report_split: split whose score is reported; never overlaps ``train_split`` or ``search_split``.
        metric: name of the main metric in :data:`flowopt.benchmarks.metrics.METRICS`.
        input_fields: the example fields that are program inputs.
        splits: every split name and its exact size.
        extra_metrics: further metrics reported next to ``metric``.

    Example:
        >>> proto = get_protocol("hotpotqa-aflow")
        >>> proto.input_fields, proto.splits["test"]
        (('question', 'context'), 800)
        >>> examples = proto.load("val", limit=2)
        >>> proto.metric_fn()(examples[0], examples[0])
        1.0
    """

    name: str
    description: str
    train_split: str
    search_split: str
    report_split: str
    metric: str
    input_fields: tuple[str, ...]
    splits: Mapping[str, int]
    extra_metrics: tuple[str, ...] = ()
    _loader: Callable[[str], list[dict[str, Any]]] = field(
        default=lambda split: [], repr=False, compare=False
    )

    def __hash__(self) -> int:
        return hash(self.name)

    def metric_fn(self) -> Metric:
        """The main metric function, ``(example, pred, trace=None) -> float``."""
        return get_metric(self.metric)

    def metric_fns(self) -> dict[str, Metric]:
        """The main and extra metrics by name, main first."""
        return {name: get_metric(name) for name in (self.metric, *self.extra_metrics)}

    def load(self, split: str, limit: int | None = None, seed: int | None = 0) -> list[dspy.Example]:
        """Shorthand for :func:`load_split` on this protocol."""
        return load_split(self, split, limit=limit, seed=seed)


PROTOCOLS: Mapping[str, Protocol] = MappingProxyType({
    p.name: p
    for p in (
        Protocol(
            name="gsm8k-dspy",
            description="GSM8K as DSPy measures it: 200 train / 300 val from the official train set, "
            "report on the official test set (1319); DSPy's gsm8k_metric",
            train_split="train", search_split="val", report_split="test", metric="gsm8k_dspy",
            input_fields=("question",), extra_metrics=("gsm8k_strict",),
            splits=MappingProxyType({"train": 200, "val": 300, "test": 1319, "train_all": 7473}),
            _loader=_load_gsm8k_dspy,
        ),
        Protocol(
            name="gsm8k-aflow",
            description="GSM8K as AFlow measures it: search on AFlow validate (264), report on AFlow "
            "test (1055); AFlow's scorer (last number within 1e-6)",
            train_split="val", search_split="val", report_split="test", metric="gsm8k_aflow",
            input_fields=("question",), extra_metrics=("gsm8k_strict",),
            splits=MappingProxyType({"val": 264, "test": 1055}),
            _loader=_load_gsm8k_aflow,
        ),
        Protocol(
            name="hotpotqa-aflow",
            description="HotpotQA distractor setting as AFlow measures it: context paragraphs given, "
            "search on AFlow validate (200), report on AFlow test (800); AFlow's answer F1 (and the official F1, EM)",
            train_split="val", search_split="val", report_split="test", metric="hotpot_f1_aflow",
            input_fields=("question", "context"),
            splits=MappingProxyType({"val": 200, "test": 800}),
            extra_metrics=("hotpot_f1", "hotpot_em"),
            _loader=_load_hotpotqa_aflow,
        ),
        Protocol(
            name="hotpotqa-closedbook",
            description="HotpotQA dev questions with no context: 200 train / 300 val taken from dev, "
            "report on the other 6905 dev questions; DSPy's answer EM (and the official EM, F1)",
            train_split="train", search_split="val", report_split="test", metric="hotpot_em_dspy",
            input_fields=("question",),
            splits=MappingProxyType({"train": 200, "val": 300, "test": 6905, "dev": 7405}),
            extra_metrics=("hotpot_em", "hotpot_f1"),
            _loader=_load_hotpotqa_closedbook,
        ),
    )
})


def list_protocols() -> list[str]:
    """Names of all protocols, sorted.

    Example:
        >>> list_protocols()
        ['gsm8k-aflow', 'gsm8k-dspy', 'hotpotqa-aflow', 'hotpotqa-closedbook']
    """
    return sorted(PROTOCOLS)


def get_protocol(name: str | Protocol) -> Protocol:
    """The protocol registered as ``name`` (a :class:`Protocol` is returned unchanged).

    Raises:
        ConfigError: no such protocol.

    Example:
        >>> get_protocol("gsm8k-dspy").splits["test"]
        1319
    """
    if isinstance(name, Protocol):
        return name
    try:
        return PROTOCOLS[name]
    except KeyError:
        raise ConfigError(
            f"unknown benchmark protocol {name!r}", fix=f"use one of: {', '.join(list_protocols())}"
        ) from None


_records_cache: dict[tuple[str, str, str], tuple[dict[str, Any], ...]] = {}
_records_lock = threading.Lock()


def _split_records(proto: Protocol, split: str) -> tuple[dict[str, Any], ...]:
    root = str(data_dir())
    key = (proto.name, split, root)
    with _records_lock:
        cached = _records_cache.get(key)
    if cached is not None and PROTOCOLS.get(proto.name) is proto:
        return cached
    records = proto._loader(split)
    if len(records) != proto.splits[split]:
        raise DataError(
            f"{proto.name} split {split!r} has {len(records)} examples, expected {proto.splits[split]} "
            f"(data in {root})",
            fix="restore the original data files",
        )
    logger.info("loaded %s/%s: %d examples from %s", proto.name, split, len(records), root)
    frozen = tuple(records)
    if PROTOCOLS.get(proto.name) is proto:
        with _records_lock:
            _records_cache[key] = frozen
    return frozen


def _example(record: Mapping[str, Any], input_fields: tuple[str, ...]) -> dspy.Example:
    import dspy

    fields = {k: list(v) if isinstance(v, tuple) else v for k, v in record.items()}
    return dspy.Example(**fields).with_inputs(*input_fields)


def load_split(
    protocol: str | Protocol, split: str, limit: int | None = None, seed: int | None = 0
) -> list[dspy.Example]:
    """Examples of one split of a protocol, as fresh :class:`dspy.Example` objects.

    Args:
        protocol: a protocol name (see :func:`list_protocols`) or a :class:`Protocol`.
        split: one of ``get_protocol(protocol).splits``.
        limit: keep only this many examples. ``None`` keeps the whole split.
        seed: with ``limit``, which examples: a ``random.Random(seed)`` sample, returned in split
            order; a smaller ``limit`` with the same seed gives a subset of a larger one. ``None``
            takes the first ``limit`` examples. Ignored without ``limit``.

    Raises:
        ConfigError: unknown protocol or split, or a negative limit.
        DataError: a data file is missing, malformed or fails its checksum.

    Example:
        >>> train = load_split("gsm8k-dspy", "train", limit=5, seed=1)
        >>> len(train), train[0].answer.isdigit(), "solution" in train[0]
        (5, True, True)
    """
    proto = get_protocol(protocol)
    if split not in proto.splits:
        raise ConfigError(
            f"protocol {proto.name!r} has no split {split!r}", fix=f"use one of: {', '.join(proto.splits)}"
        )
    if limit is not None and limit < 0:
        raise ConfigError(f"limit must be >= 0, got {limit}", fix="pass limit=None for the whole split")
    records = _split_records(proto, split)
    indices: Sequence[int] = range(len(records))
    if limit is not None and limit < len(records):
        if seed is None:
            indices = range(limit)
        else:
            order = list(indices)
            random.Random(seed).shuffle(order)
            indices = sorted(order[:limit])
    return [_example(records[i], proto.input_fields) for i in indices]
