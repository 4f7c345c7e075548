"""``LocalLM``: a transformers causal LM in this process, served to DSPy and to training code.

One object owns the weights, the tokenizer, the LoRA adapters and a continuous batch. DSPy sees it
through :attr:`LocalLM.lm`, a ``dspy.LM("local/<name>", engine=...)`` (DSPy 3.4's custom-engine
contract), so DSPy's cache, retries, ``n`` fan-out, history and callbacks apply unchanged. Training
code (the weights stages) uses the same object directly: :attr:`model`, :attr:`tokenizer`,
:meth:`render`, :meth:`generate`, :meth:`token_logprobs` and the adapter methods.

The class is assembled by purpose: loading and device/dtype choice (:mod:`flowopt.lm.loading`),
prompts (:mod:`flowopt.lm.prompts`), adapters (:mod:`flowopt.lm.adapters`), generation (the decode
loop over a static KV cache, :mod:`flowopt.lm.decoder`, fed by :mod:`flowopt.lm.continuous`) and scoring
(:mod:`flowopt.lm.scoring`); this module holds the object and its thin calls into them.
"""

from __future__ import annotations

import functools
import os
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowopt.errors import ConfigError, LMError
from flowopt.lm.adapters import AdapterSet
from flowopt.lm.continuous import ContinuousBatcher
from flowopt.lm.decode import OnTokens
from flowopt.lm.decoder import CompileSettings
from flowopt.lm.decoding import DecodeCapacity
from flowopt.lm.engine import LocalDSPyLM
from flowopt.lm.loading import contiguous_output_projection, dir_fingerprint, load_pretrained
from flowopt.lm.packing import pack
from flowopt.lm.prompts import RENDER_CACHE_SIZE, Prompt, PromptRendering
from flowopt.lm.sampling import RowSettings, Sample, derive_seed, sample
from flowopt.lm.scoring import completion_logprobs
from flowopt.lm.shared import register_builder
from flowopt.lm.stats import DecodeStats

if TYPE_CHECKING:
    import torch


class LocalLM(PromptRendering, AdapterSet, DecodeCapacity):
    """A local transformers model usable from DSPy (via :attr:`lm`) and from training code.

    ``model`` is a registered name (``"gemma-3-270m"``, the embedded default, converted once from the
    bundled GGUF) or a folder saved with ``save_pretrained`` (config, safetensors, tokenizer). Nothing is
    downloaded. The device is cuda > mps > cpu and the dtype bf16 on CUDA and on CPUs with native
    bf16, float32 elsewhere, unless given (:func:`pick_dtype`). ``chat=None`` uses the tokenizer's chat
    template when it has one; base models (no template, or ``chat=False``) get plain-text prompts and,
    through :func:`flowopt.lm.adapter_for`, the completion adapter.

    Example:
        >>> import dspy
        >>> from flowopt.lm import LocalLM, adapter_for
        >>> local = LocalLM("gemma-3-270m", max_new_tokens=128)   # doctest: +SKIP
        >>> dspy.configure(lm=local.lm, adapter=adapter_for(local.lm))  # doctest: +SKIP
        >>> dspy.ChainOfThought("question -> answer")(question="2 + 3?").answer  # doctest: +SKIP

    For training code: ``local.model`` (a ``PeftModel`` once an adapter is attached), ``local.tokenizer``,
    ``local.render(messages)`` (prompt ids exactly as generation builds them), ``local.generate(...)``
    (samples with prompt ids, completion ids and their log-probs), ``local.token_logprobs(...)`` and
    ``with local.using_adapter(None): ...`` (the reference model). Adapters attached with
    ``activate=False`` leave unpinned calls (``local.lm``) on their default weights, the base model
    unless one was loaded as the default (:mod:`flowopt.lm.adapters`). Hold ``local.lock`` around direct use
    of ``local.model`` when other threads may be generating (and make no LM calls while holding it: the
    batching thread needs it). After an optimizer step call :meth:`mark_weights_changed`, so DSPy's
    cache stops answering with the old weights' results.

    Concurrent calls share one continuous batch (rows join between decode steps and leave when they
    end) of at most ``max_batch_size`` rows (None: from the device's free memory). ``compile`` compiles
    the decode step with ``torch.compile`` once per batch bucket (None: on CUDA, where CUDA graphs pay,
    not on CPU, where compiling one bucket took longer than an evaluation); ``local.decode_stats.summary()``
    reports rows per step over time and compile seconds. ``quantize="int8"`` or ``"int4"`` (CPU, needs
    torchao) decodes steps of up to 16 rows of DSPy calls through a quantized twin of the model
    (:mod:`flowopt.lm.quantize`: weight-only kernels up to four rows, int8 activations times int8 weights up to
    16): faster steps at one to 16 concurrent calls, outputs close to but not always equal to the exact
    weights', so it is off by default; prefill, larger batches, training rollouts, scoring and adapters use the
    exact weights.

    Through DSPy, ``n`` candidates are ``n`` engine calls of one request (DSPy's fan-out); with a fixed
    ``seed`` they are therefore identical, so leave ``seed`` unset for diverse candidates, or use
    :meth:`generate` (``n`` per prompt, each sample its own derived seed).
    """

    def __init__(self, model: str | os.PathLike[str] = "gemma-3-270m", *, device: str | None = None,
                 dtype: str | torch.dtype | None = None, adapter: str | os.PathLike[str] | None = None,
                 chat: bool | None = None, name: str | None = None, max_new_tokens: int = 512,
                 temperature: float = 0.0, batch_wait_ms: float = 10.0, max_batch_size: int | None = None,
                 compile: bool | None = None, quantize: str | None = None, progress: bool = True) -> None:
        from flowopt.lm.gemma import ALIASES, check_loaded_model, check_tokenizer, ensure_gemma

        source = os.fspath(model)
        registered = ALIASES.get(source)
        if registered is not None:
            path = ensure_gemma(progress=progress)
            self.source: str | None = registered
            default_name, default_chat, fingerprint = registered, False, ""
        else:
            path = Path(source).expanduser()
            if not (path / "config.json").is_file():
                raise ConfigError(f"no local model at {source!r} (a folder with config.json was expected)",
                                  fix=f"pass a registered name ({', '.join(sorted(set(ALIASES.values())))}) "
                                      "or a folder written by save_pretrained")
            self.source = str(path.resolve())
            default_name, default_chat, fingerprint = path.resolve().name, None, dir_fingerprint(path)
        torch_model, tokenizer = load_pretrained(path, device, dtype)
        if registered is not None:  # a cache converted by an older transformers fails here, not silently
            check_loaded_model(torch_model, path)
            check_tokenizer(tokenizer, path)
        self._setup(torch_model, tokenizer, name=name or default_name,
                    chat=chat if chat is not None else default_chat, fingerprint=fingerprint, device=device,
                    dtype=dtype, max_new_tokens=max_new_tokens, temperature=temperature,
                    batch_wait_ms=batch_wait_ms, max_batch_size=max_batch_size, compile=compile, quantize=quantize)
        self.path: Path | None = path
        if adapter is not None:
            self.load_adapter(adapter)

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any, *, name: str, chat: bool | None = None,
                   max_new_tokens: int = 512, temperature: float = 0.0, batch_wait_ms: float = 10.0,
                   max_batch_size: int | None = None, compile: bool | None = None,
                   quantize: str | None = None) -> LocalLM:
        """Wrap an already loaded transformers model and tokenizer (kept on their device and dtype).

        Such a LocalLM has no source folder, so :meth:`to_spec` refuses it; save it first.
        """
        self = cls.__new__(cls)
        self.source, self.path = None, None
        param = next(model.parameters())
        self._setup(model, tokenizer, name=name, chat=chat, fingerprint=uuid.uuid4().hex[:12],
                    device=str(param.device), dtype=param.dtype, max_new_tokens=max_new_tokens,
                    temperature=temperature, batch_wait_ms=batch_wait_ms, max_batch_size=max_batch_size,
                    compile=compile, quantize=quantize)
        return self


    def _setup(self, model: Any, tokenizer: Any, *, name: str, chat: bool | None, fingerprint: str,
               device: Any, dtype: Any, max_new_tokens: int, temperature: float, batch_wait_ms: float,
               max_batch_size: int | None, compile: bool | None, quantize: str | None) -> None:
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}", fix="pass max_new_tokens=256")
        if temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {temperature}", fix="pass temperature=0.0")
        self.name = name
        self._model = model
        contiguous_output_projection(model)
        self.tokenizer = tokenizer
        tokenizer.padding_side = "left"
        if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
            tokenizer.pad_token = tokenizer.eos_token
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if chat and not has_template:
            raise ConfigError(f"model {name!r} has no chat template, so chat=True cannot be honoured",
                              fix="pass chat=None or False")
        self.chat: bool = has_template if chat is None else chat
        self._requested = {"device": None if device is None else str(device),
                           "dtype": None if dtype is None else str(dtype).replace("torch.", "")}
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.lock = threading.RLock()  # guards the model: batches, scoring and adapter changes
        self._fingerprint = fingerprint
        self._init_adapters()
        if max_batch_size is not None and max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be >= 1, got {max_batch_size}",
                              fix="pass max_batch_size=None (from the device's memory) or a positive number")
        self._max_batch_size = max_batch_size
        self._compile_asked = compile
        on_cuda = self.device.type == "cuda"
        # Compiling pays on CUDA (CUDA graphs remove the per-kernel launch cost of each step). On the shared
        # 2-core CPU, inductor took 1,017 s to compile the embedded Gemma's step for one batch bucket
        # (benchmarks/results/decode_side_by_side_cpu.md), more than a whole evaluation decodes in: off.
        self.compile_settings = CompileSettings(enabled=on_cuda if compile is None else bool(compile))
        if quantize is not None:
            from flowopt.lm.quantize import check_quantize

            check_quantize(quantize, self.device)
        self.quantize = quantize
        self.decode_stats = DecodeStats(cuda=on_cuda)
        self._decoders = {}
        self._batcher = ContinuousBatcher(
            lambda: self._decoder("continuous"), self.using_adapter, max_batch_size=lambda: self.max_batch_size,
            budget=self._cache_budget, wait_ms=batch_wait_ms, name=f"flowopt-lm-{name}")
        self._batch_wait_ms = batch_wait_ms
        self._lm: LocalDSPyLM | None = None
        self._render_messages = functools.lru_cache(maxsize=RENDER_CACHE_SIZE)(self._tokenize_messages)

    # -- identity ----------------------------------------------------------------------------------

    @property
    def model(self) -> Any:
        """The torch model: the transformers model, or a ``peft.PeftModel`` once an adapter is attached."""
        return self._model

    @property
    def base_model(self) -> Any:
        """The transformers model under any PEFT wrapper."""
        return self._model.get_base_model() if hasattr(self._model, "get_base_model") else self._model

    @property
    def device(self) -> torch.device:
        return next(self._model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.base_model.parameters()).dtype

    @property
    def lm(self) -> LocalDSPyLM:
        """The ``dspy.LM`` served by this model (created once, shared by every caller)."""
        if self._lm is None:
            self._lm = LocalDSPyLM(self, temperature=self.temperature, max_tokens=self.max_new_tokens)
        return self._lm

    @property
    def is_base(self) -> bool:
        """True when prompts are plain text (no chat template): such models want the completion adapter."""
        return not self.chat


    def check_length(self, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        """Raise :class:`~flowopt.errors.LMError` when the prompt plus ``max_new_tokens`` exceeds the context."""
        limit = getattr(self.base_model.config, "max_position_embeddings", None)
        if limit and len(prompt_ids) + max_new_tokens > limit:
            raise LMError(f"prompt of {len(prompt_ids)} tokens + {max_new_tokens} new tokens exceeds the "
                          f"model's context of {limit}", fix="shorten the prompt or lower max_tokens")

    # -- decoding ----------------------------------------------------------------------------------

    def sample_ids(self, prompts: Sequence[Sequence[int]], rows: Sequence[RowSettings], *, adapter: Any = ...,
                   generator: Any = None) -> list[Sample]:
        """Sample one completion per prompt in one round, in the calling thread (no batcher).

        ``adapter`` pins the weights (see :meth:`complete_ids`); ``generator`` draws every row's
        uniforms from one seeded stream (see :mod:`flowopt.lm.decode`).
        """
        for prompt, row in zip(prompts, rows):
            self.check_length(prompt, row.max_new_tokens)
        with self.using_adapter(adapter):
            return sample(self._model, self.tokenizer, prompts, rows, generator=generator,
                          decoder=self._decoder("direct"))

    def _pinned_state(self, adapter: Any) -> str | None:
        state = self._state() if adapter is ... else adapter
        if state is not None:
            self._check_name(state)
        return state

    def complete_ids(self, prompt_ids: Sequence[int], settings: RowSettings, *, adapter: Any = ...,
                     on_tokens: OnTokens | None = None) -> Sample:
        """Generate one completion in the continuous batch (what the DSPy engine calls; thread-safe).

        ``adapter`` pins the weights of this call: an attached adapter's name, or None for the base
        weights; the default (``...``) uses the default weights (:attr:`active_adapter`). Calls share a
        batch only with calls of the same weights. ``on_tokens(ids)``, when given, is called from the
        decode thread with each step's new token ids of this call (quick, and no model calls inside);
        returning False cancels it: the call returns what was decoded, ``finish_reason="cancelled"``
        (:mod:`flowopt.lm.continuous`).
        """
        self.check_length(prompt_ids, settings.max_new_tokens)
        state = self._pinned_state(adapter)
        return self._batcher.submit(list(prompt_ids), settings, group=state, on_tokens=on_tokens).result()

    def complete_many(self, prompt_ids: Sequence[int], settings: Sequence[RowSettings], *, adapter: Any = ...,
                      on_tokens: Callable[[int, list[int]], bool | None] | None = None) -> list[Sample]:
        """Several completions of one prompt in the continuous batch (thread-safe); ``adapter`` pins the
        weights as in :meth:`complete_ids`. ``on_tokens(index, ids)`` is one callback for all of them,
        given the completion's index in ``settings``; returning False cancels that completion only."""
        for row in settings:
            self.check_length(prompt_ids, row.max_new_tokens)
        state = self._pinned_state(adapter)
        futures = [self._batcher.submit(list(prompt_ids), row, group=state,
                                        on_tokens=None if on_tokens is None else functools.partial(on_tokens, i))
                   for i, row in enumerate(settings)]
        return [future.result() for future in futures]

    def generate(self, prompts: Sequence[Prompt], *, n: int = 1, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 stop: Sequence[str] = (), logprobs: bool = True, batch_size: int | None = None,
                 adapter: Any = ...) -> list[Sample]:
        """Sample ``n`` completions per prompt; returns ``len(prompts) * n`` samples.

        Samples come prompt-major (``prompts[0]``'s ``n`` first); ``sample.prompt_index`` says which prompt.
        Each has ``prompt_ids``, ``completion_ids`` and, with ``logprobs=True``, ``logprobs``: float32 CPU
        log-probs of each completion token under the distribution it was drawn from (``softmax(logits /
        temperature)``, temperature 1 when greedy), as the sampler computed them. With ``seed`` every
        sample is reproducible (sample ``k`` uses ``derive_seed(seed, k)``). Runs in the calling thread
        in chunks of ``batch_size``, with ``adapter`` pinned as in :meth:`complete_ids`.

        Example:
            >>> samples = local.generate([[{"role": "user", "content": "2+2="}]], n=4, temperature=1.0,
            ...                          max_new_tokens=16, seed=0)  # doctest: +SKIP
            >>> samples[0].completion_ids, samples[0].logprobs.shape  # doctest: +SKIP
        """
        if n < 1:
            raise ConfigError(f"n must be >= 1, got {n}", fix="pass n=1 or more")
        temp = self.temperature if temperature is None else temperature
        limit = max_new_tokens or self.max_new_tokens
        rows, ids, index = [], [], []
        for i, prompt in enumerate(prompts):
            prompt_ids = self.render(prompt)
            for j in range(n):
                rows.append(RowSettings(max_new_tokens=limit, temperature=temp, top_p=top_p, top_k=top_k,
                                        seed=None if seed is None else derive_seed(seed, i * n + j),
                                        stop=tuple(stop), logprobs=logprobs))
                ids.append(prompt_ids)
                index.append(i)
        size = batch_size or self.max_batch_size
        samples: list[Sample] = []
        for start in range(0, len(rows), size):
            samples.extend(self.sample_ids(ids[start:start + size], rows[start:start + size], adapter=adapter))
        for one, i in zip(samples, index):
            one.prompt_index = i
        return samples

    # -- scoring -----------------------------------------------------------------------------------

    def token_logprobs(self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], *,
                       grad: bool = False, temperature: float = 1.0) -> torch.Tensor:
        """Log-probabilities of each completion token after its prompt, batched (:mod:`flowopt.lm.scoring`).

        Returns a float32 ``[batch, longest_completion]`` tensor on the model's device, right-padded with
        0.0 (row ``i``'s valid length is ``len(completion_ids[i])``). With ``grad=True`` the graph is kept
        for a policy-gradient loss; otherwise it runs under ``torch.no_grad``. It computes with the
        selected weights (what a direct forward pass on :attr:`model` uses): wrap it in
        :meth:`using_adapter` or :meth:`adapter_disabled` for others (the reference model).

        Example:
            >>> new = local.token_logprobs([s.prompt_ids for s in samples],
            ...                            [s.completion_ids for s in samples], grad=True)  # doctest: +SKIP
        """
        import contextlib

        import torch

        if len(prompt_ids) != len(completion_ids):
            raise ValueError("one completion per prompt")
        width = max((len(c) for c in completion_ids), default=0)
        with self.lock, (contextlib.nullcontext() if grad else torch.no_grad()):
            if width == 0:
                return torch.zeros((len(prompt_ids), 0), device=self.device)
            batch = pack(prompt_ids, completion_ids, self.pad_id).to(self.device)
            return completion_logprobs(self._model, batch, temperature)[:, :width]

    @property
    def pad_id(self) -> int:
        """The id of padding columns (:func:`flowopt.lm.packing.pad_id`)."""
        from flowopt.lm.packing import pad_id

        return pad_id(self.tokenizer)

    @property
    def eos_ids(self) -> list[int]:
        """Ids that end a completion, the tokenizer's own EOS first (:func:`flowopt.lm.packing.eos_ids`)."""
        from flowopt.lm.packing import eos_ids

        return eos_ids(self._model, self.tokenizer)

    # -- specs -------------------------------------------------------------------------------------

    def to_spec(self) -> dict[str, Any]:
        """JSON data that rebuilds this LocalLM: source, adapter folder and settings, never weights."""
        if self.source is None:
            raise ConfigError(f"LocalLM {self.name!r} wraps an in-memory model and cannot be described",
                              fix="save it with model.save_pretrained(folder) and use LocalLM(folder)")
        adapter = None
        if self._default is not None:
            adapter = self._adapters[self._default]["path"]
            if adapter is None:
                raise ConfigError(f"adapter {self._default!r} exists only in memory",
                                  fix="call save_adapter(folder) before saving the workflow")
        return {"model": f"local/{self.name}", "source": self.source, "adapter": adapter, "chat": self.chat,
                "device": self._requested["device"], "dtype": self._requested["dtype"],
                "max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                "batch_wait_ms": self._batch_wait_ms, "max_batch_size": self._max_batch_size,
                "compile": self._compile_asked, "quantize": self.quantize}

    _SPEC_KEYS = frozenset({"model", "source", "adapter", "chat", "device", "dtype", "max_new_tokens",
                            "temperature", "batch_wait_ms", "max_batch_size", "compile", "max_tokens",
                            "model_type", "quantize"})

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> LocalLM:
        """Build a LocalLM from :meth:`to_spec` data (or just ``{"model": "local/gemma-3-270m"}``)."""
        model = spec.get("model")
        if not isinstance(model, str) or not model.startswith("local/"):
            raise ConfigError(f"a local LM spec needs model 'local/<name>', got {model!r}",
                              fix='write {"model": "local/gemma-3-270m"}')
        unknown = sorted(set(spec) - cls._SPEC_KEYS)
        if unknown:
            raise ConfigError(f"unknown settings for local model {model!r}: {unknown}",
                              fix=f"use only {sorted(cls._SPEC_KEYS)}")
        name = model[len("local/"):].partition("@")[0]
        source = spec.get("source") or name
        kwargs = {k: spec[k] for k in ("device", "dtype", "adapter", "chat", "max_new_tokens", "temperature",
                                       "batch_wait_ms", "max_batch_size", "compile", "quantize")
                  if spec.get(k) is not None}
        if spec.get("max_tokens") is not None and "max_new_tokens" not in kwargs:
            kwargs["max_new_tokens"] = int(spec["max_tokens"])
        return cls(source, name=name, **kwargs)

    # -- plumbing ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the decoding thread (the model stays usable for direct calls)."""
        self._batcher.close()

    def __deepcopy__(self, memo: dict[int, Any]) -> LocalLM:
        # DSPy deep-copies modules (and the LMs bound to them); the weights are a shared resource.
        return self

    def __copy__(self) -> LocalLM:
        return self

    def __repr__(self) -> str:
        adapter = f", adapter={self.active_adapter!r}" if self._adapters else ""
        return f"LocalLM({self.name!r}, device={str(self.device)!r}, dtype={str(self.dtype)!r}{adapter})"


# Shared models (flowopt.lm.shared) and saved engines (LocalEngine.load_state) are built by this class; they
# find it here rather than import this module, which imports the engine.
register_builder(LocalLM.from_spec)
