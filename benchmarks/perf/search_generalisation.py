"""Does the search pick programs that generalise? flowopt's search vs DSPy's optimizers on held-out test.

A simulated task family where the choice of demos (and instructions) really matters, scored on a
held-out test split the optimizers never see:

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
``BootstrapFewShotWithRandomSearch``), flowopt (``demos`` + ``search``) with BFRS(8)'s candidates
and its default pruner (with and without paid-for extras), with ``pruner="none"``, at BFRS(8)'s LM
calls (``Budget(max_lm_calls=...)``), flowopt's defaults (``compile()`` with no stages given),
``dspy.MIPROv2(auto="light")``, and the ``mipro`` and ``gepa`` stages (``gepa`` at BFRS(8)'s calls).

Pruner error: for the flowopt runs with pruning, the full-valset score of every pruned candidate
is computed afterwards (by the rule, no LM calls) and compared with the returned program's.

Run:  nice -n 10 .venv/bin/python benchmarks/perf/search_generalisation.py --seeds 30 --workers 2
Writes benchmarks/results/search_generalisation.{json,md}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import platform
import random
import re
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import dspy

SHAPES = ("spread", "needles", "instructions")
ORIGINAL = "Given the fields `question`, produce the fields `answer`."
METHODS = ("bfrs8", "bfrs16", "flowopt8", "flowopt8_extra0", "flowopt8_none", "flowopt_at_bfrs8_calls",
           "flowopt_defaults", "mipro_light", "mipro_stage", "gepa_stage")
LABELS = {
    "bfrs8": "DSPy BFRS(8)",
    "bfrs16": "DSPy BFRS(16)",
    "flowopt8": "flowopt, BFRS(8)'s candidates + paid-for extras (defaults otherwise)",
    "flowopt8_extra0": "flowopt, BFRS(8)'s candidates only (`extra=0`)",
    "flowopt8_none": "flowopt, BFRS(8)'s candidates, `pruner=\"none\"`",
    "flowopt_at_bfrs8_calls": "flowopt at BFRS(8)'s LM calls (`Budget`)",
    "flowopt_defaults": "flowopt defaults (`compile()`, no stages given)",
    "mipro_light": "dspy.MIPROv2(auto=\"light\")",
    "mipro_stage": "flowopt `mipro` stage (light)",
    "gepa_stage": "flowopt `gepa` stage at BFRS(8)'s LM calls",
}


def _u(*parts: Any) -> float:
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _norm(text: str) -> str:
    return " ".join(str(text).split())


class Task:
    """One seed's task: examples, hidden qualities and the answer rule."""

    def __init__(self, seed: int, n_train: int = 60, n_val: int = 100, n_test: int = 300) -> None:
        rng = random.Random(seed)
        self.seed, self.shape = seed, SHAPES[seed % len(SHAPES)]
        n = n_train + n_val + n_test
        self.questions = [f"q{seed}-{i}: {rng.choice('abcdefgh')}{rng.randint(100, 999)}" for i in range(n)]
        self.answers = [f"a{_u(seed, 'answer', i):.6f}"[:9] for i in range(n)]
        self.difficulty = [rng.gauss(0.0, 1.0) for _ in range(n)]
        if self.shape == "needles":
            self.quality = [1.6 if rng.random() < 0.125 else rng.gauss(-0.25, 0.15) for _ in range(n_train)]
        else:
            self.quality = [rng.gauss(0.0, 0.7 if self.shape == "spread" else 0.4) for _ in range(n_train)]
        self.instruction_sd = 0.6 if self.shape == "instructions" else 0.25
        self.index = {q: i for i, q in enumerate(self.questions)}
        examples = [dspy.Example(question=q, answer=a).with_inputs("question")
                    for q, a in zip(self.questions, self.answers)]
        self.train = examples[:n_train]
        self.val = examples[n_train:n_train + n_val]
        self.test = examples[n_train + n_val:]

    def instruction_effect(self, instruction: str) -> float:
        text = _norm(instruction)
        if not text or text == _norm(ORIGINAL):
            return 0.0
        u = min(max(_u(self.seed, "instruction", text), 1e-9), 1 - 1e-9)
        return statistics.NormalDist(0.0, self.instruction_sd).inv_cdf(u)

    def demo_effect(self, demos: list[tuple[str, str]]) -> float:
        effect, k = 0.0, 0
        for question, answer in demos:
            i = self.index.get(question)
            if i is None or i >= len(self.quality):
                continue
            k += 1
            effect += self.quality[i] if answer == self.answers[i] else -0.5
        return (effect / math.sqrt(k) + (0.3 if k >= 4 else 0.0)) if k else 0.0

    def probability(self, demos: list[tuple[str, str]], instruction: str, i: int) -> float:
        logit = 0.2 + self.demo_effect(demos) + self.instruction_effect(instruction) - self.difficulty[i]
        return 1.0 / (1.0 + math.exp(-logit))

    def correct(self, demos: list[tuple[str, str]], instruction: str, i: int) -> bool:
        key = (self.seed, tuple(q for q, _ in demos), _norm(instruction), i)
        return _u(*key) < self.probability(demos, instruction, i)

    # ---------------------------------------------------------------- the fake LM
    def lm(self, latency: float) -> dspy.LM:
        from flowopt.testing import scripted_lm

        objective = re.compile(r"your objective is:\s*(.*)\Z", re.S)

        def answer(req: Any) -> Any:
            question = req.inputs.get("question")
            if req.output_fields == ["answer"] and question in self.index:
                match = objective.search(req.system)
                instruction = match.group(1) if match else ORIGINAL
                demos = [(str(d.get("question", "")), str(d.get("answer", ""))) for d in req.demos]
                i = self.index[question]
                ok = self.correct(demos, instruction, i)
                return {"answer": self.answers[i] if ok else f"wrong-{i}"}
            # Any other prompt (an instruction proposer, GEPA's reflection): a fresh instruction.
            text = f"Answer the question carefully (variant {_u(self.seed, req.prompt, req.system):.6f})."
            values = {name: text for name in req.output_fields}
            return json.dumps(values) if "JSON" in req.system else values

        return scripted_lm(answer, latency_s=latency, cache=False, model=f"scripted/sim-{self.seed}")

    # ---------------------------------------------------------------- scoring without LM calls
    def program_parts(self, program: Any) -> tuple[list[tuple[str, str]], str]:
        predictor = program.predictors()[0]
        demos = [(str(d.get("question", "")), str(d.get("answer", ""))) for d in predictor.demos]
        return demos, predictor.signature.instructions

    def score(self, program: Any, split: list[Any]) -> dict[str, float]:
        demos, instruction = self.program_parts(program)
        ids = [self.index[e.question] for e in split]
        return {"expected": statistics.fmean(self.probability(demos, instruction, i) for i in ids),
                "realised": statistics.fmean(float(self.correct(demos, instruction, i)) for i in ids)}


def metric(example: Any, pred: Any, trace: Any = None) -> float:
    return float(example.answer == pred.answer)


# -------------------------------------------------------------------------------- methods
def _pruned_programs(search_stage: Any) -> list[Any]:
    return list(_CAPTURED.get(id(search_stage), {}).get("pruned", []))


_CAPTURED: dict[int, dict[str, Any]] = {}


def _capturing_search(**settings: Any) -> Any:
    """A RandomSearch that also hands the benchmark the programs it pruned (to measure pruner errors)."""
    from optuna.trial import TrialState

    from flowopt.optimizers.search import RandomSearch

    class CapturingSearch(RandomSearch):
        def _race(self, study: Any, asked: list[Any], order: list[Any], ends: list[int], ctx: Any) -> None:
            super()._race(study, asked, order, ends, ctx)
            states = {t.number: t.state for t in study.get_trials(deepcopy=False)}
            store = _CAPTURED.setdefault(id(self), {"pruned": []})
            store["pruned"].extend(p for t, p in asked if states.get(t.number) == TrialState.PRUNED)

    return CapturingSearch(**settings)


def run_method(name: str, task: Task, args: argparse.Namespace, bfrs8_calls: int | None) -> dict[str, Any]:
    import flowopt
    from flowopt import Budget

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
            budget = None
            if name == "flowopt8":
                search = _capturing_search(n_candidates=11)
                stages: Any = ["demos", search]
            elif name == "flowopt8_extra0":
                search = _capturing_search(n_candidates=11, extra=0)
                stages = ["demos", search]
            elif name == "flowopt8_none":
                stages = ["demos", ("search", {"n_candidates": 11, "extra": 0, "pruner": "none"})]
            elif name == "flowopt_at_bfrs8_calls":
                search = _capturing_search(n_candidates=11, max_extra=64)
                stages, budget = ["demos", search], Budget(max_lm_calls=bfrs8_calls)
            elif name == "flowopt_defaults":
                search = _capturing_search()
                stages = ["demos", search]  # compile()'s default stages, with the search's default settings
            elif name == "mipro_stage":
                stages = [("mipro", {"auto": "light"})]
            elif name == "gepa_stage":
                stages, budget = [("gepa", {})], Budget(max_lm_calls=bfrs8_calls)
            else:
                raise ValueError(name)
            out = flowopt.compile(student, task.train, metric, valset=task.val, stages=stages, budget=budget,
                                  seed=task.seed, num_threads=args.threads, quiet=True)
            info = {"report": {s.name: {"score": s.score, "lm_calls": s.lm_calls, "candidates": s.candidates_tried,
                                        **{k: v for k, v in s.info.items()
                                           if k in ("pruned", "pruned_by_rung", "fully_scored", "extra", "why",
                                                    "best_kind", "stop_reason", "finalists")}}
                               for s in out.report.stages}}
    wall = time.perf_counter() - start
    row = {"method": name, "lm_calls": lm.engine.calls, "wall_s": round(wall, 3),
           "test": task.score(out, task.test), "val": task.score(out, task.val), **info}
    if search is not None:
        returned = row["val"]["realised"]
        pruned_vals = [task.score(p, task.val)["realised"] for p in _pruned_programs(search)]
        row["pruned_full_val"] = pruned_vals
        row["pruner_error"] = any(v > returned + 1e-12 for v in pruned_vals)
        _CAPTURED.pop(id(search), None)
    return row


def run_seed(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    logging.disable(logging.WARNING)
    task = Task(seed)
    rows = {"bfrs8": run_method("bfrs8", task, args, None)}
    calls = rows["bfrs8"]["lm_calls"]
    for name in args.methods:
        if name != "bfrs8":
            rows[name] = run_method(name, task, args, calls)
    return {"seed": seed, "shape": task.shape, "rows": rows}


# -------------------------------------------------------------------------------- summary
def _ci(values: list[float]) -> tuple[float, float, float]:
    from scipy.stats import t

    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, mean, mean
    half = t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def summarise(seeds: list[dict[str, Any]], methods: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    base = [s["rows"]["bfrs8"] for s in seeds]
    for name in methods:
        rows = [s["rows"][name] for s in seeds]
        diffs = [r["test"]["expected"] - b["test"]["expected"] for r, b in zip(rows, base)]
        rdiffs = [r["test"]["realised"] - b["test"]["realised"] for r, b in zip(rows, base)]
        mean, lo, hi = _ci(diffs)
        rmean, rlo, rhi = _ci(rdiffs)
        entry = {
            "test_expected": statistics.fmean(r["test"]["expected"] for r in rows),
            "test_realised": statistics.fmean(r["test"]["realised"] for r in rows),
            "val_realised": statistics.fmean(r["val"]["realised"] for r in rows),
            "diff_expected": [mean, lo, hi], "diff_realised": [rmean, rlo, rhi],
            "better": sum(d > 1e-12 for d in diffs), "worse": sum(d < -1e-12 for d in diffs),
            "lm_calls": statistics.fmean(r["lm_calls"] for r in rows),
            "calls_ratio": statistics.fmean(r["lm_calls"] / b["lm_calls"] for r, b in zip(rows, base)),
            "wall_s": statistics.fmean(r["wall_s"] for r in rows),
            "wall_ratio": statistics.fmean(r["wall_s"] / b["wall_s"] for r, b in zip(rows, base)),
        }
        errors = [r["pruner_error"] for r in rows if "pruner_error" in r]
        if errors:
            entry["pruner_error_runs"] = [sum(errors), len(errors)]
            entry["pruned_candidates"] = sum(len(r["pruned_full_val"]) for r in rows)
        out[name] = entry
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=30)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--latency", type=float, default=0.005)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    parser.add_argument("--render-only", action="store_true", help="rewrite the .md from the .json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.render_only:
        payload = json.loads((args.out / "search_generalisation.json").read_text())
        methods = list(payload["summary"])
        (args.out / "search_generalisation.md").write_text(render(payload, methods, args))
        return
    log = logging.getLogger("search_generalisation")
    methods = ["bfrs8", *[m for m in args.methods if m != "bfrs8"]]
    args.methods = methods
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    load_before = os.getloadavg()
    start = time.perf_counter()
    results = []
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        for res in pool.map(run_seed, seeds, [args] * len(seeds)):
            results.append(res)
            log.info("seed %d (%s): %s", res["seed"], res["shape"], {k: round(v["test"]["expected"], 3)
                                                                    for k, v in res["rows"].items()})
            # Written after every seed, so an interrupted run still leaves its seeds so far.
            write(results, methods, args, load_before, time.perf_counter() - start)
    log.info("%s", (args.out / "search_generalisation.md").read_text())


def write(results: list[dict[str, Any]], methods: list[str], args: argparse.Namespace,
          load_before: tuple[float, float, float], total: float) -> None:
    summary = summarise(results, methods)
    machine = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
               "dspy": dspy.__version__, "load_before": load_before, "load_after": os.getloadavg()}
    command = (f"nice -n 10 .venv/bin/python benchmarks/perf/search_generalisation.py --seeds {args.seeds} "
               f"--first-seed {args.first_seed} --workers {args.workers} --threads {args.threads} "
               f"--latency {args.latency}" + ("" if methods == ["bfrs8", *METHODS[1:]] else
                                              " --methods " + " ".join(methods)))
    compact = [{"seed": r["seed"], "shape": r["shape"],
                "rows": {k: {"lm_calls": v["lm_calls"], "wall_s": v["wall_s"],
                             "test": {m: round(x, 4) for m, x in v["test"].items()},
                             "val": {m: round(x, 4) for m, x in v["val"].items()},
                             **({"pruner_error": v["pruner_error"], "pruned": len(v["pruned_full_val"])}
                                if "pruner_error" in v else {}),
                             **({"search": v["report"].get("search")} if "report" in v and "search" in v["report"]
                                else {})}
                         for k, v in r["rows"].items()}} for r in sorted(results, key=lambda r: r["seed"])]
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"command": command, "machine": machine, "total_wall_s": round(total, 1), "summary": summary,
               "seeds_done": len(results), "seeds_asked": args.seeds, "seeds": compact}
    (args.out / "search_generalisation.json").write_text(json.dumps(payload, indent=1) + "\n")
    (args.out / "search_generalisation.md").write_text(render(payload, methods, args))


def render(payload: dict[str, Any], methods: list[str], args: argparse.Namespace) -> str:
    s, m = payload["summary"], payload["machine"]
    lines = [
        "# Search generalisation: the test score of the program each method picks",
        "",
        f"Command: `{payload['command']}`",
        "",
        f"Machine: {m['platform']}, {m['cpus']} CPUs (shared with other jobs: load average "
        f"{m['load_before'][0]:.1f} before, {m['load_after'][0]:.1f} after), Python {m['python']}, DSPy {m['dspy']}. "
        f"Total {payload['total_wall_s']:.0f} s. Wall times are under that load; LM calls are exact counts.",
        "",
        f"Task family: see the script's docstring. {len(payload['seeds'])} paired seeds of {payload['seeds_asked']} "
        f"asked (shapes rotate: "
        f"{', '.join(SHAPES)}), 60 train / 100 val / 300 held-out test, fake LM with {args.latency * 1000:.0f} ms "
        f"latency, {args.threads} threads, DSPy cache off. Test score = expected accuracy on the 300 test examples "
        "of the returned program (realised accuracy in the JSON). Differences are paired against BFRS(8), mean "
        "and 95% t-interval over seeds.",
        "",
        "| method | test (expected) | vs BFRS(8) [95% CI] | better / worse seeds | LM calls | calls vs BFRS(8) | "
        "wall s | pruner errors (runs) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in methods:
        e = s[name]
        d = e["diff_expected"]
        err = e.get("pruner_error_runs")
        err_text = f"{err[0]}/{err[1]} ({e['pruned_candidates']} pruned)" if err else "-"
        lines.append(f"| {LABELS[name]} | {e['test_expected']:.4f} | {d[0]:+.4f} [{d[1]:+.4f}, {d[2]:+.4f}] | "
                     f"{e['better']} / {e['worse']} | {e['lm_calls']:.0f} | {e['calls_ratio']:.2f}x | "
                     f"{e['wall_s']:.1f} | {err_text} |")
    lines += ["", "Goals (issue 11):", ""]
    if "flowopt8_extra0" in s:
        e = s["flowopt8_extra0"]
        ok = e["diff_expected"][0] >= 0 and e["calls_ratio"] <= 0.5
        lines.append(f"* Same candidates as BFRS(8): mean paired test {e['diff_expected'][0]:+.4f} at "
                     f"{e['calls_ratio']:.2f}x its LM calls (goal: >= 0 at <= 0.5x): {'met' if ok else 'NOT met'}.")
    if "flowopt_at_bfrs8_calls" in s:
        e = s["flowopt_at_bfrs8_calls"]
        ok = e["diff_expected"][1] > 0
        lines.append(f"* At BFRS(8)'s LM calls: {e['diff_expected'][0]:+.4f} [{e['diff_expected'][1]:+.4f}, "
                     f"{e['diff_expected'][2]:+.4f}] (goal: interval above 0): {'met' if ok else 'NOT met'}.")
    errs = [s[k]["pruner_error_runs"] for k in methods if "pruner_error_runs" in s[k]]
    if errs:
        bad, runs = sum(e[0] for e in errs), sum(e[1] for e in errs)
        lines.append(f"* Pruner errors (a pruned candidate's full-valset score above the returned program's): "
                     f"{bad} of {runs} pruning runs. Stated rate: each prune decision is a one-sided test at 5%.")
    lines += ["", *notes(payload)]
    return "\n".join(lines) + "\n"


def notes(payload: dict[str, Any]) -> list[str]:
    """Where flowopt's calls go, pruning per rung, pruner errors with a bound, finalists' effect."""
    from scipy.stats import beta

    out = ["## Notes", ""]
    rows = [sd["rows"] for sd in payload["seeds"]]
    if rows and "flowopt8_extra0" in rows[0]:
        same = [r["flowopt8_extra0"] for r in rows if r["flowopt8_extra0"].get("search")]
        total = statistics.fmean(r["lm_calls"] for r in same)
        search = statistics.fmean(r["search"]["lm_calls"] for r in same)
        rungs: dict[str, list[int]] = {}
        for r in same:
            for end, count in r["search"].get("pruned_by_rung", {}).items():
                rungs.setdefault(end, []).append(count)
        out.append(f"* Where the calls go (BFRS(8)'s candidates, `extra=0`): {total:.0f} calls a run; the search "
                   f"stage {search:.0f} (bootstraps, racing, finalists), the baseline and the demos stage (its "
                   f"bootstrap and its full-valset check) {total - search:.0f}. Pruned per rung (mean a run): "
                   + ", ".join(f"{k}: {statistics.fmean(v):.2f}" for k, v in rungs.items()) + ".")
    runs = [(name, r[name]) for r in rows for name in r if "pruner_error" in r[name]]
    if runs:
        bad = sum(bool(r["pruner_error"]) for _, r in runs)
        upper = beta.ppf(0.95, bad + 1, len(runs) - bad) if bad < len(runs) else 1.0
        out.append(f"* Pruner error: in {bad} of {len(runs)} runs that pruned (all pruning methods pooled) a pruned "
                   f"candidate's full-valset score was above the returned program's (one-sided 95% upper bound "
                   f"{upper:.3f} a run). Each prune decision is a one-sided test at 5% against the leader; the "
                   "finalists' re-scoring on fresh examples may also return a program whose valset score is below "
                   "another's, by design, which counts here as an error too.")
    changed = total_f = 0
    for r in rows:
        for row in r.values():
            fin = (row.get("search") or {}).get("finalists") or []
            if len(fin) > 1:
                total_f += 1
                by_val = max(fin, key=lambda f: (f["val"], -f["candidate"]))["candidate"]
                changed += by_val != max(fin, key=lambda f: (f["combined"], -f["candidate"]))["candidate"]
    if total_f:
        out.append(f"* Winner's curse guard: in {total_f} flowopt runs several finalists could not be told apart on "
                   f"the valset; re-scoring them on unused training examples changed the pick in {changed}.")
    out.append("* BFRS and MIPROv2 run DSPy's own code; `mipro`/`gepa` stages run the same optimizers inside "
               "`compile()` (their extra calls are compile's baseline and final check). DSPy's cache is off for "
               "every method, flowopt's own score memo (same program, same example) stays on.")
    return out


if __name__ == "__main__":
    main()
