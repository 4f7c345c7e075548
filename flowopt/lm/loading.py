"""Loading a local model: device and dtype choice, the weights folder's identity, and the model itself."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowopt.errors import ConfigError, LMError

if TYPE_CHECKING:
    import torch


def pick_device(device: str | None = None) -> str:
    """The requested device, or the best available one: cuda > mps > cpu."""
    import torch

    if device:
        return device
    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return "cpu"


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), so bf16 beats float32 there.

    Without it, torch emulates bf16 matmuls and they run slower than float32.
    """
    import torch

    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


def pick_dtype(device: str, dtype: str | torch.dtype | None = None) -> torch.dtype:
    """The requested dtype, or bf16 where the hardware computes in it and float32 elsewhere.

    bf16 on CUDA (when supported) and on CPUs with native bf16 (see :func:`cpu_has_native_bf16`): a
    decode step reads every weight once, so halving their bytes nearly halves its time on a CPU, and
    batched rows cost little more than one (measured: benchmarks/results/cpu_bf16_paths.md).
    """
    import torch

    if dtype is not None:
        if isinstance(dtype, torch.dtype):
            return dtype
        resolved = getattr(torch, str(dtype).replace("torch.", ""), None)
        if not isinstance(resolved, torch.dtype):
            raise ConfigError(f"unknown dtype {dtype!r}", fix="use 'float32', 'bfloat16' or 'float16'")
        return resolved
    if device.startswith("cuda") and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    if device == "cpu" and cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def _contiguous_first_input(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    first = args[0] if args else None
    if first is not None and hasattr(first, "is_contiguous") and not first.is_contiguous():
        return (first.contiguous(), *args[1:])
    return None


def contiguous_output_projection(model: Any) -> None:
    """Make the output projection (``lm_head``) always see a contiguous input.

    transformers slices the last hidden states (``logits_to_keep``) before the projection, which leaves
    a strided view. For a bf16 weight that does not require grad (frozen under a LoRA adapter) torch's
    CPU ``linear`` then takes a batched-matmul path that copies the whole weight per row: Gemma 3
    270M's 262k x 640 projection of 8 x 8 positions took 8.0 s instead of 0.1 s (torch 2.13). Copying the
    small slice first avoids it; elsewhere the copy costs next to nothing. Idempotent.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or getattr(head, "_flowopt_contiguous_input", False):
        return
    head.register_forward_pre_hook(_contiguous_first_input)
    head._flowopt_contiguous_input = True


def dir_fingerprint(path: Path) -> str:
    """Cheap identity of a weights folder: its location plus each file's name, size and mtime."""
    digest = hashlib.sha1(str(path.resolve()).encode())
    for item in sorted(path.iterdir()):
        if item.is_file():
            stat = item.stat()
            digest.update(f"{item.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:12]


def load_pretrained(path: Path, device: str | None, dtype: Any) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a ``save_pretrained`` folder, on the picked device and dtype, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    resolved_device = pick_device(device)
    resolved_dtype = pick_dtype(resolved_device, dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=resolved_dtype, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise LMError(f"could not load the model at {path}: {exc}",
                      fix="check that the folder holds config.json, weights and a tokenizer") from exc
    return model.to(resolved_device).eval(), tokenizer
