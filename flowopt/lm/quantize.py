"""An opt-in, decode-only twin of a model with quantized linears (CPU).

A batch-1 decode step on a CPU reads every weight once per token, so its time is bounded below by the bytes
it reads: in bf16 the embedded Gemma 3 270M reads its 262k x 640 output projection and its 126 body linears
in full for every token (the measured split: ``benchmarks/results/decode_profile.md``).
:func:`decode_twin` builds a copy of the decoder and the output projection in which

- every ``nn.Linear`` of the body is int8 per output row (symmetric; torchao's ``Int8Tensor`` picks the
  scales);
- the output projection is int8 the same way (``"int8"``), or int4 in groups of 32 columns (``"int4"``;
  torchao's ``Int4OpaqueTensor`` quantizes and packs it for ``aten._weight_int4pack_mm_for_cpu``) with an
  int8 copy for larger steps. It is a copy: the input embedding it is tied to stays exact;
- every Gemma-style RMSNorm (``x * rsqrt(mean(x^2) + eps) * (1 + w)`` in float32) is one fused
  ``torch.nn.functional.rms_norm`` with ``1 + w`` precomputed, instead of ~8 small kernels.
- attention reads a grouped-query cache once per key head, compiled or not
  (:func:`flowopt.lm.attention.decode_attention`), instead of a copy per query head.

How a step multiplies depends on its rows (``benchmarks/results/decode_step_rows.md`` measures why):

- up to :data:`QUANTIZED_MAX_ROWS` rows: weight-only kernels (``aten._weight_int8pack_mm``, or the int4 one
  for an int4 projection), which read the fewest bytes but cost about one GEMV per row;
- up to :data:`DYNAMIC_MAX_ROWS` rows: int8 activations, quantized per row at each step, times the int8
  weights (``torch._int_mm``, int32 sums), which reads the weights once for all rows. A row's result does not
  depend on the other rows of its step (per-row scales, exact integer sums);
- more rows: the exact weights (the twin keeps them by reference). Prefill always uses the exact weights.

Everything else (embedding, rotary, the attention modules, the KV cache) is the model's own tensors,
shared, not copied (the module objects and the config are copies). The twin is for decoding only: scoring
and training use the model itself, and :meth:`DecodeTwin.current` tells a caller when the model's weights
changed under the twin (rebuild it then).
"""

from __future__ import annotations

from typing import Any

import torch

from flowopt.errors import ConfigError
from flowopt.lm.attention import use_decode_attention

QUANTIZE_CHOICES = ("int8", "int4")
INT4_GROUP = 32  # columns per int4 scale: the finest group torchao's CPU packing takes (best accuracy)
# torch's weight-only kernels cost about one GEMV per row, while an int8 x int8 matmul reads the weights once
# for the whole step: on the embedded Gemma the weight-only steps are the fastest at 1, 2 and 4 rows and the
# dynamic int8 ones from 8 rows (benchmarks/results/decode_step_rows.md; a bucket of 3 rows is 4).
QUANTIZED_MAX_ROWS = 4
# Past this the exact weights are faster again (the same page: 32-row steps), as oneDNN's bf16 matmul catches up
# with torch._int_mm and the per-row quantizing is pure cost; larger steps (and every prefill) use them.
DYNAMIC_MAX_ROWS = 16


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


def int8_per_row(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (out x in) as int8 with one float32 scale per output row (symmetric; torchao's ``Int8Tensor``
    picks the scales).

    Example:
        >>> qdata, scales = int8_per_row(torch.ones(3, 64))
        >>> qdata.dtype, scales.shape
        (torch.int8, torch.Size([3]))
    """
    from torchao.quantization import PerRow
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor

    with torch.no_grad():
        quantized = Int8Tensor.from_hp(weight.detach(), PerRow())
    return quantized.qdata.contiguous(), quantized.scale.reshape(-1).float()


def dynamic_int8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x`` (rows x in) times the int8 ``weight`` (:func:`int8_per_row`), with ``x`` quantized to int8 per row
    (symmetric, absmax): ``torch._int_mm`` sums in int32, so each row's result depends on that row alone.

    torchao's ``Int8Tensor`` with ``act_quant_kwargs`` computes the same product, but its eager dispatch made
    decode steps slower than these few kernels do (``benchmarks/results/decode_step_rows.md``, its notes).

    Example:
        >>> weight, scales = int8_per_row(torch.eye(64))
        >>> torch.allclose(dynamic_int8_linear(torch.ones(2, 64), weight, scales), torch.ones(2, 64), atol=0.01)
        True
    """
    wide = x.float()
    row_scales = wide.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127
    quantized = torch.round(wide / row_scales).clamp(-127, 127).to(torch.int8)
    return (torch._int_mm(quantized, weight.t()).float() * row_scales * scales).to(x.dtype)


class QuantizedLinear(torch.nn.Module):
    """Base of the twin's linears: a step of up to :data:`QUANTIZED_MAX_ROWS` rows through the weight-only
    kernel (:meth:`multiply`), up to :data:`DYNAMIC_MAX_ROWS` rows through :func:`dynamic_int8_linear` with
    ``int8`` (the weight as :func:`int8_per_row` gives it), larger ones exactly.

    ``exact`` is the source ``nn.Linear`` (held by reference: its weight is shared, not copied).
    """

    def __init__(self, exact: torch.nn.Linear, int8: tuple[torch.Tensor, torch.Tensor]) -> None:
        super().__init__()
        self.exact = exact
        self.out_features = int(exact.weight.shape[0])
        self.int8_weight, self.int8_scales = int8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        rows = flat.shape[0]
        if rows > DYNAMIC_MAX_ROWS:
            return torch.nn.functional.linear(x, self.exact.weight, self.exact.bias)
        if rows > QUANTIZED_MAX_ROWS:
            out = dynamic_int8_linear(flat, self.int8_weight, self.int8_scales)
        else:
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
    """Int8, one scale per output row (:func:`int8_per_row`): small steps weight-only
    (``aten._weight_int8pack_mm``), larger ones with int8 activations too (the same int8 weight).

    Example:
        >>> Int8Linear(torch.nn.Linear(64, 5, bias=False))(torch.ones(1, 64)).shape
        torch.Size([1, 5])
    """

    def __init__(self, exact: torch.nn.Linear) -> None:
        super().__init__(exact, int8_per_row(exact.weight))
        self.kernel_scales = self.int8_scales.to(exact.weight.dtype)  # the weight-only kernel's scale dtype

    def multiply(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(flat.to(self.kernel_scales.dtype), self.int8_weight,
                                                  self.kernel_scales)


class Int4Linear(QuantizedLinear):
    """Weight-only int4 (asymmetric, groups of :data:`INT4_GROUP` columns), packed for torch's CPU kernel
    by torchao's ``Int4OpaqueTensor``, for small steps; larger ones use an int8 copy (:func:`int8_per_row`).

    Example:
        >>> Int4Linear(torch.nn.Linear(64, 16, bias=False).bfloat16())(torch.ones(1, 64).bfloat16()).shape
        torch.Size([1, 16])
    """

    def __init__(self, exact: torch.nn.Linear) -> None:
        from torchao.prototype.quantization.int4 import Int4OpaqueTensor

        super().__init__(exact, int8_per_row(exact.weight))
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
    use_decode_attention(twin, decoder)  # its own config (copied): the model keeps its attention
    return twin, Int4Linear(head) if scheme == "int4" else Int8Linear(head)
