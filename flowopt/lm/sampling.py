"""The one sampler: batched completions with per-row settings and, when asked, per-token log-probs.

A plain KV-cache loop rather than ``model.generate``: every row carries its own settings (greedy or
temperature, top-k/top-p, seed, stop strings, token limit), GRPO needs the log-probability of every
sampled token under the distribution it was drawn from (``softmax(logits / T)``, which the training
forward reproduces), and with small models the Python around each step costs as much as the step.

- **Draws.** With one ``generator`` for the whole batch (a GRPO step: one seeded stream), a sampled
  row's token is drawn by inverse CDF from one uniform per row and step; rows draw a uniform each step
  whether running or not, so a row's sample never depends on when the others end. Without one, each
  sampled row draws from its own generator (seeded by ``RowSettings.seed``, or from the OS) with
  ``torch.multinomial``, whose one-sample draw is an exponential race (the argmax of ``p / Exp(1)``
  noise): it moves only when the top ratios are close, so a seeded sample is the same whether it ran
  alone or beside others, also in bfloat16, where batched arithmetic rounds differently from batch 1
  (an inverse CDF over the vocabulary in id order moves with the mass of every token before the pick:
  it gave 0 of 4 identical seeded samples of Gemma 3 270M where this gives 4 of 4).
- **Early exit.** Rows that ended (EOS, a stop string, their token limit) leave the batch and the KV
  cache once a quarter of them have, so one long completion does not keep every finished row computing.
- **Log-probs** are those of ``softmax(logits / T)`` (T = 1 for greedy rows), before any top-k/top-p cut.

Layout as in :mod:`flowopt.lm.packing`: prompts left-padded, completion tokens appended.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flowopt.lm.forward import halves
from flowopt.lm.packing import eos_ids, left_padded, pad_id

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RowSettings:
    """Decoding settings of one row (one completion); ``logprobs`` asks for per-token log-probs."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Sample:
    """One generated completion.

    ``completion_ids`` are exactly the tokens the model produced (a final EOS included when it ended
    that way; tokens of a stop string included), which is what training code scores. ``text`` is their
    decoding with special tokens dropped and the text cut before the first stop string (OpenAI's rule).
    ``logprobs`` (float32 CPU tensor, one per completion token) is filled when asked for.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    logprobs: torch.Tensor | None = None
    prompt_index: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def derive_seed(seed: int, index: int) -> int:
    """A distinct, reproducible seed for the ``index``-th sample drawn under ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def inverse_cdf(logprobs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logprobs`` ``[rows, vocab]``, drawn with the row's uniform in ``[0, 1)``.

    Example:
        >>> import torch
        >>> inverse_cdf(torch.tensor([[0.25, 0.75]]).log(), torch.tensor([0.5])).tolist()
        [1]
    """
    import torch

    cdf = logprobs.exp().cumsum(-1)
    # right=True: the first token whose cumulative mass exceeds the target, so a zero-probability
    # token is never drawn, even for a uniform of exactly 0.
    picked = torch.searchsorted(cdf, (uniform * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    return picked.clamp(max=cdf.shape[-1] - 1)


def _truncate(logprobs: torch.Tensor, row: RowSettings) -> torch.Tensor:
    """``logprobs`` of one row with tokens outside its top-k / top-p set at -inf."""
    import torch

    if 0 < row.top_k < logprobs.shape[-1]:
        kth = torch.topk(logprobs, row.top_k).values[-1]
        logprobs = logprobs.masked_fill(logprobs < kth, float("-inf"))
    if row.top_p < 1.0:
        ordered, order = torch.sort(logprobs, descending=True)
        probs = ordered.exp()
        drop_sorted = probs.cumsum(-1) - probs >= row.top_p  # the token that crosses p stays
        drop = torch.empty_like(drop_sorted).scatter_(0, order, drop_sorted)
        logprobs = logprobs.masked_fill(drop, float("-inf"))
    return logprobs


class _Draws:
    """Sampled rows' tokens: inverse CDF with the batch's generator, else each row's own multinomial draw."""

    def __init__(self, rows: Sequence[RowSettings], generator: Any, device: Any) -> None:
        import torch

        self.n, self.generator, self.device = len(rows), generator, device
        self.own: list[Any] = []
        if generator is None:
            for row in rows:
                gen = None
                if row.temperature > 0:
                    gen = torch.Generator(device=device)
                    # Unseeded rows still get their own stream, seeded from the OS, so no two rows share one.
                    gen.manual_seed(row.seed if row.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
                self.own.append(gen)

    def draw(self, logprobs: torch.Tensor, live: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
        """One token per row of ``logprobs`` (the live rows, in order); greedy rows keep ``greedy``."""
        import torch

        if self.generator is not None:
            uniforms = torch.rand(self.n, generator=self.generator, device=self.device)
            return inverse_cdf(logprobs, uniforms[live])
        picked = greedy.clone()
        for j, row_index in enumerate(live.tolist()):
            gen = self.own[row_index]
            if gen is not None:
                picked[j] = torch.multinomial(logprobs[j].exp(), 1, generator=gen)[0]
        return picked


OnTokens = Callable[[list[int]], "bool | None"]  # a row's new token ids after a step; False cancels the row


def sample(model: Any, tokenizer: Any, prompts: Sequence[Sequence[int]], rows: Sequence[RowSettings], *,
           generator: torch.Generator | None = None,
           on_tokens: Sequence[OnTokens | None] | None = None) -> list[Sample]:
    """One completion per prompt, in one batch (no gradients); ``rows[i]`` are prompt ``i``'s settings.

    Example:
        >>> samples = sample(model, tokenizer, [[2, 17, 18]], [RowSettings(max_new_tokens=8)])  # doctest: +SKIP
    """
    import torch

    if len(prompts) != len(rows):
        raise ValueError("one RowSettings per prompt")
    if not prompts:
        return []
    parts = halves(model)
    device = next(model.parameters()).device
    pad = pad_id(tokenizer)
    eos = eos_ids(model, tokenizer)
    n = len(prompts)
    ids, attention, positions = (t.to(device) for t in left_padded(prompts, pad))
    temps = torch.tensor([r.temperature if r.temperature > 0 else 1.0 for r in rows], device=device)
    sampled = torch.tensor([r.temperature > 0 for r in rows], device=device)
    uniform_temperature = len({float(t) for t in temps.tolist()}) == 1
    truncated = [i for i, r in enumerate(rows) if r.temperature > 0 and (r.top_k > 0 or r.top_p < 1.0)]
    want_logprobs = any(r.logprobs for r in rows)
    limits = torch.tensor([r.max_new_tokens for r in rows], device=device)
    steps = max(r.max_new_tokens for r in rows)
    draws = _Draws(rows, generator, device)
    eos_tensor = torch.as_tensor(eos or [-1], device=device)
    stops = _StopWatch(tokenizer, rows)

    tokens: list[torch.Tensor] = []
    logps: list[torch.Tensor] = []
    done = torch.zeros(n, dtype=torch.bool, device=device)
    lengths = limits.clone()
    live = torch.arange(n, device=device)  # rows still in the model's batch (prompt row indices)
    with torch.inference_mode():
        hidden, past = parts.hidden(ids, attention, positions, use_cache=True)
        for step in range(steps):
            scores = parts.logits(hidden[:, -1, :])
            live_sampled = sampled[live]
            any_sampled = bool(live_sampled.any())
            if any_sampled:
                scores = scores / (temps[0] if uniform_temperature else temps[live].unsqueeze(1))
            logprobs = torch.log_softmax(scores, dim=-1) if any_sampled or want_logprobs else None
            picked = scores.argmax(dim=-1)
            if any_sampled:
                assert logprobs is not None
                draw_from = logprobs
                if truncated:
                    draw_from = logprobs.clone()
                    for j, row_index in enumerate(live.tolist()):
                        if row_index in truncated:
                            draw_from[j] = _truncate(logprobs[j], rows[row_index])
                drawn = draws.draw(draw_from, live, picked)
                picked = torch.where(live_sampled, drawn, picked)
            token = torch.full((n,), pad, dtype=torch.long, device=device)
            token[live] = picked
            token = torch.where(done, torch.full_like(token, pad), token)
            tokens.append(token)
            if want_logprobs and logprobs is not None:
                token_logp = torch.zeros(n, dtype=logprobs.dtype, device=device)
                token_logp[live] = logprobs.gather(1, picked.unsqueeze(1)).squeeze(1)
                logps.append(token_logp)
            newly = ~done & (torch.isin(token, eos_tensor) | (limits == step + 1))
            lengths = torch.where(newly, torch.full_like(lengths, step + 1), lengths)
            was_done = done
            done = done | newly
            for i in stops.hits(tokens, done):
                lengths[i] = step + 1
                done[i] = True
            for i, hook in enumerate(on_tokens or ()):
                if hook is not None and not bool(was_done[i]) and hook([int(token[i])]) is False:
                    lengths[i] = step + 1  # cancelled by its caller: the row ends with this token
                    done[i] = True
            if bool(done.all()) or step + 1 == steps:
                break
            running = ~done[live]
            if int(running.sum()) * 4 <= 3 * len(live):
                keep = running.nonzero().squeeze(1)
                live = live[keep]
                past.batch_select_indices(keep)
                attention, positions, picked = attention[keep], positions[keep], picked[keep]
            attention = torch.cat([attention, torch.ones((len(live), 1), dtype=attention.dtype, device=device)], 1)
            positions = positions[:, -1:] + 1
            hidden, past = parts.hidden(picked.unsqueeze(1), attention, positions, cache=past, use_cache=True)
    return _samples(tokenizer, prompts, rows, tokens, logps, lengths.tolist(), stops.stopped, set(eos))


def _samples(tokenizer: Any, prompts: Sequence[Sequence[int]], rows: Sequence[RowSettings],
             tokens: list[torch.Tensor], logps: list[torch.Tensor], lengths: list[int], stopped: set[int],
             eos: set[int]) -> list[Sample]:
    import torch

    all_tokens = torch.stack(tokens, dim=1).tolist()
    all_logps = torch.stack(logps, dim=1).float().cpu() if logps else None
    out = []
    for i, (prompt, row) in enumerate(zip(prompts, rows)):
        k = min(lengths[i], len(all_tokens[i]))
        ids = all_tokens[i][:k]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        cut = min((c for c in (text.find(s) for s in row.stop) if c >= 0), default=-1)
        if cut >= 0:
            text = text[:cut]
        ended = i in stopped or cut >= 0 or (bool(ids) and ids[-1] in eos)
        logprobs = all_logps[i, :k].clone() if all_logps is not None and row.logprobs else None
        out.append(Sample(prompt_ids=list(prompt), completion_ids=ids, text=text,
                          finish_reason="stop" if ended else "length", logprobs=logprobs))
    return out


class _StopWatch:
    """Which running rows just completed one of their stop strings.

    A stop string can only have just completed where the newest token's text holds its last character:
    that is tested first (one cached decode per distinct token), and only those rows' tails are decoded.
    A non-ASCII last character may be split across tokens, so such rows are always decoded.
    """

    def __init__(self, tokenizer: Any, rows: Sequence[RowSettings]) -> None:
        self.tokenizer = tokenizer
        self.rows = [(i, r.stop) for i, r in enumerate(rows) if r.stop]
        self.pieces: dict[int, str] = {}
        self.stopped: set[int] = set()
        # A stop string of L characters spans at most L tokens (every token adds at least one character).
        self.span = max((len(s) for _, stop in self.rows for s in stop), default=0) + 1

    def hits(self, tokens: list[torch.Tensor], done: torch.Tensor) -> list[int]:
        if not self.rows:
            return []
        newest = tokens[-1].tolist()
        recent: list[list[int]] | None = None
        out = []
        for i, stop in self.rows:
            if bool(done[i]):
                continue
            last_chars = {s[-1] for s in stop}
            if all(c.isascii() for c in last_chars):
                token = newest[i]
                if token not in self.pieces:
                    self.pieces[token] = self.tokenizer.decode([token], skip_special_tokens=True)
                if not any(c in self.pieces[token] for c in last_chars):
                    continue
            if recent is None:
                recent = [t.tolist() for t in tokens[-self.span:]]
            span = max(len(s) for s in stop) + 1
            tail = self.tokenizer.decode([step[i] for step in recent[-span:]], skip_special_tokens=True)
            if any(s in tail for s in stop):
                out.append(i)
                self.stopped.add(i)
        return out
