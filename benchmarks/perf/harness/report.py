"""Results files: one JSON schema (``flowopt.perf/v1``) and its markdown rendering, written together.

A run writes ``STEM.json`` and ``STEM.md`` (``STEM`` is the script's ``--out``). The JSON holds

- ``schema``, ``script``, ``title``, ``command`` (the exact command line), ``settings`` (every option);
- ``started_at`` (UTC), ``wall_s``, ``machine`` (see :mod:`.machine`), ``load_average`` ``before``/``after``;
- ``goals``: ``[{"name", "value", "target", "met"}]`` for the issue's goals the script checks;
- ``results``: the script's own measurements.

The markdown starts with the title, command, machine and load, then the script's body (tables made
with :func:`markdown_table`), then the goals table.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from flowopt.errors import DataError
from flowopt.io import atomic_write_json, atomic_write_text

from . import machine as _machine
from .machine import describe_machine, load_average, machine_record

logger = logging.getLogger(__name__)

SCHEMA = "flowopt.perf/v1"
REQUIRED = {"schema": str, "script": str, "title": str, "command": str, "settings": dict, "started_at": str,
            "wall_s": float, "machine": dict, "load_average": dict, "goals": list, "results": dict}
MACHINE_FIELDS = ("cpu_model", "cpu_count", "cpus_usable", "memory_gib", "platform", "python", "versions", "git")


@dataclass(frozen=True)
class Goal:
    """One of an issue's goals, checked against a measured value.

    Example:
        >>> Goal.at_least("8 callers vs batch 1 (x)", 4.6, 4).to_dict()
        {'name': '8 callers vs batch 1 (x)', 'value': 4.6, 'target': '>= 4', 'met': True}
    """

    name: str
    value: float
    op: str  # "<=" or ">="
    bound: float

    @classmethod
    def at_most(cls, name: str, value: float, bound: float) -> Goal:
        return cls(name, value, "<=", bound)

    @classmethod
    def at_least(cls, name: str, value: float, bound: float) -> Goal:
        return cls(name, value, ">=", bound)

    @property
    def met(self) -> bool:
        return self.value <= self.bound if self.op == "<=" else self.value >= self.bound

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "target": f"{self.op} {self.bound:g}", "met": self.met}


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str = "") -> list[str]:
    """A markdown table as lines; ``align`` has one letter per column, ``l`` or ``r`` (default ``l``).

    Example:
        >>> markdown_table(["run", "tokens/s"], [["raw", 12.5]], align="lr")
        ['| run | tokens/s |', '|---|---:|', '| raw | 12.5 |']
    """
    widths = len(headers)
    if any(len(row) != widths for row in rows):
        raise ValueError(f"every row needs {widths} cells (the headers' count)")
    rule = ["---:" if (align[i:i + 1] == "r") else "---" for i in range(widths)]
    return ["| " + " | ".join(map(str, headers)) + " |", "|" + "|".join(rule) + "|",
            *("| " + " | ".join(map(str, row)) + " |" for row in rows)]


def stem_path(stem: Path, suffix: str) -> Path:
    """``STEM`` + ``suffix`` (``.json``, ``_curve.png``): appended, so dots in the stem are kept."""
    return stem.parent / (stem.name + suffix)


@dataclass
class PerfRun:
    """One run of a perf script, from its start (load average before) to its results files.

    Made by :func:`~.cli.start_run`; :meth:`finish` writes ``out.json`` and ``out.md``.

    Example:
        >>> run = PerfRun(script="demo", command="python -m flowopt.benchmarks.perf.demo", args=None,
        ...               out=Path("/tmp/demo"))
        >>> run.sibling("_curve.png")
        PosixPath('/tmp/demo_curve.png')
    """

    script: str
    command: str
    args: Any  # the parsed argparse.Namespace
    out: Path
    load_before: list[float] = field(default_factory=load_average)
    started_at: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    began: float = field(default_factory=time.perf_counter)
    # Recorded at the start: the commit (and whether it was clean) the run measured, before the run's own
    # outputs (an extra file written early, or a results file being replaced) make the checkout dirty.
    git: dict[str, Any] | None = field(default_factory=lambda: _machine.git_commit())

    def sibling(self, suffix: str) -> Path:
        """Where an extra output goes, e.g. ``run.sibling("_reward_curve.png")``."""
        return stem_path(self.out, suffix)

    def finish(self, title: str, results: dict[str, Any], body: Sequence[str], *,
               goals: Sequence[Goal] = ()) -> dict[str, Any]:
        """Write ``out.json`` and ``out.md`` (atomically, JSON first) and log the markdown; returns the JSON."""
        machine = machine_record(git=self.git)  # torch's threads and GPU are known only by now
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(self.args).items()}
        payload = {"schema": SCHEMA, "script": self.script, "title": title, "command": self.command,
                   "settings": settings, "started_at": self.started_at,
                   "wall_s": round(time.perf_counter() - self.began, 2), "machine": machine,
                   "load_average": {"before": self.load_before, "after": load_average()},
                   "goals": [g.to_dict() for g in goals], "results": results}
        markdown = render_markdown(payload, body)
        atomic_write_json(stem_path(self.out, ".json"), payload)
        atomic_write_text(stem_path(self.out, ".md"), markdown)
        logger.info("%s\nwrote %s.json and %s.md", markdown, self.out, self.out)
        return payload


def render_markdown(payload: dict[str, Any], body: Sequence[str]) -> str:
    load = payload["load_average"]
    lines = [f"# {payload['title']}", "", f"Command: `{payload['command']}`", "",
             f"Machine: {describe_machine(payload['machine'])}.", "",
             f"Load average (1, 5, 15 min): {_triple(load['before'])} before, {_triple(load['after'])} after; the "
             f"CPU may be shared with other jobs. Wall time {payload['wall_s']:.0f} s.", ""]
    if payload["settings"].get("smoke"):
        lines += ["**Smoke run** (`--smoke`, the smallest sizes): it checks that the script runs; its figures "
                  "measure nothing.", ""]
    lines += body
    if payload["goals"]:
        rows = [[g["name"], g["value"], g["target"], "met" if g["met"] else "**NOT met**"] for g in payload["goals"]]
        lines += ["", "Goals:", "", *markdown_table(["goal", "measured", "target", ""], rows, align="lrrl")]
    return "\n".join(lines) + "\n"


def _triple(values: Sequence[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def read_results(path: Path) -> dict[str, Any]:
    """Load a results JSON (``STEM.json``, or ``STEM``) and check it follows ``flowopt.perf/v1``.

    Raises :class:`flowopt.DataError` naming the first missing or mistyped field.
    """
    path = path if path.suffix == ".json" else stem_path(path, ".json")
    try:
        payload = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DataError(f"cannot read results file {path}: {err}", fix="run the perf script with --out") from err
    if payload.get("schema") != SCHEMA:
        raise DataError(f"{path} has schema {payload.get('schema')!r}, not {SCHEMA!r}",
                        fix="files without a schema predate the perf harness; read them as free-form JSON")
    for key, kind in REQUIRED.items():
        value = payload.get(key)
        ok = isinstance(value, (int, float)) if kind is float else isinstance(value, kind)
        if not ok:
            raise DataError(f"{path}: field {key!r} should be a {kind.__name__}, got {value!r}",
                            fix="write results with flowopt.benchmarks.perf.harness")
    missing = [k for k in MACHINE_FIELDS if k not in payload["machine"]]
    before, after = payload["load_average"].get("before"), payload["load_average"].get("after")
    if missing or not (isinstance(before, list) and isinstance(after, list) and len(before) == len(after) == 3):
        raise DataError(f"{path}: machine record lacks {missing} or load_average is not 3 numbers before/after",
                        fix="write results with flowopt.benchmarks.perf.harness")
    return payload
