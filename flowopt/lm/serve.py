"""``flowopt serve``: a LocalLM (with its LoRA adapter) behind an OpenAI-compatible HTTP API.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``,
and with ``--enable-lora --lora-root DIR`` vLLM's runtime adapter endpoints ``POST /v1/load_lora_adapter``
and ``POST /v1/unload_lora_adapter`` (:mod:`flowopt.lm.serve_lora`); a request samples with a loaded
adapter by naming it as its ``model``. Requests from concurrent clients go through the LocalLM's dynamic
batcher, so they share batches. Binds to 127.0.0.1 by default: there is no authentication (any API key
is accepted).

Log-probs: ``logprobs=true`` (chat) or ``logprobs=N`` (completions) returns each sampled token's
log-prob under the distribution it was drawn from (``softmax(logits / T)``); ``top_logprobs`` lists are
empty (the sampler computes only the sampled token's). vLLM's extensions ``return_token_ids`` (the
prompt's and completion's token ids) and ``return_tokens_as_token_ids`` (tokens as ``token_id:N``) are
honoured, so a trainer gets exactly the ids that were sampled.

Example:
    $ flowopt serve gemma-3-270m --adapter runs/grpo/adapter --port 8011
    $ flowopt serve ./my-model --enable-lora --lora-root runs/served-adapters --port 8012
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
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from flowopt.errors import FlowoptError
from flowopt.lm.sampling import RowSettings, derive_seed
from flowopt.lm.serve_lora import LoraRefused, RuntimeLoras
from flowopt.lm.serve_record import Recording, RecordingRefused, RolloutRecorder

if TYPE_CHECKING:
    from flowopt.lm.local import LocalLM

logger = logging.getLogger(__name__)

# Caps per request: a client cannot make one request hold the model for long or the server's memory.
MAX_PROMPTS = 32  # prompts in one /v1/completions request
MAX_ROWS = 64  # completions in one request: n x prompts
MAX_MESSAGES = 256
MAX_TEXT_CHARS = 200_000  # one prompt, message or text part
MAX_TOKENS = 4096  # max_tokens / max_completion_tokens
MAX_STOPS = 8
MAX_TOP_LOGPROBS = 20

_Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
_Finite = Annotated[float, Field(allow_inf_nan=False)]


class BadRequest(Exception):
    """A client error, answered as HTTP 400 in OpenAI's error shape."""


class _Request(BaseModel):
    # OpenAI clients send fields a local model has no use for (user, logit_bias, ...): ignored, never
    # stored, so a deeply nested unknown field costs nothing.
    model_config = ConfigDict(extra="ignore")


class TextPart(_Request):
    """One part of a message's content; only text parts are served."""

    type: Literal["text"]
    text: _Text


class ChatMessage(_Request):
    """One chat message: a role and text (a string or a list of text parts)."""

    role: Literal["system", "developer", "user", "assistant", "tool"] = "user"
    content: _Text | Annotated[list[TextPart], Field(max_length=MAX_MESSAGES)] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class SamplingRequest(_Request):
    """The decoding settings both endpoints share (OpenAI's names and meanings), with bounds."""

    model: Annotated[str, Field(max_length=256)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_ROWS, strict=True)] = 1
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS, strict=True)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS, strict=True)] | None = None
    temperature: Annotated[_Finite, Field(ge=0, le=2)] | None = None
    top_p: Annotated[_Finite, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0, le=100_000, strict=True)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64, strict=True)] | None = None
    stop: Annotated[str, Field(max_length=256)] | Annotated[
        list[Annotated[str, Field(max_length=256)]], Field(max_length=MAX_STOPS)] | None = None
    stream: bool = False
    return_token_ids: bool = False  # vLLM: prompt_token_ids and each choice's token_ids in the response
    return_tokens_as_token_ids: bool = False  # vLLM: log-prob tokens written as "token_id:N"

    def wants_logprobs(self) -> bool:
        return False


class ChatRequest(SamplingRequest):
    """A ``/v1/chat/completions`` body."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    tools: Annotated[list[dict[str, Any]], Field(max_length=0)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS, strict=True)] | None = None

    def wants_logprobs(self) -> bool:
        return self.logprobs


class CompletionRequest(SamplingRequest):
    """A ``/v1/completions`` body: one prompt or a list of them."""

    prompt: _Text | Annotated[list[_Text], Field(min_length=1, max_length=MAX_PROMPTS)]
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS, strict=True)] | None = None

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None


class LoadLoraRequest(_Request):
    """A ``/v1/load_lora_adapter`` body (vLLM's shape)."""

    lora_name: Annotated[str, Field(min_length=1, max_length=128)]
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]


class UnloadLoraRequest(_Request):
    """A ``/v1/unload_lora_adapter`` body (vLLM's shape)."""

    lora_name: Annotated[str, Field(min_length=1, max_length=128)]


def _rows(local: LocalLM, body: SamplingRequest, prompts: int = 1) -> list[RowSettings]:
    """The n decoding settings of a request."""
    if body.stream:
        raise BadRequest("streaming is not supported by flowopt serve; send stream=false")
    if body.n * prompts > MAX_ROWS:
        raise BadRequest(f"n x prompts = {body.n * prompts} completions; at most {MAX_ROWS} per request")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    seed = body.seed
    try:
        return [RowSettings(
            max_new_tokens=body.max_completion_tokens or body.max_tokens or local.max_new_tokens,
            temperature=float(local.temperature if body.temperature is None else body.temperature),
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            # Sample 0 uses the seed itself, so a served call matches the same call made in-process.
            seed=None if seed is None else (seed if k == 0 else derive_seed(seed, k)),
            stop=stop,
            logprobs=body.wants_logprobs(),
        ) for k in range(body.n)]
    except (TypeError, ValueError) as exc:
        raise BadRequest(str(exc)) from exc


def _usage(prompt_tokens: int, samples: Sequence[Any]) -> dict[str, int]:
    completion = sum(len(s.completion_ids) for s in samples)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def _tokens(local: LocalLM, sample: Any, as_ids: bool) -> list[str]:
    if as_ids:
        return [f"token_id:{t}" for t in sample.completion_ids]
    return [local.tokenizer.decode([t]) for t in sample.completion_ids]


def _chat_logprobs(local: LocalLM, sample: Any, body: ChatRequest) -> dict[str, Any] | None:
    """OpenAI's chat ``logprobs`` object: one entry per sampled token (``top_logprobs`` left empty)."""
    if not body.logprobs or sample.logprobs is None:
        return None
    tokens = _tokens(local, sample, body.return_tokens_as_token_ids)
    return {"content": [{"token": token, "logprob": float(lp), "bytes": list(token.encode()), "top_logprobs": []}
                        for token, lp in zip(tokens, sample.logprobs.tolist())]}


def _text_logprobs(local: LocalLM, sample: Any, body: CompletionRequest) -> dict[str, Any] | None:
    """OpenAI's legacy completions ``logprobs`` object (``top_logprobs`` null: not computed)."""
    if body.logprobs is None or sample.logprobs is None:
        return None
    tokens = _tokens(local, sample, body.return_tokens_as_token_ids)
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {"tokens": tokens, "token_logprobs": [float(lp) for lp in sample.logprobs.tolist()],
            "top_logprobs": None, "text_offset": offsets}


def chat_completion(local: LocalLM, body: ChatRequest, model_name: str, adapter: Any = ...) -> dict[str, Any]:
    """Answer one ``/v1/chat/completions`` body (``adapter`` as in :meth:`LocalLM.complete_ids`)."""
    if body.tools:
        raise BadRequest("tools are not supported by local models")
    rows = _rows(local, body)
    prompt_ids = local.render([{"role": m.role, "content": m.text()} for m in body.messages])
    samples = local.complete_many(prompt_ids, rows, adapter=adapter)
    choices = []
    for i, s in enumerate(samples):
        choice = {"index": i, "message": {"role": "assistant", "content": s.text},
                  "logprobs": _chat_logprobs(local, s, body), "finish_reason": s.finish_reason}
        if body.return_token_ids:
            choice["token_ids"] = list(s.completion_ids)
        choices.append(choice)
    answer = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
              "model": model_name, "choices": choices, "usage": _usage(len(prompt_ids), samples)}
    if body.return_token_ids:
        answer["prompt_token_ids"] = list(prompt_ids)
    return answer


def text_completion(local: LocalLM, body: CompletionRequest, model_name: str, adapter: Any = ...) -> dict[str, Any]:
    """Answer one ``/v1/completions`` body (the prompt is raw text: no chat template, no transcript)."""
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    rows = _rows(local, body, prompts=len(prompts))
    choices: list[dict[str, Any]] = []
    used: list[Any] = []
    prompt_tokens = 0
    for text in prompts:
        prompt_ids = local.render(text)
        prompt_tokens += len(prompt_ids)
        samples = local.complete_many(prompt_ids, rows, adapter=adapter)
        used += samples
        for s in samples:
            choice = {"index": len(choices), "text": s.text, "logprobs": _text_logprobs(local, s, body),
                      "finish_reason": s.finish_reason}
            if body.return_token_ids:  # vLLM puts both on the choice for completions
                choice.update(prompt_token_ids=list(prompt_ids), token_ids=list(s.completion_ids))
            choices.append(choice)
    return {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
            "model": model_name, "choices": choices, "usage": _usage(prompt_tokens, used)}


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message[:2000], "type": kind}})


def _lora_error(exc: LoraRefused) -> JSONResponse:
    kinds = {403: "PermissionDenied", 404: "NotFoundError"}
    return _error(exc.status, str(exc), kinds.get(exc.status, "invalid_request_error"))


def _validation_message(exc: RequestValidationError) -> str:
    """The first few problems, each as 'where: what' (never the offending value, which may be huge)."""
    problems = []
    for problem in exc.errors()[:5]:
        where = ".".join(str(part) for part in problem.get("loc", ()) if part != "body")[:200]
        problems.append(f"{where or 'body'}: {str(problem.get('msg', 'invalid'))[:200]}")
    return "; ".join(problems) or "invalid request body"


def create_app(local: LocalLM, *, model_name: str | None = None, loras: RuntimeLoras | None = None,
               recorder: RolloutRecorder | None = None) -> FastAPI:
    """The FastAPI application serving ``local`` under ``model_name`` (default: its name).

    Request bodies are pydantic models: a malformed or out-of-bounds body is a 400 in OpenAI's error
    shape before any generation starts. ``loras`` enables the runtime adapter endpoints (off by default:
    they answer 404, as vLLM's do without runtime LoRA updating). With them on, a request's ``model``
    must be the served name or a loaded adapter (else 404, as in vLLM), so a typo never silently samples
    the base weights; without them ``model`` is not checked.
    """
    name = model_name or local.name
    loras = loras or RuntimeLoras(local, lora_root=None)
    app = FastAPI(title="flowopt serve", version="1", routes=recorder.routes(loras) if recorder is not None else None)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, _validation_message(exc), "invalid_request_error")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # FastAPI answers 400 "error parsing the body" for JSON it cannot read (e.g. nested too deep).
        return _error(exc.status_code, str(exc.detail), "invalid_request_error")

    async def answer(handler: Any, body: SamplingRequest, request: Request) -> JSONResponse:
        try:  # recording mode (flowopt.lm.serve_record): a request tagged with a rollout id is recorded
            body = (recording := Recording.start(recorder, request.headers, body)).body
        except RecordingRefused as exc:
            return _error(exc.status, str(exc), "invalid_request_error")
        adapter = loras.adapter_for(body.model)
        if loras.enabled and adapter is None and body.model not in (None, name):
            return _error(404, f"The model {body.model!r} does not exist: serve {name!r} or a loaded LoRA "
                               f"adapter ({sorted(loras.loaded)})", "NotFoundError")
        try:
            # Generation blocks; a worker thread per request lets concurrent requests meet in one batch.
            pinned = ... if adapter is None else adapter
            result = await run_in_threadpool(handler, local, body, adapter or name, pinned)
            return JSONResponse(recording.finish(result))
        except (BadRequest, FlowoptError) as exc:
            return _error(400, str(exc), "invalid_request_error")
        except Exception as exc:  # the server stays up; the client sees what went wrong
            logger.exception("generation failed")
            return _error(500, f"{type(exc).__name__}: {exc}", "server_error")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> JSONResponse:
        return await answer(chat_completion, body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> JSONResponse:
        return await answer(text_completion, body, request)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraRequest) -> Any:
        try:
            await run_in_threadpool(loras.load, body.lora_name, body.lora_path)
        except LoraRefused as exc:
            return _lora_error(exc)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraRequest) -> Any:
        try:
            await run_in_threadpool(loras.unload, body.lora_name)
        except LoraRefused as exc:
            return _lora_error(exc)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "flowopt"}]
        data += [{"id": lora, "object": "model", "created": 0, "owned_by": "flowopt", "parent": name}
                 for lora in loras.loaded]
        return {"object": "list", "data": data}

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "model": name, "adapter": local.active_adapter, "device": str(local.device),
                "loras": sorted(loras.loaded)}

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
    parser.add_argument("--enable-lora", action="store_true",
                        help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (as vLLM's); "
                             "needs --lora-root")
    parser.add_argument("--lora-root", help="the only folder adapters may be loaded from (with --enable-lora)")
    parser.add_argument("--max-loras", type=int, default=4, help="adapters loaded at once (default 4)")
    parser.add_argument("--record-rollouts", action="store_true",
                        help="record requests tagged with an X-Rollout-Id header as training transitions "
                             "(flowopt.lm.serve_record)")
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
    if options.enable_lora and not options.lora_root:
        logger.error("--enable-lora needs --lora-root DIR: the folder adapters may be loaded from")
        return 2
    if options.lora_root and not options.enable_lora:
        logger.error("--lora-root is only used with --enable-lora; pass both to load adapters at run time")
        return 2
    if options.lora_root and not Path(options.lora_root).is_dir():
        logger.error("--lora-root %s is not a folder; create it first", options.lora_root)
        return 2
    if options.max_loras < 1:
        logger.error("--max-loras must be >= 1, got %d", options.max_loras)
        return 2
    try:
        local = LocalLM(options.model, adapter=options.adapter, device=options.device, dtype=options.dtype,
                        max_new_tokens=options.max_new_tokens, max_batch_size=options.max_batch_size)
    except FlowoptError as exc:
        logger.error("%s", exc)
        return 2
    loras = RuntimeLoras(local, lora_root=options.lora_root if options.enable_lora else None,
                         max_loras=options.max_loras)
    app = create_app(local, model_name=options.name, loras=loras,
                     recorder=RolloutRecorder() if options.record_rollouts else None)
    logger.info("serving %r at http://%s:%d/v1", options.name or local.name, options.host, options.port)
    uvicorn.run(app, host=options.host, port=options.port, log_level=options.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
