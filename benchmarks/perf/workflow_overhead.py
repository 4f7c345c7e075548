"""Workflow vs the same program hand-written as a dspy.Module, on a fake LM with fixed latency.

Run: python benchmarks/perf/workflow_overhead.py [--examples 200] [--latency-ms 20] [--repeats 3]
Writes benchmarks/results/workflow_overhead.{json,md}. Goals (issue 2): chain ratio <= 1.05;
two independent branches ratio <= 0.6 (independent nodes run concurrently).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import dspy

import flowopt
from flowopt.io import atomic_write_json, atomic_write_text
from flowopt.modules import ChainOfThought, Predict
from flowopt.testing import scripted_lm

RESULTS = Path(__file__).resolve().parents[1] / "results"


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


def timed(program, questions) -> float:
    start = time.perf_counter()
    for q in questions:
        program(question=q)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    dspy.configure(lm=scripted_lm(answer, latency_s=args.latency_ms / 1000, cache=False))
    questions = [f"question number {i}" for i in range(args.examples)]
    results = {}
    for name, hand, flow, goal in (("chain (3 nodes)", HandChain(), flow_chain(), 1.05),
                                   ("two branches (4 nodes)", HandBranches(), flow_branches(), 0.6)):
        hand_times, flow_times = [], []
        for _ in range(args.repeats):  # interleaved, so machine noise hits both sides alike
            hand_times.append(timed(hand, questions))
            flow_times.append(timed(flow, questions))
        ratio = statistics.median(flow_times) / statistics.median(hand_times)
        results[name] = {"hand_s": statistics.median(hand_times), "workflow_s": statistics.median(flow_times),
                         "ratio": ratio, "goal": goal, "met": ratio <= goal}
    report = {
        "command": "python benchmarks/perf/workflow_overhead.py " + " ".join(argv or sys.argv[1:]),
        "machine": f"{platform.platform()}, {platform.processor() or platform.machine()}, "
                   f"python {platform.python_version()}",
        "examples": args.examples, "latency_ms": args.latency_ms, "repeats": args.repeats,
        "results": results,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    atomic_write_json(RESULTS / "workflow_overhead.json", report)
    lines = ["# Workflow vs hand-written dspy.Module", "",
             f"Command: `{report['command'].strip()}`  ", f"Machine: {report['machine']}  ",
             f"{args.examples} examples, fake LM with {args.latency_ms:g} ms latency per call, "
             f"median of {args.repeats} interleaved runs.", "",
             "| program | hand-written (s) | Workflow (s) | ratio | goal | met |", "|---|---:|---:|---:|---:|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['hand_s']:.2f} | {r['workflow_s']:.2f} | {r['ratio']:.3f} | "
                     f"<= {r['goal']} | {'yes' if r['met'] else 'no'} |")
    atomic_write_text(RESULTS / "workflow_overhead.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return report


if __name__ == "__main__":
    main()
