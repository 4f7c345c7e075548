"""Time to first token through ``flowopt serve``'s streaming, as the official ``openai`` client sees it.

The server runs in a second process on 127.0.0.1. Each round sends the same greedy chat request three
ways, interleaved: streamed (``stream=true``; the time to the first chunk with text, and to the end of
the stream) and whole (``stream=false``; the time to the answer). The streamed and whole answers must be
the same text. The first round is a warm-up and not kept.

Run: python -m flowopt.benchmarks.perf.serve_streaming [--model gemma-3-270m] [--tokens 64] [--repeats 5]
Writes benchmarks/results/serve_streaming.{json,md} (``--out STEM``).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from flowopt.benchmarks.perf.harness import Goal, PerfParser, interleaved, markdown_table, setup_logging, start_run
from flowopt.benchmarks.perf.harness.timing import spread
from flowopt.lm.serve_process import serve_subprocess

SMOKE = {"model": "tiny", "tokens": 8, "repeats": 1}
QUESTION = [{"role": "user", "content": "Explain in a few sentences why the sky is blue."}]


def streamed(client: Any, model: str, tokens: int) -> dict[str, Any]:
    """Seconds to the first text chunk and to the stream's end, and the streamed text."""
    began = time.perf_counter()
    first: float | None = None
    pieces = []
    for chunk in client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=tokens,
                                                stream=True):
        text = chunk.choices[0].delta.content if chunk.choices else None
        if text:
            first = time.perf_counter() - began if first is None else first
            pieces.append(text)
    total = time.perf_counter() - began
    return {"first_s": total if first is None else first, "total_s": total, "text": "".join(pieces)}


def whole(client: Any, model: str, tokens: int) -> dict[str, Any]:
    began = time.perf_counter()
    answer = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=tokens)
    return {"total_s": time.perf_counter() - began, "text": answer.choices[0].message.content,
            "completion_tokens": answer.usage.completion_tokens}


def main(argv: list[str] | None = None) -> int:
    parser = PerfParser("serve_streaming", __doc__, smoke=SMOKE)
    parser.add_argument("--model", default="gemma-3-270m", choices=["tiny", "gemma-3-270m"],
                        help="the embedded Gemma 3 270M, or a random word-level model")
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens of each request")
    parser.add_argument("--repeats", type=int, default=5)
    run = start_run(parser, argv)
    args = run.args
    import openai

    with tempfile.TemporaryDirectory(prefix="flowopt-serve-stream-") as tmp:
        model_dir: Path | str = args.model
        if args.model == "tiny":
            from flowopt.optimizers.weights.tiny import tiny_causal_lm

            model, tokenizer = tiny_causal_lm(["sky", "blue", "light", "the", "is", "because"], seed=0)
            model_dir = Path(tmp) / "model"
            model.save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
        with serve_subprocess(model_dir, "--name", "served", "--log-level", "warning", "--dtype", "float32",
                              log=Path(tmp) / "server.log") as base, \
                openai.OpenAI(base_url=base, api_key="x", max_retries=0) as client:
            rounds = interleaved({"streamed": lambda: streamed(client, "served", args.tokens),
                                  "whole": lambda: whole(client, "served", args.tokens)}, args.repeats, warmup=1)
    same_text = all(s["text"] == w["text"] for s, w in zip(rounds["streamed"], rounds["whole"]))
    first = spread([r["first_s"] for r in rounds["streamed"]], 4)
    stream_total = spread([r["total_s"] for r in rounds["streamed"]], 4)
    whole_total = spread([r["total_s"] for r in rounds["whole"]], 4)
    ratio = first["median"] / stream_total["median"]
    tokens = rounds["whole"][0]["completion_tokens"]
    results = {"model": args.model, "dtype": "float32", "max_tokens": args.tokens, "completion_tokens": tokens,
               "first_text_s": first, "streamed_total_s": stream_total, "whole_total_s": whole_total,
               "first_over_total": round(ratio, 4), "streamed_equals_whole": same_text}
    rows = [["streamed: first text", first["median"], first["min"], first["max"]],
            ["streamed: whole stream", stream_total["median"], stream_total["min"], stream_total["max"]],
            ["not streamed: answer", whole_total["median"], whole_total["min"], whole_total["max"]]]
    body = [f"{args.model}, float32 on CPU, greedy chat, {tokens} completion tokens (max_tokens {args.tokens}), "
            f"{args.repeats} interleaved rounds after one warm-up; the openai client in this process, the server in "
            "another.", "", *markdown_table(["seconds", "median", "min", "max"], rows, align="lrrr"), "",
            f"First text after **{ratio:.1%}** of the streamed request's time; streamed text equals the whole "
            f"answer: {same_text}."]
    goals = [Goal.at_most("first text / whole streamed request (median)", round(ratio, 4), 0.5)]
    run.finish("Time to first token through flowopt serve's streaming (openai client, CPU)", results, body,
               goals=goals)
    return 0


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(main())
