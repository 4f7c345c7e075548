"""Why LocalLM picks bf16 on this CPU, and what the contiguous lm_head input saves: Gemma 3 270M timings.

Run: python -m flowopt.benchmarks.perf.cpu_bf16_paths [--repeats 3]
Writes benchmarks/results/cpu_bf16_paths.{json,md} (``--out STEM``). Four measurements, each float32
against bf16 where that applies (median of ``--repeats``):

1. a greedy decode step of Gemma 3 270M at batch 1 and 8 (``model.generate`` on GSM8K prompts, the time
   of ``--decode-tokens`` (33) new tokens minus the time of 1, over 32);
2. the 262k x 640 output projection alone on 1 and 8 rows;
3. that projection (``--head-rows`` x 640, random) on a strided ``[8, 8, 640]`` slice (what transformers
   hands ``lm_head``) with a frozen weight, as under a LoRA adapter, against the same slice made contiguous;
4. a GRPO-sized training forward and backward (``--train-rows`` (32) sequences of 85 prompt + 7
   completion tokens) with a LoRA adapter attached, through ``completion_logprobs``, with and without
   the contiguous-input hook.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from flowopt.benchmarks.perf.harness import PerfParser, markdown_table, median_seconds, setup_logging, start_run
from flowopt.benchmarks.perf.lm_workload import gsm8k_prompts

logger = logging.getLogger(__name__)
# Smoke: one call of each, and a small stand-in for the strided-input head (the full-size head's
# 262k-row weight alone takes about 20 s to draw and multiply on this CPU).
SMOKE = {"repeats": 1, "warmup": 0, "decode_tokens": 3, "train_rows": 2, "head_rows": 8192}


def decode_step_ms(local: Any, ids: list[list[int]], repeats: int, tokens: int, warmup: int) -> float:
    import torch

    width = max(len(p) for p in ids)
    x = torch.zeros((len(ids), width), dtype=torch.long)
    mask = torch.zeros_like(x)
    for i, p in enumerate(ids):
        x[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1

    def run(new: int) -> None:
        with torch.inference_mode():
            local.model.generate(input_ids=x, attention_mask=mask, do_sample=False, max_new_tokens=new,
                                 min_new_tokens=new, pad_token_id=0)

    long = median_seconds(lambda: run(tokens), repeats, warmup=warmup)
    short = median_seconds(lambda: run(1), repeats, warmup=warmup)
    return (long - short) / (tokens - 1) * 1000


def _page(out: dict[str, Any], r: int, w: int, rows: int, head_rows: int) -> list[str]:
    """The results page's lines: the float32/bf16 table, the strided-input table, the hook's effect."""
    d32, d16 = out["decode_step_ms_float32"], out["decode_step_ms_bfloat16"]
    h32, h16 = out["lm_head_ms_float32"], out["lm_head_ms_bfloat16"]
    return [
        f"Native bf16 on this CPU: {out['native_bf16']}. Median of {r} repeats after {w} untimed.", "",
        *markdown_table(["measurement", "float32", "bf16"], [
            ["decode step, batch 1 (ms)", d32[1], d16[1]],
            ["decode step, batch 8 (ms)", d32[8], d16[8]],
            ["output projection alone, 1 row (ms)", h32[1], h16[1]],
            ["output projection alone, 8 rows (ms)", h32[8], h16[8]],
            [f"LoRA training forward + backward, {rows} x 92 tokens (s)",
             out["lora_train_forward_backward_s_float32"], out["lora_train_forward_backward_s_bfloat16"]],
        ], align="lrr"), "",
        f"The strided input (bf16, frozen {head_rows} x 640 weight, an [8, 8, 640] slice of [8, 92, 640]):", "",
        *markdown_table(["input", "ms"], [
            ["strided, as transformers passes it", out["lm_head_strided_bf16_frozen_ms"]],
            ["made contiguous (LocalLM's lm_head pre-hook)", out["lm_head_contiguous_bf16_frozen_ms"]],
        ], align="lr"), "",
        f"LoRA training forward + backward in bf16 without the hook: "
        f"{out['lora_train_forward_backward_s_bfloat16_without_hook']} s (with it: "
        f"{out['lora_train_forward_backward_s_bfloat16']} s).",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = PerfParser("cpu_bf16_paths", __doc__, smoke=SMOKE)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls before each timing")
    parser.add_argument("--decode-tokens", type=int, default=33, help="new tokens of the long decode (>= 2)")
    parser.add_argument("--train-rows", type=int, default=32, help="sequences in the LoRA training step")
    parser.add_argument("--head-rows", type=int, default=262144,
                        help="vocabulary rows of the strided-input head (Gemma 3's: 262144)")
    run = start_run(parser, argv)
    args = run.args
    if args.decode_tokens < 2:
        parser.error("--decode-tokens must be >= 2: a step is (time of N tokens - time of 1) / (N - 1)")
    import torch

    from flowopt.lm import LocalLM
    from flowopt.lm.loading import cpu_has_native_bf16
    from flowopt.lm.packing import pack
    from flowopt.lm.scoring import completion_logprobs
    from flowopt.optimizers.weights.policy import LoraSettings, Policy

    r, w = args.repeats, args.warmup
    out: dict[str, Any] = {}
    texts = gsm8k_prompts(8)
    for dtype in ("float32", "bfloat16"):
        began = time.perf_counter()
        local = LocalLM("gemma-3-270m", dtype=dtype, progress=False)
        logger.info("%s: loaded in %.1f s", dtype, time.perf_counter() - began)
        ids = [local.render(t) for t in texts]
        out[f"decode_step_ms_{dtype}"] = {b: round(decode_step_ms(local, ids[:b], r, args.decode_tokens, w), 1)
                                          for b in (1, 8)}
        weight = local.base_model.get_output_embeddings().weight.detach()  # frozen, as under LoRA
        out[f"lm_head_ms_{dtype}"] = {b: round(median_seconds(lambda b=b, head=weight: torch.nn.functional.linear(
            torch.randn(b, 640, dtype=head.dtype), head), r, warmup=w) * 1000, 1) for b in (1, 8)}
        local.close()
        logger.info("%s: decode and head timed (%.1f s so far)", dtype, time.perf_counter() - began)

    began = time.perf_counter()
    weight = torch.randn(args.head_rows, 640).bfloat16()  # requires_grad False
    strided = torch.randn(8, 92, 640).bfloat16()[:, -8:, :]
    out["lm_head_strided_bf16_frozen_ms"] = round(
        median_seconds(lambda: torch.nn.functional.linear(strided, weight), r, warmup=w) * 1000, 1)
    out["lm_head_contiguous_bf16_frozen_ms"] = round(
        median_seconds(lambda: torch.nn.functional.linear(strided.contiguous(), weight), r, warmup=w) * 1000, 1)

    logger.info("strided head timed in %.1f s", time.perf_counter() - began)
    rows = args.train_rows
    batch = pack([list(range(1000, 1085))] * rows, [list(range(2000, 2007))] * rows, 0)
    for dtype in ("float32", "bfloat16"):
        for hook in (True, False):
            if dtype == "float32" and not hook:
                continue
            local = LocalLM("gemma-3-270m", dtype=dtype, progress=False)
            head = local.base_model.get_output_embeddings()
            if not hook:
                head._forward_pre_hooks.clear()  # what LocalLM did before the hook
            policy = Policy(local, lora=LoraSettings(r=16, alpha=32))
            policy.start_adapter("bench")

            def train_step(policy: Policy = policy) -> None:
                with policy.training():
                    completion_logprobs(policy.model, batch).sum().backward()

            key = f"lora_train_forward_backward_s_{dtype}" + ("" if hook else "_without_hook")
            began = time.perf_counter()
            out[key] = round(median_seconds(train_step, max(1, r - 1), warmup=w), 2)
            local.close()
            logger.info("%s: %.1f s (section %.1f s)", key, out[key], time.perf_counter() - began)

    out["native_bf16"] = cpu_has_native_bf16()
    body = _page(out, r, w, rows, args.head_rows)
    run.finish("Gemma 3 270M on this CPU: float32 vs bf16, and the strided lm_head input", out, body)
    return 0


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(main())
