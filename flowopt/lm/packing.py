"""Token layouts shared by the sampler, the scorer and training: left-padded prompts, completions after them.

Prompts are left-padded to a common width and completions right-padded after them (as in TRL), so
completion token ``j`` of every row sits in the same column, and positions are derived from the
attention mask as ``generate()`` does. Also the tokenizer facts every user of the layout needs: the
padding id and the end-of-sequence ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: Widths of prefill batches (:class:`~flowopt.lm.decoder.Decoder`) and training micro-batches are padded to a
#: multiple of this, so that a few shapes repeat: on CPU each new bf16 matmul shape costs a oneDNN kernel build
#: and the memory of its cached kernels (measured: benchmarks/results/main_command.md).
WIDTH_MULTIPLE = 64


def pad_id(tokenizer: Any) -> int:
    """The id padding columns hold: the pad token, else EOS, else 0."""
    for value in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if value is not None:
            return int(value)
    return 0


def eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """Every id that ends a completion (generation config and tokenizer); the tokenizer's own EOS first,
    since it is the one appended to training completions."""
    ids: set[int] = set()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for source in (getattr(base, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    first = tokenizer.eos_token_id
    if first is not None:
        return [int(first), *sorted(ids - {int(first)})]
    return sorted(ids)


def left_padded(prompts: Sequence[Sequence[int]], pad: int, *,
                pad_to_multiple_of: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, position_ids)`` of left-padded prompts (every prompt needs a token), the
    width rounded up to a multiple of ``pad_to_multiple_of``.

    Example:
        >>> ids, mask, positions = left_padded([[5, 6], [7]], pad=0)
        >>> ids.tolist(), positions.tolist()
        ([[5, 6], [0, 7]], [[0, 1], [0, 0]])
        >>> left_padded([[5, 6], [7]], pad=0, pad_to_multiple_of=3)[0].tolist()
        [[0, 5, 6], [0, 0, 7]]
    """
    import torch

    if any(len(p) == 0 for p in prompts):
        raise ValueError("a prompt has no tokens")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    width = padded_length(max(len(p) for p in prompts), pad_to_multiple_of)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):] = torch.as_tensor(list(prompt), dtype=torch.long)
        attention[i, width - len(prompt):] = 1
    return ids, attention, (attention.cumsum(-1) - 1).clamp(min=0)


@dataclass
class PackedBatch:
    """(prompt, completion) pairs as tensors; ``completion_mask`` is 1.0 on real completion tokens."""

    input_ids: torch.Tensor  # [N, P + C]
    attention_mask: torch.Tensor  # [N, P + C]
    position_ids: torch.Tensor  # [N, P + C]
    completion_ids: torch.Tensor  # [N, C]
    completion_mask: torch.Tensor  # [N, C], float

    @property
    def completion_width(self) -> int:
        return int(self.completion_ids.shape[1])

    def to(self, device: Any) -> PackedBatch:
        return PackedBatch(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.position_ids,
                                                     self.completion_ids, self.completion_mask)))


def pack(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int, *,
         pad_to_multiple_of: int = 1) -> PackedBatch:
    """Left-pad prompts, right-pad completions (at least one column); every prompt needs a token.

    ``pad_to_multiple_of`` adds left padding until the width is a multiple of it, so batches of similar
    lengths share one shape (training: see :func:`padded_length`).

    Example:
        >>> batch = pack([[5, 6], [7]], [[8], [9, 10]], pad_id=0)
        >>> batch.input_ids.tolist(), batch.completion_mask.tolist()
        ([[5, 6, 8, 0], [0, 7, 9, 10]], [[1.0, 0.0], [1.0, 1.0]])
        >>> pack([[5, 6], [7]], [[8], [9, 10]], pad_id=0, pad_to_multiple_of=3).input_ids.tolist()
        [[0, 0, 5, 6, 8, 0], [0, 0, 0, 7, 9, 10]]
    """
    import torch

    if len(prompts) != len(completions) or not prompts:
        raise ValueError("pack needs one completion per prompt and at least one pair")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("a prompt has no tokens")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    n = len(prompts)
    c_width = max(1, max(len(c) for c in completions))
    p_width = padded_length(max(len(p) for p in prompts) + c_width, pad_to_multiple_of) - c_width
    ids = torch.full((n, p_width + c_width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, p_width + c_width), dtype=torch.long)
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        start = p_width - len(prompt)
        ids[i, start:p_width] = torch.as_tensor(list(prompt), dtype=torch.long)
        if completion:
            ids[i, p_width:p_width + len(completion)] = torch.as_tensor(list(completion), dtype=torch.long)
        attention[i, start:p_width + len(completion)] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    return PackedBatch(ids, attention, positions, ids[:, p_width:].clone(), attention[:, p_width:].float())


def padded_length(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple``.

    Training micro-batches and prefill batches pad their width this way (to :data:`WIDTH_MULTIPLE`): CPU
    matmuls (oneDNN) build and cache a kernel per input shape, so widths that never repeat cost a kernel
    build and its cached memory at every batch, while a few widths are built once.

    Example:
        >>> padded_length(300, 64), padded_length(320, 64)
        (320, 320)
    """
    return -(-length // multiple) * multiple


def micro_batches(lengths: Sequence[int], *, max_rows: int, max_tokens: int | None = None) -> list[list[int]]:
    """Indices of ``lengths`` (sequence lengths) grouped into micro-batches for :func:`pack`.

    Rows are sorted by length, so each micro-batch pads little, then cut when a group reaches
    ``max_rows`` rows or when one more row would make it hold more than ``max_tokens`` padded
    positions (rows x its longest row). A training forward keeps activations for every padded position
    until its backward pass, so ``max_tokens`` bounds the memory of a step whatever the batch size and
    prompt lengths; a row longer than the budget gets a micro-batch of its own.

    Example:
        >>> micro_batches([5, 1, 4, 2], max_rows=8, max_tokens=8)
        [[1, 3], [2], [0]]
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    groups: list[list[int]] = []
    current: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: lengths[j]):
        # Sorted ascending, so row i is the longest of the group it joins.
        too_many = len(current) >= max_rows
        too_long = max_tokens is not None and (len(current) + 1) * lengths[i] > max_tokens
        if current and (too_many or too_long):
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups
