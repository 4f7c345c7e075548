"""Decode-step attention that reads a grouped-query model's KV cache once per key head, compiled or not.

transformers' ``sdpa`` attention gives every query head its own copy of the keys and values (``repeat_kv``)
when a model has fewer key/value heads than query heads. For one query token it instead folds the query
heads of each key head into the query axis (``pack_gqa``): the same attention, with no copy. It skips that
fold under ``torch.compile``, so a compiled decode step copies the whole static cache, for every layer and
step, to each query head. On the embedded Gemma 3 (4 query heads, 1 key head), in an 8-row step on 2 CPU
cores, the copies and the attention over them took about 15 of 63 ms; folded, the attention takes about 5
(a profile, ``benchmarks/results/decode_quantized_steps_cpu.md``, its notes).

:func:`decode_attention` folds the heads in both modes and hands every other case to transformers' own
``sdpa_attention_forward``. It is registered under :data:`DECODE_ATTENTION`. :func:`use_decode_attention`
points a decode-only copy of a decoder (the quantized twin, :mod:`flowopt.lm.quantize`) at it, and
:func:`compile_with_decode_attention` the model itself when its exact weights decode in a compiled step (on
CUDA by default). That is safe for the model's other forwards (scoring, training, prefill): for them, and
for an eager decode step, :func:`decode_attention` computes what ``sdpa`` computes; only a compiled graph
changes (no copy of the cache per query head).

Example:
    >>> import torch
    >>> from types import SimpleNamespace
    >>> layer = SimpleNamespace(num_key_value_groups=4)
    >>> q, kv = torch.randn(2, 4, 1, 8), torch.randn(2, 1, 5, 8)
    >>> mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    >>> out, _ = decode_attention(layer, q, kv, kv, mask, scaling=0.5)
    >>> out.shape
    torch.Size([2, 1, 4, 8])
"""

from __future__ import annotations

from typing import Any

import torch

DECODE_ATTENTION = "flowopt_decode_sdpa"


def decode_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature: ``query`` ``[batch, heads, q, dim]``, ``key`` and ``value``
    ``[batch, kv_heads, length, dim]``; returns ``[batch, q, heads, dim]`` (and no weights)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = int(getattr(module, "num_key_value_groups", 1))
    one_query = query.shape[2] == 1
    shared_mask = attention_mask is None or attention_mask.shape[1] == 1  # one mask for all heads
    if not (one_query and groups > 1 and shared_mask and dropout == 0.0 and kwargs.get("softcap") is None
            and kwargs.get("position_bias") is None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    batch, heads, _, dim = query.shape
    folded = query.reshape(batch, heads // groups, groups, dim)  # a key head's query heads as its queries
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=attention_mask,
                                                           scale=scaling)
    return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def register() -> str:
    """Register :func:`decode_attention` with transformers (idempotent), with ``sdpa``'s masks; its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(DECODE_ATTENTION, decode_attention)
    # Without a mask function of its own, transformers builds no mask at all for a custom name.
    AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)
    return DECODE_ATTENTION


def use_decode_attention(decoder: torch.nn.Module, source: torch.nn.Module) -> bool:
    """Point ``decoder``, a module copy of ``source`` with its own config, at :func:`decode_attention` when it
    uses ``sdpa``; False (nothing changed) otherwise. Raises ``ValueError`` if the copy shares a config with
    ``source``, whose own attention must not change.

    Example:
        >>> use_decode_attention(twin_body, model.get_decoder())  # doctest: +SKIP
        True
    """
    configs = _configs(decoder)
    if configs.keys() & _configs(source).keys():
        raise ValueError("the decode copy shares its config with the model; copy the modules first")
    return _switch(configs)


def compile_with_decode_attention(model: torch.nn.Module) -> bool:
    """Point ``model``'s own attention at :func:`decode_attention` (in place) when it uses ``sdpa``, for a decode
    step that is compiled; False (nothing changed) otherwise.

    Its other forwards are unchanged: :func:`decode_attention` hands them to transformers' ``sdpa``, and
    folds a single query token as ``sdpa`` itself does when not compiling. The name is not saved with the
    model (transformers keeps it out of ``config.json``).

    Example:
        >>> compile_with_decode_attention(model)  # doctest: +SKIP
        True
    """
    return _switch(_configs(model))


def attention_name(model: torch.nn.Module) -> str:
    """The attention implementation ``model``'s config names (``"sdpa"``, :data:`DECODE_ATTENTION`, ...).

    Example:
        >>> attention_name(model)  # doctest: +SKIP
        'sdpa'
    """
    return str(getattr(model.config, "_attn_implementation", None) or "sdpa")


def _configs(module: torch.nn.Module) -> dict[int, Any]:
    """The distinct configs of ``module``'s submodules, by id."""
    return {id(c): c for m in module.modules() if (c := getattr(m, "config", None)) is not None}


def _switch(configs: dict[int, Any]) -> bool:
    """Set every config in ``configs`` to :data:`DECODE_ATTENTION` if all of them use ``sdpa``."""
    if not configs or any(getattr(c, "_attn_implementation", None) != "sdpa" for c in configs.values()):
        return False
    name = register()
    for config in configs.values():
        config._attn_implementation = name
    return True
