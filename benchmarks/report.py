"""``flowopt bench`` reports: the markdown tables and the score plots, from ``results.json``'s content.

Example:
    >>> row = {"name": "baseline", "status": "ok", "kept": True, "lm_calls": 0, "wall_s": 1.0, "cpu_s": 1.0,
    ...        "test": {"score": 0.5, "ci": [0.3, 0.7], "n": 4, "errors": 1, "strict": {}}}
    >>> results = {"protocol": "gsm8k-aflow", "stages": [row], "splits": {"metric": "gsm8k_aflow",
    ...            "report_split": "test", "test": 4, "strict_metrics": []},
    ...            "test": {"change": {"mean": 0.0, "ci": [0.0, 0.0], "n": 4}}}
    >>> "| baseline | ok | 0.500 [0.300, 0.700]" in score_table(results)
    True
"""

from __future__ import annotations

from itertools import accumulate
from pathlib import Path
from typing import Any


def _cell(r: dict[str, Any] | None) -> str:
    return "—" if r is None else f"{r['score']:.3f} [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]"


def _status(row: dict[str, Any]) -> str:
    if row.get("error"):
        return f"{row['status']}: {row['error'][:80]}"
    reason = row.get("stop_reason")
    return f"{row['status']} ({reason[:60]})" if reason and reason != "done" else row["status"]


def _change(own: dict[str, Any] | None) -> str:
    if own is None:
        return "—"
    change = own["change"]
    return f"{change['mean']:+.3f} [{change['ci'][0]:+.3f}, {change['ci'][1]:+.3f}]"


def score_table(results: dict[str, Any]) -> str:
    """One row per stage: status, test score of the best program so far with its 95% interval (reference
    metric, then the strict ones), failed examples (the program raised, e.g. an unparseable answer:
    scored 0), whether the stage's output was kept, the stage's own output's test score (kept or not)
    and its paired change against the program the stage started from, compile LM calls (cumulative),
    wall and CPU seconds; then the paired change of the last row against the baseline."""
    split = results["splits"]
    strict = split.get("strict_metrics", [])
    head = ["stage", "status", f"test {split['metric']} [95% CI]", *(f"{m} (strict)" for m in strict),
            "failed examples", "kept", "stage's own output [95% CI]", "own vs its input (paired)",
            "LM calls (cumulative)", "wall s", "CPU s"]
    lines = [f"Report split: {results['protocol']} {split['report_split']} ({split['test']} examples); "
             f"reference metric `{split['metric']}`.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    cumulative = accumulate(row.get("lm_calls", 0) for row in results["stages"])
    for row, calls in zip(results["stages"], cumulative):
        test = row.get("test")
        cells = [row["name"], _status(row),
                 _cell(test), *(_cell((test or {}).get("strict", {}).get(m)) for m in strict),
                 f"{test['errors']}/{test['n']}" if test else "—", "yes" if row.get("kept") else "no",
                 _cell(row.get("own")), _change(row.get("own")), str(calls),
                 f"{row.get('wall_s', 0):.0f}", f"{row.get('cpu_s', 0):.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    change = results["test"]["change"]
    lines += ["", f"Change of the last row against the baseline (paired, same {change['n']} examples): "
                  f"{change['mean']:+.3f} [{change['ci'][0]:+.3f}, {change['ci'][1]:+.3f}] (95% interval)."]
    return "\n".join(lines) + "\n"


def markdown(results: dict[str, Any]) -> str:
    cfg = results["config"]
    state = "finished" if results.get("status") == "done" else "in progress (rows so far)"
    return "\n".join([
        f"# flowopt bench {results['protocol']}", "",
        f"LM `{cfg['lm']}`, program `{cfg['program']}`, stages `{cfg['stages']}`, seed {cfg['seed']}, "
        f"train {results['splits']['train']}, dev {results['splits']['dev']}, max tokens {cfg['max_tokens']}, "
        f"threads {cfg['threads']}{_stage_limits(cfg)}.  ",
        f"Machine: {results['machine']}. Run {state}: wall {results.get('wall_s', 0):.0f} s, "
        f"CPU {results.get('cpu_s', 0):.0f} s.", "",
        score_table(results),
        "A stage's output is kept only if it beats the program before it on the dev split "
        "(validation scores in results.json); each row's test score is the best program so far. A stage's "
        "own output is scored too, kept or not, so every layer's contribution shows: its change is paired "
        "against the program the stage started from.", "",
    ])


def _stage_limits(cfg: dict[str, Any]) -> str:
    """The demo, candidate and structure-round limits the command set (older results lack the keys)."""
    named = {"demos": "demos", "rounds": "structure rounds", "candidates": "candidates"}
    stages = str(cfg.get("stages", ""))
    shown = [f"{label} {cfg[key]}" for key, label in named.items() if cfg.get(key) is not None
             and (key != "candidates" or "search" in stages)]
    return "".join(f", {item}" for item in shown)


def plot_scores(results: dict[str, Any], path: Path) -> None:
    """Test score per stage (failed stages drawn red and hatched, at the score of the program kept; a
    rejected stage's own output as a red cross) and test score against cumulative compile LM calls."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    rows = results["stages"]
    names = [r["name"] for r in rows]
    scores = [r["test"]["score"] for r in rows]
    lows = [r["test"]["score"] - r["test"]["ci"][0] for r in rows]
    highs = [r["test"]["ci"][1] - r["test"]["score"] for r in rows]
    failed = [r["status"] == "failed" for r in rows]
    cost = list(accumulate(r.get("lm_calls", 0) for r in rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    bars = left.bar(names, scores, yerr=[lows, highs], capsize=4,
                    color=["#e06666" if f else "#4a86e8" for f in failed])
    for bar, f in zip(bars, failed):
        if f:
            bar.set_hatch("//")
            left.annotate("failed", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                          xytext=(0, 12), textcoords="offset points", fontsize=8, color="#cc0000")
    metric = results["splits"]["metric"]
    left.set_ylabel(f"test {metric}")
    left.set_title("score per stage (95% CI)")
    left.set_ylim(0, 1)
    rejected = [(i, r["own"]["score"]) for i, r in enumerate(rows) if r.get("own") and not r.get("kept")]
    if rejected:
        left.scatter([i for i, _ in rejected], [y for _, y in rejected], marker="x", color="#cc0000", zorder=3,
                     label="rejected stage's own output")
        left.legend(fontsize=8, loc="upper left")
    right.plot(cost, scores, marker="o")
    for name, x, y in zip(names, cost, scores):
        right.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    right.set_xlabel("cumulative compile LM calls")
    right.set_ylabel(f"test {metric}")
    right.set_title("score against cost")
    fig.suptitle(f"{results['protocol']} ({results['config']['lm']}, {results['config']['program']})")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
