"""A search shared by workers on a real PostgreSQL server: atomic claims, lost work recovered, one answer.

Needs PostgreSQL's initdb/pg_ctl and psycopg (see ``postgres.py``): skipped without them, a failure
under ``CI=true``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

sys.path.insert(0, str(Path(__file__).parent))
import postgres
from shared_worker import TRAIN, VAL, compile_once

import flowopt
from flowopt import ConfigError, FlowoptError
from flowopt.optimizers.search.shared import PLAN, SharedWorker
from flowopt.optimizers.search.shared_plan import definition_of
from flowopt.optimizers.search.shared_storage import open_rdb_storage

postgres_cluster, postgres_url = postgres.postgres_cluster, postgres.postgres_url  # the fixtures
WORKER = Path(__file__).parent / "shared_worker.py"
# 12 candidates, scored on all 8 valset examples each (no pruning: verdicts would depend on timing).
# No instruction proposals (the default has the task LM write 5): the kill points below count the plan's calls.
# Three finalists re-scored (off by default): the workers share that re-scoring too.
SETTINGS = {"n_candidates": 12, "seeded": 1, "max_demos": 2, "max_labeled_demos": 2, "pool_size": 2,
            "pruner": "none", "heartbeat_s": 1, "stale_after_s": 4, "wait_timeout_s": 60, "proposer_lm": None,
            "finalists": 3}


def _kill_and_join(victim: subprocess.Popen, survivors: list[subprocess.Popen]) -> None:
    """SIGKILL the victim; every survivor must then finish the search and exit cleanly."""
    victim.send_signal(signal.SIGKILL)
    for w in survivors:
        output = w.communicate(timeout=120)[0]
        assert w.returncode == 0, output[-3000:]


def _reap(workers: list[subprocess.Popen]) -> None:
    """No worker outlives its test, whatever failed."""
    for w in workers:
        if w.poll() is None:
            w.kill()
        w.communicate()


def _each_candidate_finished_once(url: str, study: str) -> list[Any]:
    """The study's trials, after checking that each of the 12 candidates finished exactly once."""
    trials = _trials(url, study)
    finished = Counter(t.user_attrs["candidate"] for t in trials if t.state == TrialState.COMPLETE)
    assert finished == Counter(range(12)), _states(url, study)  # none lost, none scored twice
    return trials


def _start(url: str, study: str, out: Path, latency: float, **extra) -> subprocess.Popen:
    spec = {"url": url, "study": study, "out": str(out), "latency": latency, "settings": SETTINGS, **extra}
    return subprocess.Popen([sys.executable, str(WORKER), json.dumps(spec)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _trials(url: str, study: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=study, storage=url).get_trials(deepcopy=False)


def _study_names(url: str) -> list[str]:
    try:
        return optuna.get_all_study_names(url)
    except Exception:  # the tables are not created yet
        return []


def _states(url: str, study: str) -> str:
    return "; ".join(f"#{t.number} c{t.user_attrs.get('candidate')} {t.state.name} {t.user_attrs.get('worker')}"
                     for t in _trials(url, study))


def test_three_workers_one_killed_finish_every_candidate_once_and_agree(postgres_url, tmp_path):
    reference = compile_once({**SETTINGS}, latency=0.0)  # one process, in-memory study, same seed
    outs = [tmp_path / f"w{i}.json" for i in range(3)]
    stalled = tmp_path / "stalled"
    # The victim starts first (so it plans: 7 calls), scores candidates (8 calls each, or none when
    # memoised) and hangs in one, holding it; it is killed once another worker scored.
    victim = _start(postgres_url, "qa", outs[0], latency=0.1, stall_after_calls=7 + 16 + 3, stalled=str(stalled))
    workers = [victim]
    try:
        deadline = time.monotonic() + 180  # generous: worker start-up is slow on a loaded machine
        while "qa:plan" not in _study_names(postgres_url):
            assert time.monotonic() < deadline and victim.poll() is None, "the victim never started planning"
            time.sleep(0.1)
        workers += [_start(postgres_url, "qa", out, latency=0.1) for out in outs[1:]]
        # (a trial just claimed is RUNNING a moment before its "worker" attr is written)
        while not (stalled.exists() and any(t.state == TrialState.COMPLETE and str(victim.pid) not in
                                            t.user_attrs.get("worker", "") for t in _trials(postgres_url, "qa"))):
            assert time.monotonic() < deadline, f"no kill point: {_states(postgres_url, 'qa')}"
            time.sleep(0.1)
        held = [t.user_attrs["candidate"] for t in _trials(postgres_url, "qa")
                if t.state == TrialState.RUNNING and str(victim.pid) in t.user_attrs.get("worker", "")]
        assert held, _states(postgres_url, "qa")  # the victim dies holding a candidate
        _kill_and_join(victim, workers[1:])
    finally:
        _reap(workers)
    trials = _each_candidate_finished_once(postgres_url, "qa")
    retried = [t for t in trials if "retry_of" in t.user_attrs]
    assert [t.user_attrs["candidate"] for t in retried] == held and retried[0].state == TrialState.COMPLETE
    results = [json.loads(out.read_text()) for out in outs[1:]]
    for result in results:
        assert result["definition"] == definition_of(reference)
        assert result["best_score"] == reference.report.best_score
        assert result["candidates_tried"] == 12 and result["info"]["scored_twice"] == 0
    by_victim = sum(t.state == TrialState.COMPLETE and str(victim.pid) in t.user_attrs["worker"] for t in trials)
    assert by_victim >= 1 and sum(r["info"]["scored_here"] for r in results) == 12 - by_victim


# The baseline case is slow-marked: the default suite's kill test above covers a kill mid-candidate.
def _wait_for_completed(url: str, study: str, n: int, workers: list[subprocess.Popen], deadline: float) -> None:
    while study not in _study_names(url) or sum(t.state == TrialState.COMPLETE for t in _trials(url, study)) < n:
        assert time.monotonic() < deadline, f"fewer than {n} candidates done: {_states(url, study)}"
        assert all(w.poll() is None for w in workers), "a worker ended early"
        time.sleep(0.1)


def test_three_workers_survive_a_terminated_connection_and_a_server_restart(postgres_cluster, postgres_url, tmp_path):
    """pg_terminate_backend cuts one worker's connections, then pg_ctl restart cuts everyone's: every worker
    retries across the outage, no candidate is lost or scored twice, and all return the same program."""
    settings = {**SETTINGS, "stale_after_s": 15}  # an outage under load must not read as a dead worker
    reference = compile_once(settings, latency=0.0)
    outs = [tmp_path / f"w{i}.json" for i in range(3)]
    workers = [_start(postgres_url, "faults", out, latency=0.15, settings=settings) for out in outs]
    try:
        deadline = time.monotonic() + 240
        _wait_for_completed(postgres_url, "faults", 2, workers, deadline)
        victim = workers[0].pid
        assert postgres_cluster.terminate_backends(f"flowopt-search:%:{victim}:%") >= 1
        _wait_for_completed(postgres_url, "faults", 5, workers, deadline)
        postgres_cluster.restart()
        for w in workers:
            output = w.communicate(timeout=240)[0]
            assert w.returncode == 0, output[-3000:]
    finally:
        _reap(workers)
    _each_candidate_finished_once(postgres_url, "faults")
    for out in outs:
        result = json.loads(out.read_text())
        assert result["definition"] == definition_of(reference)
        assert result["best_score"] == reference.report.best_score
        assert result["candidates_tried"] == 12 and result["info"]["scored_twice"] == 0


@pytest.mark.parametrize(("step", "stall_after_calls"),
                         [("plan", 2), pytest.param("baseline", 7 + 3, marks=pytest.mark.slow)])
def test_a_worker_killed_in_a_shared_step_is_replaced(postgres_url, tmp_path, step, stall_after_calls):
    """The planner hangs mid-plan (after 2 bootstrap calls), or holds the incumbent, whose scores are
    every worker's baseline (after the plan's 7 calls, 3 into it); it is killed while the others work."""
    reference = compile_once({**SETTINGS}, latency=0.0)
    outs = [tmp_path / f"w{i}.json" for i in range(3)]
    stalled = tmp_path / "stalled"
    victim = _start(postgres_url, step, outs[0], latency=0.1, stall_after_calls=stall_after_calls, stalled=str(stalled))
    workers = [victim]
    try:
        deadline = time.monotonic() + 180  # generous: worker start-up is slow on a loaded machine
        while not stalled.exists():
            assert time.monotonic() < deadline and victim.poll() is None, "the victim never stalled"
            time.sleep(0.1)
        held = [t.user_attrs["candidate"] for t in _trials(postgres_url, step) if t.state == TrialState.RUNNING]
        assert held == ([] if step == "plan" else [0]), _states(postgres_url, step)
        if step == "plan":  # the candidates defined without an LM call before the plan's first LM-made one are
            # enqueued before its calls: the incumbent (zero demos), whose second slot is DSPy's unshuffled bootstrap
            assert [t.user_attrs["kind"] for t in _trials(postgres_url, step)] == ["incumbent"]
        workers += [_start(postgres_url, step, out, latency=0.1) for out in outs[1:]]
        while not any(t.state == TrialState.COMPLETE for t in _trials(postgres_url, step)):
            assert time.monotonic() < deadline, f"no kill point: {_states(postgres_url, step)}"
            time.sleep(0.1)
        if step == "plan":  # the others scored while the victim, still planning, held the plan
            assert PLAN not in optuna.load_study(study_name=step, storage=postgres_url).user_attrs
        _kill_and_join(victim, workers[1:])
    finally:
        _reap(workers)
    _each_candidate_finished_once(postgres_url, step)
    results = [json.loads(out.read_text()) for out in outs[1:]]
    # The plan: taken over by one survivor when the victim died planning, else the victim's.
    assert [r["info"]["planner"] for r in results].count(True) == (1 if step == "plan" else 0)
    for result in results:
        assert result["definition"] == definition_of(reference)
        assert result["best_score"] == reference.report.best_score
        # The baseline is the incumbent's score from the study: no worker scored it on its own.
        assert result["baseline"] == {"score": reference.report.baseline_score, "lm_calls": 0}
    assert sum(r["info"]["scored_here"] for r in results) == 12
    # The finalists' re-scoring is shared: each finalist scored once, on 4 fresh examples, by some worker,
    # and the worker that picked the winner took those scores from the study.
    rescored = [t for t in _trials(postgres_url, f"{step}:finalist-scores") if t.state == TrialState.COMPLETE]
    assert sorted(t.user_attrs["candidate"] for t in rescored) == [1, 2, 5]
    assert sum(r["info"]["finalists_scored_here"] for r in results) == 3
    rows = next(r["info"]["finalists"] for r in results if "finalists" in r["info"])
    assert [(row["candidate"], row["fresh_n"]) for row in rows] == [(1, 4), (2, 4), (5, 4)]


def test_a_stale_trial_is_failed_and_its_candidate_requeued_once(postgres_url):
    import dspy

    from flowopt.compiler import BudgetTracker, StageContext
    from flowopt.optimizers.search import RandomSearch

    stage = RandomSearch(storage=postgres_url, study_name="stale", heartbeat_s=1, stale_after_s=2)
    ctx = StageContext(trainset=[], valset=[], metric=lambda *a: 1.0, budget=BudgetTracker(), seed=0,
                       rng=__import__("random").Random(0))
    dead, alive = SharedWorker(stage, ctx), SharedWorker(stage, ctx)
    definition = definition_of(dspy.Predict("question -> answer"))
    dead.study.enqueue_trial({}, user_attrs={"candidate": 0, "kind": "incumbent", "definition": definition})
    assert dead.claim(dead.study, 0) is not None  # claimed, then no heartbeat ever again
    assert alive.claim(alive.study, 0) is None  # a claimed candidate cannot be claimed again
    assert [t.state for t in alive.requeue_lost(alive.study)] == [TrialState.RUNNING]  # not stale yet
    time.sleep(3.5)
    trials = alive.requeue_lost(alive.study)
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.WAITING]
    assert trials[1].user_attrs["retry_of"] == 0 and trials[1].user_attrs["definition"] == definition
    assert len(dead.requeue_lost(dead.study)) == 2  # the other worker finds it requeued already: no second copy


def test_two_workers_on_an_empty_database_both_open_it(postgres_url):
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def open_one() -> None:
        try:
            barrier.wait()
            open_rdb_storage(postgres_url, heartbeat_s=1, stale_after_s=2)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert optuna.get_all_study_names(postgres_url) == []


def test_study_budget_is_shared_by_workers(postgres_url):
    budgeted = {**SETTINGS, "storage": postgres_url, "study_name": "budget", "study_max_lm_calls": 40}
    first = compile_once(budgeted, latency=0.0)
    second = compile_once(budgeted, latency=0.0)  # another worker: the study's budget is spent
    one, two = first.report.stage("search"), second.report.stage("search")
    assert one.stop_reason == two.stop_reason == "budget: study_max_lm_calls"
    # Planning (bootstraps, pool) plus 8 calls a candidate: it stops within one candidate of the limit.
    assert 40 <= one.info["study_lm_calls"] < 40 + 8 and one.info["scored_here"] < 12
    assert two.info["scored_here"] == 0 and two.info["study_lm_calls"] == one.info["study_lm_calls"]
    assert definition_of(first) == definition_of(second)


def test_a_worker_stopped_by_its_own_budget_leaves_the_rest_to_a_resumed_worker(postgres_url):
    shared = {**SETTINGS, "storage": postgres_url, "study_name": "resume"}
    first = compile_once(shared, latency=0.0, budget=flowopt.Budget(max_lm_calls=60))
    assert first.report.stage("search").stop_reason == "budget: max_lm_calls"
    cut = [t for t in _trials(postgres_url, "resume") if t.state == TrialState.FAIL]
    assert cut and all(t.user_attrs["interrupted"] == "budget" for t in cut)  # cut short mid-candidate
    resumed = compile_once(shared, latency=0.0)  # the same worker again, with calls to spend
    trials = _trials(postgres_url, "resume")
    finished = Counter(t.user_attrs["candidate"] for t in trials if t.state == TrialState.COMPLETE)
    assert finished == Counter(range(12))  # the cut candidates were requeued and finished, once each
    assert resumed.report.stage("search").info["scored_here"] == 12 - first.report.stage("search").info["scored_here"]
    assert definition_of(resumed) == definition_of(compile_once(dict(SETTINGS), latency=0.0))


def test_a_worker_with_other_settings_is_refused(postgres_url):
    compile_once({**SETTINGS, "n_candidates": 3, "storage": postgres_url, "study_name": "s"}, latency=0.0)
    with pytest.raises(ConfigError, match=r"planned with other search settings \(n_candidates differ\)"):
        compile_once({**SETTINGS, "n_candidates": 4, "storage": postgres_url, "study_name": "s"}, latency=0.0)


def test_waiting_for_a_plan_that_never_comes_ends_in_a_clear_error(postgres_url):
    optuna.create_study(storage=postgres_url, study_name="stuck:plan")  # a planner died before its first beat
    with pytest.raises(FlowoptError, match="no plan after waiting 1 s"):
        compile_once({**SETTINGS, "storage": postgres_url, "study_name": "stuck", "wait_timeout_s": 1}, latency=0.0)


def test_tpe_cannot_be_shared():
    with pytest.raises(ConfigError, match="plans every candidate up front"):
        compile_once({**SETTINGS, "sampler": "tpe", "storage": "postgresql+psycopg://x@127.0.0.1:1/db"}, latency=0.0)


def test_a_second_process_on_a_journal_run_dir_is_refused(tmp_path):
    lock = tmp_path / "stages" / "00-search" / "search.lock"
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, filelock; l = filelock.FileLock(sys.argv[1]); "
                               "l.acquire(); print('held', flush=True); sys.stdin.read()", str(lock)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        import dspy

        import flowopt
        from flowopt.optimizers.search import RandomSearch

        with pytest.raises(ConfigError, match="another process is running the search"):
            flowopt.compile(dspy.Predict("question -> answer"), TRAIN, lambda *a: 1.0, valset=VAL, run_dir=tmp_path,
                            stages=[RandomSearch(n_candidates=2, storage="journal")], quiet=True)
    finally:
        holder.communicate("", timeout=10)
    assert not os.path.exists(tmp_path / "stages" / "00-search" / "search.journal")  # nothing touched


def test_without_postgres_the_tests_skip_except_under_ci(monkeypatch):
    monkeypatch.setattr(postgres, "missing_reason", lambda: "initdb not found")
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception, match="initdb not found"):
        postgres.require_postgres()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true but initdb not found"):
        postgres.require_postgres()
