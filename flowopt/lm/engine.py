"""The DSPy side of a LocalLM: the one custom engine (``complete(Request) -> Response``) and its ``dspy.LM``.

DSPy 3.4 owns caching, retries, ``n`` fan-out (one engine call per candidate), history, usage
tracking and callbacks for any ``dspy.LM(model, engine=...)``; the engine only turns one canonical
request into one response. It serves evaluation threads (through the LocalLM's continuous batch) and
GRPO rollouts alike: a :class:`Lockstep` batching policy runs the rollouts' calls in lockstep, and a
``recorder`` hook sees every call's prompt ids, completion ids and log-probs.

:class:`LocalDSPyLM` is the ``dspy.LM`` of a LocalLM with two local twists: its model string carries a
tag that changes with the weights in use (DSPy's cache keys on the request, so an adapter switch must
change the request), and it knows its :class:`~flowopt.lm.local.LocalLM`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, Protocol

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
from flowopt.lm.batching import LockstepBatcher
from flowopt.lm.sampling import RowSettings, Sample
from flowopt.lm.shared import shared_local_lm

if TYPE_CHECKING:
    from collections.abc import Iterator

    from flowopt.lm.local import LocalLM


def request_messages(request: Request) -> list[dict[str, str]]:
    """OpenAI-style role/content dicts for a canonical request (text parts only)."""
    messages = []
    if request.system is not None:
        system = request.system if isinstance(request.system, str) else "".join(
            getattr(part, "text", "") or "" for part in request.system)
        if system:  # an empty system part is no system message
            messages.append({"role": "system", "content": system})
    for message in request.messages:
        text = message.text
        if text is None:
            raise UnsupportedFeatureError("local models take text messages only (no images, files or tool calls)",
                                          provider="local")
        messages.append({"role": message.role, "content": text})
    return messages


def row_settings(local: LocalLM, config: Any, *, temperature: float | None = None,
                 max_new_tokens: int | None = None, logprobs: bool = False) -> RowSettings:
    """Per-request decoding settings; unset values fall back to the LocalLM's defaults.

    ``temperature`` overrides the request's; ``max_new_tokens`` is the default and the cap of its
    ``max_tokens``; ``logprobs`` asks for per-token log-probs even when the request does not.
    """
    limit = int(config.max_tokens or max_new_tokens or local.max_new_tokens)
    if max_new_tokens is not None:
        limit = min(limit, max_new_tokens)
    if temperature is None:
        temperature = local.temperature if config.temperature is None else config.temperature
    return RowSettings(
        max_new_tokens=limit,
        temperature=float(temperature),
        top_p=1.0 if config.top_p is None else float(config.top_p),
        top_k=int(config.top_k or 0),
        seed=config.seed,
        stop=tuple(config.stop or ()),
        logprobs=logprobs or config.logprobs is not None,
    )


def sample_response(local: LocalLM, request: Request, sample: Sample) -> Response:
    """DSPy's response for one sampled completion (with token log-probs when the request asked)."""
    logprobs = None
    if request.config.logprobs is not None and sample.logprobs is not None:
        logprobs = tuple(
            TokenLogprob(token=local.tokenizer.decode([t]), logprob=float(s), token_id=int(t))
            for t, s in zip(sample.completion_ids, sample.logprobs.tolist()))
    return Response(
        id=f"local-{uuid.uuid4().hex[:16]}",
        model=request.model,
        message=Message.assistant(sample.text),
        finish_reason=sample.finish_reason,
        usage=Usage(input_tokens=len(sample.prompt_ids), output_tokens=len(sample.completion_ids)),
        logprobs=logprobs,
    )


class Batching(Protocol):
    """How the engine's calls reach the sampler (the default: the LocalLM's continuous batch)."""

    def submit(self, local: LocalLM, prompt_ids: list[int], settings: RowSettings, adapter: Any) -> Sample: ...


class Dynamic:
    """Evaluation threads: calls join the LocalLM's continuous batch (:mod:`flowopt.lm.continuous`)."""

    def submit(self, local: LocalLM, prompt_ids: list[int], settings: RowSettings, adapter: Any) -> Sample:
        return local.complete_ids(prompt_ids, settings, adapter=adapter)


class Lockstep:
    """GRPO rollouts: ``live`` program threads; a batch runs when every running one waits (sorted by
    ``key()``, the caller's rollout), on the thread that calls :meth:`serve`; ``generator`` seeds every draw.

    Example:
        >>> policy = Lockstep(local, live=8, key=lambda: current_rollout(), generator=gen)  # doctest: +SKIP
        >>> lm = dspy.LM("local/policy", engine=LocalEngine(local, batching=policy))  # doctest: +SKIP
    """

    def __init__(self, local: LocalLM, *, live: int, key: Callable[[], tuple[int, int] | None],
                 generator: Any = None, max_batch_size: int = 1024) -> None:
        self.local, self.key, self.generator = local, key, generator
        self.batcher: LockstepBatcher[tuple[list[int], RowSettings, Any], Sample] = LockstepBatcher(
            self._run, live=live, max_batch_size=max_batch_size)

    def submit(self, local: LocalLM, prompt_ids: list[int], settings: RowSettings, adapter: Any) -> Sample:
        local.check_length(prompt_ids, settings.max_new_tokens)
        return self.batcher.submit(self.key(), (prompt_ids, settings, adapter))

    def _run(self, items: list[tuple[list[int], RowSettings, Any]]) -> list[Sample]:
        results: list[Sample | None] = [None] * len(items)
        groups: dict[Hashable, list[int]] = {}
        for i, (_, _, adapter) in enumerate(items):
            groups.setdefault(adapter, []).append(i)
        for adapter, indices in groups.items():
            out = self.local.sample_ids([items[i][0] for i in indices], [items[i][1] for i in indices],
                                        adapter=adapter, generator=self.generator)
            for i, one in zip(indices, out):
                results[i] = one
        return [r for r in results if r is not None]

    def finished(self) -> None:
        """One program thread ended."""
        self.batcher.finished()

    def serve(self) -> None:
        """Run the batches on this thread until every program thread has finished."""
        self.batcher.serve()


class LocalEngine:
    """DSPy 3.4 engine over a :class:`~flowopt.lm.local.LocalLM`: one request, one sample from a batch.

    ``adapter`` pins the weights (an adapter's name, None for the base weights; ``...``: the LocalLM's
    default, see :meth:`~flowopt.lm.local.LocalLM.complete_ids`). ``batching`` decides how calls meet
    (default :class:`Dynamic`); ``recorder`` is called with every call's :class:`~flowopt.lm.sampling.Sample`
    (prompt ids, completion ids, log-probs), which GRPO records as transitions. ``temperature``
    overrides each request's, and ``max_new_tokens`` caps its ``max_tokens``.

    Example:
        >>> lm = dspy.LM("local/tiny", engine=LocalEngine(local))  # doctest: +SKIP
        >>> lm("Hello")  # doctest: +SKIP
    """

    def __init__(self, local: LocalLM, *, adapter: Any = ..., batching: Batching | None = None,
                 recorder: Callable[[Sample], None] | None = None, temperature: float | None = None,
                 max_new_tokens: int | None = None) -> None:
        self.local = local
        self.adapter = adapter
        self.batching: Batching = batching or Dynamic()
        self.recorder = recorder
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens

    def complete(self, request: Request) -> Response:
        validate_request(request)
        if request.tools:
            raise UnsupportedFeatureError("local models do not call tools natively", provider="local")
        local = self.local
        prompt_ids = local.render(request_messages(request))
        settings = row_settings(local, request.config, temperature=self.temperature,
                                max_new_tokens=self.max_new_tokens, logprobs=self.recorder is not None)
        try:
            sample = self.batching.submit(local, prompt_ids, settings, self.adapter)
        except LMError as exc:
            raise ContextLengthError(str(exc), provider="local") from exc
        if self.recorder is not None:
            self.recorder(sample)
        return sample_response(local, request, sample)

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
        # The process's LocalLM for the saved spec, built by the builder flowopt.lm.local registered (the
        # package imported it before this module): the engine never imports the module that imports it.
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
    ``engine`` defaults to a :class:`LocalEngine` on the LocalLM's own weights; a subclass pins other
    weights by passing its own (see :class:`~flowopt.lm.pinned.AdapterLM`).

    A program saved with DSPy (``program.save("p.json")``) records this LM as its class, settings and
    engine; ``program.load("p.json", allow_unsafe_lm_state=True)`` rebuilds the engine on the process's
    shared LocalLM for the saved spec and then calls ``LocalDSPyLM(**state)``: without ``local`` the LM is
    the engine's, and the saved ``model`` string is dropped (name and tag are the LocalLM's).

    Example:
        >>> lm = local.lm  # doctest: +SKIP
        >>> lm.copy(temperature=0.7)("Once upon a time")  # doctest: +SKIP
    """

    def __init__(self, local: LocalLM | None = None, *, engine: LocalEngine | None = None,
                 model: str | None = None, **kwargs: Any) -> None:
        if local is None:
            if engine is None:
                raise LMError("LocalDSPyLM needs a LocalLM or the LocalEngine of one",
                              fix="use local.lm, or LocalDSPyLM(local)")
            local = engine.local
        del model  # a saved "local/<name>@<tag>": the name and tag in use are the LocalLM's (see `model`)
        self._local = local
        self._model_name = f"local/{local.name}"
        super().__init__(self._model_name, engine=engine or LocalEngine(local), **kwargs)

    @property
    def model(self) -> str:
        return self._model_name + self.cache_tag()

    @model.setter
    def model(self, value: str) -> None:
        self._model_name = value.partition("@")[0]

    @property
    def local(self) -> LocalLM:
        return self._local

    def cache_tag(self) -> str:
        """The ``@<tag>`` of ``model``: the LocalLM's, which changes with the weights its unpinned calls use."""
        return self._local.cache_tag()

    def weights_spec(self) -> dict[str, Any]:
        """The spec of the weights this LM runs: the LocalLM's own."""
        return self._local.to_spec()

    def to_spec(self) -> dict[str, Any]:
        """The workflow-IR entry: :meth:`weights_spec` with this LM's temperature and max_tokens."""
        spec = self.weights_spec()
        if self.kwargs.get("temperature") is not None:
            spec["temperature"] = self.kwargs["temperature"]
        if self.kwargs.get("max_tokens") is not None:
            spec["max_new_tokens"] = self.kwargs["max_tokens"]
        return spec


def local_of(lm: Any) -> LocalLM | None:
    """The LocalLM behind a ``dspy.LM`` (None for hosted models)."""
    engine = getattr(lm, "engine", None)
    return engine.local if isinstance(engine, LocalEngine) else None
