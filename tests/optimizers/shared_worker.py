"""One worker of a shared search, run as a process by the shared-search tests and benchmark.

``python shared_worker.py '{"url": ..., "study": ..., "out": ..., "latency": 0.3, "settings": {...}}'``
compiles the scripted category task with a ``search`` stage on the shared study and writes the
returned program's definition and the search's report row to ``out`` (JSON). With ``"go"``, the
worker imports everything, then waits for that file to exist before it starts (timed starts).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "compiler"))
import dspy
from fakes import category_lm, exact, examples

import flowopt
from flowopt.optimizers.search import RandomSearch
from flowopt.optimizers.search.shared_plan import definition_of

TRAIN, VAL = examples(15, categories=True), examples(8, 100, categories=True)


def compile_once(settings: dict, *, latency: float, num_threads: int = 4) -> dspy.Module:
    """The task every worker (and the one-process reference) compiles."""
    lm = category_lm(latency_s=latency, cache=False, model="scripted/shared-search")
    with dspy.context(lm=lm):
        return flowopt.compile(dspy.Predict("question -> answer"), TRAIN, exact, valset=VAL,
                               stages=[RandomSearch(**settings)], quiet=True, num_threads=num_threads, seed=0)


def main(spec: dict) -> None:
    if spec.get("go"):
        while not Path(spec["go"]).exists():
            time.sleep(0.01)
    started = time.monotonic()
    settings = {**spec["settings"], "storage": spec["url"], "study_name": spec["study"]}
    out = compile_once(settings, latency=spec["latency"], num_threads=spec.get("num_threads", 4))
    row = out.report.stage("search")
    Path(spec["out"]).write_text(json.dumps({
        "definition": definition_of(out), "best_score": out.report.best_score, "wall_s": time.monotonic() - started,
        "search_wall_s": row.wall_s, "candidates_tried": row.candidates_tried, "stop_reason": row.stop_reason,
        "info": row.info}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
