"""flowopt's client for OpenAI-compatible servers drops an idle connection before such a server closes it."""

from __future__ import annotations

import http.server
import threading
import time

import pytest

from flowopt.lm.server_http import server_client


class _PortEcho(http.server.BaseHTTPRequestHandler):
    """Answers each request with the client's port: which connection carried it."""

    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn

    def do_GET(self) -> None:
        body = str(self.client_address[1]).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def echo_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _PortEcho)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_client_reuses_a_fresh_connection_and_replaces_one_idle_near_a_servers_five_second_close(echo_url):
    # uvicorn (and vLLM on it) closes idle connections at 5 s; reusing one then races the close.
    client = server_client(echo_url, api_key="k", timeout_s=10.0)
    try:
        first = client.get("/a").text
        assert client.get("/b").text == first  # kept alive while fresh
        time.sleep(4.5)
        assert client.get("/c").text != first  # idle 4.5 s: a new connection, before such a server closes the old
    finally:
        client.close()


def test_the_client_sends_the_api_key_as_a_bearer_token_and_none_without_one():
    with_key = server_client("http://127.0.0.1:1/v1", api_key="secret", timeout_s=1.0)
    without = server_client("http://127.0.0.1:1/v1", api_key=None, timeout_s=1.0)
    try:
        assert with_key.headers["Authorization"] == "Bearer secret"
        assert "Authorization" not in without.headers
    finally:
        with_key.close()
        without.close()
