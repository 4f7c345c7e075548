"""``LocalLM``: a transformers causal LM in this process, served to DSPy and to training code.

One object owns the weights, the tokenizer, the LoRA adapters and a dynamic batcher. DSPy sees it
through :attr:`LocalLM.lm`, a ``dspy.LM("local/<name>", engine=...)`` (DSPy 3.4's custom-engine
contract), so DSPy's cache, retries, ``n`` fan-out, history and callbacks apply unchanged. Training
code (the weights stages) uses the same object directly: :attr:`model`, :attr:`tokenizer`,
:meth:`render`, :meth:`generate`, :meth:`token_logprobs` and the adapter methods.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowopt.errors import ConfigError, LMError
from flowopt.lm.batching import DynamicBatcher
from flowopt.lm.generation import RowSettings, Sample, derive_seed, generate_batch
from flowopt.lm.generation import token_logprobs as _token_logprobs

if TYPE_CHECKING:
    import torch

    from flowopt.lm.engine import LocalDSPyLM

logger = logging.getLogger(__name__)

Prompt = str | Sequence[Mapping[str, str]] | Sequence[int]
_RENDER_CACHE_SIZE = 2048  # distinct chat prompts kept tokenized (see LocalLM.render)
_ROLE_LABEL = {"user": "User", "assistant": "Assistant", "tool": "Tool"}


def pick_device(device: str | None = None) -> str:
    """The requested device, or the best available one: cuda > mps > cpu."""
    import torch

    if device:
        return device
    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return "cpu"


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), so bf16 beats float32 there.

    Without it, torch emulates bf16 matmuls and they run slower than float32.
    """
    import torch

    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


def pick_dtype(device: str, dtype: str | torch.dtype | None = None) -> torch.dtype:
    """The requested dtype, or bf16 where the hardware computes in it and float32 elsewhere.

    bf16 on CUDA (when supported) and on CPUs with native bf16 (see :func:`cpu_has_native_bf16`): a
    decode step reads every weight once, so halving their bytes nearly halves its time on a CPU, and
    batched rows cost little more than one (Gemma 3 270M on a 2-core AVX512-BF16 CPU: 58 ms per step
    at batch 1 and 85 ms at batch 8, against 116 and 202 ms in float32; benchmarks/perf/cpu_bf16_paths.py).
    """
    import torch

    if dtype is not None:
        if isinstance(dtype, torch.dtype):
            return dtype
        resolved = getattr(torch, str(dtype).replace("torch.", ""), None)
        if not isinstance(resolved, torch.dtype):
            raise ConfigError(f"unknown dtype {dtype!r}", fix="use 'float32', 'bfloat16' or 'float16'")
        return resolved
    if device.startswith("cuda") and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    if device == "cpu" and cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def _contiguous_first_input(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    first = args[0] if args else None
    if first is not None and hasattr(first, "is_contiguous") and not first.is_contiguous():
        return (first.contiguous(), *args[1:])
    return None


def contiguous_output_projection(model: Any) -> None:
    """Make the output projection (``lm_head``) always see a contiguous input.

    transformers slices the last hidden states (``logits_to_keep``) before the projection, which leaves
    a strided view. For a bf16 weight that does not require grad (frozen under a LoRA adapter) torch's
    CPU ``linear`` then takes a batched-matmul path that copies the whole weight per row: Gemma 3
    270M's 262k x 640 projection of 8 x 8 positions took 8.0 s instead of 0.1 s (torch 2.13). Copying the
    small slice first avoids it; elsewhere the copy costs next to nothing. Idempotent.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or getattr(head, "_flowopt_contiguous_input", False):
        return
    head.register_forward_pre_hook(_contiguous_first_input)
    head._flowopt_contiguous_input = True


def _dir_fingerprint(path: Path) -> str:
    """Cheap identity of a weights folder: its location plus each file's name, size and mtime."""
    digest = hashlib.sha1(str(path.resolve()).encode())
    for item in sorted(path.iterdir()):
        if item.is_file():
            stat = item.stat()
            digest.update(f"{item.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:12]


def base_transcript(messages: Sequence[Mapping[str, str]]) -> str:
    """Plain text for a model without a chat template.

    A lone user message is sent verbatim (the completion adapter writes the whole prompt itself);
    otherwise the system text comes first and each turn is labelled, ending with ``Assistant:``.
    """
    if len(messages) == 1 and messages[0].get("role", "user") == "user":
        return str(messages[0].get("content") or "")
    blocks = []
    for message in messages:
        role, content = message.get("role", "user"), str(message.get("content") or "")
        label = _ROLE_LABEL.get(role, role.title())
        blocks.append(content if role in ("system", "developer") else f"{label}: {content}")
    if messages and messages[-1].get("role") != "assistant":
        blocks.append("Assistant:")
    return "\n\n".join(blocks)


class LocalLM:
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
    (samples with prompt ids, completion ids and old log-probs), ``local.token_logprobs(...)`` and
    ``with local.adapter_disabled(): ...`` (the reference model). Hold ``local.lock`` around direct use
    of ``local.model`` when other threads may be generating (and make no LM calls while holding it: the
    batching thread needs it). After an optimizer step call :meth:`mark_weights_changed`, so DSPy's
    cache stops answering with the old weights' results.

    Through DSPy, ``n`` candidates are ``n`` engine calls of one request (DSPy's fan-out); with a fixed
    ``seed`` they are therefore identical, so leave ``seed`` unset for diverse candidates, or use
    :meth:`generate` (``n`` per prompt, each sample its own derived seed).
    """

    def __init__(self, model: str | os.PathLike[str] = "gemma-3-270m", *, device: str | None = None,
                 dtype: str | torch.dtype | None = None, adapter: str | os.PathLike[str] | None = None,
                 chat: bool | None = None, name: str | None = None, max_new_tokens: int = 512,
                 temperature: float = 0.0, batch_wait_ms: float = 10.0, max_batch_size: int = 16,
                 progress: bool = True) -> None:
        from flowopt.lm.gemma import ALIASES, check_loaded_model, ensure_gemma

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
            default_name, default_chat, fingerprint = path.resolve().name, None, _dir_fingerprint(path)
        torch_model, tokenizer = self._load(path, device, dtype)
        if registered is not None:
            check_loaded_model(torch_model, path)
        self._setup(torch_model, tokenizer, name=name or default_name,
                    chat=chat if chat is not None else default_chat, fingerprint=fingerprint, device=device,
                    dtype=dtype, max_new_tokens=max_new_tokens, temperature=temperature,
                    batch_wait_ms=batch_wait_ms, max_batch_size=max_batch_size)
        self.path: Path | None = path
        if adapter is not None:
            self.load_adapter(adapter)

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any, *, name: str, chat: bool | None = None,
                   max_new_tokens: int = 512, temperature: float = 0.0, batch_wait_ms: float = 10.0,
                   max_batch_size: int = 16) -> LocalLM:
        """Wrap an already loaded transformers model and tokenizer (kept on their device and dtype).

        Such a LocalLM has no source folder, so :meth:`to_spec` refuses it; save it first.
        """
        self = cls.__new__(cls)
        self.source, self.path = None, None
        param = next(model.parameters())
        self._setup(model, tokenizer, name=name, chat=chat, fingerprint=uuid.uuid4().hex[:12],
                    device=str(param.device), dtype=param.dtype, max_new_tokens=max_new_tokens,
                    temperature=temperature, batch_wait_ms=batch_wait_ms, max_batch_size=max_batch_size)
        return self

    @staticmethod
    def _load(path: Path, device: str | None, dtype: Any) -> tuple[Any, Any]:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        resolved_device = pick_device(device)
        resolved_dtype = pick_dtype(resolved_device, dtype)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=resolved_dtype, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise LMError(f"could not load the model at {path}: {exc}",
                          fix="check that the folder holds config.json, weights and a tokenizer") from exc
        return model.to(resolved_device).eval(), tokenizer

    def _setup(self, model: Any, tokenizer: Any, *, name: str, chat: bool | None, fingerprint: str,
               device: Any, dtype: Any, max_new_tokens: int, temperature: float, batch_wait_ms: float,
               max_batch_size: int) -> None:
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
        self._adapters: dict[str, dict[str, Any]] = {}  # name -> {"path": str | None, "fingerprint": str}
        self._active: str | None = None
        self._disabled = 0
        self._batcher: DynamicBatcher[tuple[list[int], RowSettings], Sample] = DynamicBatcher(
            self._run_batch, max_batch_size=max_batch_size, wait_ms=batch_wait_ms, name=f"flowopt-lm-{name}")
        self._lm: LocalDSPyLM | None = None
        # Rendered chat prompts by content: GRPO sends each prompt G times per step, and an evaluation
        # repeats a predictor's instructions and demos on every call; tokenizing is deterministic.
        self._render_messages = functools.lru_cache(maxsize=_RENDER_CACHE_SIZE)(self._tokenize_messages)

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
            from flowopt.lm.engine import LocalDSPyLM

            self._lm = LocalDSPyLM(self, temperature=self.temperature, max_tokens=self.max_new_tokens)
        return self._lm

    @property
    def is_base(self) -> bool:
        """True when prompts are plain text (no chat template): such models want the completion adapter."""
        return not self.chat

    def cache_tag(self) -> str:
        """Suffix of the DSPy model string that changes whenever the weights in use change.

        DSPy's cache keys on the request (model string included), not on the engine, so two checkpoints
        named alike, or one model before and after an adapter switch, must not share a model string.
        """
        parts = [self._fingerprint]
        if self._active is not None and not self._disabled:
            parts.append(f"{self._active}:{self._adapters[self._active]['fingerprint']}")
        if not any(parts):
            return ""
        return "@" + hashlib.sha1("|".join(parts).encode()).hexdigest()[:10]

    def mark_weights_changed(self) -> None:
        """Tell the LM that weights were updated in place (e.g. an optimizer step), so DSPy's cache
        stops answering with results of the old weights."""
        with self.lock:
            if self._active is not None:
                self._adapters[self._active]["fingerprint"] = uuid.uuid4().hex[:12]
                self._adapters[self._active]["path"] = None  # no longer what is on disk
            else:
                self._fingerprint = uuid.uuid4().hex[:12]

    # -- prompts -----------------------------------------------------------------------------------

    def render_text(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The prompt string for chat messages (``[{"role": ..., "content": ...}]``)."""
        if self.chat:
            msgs = [{"role": m.get("role", "user"), "content": str(m.get("content") or "")} for m in messages]
            prefill = bool(msgs) and msgs[-1]["role"] == "assistant"
            return self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=not prefill,
                                                      continue_final_message=prefill)
        return base_transcript(messages)

    def render(self, prompt: Prompt) -> list[int]:
        """Prompt token ids exactly as generation builds them.

        ``prompt`` is raw text (tokenized with the tokenizer's special tokens, e.g. ``<bos>``), a list of
        chat messages (rendered by :meth:`render_text`), or token ids (returned as they are).
        """
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        items: list[Any] = list(prompt)
        if all(isinstance(t, int) for t in items):
            return [int(t) for t in items]
        key = tuple((str(m.get("role", "user")), str(m.get("content") or "")) for m in items)
        return list(self._render_messages(key))

    def _tokenize_messages(self, messages: tuple[tuple[str, str], ...]) -> tuple[int, ...]:
        text = self.render_text([{"role": role, "content": content} for role, content in messages])
        # A chat template writes its own special tokens; a base transcript needs the tokenizer's.
        return tuple(self.tokenizer(text, add_special_tokens=not self.chat)["input_ids"])

    def _check_length(self, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        limit = getattr(self.base_model.config, "max_position_embeddings", None)
        if limit and len(prompt_ids) + max_new_tokens > limit:
            raise LMError(f"prompt of {len(prompt_ids)} tokens + {max_new_tokens} new tokens exceeds the "
                          f"model's context of {limit}", fix="shorten the prompt or lower max_tokens")

    # -- generation --------------------------------------------------------------------------------

    def _state(self) -> str | None:
        """The adapter a call made now should run with (None: base weights)."""
        return None if self._disabled else self._active

    @contextlib.contextmanager
    def _running_as(self, state: str | None) -> Iterator[None]:
        """Run with ``state``'s weights (caller holds the lock), then restore the model-wide state."""
        current = self._state()
        if state == current or not self._adapters:
            yield
            return
        peft = self._model.base_model
        try:
            if state is None:
                peft.disable_adapter_layers()
            else:
                if self._disabled:
                    peft.enable_adapter_layers()
                if state != self._active:
                    self._model.set_adapter(state)
            yield
        finally:
            if self._active is not None and state is not None and state != self._active:
                self._model.set_adapter(self._active)
            if self._disabled:
                peft.disable_adapter_layers()
            elif state is None:
                peft.enable_adapter_layers()

    def _run_batch(self, state: str | None, items: list[tuple[list[int], RowSettings]]) -> list[Sample]:
        with self.lock, self._running_as(state):
            return generate_batch(self._model, self.tokenizer, [i[0] for i in items], [i[1] for i in items])

    def complete_ids(self, prompt_ids: Sequence[int], settings: RowSettings, *, adapter: Any = ...) -> Sample:
        """Generate one completion through the dynamic batcher (what the DSPy engine calls; thread-safe).

        ``adapter`` pins the weights of this call: an attached adapter's name, or None for the base
        weights; the default (``...``) uses the model-wide state (:attr:`active_adapter`). Calls are
        batched only with calls of the same weights.
        """
        self._check_length(prompt_ids, settings.max_new_tokens)
        state = self._state() if adapter is ... else adapter
        if state is not None and state not in self._adapters:
            raise ConfigError(f"no adapter named {state!r}", fix=f"attached adapters: {self.adapters}")
        return self._batcher.submit((list(prompt_ids), settings), group=state)

    def complete_many(self, prompt_ids: Sequence[int], settings: Sequence[RowSettings]) -> list[Sample]:
        """Several completions of one prompt through the batcher (they join the same batch; thread-safe)."""
        for row in settings:
            self._check_length(prompt_ids, row.max_new_tokens)
        state = self._state()
        futures = [self._batcher.submit_async((list(prompt_ids), row), group=state) for row in settings]
        return [future.result() for future in futures]

    def generate(self, prompts: Sequence[Prompt], *, n: int = 1, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 stop: Sequence[str] = (), logprobs: bool = True, batch_size: int | None = None) -> list[Sample]:
        """Sample ``n`` completions per prompt, for rollouts; returns ``len(prompts) * n`` samples.

        Samples come prompt-major (``prompts[0]``'s ``n`` first); ``sample.prompt_index`` says which prompt.
        Each has ``prompt_ids``, ``completion_ids`` and, with ``logprobs=True``, ``logprobs``: the
        per-token log-probs of the completion under the weights that generated it (the GRPO "old"
        policy), computed by :meth:`token_logprobs` at temperature 1 so they match training-time scores.
        They are float32 CPU tensors. With ``seed`` every sample is reproducible (sample ``k`` uses
        ``derive_seed(seed, k)``). Runs in the calling thread in chunks of ``batch_size``.

        Example:
            >>> samples = local.generate([[{"role": "user", "content": "2+2="}]], n=4, temperature=1.0,
            ...                          max_new_tokens=16, seed=0)  # doctest: +SKIP
            >>> samples[0].completion_ids, samples[0].logprobs.shape  # doctest: +SKIP
        """
        import torch

        if n < 1:
            raise ConfigError(f"n must be >= 1, got {n}", fix="pass n=1 or more")
        temp = self.temperature if temperature is None else temperature
        limit = max_new_tokens or self.max_new_tokens
        rows, ids, index = [], [], []
        for i, prompt in enumerate(prompts):
            prompt_ids = self.render(prompt)
            self._check_length(prompt_ids, limit)
            for j in range(n):
                k = i * n + j
                rows.append(RowSettings(max_new_tokens=limit, temperature=temp, top_p=top_p, top_k=top_k,
                                        seed=None if seed is None else derive_seed(seed, k), stop=tuple(stop)))
                ids.append(prompt_ids)
                index.append(i)
        size = batch_size or self._batcher.max_batch_size
        samples: list[Sample] = []
        with self.lock:
            state = self._state()
            with self._running_as(state):
                for start in range(0, len(rows), size):
                    end = start + size
                    chunk = generate_batch(self._model, self.tokenizer, ids[start:end], rows[start:end])
                    if logprobs:
                        with torch.no_grad():
                            scores = _token_logprobs(self._model, self.tokenizer, [s.prompt_ids for s in chunk],
                                                     [s.completion_ids for s in chunk])
                        for sample, row in zip(chunk, scores):
                            sample.logprobs = row[: len(sample.completion_ids)].float().cpu()
                    samples.extend(chunk)
        for sample, i in zip(samples, index):
            sample.prompt_index = i
        return samples

    def token_logprobs(self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], *,
                       grad: bool = False, temperature: float = 1.0) -> torch.Tensor:
        """Log-probabilities of each completion token after its prompt, batched.

        Returns a ``[batch, longest_completion]`` tensor on the model's device, right-padded with 0.0
        (row ``i``'s valid length is ``len(completion_ids[i])``). With ``grad=True`` the graph is kept
        for a policy-gradient loss; otherwise it runs under ``torch.no_grad``. The adapter state is the
        current one: wrap in ``with local.adapter_disabled():`` for the reference model.

        Example:
            >>> new = local.token_logprobs([s.prompt_ids for s in samples],
            ...                            [s.completion_ids for s in samples], grad=True)  # doctest: +SKIP
        """
        import torch

        with self.lock, (contextlib.nullcontext() if grad else torch.no_grad()):
            return _token_logprobs(self._model, self.tokenizer, prompt_ids, completion_ids, temperature=temperature)

    # -- adapters ----------------------------------------------------------------------------------

    @property
    def adapters(self) -> list[str]:
        """Names of the attached LoRA adapters."""
        return list(self._adapters)

    @property
    def active_adapter(self) -> str | None:
        """The adapter calls use now (None when none is attached or inside :meth:`adapter_disabled`)."""
        return self._state()

    def load_adapter(self, path: str | os.PathLike[str], name: str | None = None, *, activate: bool = True,
                     trainable: bool = False) -> str:
        """Attach a saved PEFT adapter folder under ``name`` (default: the folder name); returns the name."""
        from peft import PeftModel

        folder = Path(path).expanduser()
        if not (folder / "adapter_config.json").is_file():
            raise ConfigError(f"no PEFT adapter at {str(path)!r} (adapter_config.json missing)",
                              fix="pass a folder written by save_adapter() or PeftModel.save_pretrained()")
        name = name or folder.resolve().name
        with self.lock:
            if name in self._adapters:
                raise ConfigError(f"an adapter named {name!r} is already attached",
                                  fix="pass another name= or unload_adapter() it first")
            try:
                if not self._adapters:
                    self._model = PeftModel.from_pretrained(self._model, str(folder), adapter_name=name,
                                                            is_trainable=trainable)
                else:
                    self._model.load_adapter(str(folder), adapter_name=name, is_trainable=trainable)
            except (OSError, ValueError, RuntimeError, KeyError) as exc:
                raise LMError(f"could not load adapter {folder}: {exc}",
                              fix="check that it was trained for this base model") from exc
            self._adapters[name] = {"path": str(folder.resolve()), "fingerprint": _dir_fingerprint(folder)}
            self._after_attach(name, activate)
        return name

    def add_adapter(self, name: str = "default", config: Any = None, *, activate: bool = True) -> Any:
        """Attach a fresh, trainable LoRA (``peft.LoraConfig``; default r=8 on all linear layers).

        Returns :attr:`model` (the ``PeftModel``) for the optimizer. Call :meth:`mark_weights_changed`
        after updating it so DSPy's cache does not serve results of earlier weights.
        """
        from peft import LoraConfig, get_peft_model

        config = config or LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
                                      task_type="CAUSAL_LM")
        with self.lock:
            if name in self._adapters:
                raise ConfigError(f"an adapter named {name!r} is already attached", fix="pass another name=")
            if not self._adapters:
                self._model = get_peft_model(self._model, config, adapter_name=name)
            else:
                self._model.add_adapter(name, config)
            self._adapters[name] = {"path": None, "fingerprint": uuid.uuid4().hex[:12]}
            self._after_attach(name, activate)
            return self._model

    def _after_attach(self, name: str, activate: bool) -> None:
        if activate or self._active is None:
            self._model.set_adapter(name)
            self._active = name
        else:
            self._model.set_adapter(self._active)
        if self._disabled:
            self._model.base_model.disable_adapter_layers()

    def set_adapter(self, name: str) -> None:
        """Make ``name`` the adapter that calls use."""
        with self.lock:
            if name not in self._adapters:
                raise ConfigError(f"no adapter named {name!r}", fix=f"attached adapters: {self.adapters}")
            self._model.set_adapter(name)
            self._active = name

    def unload_adapter(self, name: str | None = None) -> None:
        """Remove an adapter (default: the active one). The most recently attached remaining adapter
        becomes active; with none left, the plain transformers model is restored."""
        with self.lock:
            name = name or self._active
            if name is None or name not in self._adapters:
                raise ConfigError(f"no adapter named {name!r}", fix=f"attached adapters: {self.adapters}")
            del self._adapters[name]
            if not self._adapters:
                self._model = self._model.unload()  # drops the LoRA layers, no merge
                self._active = None
                return
            self._model.delete_adapter(name)
            if self._active == name:
                self._active = None
            self._after_attach(self._active or list(self._adapters)[-1], activate=True)

    def save_adapter(self, path: str | os.PathLike[str], name: str | None = None) -> Path:
        """Save an adapter (default: the active one) as a PEFT folder at exactly ``path``; returns it.

        The folder is written beside ``path`` and moved into place, so a crash leaves either the old
        folder or the new one, never half of each. Later specs (and :meth:`adapter_path`) name it.
        """
        import shutil
        import tempfile

        with self.lock:
            name = name or self._active
            if name is None or name not in self._adapters:
                raise ConfigError(f"no adapter named {name!r} to save", fix=f"attached adapters: {self.adapters}")
            target = Path(path).expanduser()
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
            try:
                self._model.save_pretrained(str(tmp), selected_adapters=[name])
                # PEFT writes non-default adapters into a subfolder named after them.
                saved = tmp if (tmp / "adapter_config.json").is_file() else tmp / name
                old = target.with_name(f".{target.name}.old")
                if target.exists():
                    shutil.rmtree(old, ignore_errors=True)
                    os.replace(target, old)
                os.replace(saved, target)
                shutil.rmtree(old, ignore_errors=True)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            self._adapters[name]["path"] = str(target.resolve())
            return target

    def adapter_path(self, name: str | None = None) -> Path | None:
        """The folder adapter ``name`` (default: the active one) was loaded from or last saved to; None
        while its weights exist only in memory (fresh, or trained since it was saved)."""
        with self.lock:
            name = name or self._active
            if name is None or name not in self._adapters:
                raise ConfigError(f"no adapter named {name!r}", fix=f"attached adapters: {self.adapters}")
            path = self._adapters[name]["path"]
            return None if path is None else Path(path)

    @contextlib.contextmanager
    def adapter_disabled(self) -> Iterator[LocalLM]:
        """Within the block every call (DSPy, :meth:`generate`, :meth:`token_logprobs`, direct forward
        passes on :attr:`model`) uses the base weights: the GRPO reference model. Model-wide, nestable.

        Example:
            >>> with local.adapter_disabled():  # doctest: +SKIP
            ...     ref = local.token_logprobs(prompt_ids, completion_ids)
        """
        with self.lock:
            self._disabled += 1
            if self._disabled == 1 and self._adapters:
                self._model.base_model.disable_adapter_layers()
        try:
            yield self
        finally:
            with self.lock:
                self._disabled -= 1
                if self._disabled == 0 and self._adapters:
                    self._model.base_model.enable_adapter_layers()

    # -- specs -------------------------------------------------------------------------------------

    def to_spec(self) -> dict[str, Any]:
        """JSON data that rebuilds this LocalLM: source, adapter folder and settings, never weights."""
        if self.source is None:
            raise ConfigError(f"LocalLM {self.name!r} wraps an in-memory model and cannot be described",
                              fix="save it with model.save_pretrained(folder) and use LocalLM(folder)")
        adapter = None
        if self._active is not None:
            adapter = self._adapters[self._active]["path"]
            if adapter is None:
                raise ConfigError(f"adapter {self._active!r} exists only in memory",
                                  fix="call save_adapter(folder) before saving the workflow")
        return {"model": f"local/{self.name}", "source": self.source, "adapter": adapter, "chat": self.chat,
                "device": self._requested["device"], "dtype": self._requested["dtype"],
                "max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                "batch_wait_ms": self._batcher.wait_s * 1000, "max_batch_size": self._batcher.max_batch_size}

    _SPEC_KEYS = frozenset({"model", "source", "adapter", "chat", "device", "dtype", "max_new_tokens",
                            "temperature", "batch_wait_ms", "max_batch_size", "max_tokens", "model_type"})

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
                                       "batch_wait_ms", "max_batch_size") if spec.get(k) is not None}
        if spec.get("max_tokens") is not None and "max_new_tokens" not in kwargs:
            kwargs["max_new_tokens"] = int(spec["max_tokens"])
        return cls(source, name=name, **kwargs)

    # -- plumbing ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the batching thread (the model stays usable for direct calls)."""
        self._batcher.close()

    def __deepcopy__(self, memo: dict[int, Any]) -> LocalLM:
        # DSPy deep-copies modules (and the LMs bound to them); the weights are a shared resource.
        return self

    def __copy__(self) -> LocalLM:
        return self

    def __repr__(self) -> str:
        adapter = f", adapter={self.active_adapter!r}" if self._adapters else ""
        return f"LocalLM({self.name!r}, device={str(self.device)!r}, dtype={str(self.dtype)!r}{adapter})"
