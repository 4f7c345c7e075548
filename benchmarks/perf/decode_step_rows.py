"""Decode step time by rows, exact weights against the quantized twins: where ``QUANTIZED_MAX_ROWS`` comes from.

Run: python -m flowopt.benchmarks.perf.decode_step_rows [--rows 1,2,4,8] [--steps 12] [--rounds 2]
Writes benchmarks/results/decode_step_rows.{json,md} (``--out STEM``).

torch's weight-only CPU kernels (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``) cost about one GEMV
per row, while oneDNN's bf16 matmul reads the weights once per step, so past some number of rows a step is
faster with the exact weights. Here the twin is forced on for every step size (``QUANTIZED_MAX_ROWS`` raised
to the largest ``--rows`` for the run) and each :class:`~flowopt.lm.decoder.Decoder` (exact, int8, int4, on one
shared model) decodes ``--steps`` steps of R rows of GSM8K prompts after two warm-up steps; rounds alternate the
decoders, and the figure is the last round's wall ms per step (the first rounds pay oneDNN's and the twins'
first-shape costs). Wall time: run it on an idle machine.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from flowopt.benchmarks.perf.harness import PerfParser, markdown_table, setup_logging, start_run
from flowopt.benchmarks.perf.lm_workload import gsm8k_prompts

logger = logging.getLogger(__name__)
SMOKE = {"model": "tiny", "rows": "1,2", "steps": 1, "rounds": 1}
DECODERS = ("exact", "int8", "int4")


def step_ms(decoder: Any, prompts: list[list[int]], steps: int) -> float:
    """Wall ms per ``decoder.step`` with one row per prompt, after two warm-up steps."""
    from flowopt.lm.decode import Row
    from flowopt.lm.decoder import DecodeRun
    from flowopt.lm.sampling import RowSettings

    run = DecodeRun()
    decoder.admit(run, [Row(p, RowSettings(max_new_tokens=steps + 8)) for p in prompts])
    decoder.step(run)
    decoder.step(run)
    began = time.perf_counter()
    for _ in range(steps):
        decoder.step(run)
    ms = (time.perf_counter() - began) / steps * 1000
    for row in run.rows:  # end the rows and free their slots for the next measurement
        row.finish = "measured"
    decoder.harvest(run)
    return ms


def main(argv: list[str] | None = None) -> int:
    from flowopt.lm import LocalLM, quantize
    from flowopt.lm.decoder import Decoder

    parser = PerfParser("decode_step_rows", __doc__, smoke=SMOKE)
    parser.add_argument("--model", choices=["gemma", "tiny"], default="gemma")
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    run = start_run(parser, argv)
    args = run.args
    rows = [int(r) for r in args.rows.split(",")]
    if args.model == "gemma":
        local = LocalLM("gemma-3-270m", device="cpu", dtype="bfloat16", progress=False)
    else:
        from flowopt.benchmarks.perf.local_lm_cuda import build_model

        local = LocalLM(build_model(run.out.parent / "decode_step_rows_tiny", layers=2), device="cpu",
                        dtype="float32", progress=False)
    prompts = [local.render(t) for t in gsm8k_prompts(max(rows))]
    model = local.model
    decoders = {name: Decoder(lambda: model, local.tokenizer, quantize=None if name == "exact" else name)
                for name in DECODERS}
    saved = quantize.QUANTIZED_MAX_ROWS
    quantize.QUANTIZED_MAX_ROWS = max(rows)  # the twin takes every step size measured here
    rounds: list[dict[str, dict[str, float]]] = []
    try:
        for _ in range(args.rounds):
            rounds.append({str(r): {name: round(step_ms(d, prompts[:r], args.steps), 2) for name, d in decoders.items()}
                           for r in rows})
            logger.info("ms per step: %s", rounds[-1])
        paths = {name: d.stats.decode_path for name, d in decoders.items()}
    finally:
        quantize.QUANTIZED_MAX_ROWS = saved
        local.close()
    last = rounds[-1]
    results = {"ms_per_step": last, "rounds": rounds, "decode_paths": paths, "current_max_rows": saved,
               "cache_length": decoders["exact"].cache.length}
    body = [f"Model `{args.model}` on cpu; wall ms per decode step, last of {args.rounds} alternating rounds of "
            f"{args.steps} steps; the twins forced on at every row count (the library uses them up to "
            f"`QUANTIZED_MAX_ROWS` = {saved} rows).", "",
            *markdown_table(["rows", *DECODERS], [[r, *(last[str(r)][n] for n in DECODERS)] for r in rows]), "",
            "Decode paths: " + "; ".join(f"{n}: {p or 'the exact weights'}" for n, p in paths.items()) + "."]
    run.finish("Decode step time by rows: exact weights against the quantized twins", results, body)
    return 0


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(main())
