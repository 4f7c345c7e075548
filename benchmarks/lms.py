"""The LM behind ``flowopt bench --lm`` (and ``--teacher``): a local model or a litellm provider/model.

Example:
    >>> from flowopt.benchmarks.lms import make_lm
    >>> make_lm("openai/gpt-4o-mini", max_tokens=8)[0].model
    'openai/gpt-4o-mini'
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dspy

from flowopt.errors import ConfigError


def make_lm(model: str, *, api_base: str | None = None, max_tokens: int = 256, batch: int = 16,
            compile: bool | None = None, quantize: str | None = None) -> tuple[Any, Any]:
    """The LM and adapter for ``--lm``: local models (embedded name or folder) get the completion adapter
    and generate up to ``batch`` concurrent calls as one batch; ``compile`` compiles their decode step
    (None: on CUDA only); ``quantize`` decodes steps of up to 16 rows through a quantized twin (CPU)."""
    if model.startswith("local/") or model == "gemma-3-270m" or Path(model).is_dir():
        from flowopt.lm import LocalLM, adapter_for

        local = LocalLM(model.removeprefix("local/"), max_new_tokens=max_tokens, max_batch_size=batch,
                        compile=compile, quantize=quantize)
        return local.lm, adapter_for(local.lm)
    if "/" not in model:
        raise ConfigError(f"--lm {model!r} is neither a local model nor a litellm provider/model name",
                          fix="use e.g. --lm openai/gpt-4o-mini, --lm gemma-3-270m or a model folder")
    kwargs: dict[str, Any] = {"max_tokens": max_tokens}
    if api_base:
        kwargs["api_base"] = api_base
    if api_base and model.startswith("openai/"):
        kwargs["api_key"] = "local"  # OpenAI-compatible local servers ignore it; litellm insists on one
    return dspy.LM(model, **kwargs), None
