"""The static-cache decode loop: greedy equal to transformers' own generate, rows joining a running batch,
streaming and cancelling through on_tokens, and the compiled step (dynamo with a cheap backend)."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from flowopt.lm import decoder as decoder_module
from flowopt.lm.decoder import CompileSettings, Decoder
from flowopt.lm.sampling import RowSettings, sample

TEXTS = ["Question: What is two plus two?", "The quick brown fox jumps over the lazy dog. A stitch in time saves",
         "hello", "Numbers 0 1 2 3 4 5 6 7 8 9 10 42 100 and symbols [[ ## ]] $ % , . ; : ! ? Reasoning:"]


def _reference(local, prompt, tokens):
    """transformers' greedy generate with its default (dynamic) cache, one prompt alone."""
    with torch.no_grad():
        out = local.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                   max_new_tokens=tokens, do_sample=False, eos_token_id=local.eos_ids,
                                   pad_token_id=local.pad_id)
    return out[0, len(prompt):].tolist()


def test_greedy_decoding_equals_transformers_generate_in_float32(tiny_local):
    prompts = [tiny_local.tokenizer(t)["input_ids"] for t in TEXTS]
    assert max(len(p) for p in prompts) > 16  # longer than the tiny model's sliding window
    out = tiny_local.sample_ids(prompts, [RowSettings(max_new_tokens=10)] * len(prompts))
    for prompt, got in zip(prompts, out):
        assert got.completion_ids == _reference(tiny_local, prompt, 10)[:len(got.completion_ids)]


def test_a_row_joins_a_running_batch_and_both_match_their_solo_runs(tiny_local):
    prompts = [tiny_local.tokenizer(t)["input_ids"] for t in TEXTS[:2]]
    late: dict[str, object] = {}

    def after_third(ids: list[int], seen=[]) -> None:  # noqa: B006 - a counter local to this call
        seen.append(ids)
        if len(seen) == 3:  # the first row is mid-way: queue the second, which must join between steps
            late["future"] = tiny_local._batcher.submit(prompts[1], RowSettings(max_new_tokens=8))

    tiny_local.decode_stats.recent.clear()
    first = tiny_local.complete_ids(prompts[0], RowSettings(max_new_tokens=12), on_tokens=after_third)
    second = late["future"].result(timeout=60)  # type: ignore[attr-defined]
    assert first.completion_ids == _reference(tiny_local, prompts[0], 12)[:len(first.completion_ids)]
    assert second.completion_ids == _reference(tiny_local, prompts[1], 8)[:len(second.completion_ids)]
    assert 2 in tiny_local.decode_stats.recent  # they shared steps
    assert tiny_local.decode_stats.summary()["steps"] > 0


def test_on_tokens_streams_every_token_and_false_cancels_the_row(tiny_local):
    prompt = tiny_local.tokenizer(TEXTS[1])["input_ids"]
    streamed: list[int] = []
    full = tiny_local.complete_ids(prompt, RowSettings(max_new_tokens=8), on_tokens=streamed.extend)
    assert streamed == full.completion_ids
    cut = tiny_local.complete_ids(prompt, RowSettings(max_new_tokens=8), on_tokens=lambda ids, n=[]: (
        n.extend(ids), len(n) < 3)[1])
    assert cut.finish_reason == "cancelled" and cut.completion_ids == full.completion_ids[:3]


def test_complete_many_calls_one_callback_with_each_rows_index(tiny_local):
    prompt = tiny_local.tokenizer(TEXTS[0])["input_ids"]
    seen: dict[int, list[int]] = {}
    rows = [RowSettings(max_new_tokens=4 + i) for i in range(3)]
    out = tiny_local.complete_many(prompt, rows, on_tokens=lambda i, ids: seen.setdefault(i, []).extend(ids))
    assert {i: s.completion_ids for i, s in enumerate(out)} == seen


def test_an_error_in_on_tokens_fails_that_call_only(tiny_local):
    prompt = tiny_local.tokenizer(TEXTS[0])["input_ids"]

    def broken(ids: list[int]) -> None:
        raise KeyError("consumer gone")

    results: dict[str, object] = {}
    other = threading.Thread(target=lambda: results.setdefault(
        "ok", tiny_local.complete_ids(prompt, RowSettings(max_new_tokens=6))))
    other.start()
    with pytest.raises(KeyError, match="consumer gone"):
        tiny_local.complete_ids(prompt, RowSettings(max_new_tokens=6), on_tokens=broken)
    other.join(timeout=60)
    assert len(results["ok"].completion_ids) > 0  # type: ignore[attr-defined]


def test_the_batch_cap_follows_the_setting_or_the_devices_memory(tiny_model_dir):
    from flowopt.errors import ConfigError
    from flowopt.lm import LocalLM

    assert LocalLM(tiny_model_dir, device="cpu", dtype="float32", max_batch_size=3).max_batch_size == 3
    auto = LocalLM(tiny_model_dir, device="cpu", dtype="float32")
    assert 1 <= auto.max_batch_size <= 64 and auto.to_spec()["max_batch_size"] is None
    with pytest.raises(ConfigError, match="max_batch_size"):
        LocalLM(tiny_model_dir, device="cpu", max_batch_size=0)


def test_the_compiled_step_gives_the_eager_tokens(tiny_local, monkeypatch):
    """Dynamo captures the step (``aot_eager``: the graph without inductor's code generation, so the test
    stays fast; one bucket); greedy tokens and log-probs must equal the eager loop's, compile time is recorded."""
    monkeypatch.setattr(decoder_module, "_compile_failure", [])
    model, tokenizer = tiny_local.model, tiny_local.tokenizer
    prompts = [tokenizer(TEXTS[0])["input_ids"]]
    rows = [RowSettings(max_new_tokens=6, logprobs=True)]
    eager = sample(model, tokenizer, prompts, rows)
    compiled = Decoder(lambda: model, tokenizer, compile=CompileSettings(enabled=True, backend="aot_eager"))
    out = sample(model, tokenizer, prompts, rows, decoder=compiled)
    again = sample(model, tokenizer, prompts, rows, decoder=compiled)
    assert [s.completion_ids for s in out] == [s.completion_ids for s in eager] == [s.completion_ids for s in again]
    assert torch.allclose(out[0].logprobs, eager[0].logprobs, atol=1e-5)
    assert set(compiled.stats.compile_seconds) == {"batch 1, cache 256"}  # timed once, not again
    assert compiled.stats.eager_reason is None


def test_one_dynamic_graph_serves_every_bucket_and_cache_length(tiny_local, monkeypatch):
    """With ``dynamic=True``: batches of 1, 2, 3 and 5 rows (buckets 1, 2, 4, 8) and a prompt that grows the
    cache to 1024 columns: dynamo traces two graphs in all (a batch of one is specialized), and every
    output equals the eager loop's."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(decoder_module, "_compile_failure", [])
    model, tokenizer = tiny_local.model, tiny_local.tokenizer
    compiled = Decoder(lambda: model, tokenizer,
                       compile=CompileSettings(enabled=True, backend="eager", dynamic=True))
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    long_text = " ".join(TEXTS * 40)
    for prompts in ([TEXTS[0]], TEXTS[:2], TEXTS[:3], (TEXTS * 3)[:5], [long_text, TEXTS[1]]):
        ids = [tokenizer(p)["input_ids"] for p in prompts]
        rows = [RowSettings(max_new_tokens=4)] * len(ids)
        out = sample(model, tokenizer, ids, rows, decoder=compiled)
        assert [s.completion_ids for s in out] == [s.completion_ids for s in sample(model, tokenizer, ids, rows)]
    assert compiled.cache.length >= 1024
    assert counters["stats"]["unique_graphs"] - before == 2
    assert {"batch 1, cache 256", "batch 8, cache 256"} <= set(compiled.stats.compile_seconds)


def test_a_failing_compiler_falls_back_to_eager_and_says_so_once(tiny_local, monkeypatch, caplog):
    monkeypatch.setattr(decoder_module, "_compile_failure", [])
    model, tokenizer = tiny_local.model, tiny_local.tokenizer
    prompt = tokenizer(TEXTS[0])["input_ids"]
    broken = Decoder(lambda: model, tokenizer, compile=CompileSettings(enabled=True, backend="no-such-backend"))
    with caplog.at_level(logging.WARNING, logger="flowopt.lm.decoder"):
        out = sample(model, tokenizer, [prompt] * 2, [RowSettings(max_new_tokens=5)] * 2, decoder=broken)
    assert out[0].completion_ids == _reference(tiny_local, prompt, 5)[:len(out[0].completion_ids)]
    assert sum("decoding eagerly" in r.message for r in caplog.records) == 1
    assert broken.stats.eager_reason


def test_a_model_failure_reaches_every_caller_and_the_batcher_serves_on():
    from flowopt.lm.continuous import ContinuousBatcher

    class Broken:
        tokenizer, eos = None, set()

        def admit(self, run, rows, budget=None):
            raise RuntimeError("out of memory (simulated)")

    import contextlib

    batcher = ContinuousBatcher(Broken, lambda group: contextlib.nullcontext(), max_batch_size=lambda: 8,
                                wait_ms=50)
    futures = [batcher.submit([2, 5], RowSettings(max_new_tokens=3)) for _ in range(3)]
    for future in futures:
        with pytest.raises(RuntimeError, match="simulated"):
            future.result(timeout=30)
    with pytest.raises(RuntimeError, match="simulated"):  # the worker lived on and served the next call
        batcher.submit([2, 5], RowSettings(max_new_tokens=3)).result(timeout=30)
    batcher.close()
