"""A batch-1 decode step on CPU in half precision: every linear layer as a matrix-vector product.

At batch 1 a decode step multiplies one row by each weight matrix. torch's bf16 ``F.linear`` sends it to a
oneDNN matmul; ``torch.mv`` on the same weight runs torch's own vectorised GEMV, which took less CPU on
the CPU measured (figures, and the load they were measured under: benchmarks/results/decode_profile.md).
:class:`SingleRowMatVec`
is a ``TorchFunctionMode`` that rewrites ``F.linear`` calls whose input is one row of a half-precision
dtype; everything else (float32, batches, prefill, LoRA's float32 adapters) runs unchanged. The decode
loop (:mod:`flowopt.lm.decoder`) enters it around eager batch-1 steps on CPU.

Example:
    >>> import torch
    >>> w, x = torch.randn(5, 3, dtype=torch.bfloat16), torch.randn(1, 1, 3, dtype=torch.bfloat16)
    >>> with SingleRowMatVec():
    ...     y = torch.nn.functional.linear(x, w)
    >>> tuple(y.shape)
    (1, 1, 5)
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_HALF = (torch.bfloat16, torch.float16)


class SingleRowMatVec(TorchFunctionMode):
    """``F.linear(x, w, b)`` with ``x`` one half-precision row computed as ``torch.mv(w, x) + b``."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and len(args) >= 2:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if (x.dtype in _HALF and weight.dtype == x.dtype and weight.dim() == 2
                    and x.numel() == weight.shape[1] and not x.requires_grad):
                out = torch.mv(weight, x.reshape(-1))
                if bias is not None:
                    out = out + bias
                return out.view(*x.shape[:-1], weight.shape[0])
        return func(*args, **kwargs)


def applies(device: Any, dtype: Any, rows: int) -> bool:
    """Whether a decode step of ``rows`` rows of a ``dtype`` model on ``device`` should run under the mode."""
    return rows == 1 and getattr(device, "type", str(device)) == "cpu" and dtype in _HALF
