"""One ``search`` stage shared by 1, 2 and 3 worker processes on a real PostgreSQL server.

The task: the scripted category task (an LM that answers a question right only when a demo of its
category is shown; 0.5 s a call, no cache), 24 candidates (incumbent, zero-shot, labeled, 4 shuffled
bootstraps, 17 sampled), each scored on all 24 valset examples (``pruner="none"``, so which worker
scores what cannot change a verdict), 4 LM threads per worker.

Each worker is a separate process that imports everything, says it is ready, and waits for a "go"
file; the wall time runs from "go" to the last worker's exit (imports and the one-time creation of
optuna's tables in the empty database excluded; the baseline score, planning, search and the
compiler's final check included). Then a run with 3 workers where one is
SIGKILLed while it holds a candidate. Counted from the study: candidates scored twice, candidates
lost, and whether every worker returned the 1-worker run's program.

Run: python benchmarks/perf/shared_search.py [--latency 0.5] [--url postgresql+psycopg://...]
(without --url a throwaway cluster is started with tests/optimizers/postgres.py: needs initdb).
Writes benchmarks/results/shared_search.{json,md}. Goal (issue 17): 3 workers <= 0.45x one worker.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import platform
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
SETTINGS: dict[str, Any] = {"n_candidates": 24, "seeded": 4, "max_demos": 2, "max_labeled_demos": 2,
                            "pool_size": 4, "pruner": "none", "heartbeat_s": 2, "stale_after_s": 8,
                            "wait_timeout_s": 300}
CATS = "abc"


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

    for module in ("alembic.command", "alembic.migration", "sqlalchemy.orm"):  # optuna's RDB storage's imports
        importlib.import_module(module)  # are outside the timing, as every import is

    import flowopt
    from flowopt.optimizers.search import RandomSearch
    from flowopt.optimizers.search.shared_plan import definition_of

    logging.basicConfig(format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("flowopt.optimizers.search.shared").setLevel(logging.INFO)  # the worker's timeline
    train, val = _examples(15, 0), _examples(24, 100)
    stage = RandomSearch(**SETTINGS, storage=spec["url"], study_name="bench")
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
        "lm_calls": sum(r.lm_calls for r in out.report.stages), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1)}))


def run(url: str, n_workers: int, latency: float, tmp: Path, kill: bool = False) -> dict[str, Any]:
    """Start ``n_workers`` on the empty database ``url``; kill one mid-search if ``kill``."""
    import optuna
    from optuna.trial import TrialState

    tag = f"{n_workers}{'k' if kill else ''}"
    optuna.storages.RDBStorage(url)  # creates optuna's tables: a one-time set-up of the database
    go = tmp / f"go-{tag}"
    specs: list[dict[str, Any]] = [{"url": url, "latency": latency, "go": str(go),
                                    "ready": str(tmp / f"ready-{tag}-{i}"), "out": str(tmp / f"out-{tag}-{i}.json")}
                                   for i in range(n_workers)]
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(s)], cwd=ROOT) for s in specs]
    while not all(Path(s["ready"]).exists() for s in specs):
        time.sleep(0.05)
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
            if sum(t.state == TrialState.COMPLETE for t in trials) < 4:
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
    return {"workers": n_workers, "killed": kill, "wall_s": round(wall, 2),
            "exit_codes": [p.returncode for p in procs],
            "scored_twice": sum(c - 1 for c in done.values() if c > 1),
            "lost": SETTINGS["n_candidates"] - len(done),
            "scored_here": [o["scored_here"] for o in outs], "best_score": [o["best_score"] for o in outs],
            "lm_calls": [o["lm_calls"] for o in outs], "cpu_s": [o["cpu_s"] for o in outs],
            "definitions": [o["definition"] for o in outs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--latency", type=float, default=0.5)
    parser.add_argument("--url", help="a PostgreSQL server URL (postgresql+psycopg://user@host:port); default: "
                                      "a throwaway cluster")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 3], help="worker counts to time")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # leave the with-blocks: the cluster is removed
    sys.path.insert(0, str(ROOT / "tests" / "optimizers"))
    from postgres import PostgresCluster  # the tests' throwaway-cluster helper

    load_before = os.getloadavg()
    runs = []
    with tempfile.TemporaryDirectory() as tmp, PostgresCluster.start() as cluster:
        kill_run = [(max(args.workers), True)] if max(args.workers) > 1 else []
        for n, kill in [*((n, False) for n in args.workers), *kill_run]:
            url = cluster.create_database(f"bench{n}{'k' if kill else ''}")
            runs.append(run(url, n, args.latency, Path(tmp), kill))
            print(f"{n} workers{' (one killed)' if kill else ''}: {runs[-1]['wall_s']} s", flush=True)
    reference = runs[0]["definitions"][0]
    for r in runs:
        r["same_program_as_one_worker"] = all(d == reference for d in r.pop("definitions"))
    one, one_calls = runs[0]["wall_s"], runs[0]["lm_calls"][0]
    for r in runs:
        r["vs_one_worker"] = round(r["wall_s"] / one, 3)
        # Calls are latency-bound (0.5 s each): the busiest worker's calls bound the wall time from below.
        r["busiest_calls_vs_one_worker"] = round(max(r["lm_calls"]) / one_calls, 3)
    result = {"command": "python " + " ".join(sys.argv), "machine": f"{platform.node()} {platform.machine()}, "
              f"{os.cpu_count()} CPUs, {platform.python_version()}", "load_average_before": load_before,
              "load_average_after": os.getloadavg(), "latency_s": args.latency, "settings": SETTINGS, "runs": runs}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "shared_search.json").write_text(json.dumps(result, indent=1))
    lines = ["# Shared search: 1, 2, 3 workers on one PostgreSQL study", "",
             f"Command: `{result['command']}`  ", f"Machine: {result['machine']}; load average (1, 5, 15 min) "
             f"before {tuple(round(x, 1) for x in load_before)}, after "
             f"{tuple(round(x, 1) for x in result['load_average_after'])} (other jobs shared the 2 cores).  ",
             f"Task: {SETTINGS['n_candidates']} candidates, each on 24 valset examples, {args.latency} s a "
             "scripted LM call, 4 threads a worker. Wall time from 'go' to the last exit (imports excluded).", "",
             "| workers | wall s | vs 1 worker | busiest worker's LM calls vs 1 worker | LM calls by each "
             "| CPU s by each | scored twice | lost | scored by each | same program | exit codes |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['workers']}{' (1 killed)' if r['killed'] else ''} | {r['wall_s']} | {r['vs_one_worker']} "
                     f"| {r['busiest_calls_vs_one_worker']} | {r['lm_calls']} | {r['cpu_s']} | {r['scored_twice']} "
                     f"| {r['lost']} | {r['scored_here']} | {r['same_program_as_one_worker']} "
                     f"| {r['exit_codes']} |")
    (RESULTS / "shared_search.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
