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
import random
import re
import statistics
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from flowopt.benchmarks.perf.harness import PerfParser, setup_logging, start_run
from flowopt.benchmarks.perf.search_generalisation_methods import (
    DETAILED,
    METHODS,
    SMOKE,
    STRICT_ALPHA,
    run_method,
)
from flowopt.benchmarks.perf.search_generalisation_report import body, goals
from flowopt.benchmarks.perf.search_tasks import Task, mean_ci
from flowopt.optimizers.search.pruning import ALPHA


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


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(main())
