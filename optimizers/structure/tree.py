"""The search tree: candidate workflows (as IR data), the edits between them, scores and visit counts.

Plain data all the way down, so the whole tree is one JSON document: it is the checkpoint, the report's
tree, and the input of :mod:`~flowopt.optimizers.structure.draw`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from typing import Any


def interval_half_width(n: int, total: float, total_sq: float) -> float:
    if n < 2:
        return 0.0
    mean = total / n
    variance = max(total_sq / n - mean * mean, 0.0) * n / (n - 1)
    return 1.96 * math.sqrt(variance / n)


def workflow_key(canonical_json: str) -> str:
    """Short, stable cache key of a workflow's canonical JSON."""
    return hashlib.sha256(canonical_json.encode("utf-8")).hexdigest()[:32]


def ir_key(ir: dict[str, Any]) -> str:
    """``workflow_key(wf.canonical_json())`` from ``wf.to_dict()``, so one serialisation gives both.

    Example:
        >>> from flowopt import Workflow
        >>> from flowopt.modules import Predict
        >>> wf = Workflow("question -> answer").add("solve", Predict("question -> answer"))
        >>> ir_key(wf.to_dict()) == workflow_key(wf.canonical_json())
        True
    """
    from flowopt.ir import canonical_dumps

    return workflow_key(canonical_dumps(ir))


@dataclass
class TreeNode:
    """One candidate workflow: the edit that made it from its parent, its score and statistics."""

    id: int
    parent: int | None
    edit: dict[str, Any] | None
    description: str
    key: str
    workflow: dict[str, Any]
    score: float | None = None
    depth: int = 0
    round: int = 0
    evaluation: int | None = None  # index of the evaluation that scored it (1-based)
    visits: int = 0
    value_sum: float = 0.0
    children: list[int] = field(default_factory=list)
    tried: list[dict[str, Any]] = field(default_factory=list)  # {"edit", "delta", "child" | "duplicate_of"}
    exhausted: bool = False
    # Measurements: n values (per-example scores when the evaluator gives them, else one per call),
    # their sum and sum of squares give the mean and its 95% interval.
    n: int = 0
    total: float = 0.0
    total_sq: float = 0.0
    calls: int = 0  # evaluator calls spent on this node
    cost: dict[str, float] = field(default_factory=dict)  # mean LM calls / tokens per example
    value: float | None = None  # the objective the search ranks by (score, or score minus cost)
    final: dict[str, Any] | None = None  # the re-measurement on fresh examples, for finalists

    @property
    def mean_value(self) -> float:
        return self.value_sum / self.visits if self.visits else (self.score or 0.0)

    def record(self, values: list[float]) -> None:
        self.n += len(values)
        self.total += sum(values)
        self.total_sq += sum(v * v for v in values)
        self.calls += 1
        self.score = self.total / self.n

    @property
    def half_width(self) -> float:
        """Half the 95% interval of the mean score (normal approximation); 0 for one measurement."""
        return interval_half_width(self.n, self.total, self.total_sq)

    @property
    def interval(self) -> tuple[float, float]:
        score = self.score or 0.0
        return (score - self.half_width, score + self.half_width)


def _value(node: TreeNode) -> float:
    return float(node.value if node.value is not None else node.score)  # type: ignore[arg-type]


@dataclass
class SearchTree:
    """All nodes by id (``nodes[i].id == i``); node 0 is the initial workflow.

    Example:
        >>> tree = SearchTree()
        >>> root = tree.add(None, None, "initial", "k0", {}, score=0.5)
        >>> tree.best().id, tree.top_k_mean(3)
        (0, 0.5)
    """

    nodes: list[TreeNode] = field(default_factory=list)
    _index: dict[str, TreeNode] = field(default_factory=dict, init=False, repr=False, compare=False)

    def add(self, parent: int | None, edit: dict[str, Any] | None, description: str, key: str,
            workflow: dict[str, Any], *, score: float | None = None, round: int = 0,
            evaluation: int | None = None) -> TreeNode:
        depth = 0 if parent is None else self.nodes[parent].depth + 1
        node = TreeNode(len(self.nodes), parent, edit, description, key, workflow, score, depth, round, evaluation)
        self.nodes.append(node)
        if parent is not None:
            self.nodes[parent].children.append(node.id)
        return node

    def pareto_front(self) -> list[TreeNode]:
        """Scored nodes that no other node beats on both score (higher) and LM calls per example (fewer)."""
        nodes = [n for n in self.scored() if "lm_calls" in n.cost]
        front = [n for n in nodes if not any(
            (o.score >= n.score and o.cost["lm_calls"] <= n.cost["lm_calls"])  # type: ignore[operator]
            and (o.score > n.score or o.cost["lm_calls"] < n.cost["lm_calls"])  # type: ignore[operator]
            for o in nodes)]
        return sorted(front, key=lambda n: (n.cost["lm_calls"], n.id))

    def discard_last(self) -> None:
        """Drop the node added last (one whose measurement failed)."""
        node = self.nodes.pop()
        if node.parent is not None:
            self.nodes[node.parent].children.remove(node.id)
        self._index.pop(node.key, None)

    def by_key(self, key: str) -> TreeNode | None:
        if len(self._index) != len(self.nodes):
            self._index = {n.key: n for n in self.nodes}
        return self._index.get(key)

    def scored(self) -> list[TreeNode]:
        return [n for n in self.nodes if n.score is not None]

    def best(self) -> TreeNode:
        """Highest objective; the earliest node wins ties (fewer edits, found first). Finalists that were
        re-measured on fresh examples are ranked by that re-measurement alone."""
        finals = [n for n in self.scored() if n.final is not None]
        if finals:
            return max(finals, key=lambda n: (n.final["value"], -n.id))  # type: ignore[index]
        return max(self.scored(), key=lambda n: (_value(n), -n.id))

    def top_k_mean(self, k: int) -> float:
        scores = sorted((_value(n) for n in self.scored()), reverse=True)[:k]
        return sum(scores) / len(scores) if scores else 0.0

    def path(self, node_id: int) -> list[TreeNode]:
        """Nodes from the root to ``node_id``."""
        out = []
        current: int | None = node_id
        while current is not None:
            out.append(self.nodes[current])
            current = self.nodes[current].parent
        return out[::-1]

    def backpropagate(self, node_id: int, value: float) -> None:
        for node in self.path(node_id):
            node.visits += 1
            node.value_sum += value

    def subtree_exhausted(self, node_id: int) -> bool:
        node = self.nodes[node_id]
        return node.exhausted and all(self.subtree_exhausted(c) for c in node.children)

    def to_dict(self, *, with_workflows: bool = True) -> dict[str, Any]:
        nodes = []
        for node in self.nodes:
            data = dataclasses.asdict(node)
            if not with_workflows:
                data.pop("workflow")
            nodes.append(data)
        return {"nodes": nodes}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SearchTree:
        return cls([TreeNode(**node) for node in data["nodes"]])
