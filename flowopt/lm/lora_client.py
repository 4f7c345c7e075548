"""A client for an OpenAI-compatible server that loads LoRA adapters at run time (vLLM, ``flowopt serve``).

What a trainer needs from such a server: load and unload adapters (vLLM's ``POST /v1/load_lora_adapter``
``{"lora_name", "lora_path"}`` and ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``), and one sampled
completion with the ids that were sampled and each token's log-prob (``logprobs``, plus vLLM's
``return_token_ids`` and ``return_tokens_as_token_ids``). Every failure is a :class:`~flowopt.errors.LMError`
that names the server, what it lacks and how to fix it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from flowopt.errors import LMError
from flowopt.lm.sampling import RowSettings, Sample
from flowopt.lm.server_http import server_client

logger = logging.getLogger(__name__)

START_HINT = ("start one with `vllm serve MODEL --enable-lora` (and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True) or "
              "`flowopt serve MODEL --enable-lora --lora-root DIR --port N`, and pass its /v1 URL")
ENDPOINT_HINT = ("vLLM: set VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and pass --enable-lora; "
                 "flowopt serve: pass --enable-lora --lora-root DIR")


def _token_id(token: str) -> int | None:
    """``"token_id:42"`` (vLLM's ``return_tokens_as_token_ids``) -> 42."""
    head, _, tail = token.partition(":")
    return int(tail) if head == "token_id" and tail.isdigit() else None


class LoraServer:
    """One server at ``base_url`` (ending in ``/v1``); ``api_key`` is sent as a Bearer token when given.
    ``http``: an ``httpx.Client`` to send through instead of a new one (e.g. a FastAPI ``TestClient``).

    Example:
        >>> server = LoraServer("http://127.0.0.1:8000/v1")  # doctest: +SKIP
        >>> server.load_adapter("grpo-step-3", "/srv/adapters/grpo-step-3")  # doctest: +SKIP
        >>> sample = server.sample("grpo-step-3", RowSettings(max_new_tokens=32, temperature=1.0),
        ...                        messages=[{"role": "user", "content": "2+2="}])  # doctest: +SKIP
        >>> sample.completion_ids, sample.logprobs  # doctest: +SKIP
    """

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout_s: float = 600.0,
                 http: Any = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = http if http is not None else server_client(self.base_url, api_key=api_key,
                                                                 timeout_s=timeout_s)

    def close(self) -> None:
        self._http.close()

    # -- HTTP --------------------------------------------------------------------------------------

    def _send(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Any:
        import httpx

        try:
            return self._http.request(method, path, json=body)
        except httpx.TimeoutException as exc:
            raise LMError(f"the inference server at {self.base_url} did not answer {path} in time ({exc})",
                          fix="check that it is running and not overloaded, or raise timeout_s") from exc
        except httpx.TransportError as exc:
            raise LMError(f"cannot reach the inference server at {self.base_url} ({type(exc).__name__}: {exc})",
                          fix=START_HINT) from exc

    @staticmethod
    def _message(response: Any) -> str:
        try:
            body = response.json()
        except ValueError:
            return response.text[:500]
        if isinstance(body, dict):
            error = body.get("error", body)
            if isinstance(error, dict):
                return str(error.get("message") or error.get("detail") or error)[:500]
            return str(error)[:500]
        return str(body)[:500]

    # -- models and adapters -----------------------------------------------------------------------

    def models(self) -> list[str]:
        """Ids the server serves (``GET /v1/models``): also a check that it is there."""
        response = self._send("GET", "/models")
        if response.status_code != 200:
            raise LMError(f"the inference server at {self.base_url} answered GET /models with HTTP "
                          f"{response.status_code}: {self._message(response)}",
                          fix="pass the server's OpenAI-compatible base URL, ending in /v1")
        return [str(m.get("id")) for m in response.json().get("data", [])]

    def _adapter_call(self, path: str, body: dict[str, str]) -> None:
        response = self._send("POST", path, body)
        if response.status_code == 200:
            return
        message = self._message(response)
        # No such route (vLLM without runtime LoRA updating: FastAPI's bare "Not Found"), or flowopt serve
        # started without --enable-lora.
        if response.status_code == 405 or (response.status_code == 404 and (
                message.strip().lower() == "not found" or "--enable-lora" in message)):
            raise LMError(f"the inference server at {self.base_url} has no runtime LoRA endpoint {path} "
                          f"(HTTP {response.status_code}: {message})", fix=ENDPOINT_HINT)
        if response.status_code == 403:
            raise LMError(f"the inference server at {self.base_url} refused {path} for {body}: {message}",
                          fix="save adapters under the folder the server may load from (flowopt serve's "
                              "--lora-root) and pass that folder as adapter_dir")
        raise LMError(f"the inference server at {self.base_url} failed {path} for {body} "
                      f"(HTTP {response.status_code}): {message}", fix="see the server's log")

    def load_adapter(self, name: str, path: str) -> None:
        """Load the PEFT folder ``path`` (as the server sees it) under ``name``."""
        self._adapter_call("/load_lora_adapter", {"lora_name": name, "lora_path": path})

    def unload_adapter(self, name: str) -> None:
        self._adapter_call("/unload_lora_adapter", {"lora_name": name})

    # -- sampling ----------------------------------------------------------------------------------

    def sample(self, model: str, settings: RowSettings, *, messages: Sequence[Mapping[str, str]] | None = None,
               prompt: str | None = None) -> Sample:
        """One completion of chat ``messages`` (``/chat/completions``) or a raw ``prompt`` (``/completions``),
        sampled by ``model`` (a loaded adapter's name), with the sampled ids and their log-probs.

        ``Sample.prompt_ids`` is empty when the server does not return the prompt's ids (vLLM before
        0.10.2); the caller renders them.
        """
        body: dict[str, Any] = {"model": model, "n": 1, "max_tokens": settings.max_new_tokens,
                                "temperature": settings.temperature, "top_p": settings.top_p,
                                "return_token_ids": True, "return_tokens_as_token_ids": True}
        if settings.top_k:
            body["top_k"] = settings.top_k
        if settings.seed is not None:
            body["seed"] = settings.seed
        if settings.stop:
            body["stop"] = list(settings.stop)
        if messages is not None:
            path = "/chat/completions"
            body.update(messages=[dict(m) for m in messages], logprobs=True, top_logprobs=0)
        elif prompt is not None:
            path = "/completions"
            body.update(prompt=prompt, logprobs=1)  # the sampled token's log-prob comes with the top 1
        else:
            raise ValueError("sample() needs messages= or prompt=")
        response = self._send("POST", path, body)
        if response.status_code != 200:
            raise LMError(f"the inference server at {self.base_url} failed POST {path} for model {model!r} "
                          f"(HTTP {response.status_code}): {self._message(response)}",
                          fix="check that the adapter is loaded and the request fits the served model")
        return self._parse(path, response.json())

    def _parse(self, path: str, answer: dict[str, Any]) -> Sample:
        import torch

        choice = answer["choices"][0]
        chat = path == "/chat/completions"
        raw = choice.get("logprobs") or {}
        if chat:
            entries = raw.get("content") or []
            tokens, logprobs = [e.get("token", "") for e in entries], [e.get("logprob") for e in entries]
            text = (choice.get("message") or {}).get("content") or ""
            prompt_ids = answer.get("prompt_token_ids") or choice.get("prompt_token_ids")
        else:
            tokens, logprobs = list(raw.get("tokens") or []), list(raw.get("token_logprobs") or [])
            text = choice.get("text") or ""
            prompt_ids = choice.get("prompt_token_ids") or answer.get("prompt_token_ids")
        completion_ids = choice.get("token_ids")
        if completion_ids is None:
            parsed = [_token_id(t) for t in tokens]
            completion_ids = None if any(t is None for t in parsed) else parsed
        if completion_ids is None:
            raise LMError(f"the inference server at {self.base_url} returned no token ids for the completion",
                          fix="use a server that honours return_token_ids or return_tokens_as_token_ids "
                              "(vLLM, flowopt serve)")
        if completion_ids and (not logprobs or any(lp is None for lp in logprobs)):
            raise LMError(f"the inference server at {self.base_url} returned no log-probs for the sampled tokens",
                          fix="use a server that returns logprobs (vLLM, flowopt serve); GRPO reports the "
                              "sampler's log-probs against the training forward's")
        if len(logprobs) != len(completion_ids):
            raise LMError(f"the inference server at {self.base_url} returned {len(logprobs)} log-probs for "
                          f"{len(completion_ids)} tokens", fix="report this server's response shape as a bug")
        finish = "length" if choice.get("finish_reason") == "length" else "stop"
        return Sample(prompt_ids=[int(t) for t in prompt_ids or []], completion_ids=[int(t) for t in completion_ids],
                      text=text, finish_reason=finish, logprobs=torch.tensor(logprobs, dtype=torch.float32))
