"""How big the continuous batch may grow, and the decoders a LocalLM keeps (a mixin of :class:`LocalLM`).

The batch cap follows the device unless given: the rows whose KV cache (2,048 columns each, or the
model's context if shorter) fits in a share of the memory free at first use (half of the GPU's, a
quarter of the CPU's), at most 256 on CUDA and 64 on CPU (where larger batches stop paying).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from flowopt.errors import ConfigError
from flowopt.lm.decoder import CompileSettings, Decoder
from flowopt.lm.slots import available_memory

if TYPE_CHECKING:
    import torch

    from flowopt.lm.stats import DecodeStats


class DecodeCapacity:
    """The batch cap (:attr:`max_batch_size`) and the per-purpose :class:`~flowopt.lm.decoder.Decoder` s."""

    name: str
    tokenizer: Any
    compile_settings: CompileSettings
    quantize: str | None
    decode_stats: DecodeStats
    _model: Any
    _max_batch_size: int | None
    _decoders: dict[str, Decoder]

    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    @property
    def base_model(self) -> Any:
        raise NotImplementedError

    @property
    def max_batch_size(self) -> int:
        """Rows one batch may hold: the explicit setting, else what the device's free memory allows (see the
        module's docstring)."""
        if self._max_batch_size is not None:
            return self._max_batch_size
        per_row = self._decoder("continuous").cache.bytes_per_slot(self._cache_columns())
        budget = self._cache_budget()
        ceiling = 256 if self.device.type == "cuda" else 64
        return ceiling if budget is None else max(1, min(ceiling, budget // per_row))

    def _cache_columns(self) -> int:
        limit = getattr(self.base_model.config, "max_position_embeddings", None) or 2048
        return min(int(limit), 2048)

    @functools.cached_property
    def _memory_budget(self) -> int | None:
        free = available_memory(self.device)
        if free is None:
            return None
        return int(free * (0.5 if self.device.type == "cuda" else 0.25))

    def _cache_budget(self) -> int | None:
        """Bytes the continuous batch's KV cache may take (from the free memory seen at first use)."""
        if self._max_batch_size is not None:
            return None
        return self._memory_budget

    def _decoder(self, purpose: str) -> Decoder:
        """The decoder of ``purpose``: "continuous" (the batching thread's) or "direct" (calls in the caller's
        thread, e.g. GRPO rounds); each has its own static cache, they share the compiled steps."""
        decoder = self._decoders.get(purpose)
        if decoder is None:
            # Only the batcher's decoder (DSPy calls, evaluation) may quantize: direct rounds are training
            # rollouts, whose sampled log-probs must match what scoring computes from the exact weights.
            decoder = Decoder(lambda: self._model, self.tokenizer, compile=self.compile_settings,
                              stats=self.decode_stats, quantize=self.quantize if purpose == "continuous" else None)
            reason = decoder.cache.supported()
            if reason is not None:
                raise ConfigError(f"model {self.name!r} cannot decode from a static cache: {reason}",
                                  fix="load it with attn_implementation='sdpa'")
            self._decoders[purpose] = decoder
        return decoder
