"""One worker of a shared search, run as a process by the shared-search tests and benchmark.

``python shared_worker.py '{"url": ..., "study": ..., "out": ..., "latency": 0.3, "settings": {...}}'``
compiles the scripted category task with a ``search`` stage on the shared study and writes the
returned program's definition and the search's report row to ``out`` (JSON). With
``"stall_after_calls": n`` and ``"stalled": path``, LM call n+1 creates ``path`` and never returns:
the worker hangs mid-candidate, heartbeats still going, until the test kills it.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "compiler"))
import dspy
from fakes import category_lm, exact, examples, reverse_answer

import flowopt
from flowopt.optimizers.search import RandomSearch
from flowopt.optimizers.search.shared_plan import definition_of
from flowopt.testing import scripted_lm

TRAIN, VAL = examples(15, categories=True), examples(8, 100, categories=True)


def compile_once(settings: dict, *, latency: float, num_threads: int = 4, **kwargs) -> dspy.Module:
    """The task every worker (and the one-process reference) compiles."""
    lm = category_lm(latency_s=latency, cache=False, model="scripted/shared-search")
    with dspy.context(lm=lm):
        return flowopt.compile(dspy.Predict("question -> answer"), TRAIN, exact, valset=VAL,
                               stages=[RandomSearch(**settings)], quiet=True, num_threads=num_threads, seed=0,
                               **kwargs)


def stalling_lm(latency: float, after: int, stalled: Path) -> dspy.LM:
    """The category task's LM, except that call ``after + 1`` marks ``stalled`` and blocks for good."""
    counter = itertools.count(1)

    def answer(req):
        if next(counter) > after:
            stalled.touch()
            time.sleep(3600)
        q = req.inputs.get("question", "")
        cats = {str(d.get("question", "")).split(":")[0] for d in req.demos
                if str(d.get("answer", "")).startswith("#")}
        return {"answer": reverse_answer(q) if q.split(":")[0] in cats else q}

    return scripted_lm(answer, latency_s=latency, cache=False, model="scripted/shared-search")


def main(spec: dict) -> None:
    started = time.monotonic()
    settings = {**spec["settings"], "storage": spec["url"], "study_name": spec["study"]}
    if "stall_after_calls" in spec:
        lm = stalling_lm(spec["latency"], spec["stall_after_calls"], Path(spec["stalled"]))
        with dspy.context(lm=lm):
            out = flowopt.compile(dspy.Predict("question -> answer"), TRAIN, exact, valset=VAL,
                                  stages=[RandomSearch(**settings)], quiet=True, num_threads=4, seed=0)
    else:
        out = compile_once(settings, latency=spec["latency"])
    row = out.report.stage("search")
    Path(spec["out"]).write_text(json.dumps({
        "definition": definition_of(out), "best_score": out.report.best_score, "wall_s": time.monotonic() - started,
        "search_wall_s": row.wall_s, "candidates_tried": row.candidates_tried, "stop_reason": row.stop_reason,
        "search_lm_calls": row.lm_calls, "info": row.info, "baseline": {"score": out.report.baseline_score,
                                       "lm_calls": out.report.stage("baseline").lm_calls}}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
