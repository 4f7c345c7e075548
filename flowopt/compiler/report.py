"""``CompileReport``: what each stage gained and what it cost; a table, JSON, and part of ``meta``."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class StageReport:
    """One row of the report: a stage (or the baseline) and its validation score and costs."""

    name: str
    score: float | None = None
    ci: tuple[float, float] | None = None
    change: float | None = None
    kept: bool = False
    lm_calls: int = 0
    cache_hits: int = 0
    tokens: int = 0
    cost_usd: float = 0.0
    wall_s: float = 0.0
    candidates_tried: int | None = None
    stop_reason: str = "done"
    resumed: bool = False
    settings: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["ci"] = list(self.ci) if self.ci is not None else None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StageReport:
        data = dict(data)
        if data.get("ci") is not None:
            data["ci"] = tuple(data["ci"])
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class CompileReport:
    """The compile report: baseline and one row per stage, plus totals.

    ``print(report)`` shows a table; ``report.to_json()`` is the same as JSON; the compiled program
    carries it as ``program.report`` (and, for a Workflow, in ``meta["report"]``).

    Example:
        >>> from flowopt.compiler import CompileReport, StageReport
        >>> r = CompileReport(stages=[StageReport("baseline", score=0.5, ci=(0.3, 0.7), kept=True)])
        >>> r.best_score
        0.5
    """

    stages: list[StageReport] = field(default_factory=list)
    seed: int = 0
    n_train: int = 0
    n_val: int = 0
    valset_source: str = "given"
    budget: dict[str, Any] = field(default_factory=dict)
    stop_reason: str = "done"
    best_stage: str = "baseline"
    total: dict[str, Any] = field(default_factory=dict)

    @property
    def best_score(self) -> float | None:
        for row in self.stages:
            if row.name == self.best_stage and row.score is not None:
                return row.score
        kept = [r.score for r in self.stages if r.kept and r.score is not None]
        return kept[-1] if kept else None

    @property
    def baseline_score(self) -> float | None:
        return self.stages[0].score if self.stages else None

    def stage(self, name: str) -> StageReport:
        for row in self.stages:
            if row.name == name:
                return row
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": "flowopt.report/v1", "seed": self.seed, "n_train": self.n_train, "n_val": self.n_val,
                "valset_source": self.valset_source, "budget": self.budget, "stop_reason": self.stop_reason,
                "best_stage": self.best_stage, "best_score": self.best_score, "total": self.total,
                "stages": [s.to_dict() for s in self.stages]}

    def to_json(self, *, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CompileReport:
        return cls(stages=[StageReport.from_dict(s) for s in data.get("stages", [])], seed=data.get("seed", 0),
                   n_train=data.get("n_train", 0), n_val=data.get("n_val", 0),
                   valset_source=data.get("valset_source", "given"), budget=data.get("budget", {}),
                   stop_reason=data.get("stop_reason", "done"), best_stage=data.get("best_stage", "baseline"),
                   total=data.get("total", {}))

    def table(self) -> str:
        header = ["stage", "score", "95% CI", "change", "kept", "LM calls", "cache hits", "tokens", "cost $",
                  "wall s", "candidates", "stop reason"]
        rows = [header]
        for s in self.stages:
            rows.append([
                s.name + (" (resumed)" if s.resumed else ""),
                "-" if s.score is None else f"{s.score:.3f}",
                "-" if s.ci is None else f"[{s.ci[0]:.3f}, {s.ci[1]:.3f}]",
                "-" if s.change is None else f"{s.change:+.3f}",
                "*" if s.kept else "",
                str(s.lm_calls), str(s.cache_hits), str(s.tokens), f"{s.cost_usd:.4f}", f"{s.wall_s:.1f}",
                "-" if s.candidates_tried is None else str(s.candidates_tried),
                s.stop_reason,
            ])
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        notes = [f"valset: {self.n_val} examples ({self.valset_source}); trainset: {self.n_train}; seed {self.seed}"]
        if self.budget:
            notes.append(f"budget: {self.budget}; stopped: {self.stop_reason}")
        best = self.best_score
        notes.append(f"best: {self.best_stage}" + ("" if best is None else f" ({best:.3f})"))
        return "\n".join([*lines, "", *notes])

    def __str__(self) -> str:
        return self.table()
