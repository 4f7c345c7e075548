"""LocalLM generation on a tiny random model: shapes, seeds, stops, usage, log-probs, concurrency."""

from __future__ import annotations

import threading

import dspy
import pytest
import torch

PROMPTS = [f"Question: what is {i} plus {i}?\nAnswer:" for i in range(6)] + ["hello there", "The quick brown fox"]


def test_generate_shapes_and_logprobs(tiny_local):
    samples = tiny_local.generate(PROMPTS[:3], n=2, max_new_tokens=7, temperature=1.0, seed=3)
    assert len(samples) == 6
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1, 2, 2]
    for s in samples:
        assert s.prompt_ids == tiny_local.render(PROMPTS[s.prompt_index])
        assert 1 <= len(s.completion_ids) <= 7
        assert s.logprobs.shape == (len(s.completion_ids),)
        assert torch.all(s.logprobs <= 0)
        assert s.finish_reason in ("stop", "length")
        assert (s.finish_reason == "length") == (len(s.completion_ids) == 7 and s.completion_ids[-1] != 1)


def test_same_seed_same_sample_other_seed_other_sample(tiny_local):
    first = tiny_local.generate(PROMPTS[:2], n=3, temperature=1.0, seed=11, logprobs=False)
    again = tiny_local.generate(PROMPTS[:2], n=3, temperature=1.0, seed=11, logprobs=False)
    other = tiny_local.generate(PROMPTS[:2], n=3, temperature=1.0, seed=12, logprobs=False)
    ids = [s.completion_ids for s in first]
    assert ids == [s.completion_ids for s in again]
    assert ids != [s.completion_ids for s in other]
    assert len({tuple(i) for i in ids}) > 1  # the n samples of a prompt differ from each other


def test_seeded_sample_is_the_same_alone_and_in_a_batch(tiny_local):
    from flowopt.lm.sampling import RowSettings, sample

    rows = [RowSettings(max_new_tokens=10, temperature=1.0, seed=100 + i) for i in range(4)]
    prompts = [tiny_local.render(p) for p in PROMPTS[:4]]
    together = sample(tiny_local.model, tiny_local.tokenizer, prompts, rows)
    alone = [sample(tiny_local.model, tiny_local.tokenizer, [p], [r])[0] for p, r in zip(prompts, rows)]
    assert [s.completion_ids for s in together] == [s.completion_ids for s in alone]


def test_generation_logprobs_match_token_logprobs_and_greedy_picks_the_argmax(tiny_local):
    sample = tiny_local.generate([PROMPTS[0]], max_new_tokens=6, temperature=0.0)[0]
    scores = tiny_local.token_logprobs([sample.prompt_ids], [sample.completion_ids])[0]
    assert torch.allclose(scores, sample.logprobs, atol=1e-5)
    # Greedy: each chosen token is the most likely one, so no other token may score higher.
    ids = torch.tensor([sample.prompt_ids + sample.completion_ids])
    with torch.no_grad():
        logits = tiny_local.model(input_ids=ids).logits[0, len(sample.prompt_ids) - 1:-1]
    assert logits.argmax(-1).tolist() == sample.completion_ids


def test_token_logprobs_batches_with_padding_and_grad(tiny_local):
    prompts = [tiny_local.render(p) for p in ("hi", PROMPTS[0])]
    completions = [[40, 41, 42], [50]]
    batched = tiny_local.token_logprobs(prompts, completions, grad=True)
    assert batched.shape == (2, 3) and batched.requires_grad
    assert batched[1, 1:].tolist() == [0.0, 0.0]
    for i in range(2):
        alone = tiny_local.token_logprobs([prompts[i]], [completions[i]])
        assert not alone.requires_grad
        assert torch.allclose(alone[0], batched[i, : len(completions[i])].detach(), atol=1e-5)


def test_stop_sequences_cut_the_text(tiny_local):
    full = tiny_local.generate([PROMPTS[1]], max_new_tokens=12, logprobs=False)[0]
    assert len(full.text) > 6, full.text
    stop = full.text[3:6]
    cut = tiny_local.generate([PROMPTS[1]], max_new_tokens=12, stop=[stop], logprobs=False)[0]
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.finish_reason == "stop"
    assert len(cut.completion_ids) < len(full.completion_ids)


def _call_lm(lm, prompt):
    return lm(prompt, cache=False)[0]


def test_eight_threads_get_the_same_greedy_outputs_as_sequential_calls(tiny_local):
    lm = tiny_local.lm.copy(temperature=0.0)
    sequential = [_call_lm(lm, p) for p in PROMPTS]
    assert len(set(sequential)) > 4  # distinct prompts, distinct outputs: a mix-up would show
    tiny_local.decode_stats.recent.clear()
    results: dict[int, str] = {}
    barrier = threading.Barrier(len(PROMPTS))

    def worker(i):
        barrier.wait()
        results[i] = _call_lm(lm, PROMPTS[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [results[i] for i in range(len(PROMPTS))] == sequential
    assert max(tiny_local.decode_stats.recent) > 1  # they were batched


def test_usage_and_history_report_real_token_counts(tiny_local):
    lm = tiny_local.lm.copy(max_tokens=5)
    with dspy.context(track_usage=True):
        lm(PROMPTS[2], cache=False)
    usage = lm.history[-1]["usage"]
    prompt_ids = tiny_local.render(PROMPTS[2])
    sample = tiny_local.generate([PROMPTS[2]], max_new_tokens=5, logprobs=False)[0]
    assert usage["prompt_tokens"] == len(prompt_ids)
    assert usage["completion_tokens"] == len(sample.completion_ids)
    assert lm.history[-1]["outputs"] == [sample.text]


def test_chat_messages_render_as_a_labelled_transcript_for_base_models(tiny_local):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    assert tiny_local.render_text(messages) == "Be brief.\n\nUser: hello\n\nAssistant:"
    assert tiny_local.render(messages) == tiny_local.render("Be brief.\n\nUser: hello\n\nAssistant:")
    assert tiny_local.render_text([{"role": "user", "content": "raw"}]) == "raw"


def test_too_long_prompts_are_refused(tiny_local):
    from flowopt.errors import LMError

    with pytest.raises(LMError, match="context"):
        tiny_local.generate(["word " * 600], max_new_tokens=4)


def test_models_with_a_chat_template_render_through_it_and_keep_the_chat_adapter(tiny_local):
    import copy

    from flowopt.errors import ConfigError
    from flowopt.lm import LocalLM, adapter_for

    tokenizer = copy.deepcopy(tiny_local.tokenizer)
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    chat = LocalLM.from_model(tiny_local.model, tokenizer, name="tiny-chat", max_new_tokens=4)
    messages = [{"role": "user", "content": "hello"}]
    assert chat.chat and not chat.is_base
    assert chat.render_text(messages) == "<user>hello\n<assistant>"
    assert chat.render(messages) == tokenizer("<user>hello\n<assistant>", add_special_tokens=False)["input_ids"]
    assert isinstance(adapter_for(chat.lm), dspy.ChatAdapter)
    assert chat.lm(messages=messages, cache=False)[0] == chat.generate([messages], logprobs=False)[0].text
    with pytest.raises(ConfigError, match="in-memory"):
        chat.to_spec()
    chat.close()


def test_rendered_prompts_are_reused_and_callers_cannot_corrupt_them(tiny_local):
    messages = [{"role": "user", "content": "Question: red\nAnswer:"}]
    first = tiny_local.render(messages)
    first.append(-1)  # a caller's edit stays in its own list
    again = tiny_local.render([dict(m) for m in messages])
    assert again == first[:-1]
    assert again == list(tiny_local.tokenizer(tiny_local.render_text(messages), add_special_tokens=True)["input_ids"])
    other = tiny_local.render([{"role": "user", "content": "Question: blue\nAnswer:"}])
    assert other != again
