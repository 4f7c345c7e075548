"""Decode tokens/s side by side: LocalLM against transformers ``generate`` (dynamic cache, and static cache compiled).

Run: python -m flowopt.benchmarks.perf.decode_side_by_side [--device cpu|cuda] [--model gemma|gemma-shaped|tiny]
     [--callers 1,8,64] [--tokens 64] [--impls local,local-compiled,generate,generate-static] [--repeats 2]
Writes benchmarks/results/decode_side_by_side.{json,md} (``--out STEM``), and STEM.partial.json after each caller count
until the run ends (what a time limit leaves).

Every implementation decodes greedily the same GSM8K prompts (rendered once by LocalLM) with the same
token limit, on the same weights in one process, and stops at EOS. ``C`` concurrent callers are:

- ``local`` / ``local-compiled``: C threads each calling ``LocalLM.complete_ids`` (continuous batching;
  the second with the decode step compiled, ``compile=True``: CUDA graphs on CUDA), on one shared model;
- ``local-compiled-sdpa``: ``local-compiled`` on its own copy of the weights, whose compiled step keeps
  transformers' ``sdpa`` attention (``CompileSettings(decode_attention=False)``): what
  :mod:`flowopt.lm.attention` buys (the other compiled impls switch the shared model's attention);
- ``local-int8`` / ``local-int4``: ``local`` with ``quantize="int8"`` / ``"int4"`` (CPU: steps of up to 16
  rows through a quantized twin, :mod:`flowopt.lm.quantize`), on the same model; ``--agreement``
  also counts how many of the prompts each decodes greedily to exactly the tokens ``local`` decodes;
- ``local-int8-compiled`` / ``local-int4-compiled``: the same twins with the decode step compiled too;
- ``generate``: one ``model.generate`` call on the C prompts, left-padded (its default dynamic cache);
- ``generate-static``: the same with ``cache_implementation="static"`` and its forward compiled by
  transformers (``CompileConfig``; on CPU forced on, with inductor's default mode).

At C = 1 each implementation decodes 4 prompts one after another. Rates count the tokens each row
produced (a batched ``generate`` runs on to its longest row; that cost is counted against it). The first
round of every implementation and caller count is a warm-up (compilation happens there; its seconds are
reported). Implementations are interleaved over ``--repeats`` and the median is reported.

GPU command (one call on the lent GPU machine, ``/work/shared/gpu/README.md`` case (a); run on an H200 on
2026-11-27 with ``--impls local-compiled,generate-static --callers 1,64``, about 200 s, most of it compiling:
``benchmarks/results/decode_side_by_side_h200.md``). Build the bundle from the committed HEAD, then make one
call that carries ``.gpu``; it runs this script and the GRPO step against TRL, about 9 minutes in all::

    ../shared/gpu/build-bundle.sh .gpu --with-trl
    bash .gpu/run-on-gpu.sh --timeout 230 --log decode.log -- python3 -m flowopt.benchmarks.perf.decode_side_by_side \
      --device cuda --model gemma-shaped --callers 1,8,64 --tokens 64 --repeats 2 \
      --out "$OUT/decode_side_by_side_cuda"; \
    bash .gpu/run-on-gpu.sh --timeout 290 --log grpo.log -- python3 -m flowopt.benchmarks.perf.grpo_throughput \
      --model gemma-shaped --device cuda --threads 8 --batch 8 --group 8 --completion 64 --steps 4 --warmup 2 \
      --repeats 2 --impls flowopt,flowopt-ckpt,trl,trl-nockpt --out "$OUT/grpo_throughput_cuda"

Back in ``$OUT``: setup.log, decode.log, grpo.log and the two results' .json/.md (commit them under
benchmarks/results/). The goals: ``local-compiled`` >= 1.0x ``generate-static`` at 1 caller and >= 0.9x at 64.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from flowopt.benchmarks.perf.harness import Goal, PerfParser, interleaved, markdown_table, setup_logging, start_run
from flowopt.benchmarks.perf.lm_workload import gsm8k_prompts
from flowopt.io import atomic_write_json

logger = logging.getLogger(__name__)

SMOKE = {"model": "tiny", "callers": "1,4", "tokens": 4, "repeats": 1, "impls": "local,local-int8,generate",
         "dtype": "float32", "agreement": 2}
IMPLS = ("local", "local-compiled", "local-compiled-sdpa", "local-int8", "local-int4", "local-int8-compiled",
         "local-int4-compiled", "generate", "generate-static")
# name: (quantize, compile) of a LocalLM twin on the same model
QUANTIZED = {"local-int8": ("int8", False), "local-int4": ("int4", False), "local-int8-compiled": ("int8", True),
             "local-int4-compiled": ("int4", True)}


def load(model: str, device: str, dtype: str, folder: Path) -> Any:
    """The LocalLM (eager decode step) of ``--model``; a compiled twin shares its weights."""
    from flowopt.lm import LocalLM

    kwargs = {"device": device, "dtype": dtype or None, "compile": False, "batch_wait_ms": 5, "progress": False}
    if model == "gemma":
        return LocalLM("gemma-3-270m", **kwargs)
    from flowopt.benchmarks.perf.local_lm_cuda import build_model

    return LocalLM(build_model(folder / model, layers=18 if model == "gemma-shaped" else 2), **kwargs)


def local_round(local: Any, prompts: list[list[int]], callers: int, tokens: int) -> tuple[int, float]:
    """``callers`` threads, caller ``j`` decoding prompts ``j, j + callers, ...``; (tokens, seconds)."""
    from flowopt.lm.sampling import RowSettings

    settings = RowSettings(max_new_tokens=tokens)
    produced = [0] * callers
    barrier = threading.Barrier(callers + 1)

    def caller(j: int) -> None:
        barrier.wait()
        for prompt in prompts[j::callers]:
            produced[j] += len(local.complete_ids(prompt, settings).completion_ids)

    threads = [threading.Thread(target=caller, args=(j,)) for j in range(callers)]
    for thread in threads:
        thread.start()
    barrier.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    return sum(produced), time.perf_counter() - began


def generate_round(local: Any, prompts: list[list[int]], callers: int, tokens: int,
                   static: bool) -> tuple[int, float]:
    """``model.generate`` on ``callers`` prompts at a time; (tokens up to each row's EOS, seconds)."""
    import torch
    from transformers import CompileConfig

    from flowopt.lm.packing import left_padded

    model, eos = local.base_model, local.eos_ids
    extra: dict[str, Any] = {}
    if static:
        if local.device.type == "cuda":
            from flowopt.lm.decoder import cuda_graph_thread_state

            cuda_graph_thread_state()  # this thread's own CUDA-graph trees (the decode loop's live in its thread)
        config = CompileConfig(mode="reduce-overhead" if local.device.type == "cuda" else "default")
        config._compile_all_devices = True  # transformers compiles only on accelerators unless told
        extra = {"cache_implementation": "static", "compile_config": config}
    produced, began = 0, time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(prompts), callers):
            ids, mask, _ = (t.to(local.device) for t in left_padded(prompts[start:start + callers], local.pad_id))
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False,
                                 eos_token_id=eos, pad_token_id=local.pad_id, **extra)[:, ids.shape[1]:].tolist()
            for row in out:
                ends = [i for i, t in enumerate(row) if t in eos]
                produced += ends[0] + 1 if ends else len(row)
    if local.device.type == "cuda":
        torch.cuda.synchronize()
    return produced, time.perf_counter() - began


def agreement(local: Any, twins: dict[str, Any], prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    """Per quantized impl: prompts decoded greedily to exactly ``local``'s tokens, and the mean share of
    ``local``'s tokens before the first difference (one caller at a time: every step has one row)."""
    from flowopt.lm.sampling import RowSettings

    settings = RowSettings(max_new_tokens=tokens)
    exact = [local.complete_ids(p, settings).completion_ids for p in prompts]
    out: dict[str, Any] = {"prompts": len(prompts), "tokens": tokens}
    for name, twin in twins.items():
        same, prefix = 0, []
        for want, prompt in zip(exact, prompts):
            got = twin.complete_ids(prompt, settings).completion_ids
            same += got == want
            common = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            prefix.append(common / max(len(want), 1))
        out[name] = {"identical": same, "mean_common_prefix": round(statistics.fmean(prefix), 3)}
    return out


def report(args: Any, impls: list[str], callers: list[int], results: dict[str, Any]) -> tuple[list[str], list[Goal]]:
    """The page's body (rates table, greedy agreement) and the goals of one run."""
    rates = results["rates"]
    rows = [[name, *(rates[str(c)].get(name, "") for c in callers)] for name in impls]
    body = [f"Model `{args.model}` on `{results['device']}` ({results['dtype']}); greedy, up to {args.tokens} new "
            "tokens per call; decode tokens/s (median of interleaved repeats; the first round of each is a "
            "warm-up, seconds in the JSON).", "",
            *markdown_table(["implementation", *(f"{c} caller(s)" for c in callers)], rows)]
    goals = []
    if "local" in impls and 1 in callers and 8 in callers:
        goals.append(Goal.at_least("LocalLM, 8 callers vs 1 (tokens/s ratio)",
                                   round(rates["8"]["local"] / rates["1"]["local"], 2), 4))
    for name in QUANTIZED:
        if name in impls and 1 in callers:
            goals.append(Goal.at_least(f"{name}, 1 caller (tokens/s)", rates["1"][name], 25))
            if 8 in callers:
                goals.append(Goal.at_least(f"{name}, 8 callers vs 1 (tokens/s ratio)",
                                           round(rates["8"][name] / rates["1"][name], 2), 4))
    if "greedy_agreement" in results:
        body += ["", f"Greedy agreement with `local` ({results['greedy_agreement']['prompts']} prompts, up to "
                 f"{args.tokens} tokens): " + "; ".join(
                     f"{n}: {v['identical']} identical, mean common prefix {v['mean_common_prefix']:.0%}"
                     for n, v in results["greedy_agreement"].items() if isinstance(v, dict)) + "."]
    if "generate-static" in impls and "local-compiled" in impls:
        for c in (1, 64):
            if c in callers:
                goals.append(Goal.at_least(f"LocalLM compiled vs generate static compiled, {c} caller(s)",
                                           round(rates[str(c)]["local-compiled"] / rates[str(c)]["generate-static"], 3),
                                           1.0 if c == 1 else 0.9))
    return body, goals


def main(argv: list[str] | None = None) -> int:
    parser = PerfParser("decode_side_by_side", __doc__, smoke=SMOKE)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", choices=("gemma", "gemma-shaped", "tiny"), default="gemma")
    parser.add_argument("--dtype", default="", help="float32 or bfloat16 (default: LocalLM's pick)")
    parser.add_argument("--callers", default="1,8,64", help="comma-separated concurrent caller counts")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per call (greedy, EOS ends early)")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated subset of {','.join(IMPLS)}")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--agreement", type=int, default=0,
                        help="prompts on which to compare each quantized impl's greedy tokens with local's (0: none)")
    parser.add_argument("--torch-threads", type=int, default=0, help="0: torch's default")
    run = start_run(parser, argv)
    args = run.args
    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    impls = [i for i in args.impls.split(",") if i]
    unknown = sorted(set(impls) - set(IMPLS))
    if unknown:
        parser.error(f"unknown --impls {unknown}; choose from {list(IMPLS)}")
    callers = [int(c) for c in args.callers.split(",")]
    from flowopt.lm import LocalLM
    from flowopt.lm.attention import attention_name

    with tempfile.TemporaryDirectory() as tmp:
        local = load(args.model, args.device, args.dtype, Path(tmp))
        compiled = LocalLM.from_model(local.model, local.tokenizer, name="compiled", max_new_tokens=args.tokens,
                                      batch_wait_ms=5, compile=True)
        prompts = [local.render(t) for t in gsm8k_prompts(max(max(callers), 4, args.agreement))]
        plain = sdpa = None
        if "local-compiled-sdpa" in impls:  # its own weights: a compiled step switches its model's attention
            plain = load(args.model, args.device, args.dtype, Path(tmp) / "sdpa")  # not over the loaded one's files
            sdpa = LocalLM.from_model(plain.model, plain.tokenizer, name="compiled-sdpa", max_new_tokens=args.tokens,
                                      batch_wait_ms=5, compile=True)
            sdpa.compile_settings = dataclasses.replace(sdpa.compile_settings, decode_attention=False)
        twins = {name: LocalLM.from_model(local.model, local.tokenizer, name=name, max_new_tokens=args.tokens,
                                          batch_wait_ms=5, compile=compiled_step, quantize=scheme)
                 for name, (scheme, compiled_step) in QUANTIZED.items() if name in impls}
        cases: dict[str, Any] = {
            "local": lambda c: local_round(local, prompts[:max(c, 4)], c, args.tokens),
            **{name: (lambda c, twin=twin: local_round(twin, prompts[:max(c, 4)], c, args.tokens))
               for name, twin in twins.items()},
            "local-compiled": lambda c: local_round(compiled, prompts[:max(c, 4)], c, args.tokens),
            "local-compiled-sdpa": lambda c: local_round(sdpa, prompts[:max(c, 4)], c, args.tokens),
            "generate": lambda c: generate_round(local, prompts[:max(c, 4)], c, args.tokens, static=False),
            "generate-static": lambda c: generate_round(local, prompts[:max(c, 4)], c, args.tokens, static=True)}
        results: dict[str, Any] = {"device": str(local.device), "dtype": str(local.dtype).replace("torch.", ""),
                                   "rates": {}, "warmup_s": {}, "tokens": {}, "seconds": {}}
        for c in callers:
            logger.info("%d caller(s): warm-up of %s", c, ", ".join(impls))
            warm = {name: cases[name](c) for name in impls}  # compiles here
            results["warmup_s"][str(c)] = {name: round(s, 2) for name, (_, s) in warm.items()}
            runs = interleaved({name: (lambda name=name, c=c: cases[name](c)) for name in impls}, args.repeats)
            results["rates"][str(c)] = {n: round(statistics.median(k / s for k, s in v), 2) for n, v in runs.items()}
            results["tokens"][str(c)] = {n: [k for k, _ in v] for n, v in runs.items()}
            results["seconds"][str(c)] = {n: [round(s, 3) for _, s in v] for n, v in runs.items()}  # per repeat
            logger.info("%d caller(s): tokens/s %s", c, results["rates"][str(c)])
            # What is measured so far survives a run stopped by a time limit (a GPU call's, say).
            atomic_write_json(run.sibling(".partial.json"), results)
        if args.agreement and twins:
            results["greedy_agreement"] = agreement(local, twins, prompts[:args.agreement], args.tokens)
        results["local_decode_stats"] = local.decode_stats.summary()
        for name, twin in twins.items():
            results[f"{name}_decode_stats"] = twin.decode_stats.summary()
            twin.close()
        results["local_compiled_decode_stats"] = compiled.decode_stats.summary()
        results["attention"] = {name: attention_name(lm.model) for name, lm in
                                (("local-compiled", compiled), ("local-compiled-sdpa", sdpa)) if name in impls}
        local.close()
        compiled.close()
        for extra in (sdpa, plain):
            if extra is not None:
                extra.close()
    run.sibling(".partial.json").unlink(missing_ok=True)
    body, goals = report(args, impls, callers, results)
    run.finish("Decode tokens/s side by side: LocalLM vs transformers generate (dynamic, static compiled)",
               results, body, goals=goals)
    return 0


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(main())
