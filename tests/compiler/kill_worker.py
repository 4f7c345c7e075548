"""Subprocess for test_kill_resume: compile demos+search with a run_dir; log every real LM call.

Usage: python kill_worker.py RUN_DIR CALL_LOG OUT_JSON [--resume]
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    run_dir, call_log, out_path = sys.argv[1:4]
    resume = "--resume" in sys.argv
    import dspy
    from fakes import CATS, exact, examples, reverse_answer

    import flowopt
    from flowopt.modules import Predict
    from flowopt.optimizers.search import RandomSearch
    from flowopt.testing import scripted_lm

    fd = os.open(call_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def answer(req):
        os.write(fd, (hashlib.sha1(req.prompt.encode()).hexdigest() + "\n").encode())
        q = req.inputs.get("question", "")
        cats = {str(d.get("question", "")).split(":")[0] for d in req.demos
                if str(d.get("answer", "")).startswith("#")}
        return {"answer": reverse_answer(q) if q.split(":")[0] in cats else q}

    assert CATS
    lm = scripted_lm(answer, latency_s=0.01, model="scripted/kill-test")
    stages = [("demos", {"max_labeled_demos": 4}),
              RandomSearch(n_candidates=10, max_demos=3, pool_size=6, sampler="tpe")]
    with dspy.context(lm=lm):
        out = flowopt.compile(flowopt.chain("question -> answer", Predict("question -> answer")),
                              examples(15, categories=True), exact, valset=examples(24, 100, categories=True),
                              stages=stages, seed=7, run_dir=run_dir, resume=resume, quiet=True, num_threads=4)
    Path(out_path).write_text(json.dumps({"program": out.canonical_json(), "report": out.report.to_dict()}))


if __name__ == "__main__":
    main()
