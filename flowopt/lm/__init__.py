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

from typing import TYPE_CHECKING, Any

from flowopt.lm.completion_adapter import AutoAdapter, CompletionAdapter, adapter_for

if TYPE_CHECKING:
    from flowopt.lm.engine import LocalDSPyLM, LocalEngine, local_of
    from flowopt.lm.local import LocalLM
    from flowopt.lm.sampling import RowSettings, Sample
    from flowopt.lm.served_engine import ServerEngine
    from flowopt.lm.shared import lm_from_spec, shared_local_lm

__all__ = [
    "AutoAdapter",
    "CompletionAdapter",
    "LocalDSPyLM",
    "LocalEngine",
    "LocalLM",
    "RowSettings",
    "Sample",
    "ServerEngine",
    "adapter_for",
    "lm_from_spec",
    "local_of",
    "shared_local_lm",
]

_LAZY = {
    "LocalLM": "flowopt.lm.local",
    "LocalEngine": "flowopt.lm.engine",
    "LocalDSPyLM": "flowopt.lm.engine",
    "RowSettings": "flowopt.lm.sampling",
    "Sample": "flowopt.lm.sampling",
    "ServerEngine": "flowopt.lm.served_engine",
    "lm_from_spec": "flowopt.lm.shared",
    "local_of": "flowopt.lm.engine",
    "shared_local_lm": "flowopt.lm.shared",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'flowopt.lm' has no attribute {name!r}")
