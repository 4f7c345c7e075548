"""The DSPy side of a LocalLM: a custom engine (``complete(Request) -> Response``) and its ``dspy.LM``.

DSPy 3.4 owns caching, retries, ``n`` fan-out (one engine call per candidate), history, usage
tracking and callbacks for any ``dspy.LM(model, engine=...)``; the engine only turns one canonical
request into one response. :class:`LocalDSPyLM` is that ``dspy.LM`` with two local twists: its model
string carries a tag that changes with the weights in use (DSPy's cache keys on the request, so an
adapter switch must change the request), and it knows its :class:`~flowopt.lm.local.LocalLM`.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

import dspy
from dspy.clients.engines.base import validate_request
from dspy.lm15 import (
    ContextLengthError,
    Message,
    Request,
    Response,
    TokenLogprob,
    UnsupportedFeatureError,
    Usage,
    response_to_events,
)

from flowopt.errors import LMError
from flowopt.lm.generation import RowSettings

if TYPE_CHECKING:
    from collections.abc import Iterator

    from flowopt.lm.local import LocalLM


def request_messages(request: Request) -> list[dict[str, str]]:
    """OpenAI-style role/content dicts for a canonical request (text parts only)."""
    messages = []
    if request.system is not None:
        system = request.system if isinstance(request.system, str) else "".join(
            getattr(part, "text", "") or "" for part in request.system)
        messages.append({"role": "system", "content": system})
    for message in request.messages:
        text = message.text
        if text is None:
            raise UnsupportedFeatureError("local models take text messages only (no images, files or tool calls)",
                                          provider="local")
        messages.append({"role": message.role, "content": text})
    return messages


def row_settings(local: LocalLM, config: Any) -> RowSettings:
    """Per-request decoding settings; unset values fall back to the LocalLM's defaults."""
    return RowSettings(
        max_new_tokens=int(config.max_tokens or local.max_new_tokens),
        temperature=float(local.temperature if config.temperature is None else config.temperature),
        top_p=1.0 if config.top_p is None else float(config.top_p),
        top_k=int(config.top_k or 0),
        seed=config.seed,
        stop=tuple(config.stop or ()),
    )


class LocalEngine:
    """DSPy 3.4 engine over a :class:`~flowopt.lm.local.LocalLM`: one request, one batched generation.

    Example:
        >>> lm = dspy.LM("local/tiny", engine=LocalEngine(local))  # doctest: +SKIP
        >>> lm("Hello")  # doctest: +SKIP
    """

    def __init__(self, local: LocalLM, *, adapter: Any = ...) -> None:
        self.local = local
        # ``...``: the model-wide adapter state; an adapter's name (or None for the base weights) pins
        # every call of this engine to those weights (see LocalLM.complete_ids).
        self.adapter = adapter

    def complete(self, request: Request) -> Response:
        validate_request(request)
        if request.tools:
            raise UnsupportedFeatureError("local models do not call tools natively", provider="local")
        local = self.local
        prompt_ids = local.render(request_messages(request))
        settings = row_settings(local, request.config)
        try:
            sample = local.complete_ids(prompt_ids, settings, adapter=self.adapter)
        except LMError as exc:
            raise ContextLengthError(str(exc), provider="local") from exc
        logprobs = None
        if request.config.logprobs is not None and sample.completion_ids:
            scores = local.token_logprobs([sample.prompt_ids], [sample.completion_ids])[0].tolist()
            logprobs = tuple(
                TokenLogprob(token=local.tokenizer.decode([t]), logprob=float(s), token_id=int(t))
                for t, s in zip(sample.completion_ids, scores))
        return Response(
            id=f"local-{uuid.uuid4().hex[:16]}",
            model=request.model,
            message=Message.assistant(sample.text),
            finish_reason=sample.finish_reason,
            usage=Usage(input_tokens=len(prompt_ids), output_tokens=len(sample.completion_ids)),
            logprobs=logprobs,
        )

    def stream(self, request: Request) -> Iterator[Any]:
        # Generation is not incremental here; a stream is the finished response as events.
        return iter(response_to_events(self.complete(request)))

    def close(self) -> None:
        """Nothing to release: the LocalLM owns the model and outlives any one dspy.LM."""

    # DSPy saves a custom engine as its class path plus dump_state(), and rebuilds it with load_state().
    def dump_state(self) -> dict[str, Any]:
        return self.local.to_spec()

    @classmethod
    def load_state(cls, state: dict[str, Any]) -> LocalEngine:
        from flowopt.lm import shared_local_lm

        return cls(shared_local_lm(state))

    def __deepcopy__(self, memo: dict[int, Any]) -> LocalEngine:
        return self

    def __repr__(self) -> str:
        return f"LocalEngine({self.local!r})"


class LocalDSPyLM(dspy.LM):
    """The ``dspy.LM`` of a :class:`~flowopt.lm.local.LocalLM` (get it as ``local.lm``).

    Behaves as any ``dspy.LM``; ``lm.local`` is the LocalLM and ``lm.to_spec()`` its workflow entry.
    Its ``model`` reads ``local/<name>`` plus ``@<tag>`` when the weights in use are not the registered
    ones (a folder, an adapter, weights changed in place), so DSPy's cache never mixes them.

    Example:
        >>> lm = local.lm  # doctest: +SKIP
        >>> lm.copy(temperature=0.7)("Once upon a time")  # doctest: +SKIP
    """

    def __init__(self, local: LocalLM, **kwargs: Any) -> None:
        self._local = local
        self._model_name = f"local/{local.name}"
        super().__init__(f"local/{local.name}", engine=LocalEngine(local), **kwargs)

    @property
    def model(self) -> str:
        return self._model_name + self._local.cache_tag()

    @model.setter
    def model(self, value: str) -> None:
        self._model_name = value.partition("@")[0]

    @property
    def local(self) -> LocalLM:
        return self._local

    def to_spec(self) -> dict[str, Any]:
        """The workflow-IR entry: the LocalLM's spec with this LM's temperature and max_tokens."""
        spec = self._local.to_spec()
        if self.kwargs.get("temperature") is not None:
            spec["temperature"] = self.kwargs["temperature"]
        if self.kwargs.get("max_tokens") is not None:
            spec["max_new_tokens"] = self.kwargs["max_tokens"]
        return spec
