"""The one scorer: log-probs in vocabulary chunks equal the full log-softmax, values and gradients."""

from __future__ import annotations

import pytest
import torch

from flowopt.lm.packing import pack
from flowopt.lm.scoring import completion_logprobs

PROMPTS = [[2, 30, 31, 32], [2, 33], [2, 34, 35]]
COMPLETIONS = [[36, 37], [38, 39, 40, 41], [42]]


def _fresh_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def _full(model, batch, temperature):
    """The reference: the model's whole [batch, time, vocab] logits, log-softmax, gather, mask."""
    width = batch.completion_width
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=batch.position_ids).logits[:, -(width + 1):-1].float()
    logps = torch.log_softmax(logits / temperature, -1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    return logps * batch.completion_mask


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_equal_the_full_ones_with_the_same_gradients(tiny_model_dir, temperature):
    model = _fresh_model(tiny_model_dir)
    batch = pack(PROMPTS, COMPLETIONS, pad_id=0)
    vocab = model.get_output_embeddings().weight.shape[0]
    rows_seen: list[int] = []
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda m, args: rows_seen.append(args[0].shape[0]))
    weights = torch.linspace(0.5, 1.5, batch.completion_ids.numel()).view_as(batch.completion_mask)
    results = []
    for chunk in (None, 3 * vocab):  # None: the reference; else 3 tokens per chunk (7 tokens: 3 chunks)
        model.zero_grad(set_to_none=True)
        rows_seen.clear()
        if chunk is None:
            logps = _full(model, batch, temperature)
        else:
            logps = completion_logprobs(model, batch, temperature, chunk_elements=chunk)
        (logps * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((logps.detach(), grads, list(rows_seen)))
    hook.remove()
    (full, full_grads, _), (chunked, chunked_grads, seen) = results
    assert torch.allclose(chunked, full, atol=1e-5)
    assert (chunked[batch.completion_mask == 0] == 0).all()  # padding columns hold exactly 0
    assert full_grads.keys() == chunked_grads.keys() and full_grads
    for name, grad in full_grads.items():
        assert torch.allclose(chunked_grads[name], grad, atol=1e-5), name
    # The projection never saw more than a chunk of tokens, nor any prompt or padding column: 7 real
    # tokens in chunks of 3, 3, 1, projected once forward and once more in the backward pass.
    assert max(seen) <= 3 and sum(seen) == 2 * sum(len(c) for c in COMPLETIONS)


def test_without_gradients_one_pass_and_no_recompute(tiny_model_dir):
    model = _fresh_model(tiny_model_dir)
    batch = pack(PROMPTS, COMPLETIONS, pad_id=0)
    rows_seen: list[int] = []
    model.get_output_embeddings().register_forward_pre_hook(lambda m, args: rows_seen.append(args[0].shape[0]))
    with torch.no_grad():
        chunked = completion_logprobs(model, batch, chunk_elements=2 * model.get_output_embeddings().weight.shape[0])
        full = _full(model, batch, 1.0)
    assert torch.allclose(chunked, full, atol=1e-5)
    assert rows_seen[:4] == [2, 2, 2, 1]


def test_bad_settings_are_refused(tiny_model_dir):
    model = _fresh_model(tiny_model_dir)
    batch = pack(PROMPTS, COMPLETIONS, pad_id=0)
    with pytest.raises(ValueError, match="temperature"):
        completion_logprobs(model, batch, 0.0)
    with pytest.raises(ValueError, match="chunk_elements"):
        completion_logprobs(model, batch, chunk_elements=0)
