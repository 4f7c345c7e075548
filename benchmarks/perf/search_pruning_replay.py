"""Pruning rules replayed on BFRS(8)'s candidates fully scored: what each rule's picks lose against BFRS's
pick, and what it costs in LM calls, without an LM call per rule.

Issue 27's third goal: the search with BFRS(8)'s own 11 candidates (``n_candidates=11, extra=0``) at
<= 0.5x BFRS(8)'s calls with a held-out test difference >= 0. BFRS scores every candidate on the whole
valset and picks the best; the search's pruner stops candidates early, so a pick can differ only where
the pruner stopped the valset's best. Here each seed's 11 candidates are scored on the whole valset
once (the search with ``pruner="none"``: exactly BFRS(8)'s LM calls and pick), and every rule is then
raced on those scores as :meth:`RandomSearch.race` does (one wave, the same looks, ``next_look``'s
skipping, the incumbent never pruned, ``"stratified"``'s leader scored ahead): its pick, the look at
which it stopped the valset's best, and its LM calls (the bootstraps, which every rule pays, plus the
valset scores it asked for). The replay of the default rule gives the search's own calls and pick: the
``--check`` option compares them with a ``search_defaults`` seeds log.

Rules: the registered ones at the default ``alpha`` (0.1) and ``alpha=0.05``, and variants defined here
(not the search's): looks every 10% of the valset instead of 5%; a challenger stopped only when shown
worse than each of the two best (a lucky leader alone cannot stop it); the confidence test at
``alpha / (live challengers)`` (Bonferroni over the comparisons a look makes); alpha spent unevenly
(``alpha=0.05`` at the first look, where the leader is ahead partly by selection, 0.1 after); the
stratified rule at ``alpha=0.05`` or with looks every 10%; "two best" at ``alpha=0.2`` with looks every
10%; successive halving at optuna's ``SuccessiveHalvingPruner`` rungs (20, 40, 80; keep the best half),
in its synchronous form (optuna's own judges each trial against those that reached the rung before it
asked, so in a race it depends on the order of asking). "Where the calls go" splits a few rules' calls:
bootstraps, the incumbent (never pruned), the pick, the other fully scored candidates, the stopped ones.
``--race-start`` prices that fixed cost: every rule may then stop the incumbent too.

Seeds: world seed ``shape_index + 3 * i`` as ``search_defaults``; the tuning blocks are ``--first-seed 0``
and ``10000``. Run:  nice -n 5 python -m flowopt.benchmarks.perf.search_pruning_replay --first-seed 0 10000
--seeds 20 --scores benchmarks/results/search_pruning_replay_scores.jsonl
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import statistics
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import dspy

from flowopt.benchmarks.perf.harness import PerfParser, markdown_table, setup_logging, start_run
from flowopt.benchmarks.perf.search_tasks import DEMOS_ONLY, Task, dspy_cache_off, mean_ci, metric
from flowopt.io import atomic_write_text
from flowopt.optimizers.search.pruners import (
    ConfidencePruner,
    HalvingPruner,
    Look,
    Pruner,
    StratifiedPruner,
    get_pruner,
)
from flowopt.optimizers.search.pruning import first_look, looks, next_look, rungs, worse_than

SHAPES = (DEMOS_ONLY, "needles", "instructions")
SMOKE = {"seeds": 1, "train": 30, "val": 40, "test": 60}


class Every10:
    """Looks every 10% of the valset instead of 5% (half the looks: half the chances to prune a tie); mixed
    in before a rule."""

    def rung_ends(self, n: int, minibatch_size: int | None) -> list[int]:
        return looks(n, first_look(n, minibatch_size), every=max(1, round(n / 10)))


class LooksEvery10(Every10, ConfidencePruner):
    """The confidence rule, looking every 10% of the valset."""


class StratifiedEvery10(Every10, StratifiedPruner):
    """The stratified rule (the look's leader scored ahead), looking every 10% of the valset."""


class StricterFirstLook(Every10, ConfidencePruner):
    """Alpha spent unevenly: the confidence test at ``FIRST_ALPHA`` at the first look (where the leader is
    the best of every candidate on 20 examples, so ahead partly by selection), at ``alpha`` after, looking
    every 10%."""

    FIRST_ALPHA = 0.05

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.looked = False

    def worse(self, challenger: Any, leader: Any, population: int | None) -> bool:
        alpha = self.alpha if self.looked else min(self.alpha, self.FIRST_ALPHA)
        return worse_than(challenger, leader, alpha, population=population)

    def prune(self, look: Look) -> dict[int, str]:
        out = super().prune(look)
        self.looked = True
        return out


class WorseThanTwo(ConfidencePruner):
    """Stop a challenger only when the confidence test shows it worse than each of the two best so far."""

    def prune(self, look: Look) -> dict[int, str]:
        scored = look.scored()
        ranked = sorted(scored, key=lambda k: (-sum(scored[k]), k))
        out = {}
        for k in look.challengers():
            best = [j for j in ranked if j != k][:2]
            if len(best) == 2 and all(self.worse(scored[k], scored[j], look.population) for j in best):
                out[k] = "worse than the two best"
        return out


class Bonferroni(ConfidencePruner):
    """The confidence rule at ``alpha`` divided by the challengers racing at the look."""

    def worse(self, challenger: Any, leader: Any, population: int | None) -> bool:
        return worse_than(challenger, leader, self.alpha / max(1, self.racing - 1), population=population)

    def prune(self, look: Look) -> dict[int, str]:
        self.racing = len(look.live)
        return super().prune(look)


class WorseThanTwoEvery10(Every10, WorseThanTwo):
    """"Worse than each of the two best", looking every 10% of the valset."""


class HalvingFrom20(HalvingPruner):
    """Successive halving with optuna's ``SuccessiveHalvingPruner`` rungs at ``min_resource=20,
    reduction_factor=2`` (20, 40, 80 examples): each rung keeps the best half of the challengers. optuna's
    own pruner is asynchronous: a trial is judged against the trials that reached the rung *before it asked*
    (the first to ask is always kept), so in a race whose candidates all reach a rung together its verdicts
    depend on the order they ask in; the search's ``"halving"`` rule is its synchronous form."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{**kwargs, "reduction_factor": 2})

    def rung_ends(self, n: int, minibatch_size: int | None) -> list[int]:
        return rungs(n, first_look(n, minibatch_size), 2.0)


RULES: dict[str, Callable[[], Pruner]] = {
    "confidence (default)": lambda: get_pruner("confidence")(),
    "confidence, alpha=0.05": lambda: get_pruner("confidence")(alpha=0.05),
    "stratified": lambda: get_pruner("stratified")(),
    "anytime": lambda: get_pruner("anytime")(),
    "confidence, looks every 10%": LooksEvery10,
    "worse than each of the two best": WorseThanTwo,
    "confidence, Bonferroni over the challengers": Bonferroni,
    "confidence, alpha=0.05 at the first look, looks every 10%": StricterFirstLook,
    "stratified, alpha=0.05": lambda: get_pruner("stratified")(alpha=0.05),
    "stratified, looks every 10%": StratifiedEvery10,
    "stratified, alpha=0.02, looks every 10%": lambda: StratifiedEvery10(alpha=0.02),
    "two best, alpha=0.2, looks every 10%": lambda: WorseThanTwoEvery10(alpha=0.2),
    "halving, rungs 20, 40, 80 (keep the best half)": HalvingFrom20,
}
#: The rules whose calls the report splits (where the calls go).
SPLIT_RULES = ("confidence (default)", "confidence, alpha=0.05", "stratified, alpha=0.05")


def collect(job: tuple[int, str, int, int, int]) -> dict[str, Any]:
    """One seed: every BFRS(8) candidate's 0/1 valset scores (in the search's order) and test score, and the
    LM calls of the unpruned search (BFRS(8)'s)."""
    import flowopt
    from flowopt.optimizers.search import RandomSearch

    seed, shape, n_train, n_val, n_test = job
    task = Task(seed, n_train, n_val, n_test, shape=shape)
    captured: list[dict[str, Any]] = []

    class Capturing(RandomSearch):
        def race(self, study: Any, asked: list[Any], *args: Any, **kwargs: Any) -> None:
            super().race(study, asked, *args, **kwargs)
            stored = {t.number: t for t in study.get_trials(deepcopy=False)}
            captured.extend({"number": t.number, "kind": stored[t.number].user_attrs.get("kind"),
                             "scores": "".join(str(round(s)) for s in stored[t.number].user_attrs["scores"]),
                             "test": round(task.score(program, task.test)["expected"], 6)} for t, program in asked)

    lm = task.lm(0.0)
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
                dspy_cache_off(), dspy.context(lm=lm):
            flowopt.compile(dspy.Predict("question -> answer"), task.train, metric, valset=task.val,
                            stages=[Capturing(n_candidates=11, extra=0, pruner="none")], num_threads=8, quiet=True)
    finally:
        logging.disable(previous)
    return {"seed": seed, "shape": shape, "calls": lm.engine.calls, "candidates": captured}


def replay(record: dict[str, Any], rule: Pruner, threads: int = 8, race_start: bool = False) -> dict[str, Any]:
    """Race ``rule`` on one seed's full scores as the search's one wave would: pick, calls, pruning looks.
    ``race_start``: the incumbent may be stopped like any candidate (the search never does this: the compiler
    scores its start in full as the baseline; the option prices that fixed cost)."""
    full = {c["number"]: [float(x) for x in c["scores"]] for c in record["candidates"]}
    incumbent = None if race_start else next(c["number"] for c in record["candidates"] if c["kind"] == "incumbent")
    n = len(next(iter(full.values())))
    ends = rule.rung_ends(n, None)
    alive, scores, prev, stopped = sorted(full), {k: [] for k in full}, 0, {}
    while alive and prev < n:
        behind = [k for k in alive if len(scores[k]) < n]
        if not behind:
            break
        cum = next_look(ends, prev, len(behind), threads)
        for k in behind:
            scores[k] = full[k][:cum]
        prev = cum
        if cum < n:
            if rule.scores_leader_ahead:
                leader = max(alive, key=lambda k: (sum(full[k][:cum]), -k))
                scores[leader] = full[leader]
            pruned = rule.prune(Look({k: scores[k] for k in alive}, {}, cum, incumbent, population=n))
            stopped.update({k: cum for k in pruned})
            alive = [k for k in alive if k not in pruned]
    bootstraps = record["calls"] - n * len(full)
    pick = max(alive, key=lambda k: (sum(full[k]), -k))
    return {"pick": pick, "calls": bootstraps + sum(len(v) for v in scores.values()), "stopped": stopped,
            "bootstraps": bootstraps, "scored": {k: len(v) for k, v in scores.items()}}


def where_calls_go(records: list[dict[str, Any]], make: Callable[[], Pruner],
                   race_start: bool = False) -> dict[str, float]:
    """A rule's mean LM calls a seed, split: bootstraps (every rule pays them), the incumbent (never pruned
    unless ``race_start``; the compiler scores it on the whole valset as its baseline anyway), the pick, the
    other fully scored candidates, and the stopped ones."""
    parts: dict[str, list[float]] = {k: [] for k in ("bootstraps", "incumbent", "pick", "others_full", "stopped")}
    for record in records:
        out = replay(record, make(), race_start=race_start)
        n = len(record["candidates"][0]["scores"])
        incumbent = next(c["number"] for c in record["candidates"] if c["kind"] == "incumbent")
        rest = {k: v for k, v in out["scored"].items() if k not in (incumbent, out["pick"])}
        parts["bootstraps"].append(out["bootstraps"])
        parts["incumbent"].append(out["scored"][incumbent] if incumbent != out["pick"] else 0)
        parts["pick"].append(out["scored"][out["pick"]])
        parts["others_full"].append(sum(v for v in rest.values() if v == n))
        parts["stopped"].append(sum(v for v in rest.values() if v < n))
    return {k: round(statistics.fmean(v), 1) for k, v in parts.items()}


def compare(records: list[dict[str, Any]], make: Callable[[], Pruner], race_start: bool = False) -> dict[str, Any]:
    """A rule over ``records``: test difference against BFRS's pick, picks that differ, calls ratio, and
    at which look the valset's best was stopped where it was."""
    diffs, ratios, at = [], [], []
    for record in records:
        test = {c["number"]: c["test"] for c in record["candidates"]}
        totals = {c["number"]: c["scores"].count("1") for c in record["candidates"]}
        best = max(totals, key=lambda k: (totals[k], -k))  # BFRS's pick: the first of the best
        out = replay(record, make(), race_start=race_start)
        diffs.append(test[out["pick"]] - test[best])
        ratios.append(out["calls"] / record["calls"])
        if best in out["stopped"]:
            at.append(out["stopped"][best])
    return {"diff": [round(x, 5) for x in mean_ci(diffs)], "worse": sum(d < -1e-9 for d in diffs),
            "better": sum(d > 1e-9 for d in diffs), "best_stopped": len(at), "best_stopped_at": sorted(at),
            "calls_ratio": round(statistics.fmean(ratios), 4), "max_calls_ratio": round(max(ratios), 4),
            "n": len(records)}


def check(records: list[dict[str, Any]], log: Path, method: str = "flowopt_bfrs8_candidates") -> dict[str, Any]:
    """The default rule's replayed calls and pick test score against the search's own, from a seeds log."""
    rows = {(r["seed"], r["shape"]): r["rows"] for r in map(json.loads, log.read_text().splitlines()) if r}
    same_calls, same_test, n = 0, 0, 0
    for record in records:
        row = rows.get((record["seed"], record["shape"]), {}).get(method)
        if row is None:
            continue
        out = replay(record, get_pruner("confidence")())
        test = {c["number"]: c["test"] for c in record["candidates"]}[out["pick"]]
        n, same_calls, same_test = n + 1, same_calls + (out["calls"] == row["lm_calls"]), \
            same_test + (abs(test - row["test"]) < 1e-6)
    return {"seeds": n, "same_calls": same_calls, "same_test": same_test, "log": str(log), "method": method}


def body(summary: dict[str, Any], args: Any) -> list[str]:
    lines = [f"{args.seeds} seeds a shape from each first seed {args.first_seed}, {args.train} train / {args.val} val "
             f"/ {args.test} test, 8 threads. Test difference: the rule's pick against BFRS(8)'s (the valset's "
             "best), expected accuracy on the test split, paired per seed, mean [95% t-interval]. Calls: exact, "
             "x BFRS(8)'s (mean; max over the seeds). 'Best stopped': seeds in which the rule stopped the "
             "valset's best candidate, and at which look (examples scored)."
             + (" `--race-start`: every rule may stop the incumbent (the zero-shot start) too; the search never "
                "does, because the compiler scores its start in full as the baseline." if args.race_start else ""),
             ""]
    rows = [[shape, rule, f"{r['diff'][0]:+.4f} [{r['diff'][1]:+.4f}, {r['diff'][2]:+.4f}]",
             f"{r['better']}/{r['n'] - r['better'] - r['worse']}/{r['worse']}",
             f"{r['best_stopped']} ({', '.join(map(str, r['best_stopped_at'])) or '-'})",
             f"{r['calls_ratio']:.3f}x ({r['max_calls_ratio']:.2f}x)"]
            for shape, by_rule in summary["rules"].items() for rule, r in by_rule.items()]
    lines += markdown_table(["shape", "rule", "test difference [95% CI]", "better/equal/worse", "best stopped (at)",
                             "LM calls x BFRS(8) (max)"], rows, align="llrrrr")
    split = summary.get("calls_split", {})
    if split:
        lines += ["", f"Where the calls go (all seeds, mean LM calls a seed; BFRS(8): {summary['bfrs8_calls']:.1f}, "
                      "the unpruned search's calls):", ""]
        keys = ("bootstraps", "incumbent", "pick", "others_full", "stopped")
        lines += markdown_table(["rule", "bootstraps", "incumbent (zero-shot)", "pick", "other fully scored",
                                 "stopped candidates", "total"],
                                [[rule, *(f"{parts[k]:.1f}" for k in keys), f"{sum(parts[k] for k in keys):.1f}"]
                                 for rule, parts in split.items()], align="lrrrrrr")
    if summary.get("check"):
        c = summary["check"]
        lines += ["", f"Replay check against `{c['log']}` ({c['method']}): of {c['seeds']} seeds in common, the "
                      f"replayed default rule gives the search's own LM calls on {c['same_calls']} and its pick's "
                      f"test score on {c['same_test']}."]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = PerfParser("search_pruning_replay", __doc__, smoke=SMOKE)
    parser.add_argument("--seeds", type=int, default=20, help="seeds a shape, from each first seed")
    parser.add_argument("--first-seed", type=int, nargs="+", default=[0, 10000])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--train", type=int, default=60)
    parser.add_argument("--val", type=int, default=100)
    parser.add_argument("--test", type=int, default=300)
    parser.add_argument("--scores", type=Path, default=None,
                        help="JSON-lines file of the seeds' full scores: read if it exists (no LM calls), else written")
    parser.add_argument("--check", type=Path, default=None, help="a search_defaults seeds log to check the replay by")
    parser.add_argument("--check-method", default="flowopt_bfrs8_candidates",
                        help="the log's method that ran the search's default rule on these candidates")
    parser.add_argument("--race-start", action="store_true",
                        help="let every rule stop the incumbent too (prices the compiler's full baseline score)")
    run = start_run(parser, argv)
    args = run.args
    jobs = [(SHAPES.index(shape) + 3 * i, shape, args.train, args.val, args.test)
            for first in args.first_seed for i in range(first, first + args.seeds) for shape in SHAPES]
    if args.scores is not None and args.scores.exists():
        wanted = {(seed, shape) for seed, shape, *_ in jobs}
        lines = args.scores.read_text().splitlines()
        records = [r for r in map(json.loads, lines) if (r["seed"], r["shape"]) in wanted]
        missing = sorted(wanted - {(r["seed"], r["shape"]) for r in records})
        if missing:
            parser.error(f"--scores {args.scores} lacks {len(missing)} of the {len(wanted)} seeds asked for "
                         f"(first: {missing[0]}); pass the --first-seed/--seeds it was collected with, or a new "
                         "file to collect")
    else:
        with ProcessPoolExecutor(max_workers=args.workers) as pool:
            records = list(pool.map(collect, jobs))
        if args.scores is not None:
            atomic_write_text(args.scores, "".join(json.dumps(r) + "\n" for r in records))
    summary: dict[str, Any] = {"rules": {}}
    for shape in [*SHAPES, "all"]:
        chosen = [r for r in records if shape in ("all", r["shape"])]
        if chosen:
            summary["rules"][shape] = {name: compare(chosen, make, args.race_start) for name, make in RULES.items()}
    summary["bfrs8_calls"] = statistics.fmean(r["calls"] for r in records)
    summary["calls_split"] = {name: where_calls_go(records, RULES[name], args.race_start) for name in SPLIT_RULES}
    summary["race_start"] = args.race_start
    if args.check is not None and not args.race_start:  # the search's own race never stops its start
        summary["check"] = check(records, args.check, args.check_method)
    run.finish("Pruning rules replayed on BFRS(8)'s candidates", {"summary": summary}, body(summary, args))
    return 0


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(main())
