"""The two halves of a causal LM's forward pass, as the sampler and the scorer call them.

Both run the decoder (the transformer body) for hidden states and apply the output projection
(``lm_head``) themselves, only where logits are needed: the sampler at each row's last position, the
scorer at the completion tokens in vocabulary-sized chunks. Calling the decoder directly keeps any
LoRA layers (injected in place by PEFT) and gradient checkpointing in play. A final logit
soft-cap (Gemma 2) is applied as the model's own head applies it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Halves:
    """A causal LM split into ``decoder`` (ids -> hidden states) and ``head`` (hidden -> logits)."""

    decoder: Any
    head: Any
    softcap: float | None
    cache_arg: str  # the decoder's keyword for the KV cache: "cache" (transformers 5.2x) or "past_key_values"

    @property
    def vocab_size(self) -> int:
        return int(self.head.weight.shape[0])

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | dict[str, torch.Tensor],
               position_ids: torch.Tensor, *,
               cache: Any = None, use_cache: bool = False) -> tuple[torch.Tensor, Any]:
        """Last hidden states ``[N, T, H]`` and the KV cache (None without ``use_cache``)."""
        kwargs: dict[str, Any] = {}
        if cache is not None:
            kwargs[self.cache_arg] = cache
        out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           use_cache=use_cache, **kwargs)
        past = None
        if use_cache:
            past = out["cache"] if "cache" in out else out["past_key_values"]
        return out.last_hidden_state, past

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of ``hidden`` (any leading shape)."""
        import torch

        logits = self.head(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def halves(model: Any) -> Halves:
    """Split ``model`` (a transformers causal LM, or a PEFT model around one).

    Example:
        >>> from flowopt.optimizers.weights.tiny import tiny_causal_lm
        >>> halves(tiny_causal_lm(["red"])[0]).vocab_size
        15
    """
    from flowopt.errors import ConfigError

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if decoder is None or head is None:
        raise ConfigError(f"{type(base).__name__} does not expose its decoder and output projection",
                          fix="use a transformers causal LM (AutoModelForCausalLM)")
    softcap = getattr(getattr(base, "config", None), "final_logit_softcapping", None)
    return Halves(decoder, head, float(softcap) if softcap else None, _cache_arg(type(decoder)))


def _cache_arg(cls: Any) -> str:
    try:
        return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"
    except (TypeError, ValueError):
        return "past_key_values"
