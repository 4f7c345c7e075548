"""``flowopt serve`` in a subprocess on a free loopback port, called through dspy.LM + litellm."""

from __future__ import annotations

import contextlib
import http.client
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import dspy
import pytest

from flowopt.lm.serve_process import serve_subprocess

REPO = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Question: hello there?"}]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# The console command's entry point (``flowopt serve`` dispatches to the bench CLI's main).
CONSOLE = ("-c", "import sys; from flowopt.benchmarks.cli import main; sys.exit(main())", "serve")


def _serving(model_dir: Path, log: Path, *extra: str) -> contextlib.AbstractContextManager[str]:
    """Run ``flowopt serve MODEL ...`` (the console command's entry point) on a free loopback port."""
    # float32 like the in-process fixtures, so greedy outputs can be compared token for token. The start waits as
    # long as the library's default (180 s): on a loaded 2-core machine the server's imports alone took over 90 s.
    return serve_subprocess(model_dir, "--dtype", "float32", "--max-new-tokens", "12", "--log-level", "warning",
                            *extra, log=log, entry=CONSOLE, env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                            cwd=REPO)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with _serving(tiny_model_dir, tmp_path_factory.mktemp("serve") / "server.log", "--name", "tiny-served") as base:
        yield base


def test_served_greedy_output_matches_in_process_through_dspy_and_litellm(server, tiny_local):
    remote = dspy.LM("openai/tiny-served", api_base=server, api_key="x", engine="litellm", temperature=0.0,
                     max_tokens=8, cache=False, num_retries=0)
    served = remote(messages=MESSAGES)
    local = tiny_local.lm(messages=MESSAGES, temperature=0.0, max_tokens=8, cache=False)
    assert served == local
    assert served[0]  # something was generated
    assert remote.history[-1]["usage"]["prompt_tokens"] == len(tiny_local.render(MESSAGES))


def test_completions_endpoint_and_openai_shapes(server, tiny_local):
    status, body = _post(f"{server}/completions", {"model": "tiny-served", "prompt": "hello there", "max_tokens": 6,
                                                    "temperature": 0, "n": 2})
    assert status == 200 and body["object"] == "text_completion" and body["model"] == "tiny-served"
    expected = tiny_local.generate(["hello there"], max_new_tokens=6, temperature=0.0, logprobs=False)[0]
    assert [c["text"] for c in body["choices"]] == [expected.text] * 2
    assert body["usage"]["prompt_tokens"] == len(expected.prompt_ids)
    assert body["usage"]["completion_tokens"] == 2 * len(expected.completion_ids)
    assert _get(f"{server}/models")["data"][0]["id"] == "tiny-served"


def test_bad_requests_get_openai_style_errors(server):
    status, body = _post(f"{server}/chat/completions", {"model": "tiny-served", "messages": []})
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = _post(f"{server}/chat/completions", {"model": "gpt-4o", "messages": MESSAGES})
    assert status == 404 and body["error"]["code"] == "model_not_found" and "gpt-4o" in body["error"]["message"]


def test_an_idle_connection_stays_open_past_the_five_seconds_clients_keep_theirs(server):
    """uvicorn's default closes it at 5 s, when httpx and OpenAI's client may still reuse it: a request sent
    then failed in CI with "Server disconnected without sending a response" (flowopt.lm.server_http)."""
    url = urllib.parse.urlsplit(server)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    try:
        for wait in (0.0, 5.5):
            time.sleep(wait)
            connection.request("GET", f"{url.path}/models")
            response = connection.getresponse()
            assert response.status == 200 and json.loads(response.read())["data"]
            if not wait:
                first = connection.sock.getsockname()
        assert connection.sock.getsockname() == first  # the same connection answered after 5.5 s idle
    finally:
        connection.close()


def test_cli_refuses_a_keep_alive_under_one_second(tmp_path, caplog):
    from flowopt.lm.serve import cli_main

    assert cli_main(["serve", str(tmp_path), "--port", "1", "--keep-alive", "0"]) == 2
    assert "--keep-alive must be >= 1 second" in caplog.text


def test_cli_reports_a_missing_model_with_exit_status_2(tmp_path):
    from flowopt.lm.serve import cli_main

    assert cli_main(["serve", str(tmp_path / "missing"), "--port", "1"]) == 2


def test_serve_with_adapter_answers_with_the_adapted_weights(tiny_model_dir, tmp_path, make_adapter):
    """``flowopt serve MODEL --adapter DIR`` in its own process: what a user runs after a weights stage."""
    from flowopt.lm import LocalLM

    adapter = make_adapter(tiny_model_dir, tmp_path / "lora", seed=5)
    local = LocalLM(tiny_model_dir, device="cpu", dtype="float32", adapter=adapter, max_new_tokens=8, batch_wait_ms=1)
    try:
        expected = local.generate([MESSAGES], temperature=0.0, max_new_tokens=8, logprobs=False)[0].text
        with local.adapter_disabled():
            base_text = local.generate([MESSAGES], temperature=0.0, max_new_tokens=8, logprobs=False)[0].text
    finally:
        local.close()
    assert base_text != expected  # the adapter matters, so serving it is what is checked
    with _serving(tiny_model_dir, tmp_path / "server.log", "--adapter", str(adapter), "--name", "tuned") as base:
        assert _get(base.removesuffix("/v1") + "/health")["adapter"] == "lora"
        remote = dspy.LM("openai/tuned", api_base=base, api_key="x", engine="litellm", temperature=0.0,
                         max_tokens=8, cache=False, num_retries=0)
        assert remote(messages=MESSAGES) == [expected]


def test_serve_quantize_decodes_concurrent_requests_through_the_twin(tiny_model_dir, tmp_path):
    """``flowopt serve MODEL --quantize int8``: eight concurrent requests decode through the quantized twin (steps
    of 5-8 rows: int8 activations), whose answers stay close to the exact weights' (the twin's closeness itself
    is checked in-process, tests/lm/test_quantize.py; here, that the server decodes through it)."""
    from concurrent.futures import ThreadPoolExecutor

    from flowopt.lm import LocalLM

    prompts = [f"Question: {word}?" for word in ("hello there", "two plus two", "a stitch", "brown fox",
                                                  "numbers", "time", "helpful", "fields")]
    messages = [[{"role": "user", "content": p}] for p in prompts]
    exact = LocalLM(tiny_model_dir, device="cpu", dtype="float32", max_new_tokens=8, batch_wait_ms=1)
    try:
        want = [exact.generate([m], temperature=0.0, max_new_tokens=8, logprobs=False)[0].text for m in messages]
    finally:
        exact.close()
    with _serving(tiny_model_dir, tmp_path / "server.log", "--quantize", "int8", "--name", "q") as base:
        health = _get(base.removesuffix("/v1") + "/health")
        assert health["quantize"] == "int8" and health["decode_path"] is None  # nothing decoded yet
        remote = dspy.LM("openai/q", api_base=base, api_key="x", engine="litellm", temperature=0.0,
                         max_tokens=8, cache=False, num_retries=0)
        with ThreadPoolExecutor(len(messages)) as pool:
            served = [out[0] for out in pool.map(lambda m: remote(messages=m), messages)]
        health = _get(base.removesuffix("/v1") + "/health")
    assert health["decode_path"] == "decode step on cpu: quantized int8 twin"
    same = sum(a == b for a, b in zip(served, want))
    assert all(served) and same >= 6, (served, want)  # measured 7 of 8: one near tie picks differently


def test_serve_parses_quantize_and_compile_and_refuses_unknown_values(capsys):
    from flowopt.lm.serve import _parser

    options = _parser().parse_args(["m", "--quantize", "int4", "--compile", "on"])
    assert (options.quantize, options.compile) == ("int4", "on")
    options = _parser().parse_args(["m"])
    assert (options.quantize, options.compile) == (None, "auto")
    for bad in (["--quantize", "int3"], ["--compile", "yes"]):
        with pytest.raises(SystemExit):
            _parser().parse_args(["m", *bad])
        assert "invalid choice" in capsys.readouterr().err


# --- bad request bodies, through the real app in-process (no generation is reached) -----------------

DEEP = "[" * 100_000 + "]" * 100_000
NESTED_OBJECT = '{"a":' * 900 + "1" + "}" * 900
MSG = [{"role": "user", "content": "hi"}]
BAD_CHAT_BODIES = [
    ("not json", "{not json"),
    ("an array", "[1, 2]"),
    ("a string", '"hi"'),
    ("empty object", "{}"),
    ("nested 100k deep", DEEP),
    ("messages nested 100k deep", '{"messages": ' + DEEP + "}"),
    ("message content nested", json.dumps({"messages": [{"role": "user", "content": [[[["hi"]]]]}]})),
    ("messages of strings", json.dumps({"messages": ["hi"]})),
    ("messages a string", json.dumps({"messages": "hi"})),
    ("messages empty", json.dumps({"messages": []})),
    ("message null", json.dumps({"messages": [None]})),
    ("unknown role", json.dumps({"messages": [{"role": "root", "content": "hi"}]})),
    ("content a number", json.dumps({"messages": [{"role": "user", "content": 5}]})),
    ("image part", json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]})),
    ("stop a number", json.dumps({"messages": MSG, "stop": 5})),
    ("stop list of numbers", json.dumps({"messages": MSG, "stop": [1, 2]})),
    ("too many stops", json.dumps({"messages": MSG, "stop": ["a"] * 50})),
    ("NaN temperature", '{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'),
    ("Infinity temperature", '{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}'),
    ("negative temperature", json.dumps({"messages": MSG, "temperature": -1})),
    ("temperature a string", json.dumps({"messages": MSG, "temperature": "hot"})),
    ("top_p zero", json.dumps({"messages": MSG, "top_p": 0})),
    ("n zero", json.dumps({"messages": MSG, "n": 0})),
    ("n huge", json.dumps({"messages": MSG, "n": 10**9})),
    ("n a float", json.dumps({"messages": MSG, "n": 2.5})),
    ("n a string", json.dumps({"messages": MSG, "n": "3"})),
    ("max_tokens huge", json.dumps({"messages": MSG, "max_tokens": 10**9})),
    ("max_tokens negative", json.dumps({"messages": MSG, "max_tokens": -1})),
    ("max_tokens a string", json.dumps({"messages": MSG, "max_tokens": "12"})),
    ("max_completion_tokens huge", json.dumps({"messages": MSG, "max_completion_tokens": 10**6})),
    ("seed a float", json.dumps({"messages": MSG, "seed": 1.5})),
    ("seed past 64 bits", json.dumps({"messages": MSG, "seed": 2**70})),
    ("stream_options without stream", json.dumps({"messages": MSG, "stream_options": {"include_usage": True}})),
    ("response_format json_object", json.dumps({"messages": MSG, "response_format": {"type": "json_object"}})),
    ("logit_bias", json.dumps({"messages": MSG, "logit_bias": {"5": 10}})),
    ("presence_penalty", json.dumps({"messages": MSG, "presence_penalty": 0.5})),
    ("max_tokens 0 in chat", json.dumps({"messages": MSG, "max_tokens": 0})),
    ("logprobs while streaming", json.dumps({"messages": MSG, "stream": True, "logprobs": True})),
    ("tools", json.dumps({"messages": MSG, "tools": [{"type": "function"}]})),
    ("too many messages", json.dumps({"messages": MSG * 1000})),
    ("a 1 MB message", json.dumps({"messages": [{"role": "user", "content": "x" * 2**20}]})),
]
BAD_COMPLETION_BODIES = [
    ("no prompt", "{}"),
    ("prompt a number", json.dumps({"prompt": 5})),
    ("prompt list of numbers", json.dumps({"prompt": [1, 2]})),
    ("prompt empty list", json.dumps({"prompt": []})),
    ("prompt nested 100k deep", '{"prompt": ' + DEEP + "}"),
    ("too many prompts", json.dumps({"prompt": ["hi"] * 1000})),
    ("n x prompts over the cap", json.dumps({"prompt": ["hi"] * 8, "n": 16})),
    ("NaN top_p", '{"prompt": "hi", "top_p": NaN}'),
    ("max_tokens 0 without echo", json.dumps({"prompt": "hi", "max_tokens": 0})),
    ("suffix", json.dumps({"prompt": "hi", "suffix": "end"})),
    ("best_of 3", json.dumps({"prompt": "hi", "best_of": 3})),
]


@pytest.fixture(scope="module")
def client(tiny_local):
    from fastapi.testclient import TestClient

    from flowopt.lm.serve import create_app

    with TestClient(create_app(tiny_local, model_name="tiny")) as test_client:
        yield test_client


@pytest.mark.parametrize(("path", "label", "body"),
                         [("/v1/chat/completions", label, body) for label, body in BAD_CHAT_BODIES]
                         + [("/v1/completions", label, body) for label, body in BAD_COMPLETION_BODIES],
                         ids=[label for label, _ in BAD_CHAT_BODIES + BAD_COMPLETION_BODIES])
def test_bad_bodies_get_a_400_in_openai_shape(client, tiny_local, monkeypatch, path, label, body):
    calls = []
    monkeypatch.setattr(tiny_local, "complete_many", lambda *a, **k: calls.append(a) or [])
    response = client.post(path, content=body.encode(), headers={"Content-Type": "application/json"})
    assert response.status_code == 400, (label, response.text[:500])
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert len(response.content) < 5000  # the offending input is never echoed back
    assert calls == []  # rejected before any generation


def test_a_good_body_still_generates_in_process(client):
    response = client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 3, "temperature": 0})
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["role"] == "assistant"
    # Fields OpenAI clients send that a local model ignores are dropped unread, however deep.
    ignored = json.dumps({"messages": MSG, "max_tokens": 2})[:-1] + ', "user": ' + NESTED_OBJECT + "}"
    response = client.post("/v1/chat/completions", content=ignored.encode(),
                           headers={"Content-Type": "application/json"})
    assert response.status_code == 200 and len(response.json()["choices"]) == 1
