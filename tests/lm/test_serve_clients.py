"""``flowopt serve`` driven by other people's clients: the official ``openai`` package and litellm.

The app runs under uvicorn in a thread of this process (a real HTTP server on a free loopback port),
over the tiny model, so tests can also watch the decode loop while a client reads the stream.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import litellm
import openai
import pytest

from flowopt.lm.sampling import RowSettings
from flowopt.lm.serve import create_app
from flowopt.lm.serve_schema import MAX_BODY_BYTES
from flowopt.lm.serve_stream import HeldBackText
from flowopt.lm.server_http import SERVER_KEEPALIVE_S
from flowopt.ports import free_port
from tests.lm.conftest import serve_in_thread

MSG = [{"role": "user", "content": "Question: hello there?"}]


@pytest.fixture(scope="module")
def base_url(tiny_local):
    import uvicorn

    config = uvicorn.Config(create_app(tiny_local, model_name="tiny"), host="127.0.0.1", port=free_port(),
                            log_level="warning", timeout_keep_alive=SERVER_KEEPALIVE_S)  # as flowopt serve
    with serve_in_thread(uvicorn.Server(config)) as base:
        yield base


@pytest.fixture
def client(base_url):
    with openai.OpenAI(base_url=base_url, api_key="x", max_retries=0) as c:
        yield c


def greedy_chat(client, **extra):
    return client.chat.completions.create(model="tiny", messages=MSG, temperature=0, max_tokens=10, **extra)


# ---------------------------------------------------------------- models
def test_unknown_model_is_a_404_and_served_models_are_retrievable(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=2)
    assert caught.value.body["code"] == "model_not_found"  # OpenAI's error shape, read by its client
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_a_runtime_loaded_adapter_is_a_model(tiny_model_dir, tmp_path, make_adapter):
    from fastapi.testclient import TestClient

    from flowopt.lm import LocalLM
    from flowopt.lm.serve_lora import RuntimeLoras

    local = LocalLM(tiny_model_dir, device="cpu", dtype="float32", max_new_tokens=4, batch_wait_ms=1)
    make_adapter(tiny_model_dir, tmp_path / "a", seed=5)
    app = create_app(local, model_name="tiny", loras=RuntimeLoras(local, lora_root=tmp_path))
    try:
        with TestClient(app) as http:
            assert http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(tmp_path / "a")}
                             ).status_code == 200
            remote = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
            assert remote.models.retrieve("a").id == "a"
            assert remote.chat.completions.create(model="a", messages=MSG, max_tokens=2).model == "a"
            http.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
            with pytest.raises(openai.NotFoundError):
                remote.models.retrieve("a")
    finally:
        local.close()


# ---------------------------------------------------------------- log-probs
def test_chat_top_logprobs_list_the_likeliest_tokens(client, tiny_local):
    answer = greedy_chat(client, logprobs=True, top_logprobs=3)
    entries = answer.choices[0].logprobs.content
    assert entries and len(entries) == answer.usage.completion_tokens
    for entry in entries:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        # Greedy: the sampled token is the likeliest one, with the log-prob the sampler gave it.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)


def test_completions_logprobs_n_give_the_top_n_per_token(client):
    # Tokens as "token_id:N" (vLLM's option): byte pieces that decode alike would share a text key.
    answer = client.completions.create(model="tiny", prompt="hello there", temperature=0, max_tokens=5, logprobs=2,
                                       extra_body={"return_tokens_as_token_ids": True})
    logprobs = answer.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 2 and top[token] == pytest.approx(logprob, abs=1e-4)
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4)  # greedy picked the likeliest


def test_echo_with_max_tokens_0_scores_the_prompt(client, tiny_local):
    """What evaluation harnesses send for a prompt's log-likelihood."""
    prompt = "The quick brown fox jumps over the lazy dog."
    answer = client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    choice = answer.choices[0]
    ids = tiny_local.render(prompt)
    expected = tiny_local.token_logprobs([ids[:1]], [ids[1:]])[0].tolist()  # the training scorer
    assert choice.text == prompt and answer.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == len(ids) and choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert choice.logprobs.text_offset[0] == 0


def test_echo_puts_the_prompt_before_the_completion(client):
    plain = client.completions.create(model="tiny", prompt="hello there", temperature=0, max_tokens=4)
    echoed = client.completions.create(model="tiny", prompt="hello there", temperature=0, max_tokens=4, echo=True)
    assert echoed.choices[0].text == "hello there" + plain.choices[0].text


# ---------------------------------------------------------------- refused fields and limits
def test_response_format_is_refused_by_name(client):
    with pytest.raises(openai.BadRequestError, match="response_format"):
        greedy_chat(client, response_format={"type": "json_object"})
    assert greedy_chat(client, response_format={"type": "text"}).choices[0].message.role == "assistant"


def test_a_body_over_the_cap_is_a_413_declared_or_chunked(base_url):
    body = json.dumps({"model": "tiny", "messages": MSG, "user": "x" * (MAX_BODY_BYTES + 10)}).encode()
    response = httpx.post(f"{base_url}/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and "request body over" in response.json()["error"]["message"]

    def pieces():
        for start in range(0, len(body), 2**20):
            yield body[start:start + 2**20]

    response = httpx.post(f"{base_url}/chat/completions", content=pieces(),
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 413


def test_chat_without_max_tokens_uses_what_the_context_has_left(client, tiny_local):
    context = tiny_local.base_model.config.max_position_embeddings
    words = ["The", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog."]
    text, k = "", 0
    while len(tiny_local.render([{"role": "user", "content": f"{text} {words[k % 9]}"}])) < context - 5:
        text, k = f"{text} {words[k % 9]}", k + 1
    left = context - len(tiny_local.render([{"role": "user", "content": text}]))
    assert 0 < left < tiny_local.max_new_tokens  # the server's default would not fit
    answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}], temperature=0)
    assert answer.usage.completion_tokens <= left


# ---------------------------------------------------------------- streaming
def test_chat_stream_matches_the_answer_and_reports_usage(client):
    whole = greedy_chat(client)
    stream = greedy_chat(client, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2  # piece by piece


def test_completions_stream_with_several_choices(client):
    kwargs = {"model": "tiny", "prompt": "hello there", "max_tokens": 6, "temperature": 1.0, "seed": 3, "n": 2}
    whole = client.completions.create(**kwargs)
    texts = ["", ""]
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in whole.choices]


def test_streamed_text_never_shows_a_stop_string(client, tiny_local):
    full = greedy_chat(client).choices[0].message.content
    stop = full[3:6]
    assert len(stop) == 3 and stop.strip()
    cut = greedy_chat(client, stop=[stop]).choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in greedy_chat(client, stop=[stop], stream=True) if c.choices]
    assert "".join(pieces) == cut == full[:full.find(stop)]
    assert all(stop not in "".join(pieces[:k]) for k in range(len(pieces) + 1))


def test_held_back_text_waits_for_a_possible_stop_string(tiny_local):
    held = HeldBackText(tiny_local.tokenizer, stops=("END",))
    ids = tiny_local.tokenizer.encode("abc EN", add_special_tokens=False)
    assert "".join(held.push([t]) for t in ids) == "abc "  # "EN" may start "END": not sent yet
    assert held.finish("abc ENx") == "ENx"


def test_the_first_token_reaches_the_client_before_the_completion_ends(client, tiny_local, monkeypatch):
    """The decode loop is paused after its first step until the client has read a piece of text."""
    read_first, resumed = threading.Event(), threading.Event()
    read_while_paused: list[bool] = []
    real = tiny_local.complete_ids

    def gated(prompt_ids, settings, *, adapter=..., on_tokens=None):
        steps = [0]

        def watch(ids):
            steps[0] += 1
            keep = on_tokens(ids) if on_tokens is not None else None
            if steps[0] == 2:  # the first piece was sent at step 1; wait for the client to read it
                read_while_paused.append(read_first.wait(timeout=30))
                resumed.set()
            return keep

        return real(prompt_ids, settings, adapter=adapter, on_tokens=watch)

    monkeypatch.setattr(tiny_local, "complete_ids", gated)
    stream = client.completions.create(model="tiny", prompt="hello there", temperature=0, max_tokens=10,
                                       stream=True)
    first_text = ""
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            first_text = chunk.choices[0].text
            read_first.set()
            break
    stream.close()
    assert resumed.wait(timeout=30)
    assert first_text and read_while_paused == [True]  # read while the row was paused at its second step


# ---------------------------------------------------------------- litellm
def test_litellm_reads_the_stream_and_the_404(base_url, client):
    whole = greedy_chat(client).choices[0].message.content
    chunks = litellm.completion(model="openai/tiny", api_base=base_url, api_key="x", messages=MSG, temperature=0,
                                max_tokens=10, stream=True, stream_options={"include_usage": True})
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == whole
    with pytest.raises(litellm.NotFoundError):
        litellm.completion(model="openai/gpt-4o", api_base=base_url, api_key="x", messages=MSG, max_tokens=2,
                           num_retries=0)


def test_a_cancelled_row_ends_early(tiny_local):
    prompt = tiny_local.render("hello there")
    sample = tiny_local.complete_ids(prompt, RowSettings(max_new_tokens=12), on_tokens=lambda ids: False)
    assert len(sample.completion_ids) == 1


def test_a_client_that_leaves_mid_stream_cancels_its_rows():
    """Closing the event stream (what a disconnect does) makes the row's next on_tokens return False."""
    import asyncio

    from flowopt.lm.sampling import Sample
    from flowopt.lm.serve_stream import StreamJob, stream_rows

    class Letters:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    class SlowLocal:
        tokenizer = Letters()
        steps = 0
        told_to_stop = threading.Event()

        def complete_ids(self, prompt_ids, row, *, adapter, on_tokens):
            ids = []
            for step in range(1000):  # 10 s if never cancelled
                SlowLocal.steps = step + 1
                ids.append(65 + step % 26)
                if on_tokens([ids[-1]]) is False:
                    SlowLocal.told_to_stop.set()
                    break
                time.sleep(0.01)
            return Sample(list(prompt_ids), ids, Letters().decode(ids), "length")

    async def leave_after_first_piece():
        events = stream_rows(SlowLocal(), [StreamJob(0, 0, [1], RowSettings(max_new_tokens=1000))], adapter=...,
                             chunk=lambda i, text, finish: {"text": text})
        first = await events.__anext__()
        await events.aclose()
        return first

    assert b'"text": "A"' in asyncio.run(leave_after_first_piece())
    assert SlowLocal.told_to_stop.wait(timeout=10) and SlowLocal.steps < 1000
