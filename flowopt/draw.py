"""Render a workflow graph as a picture (matplotlib, no system graphviz needed)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING

from flowopt.errors import ConfigError
from flowopt.workflow_graph import INPUT, OUTPUT

if TYPE_CHECKING:
    from flowopt.workflow import Workflow


def draw_workflow(wf: Workflow, *, path: str | Path | None = None, fmt: str = "png") -> bytes:
    """Draw nodes (id and operator, outputs below) left to right by dependency depth; edges show field maps."""
    if fmt not in ("png", "svg"):
        raise ConfigError(f"cannot draw as {fmt!r}", fix='use fmt="png" or fmt="svg"')
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import networkx as nx

    graph = wf.graph
    layer_of = {n: d for d, gen in enumerate(nx.topological_generations(graph)) for n in gen}
    subsets: dict[int, list[str]] = {}
    for node, depth in layer_of.items():
        subsets.setdefault(depth, []).append(node)
    pos = nx.multipartite_layout(graph, subset_key=subsets)

    def label(node: str) -> str:
        if node == INPUT:
            return "$input\n" + ", ".join(wf.io.input_names)
        if node == OUTPUT:
            return "$output\n" + ", ".join(wf.io.output_names)
        op = wf.nodes[node]
        return f"{node}\n[{type(op).op_name}]\n-> " + ", ".join(op.spec.output_names)

    width = max(6.0, 2.4 * len(subsets))
    fig, ax = plt.subplots(figsize=(width, 4.5))
    colors = ["#d9ead3" if n in (INPUT, OUTPUT) else "#cfe2f3" for n in graph.nodes]
    nx.draw_networkx_nodes(graph, pos, ax=ax, node_color=colors, node_size=5200, node_shape="s")
    nx.draw_networkx_labels(graph, pos, labels={n: label(n) for n in graph.nodes}, font_size=8, ax=ax)
    edge_labels = {(u, v): ", ".join(s if s == d else f"{s}->{d}" for s, d in m.items())
                   for u, v, m in wf.edges()}
    # Edges that skip a layer are drawn as arcs so they do not run through the nodes in between.
    for curved in (False, True):
        edges = [(u, v) for u, v in graph.edges if (layer_of[v] - layer_of[u] > 1) == curved]
        style = "arc3,rad=0.3" if curved else "arc3"
        nx.draw_networkx_edges(graph, pos, edgelist=edges, ax=ax, arrows=True, arrowsize=16, node_size=5200,
                               connectionstyle=style)
        nx.draw_networkx_edge_labels(graph, pos, edge_labels={e: edge_labels[e] for e in edges}, font_size=7,
                                     ax=ax, connectionstyle=style)
    ax.set_title(wf.name)
    ax.axis("off")
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, bbox_inches="tight")
    plt.close(fig)
    data = buffer.getvalue()
    if path is not None:
        from flowopt.io import atomic_write_bytes

        atomic_write_bytes(path, data)
    return data
