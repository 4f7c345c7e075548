"""Before/after A/B of a throughput script: two code versions alternated over several runs, paired inside each.

Run (``{out}`` becomes a temporary file stem, ``{python}`` this interpreter; here both sides run this
tree's ``lm_throughput`` script, the before side importing an older checkout's packages through an overlay
folder on ``PYTHONPATH``, since a script must record its rounds, not only their medians):

    nice -n -10 python -m flowopt.benchmarks.perf.runtime_ab --measure lm --alternations 4 \\
      --before "cd /tmp && PYTHONPATH=/tmp/overlay-before python -m flowopt.benchmarks.perf.lm_throughput \\
                --tokens 24 --repeats 2 --torch-threads 1 --out {out}" \\
      --after "cd /tmp && PYTHONPATH=/tmp/overlay-after python -m flowopt.benchmarks.perf.lm_throughput \\
               --tokens 24 --repeats 2 --torch-threads 1 --out {out}"

Each run is a fresh process (the two versions are different checkouts and cannot share one), and the sides
alternate as before, after, after, before, before, after, ... so a drift in the machine's load falls on
both. A run's statistic is computed per round from quantities measured side by side *inside* that round,
which cancels most of the machine's speed at that moment:

- ``lm``: LocalLM batch-1 overhead against the raw ``model.generate`` loop of the same round
  (``raw tokens/s / LocalLM tokens/s - 1``), and 8 concurrent callers against batch 1 (tokens/s ratio);
- ``grpo``: TRL's median step time over flowopt's in the same round (``> 1``: flowopt is faster), for
  the token-level step and the whole stage.

Each side's rounds are pooled and reported as a median with a 95% percentile-bootstrap interval, and the
after-minus-before difference of the medians with its own bootstrap interval. The results JSON a run
writes may be the harness schema (``results`` inside) or the pre-harness flat one; both are read.
"""

from __future__ import annotations

import logging
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from flowopt.benchmarks.perf.harness import Goal, PerfParser, load_average, markdown_table, setup_logging, start_run
from flowopt.errors import ConfigError, DataError

logger = logging.getLogger(__name__)
SIDES = ("before", "after")
SMOKE = {"alternations": 1, "measure": "grpo", "resamples": 200}
# Per measure: the current tree's smoke command (the default for both sides: a self-A/B that checks the
# script runs), and the statistics read per round from a run's results.
DEFAULT_COMMANDS = {"lm": "{python} -m flowopt.benchmarks.perf.lm_throughput --smoke --out {out}",
                    "grpo": "{python} -m flowopt.benchmarks.perf.grpo_throughput --smoke --out {out}"}


def lm_rounds(payload: dict[str, Any]) -> dict[str, list[float]]:
    """Per-round batch-1 overhead vs raw generate, 8-caller speedup and raw tokens/s of an lm_throughput run.

    Example:
        >>> lm_rounds({"seconds": {"raw": [2.0], "local_batch1": [2.2], "local_8_callers": [0.5]},
        ...            "tokens_generated": {"raw": [10], "local_batch1": [10], "local_8_callers": [10]}})
        {'batch1_overhead': [0.1], 'speedup_8_callers': [4.4], 'raw_tokens_per_s': [5.0]}
    """
    r = payload.get("results", payload)
    if "seconds" not in r:
        raise DataError("the lm run's results hold no per-round seconds (a pre-harness lm_throughput.py "
                        "records medians only)", fix="run this tree's lm_throughput script against the older code")
    rate = {k: [n / s for n, s in zip(r["tokens_generated"][k], r["seconds"][k])] for k in r["seconds"]}
    return {"batch1_overhead": [round(raw / one - 1, 6) for raw, one in zip(rate["raw"], rate["local_batch1"])],
            "speedup_8_callers": [round(many / one, 6) for many, one in zip(rate["local_8_callers"],
                                                                            rate["local_batch1"])],
            "raw_tokens_per_s": [round(v, 4) for v in rate["raw"]]}


def grpo_rounds(payload: dict[str, Any]) -> dict[str, list[float]]:
    """Per-round TRL-over-flowopt step-time ratios (``> 1``: flowopt faster) of a grpo_throughput run.

    Example:
        >>> grpo_rounds({"results": {"runs": {"flowopt": {"runs_median_step_s": [0.1]},
        ...                                    "trl-nockpt": {"runs_median_step_s": [0.15]}}}})
        {'flowopt_vs_trl': [1.5], 'flowopt_step_s': [0.1]}
    """
    r = payload["results"]
    runs = r.get("runs", r)  # the harness nests the implementations under "runs"
    trl = runs["trl-nockpt"]["runs_median_step_s"]
    out = {"flowopt_vs_trl": [round(t / f, 6) for f, t in zip(runs["flowopt"]["runs_median_step_s"], trl)],
           "flowopt_step_s": list(runs["flowopt"]["runs_median_step_s"])}
    if "stage" in runs:
        out["stage_vs_trl"] = [round(t / s, 6) for s, t in zip(runs["stage"]["runs_median_step_s"], trl)]
    return out


MEASURES: dict[str, Callable[[dict[str, Any]], dict[str, list[float]]]] = {"lm": lm_rounds, "grpo": grpo_rounds}
# The statistic each goal reads, and which direction is better.
HEADLINE = {"lm": [("batch1_overhead", "lower"), ("speedup_8_callers", "higher")],
            "grpo": [("flowopt_vs_trl", "higher"), ("stage_vs_trl", "higher")]}


def bootstrap_median(values: Sequence[float], resamples: int, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the median of ``values``.

    Example:
        >>> low, high = bootstrap_median([1.0, 2.0, 3.0, 4.0, 5.0], resamples=500)
        >>> 1.0 <= low <= 3.0 <= high <= 5.0
        True
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    data = np.asarray(values, dtype=float)
    medians = np.median(rng.choice(data, size=(resamples, len(data)), replace=True), axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return float(low), float(high)


def bootstrap_difference(after: Sequence[float], before: Sequence[float], resamples: int,
                         seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of ``median(after) - median(before)`` (the sides resampled apart).

    Example:
        >>> low, high = bootstrap_difference([2.0, 2.1, 2.2], [1.0, 1.1, 1.2], resamples=500)
        >>> 0.79 <= low <= high <= 1.21  # the differences of medians lie in [0.8, 1.2], up to rounding
        True
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    a, b = np.asarray(after, dtype=float), np.asarray(before, dtype=float)
    diffs = (np.median(rng.choice(a, size=(resamples, len(a))), axis=1)
             - np.median(rng.choice(b, size=(resamples, len(b))), axis=1))
    low, high = np.percentile(diffs, [2.5, 97.5])
    return float(low), float(high)


def run_order(alternations: int) -> list[str]:
    """The sides in run order: before, after, after, before, before, after, ...

    Example:
        >>> run_order(2)
        ['before', 'after', 'after', 'before']
    """
    order: list[str] = []
    for i in range(alternations):
        order += list(SIDES) if i % 2 == 0 else list(reversed(SIDES))
    return order


def run_once(command: str, stem: Path) -> dict[str, Any]:
    """Run one side's command with ``{out}`` set to ``stem``; return its results JSON."""
    import json

    # Plain replacement, not str.format: a shell command may hold braces of its own.
    line = command.replace("{out}", shlex.quote(str(stem))).replace("{python}", shlex.quote(sys.executable))
    done = subprocess.run(line, shell=True, capture_output=True, text=True)
    if done.returncode != 0:
        raise DataError(f"the A/B run failed (exit {done.returncode}): {line}\n{done.stderr[-3000:]}",
                        fix="run that command alone and fix what it reports")
    path = stem.parent / (stem.name + ".json")
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError) as err:
        raise DataError(f"the A/B run wrote no readable {path}: {err}",
                        fix="the command must write its results JSON to the {out} stem") from err


def summarise(per_side: dict[str, dict[str, list[float]]], resamples: int) -> dict[str, Any]:
    """Median, 95% interval and n per side and statistic, and the after-minus-before difference."""
    out: dict[str, Any] = {}
    for stat in per_side["after"]:
        before, after = per_side["before"].get(stat, []), per_side["after"][stat]
        if not before:
            continue
        entry: dict[str, Any] = {}
        for side, values in (("before", before), ("after", after)):
            low, high = bootstrap_median(values, resamples)
            entry[side] = {"median": round(statistics.median(values), 4), "ci95": [round(low, 4), round(high, 4)],
                           "n": len(values)}
        low, high = bootstrap_difference(after, before, resamples)
        entry["after_minus_before"] = {"median": round(statistics.median(after) - statistics.median(before), 4),
                                       "ci95": [round(low, 4), round(high, 4)]}
        out[stat] = entry
    return out


def main(argv: list[str] | None = None) -> int:
    parser = PerfParser("runtime_ab", __doc__, smoke=SMOKE)
    parser.add_argument("--measure", choices=sorted(MEASURES), default="lm")
    parser.add_argument("--before", default="", help="shell command of the earlier version ({out}, {python})")
    parser.add_argument("--after", default="", help="shell command of the later version ({out}, {python})")
    parser.add_argument("--alternations", type=int, default=4, help="runs of each side")
    parser.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples")
    run = start_run(parser, argv)
    args = run.args
    if args.alternations < 1:
        raise ConfigError(f"--alternations must be >= 1, got {args.alternations}", fix="pass --alternations 4")
    commands = {side: getattr(args, side) or DEFAULT_COMMANDS[args.measure] for side in SIDES}
    for side, command in commands.items():
        if "{out}" not in command:
            raise ConfigError(f"--{side} has no {{out}}: the A/B cannot find the run's results",
                              fix="end the command with --out {out} (or --out-name {out} for older scripts)")
    rounds_of = MEASURES[args.measure]
    per_side: dict[str, dict[str, list[float]]] = {side: {} for side in SIDES}
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="runtime_ab_") as folder:
        for index, side in enumerate(run_order(args.alternations)):
            load, began = load_average(), time.perf_counter()
            started = time.strftime("%H:%M:%S", time.gmtime())
            payload = run_once(commands[side], Path(folder) / f"run{index}_{side}")
            rounds = rounds_of(payload)
            runs.append({"index": index, "side": side, "started_utc": started, "load_before": load,
                         "load_after": load_average(), "wall_s": round(time.perf_counter() - began, 1),
                         "rounds": rounds})
            for stat, values in rounds.items():
                per_side[side].setdefault(stat, []).extend(values)
            logger.info("run %d (%s, load %.1f): %s", index, side, load[0], rounds)
    summary = summarise(per_side, args.resamples)
    rows = []
    for stat, entry in summary.items():
        b, a, d = entry["before"], entry["after"], entry["after_minus_before"]
        rows.append([stat, f"{b['median']} [{b['ci95'][0]}, {b['ci95'][1]}] (n={b['n']})",
                     f"{a['median']} [{a['ci95'][0]}, {a['ci95'][1]}] (n={a['n']})",
                     f"{d['median']:+} [{d['ci95'][0]:+}, {d['ci95'][1]:+}]"])
    run_rows = [[r["index"], r["side"], r["started_utc"], f"{r['load_before'][0]:.2f} -> {r['load_after'][0]:.2f}",
                 r["wall_s"], "; ".join(f"{k} " + ", ".join(f"{v:.3f}" for v in values)
                                        for k, values in r["rounds"].items())]
                for r in runs]
    body = ["Commands (`{out}` a temporary stem, `{python}` this interpreter):", "",
            *(f"- {side}: `{commands[side]}`" for side in SIDES), "",
            f"{args.alternations} runs of each side, alternated; statistics per round, paired inside the round; "
            "median [95% bootstrap interval] over each side's rounds.", "",
            *markdown_table(["statistic", "before", "after", "after - before"], rows, align="lrrr"), "",
            "Runs:", "", *markdown_table(["#", "side", "start (UTC)", "1-min load", "wall s", "per-round values"],
                                         run_rows, align="rllrrl")]
    goals = []
    for stat, better in HEADLINE[args.measure]:
        if stat not in summary:
            continue
        low, high = summary[stat]["after_minus_before"]["ci95"]
        # "No worse within noise": the interval of the difference reaches the side of no change or better.
        goals.append(Goal.at_most(f"{stat}: after - before, lower 95% bound", low, 0.0) if better == "lower"
                     else Goal.at_least(f"{stat}: after - before, upper 95% bound", high, 0.0))
    run.finish(f"Before/after A/B ({args.measure}), {args.alternations} alternations",
               {"measure": args.measure, "commands": commands, "summary": summary, "runs": runs,
                "nice": os.nice(0)}, body, goals=goals)
    return 0


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(main())
