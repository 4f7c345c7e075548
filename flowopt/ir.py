"""The workflow JSON IR (``flowopt.workflow/v1``): to and from plain data, with full validation.

Loading only reads data: operators are looked up by name in the registry, types in a fixed table,
LMs are described by model name and settings. Nothing is unpickled or evaluated.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, TypeVar

from flowopt.errors import SchemaError, WorkflowError
from flowopt.lm_spec import LoadedLMSpec, lm_to_spec
from flowopt.operator import Operator
from flowopt.registry import get_operator
from flowopt.signature import FieldSpec, SignatureSpec
from flowopt.validate import check_document, parse_json
from flowopt.version import __version__
from flowopt.workflow_graph import INPUT, OUTPUT, WorkflowGraph

SCHEMA = "flowopt.workflow/v1"
_TOP_KEYS = {"schema", "name", "inputs", "outputs", "nodes", "edges", "lms", "weights", "meta"}
_NODE_KEYS = {"id", "op", "signature", "config", "lm", "predictors"}


def dumps(data: Any, *, indent: int | None = 2, sort_keys: bool = False) -> str:
    try:
        text = json.dumps(data, indent=indent, sort_keys=sort_keys, ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")  # a lone surrogate would fail only when the file is written
        return text
    except (TypeError, ValueError) as err:  # UnicodeEncodeError is a ValueError
        raise SchemaError(f"the workflow holds a value JSON cannot store ({err})",
                          fix="keep settings, demos and meta to plain JSON values") from err


def canonical_dumps(data: Mapping[str, Any]) -> str:
    """The canonical JSON of workflow IR data: sorted keys, nodes by id, edges by ends, no ``meta``."""
    canonical = {k: v for k, v in data.items() if k != "meta"}
    canonical["nodes"] = sorted(data.get("nodes", []), key=lambda n: str(n.get("id")))
    canonical["edges"] = sorted(data.get("edges", []), key=lambda e: (str(e.get("src")), str(e.get("dst"))))
    return dumps(canonical, indent=None, sort_keys=True)


def loads(text: str | bytes) -> Any:
    return parse_json(text)


def workflow_to_dict(wf: WorkflowGraph) -> dict[str, Any]:
    nodes = []
    for node_id, op in wf.nodes.items():
        nodes.append({
            "id": node_id,
            "op": type(op).op_name,
            "signature": op.spec.to_dict(),
            "config": op.config(),
            "lm": wf.node_lms.get(node_id),
            "predictors": op.predictor_state(),
        })
    edges = [{"src": u, "dst": v, "map": dict(m)} for u, v, m in wf.edges()]
    lms = {name: (dict(lm) if isinstance(lm, Mapping) else lm_to_spec(lm)) for name, lm in wf.lms.items()}
    import dspy

    meta = {"flowopt": __version__, "dspy": dspy.__version__, **wf.meta}
    return {
        "schema": SCHEMA,
        "name": wf.name,
        "inputs": [f.to_dict() for f in wf.io.inputs],
        "outputs": [f.to_dict() for f in wf.io.outputs],
        "nodes": nodes,
        "edges": edges,
        "lms": lms,
        "weights": dict(wf.weights),
        "meta": meta,
    }


def _fields(data: Any, key: str) -> tuple[FieldSpec, ...]:
    if not isinstance(data, list) or not data:
        raise SchemaError(f"'{key}' must be a non-empty list of fields", field=key,
                          fix=f'write "{key}": [{{"name": "question", "type": "str"}}]')
    # A bare name is shorthand for a str field.
    return tuple(FieldSpec.from_dict({"name": f} if isinstance(f, str) else f, node=f"${key[:-1]}")
                 for f in data)


GraphT = TypeVar("GraphT", bound=WorkflowGraph)


def workflow_from_dict(data: Any, cls: type[GraphT]) -> GraphT:
    """Build and validate a workflow of class ``cls`` (:class:`~flowopt.workflow.Workflow`) from IR data;
    every failure names node, field and fix. ``Workflow.from_dict`` and :func:`flowopt.load` call it."""
    check_document(data)
    schema = data.get("schema")
    if schema != SCHEMA:
        raise SchemaError(f"unsupported schema {schema!r}", field="schema",
                          fix=f'this flowopt reads "{SCHEMA}"; re-export the workflow or upgrade flowopt')
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise SchemaError(f"unknown top-level keys {sorted(unknown)}", field=sorted(unknown)[0],
                          fix=f"use only {sorted(_TOP_KEYS)}")
    io = SignatureSpec("", _fields(data.get("inputs"), "inputs"), _fields(data.get("outputs"), "outputs"))
    lms: dict[str, Any] = {}
    for name, spec in (data.get("lms") or {}).items():
        if not isinstance(spec, Mapping) or not isinstance(spec.get("model"), str):
            raise SchemaError("an LM entry needs a 'model' string", node=f"lms.{name}", field="model",
                              fix='write {"model": "openai/gpt-4o-mini"}')
        lms[name] = LoadedLMSpec(spec)  # built lazily on first use; may not choose endpoints
    raw_nodes = data.get("nodes")
    if not isinstance(raw_nodes, list):
        raise SchemaError("'nodes' must be a list", field="nodes", fix="write \"nodes\": [...]")
    nodes: dict[str, Operator] = {}
    node_lms: dict[str, str | None] = {}
    for raw in raw_nodes:
        node_id, op, lm = _node_from_dict(raw)
        if node_id in nodes:
            raise WorkflowError("duplicate node id", node=node_id, fix="give every node a distinct id")
        nodes[node_id], node_lms[node_id] = op, lm
    raw_edges = data.get("edges")
    if not isinstance(raw_edges, list):
        raise SchemaError("'edges' must be a list", field="edges", fix="write \"edges\": [...]")
    edges: list[tuple[str, str, dict[str, str]]] = []
    for raw in raw_edges:
        if not isinstance(raw, Mapping) or not {"src", "dst", "map"} <= set(raw):
            raise SchemaError(f"an edge needs 'src', 'dst' and 'map', got {raw!r}", field="edges",
                              fix='write {"src": "$input", "dst": "solve", "map": {"question": "question"}}')
        src, dst, mapping = raw["src"], raw["dst"], raw["map"]
        for end in (src, dst):
            if end not in nodes and end not in (INPUT, OUTPUT):
                raise WorkflowError("an edge refers to a node that does not exist", node=str(end),
                                    fix=f"declare it in 'nodes' or use one of {[INPUT, OUTPUT, *nodes]}")
        if not isinstance(mapping, Mapping) or not all(isinstance(v, str) for v in mapping.values()):
            raise SchemaError(f"edge {src} -> {dst}: 'map' must map field names to field names",
                              node=str(dst), fix='write "map": {"answer": "answer"}')
        edges.append((src, dst, dict(mapping)))
    meta = dict(data.get("meta") or {})
    meta.pop("flowopt", None)
    meta.pop("dspy", None)
    # from_graph keeps the loaded wiring exactly and validates the whole graph.
    wf = cls.from_graph(io, nodes, edges, name=str(data.get("name", "workflow")), node_lms=node_lms,
                             lms=lms, weights=dict(data.get("weights") or {}), meta=meta)
    for node_id, lm_name in wf.node_lms.items():
        if lm_name is not None and lm_name not in wf.lms:
            raise WorkflowError(f"node uses LM {lm_name!r}, which 'lms' does not define", node=node_id,
                                field="lm", fix=f"add {lm_name!r} to 'lms' or set the node's lm to null")
    return wf


def _node_from_dict(raw: Any) -> tuple[str, Operator, str | None]:
    if not isinstance(raw, Mapping) or not isinstance(raw.get("id"), str):
        raise SchemaError(f"a node needs an 'id' string, got {raw!r}", field="nodes",
                          fix='write {"id": "solve", "op": "Predict", "signature": {...}}')
    node_id = raw["id"]
    unknown = set(raw) - _NODE_KEYS
    if unknown:
        raise SchemaError(f"unknown node keys {sorted(unknown)}", node=node_id, field=sorted(unknown)[0],
                          fix=f"use only {sorted(_NODE_KEYS)}")
    if not isinstance(raw.get("op"), str):
        raise SchemaError("a node needs an 'op' string", node=node_id, field="op",
                          fix="name a registered operator, e.g. \"Predict\"")
    op_cls = get_operator(raw["op"], node=node_id)
    spec = SignatureSpec.from_dict(raw.get("signature"), node=node_id)
    config = raw.get("config") or {}
    if not isinstance(config, Mapping):
        raise SchemaError("'config' must be an object", node=node_id, field="config", fix='write "config": {}')
    op = op_cls.from_config(spec, dict(config), node=node_id)
    declared = op.spec
    if declared.input_names != spec.input_names or declared.output_names != spec.output_names:
        raise WorkflowError(f"{raw['op']} with this config declares {declared.input_names} -> "
                            f"{declared.output_names}, not the saved {spec.input_names} -> {spec.output_names}",
                            node=node_id, field="signature", fix="re-export the workflow with flowopt")
    op.load_predictor_state(raw.get("predictors") or {}, node=node_id)
    lm = raw.get("lm")
    if lm is not None and not isinstance(lm, str):
        raise SchemaError("'lm' must be an LM name or null", node=node_id, field="lm",
                          fix='write "lm": "default" or "lm": null')
    return node_id, op, lm
