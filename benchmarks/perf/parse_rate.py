"""Parse-success rate of Gemma 3 270M (base) on GSM8K: DSPy's ChatAdapter vs flowopt's CompletionAdapter.

Run: python benchmarks/perf/parse_rate.py [--questions 50] [--max-tokens 128] [--threads 8]
Writes benchmarks/results/parse_rate.{json,md}.

A call "parses" when the module returns a prediction with every output field filled, after the
adapter's own recovery: DSPy's ChatAdapter retries with its JSONAdapter fallback, the completion
adapter continues the document with the missing field's label. Both run zero-shot on the first N
questions of the GSM8K test split, greedy, through the same LocalLM (DSPy cache off, so every call is
generated). Accuracy (the answer's number equals the reference) is reported too, for context: a base
270M model is not expected to solve GSM8K.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import dspy

from flowopt.lm import CompletionAdapter, LocalLM

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
DATA = [ROOT / "benchmarks" / "data" / "gsm8k" / "test.jsonl", Path("/work/shared/data/gsm8k/test.jsonl")]
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def load_questions(count: int) -> list[dict[str, str]]:
    path = next((p for p in DATA if p.is_file()), None)
    if path is None:
        sys.exit(f"GSM8K test split not found in {[str(p) for p in DATA]}")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"question": r["question"], "gold": r["answer"].split("####")[-1].strip().replace(",", "")}
            for r in rows[:count]]


def numbers_match(answer: str, gold: str) -> bool:
    found = _NUMBER.findall(str(answer))
    if not found:
        return False
    try:
        return abs(float(found[-1].replace(",", "")) - float(gold)) < 1e-6
    except ValueError:
        return False


def run_config(lm: dspy.LM, adapter: dspy.Adapter, module_name: str, questions: list[dict[str, str]],
               threads: int) -> dict:
    module = dspy.Predict("question -> answer") if module_name == "Predict" else dspy.ChainOfThought(
        "question -> answer")
    start_history = len(lm.history)

    def one(row: dict[str, str]) -> dict:
        with dspy.context(lm=lm, adapter=adapter):
            try:
                prediction = module(question=row["question"])
            except Exception as exc:  # AdapterParseError after the adapter's own recovery
                return {"parsed": False, "error": type(exc).__name__, "correct": False}
        values = prediction.toDict()
        parsed = all(v not in (None, "") for v in values.values())
        return {"parsed": parsed, "correct": parsed and numbers_match(values.get("answer", ""), row["gold"]),
                "answer": str(values.get("answer", ""))[:80]}

    began = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        outcomes = list(pool.map(one, questions))
    wall = time.perf_counter() - began
    calls = lm.history[start_history:]
    return {
        "adapter": type(adapter).__name__, "module": module_name, "questions": len(questions),
        "parsed": sum(o["parsed"] for o in outcomes), "correct": sum(o["correct"] for o in outcomes),
        "lm_calls": len(calls), "completion_tokens": sum((c.get("usage") or {}).get("completion_tokens") or 0
                                                         for c in calls),
        "wall_s": round(wall, 1), "examples": outcomes[:5],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="torch intra-op threads (0: torch's default). On a CPU shared with other jobs, 1 is "
                             "several times faster than 2: OpenMP threads stall each other when descheduled")
    parser.add_argument("--out", type=Path, default=RESULTS / "parse_rate")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    questions = load_questions(args.questions)
    load_began = time.perf_counter()
    local = LocalLM("gemma-3-270m", max_new_tokens=args.max_tokens, max_batch_size=args.threads)
    load_s = time.perf_counter() - load_began
    lm = local.lm.copy(temperature=0.0, max_tokens=args.max_tokens, cache=False)
    results = []
    for adapter in (dspy.ChatAdapter(), CompletionAdapter()):
        for module_name in ("Predict", "ChainOfThought"):
            result = run_config(lm, adapter, module_name, questions, args.threads)
            logging.warning("%s %s: %d/%d parsed, %d correct, %.0fs", result["adapter"], module_name,
                            result["parsed"], result["questions"], result["correct"], result["wall_s"])
            results.append(result)
    import torch
    import transformers

    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
               "torch": torch.__version__, "transformers": transformers.__version__, "dspy": dspy.__version__,
               "torch_threads": torch.get_num_threads(), "device": str(local.device), "dtype": str(local.dtype),
               "model_load_s": round(load_s, 1),
               "load_average_end": os.getloadavg()}
    command = "python benchmarks/perf/parse_rate.py " + " ".join(argv if argv is not None else sys.argv[1:])
    payload = {"command": command.strip(), "machine": machine, "model": "gemma-3-270m (base, Q4_K_M dequantized)",
               "max_tokens": args.max_tokens, "threads": args.threads, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")
    lines = [
        "# Parse-success rate: Gemma 3 270M on GSM8K, ChatAdapter vs CompletionAdapter", "",
        f"Command: `{payload['command']}`", "",
        f"Machine: {machine['platform']}, {machine['cpus']} CPUs (shared with other jobs; load average at the "
        f"end {machine['load_average_end'][0]:.1f}), torch {machine['torch']}, transformers "
        f"{machine['transformers']}, DSPy {machine['dspy']}; {machine['device']} {machine['dtype']}, "
        f"{machine['torch_threads']} torch thread(s).", "",
        f"First {len(questions)} GSM8K test questions, zero-shot, greedy, max_tokens={args.max_tokens}, "
        f"{args.threads} threads (dynamic batching), DSPy cache off. Parsed = every output field filled after the "
        "adapter's own recovery (ChatAdapter: JSONAdapter fallback; CompletionAdapter: continuation).", "",
        "| adapter | module | parsed | parse rate | correct | LM calls | completion tokens | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['adapter']} | {r['module']} | {r['parsed']}/{r['questions']} | "
                     f"{r['parsed'] / r['questions']:.0%} | {r['correct']} | {r['lm_calls']} | "
                     f"{r['completion_tokens']} | {r['wall_s']} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
