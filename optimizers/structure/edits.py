"""Typed edits of a workflow graph: the moves of structure search.

Each edit is a small frozen dataclass that transforms the workflow's JSON IR (``wf.to_dict()``) and
rebuilds it with ``Workflow.from_dict``, which validates everything (acyclic, every input fed once,
types compatible, operator settings) before any LM call. A refused edit raises :class:`InvalidEdit`
with the reason. Nodes an edit does not touch keep their demos and instructions because their IR
entries are copied unchanged. Every edit serialises to a plain dict (``{"kind": ..., ...}``) so a
search log can be replayed with :func:`edit_from_dict`.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any, ClassVar

from flowopt.errors import FlowoptError, WorkflowError
from flowopt.optimizers.structure.graph_ir import (
    IR,
    SELECT_INSTRUCTION,
    add_map,
    ancestors_of,
    consumers_of,
    delete_node,
    drop_map,
    find_node,
    is_selector,
    move_consumers,
    new_node,
    pass_through,
    replace_op,
    sources_of,
    unique_id,
)
from flowopt.registry import get_operator
from flowopt.workflow import INPUT, OUTPUT, Workflow

# Operators over the same signature that answer with one LM call (or a vote of them): any can become
# any other, so every wrap has its unwrap.
SWAPPABLE = ("Predict", "ChainOfThought")
ENSEMBLE = "ScEnsemble"
# Operators whose single LM answer can be sampled, refined or checked by a program.
ANSWERING = ("Predict", "ChainOfThought", "ScEnsemble", "Custom")
_EDIT_KINDS: dict[str, type[Edit]] = {}


class InvalidEdit(WorkflowError):
    """An edit cannot be applied to this workflow; ``reason`` says why (before any LM call)."""

    def __init__(self, edit: Edit | Mapping[str, Any] | None, reason: str, *, node: str | None = None) -> None:
        self.edit = edit.to_dict() if isinstance(edit, Edit) else (dict(edit) if edit is not None else None)
        self.reason = reason
        what = edit.describe() if isinstance(edit, Edit) else f"edit {self.edit!r}"
        super().__init__(f"{what} is invalid: {reason}", node=node,
                         fix="propose another edit from the vocabulary")


@dataclasses.dataclass(frozen=True)
class Edit(abc.ABC):
    """Base class: ``apply(workflow) -> new workflow`` (the input is never mutated).

    Example:
        >>> from flowopt import Workflow
        >>> from flowopt.modules import Predict
        >>> from flowopt.optimizers.structure.edits import SwapOperator, edit_from_dict
        >>> wf = Workflow("question -> answer").add("solve", Predict("question -> answer"))
        >>> edit = SwapOperator("solve", "ChainOfThought")
        >>> edit.apply(wf).nodes["solve"].op_name
        'ChainOfThought'
        >>> edit_from_dict(edit.to_dict()) == edit
        True
    """

    kind: ClassVar[str] = ""
    node: str

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.kind:
            _EDIT_KINDS[cls.kind] = cls

    # -- public API ------------------------------------------------------------------------------
    def apply(self, workflow: Workflow, *, ir: IR | None = None) -> Workflow:
        """Return the edited workflow, validated; raise :class:`InvalidEdit` with the reason.

        ``ir`` is ``workflow.to_dict()`` when the caller already has it (it is not modified): a
        proposer that tries many edits of one workflow serialises it once.
        """
        return self.build(workflow, self.apply_ir(workflow.to_dict() if ir is None else ir))

    def build(self, workflow: Workflow, data: IR) -> Workflow:
        """The workflow of edited IR ``data`` (from :meth:`apply_ir` on ``workflow``), validated; it keeps
        ``workflow``'s LM clients. Raises :class:`InvalidEdit` when the result does not validate."""
        try:
            new = Workflow.from_dict(data)
        except FlowoptError as err:
            raise InvalidEdit(self, f"the result does not validate: {err}", node=self.node) from err
        # to_dict turns live LM clients into specs; keep the caller's clients (they hold engines,
        # caches and keys that a spec cannot carry).
        new.lms.update({name: lm for name, lm in workflow.lms.items() if name in new.lms})
        return new

    def apply_ir(self, ir: IR) -> IR:
        """The edited IR data (a new dict; ``ir`` is not modified), before ``Workflow.from_dict`` validates it.

        Raises :class:`InvalidEdit` when a precondition of the edit fails.
        """
        data = copy.deepcopy(ir)
        node = find_node(data, self.node)
        if node is None:
            raise InvalidEdit(self, f"no node {self.node!r} (nodes: {[n['id'] for n in data['nodes']]})",
                              node=self.node)
        try:
            self._transform(data, node)
        except InvalidEdit:
            raise
        except FlowoptError as err:
            raise InvalidEdit(self, err.problem, node=self.node) from err
        return data

    @abc.abstractmethod
    def describe(self) -> str:
        """One line for logs and reports."""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **dataclasses.asdict(self)}

    # -- subclass hook ---------------------------------------------------------------------------
    @abc.abstractmethod
    def _transform(self, data: IR, node: IR) -> None:
        """Change ``data`` in place; raise :class:`InvalidEdit` when a precondition fails."""


def edit_from_dict(data: Mapping[str, Any]) -> Edit:
    """Rebuild an edit from :meth:`Edit.to_dict` output; raises :class:`InvalidEdit` on bad data."""
    if not isinstance(data, Mapping) or not isinstance(data.get("kind"), str):
        raise InvalidEdit(dict(data) if isinstance(data, Mapping) else None,
                          f"an edit must be an object with a 'kind' (one of {sorted(_EDIT_KINDS)})")
    cls = _EDIT_KINDS.get(data["kind"])
    if cls is None:
        raise InvalidEdit(data, f"unknown kind {data['kind']!r}; use one of {sorted(_EDIT_KINDS)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    params = {k: v for k, v in data.items() if k != "kind"}
    unknown = sorted(set(params) - set(fields))
    missing = sorted(name for name, f in fields.items() if name not in params
                     and f.default is dataclasses.MISSING)
    if unknown or missing:
        raise InvalidEdit(data, f"{cls.kind} takes {sorted(fields)}; unknown {unknown}, missing {missing}")
    if not isinstance(params.get("node"), str):
        raise InvalidEdit(data, "'node' must be a node id string")
    return cls(**params)


def edit_kinds() -> dict[str, type[Edit]]:
    """The edit vocabulary: kind -> class."""
    return dict(_EDIT_KINDS)


# ---------------------------------------------------------------------------------------- edits
@dataclasses.dataclass(frozen=True)
class SwapOperator(Edit):
    """Swap a node between ``Predict`` and ``ChainOfThought``, or unwrap a ``ScEnsemble`` into either
    (same signature, demos carried): the inverse of :class:`WrapEnsemble` and of itself."""

    kind: ClassVar[str] = "swap_operator"
    op: str = "ChainOfThought"

    def describe(self) -> str:
        verb = "swap" if self.op in SWAPPABLE else "set"
        return f"{verb} {self.node} to {self.op}"

    def _transform(self, data: IR, node: IR) -> None:
        if node["op"] not in (*SWAPPABLE, ENSEMBLE) or self.op not in SWAPPABLE:
            raise InvalidEdit(self, f"swap turns one of {(*SWAPPABLE, ENSEMBLE)} into one of {SWAPPABLE}; "
                                    f"node is {node['op']}, target {self.op}", node=self.node)
        if node["op"] == self.op:
            raise InvalidEdit(self, f"node is already {self.op}", node=self.node)
        config = {k: v for k, v in node["config"].items() if k == "temperature" and node["op"] != ENSEMBLE}
        replace_op(node, self.op, config)


@dataclasses.dataclass(frozen=True)
class WrapEnsemble(Edit):
    """Replace a node by ``ScEnsemble(n)`` over the same signature (n samples, majority vote)."""

    kind: ClassVar[str] = "wrap_ensemble"
    n: int = 3

    def describe(self) -> str:
        return f"wrap {self.node} in ScEnsemble(n={self.n})"

    def _transform(self, data: IR, node: IR) -> None:
        if node["op"] not in SWAPPABLE:
            raise InvalidEdit(self, f"only {SWAPPABLE} nodes can be wrapped, node is {node['op']}", node=self.node)
        if not isinstance(self.n, int) or not 2 <= self.n <= 15:
            raise InvalidEdit(self, f"n must be an int in 2..15, got {self.n!r}", node=self.node)
        replace_op(node, "ScEnsemble", {"n": self.n, "select": "majority"})


@dataclasses.dataclass(frozen=True)
class AddRefine(Edit):
    """Insert a ``Refine`` node after a node: it reviews and revises the node's outputs.

    The new node ``<node>_refine`` takes the node's inputs plus ``draft_<field>`` for each output and
    produces the same outputs; everything that read the node's outputs now reads the refined ones.
    """

    kind: ClassVar[str] = "add_refine"
    max_rounds: int = 1

    def describe(self) -> str:
        return f"add Refine(max_rounds={self.max_rounds}) after {self.node}"

    def _transform(self, data: IR, node: IR) -> None:
        if node["op"] not in ANSWERING:
            raise InvalidEdit(self, f"Refine follows an answering node {ANSWERING}, node is {node['op']}",
                              node=self.node)
        consumers = consumers_of(data, self.node)
        if any((found := find_node(data, dst)) is not None and found["op"] == "Refine" for dst, _, _ in consumers):
            raise InvalidEdit(self, "the node is already followed by a Refine; raise its max_rounds instead",
                              node=self.node)
        sig = node["signature"]
        inputs = [dict(f) for f in sig["inputs"]]
        drafts = [{"name": f"draft_{f['name']}", "type": f["type"], "desc": ""} for f in sig["outputs"]]
        new_id = unique_id(data, f"{self.node}_refine")
        data["nodes"].append(new_node(new_id, "Refine", {"instructions": "", "inputs": inputs + drafts,
                                                       "outputs": [dict(f) for f in sig["outputs"]]},
                                   {"max_rounds": self.max_rounds}, node.get("lm")))
        for out in sig["outputs"]:
            move_consumers(data, self.node, out["name"], new_id, out["name"])
        for field, (src, src_field) in sources_of(data, self.node).items():
            add_map(data, src, new_id, src_field, field)
        for out in sig["outputs"]:
            add_map(data, self.node, new_id, out["name"], f"draft_{out['name']}")


@dataclasses.dataclass(frozen=True)
class AddProgrammer(Edit):
    """Add a ``Programmer`` branch beside a node and a selector that picks between the two answers.

    For math: ``<node>_code`` writes and runs a program on the node's inputs (``on_failure="empty"``),
    ``<node>_select`` (a ``Custom`` node) sees ``candidate_<out>`` and ``program_<out>`` and answers.
    Needs a node with exactly one ``str`` output.
    """

    kind: ClassVar[str] = "add_programmer"

    def describe(self) -> str:
        return f"add a Programmer branch and a selector beside {self.node}"

    def _transform(self, data: IR, node: IR) -> None:
        sig = node["signature"]
        if node["op"] not in ANSWERING or is_selector(node):
            raise InvalidEdit(self, f"a Programmer branch goes beside an answering node {ANSWERING} that is "
                                    f"not itself a selector; node is {node['op']}", node=self.node)
        if len(sig["outputs"]) != 1 or sig["outputs"][0]["type"] not in ("str", "Any"):
            raise InvalidEdit(self, "the node needs exactly one str output for a program to compute",
                              node=self.node)
        out = sig["outputs"][0]["name"]
        inputs = [dict(f) for f in sig["inputs"]]
        code_id = unique_id(data, f"{self.node}_code")
        data["nodes"].append(new_node(code_id, "Programmer",
                                   {"instructions": "", "inputs": inputs, "outputs": [dict(sig["outputs"][0])]},
                                   {"timeout_s": 5.0, "memory_mb": 512, "max_attempts": 2, "on_failure": "empty"},
                                   node.get("lm")))
        select_id = unique_id(data, f"{self.node}_select")
        candidates = [{"name": f"candidate_{out}", "type": "str", "desc": "answer from reasoning"},
                      {"name": f"program_{out}", "type": "str", "desc": "answer printed by a program"}]
        data["nodes"].append(new_node(select_id, "Custom",
                                   {"instructions": SELECT_INSTRUCTION, "inputs": inputs + candidates,
                                    "outputs": [dict(sig["outputs"][0])]}, {}, node.get("lm")))
        move_consumers(data, self.node, out, select_id, out)
        for field, (src, src_field) in sources_of(data, self.node).items():
            add_map(data, src, code_id, src_field, field)
            add_map(data, src, select_id, src_field, field)
        add_map(data, self.node, select_id, out, f"candidate_{out}")
        add_map(data, code_id, select_id, out, f"program_{out}")


@dataclasses.dataclass(frozen=True)
class AddRetrieve(Edit):
    """Insert ``Retrieve(k)`` before a node that reads a ``list[str]`` context: it keeps the k best passages.

    The query is the node's first ``str`` input; the node's context now comes from the retriever.
    """

    kind: ClassVar[str] = "add_retrieve"
    k: int = 3

    def describe(self) -> str:
        return f"add Retrieve(k={self.k}) before {self.node}"

    def _transform(self, data: IR, node: IR) -> None:
        sig = node["signature"]
        query = next((f for f in sig["inputs"] if f["type"] == "str"), None)
        context = next((f for f in sig["inputs"] if f["type"] == "list[str]"), None)
        if query is None or context is None:
            raise InvalidEdit(self, "Retrieve needs a node with a str input (the query) and a list[str] "
                                    "context input", node=self.node)
        sources = sources_of(data, self.node)
        ctx_src = sources[context["name"]]
        src_node = find_node(data, ctx_src[0])
        if src_node is not None and src_node["op"] == "Retrieve":
            raise InvalidEdit(self, "the context already comes from a Retrieve; change its k instead",
                              node=self.node)
        if not isinstance(self.k, int) or self.k < 1:
            raise InvalidEdit(self, f"k must be an int >= 1, got {self.k!r}", node=self.node)
        new_id = unique_id(data, f"{self.node}_retrieve")
        data["nodes"].append(new_node(new_id, "Retrieve",
                                   {"instructions": "", "inputs": [dict(query), dict(context)],
                                    "outputs": [{"name": "passages", "type": "list[str]", "desc": ""}]},
                                   {"k": self.k}, None))
        drop_map(data, ctx_src[0], self.node, context["name"])
        add_map(data, sources[query["name"]][0], new_id, sources[query["name"]][1], query["name"])
        add_map(data, ctx_src[0], new_id, ctx_src[1], context["name"])
        add_map(data, new_id, self.node, "passages", context["name"])


@dataclasses.dataclass(frozen=True)
class RemoveNode(Edit):
    """Remove a node; its readers are re-wired to what it was built on, and branches left dead go too.

    An output ``f`` is replaced by the node's input ``f``, else ``draft_f`` (a refine's draft), else an
    input ending in ``_f`` (a selector's first candidate), else its only input of the same non-str type (a retriever's
    context). When none fits, the edit is refused.
    """

    kind: ClassVar[str] = "remove_node"

    def describe(self) -> str:
        return f"remove {self.node}"

    def _transform(self, data: IR, node: IR) -> None:
        if len(data["nodes"]) <= 1:
            raise InvalidEdit(self, "it is the only node", node=self.node)
        sources = sources_of(data, self.node)
        replacement: dict[str, tuple[str, str]] = {}
        for dst, src_field, _dst_field in consumers_of(data, self.node):
            if src_field in replacement:
                continue
            field = next(f for f in node["signature"]["outputs"] if f["name"] == src_field)
            via = pass_through(node["signature"]["inputs"], field)
            if via is None or via not in sources:
                raise InvalidEdit(self, f"nothing can replace its output {src_field!r} read by {dst}",
                                  node=self.node)
            replacement[src_field] = sources[via]
        ancestors = ancestors_of(data, self.node)
        for src_field, (src, new_field) in replacement.items():
            move_consumers(data, self.node, src_field, src, new_field)
        delete_node(data, self.node)
        # Nodes that only fed the removed one are now dead: drop them so the graph stays minimal.
        live = ancestors_of(data, OUTPUT)
        for dead in [n for n in ancestors if n not in live and n != INPUT]:
            delete_node(data, dead)


@dataclasses.dataclass(frozen=True)
class SetConfig(Edit):
    """Change one setting of a node (``n``, ``temperature``, ``max_rounds``, ``k``...)."""

    kind: ClassVar[str] = "set_config"
    key: str = ""
    value: Any = None

    def describe(self) -> str:
        return f"set {self.node}.{self.key} = {self.value!r}"

    def _transform(self, data: IR, node: IR) -> None:
        allowed = settable_keys(node["op"])
        if self.key not in allowed:
            raise InvalidEdit(self, f"{node['op']} has no setting {self.key!r} (settings: {allowed})",
                              node=self.node)
        if node["config"].get(self.key) == self.value:
            raise InvalidEdit(self, f"{self.key} is already {self.value!r}", node=self.node)
        node["config"] = {**node["config"], self.key: self.value}


def settable_keys(op: str) -> list[str]:
    """Keyword settings of an operator that an edit may change (read from its constructor)."""
    params = inspect.signature(get_operator(op).__init__).parameters.values()
    skip = {"corpus", "instruction", "vote_field", "on_failure", "select"}
    return [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in skip]
