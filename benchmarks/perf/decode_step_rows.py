"""Decode step time by rows, exact weights against each kernel of the quantized twins: where
``QUANTIZED_MAX_ROWS`` and ``DYNAMIC_MAX_ROWS`` come from.

Run: python -m flowopt.benchmarks.perf.decode_step_rows [--rows 1,2,4,8,16,32] [--steps 12] [--rounds 2]
Writes benchmarks/results/decode_step_rows.{json,md} (``--out STEM``).

torch's weight-only CPU kernels (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``) cost about one GEMV
per row; an int8 x int8 matmul (``torch._int_mm``, the activations quantized per row at each step) and oneDNN's
bf16 matmul read the weights once per step. Here each twin kernel is forced on for every step size (the two
limits set for the run) and each :class:`~flowopt.lm.decoder.Decoder` (exact, int8, int4, on one shared model)
decodes ``--steps`` steps of R rows of GSM8K prompts after two warm-up steps. The columns: the exact weights;
the weight-only int8 twin; the weight-only int4 one (int8 body, int4 output projection); int8 activations
times the int8 weights (the int8 twin; the int4 twin's larger steps use the same int8 weights). Rounds
alternate the decoders, and the figure is the last round's wall ms per step (the first rounds pay oneDNN's
and the twins' first-shape costs). Wall time: run it on an idle machine.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from flowopt.benchmarks.perf.harness import PerfParser, markdown_table, setup_logging, start_run
from flowopt.benchmarks.perf.lm_workload import gsm8k_prompts

logger = logging.getLogger(__name__)
SMOKE = {"model": "tiny", "rows": "1,2", "steps": 1, "rounds": 1}
# column: (its decoder, which twin kernel the run forces on at every row count; None: the exact weights)
KERNELS = {"exact": ("exact", None), "int8 weight-only": ("int8", "weight-only"),
           "int4 weight-only": ("int4", "weight-only"), "int8 activations": ("int8", "activations")}


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
    parser.add_argument("--rows", default="1,2,4,8,16,32")
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
                for name in ("exact", "int8", "int4")}
    saved = quantize.QUANTIZED_MAX_ROWS, quantize.DYNAMIC_MAX_ROWS
    forced = {"weight-only": (max(rows), max(rows)), "activations": (0, max(rows))}

    def measure(column: str, r: int) -> float:
        decoder, kernel = KERNELS[column]
        if kernel is not None:
            quantize.QUANTIZED_MAX_ROWS, quantize.DYNAMIC_MAX_ROWS = forced[kernel]
        try:
            return round(step_ms(decoders[decoder], prompts[:r], args.steps), 2)
        finally:
            quantize.QUANTIZED_MAX_ROWS, quantize.DYNAMIC_MAX_ROWS = saved

    rounds: list[dict[str, dict[str, float]]] = []
    try:
        for _ in range(args.rounds):
            rounds.append({str(r): {column: measure(column, r) for column in KERNELS} for r in rows})
            logger.info("ms per step: %s", rounds[-1])
        paths = {name: d.stats.decode_path for name, d in decoders.items()}
    finally:
        local.close()
    last = rounds[-1]
    results = {"ms_per_step": last, "rounds": rounds, "decode_paths": paths,
               "library_limits": {"QUANTIZED_MAX_ROWS": saved[0], "DYNAMIC_MAX_ROWS": saved[1]},
               "cache_length": decoders["exact"].cache.length}
    body = [f"Model `{args.model}` on cpu; wall ms per decode step, last of {args.rounds} alternating rounds of "
            f"{args.steps} steps; each twin kernel forced on at every row count (the library uses the weight-only "
            f"ones up to `QUANTIZED_MAX_ROWS` = {saved[0]} rows, int8 activations up to `DYNAMIC_MAX_ROWS` = "
            f"{saved[1]}, the exact weights above).", "",
            *markdown_table(["rows", *KERNELS], [[r, *(last[str(r)][c] for c in KERNELS)] for r in rows]), "",
            "Decode paths: " + "; ".join(f"{n}: {p or 'the exact weights'}" for n, p in paths.items()) + "."]
    run.finish("Decode step time by rows: exact weights against the quantized twins", results, body)
    return 0


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(main())
