"""The search core: selection, evaluation cache, stops, budget, checkpoint and resume, replay, drawing."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flowopt import BudgetExhausted, ConfigError
from flowopt.optimizers.structure import (
    MCTS,
    JsonCheckpoint,
    RuleProposer,
    SearchSettings,
    SearchTree,
    Vocabulary,
    mixed_probabilities,
    replay,
    replay_log,
)
from flowopt.optimizers.structure.baselines import MAX_FRUITLESS_RESTARTS, hill_climb, random_walk
from flowopt.optimizers.structure.draw import draw_tree
from flowopt.optimizers.structure.proposers import NoProposal
from flowopt.optimizers.structure.selection import select_mixed
from flowopt.optimizers.structure.tree import workflow_key

VOCAB = Vocabulary(max_nodes=5)


class Killed(BaseException):
    """Stands in for SIGKILL inside the process: nothing after it runs, no handler sees it."""


class CountingScore:
    def __init__(self, score, *, kill_at: int | None = None, budget: int | None = None):
        self.score, self.kill_at, self.budget = score, kill_at, budget
        self.keys: list[str] = []

    def __call__(self, wf):
        if self.kill_at is not None and len(self.keys) + 1 == self.kill_at:
            raise Killed()
        if self.budget is not None and len(self.keys) >= self.budget:
            raise BudgetExhausted("max_lm_calls", used=self.budget, allowed=self.budget)
        self.keys.append(workflow_key(wf.canonical_json()))
        return self.score(wf)


def _run(toys, tmp_path=None, *, seed=0, evaluate=None, **settings):
    evaluate = evaluate or CountingScore(toys.score)
    ckpt = JsonCheckpoint(tmp_path / "tree.json") if tmp_path is not None else None
    search = MCTS(RuleProposer(VOCAB), evaluate, SearchSettings(**settings), seed=seed, checkpoint=ckpt)
    return search.run(toys.single()), evaluate


def test_mixed_probabilities_follow_aflow():
    scores = [0.9, 0.7, 0.5]
    probs = mixed_probabilities(scores, alpha=0.2, lambda_=0.3)
    weights = [math.exp(0.2 * (100 * s - 90)) for s in scores]
    expected = [0.3 / 3 + 0.7 * w / sum(weights) for w in weights]
    assert probs == pytest.approx(expected)
    assert sum(probs) == pytest.approx(1.0)
    assert mixed_probabilities([0.5, 0.5], lambda_=1.0) == pytest.approx([0.5, 0.5])


def test_mixed_selection_keeps_the_root_among_the_top_k():
    tree = SearchTree()
    tree.add(None, None, "root", "k0", {}, score=0.1)
    for i in range(1, 8):
        tree.add(0, {"kind": "x"}, f"e{i}", f"k{i}", {}, score=0.1 + i / 10)
    rng = random.Random(0)
    picked = {select_mixed(tree, rng, top_k=3).id for _ in range(400)}
    assert picked == {0, 6, 7}


@pytest.mark.parametrize("selection", ["climb", "best_first", "mixed", "uct"])
def test_search_improves_and_never_scores_a_graph_twice(toys, selection):
    result, evaluate = _run(toys, selection=selection, max_rounds=25, convergence_rounds=None)
    assert result.best_score > toys.score(toys.single()) + 0.2
    assert len(evaluate.keys) == len(set(evaluate.keys)) == result.evaluations == len(result.tree.nodes)
    assert result.rounds == 25 or result.stop_reason.startswith("exhausted")
    # A round scores one new workflow; re-proposing a scored one is logged but uses no round.
    assert result.evaluations == result.rounds + 1
    for node in result.tree.nodes:  # an edit is never proposed twice from the same node
        tried = [json.dumps(t["edit"], sort_keys=True) for t in node.tried]
        assert len(tried) == len(set(tried))
    assert replay(toys.single(), result.edits).canonical_json() == result.best.canonical_json()


def test_search_log_replays_every_node(toys):
    result, _ = _run(toys, max_rounds=15)
    rebuilt = replay_log(toys.single(), json.loads(json.dumps(result.log)))
    assert set(rebuilt) == {n.id for n in result.tree.nodes}
    for node in result.tree.nodes:
        assert workflow_key(rebuilt[node.id].canonical_json()) == node.key


def test_same_seed_same_search_other_seed_other_search(toys):
    a, _ = _run(toys, seed=3, max_rounds=12)
    b, _ = _run(toys, seed=3, max_rounds=12)
    c, _ = _run(toys, seed=4, max_rounds=12)
    assert a.log == b.log
    assert a.log != c.log


def test_stops_on_max_evaluations_and_convergence(toys):
    result, evaluate = _run(toys, max_rounds=100, max_evaluations=6, convergence_rounds=None)
    assert result.evaluations == len(evaluate.keys) == 6
    assert result.stop_reason == "max_evaluations (6)"
    flat, _ = _run(toys, evaluate=CountingScore(lambda wf: 0.5), max_rounds=100, convergence_rounds=3)
    assert flat.stop_reason.startswith("converged")
    assert flat.rounds == 3


def test_budget_is_respected_and_the_best_so_far_returned(toys):
    evaluate = CountingScore(toys.score, budget=5)
    result, _ = _run(toys, evaluate=evaluate, max_rounds=50)
    assert len(evaluate.keys) == 5 == result.evaluations
    assert result.stop_reason == "budget exhausted (max_lm_calls)"
    assert result.best_score == max(n.score for n in result.tree.nodes)
    with pytest.raises(BudgetExhausted):  # nothing scored at all: nothing to return
        _run(toys, evaluate=CountingScore(toys.score, budget=0), max_rounds=5)


def test_should_stop_hook_stops_before_the_next_round(toys):
    calls = []

    def should_stop():
        calls.append(1)
        return "max_wall_s" if len(calls) > 3 else None

    search = MCTS(RuleProposer(VOCAB), toys.score, SearchSettings(max_rounds=50), should_stop=should_stop)
    result = search.run(toys.single())
    # Consulted before every step (a step that only re-proposes a scored workflow uses no round).
    assert len(calls) == 4 and 1 <= result.rounds <= 3 and result.evaluations == result.rounds + 1
    assert result.stop_reason == "budget exhausted (max_wall_s)"


@pytest.mark.parametrize("kill_at", [2, 9])
def test_resume_after_kill_equals_uninterrupted(toys, tmp_path, kill_at):
    settings = {"max_rounds": 14, "convergence_rounds": None}
    full, _ = _run(toys, tmp_path / "full", seed=7, **settings)
    with pytest.raises(Killed):
        _run(toys, tmp_path / "killed", seed=7, evaluate=CountingScore(toys.score, kill_at=kill_at), **settings)
    resumed_eval = CountingScore(toys.score)
    resumed, _ = _run(toys, tmp_path / "killed", seed=7, evaluate=resumed_eval, **settings)
    assert resumed.tree.to_dict() == full.tree.to_dict()
    assert resumed.log == full.log
    assert resumed.best.canonical_json() == full.best.canonical_json()
    # Only what was not yet checkpointed is evaluated again.
    assert len(resumed_eval.keys) == full.evaluations - (kill_at - 1)


_CHILD = textwrap.dedent("""
    import pathlib, sys, time
    sys.path.insert(0, {tests!r})
    from conftest import single, toy_score
    from flowopt.optimizers.structure import MCTS, JsonCheckpoint, RuleProposer, SearchSettings, Vocabulary

    calls = 0

    def hangs_at_the_fifth(wf):
        # The fifth evaluation (round 4's, after round 3 was checkpointed) tells the parent and never
        # returns, so the SIGKILL lands mid-measurement at a known point however slow the machine is.
        global calls
        calls += 1
        if calls == 5:
            pathlib.Path({ready!r}).write_text("measuring")
            time.sleep(3600)
        return toy_score(wf)

    MCTS(RuleProposer(Vocabulary(max_nodes=5)), hangs_at_the_fifth,
         SearchSettings(max_rounds=10, convergence_rounds=None), seed=7,
         checkpoint=JsonCheckpoint({path!r})).run(single())
""")


def test_resume_after_sigkill_equals_uninterrupted(toys, tmp_path):
    path, ready = tmp_path / "tree.json", tmp_path / "ready"
    script = _CHILD.format(tests=str(Path(__file__).parent), path=str(path), ready=str(ready))
    child = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": ""})
    try:
        deadline = time.monotonic() + 600  # only a hung machine takes this long; the wait ends on the file
        while not ready.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ready.exists(), f"the child never reached its fifth evaluation (exit code {child.poll()})"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert json.loads(path.read_text())["round"] == 3  # killed mid-search, during round 4's measurement
    resumed, _ = _run(toys, tmp_path, seed=7, max_rounds=10, convergence_rounds=None)
    full, _ = _run(toys, tmp_path / "full", seed=7, max_rounds=10, convergence_rounds=None)
    assert resumed.tree.to_dict() == full.tree.to_dict()
    assert resumed.log == full.log


def test_checkpoint_of_another_program_is_not_resumed(toys, tmp_path):
    _run(toys, tmp_path, max_rounds=3)
    other = MCTS(RuleProposer(VOCAB), toys.score, SearchSettings(max_rounds=3),
                 checkpoint=JsonCheckpoint(tmp_path / "tree.json")).run(toys.two_step())
    assert other.tree.nodes[0].key == workflow_key(toys.two_step().canonical_json())


def test_bad_settings_say_how_to_fix():
    with pytest.raises(ConfigError, match="Fix: pass selection"):
        SearchSettings(selection="greedy")
    with pytest.raises(ConfigError, match="max_rounds"):
        SearchSettings(max_rounds=0)
    with pytest.raises(ConfigError, match="lambda_"):
        SearchSettings(lambda_=1.5)


def test_baselines_count_unique_evaluations(toys):
    walk = random_walk(toys.single(), RuleProposer(VOCAB), toys.score, seed=1, max_evaluations=10)
    assert [i for i, _ in walk.trace] == list(range(1, 11))
    assert walk.best_score == max(s for _, s in walk.trace) == toys.score(walk.best)
    counting = CountingScore(toys.score)
    climb = hill_climb(toys.single(), RuleProposer(VOCAB), counting, seed=1, max_evaluations=60)
    assert climb.best_score == max(s for _, s in climb.trace) > toys.score(toys.single())
    assert climb.best_score == toys.score(climb.best)
    # With restarts the climb keeps going past its first local optimum until the evaluations are spent.
    assert climb.restarts >= 1 and climb.evaluations == len(counting.keys) == 60
    once = hill_climb(toys.single(), RuleProposer(VOCAB), toys.score, seed=1, max_evaluations=60, restarts=False)
    assert once.restarts == 0 and once.evaluations < 60


class _Stuck:
    """A proposer with nowhere to go: no valid edits, no proposals."""

    def valid_edits(self, workflow):
        return []

    def propose(self, workflow, context, rng):
        raise NoProposal("nothing to propose")


def test_hill_climb_stops_when_restarts_find_nothing_new(toys):
    # Everything reachable is scored after one evaluation; the climb must not spin through its budget.
    climb = hill_climb(toys.single(), _Stuck(), toys.score, seed=0, max_evaluations=10_000)
    assert climb.evaluations == 1 and climb.restarts == MAX_FRUITLESS_RESTARTS - 1


def test_tree_picture(toys, tmp_path):
    result, _ = _run(toys, max_rounds=5)
    data = draw_tree(result.tree, path=tmp_path / "tree.png")
    assert data[:4] == b"\x89PNG" and (tmp_path / "tree.png").read_bytes() == data
