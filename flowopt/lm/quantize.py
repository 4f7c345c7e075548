"""An opt-in, decode-only twin of a model with weight-only quantized linears (CPU).

A batch-1 decode step on a CPU reads every weight once per token, so its time is bounded below by the bytes
it reads: in bf16 the embedded Gemma 3 270M reads its 262k x 640 output projection and its 126 body linears
in full for every token (the measured split: ``benchmarks/results/decode_profile.md``).
:func:`decode_twin` builds a copy of the decoder and the output projection in which

- every ``nn.Linear`` of the body is int8 per output row (symmetric; torchao's ``Int8Tensor`` picks the
  scales), multiplied by torch's own weight-only int8 kernel ``aten._weight_int8pack_mm``;
- the output projection is int8 the same way (``"int8"``) or int4 in groups of 32 columns (``"int4"``;
  torchao's ``Int4OpaqueTensor`` quantizes and packs it for ``aten._weight_int4pack_mm_for_cpu``). It is a
  copy: the input embedding it is tied to stays exact;
- every Gemma-style RMSNorm (``x * rsqrt(mean(x^2) + eps) * (1 + w)`` in float32) is one fused
  ``torch.nn.functional.rms_norm`` with ``1 + w`` precomputed, instead of ~8 small kernels.

Everything else (embedding, rotary, attention, the KV cache) is the model's own modules and tensors,
shared, not copied. Steps of more than :data:`QUANTIZED_MAX_ROWS` rows (prefill, larger batches) go through
the exact weights (the twin keeps them by reference), so only small steps change. The twin is for decoding
only: scoring and training use the model itself, and :meth:`DecodeTwin.current` tells a caller when the
model's weights changed under the twin (rebuild it then).
"""

from __future__ import annotations

from typing import Any

import torch

from flowopt.errors import ConfigError

QUANTIZE_CHOICES = ("int8", "int4")
INT4_GROUP = 32  # columns per int4 scale: the finest group torchao's CPU packing takes (best accuracy)
# Steps of more rows use the exact weights. torch's weight-only kernels cost about one GEMV per row, while
# oneDNN's bf16 matmul reads the weights once for the whole batch: the twins' decode steps of the embedded
# Gemma are faster than exact ones at 1, 2 and 4 rows and slower at 8 (benchmarks/results/decode_step_rows.md),
# so the twin takes steps up to 4 rows (a bucket of 3 rows is 4) and 8-row steps stay exact.
QUANTIZED_MAX_ROWS = 4


def check_quantize(scheme: str | None, device: Any) -> None:
    """Raise :class:`ConfigError` unless ``scheme`` (None: off) can decode on ``device`` here."""
    if scheme is None:
        return
    if scheme not in QUANTIZE_CHOICES:
        raise ConfigError(f"unknown quantize setting {scheme!r}",
                          fix=f"pass one of {list(QUANTIZE_CHOICES)}, or None for the exact weights")
    if str(device).split(":")[0] != "cpu":
        raise ConfigError(f"quantize={scheme!r} decodes with CPU kernels only; the model is on {device}",
                          fix="leave quantize unset on GPUs (their decode step is compiled instead)")
    try:
        import torchao  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"quantize={scheme!r} needs torchao, which is not installed ({exc})",
                          fix="pip install 'torchao>=0.18'") from exc


class QuantizedLinear(torch.nn.Module):
    """Base of the twin's linears: a step of up to :data:`QUANTIZED_MAX_ROWS` rows through the quantized
    kernel, larger ones exactly.

    ``exact`` is the source ``nn.Linear`` (held by reference: its weight is shared, not copied).
    """

    def __init__(self, exact: torch.nn.Linear) -> None:
        super().__init__()
        self.exact = exact
        self.out_features = int(exact.weight.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] > QUANTIZED_MAX_ROWS:
            return torch.nn.functional.linear(x, self.exact.weight, self.exact.bias)
        out = self.multiply(flat.contiguous())
        if self.exact.bias is not None:
            out = out + self.exact.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def multiply(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def weight(self) -> torch.Tensor:
        """The exact weight (what callers reading ``head.weight.shape`` expect)."""
        return self.exact.weight


class Int8Linear(QuantizedLinear):
    """Weight-only int8, one scale per output row (torchao's ``Int8Tensor`` picks them).

    Example:
        >>> Int8Linear(torch.nn.Linear(64, 5, bias=False))(torch.ones(1, 64)).shape
        torch.Size([1, 5])
    """

    def __init__(self, exact: torch.nn.Linear) -> None:
        from torchao.quantization import PerRow
        from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor

        super().__init__(exact)
        with torch.no_grad():
            quantized = Int8Tensor.from_hp(exact.weight.detach(), PerRow())
        self.qdata = quantized.qdata.contiguous()
        self.scales = quantized.scale.reshape(-1).to(exact.weight.dtype)

    def multiply(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(flat.to(self.scales.dtype), self.qdata, self.scales)


class Int4Linear(QuantizedLinear):
    """Weight-only int4 (asymmetric, groups of :data:`INT4_GROUP` columns), packed for torch's CPU kernel
    by torchao's ``Int4OpaqueTensor``.

    Example:
        >>> Int4Linear(torch.nn.Linear(64, 5, bias=False).bfloat16())(torch.ones(1, 64).bfloat16()).shape
        torch.Size([1, 5])
    """

    def __init__(self, exact: torch.nn.Linear) -> None:
        from torchao.prototype.quantization.int4 import Int4OpaqueTensor

        super().__init__(exact)
        with torch.no_grad():
            packed = Int4OpaqueTensor.from_hp(exact.weight.detach(), [1, INT4_GROUP])
        self.qdata, self.scale_and_zero = packed.qdata, packed.scale_and_zero

    def multiply(self, flat: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.to(self.scale_and_zero.dtype), self.qdata,
                                                         INT4_GROUP, self.scale_and_zero)
        return out[:, :self.out_features]


class FusedGemmaNorm(torch.nn.Module):
    """A Gemma RMSNorm (``x * rsqrt(mean(x^2) + eps) * (1 + weight)`` in float32) as one ``F.rms_norm``.

    Example:
        >>> from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
        >>> FusedGemmaNorm(Gemma3RMSNorm(8))(torch.ones(2, 8)).shape
        torch.Size([2, 8])
    """

    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.eps = float(norm.eps)  # type: ignore[arg-type]
        with torch.no_grad():
            self.scale = 1.0 + norm.weight.detach().float()  # type: ignore[operator]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.rms_norm(x.float(), self.scale.shape, self.scale, self.eps)
        return out.to(x.dtype)


def is_gemma_norm(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a Gemma RMSNorm (scaled by ``1 + weight`` in float32; Llama's scale differently)."""
    name = type(module).__name__
    return name.startswith("Gemma") and name.endswith("RMSNorm") and hasattr(module, "eps") and \
        isinstance(getattr(module, "weight", None), torch.Tensor)


def quantizable(decoder: torch.nn.Module, head: Any, scheme: str) -> str | None:
    """Why this decoder and head cannot get a ``scheme`` twin, or None when they can."""
    if type(head) is not torch.nn.Linear:
        return f"the output projection is a {type(head).__name__}, not a plain torch.nn.Linear"
    if scheme == "int4" and head.weight.shape[0] % 16:  # torch's int4 CPU packing takes rows in sixteens
        return f"the vocabulary size {head.weight.shape[0]} is not a multiple of 16 (int4 packing)"
    adapters = [type(m).__name__ for m in decoder.modules() if hasattr(m, "base_layer")]
    if adapters:
        return f"the body holds adapter layers ({adapters[0]})"
    for module in [*(m for m in decoder.modules() if isinstance(m, torch.nn.Linear)), head]:
        weight = module.weight
        if weight.device.type != "cpu":
            return f"the weights are on {weight.device.type}; the quantized kernels run on CPU"
        if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"a weight's dtype is {weight.dtype}"
        if weight.shape[1] % 64:  # torch's int8/int4 CPU kernels need widths in multiples of 64
            return f"a linear's input width {weight.shape[1]} is not a multiple of 64"
    return None


class DecodeTwin:
    """The decoding twin of ``decoder`` and ``head`` (:func:`decode_twin`), and whether it is still current:
    :meth:`current` is False once any source weight moved or changed in place (an optimizer step bumps a
    tensor's version), and the caller builds a new twin.

    Example:
        >>> from transformers import Gemma3ForCausalLM, Gemma3TextConfig
        >>> model = Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=32, hidden_size=64, intermediate_size=128,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=64))
        >>> twin = DecodeTwin(model.get_decoder(), model.get_output_embeddings(), "int8")
        >>> twin.current(), type(twin.head).__name__
        (True, 'Int8Linear')
    """

    def __init__(self, decoder: torch.nn.Module, head: torch.nn.Linear, scheme: str) -> None:
        self._sources = [*decoder.parameters(), head.weight]
        self._key = self._weights_key()
        self.decoder, self.head = decode_twin(decoder, head, scheme)

    def _weights_key(self) -> list[tuple[int, int]]:
        return [(t.data_ptr(), t._version) for t in self._sources]

    def current(self) -> bool:
        return self._weights_key() == self._key


def decode_twin(decoder: torch.nn.Module, head: torch.nn.Linear, scheme: str) -> tuple[torch.nn.Module,
                                                                                    QuantizedLinear]:
    """``(decoder, head)`` for decoding: quantized linears and fused norms; every other tensor shared.

    Example:
        >>> body, head = decode_twin(model.get_decoder(), model.get_output_embeddings(), "int4")  # doctest: +SKIP
    """
    import copy

    shared = {id(t): t for t in [*decoder.parameters(), *decoder.buffers()]}
    twin = copy.deepcopy(decoder, memo=dict(shared))  # module objects copied, tensors shared
    for parent in list(twin.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, Int8Linear(child))
            elif is_gemma_norm(child):
                setattr(parent, name, FusedGemmaNorm(child))
    return twin, Int4Linear(head) if scheme == "int4" else Int8Linear(head)
