"""Loading hostile or careless workflow files: every case a named flowopt error with the fix.

Two suites: named cases (encodings, pickles, nesting, wrong types, out-of-bounds settings, huge and
unencodable names), and a sweep that replaces each value of a full workflow document, one at a time,
with values of the wrong type. Neither may end in a raw exception, and a failed load or save writes
nothing.
"""

from __future__ import annotations

import copy
import json
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import flowopt
from flowopt import ConfigError, FlowoptError, SchemaError
from flowopt.errors import MAX_MESSAGE_CHARS
from flowopt.modules import ChainOfThought, Custom, Predict, Programmer, Refine, Retrieve, ScEnsemble


def full_workflow() -> flowopt.Workflow:
    """One node of every built-in operator, with demos, an LM entry, weights and meta."""
    wf = (flowopt.Workflow("question, context: list[str] -> answer", name="every-op")
          .add("find", Retrieve(k=2))
          .add("draft", Predict("question, passages: list[str] -> draft", temperature=0.0), lm="default")
          .add("think", ChainOfThought("question, draft -> notes"))
          .add("vote", ScEnsemble("question, notes -> guess", n=3))
          .add("code", Programmer("question, guess -> program_answer"))
          .add("polish", Refine("question, program_answer -> polished", max_rounds=2))
          .add("final", Custom("question, polished -> answer", instruction="Answer in one word.")))
    wf.lms["default"] = {"model": "openai/gpt-4o-mini", "temperature": 0.0}
    wf.weights = {"student": "gemma"}
    wf.meta = {"note": "for the bad-input suite"}
    return wf


@pytest.fixture(scope="module")
def good() -> dict[str, Any]:
    data = full_workflow().to_dict()
    data["nodes"][1]["predictors"]["predict"]["demos"] = [{"question": "q", "passages": ["p"], "draft": "d"}]
    flowopt.Workflow.from_dict(copy.deepcopy(data))  # the base document itself loads
    return data


def assert_named_error(err: BaseException) -> None:
    assert isinstance(err, FlowoptError), f"raw {type(err).__name__}: {err}"
    message = str(err)
    assert "Fix:" in message, message
    assert len(message) <= MAX_MESSAGE_CHARS + 200, len(message)


def load_bytes(tmp_path: Path, data: bytes) -> flowopt.Workflow:
    path = tmp_path / "wf.json"
    path.write_bytes(data)
    return flowopt.load(path)


def node(data: dict[str, Any], node_id: str) -> dict[str, Any]:
    return next(n for n in data["nodes"] if n["id"] == node_id)


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        target = data
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return edit


def _config(node_id: str, **config: Any) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        node(data, node_id)["config"].update(config)
    return edit


def _edge_src(value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        data["edges"][0]["src"] = value
    return edit


def _demos(value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        node(data, "draft")["predictors"]["predict"]["demos"] = value
    return edit


def _predictors(value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        node(data, "draft")["predictors"] = value
    return edit


def _field_name(name: str) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        data["inputs"][0]["name"] = name
    return edit


DOCUMENT_CASES: dict[str, tuple[Callable[[dict[str, Any]], None], type[FlowoptError]]] = {
    "lms is a list": (_set(("lms",), ["openai/gpt-4o-mini"]), SchemaError),
    "lms entry is a string": (_set(("lms", "default"), "openai/gpt-4o-mini"), SchemaError),
    "weights is a string": (_set(("weights",), "gemma"), SchemaError),
    "meta is a list": (_set(("meta",), [1, 2]), SchemaError),
    "name is an object": (_set(("name",), {"a": 1}), SchemaError),
    "predictors is a list": (_predictors([]), SchemaError),
    "predictor state is a string": (_predictors({"predict": "demos"}), SchemaError),
    "demos is an object": (_demos({"question": "q"}), SchemaError),
    "a demo is a string": (_demos(["q -> a"]), SchemaError),
    "edge src is a list": (_edge_src(["$input"]), SchemaError),
    "edge src is a number": (_edge_src(3), SchemaError),
    "ScEnsemble temperature 'hot'": (_config("vote", temperature="hot"), ConfigError),
    "ScEnsemble n = 10**9": (_config("vote", n=10**9), ConfigError),
    "ScEnsemble n = 0": (_config("vote", n=0), ConfigError),
    "ScEnsemble select unknown": (_config("vote", select="best"), ConfigError),
    "Programmer timeout_s 'abc'": (_config("code", timeout_s="abc"), ConfigError),
    "Programmer max_attempts 2.5": (_config("code", max_attempts=2.5), ConfigError),
    "Programmer memory_mb true": (_config("code", memory_mb=True), ConfigError),
    "Programmer on_failure unknown": (_config("code", on_failure="ignore"), ConfigError),
    "Custom instruction 123": (_config("final", instruction=123), ConfigError),
    "Refine max_rounds 1000": (_config("polish", max_rounds=1000), ConfigError),
    "Retrieve k as a string": (_config("find", k="3"), ConfigError),
    "Predict temperature 5": (_config("draft", temperature=5), ConfigError),
    "ChainOfThought temperature a list": (_config("think", temperature=[0.1]), ConfigError),
    "a setting the operator lacks": (_config("draft", wings=2), FlowoptError),
    "field name of 10 MB": (_field_name("x" * 10_000_000), SchemaError),
    "field type a list": (_set(("inputs", 0, "type"), ["str"]), SchemaError),
    "signature inputs an object": (lambda d: node(d, "draft")["signature"].update(inputs={"a": 1}), SchemaError),
    "instructions a number": (lambda d: node(d, "draft")["signature"].update(instructions=5), SchemaError),
}

# Raw file contents: each refused before it is parsed as a workflow.
FILE_CASES: dict[str, Callable[[bytes], bytes]] = {
    "UTF-16 with BOM": lambda good: good.decode().encode("utf-16"),
    "UTF-16-LE without BOM": lambda good: good.decode().encode("utf-16-le"),
    "Latin-1 byte": lambda good: good.replace(b'"every-op"', b'"caf\xe9"'),
    "a pickle of the document": lambda good: pickle.dumps(json.loads(good)),
    "a pickle of protocol 2": lambda good: pickle.dumps({"schema": 1}, protocol=2),
    "random binary": lambda good: bytes(range(256)) * 4,
    "truncated JSON": lambda good: good[: len(good) // 2],
    "empty file": lambda good: b"",
    "JSON nested 10,000 deep": lambda good: b"[" * 10_000 + b"]" * 10_000,
    "object nested 100,000 deep": lambda good: b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    "NaN in meta": lambda good: good.replace(b'"for the bad-input suite"', b"NaN"),
    "Infinity temperature": lambda good: good.replace(b'"temperature": 0.0', b'"temperature": Infinity', 1),
    "lone surrogate in the name": lambda good: good.replace(b'"every-op"', b'"every\\ud800op"'),
    "lone surrogate in a node id": lambda good: good.replace(b'"id": "vote"', b'"id": "vo\\udfffte"'),
    "a JSON list": lambda good: b"[1, 2, 3]",
    "a JSON string": lambda good: b'"workflow"',
}


REPLACEMENTS: list[Any] = [None, 0, -1, 2.5, True, "", "x", [], [1], {}, {"a": 1}, [[[]]]]


def sweep_documents(good: dict[str, Any], per_path: int = len(REPLACEMENTS)
                    ) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every value of the document (each path), replaced by wrong-typed values: all of them, or
    ``per_path`` of them taken in rotation so that every replacement still meets many paths."""

    def paths(value: Any, prefix: tuple[Any, ...]) -> Iterator[tuple[Any, ...]]:
        if isinstance(value, dict):
            for key, item in value.items():
                yield (*prefix, key)
                yield from paths(item, (*prefix, key))
        elif isinstance(value, list):
            for index, item in enumerate(value):
                yield (*prefix, index)
                yield from paths(item, (*prefix, index))

    for number, path in enumerate(paths(good, ())):
        for k in range(per_path):
            replacement = REPLACEMENTS[(number * per_path + k) % len(REPLACEMENTS)]
            data = copy.deepcopy(good)
            target = data
            for key in path[:-1]:
                target = target[key]
            if target[path[-1]] == replacement and type(target[path[-1]]) is type(replacement):
                continue
            target[path[-1]] = replacement
            yield f"{'.'.join(map(str, path))} = {replacement!r}", data


@pytest.mark.parametrize("case", sorted(DOCUMENT_CASES))
def test_bad_documents_get_named_errors(case, good, tmp_path):
    edit, error = DOCUMENT_CASES[case]
    data = copy.deepcopy(good)
    edit(data)
    with pytest.raises(error) as info:
        flowopt.Workflow.from_dict(data)
    assert_named_error(info.value)
    path = tmp_path / "wf.json"  # the same through a file
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(error):
        flowopt.load(path)


@pytest.mark.parametrize("case", sorted(FILE_CASES))
def test_bad_files_get_named_errors(case, good, tmp_path):
    raw = FILE_CASES[case](json.dumps(good, indent=2).encode("utf-8"))
    with pytest.raises(SchemaError) as info:
        load_bytes(tmp_path, raw)
    assert_named_error(info.value)
    with pytest.raises(SchemaError):  # from_json takes text or bytes and refuses the same
        flowopt.Workflow.from_json(raw)
    assert [p.name for p in tmp_path.iterdir()] == ["wf.json"]  # nothing written beside it


def test_huge_names_give_short_messages(good):
    data = copy.deepcopy(good)
    node(data, "vote")["config"]["vote_field"] = "v" * 5_000_000
    with pytest.raises(FlowoptError) as info:
        flowopt.Workflow.from_dict(data)
    assert_named_error(info.value)
    assert "more characters" in str(info.value) or "characters long" in str(info.value)


def check_sweep(good: dict[str, Any], per_path: int) -> int:
    tried = 0
    failures: list[str] = []
    for label, data in sweep_documents(good, per_path):
        tried += 1
        try:
            flowopt.Workflow.from_dict(data)
        except FlowoptError as err:
            if "Fix:" not in str(err):
                failures.append(f"{label}: no fix in {err}")
        except Exception as err:  # the point of the sweep: anything else is a raw traceback
            failures.append(f"{label}: raw {type(err).__name__}: {str(err)[:200]}")
    assert not failures, f"{len(failures)} of {tried} escaped:\n" + "\n".join(failures[:40])
    return tried


def test_one_value_sweep_never_escapes_as_a_raw_error(good):
    assert check_sweep(good, per_path=2) > 500


@pytest.mark.slow
def test_full_one_value_sweep_never_escapes_as_a_raw_error(good):
    assert check_sweep(good, per_path=len(REPLACEMENTS)) > 3000


def test_a_loaded_workflow_saves_and_a_refused_save_writes_nothing(good, tmp_path):
    wf = flowopt.Workflow.from_dict(copy.deepcopy(good))
    assert flowopt.load(wf.save(tmp_path / "ok.json")).canonical_json() == wf.canonical_json()
    wf.name = "bad\ud800name"  # built in Python, where no loader checked it
    with pytest.raises(SchemaError) as info:
        wf.save(tmp_path / "bad.json")
    assert_named_error(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.json"]


def test_a_utf8_bom_is_accepted(good, tmp_path):
    wf = load_bytes(tmp_path, b"\xef\xbb\xbf" + json.dumps(good).encode("utf-8"))
    assert wf.node_ids == [n["id"] for n in good["nodes"]]
