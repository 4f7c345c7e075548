"""Workflow vs the same program hand-written as a dspy.Module, on a fake LM with fixed latency.

Run: python -m flowopt.benchmarks.perf.workflow_overhead [--examples 200] [--latency-ms 20] [--repeats 3]
Writes benchmarks/results/workflow_overhead.{json,md} (``--out STEM``). Goals (issue 2): chain ratio
<= 1.05; two independent branches ratio <= 0.6 (independent nodes run concurrently).
"""

from __future__ import annotations

import statistics

import dspy

import flowopt
from flowopt.benchmarks.perf.harness import (
    Goal,
    PerfParser,
    interleaved,
    markdown_table,
    setup_logging,
    spread,
    start_run,
    timed,
)
from flowopt.modules import ChainOfThought, Predict
from flowopt.testing import scripted_lm

SMOKE = {"examples": 4, "latency_ms": 1.0, "repeats": 1}


def answer(request):
    return {name: f"{name} for {len(request.prompt)}" for name in request.output_fields}


class HandChain(dspy.Module):
    def __init__(self):
        super().__init__()
        self.draft = dspy.Predict("question -> draft")
        self.critique = dspy.Predict("question, draft -> critique")
        self.final = dspy.ChainOfThought("question, draft, critique -> answer")

    def forward(self, question):
        draft = self.draft(question=question).draft
        critique = self.critique(question=question, draft=draft).critique
        return self.final(question=question, draft=draft, critique=critique)


class HandBranches(dspy.Module):
    """Two independent two-step branches, written the usual way: one after the other."""

    def __init__(self):
        super().__init__()
        self.plan_a = dspy.Predict("question -> plan_a")
        self.solve_a = dspy.ChainOfThought("question, plan_a -> answer")
        self.plan_b = dspy.Predict("question -> plan_b")
        self.solve_b = dspy.ChainOfThought("question, plan_b -> rationale")

    def forward(self, question):
        a = self.solve_a(question=question, plan_a=self.plan_a(question=question).plan_a).answer
        b = self.solve_b(question=question, plan_b=self.plan_b(question=question).plan_b).rationale
        return dspy.Prediction(answer=a, rationale=b)


def flow_chain() -> flowopt.Workflow:
    return (flowopt.Workflow("question -> answer", name="chain")
            .add("draft", Predict("question -> draft"))
            .add("critique", Predict("question, draft -> critique"))
            .add("final", ChainOfThought("question, draft, critique -> answer")))


def flow_branches() -> flowopt.Workflow:
    return (flowopt.Workflow("question -> answer, rationale", name="branches")
            .add("plan_a", Predict("question -> plan_a"))
            .add("solve_a", ChainOfThought("question, plan_a -> answer"))
            .add("plan_b", Predict("question -> plan_b"))
            .add("solve_b", ChainOfThought("question, plan_b -> rationale")))


def run_all(program, questions) -> float:
    """Seconds to call ``program`` on every question in turn."""
    return timed(lambda: [program(question=q) for q in questions])[1]


def main(argv: list[str] | None = None) -> int:
    parser = PerfParser("workflow_overhead", __doc__, smoke=SMOKE)
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=3)
    run = start_run(parser, argv)
    args = run.args
    dspy.configure(lm=scripted_lm(answer, latency_s=args.latency_ms / 1000, cache=False))
    questions = [f"question number {i}" for i in range(args.examples)]
    results, goals, rows = {}, [], []
    for name, hand, flow, goal in (("chain (3 nodes)", HandChain(), flow_chain(), 1.05),
                                   ("two branches (4 nodes)", HandBranches(), flow_branches(), 0.6)):
        runs = interleaved({"hand": lambda h=hand: run_all(h, questions),
                            "workflow": lambda f=flow: run_all(f, questions)}, args.repeats)
        ratio = statistics.median(runs["workflow"]) / statistics.median(runs["hand"])
        results[name] = {"hand_s": spread(runs["hand"]), "workflow_s": spread(runs["workflow"]),
                         "ratio": round(ratio, 4)}
        goals.append(Goal.at_most(f"{name}: Workflow / hand-written time", round(ratio, 3), goal))
        rows.append([name, f"{results[name]['hand_s']['median']:.2f}", f"{results[name]['workflow_s']['median']:.2f}",
                     f"{ratio:.3f}"])
    body = [f"{args.examples} examples, fake LM with {args.latency_ms:g} ms latency per call, "
            f"median of {args.repeats} interleaved runs.", "",
            *markdown_table(["program", "hand-written (s)", "Workflow (s)", "ratio"], rows, align="lrrr")]
    run.finish("Workflow vs hand-written dspy.Module", results, body, goals=goals)
    return 0


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(main())
