"""Subprocess for test_kill_resume: compile demos+search with a run_dir; log every real LM call.

Usage: python kill_worker.py RUN_DIR CALL_LOG OUT_JSON [--resume]

Two logs, one line per real call:

* ``CALL_LOG`` gets the call's DSPy cache key once DSPy has stored its result (after ``dspy.cache.put``),
  for runs that end normally. A killed run's log may miss the last calls (a SIGKILL can land between
  the cache write and the log write), so the test reads a killed run's completed calls from the
  cache itself.
* ``CALL_LOG.sent`` gets a line when the engine answers: calls in flight at the kill show up there only.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    run_dir, call_log, out_path = sys.argv[1:4]
    resume = "--resume" in sys.argv
    import dspy
    from fakes import reverse_answer

    import flowopt
    from flowopt.io import atomic_write_json
    from flowopt.modules import Predict
    from flowopt.optimizers.search import RandomSearch
    from flowopt.testing import scripted_lm

    done = os.open(call_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sent = os.open(call_log + ".sent", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    cache = dspy.cache
    put = cache.put

    def logged_put(request, value, ignored_args_for_cache_key=None, *args, **kwargs):
        put(request, value, ignored_args_for_cache_key, *args, **kwargs)
        os.write(done, (cache.cache_key(request, ignored_args_for_cache_key) + "\n").encode())

    cache.put = logged_put

    def answer(req):
        os.write(sent, b"x\n")
        q = req.inputs.get("question", "")
        cats = {str(d.get("question", "")).split(":")[0] for d in req.demos
                if str(d.get("answer", "")).startswith("#")}
        return {"answer": reverse_answer(q) if q.split(":")[0] in cats else q}

    from fakes import exact, examples

    lm = scripted_lm(answer, latency_s=0.01, model="scripted/kill-test")
    stages = [("demos", {"max_labeled_demos": 4}),
              RandomSearch(n_candidates=10, seeded=3, max_demos=3, pool_size=6, sampler="tpe", parallel=3,
                           max_labeled_demos=4)]
    with dspy.context(lm=lm):
        out = flowopt.compile(flowopt.chain("question -> answer", Predict("question -> answer")),
                              examples(15, categories=True), exact, valset=examples(24, 100, categories=True),
                              stages=stages, seed=7, run_dir=run_dir, resume=resume, quiet=True, num_threads=4)
    atomic_write_json(Path(out_path), {"program": out.canonical_json(), "report": out.report.to_dict()})


if __name__ == "__main__":
    main()
