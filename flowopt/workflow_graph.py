"""The structure of a workflow: a typed graph of operators, built node by node or all at once, validated.

The graph is a ``networkx.DiGraph`` over node ids plus two pseudo-nodes, ``$input`` (the program's
inputs) and ``$output`` (its outputs). Each edge carries a ``map`` from the source's output fields to
the target's input fields. Operators live in ``self.nodes`` (a dict), so DSPy finds their predictors
and its optimizers run on a workflow unchanged. :class:`~flowopt.workflow.Workflow` adds running,
saving and loading on top of this class; build workflows through it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

import dspy
import networkx as nx

from flowopt.errors import WorkflowError
from flowopt.operator import Operator
from flowopt.signature import SignatureSpec, types_compatible

INPUT = "$input"
OUTPUT = "$output"
PSEUDO_NODES = (INPUT, OUTPUT)

GraphT = TypeVar("GraphT", bound="WorkflowGraph")


class WorkflowGraph(dspy.Module):
    """The nodes, their wiring and its checks; :class:`~flowopt.workflow.Workflow` is the class to use.

    Example:
        >>> from flowopt.modules import Predict
        >>> graph = WorkflowGraph("question -> answer").add("solve", Predict("question -> answer"))
        >>> graph.sources("$output")
        {'answer': ('solve', 'answer')}
    """

    def __init__(self, signature: str | SignatureSpec = "question -> answer", *, name: str = "workflow",
                 lms: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.name = name
        self.io = SignatureSpec.parse(signature)
        if not self.io.inputs or not self.io.outputs:
            raise WorkflowError(f"the program signature {signature!r} needs inputs and outputs",
                                fix="write it as 'question -> answer'")
        self.nodes: dict[str, Operator] = {}
        self.node_lms: dict[str, str | None] = {}
        self.graph = nx.DiGraph()
        self.graph.add_nodes_from(PSEUDO_NODES)
        self._pinned_outputs: set[str] = set()
        self._producers: dict[str, list[str]] = {}
        self.lms: dict[str, Any] = dict(lms or {})
        self.weights: dict[str, Any] = {}
        self.meta: dict[str, Any] = {}

    # ------------------------------------------------------------------ building
    @property
    def node_ids(self) -> list[str]:
        return list(self.nodes)

    def add(self: GraphT, node_id: str, op: Operator, *, inputs: Mapping[str, str] | None = None,
            lm: str | None = None) -> GraphT:
        """Add a node; ``inputs`` maps its input fields to ``"node.field"`` or ``"$input.field"``.

        Returns ``self`` so that chains read as one expression. Costs time in the node's own fields,
        not in the graph's size: only the new node's edges and the program outputs are re-checked
        (a new node has no readers yet, so it cannot close a cycle).
        """
        self._check_new_node(node_id, op)
        explicit = dict(inputs or {})
        unknown = [f for f in explicit if op.spec.input(f) is None]
        if unknown:
            raise WorkflowError(f"inputs= names {unknown[0]!r}, which is not an input of the operator",
                                node=node_id, field=unknown[0],
                                fix=f"use one of its inputs {op.spec.input_names}")
        wiring: list[tuple[str, str, str]] = []  # (src node, src field, dst field)
        for field in op.spec.inputs:
            if field.name in explicit:
                src, src_field = self._parse_ref(explicit[field.name], node_id, field.name)
            else:
                src, src_field = self._default_source(field.name, node_id)
            wiring.append((src, src_field, field.name))
        output_edges = {pred: dict(self.graph.edges[pred, OUTPUT]["map"])
                        for pred in self.graph.predecessors(OUTPUT)}
        self.nodes[node_id] = op
        self.node_lms[node_id] = lm
        self.graph.add_node(node_id)
        try:
            for src, src_field, dst_field in wiring:
                self._add_mapping(src, node_id, src_field, dst_field)
            # Latest producer of a program output feeds it, unless the user pinned another source.
            for field in op.spec.outputs:
                if self.io.output(field.name) is not None and field.name not in self._pinned_outputs:
                    self._set_output_source(field.name, node_id, field.name)
            self._validate_inputs_of(node_id, require_complete=True)
            self._validate_inputs_of(OUTPUT, require_complete=False)
        except BaseException:
            # A refused node leaves nothing behind: drop it and restore the outputs' wiring.
            self.graph.remove_node(node_id)
            del self.nodes[node_id], self.node_lms[node_id]
            for pred in list(self.graph.predecessors(OUTPUT)):
                self.graph.remove_edge(pred, OUTPUT)
            for pred, mapping in output_edges.items():
                self.graph.add_edge(pred, OUTPUT, map=mapping)
            raise
        self._index_producer(node_id, op)
        return self

    @classmethod
    def from_graph(cls: type[GraphT], signature: str | SignatureSpec, nodes: Mapping[str, Operator],
                   edges: Iterable[tuple[str, str, Mapping[str, str]]], *, name: str = "workflow",
                   node_lms: Mapping[str, str | None] | None = None, lms: Mapping[str, Any] | None = None,
                   weights: Mapping[str, Any] | None = None, meta: Mapping[str, Any] | None = None) -> GraphT:
        """A workflow wired exactly as given (no default wiring), validated as a whole.

        ``nodes`` is in insertion order; ``edges`` are ``(src, dst, {src_field: dst_field})`` with
        ``$input``/``$output`` as the program's ends. Every program output is pinned to its edge.

        Example:
            >>> from flowopt.modules import Predict
            >>> wf = WorkflowGraph.from_graph("question -> answer", {"solve": Predict("question -> answer")},
            ...                          [("$input", "solve", {"question": "question"}),
            ...                           ("solve", "$output", {"answer": "answer"})])
            >>> wf.sources("$output")
            {'answer': ('solve', 'answer')}
        """
        wf = cls(signature, name=name, lms=lms)
        node_lms = dict(node_lms or {})
        for node_id, op in nodes.items():
            wf._check_new_node(node_id, op)
            wf.nodes[node_id] = op
            wf.node_lms[node_id] = node_lms.get(node_id)
            wf.graph.add_node(node_id)
            wf._index_producer(node_id, op)
        for src, dst, mapping in edges:
            for end in (src, dst):
                if end not in wf.nodes and end not in PSEUDO_NODES:
                    raise WorkflowError("an edge refers to a node that does not exist", node=str(end),
                                        fix=f"declare it first or use one of {[*PSEUDO_NODES, *wf.nodes]}")
            if wf.graph.has_edge(src, dst):
                raise WorkflowError(f"edge {src} -> {dst} appears twice", node=str(dst),
                                    fix="merge the two maps into one edge")
            wf.graph.add_edge(src, dst, map=dict(mapping))
        wf._pinned_outputs = set(wf.io.output_names)  # the given wiring is kept exactly
        wf.weights = dict(weights or {})
        wf.meta = dict(meta or {})
        return wf.validate()

    def output(self: GraphT, **sources: str) -> GraphT:
        """Pin program outputs to node fields: ``wf.output(answer="final.answer")``."""
        with self._rollback_on_error():
            for out_field, ref in sources.items():
                if self.io.output(out_field) is None:
                    raise WorkflowError("not an output of the program", node=OUTPUT, field=out_field,
                                        fix=f"use one of {self.io.output_names}")
                src, src_field = self._parse_ref(ref, OUTPUT, out_field)
                self._set_output_source(out_field, src, src_field)
                self._pinned_outputs.add(out_field)
            self.validate(require_complete=False)
        return self

    def connect(self: GraphT, src: str, dst: str, mapping: Mapping[str, str]) -> GraphT:
        """Low-level: add an edge ``src -> dst`` mapping ``{src_field: dst_field}``; validates."""
        with self._rollback_on_error():
            for src_field, dst_field in mapping.items():
                self._add_mapping(src, dst, src_field, dst_field)
            self.validate(require_complete=False)
        return self

    @contextlib.contextmanager
    def _rollback_on_error(self) -> Iterator[None]:
        """Restore the wiring if a change fails validation: a refused edit leaves nothing behind."""
        graph, pinned = self.graph.copy(), set(self._pinned_outputs)
        for u, v in graph.edges:
            graph.edges[u, v]["map"] = dict(graph.edges[u, v]["map"])
        try:
            yield
        except BaseException:
            self.graph, self._pinned_outputs = graph, pinned
            raise

    def remove(self: GraphT, node_id: str) -> GraphT:
        """Remove a node and its edges (the caller re-wires what it fed)."""
        if node_id not in self.nodes:
            raise WorkflowError("no such node", node=node_id, fix=f"use one of {self.node_ids}")
        op = self.nodes.pop(node_id)
        del self.node_lms[node_id]
        self.graph.remove_node(node_id)
        for out in op.spec.outputs:
            self._producers[out.name].remove(node_id)
        return self

    def _check_new_node(self, node_id: str, op: Operator) -> None:
        if not isinstance(node_id, str) or not node_id or node_id.startswith("$") or "." in node_id:
            raise WorkflowError(f"invalid node id {node_id!r}", node=str(node_id),
                                fix="use a non-empty name without '.' that does not start with '$'")
        if node_id in self.nodes:
            raise WorkflowError("duplicate node id", node=node_id, fix="give every node a distinct id")
        if not isinstance(op, Operator):
            raise WorkflowError(f"{type(op).__name__} is not a flowopt Operator", node=node_id,
                                fix="use an operator from flowopt.modules or subclass flowopt.Operator")

    def _parse_ref(self, ref: str, node_id: str, field: str) -> tuple[str, str]:
        if not isinstance(ref, str) or "." not in ref:
            raise WorkflowError(f"source {ref!r} is not of the form 'node.field'", node=node_id, field=field,
                                fix="write the source as 'node.field' or '$input.field'")
        src, src_field = ref.rsplit(".", 1)
        if src not in self.nodes and src != INPUT:
            raise WorkflowError(f"source node {src!r} does not exist", node=node_id, field=field,
                                fix=f"add {src!r} first, or use one of {[INPUT, *self.node_ids]}")
        return src, src_field

    def _default_source(self, field: str, node_id: str) -> tuple[str, str]:
        producers = self._producers.get(field)
        if producers:
            return producers[-1], field
        if self.io.input(field) is not None:
            return INPUT, field
        raise WorkflowError(
            "input has no source: no earlier node produces it and it is not a program input",
            node=node_id, field=field,
            fix=f"add {field!r} to the program inputs, or pass inputs={{'{field}': 'node.field'}}",
        )

    def _index_producer(self, node_id: str, op: Operator) -> None:
        # {field: node ids producing it, in insertion order}: the latest producer is found in O(1),
        # which keeps add() independent of the graph's size.
        for out in op.spec.outputs:
            self._producers.setdefault(out.name, []).append(node_id)

    def _add_mapping(self, src: str, dst: str, src_field: str, dst_field: str) -> None:
        if self.graph.has_edge(src, dst):
            mapping = self.graph.edges[src, dst]["map"]
            if mapping.get(src_field, dst_field) != dst_field:
                # An edge maps each source field once; silently re-pointing it would unfeed an input.
                raise WorkflowError(
                    f"{src}.{src_field} already feeds {dst}.{mapping[src_field]} on this edge", node=dst,
                    field=dst_field, fix="feed the second input from another field or through another node")
            mapping[src_field] = dst_field
        else:
            self.graph.add_edge(src, dst, map={src_field: dst_field})

    def _set_output_source(self, out_field: str, src: str, src_field: str) -> None:
        for pred in list(self.graph.predecessors(OUTPUT)):
            mapping = self.graph.edges[pred, OUTPUT]["map"]
            for key in [k for k, v in mapping.items() if v == out_field]:
                del mapping[key]
            if not mapping:
                self.graph.remove_edge(pred, OUTPUT)
        self._add_mapping(src, OUTPUT, src_field, out_field)

    # ------------------------------------------------------------------ inspection
    def node_spec(self, node_id: str) -> SignatureSpec:
        """The signature of a node, or of ``$input``/``$output`` (the program's fields)."""
        if node_id == INPUT:
            return SignatureSpec("", (), self.io.inputs)
        if node_id == OUTPUT:
            return SignatureSpec("", self.io.outputs, ())
        return self.nodes[node_id].spec

    def sources(self, node_id: str) -> dict[str, tuple[str, str]]:
        """``{input_field: (src_node, src_field)}`` for a node or ``$output``."""
        result: dict[str, tuple[str, str]] = {}
        for pred in self.graph.predecessors(node_id):
            for src_field, dst_field in self.graph.edges[pred, node_id]["map"].items():
                result[dst_field] = (pred, src_field)
        return result

    def edges(self) -> list[tuple[str, str, dict[str, str]]]:
        return [(u, v, dict(d["map"])) for u, v, d in self.graph.edges(data=True)]

    def topological_order(self) -> list[str]:
        return [n for n in nx.topological_sort(self.graph) if n not in PSEUDO_NODES]

    # ------------------------------------------------------------------ validation
    def validate(self: GraphT, *, require_complete: bool = True) -> GraphT:
        """Check the graph; raise :class:`~flowopt.errors.WorkflowError` naming node, field and fix.

        ``require_complete=False`` (used while building) skips the check that every program output
        is produced, since later nodes may still produce it.
        """
        if not nx.is_directed_acyclic_graph(self.graph):
            cycle = nx.find_cycle(self.graph)
            path = " -> ".join([u for u, _ in cycle] + [cycle[0][0]])
            raise WorkflowError(f"the graph has a cycle ({path})", node=cycle[0][0],
                                fix="remove an edge of the cycle; bounded loops belong inside an operator "
                                    "such as Refine(max_rounds=...)")
        for src, dst in self.graph.edges:
            if dst == INPUT or src == OUTPUT:
                raise WorkflowError(f"edge {src} -> {dst} points the wrong way", node=dst,
                                    fix="$input may only be a source and $output only a target")
        for node_id in self.nodes:
            self._validate_inputs_of(node_id, require_complete=True)
        self._validate_inputs_of(OUTPUT, require_complete=require_complete)
        return self

    def _validate_inputs_of(self, node_id: str, *, require_complete: bool) -> None:
        """Check the edges into one node (or ``$output``): fields exist, types match, each input fed once."""
        dst_spec = self.node_spec(node_id)
        counts: dict[str, int] = {}
        for src in self.graph.predecessors(node_id):
            if src not in self.nodes and src not in PSEUDO_NODES:
                raise WorkflowError("edge refers to a node that does not exist", node=src,
                                    fix=f"use one of {[*PSEUDO_NODES, *self.node_ids]}")
            if src == OUTPUT or node_id == INPUT:
                raise WorkflowError(f"edge {src} -> {node_id} points the wrong way", node=node_id,
                                    fix="$input may only be a source and $output only a target")
            src_spec = self.node_spec(src)
            for src_field, dst_field in self.graph.edges[src, node_id]["map"].items():
                out = src_spec.output(src_field)
                if out is None:
                    raise WorkflowError(f"edge {src} -> {node_id} reads {src_field!r}, which {src} does not "
                                        "produce", node=src, field=src_field,
                                        fix=f"map one of {src_spec.output_names}")
                inp = dst_spec.input(dst_field)
                if inp is None:
                    raise WorkflowError(f"edge {src} -> {node_id} feeds {dst_field!r}, which {node_id} does not "
                                        "take", node=node_id, field=dst_field,
                                        fix=f"map to one of {dst_spec.input_names}")
                if not types_compatible(out.type, inp.type):
                    raise WorkflowError(
                        f"type mismatch: {src}.{src_field} is {out.type} but {node_id}.{dst_field} takes "
                        f"{inp.type}", node=node_id, field=dst_field,
                        fix="change one of the two field types, or insert a node that converts",
                    )
                counts[dst_field] = counts.get(dst_field, 0) + 1
        for field in dst_spec.inputs:
            n = counts.get(field.name, 0)
            if n > 1:
                raise WorkflowError(f"input is fed {n} times", node=node_id, field=field.name,
                                    fix="keep exactly one edge into each input field")
            if n == 0 and require_complete:
                raise WorkflowError("input is not fed by any edge", node=node_id, field=field.name,
                                    fix="add a node that produces it or map a source to it")
