"""The LocalLMs a process shares: one copy of the weights per model spec, and the ``dspy.LM`` of a spec entry."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import dspy

    from flowopt.lm.local import LocalLM


_shared: weakref.WeakValueDictionary[tuple, LocalLM] = weakref.WeakValueDictionary()
_shared_lock = threading.Lock()
_MODEL_KEYS = ("source", "adapter", "chat", "device", "dtype", "batch_wait_ms", "max_batch_size", "compile")


def shared_local_lm(spec: Mapping[str, Any]) -> LocalLM:
    """The LocalLM for ``spec``, loaded once per process and shared while anything holds it.

    Workflows name the same local model in many nodes; they must share one copy of the weights.
    """
    from flowopt.lm.local import LocalLM

    model = str(spec.get("model", ""))
    name = model[len("local/"):].partition("@")[0] if model.startswith("local/") else model
    key = (name, *(spec.get(k) for k in _MODEL_KEYS))
    with _shared_lock:
        local = _shared.get(key)
        if local is None:
            local = LocalLM.from_spec(spec)
            _shared[key] = local
        return local


def lm_from_spec(spec: Mapping[str, Any]) -> dspy.LM:
    """A ``dspy.LM`` for a workflow-IR entry whose model starts with ``local/``.

    Accepts what ``LocalDSPyLM.to_spec()`` writes, or just ``{"model": "local/gemma-3-270m"}``; per-entry
    ``temperature`` and ``max_new_tokens``/``max_tokens`` apply to the returned LM only.

    Example:
        >>> lm = lm_from_spec({"model": "local/gemma-3-270m", "temperature": 0.0})  # doctest: +SKIP
    """
    local = shared_local_lm(spec)
    overrides: dict[str, Any] = {}
    if spec.get("temperature") is not None:
        overrides["temperature"] = float(spec["temperature"])
    max_tokens = spec.get("max_new_tokens", spec.get("max_tokens"))
    if max_tokens is not None:
        overrides["max_tokens"] = int(max_tokens)
    return local.lm.copy(**overrides) if overrides else local.lm
