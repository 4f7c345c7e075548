"""A preallocated (static) KV cache of row slots, and the attention masks that read it.

The decode loop (:mod:`flowopt.lm.decode`) keeps every running row in a slot of one static cache:
per layer a ``[slots, kv_heads, length, head_dim]`` tensor for keys and one for values, allocated once
and written in place, so a compiled decode step sees the same tensors at every step (CUDA graphs need
fixed addresses). All rows write the column of the shared pointer ``t`` at each step (transformers'
``StaticLayer`` writes at its ``cumulative_length``); a row's own tokens sit in the columns from its
``start`` to ``t``, and a per-row mask hides everything else, so rows that joined at different times
share one step. Sliding-window layers get full-length slots too, and the window is applied by the mask
(the columns of a row are contiguous, so a window over columns is the window over positions).

Running rows occupy slots ``0 .. n-1`` (a leaving row's slot is refilled by the last row); a step runs
on the first ``bucket(n)`` slots (powers of two), each bucket a view of the same storage, so a compiled
step exists once per bucket and cache length, and no bucket change copies the cache.

Example:
    >>> cache = SlotCache(model)  # doctest: +SKIP
    >>> cache.ensure(slots=8, length=512); view = cache.view(0, 8)  # doctest: +SKIP
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MIN_LENGTH = 256  # cache columns are allocated in powers of two from here, so few shapes get compiled


def power_of_two(n: int, floor: int = 1) -> int:
    """The smallest power of two >= ``max(n, floor)``.

    Example:
        >>> power_of_two(5), power_of_two(1, floor=256)
        (8, 256)
    """
    size = 1
    while size < max(n, floor):
        size *= 2
    return size


class SlotCache:
    """Per-layer static key/value tensors of ``capacity`` row slots and ``length`` columns (grown on demand)."""

    def __init__(self, model: Any, *, static_addresses: bool = False) -> None:
        self.static_addresses = static_addresses  # mark tensors for CUDA graphs (imports torch._dynamo: seconds)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = base.config.get_text_config(decoder=True)
        self.layers = int(config.num_hidden_layers)
        heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        types = list(getattr(config, "layer_types", None) or [])
        window = getattr(config, "sliding_window", None)
        # Models with sliding layers (Gemma 2/3, ...) take one mask per layer type, as a dict.
        self.window: int | None = int(window) if window and "sliding_attention" in types else None
        self.attention = str(getattr(config, "_attn_implementation", "sdpa") or "sdpa")
        self.mask_kind = mask_form(self.attention)  # "sdpa" (boolean), "eager" (additive) or the name (none taken)
        param = next(base.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.capacity = 0
        self.length = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._views: dict[tuple[int, int], Any] = {}

    def bytes_per_slot(self, length: int) -> int:
        """Memory of one row's keys and values over ``length`` columns."""
        import torch

        size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers * self.kv_heads * self.head_dim * length * size

    def ensure(self, slots: int, length: int) -> bool:
        """Grow to at least ``slots`` slots and ``length`` columns (powers of two), keeping the contents.
        True when the storage was reallocated (views taken before are stale)."""
        import torch

        slots = max(power_of_two(slots), self.capacity)
        length = max(power_of_two(length, MIN_LENGTH), self.length)
        if slots == self.capacity and length == self.length:
            return False
        shape = (slots, self.kv_heads, length, self.head_dim)
        with torch.inference_mode():
            keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
            values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
            for new, old in zip(keys + values, self.keys + self.values):
                new[:self.capacity, :, :self.length] = old
        self.keys, self.values, self.capacity, self.length = keys, values, slots, length
        self._views.clear()
        return True

    def view(self, start: int, stop: int) -> Any:
        """A transformers ``Cache`` over slots ``start .. stop-1`` (static layers on views of the storage)."""
        key = (start, stop)
        cache = self._views.get(key)
        if cache is None:
            cache = self._views[key] = self._make_view(start, stop)
        return cache

    def _make_view(self, start: int, stop: int) -> Any:
        import torch
        from transformers.cache_utils import Cache, StaticLayer

        layers: list[Any] = []
        for keys, values in zip(self.keys, self.values):
            layer = StaticLayer(max_cache_len=self.length)
            layer.device = self.device
            layer.batch_size, layer.num_heads = stop - start, self.kv_heads
            layer.k_head_dim = layer.v_head_dim = self.head_dim
            layer.keys, layer.values = keys[start:stop], values[start:stop]
            layer.cumulative_length = torch.zeros((), dtype=torch.long, device=self.device)
            layer.is_initialized = True
            for tensor in (layer.keys, layer.values, layer.cumulative_length) if self.static_addresses else ():
                # Fixed addresses: a compiled step with CUDA graphs writes the cache in place.
                torch._dynamo.mark_static_address(tensor)
            layers.append(layer)
        return Cache(layers=layers)

    @staticmethod
    def set_column(cache: Any, column: int) -> None:
        """Make the next write of every layer of ``cache`` (a :meth:`view`) land in ``column``."""
        for layer in cache.layers:
            layer.cumulative_length.fill_(column)

    def move(self, source: int, target: int) -> None:
        """Copy slot ``source`` into slot ``target`` (a row changes slot)."""
        import torch

        with torch.inference_mode():
            for tensor in (*self.keys, *self.values):
                tensor[target].copy_(tensor[source])

    def shift(self, slots: int, by: int) -> None:
        """Move the columns of slots ``0 .. slots-1`` by ``by`` (negative: to the left); vacated columns
        keep stale values, which every row's mask hides."""
        import torch

        if by == 0 or slots == 0:
            return
        with torch.inference_mode():
            for tensor in (*self.keys, *self.values):
                part = tensor[:slots]
                if by < 0:
                    part[:, :, :by] = part[:, :, -by:].clone()
                else:
                    part[:, :, by:] = part[:, :, :-by].clone()

    def masks(self, starts: torch.Tensor, first: int, queries: int) -> Any:
        """The attention mask(s) of queries at columns ``first .. first+queries-1`` for rows whose tokens
        start at ``starts`` (``[rows]``): what the decoder takes as ``attention_mask``.

        A query sees its row's columns from ``start`` up to itself (and, in sliding layers, only the last
        ``window``); a query before its row's start (left padding) sees itself only, so no softmax row is
        empty (an empty one gives NaN, and NaN keys poison later steps even when masked).
        """
        import torch

        columns = torch.arange(self.length, device=self.device)
        query = first + torch.arange(queries, device=self.device)
        col, q = columns.view(1, 1, -1), query.view(1, -1, 1)
        own = col == q
        visible = (col >= starts.view(-1, 1, 1)) & (col <= q)
        full = (visible | own).unsqueeze(1)
        if self.window is None:
            return self.typed(full)
        sliding = ((visible & (col > q - self.window)) | own).unsqueeze(1)
        return {"full_attention": self.typed(full), "sliding_attention": self.typed(sliding)}

    def typed(self, mask: torch.Tensor) -> torch.Tensor:
        """``mask`` (boolean) as the attention implementation takes it: as is, or additive for eager."""
        import torch

        if self.mask_kind == "eager":  # eager attention adds its mask to the scores
            zero = torch.zeros((), dtype=self.dtype, device=self.device)
            return torch.where(mask, zero, torch.finfo(self.dtype).min)
        return mask

    def supported(self) -> str | None:
        """Why this model cannot decode from slots, or None when it can."""
        if self.mask_kind not in ("sdpa", "eager"):
            return f"attention implementation {self.attention!r} takes no custom mask (use sdpa or eager)"
        return None


def mask_form(attention: str) -> str:
    """The masks ``attention`` takes, by the mask function transformers registered for it: ``"sdpa"`` (boolean;
    also flowopt's decode attention, :mod:`flowopt.lm.attention`), ``"eager"`` (additive), else ``attention``
    itself (no custom mask).

    Example:
        >>> mask_form("sdpa"), mask_form("eager")
        ('sdpa', 'eager')
    """
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask

    function = ALL_MASK_ATTENTION_FUNCTIONS.get(attention)
    return "sdpa" if function is sdpa_mask else "eager" if function is eager_mask else attention


def available_memory(device: Any) -> int | None:
    """Free bytes on ``device`` (CUDA: free GPU memory; CPU: the OS's available memory), None if unknown."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None
