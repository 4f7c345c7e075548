"""Batched sampling that returns each token's log-probability: the "old policy" scores of a rollout.

A plain KV-cache loop rather than ``model.generate``: GRPO needs the log-probability of every sampled
token under exactly the distribution it was drawn from (``softmax(logits / T)``, no top-k or top-p,
which the training forward reproduces), one seeded ``torch.Generator`` for the whole batch, and little
per-step overhead, since with small models the Python around each step costs as much as the step.
Rows that have ended leave the batch (and the KV cache), so a long completion does not keep every
finished row computing; each step draws one uniform per row whether or not the row is still running,
so a row's sample does not depend on when the others end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class Generated:
    """One sampled completion: its token ids (a final EOS included), their log-probs, why it ended."""

    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"


def sample_batch(model: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float,
                 eos_ids: Sequence[int], pad_id: int, generator: torch.Generator | None = None,
                 stop: Sequence[str] = (), tokenizer: Any = None) -> list[Generated]:
    """Sample one completion per prompt (temperature 0 = greedy); no gradients.

    Example:
        >>> out = sample_batch(model, [[5, 6, 7]], max_new_tokens=8, temperature=1.0, eos_ids=[2],
        ...                    pad_id=0)  # doctest: +SKIP
        >>> out[0].completion_ids, out[0].logprobs  # doctest: +SKIP
    """
    import torch

    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("a prompt has no tokens")
    if stop and tokenizer is None:
        raise ValueError("stop strings need the tokenizer")
    device = next(model.parameters()).device
    n = len(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):] = torch.as_tensor(list(prompt), dtype=torch.long)
        attention[i, width - len(prompt):] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    ids, attention, positions = ids.to(device), attention.to(device), positions.to(device)
    eos = torch.as_tensor(list(eos_ids) or [-1], device=device)

    tokens: list[torch.Tensor] = []
    logps: list[torch.Tensor] = []
    done = torch.zeros(n, dtype=torch.bool, device=device)
    lengths = torch.full((n,), max_new_tokens, dtype=torch.long, device=device)
    stopped_by_string: set[int] = set()
    pieces: dict[int, str] = {}  # token id -> its text, for the stop-string prefilter
    # ``live`` maps the rows still in the model's batch to prompt rows. Once a quarter of them have
    # ended they are dropped from the batch and the KV cache: a batch otherwise runs at full width
    # until its longest completion ends. Tokens and log-probs are kept at full width (pad / 0.0).
    live = torch.arange(n, device=device)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=True,
                    logits_to_keep=1)
        past = out.past_key_values
        logits = out.logits[:, -1, :]
        for step in range(max_new_tokens):
            scores = logits.float()
            if temperature > 0:
                scores = scores / temperature
            logprobs = torch.log_softmax(scores, dim=-1)
            if temperature > 0:
                # Inverse-CDF draws from one uniform per prompt row and step, used or not: a row's sample
                # then depends only on the seed and its own logits, not on which rows were dropped.
                picked = inverse_cdf(logprobs, torch.rand(n, generator=generator, device=device)[live])
            else:
                picked = logprobs.argmax(dim=-1)
            token = torch.full((n,), pad_id, dtype=torch.long, device=device)
            token[live] = picked
            token_logp = torch.zeros(n, dtype=logprobs.dtype, device=device)
            token_logp[live] = logprobs.gather(1, picked.unsqueeze(1)).squeeze(1)
            token = torch.where(done, torch.full_like(token, pad_id), token)
            tokens.append(token)
            logps.append(token_logp)
            newly = ~done & torch.isin(token, eos)
            lengths = torch.where(newly, torch.full_like(lengths, step + 1), lengths)
            done = done | newly
            if stop:
                for i in _rows_hitting_stop(tokenizer, tokens, done, stop, pieces):
                    lengths[i] = step + 1
                    done[i] = True
                    stopped_by_string.add(i)
            if bool(done.all()) or step + 1 == max_new_tokens:
                break
            running = ~done[live]
            if int(running.sum()) * 4 <= 3 * len(live):
                keep = running.nonzero().squeeze(1)
                live = live[keep]
                past.batch_select_indices(keep)
                attention, positions, picked = attention[keep], positions[keep], picked[keep]
            attention = torch.cat([attention, torch.ones((len(live), 1), dtype=attention.dtype, device=device)],
                                  dim=1)
            positions = positions[:, -1:] + 1
            out = model(input_ids=picked.unsqueeze(1), attention_mask=attention, position_ids=positions,
                        past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[:, -1, :]
    all_tokens = torch.stack(tokens, dim=1).tolist()
    all_logps = torch.stack(logps, dim=1).float().tolist()
    lengths_list = lengths.tolist()
    eos_set = set(int(e) for e in eos_ids)
    results = []
    for i in range(n):
        k = min(lengths_list[i], len(all_tokens[i]))
        ids_i = all_tokens[i][:k]
        ended = i in stopped_by_string or (bool(ids_i) and ids_i[-1] in eos_set)
        results.append(Generated(ids_i, all_logps[i][:k], "stop" if ended else "length"))
    return results


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


def _rows_hitting_stop(tokenizer: Any, tokens: list[torch.Tensor], done: torch.Tensor, stop: Sequence[str],
                       pieces: dict[int, str]) -> list[int]:
    # A stop string can only have just completed where the newest token's text holds its last
    # character: test that first (one cached decode per distinct token), and decode the tail of only
    # those rows. A non-ASCII last character may be split across tokens, so it is always checked.
    last_chars = {s[-1] for s in stop}
    prefilter = all(c.isascii() for c in last_chars)
    newest = tokens[-1].tolist()
    span = max(len(s) for s in stop) + 1  # a stop string of L characters spans at most L tokens
    recent: list[list[int]] | None = None
    hits = []
    for i, token in enumerate(newest):
        if bool(done[i]):
            continue
        if prefilter:
            if token not in pieces:
                pieces[token] = tokenizer.decode([token], skip_special_tokens=True)
            if not any(c in pieces[token] for c in last_chars):
                continue
        if recent is None:
            recent = [t.tolist() for t in tokens[-span:]]
        tail = tokenizer.decode([step[i] for step in recent], skip_special_tokens=True)
        if any(s in tail for s in stop):
            hits.append(i)
    return hits
