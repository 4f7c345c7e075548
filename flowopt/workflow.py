"""``Workflow``: a DSPy module whose structure is a typed graph of operators, run, saved and loaded.

The structure and its checks are :class:`~flowopt.workflow_graph.WorkflowGraph`'s; this class runs the
graph (independent nodes concurrently, each with its own LM) and is what the JSON IR
(:mod:`flowopt.ir`), the program files (:mod:`flowopt.program_files`) and drawing (:mod:`flowopt.draw`)
read and write. :func:`load` reads a saved workflow back.
"""

from __future__ import annotations

import contextvars
import copy
import re
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import dspy
import networkx as nx

from flowopt.draw import draw_workflow
from flowopt.errors import SchemaError, WorkflowError
from flowopt.ir import canonical_dumps, dumps, loads, workflow_from_dict, workflow_to_dict
from flowopt.lm_spec import refuse_loaded_endpoints, trust_loaded_specs
from flowopt.operator import Operator
from flowopt.program_files import PROGRAM_JSON, document_workflow, load_into, save_workflow
from flowopt.signature import SignatureSpec
from flowopt.validate import read_document
from flowopt.workflow_graph import INPUT, OUTPUT, PSEUDO_NODES, WorkflowGraph

__all__ = ["INPUT", "OUTPUT", "PSEUDO_NODES", "Workflow", "chain", "load", "workflow_from_program_json"]


class Workflow(WorkflowGraph):
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
        super().__init__(signature, name=name, lms=lms)
        self._lm_lock = threading.Lock()  # builds a loaded LM once (lm_for)

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
        return workflow_to_dict(self)

    def to_json(self, *, indent: int | None = 2) -> str:
        return dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Workflow:
        """Build and validate a workflow from IR data (:func:`flowopt.ir.workflow_from_dict`)."""
        return workflow_from_dict(data, cls)

    @classmethod
    def from_json(cls, text: str | bytes) -> Workflow:
        """Build and validate a workflow from its JSON document."""
        return workflow_from_dict(loads(text), cls)

    def save(self, path: str | Path, save_program: bool = False,
             modules_to_serialize: Iterable[Any] | None = None) -> Path:
        """Write the workflow JSON atomically; DSPy's calls work too (see :mod:`flowopt.program_files`):
        ``save_program=True`` writes a folder that ``flowopt.load`` and ``dspy.load`` both read back."""
        return save_workflow(self, path, save_program=save_program, modules_to_serialize=modules_to_serialize)

    def load(self, path: str | Path, allow_pickle: bool = False, allow_unsafe_lm_state: bool = False) -> str:
        """Load a saved program into this workflow, as ``dspy.Module.load`` does, from flowopt's document
        or DSPy's state format; returns (and logs) which: ``"flowopt.workflow/v1"`` or ``"dspy.state"``."""
        return load_into(self, path, allow_pickle=allow_pickle, allow_unsafe_lm_state=allow_unsafe_lm_state)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        # Pickled (dspy.Module.save(save_program=True), cloudpickle, dspy.load) as its JSON document and a
        # call that rebuilds it: no code and no locks in the pickle.
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
        return canonical_dumps(self.to_dict())

    def draw(self, path: str | Path | None = None, *, fmt: str = "png") -> bytes:
        """Render the graph (node ids, ops, field maps) to PNG or SVG bytes; optionally save to ``path``."""
        return draw_workflow(self, path=path, fmt=fmt)

    def __repr__(self) -> str:
        chain = ", ".join(f"{n}:{type(op).op_name}" for n, op in self.nodes.items())
        return f"Workflow({self.name!r}, {self.io.input_names} -> {self.io.output_names}, [{chain}])"

    # dspy.Module.deepcopy falls back to shallow copies for attributes that fail to deepcopy, which
    # would share the graph between copies; copy the lock-free parts explicitly instead.
    def __deepcopy__(self, memo: dict[int, Any]) -> Workflow:
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
    ids: list[str] = []
    for op in ops:
        base = re.sub(r"(?<!^)(?=[A-Z])", "_", getattr(type(op), "op_name", "") or type(op).__name__).lower()
        candidate, k = base, 2
        while candidate in ids:
            candidate, k = f"{base}_{k}", k + 1
        ids.append(candidate)
    return ids


def load(path: str | Path, *, lms: Mapping[str, Any] | None = None, trust_endpoints: bool = False) -> Workflow:
    """Load a workflow saved with :meth:`Workflow.save`; ``lms`` binds (or overrides) its LMs by name.

    A file's ``lms`` entries may name models and sampling settings only: one that sets ``api_base``,
    headers, provider routing and the like raises :class:`ConfigError` unless ``lms`` binds that entry
    or ``trust_endpoints=True`` (for files you wrote or trust).

    Example:
        >>> import flowopt  # doctest: +SKIP
        >>> wf = flowopt.load("qa.json", lms={"default": dspy.LM("openai/gpt-4o-mini")})  # doctest: +SKIP
    """
    file = Path(path)
    if file.is_dir():  # a folder written by wf.save(folder, save_program=True)
        file = file / PROGRAM_JSON
    if not file.is_file():
        raise SchemaError(f"no workflow file at {file}", fix="check the path, or save one with Workflow.save")
    wf = workflow_from_dict(read_document(file), Workflow)
    if lms:
        wf.lms.update(lms)
    if trust_endpoints:
        wf.lms = trust_loaded_specs(wf.lms)
    refuse_loaded_endpoints(wf.lms, source=str(file))
    return wf


def workflow_from_program_json(text: str) -> Workflow:
    """What ``program.pkl`` calls when unpickled: the workflow from its flowopt document, with the
    same refusal of file-chosen LM endpoints as :func:`load`."""
    return document_workflow(loads(text), Workflow, source="a pickled flowopt program")
