"""Decode-step attention (flowopt.lm.attention): the same attention as transformers' sdpa, without the
per-query-head copy of the cache, compiled or not; a decode copy's config points at it, and the model's own
when its exact weights decode in a compiled step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch


def _inputs(queries: int, groups: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    batch, kv_heads, length, dim = 3, 2, 11, 16
    query = torch.randn(batch, kv_heads * groups, queries, dim)
    key, value = torch.randn(batch, kv_heads, length, dim), torch.randn(batch, kv_heads, length, dim)
    mask = torch.rand(batch, 1, queries, length) > 0.4
    mask[..., 0] = True  # no empty softmax row
    return SimpleNamespace(num_key_value_groups=groups), query, key, value, mask


@pytest.mark.parametrize("queries", [1, 3])
def test_decode_attention_equals_transformers_sdpa(queries):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from flowopt.lm.attention import decode_attention

    layer, query, key, value, mask = _inputs(queries)
    got, _ = decode_attention(layer, query, key, value, mask, scaling=0.25)
    want, _ = sdpa_attention_forward(layer, query, key, value, mask, scaling=0.25)
    assert got.shape == (3, queries, 8, 16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _traced_ops(function, *args) -> list[str]:
    graphs: list[torch.fx.GraphModule] = []

    def record(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(function, backend=record, fullgraph=True)(*args)
    return [str(node.target) for gm in graphs for node in gm.graph.nodes]


def test_compiled_decode_attention_reads_the_cache_without_copying_it_per_query_head():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from flowopt.lm.attention import decode_attention

    layer, query, key, value, mask = _inputs(1)
    ours = _traced_ops(lambda q, k, v, m: decode_attention(layer, q, k, v, m, scaling=0.25)[0], query, key, value, mask)
    theirs = _traced_ops(lambda q, k, v, m: sdpa_attention_forward(layer, q, k, v, m, scaling=0.25)[0],
                         query, key, value, mask)
    # transformers' sdpa, compiled, expands keys and values to every query head (repeat_kv); ours does not
    assert any("expand" in op for op in theirs), theirs
    assert not any("expand" in op for op in ours), ours
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, m: decode_attention(layer, q, k, v, m, scaling=0.25)[0],
                             backend="aot_eager")
    torch.testing.assert_close(compiled(query, key, value, mask),
                               sdpa_attention_forward(layer, query, key, value, mask, scaling=0.25)[0],
                               rtol=1e-5, atol=1e-5)


def test_a_twin_decodes_with_it_on_its_own_config_and_the_model_keeps_sdpa(tiny_model_dir):
    pytest.importorskip("torchao")
    from flowopt.lm.attention import DECODE_ATTENTION, use_decode_attention
    from flowopt.lm.forward import halves
    from flowopt.lm.loading import load_pretrained
    from flowopt.lm.quantize import DecodeTwin

    model, _ = load_pretrained(tiny_model_dir, "cpu", "float32")
    exact = halves(model)
    twin = DecodeTwin(exact.decoder, exact.head, "int8")
    assert model.config._attn_implementation == "sdpa"
    assert {m.config._attn_implementation for m in twin.decoder.modules() if hasattr(m, "config")} == \
        {DECODE_ATTENTION}
    with pytest.raises(ValueError, match="shares its config"):
        use_decode_attention(exact.decoder, exact.decoder)


def test_a_compiled_exact_decoder_points_the_model_at_it_and_nothing_else_changes(tiny_model_dir, monkeypatch):
    """The tiny model groups 2 query heads per key head. Its compiled exact decode step switches the model to
    decode attention; the tokens and log-probs equal the eager loop's (with sdpa), and the model's own forward
    over many tokens (scoring, training) gives the very logits it gave with sdpa."""
    from flowopt.lm import decoder as decoder_module
    from flowopt.lm.attention import DECODE_ATTENTION
    from flowopt.lm.decoder import CompileSettings, Decoder
    from flowopt.lm.loading import load_pretrained
    from flowopt.lm.sampling import RowSettings, sample

    monkeypatch.setattr(decoder_module, "_compile_failure", [])
    model, tokenizer = load_pretrained(tiny_model_dir, "cpu", "float32")
    assert model.config.num_attention_heads // model.config.num_key_value_heads == 2
    prompts = [tokenizer("Question: What is two plus two? Reasoning:")["input_ids"], tokenizer("hello")["input_ids"]]
    rows = [RowSettings(max_new_tokens=6, logprobs=True)] * 2
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        before = model(ids).logits
    eager = sample(model, tokenizer, prompts, rows)
    Decoder(lambda: model, tokenizer)  # not compiled: nothing changes
    assert model.config._attn_implementation == "sdpa"

    compiled = Decoder(lambda: model, tokenizer, compile=CompileSettings(enabled=True, backend="aot_eager"))
    out = sample(model, tokenizer, prompts, rows, decoder=compiled)
    assert model.config._attn_implementation == DECODE_ATTENTION
    assert compiled.stats.eager_reason is None
    assert [s.completion_ids for s in out] == [s.completion_ids for s in eager]
    for got, want in zip(out, eager):
        torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=1e-5)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    assert "attn_implementation" not in model.config.to_json_string()
    # A decoder made after the switch (a LocalLM's second one: GRPO rollouts) takes the model as it is now.
    later = Decoder(lambda: model, tokenizer)
    assert later.cache.supported() is None
    assert [s.completion_ids for s in sample(model, tokenizer, prompts, rows, decoder=later)] == \
        [s.completion_ids for s in eager]


def test_the_slot_cache_reads_each_attentions_mask_form_from_transformers_registry():
    from flowopt.lm.attention import register
    from flowopt.lm.slots import mask_form

    assert mask_form(register()) == "sdpa"  # registered with sdpa's boolean masks
    assert (mask_form("sdpa"), mask_form("eager")) == ("sdpa", "eager")
    assert mask_form("flash_attention_2") == "flash_attention_2"  # its own masks: SlotCache.supported refuses it
