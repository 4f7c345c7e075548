"""Which tree node to expand next: iterated local search (``climb``, the default), best-first, AFlow's
mixed probability, or UCT.

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


def neighbourhood(tree: SearchTree, node_id: int) -> list[list[TreeNode]]:
    """Scored nodes by edit distance from ``node_id`` (rings 1, 2, ...), over the edits the tree knows:
    each node's parent, its children, and the scored workflows its edits reached again (duplicates).

    Example:
        >>> tree = SearchTree()
        >>> _ = tree.add(None, None, "root", "k0", {}, score=0.4)
        >>> _ = tree.add(0, {"kind": "x"}, "e", "k1", {}, score=0.6)
        >>> [[n.id for n in ring] for ring in neighbourhood(tree, 1)]
        [[0]]
    """
    seen, ring, rings = {node_id}, [node_id], []
    while ring:
        nxt: list[int] = []
        for i in ring:
            node = tree.nodes[i]
            links = [*node.children, *(t["duplicate_of"] for t in node.tried if "duplicate_of" in t)]
            if node.parent is not None:
                links.append(node.parent)
            for j in links:
                if j not in seen and tree.nodes[j].score is not None:
                    seen.add(j)
                    nxt.append(j)
        if nxt:
            rings.append([tree.nodes[j] for j in sorted(nxt)])
        ring = nxt
    return rings


def select_climb(tree: SearchTree, rng: random.Random, climb: list[int], *, explore: float = 0.0,
                 anchors: Sequence[TreeNode] | None = None) -> TreeNode | None:
    """Iterated local search: expand the node being climbed (``climb[-1]``) until its edits are used up;
    the search moves ``climb`` to a child as soon as one beats it (first improvement, see
    :class:`~flowopt.optimizers.structure.search.MCTS`). At a local optimum, restart from the
    incumbent's neighbourhood: a uniformly random open node among those nearest (in edits) to the best
    node (or to a random one of ``anchors``, e.g. the score/cost front), which becomes the new climb.
    A kick of one edit followed by a climb is a pair of edits, which crosses a deceptive valley (two
    edits that help only together) that a greedy step cannot. With probability ``explore`` the restart
    is from a uniformly random open node instead.

    Example:
        >>> tree = SearchTree()
        >>> _ = tree.add(None, None, "root", "k0", {}, score=0.4)
        >>> _ = tree.add(0, {"kind": "x"}, "e", "k1", {}, score=0.6)
        >>> climb = [1]
        >>> select_climb(tree, random.Random(0), climb).id
        1
        >>> tree.nodes[1].exhausted = True
        >>> select_climb(tree, random.Random(0), climb).id, climb
        (0, [0])
    """
    open_nodes = [n for n in tree.nodes if n.score is not None and not n.exhausted]
    if not open_nodes:
        return None
    current = tree.nodes[climb[-1]] if climb else tree.nodes[0]
    if not current.exhausted:
        return current
    if explore > 0 and rng.random() < explore:
        pick = open_nodes[rng.randrange(len(open_nodes))]
    else:
        incumbent = (anchors[rng.randrange(len(anchors))] if anchors
                     else max(tree.scored(), key=lambda n: (_objective(n), -n.id)))
        rings = [[n for n in ring if not n.exhausted] for ring in neighbourhood(tree, incumbent.id)]
        nearest = next((ring for ring in rings if ring), [])
        if not incumbent.exhausted:
            nearest = [incumbent]
        # A node the tree cannot reach by known edits (never: every node has its parent) falls back to any.
        pick = nearest[rng.randrange(len(nearest))] if nearest else open_nodes[rng.randrange(len(open_nodes))]
    climb[:] = [pick.id]
    return pick


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
