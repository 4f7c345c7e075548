"""The reward curve of a GRPO run as a PNG (matplotlib, headless)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def plot_reward_curve(curve: Sequence[dict[str, Any]], path: str | Path, *, title: str = "GRPO reward") -> Path:
    """Plot mean reward per step (with a +/- one standard deviation band) and save it to ``path``.

    Example:
        >>> plot_reward_curve([{"step": 1, "mean_reward": 0.1, "reward_std": 0.3}], "curve.png")  # doctest: +SKIP
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from flowopt.io import atomic_write_bytes

    steps = [p["step"] for p in curve]
    mean = [p["mean_reward"] for p in curve]
    std = [p.get("reward_std", 0.0) for p in curve]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    try:
        ax.plot(steps, mean, marker="o", markersize=3, label="mean reward")
        ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2)
        ax.set_xlabel("step")
        ax.set_ylabel("reward")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        import io

        buffer = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buffer, format="png")
    finally:
        plt.close(fig)
    return atomic_write_bytes(path, buffer.getvalue())
