"""Where a structure search keeps its state between rounds: the :class:`Checkpointer` protocol, its JSON
file implementation, and the state's JSON form (:func:`state_to_dict`).

Example:
    >>> import tempfile, pathlib
    >>> from flowopt.optimizers.structure.checkpoint import JsonCheckpoint
    >>> JsonCheckpoint(pathlib.Path(tempfile.mkdtemp()) / "tree.json").load() is None
    True
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

from flowopt.io import atomic_write_json
from flowopt.optimizers.structure.search_settings import SearchSettings

CHECKPOINT_VERSION = 3


class Checkpointer(Protocol):
    """Keeps a search's state (the JSON-able dict of :func:`state_to_dict`) between rounds: ``save`` it
    after every round, ``load`` it back on resume (``None``: nothing saved yet)."""

    def save(self, data: dict[str, Any]) -> None: ...

    def load(self) -> dict[str, Any] | None: ...


class JsonCheckpoint:
    """Keeps the search state in one JSON file, written atomically.

    Example:
        >>> import tempfile, pathlib
        >>> ckpt = JsonCheckpoint(pathlib.Path(tempfile.mkdtemp()) / "tree.json")
        >>> ckpt.load() is None
        True
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def save(self, data: dict[str, Any]) -> None:
        atomic_write_json(self.path, data)

    def load(self) -> dict[str, Any] | None:
        if not self.path.is_file():
            return None
        return json.loads(self.path.read_text(encoding="utf-8"))


def state_to_dict(state: Mapping[str, Any], seed: int, settings: SearchSettings) -> dict[str, Any]:
    """The search state as the JSON-able dict a :class:`Checkpointer` saves (the tree, the rng, the log)."""
    return {"version": CHECKPOINT_VERSION, "seed": seed, "settings": asdict(settings),
            "round": state["round"], "evaluations": state["evaluations"], "history": list(state["history"]),
            "climb": list(state["climb"]),
            "log": list(state["log"]), "failures": dict(state["failures"]), "rng": list(state["rng"].getstate()),
            "tree": state["tree"].to_dict()}
