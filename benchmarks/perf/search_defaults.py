"""Defaults against defaults: ``flowopt.compile(program, trainset, metric)`` against DSPy's optimizers with
no settings, on task shapes the search was not tuned on, each pick scored on a held-out test split.

What a DSPy user tries first: ``compile()`` with no stages and no settings (its default stage, the
``search``), against ``dspy.BootstrapFewShotWithRandomSearch`` at DSPy's defaults (16 candidate
programs: 19 programs scored), ``dspy.MIPROv2(auto="light")`` and ``dspy.GEPA(auto="light")`` (its
reflection LM is the same scripted LM, so its calls are counted with the rest). Also: BFRS(8) beside
the search with BFRS(8)'s 11 candidates and no extras (``n_candidates=11, extra=0``; and with
``finalists=3``, the winner's-curse re-scoring that is off by default), and ``compile()`` under a
``Budget(max_lm_calls=...)`` of MIPROv2's and GEPA's own calls on the same seed.

Task shapes (:mod:`~flowopt.benchmarks.perf.search_tasks`; 60 train / 100 val / 300 test a seed):
``demos_only`` (which training examples become demos is the only lever; instructions change nothing),
``needles`` (one demo in eight strongly helpful) and ``instructions`` (instructions matter more than
demos). Every method runs on every seed of every shape, in this process, on its own scripted LM (a
DSPy engine, DSPy's cache off), so LM calls are exact counts. The test score of a pick is its expected
accuracy on the 300 test examples (by the task's rule, no LM calls). Differences are paired per seed,
mean and 95% t-interval, with better / equal / worse seed counts.

The seeds: world seed ``shape_index + 3 * i`` for i in ``--first-seed ..``; the defaults were developed
on seeds from 10000 up (``--first-seed 10000``) and compile()'s default seed was settled on i = 0..39
(``search_defaults.md``); ``--first-seed 2000`` (world seeds 6000 up) was the confirmation of those
defaults (``search_defaults_fresh.md``); the kinds' exploration and ``finalists=0`` (issue 27) were
tuned on i = 0..19 and 10000..10019 and confirmed on ``--first-seed 8000`` (world seeds 24000 up,
``search_defaults_confirm.md``, ``search_defaults_bfrs8_confirm.md``), and re-measured on
``--first-seed 16000`` (world seeds 48000 up, ``search_defaults_block16000.md``,
``search_defaults_bfrs8_block16000.md``; its BFRS(8) candidates fully scored for the pruning replay,
``search_pruning_replay_block16000.md``, no rule chosen there); ``--first-seed 24000`` (world seeds
72000 up) is untouched. The world seed
draws the task (examples, their difficulties and demo qualities); every optimizer runs at its own
default seed, as a user who passes no settings gets it (``compile()``: 0, whose shuffled bootstraps are
BFRS's own candidates, so the pair differs only by what the search adds and prunes).

DSPy's cache is off, so every request is a counted call; ``--dspy-cache`` runs each method with a fresh
in-memory one (``search_defaults_bfrs8_dspy_cache.md``: the same counts, no request repeats).

Run:  nice -n 5 python -m flowopt.benchmarks.perf.search_defaults --seeds 40 --workers 2
Writes benchmarks/results/search_defaults.{json,md} (``--out STEM``); ``--smoke`` runs one small seed a
shape.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import dspy

from flowopt.benchmarks.perf.harness import Goal, PerfParser, markdown_table, setup_logging, start_run
from flowopt.benchmarks.perf.search_tasks import DEMOS_ONLY, Task, dspy_cache, mean_ci, metric

SHAPES = (DEMOS_ONLY, "needles", "instructions")
METHODS = ("bfrs16", "mipro_light", "gepa_light", "flowopt_defaults", "bfrs8", "flowopt_bfrs8_candidates",
           "flowopt_bfrs8_candidates_finalists", "flowopt_at_mipro_calls", "flowopt_at_gepa_calls")
LABELS = {
    "flowopt_defaults": "flowopt `compile()`, no settings",
    "bfrs16": "DSPy BFRS, defaults (16 candidate programs)",
    "mipro_light": "DSPy MIPROv2(auto=\"light\")",
    "gepa_light": "DSPy GEPA(auto=\"light\")",
    "bfrs8": "DSPy BFRS(8)",
    "flowopt_bfrs8_candidates": "flowopt `search`, BFRS(8)'s 11 candidates, no extras",
    "flowopt_bfrs8_candidates_finalists": "flowopt `search`, BFRS(8)'s 11 candidates, no extras, `finalists=3`",
    "flowopt_at_mipro_calls": "flowopt `compile()` at MIPROv2 light's LM calls (`Budget`)",
    "flowopt_at_gepa_calls": "flowopt `compile()` at GEPA light's LM calls (`Budget`)",
}
# (ours, peer): the paired comparisons the report makes, the goals' first.
PAIRS = (("flowopt_defaults", "bfrs16"), ("flowopt_defaults", "mipro_light"), ("flowopt_defaults", "gepa_light"),
         ("flowopt_at_mipro_calls", "mipro_light"), ("flowopt_at_gepa_calls", "gepa_light"),
         ("flowopt_bfrs8_candidates", "bfrs8"), ("flowopt_bfrs8_candidates_finalists", "bfrs8"),
         ("flowopt_defaults", "bfrs8"))
BUDGETED = {"flowopt_at_mipro_calls": "mipro_light", "flowopt_at_gepa_calls": "gepa_light"}
SMOKE = {"seeds": 1, "workers": 1, "threads": 4, "train": 30, "val": 40, "test": 60}


def run_method(name: str, task: Task, threads: int, calls_of: dict[str, int], cache: bool = False) -> dict[str, Any]:
    """Run one method on one task, on a fresh scripted LM: the pick's scores, exact LM calls, wall time."""
    import flowopt

    lm = task.lm(0.0, cache=cache)
    student = dspy.Predict("question -> answer")
    info: dict[str, Any] = {}
    start = time.perf_counter()
    with dspy_cache(cache), dspy.context(lm=lm):
        if name in ("bfrs16", "bfrs8"):
            from dspy.teleprompt import BootstrapFewShotWithRandomSearch

            settings = {"num_candidate_programs": 8} if name == "bfrs8" else {}  # DSPy's default is 16
            bfrs = BootstrapFewShotWithRandomSearch(metric=metric, num_threads=threads, **settings)
            out = bfrs.compile(student, trainset=task.train, valset=task.val)
        elif name == "mipro_light":
            mipro = dspy.MIPROv2(metric=metric, auto="light", num_threads=threads, verbose=False)
            out = mipro.compile(student, trainset=task.train, valset=task.val)
        elif name == "gepa_light":
            def feedback(gold: Any, pred: Any, trace: Any = None, pred_name: Any = None,
                         pred_trace: Any = None) -> float:
                return metric(gold, pred, trace)

            gepa = dspy.GEPA(metric=feedback, auto="light", reflection_lm=lm, num_threads=threads)
            out = gepa.compile(student, trainset=task.train, valset=task.val)
        else:
            stages: Any = None
            budget = None
            if name == "flowopt_bfrs8_candidates":
                stages = [("search", {"n_candidates": 11, "extra": 0})]
            elif name == "flowopt_bfrs8_candidates_finalists":  # the winner's-curse re-scoring on
                stages = [("search", {"n_candidates": 11, "extra": 0, "finalists": 3})]
            elif name in BUDGETED:
                budget = flowopt.Budget(max_lm_calls=calls_of[BUDGETED[name]])
            out = flowopt.compile(student, task.train, metric, valset=task.val, stages=stages, budget=budget,
                                  num_threads=threads, quiet=True)
            search = next((s for s in out.report.stages if s.name == "search"), None)
            if search is not None:
                keys = ("extra", "fully_scored", "pruned", "best_kind", "extra_kinds", "stop_reason")
                info["search"] = {k: search.info[k] for k in keys if k in search.info}
                # the finalists' re-scoring on fresh training examples: one LM call an example a finalist
                info["search"]["fresh_calls"] = sum(f["fresh_n"] for f in search.info.get("finalists", []))
    return {"lm_calls": lm.engine.calls, "wall_s": round(time.perf_counter() - start, 3),
            "test": round(task.score(out, task.test)["expected"], 6),
            "val": round(task.score(out, task.val)["realised"], 6), **info}


def run_seed(job: tuple[int, str], args: Any, logged: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Every one of ``args.methods`` on one seed; those in ``logged`` (this seed's rows from the seeds log)
    are taken from it, not run again."""
    seed, shape = job
    task = Task(seed, args.train, args.val, args.test, shape=shape)
    rows: dict[str, dict[str, Any]] = {}
    # DSPy's optimizers print their progress (print and tqdm, warnings): kept out of the benchmark's own log,
    # and the process's logging restored after (a caller in the same process keeps its warnings).
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            for name in args.methods:  # the peers first: the budgeted rows take their calls
                done = (logged or {}).get(name)
                rows[name] = done if done is not None else run_method(
                    name, task, args.threads, {k: v["lm_calls"] for k, v in rows.items()}, args.dspy_cache)
    finally:
        logging.disable(previous)
    return {"seed": seed, "shape": shape, "rows": rows}



def compare(seeds: list[dict[str, Any]], ours: str, peer: str) -> dict[str, Any]:
    """Paired over ``seeds``: test difference [95% CI], better / equal / worse seeds, calls ratio."""
    diffs = [s["rows"][ours]["test"] - s["rows"][peer]["test"] for s in seeds]
    ratios = [s["rows"][ours]["lm_calls"] / s["rows"][peer]["lm_calls"] for s in seeds]
    return {"diff": [round(x, 5) for x in mean_ci(diffs)], "better": sum(d > 1e-9 for d in diffs),
            "equal": sum(abs(d) <= 1e-9 for d in diffs), "worse": sum(d < -1e-9 for d in diffs),
            "calls_ratio": round(statistics.fmean(ratios), 4), "n": len(diffs)}


def summarise(results: list[dict[str, Any]], methods: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for shape in [*SHAPES, "all"]:
        seeds = [r for r in results if shape in ("all", r["shape"])]
        if not seeds:
            continue
        out[shape] = {
            "methods": {m: {"test": round(statistics.fmean(s["rows"][m]["test"] for s in seeds), 5),
                            "lm_calls": round(statistics.fmean(s["rows"][m]["lm_calls"] for s in seeds), 1),
                            "wall_s": round(statistics.fmean(s["rows"][m]["wall_s"] for s in seeds), 2)}
                        for m in methods},
            "pairs": {f"{a} vs {b}": compare(seeds, a, b) for a, b in PAIRS if a in methods and b in methods},
        }
    return out


def goals(summary: dict[str, Any]) -> list[Goal]:
    """Issue 27's goals, per shape."""
    out: list[Goal] = []
    for shape in SHAPES:
        pairs = summary.get(shape, {}).get("pairs", {})
        if (p := pairs.get("flowopt_defaults vs bfrs16")) is not None:
            if shape == DEMOS_ONLY:
                out += [Goal.at_least(f"{shape}: defaults vs BFRS defaults, paired test difference", p["diff"][0],
                                      0.01),
                        Goal.at_least(f"{shape}: defaults vs BFRS defaults, lower end of the 95% CI", p["diff"][1],
                                      1e-6)]
            else:
                out.append(Goal.at_least(f"{shape}: defaults vs BFRS defaults, paired test difference", p["diff"][0],
                                         0.0))
            out.append(Goal.at_most(f"{shape}: defaults, LM calls vs BFRS defaults (x)", p["calls_ratio"], 1.0))
        for ours, peer in (("flowopt_at_mipro_calls", "mipro_light"), ("flowopt_at_gepa_calls", "gepa_light")):
            if (p := pairs.get(f"{ours} vs {peer}")) is not None:
                out += [Goal.at_least(f"{shape}: at {peer}'s calls, paired test difference", p["diff"][0], 0.0),
                        Goal.at_most(f"{shape}: at {peer}'s calls, LM calls ratio (x)", p["calls_ratio"], 1.0)]
        if (p := pairs.get("flowopt_bfrs8_candidates vs bfrs8")) is not None:
            out += [Goal.at_least(f"{shape}: BFRS(8)'s candidates, paired test difference", p["diff"][0], 0.0),
                    Goal.at_most(f"{shape}: BFRS(8)'s candidates, LM calls vs BFRS(8) (x)", p["calls_ratio"], 0.5)]
    return out


def body(summary: dict[str, Any], args: Any) -> list[str]:
    cache = "on (in memory, fresh for each run)" if getattr(args, "dspy_cache", False) else "off"
    lines = [f"Task shapes: see the script's docstring. {args.seeds} paired seeds a shape, {args.train} train / "
             f"{args.val} val / {args.test} held-out test, scripted LM (no latency), {args.threads} threads, "
             f"{args.workers} seeds at a time, DSPy cache {cache}. Test score = expected accuracy of the returned "
             "program on the test split. Differences paired per seed: mean [95% t-interval]. LM calls are exact "
             "counts; wall times are under the load above.", ""]
    rows = []
    for shape, entry in summary.items():
        for key, p in entry["pairs"].items():
            ours, peer = key.split(" vs ")
            rows.append([shape, LABELS[ours], LABELS[peer], f"{p['diff'][0]:+.4f} [{p['diff'][1]:+.4f}, "
                         f"{p['diff'][2]:+.4f}]", f"{p['better']}/{p['equal']}/{p['worse']}",
                         f"{p['calls_ratio']:.2f}x"])
    lines += markdown_table(["shape", "flowopt", "against", "test difference [95% CI]", "better/equal/worse",
                             "LM calls (x peer)"], rows, align="lllrrr")
    lines += ["", "Per method, mean over the seeds of each shape:", ""]
    rows = [[shape, LABELS[m], f"{e['test']:.4f}", f"{e['lm_calls']:.0f}", f"{e['wall_s']:.1f}"]
            for shape, entry in summary.items() for m, e in entry["methods"].items()]
    lines += markdown_table(["shape", "method", "test (expected)", "LM calls", "wall s"], rows, align="llrrr")
    return lines


def logged_rows(path: Path | None, jobs: list[tuple[int, str]]) -> dict[tuple[int, str], dict[str, dict[str, Any]]]:
    """The rows of the seeds of ``jobs`` already in the JSON-lines file at ``path``, by method (a later
    line of a seed adds to or replaces an earlier one's): the methods a seed has there are not run again."""
    out: dict[tuple[int, str], dict[str, dict[str, Any]]] = {}
    if path is None or not path.exists():
        return out
    wanted = set(jobs)
    for line in path.read_text().splitlines():
        if line.strip() and ((r := json.loads(line))["seed"], r["shape"]) in wanted:
            out.setdefault((r["seed"], r["shape"]), {}).update(r["rows"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = PerfParser("search_defaults", __doc__, smoke=SMOKE)
    parser.add_argument("--seeds", type=int, default=40, help="seeds a shape")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--train", type=int, default=60)
    parser.add_argument("--val", type=int, default=100)
    parser.add_argument("--test", type=int, default=300)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--dspy-cache", action="store_true",
                        help="DSPy's in-memory cache on (fresh for each method and seed): a request already seen is "
                             "answered by the cache and not counted")
    parser.add_argument("--seeds-log", type=Path, default=None,
                        help="append each finished seed to this JSON-lines file; the methods a seed has there are "
                             "not run again (a run stopped early goes on from it; a new method joins an earlier run)")
    run = start_run(parser, argv)
    args = run.args
    args.methods = [m for m in METHODS if m in args.methods]  # peers before the rows that read their calls
    log = logging.getLogger("search_defaults")
    jobs = [(SHAPES.index(shape) + 3 * i, shape) for i in range(args.first_seed, args.first_seed + args.seeds)
            for shape in args.shapes]
    logged = logged_rows(args.seeds_log, jobs)
    done = [job for job in jobs if set(args.methods) <= set(logged.get(job, {}))]
    results = [{"seed": seed, "shape": shape, "rows": {m: logged[seed, shape][m] for m in args.methods}}
               for seed, shape in done]
    todo = [job for job in jobs if job not in done]
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        for res in pool.map(run_seed, todo, [args] * len(todo), [logged.get(job) for job in todo]):
            results.append(res)
            if args.seeds_log is not None:
                with args.seeds_log.open("a") as log_file:
                    log_file.write(json.dumps(res) + "\n")
            log.info("seed %d (%s): %s", res["seed"], res["shape"],
                     {k: (round(v["test"], 3), v["lm_calls"]) for k, v in res["rows"].items()})
    results.sort(key=lambda r: (SHAPES.index(r["shape"]), r["seed"]))
    summary = summarise(results, args.methods)
    run.finish("Defaults against defaults: compile() vs DSPy's optimizers, held-out test",
               {"summary": summary, "seeds": results}, body(summary, args), goals=goals(summary))
    return 0


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(main())
