"""The results of ``structure_search_sim``: its goals and its page.
"""

from __future__ import annotations

from typing import Any

from flowopt.benchmarks.perf.harness import Goal, markdown_table
from flowopt.benchmarks.perf.structure_sim_world import (
    MAX_NODES,
    describe_structure,
)

METHODS = ("search", "random_walk", "hill_climb")
RANDOM_WALK_GOAL = ("deceptive", "additive")
DESIGN_SEEDS = {"noisy": "0-119 (19/20 on 0-19 and 93/100 on 20-119 with these settings)."}


def goals(families: dict[str, Any]) -> list[Goal]:
    """The run's goals, per family: the optimum found, enough seeds, fewer evaluations than the baselines."""
    out = []
    for name, fam in families.items():
        summ = fam["summary"]
        if "search" not in summ:
            continue
        search = summ["search"]
        out.append(Goal.at_least(f"{name}: share of seeds the search returns the optimum",
                                   round(search["returned_optimum"] / search["runs"], 3), 0.9))
        ran = {m: summ[m]["runs"] for m in METHODS if m in summ}
        out.append(Goal.at_least(f"{name}: seeds of the method with fewest ({min(ran, key=ran.__getitem__)})",
                                   min(ran.values()), 20))
        if "search_over_hill_climb" in summ:
            out.append(Goal.at_most(f"{name}: search / hill climbing, median evals to optimum",
                                      summ["search_over_hill_climb"], 1.2))
        if name in RANDOM_WALK_GOAL and "search_over_random_walk" in summ:
            out.append(Goal.at_most(f"{name}: search / random walk, median evals to optimum",
                                      summ["search_over_random_walk"], 0.5))
        if fam.get("settings", {}).get("final_top") and "covered" in search:
            out.append(Goal.at_least(f"{name}: true score inside the reported 95% interval",
                                       round(search["covered"] / search["runs"], 3), 0.9))
    return out


def markdown(data: dict[str, Any], all_families: dict[str, Any]) -> list[str]:
    """The results page: per family, the methods' evaluations to the optimum, and the checks."""
    lines = []
    for part in data["parts"]:
        load = part["load_average"]
        lines.append(f"- part `{part['command']}`: " + (f"load average {load['before']} before, {load['after']} "
                                                          f"after, {part['wall_s']} s" if load["before"] else
                                                          "its load was not recorded (see the load of this merge)"))
    if data["parts"]:
        lines.append("")
    lines += [
        "Counts, not times, are the result. Methods, side by side on every family and seed, from the same "
        "start with the same rule proposer and one shared evaluation function: `search` = `MCTS` with the "
        "stage's defaults (selection `auto`: an iterated local search, a first-improvement climb, and at a local "
        "optimum a restart from a random open workflow nearest the best one; on the noisy family `confirm=3` (a "
        "node is measured 3 times before it is expanded, so `auto` searches best-first: the highest upper 95% "
        "bound), at most 60 new candidates explored, and the rest of the budget a race of the 10 leaders on "
        "fresh samples (3 measurements each, then the leader against its strongest challenger, ranked by all "
        "of a finalist's measurements, the interval from the fresh ones alone); on "
        "the cost family `objective=\"penalised\"`); `random_walk` = a uniformly random valid edit at each step; "
        "`hill_climb` = steepest ascent with random restarts. An evaluation is one evaluator call (the search's "
        "final re-measurements included). Deterministic families stop a run once the optimum is scored (the "
        "best scored is what every method returns, so from then on it is returned); a run that never scores "
        "it counts as its budget + 1 evaluations (so a median above the budget means fewer than half the runs "
        "found it, and a ratio to it is an upper bound).",
        "",
    ]
    if data["space"]:
        sp = data["space"]
        lines += [f"Needle/cost space: **{sp['size']} workflows** reachable from `Predict` with at most {MAX_NODES} "
                  f"nodes (enumerated; workflows by edits from `Predict`: {sp['depth_histogram']}).", ""]
    for name, fam in data["families"].items():
        summ = fam["summary"]
        start = fam.get("start") or describe_structure(all_families[name]().start().to_dict())
        deep = (f" ({fam['optimal_workflows']} optimal workflows, the nearest {fam['optimal_depth']} edits from "
                f"the start `{start}`: `{fam['optimal_structure']}`; runner-up {fam['runner_up']})"
                if "optimal_depth" in fam else "")
        optimum = "not recorded (its process was stopped before it wrote its results)" if fam["optimum"] is None \
            else round(fam["optimum"], 6)
        seeds = sorted({r["seed"] for r in fam["runs"]})
        design = (f" The search's settings for this family were chosen on seeds {DESIGN_SEEDS[name]}"
                  if name in DESIGN_SEEDS else "")
        lines += [f"## {name}", "", f"{fam['description']}. Budget {fam['max_evals']} evaluations; optimum "
                  f"{optimum}{deep}. Seeds {seed_ranges(seeds)}.{design}", ""]
        costs = any("median_lm_calls" in m for m in summ.values() if isinstance(m, dict))
        rows = []
        for method in [m for m in METHODS if m in summ]:
            m = summ[method]
            rows.append([method, m.get("budget", fam["max_evals"]), f"{m['scored_optimum']}/{m['runs']}",
                         f"{m['returned_optimum']}/{m['runs']}", m["median_evals_to_optimum"],
                         m["mean_returned_true"], m["median_evaluations"]] + ([m["median_lm_calls"]] if costs else []))
        lines += markdown_table(["method", "budget", "scored the optimum", "returned it", "median evals to optimum",
                                 "mean true score returned", "median evaluations used"]
                                + (["median LM calls"] if costs else []), rows, align="lrrrrrr" + "r" * costs)
        if "search_over_random_walk" in summ:
            lines += ["", f"search / random walk median evals to optimum: **{summ['search_over_random_walk']}**; "
                          f"search / hill climbing: **{summ['search_over_hill_climb']}**."]
        if fam.get("settings", {}).get("final_top") and "search" in summ:
            s = summ["search"]
            lines += ["", f"Returned workflow's true score inside its reported 95% interval (from the "
                          f"re-measurement on fresh samples): **{s['covered']}/{s['runs']}**; median re-measured "
                          f"minus true {s['median_measured_minus_true']}."]
        lines.append("")
    return lines


def seed_ranges(seeds: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    spans: list[list[int]] = []
    for seed in seeds:
        if spans and seed == spans[-1][1] + 1:
            spans[-1][1] = seed
        else:
            spans.append([seed, seed])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)

