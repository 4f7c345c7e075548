"""``flowopt serve`` in a subprocess on a free loopback port, called through dspy.LM + litellm."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import dspy
import pytest

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


@contextlib.contextmanager
def _serving(model_dir: Path, log: Path, *extra: str) -> Iterator[str]:
    """Run ``flowopt serve MODEL ...`` (the console command's entry point) on a free loopback port."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    # float32 like the in-process fixtures, so greedy outputs can be compared token for token.
    command = [sys.executable, "-c", "import sys; from flowopt.benchmarks.cli import main; sys.exit(main())",
               "serve", str(model_dir), "--port", str(port), "--dtype", "float32", "--max-new-tokens", "12",
               "--log-level", "warning", *extra]
    with log.open("w") as handle:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                _get(f"{base}/models")
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"server did not start:\n{log.read_text()}") from None
                time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with _serving(tiny_model_dir, tmp_path_factory.mktemp("serve") / "server.log", "--name", "tiny-served") as base:
        yield base


def _free_port() -> int:
    """A free loopback port (released again just before the server binds it)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    status, body = _post(f"{server}/chat/completions", {"messages": MESSAGES, "stream": True})
    assert status == 400 and "stream" in body["error"]["message"]


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
