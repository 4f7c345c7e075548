"""One search shared by several workers (processes or machines) through an optuna RDB study.

The study holds the truth, and every step is safe against a worker killed at any moment:

1. **Plan.** The first worker to create the lock study ``<study_name>:plan`` builds the search
   space and enqueues every candidate (``n_candidates``, plus ``extra`` if it is an int) as a
   WAITING trial whose user attrs hold its full definition (demos, instruction text, settings),
   then writes the plan in the study. The others wait for it; if the planner's heartbeat stops,
   one of them (chosen atomically) plans instead, adding only the candidates still missing.
2. **Claim.** A worker records a heartbeat for a WAITING trial, then moves it to RUNNING; the storage
   does that under a row lock and refuses a trial another worker already took, so no candidate is
   claimed twice. ``study.ask()`` is not used: with nothing waiting it would make a trial from the
   sampler. As the heartbeat is recorded before the claim, a trial can never be RUNNING without one.
3. **Heartbeats.** A thread records one for every trial the worker holds, every ``heartbeat_s``.
4. **Lost work.** Each worker fails stale trials (``optuna.storages.fail_stale_trials``: no heartbeat
   for ``stale_after_s``) and re-enqueues any candidate whose trials all failed; a one-time token per
   failed trial makes exactly one worker do that.
5. **The answer.** A worker with nothing to claim waits until every candidate is scored (requeued
   ones included). Then one worker picks the winner by the stage's own rule (finalists included)
   and writes it in the study (lock study ``<study_name>:winner``, as for the plan); every worker
   returns that candidate. Every wait ends after ``wait_timeout_s`` without progress with an error
   that says what is stuck. A worker stopped by its own ``Budget`` returns its own pick so far.

Example:
    >>> from flowopt.optimizers.search import RandomSearch
    >>> stage = RandomSearch(storage="postgresql+psycopg://me@127.0.0.1/db", study_max_lm_calls=500)
    >>> stage.settings()["study_max_lm_calls"]
    500
"""

from __future__ import annotations

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
from flowopt.optimizers.search.shared_plan import apply_definition, plan_candidates
from flowopt.optimizers.search.shared_storage import once, open_rdb_storage
from flowopt.optimizers.search.study import INTERRUPTED

if TYPE_CHECKING:
    from flowopt.optimizers.search.stage import RandomSearch

logger = logging.getLogger(__name__)

POLL_S = 0.25  # how often a waiting worker looks at the study again
PLAN = "plan"  # the study's user attr written once every candidate is enqueued
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
    started = time.monotonic()
    worker = SharedWorker(stage, ctx)
    with worker.heartbeats():
        plan = worker.ensure_plan(program)
        logger.info("%s: plan of %d candidates ready after %.1f s", worker.worker_id, plan["candidates"],
                    time.monotonic() - started)
        stop_reason = worker.search(program)
        logger.info("%s: search %s after %.1f s, %d candidates scored here", worker.worker_id, stop_reason,
                    time.monotonic() - started, worker.scored_here)
        chosen = worker.best(program, stop_reason, plan)
    logger.info("%s: winner %s after %.1f s", worker.worker_id, ctx.info.get("best_candidate"),
                time.monotonic() - started)
    return chosen


class SharedWorker:
    """One worker's view of the shared study: claiming, heartbeats, requeueing and the final pick."""

    def __init__(self, stage: RandomSearch, ctx: StageContext) -> None:
        import optuna

        self.stage, self.ctx = stage, ctx
        self.storage = open_rdb_storage(str(stage.storage), heartbeat_s=stage.heartbeat_s,
                                        stale_after_s=stage.stale_after_s)
        self.study = optuna.create_study(storage=self.storage, study_name=stage.study_name, direction="maximize",
                                         pruner=optuna.pruners.NopPruner(), load_if_exists=True,
                                         sampler=optuna.samplers.RandomSampler(seed=ctx.seed))
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.held: set[int] = set()  # trial ids this worker runs (heartbeats go to these)
        self._lock = threading.Lock()
        self.scored_here = 0
        self._calls_at_start = ctx.budget.snapshot().lm_calls
        self.n_candidates = 0  # from the plan
        self._lost_since: dict[int, float] = {}  # candidate -> when this worker first found it lost

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

    # ------------------------------------------------------------------ plan
    def decided(self, what: str, decide: Callable[[], Any]) -> Any:
        """The study's user attr ``what``: computed by one worker (``decide``), waited for by the others.

        The first worker to create the lock study ``<study_name>:<what>`` decides, holding a trial
        there with heartbeats; if that trial goes stale (the worker died), one waiting worker, chosen
        by a one-time token, decides instead. Waiting ends after ``wait_timeout_s`` with an error.
        """
        import optuna

        lock_name = f"{self.stage.study_name}:{what}"
        lock_study = None
        deadline = time.monotonic() + self.stage.wait_timeout_s
        while what not in self.study.user_attrs:
            if once(self.storage, lock_name):
                return self._decide(what, decide, optuna.load_study(study_name=lock_name, storage=self.storage))
            lock_study = lock_study or optuna.load_study(study_name=lock_name, storage=self.storage)
            self._fail_stale(lock_study)
            leaders = lock_study.get_trials(deepcopy=False)
            leader_died = bool(leaders) and all(t.state == optuna.trial.TrialState.FAIL for t in leaders)
            if leader_died and once(self.storage, f"{lock_name}:{leaders[-1].number}"):
                logger.warning("the worker deciding the %s stopped; %s decides instead", what, self.worker_id)
                return self._decide(what, decide, lock_study)
            if time.monotonic() > deadline:
                raise FlowoptError(f"shared search {self.stage.study_name!r}: no {what} after waiting "
                                   f"{self.stage.wait_timeout_s} s (the worker deciding it is alive but slow, or died "
                                   "before its first heartbeat)",
                                   fix=f"raise wait_timeout_s, or delete the study and its ':{what}' study and "
                                       "start again")
            time.sleep(POLL_S)
        return self.study.user_attrs[what]

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

    def ensure_plan(self, program: dspy.Module) -> dict[str, Any]:
        """Plan the candidates (one worker) or wait for the plan; returns the plan's summary."""
        plan = dict(self.decided(PLAN, lambda: self._plan(program)))
        self.n_candidates = int(plan["candidates"])
        mine = _fingerprint(self.stage)
        if plan["settings"] != mine:
            differ = sorted(k for k in set(mine) | set(plan["settings"]) if mine.get(k) != plan["settings"].get(k))
            raise ConfigError(f"the shared study {self.stage.study_name!r} was planned with other search settings "
                              f"({', '.join(differ)} differ)",
                              fix="run every worker with the same search settings, or pass a new study_name")
        return plan

    def _plan(self, program: dspy.Module) -> dict[str, Any]:
        started = time.monotonic()
        planned, space = plan_candidates(self.stage, program, self.ctx)
        logger.info("%s: %d candidates planned in %.1f s", self.worker_id, len(planned), time.monotonic() - started)
        present = {t.user_attrs.get("candidate") for t in self.study.get_trials(deepcopy=False)}
        for number, (kind, definition) in enumerate(planned):
            if number not in present:  # a planner that died half-way enqueued the others
                self.study.enqueue_trial({}, user_attrs={"candidate": number, "kind": kind, "definition": definition})
        self._record_calls()
        return {"candidates": len(planned), "settings": _fingerprint(self.stage), "planner": self.worker_id,
                "pool_demos": {n: len(p) for n, p in space.pools.items()},
                "instruction_candidates": {n: len(c) for n, c in space.instructions.items()},
                "pool_exhausted_by": space.pool_exhausted_by}

    # ------------------------------------------------------------------ search
    def search(self, program: dspy.Module) -> str:
        """Claim and score candidates until none is left and none is running; the stop reason.

        This worker's own budget ends its part at once; the study's budget (``study_max_lm_calls``)
        stops every worker from claiming, and each still waits for the running trials, so all agree.
        """
        from optuna.trial import TrialState

        order = list(self.ctx.valset)
        self.ctx.rng.shuffle(order)  # the same seed in every worker: the same order, comparable minibatches
        ends = self.stage.rung_ends(len(order))
        width = self.stage.parallel or 1
        stop_reason = "done"
        last_progress, progress_mark = time.monotonic(), None
        while True:
            try:
                self.ctx.budget.check()
            except BudgetExhausted as err:
                return f"budget: {err.limit}"
            limit = self.stage.study_max_lm_calls
            if limit is not None and self.study_calls() >= limit:
                stop_reason = STUDY_BUDGET
            trials = self.requeue_lost() if stop_reason == "done" else self.study.get_trials(deepcopy=False)
            waiting = [t for t in trials if t.state == TrialState.WAITING] if stop_reason == "done" else []
            claimed: list[tuple[int, int]] = []
            for t in waiting:
                if len(claimed) >= width:
                    break
                trial_id = self._claim(self.study, t.number)
                if trial_id is not None:
                    claimed.append((t.number, trial_id))
            if claimed:
                stop = self._score(program, claimed, order, ends)
                if stop:
                    return stop
                continue
            running = [t.number for t in trials if t.state == TrialState.RUNNING]
            finished = {t.user_attrs.get("candidate") for t in trials if t.state in (TrialState.COMPLETE,
                                                                                    TrialState.PRUNED)}
            if not running and not waiting and (stop_reason != "done" or finished >= set(range(self.n_candidates))):
                return stop_reason
            mark = (tuple(running), sum(1 for t in trials if t.state.is_finished()))
            if mark != progress_mark:
                last_progress, progress_mark = time.monotonic(), mark
            elif time.monotonic() - last_progress > self.stage.wait_timeout_s:
                raise FlowoptError(f"shared search {self.stage.study_name!r}: trials {running} ran for "
                                   f"{self.stage.wait_timeout_s} s without any trial finishing",
                                   fix="raise wait_timeout_s if candidates take that long; a dead worker's trials "
                                       f"are failed and requeued after stale_after_s={self.stage.stale_after_s} s")
            time.sleep(POLL_S)

    def _score(self, program: dspy.Module, claimed: list[tuple[int, int]], order: list[Any],
               ends: list[int]) -> str | None:
        """Race the claimed trials; a budget stop returns its reason (their candidates are requeued)."""
        import optuna

        trials = [optuna.trial.Trial(self.study, trial_id) for _, trial_id in claimed]
        try:
            asked = [(t, apply_definition(program, t.user_attrs["definition"])) for t in trials]
            self.stage._race(self.study, asked, order, ends, self.ctx)
            self.scored_here += len(trials)
            return None
        except BudgetExhausted as err:  # _race failed our running trials, marked interrupted
            return f"budget: {err.limit}"
        except (optuna.exceptions.UpdateFinishedTrialError, ValueError, RuntimeError) as err:
            # Another worker found our heartbeat too old and failed the trials: it requeues them.
            states = {t.number: t.state for t in self.study.get_trials(deepcopy=False)}
            if all(states[t.number] != optuna.trial.TrialState.FAIL for t in trials):
                raise
            logger.warning("trials %s were failed as stale while this worker scored them (%s); requeued",
                           [t.number for t in trials], err)
            for t in trials:
                if states[t.number] == optuna.trial.TrialState.RUNNING:
                    self.study.tell(t, state=optuna.trial.TrialState.FAIL)
            return None
        finally:
            self._release([trial_id for _, trial_id in claimed])
            self._record_calls()

    # ------------------------------------------------------------------ lost work
    def _fail_stale(self, study: Any) -> None:
        import optuna

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)

    def requeue_lost(self) -> list[Any]:
        """Fail stale trials, re-enqueue candidates whose trials all failed; the study's trials after."""
        from optuna.trial import TrialState

        self._fail_stale(self.study)
        trials = self.study.get_trials(deepcopy=False)
        by_candidate: dict[int, list[Any]] = {}
        for t in trials:
            if "candidate" in t.user_attrs:
                by_candidate.setdefault(t.user_attrs["candidate"], []).append(t)
        requeued = False
        for number, members in by_candidate.items():
            if any(t.state != TrialState.FAIL for t in members):
                self._lost_since.pop(number, None)
                continue
            last = max(members, key=lambda t: t.number)
            # The worker that wins the token enqueues. Should it die before that, the candidate stays
            # lost: after stale_after_s the next generation's token lets another worker do it.
            since = self._lost_since.setdefault(number, time.monotonic())
            generation = int((time.monotonic() - since) // self.stage.stale_after_s)
            if once(self.storage, f"{self.stage.study_name}:requeue:{last.number}:{generation}"):
                logger.info("candidate %d lost its worker (trial %d); requeued", number, last.number)
                attrs = {k: v for k, v in last.user_attrs.items() if k != INTERRUPTED}
                self.study.enqueue_trial({}, user_attrs={**attrs, "retry_of": last.number})
                requeued = True
        return self.study.get_trials(deepcopy=False) if requeued else trials

    # ------------------------------------------------------------------ budget and the answer
    def _record_calls(self) -> None:
        spent = self.ctx.budget.snapshot().lm_calls - self._calls_at_start
        self.study.set_user_attr(f"{CALLS}{self.worker_id}", spent)

    def study_calls(self) -> int:
        """LM calls all workers spent on this search (planning included)."""
        return sum(int(v) for k, v in self.study.user_attrs.items() if k.startswith(CALLS))

    def best(self, program: dspy.Module, stop_reason: str, plan: dict[str, Any]) -> dspy.Module:
        """The study's pick: one worker picks by the stage's own rule (finalists included) from the
        stored definitions and writes it in the study; every worker returns that candidate."""
        from optuna.trial import TrialState

        n_val = len(self.ctx.valset)

        def pick() -> int | None:
            self.stage._best(self.study, StoredCandidates(), program, self.ctx, stop_reason,
                             self.stage.rung_ends(n_val), n_val)
            return self.ctx.info.get("best_candidate")

        if stop_reason.startswith("budget:") and stop_reason != STUDY_BUDGET:
            winner = pick()  # this worker's own budget stopped it early: its pick so far, not the study's
        else:
            winner = self.decided(WINNER, pick)
        finished = [t for t in self.study.get_trials(deepcopy=False)
                    if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
        scored = {t.user_attrs.get("candidate") for t in finished}
        self.ctx.record(candidates_tried=len(scored), scored_here=self.scored_here,
                        scored_twice=len(finished) - len(scored), study_candidates=plan["candidates"],
                        study_lm_calls=self.study_calls(), planner=plan["planner"] == self.worker_id,
                        pool_demos=plan["pool_demos"], instruction_candidates=plan["instruction_candidates"],
                        stop_reason=stop_reason)
        if winner is None:
            return program
        top = next(t for t in finished if t.state == TrialState.COMPLETE and t.user_attrs["candidate"] == winner)
        value = float(top.value or 0.0)  # a COMPLETE trial of this study always has its value
        self.ctx.record(best_candidate=winner, best_kind=top.user_attrs.get("kind"), best_value=round(value, 6))
        return apply_definition(program, top.user_attrs["definition"])

class StoredCandidates:
    """Stands in for the search space when the stage picks its winner: a trial's program is its
    stored definition applied to this worker's program."""

    pools: ClassVar[dict[str, list[Any]]] = {}
    instructions: ClassVar[dict[str, list[str]]] = {}

    def apply(self, program: dspy.Module, trial: Any) -> dspy.Module:
        return apply_definition(program, trial.user_attrs["definition"])


def _fingerprint(stage: RandomSearch) -> dict[str, Any]:
    """The settings every worker of one study must share (JSON-able, as stored in the study)."""
    import json

    settings = {k: v for k, v in stage.settings().items() if k not in SETTINGS_LOCAL_TO_A_WORKER}
    return dict(json.loads(json.dumps(settings, default=str)))
