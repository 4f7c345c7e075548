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

from flowopt.lm.completion_adapter import AutoAdapter, CompletionAdapter, adapter_for
from flowopt.lm.engine import LocalDSPyLM, LocalEngine, local_of

# Importing flowopt.lm.local registers LocalLM as the builder of shared models (flowopt.lm.shared). Python runs
# this file before any module of the package, so a process that only imports flowopt.lm.engine (as DSPy does to
# rebuild a saved program's engine, LocalEngine.load_state) has the builder too.
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
