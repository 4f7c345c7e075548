"""The rows of the decode loop: one completion in progress each, and how a step's logits become its tokens.

A :class:`Row` carries its prompt, its :class:`~flowopt.lm.settings.RowSettings`, the tokens and log-probs
decoded so far, its slot in the static cache (:mod:`flowopt.lm.slots`) and why it ended. :func:`choose`
turns one step's logits into each row's next token:

- **Draws.** With one ``generator`` for a whole round of rows (a GRPO step: one seeded stream), a sampled
  row's token is drawn by inverse CDF from the uniform of its round index; every step draws one uniform
  per row of the round whether the row still runs or not, so a row's sample never depends on when the
  others end. Without one, each sampled row draws from its own generator (seeded by ``RowSettings.seed``,
  or from the OS) with ``torch.multinomial``, whose one-sample draw is an exponential race (the argmax of
  ``p / Exp(1)`` noise): it moves only when the top ratios are close, so a seeded sample is the same
  whether it ran alone or beside others, also in bfloat16, where batched arithmetic rounds differently
  from batch 1 (an inverse CDF over the vocabulary in id order moves with the mass of every token before
  the pick: it gave 0 of 4 identical seeded samples of Gemma 3 270M where this gives 4 of 4).
- **Log-probs** are those of ``softmax(logits / T)`` (T = 1 for greedy rows), before any top-k/top-p cut.

:meth:`Row.accept` appends a token and decides whether the row ended: EOS, one of its stop strings, its
token limit, or its ``on_tokens`` callback returning False (``"cancelled"``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flowopt.lm.settings import RowSettings, Sample, inverse_cdf

if TYPE_CHECKING:
    import torch

OnTokens = Callable[[list[int]], "bool | None"]


@dataclass(eq=False)
class Row:
    """One completion in progress; ``index`` is its place in a seeded round (which uniform it draws)."""

    prompt: list[int]
    settings: RowSettings
    index: int = 0
    on_tokens: OnTokens | None = None
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    slot: int = -1
    start: int = 0  # the cache column of its first prompt token
    finish: str | None = None  # "stop", "length", "cancelled" or "error" once it ended
    stopped: bool = False  # ended on a stop string
    error: BaseException | None = None
    generator: Any = None  # its own sampling stream (rows outside a seeded round)

    @property
    def position(self) -> int:
        """The position of the newest token (the one the next step feeds)."""
        return len(self.prompt) + len(self.tokens) - 1

    @property
    def remaining(self) -> int:
        return self.settings.max_new_tokens - len(self.tokens)

    def seed_stream(self, device: Any) -> None:
        """Give a sampled row its own generator (seeded by its settings, else from the OS)."""
        import torch

        if self.settings.temperature > 0 and self.generator is None:
            self.generator = torch.Generator(device=device)
            seed = self.settings.seed
            self.generator.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)

    def accept(self, token: int, logp: float | None, eos: set[int], stops: StopCheck) -> None:
        """Append ``token``, decide whether the row ended, and hand the token to ``on_tokens``."""
        self.tokens.append(token)
        if logp is not None:
            self.logps.append(logp)
        if token in eos:
            self.finish = "stop"
        elif self.settings.stop and stops.hit(self):
            self.finish, self.stopped = "stop", True
        elif len(self.tokens) >= self.settings.max_new_tokens:
            self.finish = "length"
        if self.on_tokens is None:
            return
        try:
            keep = self.on_tokens([token])
        except Exception as exc:  # the caller's callback failed: its call raises that error
            self.finish, self.error = "error", exc
            return
        if keep is False and self.finish is None:
            self.finish = "cancelled"

    def sample(self, tokenizer: Any, eos: set[int]) -> Sample:
        """The finished :class:`~flowopt.lm.settings.Sample` (text cut before the first stop string)."""
        import torch

        text = tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = min((c for c in (text.find(s) for s in self.settings.stop) if c >= 0), default=-1)
        if cut >= 0:
            text = text[:cut]
        if self.finish == "cancelled":
            reason = "cancelled"
        else:
            ended = self.stopped or cut >= 0 or (bool(self.tokens) and self.tokens[-1] in eos)
            reason = "stop" if ended else "length"
        logprobs = None
        if self.settings.logprobs:
            logprobs = torch.tensor(self.logps[:len(self.tokens)], dtype=torch.float32)
        return Sample(prompt_ids=list(self.prompt), completion_ids=list(self.tokens), text=text,
                      finish_reason=reason, logprobs=logprobs)


class StopCheck:
    """Whether a row's newest token completed one of its stop strings.

    A stop string can only have just completed where the newest token's text holds its last character:
    that is tested first (one cached decode per distinct token), and only then the row's tail is decoded.
    A non-ASCII last character may be split across tokens, so such rows are always decoded.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.pieces: dict[int, str] = {}

    def hit(self, row: Row) -> bool:
        stop = row.settings.stop
        last_chars = {s[-1] for s in stop}
        if all(c.isascii() for c in last_chars):
            token = row.tokens[-1]
            piece = self.pieces.get(token)
            if piece is None:
                piece = self.pieces[token] = self.tokenizer.decode([token], skip_special_tokens=True)
            if not any(c in piece for c in last_chars):
                return False
        # A stop string of L characters spans at most L tokens (every token adds at least one character).
        span = max(len(s) for s in stop) + 1
        tail = self.tokenizer.decode(row.tokens[-span:], skip_special_tokens=True)
        return any(s in tail for s in stop)


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


def choose(rows: Sequence[Row], logits: torch.Tensor, uniforms: torch.Tensor | None,
           greedy: torch.Tensor | None = None) -> tuple[list[int], list[float] | None]:
    """Each row's next token from ``logits`` (float32 ``[rows, vocab]``), and its log-prob when any row
    asks for them; ``uniforms`` (one per row of a seeded round, indexed by ``Row.index``) or None;
    ``greedy``: ``logits.argmax(-1)`` when the caller has it (a compiled step computes it in its graph)."""
    import torch

    settings = [r.settings for r in rows]
    temps = [s.temperature if s.temperature > 0 else 1.0 for s in settings]
    sampled = [s.temperature > 0 for s in settings]
    any_sampled = any(sampled)
    want = any(s.logprobs for s in settings)
    scores = logits
    if any_sampled:
        if len(set(temps)) == 1:
            scores = scores / temps[0]
        else:
            scores = scores / torch.tensor(temps, device=logits.device, dtype=logits.dtype).unsqueeze(1)
    logprobs = torch.log_softmax(scores, dim=-1) if any_sampled or want else None
    picked = greedy if greedy is not None and not any_sampled else scores.argmax(dim=-1)  # scores is logits then
    if any_sampled:
        assert logprobs is not None
        draw_from = logprobs
        cut = [j for j, s in enumerate(settings) if s.temperature > 0 and (s.top_k > 0 or s.top_p < 1.0)]
        if cut:
            draw_from = logprobs.clone()
            for j in cut:
                draw_from[j] = _truncate(logprobs[j], settings[j])
        if uniforms is not None:
            index = torch.tensor([r.index for r in rows], device=uniforms.device)
            drawn = inverse_cdf(draw_from, uniforms[index])
            picked = torch.where(torch.tensor(sampled, device=logits.device), drawn, picked)
        else:
            picked = picked.clone()
            for j, row in enumerate(rows):
                if row.generator is not None:
                    picked[j] = torch.multinomial(draw_from[j].exp(), 1, generator=row.generator)[0]
    tokens = picked.tolist()
    if not want:
        return tokens, None
    assert logprobs is not None
    return tokens, logprobs.gather(1, picked.unsqueeze(1)).squeeze(1).float().tolist()
