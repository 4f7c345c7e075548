"""One search shared by several workers (processes or machines) through an optuna RDB study.

The study holds the truth, and every step is safe against a worker killed at any moment:

1. **Plan.** The first worker to create the lock study ``<study_name>:plan`` writes its settings in
   the study, enqueues the candidates that need no LM call (incumbent, zero-shot, labeled-only),
   then builds the search space and enqueues the rest (``n_candidates``, plus ``extra`` if it is an
   int), each a WAITING trial whose user attrs hold its full definition (demos, instruction text,
   settings), then writes the plan in the study. The others score the enqueued candidates meanwhile
   (after checking their settings against the study's); if the planner's heartbeat stops, one of
   them (chosen atomically) plans instead, adding only the candidates still missing.
2. **Claim.** A worker records a heartbeat for a WAITING trial, then moves it to RUNNING; the storage
   does that under a row lock and refuses a trial another worker already took, so no candidate is
   claimed twice. ``study.ask()`` is not used: with nothing waiting it would make a trial from the
   sampler. As the heartbeat is recorded before the claim, a trial can never be RUNNING without one.
   A candidate whose definition equals one already scored takes those stored scores.
3. **Heartbeats.** A thread records one for every trial the worker holds, every ``heartbeat_s``.
4. **Lost work.** Each worker fails stale trials (``optuna.storages.fail_stale_trials``: no heartbeat
   for ``stale_after_s``) and re-enqueues any candidate whose trials all failed; a one-time token per
   failed trial makes exactly one worker do that.
5. **The answer.** A worker with nothing to claim waits until the plan is complete and every
   candidate is scored (requeued ones included). One worker picks the finalists (lock study
   ``<study_name>:finalists``) and enqueues their re-scoring in ``<study_name>:finalist-scores``,
   which all workers claim as above; then one worker picks the winner by the stage's own rule from
   the stored scores and writes it in the study (``<study_name>:winner``); every worker returns that
   candidate. Every wait ends after ``wait_timeout_s`` without progress with an error that says what
   is stuck. A worker stopped by its own ``Budget`` returns its own pick so far.
6. **The compiler's scores.** Each worker takes the winner's and the incumbent's stored valset scores
   as its own (:meth:`~flowopt.compiler.Evaluator.remember`), so its final check of the winner and,
   with ``search`` as the first stage, its baseline cost no LM call.

Example:
    >>> from flowopt.optimizers.search import RandomSearch
    >>> stage = RandomSearch(storage="postgresql+psycopg://me@127.0.0.1/db", study_max_lm_calls=500)
    >>> stage.settings()["study_max_lm_calls"]
    500
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

import dspy

from flowopt.compiler import StageContext
from flowopt.errors import BudgetExhausted, ConfigError, FlowoptError
from flowopt.optimizers.search.shared_claims import POLL_S
from flowopt.optimizers.search.shared_plan import PLAN, PlanningWorker, apply_definition
from flowopt.optimizers.search.shared_winner import STUDY_BUDGET, WinnerPicking
from flowopt.optimizers.search.study import SCORES, stored_outcomes

if TYPE_CHECKING:
    from flowopt.optimizers.search.stage import RandomSearch

logger = logging.getLogger(__name__)

__all__ = ["PLAN", "SharedWorker", "run_shared"]


def run_shared(stage: RandomSearch, program: dspy.Module, ctx: StageContext) -> dspy.Module:
    """Work on the shared study until no candidate is left, then return the study's best program."""
    import optuna

    if stage.sampler != "random":
        raise ConfigError("a shared search plans every candidate up front, which TPE cannot (it learns from "
                          "finished trials)", fix='pass sampler="random" with a shared storage URL')
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    worker = SharedWorker(stage, ctx)
    with worker.heartbeats():
        stop_reason = worker.search(program)
        worker.log(f"search {stop_reason}, {worker.scored_here} candidates scored here")
        chosen = worker.best(program, stop_reason)
    worker.log(f"winner {ctx.outcome.best_candidate}")
    return chosen


class SharedWorker(PlanningWorker, WinnerPicking):
    """One worker's view of the shared study: it plans (:class:`PlanningWorker`), claims and scores
    candidates (here), and picks the answer with the others (:class:`WinnerPicking`)."""

    def search(self, program: dspy.Module) -> str:
        """Claim and score candidates, planning them first if this worker is the planner, until the
        plan is complete and no candidate is left or running; the stop reason.

        Candidates are scored as soon as they are enqueued, while the plan's later ones are still
        being defined. This worker's own budget ends its part at once; the study's budget
        (``study_max_lm_calls``) stops every worker from claiming, and each still waits for the
        running trials, so all agree.
        """
        from optuna.trial import TrialState

        ends = self.stage.rung_ends(len(self.order))
        width = self.stage.parallel or 1
        stop_reason = "done"
        last_progress, progress_mark = time.monotonic(), None
        while True:
            try:
                self.ctx.budget.check()
            except BudgetExhausted as err:
                return f"budget: {err.limit}"
            planned = self.plan_step(program)
            limit = self.stage.study_max_lm_calls
            if planned and limit is not None and self.study_calls() >= limit:
                stop_reason = STUDY_BUDGET
            trials = self.requeue_lost(self.study) if stop_reason == "done" else self.study.get_trials(deepcopy=False)
            waiting = ([t for t in trials if t.state == TrialState.WAITING]
                       if stop_reason == "done" and self.settings_checked else [])
            claimed: list[tuple[int, int]] = []
            for t in waiting:
                if len(claimed) >= width:
                    break
                trial_id = self.claim(self.study, t.number)
                if trial_id is not None:
                    claimed.append((t.number, trial_id))
            if claimed:
                stop = self._score(program, claimed, ends, trials)
                if stop:
                    return stop
                continue
            running = [t.number for t in trials if t.state == TrialState.RUNNING]
            finished = {t.user_attrs.get("candidate") for t in trials if t.state in (TrialState.COMPLETE,
                                                                                    TrialState.PRUNED)}
            everything = set(range(self.plan["candidates"])) if self.plan else None
            if everything is not None and not running and not waiting and (
                    stop_reason != "done" or finished >= everything):
                return stop_reason
            mark = (planned, tuple(running), sum(1 for t in trials if t.state.is_finished()))
            if mark != progress_mark:
                last_progress, progress_mark = time.monotonic(), mark
            elif time.monotonic() - last_progress > self.stage.wait_timeout_s:
                if not planned:
                    raise self.stuck(PLAN)
                raise FlowoptError(f"shared search {self.stage.study_name!r}: trials {running} ran for "
                                   f"{self.stage.wait_timeout_s} s without any trial finishing",
                                   fix="raise wait_timeout_s if candidates take that long; a dead worker's trials "
                                       f"are failed and requeued after stale_after_s={self.stage.stale_after_s} s")
            time.sleep(POLL_S)

    def _score(self, program: dspy.Module, claimed: list[tuple[int, int]], ends: list[int],
               known: list[Any]) -> str | None:
        """Race the claimed trials; a budget stop returns its reason (their candidates are requeued).

        A candidate whose definition equals one another worker scored already (``known``: the study's
        trials) takes those scores, as a one-process search takes them from its memo."""
        import optuna

        assert self.ctx.evaluator is not None
        scored = {_key(t.user_attrs["definition"]): t for t in known
                  if SCORES in t.user_attrs and "definition" in t.user_attrs}
        trials = [optuna.trial.Trial(self.study, trial_id) for _, trial_id in claimed]
        try:
            asked = [(t, apply_definition(program, t.user_attrs["definition"])) for t in trials]
            for t, candidate in asked:
                twin = scored.get(_key(t.user_attrs["definition"]))
                if twin is not None:
                    outcomes = stored_outcomes(twin)
                    self.ctx.evaluator.remember(candidate, self.order[: len(outcomes)], outcomes)
            self.stage.race(self.study, asked, self.order, ends, self.ctx)
            self.scored_here += len(trials)
            return None
        except BudgetExhausted as err:  # race failed our running trials, marked interrupted
            return f"budget: {err.limit}"
        except (optuna.exceptions.UpdateFinishedTrialError, ValueError, RuntimeError) as err:
            self.lost_to_others(self.study, trials, err)
            return None
        finally:
            self.release([trial_id for _, trial_id in claimed])
            self.record_calls()



def _key(definition: dict[str, Any]) -> str:
    return json.dumps(definition, sort_keys=True, default=str)


