"""Gemma 3 270M throughput on this CPU: LocalLM vs a raw ``model.generate`` loop, and under 8 callers.

Run: python -m flowopt.benchmarks.perf.lm_throughput [--tokens 48] [--repeats 3] [--torch-threads 1]
Writes benchmarks/results/lm_throughput.{json,md} (``--out STEM``). Goals (issue 4): LocalLM at batch 1
within 5% of a raw generate loop; 8 concurrent callers >= 4x the tokens/s of batch 1.

Both sides decode greedily the same 8 GSM8K prompts with the same limit, so they produce the same
tokens; LocalLM goes through the whole DSPy path (``local.lm(...)``, cache off: request building,
engine, batcher, Response). Raw and LocalLM runs are interleaved and the median of the repeats is
reported, because the CPU may be shared with other jobs.
"""

from __future__ import annotations

import statistics
import time

from flowopt.benchmarks.perf.harness import Goal, PerfParser, interleaved, markdown_table, setup_logging, start_run
from flowopt.benchmarks.perf.lm_workload import calls_at_once, calls_one_at_a_time, gsm8k_prompts

SMOKE = {"tokens": 4, "repeats": 1, "torch_threads": 1}


def main(argv: list[str] | None = None) -> int:
    parser = PerfParser("lm_throughput", __doc__, smoke=SMOKE)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--torch-threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--dtype", default="", help="float32 or bfloat16 (default: LocalLM's pick)")
    run = start_run(parser, argv)
    args = run.args
    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    from flowopt.lm import LocalLM

    local = LocalLM("gemma-3-270m", max_new_tokens=args.tokens, max_batch_size=8,
                    dtype=args.dtype or None)
    lm = local.lm.copy(temperature=0.0, max_tokens=args.tokens, cache=False)
    texts = gsm8k_prompts(8)
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
    runs = interleaved({"raw": raw_loop, "local_batch1": lambda: calls_one_at_a_time(lm, texts),
                        "local_8_callers": lambda: calls_at_once(lm, texts)}, args.repeats)
    rate = {k: statistics.median(n / s for n, s in v) for k, v in runs.items()}
    tokens = {k: [n for n, _ in v] for k, v in runs.items()}
    overhead = rate["raw"] / rate["local_batch1"] - 1
    speedup = rate["local_8_callers"] / rate["local_batch1"]
    dtype = str(local.dtype).replace("torch.", "")
    results = {"dtype": dtype, "tokens_per_s": {k: round(v, 2) for k, v in rate.items()},
               "tokens_generated": tokens, "seconds": {k: [round(s, 3) for _, s in v] for k, v in runs.items()},
               "batch1_overhead_vs_raw": round(overhead, 4), "speedup_8_callers_vs_batch1": round(speedup, 2),
               "rows_per_step_seen": sorted(local.decode_stats.summary()["steps_by_rows"])}
    local.close()
    rows = [["raw `model.generate`, one prompt at a time", f"{rate['raw']:.2f}", tokens["raw"]],
            ["LocalLM via `dspy.LM`, one call at a time", f"{rate['local_batch1']:.2f}", tokens["local_batch1"]],
            ["LocalLM via `dspy.LM`, 8 concurrent callers", f"{rate['local_8_callers']:.2f}",
             tokens["local_8_callers"]]]
    body = [f"{dtype}; 8 GSM8K prompts, greedy, up to {args.tokens} new tokens each, median of {args.repeats} "
            "interleaved repeats.", "",
            *markdown_table(["run", "tokens/s", "tokens per repeat"], rows, align="lrl")]
    goals = [Goal.at_most("batch-1 overhead vs raw generate", round(overhead, 4), 0.05),
             Goal.at_least("8 callers vs batch 1 (tokens/s ratio)", round(speedup, 2), 4)]
    run.finish("Gemma 3 270M throughput on CPU: LocalLM vs raw generate, and 8 concurrent callers", results, body,
               goals=goals)
    return 0


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(main())
