"""Batched generation and log-probabilities over a transformers causal LM, with per-row settings.

One ``model.generate`` call serves a whole batch even when its rows ask for different temperatures,
seeds, stop strings and token limits: greedy decoding runs in transformers (KV cache, padding,
sliding windows), and a logits processor draws each sampled row's token from that row's own seeded
``torch.Generator``, so a seeded sample is the same whether it ran alone or beside seven others.
A stopping criterion ends each row at its own limit or stop string.

Layout shared by generation and :func:`token_logprobs`: prompts are left-padded to a common length
and completions follow them, so completion token ``j`` of every row sits at the same position.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RowSettings:
    """Decoding settings of one row (one completion)."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()

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
    ``logprobs`` (float32, one per completion token) is filled when asked for.
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


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return sorted(ids)


def pad_id(tokenizer: Any) -> int:
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    return 0


def generate_batch(model: Any, tokenizer: Any, prompts: Sequence[Sequence[int]],
                   rows: Sequence[RowSettings]) -> list[Sample]:
    """Generate one completion per prompt in a single left-padded batch (no grad).

    Example:
        >>> samples = generate_batch(model, tokenizer, [[2, 17, 18]], [RowSettings(max_new_tokens=8)])
        ... # doctest: +SKIP
    """
    import torch
    from transformers import (
        GenerationConfig,
        LogitsProcessor,
        LogitsProcessorList,
        StoppingCriteria,
        StoppingCriteriaList,
    )

    if len(prompts) != len(rows):
        raise ValueError("one RowSettings per prompt")
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("a prompt has no tokens")
    device = next(model.parameters()).device
    pad = pad_id(tokenizer)
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
        attention[i, width - len(prompt):] = 1
    input_ids, attention = input_ids.to(device), attention.to(device)

    generators: list[torch.Generator | None] = []
    for row in rows:
        if row.temperature > 0:
            gen = torch.Generator(device=device)
            # Unseeded rows still get their own generator, seeded from the OS, so no row shares a stream.
            gen.manual_seed(row.seed if row.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
            generators.append(gen)
        else:
            generators.append(None)

    class RowSampler(LogitsProcessor):
        """Draw sampled rows' tokens here; transformers' greedy argmax then picks them."""

        def __call__(self, ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
            if all(g is None for g in generators):
                return scores
            out = scores.clone()
            for i, (row, gen) in enumerate(zip(rows, generators)):
                if gen is None:
                    continue
                logits = scores[i].float() / row.temperature
                if row.top_k > 0 and row.top_k < logits.shape[-1]:
                    kth = torch.topk(logits, row.top_k).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                if row.top_p < 1.0:
                    sorted_logits, order = torch.sort(logits, descending=True)
                    probs = torch.softmax(sorted_logits, -1)
                    drop_sorted = probs.cumsum(-1) - probs >= row.top_p  # the token that crosses p stays
                    drop = torch.empty_like(drop_sorted).scatter_(0, order, drop_sorted)
                    logits = logits.masked_fill(drop, float("-inf"))
                token = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
                out[i].fill_(float("-inf"))
                out[i, token] = 0.0
            return cast(torch.FloatTensor, out)  # transformers' declared return type

    max_stop = max((len(s) for row in rows for s in row.stop), default=0)
    done_len: list[int | None] = [None] * len(rows)

    class RowStop(StoppingCriteria):
        """End each row at its own token limit or stop string."""

        def __call__(self, ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
            generated = ids.shape[1] - width
            for i, row in enumerate(rows):
                if done_len[i] is not None:
                    continue
                if generated >= row.max_new_tokens:
                    done_len[i] = generated
                elif row.stop:
                    # A stop string is at most max_stop characters and every token adds at least one byte,
                    # so the last few tokens are enough to see one that just completed.
                    span = min(generated, 2 * max_stop + 8)
                    tail = tokenizer.decode(ids[i, ids.shape[1] - span:].tolist(), skip_special_tokens=True)
                    if any(s in tail for s in row.stop):
                        done_len[i] = generated
            done = torch.tensor([d is not None for d in done_len], dtype=torch.bool, device=ids.device)
            return cast(torch.BoolTensor, done)

    eos = _eos_ids(model, tokenizer)
    config = GenerationConfig(max_new_tokens=max(r.max_new_tokens for r in rows), do_sample=False, num_beams=1,
                              pad_token_id=pad, eos_token_id=eos or None, use_cache=True)
    with torch.inference_mode():
        output = model.generate(input_ids=input_ids, attention_mask=attention, generation_config=config,
                                logits_processor=LogitsProcessorList([RowSampler()]),
                                stopping_criteria=StoppingCriteriaList([RowStop()]))
    output = output.tolist()
    samples = []
    for i, (prompt, row) in enumerate(zip(prompts, rows)):
        generated = output[i][width:]
        limit = done_len[i] if done_len[i] is not None else len(generated)
        ids = generated[:limit]
        finish = None
        for j, token in enumerate(ids):
            if token in eos:
                ids, finish = ids[: j + 1], "stop"
                break
        text = tokenizer.decode(ids, skip_special_tokens=True)
        cut = min((k for k in (text.find(s) for s in row.stop) if k >= 0), default=-1)
        if cut >= 0:
            text, finish = text[:cut], "stop"
        if finish is None:
            finish = "length" if len(ids) >= row.max_new_tokens else "stop"
        samples.append(Sample(prompt_ids=list(prompt), completion_ids=ids, text=text, finish_reason=finish))
    return samples


def _supports_logits_to_keep(model: Any) -> bool:
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def token_logprobs(model: Any, tokenizer: Any, prompt_ids: Sequence[Sequence[int]],
                   completion_ids: Sequence[Sequence[int]], *, temperature: float = 1.0) -> torch.Tensor:
    """Per-token log-probabilities of each completion after its prompt, shape ``[batch, max_completion]``.

    Rows are right-padded with ``0.0`` past their completion length. Gradients flow when the caller has
    them enabled (wrap in ``torch.no_grad()`` for reference or old-policy scores).
    """
    import torch

    if len(prompt_ids) != len(completion_ids):
        raise ValueError("one completion per prompt")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("a prompt has no tokens")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    device = next(model.parameters()).device
    batch = len(prompt_ids)
    lengths = [len(c) for c in completion_ids]
    p_width, c_width = max(len(p) for p in prompt_ids), max(lengths, default=0)
    if c_width == 0:
        return torch.zeros((batch, 0), device=device)
    pad = pad_id(tokenizer)
    ids = torch.full((batch, p_width + c_width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
        start = p_width - len(prompt)
        ids[i, start:p_width] = torch.tensor(list(prompt), dtype=torch.long)
        ids[i, p_width:p_width + len(completion)] = torch.tensor(list(completion), dtype=torch.long)
        mask[i, start:p_width + len(completion)] = 1
    # Left padding shifts positions; derive them from the mask as generate() does.
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    ids, mask, positions = ids.to(device), mask.to(device), positions.to(device)
    kwargs: dict[str, Any] = {}
    if _supports_logits_to_keep(model):
        kwargs["logits_to_keep"] = c_width + 1  # only the positions that predict completion tokens
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, **kwargs).logits
    logits = logits[:, -(c_width + 1):-1, :]
    targets = ids[:, p_width:]
    rows = []
    for i in range(batch):  # one row at a time keeps the float32 copy of [tokens, vocab] small
        row = logits[i].float() / temperature
        picked = row.gather(-1, targets[i].unsqueeze(-1)).squeeze(-1)
        rows.append(picked - torch.logsumexp(row, dim=-1))
    out = torch.stack(rows)
    valid = torch.arange(c_width, device=device).unsqueeze(0) < torch.tensor(lengths, device=device).unsqueeze(1)
    return out.masked_fill(~valid, 0.0)
