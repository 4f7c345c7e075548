"""Parse-success rate of Gemma 3 270M (base) on GSM8K: DSPy's ChatAdapter vs flowopt's CompletionAdapter.

Run: python -m flowopt.benchmarks.perf.parse_rate [--questions 50] [--max-tokens 128] [--threads 8]
Writes benchmarks/results/parse_rate.{json,md} (``--out STEM``).

A call "parses" when the module returns a prediction with every output field filled, after the
adapter's own recovery: DSPy's ChatAdapter retries with its JSONAdapter fallback, the completion
adapter continues the document with the missing field's label. Both run zero-shot on the first N
questions of the GSM8K test split, greedy, through the same LocalLM (DSPy cache off, so every call is
generated). Accuracy (the answer's number equals the reference) is reported too, for context: a base
270M model is not expected to solve GSM8K.
"""

from __future__ import annotations

import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor

import dspy
from dspy.utils.exceptions import AdapterParseError

from flowopt.benchmarks.perf.harness import PerfParser, markdown_table, setup_logging, start_run
from flowopt.benchmarks.perf.lm_workload import gsm8k_rows
from flowopt.lm import CompletionAdapter, LocalLM

logger = logging.getLogger(__name__)
SMOKE = {"questions": 1, "max_tokens": 8, "threads": 1, "torch_threads": 1}
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


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
            except AdapterParseError as exc:  # after the adapter's own recovery: a parse failure, counted
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
    parser = PerfParser("parse_rate", __doc__, smoke=SMOKE)
    parser.add_argument("--questions", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="torch intra-op threads (0: torch's default). On a CPU shared with other jobs, 1 is "
                             "several times faster than 2: OpenMP threads stall each other when descheduled")
    run = start_run(parser, argv)
    args = run.args
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    questions = gsm8k_rows(args.questions)
    load_began = time.perf_counter()
    local = LocalLM("gemma-3-270m", max_new_tokens=args.max_tokens, max_batch_size=args.threads)
    load_s = time.perf_counter() - load_began
    lm = local.lm.copy(temperature=0.0, max_tokens=args.max_tokens, cache=False)
    results = []
    for adapter in (dspy.ChatAdapter(), CompletionAdapter()):
        for module_name in ("Predict", "ChainOfThought"):
            result = run_config(lm, adapter, module_name, questions, args.threads)
            logger.info("%s %s: %d/%d parsed, %d correct, %.0fs", result["adapter"], module_name,
                        result["parsed"], result["questions"], result["correct"], result["wall_s"])
            results.append(result)
    device, dtype = str(local.device), str(local.dtype).replace("torch.", "")
    local.close()
    rows = [[r["adapter"], r["module"], f"{r['parsed']}/{r['questions']}", f"{r['parsed'] / r['questions']:.0%}",
             r["correct"], r["lm_calls"], r["completion_tokens"], r["wall_s"]] for r in results]
    body = [f"gemma-3-270m (base, Q4_K_M dequantized) on {device} {dtype}, loaded in {load_s:.1f} s. First "
            f"{len(questions)} GSM8K test questions, zero-shot, greedy, max_tokens={args.max_tokens}, "
            f"{args.threads} threads (dynamic batching), DSPy cache off. Parsed = every output field filled after "
            "the adapter's own recovery (ChatAdapter: JSONAdapter fallback; CompletionAdapter: continuation).", "",
            *markdown_table(["adapter", "module", "parsed", "parse rate", "correct", "LM calls", "completion tokens",
                             "wall s"], rows, align="llrrrrrr")]
    payload = {"model": "gemma-3-270m (base, Q4_K_M dequantized)", "device": device, "dtype": dtype,
               "model_load_s": round(load_s, 1), "configs": results}
    run.finish("Parse-success rate: Gemma 3 270M on GSM8K, ChatAdapter vs CompletionAdapter", payload, body)
    return 0


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(main())
