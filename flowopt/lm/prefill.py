"""Packed prefill: the prompts a decode batch admits together share the rows of one forward pass.

Left-padding every new prompt to the longest one wastes the padding's compute: eight GSM8K prompts of 32-117
tokens (503 in all) took 8 x 128 = 1,024 rows, and prefill is compute-bound. :func:`pack_prompts` places
the prompts one after another in as few rows as fit ``capacity`` tokens (first fit, longest first), each
prompt at positions from 0; :func:`packed_masks` lets a token attend only to its own prompt's earlier tokens
(and, in sliding-window layers, only the last ``window``), so every prompt's keys, values and last hidden
state are what it gets alone. :func:`prefill_into_slots` runs that forward on a cache of its own and copies
each prompt's keys and values into its slot of the decode batch's :class:`~flowopt.lm.slots.SlotCache`,
ending at column ``t``.

Example:
    >>> packed = pack_prompts([[5, 6, 7], [8], [9, 9]], pad=0, capacity=4, width_multiple=1)
    >>> packed.ids.tolist(), packed.positions.tolist()
    ([[5, 6, 7, 8], [9, 9, 0, 0]], [[0, 1, 2, 0], [0, 1, 0, 0]])
    >>> packed.places
    [(0, 0), (0, 3), (1, 0)]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flowopt.lm.packing import padded_length

if TYPE_CHECKING:
    import torch

    from flowopt.lm.forward import Halves
    from flowopt.lm.slots import SlotCache

#: Tokens one packed row takes at least (more when a prompt is longer): enough to fill a row with a few
#: prompts, small enough that attention over a row (quadratic in its length) stays cheap.
PACK_TOKENS = 512


@dataclass
class PackedPrompts:
    """Prompts packed into rows: ``ids``, ``positions`` and ``segments`` (the prompt each column holds, -1 for
    padding) are ``[rows, width]``; ``places[i]`` is prompt ``i``'s (row, first column), ``lengths[i]`` its
    tokens."""

    ids: torch.Tensor
    positions: torch.Tensor
    segments: torch.Tensor
    places: list[tuple[int, int]]
    lengths: list[int]


def pack_prompts(prompts: Sequence[Sequence[int]], *, pad: int, capacity: int, width_multiple: int) -> PackedPrompts:
    """Pack ``prompts`` into rows of at most ``max(capacity, longest prompt)`` tokens, first fit in order of
    decreasing length; the width is the fullest row's tokens rounded up to ``width_multiple``."""
    import torch

    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("pack_prompts needs prompts of at least one token")
    room = max(capacity, max(len(p) for p in prompts))
    used: list[int] = []
    places: list[tuple[int, int]] = [(0, 0)] * len(prompts)
    for i in sorted(range(len(prompts)), key=lambda i: -len(prompts[i])):
        row = next((r for r, tokens in enumerate(used) if tokens + len(prompts[i]) <= room), len(used))
        if row == len(used):
            used.append(0)
        places[i] = (row, used[row])
        used[row] += len(prompts[i])
    width = padded_length(max(used), width_multiple)
    ids = torch.full((len(used), width), pad, dtype=torch.long)
    positions = torch.zeros((len(used), width), dtype=torch.long)
    segments = torch.full((len(used), width), -1, dtype=torch.long)
    for i, (prompt, (row, first)) in enumerate(zip(prompts, places)):
        ids[row, first:first + len(prompt)] = torch.as_tensor(list(prompt), dtype=torch.long)
        positions[row, first:first + len(prompt)] = torch.arange(len(prompt))
        segments[row, first:first + len(prompt)] = i
    return PackedPrompts(ids, positions, segments, places, [len(p) for p in prompts])


def packed_masks(segments: torch.Tensor, window: int | None) -> torch.Tensor | dict[str, torch.Tensor]:
    """Boolean ``[rows, 1, width, width]`` mask (a ``{"full_attention", "sliding_attention"}`` dict when
    ``window`` is set): a token sees its own prompt's tokens up to itself (in sliding layers the last
    ``window`` of them); a padding column sees itself only, so no softmax row is empty.

    Example:
        >>> import torch
        >>> packed_masks(torch.tensor([[0, 0, 1, -1]]), None)[0, 0].int().tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    """
    import torch

    width = segments.shape[1]
    columns = torch.arange(width, device=segments.device)
    col, query = columns.view(1, 1, -1), columns.view(1, -1, 1)
    own = col == query
    visible = (segments.unsqueeze(2) == segments.unsqueeze(1)) & (segments.unsqueeze(2) >= 0) & (col <= query)
    full = (visible | own).unsqueeze(1)
    if window is None:
        return full
    # A prompt's columns are contiguous and its positions count from its first one: a window over columns
    # is the window over positions.
    sliding = ((visible & (col > query - window)) | own).unsqueeze(1)
    return {"full_attention": full, "sliding_attention": sliding}


def prefill_into_slots(parts: Halves, cache: SlotCache, prompts: Sequence[Sequence[int]], *, slots: Sequence[int],
                       end: int, pad: int, width_multiple: int) -> torch.Tensor:
    """Prefill ``prompts`` packed, write prompt ``i``'s keys and values into slot ``slots[i]`` of ``cache`` at
    the columns ending before ``end``, and return the float32 logits of each prompt's last token
    (``[prompts, vocabulary]``, in prompt order)."""
    import torch
    from transformers import DynamicCache

    packed = pack_prompts(prompts, pad=pad, capacity=PACK_TOKENS, width_multiple=width_multiple)
    device = cache.device
    segments, positions = packed.segments.to(device), packed.positions.to(device)
    masks = packed_masks(segments, cache.window)
    typed = {k: cache.typed(v) for k, v in masks.items()} if isinstance(masks, dict) else cache.typed(masks)
    # A cache without a config has only full-length layers: sliding-window ones would keep just their window.
    hidden, past = parts.hidden(packed.ids.to(device), typed, positions, cache=DynamicCache(), use_cache=True)
    # Every prompt column goes to its prompt's slot, at the column its position has counting back from ``end``.
    source = (segments >= 0).nonzero(as_tuple=True)
    prompt = segments[source]
    lengths = torch.tensor(packed.lengths, device=device)
    target = (torch.tensor(list(slots), device=device)[prompt], end - lengths[prompt] + positions[source])
    for layer, keys, values in zip(past.layers, cache.keys, cache.values, strict=True):
        keys[target[0], :, target[1]] = layer.keys[source[0], :, source[1]]
        values[target[0], :, target[1]] = layer.values[source[0], :, source[1]]
    places = torch.tensor(packed.places, device=device)  # [prompts, 2]: row, first column
    return parts.logits(hidden[places[:, 0], places[:, 1] + lengths - 1])
