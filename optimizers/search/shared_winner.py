"""The end of a shared search: the finalists re-scored by all workers against the winner's curse, then
the winner, picked once by the stage's own rule from the stored scores (see
:mod:`~flowopt.optimizers.search.shared` for the protocol).

Example:
    >>> from flowopt.optimizers.search.shared_winner import STUDY_BUDGET
    >>> STUDY_BUDGET
    'budget: study_max_lm_calls'
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, ClassVar

import dspy

from flowopt.errors import BudgetExhausted, FlowoptError
from flowopt.optimizers.search.shared_claims import POLL_S, StudyWorker
from flowopt.optimizers.search.shared_plan import apply_definition
from flowopt.optimizers.search.study import SCORES, record_scores, stop_running, stored_outcomes

logger = logging.getLogger(__name__)

FINALISTS = "finalists"  # the study's user attr: the candidates re-scored against the winner's curse
FINALIST_SCORES = "finalist-scores"  # the study ``<study_name>:finalist-scores``: one trial per finalist
WINNER = "winner"  # the study's user attr: the candidate every worker returns
STUDY_BUDGET = "budget: study_max_lm_calls"


class WinnerPicking(StudyWorker):
    """A worker's part in the end of the search: the finalists' re-scoring and the study's pick."""

    def _choose_finalists(self, program: dspy.Module) -> list[int]:
        """Enqueue the finalists' re-scoring, one trial per finalist in the study
        ``<study_name>:finalist-scores``; their candidate numbers ([] when there is nothing to re-score)."""
        from optuna.trial import TrialState

        n_val = len(self.order)
        complete = [t for t in self.study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE
                    and SCORES in t.user_attrs and len(t.user_attrs[SCORES]) == n_val]
        if not complete or not self.stage.finalists:
            return []
        close = self.stage.close_finalists(complete)
        if len(close) < 2 or not self.stage.fresh_examples(self._programs(program, close), self.ctx):
            return []
        study = self._finalist_study()
        present = {t.user_attrs.get("candidate") for t in study.get_trials(deepcopy=False)}
        for t in close:  # a decider that died half-way enqueued some
            if t.user_attrs["candidate"] not in present:
                study.enqueue_trial({}, user_attrs={"candidate": t.user_attrs["candidate"],
                                                    "definition": t.user_attrs["definition"]})
        return [int(t.user_attrs["candidate"]) for t in close]

    def _finalist_study(self) -> Any:
        import optuna

        return optuna.create_study(storage=self.storage, study_name=f"{self.stage.study_name}:{FINALIST_SCORES}",
                                   direction="maximize", load_if_exists=True)

    def _programs(self, program: dspy.Module, trials: list[Any]) -> list[dspy.Module]:
        return [apply_definition(program, t.user_attrs["definition"]) for t in trials]

    def score_finalists(self, program: dspy.Module, finalists: list[int]) -> str | None:
        """Claim and re-score finalists on the fresh examples until every one is scored (the workers
        share them); a budget stop of this worker returns its reason."""
        import optuna
        from optuna.trial import TrialState

        study = self._finalist_study()
        fresh: list[Any] | None = None
        last_progress, progress_mark = time.monotonic(), None
        while True:
            trials = self.requeue_lost(study)
            if fresh is None:  # from every finalist's demos, as the one-process search takes them
                fresh = self.stage.fresh_examples(self._programs(program, trials), self.ctx)
            claimed, trial_id = None, None
            for t in trials:
                if t.state == TrialState.WAITING:
                    trial_id = self.claim(study, t.number)
                    if trial_id is not None:
                        claimed = t
                        break
            if claimed is not None and trial_id is not None:
                trial = optuna.trial.Trial(study, trial_id)
                candidate = apply_definition(program, claimed.user_attrs["definition"])
                try:
                    result = self.ctx.evaluate(candidate, fresh, desc="finalist, fresh examples")
                    record_scores(trial, candidate, fresh, result.scores, self.ctx)
                    study.tell(trial, result.score)
                    self.finalists_here += 1
                except BudgetExhausted as err:
                    stop_running(study, [trial], "budget")
                    return f"budget: {err.limit}"
                except (optuna.exceptions.UpdateFinishedTrialError, ValueError, RuntimeError) as err:
                    self.lost_to_others(study, [trial], err)
                finally:
                    self.release([trial_id])
                    self.record_calls()
                continue
            done = {t.user_attrs["candidate"] for t in trials if t.state == TrialState.COMPLETE}
            if done >= set(finalists):
                return None
            running = [t.number for t in trials if t.state == TrialState.RUNNING]
            mark = (tuple(running), len(done))
            if mark != progress_mark:
                last_progress, progress_mark = time.monotonic(), mark
            elif time.monotonic() - last_progress > self.stage.wait_timeout_s:
                raise FlowoptError(f"shared search {self.stage.study_name!r}: finalists {running} were re-scored "
                                   f"for {self.stage.wait_timeout_s} s without one finishing",
                                   fix="raise wait_timeout_s; a dead worker's finalists are requeued after "
                                       f"stale_after_s={self.stage.stale_after_s} s")
            time.sleep(POLL_S)

    def _take_finalist_scores(self, program: dspy.Module) -> None:
        """Take the finalists' fresh scores from the study, so picking the winner costs no LM call."""
        from optuna.trial import TrialState

        assert self.ctx.evaluator is not None
        scored = [t for t in self._finalist_study().get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
        if not scored:
            return
        fresh = self.stage.fresh_examples(self._programs(program, scored), self.ctx)
        for t in scored:
            self.ctx.evaluator.remember(apply_definition(program, t.user_attrs["definition"]), fresh,
                                        stored_outcomes(t))

    # ------------------------------------------------------------------ the answer
    def best(self, program: dspy.Module, stop_reason: str) -> dspy.Module:
        """The study's pick: the finalists are re-scored by all workers, then one worker picks by the
        stage's own rule from the stored definitions and scores and writes it in the study; every
        worker returns that candidate, with its scores (and the incumbent's, the compiler's baseline)
        taken from the study, so the compiler scores neither again."""
        from optuna.trial import TrialState

        n_val = len(self.order)

        def pick() -> int | None:
            self._take_finalist_scores(program)
            # A study out of budget picks by the valset alone, as a one-process search whose budget
            # leaves nothing for the finalists.
            rule = dataclasses.replace(self.stage, finalists=0) if stop_reason == STUDY_BUDGET else self.stage
            rule.pick_best(self.study, StoredCandidates(), program, self.ctx, stop_reason, self.stage.rung_ends(n_val),
                       n_val)
            return self.ctx.outcome.best_candidate

        if stop_reason.startswith("budget:") and stop_reason != STUDY_BUDGET:
            winner = pick()  # this worker's own budget stopped it early: its pick so far, not the study's
        else:
            finalists = [] if stop_reason == STUDY_BUDGET else self.decided(
                FINALISTS, lambda: self._choose_finalists(program))
            stopped = self.score_finalists(program, finalists) if finalists else None
            if stopped:
                stop_reason = stopped
                winner = pick()
            else:
                winner = self.decided(WINNER, pick)
        trials = self.study.get_trials(deepcopy=False)
        finished = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
        scored = {t.user_attrs.get("candidate") for t in finished}
        plan = self.plan or {}
        self.ctx.record(candidates_tried=len(scored), scored_here=self.scored_here,
                        finalists_scored_here=self.finalists_here, scored_twice=len(finished) - len(scored),
                        study_candidates=plan.get("candidates"), study_lm_calls=self.study_calls(),
                        planner=plan.get("planner") == self.worker_id, pool_demos=plan.get("pool_demos"),
                        instruction_candidates=plan.get("instruction_candidates"), stop_reason=stop_reason)
        self._take_scores(program, trials, "incumbent", lambda t: t.user_attrs.get("kind") == "incumbent")
        if winner is None:
            return program
        top = next(t for t in finished if t.state == TrialState.COMPLETE and t.user_attrs["candidate"] == winner)
        value = float(top.value or 0.0)  # a COMPLETE trial of this study always has its value
        self.ctx.record(best_candidate=winner, best_kind=top.user_attrs.get("kind"), best_value=round(value, 6))
        chosen = apply_definition(program, top.user_attrs["definition"])
        self._take_scores(chosen, [top], "winner", lambda t: True)
        return chosen

    def _take_scores(self, program: dspy.Module, trials: list[Any], what: str, which: Callable[[Any], bool]) -> None:
        """Take the valset scores of the first fully scored trial ``which`` selects as ``program``'s."""
        from optuna.trial import TrialState

        assert self.ctx.evaluator is not None
        for t in trials:
            if which(t) and t.state == TrialState.COMPLETE and len(t.user_attrs.get(SCORES, ())) == len(self.order):
                self.ctx.evaluator.remember(program, self.order, stored_outcomes(t))
                return
        logger.info("%s: no fully scored %s in the study; the compiler scores it", self.worker_id, what)


class StoredCandidates:
    """Stands in for the search space when the stage picks its winner: a trial's program is its
    stored definition applied to this worker's program."""

    pools: ClassVar[dict[str, list[Any]]] = {}
    instructions: ClassVar[dict[str, list[str]]] = {}

    def apply(self, program: dspy.Module, trial: Any) -> dspy.Module:
        return apply_definition(program, trial.user_attrs["definition"])

