"""LM entries of the workflow IR: model names and settings only, never secrets.

``lm_to_spec`` turns a ``dspy.LM`` into JSON data (dropping API keys, tokens and headers);
``lm_from_spec`` builds the LM back. Local models (``model`` starting with ``local/``) are built by
:mod:`flowopt.lm`, hosted ones by ``dspy.LM`` (litellm).
"""

from __future__ import annotations

import re
from typing import Any

import dspy

from flowopt.errors import SchemaError

# Any setting whose name looks like a credential is dropped on export, whatever the provider. A name
# ending in "token" (auth_token, hf_token) is one; "max_tokens" and "max_new_tokens" are not.
_SECRET = re.compile(r"(api_?key|secret|passw|authorization|headers|credential|bearer|token$)", re.I)
# Client objects and callables are not data.
_SKIPPED = {"callbacks", "engine", "provider", "cache", "num_retries_fn"}


def is_secret_setting(name: str) -> bool:
    return bool(_SECRET.search(name))


def lm_to_spec(lm: Any) -> dict[str, Any]:
    """JSON data describing ``lm`` (model plus plain settings); secrets are never included."""
    if hasattr(lm, "to_spec"):
        spec = dict(lm.to_spec())
    else:
        model = getattr(lm, "model", None)
        if not isinstance(model, str):
            raise SchemaError(f"cannot describe LM {lm!r}: it has no model name",
                              fix="bind a dspy.LM or a flowopt LocalLM")
        spec = {"model": model}
        spec.update(getattr(lm, "kwargs", {}) or {})
        spec["model_type"] = getattr(lm, "model_type", "chat")
    clean: dict[str, Any] = {}
    for key, value in spec.items():
        if is_secret_setting(key) or key in _SKIPPED:
            continue
        if isinstance(value, str | int | float | bool) or value is None:
            clean[key] = value
        elif isinstance(value, list) and all(isinstance(v, str | int | float) for v in value):
            clean[key] = list(value)
    return clean


def lm_from_spec(spec: dict[str, Any]) -> Any:
    """Build an LM from an IR entry. Keys are read from the environment by litellm, never the file."""
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), str):
        raise SchemaError(f"an 'lms' entry needs a 'model' string, got {spec!r}",
                          fix='write {"model": "openai/gpt-4o-mini", "temperature": 0.0}')
    settings = {k: v for k, v in spec.items() if not is_secret_setting(k)}
    if settings["model"].startswith("local/"):
        from flowopt.lm import lm_from_spec as local_lm_from_spec

        return local_lm_from_spec(settings)
    model = settings.pop("model")
    return dspy.LM(model, **settings)
