"""``flowopt serve``: a LocalLM (with its LoRA adapter) behind an OpenAI-compatible HTTP API.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``.
Requests from concurrent clients go through the LocalLM's dynamic batcher, so they share batches.
Binds to 127.0.0.1 by default: there is no authentication (any API key is accepted).

Example:
    $ flowopt serve gemma-3-270m --adapter runs/grpo/adapter --port 8011
    $ python -m flowopt.lm.serve ./my-model --port 8011          # the same, without the console script

    >>> import dspy
    >>> lm = dspy.LM("openai/gemma-3-270m", api_base="http://127.0.0.1:8011/v1", api_key="x")  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from flowopt.errors import FlowoptError
from flowopt.lm.generation import RowSettings, derive_seed

if TYPE_CHECKING:
    from flowopt.lm.local import LocalLM

logger = logging.getLogger(__name__)


class BadRequest(Exception):
    """A client error, answered as HTTP 400 in OpenAI's error shape."""


def _text_of(content: Any) -> str:
    """OpenAI message content: a string or a list of parts, of which only text parts are accepted."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise BadRequest("only text content parts are supported")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise BadRequest(f"unsupported message content {type(content).__name__}")


def _rows(local: LocalLM, body: dict[str, Any]) -> list[RowSettings]:
    """The n decoding settings of a request (OpenAI field names)."""
    n = body.get("n") or 1
    if not isinstance(n, int) or n < 1 or n > 64:
        raise BadRequest("n must be an integer between 1 and 64")
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(str(s) for s in stop)
    seed = body.get("seed")
    temperature = body.get("temperature")
    try:
        return [RowSettings(
            max_new_tokens=int(body.get("max_completion_tokens") or body.get("max_tokens") or local.max_new_tokens),
            temperature=float(local.temperature if temperature is None else temperature),
            top_p=float(1.0 if body.get("top_p") is None else body["top_p"]),
            top_k=int(body.get("top_k") or 0),
            # Sample 0 uses the seed itself, so a served call matches the same call made in-process.
            seed=None if seed is None else (int(seed) if k == 0 else derive_seed(int(seed), k)),
            stop=stop,
        ) for k in range(n)]
    except (TypeError, ValueError) as exc:
        raise BadRequest(str(exc)) from exc


def _usage(prompt_tokens: int, samples: Sequence[Any]) -> dict[str, int]:
    completion = sum(len(s.completion_ids) for s in samples)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def chat_completion(local: LocalLM, body: dict[str, Any], model_name: str) -> dict[str, Any]:
    """Answer one ``/v1/chat/completions`` body."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    if body.get("stream"):
        raise BadRequest("streaming is not supported by flowopt serve; send stream=false")
    if body.get("tools"):
        raise BadRequest("tools are not supported by local models")
    rendered = [{"role": str(m.get("role", "user")), "content": _text_of(m.get("content"))} for m in messages]
    prompt_ids = local.render(rendered)
    samples = local.complete_many(prompt_ids, _rows(local, body))
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
        "model": model_name,
        "choices": [{"index": i, "message": {"role": "assistant", "content": s.text}, "logprobs": None,
                     "finish_reason": s.finish_reason} for i, s in enumerate(samples)],
        "usage": _usage(len(prompt_ids), samples),
    }


def text_completion(local: LocalLM, body: dict[str, Any], model_name: str) -> dict[str, Any]:
    """Answer one ``/v1/completions`` body (the prompt is raw text: no chat template, no transcript)."""
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise BadRequest("prompt must be a string or a list of strings")
    if body.get("stream"):
        raise BadRequest("streaming is not supported by flowopt serve; send stream=false")
    rows = _rows(local, body)
    choices: list[dict[str, Any]] = []
    used: list[Any] = []
    prompt_tokens = 0
    for text in prompts:
        prompt_ids = local.render(text)
        prompt_tokens += len(prompt_ids)
        samples = local.complete_many(prompt_ids, rows)
        used += samples
        for s in samples:
            choices.append({"index": len(choices), "text": s.text, "logprobs": None, "finish_reason": s.finish_reason})
    return {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
            "model": model_name, "choices": choices, "usage": _usage(prompt_tokens, used)}


def create_app(local: LocalLM, *, model_name: str | None = None) -> FastAPI:
    """The FastAPI application serving ``local`` under ``model_name`` (default: its name)."""
    name = model_name or local.name
    app = FastAPI(title="flowopt serve", version="1")

    def error(status: int, message: str, kind: str) -> JSONResponse:
        return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind}})

    async def read(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError as exc:
            raise BadRequest(f"the body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        return body

    async def answer(request: Request, handler: Any) -> JSONResponse:
        try:
            body = await read(request)
            # Generation blocks; a worker thread per request lets concurrent requests meet in one batch.
            return JSONResponse(await run_in_threadpool(handler, local, body, name))
        except BadRequest as exc:
            return error(400, str(exc), "invalid_request_error")
        except FlowoptError as exc:
            return error(400, str(exc), "invalid_request_error")
        except Exception as exc:  # the server stays up; the client sees what went wrong
            logger.exception("generation failed")
            return error(500, f"{type(exc).__name__}: {exc}", "server_error")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        return await answer(request, chat_completion)

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        return await answer(request, text_completion)

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "flowopt"}]}

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "model": name, "adapter": local.active_adapter, "device": str(local.device)}

    return app


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flowopt serve",
                                     description="Serve a local model over an OpenAI-compatible HTTP API.")
    parser.add_argument("model", help="registered name (gemma-3-270m) or a folder written by save_pretrained")
    parser.add_argument("--adapter", help="a PEFT LoRA adapter folder to serve on top of the model")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, local only)")
    parser.add_argument("--name", help="model id clients use (default: the model's name)")
    parser.add_argument("--device", help="cuda, mps or cpu (default: the best available)")
    parser.add_argument("--dtype", help="float32, bfloat16 or float16 (default: bf16 on CUDA and on CPUs "
                        "with native bf16, else float32)")
    parser.add_argument("--max-new-tokens", type=int, default=512, help="default completion limit")
    parser.add_argument("--max-batch-size", type=int, default=16, help="largest dynamic batch")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def cli_main(argv: Sequence[str] | None = None) -> int:
    """``flowopt serve MODEL [--adapter DIR] --port N [--host 127.0.0.1]``; returns the exit status."""
    import uvicorn

    from flowopt.lm.local import LocalLM

    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["serve"]:  # accept the subcommand name whether or not the dispatcher strips it
        args = args[1:]
    options = _parser().parse_args(args)
    logging.basicConfig(level=options.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if options.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("binding to %s exposes the model without authentication", options.host)
    try:
        local = LocalLM(options.model, adapter=options.adapter, device=options.device, dtype=options.dtype,
                        max_new_tokens=options.max_new_tokens, max_batch_size=options.max_batch_size)
    except FlowoptError as exc:
        logger.error("%s", exc)
        return 2
    app = create_app(local, model_name=options.name)
    logger.info("serving %r at http://%s:%d/v1", options.name or local.name, options.host, options.port)
    uvicorn.run(app, host=options.host, port=options.port, log_level=options.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
