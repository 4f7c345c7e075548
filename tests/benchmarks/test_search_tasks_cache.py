"""search_tasks' scripted LM under DSPy's cache: on, a repeated request is answered by the cache and not
counted; off, every request is a counted call; the caller's cache is back either way."""

from __future__ import annotations

import dspy

from flowopt.benchmarks.perf.search_tasks import Task, dspy_cache


def test_a_repeated_request_is_counted_once_with_dspys_cache_and_twice_without():
    task = Task(0, 6, 4, 4, shape="demos_only")
    question = task.val[0].question
    saved = dspy.cache
    for on, counted in ((True, 1), (False, 2)):
        lm = task.lm(0.0, cache=on)
        with dspy_cache(on), dspy.context(lm=lm):
            answers = [dspy.Predict("question -> answer")(question=question).answer for _ in range(2)]
        assert lm.engine.calls == counted and answers[0] == answers[1]
        assert dspy.cache is saved
