"""Does the search pick programs that generalise? flowopt's search vs DSPy's optimizers on held-out test.

A simulated task family where the choice of demos (and instructions) really matters, scored on a
held-out test split the optimizers never see (the task: :mod:`~flowopt.benchmarks.perf.search_tasks`;
``search_defaults`` runs it against DSPy's optimizers at everyone's defaults):

* per seed: 60 train, 100 val, 300 test examples; each example has a hidden difficulty, each
  training example a hidden quality as a demo (some help, some hurt). Three task shapes rotate
  over the seeds: ``spread`` (qualities ~ N(0, 0.7)), ``needles`` (most demos slightly harmful, one
  in eight strongly helpful) and ``instructions`` (demos ~ N(0, 0.4), instructions matter more).
* the fake LM (a DSPy engine, ``flowopt.testing``) answers an example right with probability
  ``sigmoid(0.2 + demo effect + instruction effect - difficulty)``, decided by a hash of
  (seed, the demos shown in order, the instruction, the question): the answer is deterministic per
  (prompt, example), as an LM at temperature 0. Demo effect: the qualities of the demos shown
  summed / sqrt(k), plus 0.3 for showing 4 or more. Instruction effect: 0 for the original, a
  hash-drawn N(0, sigma) for any other text. Any other prompt (MIPRO's proposer, GEPA's reflection)
  gets a fresh instruction-like text. Latency ``--latency`` per call, DSPy's cache off.
* the program each method returns is scored on test by the same rule, without LM calls: its
  *expected* test accuracy (mean probability over the 300 test examples, the quantity that matters)
  and its realised accuracy (the hash draws).

Methods, every one on every seed (paired): BFRS(8) and BFRS(16) (DSPy's
``BootstrapFewShotWithRandomSearch``); flowopt's ``search`` stage on its own with BFRS(8)'s 11
candidates (zero-shot as the incumbent, DSPy's unshuffled bootstrap, labeled-only, 8 shuffled
bootstraps) and its default pruner (``"confidence"`` at ``alpha=0.1``, with and without paid-for
extras); with the same candidates only, the other pruning settings (``pruner="stratified"``,
``"anytime"``, the stricter ``alpha=0.05``, ``finalists=0``, and ``pruner="none"``); at BFRS(8)'s LM
calls (``Budget(max_lm_calls=...)``); ``demos`` + ``search`` with the same candidates;
``demos`` + ``search`` with the search's default settings (``compile()``'s default stages until
b7bc532, now ``search`` alone);
``dspy.MIPROv2(auto="light")``; and the ``mipro`` and ``gepa`` stages (``gepa`` at BFRS(8)'s calls).

Pruner error: for the flowopt runs with pruning, the full-valset score of every pruned candidate
is computed afterwards (by the rule, no LM calls) and compared with the returned program's; each
pruned candidate's scores, full-valset score and the pruner's reason are in the JSON. The stated
rate is the default ``alpha`` (10%, per prune decision); the goals measure the share of runs with a
pruner error for the rows at the default pruning settings and for every pruning row pooled.

Run:  nice -n 10 python -m flowopt.benchmarks.perf.search_generalisation --seeds 30 --workers 2
Writes benchmarks/results/search_generalisation.{json,md} (``--out STEM``); ``--smoke`` runs 2 small
seeds with 7 of the methods, in seconds.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import random
import re
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import dspy

from flowopt.benchmarks.perf.harness import Goal, PerfParser, markdown_table, setup_logging, start_run
from flowopt.benchmarks.perf.search_tasks import SHAPES, Task, mean_ci, metric
from flowopt.optimizers.search.pruning import ALPHA

STRICT_ALPHA = 0.05  # the stricter level a user can ask for (the default is pruning.ALPHA, 0.1)
# BFRS(8)'s candidates only (extra=0), with other pruning settings: what the calls cost in guarantees.
SAME_CANDIDATE_VARIANTS: dict[str, dict[str, Any]] = {
    "flowopt8_extra0_stratified": {"pruner": "stratified"},
    "flowopt8_extra0_anytime": {"pruner": "anytime"},
    "flowopt8_extra0_alpha05": {"alpha": STRICT_ALPHA},
    "flowopt8_extra0_no_finalists": {"finalists": 0},
    "flowopt8_extra0_alpha05_no_finalists": {"alpha": STRICT_ALPHA, "finalists": 0},
    "flowopt8_extra0_stratified_no_finalists": {"pruner": "stratified", "finalists": 0},
}
METHODS = ("bfrs8", "bfrs16", "flowopt8", "flowopt8_extra0", *SAME_CANDIDATE_VARIANTS, "flowopt8_none",
           "flowopt_at_bfrs8_calls",
           "flowopt8_demos_extra0", "flowopt_demos_search", "mipro_light", "mipro_stage", "gepa_stage")
LABELS = {
    "bfrs8": "DSPy BFRS(8)",
    "bfrs16": "DSPy BFRS(16)",
    "flowopt8": "flowopt `search`, BFRS(8)'s candidates + paid-for extras (defaults otherwise)",
    "flowopt8_extra0": "flowopt `search`, BFRS(8)'s candidates only (`extra=0`; default `alpha=0.1`)",
    "flowopt8_extra0_stratified": "flowopt `search`, BFRS(8)'s candidates only, `pruner=\"stratified\"`",
    "flowopt8_extra0_anytime": "flowopt `search`, BFRS(8)'s candidates only, `pruner=\"anytime\"`",
    "flowopt8_extra0_alpha05": "flowopt `search`, BFRS(8)'s candidates only, `alpha=0.05` (a 5% test at each look)",
    "flowopt8_extra0_no_finalists": ("flowopt `search`, BFRS(8)'s candidates only, `finalists=0` (no winner's-curse "
                                     "guard)"),
    "flowopt8_extra0_alpha05_no_finalists": "flowopt `search`, BFRS(8)'s candidates only, `alpha=0.05`, `finalists=0`",
    "flowopt8_extra0_stratified_no_finalists": ("flowopt `search`, BFRS(8)'s candidates only, `stratified`, "
                                                "`finalists=0`"),
    "flowopt8_none": "flowopt `search`, BFRS(8)'s candidates, `pruner=\"none\"`",
    "flowopt_at_bfrs8_calls": "flowopt `search` at BFRS(8)'s LM calls (`Budget`)",
    "flowopt8_demos_extra0": "flowopt `demos` + `search`, BFRS(8)'s candidates only (`extra=0`)",
    "flowopt_demos_search": ("flowopt `demos` + `search`, the search's default settings "
                             "(`compile()`'s default stages before b7bc532)"),
    "mipro_light": "dspy.MIPROv2(auto=\"light\")",
    "mipro_stage": "flowopt `mipro` stage (light)",
    "gepa_stage": "flowopt `gepa` stage at BFRS(8)'s LM calls",
}
SAME_CANDIDATES = "flowopt8_extra0"  # the method the "same candidates" goal reads
ANYTIME = "flowopt8_extra0_anytime"  # the same candidates under the anytime-valid pruner
STRATIFIED = "flowopt8_extra0_stratified"  # the same candidates, tested against a fully scored reference
STATED_ERROR = ALPHA  # the stated rate: each prune decision is a one-sided test at the default alpha (10%)
SMOKE = {"seeds": 2, "workers": 1, "threads": 4, "latency": 0.0, "train": 30, "val": 40, "test": 60, "tie_orders": 5,
         "methods": ["bfrs8", "flowopt8", "flowopt8_extra0", ANYTIME, "flowopt_at_bfrs8_calls", "mipro_stage",
                     "gepa_stage"]}


# -------------------------------------------------------------------------------- methods
_CAPTURED: dict[int, dict[int, Any]] = {}


def _capturing_search(**settings: Any) -> Any:
    """A RandomSearch that also hands the benchmark the programs it pruned, by candidate number (to
    score them on the whole valset afterwards, by the rule: pruner errors)."""
    from optuna.trial import TrialState

    from flowopt.optimizers.search import RandomSearch

    class CapturingSearch(RandomSearch):
        def race(self, study: Any, asked: list[Any], order: list[Any], ends: list[int], ctx: Any,
                 before_tell: Any = None) -> None:
            super().race(study, asked, order, ends, ctx, before_tell=before_tell)
            states = {t.number: t.state for t in study.get_trials(deepcopy=False)}
            store = _CAPTURED.setdefault(id(self), {})
            store.update({t.user_attrs["candidate"]: p for t, p in asked if states.get(t.number) == TrialState.PRUNED})

    return CapturingSearch(**settings)


def _stages(name: str, bfrs8_calls: int | None) -> tuple[list[Any], Any, Any]:
    """The compile() stages, budget and capturing search (if any) of one flowopt method."""
    from flowopt import Budget

    search: Any = None
    if name == "flowopt8":
        search = _capturing_search(n_candidates=11)
        return [search], None, search
    if name == "flowopt8_extra0":
        search = _capturing_search(n_candidates=11, extra=0)
        return [search], None, search
    if name in SAME_CANDIDATE_VARIANTS:
        search = _capturing_search(n_candidates=11, extra=0, **SAME_CANDIDATE_VARIANTS[name])
        return [search], None, search
    if name == "flowopt8_none":
        return [("search", {"n_candidates": 11, "extra": 0, "pruner": "none"})], None, None
    if name == "flowopt_at_bfrs8_calls":
        search = _capturing_search(n_candidates=11, max_extra=64)
        return [search], Budget(max_lm_calls=bfrs8_calls), search
    if name == "flowopt8_demos_extra0":
        search = _capturing_search(n_candidates=11, extra=0)
        return ["demos", search], None, search
    if name == "flowopt_demos_search":
        search = _capturing_search()
        return ["demos", search], None, search  # the default stages until b7bc532
    if name == "mipro_stage":
        return [("mipro", {"auto": "light"})], None, None
    if name == "gepa_stage":
        return [("gepa", {})], Budget(max_lm_calls=bfrs8_calls), None
    raise ValueError(name)


DSPY_METHODS = ("bfrs8", "bfrs16", "mipro_light")
PRUNING_KEYS = ("pruner", "alpha", "finalists")  # the settings behind a pruner error (the finalists may pick too)


def default_pruning(name: str) -> bool:
    """Does this method's search prune with the stage's default settings (``pruner``, ``alpha``, ``finalists``)?"""
    from flowopt.optimizers.search import RandomSearch

    search = None if name in DSPY_METHODS else _stages(name, 1)[2]
    return search is not None and all(getattr(search, k) == getattr(RandomSearch(), k) for k in PRUNING_KEYS)


REPORT_KEYS = ("pruned", "fully_scored", "extra", "why", "best_kind", "best_candidate", "stop_reason", "finalists",
               "candidates")


def run_method(name: str, task: Task, args: Any, bfrs8_calls: int | None) -> dict[str, Any]:
    import flowopt

    dspy.configure_cache(enable_disk_cache=False, enable_memory_cache=False)
    lm = task.lm(args.latency)
    student = dspy.Predict("question -> answer")
    info: dict[str, Any] = {}
    search = None
    start = time.perf_counter()
    with dspy.context(lm=lm):
        if name in ("bfrs8", "bfrs16"):
            from dspy.teleprompt import BootstrapFewShotWithRandomSearch

            opt = BootstrapFewShotWithRandomSearch(metric=metric, num_candidate_programs=8 if name == "bfrs8" else 16,
                                                   num_threads=args.threads)
            out = opt.compile(student, trainset=task.train, valset=task.val)
        elif name == "mipro_light":
            opt = dspy.MIPROv2(metric=metric, auto="light", num_threads=args.threads, seed=task.seed, verbose=False)
            out = opt.compile(student, trainset=task.train, valset=task.val)
        else:
            stages, budget, search = _stages(name, bfrs8_calls)
            out = flowopt.compile(student, task.train, metric, valset=task.val, stages=stages, budget=budget,
                                  seed=task.seed, num_threads=args.threads, quiet=True)
            info = {"report": {s.name: {"score": s.score, "lm_calls": s.lm_calls, "tried": s.candidates_tried,
                                        **{k: v for k, v in s.info.items() if k in REPORT_KEYS}}
                               for s in out.report.stages}}
    wall = time.perf_counter() - start
    row = {"method": name, "lm_calls": lm.engine.calls, "wall_s": round(wall, 3),
           "test": task.score(out, task.test), "val": task.score(out, task.val), **info}
    if search is not None:
        returned = row["val"]["realised"]
        captured = _CAPTURED.pop(id(search), {})
        pruned = {c: task.score(p, task.val)["realised"] for c, p in captured.items()}
        row["pruned_full_val"] = pruned
        row["pruner_error"] = any(v > returned + 1e-12 for v in pruned.values())
        row["strata_variance"] = _strata_variance(task, out, student, list(captured.values()))
    return row


def _strata_variance(task: Task, pick: Any, incumbent: Any, pruned: list[Any]) -> dict[str, float] | None:
    """How much of a pruned candidate's per-example variance on the valset (its 0/1 answers, by the rule)
    stratifying by other programs' answers removes: the within-strata share, by the pick's answers and
    by the pick's and the incumbent's together, mean over the pruned candidates (the best case for any
    stratified sample: a test of the same power needs about that share of the examples)."""
    def answers(program: Any) -> list[float]:
        demos, instruction = task.program_parts(program)
        return [float(task.correct(demos, instruction, task.index[e.question])) for e in task.val]

    by_pick, by_both = answers(pick), list(zip(answers(pick), answers(incumbent)))
    shares: dict[str, list[float]] = {"by_pick": [], "by_pick_and_incumbent": []}
    for program in pruned:
        mine = answers(program)
        total = statistics.pvariance(mine)
        if total == 0:
            continue
        for key, labels in (("by_pick", by_pick), ("by_pick_and_incumbent", by_both)):
            strata: dict[Any, list[float]] = {}
            for label, x in zip(labels, mine):
                strata.setdefault(label, []).append(x)
            within = sum(len(v) * statistics.pvariance(v) for v in strata.values()) / len(mine)
            shares[key].append(within / total)
    return {k: round(statistics.fmean(v), 4) for k, v in shares.items()} if shares["by_pick"] else None


def tie_prune_rates(orders: int, seed: int = 0,
                    alphas: tuple[float, ...] = (ALPHA, STRICT_ALPHA)) -> dict[str, dict[str, dict[str, float]]]:
    """How often each rule prunes a challenger that ties the leader on a valset of 100, at *some* look,
    over random orders (the same orders at every level): 15 + 15 and 35 + 35 discordant examples (the
    rest both right), by discordance, rule and ``alpha`` (the default first). ``confidence`` and
    ``stratified`` (whose reference, the leader, is fully scored) look at the stage's looks, each a
    test at ``alpha``; ``anytime`` after every example, at ``alpha`` over all of them."""
    from flowopt.optimizers.search.pruning import anytime_worse, first_look, looks, stratified_worse, worse_than

    rng, ends = random.Random(seed), looks(100, first_look(100))[:-1]
    out: dict[str, dict[str, dict[str, float]]] = {}
    for discordant in (15, 35):
        challenger = [0.0] * discordant + [1.0] * discordant + [1.0] * (100 - 2 * discordant)
        leader = [1.0] * discordant + [0.0] * discordant + [1.0] * (100 - 2 * discordant)
        hits = {rule: dict.fromkeys(alphas, 0) for rule in ("confidence", "stratified", "anytime")}
        for _ in range(orders):
            order = rng.sample(range(100), 100)
            c, lead = [challenger[i] for i in order], [leader[i] for i in order]
            for alpha in alphas:
                hits["confidence"][alpha] += any(worse_than(c[:end], lead[:end], alpha, population=100) for end in ends)
                hits["stratified"][alpha] += any(stratified_worse(c[:end], lead, alpha) for end in ends)
                # Every look, as the stage looks: anytime_worse reads the wealth's maximum so far, but only prunes
                # where the challenger trails, so a single read at the end would miss a prune at an earlier look.
                hits["anytime"][alpha] += any(anytime_worse(c[:end], lead[:end], alpha, population=100)
                                              for end in range(1, 100))
        out[f"{discordant}+{discordant}"] = {rule: {f"{a:g}": round(v / orders, 4) for a, v in by.items()}
                                             for rule, by in hits.items()}
    return out


def run_seed(seed: int, args: Any) -> dict[str, Any]:
    logging.disable(logging.WARNING)
    task = Task(seed, args.train, args.val, args.test)
    # DSPy's optimizers print their progress (print and tqdm): kept out of the benchmark's own log.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rows = {"bfrs8": run_method("bfrs8", task, args, None)}
        calls = rows["bfrs8"]["lm_calls"]
        for name in args.methods:
            if name != "bfrs8":
                rows[name] = run_method(name, task, args, calls)
    return {"seed": seed, "shape": task.shape, "rows": rows}


# -------------------------------------------------------------------------------- summary


def summarise(seeds: list[dict[str, Any]], methods: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    base = [s["rows"]["bfrs8"] for s in seeds]
    for name in methods:
        rows = [s["rows"][name] for s in seeds]
        diffs = [r["test"]["expected"] - b["test"]["expected"] for r, b in zip(rows, base)]
        rdiffs = [r["test"]["realised"] - b["test"]["realised"] for r, b in zip(rows, base)]
        ratios = [r["lm_calls"] / b["lm_calls"] for r, b in zip(rows, base)]
        entry = {
            "test_expected": statistics.fmean(r["test"]["expected"] for r in rows),
            "test_realised": statistics.fmean(r["test"]["realised"] for r in rows),
            "val_realised": statistics.fmean(r["val"]["realised"] for r in rows),
            "diff_expected": mean_ci(diffs), "diff_realised": mean_ci(rdiffs),
            "better": sum(d > 1e-12 for d in diffs), "worse": sum(d < -1e-12 for d in diffs),
            "lm_calls": statistics.fmean(r["lm_calls"] for r in rows),
            "calls_ratio": statistics.fmean(ratios), "calls_ratio_ci": mean_ci(ratios),
            "wall_s": statistics.fmean(r["wall_s"] for r in rows),
        }
        errors = [r["pruner_error"] for r in rows if "pruner_error" in r]
        if errors:
            entry["pruner_error_runs"] = [sum(errors), len(errors)]
            entry["pruned_candidates"] = sum(len(r["pruned_full_val"]) for r in rows)
        out[name] = entry
    return out


DETAILED = (SAME_CANDIDATES, STRATIFIED, ANYTIME)  # methods whose every candidate is listed (the seeds file < 300 KB)


def _candidate_line(c: dict[str, Any], full: dict[int, float]) -> str:
    """One candidate as one line: what it was, how far it was scored, its whole-valset score, why it stopped."""
    line = f"c{c['candidate']} {c['kind']}: {c['mean']:.3f} on {c['scored']}"
    if c["candidate"] in full:
        line += f", whole valset {full[c['candidate']]:.3f}"
    if "pruned" in c:
        found = re.search(r"candidate (\d+).*\((\d+) losses, (\d+) wins\)", c["pruned"])
        reference = re.search(r"candidate (\d+) \(whole valset ([\d.]+)\)", c["pruned"])  # the stratified rule
        line += (f"; pruned: behind c{found[1]}, {found[2]} losses {found[3]} wins" if found
                 else f"; pruned: below c{reference[1]}'s whole valset {reference[2]}" if reference
                 else f"; pruned: {c['pruned']}")
    return line


def _compact(row: dict[str, Any], detailed: bool) -> dict[str, Any]:
    """A seed's row for the JSON: counts, scores and the search's report. ``detailed``: also every
    candidate, one line each (pruned ones with their whole-valset score, by the rule, and the reason)."""
    out: dict[str, Any] = {"lm_calls": row["lm_calls"], "wall_s": row["wall_s"],
                           "test": {m: round(x, 4) for m, x in row["test"].items()},
                           "val": {m: round(x, 4) for m, x in row["val"].items()}}
    report = row.get("report") or {}
    if report:
        out["stage_calls"] = {name: r["lm_calls"] for name, r in report.items()}
    search = dict(report.get("search") or {})
    if search:
        full = row.get("pruned_full_val", {})
        candidates = search.pop("candidates", [])
        search["scored_examples"] = sum(c["scored"] for c in candidates)
        search["incumbent_scored"] = next((c["scored"] for c in candidates if c["kind"] == "incumbent"), 0)
        search["pruned_mean_scored"] = round(statistics.fmean([c["scored"] for c in candidates if "pruned" in c]
                                                              or [0]), 1)
        if full:
            search["best_pruned_full_val"] = round(max(full.values()), 4)
        if detailed:
            search["candidates"] = [_candidate_line(c, full) for c in candidates]
        else:
            search.pop("finalists", None)
            search.pop("why", None)
        out["search"] = search
    if "pruner_error" in row:
        out["pruner_error"] = row["pruner_error"]
    if detailed and row.get("strata_variance"):
        out["strata_variance"] = row["strata_variance"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = PerfParser("search_generalisation", __doc__, smoke=SMOKE)
    parser.add_argument("--seeds", type=int, default=30)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--latency", type=float, default=0.005)
    parser.add_argument("--train", type=int, default=60)
    parser.add_argument("--val", type=int, default=100)
    parser.add_argument("--test", type=int, default=300)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--tie-orders", type=int, default=400,
                        help="random valset orders for the rules' tie-prune rates (0: skip)")
    run = start_run(parser, argv)
    args = run.args
    log = logging.getLogger("search_generalisation")
    args.methods = ["bfrs8", *[m for m in args.methods if m != "bfrs8"]]
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    results = []
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        for res in pool.map(run_seed, seeds, [args] * len(seeds)):
            results.append(res)
            log.info("seed %d (%s): %s", res["seed"], res["shape"],
                     {k: (round(v["test"]["expected"], 3), v["lm_calls"]) for k, v in res["rows"].items()})
    compact = [{"seed": r["seed"], "shape": r["shape"],
                "rows": {k: _compact(v, k in DETAILED) for k, v in r["rows"].items()}}
               for r in sorted(results, key=lambda r: r["seed"])]
    # The per-seed rows (every search's report, every candidate of the DETAILED runs) go to a compact
    # sibling file; the results JSON keeps the summary and each method's per-seed test scores and calls.
    seeds_file = run.sibling("_seeds.json")
    seeds_file.write_text(json.dumps({"command": run.command, "seeds": compact}, separators=(",", ":")) + "\n")
    per_seed = {m: {"test_expected": [r["rows"][m]["test"]["expected"] for r in compact],
                    "lm_calls": [r["rows"][m]["lm_calls"] for r in compact]} for m in args.methods}
    summary = summarise(results, args.methods)
    ties = tie_prune_rates(args.tie_orders) if args.tie_orders else {}
    full = {"summary": summary, "seeds": compact, "tie_prune_rates": ties, "tie_orders": args.tie_orders}
    run.finish("Search generalisation: the test score of the program each method picks",
               {"summary": summary, "seeds": [r["seed"] for r in compact], "shapes": [r["shape"] for r in compact],
                "per_seed": per_seed, "seeds_file": seeds_file.name, "tie_prune_rates": ties},
               body(full, args, seeds_file.name), goals=goals(full))
    return 0


def goals(payload: dict[str, Any]) -> list[Goal]:
    """Issue 11's goals, read from the summary."""
    summary, out = payload["summary"], []
    if SAME_CANDIDATES in summary:
        e = summary[SAME_CANDIDATES]
        out += [Goal.at_least("same candidates as BFRS(8): mean paired test difference",
                              round(e["diff_expected"][0], 4), 0),
                Goal.at_most("same candidates as BFRS(8): LM calls vs BFRS(8) (x)", round(e["calls_ratio"], 3), 0.5)]
    if "flowopt_at_bfrs8_calls" in summary:
        e = summary["flowopt_at_bfrs8_calls"]
        out.append(Goal.at_least("at BFRS(8)'s LM calls: lower end of the paired test difference's 95% interval "
                                 "(above 0)", round(e["diff_expected"][1], 4), 1e-4))
    for which, keep in (("rows at the default pruning settings", default_pruning), ("every pruning row pooled",
                                                                                   lambda name: True)):
        runs = [r for s in payload["seeds"] for name, r in s["rows"].items() if "pruner_error" in r and keep(name)]
        if runs:
            rate = sum(bool(r["pruner_error"]) for r in runs) / len(runs)
            out.append(Goal.at_most(f"pruner error, {which}: share of {len(runs)} runs where a pruned candidate's "
                                    f"full-valset score beats the returned program's (stated: {STATED_ERROR:.0%} "
                                    "per prune decision)", round(rate, 4), STATED_ERROR))
    return out


def body(payload: dict[str, Any], args: Any, seeds_file: str) -> list[str]:
    s = payload["summary"]
    lines = [f"Task family: see the script's docstring. {len(payload['seeds'])} paired seeds (shapes rotate: "
             f"{', '.join(SHAPES)}), {args.train} train / {args.val} val / {args.test} held-out test, fake LM with "
             f"{args.latency * 1000:.0f} ms latency, {args.threads} threads, {args.workers} seeds at a time, DSPy "
             f"cache off. Test score = expected accuracy on the {args.test} test examples of the returned program "
             "(realised accuracy in the JSON). Differences are paired against BFRS(8), mean and 95% t-interval "
             "over seeds. LM calls are exact counts; wall times are under the load above.", ""]
    rows = []
    for name in args.methods:
        e = s[name]
        d = e["diff_expected"]
        err = e.get("pruner_error_runs")
        rows.append([LABELS[name], f"{e['test_expected']:.4f}", f"{d[0]:+.4f} [{d[1]:+.4f}, {d[2]:+.4f}]",
                     f"{e['better']} / {e['worse']}", f"{e['lm_calls']:.0f}", f"{e['calls_ratio']:.2f}x",
                     f"{e['wall_s']:.1f}", f"{err[0]}/{err[1]} ({e['pruned_candidates']} pruned)" if err else "-"])
    lines += markdown_table(["method", "test (expected)", "vs BFRS(8) [95% CI]", "better / worse seeds", "LM calls",
                             "calls vs BFRS(8)", "wall s", "pruner errors (runs)"], rows, align="lrlrrrrl")
    return [*lines, "", *notes(payload, seeds_file)]


def notes(payload: dict[str, Any], seeds_file: str) -> list[str]:
    """Where flowopt's calls go, what was pruned, pruner errors with a bound, the finalists' effect."""
    from scipy.stats import beta

    out = ["## Notes", ""]
    rows = [sd["rows"] for sd in payload["seeds"]]
    same = [r[SAME_CANDIDATES] for r in rows if SAME_CANDIDATES in r and r[SAME_CANDIDATES].get("search")]
    if same:
        total = statistics.fmean(r["lm_calls"] for r in same)
        stage = {k: statistics.fmean(r["stage_calls"].get(k, 0) for r in same) for k in same[0]["stage_calls"]}
        search = statistics.fmean(r["search"]["lm_calls"] for r in same)
        fresh = _fresh_scores(same)
        new = _valset_scores(same)
        pruned = statistics.fmean(r["search"]["pruned"] for r in same)
        tried = statistics.fmean(r["search"]["tried"] for r in same)
        after = statistics.fmean(r["search"]["pruned_mean_scored"] for r in same)
        out.append(f"* Where the calls go (`search` alone, BFRS(8)'s candidates, `extra=0`), mean a run: {total:.0f} "
                   "calls: " + ", ".join(f"{k} {v:.0f}" for k, v in stage.items())
                   + f". Inside the search: {new:.0f} valset scores of the candidates (the incumbent's are the "
                   f"baseline's, memoised), {fresh:.0f} finalists' fresh-example scores, "
                   f"{search - new - fresh:.0f} bootstrap calls. Pruned: {pruned:.1f} of {tried:.1f} candidates, "
                   f"after {after:.0f} valset examples on average. Every candidate of the "
                   f"{', '.join(f'`{m}`' for m in DETAILED)} runs, with its scores, whole-valset score and "
                   f"the pruner's reason, is in `{seeds_file}` (`search.candidates`), with every search's report.")
        out.append(_survivors_note(same, rows))
        out += _variants_notes(rows)
        if "baseline" in stage:
            out.append(f"* The baseline's {stage['baseline']:.0f} calls are the zero-shot program scored on the whole "
                       "valset: BFRS scores the same program as its zero-shot candidate on the whole valset too, so "
                       "both sides pay for it once (the search reads the baseline's scores from the memo). What "
                       "flowopt saves is on the other candidates: the pruner's looks (the first at 20 examples, "
                       "then every 5% of the valset) and the finalists' re-scoring.")
    runs = [r[name] for r in rows for name in r if "pruner_error" in r[name]]
    if runs:
        defaults = [name for name in rows[0] if "pruner_error" in rows[0][name] and default_pruning(name)]
        counted = []
        for group in ([r[name] for r in rows for name in defaults], runs):
            bad = sum(bool(r["pruner_error"]) for r in group)
            upper = beta.ppf(0.95, bad + 1, len(group) - bad) if bad < len(group) else 1.0
            counted.append(f"{bad} of {len(group)} runs (one-sided 95% upper bound {upper:.3f} a run)")
        out.append(f"* Pruner error: a pruned candidate's full-valset score was above the returned program's in "
                   f"{counted[0]} at the default pruning settings ({', '.join(f'`{m}`' for m in defaults)}), and in "
                   f"{counted[1]} of every pruning row pooled. Stated rate: each prune decision is a one-sided test "
                   f"at `alpha` ({ALPHA:.0%} by default, {STRICT_ALPHA:.0%} in the `alpha={STRICT_ALPHA}` rows) of "
                   "whether the challenger's whole-valset score is below the leader's (`stratified`: below the fully "
                   "scored reference's; `anytime`: a test at `alpha` over all of its looks). A run makes several "
                   "decisions, so the per-decision rate alone does not bound the share of runs; the share is "
                   "measured here. The finalists' re-scoring on fresh examples may also return a program whose "
                   "valset score is below another's, by design, which counts here as an error too.")
    ties = payload.get("tie_prune_rates") or {}
    if ties:
        default, strict = f"{ALPHA:g}", f"{STRICT_ALPHA:g}"
        rates = "; ".join(f"{k} discordant: " + ", ".join(f"`{rule}` {v[default]:.1%} ({v[strict]:.1%})"
                                                          for rule, v in r.items()) for k, r in ties.items())
        out.append(f"* A challenger that ties the leader on the whole valset (100 examples), over "
                   f"{payload.get('tie_orders')} random orders (`tie_prune_rates`), is pruned at some look in, at "
                   f"the default `alpha={default}` (in brackets: at `alpha={strict}`, the same orders): {rates}. "
                   "`confidence` and `stratified` test at `alpha` at each of their looks (every 5% of the valset "
                   "from 20 examples), so over all looks a tie is pruned more often than `alpha`, more as "
                   "discordance grows; `anytime` is a test at `alpha` over every look by construction (Monte Carlo "
                   f"error: a rate of {ALPHA:.0%} has a standard error of "
                   f"{math.sqrt(ALPHA * (1 - ALPHA) / max(1, payload.get('tie_orders') or 1)):.1%} over these "
                   "orders).")
    changed = total_f = 0
    for r in rows:
        for row in r.values():
            fin = (row.get("search") or {}).get("finalists") or []
            if len(fin) > 1:
                total_f += 1
                by_val = max(fin, key=lambda f: (f["val"], -f["candidate"]))["candidate"]
                changed += by_val != row["search"].get("best_candidate")
    if total_f:
        out.append(f"* Winner's curse guard: in {total_f} flowopt runs several finalists could not be told apart on "
                   "the valset; re-scoring them on unused training examples (only while their order was uncertain) "
                   f"changed the pick in {changed}.")
    out.append("* BFRS and MIPROv2 run DSPy's own code; `mipro`/`gepa` stages run the same optimizers inside "
               "`compile()` (their extra calls are compile's baseline and final check). DSPy's cache is off for "
               "every method; flowopt's own score memo (same program, same example) stays on by design: the "
               "search's incumbent and the compiler's final check reuse scores already paid for.")
    return out


def _variants_notes(rows: list[dict[str, Any]]) -> list[str]:
    """The same candidates under other pruning settings: the stratified rule, and what each guarantee
    given up buys in calls (the rows of :data:`SAME_CANDIDATE_VARIANTS`)."""
    from flowopt.optimizers.search.pruning import first_look

    out = []
    base = [r[SAME_CANDIDATES] for r in rows if SAME_CANDIDATES in r]
    strat = [r[STRATIFIED] for r in rows if STRATIFIED in r and r[STRATIFIED].get("search")]
    if strat and base:
        shares = [r["strata_variance"] for r in base + strat if r.get("strata_variance")]
        pick = statistics.fmean(s["by_pick"] for s in shares) if shares else float("nan")
        both = statistics.fmean(s["by_pick_and_incumbent"] for s in shares) if shares else float("nan")
        n_val = max(r["search"]["incumbent_scored"] for r in base)
        after = statistics.fmean(r["search"]["pruned"] * max(0.0, r["search"]["pruned_mean_scored"] - first_look(n_val))
                                 for r in base)
        out.append(
            f"* `pruner=\"stratified\"` (same candidates): {statistics.fmean(r['lm_calls'] for r in strat):.0f} calls "
            f"a run (default rule: {statistics.fmean(r['lm_calls'] for r in base):.0f}), {_valset_scores(strat):.0f} "
            f"valset scores of the candidates (default: {_valset_scores(base):.0f}), {_fresh_scores(strat):.0f} "
            f"finalists' fresh-example scores (default: {_fresh_scores(base):.0f}); pruned "
            f"{statistics.fmean(r['search']['pruned'] for r in strat):.1f} candidates after "
            f"{statistics.fmean(r['search']['pruned_mean_scored'] for r in strat):.0f} valset examples on average "
            f"(default: {statistics.fmean(r['search']['pruned_mean_scored'] for r in base):.0f}). Why stratifying "
            f"cannot buy much more here: by the task's rule, stratifying the valset by the pick's 0/1 answers leaves "
            f"{pick:.0%} of a pruned candidate's per-example variance (by the pick's and the incumbent's answers: "
            f"{both:.0%}; mean over every pruned candidate of both rows, `strata_variance` in the seeds file). A "
            f"test of the same power needs about that share of the examples, so even a perfect stratified design "
            f"would save about {1 - both:.0%} of the {after:.0f} valset examples a run the pruned candidates are "
            f"scored on after the first look ({(1 - both) * after:.0f} calls): the answers of different prompts "
            "to one example agree little beyond the example's difficulty.")
    def cost(name: str) -> str:
        runs = [r[name] for r in rows]
        ratio = statistics.fmean(r["lm_calls"] / b["bfrs8"]["lm_calls"] for r, b in zip(runs, rows))
        diff = statistics.fmean(r["test"]["expected"] - b["bfrs8"]["test"]["expected"] for r, b in zip(runs, rows))
        errors = sum(bool(r.get("pruner_error")) for r in runs)
        return f"{ratio:.3f}x, paired test {diff:+.4f}, pruner errors in {errors} of {len(runs)} runs"

    costs = [", ".join(f"`{k}={v!r}`" for k, v in settings.items()) + ": " + cost(name)
             for name, settings in SAME_CANDIDATE_VARIANTS.items()
             if name not in (STRATIFIED, ANYTIME) and all(name in r for r in rows)]
    strict = "flowopt8_extra0_alpha05"
    if costs and base and all(SAME_CANDIDATES in r and strict in r for r in rows):
        diffs = [r[SAME_CANDIDATES]["test"]["expected"] - r[strict]["test"]["expected"] for r in rows]
        mean, low, high = mean_ci(diffs)
        calls = statistics.fmean(r[SAME_CANDIDATES]["lm_calls"] / r[strict]["lm_calls"] for r in rows)
        out.append(f"* The same candidates under other settings (the default, `alpha={ALPHA}` with the finalists: "
                   f"{cost(SAME_CANDIDATES)}; against `alpha={STRICT_ALPHA}`, paired over the seeds: test "
                   f"{mean:+.4f} [{low:+.4f}, {high:+.4f}], the pick's test score differing in "
                   f"{sum(abs(d) > 1e-12 for d in diffs)} of {len(diffs)} seeds, {calls:.3f}x its calls): "
                   + "; ".join(costs)
                   + f". `alpha={STRICT_ALPHA}` halves the chance that each prune decision drops a candidate that "
                   "is not worse, for the calls shown; `finalists=0` drops the winner's-curse guard (the pick is the "
                   "best valset mean, biased upward); the first look's floor of 20 examples is not a setting "
                   "(`first_look`).")
    anytime = [r[ANYTIME] for r in rows if ANYTIME in r and r[ANYTIME].get("search")]
    if anytime:
        out.append(f"* With `pruner=\"anytime\"` (same candidates; a betting test valid at every look, looking "
                   f"after every example): {statistics.fmean(r['lm_calls'] for r in anytime):.0f} calls a run, "
                   f"{_valset_scores(anytime):.0f} valset scores of the candidates, "
                   f"{_fresh_scores(anytime):.0f} finalists' fresh-example scores; pruned "
                   f"{statistics.fmean(r['search']['pruned'] for r in anytime):.1f} candidates after "
                   f"{statistics.fmean(r['search']['pruned_mean_scored'] for r in anytime):.0f} valset examples on "
                   f"average. It needs more evidence than one look of the default rule, which is a {ALPHA:.0%} test "
                   "at each look, not over all of them.")
    return out


def _valset_scores(runs: list[dict[str, Any]]) -> float:
    """Mean valset scores of the candidates a run paid for (the incumbent's are the baseline's, memoised)."""
    return statistics.fmean(r["search"]["scored_examples"] - r["search"]["incumbent_scored"] for r in runs)


def _survivors_note(same: list[dict[str, Any]], rows: list[dict[str, Any]]) -> str:
    """How far the same-candidates runs are from 0.5x BFRS(8)'s calls, and the most that stopping the
    challengers left after pruning (all but the pick) at the first look could save."""
    from flowopt.optimizers.search.pruning import first_look

    bfrs = statistics.fmean(r["bfrs8"]["lm_calls"] for r in rows)
    n_val = max(r["search"]["incumbent_scored"] for r in same)  # the incumbent is never pruned: the whole valset
    first = first_look(n_val)
    survivors = [max(0, r["search"]["fully_scored"] - 1) for r in same]  # fully scored challengers
    # The pick's whole-valset scores are paid for either way (compile() checks the stage's program on the valset).
    saved = [max(0, k - (r["search"].get("best_kind") != "incumbent")) * (n_val - first)
             for r, k in zip(same, survivors)]
    bound = statistics.fmean(saved)
    total = statistics.fmean(r["lm_calls"] for r in same)
    ratio = statistics.fmean((r["lm_calls"] - x) / b["bfrs8"]["lm_calls"] for r, x, b in zip(same, saved, rows))
    now = statistics.fmean(r["lm_calls"] / b["bfrs8"]["lm_calls"] for r, b in zip(same, rows))
    return (f"* How far `extra=0` is from 0.5x: 0.5x of BFRS(8)'s {bfrs:.0f} calls (mean a seed) is {bfrs / 2:.0f}, "
            f"and the run spends {total:.0f}: {now:.3f}x, the mean of the per-seed ratios (the goal's measure), "
            f"{'within' if now <= 0.5 else 'above'} 0.5x. Pruning leaves {statistics.fmean(survivors):.1f} challengers "
            "a run scored on the whole valset; all but the pick could be stopped sooner (the pick's scores are paid "
            "for by compile()'s final check anyway). Stopping every one of them at the first look "
            f"({first} examples), with no extra cost anywhere, would save at most {bound:.0f} calls a run: "
            f"{ratio:.3f}x."
            + (" Going lower needs earlier prunes, i.e. less evidence per prune, or fewer finalists' "
               "fresh-example scores (the winner's-curse guard)." if now > 0.5 else ""))


def _fresh_scores(runs: list[dict[str, Any]]) -> float:
    """Mean fresh-example scores of the finalists a run paid for."""
    return statistics.fmean(sum(f["fresh_n"] for f in r["search"].get("finalists", [])) for r in runs)


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(main())
