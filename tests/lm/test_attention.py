"""Decode-step attention (flowopt.lm.attention): the same attention as transformers' sdpa, without the
per-query-head copy of the cache, compiled or not; only a decode copy's config points at it."""

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


def test_only_the_twin_decodes_with_it_and_the_model_keeps_sdpa(tiny_model_dir):
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
