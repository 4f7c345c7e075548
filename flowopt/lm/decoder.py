"""The decode loop over a static KV cache: prefill apart, one (optionally compiled) step for every running row.

A :class:`Decoder` owns one :class:`~flowopt.lm.slots.SlotCache` and the decode step of one model. A
:class:`DecodeRun` is the set of rows decoding together: :meth:`Decoder.admit` prefills new rows
(eagerly, packed into as few rows as fit: :mod:`flowopt.lm.prefill`, then copied into their slots) and
picks their first token; each
:meth:`Decoder.step` feeds every running row's newest token at the shared column ``t`` and picks the
next; :meth:`Decoder.harvest` takes out the rows that ended and frees their slots. Rows may join
between any two steps (continuous batching, :mod:`flowopt.lm.continuous`) or all at once (a seeded
round: :func:`flowopt.lm.sampling.sample`).

The step is a pure function of (token ids, positions, masks, cache view) and runs on the first
``bucket(n)`` slots, so with ``compile=True`` ``torch.compile`` captures it once per bucket and cache
length (on CUDA ``mode="reduce-overhead"``: CUDA graphs), or with ``CompileSettings(dynamic=True)`` once
for all of them (see :class:`CompileSettings`). The first call of each shape is timed and logged
(:class:`~flowopt.lm.stats.DecodeStats`); if compiling fails, the step runs eagerly from then on and a
warning says so once per process.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flowopt.errors import ConfigError
from flowopt.lm.decode import Row, StopCheck, choose
from flowopt.lm.forward import Halves, halves
from flowopt.lm.packing import WIDTH_MULTIPLE, eos_ids, pad_id, padded_length
from flowopt.lm.prefill import prefill_into_slots
from flowopt.lm.slots import SlotCache, power_of_two
from flowopt.lm.stats import DecodeStats

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_compile_failure: list[str] = []  # the first compile failure of this process (compiling is not retried)
_paths_logged: set[str] = set()  # the decode paths this process has announced


def cuda_graph_thread_state() -> None:
    """Give the calling thread its own CUDA-graph tree state, so compiled code with CUDA graphs runs in it.

    torch keeps the CUDA-graph trees of ``mode="reduce-overhead"`` in a ``threading.local`` filled only in
    the thread that first imported ``torch._inductor.cudagraph_trees`` (and in autograd's threads); any
    other thread that replays a graph fails an assertion (``_is_key_in_tls``). The decode loop runs in a
    batcher thread, and callers (``generate`` with a compiled static cache, say) in theirs: each gets its
    own trees here.
    """
    from collections import defaultdict

    from torch._inductor import cudagraph_trees

    local = cudagraph_trees.local
    if not hasattr(local, "tree_manager_containers"):
        local.tree_manager_containers = {}
        local.tree_manager_locks = defaultdict(threading.Lock)


@dataclass(frozen=True)
class CompileSettings:
    """How the decode step is compiled: ``enabled``, torch.compile's ``backend`` and ``mode`` (None: per device:
    ``"reduce-overhead"`` on CUDA, the default elsewhere), and ``dynamic`` shapes.

    ``dynamic=False`` (the default) compiles each (bucket, cache length) pair apart: the configuration whose
    compile time and speed were measured on a GPU. ``dynamic=True`` (a :class:`Decoder` option; ``LocalLM``
    does not expose it) traces one graph for every bucket and length, plus one for a batch of one; on a GPU
    it compiled slower than a static bucket and its speed is not measured
    (``benchmarks/results/gsm8k_gemma_h200.md``).

    ``decode_attention=True`` (the default) points a model that decodes with its exact weights in a compiled
    step at :func:`flowopt.lm.attention.decode_attention`, which reads a grouped-query cache once per key head;
    ``False`` keeps transformers' ``sdpa`` (the benchmarks' side-by-side; ``LocalLM`` does not expose it).

    Example:
        >>> CompileSettings(enabled=True).dynamic
        False
    """

    enabled: bool = False
    backend: str = "inductor"
    mode: str | None = None
    dynamic: bool = False
    decode_attention: bool = True


def _forward(parts: Halves, cache: Any, ids: torch.Tensor, positions: torch.Tensor,
             mask: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 logits of the last column and their argmax (the greedy tokens): the step that is compiled.

    The argmax is taken here so that a compiled step fuses it with the logits' last kernel instead of reading
    the ``rows x vocabulary`` logits once more, eagerly, outside the graph.
    """
    hidden, _ = parts.hidden(ids, mask, positions, cache=cache, use_cache=True)
    logits = parts.logits(hidden[:, -1, :])
    return logits, logits.argmax(dim=-1)


class DecodeRun:
    """Rows decoding together: ``rows[s]`` sits in slot ``s``; ``t`` is the column the next step writes.

    ``generator`` (with ``round_size`` rows, admitted together) draws every sampled token of the run from
    one seeded stream, one uniform per row of the round and step.
    """

    def __init__(self, *, generator: Any = None, round_size: int = 0) -> None:
        self.rows: list[Row] = []
        self.t = 0
        self.generator = generator
        self.round_size = round_size
        self.steps = 0


class Decoder:
    """A static slot cache and the decode step of the model ``get_model()`` returns (it may change: PEFT).

    Example:
        >>> decoder = Decoder(lambda: model, tokenizer)  # doctest: +SKIP
        >>> run = DecodeRun(); decoder.admit(run, [Row([2, 5, 6], RowSettings(max_new_tokens=8))])  # doctest: +SKIP
        >>> while run.rows: decoder.step(run); done = decoder.harvest(run)  # doctest: +SKIP
    """

    def __init__(self, get_model: Any, tokenizer: Any, *, compile: CompileSettings | None = None,
                 stats: DecodeStats | None = None, width_multiple: int = WIDTH_MULTIPLE,
                 quantize: str | None = None) -> None:
        if width_multiple < 1:
            raise ConfigError(f"width_multiple must be >= 1, got {width_multiple}",
                              fix="pass 1 for exact prefill widths, or a larger multiple to bound the shapes")
        self._get_model = get_model
        self.width_multiple = width_multiple  # prefill widths are padded to a multiple of it (masked columns)
        self.tokenizer = tokenizer
        model = get_model()
        self.settings = compile or CompileSettings()
        self.cache = SlotCache(model, static_addresses=self.settings.enabled)
        self.pad = pad_id(tokenizer)
        self.eos = set(eos_ids(model, tokenizer))
        self.stops = StopCheck(tokenizer)
        self.stats = stats or DecodeStats()
        self.quantize = quantize  # a quantized twin decodes (flowopt.lm.quantize); None: exact
        # (model, its DecodeTwin or None, its own halves, the halves decoding)
        self._parts: tuple[Any, Any, Halves, Halves] | None = None
        self._compiled: Any = None
        self._shapes: set[tuple[int, int]] = set()
        self._graph_threads: set[int] = set()  # threads given their CUDA-graph tree state

    @property
    def device(self) -> torch.device:
        return self.cache.device

    def parts(self, *, exact: bool = False) -> Halves:
        """The model's halves as the decode step uses them: its own, or its quantized twin's when asked
        (``exact=True``: the model's own either way, as prefill uses them)."""
        model = self._get_model()
        cached = self._parts
        if not (cached is not None and cached[0] is model and (cached[1] is None or cached[1].current())):
            own = halves(model)
            twin = None if self.quantize is None else self._twin(own)
            if twin is None and self.settings.enabled and self.settings.decode_attention:  # the cache read once
                from flowopt.lm.attention import compile_with_decode_attention

                compile_with_decode_attention(model)
            decoding = own if twin is None else dataclasses.replace(own, decoder=twin.decoder, head=twin.head)
            cached = self._parts = (model, twin, own, decoding)
        return cached[2] if exact else cached[3]

    def _twin(self, exact: Halves) -> Any:
        """The quantized twin of ``exact`` (None when it cannot have one: the reason is logged once)."""
        from flowopt.lm.quantize import DecodeTwin, quantizable

        assert self.quantize is not None
        reason = quantizable(exact.decoder, exact.head, self.quantize)
        path = (f"decode step on {self.device.type}: quantized {self.quantize} twin" if reason is None else
                f"decode step on {self.device.type}: exact weights, although quantize={self.quantize!r} was "
                f"asked ({reason})")
        self.stats.decode_path = path
        if path not in _paths_logged:  # once per process and path: a LocalLM has two decoders
            _paths_logged.add(path)
            (logger.info if reason is None else logger.warning)(path)
        return None if reason is not None else DecodeTwin(exact.decoder, exact.head, self.quantize)

    # -- rows joining ------------------------------------------------------------------------------

    def admit(self, run: DecodeRun, rows: Sequence[Row], *, budget: int | None = None) -> bool:
        """Prefill ``rows`` into free slots and pick their first tokens; False (nothing done) when the cache
        they need would exceed ``budget`` bytes while other rows are running.

        The new prompts are packed into rows (:mod:`flowopt.lm.prefill`) whose width is rounded up to
        ``width_multiple`` (masked columns, so no output changes): on CPU every new bf16 matmul shape builds and
        caches a oneDNN kernel, so exact widths grow the process as scoring goes on
        (benchmarks/results/main_command.md).
        """
        import torch

        if not rows:
            return True
        cache = self.cache
        width = padded_length(max(len(r.prompt) for r in rows), self.width_multiple)
        n = len(run.rows)
        if n == 0:
            run.t = width
        elif run.t < width:  # make room on the left for the new prompts
            cache.ensure(n, width)
            self._shift(run, width - run.t)
        need = run.t + max(r.remaining for r in [*run.rows, *rows])
        if need > cache.length and n:
            left = min(min(r.start for r in run.rows), run.t - width)
            self._shift(run, -left)
            need -= left
        slots, length = power_of_two(n + len(rows)), max(need, cache.length)
        if budget is not None and n and cache.bytes_per_slot(power_of_two(length)) * slots > budget:
            return False
        cache.ensure(n + len(rows), length)
        for i, row in enumerate(rows):
            row.slot, row.start = n + i, run.t - len(row.prompt)
            if run.generator is None:
                row.seed_stream(self.device)
        with torch.inference_mode():
            # Prefill with the exact weights: the prompt's keys and values are the model's own, whatever decodes.
            logits = prefill_into_slots(self.parts(exact=True), cache, [r.prompt for r in rows],
                                        slots=[r.slot for r in rows], end=run.t, pad=self.pad,
                                        width_multiple=self.width_multiple)
            run.rows.extend(rows)
            self._accept(run, rows, logits)  # prefill is eager: choose takes the argmax itself, only if needed
        return True

    def _shift(self, run: DecodeRun, by: int) -> None:
        self.cache.shift(len(run.rows), by)
        run.t += by
        for row in run.rows:
            row.start += by

    # -- one step ----------------------------------------------------------------------------------

    def step(self, run: DecodeRun) -> None:
        """Decode one token for every running row (rows that ended must be harvested first)."""
        import torch

        rows, cache = run.rows, self.cache
        n = len(rows)
        if n == 0:
            return
        bucket = min(power_of_two(n), cache.capacity)
        spare = bucket - n
        with torch.inference_mode():
            device = self.device
            ids = torch.tensor([[r.tokens[-1]] for r in rows] + [[self.pad]] * spare, device=device)
            positions = torch.tensor([[r.position] for r in rows] + [[0]] * spare, device=device)
            starts = torch.tensor([r.start for r in rows] + [run.t] * spare, device=device)
            view = cache.view(0, bucket)
            cache.set_column(view, run.t)
            logits, greedy = self._decode(view, ids, positions, cache.masks(starts, run.t, 1))
            run.t += 1
            self._accept(run, rows, logits[:n], greedy[:n])
        self.stats.record_step(n)

    def _accept(self, run: DecodeRun, rows: Sequence[Row], logits: torch.Tensor,
                greedy: torch.Tensor | None = None) -> None:
        import torch

        uniforms = None
        if run.generator is not None:
            uniforms = torch.rand(run.round_size, generator=run.generator, device=self.device)
        run.steps += 1
        tokens, logps = choose(rows, logits, uniforms, greedy)
        for j, row in enumerate(rows):
            row.accept(tokens[j], None if logps is None else logps[j], self.eos, self.stops)

    def harvest(self, run: DecodeRun) -> list[Row]:
        """Take the rows that ended out of ``run``; the last rows move into the freed slots."""
        done = [r for r in run.rows if r.finish is not None]
        for row in sorted(done, key=lambda r: r.slot, reverse=True):
            last = run.rows.pop()
            if last is not row:
                self.cache.move(last.slot, row.slot)
                last.slot = row.slot
                run.rows[row.slot] = last
        return done

    # -- compiling ---------------------------------------------------------------------------------

    def _decode(self, view: Any, ids: torch.Tensor, positions: torch.Tensor,
                mask: Any) -> tuple[torch.Tensor, torch.Tensor]:
        parts = self.parts()
        if not self.settings.enabled or _compile_failure:
            return _forward(parts, view, ids, positions, mask)
        shape = (int(ids.shape[0]), self.cache.length)
        first = shape not in self._shapes
        began = time.perf_counter()
        try:
            if self.device.type == "cuda" and threading.get_ident() not in self._graph_threads:
                cuda_graph_thread_state()  # once per thread, not on every step
                self._graph_threads.add(threading.get_ident())
            out = self._compiled_step()(parts, view, ids, positions, mask)
        except Exception as exc:  # any compiler failure: decode eagerly, and say so once
            _compile_failure.append(f"{type(exc).__name__}: {exc}")
            logger.warning("torch.compile of the decode step failed (%s); decoding eagerly from now on",
                           _compile_failure[0][:300])
            self.stats.eager_reason = _compile_failure[0]
            return _forward(parts, view, ids, positions, mask)
        if first:
            self._shapes.add(shape)
            seconds = time.perf_counter() - began
            self.stats.compile_seconds[f"batch {shape[0]}, cache {shape[1]}"] = round(seconds, 2)
            logger.info("first decode step of batch %d, cache length %d (compiling or recording it) took %.1f s",
                        *shape, seconds)
        return out

    def _compiled_step(self) -> Any:
        if self._compiled is None:
            import torch

            settings = self.settings
            mode = settings.mode
            if mode is None and self.device.type == "cuda" and settings.backend == "inductor":
                mode = "reduce-overhead"
            # Static shapes compile one graph per bucket and cache length (and adapter state): more than
            # dynamo's default limit of 8.
            config = torch._dynamo.config
            limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
            setattr(config, limit, max(int(getattr(config, limit)), 64))
            self._compiled = torch.compile(_forward, backend=settings.backend, mode=mode, dynamic=settings.dynamic)
        return self._compiled
