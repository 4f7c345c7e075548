"""The LocalLMs a process shares: one copy of the weights per model spec, and the ``dspy.LM`` of a spec entry.

This module knows no model class. :mod:`flowopt.lm.local` registers how a LocalLM is built from a spec
(:func:`register_builder`) when it is imported, and the package ``flowopt.lm`` imports it first, so anything
that reaches this module through the package finds the builder: ``LocalEngine.load_state``, which DSPy calls
after importing ``flowopt.lm.engine`` to rebuild a saved program's LM, included. Keeping the class out of
here is what lets the engine share models without importing the module that imports the engine.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from flowopt.errors import LMError

if TYPE_CHECKING:
    import dspy

    from flowopt.lm.local import LocalLM

#: Builds the LocalLM of a spec (``LocalLM.from_spec``, registered by :mod:`flowopt.lm.local`).
Builder = Callable[[Mapping[str, Any]], "LocalLM"]

_builder: Builder | None = None
_shared: weakref.WeakValueDictionary[tuple, LocalLM] = weakref.WeakValueDictionary()
_shared_lock = threading.Lock()
_MODEL_KEYS = ("source", "adapter", "chat", "device", "dtype", "batch_wait_ms", "max_batch_size", "compile")


def register_builder(builder: Builder) -> None:
    """Make ``builder`` build the LocalLMs this process shares (:mod:`flowopt.lm.local` registers
    ``LocalLM.from_spec`` on import; a later registration replaces it, as a reloaded module's does)."""
    global _builder
    _builder = builder


def shared_local_lm(spec: Mapping[str, Any]) -> LocalLM:
    """The LocalLM for ``spec``, loaded once per process and shared while anything holds it.

    Workflows name the same local model in many nodes; they must share one copy of the weights.
    """
    if _builder is None:  # unreachable through the package (it imports flowopt.lm.local first); said if that changes
        raise LMError("no LocalLM builder is registered: flowopt.lm.local, which registers it, was not imported",
                      fix="import flowopt.lm.local (importing the package flowopt.lm does) before loading local models")
    model = str(spec.get("model", ""))
    name = model[len("local/"):].partition("@")[0] if model.startswith("local/") else model
    key = (name, *(spec.get(k) for k in _MODEL_KEYS))
    with _shared_lock:
        local = _shared.get(key)
        if local is None:
            local = _builder(spec)
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
