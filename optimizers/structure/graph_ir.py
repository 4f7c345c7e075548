"""Small operations on a workflow's JSON IR (``wf.to_dict()``) that the structure edits are made of:
find, add and delete nodes, rewire edges, and walk the graph.

Example:
    >>> from flowopt.optimizers.structure.graph_ir import unique_id
    >>> unique_id({"nodes": [{"id": "solve"}]}, "solve")
    'solve2'
"""

from __future__ import annotations

from typing import Any

from flowopt.errors import WorkflowError
from flowopt.registry import get_operator
from flowopt.signature import SignatureSpec

IR = dict[str, Any]
#: The instruction of the selector node that ``AddProgrammer`` adds (how the edits recognise it).
SELECT_INSTRUCTION = (
    "Several candidate answers to the same inputs follow, one from step-by-step reasoning and one from "
    "running a program (empty when the program failed). Pick the candidate most likely correct and "
    "give it as the final answer."
)


def find_node(data: IR, node_id: str) -> IR | None:
    """The node ``node_id`` of the IR, or ``None``."""
    return next((n for n in data["nodes"] if n["id"] == node_id), None)


def new_node(node_id: str, op: str, signature: IR, config: IR, lm: str | None) -> IR:
    """A new node entry (no demos yet)."""
    return {"id": node_id, "op": op, "signature": signature, "config": config, "lm": lm, "predictors": {}}


def unique_id(data: IR, base: str) -> str:
    """``base``, or ``base2``, ``base3``... : an id no node of the IR has."""
    taken = {n["id"] for n in data["nodes"]}
    candidate, i = base, 2
    while candidate in taken:
        candidate, i = f"{base}{i}", i + 1
    return candidate


def is_selector(node: IR) -> bool:
    """Whether ``node`` is the selector ``AddProgrammer`` adds."""
    return node["op"] == "Custom" and node["signature"].get("instructions") == SELECT_INSTRUCTION


def replace_op(node: IR, op: str, config: IR) -> None:
    """Change a node's operator in place, moving its main predictor's demos to the new operator."""
    old: dict[str, Any] = node.get("predictors") or {}
    main: dict[str, Any] = next(iter(old.values()), {})
    demos = main.get("demos", [])
    spec = SignatureSpec.from_dict(node["signature"], node=node["id"])
    fresh = get_operator(op).from_config(spec, dict(config), node=node["id"])
    main = fresh.named_predictors()[0][0]
    node["op"], node["config"] = op, config
    node["predictors"] = {main: {"demos": demos}} if demos else {}


def sources_of(data: IR, node_id: str) -> dict[str, tuple[str, str]]:
    """Where each input field of ``node_id`` comes from: ``{field: (src node, src field)}``."""
    return {dst_f: (e["src"], src_f) for e in data["edges"] if e["dst"] == node_id
            for src_f, dst_f in e["map"].items()}


def consumers_of(data: IR, node_id: str) -> list[tuple[str, str, str]]:
    """Who reads ``node_id``'s outputs: ``[(dst node, src field, dst field)]``."""
    return [(e["dst"], src_f, dst_f) for e in data["edges"] if e["src"] == node_id
            for src_f, dst_f in e["map"].items()]


def add_map(data: IR, src: str, dst: str, src_field: str, dst_field: str) -> None:
    """Feed ``dst.dst_field`` from ``src.src_field`` (refused when that source feeds another input of ``dst``)."""
    edge = next((e for e in data["edges"] if e["src"] == src and e["dst"] == dst), None)
    if edge is None:
        data["edges"].append({"src": src, "dst": dst, "map": {src_field: dst_field}})
    elif src_field in edge["map"] and edge["map"][src_field] != dst_field:
        # A map is keyed by source field; one source field feeding two inputs of the same node
        # cannot be stored, so the IR refuses it rather than silently dropping one.
        raise WorkflowError(f"{src}.{src_field} would feed two inputs of {dst}", node=dst, field=dst_field,
                            fix="choose another edit")
    else:
        edge["map"][src_field] = dst_field


def drop_map(data: IR, src: str, dst: str, dst_field: str) -> None:
    """Stop feeding ``dst.dst_field`` from ``src``."""
    for edge in data["edges"]:
        if edge["src"] == src and edge["dst"] == dst:
            edge["map"] = {s: d for s, d in edge["map"].items() if d != dst_field}
    data["edges"] = [e for e in data["edges"] if e["map"]]


def move_consumers(data: IR, old_src: str, old_field: str, new_src: str, new_field: str) -> None:
    """Every edge reading ``old_src.old_field`` reads ``new_src.new_field`` instead."""
    moves: list[tuple[str, str]] = []
    for edge in data["edges"]:
        if edge["src"] == old_src and old_field in edge["map"] and edge["dst"] != new_src:
            moves.append((edge["dst"], edge["map"].pop(old_field)))
    data["edges"] = [e for e in data["edges"] if e["map"]]
    for dst, dst_field in moves:
        add_map(data, new_src, dst, new_field, dst_field)


def pass_through(inputs: list[IR], out: IR) -> str | None:
    """The input of ``inputs`` that can stand in for output ``out`` when its node is removed: the same
    name, a Refine's ``draft_`` of it, a ``*_name`` one, or the only one of its (non-str) type; else ``None``."""
    same_name = next((f["name"] for f in inputs if f["name"] == out["name"]), None)
    if same_name:
        return same_name
    if any(f["name"] == f"draft_{out['name']}" for f in inputs):  # a Refine: back to its draft
        return f"draft_{out['name']}"
    suffixed = next((f["name"] for f in inputs if f["name"].endswith(f"_{out['name']}")), None)
    if suffixed:
        return suffixed
    same_type = [f["name"] for f in inputs if f["type"] == out["type"]]
    return same_type[0] if len(same_type) == 1 and out["type"] != "str" else None


def ancestors_of(data: IR, node_id: str) -> set[str]:
    """Every node ``node_id`` depends on (through edges)."""
    parents: dict[str, set[str]] = {}
    for edge in data["edges"]:
        parents.setdefault(edge["dst"], set()).add(edge["src"])
    seen: set[str] = set()
    stack = [node_id]
    while stack:
        for parent in parents.get(stack.pop(), ()):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def delete_node(data: IR, node_id: str) -> None:
    """Remove ``node_id`` and every edge to or from it."""
    data["nodes"] = [n for n in data["nodes"] if n["id"] != node_id]
    data["edges"] = [e for e in data["edges"] if node_id not in (e["src"], e["dst"])]
