"""The HTTP client flowopt's own code uses to talk to an OpenAI-compatible server (vLLM, ``flowopt serve``).

Why it is not a plain ``httpx.Client``: a pooled keep-alive connection must never be reused just as the server
closes it. uvicorn closes an idle connection after 5 s by default (vLLM's ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``
defaults to it) and httpx also keeps idle connections for 5 s; with equal timers a request sent on a
connection at about 5 s idle can meet the server's close and fail with "Server disconnected without sending a
response". That happened in CI to a GRPO run's rollout fetch while the server process was busy training. This
client drops its idle connections after :data:`CLIENT_KEEPALIVE_S`, a second before such a server would; and
``flowopt serve`` keeps them for :data:`SERVER_KEEPALIVE_S` (:mod:`flowopt.lm.serve_lifecycle`), longer than
any common client keeps its own.

Example:
    >>> client = server_client("http://127.0.0.1:8000/v1", api_key=None, timeout_s=30.0)
    >>> str(client.base_url)
    'http://127.0.0.1:8000/v1/'
    >>> client.close()
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx

CLIENT_KEEPALIVE_S = 4.0  # under uvicorn's default 5 s, with a second's margin for a busy client thread
SERVER_KEEPALIVE_S = 75  # over httpx's and OpenAI's 5 s and aiohttp's 15 s; nginx's default


def server_client(base_url: str, *, api_key: str | None, timeout_s: float) -> httpx.Client:
    """An ``httpx.Client`` for ``base_url`` that sends ``api_key`` as a Bearer token when given."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s,
                        limits=httpx.Limits(keepalive_expiry=CLIENT_KEEPALIVE_S))
