"""Checks on a raw workflow document before anything is built from it.

A workflow file is shared data, so it may be anything: another encoding, a pickle, JSON nested
thousands deep, a 10 MB name, a lone surrogate, or a value of the wrong type where the IR expects an
object. Each of these is refused here with a :class:`~flowopt.errors.SchemaError` that names the
place and the fix, before any operator is built, so the loader itself only meets well-shaped data.

Example:
    >>> from flowopt.validate import parse_json
    >>> parse_json('{"a": [1, 2]}')
    {'a': [1, 2]}
    >>> parse_json('{"a": NaN}')
    Traceback (most recent call last):
    ...
    flowopt.errors.SchemaError: not valid workflow JSON: NaN is not a JSON number. Fix: write numbers as plain decimals
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flowopt.errors import SchemaError

MAX_FILE_BYTES = 64 * 1024 * 1024
MAX_DEPTH = 64  # workflow documents nest about 8 deep; demos may hold a few levels of their own
MAX_NAME_CHARS = 200  # node ids, field names, LM names, predictor names
MAX_KEY_CHARS = 1000  # any other object key (demo fields, meta)

_PICKLE_PROTOCOLS = range(2, 6)
_BOMS = {b"\xff\xfe\x00\x00": "UTF-32", b"\x00\x00\xfe\xff": "UTF-32", b"\xff\xfe": "UTF-16",
         b"\xfe\xff": "UTF-16"}


def read_document(path: Path) -> Any:
    """Read and parse a workflow file: UTF-8 JSON only (a UTF-8 byte order mark is allowed)."""
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise SchemaError(f"{path} is {size:,} bytes, over the {MAX_FILE_BYTES:,}-byte limit for a workflow file",
                          fix="pass a file written by Workflow.save (demos belong in a few KB)")
    return parse_json(decode(path.read_bytes(), source=str(path)))


def decode(data: bytes, *, source: str = "the document") -> str:
    """UTF-8 text of ``data``; other encodings and pickles are refused by name."""
    if len(data) >= 2 and data[0] == 0x80 and data[1] in _PICKLE_PROTOCOLS:
        raise SchemaError(f"{source} is a Python pickle, not workflow JSON",
                          fix="flowopt never unpickles; export the workflow with Workflow.save")
    for bom, name in _BOMS.items():
        if data.startswith(bom):
            raise SchemaError(f"{source} is {name} text, not UTF-8",
                              fix="re-save the file as UTF-8 (e.g. iconv -f UTF-16 -t UTF-8)")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise SchemaError(f"{source} is not UTF-8 text (byte {err.start}: {data[err.start:err.start + 1]!r})",
                          fix="re-save the file as UTF-8 JSON, e.g. with Workflow.save") from None


def _refuse_constant(name: str) -> Any:
    raise SchemaError(f"not valid workflow JSON: {name} is not a JSON number", fix="write numbers as plain decimals")


def parse_json(text: str | bytes) -> Any:
    """Parse workflow JSON; NaN/Infinity, over-deep nesting and unencodable strings are refused."""
    if isinstance(text, bytes | bytearray):
        text = decode(bytes(text))
    if not isinstance(text, str):
        raise SchemaError(f"expected JSON text, got a {type(text).__name__}", fix="pass the file's text")
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as err:
        raise SchemaError(f"not valid JSON ({_clip(str(err))})", fix="pass a file written by Workflow.save") from None
    except RecursionError:
        raise SchemaError("the JSON is nested too deeply to read",
                          fix=f"a workflow file nests at most {MAX_DEPTH} levels; pass one written by Workflow.save"
                          ) from None
    check_values(data)
    return data


def check_values(data: Any) -> None:
    """Depth, key length and text encodability of every value (iterative: no recursion limit to hit)."""
    stack: list[tuple[Any, int, str]] = [(data, 0, "$")]
    while stack:
        value, depth, where = stack.pop()
        if depth > MAX_DEPTH:
            raise SchemaError(f"the JSON nests deeper than {MAX_DEPTH} levels (at {_clip(where)})",
                              fix="pass a file written by Workflow.save")
        if isinstance(value, str):
            _check_text(value, where)
        elif isinstance(value, Mapping):
            for key, item in value.items():
                _check_text(key, where)
                if len(key) > MAX_KEY_CHARS:
                    raise SchemaError(f"an object key at {_clip(where)} is {len(key):,} characters long "
                                      f"(starts {_clip(key, 40)!r})", fix=f"keep keys under {MAX_KEY_CHARS} characters")
                stack.append((item, depth + 1, f"{where}.{_clip(key, 40)}"))
        elif isinstance(value, list):
            stack.extend((item, depth + 1, f"{where}[{i}]") for i, item in enumerate(value))


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise SchemaError(f"text at {_clip(where)} holds a lone surrogate (\\u{ord(text[err.start]):04x}) that "
                          "no UTF-8 file can store", fix="replace it with the character it was meant to be"
                          ) from None


def check_document(data: Any) -> None:
    """The shape of a workflow document: every part of the type the IR expects, names of sane length."""
    if not isinstance(data, Mapping):
        raise SchemaError(f"a workflow document must be a JSON object, got {_kind(data)}",
                          fix="pass a file written by Workflow.save")
    if "name" in data and not isinstance(data["name"], str):
        raise SchemaError(f"'name' must be a string, got {_kind(data['name'])}", field="name",
                          fix='write "name": "qa"')
    for key in ("lms", "weights", "meta"):
        if data.get(key) is not None and not isinstance(data[key], Mapping):
            raise SchemaError(f"'{key}' must be an object, got {_kind(data[key])}", field=key,
                              fix=f'write "{key}": {{}}')
    for name, spec in (data.get("lms") or {}).items():
        _name(name, "an LM name", "lms")
        if not isinstance(spec, Mapping):
            raise SchemaError(f"LM entry must be an object, got {_kind(spec)}", node=f"lms.{name}",
                              fix='write {"model": "openai/gpt-4o-mini"}')
    for key in ("inputs", "outputs"):
        fields = data.get(key)
        for field in fields if isinstance(fields, list) else []:
            _field(field, f"${key[:-1]}")
    nodes = data.get("nodes")
    for raw in nodes if isinstance(nodes, list) else []:
        if isinstance(raw, Mapping):
            _node(raw)
    edges = data.get("edges")
    for raw in edges if isinstance(edges, list) else []:
        if not isinstance(raw, Mapping):
            raise SchemaError(f"an edge must be an object, got {_kind(raw)}", field="edges",
                              fix='write {"src": "$input", "dst": "solve", "map": {"question": "question"}}')
        for end in ("src", "dst"):
            if end in raw and not isinstance(raw[end], str):
                raise SchemaError(f"an edge's '{end}' must be a node id string, got {_kind(raw[end])}",
                                  field="edges", fix=f'write "{end}": "solve" (one edge per pair of nodes)')
            if end in raw:
                _name(raw[end], f"an edge's '{end}'", "edges")
        mapping = raw.get("map")
        if mapping is not None and (not isinstance(mapping, Mapping)
                                    or not all(isinstance(v, str) for v in mapping.values())):
            raise SchemaError(f"an edge's 'map' must map field names to field names, got {_kind(mapping)}",
                              field="edges", fix='write "map": {"answer": "answer"}')


def _node(raw: Mapping[str, Any]) -> None:
    node_id = raw.get("id")
    if isinstance(node_id, str):
        _name(node_id, "a node id", "nodes")
    where = _clip(str(node_id), 60)
    signature = raw.get("signature")
    if isinstance(signature, Mapping):
        if not isinstance(signature.get("instructions", ""), str):
            raise SchemaError("'instructions' must be a string", node=where, field="signature",
                              fix='write "instructions": "Answer briefly."')
        for key in ("inputs", "outputs"):
            fields = signature.get(key, [])
            if not isinstance(fields, list):
                raise SchemaError(f"signature '{key}' must be a list, got {_kind(fields)}", node=where,
                                  field="signature", fix=f'write "{key}": [{{"name": "question", "type": "str"}}]')
            for field in fields:
                _field(field, where)
    predictors = raw.get("predictors")
    if predictors is None:
        return
    if not isinstance(predictors, Mapping):
        raise SchemaError(f"'predictors' must be an object, got {_kind(predictors)}", node=where, field="predictors",
                          fix='write "predictors": {"predict": {"demos": []}}')
    for name, state in predictors.items():
        _name(name, "a predictor name", where)
        if not isinstance(state, Mapping):
            raise SchemaError(f"predictor '{_clip(name, 60)}' state must be an object, got {_kind(state)}",
                              node=where, field="predictors", fix='write {"demos": []}')
        demos = state.get("demos", [])
        if not isinstance(demos, list) or not all(isinstance(d, Mapping) for d in demos):
            raise SchemaError(f"predictor '{_clip(name, 60)}' demos must be a list of objects", node=where,
                              field="predictors", fix='write "demos": [{"question": "...", "answer": "..."}]')
        if "signature" in state and not isinstance(state["signature"], Mapping):
            raise SchemaError(f"predictor '{_clip(name, 60)}' signature state must be an object", node=where,
                              field="predictors", fix="re-export the workflow with flowopt")


def _field(field: Any, where: str) -> None:
    if isinstance(field, str):
        _name(field, "a field name", where)
        return
    if not isinstance(field, Mapping):
        raise SchemaError(f"a signature field must be an object, got {_kind(field)}", node=where,
                          fix='write {"name": "question", "type": "str"}')
    for key in ("name", "type", "desc"):
        if key in field and not isinstance(field[key], str):
            raise SchemaError(f"a field's '{key}' must be a string, got {_kind(field[key])}", node=where,
                              fix='write {"name": "question", "type": "str", "desc": ""}')
    if isinstance(field.get("name"), str):
        _name(field["name"], "a field name", where)


def _name(name: Any, what: str, where: str) -> None:
    if isinstance(name, str) and len(name) > MAX_NAME_CHARS:
        raise SchemaError(f"{what} in {_clip(where, 60)} is {len(name):,} characters long "
                          f"(starts {_clip(name, 40)!r})", fix=f"use names of at most {MAX_NAME_CHARS} characters")


def _kind(value: Any) -> str:
    return f"{type(value).__name__} {_clip(repr(value), 60)}"


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else f"{text[:limit]}..."
