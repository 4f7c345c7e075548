"""The methods ``search_generalisation`` compares: their names, labels and stages, and one run of one method on
one seed's task (what it picked, its LM calls, the pruner's decisions scored afterwards)."""


from __future__ import annotations

import statistics
import time
from typing import Any

import dspy

from flowopt.benchmarks.perf.search_tasks import Task, dspy_cache_off, metric
from flowopt.optimizers.search.pruning import ALPHA

STRICT_ALPHA = 0.05  # the stricter level a user can ask for (the default is pruning.ALPHA, 0.1)
FINALISTS = 3  # the winner's-curse re-scoring a user can ask for (the default is finalists=0: off)
# BFRS(8)'s candidates only (extra=0), with other pruning settings: what the calls cost in guarantees.
SAME_CANDIDATE_VARIANTS: dict[str, dict[str, Any]] = {
    "flowopt8_extra0_stratified": {"pruner": "stratified"},
    "flowopt8_extra0_anytime": {"pruner": "anytime"},
    "flowopt8_extra0_alpha05": {"alpha": STRICT_ALPHA},
    # finalists=0 is the default, so the winner's-curse re-scoring is the variant (off by default, issue 27)
    "flowopt8_extra0_finalists": {"finalists": FINALISTS},
    "flowopt8_extra0_alpha05_finalists": {"alpha": STRICT_ALPHA, "finalists": FINALISTS},
    "flowopt8_extra0_stratified_finalists": {"pruner": "stratified", "finalists": FINALISTS},
}
METHODS = ("bfrs8", "bfrs16", "flowopt8", "flowopt8_extra0", *SAME_CANDIDATE_VARIANTS, "flowopt8_none",
           "flowopt_at_bfrs8_calls",
           "flowopt8_demos_extra0", "flowopt_demos_search", "mipro_light", "mipro_stage", "gepa_stage")
LABELS = {
    "bfrs8": "DSPy BFRS(8)",
    "bfrs16": "DSPy BFRS(16)",
    "flowopt8": "flowopt `search`, BFRS(8)'s candidates + paid-for extras (defaults otherwise)",
    "flowopt8_extra0": "flowopt `search`, BFRS(8)'s candidates only (`extra=0`; default `alpha=0.1`)",
    "flowopt8_extra0_stratified": "flowopt `search`, BFRS(8)'s candidates only, `pruner=\"stratified\"`",
    "flowopt8_extra0_anytime": "flowopt `search`, BFRS(8)'s candidates only, `pruner=\"anytime\"`",
    "flowopt8_extra0_alpha05": "flowopt `search`, BFRS(8)'s candidates only, `alpha=0.05` (a 5% test at each look)",
    "flowopt8_extra0_finalists": ("flowopt `search`, BFRS(8)'s candidates only, `finalists=3` (the winner's-curse "
                                  "re-scoring)"),
    "flowopt8_extra0_alpha05_finalists": "flowopt `search`, BFRS(8)'s candidates only, `alpha=0.05`, `finalists=3`",
    "flowopt8_extra0_stratified_finalists": ("flowopt `search`, BFRS(8)'s candidates only, `stratified`, "
                                             "`finalists=3`"),
    "flowopt8_none": "flowopt `search`, BFRS(8)'s candidates, `pruner=\"none\"`",
    "flowopt_at_bfrs8_calls": "flowopt `search` at BFRS(8)'s LM calls (`Budget`)",
    "flowopt8_demos_extra0": "flowopt `demos` + `search`, BFRS(8)'s candidates only (`extra=0`)",
    "flowopt_demos_search": ("flowopt `demos` + `search`, the search's default settings "
                             "(`compile()`'s default stages before b7bc532)"),
    "mipro_light": "dspy.MIPROv2(auto=\"light\")",
    "mipro_stage": "flowopt `mipro` stage (light)",
    "gepa_stage": "flowopt `gepa` stage at BFRS(8)'s LM calls",
}
SAME_CANDIDATES = "flowopt8_extra0"  # the method the "same candidates" goal reads
ANYTIME = "flowopt8_extra0_anytime"  # the same candidates under the anytime-valid pruner
STRATIFIED = "flowopt8_extra0_stratified"  # the same candidates, tested against a fully scored reference
STATED_ERROR = ALPHA  # the stated rate: each prune decision is a one-sided test at the default alpha (10%)
SMOKE = {"seeds": 2, "workers": 1, "threads": 4, "latency": 0.0, "train": 30, "val": 40, "test": 60, "tie_orders": 5,
         "methods": ["bfrs8", "flowopt8", "flowopt8_extra0", ANYTIME, "flowopt_at_bfrs8_calls", "mipro_stage",
                     "gepa_stage"]}


# -------------------------------------------------------------------------------- methods
_CAPTURED: dict[int, dict[int, Any]] = {}


def _capturing_search(**settings: Any) -> Any:
    """A RandomSearch that also hands the benchmark the programs it pruned, by candidate number (to
    score them on the whole valset afterwards, by the rule: pruner errors)."""
    from optuna.trial import TrialState

    from flowopt.optimizers.search import RandomSearch

    class CapturingSearch(RandomSearch):
        def race(self, study: Any, asked: list[Any], order: list[Any], ends: list[int], ctx: Any,
                 before_tell: Any = None) -> None:
            super().race(study, asked, order, ends, ctx, before_tell=before_tell)
            states = {t.number: t.state for t in study.get_trials(deepcopy=False)}
            store = _CAPTURED.setdefault(id(self), {})
            store.update({t.user_attrs["candidate"]: p for t, p in asked if states.get(t.number) == TrialState.PRUNED})

    return CapturingSearch(**settings)


def _stages(name: str, bfrs8_calls: int | None) -> tuple[list[Any], Any, Any]:
    """The compile() stages, budget and capturing search (if any) of one flowopt method."""
    from flowopt import Budget

    search: Any = None
    if name == "flowopt8":
        search = _capturing_search(n_candidates=11)
        return [search], None, search
    if name == "flowopt8_extra0":
        search = _capturing_search(n_candidates=11, extra=0)
        return [search], None, search
    if name in SAME_CANDIDATE_VARIANTS:
        search = _capturing_search(n_candidates=11, extra=0, **SAME_CANDIDATE_VARIANTS[name])
        return [search], None, search
    if name == "flowopt8_none":
        return [("search", {"n_candidates": 11, "extra": 0, "pruner": "none"})], None, None
    if name == "flowopt_at_bfrs8_calls":
        search = _capturing_search(n_candidates=11, max_extra=64)
        return [search], Budget(max_lm_calls=bfrs8_calls), search
    if name == "flowopt8_demos_extra0":
        search = _capturing_search(n_candidates=11, extra=0)
        return ["demos", search], None, search
    if name == "flowopt_demos_search":
        search = _capturing_search()
        return ["demos", search], None, search  # the default stages until b7bc532
    if name == "mipro_stage":
        return [("mipro", {"auto": "light"})], None, None
    if name == "gepa_stage":
        return [("gepa", {})], Budget(max_lm_calls=bfrs8_calls), None
    raise ValueError(name)


DSPY_METHODS = ("bfrs8", "bfrs16", "mipro_light")
PRUNING_KEYS = ("pruner", "alpha", "finalists")  # the settings behind a pruner error (the finalists may pick too)


def default_pruning(name: str) -> bool:
    """Does this method's search prune with the stage's default settings (``pruner``, ``alpha``, ``finalists``)?"""
    from flowopt.optimizers.search import RandomSearch

    search = None if name in DSPY_METHODS else _stages(name, 1)[2]
    return search is not None and all(getattr(search, k) == getattr(RandomSearch(), k) for k in PRUNING_KEYS)


REPORT_KEYS = ("pruned", "fully_scored", "extra", "why", "best_kind", "best_candidate", "stop_reason", "finalists",
               "candidates")


def run_method(name: str, task: Task, args: Any, bfrs8_calls: int | None) -> dict[str, Any]:
    import flowopt

    lm = task.lm(args.latency)
    student = dspy.Predict("question -> answer")
    info: dict[str, Any] = {}
    search = None
    start = time.perf_counter()
    with dspy_cache_off(), dspy.context(lm=lm):
        if name in ("bfrs8", "bfrs16"):
            from dspy.teleprompt import BootstrapFewShotWithRandomSearch

            opt = BootstrapFewShotWithRandomSearch(metric=metric, num_candidate_programs=8 if name == "bfrs8" else 16,
                                                   num_threads=args.threads)
            out = opt.compile(student, trainset=task.train, valset=task.val)
        elif name == "mipro_light":
            opt = dspy.MIPROv2(metric=metric, auto="light", num_threads=args.threads, seed=task.seed, verbose=False)
            out = opt.compile(student, trainset=task.train, valset=task.val)
        else:
            stages, budget, search = _stages(name, bfrs8_calls)
            out = flowopt.compile(student, task.train, metric, valset=task.val, stages=stages, budget=budget,
                                  seed=task.seed, num_threads=args.threads, quiet=True)
            info = {"report": {s.name: {"score": s.score, "lm_calls": s.lm_calls, "tried": s.candidates_tried,
                                        **{k: v for k, v in s.info.items() if k in REPORT_KEYS}}
                               for s in out.report.stages}}
    wall = time.perf_counter() - start
    row = {"method": name, "lm_calls": lm.engine.calls, "wall_s": round(wall, 3),
           "test": task.score(out, task.test), "val": task.score(out, task.val), **info}
    if search is not None:
        returned = row["val"]["realised"]
        captured = _CAPTURED.pop(id(search), {})
        pruned = {c: task.score(p, task.val)["realised"] for c, p in captured.items()}
        row["pruned_full_val"] = pruned
        row["pruner_error"] = any(v > returned + 1e-12 for v in pruned.values())
        row["strata_variance"] = _strata_variance(task, out, student, list(captured.values()))
    return row


def _strata_variance(task: Task, pick: Any, incumbent: Any, pruned: list[Any]) -> dict[str, float] | None:
    """How much of a pruned candidate's per-example variance on the valset (its 0/1 answers, by the rule)
    stratifying by other programs' answers removes: the within-strata share, by the pick's answers and
    by the pick's and the incumbent's together, mean over the pruned candidates (the best case for any
    stratified sample: a test of the same power needs about that share of the examples)."""
    def answers(program: Any) -> list[float]:
        demos, instruction = task.program_parts(program)
        return [float(task.correct(demos, instruction, task.index[e.question])) for e in task.val]

    by_pick, by_both = answers(pick), list(zip(answers(pick), answers(incumbent)))
    shares: dict[str, list[float]] = {"by_pick": [], "by_pick_and_incumbent": []}
    for program in pruned:
        mine = answers(program)
        total = statistics.pvariance(mine)
        if total == 0:
            continue
        for key, labels in (("by_pick", by_pick), ("by_pick_and_incumbent", by_both)):
            strata: dict[Any, list[float]] = {}
            for label, x in zip(labels, mine):
                strata.setdefault(label, []).append(x)
            within = sum(len(v) * statistics.pvariance(v) for v in strata.values()) / len(mine)
            shares[key].append(within / total)
    return {k: round(statistics.fmean(v), 4) for k, v in shares.items()} if shares["by_pick"] else None


DETAILED = (SAME_CANDIDATES, STRATIFIED, ANYTIME)  # methods whose every candidate is listed (the seeds file < 300 KB)
