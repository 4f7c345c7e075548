"""``flowopt serve`` ending work early: a client that leaves a non-streamed request, and SIGTERM/SIGINT.

The disconnect test runs the app under uvicorn in a thread of this process (so it can watch the rows);
the signal tests start ``flowopt serve`` as a real subprocess and signal it.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest

from flowopt.lm.serve import create_app
from flowopt.lm.serve_lifecycle import GracefulServer
from flowopt.lm.serve_process import serve_process
from flowopt.ports import free_port
from tests.lm.conftest import serve_in_thread

LONG = 40  # tokens a request asks for; the tiny model does not stop early on the prompt below


def _post_then_close(port: int, path: str, body: dict, close_when: threading.Event) -> None:
    """Send a request on a raw socket and close the connection once ``close_when`` is set (a client leaving)."""
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head + payload)
        assert close_when.wait(timeout=60), "the request never started decoding"


@pytest.mark.parametrize("path, extra", [("/v1/completions", {"prompt": "hello there"}),
                                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_a_client_that_leaves_a_non_streamed_request_frees_its_rows(tiny_local, monkeypatch, path, extra):
    """The same request decodes all LONG tokens while its client stays; when the client disconnects after
    the first decode step, both rows end as "cancelled" with fewer tokens, and the batch serves the next
    request. The decode loop is held (not timed) from the first step until the server has seen the
    disconnect; without the cancel the rows would go on to LONG tokens after 30 s."""
    import uvicorn

    real = tiny_local.complete_many
    returned: list[list] = []
    decoding, abandoning, left = threading.Event(), threading.Event(), threading.Event()

    def watched(prompt_ids, settings, *, adapter=..., on_tokens=None):
        def step(index, ids):
            decoding.set()
            keep = on_tokens(index, ids) if on_tokens is not None else None
            if abandoning.is_set():  # hold the rows until the client left and the server cancelled them (or 30 s)
                left.wait(timeout=30)
                deadline = time.monotonic() + 30
                while keep is not False and time.monotonic() < deadline:
                    time.sleep(0.01)
                    keep = on_tokens(index, ids)
            return keep

        samples = real(prompt_ids, settings, adapter=adapter, on_tokens=step)
        returned.append(samples)
        return samples

    monkeypatch.setattr(tiny_local, "complete_many", watched)
    port = free_port()
    config = uvicorn.Config(create_app(tiny_local, model_name="tiny"), host="127.0.0.1", port=port,
                            log_level="warning")
    body = {"model": "tiny", "temperature": 0, "max_tokens": LONG, "n": 2, **extra}
    with serve_in_thread(uvicorn.Server(config)) as base:
        stayed = httpx.post(f"{base}{path.removeprefix('/v1')}", json=body, timeout=120).json()
        assert stayed["usage"]["completion_tokens"] == 2 * LONG
        assert [c["finish_reason"] for c in stayed["choices"]] == ["length", "length"]

        decoding.clear()
        abandoning.set()
        client = threading.Thread(target=_post_then_close, args=(port, path, body, decoding))
        client.start()
        client.join(timeout=60)
        left.set()
        deadline = time.monotonic() + 60
        while len(returned) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(returned) == 2, "the abandoned request's rows never returned"
        abandoned = returned[1]
        assert [s.finish_reason for s in abandoned] == ["cancelled", "cancelled"]
        assert all(len(s.completion_ids) < LONG for s in abandoned)
        abandoning.clear()
        after = httpx.post(f"{base}{path.removeprefix('/v1')}", json={**body, "max_tokens": 3}, timeout=60)
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 6


def test_a_stop_signal_ends_the_server_with_128_plus_the_signal(tiny_local):
    """In-process: uvicorn's handler for SIGINT, called as the signal would call it, stops the server,
    which stops accepting and reports 130 (the real signal to a subprocess: the tests below)."""
    import uvicorn

    port = free_port()
    server = GracefulServer(uvicorn.Config(create_app(tiny_local, model_name="tiny"), host="127.0.0.1", port=port,
                                           log_level="warning"))
    with serve_in_thread(server) as base:
        assert httpx.get(f"{base}/models", timeout=10).status_code == 200
        assert server.exit_status == 0
        server.handle_exit(signal.SIGINT, None)
        deadline = time.monotonic() + 30
        while server.started and not _refused(port) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _refused(port)
    assert server.stop_signal == signal.SIGINT and server.exit_status == 130


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return False
    except OSError:
        return True


def _stream(base: str, max_tokens: int, started: threading.Event, out: dict) -> None:
    """Stream a completion; set ``started`` once the server answered the headers (the request is in flight);
    ``out``: its status, the text pieces, whether [DONE] came, the error that ended it."""
    out.update(pieces=[], done=False, error=None, status=None)
    body = {"model": "tiny", "prompt": "red", "temperature": 0, "max_tokens": max_tokens, "stream": True}
    try:
        with httpx.stream("POST", f"{base}/completions", json=body, timeout=120) as response:
            out["status"] = response.status_code
            started.set()
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    choice = json.loads(line[6:])["choices"][0]
                    if choice["text"]:
                        out["pieces"].append(choice["text"])
    except httpx.HTTPError as exc:  # the server cancelled this stream at shutdown
        out["error"] = type(exc).__name__
    finally:
        started.set()


def _stop_with(sig: int, model_dir, log) -> dict:
    """Serve, open a long and a short stream, send ``sig`` once both are in flight; what each client saw."""
    short, long_ = {}, {}
    with serve_process(model_dir, "--name", "tiny", "--dtype", "float32", "--shutdown-timeout", "1",
                       "--log-level", "info", log=log, env={"OMP_NUM_THREADS": "1"}, start_timeout_s=180) as served:
        port = httpx.URL(served.base).port
        threads = []
        for out, max_tokens in ((long_, 2000), (short, 2)):
            started = threading.Event()
            threads.append(threading.Thread(target=_stream, args=(served.base, max_tokens, started, out)))
            threads[-1].start()
            assert started.wait(timeout=60)
        served.process.send_signal(sig)
        deadline = time.monotonic() + 30
        while not _refused(port) and time.monotonic() < deadline:
            time.sleep(0.05)
        refused = _refused(port)
        status = served.process.wait(timeout=60)
        for thread in threads:
            thread.join(timeout=60)
    return {"status": status, "refused": refused, "short": short, "long": long_, "log": log.read_text()}


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    """A random word-level model whose greedy answer to "red" never ends before 2,000 tokens (its context)."""
    from flowopt.optimizers.weights.tiny import tiny_causal_lm

    folder = tmp_path_factory.mktemp("long-model")
    model, tokenizer = tiny_causal_lm(["red", "blue", "green"], seed=0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_sigterm_stops_accepting_finishes_a_short_request_cancels_a_long_one_and_exits_143(long_model_dir, tmp_path):
    seen = _stop_with(signal.SIGTERM, long_model_dir, tmp_path / "serve.log")
    assert seen["status"] == 143, seen["log"][-3000:]
    assert seen["short"]["status"] == seen["long"]["status"] == 200
    assert seen["refused"]  # no new connections once the signal arrived
    assert seen["short"]["done"] and seen["short"]["error"] is None  # finished within the grace period
    assert not seen["long"]["done"] and len(seen["long"]["pieces"]) < 2000  # cancelled after it
    assert "SIGTERM received" in seen["log"] and "stopped by SIGTERM" in seen["log"]


@pytest.mark.slow
def test_sigint_to_the_server_exits_130(long_model_dir, tmp_path):
    """Ctrl-C takes the same path as SIGTERM (covered in the default suite by the test above and by
    test_a_stop_signal_ends_the_server_with_128_plus_the_signal); this sends the real signal."""
    seen = _stop_with(signal.SIGINT, long_model_dir, tmp_path / "serve.log")
    assert seen["status"] == 130, seen["log"][-3000:]
    assert seen["refused"] and seen["short"]["done"] and not seen["long"]["done"]
    assert "SIGINT received" in seen["log"] and "stopped by SIGINT" in seen["log"]
