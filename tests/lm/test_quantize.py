"""The opt-in quantized decode twin (flowopt.lm.quantize): close to the exact weights, refused clearly.

The tiny Gemma of conftest is random, so agreement bounds here are about this model at this seed: what
they check is that the twin computes the same function within the quantization error, not its speed.
"""

from __future__ import annotations

import pytest
import torch

from flowopt.errors import ConfigError

pytest.importorskip("torchao")

PROMPTS = ["Question: what is two plus two?\nAnswer:", "hello there", "The quick brown fox",
           "Numbers 0 1 2 3", "Reasoning: Let's think step by step.", "A stitch in time",
           "System: You are helpful.", "Given the fields `question`"]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from flowopt.lm.loading import load_pretrained

    model, tokenizer = load_pretrained(tiny_model_dir, "cpu", "float32")
    return model, tokenizer


def _local(tiny, **kwargs):
    from flowopt.lm import LocalLM

    model, tokenizer = tiny
    return LocalLM.from_model(model, tokenizer, name="tiny", max_new_tokens=12, batch_wait_ms=1, **kwargs)


@pytest.mark.parametrize("cls_name", ["Int8Linear", "Int4Linear"])
def test_quantized_linear_by_step_rows_weight_only_then_int8_activations_then_exact(cls_name):
    from flowopt.lm import quantize

    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 64, bias=True)
    quantized = getattr(quantize, cls_name)(linear)
    small_bound = 0.01 if cls_name == "Int8Linear" else 0.1  # int8: ~0.4%, int4 (groups of 32): ~5%
    weight_only = [torch.randn(1, 1, 128), torch.randn(quantize.QUANTIZED_MAX_ROWS, 1, 128)]
    dynamic = [torch.randn(quantize.QUANTIZED_MAX_ROWS + 1, 128), torch.randn(quantize.DYNAMIC_MAX_ROWS, 128)]
    for rows, bound in [*((r, small_bound) for r in weight_only), *((r, 0.02) for r in dynamic)]:
        want, got = linear(rows), quantized(rows)
        assert got.shape == want.shape
        assert not torch.equal(got, want)  # a quantized kernel ran
        assert ((got - want).norm() / want.norm()).item() < bound
        # each row as it would be alone in a step of the same kind: rows do not depend on which others share it
        if rows.shape[0] > quantize.QUANTIZED_MAX_ROWS:
            alone = quantized(torch.cat([rows[:1]] * rows.shape[0]))[:1]
            assert torch.equal(got[:1], alone)  # per-row scales and int32 sums: bitwise the same
        else:
            torch.testing.assert_close(got[:1], quantized(rows[:1]), rtol=1e-5, atol=1e-5)
    # the two quantized kernels differ (int4 vs int8 weights, or int8 activations): a row's kernel follows the step
    one = torch.randn(1, 128)
    assert not torch.equal(quantized(one), quantized(torch.cat([one] * (quantize.QUANTIZED_MAX_ROWS + 1)))[:1])
    larger = torch.randn(quantize.DYNAMIC_MAX_ROWS + 1, 128)
    assert torch.equal(quantized(larger), linear(larger))  # larger steps go through the exact weight


def test_dynamic_int8_linear_quantizes_each_row_on_its_own_scale():
    from flowopt.lm.quantize import dynamic_int8_linear, int8_per_row

    weight, scales = int8_per_row(torch.eye(64))
    x = torch.zeros(3, 64)
    x[0, 0], x[1, 1], x[1, 2] = 1000.0, 1e-3, -5e-4  # rows of very different sizes; the last all zeros
    out = dynamic_int8_linear(x, weight, scales)
    # each row within half an int8 step of its own absmax (one scale for the whole step would round row 1 to 0)
    half_step = x.abs().amax(dim=-1, keepdim=True) / 254
    assert ((out - x).abs() <= half_step * 1.001 + 1e-4 * x.abs()).all(), out[:2, :3]
    assert out[1, 1].item() > 9e-4 and out[1, 2].item() < -4e-4 and torch.equal(out[2], torch.zeros(64))


def test_fused_norm_equals_gemma_norm_in_float32():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from flowopt.lm.quantize import FusedGemmaNorm, is_gemma_norm

    norm = Gemma3RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, 64)
    assert is_gemma_norm(norm) and not is_gemma_norm(torch.nn.LayerNorm(64))
    torch.testing.assert_close(FusedGemmaNorm(norm)(x), norm(x), rtol=1e-5, atol=1e-5)
    assert FusedGemmaNorm(norm)(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_twin_logits_stay_close_to_the_exact_models(tiny, scheme):
    from flowopt.lm import quantize
    from flowopt.lm.forward import halves
    from flowopt.lm.quantize import DecodeTwin

    model, tokenizer = tiny
    exact = halves(model)
    twin = DecodeTwin(exact.decoder, exact.head, scheme)
    ids = torch.tensor([tokenizer("The quick brown fox jumps over the lazy dog")["input_ids"]])
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    assert ids.shape[1] > quantize.QUANTIZED_MAX_ROWS  # both quantized paths: weight-only, int8 activations
    with torch.inference_mode():
        picks, gaps = [], []
        for t in range(1, ids.shape[1] + 1):  # prefixes of t rows: the path a decode step of t rows takes
            prefix = ids[:, :t]
            want = model(input_ids=prefix, position_ids=positions[:, :t]).logits[0, -1].float()
            hidden = twin.decoder(input_ids=prefix, position_ids=positions[:, :t]).last_hidden_state
            got = twin.head(hidden[:, -1:]).float()[0, -1]
            top = want.log_softmax(-1).topk(2).values
            picks.append(bool(got.argmax() == want.argmax()) or (top[0] - top[1]).item() < 0.2)  # or a near tie
            gaps.append(((got.log_softmax(-1) - want.log_softmax(-1)).abs().max()).item())
    assert all(picks), picks
    small, large = gaps[:quantize.QUANTIZED_MAX_ROWS], gaps[quantize.QUANTIZED_MAX_ROWS:]
    # nats, on this random model: measured 0.06 / 0.48 (int8 / int4) for weight-only bodies, 0.13 / 0.55 with
    # int8 activations in the body (the head here always takes one row: weight-only)
    assert max(small) < (0.1 if scheme == "int8" else 1.0), small
    assert max(large) < (0.2 if scheme == "int8" else 1.0), large
    assert twin.current()
    with torch.no_grad():
        model.lm_head.weight.mul_(1.0)  # an in-place update (as an optimizer step does) bumps the version
    assert not twin.current()


def _top_two_gap(model, ids):
    """The exact model's gap (nats) between its two likeliest next tokens after ``ids``."""
    with torch.inference_mode():
        logps = model(input_ids=torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
    top = logps.topk(2).values
    return (top[0] - top[1]).item()


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_local_lm_decodes_through_the_twin_and_differs_only_at_near_ties(tiny, scheme):
    from flowopt.lm.sampling import RowSettings

    model = tiny[0]
    exact, quantized = _local(tiny), _local(tiny, quantize=scheme)
    bound = 0.1 if scheme == "int8" else 1.0  # nats: the twin's log-probs against the exact weights
    try:
        settings = RowSettings(max_new_tokens=12, logprobs=True)
        agreed = 0
        for prompt in PROMPTS:
            ids = exact.render(prompt)
            want, got = exact.complete_ids(ids, settings), quantized.complete_ids(ids, settings)
            common = next((i for i, (a, b) in enumerate(zip(want.completion_ids, got.completion_ids)) if a != b),
                          len(want.completion_ids))
            agreed += common
            if common:
                assert (want.logprobs[:common] - got.logprobs[:common]).abs().max() < bound
            if common < len(want.completion_ids):  # a different pick: only where the exact model nearly ties
                assert _top_two_gap(model, ids + want.completion_ids[:common]) < 2 * bound
        assert agreed >= len(PROMPTS) * 3, agreed
        assert quantized.decode_stats.summary()["decode_path"] == f"decode step on cpu: quantized {scheme} twin"
        assert exact.decode_stats.summary()["decode_path"] is None
        assert quantized.lm.model != exact.lm.model  # DSPy's cache keeps the two apart
        # Training rollouts (direct rounds) decode with the exact weights: their log-probs match scoring's.
        rollout = quantized.generate(PROMPTS[:2], temperature=0.0)
        assert [s.completion_ids for s in rollout] == [s.completion_ids for s in exact.generate(PROMPTS[:2])]
    finally:
        exact.close()
        quantized.close()


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_decoder_prefills_exactly_and_decodes_eight_rows_with_int8_activations(tiny, scheme):
    from flowopt.lm.decode import Row
    from flowopt.lm.decoder import Decoder, DecodeRun
    from flowopt.lm.sampling import RowSettings

    model, tokenizer = tiny

    def decode(decoder, prompts):
        decoder.eos = set()  # no row ends early: every step has all its rows
        run, rows = DecodeRun(), [Row(p if isinstance(p, list) else tokenizer(p)["input_ids"],
                                      RowSettings(max_new_tokens=6, logprobs=True)) for p in prompts]
        decoder.admit(run, rows)
        while run.rows:
            decoder.step(run)
            decoder.harvest(run)
        return {str(p): (r.tokens, r.logps) for p, r in zip(prompts, rows)}

    exact_decoder = Decoder(lambda: model, tokenizer, width_multiple=1)
    twin = Decoder(lambda: model, tokenizer, width_multiple=1, quantize=scheme)
    # width_multiple=1: a prompt of three tokens is a prefill of three rows, which the twin's linears would
    # multiply quantized; the prefill uses the model's own weights instead, so the first pick is exact
    short = [tokenizer.bos_token_id or 2, 5, 6]
    assert decode(twin, [short])[str(short)][1][0] == decode(exact_decoder, [short])[str(short)][1][0]
    exact, got = decode(exact_decoder, PROMPTS), decode(twin, PROMPTS)
    assert twin.stats.summary()["decode_path"] == f"decode step on cpu: quantized {scheme} twin"
    for prompt in PROMPTS:
        (want_tokens, want_logps), (tokens, logps) = exact[prompt], got[prompt]
        assert tokens[0] == want_tokens[0] and logps[0] == want_logps[0]  # the prefill's pick: exact weights
        common = next((i for i, (a, b) in enumerate(zip(want_tokens, tokens)) if a != b), len(tokens))
        steps = [abs(a - b) for a, b in zip(want_logps[1:common], logps[1:common])]
        assert max(steps, default=0.0) < (0.2 if scheme == "int8" else 1.0), steps  # nats: quantized steps
    assert any(got[p][1][1:] != exact[p][1][1:] for p in PROMPTS)  # the 8-row steps were not exact
    # a row's tokens do not depend on which rows share its steps, nor in what order
    assert decode(twin, PROMPTS[::-1]) == got


def test_adapters_decode_with_the_exact_weights_and_say_so(tiny_model_dir, tmp_path, make_adapter, caplog):
    from flowopt.lm import LocalLM

    plain = LocalLM(tiny_model_dir, device="cpu", dtype="float32", max_new_tokens=8, batch_wait_ms=1)
    local = LocalLM(tiny_model_dir, device="cpu", dtype="float32", max_new_tokens=8, batch_wait_ms=1,
                    quantize="int8")
    try:
        path = make_adapter(tiny_model_dir, tmp_path / "a1", seed=1)
        plain.load_adapter(path)
        local.load_adapter(path)
        with caplog.at_level("WARNING", logger="flowopt.lm.decoder"):
            got = local.lm("hello there", cache=False)
        assert got == plain.lm("hello there", cache=False)  # the adapter applies: exact weights, exact outputs
        assert "exact weights, although quantize='int8' was asked (the body holds adapter layers" in \
            local.decode_stats.summary()["decode_path"]
        assert local.to_spec()["quantize"] == "int8"
        rebuilt = LocalLM.from_spec(local.to_spec())
        assert rebuilt.quantize == "int8" and rebuilt.active_adapter == "a1"
        rebuilt.close()
    finally:
        plain.close()
        local.close()


def test_bad_quantize_settings_raise_config_errors(tiny, monkeypatch):
    import sys

    from flowopt.lm.quantize import check_quantize

    with pytest.raises(ConfigError, match="unknown quantize setting 'int3'"):
        _local(tiny, quantize="int3")
    with pytest.raises(ConfigError, match="CPU kernels only; the model is on cuda"):
        check_quantize("int8", torch.device("cuda", 0))
    monkeypatch.setitem(sys.modules, "torchao", None)  # as if not installed
    with pytest.raises(ConfigError, match="needs torchao"):
        check_quantize("int4", "cpu")
    check_quantize(None, "cuda")  # off: nothing to check


def test_bench_lm_quantize_reaches_the_local_model(tiny_model_dir):
    from flowopt.benchmarks.cli import bench_parser
    from flowopt.benchmarks.lms import make_lm
    from flowopt.lm import local_of

    parser = bench_parser()
    assert parser.parse_args(["gsm8k-aflow", "--lm-quantize", "int4"]).lm_quantize == "int4"
    assert parser.parse_args(["gsm8k-aflow"]).lm_quantize is None
    with pytest.raises(SystemExit):
        parser.parse_args(["gsm8k-aflow", "--lm-quantize", "int3"])
    lm, _adapter = make_lm(str(tiny_model_dir), max_tokens=4, quantize="int8")
    local = local_of(lm)
    try:
        assert local is not None and local.quantize == "int8"
    finally:
        local.close()


def test_the_compiled_twin_traces_both_quantized_kernels_and_gives_the_eager_tokens(tiny, monkeypatch):
    """dynamo and AOT autograd trace the weight-only kernel (1 row) and ``torch._int_mm`` (8 rows) (``aot_eager``:
    no inductor, so the test stays fast); greedy tokens and log-probs equal the eager twin's."""
    from flowopt.lm import decoder as decoder_module
    from flowopt.lm.decode import Row
    from flowopt.lm.decoder import CompileSettings, Decoder, DecodeRun
    from flowopt.lm.sampling import RowSettings

    monkeypatch.setattr(decoder_module, "_compile_failure", [])
    model, tokenizer = tiny

    def decode(decoder, prompts):
        decoder.eos = set()
        rows = [Row(tokenizer(p)["input_ids"], RowSettings(max_new_tokens=4, logprobs=True)) for p in prompts]
        run = DecodeRun()
        decoder.admit(run, rows)
        while run.rows:
            decoder.step(run)
            decoder.harvest(run)
        return [(r.tokens, r.logps) for r in rows]

    eager = Decoder(lambda: model, tokenizer, quantize="int8")
    compiled = Decoder(lambda: model, tokenizer, quantize="int8",
                       compile=CompileSettings(enabled=True, backend="aot_eager"))
    for prompts in (PROMPTS[:1], PROMPTS):
        got, want = decode(compiled, prompts), decode(eager, prompts)
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
        # AOT autograd may decompose the fused norm: log-probs equal up to float32 rounding
        torch.testing.assert_close(torch.tensor([lp for _, lp in got]), torch.tensor([lp for _, lp in want]),
                                   rtol=0, atol=1e-4)
    assert compiled.stats.eager_reason is None
    assert {"batch 1, cache 256", "batch 8, cache 256"} <= set(compiled.stats.compile_seconds)
