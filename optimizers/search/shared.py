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

import dataclasses
import json
import logging
import os
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

import dspy

from flowopt.compiler import StageContext
from flowopt.errors import BudgetExhausted, ConfigError, FlowoptError
from flowopt.optimizers.search.shared_plan import apply_definition, first_candidates, plan_candidates
from flowopt.optimizers.search.shared_storage import once, open_rdb_storage
from flowopt.optimizers.search.study import INTERRUPTED, SCORES, record_scores, stop_running, stored_outcomes

if TYPE_CHECKING:
    from flowopt.optimizers.search.stage import RandomSearch

logger = logging.getLogger(__name__)

POLL_S = 0.25  # how often a waiting worker looks at the study again
PLAN = "plan"  # the study's user attr written once every candidate is enqueued
SETTINGS = "settings"  # the study's user attr: the settings it was planned with (written before any candidate)
FINALISTS = "finalists"  # the study's user attr: the candidates re-scored against the winner's curse
FINALIST_SCORES = "finalist-scores"  # the study ``<study_name>:finalist-scores``: one trial per finalist
WINNER = "winner"  # the study's user attr: the candidate every worker returns
STUDY_BUDGET = "budget: study_max_lm_calls"
CALLS = "lm_calls:"  # study user attrs: LM calls each worker spent on this search
# Settings that may differ between the workers of one study (the planner alone uses the proposer LM).
SETTINGS_LOCAL_TO_A_WORKER = ("heartbeat_s", "stale_after_s", "wait_timeout_s", "parallel", "proposer_lm")


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
    worker.log(f"winner {ctx.info.get('best_candidate')}")
    return chosen


class SharedWorker:
    """One worker's view of the shared study: planning, claiming, heartbeats, requeueing, the final pick."""

    def __init__(self, stage: RandomSearch, ctx: StageContext) -> None:
        import optuna

        self.stage, self.ctx = stage, ctx
        self.started = time.monotonic()
        self.storage = open_rdb_storage(str(stage.storage), heartbeat_s=stage.heartbeat_s,
                                        stale_after_s=stage.stale_after_s)
        self.study = optuna.create_study(storage=self.storage, study_name=stage.study_name, direction="maximize",
                                         pruner=optuna.pruners.NopPruner(), load_if_exists=True,
                                         sampler=optuna.samplers.RandomSampler(seed=ctx.seed))
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.held: set[int] = set()  # trial ids this worker runs (heartbeats go to these)
        self._lock = threading.Lock()
        self.scored_here = 0
        self.finalists_here = 0
        self._calls_at_start = ctx.budget.snapshot().lm_calls
        self.plan: dict[str, Any] | None = None  # the study's plan summary, once complete
        self.settings_checked = False  # this worker's settings equal the ones the study was planned with
        self.order = list(ctx.valset)
        ctx.rng.shuffle(self.order)  # the same seed in every worker: the same order, comparable minibatches
        self._lost_since: dict[tuple[str, int], float] = {}  # (study, candidate) -> when first found lost
        self._locks_seen: dict[str, Any] = {}  # lock studies known to exist (someone decides there)

    def log(self, what: str) -> None:
        """A line of this worker's timeline (seconds since its search stage started)."""
        logger.info("%s: %s after %.1f s", self.worker_id, what, time.monotonic() - self.started)

    # ------------------------------------------------------------------ heartbeats
    @contextmanager
    def heartbeats(self) -> Iterator[None]:
        """Record a heartbeat for every held trial each ``heartbeat_s`` while the block runs."""
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(self.stage.heartbeat_s):
                with self._lock:
                    held = list(self.held)
                for trial_id in held:
                    try:
                        self.storage.record_heartbeat(trial_id)
                    except Exception as err:  # a database hiccup: the next beat tries again
                        logger.warning("heartbeat for trial %d failed: %s", trial_id, err)

        thread = threading.Thread(target=beat, name="flowopt-search-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def _claim(self, study: Any, trial_number: int) -> int | None:
        """Take a WAITING trial of ``study``: its id, or ``None`` when another worker got it first."""
        import optuna

        study_id = self.storage.get_study_id_from_name(study.study_name)
        trial_id = self.storage.get_trial_id_from_study_id_trial_number(study_id, trial_number)
        self.storage.record_heartbeat(trial_id)  # before RUNNING: a RUNNING trial always has a heartbeat
        try:
            if not self.storage.set_trial_state_values(trial_id, optuna.trial.TrialState.RUNNING):
                return None
        except optuna.exceptions.UpdateFinishedTrialError:
            return None
        with self._lock:
            self.held.add(trial_id)
        self.storage.set_trial_user_attr(trial_id, "worker", self.worker_id)
        return trial_id

    def _release(self, trial_ids: list[int]) -> None:
        with self._lock:
            self.held.difference_update(trial_ids)

    # ------------------------------------------------------------------ decisions taken once
    def try_decide(self, what: str, decide: Callable[[], Any],
                   attrs: dict[str, Any] | None = None) -> tuple[bool, Any]:
        """``(True, value)`` once the study's user attr ``what`` is decided, else ``(False, None)``.

        The first worker to create the lock study ``<study_name>:<what>`` decides (``decide``, now),
        holding a trial there with heartbeats; if that trial goes stale (the worker died), one
        waiting worker, chosen by a one-time token, decides instead.
        """
        import optuna

        attrs = self.study.user_attrs if attrs is None else attrs
        if what in attrs:
            return True, attrs[what]
        lock_name = f"{self.stage.study_name}:{what}"
        if lock_name not in self._locks_seen:
            if once(self.storage, lock_name):
                return True, self._decide(what, decide, optuna.load_study(study_name=lock_name, storage=self.storage))
            self._locks_seen[lock_name] = optuna.load_study(study_name=lock_name, storage=self.storage)
        lock_study = self._locks_seen[lock_name]
        self._fail_stale(lock_study)
        leaders = lock_study.get_trials(deepcopy=False)
        leader_died = bool(leaders) and all(t.state == optuna.trial.TrialState.FAIL for t in leaders)
        if leader_died and once(self.storage, f"{lock_name}:{leaders[-1].number}"):
            logger.warning("the worker deciding the %s stopped; %s decides instead", what, self.worker_id)
            return True, self._decide(what, decide, lock_study)
        return False, None

    def decided(self, what: str, decide: Callable[[], Any]) -> Any:
        """The study's user attr ``what``: decided by one worker (:meth:`try_decide`), waited for by the
        others; waiting ends after ``wait_timeout_s`` with an error."""
        deadline = time.monotonic() + self.stage.wait_timeout_s
        while True:
            done, value = self.try_decide(what, decide)
            if done:
                return value
            if time.monotonic() > deadline:
                raise self._stuck(what)
            time.sleep(POLL_S)

    def _stuck(self, what: str) -> FlowoptError:
        return FlowoptError(f"shared search {self.stage.study_name!r}: no {what} after waiting "
                            f"{self.stage.wait_timeout_s} s (the worker deciding it is alive but slow, or died "
                            "before its first heartbeat)",
                            fix=f"raise wait_timeout_s, or delete the study and its ':{what}' study and start again")

    def _decide(self, what: str, decide: Callable[[], Any], lock_study: Any) -> Any:
        from optuna.trial import TrialState

        lock_study.enqueue_trial({})
        me = self._claim(lock_study, lock_study.get_trials(deepcopy=False)[-1].number)
        value = decide()
        self.study.set_user_attr(what, value)
        if me is not None:
            self.storage.set_trial_state_values(me, TrialState.COMPLETE, [0.0])
            self._release([me])
        return value

    # ------------------------------------------------------------------ plan
    def plan_step(self, program: dspy.Module) -> bool:
        """Whether the plan is complete: checks this worker's settings against the study's, and plans
        now if no other worker is planning (or the one that was died)."""
        if self.plan is not None:
            return True
        attrs = self.study.user_attrs
        if SETTINGS in attrs and not self.settings_checked:
            mine = _fingerprint(self.stage)
            if attrs[SETTINGS] != mine:
                theirs = attrs[SETTINGS]
                differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
                raise ConfigError(f"the shared study {self.stage.study_name!r} was planned with other search "
                                  f"settings ({', '.join(differ)} differ)",
                                  fix="run every worker with the same search settings, or pass a new study_name")
            self.settings_checked = True
        done, plan = self.try_decide(PLAN, lambda: self._plan(program), attrs)
        if done:
            self.plan = dict(plan)
            self.settings_checked = True  # planned with our settings (the check above, or by us)
            self.log(f"plan of {self.plan['candidates']} candidates ready")
        return done

    def _plan(self, program: dspy.Module) -> dict[str, Any]:
        """Enqueue every candidate: first the ones defined without an LM call (other workers score them
        while this one bootstraps), then the rest."""
        self.study.set_user_attr(SETTINGS, _fingerprint(self.stage))  # before any candidate exists
        present = {t.user_attrs.get("candidate") for t in self.study.get_trials(deepcopy=False)}
        first = first_candidates(self.stage, program, self.ctx)
        self._enqueue(first, present)
        self.log(f"{len(first)} candidates enqueued before planning the rest")
        planned, space = plan_candidates(self.stage, program, self.ctx)
        if planned[: len(first)] != first:  # the two ways of defining them must agree, or workers would differ
            raise FlowoptError("the shared search's first candidates differ from its full plan's",
                               fix="report this as a flowopt bug; meanwhile run the search in one process")
        self._enqueue(planned, present)
        self._record_calls()
        return {"candidates": len(planned), "planner": self.worker_id,
                "pool_demos": {n: len(p) for n, p in space.pools.items()},
                "instruction_candidates": {n: len(c) for n, c in space.instructions.items()},
                "pool_exhausted_by": space.pool_exhausted_by}

    def _enqueue(self, planned: list[tuple[str, dict[str, Any]]], present: set[Any]) -> None:
        for number, (kind, definition) in enumerate(planned):
            if number not in present:  # a planner that died half-way enqueued the others
                self.study.enqueue_trial({}, user_attrs={"candidate": number, "kind": kind, "definition": definition})
                present.add(number)

    # ------------------------------------------------------------------ search
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
                trial_id = self._claim(self.study, t.number)
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
                    raise self._stuck(PLAN)
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
            self._lost_to_others(self.study, trials, err)
            return None
        finally:
            self._release([trial_id for _, trial_id in claimed])
            self._record_calls()

    def _lost_to_others(self, study: Any, trials: list[Any], err: BaseException) -> None:
        """Another worker found our heartbeat too old and failed these trials: it requeues them."""
        import optuna

        states = {t.number: t.state for t in study.get_trials(deepcopy=False)}
        if all(states[t.number] != optuna.trial.TrialState.FAIL for t in trials):
            raise err
        logger.warning("trials %s were failed as stale while this worker scored them (%s); requeued",
                       [t.number for t in trials], err)
        for t in trials:
            if states[t.number] == optuna.trial.TrialState.RUNNING:
                study.tell(t, state=optuna.trial.TrialState.FAIL)

    # ------------------------------------------------------------------ lost work
    def _fail_stale(self, study: Any) -> None:
        import optuna

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)

    def requeue_lost(self, study: Any) -> list[Any]:
        """Fail stale trials, re-enqueue candidates whose trials all failed; the study's trials after."""
        from optuna.trial import TrialState

        self._fail_stale(study)
        trials = study.get_trials(deepcopy=False)
        by_candidate: dict[int, list[Any]] = {}
        for t in trials:
            if "candidate" in t.user_attrs:
                by_candidate.setdefault(t.user_attrs["candidate"], []).append(t)
        requeued = False
        for number, members in by_candidate.items():
            key = (study.study_name, number)
            if any(t.state != TrialState.FAIL for t in members):
                self._lost_since.pop(key, None)
                continue
            last = max(members, key=lambda t: t.number)
            # The worker that wins the token enqueues. Should it die before that, the candidate stays
            # lost: after stale_after_s the next generation's token lets another worker do it.
            since = self._lost_since.setdefault(key, time.monotonic())
            generation = int((time.monotonic() - since) // self.stage.stale_after_s)
            if once(self.storage, f"{study.study_name}:requeue:{last.number}:{generation}"):
                logger.info("candidate %d of %s lost its worker (trial %d); requeued", number, study.study_name,
                            last.number)
                attrs = {k: v for k, v in last.user_attrs.items() if k != INTERRUPTED}
                study.enqueue_trial({}, user_attrs={**attrs, "retry_of": last.number})
                requeued = True
        return study.get_trials(deepcopy=False) if requeued else trials

    # ------------------------------------------------------------------ budget
    def _record_calls(self) -> None:
        spent = self.ctx.budget.snapshot().lm_calls - self._calls_at_start
        self.study.set_user_attr(f"{CALLS}{self.worker_id}", spent)

    def study_calls(self) -> int:
        """LM calls all workers spent on this search (planning included)."""
        return sum(int(v) for k, v in self.study.user_attrs.items() if k.startswith(CALLS))

    # ------------------------------------------------------------------ finalists
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
                    trial_id = self._claim(study, t.number)
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
                    self._lost_to_others(study, [trial], err)
                finally:
                    self._release([trial_id])
                    self._record_calls()
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
            rule._best(self.study, StoredCandidates(), program, self.ctx, stop_reason, self.stage.rung_ends(n_val),
                       n_val)
            return self.ctx.info.get("best_candidate")

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


def _key(definition: dict[str, Any]) -> str:
    return json.dumps(definition, sort_keys=True, default=str)


def _fingerprint(stage: RandomSearch) -> dict[str, Any]:
    """The settings every worker of one study must share (JSON-able, as stored in the study)."""
    settings = {k: v for k, v in stage.settings().items() if k not in SETTINGS_LOCAL_TO_A_WORKER}
    return dict(json.loads(json.dumps(settings, default=str)))
