"""Where a batch-1 decode step of the embedded Gemma goes on CPU: the body's matmuls, attention, norms, the rest.

Run: python -m flowopt.benchmarks.perf.decode_profile [--rounds 5] [--steps 8]
Writes benchmarks/results/decode_profile.{json,md} (``--out STEM``). Every figure is **CPU time of the
calling thread** (``time.thread_time``) with one torch thread, the minimum over ``--rounds`` rounds of
``--steps`` calls: CPU time, unlike wall time, is not inflated by other processes on a shared machine
(still by their use of the memory bus, hence the minimum). Pieces, all on the LocalLM's own decode loop
(:class:`~flowopt.lm.decoder.Decoder`, static cache) after a GSM8K-style prompt:

- the whole step (``Decoder.step``: body, output projection, greedy pick), and the same step with every
  one-row linear computed as ``torch.mv`` (:class:`SingleRowMatVec`, alternating rounds): torch's own GEMV
  instead of oneDNN's one-row matmul, an alternative measured here and not adopted (the results' notes);
- the body (18 layers and the final norm) and the output projection (262k x 640, float32 logits) alone;
- the body's 126 linear layers alone (the same weights, one row each), 18 SDPA calls over the cache, and
  108 Gemma3 RMSNorm calls (6 a layer): what is left of the body is per-op dispatch and small ops;
- the aten kernels dispatched per token (``TorchDispatchMode``).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import Any

from flowopt.benchmarks.perf.harness import PerfParser, markdown_table, setup_logging, start_run

logger = logging.getLogger(__name__)
SMOKE = {"rounds": 1, "steps": 1, "model": "tiny"}
PROMPT = ("Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
          "How many clips did Natalia sell altogether in April and May? Reasoning: Let's think step by step.")


class SingleRowMatVec:
    """A ``TorchFunctionMode`` (built on first use) computing ``F.linear`` of one half-precision row as ``torch.mv``."""

    def __new__(cls) -> Any:
        import torch
        from torch.overrides import TorchFunctionMode

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                kwargs = kwargs or {}
                if func is torch.nn.functional.linear and len(args) >= 2 and len(args) + len(kwargs) == 2:
                    x, weight = args
                    if x.dtype in (torch.bfloat16, torch.float16) and x.numel() == weight.shape[1]:
                        return torch.mv(weight, x.reshape(-1)).view(*x.shape[:-1], weight.shape[0])
                return func(*args, **kwargs)

        return Mode()


def cpu_ms(fn: Callable[[], Any], steps: int, rounds: int) -> float:
    """The least CPU milliseconds per call of ``fn`` over ``rounds`` rounds of ``steps`` calls (one warm-up)."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        began = time.thread_time()
        for _ in range(steps):
            fn()
        best = min(best, (time.thread_time() - began) / steps * 1000)
    return round(best, 2)


def kernels_per_step(step: Callable[[], Any]) -> dict[str, int]:
    """aten kernels one call of ``step`` dispatches, by name."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: collections.Counter[str] = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            counts[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step()
    return dict(counts.most_common())


def body_pieces(model: Any, decoder: Any, steps: int, rounds: int) -> dict[str, float]:
    """CPU ms of the body's linears, attention calls and norms, each alone on the model's own weights."""
    import torch
    import torch.nn.functional as F

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = base.get_decoder().layers
    dtype = next(base.parameters()).dtype

    def one_row(width: int) -> torch.Tensor:
        return torch.randn(1, 1, width, dtype=dtype)

    def linears() -> None:
        for layer in layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                         layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                F.linear(one_row(proj.weight.shape[1]), proj.weight)

    attn = layers[0].self_attn
    heads, head_dim = base.config.num_attention_heads, attn.head_dim
    keys, values = decoder.cache.keys[0][:1], decoder.cache.values[0][:1]
    query = torch.randn(1, heads, 1, head_dim, dtype=dtype)
    norm, x = layers[0].input_layernorm, one_row(base.config.hidden_size)
    n = len(layers)
    return {
        "layers": n,
        "linears": cpu_ms(linears, steps, rounds),
        "sdpa": cpu_ms(lambda: [F.scaled_dot_product_attention(query, keys, values, enable_gqa=True)
                                for _ in range(n)], steps, rounds),
        "rms_norms": cpu_ms(lambda: [norm(x) for _ in range(6 * n)], steps, rounds),
    }


def measure(local: Any, steps: int, rounds: int) -> dict[str, Any]:
    import torch

    from flowopt.lm.decode import Row
    from flowopt.lm.decoder import Decoder, DecodeRun
    from flowopt.lm.sampling import RowSettings

    model, tokenizer = local.model, local.tokenizer
    decoder = Decoder(lambda: model, tokenizer)
    run = DecodeRun()
    decoder.admit(run, [Row(local.render(PROMPT), RowSettings(max_new_tokens=400))])
    parts, view = decoder.parts(), decoder.cache.view(0, 1)
    row = run.rows[0]

    def step() -> None:
        decoder.step(run)

    def step_matvec() -> None:
        with SingleRowMatVec():
            decoder.step(run)

    plain, matvec = [], []
    for _ in range(rounds):  # alternating, so both see the same machine
        plain.append(cpu_ms(step, steps, 1))
        matvec.append(cpu_ms(step_matvec, steps, 1))
    with torch.inference_mode():
        ids, positions = torch.tensor([[row.tokens[-1]]]), torch.tensor([[row.position]])
        mask = decoder.cache.masks(torch.tensor([row.start]), run.t, 1)

        def body() -> Any:
            decoder.cache.set_column(view, run.t)
            return parts.hidden(ids, mask, positions, cache=view, use_cache=True)[0]

        hidden = body()[:, -1, :]
        out: dict[str, Any] = {
            "step_ms": min(plain), "step_matvec_ms": min(matvec), "step_ms_rounds": plain,
            "step_matvec_ms_rounds": matvec, "cache_length": decoder.cache.length,
            "body_ms": cpu_ms(body, steps, rounds), "head_ms": cpu_ms(lambda: parts.logits(hidden), steps, rounds),
            "masks_ms": cpu_ms(lambda: decoder.cache.masks(torch.tensor([row.start]), run.t, 1), steps, rounds),
            **{f"body_{k}_ms" if k != "layers" else k: v
               for k, v in body_pieces(model, decoder, steps, rounds).items()},
        }
        with SingleRowMatVec():
            out["head_matvec_ms"] = cpu_ms(lambda: parts.logits(hidden), steps, rounds)
        out["kernels"] = kernels_per_step(body)
    return out


def _page(out: dict[str, Any]) -> list[str]:
    rest = out["body_ms"] - out["body_linears_ms"] - out["body_sdpa_ms"] - out["body_rms_norms_ms"]
    n = out["layers"]
    return [
        f"CPU ms per token, one torch thread, least of the rounds; cache length {out['cache_length']}.", "",
        *markdown_table(["piece", "CPU ms"], [
            ["whole step (Decoder.step)", out["step_ms"]],
            ["whole step, linears as torch.mv (SingleRowMatVec)", out["step_matvec_ms"]],
            [f"body: {n} layers + final norm", out["body_ms"]],
            [f"  of it: {7 * n} linears alone", out["body_linears_ms"]],
            [f"  of it: {n} SDPA calls alone", out["body_sdpa_ms"]],
            [f"  of it: {6 * n} RMSNorms alone", out["body_rms_norms_ms"]],
            ["  of it: the rest (dispatch, rotary, casts, cache writes)", round(rest, 2)],
            ["output projection + float32 logits", out["head_ms"]],
            ["output projection, as torch.mv", out["head_matvec_ms"]],
            ["attention masks", out["masks_ms"]],
        ]), "",
        f"aten kernels dispatched by the body per token: {sum(out['kernels'].values())} "
        f"(most: {', '.join(f'{k} {v}' for k, v in list(out['kernels'].items())[:8])}).",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = PerfParser("decode_profile", __doc__, smoke=SMOKE)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="calls per round")
    parser.add_argument("--model", choices=["gemma", "tiny"], default="gemma")
    parser.add_argument("--dtype", default="bfloat16")
    run = start_run(parser, argv)
    args = run.args
    import torch

    from flowopt.lm import LocalLM

    torch.set_num_threads(1)
    if args.model == "gemma":
        local = LocalLM("gemma-3-270m", device="cpu", dtype=args.dtype, progress=False)
    else:
        from flowopt.benchmarks.perf.local_lm_cuda import build_model

        local = LocalLM(build_model(run.out.parent / "decode_profile_tiny", layers=2), device="cpu", dtype=args.dtype,
                        progress=False)
    try:
        out = measure(local, args.steps, args.rounds)
    finally:
        local.close()
    run.finish("A batch-1 decode step on CPU, piece by piece (CPU time)", out, _page(out))
    return 0


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(main())
