"""RandomSearch: seeded and sampled candidates, instructions, node settings, samplers, pruning, storage."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import dspy
import optuna
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "compiler"))
from fakes import category_lm, exact, examples, reverse_answer

import flowopt
from flowopt import ConfigError
from flowopt.modules import Predict, ScEnsemble
from flowopt.optimizers.search import RandomSearch
from flowopt.testing import scripted_lm

TRAIN, VAL = examples(15, categories=True), examples(12, 100, categories=True)
BIG_VAL = examples(60, 200, categories=True)  # pruning needs a first rung of >= 20 examples


def _search(lm, stage, program=None, valset=VAL, **kwargs):
    with dspy.context(lm=lm):
        return flowopt.compile(program or dspy.Predict("question -> answer"), TRAIN, exact, valset=valset,
                               stages=[stage], quiet=True, num_threads=4, **kwargs)


def _study(run_dir: Path) -> optuna.Study:
    return optuna.load_study(study_name="flowopt-search", storage=f"sqlite:///{run_dir}/stages/00-search/search.db")


def test_seeded_candidates_mirror_bfrs_and_reach_the_optimum(tmp_path):
    out = _search(category_lm(), RandomSearch(n_candidates=7, seeded=4, max_demos=3, max_labeled_demos=3),
                  run_dir=tmp_path)
    kinds = [t.user_attrs["kind"] for t in sorted(_study(tmp_path).trials, key=lambda t: t.number)]
    # The incumbent has no demos, so it is the zero-shot program: that slot is DSPy's unshuffled bootstrap.
    assert kinds == ["incumbent", "bootstrap", "labeled", "bootstrap-0", "bootstrap-1", "bootstrap-2", "bootstrap-3"]
    complete = [t.value for t in _study(tmp_path).trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert out.report.best_score == max(complete) > out.report.baseline_score == 0.0


def test_search_alone_tries_the_demos_stages_program_and_after_it_the_zero_shot_one(tmp_path):
    stage = RandomSearch(n_candidates=4, seeded=1, max_demos=3, max_labeled_demos=3, pruner="none", finalists=0)
    alone = _search(category_lm(), stage, run_dir=tmp_path / "alone")
    with dspy.context(lm=category_lm()):
        after = flowopt.compile(dspy.Predict("question -> answer"), TRAIN, exact, valset=VAL, quiet=True,
                                num_threads=4, stages=[("demos", {"max_bootstrapped_demos": 3, "max_labeled_demos": 3}),
                                                       stage], run_dir=tmp_path / "after")
    by_kind = {c["kind"]: c for c in alone.report.stage("search").info["candidates"]}
    assert list(by_kind) == ["incumbent", "bootstrap", "labeled", "bootstrap-0"]
    kinds = [c["kind"] for c in after.report.stage("search").info["candidates"]]
    assert kinds == ["incumbent", "zero-shot", "labeled", "bootstrap-0"]
    # The search's own unshuffled bootstrap is the demos stage's program: same valset score.
    assert by_kind["bootstrap"]["mean"] == pytest.approx(after.report.stage("demos").score, abs=1e-4)


def test_sampled_demo_subsets_come_from_the_pooled_demos():
    out = _search(category_lm(), RandomSearch(n_candidates=6, seeded=0, max_demos=3, pool_size=4, pruner="none"))
    row = out.report.stage("search")
    assert row.candidates_tried == 6 and row.info["pool_demos"]["self"] >= 4
    questions = {e.question for e in TRAIN}
    assert all(d.question in questions and d.answer.startswith("#") for d in out.demos)


def test_instruction_candidates_from_a_proposer_lm():
    proposer = scripted_lm(lambda req: {"instruction": "Reverse the question and prefix it with #."},
                           model="scripted/proposer", cache=False)

    def answer(req):  # right only under the proposed instruction
        q = req.inputs.get("question", "")
        return {"answer": reverse_answer(q) if "Reverse the question" in req.system else q}

    lm = scripted_lm(answer, model="scripted/instr")
    out = _search(lm, RandomSearch(n_candidates=6, seeded=0, max_demos=0, proposer_lm=proposer, n_proposals=2,
                                   pruner="none"))
    assert proposer.engine.calls == 2
    assert out.report.best_score == 1.0
    assert out.signature.instructions.startswith("Reverse the question")


def test_no_instruction_proposals_when_every_candidate_is_seeded():
    proposer = scripted_lm(lambda req: {"instruction": "Reverse the question and prefix it with #."},
                           model="scripted/proposer-unused", cache=False)
    # Every planned candidate seeded and no extras: no candidate can use a proposal, so none is paid for.
    stage = RandomSearch(n_candidates=5, max_demos=2, max_labeled_demos=2, extra=0, proposer_lm=proposer,
                         n_proposals=3, pruner="none")
    assert not stage.may_sample()
    out = _search(category_lm(), stage)
    assert proposer.engine.calls == 0
    assert out.report.stage("search").info["instruction_candidates"] == {"self": 1}
    # One sampled candidate is enough to pay for them.
    _search(category_lm(), RandomSearch(n_candidates=5, seeded=1, max_demos=2, max_labeled_demos=2, extra=0,
                                        proposer_lm=proposer, n_proposals=3, pruner="none"))
    assert proposer.engine.calls == 3


def test_temperature_and_ensemble_n_are_searched_on_a_workflow():
    def answer(req):  # right only when sampled at temperature 0.3
        q = req.inputs.get("question", "")
        return {"reasoning": "r", "answer": reverse_answer(q) if req.temperature == 0.3 else q}

    wf = flowopt.chain("question -> answer", ScEnsemble("question -> answer", n=1, temperature=0.7))
    out = _search(scripted_lm(answer, model="scripted/temp"),
                  RandomSearch(n_candidates=8, seeded=0, max_demos=0, temperatures=(0.3,), ensemble_n=(2,),
                               pruner="none"), program=wf)
    assert out.report.best_score == 1.0
    node = next(iter(out.nodes.values()))
    assert node.temperature == 0.3 and node.n in (1, 2)


def test_tpe_sampler_runs_in_waves_and_is_deterministic():
    stage = RandomSearch(n_candidates=8, seeded=1, max_demos=2, pool_size=4, sampler="tpe", parallel=2, extra=0)
    a = _search(category_lm(), stage)
    b = _search(category_lm(), stage)
    assert [d.toDict() for d in a.demos] == [d.toDict() for d in b.demos]
    assert a.report.stage("search").candidates_tried == 8


@pytest.mark.parametrize("pruner", ["halving", "confidence", "anytime"])
def test_pruning_stops_trailing_candidates_and_saves_calls(pruner):
    pruned = category_lm(cache=False)
    full = category_lm(cache=False)
    # The incumbent shows one demo (category a: it scores 1/3), so the zero-shot program is a candidate of its own.
    start = dspy.Predict("question -> answer")
    start.demos = [TRAIN[0]]
    # The confidence rule at 5%: at its default 10%, this valset's order prunes two of the candidates that tie
    # at 2/3 overall (13 losses, 7 wins on the first 26 examples), the per-decision error the default accepts
    # (measured in benchmarks/results/search_generalisation.md). The anytime rule runs at its default.
    level = {"alpha": 0.05} if pruner == "confidence" else {}
    a = _search(pruned, RandomSearch(n_candidates=7, seeded=4, max_demos=3, max_labeled_demos=3, pruner=pruner,
                                     extra=0, **level), program=start.deepcopy(), valset=BIG_VAL)
    b = _search(full, RandomSearch(n_candidates=7, seeded=4, max_demos=3, max_labeled_demos=3, pruner="none",
                                   extra=0), program=start.deepcopy(), valset=BIG_VAL)
    # Halving keeps a third of the challengers; the confidence and anytime rules prune only the 0-scoring
    # zero-shot candidate: the others tie at 2/3 and a tie never prunes.
    info = a.report.stage("search").info
    assert info["pruned"] >= (3 if pruner == "halving" else 1)
    if pruner != "halving":
        assert [c["kind"] for c in info["candidates"] if "pruned" in c] == ["zero-shot"]
    if pruner == "anytime":
        assert all("at 10% over every look" in c["pruned"] for c in info["candidates"] if "pruned" in c)
    assert b.report.stage("search").info["pruned"] == 0
    assert pruned.engine.calls < full.engine.calls
    assert a.report.best_score > a.report.baseline_score and b.report.best_score > b.report.baseline_score


def test_stratified_pruner_scores_the_leader_ahead_and_tests_against_it():
    start = dspy.Predict("question -> answer")
    start.demos = [TRAIN[0]]
    lm = category_lm(cache=False)
    out = _search(lm, RandomSearch(n_candidates=7, seeded=4, max_demos=3, max_labeled_demos=3, pruner="stratified",
                                   extra=0, finalists=0), program=start.deepcopy(), valset=BIG_VAL)
    info = out.report.stage("search").info
    candidates = {c["kind"]: c for c in info["candidates"]}
    # The 0-scoring zero-shot program stops at the first look (20 examples), against a reference scored on
    # all 60 examples: the first look's leader, scored ahead.
    assert candidates["zero-shot"]["scored"] == 20
    reference = re.search(r"worse than candidate (\d+) \(whole valset ([\d.]+)\)", candidates["zero-shot"]["pruned"])
    assert reference is not None and "stratified" in candidates["zero-shot"]["pruned"]
    leader = next(c for c in info["candidates"] if c["candidate"] == int(reference[1]))
    assert leader["scored"] == 60 and leader["mean"] == pytest.approx(float(reference[2]), abs=1e-3)
    assert out.report.best_score == pytest.approx(2 / 3, abs=1e-3)
    assert out.report.best_score > out.report.baseline_score
    # Every LM call of the search is a candidate's example: nothing is scored twice.
    assert info["pruned"] >= 1 and lm.engine.calls <= sum(c["scored"] for c in info["candidates"]) + 60


def test_sqlite_storage_resumes_without_paying_again(tmp_path):
    stage = RandomSearch(n_candidates=5, seeded=2, max_demos=2, max_labeled_demos=2)
    first = _search(category_lm(), stage, run_dir=tmp_path)
    assert (tmp_path / "stages" / "00-search" / "search.db").exists()
    tried = first.report.stage("search").candidates_tried  # the 5 planned ones and the extras pruning paid for
    assert tried >= 5 and len(_study(tmp_path).trials) == tried
    (tmp_path / "stages" / "00-search" / "output.json").unlink()  # as if killed at the very end
    dspy.cache.reset_memory_cache()
    lm = category_lm(model="scripted/other")  # a fresh model name: nothing in DSPy's cache
    out = _search(lm, stage, run_dir=tmp_path, resume=True)
    assert len(_study(tmp_path).trials) == tried  # no candidate was tried again
    assert out.report.stage("search").candidates_tried == tried


def test_journal_storage_is_available(tmp_path):
    out = _search(category_lm(), RandomSearch(n_candidates=4, seeded=1, max_demos=2, storage="journal"),
                  run_dir=tmp_path)
    assert (tmp_path / "stages" / "00-search" / "search.journal").exists()
    assert out.report.stage("search").candidates_tried == 4


def test_rdb_url_storage_is_shared_by_workers(tmp_path):
    url = f"sqlite:///{tmp_path / 'shared.db'}"  # stands in for postgresql://...
    stage = RandomSearch(n_candidates=5, seeded=2, max_demos=2, max_labeled_demos=2, storage=url, study_name="s1")
    first = _search(category_lm(), stage, run_dir=tmp_path / "w1")
    lm = category_lm(cache=False)
    second = _search(lm, stage, run_dir=tmp_path / "w2")  # another worker: finds every candidate done
    study = optuna.load_study(study_name="s1", storage=url)
    assert len(study.trials) == 5
    assert second.report.stage("search").lm_calls < first.report.stage("search").lm_calls
    assert [d.toDict() for d in second.demos] == [d.toDict() for d in first.demos]


@pytest.mark.parametrize("settings, match", [
    ({"n_candidates": 0}, "n_candidates must be an int >= 1"),
    ({"seeded": -1}, "seeded must be an int >= 0"),
    ({"sampler": "grid"}, "sampler must be one of"),
    ({"pruner": "hyperband"}, "pruner must be one of"),
    ({"reduction_factor": 1}, "reduction_factor must be an int >= 2"),
    ({"minibatch_size": 0}, "minibatch_size must be an int >= 1"),
    ({"temperatures": (3.0,)}, r"temperatures must be a list of numbers each >= 0 and <= 2"),
    ({"ensemble_n": (0,)}, "ensemble_n must be a list of ints each >= 1"),
    ({"instructions": ["x"]}, "instructions must be an object whose values are each a list of strings"),
    ({"storage": "mysql"}, "storage must be None, 'journal' or an optuna RDB URL"),
])
def test_settings_checks_say_how_to_fix(settings, match):
    with pytest.raises(ConfigError, match=match) as info:
        RandomSearch(**settings)
    assert "pass" in str(info.value) or "leave" in str(info.value)


def test_file_storage_without_run_dir_is_a_config_error():
    with dspy.context(lm=category_lm()), pytest.raises(ConfigError, match="needs a run_dir"):
        flowopt.compile(dspy.Predict("question -> answer"), TRAIN, exact, valset=VAL,
                        stages=[RandomSearch(n_candidates=2, storage="journal")], quiet=True)


def test_workflow_predict_node_is_searchable():
    wf = flowopt.chain("question -> answer", Predict("question -> answer"))
    out = _search(category_lm(), RandomSearch(n_candidates=5, seeded=2, max_demos=3, max_labeled_demos=3), program=wf)
    assert out.report.best_score >= out.report.baseline_score


def test_extras_are_paid_for_by_what_pruning_saved():
    settings = dict(n_candidates=7, seeded=4, max_demos=3, max_labeled_demos=3)
    pruned = _search(category_lm(cache=False), RandomSearch(pruner="halving", **settings), valset=BIG_VAL)
    full = _search(category_lm(cache=False), RandomSearch(pruner="none", **settings), valset=BIG_VAL)
    row = pruned.report.stage("search")
    # Halving stopped >= 3 challengers at the first rung (20 of 60 examples): >= 120 evaluations saved.
    assert row.info["extra"] >= 1 and row.candidates_tried == 7 + row.info["extra"]
    assert full.report.stage("search").info["extra"] == 0  # nothing saved, nothing extra
    assert sum(row.info["pruned_by_rung"].values()) == row.info["pruned"]


def test_a_call_budget_buys_extra_candidates_and_is_not_exceeded():
    lm = category_lm(cache=False)
    out = _search(lm, RandomSearch(n_candidates=5, seeded=2, max_demos=3, max_labeled_demos=3, pruner="none"),
                  valset=BIG_VAL, budget=flowopt.Budget(max_lm_calls=700))
    row = out.report.stage("search")
    assert row.info["extra"] >= 2 and lm.engine.calls <= 700


def test_finalists_are_rescored_on_fresh_examples_and_both_scores_reported():
    out = _search(category_lm(cache=False), RandomSearch(n_candidates=7, seeded=4, max_demos=3, max_labeled_demos=3,
                                                         extra=0, finalists=3), valset=BIG_VAL)
    info = out.report.stage("search").info
    finalists = info["finalists"]
    assert len(finalists) >= 2  # several candidates tie on the valset
    assert all(f["fresh_n"] > 0 and f["val"] is not None and f["fresh"] is not None for f in finalists)
    best = max(finalists, key=lambda f: (f["combined"], -f["candidate"]))
    assert info["best_candidate"] == best["candidate"] and "fresh training examples" in info["why"]
