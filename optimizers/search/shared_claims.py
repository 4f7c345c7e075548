"""The study side of a shared search: one worker's storage, its heartbeats and claims, decisions taken
once for all workers, lost work requeued, and the LM calls each worker spent (see
:mod:`~flowopt.optimizers.search.shared` for the protocol).

Example:
    >>> from flowopt.optimizers.search.shared_claims import POLL_S
    >>> POLL_S
    0.25
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
from typing import TYPE_CHECKING, Any

from flowopt.compiler import StageContext
from flowopt.errors import FlowoptError
from flowopt.optimizers.search.shared_storage import once, open_rdb_storage
from flowopt.optimizers.search.study import INTERRUPTED

if TYPE_CHECKING:
    from flowopt.optimizers.search.stage import RandomSearch

logger = logging.getLogger(__name__)

POLL_S = 0.25  # how often a waiting worker looks at the study again
CALLS = "lm_calls:"  # study user attrs: LM calls each worker spent on this search


class StudyWorker:
    """One worker's hold on the shared study: heartbeats, claims, decisions taken once, requeueing.

    The planning (:class:`~flowopt.optimizers.search.shared_plan.PlanningWorker`), the search
    (:class:`~flowopt.optimizers.search.shared.SharedWorker`) and the winner
    (:class:`~flowopt.optimizers.search.shared_winner.WinnerPicking`) build on it.
    """

    def __init__(self, stage: RandomSearch, ctx: StageContext) -> None:
        import optuna

        self.stage, self.ctx = stage, ctx
        self.started = time.monotonic()
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.storage = open_rdb_storage(str(stage.storage), heartbeat_s=stage.heartbeat_s,
                                        stale_after_s=stage.stale_after_s, worker=self.worker_id)
        self.study = optuna.create_study(storage=self.storage, study_name=stage.study_name, direction="maximize",
                                         pruner=optuna.pruners.NopPruner(), load_if_exists=True,
                                         sampler=optuna.samplers.RandomSampler(seed=ctx.seed))
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

    def claim(self, study: Any, trial_number: int) -> int | None:
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

    def release(self, trial_ids: list[int]) -> None:
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
        self.fail_stale(lock_study)
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
                raise self.stuck(what)
            time.sleep(POLL_S)

    def stuck(self, what: str) -> FlowoptError:
        return FlowoptError(f"shared search {self.stage.study_name!r}: no {what} after waiting "
                            f"{self.stage.wait_timeout_s} s (the worker deciding it is alive but slow, or died "
                            "before its first heartbeat)",
                            fix=f"raise wait_timeout_s, or delete the study and its ':{what}' study and start again")

    def _decide(self, what: str, decide: Callable[[], Any], lock_study: Any) -> Any:
        from optuna.trial import TrialState

        lock_study.enqueue_trial({})
        me = self.claim(lock_study, lock_study.get_trials(deepcopy=False)[-1].number)
        value = decide()
        self.study.set_user_attr(what, value)
        if me is not None:
            self.storage.set_trial_state_values(me, TrialState.COMPLETE, [0.0])
            self.release([me])
        return value


    def lost_to_others(self, study: Any, trials: list[Any], err: BaseException) -> None:
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
    def fail_stale(self, study: Any) -> None:
        import optuna

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)

    def requeue_lost(self, study: Any) -> list[Any]:
        """Fail stale trials, re-enqueue candidates whose trials all failed; the study's trials after."""
        from optuna.trial import TrialState

        self.fail_stale(study)
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
    def record_calls(self) -> None:
        spent = self.ctx.budget.snapshot().lm_calls - self._calls_at_start
        self.study.set_user_attr(f"{CALLS}{self.worker_id}", spent)

    def study_calls(self) -> int:
        """LM calls all workers spent on this search (planning included)."""
        return sum(int(v) for k, v in self.study.user_attrs.items() if k.startswith(CALLS))

