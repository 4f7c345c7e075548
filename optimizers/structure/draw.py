"""A picture of the search tree: one box per workflow with its score, edges labelled by the edit."""

from __future__ import annotations

import io
from pathlib import Path

from flowopt.errors import ConfigError
from flowopt.optimizers.structure.tree import SearchTree


def draw_tree(tree: SearchTree, *, path: str | Path | None = None, best: int | None = None,
              fmt: str = "png") -> bytes:
    """Draw ``tree`` top-down (root at the top); the path to ``best`` (default: best score) is highlighted.

    Example:
        >>> from flowopt.optimizers.structure.tree import SearchTree
        >>> tree = SearchTree()
        >>> _ = tree.add(None, None, "initial workflow", "k0", {}, score=0.4)
        >>> _ = tree.add(0, {"kind": "swap_operator"}, "swap solve to ChainOfThought", "k1", {}, score=0.6)
        >>> draw_tree(tree)[:4] == b"\\x89PNG"
        True
    """
    if fmt not in ("png", "svg"):
        raise ConfigError(f"cannot draw as {fmt!r}", fix='use fmt="png" or fmt="svg"')
    if not tree.nodes:
        raise ConfigError("the search tree is empty", fix="run the search before drawing it")
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    best_id = tree.best().id if best is None else best
    on_path = {n.id for n in tree.path(best_id)}
    pos = _layout(tree)
    width = max(6.0, 1.9 * (max(x for x, _ in pos.values()) + 1))
    height = max(3.0, 1.6 * (max(n.depth for n in tree.nodes) + 1))
    fig, ax = plt.subplots(figsize=(width, height))
    for node in tree.nodes:
        if node.parent is None:
            continue
        (x0, y0), (x1, y1) = pos[node.parent], pos[node.id]
        highlight = node.id in on_path
        ax.plot([x0, x1], [y0, y1], color="#cc4125" if highlight else "#999999", lw=2 if highlight else 1, zorder=1)
        ax.text((x0 + x1) / 2, (y0 + y1) / 2, _wrap(node.description, 22), fontsize=6, ha="center", va="center",
                color="#444444", bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8})
    for node in tree.nodes:
        x, y = pos[node.id]
        score = "?" if node.score is None else f"{node.score:.3f}"
        color = "#f4cccc" if node.id == best_id else ("#fce5cd" if node.id in on_path else "#cfe2f3")
        ax.text(x, y, f"#{node.id}\n{score}", fontsize=8, ha="center", va="center", zorder=2,
                bbox={"boxstyle": "round,pad=0.3", "fc": color, "ec": "#333333"})
    ax.set_xlim(-0.8, max(x for x, _ in pos.values()) + 0.8)
    ax.set_ylim(-max(n.depth for n in tree.nodes) - 0.6, 0.6)
    ax.set_title(f"structure search: {len(tree.nodes)} workflows, best #{best_id} = {tree.nodes[best_id].score:.3f}")
    ax.axis("off")
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, bbox_inches="tight", dpi=110)
    plt.close(fig)
    data = buffer.getvalue()
    if path is not None:
        from flowopt.io import atomic_write_bytes

        atomic_write_bytes(path, data)
    return data


def _layout(tree: SearchTree) -> dict[int, tuple[float, float]]:
    """Leaves get consecutive x positions in depth-first order; a parent sits above its children's middle."""
    pos: dict[int, tuple[float, float]] = {}
    next_x = [0.0]

    def place(node_id: int) -> float:
        node = tree.nodes[node_id]
        if not node.children:
            x = next_x[0]
            next_x[0] += 1
        else:
            xs = [place(c) for c in node.children]
            x = (xs[0] + xs[-1]) / 2
        pos[node_id] = (x, -float(node.depth))
        return x

    place(0)
    return pos


def _wrap(text: str, width: int) -> str:
    words, lines, line = text.split(), [], ""
    for word in words:
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    lines.append(line)
    return "\n".join(lines)


def draw_pareto(tree: SearchTree, *, path: str | Path, best: int | None = None) -> Path:
    """Plot every measured candidate's score (with its 95% interval) against its LM calls per example,
    joining the Pareto front; the returned workflow (``best``) is circled. Returns ``path``.

    Example:
        >>> import tempfile, pathlib
        >>> from flowopt.optimizers.structure.tree import SearchTree
        >>> tree = SearchTree()
        >>> for i, (s, c) in enumerate([(0.4, 1.0), (0.6, 3.0), (0.5, 5.0)]):
        ...     node = tree.add(None if i == 0 else 0, None, f"n{i}", f"k{i}", {}, score=s)
        ...     node.cost = {"lm_calls": c}
        >>> out = draw_pareto(tree, path=pathlib.Path(tempfile.mkdtemp()) / "pareto.png")
        >>> out.read_bytes()[:4] == b"\\x89PNG"
        True
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    points = [n for n in tree.scored() if "lm_calls" in n.cost]
    if not points:
        raise ConfigError("no candidate has a measured cost", fix="have the evaluator report cost['lm_calls']")
    front = tree.pareto_front()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    # scored() and pareto_front() hold measured nodes only, so every score is a float.
    ax.errorbar([n.cost["lm_calls"] for n in points], [float(n.score or 0.0) for n in points],
                yerr=[n.half_width for n in points], fmt="o", color="0.6", ms=4, lw=0.8, label="candidates")
    ax.plot([n.cost["lm_calls"] for n in front], [float(n.score or 0.0) for n in front], "-o", color="tab:blue",
            label="Pareto front")
    chosen = tree.nodes[tree.best().id if best is None else best]
    if "lm_calls" in chosen.cost:
        ax.plot([chosen.cost["lm_calls"]], [float(chosen.score or 0.0)], "o", ms=14, mfc="none", mec="tab:red",
                label="returned")
    for node in front:
        ax.annotate(str(node.id), (node.cost["lm_calls"], node.score), textcoords="offset points", xytext=(4, 4),
                    fontsize=8)
    ax.set_xlabel("LM calls per example")
    ax.set_ylabel("score (95% interval)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=110)
    plt.close(fig)
    return out
