"""Which tree node to expand next: best-first (the default), AFlow's mixed probability, or UCT.

AFlow (``scripts/optimizer_utils/data_utils.py``, ``select_round``/``_compute_probabilities``) keeps the
initial workflow plus the best-scoring rounds (top k), scales scores by 100 and samples from
``lambda * uniform + (1 - lambda) * softmax(alpha * (score - max_score))`` with alpha = 0.2 and
lambda = 0.3. The uniform share keeps weaker branches alive; the softmax exploits the leaders.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from flowopt.optimizers.structure.tree import SearchTree, TreeNode


def mixed_probabilities(scores: Sequence[float], *, alpha: float = 0.2, lambda_: float = 0.3,
                        scale: float = 100.0) -> list[float]:
    """AFlow's mixed distribution over candidates with the given scores (in 0..1, scaled by ``scale``).

    Example:
        >>> [round(p, 3) for p in mixed_probabilities([0.8, 0.6])]
        [0.837, 0.163]
    """
    if not scores:
        raise ValueError("no candidates to select from")
    scaled = [s * scale for s in scores]
    top = max(scaled)
    weights = [math.exp(alpha * (s - top)) for s in scaled]
    total = sum(weights)
    n = len(scores)
    return [lambda_ / n + (1 - lambda_) * w / total for w in weights]


def select_mixed(tree: SearchTree, rng: random.Random, *, top_k: int = 4, alpha: float = 0.2,
                 lambda_: float = 0.3) -> TreeNode | None:
    """Sample among the root and the best ``top_k - 1`` other expandable nodes (AFlow's rule)."""
    open_nodes = [n for n in tree.nodes if n.score is not None and not n.exhausted]
    if not open_nodes:
        return None
    # Highest score first; the earlier node wins a tie so the order is reproducible.
    ranked = sorted(open_nodes, key=lambda n: (-n.score, n.id))  # type: ignore[operator]
    root = tree.nodes[0]
    candidates = [root] if root in ranked else []
    candidates += [n for n in ranked if n is not root][: top_k - len(candidates)]
    candidates.sort(key=lambda n: (-n.score, n.id))  # type: ignore[operator]
    probs = mixed_probabilities([n.score for n in candidates], alpha=alpha, lambda_=lambda_)  # type: ignore[misc]
    return candidates[_sample(probs, rng)]


def select_best_first(tree: SearchTree, rng: random.Random, *, explore: float = 0.2) -> TreeNode | None:
    """The open node with the highest upper 95% bound of its objective; with probability ``explore`` a
    uniformly random open node instead.

    Always expanding the leader is greedy on additive landscapes (each improving edit is built on at
    once); when the leader's edits are used up the next best is expanded, which walks out of a local
    optimum two edits deep; the random picks are restarts from elsewhere in the tree. Under noise the
    upper bound favours leaders measured on few examples, which a re-measurement then settles.

    Example:
        >>> tree = SearchTree()
        >>> _ = tree.add(None, None, "root", "k0", {}, score=0.4)
        >>> _ = tree.add(0, {"kind": "x"}, "e", "k1", {}, score=0.6)
        >>> select_best_first(tree, random.Random(0), explore=0.0).id
        1
    """
    open_nodes = [n for n in tree.nodes if n.score is not None and not n.exhausted]
    if not open_nodes:
        return None
    if explore > 0 and rng.random() < explore:
        return open_nodes[rng.randrange(len(open_nodes))]
    return max(open_nodes, key=lambda n: (_objective(n) + n.half_width, -n.id))


def _objective(node: TreeNode) -> float:
    return float(node.value if node.value is not None else node.score)  # type: ignore[arg-type]


def select_uct(tree: SearchTree, rng: random.Random, *, c: float = 1.4, widen: float = 1.0) -> TreeNode | None:
    """Walk down from the root by UCT; expand the first node allowed another child.

    Progressive widening: a node may have up to ``max(1, widen * sqrt(visits))`` children, so the tree
    grows deeper along good paths instead of listing every edit of the root first.
    """
    node = tree.nodes[0]
    while True:
        children = [tree.nodes[i] for i in node.children if not tree.subtree_exhausted(i)]
        may_widen = not node.exhausted and len(node.children) < max(1.0, widen * math.sqrt(node.visits))
        if may_widen or not children:
            # Only the root can get here exhausted: descent skips exhausted subtrees.
            return None if node.exhausted else node
        log_n = math.log(max(node.visits, 1))
        best = max(children, key=lambda ch: (ch.mean_value + c * math.sqrt(log_n / max(ch.visits, 1)),
                                             -ch.id))
        node = best


def _sample(probs: Sequence[float], rng: random.Random) -> int:
    # One uniform draw from our own RNG (not numpy's global one) keeps resumed searches identical.
    r, acc = rng.random(), 0.0
    for i, p in enumerate(probs):
        acc += p
        if r < acc:
            return i
    return len(probs) - 1
