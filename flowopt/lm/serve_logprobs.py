"""Log-probs ``flowopt serve`` returns beyond the sampled token's: the top-k alternatives at each step
(chat ``top_logprobs``, completions ``logprobs=N``) and the prompt's own tokens (completions ``echo``).

The sampler computes only each sampled token's log-prob, so these come from one more forward pass over
prompt + completion with the weights that sampled it (the decode loop is left alone). Every log-prob is
under the distribution the sampler draws from, ``softmax(logits / T)`` with ``T = 1`` when greedy, so
a sampled token's entry and its top-k list agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flowopt.lm.forward import halves
from flowopt.lm.scoring import DEFAULT_CHUNK_ELEMENTS

if TYPE_CHECKING:
    from flowopt.lm.local import LocalLM
    from flowopt.lm.sampling import Sample


@dataclass
class ScoredTokens:
    """For each token after the first of a sequence: its log-prob and the ``k`` likeliest tokens there."""

    logprobs: list[float]
    top: list[list[tuple[int, float]]]


def score_sequence(local: LocalLM, ids: Sequence[int], *, k: int, temperature: float, adapter: Any = ...
                   ) -> ScoredTokens:
    """Score ``ids[1:]`` given what precedes each, with ``adapter``'s weights (as ``complete_ids`` pins them).

    Logits are projected a vocabulary-sized chunk of positions at a time (as the training scorer does),
    so a long prompt never holds ``[length, vocab]`` float32 logits at once.

    Example:
        >>> scored = score_sequence(local, [2, 17, 18, 19], k=2, temperature=1.0)  # doctest: +SKIP
        >>> len(scored.logprobs), len(scored.top[0])  # doctest: +SKIP
        (3, 2)
    """
    import torch

    if len(ids) < 2:
        return ScoredTokens([], [])
    scale = temperature if temperature > 0 else 1.0
    with local.using_adapter(adapter), torch.inference_mode():
        parts = halves(local.model)
        tokens = torch.tensor([list(ids)], device=local.device)
        hidden, _ = parts.hidden(tokens, torch.ones_like(tokens), torch.arange(len(ids), device=local.device)[None])
        step = max(1, DEFAULT_CHUNK_ELEMENTS // parts.vocab_size)
        logprobs: list[float] = []
        top: list[list[tuple[int, float]]] = []
        for start in range(0, len(ids) - 1, step):
            stop = min(start + step, len(ids) - 1)
            logps = torch.log_softmax(parts.logits(hidden[0, start:stop]) / scale, dim=-1)
            logprobs += logps.gather(1, tokens[0, start + 1:stop + 1, None]).squeeze(1).tolist()
            if k:
                values, indices = logps.topk(min(k, logps.shape[-1]), dim=-1)
                top += [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
            else:
                top += [[] for _ in range(stop - start)]
    return ScoredTokens(logprobs, top)


def token_text(local: LocalLM, token: int, as_ids: bool) -> str:
    return f"token_id:{token}" if as_ids else local.tokenizer.decode([token])


def chat_logprobs(local: LocalLM, sample: Sample, *, k: int, temperature: float, as_ids: bool,
                  adapter: Any = ...) -> dict[str, Any]:
    """OpenAI's chat ``logprobs`` object: each sampled token with its log-prob and ``k`` alternatives."""
    sampled = sample.logprobs.tolist() if sample.logprobs is not None else []
    top = _completion_top(local, sample, k=k, temperature=temperature, adapter=adapter)
    content = []
    for token, logprob, alternatives in zip(sample.completion_ids, sampled, top):
        text = token_text(local, token, as_ids)
        content.append({"token": text, "logprob": float(logprob), "bytes": list(text.encode()),
                        "top_logprobs": [{"token": (t := token_text(local, other, as_ids)), "logprob": float(lp),
                                          "bytes": list(t.encode())} for other, lp in alternatives]})
    return {"content": content}


def text_logprobs(local: LocalLM, sample: Sample, *, k: int, temperature: float, as_ids: bool, echo: bool,
                  adapter: Any = ...) -> dict[str, Any]:
    """OpenAI's completions ``logprobs`` object; with ``echo`` the prompt's tokens come first (the very
    first has no log-prob: nothing precedes it)."""
    tokens: list[int] = list(sample.completion_ids)
    logprobs: list[float | None] = list(sample.logprobs.tolist() if sample.logprobs is not None else [])
    tops: list[list[tuple[int, float]] | None] = []
    if echo:  # one pass scores the prompt and gives the completion's alternatives
        scored = score_sequence(local, [*sample.prompt_ids, *sample.completion_ids], k=k, temperature=temperature,
                                adapter=adapter)
        cut = len(sample.prompt_ids) - 1
        tokens = [*sample.prompt_ids, *tokens]
        logprobs = [None, *scored.logprobs[:cut], *logprobs]
        tops = [None, *scored.top]
    else:
        tops += _completion_top(local, sample, k=k, temperature=temperature, adapter=adapter)
    texts = [token_text(local, t, as_ids) for t in tokens]
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    top_dicts: list[dict[str, float] | None] = []
    for text, logprob, alternatives in zip(texts, logprobs, tops):
        if alternatives is None:
            top_dicts.append(None)
            continue
        # OpenAI's legacy shape: the sampled token and the k likeliest, by text.
        entry = {token_text(local, other, as_ids): float(lp) for other, lp in alternatives}
        entry.setdefault(text, float(logprob) if logprob is not None else 0.0)
        top_dicts.append(entry)
    return {"tokens": texts, "token_logprobs": logprobs, "top_logprobs": top_dicts, "text_offset": offsets}


def _completion_top(local: LocalLM, sample: Sample, *, k: int, temperature: float, adapter: Any
                    ) -> list[list[tuple[int, float]]]:
    if not k or not sample.completion_ids:
        return [[] for _ in sample.completion_ids]
    ids = [*sample.prompt_ids, *sample.completion_ids]
    scored = score_sequence(local, ids, k=k, temperature=temperature, adapter=adapter)
    return scored.top[len(sample.prompt_ids) - 1:]
