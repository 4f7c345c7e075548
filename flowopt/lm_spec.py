"""LM entries of the workflow IR: model names and settings only, never secrets.

``lm_to_spec`` turns a ``dspy.LM`` into JSON data (dropping API keys, tokens and headers);
``lm_from_spec`` builds the LM back. Local models (``model`` starting with ``local/``) are built by
:mod:`flowopt.lm`, hosted ones by ``dspy.LM`` (litellm).

A loaded file never decides where the user's credentials go: entries read from JSON are
:class:`LoadedLMSpec` objects, and building one that sets anything beyond the model and its sampling
settings (``api_base``, ``base_url``, headers, provider routing, regions, deployments...) raises
:class:`~flowopt.errors.ConfigError` unless the caller trusted the file or bound that LM itself.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import dspy

from flowopt.errors import ConfigError, SchemaError

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


# Settings of a hosted LM that shape only what is asked and how it is sampled. Anything else (an allow-
# list, since litellm takes many routing settings: api_base, base_url, extra_headers,
# custom_llm_provider, api_version, aws_region_name, vertex_project, deployment_id, ...) may send the
# request, and the key litellm attaches to it, somewhere the user did not choose.
SAMPLING_SETTINGS = frozenset({
    "model", "model_type", "temperature", "max_tokens", "max_completion_tokens", "top_p", "n", "stop", "seed",
    "presence_penalty", "frequency_penalty", "reasoning_effort", "logprobs", "top_logprobs", "num_retries",
    "cache",
})


class LoadedLMSpec(dict[str, Any]):
    """An ``lms`` entry read from a file (or checkpoint): it may not choose endpoints until trusted.

    Example:
        >>> spec = LoadedLMSpec({"model": "openai/gpt-4o-mini", "api_base": "http://elsewhere/v1"})
        >>> endpoint_settings(spec)
        ['api_base']
    """


def endpoint_settings(spec: Mapping[str, Any]) -> list[str]:
    """The settings of ``spec`` that could change where requests (and credentials) go."""
    model = spec.get("model")
    if isinstance(model, str) and model.startswith("local/"):
        return []  # built by flowopt.lm from local files; LocalLM.from_spec checks its keys
    found = sorted(str(key) for key in spec if key not in SAMPLING_SETTINGS)
    # Some litellm providers take a URL as the model ("huggingface/https://host/...") and send the key there.
    if isinstance(model, str) and "://" in model:
        found.insert(0, "model")
    return found


def refuse_loaded_endpoints(lms: Mapping[str, Any], *, source: str = "the loaded workflow") -> None:
    """Raise :class:`ConfigError` for the first loaded, untrusted entry of ``lms`` that sets an endpoint."""
    for name, spec in lms.items():
        if isinstance(spec, LoadedLMSpec):
            _refuse(spec, name=str(name), source=source)


def trust_loaded_specs(lms: Mapping[str, Any]) -> dict[str, Any]:
    """``lms`` with every loaded entry turned into a plain (trusted) one: ``load(..., trust_endpoints=True)``."""
    return {name: dict(spec) if isinstance(spec, LoadedLMSpec) else spec for name, spec in lms.items()}


def _refuse(spec: LoadedLMSpec, *, name: str, source: str) -> None:
    keys = endpoint_settings(spec)
    if keys:
        shown = ", ".join(repr(k[:60]) for k in keys[:5])
        raise ConfigError(
            f"{source}: LM entry {name[:80]!r} sets {shown}, which can send your requests and API key to a "
            f"server the file chooses; loaded files may only name the model and its sampling settings",
            fix=f"bind the LM yourself (flowopt.load(path, lms={{{name[:80]!r}: dspy.LM(...)}})), or pass "
                f"trust_endpoints=True to flowopt.load if you wrote or trust this file")


def lm_from_spec(spec: dict[str, Any], *, name: str = "?") -> Any:
    """Build an LM from an IR entry. Keys are read from the environment by litellm, never the file.

    A :class:`LoadedLMSpec` that sets an endpoint is refused (:class:`ConfigError` naming ``name``)."""
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), str):
        raise SchemaError(f"an 'lms' entry needs a 'model' string, got {spec!r}",
                          fix='write {"model": "openai/gpt-4o-mini", "temperature": 0.0}')
    if isinstance(spec, LoadedLMSpec):
        _refuse(spec, name=name, source="a loaded workflow")
    settings = {k: v for k, v in spec.items() if not is_secret_setting(k)}
    if settings["model"].startswith("local/"):
        from flowopt.lm import lm_from_spec as local_lm_from_spec

        return local_lm_from_spec(settings)
    model = settings.pop("model")
    return dspy.LM(model, **settings)
