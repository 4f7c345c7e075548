"""``RandomSearch``: optuna search over demo sets, instructions and node settings.

Candidates, in this order (candidate numbers 0, 1, ...); by default the first ``n_candidates`` (19)
are DSPy's ``BootstrapFewShotWithRandomSearch`` (BFRS) set at DSPy's defaults (16 candidate programs),
so the search tries every program BFRS tries:

* the incumbent (the program the stage starts from);
* zero-shot (or, when the incumbent has no demos and so is the zero-shot program, DSPy's unshuffled
  bootstrap: the demos stage's program, raced like the rest instead of scored in full), labeled
  demos only, then ``n_candidates - 3`` shuffled bootstraps of DSPy's full demo size (see
  :func:`~flowopt.optimizers.demos.shuffled_bootstrap`; with seed 0 these are BFRS's very
  candidates). ``seeded=k`` keeps only ``k`` bootstraps and samples the rest;
* then extras paid for by what pruning saved or a budget leaves (:mod:`.allowance`), each a change
  to the leader of a *kind* learned during the search (:mod:`.kinds`): a fresh bootstrap, a demo
  subset drawn by optuna (random or TPE), another instruction (given, or written by the task LM or a
  ``proposer_lm``), another temperature or ``ScEnsemble`` size.

Candidates are raced in waves: the examples of every live candidate share one pool of
``num_threads`` threads, rung by rung over one shuffled order of the valset, and after each rung the
pruner (:mod:`~flowopt.optimizers.search.pruners`; default ``"confidence"``: paired test against the
leader of whether the challenger's *whole-valset* score is below the leader's, pruned only when so at
one-sided 90% (``alpha=0.1``; ``alpha=0.05`` for 95%), looking again every 5% of the valset) stops the
candidates that are behind. Scores are memoised, so the incumbent, the zero-shot program and the
compiler's final check cost nothing again. The report lists every candidate: its kind, its examples
scored, its mean there, and for a pruned one the pruner's reason.

Winner's curse: the best valset score is biased upward. ``finalists=k`` re-scores up to k fully scored
candidates the valset cannot tell from the leader on training examples that are demos of none of them,
while their order is uncertain, and picks the best on both (:mod:`.finalists`; off by default: on the
search benchmark's task it bought no measurable test score for its calls, ``benchmarks/results/README.md``).

Storage and resume: with a ``run_dir`` the study is an sqlite file, ``search.db`` in the stage's folder
(``run_dir/stages/NN-search/``), used by one process at a time; a killed search resumes from it
(candidates are numbered, sampled from a sampler seeded by (seed, number), and a wave cut short is
rerun with the parameters it had). ``storage="journal"`` uses optuna's journal file instead; an RDB URL
(``postgresql+psycopg://...``) is a study shared by workers (:mod:`~flowopt.optimizers.search.shared`).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import dspy

from flowopt.compiler import Stage, StageContext
from flowopt.errors import BudgetExhausted, ConfigError
from flowopt.optimizers.search.allowance import (
    SearchCalls,
    next_extra_wave,
    planned_count,
    racing_share,
    requests,
    wave_affordable,
)
from flowopt.optimizers.search.finalists import (
    close_finalists,
    fresh_examples,
    rescore_finalists,
)
from flowopt.optimizers.search.kinds import KINDS, LEADER, plan_extra
from flowopt.optimizers.search.pruners import Look, Pruner, get_pruner, pruner_names
from flowopt.optimizers.search.pruning import ALPHA, next_look
from flowopt.optimizers.search.shared import run_shared
from flowopt.optimizers.search.shared_storage import exclusive_run_dir, is_shared
from flowopt.optimizers.search.space import CandidateSource, SearchSpace
from flowopt.optimizers.search.study import (
    INTERRUPTED,
    SCORES,
    STUDY_NAME,
    WHY_PRUNED,
    ask,
    candidate_number,
    candidate_sampler,
    candidate_summary,
    candidate_words,
    earlier_scores,
    finished_count,
    next_wave,
    open_study,
    record_scores,
    stop_running,
)
from flowopt.settings import above, at_least, between, check_stage, one_of

SAMPLERS = ("random", "tpe")


@dataclass(frozen=True)
class RandomSearch(Stage):
    """Search demo sets, instructions and node settings with optuna; prune only what is shown worse.

    Default mix: DSPy's BFRS set at its defaults, then extras that change the leader, of the kinds
    that win on the task at hand, paid for by the calls pruning saved or a ``Budget`` leaves.

    Settings:
        n_candidates: planned candidates, counting the incumbent, zero-shot and labeled-only ones
            (default 19: BFRS's 16 candidate programs and its 3 others).
        seeded: how many shuffled bootstraps among them (``None``: all ``n_candidates - 3``); the
            rest of the planned candidates are sampled.
        extra: sampled candidates beyond the planned ones: ``None`` (default) as many as the savings
            of pruning (or a ``max_lm_calls`` budget) pay for, at most ``max_extra``; an int: exactly
            that many.
        max_extra: cap on paid-for extras.
        kinds: extra kinds allowed (:data:`~.kinds.KINDS`, default all; one with nothing to vary is skipped).
        max_demos: bootstrapped demos per seeded candidate (1..max_demos, drawn per candidate) and
            demo slots of a sampled candidate.
        search_k: for sampled candidates, also search how many demos to show (1..max_demos).
        pool_size: demos the sampled candidates draw from; bootstrapped only when the planned
            candidates' demos are fewer.
        max_labeled_demos: labeled demos in each teacher, and the demo count seeded candidates are
            topped up to with labeled examples (DSPy's ``max_labeled_demos``).
        metric_threshold: the score a bootstrapped trace must reach to become a demo (``None``: truthy).
        sampler: ``"random"`` or ``"tpe"``.
        pruner: the name of a registered :class:`~flowopt.optimizers.search.pruners.Pruner`, each
            documented on its class: ``"confidence"`` (paired test against the leader, prune when worse
            at one-sided ``alpha``), ``"stratified"`` (tested against a fully scored reference),
            ``"anytime"`` (a betting test valid at every look), ``"halving"`` (keep the best
            ``1/reduction_factor`` of the challengers), ``"median"``, ``"none"``, or a user's own rule
            (:func:`~flowopt.optimizers.search.pruners.register_pruner`). The incumbent is never pruned.
        alpha: the pruners' one-sided error level per decision, and the finalists' (default 0.1,
            :data:`~flowopt.optimizers.search.pruning.ALPHA`; ``"anytime"``: over all of a challenger's
            looks against one leader). ``alpha=0.05`` prunes a candidate that is not worse half as
            often, for more LM calls (``benchmarks/results/search_generalisation.md``).
        reduction_factor: successive halving's eta.
        minibatch_size: valset examples in the first rung (``confidence``, ``anytime``: at least 20;
            the other rules: at least ``max(20, 25% of the valset)``); then ``confidence`` looks again
            every 5% of the valset (a trailing candidate stops within a few examples of falling
            clearly behind), ``anytime`` after every example, the other rules at rungs growing 2x.
        parallel: candidates raced at once (default: all planned ones for ``"random"``, 4 for
            ``"tpe"``; extras go 4 at a time).
        finalists: how many fully scored candidates to re-score against the winner's curse (default 0: off).
        instructions: extra candidate instructions per predictor name (``"*"``: every predictor).
        proposer_lm: the LM that writes ``n_proposals`` more instructions per predictor: ``"task"``
            (default) the program's own LM, ``None`` none.
        n_proposals: instructions the proposer writes per predictor.
        temperatures: temperatures to try per node (the current one is always a candidate).
        ensemble_n: sample counts to try for ``ScEnsemble`` nodes of a Workflow.
        storage: ``None`` (sqlite file ``run_dir/search.db``; in memory without a run_dir),
            ``"journal"`` (optuna journal file in run_dir) or an optuna RDB URL shared by workers.
        study_name: the study's name in ``storage``.
        study_max_lm_calls: a shared study's LM-call budget, counted over all workers (each worker's
            own ``Budget`` still applies to it).
        heartbeat_s, stale_after_s: a shared study's worker records a heartbeat for its trials every
            ``heartbeat_s``; a trial without one for ``stale_after_s`` is failed and its candidate requeued.
        wait_timeout_s: how long a worker of a shared study waits without progress (for the plan, or
            for other workers' trials) before it stops with an error.

    Example:
        >>> from flowopt.optimizers.search import RandomSearch
        >>> RandomSearch(n_candidates=8, sampler="tpe").settings()["sampler"]
        'tpe'
        >>> RandomSearch(n_candidates=11).seeded_count()  # BFRS with 8 candidate programs
        8
    """

    name: ClassVar[str] = "search"
    n_candidates: int = 19
    seeded: int | None = None
    extra: int | None = None
    max_extra: int = 48
    kinds: Sequence[str] = KINDS
    max_demos: int = 4
    search_k: bool = True
    pool_size: int = 16
    max_labeled_demos: int = 16
    metric_threshold: float | None = None
    sampler: str = "random"
    pruner: str = "confidence"
    alpha: float = ALPHA
    reduction_factor: int = 3
    minibatch_size: int | None = None
    parallel: int | None = None
    finalists: int = 0
    instructions: Mapping[str, Sequence[str]] | None = None
    proposer_lm: Any = "task"
    n_proposals: int = 5
    temperatures: Sequence[float] = ()
    ensemble_n: Sequence[int] = ()
    storage: str | None = None
    study_name: str = STUDY_NAME
    study_max_lm_calls: int | None = None
    heartbeat_s: int = 10
    stale_after_s: int = 60
    wait_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        check_stage(self, {
            "n_candidates": at_least(1), "max_demos": at_least(0), "pool_size": at_least(0),
            "max_labeled_demos": at_least(0), "n_proposals": at_least(0), "max_extra": at_least(0),
            "finalists": at_least(0), "reduction_factor": at_least(2), "heartbeat_s": at_least(1),
            "wait_timeout_s": above(0.0), "seeded": at_least(0), "extra": at_least(0),
            "minibatch_size": at_least(1), "parallel": at_least(1), "study_max_lm_calls": at_least(1),
            "alpha": above(0.0, 0.5), "sampler": one_of(*SAMPLERS), "pruner": one_of(*pruner_names()),
            "temperatures": between(0.0, 2.0), "ensemble_n": at_least(1),
        })
        if not self.kinds or not set(self.kinds) <= set(KINDS):
            raise ConfigError(f"RandomSearch kinds must be a non-empty subset of {list(KINDS)}, got {self.kinds!r}",
                              fix=f"pass kinds={list(KINDS)!r}, or some of them")
        if self.stale_after_s < 2 * self.heartbeat_s:  # a live worker must get two heartbeats in
            raise ConfigError(f"RandomSearch stale_after_s must be >= 2 * heartbeat_s ({2 * self.heartbeat_s}), "
                              f"got {self.stale_after_s!r}", fix=f"pass stale_after_s={max(60, 2 * self.heartbeat_s)}")
        if self.storage is not None and not (self.storage in ("sqlite", "journal") or "://" in self.storage):
            raise ConfigError(f"RandomSearch storage must be None, 'journal' or an optuna RDB URL, "
                              f"got {self.storage!r}",
                              fix='leave storage unset (sqlite in run_dir), or pass "postgresql://user@host/db"')

    def seeded_count(self) -> int:
        """How many shuffled-bootstrap candidates this search tries."""
        left = max(0, self.n_candidates - 3)
        return min(left, self.seeded if self.seeded is not None else left)

    def may_sample(self) -> bool:
        """Whether any candidate may be sampled (so the space needs a demo pool)."""
        return self.n_candidates > 3 + self.seeded_count() or self.extra != 0

    def pruning_rule(self) -> Pruner:
        """The :class:`~flowopt.optimizers.search.pruners.Pruner` that ``pruner`` names, at this ``alpha``."""
        return get_pruner(self.pruner)(alpha=self.alpha, reduction_factor=self.reduction_factor)

    def rung_ends(self, n: int) -> list[int]:
        """Where the rungs end on a valset of ``n`` examples (cumulative counts; the last is ``n``)."""
        return self.pruning_rule().rung_ends(n, self.minibatch_size)

    def scores_its_start(self) -> bool:
        """A shared search scores the incumbent (the program it starts from) on the whole valset as
        one of its candidates, once for all workers: the compiler takes the baseline from it."""
        return is_shared(self.storage)

    # ------------------------------------------------------------------ run
    def run(self, program: dspy.Module, ctx: StageContext) -> dspy.Module:
        if is_shared(self.storage):
            return run_shared(self, program, ctx)
        with exclusive_run_dir(ctx.run_dir):
            return self._run_alone(program, ctx)

    def _run_alone(self, program: dspy.Module, ctx: StageContext) -> dspy.Module:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        start_calls = requests(ctx)
        planned = planned_count(self, len(ctx.valset), ctx.budget.remaining_calls())
        with ThreadPoolExecutor(max_workers=max(1, ctx.num_threads), thread_name_prefix="flowopt-search") as lm_pool:
            space = SearchSpace.build(self, program, ctx, lm_pool, planned)
        calls = SearchCalls(ctx, start_calls)
        study = open_study(self.storage, self.study_name, optuna.pruners.NopPruner(), ctx.run_dir, ctx.resume)
        order = list(ctx.valset)
        ctx.rng.shuffle(order)  # one fixed order: the candidates' scores are paired example by example
        n = len(order)
        ends = self.rung_ends(n)
        budgeted = ctx.budget.remaining_calls() is not None
        # Under a call budget the planned candidates race 4 at a time, so each wave ends scored before the next
        # starts, and a wave starts only while the budget pays for it (a wave cut short returns nothing).
        width = self.parallel or (planned if self.sampler == "random" and not budgeted else 4)
        stop_reason, extras = "done", 0
        calls.resume_from(study)  # resumed: the earlier run's candidates' calls count too
        bar = ctx.progress(total=planned, desc=f"{ctx.stage_name}: candidates",
                           initial=min(planned, finished_count(study)))
        try:
            while wave := next_wave(study, planned, width):
                ctx.budget.check()
                if budgeted and finished_count(study) and not wave_affordable(study, n, len(wave), ctx):
                    planned = 0  # no extras either
                    stop_reason = "budget: max_lm_calls"  # stopped early by the budget, so a resume goes on
                    break
                asked = [self.ask_candidate(study, space, program, ctx, number, previous, planned)
                         for number, previous in wave]
                calls.start_wave()
                self.race(study, asked, order, ends, ctx, before_tell=lambda racing: calls.record(study, racing))
                bar.update(len(asked))
            extra_width = self.parallel or 4
            while (count := next_extra_wave(self, study, planned, n, extras, extra_width, ctx, calls)) > 0:
                wave = next_wave(study, planned + extras + count, count, start=planned + extras)
                extras += count
                if not wave:
                    continue
                ctx.budget.check()
                asked = [self.ask_candidate(study, space, program, ctx, number, previous, planned)
                         for number, previous in wave]
                calls.start_wave()
                self.race(study, asked, order, ends, ctx, before_tell=lambda racing: calls.record(study, racing))
                bar.update(len(asked))
        except BudgetExhausted as err:
            stop_reason = f"budget: {err.limit}"
        finally:
            bar.close()
        if space.pool_exhausted_by:
            stop_reason = f"budget: {space.pool_exhausted_by}"
        return self.pick_best(study, space, program, ctx, stop_reason, ends, n)

    def ask_candidate(self, study: Any, space: SearchSpace, program: dspy.Module, ctx: StageContext, number: int,
                      previous: Any, planned: int | None = None) -> tuple[Any, dspy.Module]:
        """Ask candidate ``number``: rerun, seed, plan an extra past ``planned`` by kind, or sample one."""
        if previous is not None:  # rerun a candidate cut short by a kill with the parameters it had
            attrs = {k: v for k, v in previous.user_attrs.items() if k not in (INTERRUPTED, SCORES)}
            study.enqueue_trial(dict(previous.params), user_attrs=attrs)
        elif number < len(space.seeded):
            kind, demos = space.seeded[number]
            study.enqueue_trial(space.fixed_params(), user_attrs={"candidate": number, "kind": kind, "demos": demos})
        elif planned is not None and number >= planned and space.extra_kinds():  # an extra: changes the leader
            plan_extra(study, space, ctx, number, self.sampler, self.n_candidates,
                       lambda k: space.fresh_bootstrap(self, program, ctx, k))
        else:
            study.sampler = candidate_sampler(self.sampler, ctx.seed, number, self.n_candidates)
        trial = ask(study)
        if "candidate" not in trial.user_attrs:
            trial.set_user_attr("candidate", number)
            trial.set_user_attr("kind", "sampled")
        return trial, space.apply(program, trial)

    def race(self, study: Any, asked: list[tuple[Any, dspy.Module]], order: list[Any], ends: list[int],
             ctx: StageContext, before_tell: Callable[[float], Any] | None = None) -> None:
        """Score a wave of candidates together, rung by rung, pruning those shown to trail (a shared search
        races its claims through it too); ``before_tell`` runs before each verdict is stored, given the share
        of the wave's scores that candidates still racing after that verdict hold (a kill would cut them short)."""
        tell_hook = before_tell or (lambda racing: None)
        from optuna.trial import TrialState

        alive = list(asked)
        scores: dict[int, list[float]] = {t.number: [] for t, _ in alive}
        # Only a verdict between rungs reads the other trials (a database round trip in a shared study).
        earlier = study.get_trials(deepcopy=False) if len(ends) > 1 else []
        others = earlier_scores(earlier, exclude=set(scores))
        incumbent = next((t.number for t in earlier if t.user_attrs.get("kind") == "incumbent"), None)
        rule = self.pruning_rule()
        prev, told = 0, set()

        def tell(trial: Any, *value: float, **state: Any) -> None:
            told.add(trial.number)
            tell_hook(racing_share(scores, set(scores) - told))
            study.tell(trial, *value, **state)

        try:
            while alive and prev < len(order):
                behind = [(t, c) for t, c in alive if len(scores[t.number]) < len(order)]  # not scored ahead
                if not behind:
                    break
                # The next look is the first that gives every thread an example (one candidate left: 8 at a time).
                cum = next_look(ends, prev, len(behind), ctx.num_threads)
                ctx.budget.check()
                results = ctx.evaluate_many([(c, order[prev:cum]) for _, c in behind],
                                            desc=f"{len(behind)} candidates, {cum}/{len(order)}")
                for (trial, _), result in zip(behind, results):
                    scores[trial.number].extend(result.scores)
                    trial.report(_mean(scores[trial.number]), step=cum)
                prev = cum
                if cum < len(order):
                    if rule.scores_leader_ahead:
                        self._score_leader_ahead(alive, scores, others, cum, order, ctx)
                    # Every candidate is scored on the rung before any is judged: verdicts don't depend on order.
                    live = {t.number: scores[t.number] for t, _ in alive}
                    pruned = rule.prune(Look(live, others, cum, incumbent, population=len(order)))
                    for trial, candidate in alive:
                        if trial.number in pruned:
                            record_scores(trial, candidate, order, scores[trial.number], ctx)
                            trial.set_user_attr(WHY_PRUNED, candidate_words(study, pruned[trial.number]))
                            tell(trial, state=TrialState.PRUNED)
                    alive = [a for a in alive if a[0].number not in pruned]
            for trial, candidate in alive:
                record_scores(trial, candidate, order, scores[trial.number], ctx)
                tell(trial, _mean(scores[trial.number]))
        except BudgetExhausted:
            stop_running(study, [trial for trial, _ in alive], "budget")
            raise

    @staticmethod
    def _score_leader_ahead(alive: list[tuple[Any, dspy.Module]], scores: dict[int, list[float]],
                            others: Mapping[int, Sequence[float]], cum: int, order: list[Any],
                            ctx: StageContext) -> None:
        """The stratified pruner tests challengers against a fully scored reference: score this look's
        leader (the best on the first ``cum`` examples, of this wave or an earlier one) on the rest of the
        valset now. It is the likely pick, whose whole-valset scores the compiler's final check needs
        anyway (the incumbent's come from the memo)."""
        firsts = {k: v[:cum] for k, v in {**others, **scores}.items() if len(v) >= cum}
        leader = max(firsts, key=lambda k: (sum(firsts[k]), -k))
        ahead = next(((t, c) for t, c in alive if t.number == leader and len(scores[leader]) < len(order)), None)
        if ahead is None:
            return
        trial, candidate = ahead
        result, = ctx.evaluate_many([(candidate, order[cum:])], desc=f"leader, {cum}/{len(order)} -> all")
        scores[leader].extend(result.scores)
        trial.report(_mean(scores[leader]), step=len(order))

    def close_finalists(self, complete: list[Any]) -> list[Any]:
        """The fully scored trials (at most ``finalists``) the valset cannot tell from the leader, best first."""
        return close_finalists(complete, self.finalists, self.alpha)

    @staticmethod
    def fresh_examples(programs: list[dspy.Module], ctx: StageContext) -> list[Any]:
        """The training examples the finalists are re-scored on: demos of none of ``programs``."""
        return fresh_examples(programs, ctx)

    def _finalists(self, complete: list[Any], space: CandidateSource, program: dspy.Module,
                   ctx: StageContext) -> list[dict[str, Any]]:
        return rescore_finalists(self.close_finalists(complete), space, program, ctx, self.alpha)

    def pick_best(self, study: Any, space: CandidateSource, program: dspy.Module, ctx: StageContext,
              stop_reason: str, ends: list[int], n_val: int) -> dspy.Module:
        from optuna.trial import TrialState

        trials = study.get_trials(deepcopy=False)
        complete = [t for t in trials if t.state == TrialState.COMPLETE and SCORES in t.user_attrs
                    and len(t.user_attrs[SCORES]) == n_val]
        pruned = [t for t in trials if t.state == TrialState.PRUNED]
        by_rung = {str(end): count for end in ends[:-1]
                   if (count := sum(1 for t in pruned if len(t.user_attrs.get(SCORES, ())) == end))}
        ctx.record(candidates_tried=len(complete) + len(pruned), pruned=len(pruned), pruned_by_rung=by_rung,
                   fully_scored=len(complete), rungs=ends, pruner=self.pruner, stop_reason=stop_reason,
                   extra=sum(1 for t in complete + pruned if LEADER in t.user_attrs
                             or t.user_attrs.get("candidate", 0) >= self.n_candidates),
                   seeded=sum(1 for t in complete + pruned if LEADER not in t.user_attrs
                              and t.user_attrs.get("kind") not in (None, "sampled", "incumbent")),
                   extra_kinds=dict(Counter(t.user_attrs["kind"] for t in complete + pruned if LEADER in t.user_attrs)),
                   pool_demos={n: len(p) for n, p in space.pools.items()},
                   instruction_candidates={n: len(c) for n, c in space.instructions.items()})
        if not complete:
            return program
        rows = self._finalists(complete, space, program, ctx) if self.finalists else []
        if rows:
            best_row = max((r for r in rows if r["in_final"]), key=lambda r: (r["combined"], -r["candidate"]))
            best = best_row["trial"]
        else:
            best = max(complete, key=lambda t: (t.value, -t.user_attrs.get("candidate", t.number)))
        ranked = sorted(complete, key=lambda t: -t.value)
        runner_up = next((t for t in ranked if t is not best), None)
        why = (f"best valset mean {best.value:.3f} over {n_val} examples among {len(complete)} fully scored"
               + (f" (runner-up {runner_up.value:.3f})" if runner_up is not None else ""))
        if len(rows) > 1:
            why = (f"best mean over the valset + {best_row['fresh_n']} fresh training examples among {len(rows)} "
                   f"finalists the valset could not tell apart"
                   + (f" ({len(rows) - sum(r['in_final'] for r in rows)} stopped early, shown worse)"
                      if not all(r["in_final"] for r in rows) else ""))
        ctx.record(best_candidate=candidate_number(best), best_kind=best.user_attrs.get("kind"),
                   best_value=round(best.value, 6), why=why,
                   finalists=[{k: v for k, v in r.items() if k != "trial"} for r in rows],
                   candidates=[candidate_summary(t) for t in sorted(complete + pruned, key=candidate_number)])
        return space.apply(program, best)


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else 0.0
