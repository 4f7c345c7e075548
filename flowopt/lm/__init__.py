"""Local language models: ``LocalLM`` (transformers + PEFT in this process), the embedded Gemma 3 270M,
a completion adapter for base models, and ``flowopt serve`` (an OpenAI-compatible server).

Importing this package is cheap: torch and transformers load only when a LocalLM is built.

Example:
    >>> import dspy
    >>> from flowopt.lm import LocalLM, adapter_for
    >>> local = LocalLM("gemma-3-270m")  # doctest: +SKIP
    >>> dspy.configure(lm=local.lm, adapter=adapter_for(local.lm))  # doctest: +SKIP
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from flowopt.lm.completion_adapter import AutoAdapter, CompletionAdapter, adapter_for

if TYPE_CHECKING:
    import dspy

    from flowopt.lm.engine import LocalDSPyLM, LocalEngine
    from flowopt.lm.generation import RowSettings, Sample
    from flowopt.lm.local import LocalLM

__all__ = [
    "AutoAdapter",
    "CompletionAdapter",
    "LocalDSPyLM",
    "LocalEngine",
    "LocalLM",
    "RowSettings",
    "Sample",
    "adapter_for",
    "lm_from_spec",
    "local_of",
    "shared_local_lm",
]

_LAZY = {
    "LocalLM": "flowopt.lm.local",
    "LocalEngine": "flowopt.lm.engine",
    "LocalDSPyLM": "flowopt.lm.engine",
    "RowSettings": "flowopt.lm.generation",
    "Sample": "flowopt.lm.generation",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'flowopt.lm' has no attribute {name!r}")


_shared: weakref.WeakValueDictionary[tuple, LocalLM] = weakref.WeakValueDictionary()
_shared_lock = threading.Lock()
_MODEL_KEYS = ("source", "adapter", "chat", "device", "dtype", "batch_wait_ms", "max_batch_size")


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


def local_of(lm: Any) -> LocalLM | None:
    """The LocalLM behind a ``dspy.LM`` (None for hosted models)."""
    from flowopt.lm.engine import LocalEngine

    engine = getattr(lm, "engine", None)
    return engine.local if isinstance(engine, LocalEngine) else None
