"""The report of ``search_generalisation``: its goals, tables and notes, read from the summary of its seeds."""


from __future__ import annotations

import math
import statistics
from typing import Any

from flowopt.benchmarks.perf.harness import Goal, markdown_table
from flowopt.benchmarks.perf.search_generalisation_methods import (
    ANYTIME,
    DETAILED,
    LABELS,
    SAME_CANDIDATE_VARIANTS,
    SAME_CANDIDATES,
    STATED_ERROR,
    STRATIFIED,
    STRICT_ALPHA,
    default_pruning,
)
from flowopt.benchmarks.perf.search_tasks import SHAPES, mean_ci
from flowopt.optimizers.search.pruning import ALPHA


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
        out.append(f"* The same candidates under other settings (the default, `alpha={ALPHA}`, no finalists: "
                   f"{cost(SAME_CANDIDATES)}; against `alpha={STRICT_ALPHA}`, paired over the seeds: test "
                   f"{mean:+.4f} [{low:+.4f}, {high:+.4f}], the pick's test score differing in "
                   f"{sum(abs(d) > 1e-12 for d in diffs)} of {len(diffs)} seeds, {calls:.3f}x its calls): "
                   + "; ".join(costs)
                   + f". `alpha={STRICT_ALPHA}` halves the chance that each prune decision drops a candidate that "
                   "is not worse, for the calls shown; `finalists=3` adds the winner's-curse re-scoring (the best "
                   "valset mean is biased upward); the first look's floor of 20 examples is not a setting "
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
