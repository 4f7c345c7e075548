"""One ``search`` stage shared by 1, 2 and 3 worker processes on a real PostgreSQL server.

The task: the scripted category task (an LM that answers a question right only when a demo of its
category is shown; 0.5 s a call, no cache), 24 candidates (incumbent, zero-shot, labeled, 4 shuffled
bootstraps, 17 sampled), each scored on all 24 valset examples (``pruner="none"``, so which worker
scores what cannot change a verdict), 4 LM threads per worker.

Each worker is a separate process that imports everything, says it is ready, and waits for a "go"
file. The search's wall time runs from "go" to the last worker's return from ``compile()`` (imports
and the one-time creation of optuna's tables in the empty database excluded; the baseline, planning,
search, finalists and the compiler's final check included); the time to the last process exit
(interpreter teardown too) is reported beside it. The worker counts are run in interleaved rounds
(``--repeats``).
Then a run with the most workers where one is SIGKILLed while it holds a candidate. Counted from the
study: candidates scored twice, candidates lost, and whether every worker returned the 1-worker run's
program.

Run: python -m flowopt.benchmarks.perf.shared_search [--latency 0.5] [--repeats 1] [--url postgresql+psycopg://...]
(without --url a throwaway cluster is started with tests/optimizers/postgres.py: needs initdb).
Writes benchmarks/results/shared_search.{json,md} (``--out STEM``). Goal (issue 17): 3 workers <= 0.45x
one worker's wall time; 0 candidates scored twice; 0 lost after a kill; the same program in every worker.
"""

from __future__ import annotations

import importlib
import json
import logging
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from flowopt.benchmarks.perf.harness import Goal, PerfParser, interleaved, markdown_table, setup_logging, start_run

ROOT = Path(__file__).resolve().parents[2]
MODULE = "flowopt.benchmarks.perf.shared_search"
SMOKE = {"latency": 0.01, "candidates": 6, "valset": 8, "workers": [1, 2], "kill": 0}
CATS = "abc"
log = logging.getLogger(MODULE)


def settings(candidates: int) -> dict[str, Any]:
    return {"n_candidates": candidates, "seeded": min(4, max(0, candidates - 3)), "max_demos": 2,
            "max_labeled_demos": 2, "pool_size": 4, "pruner": "none", "heartbeat_s": 2, "stale_after_s": 8,
            "wait_timeout_s": 300}


def _examples(n: int, start: int) -> list[Any]:
    import dspy

    out = []
    for i in range(start, start + n):
        q = f"{CATS[i % 3]}:w{i}"
        out.append(dspy.Example(question=q, answer="#" + q[::-1]).with_inputs("question"))
    return out


def _category_lm(latency: float) -> Any:
    from flowopt.testing import scripted_lm

    def answer(req: Any) -> dict[str, str]:
        q = req.inputs.get("question", "")
        cats = {str(d.get("question", "")).split(":")[0] for d in req.demos if str(d.get("answer", "")).startswith("#")}
        return {"answer": "#" + q[::-1] if q.split(":")[0] in cats else q}

    return scripted_lm(answer, latency_s=latency, cache=False, model="scripted/shared-search-bench")


def worker(spec: dict[str, Any]) -> None:
    """One worker: compile with the shared search stage, write what it returned to ``spec["out"]``."""
    import dspy

    for module in ("optuna", "optuna.storages", "psycopg", "alembic.command", "alembic.migration", "sqlalchemy.orm"):
        importlib.import_module(module)  # optuna's RDB storage's imports are outside the timing, as every import is

    import flowopt
    from flowopt.optimizers.search import RandomSearch
    from flowopt.optimizers.search.shared_plan import definition_of

    logging.basicConfig(format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("flowopt.optimizers.search.shared").setLevel(logging.INFO)  # the worker's timeline
    train, val = _examples(15, 0), _examples(spec["valset"], 100)
    stage = RandomSearch(**settings(spec["candidates"]), storage=spec["url"], study_name="bench")
    Path(spec["ready"]).touch()
    while not Path(spec["go"]).exists():
        time.sleep(0.01)
    with dspy.context(lm=_category_lm(spec["latency"])):
        out = flowopt.compile(dspy.Predict("question -> answer"), train,
                              lambda ex, pred, trace=None: ex.answer == pred.answer, valset=val, stages=[stage],
                              quiet=True, num_threads=4, seed=0)
    row = out.report.stage("search")
    usage = resource.getrusage(resource.RUSAGE_SELF)
    Path(spec["out"]).write_text(json.dumps({
        "definition": definition_of(out), "best_score": out.report.best_score, "scored_here": row.info["scored_here"],
        "finalists_here": row.info.get("finalists_scored_here", 0), "planner": row.info.get("planner"),
        "baseline_lm_calls": out.report.stage("baseline").lm_calls, "search_lm_calls": row.lm_calls,
        "search_wall_s": row.wall_s, "lm_calls": sum(r.lm_calls for r in out.report.stages),
        "compile_done_at": time.time(), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1)}))


def run(url: str, n_workers: int, args: Any, tmp: Path, kill: bool = False) -> dict[str, Any]:
    """Start ``n_workers`` on the empty database ``url``; kill one mid-search if ``kill``."""
    import optuna
    from optuna.trial import TrialState

    tag = f"{n_workers}{'k' if kill else ''}-{time.monotonic_ns()}"
    optuna.storages.RDBStorage(url)  # creates optuna's tables: a one-time set-up of the database
    go = tmp / f"go-{tag}"
    specs: list[dict[str, Any]] = [{"url": url, "latency": args.latency, "candidates": args.candidates,
                                    "valset": args.valset, "go": str(go), "ready": str(tmp / f"ready-{tag}-{i}"),
                                    "out": str(tmp / f"out-{tag}-{i}.json")} for i in range(n_workers)]
    procs = [subprocess.Popen([sys.executable, "-m", MODULE, "--worker", json.dumps(s)], cwd=ROOT) for s in specs]
    while not all(Path(s["ready"]).exists() for s in specs):
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a worker exited before it was ready: {[p.returncode for p in procs]}")
        time.sleep(0.05)
    go_at = time.time()
    start = time.monotonic()
    go.touch()
    victim = None
    if kill:
        while victim is None:
            time.sleep(0.2)
            try:
                trials = optuna.load_study(study_name="bench", storage=url).get_trials(deepcopy=False)
            except KeyError:
                continue
            if sum(t.state == TrialState.COMPLETE for t in trials) < max(1, args.candidates // 6):
                continue
            pids = {t.user_attrs.get("worker", "::").split(":")[1] for t in trials if t.state == TrialState.RUNNING}
            victim = next((p for p in procs if str(p.pid) in pids), None)
        victim.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait(timeout=900)
    wall = time.monotonic() - start
    trials = optuna.load_study(study_name="bench", storage=url).get_trials(deepcopy=False)
    done = Counter(t.user_attrs["candidate"] for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED))
    outs = [json.loads(Path(s["out"]).read_text()) for s, p in zip(specs, procs) if p is not victim]
    result = {"workers": n_workers, "killed": kill, "wall_s": round(wall, 2),
              "exit_codes": [p.returncode for p in procs],
              "scored_twice": sum(c - 1 for c in done.values() if c > 1), "lost": args.candidates - len(done),
              "definitions": [o["definition"] for o in outs]}
    for key in ("scored_here", "finalists_here", "planner", "baseline_lm_calls", "search_lm_calls", "search_wall_s",
                "lm_calls", "cpu_s", "best_score"):
        result[key] = [o[key] for o in outs]
    result["compile_done_s"] = [round(o["compile_done_at"] - go_at, 2) for o in outs]  # from "go", per worker
    result["search_s"] = max(result["compile_done_s"])  # go to the last compile() return: the search's wall time
    log.info("%d workers%s: %.2f s", n_workers, " (one killed)" if kill else "", wall)
    return result


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:  # one worker process, started by run()
        worker(json.loads(argv[1]))
        return 0
    parser = PerfParser("shared_search", __doc__, smoke=SMOKE)
    parser.add_argument("--latency", type=float, default=0.5, help="seconds a scripted LM call takes")
    parser.add_argument("--candidates", type=int, default=24)
    parser.add_argument("--valset", type=int, default=24)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 3], help="worker counts to time")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved rounds of every worker count")
    parser.add_argument("--kill", type=int, default=1, help="1: also a run with the most workers, one killed")
    parser.add_argument("--url", help="a PostgreSQL server URL (postgresql+psycopg://user@host:port/db); default: "
                                      "a throwaway cluster")
    run_ = start_run(parser, argv)
    args = run_.args
    if 1 not in args.workers:
        parser.error("--workers must include 1 (the reference run)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # leave the with-blocks: the cluster is removed
    sys.path.insert(0, str(ROOT / "tests" / "optimizers"))
    from postgres import PostgresCluster  # the tests' throwaway-cluster helper

    with tempfile.TemporaryDirectory() as tmp, PostgresCluster.start() as cluster:
        def one(n: int, kill: bool = False) -> dict[str, Any]:
            return run(cluster.create_database(f"bench{n}{'k' if kill else ''}"), n, args, Path(tmp), kill)

        rounds = interleaved({str(n): (lambda n=n: one(n)) for n in args.workers}, args.repeats)
        killed = [one(max(args.workers), kill=True)] if args.kill and max(args.workers) > 1 else []
    reference = rounds["1"][0]["definitions"][0]
    runs = [r for n in args.workers for r in rounds[str(n)]] + killed
    for r in runs:
        r["same_program_as_one_worker"] = all(d == reference for d in r.pop("definitions"))
    one_search = statistics.median(r["search_s"] for r in rounds["1"])
    one_wall = statistics.median(r["wall_s"] for r in rounds["1"])
    median_search = {n: statistics.median(r["search_s"] for r in rounds[str(n)]) for n in args.workers}
    median_wall = {n: statistics.median(r["wall_s"] for r in rounds[str(n)]) for n in args.workers}
    ratio = {n: round(median_search[n] / one_search, 3) for n in args.workers}
    ratio_exit = {n: round(median_wall[n] / one_wall, 3) for n in args.workers}
    rows = [[f"{r['workers']}{' (1 killed)' if r['killed'] else ''}", r["search_s"],
             round(r["search_s"] / one_search, 3),
             r["wall_s"], round(r["wall_s"] / one_wall, 3), r["compile_done_s"], r["cpu_s"], r["lm_calls"],
             r["baseline_lm_calls"],
             r["scored_here"], r["finalists_here"], r["scored_twice"], r["lost"], r["same_program_as_one_worker"],
             r["exit_codes"]] for r in runs]
    body = [f"Task: {args.candidates} candidates, each on {args.valset} valset examples, {args.latency} s a scripted "
            f"LM call, 4 LM threads a worker, {args.repeats} interleaved round(s) of {args.workers} workers. Search s: "
            "from 'go' to the last worker's return from compile() (imports excluded); to exit: to the last process "
            "exit; 'done at' is when each worker's compile() returned.", "",
            *markdown_table(["workers", "search s", "vs 1 worker", "to exit s", "vs 1 worker", "done at (s, each)",
                             "CPU s (each)", "LM calls (each)", "baseline LM calls (each)", "candidates scored (each)",
                             "finalists scored (each)", "scored twice", "lost", "same program", "exit codes"], rows,
                            align="lrrrrllllllrrll"),
            "", "Medians per worker count, search (to exit): "
            + ", ".join(f"{n}: {median_search[n]:.2f} s {ratio[n]}x ({median_wall[n]:.2f} s {ratio_exit[n]}x)"
                        for n in args.workers) + "."]
    top = max(args.workers)
    goals = [Goal.at_most("candidates scored twice (all runs)", sum(r["scored_twice"] for r in runs), 0),
             Goal.at_most("candidates lost (all runs, the kill included)", sum(r["lost"] for r in runs), 0),
             Goal.at_least("runs where every worker returned the 1-worker program",
                           sum(r["same_program_as_one_worker"] for r in runs), len(runs))]
    if top >= 3:
        goals.insert(0, Goal.at_most(f"{top} workers' search wall time / 1 worker's (median)", ratio[top], 0.45))
    run_.finish("Shared search: 1, 2, 3 workers on one PostgreSQL study", {
        "settings": settings(args.candidates), "median_search_s": {str(n): median_search[n] for n in args.workers},
        "vs_one_worker": {str(n): ratio[n] for n in args.workers},
        "median_to_exit_s": {str(n): median_wall[n] for n in args.workers},
        "to_exit_vs_one_worker": {str(n): ratio_exit[n] for n in args.workers}, "runs": runs}, body, goals=goals)
    return 0


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(main())
