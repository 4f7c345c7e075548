"""``Workflow``: a DSPy module whose structure is a typed graph of operators.

The graph is a ``networkx.DiGraph`` over node ids plus two pseudo-nodes, ``$input`` (the program's
inputs) and ``$output`` (its outputs). Each edge carries a ``map`` from the source's output fields to
the target's input fields. Operators live in ``self.nodes`` (a dict), so DSPy finds their predictors
and its optimizers run on a Workflow unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import dspy
import networkx as nx

from flowopt.errors import WorkflowError
from flowopt.operator import Operator
from flowopt.signature import SignatureSpec, types_compatible

INPUT = "$input"
OUTPUT = "$output"
PSEUDO_NODES = (INPUT, OUTPUT)


class Workflow(dspy.Module):
    """A typed graph of operators that runs as one ``dspy.Module``.

    Inputs of a node that are not wired explicitly are taken, by name, from the latest node that
    produces that field, else from the program's inputs. Program outputs come from the latest node
    producing them unless pinned with :meth:`output`.

    Example:
        >>> from flowopt import Workflow
        >>> from flowopt.modules import ChainOfThought, Predict
        >>> wf = (Workflow("question -> answer", name="qa")
        ...       .add("draft", Predict("question -> draft"))
        ...       .add("final", ChainOfThought("question, draft -> answer")))
        >>> wf.node_ids
        ['draft', 'final']
        >>> wf.sources("final")
        {'question': ('$input', 'question'), 'draft': ('draft', 'draft')}
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
        self._lm_lock = threading.Lock()

    # ------------------------------------------------------------------ building
    @property
    def node_ids(self) -> list[str]:
        return list(self.nodes)

    def add(self, node_id: str, op: Operator, *, inputs: Mapping[str, str] | None = None,
            lm: str | None = None) -> Workflow:
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
    def from_graph(cls, signature: str | SignatureSpec, nodes: Mapping[str, Operator],
                   edges: Iterable[tuple[str, str, Mapping[str, str]]], *, name: str = "workflow",
                   node_lms: Mapping[str, str | None] | None = None, lms: Mapping[str, Any] | None = None,
                   weights: Mapping[str, Any] | None = None, meta: Mapping[str, Any] | None = None) -> Workflow:
        """A workflow wired exactly as given (no default wiring), validated as a whole.

        ``nodes`` is in insertion order; ``edges`` are ``(src, dst, {src_field: dst_field})`` with
        ``$input``/``$output`` as the program's ends. Every program output is pinned to its edge.

        Example:
            >>> from flowopt.modules import Predict
            >>> wf = Workflow.from_graph("question -> answer", {"solve": Predict("question -> answer")},
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

    def output(self, **sources: str) -> Workflow:
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

    def connect(self, src: str, dst: str, mapping: Mapping[str, str]) -> Workflow:
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

    def remove(self, node_id: str) -> Workflow:
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
    def validate(self, *, require_complete: bool = True) -> Workflow:
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

    # ------------------------------------------------------------------ running
    def forward(self, **inputs: Any) -> dspy.Prediction:
        self._check_call_inputs(inputs)
        order = self.topological_order()
        values: dict[str, dict[str, Any]] = {INPUT: dict(inputs)}
        if self._max_width(order) <= 1:
            for node_id in order:
                values[node_id] = self.run_node(node_id, values)
        else:
            self._run_concurrently(order, values)
        return self._program_outputs(values)

    def _check_call_inputs(self, inputs: Mapping[str, Any]) -> None:
        missing = [name for name in self.io.input_names if name not in inputs]
        if missing:
            raise WorkflowError("the program was called without this input", node=INPUT, field=missing[0],
                                fix=f"call it with {self.io.input_names}")

    def _program_outputs(self, values: Mapping[str, Mapping[str, Any]]) -> dspy.Prediction:
        return dspy.Prediction(**{dst: values[src][src_field]
                                  for dst, (src, src_field) in self.sources(OUTPUT).items()})

    def _max_width(self, order: list[str]) -> int:
        # Widest antichain is costly; the widest topological generation is a cheap, exact enough test
        # for "can anything run in parallel here".
        if len(order) <= 1:
            return len(order)
        return max(len([n for n in gen if n not in PSEUDO_NODES])
                   for gen in nx.topological_generations(self.graph))

    def _dependencies(self, order: list[str]) -> dict[str, set[str]]:
        return {n: {p for p in self.graph.predecessors(n) if p != INPUT} for n in order}

    def _run_concurrently(self, order: list[str], values: dict[str, dict[str, Any]]) -> None:
        if dspy.settings.send_stream is not None:
            # Under dspy.streamify the LM sends chunks with anyio.from_thread, which works only in AnyIO
            # worker threads: run the branches there rather than in our own pool.
            from flowopt.graph_async import run_in_anyio_threads

            def run_and_keep(node_id: str) -> dict[str, Any]:
                values[node_id] = self.run_node(node_id, values)  # later nodes read it from here
                return values[node_id]

            if run_in_anyio_threads(self._dependencies(order), run_and_keep) is not None:
                return
        remaining = self._dependencies(order)
        running: dict[Future[dict[str, Any]], str] = {}
        with ThreadPoolExecutor(max_workers=self._max_width(order),
                                thread_name_prefix=f"flowopt-{self.name}") as pool:
            while remaining or running:
                ready = [n for n, deps in remaining.items() if not deps]
                for node_id in ready:
                    del remaining[node_id]
                    # Each task runs in a copy of the caller's context, so dspy.context(lm=..., trace=...)
                    # set by the caller (e.g. an optimizer) applies inside the worker thread too.
                    ctx = contextvars.copy_context()
                    running[pool.submit(ctx.run, self.run_node, node_id, values)] = node_id
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    node_id = running.pop(future)
                    values[node_id] = future.result()  # re-raises the node's error in the caller
                    for deps in remaining.values():
                        deps.discard(node_id)

    def run_node(self, node_id: str, values: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """Run one node on the outputs computed so far (``values``: node id -> its output fields, the
        inputs under ``INPUT``), with its own LM bound; its output fields."""
        op, kwargs = self.nodes[node_id], self._node_inputs(node_id, values)
        with dspy.context(**self._node_overrides(node_id)):
            pred = op(**kwargs)
        return {name: pred[name] for name in op.spec.output_names}

    def _node_inputs(self, node_id: str, values: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
        return {dst: values[src][src_field] for dst, (src, src_field) in self.sources(node_id).items()}

    def _node_overrides(self, node_id: str) -> dict[str, Any]:
        """The ``dspy.context`` a node runs in: its own LM, and the adapter local models need."""
        overrides: dict[str, Any] = {}
        lm = self.lm_for(node_id)
        if lm is not None:
            overrides["lm"] = lm
        if dspy.settings.adapter is None:
            # DSPy's default (ChatAdapter) is kept for hosted models; base-model LocalLMs, which cannot
            # follow its field markers, get the completion adapter.
            from flowopt.lm.completion_adapter import AutoAdapter

            overrides["adapter"] = AutoAdapter()
        return overrides

    def lm_for(self, node_id: str) -> Any:
        """The LM node ``node_id`` runs on (``None``: the ambient one), built on first use when loaded."""
        name = self.node_lms.get(node_id)
        if name is None:
            return None
        if name not in self.lms:
            raise WorkflowError(f"node uses LM {name!r}, which the workflow does not define",
                                node=node_id, fix=f"bind it with workflow.lms[{name!r}] = dspy.LM(...)")
        lm = self.lms[name]
        if isinstance(lm, dict):  # loaded from JSON: build the LM on first use, once
            from flowopt.lm_spec import lm_from_spec

            with self._lm_lock:
                if isinstance(self.lms[name], dict):
                    self.lms[name] = lm_from_spec(self.lms[name], name=name)
                lm = self.lms[name]
        return lm

    # ------------------------------------------------------------------ async
    async def aforward(self, **inputs: Any) -> dspy.Prediction:
        """Run the graph on the event loop (``await wf.acall(...)``): independent nodes run concurrently,
        each through its operator's ``acall``."""
        from flowopt.graph_async import run_when_ready

        self._check_call_inputs(inputs)
        values: dict[str, dict[str, Any]] = {INPUT: dict(inputs)}

        async def run_node(node_id: str) -> dict[str, Any]:
            op, kwargs = self.nodes[node_id], self._node_inputs(node_id, values)
            with dspy.context(**self._node_overrides(node_id)):
                pred = await op.acall(**kwargs)
            values[node_id] = {name: pred[name] for name in op.spec.output_names}
            return values[node_id]

        await run_when_ready(self._dependencies(self.topological_order()), run_node)
        return self._program_outputs(values)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        from flowopt.ir import workflow_to_dict

        return workflow_to_dict(self)

    def to_json(self, *, indent: int | None = 2) -> str:
        from flowopt.ir import dumps

        return dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Workflow:
        from flowopt.ir import workflow_from_dict

        return workflow_from_dict(data)

    @classmethod
    def from_json(cls, text: str | bytes) -> Workflow:
        from flowopt.ir import loads, workflow_from_dict

        return workflow_from_dict(loads(text))

    def save(self, path: str | Path, save_program: bool = False,
             modules_to_serialize: Iterable[Any] | None = None) -> Path:
        """Write the workflow JSON atomically; DSPy's calls work too (see :mod:`flowopt.program_files`):
        ``save_program=True`` writes a folder that ``flowopt.load`` and ``dspy.load`` both read back."""
        from flowopt.program_files import save_workflow

        return save_workflow(self, path, save_program=save_program, modules_to_serialize=modules_to_serialize)

    def load(self, path: str | Path, allow_pickle: bool = False, allow_unsafe_lm_state: bool = False) -> str:
        """Load a saved program into this workflow, as ``dspy.Module.load`` does, from flowopt's document
        or DSPy's state format; returns (and logs) which: ``"flowopt.workflow/v1"`` or ``"dspy.state"``."""
        from flowopt.program_files import load_into

        return load_into(self, path, allow_pickle=allow_pickle, allow_unsafe_lm_state=allow_unsafe_lm_state)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        # Pickled (dspy.Module.save(save_program=True), cloudpickle, dspy.load) as its JSON document and a
        # call that rebuilds it: no code and no locks in the pickle.
        from flowopt.program_files import workflow_from_program_json

        return workflow_from_program_json, (self.to_json(indent=None),)

    def __copy__(self) -> Workflow:
        new = self.__class__.__new__(self.__class__)
        new.__dict__.update(self.__dict__)
        return new

    def canonical_json(self) -> str:
        """Structure, settings, instructions and demos with sorted keys, without ``meta``.

        Two workflows that behave the same under the same LMs have the same canonical JSON, so it is
        the key for caching evaluations: nodes and edges are sorted too, since the order they were
        added in does not change what the graph computes.
        """
        from flowopt.ir import canonical_dumps

        return canonical_dumps(self.to_dict())

    def draw(self, path: str | Path | None = None, *, fmt: str = "png") -> bytes:
        """Render the graph (node ids, ops, field maps) to PNG or SVG bytes; optionally save to ``path``."""
        from flowopt.draw import draw_workflow

        return draw_workflow(self, path=path, fmt=fmt)

    def __repr__(self) -> str:
        chain = ", ".join(f"{n}:{type(op).op_name}" for n, op in self.nodes.items())
        return f"Workflow({self.name!r}, {self.io.input_names} -> {self.io.output_names}, [{chain}])"

    # dspy.Module.deepcopy falls back to shallow copies for attributes that fail to deepcopy, which
    # would share the graph between copies; copy the lock-free parts explicitly instead.
    def __deepcopy__(self, memo: dict[int, Any]) -> Workflow:
        import copy

        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key == "_lm_lock":
                new.__dict__[key] = threading.Lock()
            elif key == "lms":
                # LM clients hold connections and caches: share them, never copy.
                new.__dict__[key] = dict(value)
            else:
                new.__dict__[key] = copy.deepcopy(value, memo)
        return new


def chain(signature: str, *ops: Operator, name: str = "workflow",
          ids: Iterable[str] | None = None) -> Workflow:
    """A linear workflow in one call: ``chain("question -> answer", Predict(...), ChainOfThought(...))``.

    Node ids default to the operator names in snake case, numbered when repeated.
    """
    wf = Workflow(signature, name=name)
    names = list(ids) if ids is not None else _default_ids(ops)
    if len(names) != len(ops):
        raise WorkflowError(f"{len(ops)} operators but {len(names)} ids", fix="give one id per operator")
    for node_id, op in zip(names, ops):
        wf.add(node_id, op)
    return wf


def _default_ids(ops: Iterable[Operator]) -> list[str]:
    import re

    ids: list[str] = []
    for op in ops:
        base = re.sub(r"(?<!^)(?=[A-Z])", "_", getattr(type(op), "op_name", "") or type(op).__name__).lower()
        candidate, k = base, 2
        while candidate in ids:
            candidate, k = f"{base}_{k}", k + 1
        ids.append(candidate)
    return ids
