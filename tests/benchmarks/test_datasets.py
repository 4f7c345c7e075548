"""Benchmark loaders: exact split sizes, split hygiene, example shape, and checksum verification."""

from __future__ import annotations

import json
import random
import shutil

import dspy
import pytest

from flowopt.benchmarks import data_files
from flowopt.benchmarks.datasets import (
    DATA_DIR_ENV,
    Protocol,
    get_protocol,
    list_protocols,
    load_split,
    verify_file,
)
from flowopt.benchmarks.metrics import gsm8k_metric, hotpot_em, hotpot_f1, normalize_answer
from flowopt.errors import ConfigError, DataError

PACKAGED = data_files.PACKAGED_DATA


def ids(examples):
    return [e.id for e in examples]


# ------------------------------------------------------------------------------------- counts


@pytest.mark.parametrize(
    ("protocol", "split", "size"),
    [
        ("gsm8k-dspy", "train_all", 7473),
        ("gsm8k-dspy", "train", 200),
        ("gsm8k-dspy", "val", 300),
        ("gsm8k-dspy", "test", 1319),
        ("gsm8k-aflow", "val", 264),
        ("gsm8k-aflow", "test", 1055),
        ("hotpotqa-aflow", "val", 200),
        ("hotpotqa-aflow", "test", 800),
        ("hotpotqa-closedbook", "dev", 7405),
        ("hotpotqa-closedbook", "train", 200),
        ("hotpotqa-closedbook", "val", 300),
        ("hotpotqa-closedbook", "test", 6905),
    ],
)
def test_exact_split_sizes(protocol, split, size):
    examples = load_split(protocol, split)
    assert len(examples) == size == get_protocol(protocol).splits[split]
    assert len(set(ids(examples))) == size


def test_registry():
    assert list_protocols() == ["gsm8k-aflow", "gsm8k-dspy", "hotpotqa-aflow", "hotpotqa-closedbook"]
    for name in list_protocols():
        proto = get_protocol(name)
        assert isinstance(proto, Protocol) and proto.name == name and proto.description
        assert {proto.train_split, proto.search_split, proto.report_split} <= set(proto.splits)
        assert callable(proto.metric_fn()) and next(iter(proto.metric_fns())) == proto.metric
        assert get_protocol(proto) is proto
    assert get_protocol("gsm8k-dspy").metric == "gsm8k_dspy"
    assert get_protocol("gsm8k-aflow").metric == "gsm8k_aflow"
    assert get_protocol("hotpotqa-aflow").metric == "hotpot_f1_aflow"
    assert get_protocol("hotpotqa-closedbook").metric == "hotpot_em_dspy"


def test_unknown_names_are_config_errors():
    with pytest.raises(ConfigError, match=r"unknown benchmark protocol 'gsm8k'.*gsm8k-dspy"):
        get_protocol("gsm8k")
    with pytest.raises(ConfigError, match=r"has no split 'dev'.*train, val, test"):
        load_split("gsm8k-dspy", "dev")
    with pytest.raises(ConfigError, match="limit must be >= 0"):
        load_split("gsm8k-aflow", "val", limit=-1)


@pytest.mark.parametrize("name", ["gsm8k-dspy", "gsm8k-aflow", "hotpotqa-aflow", "hotpotqa-closedbook"])
def test_report_split_never_overlaps_train_or_search(name):
    proto = get_protocol(name)
    report = load_split(proto, proto.report_split)
    used = load_split(proto, proto.train_split) + load_split(proto, proto.search_split)
    assert not set(ids(report)) & set(ids(used))
    assert not {e.question for e in report} & {e.question for e in used}


# ------------------------------------------------------------------------------------- GSM8K


def test_gsm8k_dspy_matches_dspy_loader():
    """Same examples, order and gold answers as dspy.datasets.gsm8k.GSM8K (its code, on the raw files)."""
    def dspy_style(path):
        out = []
        for line in path.open():
            rec = json.loads(line)
            answer = rec["answer"].strip().split()
            assert answer[-2] == "####"
            out.append({"question": rec["question"], "answer": str(int(answer[-1].replace(",", "")))})
        return out

    train, test = dspy_style(PACKAGED / "gsm8k/train.jsonl"), dspy_style(PACKAGED / "gsm8k/test.jsonl")
    random.Random(0).shuffle(train)
    random.Random(0).shuffle(test)
    for split, expected in [("train", train[:200]), ("val", train[200:500]), ("test", test)]:
        got = [{"question": e.question, "answer": e.answer} for e in load_split("gsm8k-dspy", split)]
        assert got == expected, split


def test_gsm8k_example_fields():
    for proto in ("gsm8k-dspy", "gsm8k-aflow"):
        for e in load_split(proto, "test"):
            assert isinstance(e, dspy.Example)
            assert set(e.inputs().keys()) == {"question"}
            assert set(e.labels().keys()) == {"id", "answer", "solution"}
            assert "," not in e.answer and e.answer.lstrip("-").isdigit()
            assert "####" not in e.solution
    first = load_split("gsm8k-dspy", "train_all")[0]
    assert first.id == "gsm8k-train-0" and first.answer == "72"
    assert first.solution.endswith("72 clips altogether in April and May.")
    assert {"65960", "1875", "-3"} <= {e.answer for e in load_split("gsm8k-aflow", "val")}  # "65,960"


def test_gsm8k_aflow_is_the_official_test_set():
    official = {e.id: e for e in load_split("gsm8k-dspy", "test")}
    aflow = load_split("gsm8k-aflow", "val") + load_split("gsm8k-aflow", "test")
    assert sorted(ids(aflow)) == sorted(official)
    for e in aflow:
        assert (e.question, e.answer, e.solution) == (official[e.id].question, official[e.id].answer,
                                                      official[e.id].solution)


def test_gsm8k_gold_solutions_score_one():
    for e in load_split("gsm8k-dspy", "train_all") + load_split("gsm8k-dspy", "test"):
        assert gsm8k_metric(e, dspy.Prediction(answer=f"{e.solution}\n#### {e.answer}")) == 1.0


# ----------------------------------------------------------------------------------- HotpotQA


def test_hotpotqa_aflow_examples():
    val = load_split("hotpotqa-aflow", "val")
    for e in val + load_split("hotpotqa-aflow", "test"):
        assert set(e.inputs().keys()) == {"question", "context"}
        assert isinstance(e.context, list) and 2 <= len(e.context) <= 10
        assert all(isinstance(p, str) and p for p in e.context) and len(e.titles) == len(e.context)
        assert isinstance(e.id, str) and len(e.id) == 24
        for title, _ in e.supporting_facts:
            assert title in e.titles
        assert hotpot_em(e, e) == 1.0
        # official F1 scores an answer that normalises to "" as 0 even against itself ("The The", "!!!")
        assert hotpot_f1(e, e) == (1.0 if normalize_answer(e.answer) else 0.0)
    # AFlow's integer _id 37 is restored to the official id (see benchmarks/data/README.md)
    assert "5a80721b554299485f5985ef" in ids(val)
    first = val[0]
    # AFlow's layout: no title, the sentences joined by one space as they are (so some double spaces)
    assert first.titles[1] == "VIVA Poland"
    assert first.context[1].startswith('VIVA Polska (earlier "VIVApolska!")  is a Polish')


def test_hotpotqa_closedbook_partition():
    dev = load_split("hotpotqa-closedbook", "dev")
    parts = {s: load_split("hotpotqa-closedbook", s) for s in ("train", "val", "test")}
    assert dev[0].question == "Were Scott Derrickson and Ed Wood of the same nationality?"
    assert [e.dev_index for e in dev] == list(range(7405))
    indices = [set(e.dev_index for e in part) for part in parts.values()]
    assert set().union(*indices) == set(range(7405)) and sum(map(len, indices)) == 7405
    for e in dev[:50]:
        assert set(e.inputs().keys()) == {"question"} and "context" not in e
    # the partition is fixed (random.Random(20180925)); pin its first members
    assert [e.dev_index for e in parts["train"][:5]] == [14, 16, 27, 52, 119]
    assert [e.dev_index for e in parts["val"][:5]] == [22, 36, 107, 108, 126]


# ------------------------------------------------------------------------------ limit and seed


def test_limit_and_seed():
    full = ids(load_split("gsm8k-aflow", "test"))
    a = ids(load_split("gsm8k-aflow", "test", limit=20, seed=7))
    assert a == ids(load_split("gsm8k-aflow", "test", limit=20, seed=7))
    assert a != ids(load_split("gsm8k-aflow", "test", limit=20, seed=8))
    assert a == [i for i in full if i in set(a)]  # split order
    assert set(ids(load_split("gsm8k-aflow", "test", limit=5, seed=7))) <= set(a)  # nested
    assert ids(load_split("gsm8k-aflow", "test", limit=5, seed=None)) == full[:5]
    assert ids(load_split("gsm8k-aflow", "test", limit=5000)) == full
    assert load_split("gsm8k-aflow", "test", limit=0) == []


def test_examples_are_fresh_copies():
    first = load_split("hotpotqa-aflow", "val", limit=1, seed=None)[0]
    first.context.append("tampered")
    first.answer = "changed"
    again = load_split("hotpotqa-aflow", "val", limit=1, seed=None)[0]
    assert "tampered" not in again.context and again.answer != "changed"


# --------------------------------------------------------------------------------- checksums


def _copy(tmp_path, *relpaths):
    for rel in relpaths:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(PACKAGED / rel, tmp_path / rel)
    return tmp_path


def test_tampered_file_fails_checksum(tmp_path, monkeypatch):
    rel = "aflow_splits/gsm8k_validate.jsonl"
    intact = _copy(tmp_path / "intact", rel)
    monkeypatch.setenv(DATA_DIR_ENV, str(intact))
    assert len(load_split("gsm8k-aflow", "val")) == 264  # an intact copy elsewhere loads

    tampered = _copy(tmp_path / "tampered", rel)
    data = (tampered / rel).read_bytes()
    assert data.startswith(b'{"question": "Carol and Jennifer')
    (tampered / rel).write_bytes(data.replace(b"Carol", b"Karol", 1))  # one byte changed
    monkeypatch.setenv(DATA_DIR_ENV, str(tampered))
    with pytest.raises(DataError) as err:
        load_split("gsm8k-aflow", "val")
    message = str(err.value)
    expected = data_files.expected_checksums()[rel]
    assert f"benchmark data file {tampered / rel} fails its checksum" in message
    assert f"expected sha256 {expected}, got " in message
    actual = message.split(", got ")[1][:64]
    assert len(actual) == 64 and actual != expected
    assert "Fix: restore the original file" in message and DATA_DIR_ENV in message


def test_missing_file_is_data_error(tmp_path, monkeypatch):
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    with pytest.raises(DataError, match="is missing"):
        load_split("hotpotqa-aflow", "val")
    with pytest.raises(DataError, match="has no checksum"):
        verify_file("gsm8k/unknown.jsonl")


def test_checksum_is_verified_once_per_file(tmp_path, monkeypatch):
    root = _copy(tmp_path, "gsm8k/train.jsonl")
    monkeypatch.setenv(DATA_DIR_ENV, str(root))
    calls = []
    real = data_files.sha256
    monkeypatch.setattr(data_files, "sha256", lambda path: calls.append(path) or real(path))
    load_split("gsm8k-dspy", "train")
    load_split("gsm8k-dspy", "val")  # reads the same file again
    load_split("gsm8k-dspy", "train_all")
    assert calls == [root / "gsm8k/train.jsonl"]


def test_packaged_checksum_file_lists_every_data_file():
    listed = set(data_files.expected_checksums())
    on_disk = {str(p.relative_to(PACKAGED)) for p in PACKAGED.rglob("*")
               if p.is_file() and p.name not in ("SHA256SUMS", "README.md")}
    assert listed == on_disk
