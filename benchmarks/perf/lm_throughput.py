"""Gemma 3 270M throughput on this CPU: LocalLM vs a raw ``model.generate`` loop, and under 8 callers.

Run: python benchmarks/perf/lm_throughput.py [--tokens 48] [--repeats 3] [--torch-threads 1]
Writes benchmarks/results/lm_throughput.{json,md}. Goals (issue 4): LocalLM at batch 1 within 5% of a
raw generate loop; 8 concurrent callers >= 4x the tokens/s of batch 1.

Both sides decode greedily the same 8 GSM8K prompts with the same limit, so they produce the same
tokens; LocalLM goes through the whole DSPy path (``local.lm(...)``, cache off: request building,
engine, batcher, Response). Raw and LocalLM runs are interleaved and the median of the repeats is
reported, because the CPU may be shared with other jobs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
DATA = [ROOT / "benchmarks" / "data" / "gsm8k" / "test.jsonl", Path("/work/shared/data/gsm8k/test.jsonl")]


def prompts(count: int) -> list[str]:
    path = next(p for p in DATA if p.is_file())
    rows = [json.loads(line) for line in path.read_text().splitlines()[:count]]
    return [f"Question: {r['question']}\nAnswer:" for r in rows]


def calls_one_at_a_time(lm: Any, texts: list[str]) -> tuple[int, float]:
    """Call ``lm`` on each text in turn; (completion tokens, seconds)."""
    began = time.perf_counter()
    for text in texts:
        lm(text)
    produced = sum(h["usage"]["completion_tokens"] for h in lm.history[-len(texts):])
    return produced, time.perf_counter() - began


def calls_at_once(lm: Any, texts: list[str]) -> tuple[int, float]:
    """Call ``lm`` on every text from its own thread, all released together; (completion tokens, seconds)."""
    barrier = threading.Barrier(len(texts))

    def call(text: str) -> None:
        barrier.wait()
        lm(text)

    threads = [threading.Thread(target=call, args=(t,)) for t in texts]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    produced = sum(h["usage"]["completion_tokens"] for h in lm.history[-len(texts):])
    return produced, time.perf_counter() - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--torch-threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--dtype", default="", help="float32 or bfloat16 (default: LocalLM's pick)")
    parser.add_argument("--out", type=Path, default=RESULTS / "lm_throughput")
    args = parser.parse_args(argv)
    import torch
    import transformers

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    from flowopt.lm import LocalLM

    load_before = os.getloadavg()
    local = LocalLM("gemma-3-270m", max_new_tokens=args.tokens, max_batch_size=8,
                    dtype=args.dtype or None)
    lm = local.lm.copy(temperature=0.0, max_tokens=args.tokens, cache=False)
    texts = prompts(8)
    ids = [torch.tensor([local.render(t)]) for t in texts]
    eos = local.model.generation_config.eos_token_id

    def raw_loop() -> tuple[int, float]:
        began, produced = time.perf_counter(), 0
        with torch.inference_mode():
            for prompt in ids:
                out = local.model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                           max_new_tokens=args.tokens, pad_token_id=local.tokenizer.pad_token_id,
                                           eos_token_id=eos)
                produced += out.shape[1] - prompt.shape[1]
        return produced, time.perf_counter() - began

    lm(texts[0])  # warm-up
    runs: dict[str, list[tuple[int, float]]] = {"raw": [], "local_batch1": [], "local_8_callers": []}
    for _ in range(args.repeats):
        runs["raw"].append(raw_loop())
        runs["local_batch1"].append(calls_one_at_a_time(lm, texts))
        runs["local_8_callers"].append(calls_at_once(lm, texts))
    rate = {k: statistics.median(n / s for n, s in v) for k, v in runs.items()}
    tokens = {k: [n for n, _ in v] for k, v in runs.items()}
    overhead = rate["raw"] / rate["local_batch1"] - 1
    speedup = rate["local_8_callers"] / rate["local_batch1"]
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
               "transformers": transformers.__version__, "torch_threads": torch.get_num_threads(),
               "dtype": str(local.dtype).replace("torch.", ""), "load_average_before": load_before,
               "load_average_end": os.getloadavg()}
    payload = {"command": "python benchmarks/perf/lm_throughput.py " + " ".join(sys.argv[1:] if argv is None else argv),
               "machine": machine, "tokens_limit": args.tokens, "repeats": args.repeats,
               "tokens_per_s": {k: round(v, 2) for k, v in rate.items()}, "tokens_generated": tokens,
               "batch1_overhead_vs_raw": round(overhead, 4), "speedup_8_callers_vs_batch1": round(speedup, 2),
               "batch_sizes_seen": sorted(set(local._batcher.batch_sizes))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")
    lines = [
        "# Gemma 3 270M throughput on CPU: LocalLM vs raw generate, and 8 concurrent callers", "",
        f"Command: `{payload['command'].strip()}`", "",
        f"Machine: {machine['platform']}, {machine['cpus']} CPUs (1-minute load average "
        f"{machine['load_average_before'][0]:.2f} before the run, {machine['load_average_end'][0]:.2f} at its end), "
        f"torch {machine['torch']} with {machine['torch_threads']} thread(s), transformers "
        f"{machine['transformers']}; {machine['dtype']}.", "",
        f"8 GSM8K prompts, greedy, up to {args.tokens} new tokens each, median of {args.repeats} interleaved repeats.",
        "", "| run | tokens/s | tokens per repeat |", "|---|---|---|",
        f"| raw `model.generate`, one prompt at a time | {rate['raw']:.2f} | {tokens['raw']} |",
        f"| LocalLM via `dspy.LM`, one call at a time | {rate['local_batch1']:.2f} | {tokens['local_batch1']} |",
        f"| LocalLM via `dspy.LM`, 8 concurrent callers | {rate['local_8_callers']:.2f} | "
        f"{tokens['local_8_callers']} |", "",
        f"Batch-1 overhead vs raw: **{overhead:+.1%}** (goal <= 5%: {'met' if overhead <= 0.05 else 'NOT met'}).",
        f"8 callers vs batch 1: **{speedup:.2f}x** (goal >= 4x: {'met' if speedup >= 4 else 'NOT met'}).",
    ]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
