"""Proposers: pick the next edit to try from a workflow.

:class:`RuleProposer` enumerates every valid edit of the vocabulary (no optimizer LM needed) and picks
an untried one at random. :class:`LMProposer` shows an optimizer LM the graph JSON, its score, a few
failing examples and the edits already tried from this node with their score changes, and reads back
one edit as structured output; an invalid answer is rejected with its reason and the LM asked again,
a bounded number of times.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import dspy

from flowopt.errors import ConfigError, FlowoptError
from flowopt.optimizers.structure.edits import (
    ANSWERING,
    ENSEMBLE,
    SWAPPABLE,
    AddProgrammer,
    AddRefine,
    AddRetrieve,
    Edit,
    InvalidEdit,
    RemoveNode,
    SetConfig,
    SwapOperator,
    WrapEnsemble,
    edit_from_dict,
    edit_kinds,
)
from flowopt.workflow import Workflow

logger = logging.getLogger(__name__)


class NoProposal(FlowoptError):
    """No valid, untried edit could be found for this workflow (the tree node is exhausted)."""


@dataclass
class ProposalContext:
    """What a proposer knows about the node it expands."""

    score: float
    tried: list[dict[str, Any]] = field(default_factory=list)  # {"edit": dict, "delta": float | None}
    failures: list[dict[str, Any]] = field(default_factory=list)  # a few failing examples (inputs, gold)

    def tried_edits(self) -> list[dict[str, Any]]:
        return [t["edit"] for t in self.tried]


@dataclass
class Proposal:
    """A valid edit, the workflow it produces, and the proposals refused on the way."""

    edit: Edit
    workflow: Workflow
    rejected: list[dict[str, Any]] = field(default_factory=list)  # {"edit": ..., "reason": ...}


class Proposer(Protocol):
    def propose(self, workflow: Workflow, context: ProposalContext, rng: random.Random) -> Proposal: ...


@dataclass(frozen=True)
class Vocabulary:
    """Which edits and parameter values the proposers may use, and the size limit of a graph.

    Example:
        >>> Vocabulary(ensemble_sizes=(3, 5), max_nodes=4).max_nodes
        4
    """

    kinds: tuple[str, ...] = ("swap_operator", "wrap_ensemble", "add_refine", "add_programmer", "add_retrieve",
                              "remove_node", "set_config")
    ensemble_sizes: tuple[int, ...] = (3, 5)
    refine_rounds: tuple[int, ...] = (1, 2)
    retrieve_k: tuple[int, ...] = (3,)
    temperatures: tuple[float, ...] = ()
    max_nodes: int = 8

    def __post_init__(self) -> None:
        unknown = sorted(set(self.kinds) - set(edit_kinds()))
        if unknown:
            raise ConfigError(f"unknown edit kinds {unknown}", fix=f"use kinds from {sorted(edit_kinds())}")

    def candidates(self, workflow: Workflow) -> list[Edit]:
        """Every edit this vocabulary allows on ``workflow``, in a fixed order (not yet validated)."""
        out: list[Edit] = []
        for node_id, op in workflow.nodes.items():
            name = type(op).op_name
            config = op.config()
            if name in (*SWAPPABLE, ENSEMBLE):  # an ensemble unwraps into either single-call operator
                out += [SwapOperator(node_id, other) for other in SWAPPABLE if other != name]
            if name in SWAPPABLE:
                out += [WrapEnsemble(node_id, n) for n in self.ensemble_sizes]
            if name in ANSWERING:
                # Every round count, so that removing a Refine of any rounds is undone by one edit.
                out += [AddRefine(node_id, r) for r in self.refine_rounds]
                out.append(AddProgrammer(node_id))
            out += [AddRetrieve(node_id, k) for k in self.retrieve_k[:1]]
            out.append(RemoveNode(node_id))
            settings = {"n": self.ensemble_sizes, "max_rounds": self.refine_rounds, "k": self.retrieve_k,
                        "temperature": self.temperatures}
            for key, values in settings.items():
                if key in config or (key == "temperature" and name in SWAPPABLE):
                    out += [SetConfig(node_id, key, v) for v in values if config.get(key) != v]
        return [e for e in out if e.kind in self.kinds]

    def check(self, edit: Edit, workflow: Workflow, *, ir: dict[str, Any] | None = None) -> Workflow:
        """Apply ``edit`` under this vocabulary's limits; raise :class:`InvalidEdit` with the reason.

        ``ir`` is ``workflow.to_dict()`` when the caller already has it (see :meth:`Edit.apply`).
        """
        if edit.kind not in self.kinds:
            raise InvalidEdit(edit, f"kind {edit.kind!r} is not allowed here (allowed: {list(self.kinds)})")
        data = edit.apply_ir(workflow.to_dict() if ir is None else ir)
        # Counted on the data, before the workflow is built: an edit over the limit costs no validation.
        if len(data["nodes"]) > self.max_nodes:
            raise InvalidEdit(edit, f"the graph would have {len(data['nodes'])} nodes, over the limit {self.max_nodes}")
        return edit.build(workflow, data)


class RuleProposer:
    """Enumerates valid edits and picks an untried one uniformly at random; needs no optimizer LM.

    Example:
        >>> import random
        >>> from flowopt import Workflow
        >>> from flowopt.modules import Predict
        >>> wf = Workflow("question -> answer").add("solve", Predict("question -> answer"))
        >>> proposal = RuleProposer().propose(wf, ProposalContext(score=0.5), random.Random(0))
        >>> proposal.edit.node
        'solve'
    """

    def __init__(self, vocabulary: Vocabulary | None = None) -> None:
        self.vocabulary = vocabulary or Vocabulary()

    def valid_edits(self, workflow: Workflow) -> list[tuple[Edit, Workflow]]:
        """All edits that apply and validate, with the workflows they produce."""
        valid = []
        ir = workflow.to_dict()  # serialised once, not once per edit
        for edit in self.vocabulary.candidates(workflow):
            try:
                valid.append((edit, self.vocabulary.check(edit, workflow, ir=ir)))
            except InvalidEdit as err:
                logger.debug("skipping %s: %s", edit.describe(), err.reason)
        return valid

    def propose(self, workflow: Workflow, context: ProposalContext, rng: random.Random) -> Proposal:
        tried = context.tried_edits()
        options = [e for e in self.vocabulary.candidates(workflow) if e.to_dict() not in tried]
        # The first valid edit of a uniform random order is uniform over the valid edits, and costs
        # one validation per refused candidate instead of validating them all.
        rng.shuffle(options)
        ir: dict[str, Any] | None = None
        for edit in options:
            try:
                ir = workflow.to_dict() if ir is None else ir
                return Proposal(edit, self.vocabulary.check(edit, workflow, ir=ir))
            except InvalidEdit as err:
                logger.debug("skipping %s: %s", edit.describe(), err.reason)
        raise NoProposal("every valid edit of this workflow was tried", fix="select another node")


class ProposeEdit(dspy.Signature):
    """You improve an LLM workflow (a graph of operators, given as JSON) by choosing ONE edit.

    Read the score, the failing examples and the edits already tried from this workflow with their score
    changes; do not repeat a tried edit. Answer with an edit object from the vocabulary, e.g.
    {"kind": "wrap_ensemble", "node": "solve", "n": 5}. If earlier proposals were rejected, the reasons
    are given: fix them."""

    workflow: str = dspy.InputField(desc="the workflow graph as JSON")
    score: float = dspy.InputField(desc="its score on the search split, 0..1")
    failing_examples: str = dspy.InputField(desc="a few examples it gets wrong")
    tried_edits: str = dspy.InputField(desc="edits already tried from this workflow, with score change")
    vocabulary: str = dspy.InputField(desc="the edits you may use and their parameters")
    rejected: str = dspy.InputField(desc="your earlier invalid proposals for this step and why")
    edit: dict = dspy.OutputField(desc='one edit as a JSON object with "kind", "node" and its parameters')


class LMProposer:
    """Asks an optimizer LM for one edit; rejects invalid or repeated ones and asks again.

    After ``max_attempts`` refusals it falls back to ``fallback`` (a :class:`RuleProposer` by default;
    ``None`` raises :class:`NoProposal`).

    Example:
        >>> from flowopt.testing import scripted_lm
        >>> lm = scripted_lm(lambda req: {"edit": {"kind": "swap_operator", "node": "solve",
        ...                                         "op": "ChainOfThought"}})
        >>> proposer = LMProposer(lm, max_attempts=2)
    """

    def __init__(self, lm: Any = None, *, vocabulary: Vocabulary | None = None, max_attempts: int = 3,
                 max_failures_shown: int = 3, fallback: Proposer | str | None = "rule") -> None:
        if not isinstance(max_attempts, int) or max_attempts < 1:
            raise ConfigError(f"max_attempts must be an int >= 1, got {max_attempts!r}", fix="pass max_attempts=3")
        self.lm = lm
        self.vocabulary = vocabulary or Vocabulary()
        self.max_attempts = max_attempts
        self.max_failures_shown = max_failures_shown
        self.fallback: Proposer | None = RuleProposer(self.vocabulary) if fallback == "rule" else fallback  # type: ignore[assignment]
        self.predict = dspy.Predict(ProposeEdit)

    def propose(self, workflow: Workflow, context: ProposalContext, rng: random.Random) -> Proposal:
        rejected: list[dict[str, Any]] = []
        tried = context.tried_edits()
        graph = _graph_summary(workflow)
        for attempt in range(self.max_attempts):
            raw: Any = None
            try:
                with dspy.context(lm=self.lm) if self.lm is not None else contextlib.nullcontext():
                    raw = self.predict(
                        workflow=graph, score=round(context.score, 4),
                        failing_examples=_jsonl(context.failures[: self.max_failures_shown]),
                        tried_edits=_jsonl(context.tried), vocabulary=vocabulary_text(self.vocabulary),
                        rejected=_jsonl(rejected) or "none",
                    ).edit
                edit = edit_from_dict(raw)
                if edit.to_dict() in tried:
                    raise InvalidEdit(edit, "it was already tried from this workflow")
                return Proposal(edit, self.vocabulary.check(edit, workflow), rejected)
            except InvalidEdit as err:
                reason = err.reason
            except (ValueError, TypeError) as err:  # the adapter could not parse the answer
                reason = f"the answer was not an edit object: {err}"
            logger.info("optimizer LM proposal %d rejected: %s", attempt + 1, reason)
            rejected.append({"edit": raw, "reason": reason})
        if self.fallback is None:
            raise NoProposal(f"the optimizer LM gave no valid edit in {self.max_attempts} attempts "
                             f"(last reason: {rejected[-1]['reason']})", fix="raise max_attempts or use a fallback")
        proposal = self.fallback.propose(workflow, context, rng)
        proposal.rejected = rejected + proposal.rejected
        return proposal


def vocabulary_text(vocabulary: Vocabulary) -> str:
    """The edit kinds with their parameters and what they do, for the optimizer LM's prompt."""
    lines = []
    for kind, cls in sorted(edit_kinds().items()):
        if kind not in vocabulary.kinds:
            continue
        params = [f.name for f in dataclasses.fields(cls)]
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        lines.append(f"- {kind}({', '.join(params)}): {doc}")
    lines.append(f"Limits: n in {list(vocabulary.ensemble_sizes)}, max_rounds in {list(vocabulary.refine_rounds)}, "
                 f"at most {vocabulary.max_nodes} nodes.")
    return "\n".join(lines)


def _graph_summary(workflow: Workflow) -> str:
    # Demos are long and say nothing about structure; leave them out of the optimizer's prompt.
    data = workflow.to_dict()
    for node in data["nodes"]:
        node.pop("predictors", None)
    data.pop("meta", None)
    data.pop("lms", None)
    return json.dumps(data, sort_keys=True)


def _jsonl(items: Sequence[Any]) -> str:
    return "\n".join(json.dumps(item, sort_keys=True, default=str) for item in items)
