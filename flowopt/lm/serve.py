"""``flowopt serve``: a LocalLM (with its LoRA adapter) behind an OpenAI-compatible HTTP API.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /v1/models/{id}``, ``GET /health``, and with ``--enable-lora --lora-root DIR`` vLLM's runtime
adapter endpoints ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``
(:mod:`flowopt.lm.serve_lora`); a request samples with a loaded adapter by naming it as its ``model``.
A ``model`` the server does not serve is a 404 in OpenAI's error shape. Requests from concurrent clients
go through the LocalLM's dynamic batcher, so they share batches; a client that leaves, and SIGTERM or
Ctrl-C, end work early (:mod:`flowopt.lm.serve_lifecycle`). Binds to 127.0.0.1 by default: there is no
authentication (any API key is accepted). Bodies over 8 MiB are a 413.

As OpenAI and vLLM behave: ``stream=true`` streams server-sent events (:mod:`flowopt.lm.serve_stream`,
``stream_options.include_usage`` too); without ``max_tokens`` a completion may use what the model's
context has left (at most ``--max-new-tokens``). Log-probs: chat ``logprobs``/``top_logprobs`` and
completions ``logprobs=N`` give each sampled token's log-prob under the distribution it was drawn from
(``softmax(logits / T)``) and the N likeliest alternatives; completions ``echo=true`` puts the prompt
(and its tokens' log-probs) first, and ``echo=true, max_tokens=0`` scores a prompt without generating
(:mod:`flowopt.lm.serve_logprobs`). vLLM's ``return_token_ids`` and ``return_tokens_as_token_ids`` are
honoured, so a trainer gets exactly the ids that were sampled. Fields not implemented are refused or
ignored as :mod:`flowopt.lm.serve_schema` lists (``response_format`` other than text is a 400).

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
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from flowopt.errors import FlowoptError
from flowopt.lm.sampling import RowSettings, Sample, derive_seed
from flowopt.lm.serve_errors import BodyLimit, add_error_handlers, error_response, lora_error
from flowopt.lm.serve_lifecycle import CLIENT_CLOSED, answer_while_connected, keep_going, serve
from flowopt.lm.serve_logprobs import chat_logprobs, text_logprobs
from flowopt.lm.serve_lora import LoraRefused, RuntimeLoras
from flowopt.lm.serve_record import Recording, RecordingRefused, RolloutRecorder
from flowopt.lm.serve_schema import (
    MAX_BODY_BYTES,
    MAX_ROWS,
    BadRequest,
    ChatRequest,
    CompletionRequest,
    LoadLoraRequest,
    SamplingRequest,
    UnloadLoraRequest,
)
from flowopt.lm.serve_stream import StreamJob, new_id, now, stream_rows
from flowopt.lm.server_http import SERVER_KEEPALIVE_S

if TYPE_CHECKING:
    from flowopt.lm.local import LocalLM

logger = logging.getLogger(__name__)


def _context_left(local: LocalLM, prompt_len: int) -> int | None:
    limit = getattr(local.base_model.config, "max_position_embeddings", None)
    return None if not limit else int(limit) - prompt_len


def _rows(local: LocalLM, body: SamplingRequest, prompt_len: int) -> list[RowSettings]:
    """The n decoding settings of a request for one prompt of ``prompt_len`` tokens (none for max_tokens=0)."""
    limit = body.token_limit
    left = _context_left(local, prompt_len)
    if left is not None and left < 1:
        raise BadRequest(f"the prompt of {prompt_len} tokens fills the model's context; shorten it", "messages")
    if limit is None:  # as OpenAI and vLLM: what the context has left, here at most the server's default
        limit = local.max_new_tokens if left is None else min(local.max_new_tokens, left)
    if limit == 0:
        return []
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    seed = body.seed
    try:
        return [RowSettings(
            max_new_tokens=limit,
            temperature=float(local.temperature if body.temperature is None else body.temperature),
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(0, body.top_k or 0),  # vLLM's -1 and OpenAI's absent both mean "no top-k"
            # Sample 0 uses the seed itself, so a served call matches the same call made in-process.
            seed=None if seed is None else (seed if k == 0 else derive_seed(seed, k)),
            stop=stop,
            logprobs=body.top_logprobs_wanted() is not None,
        ) for k in range(body.n)]
    except (TypeError, ValueError) as exc:
        raise BadRequest(str(exc)) from exc


def _check_request(body: SamplingRequest, prompts: int = 1) -> None:
    if body.n * prompts > MAX_ROWS:
        raise BadRequest(f"n x prompts = {body.n * prompts} completions; at most {MAX_ROWS} per request", "n")
    if body.stream_options is not None and not body.stream:
        raise BadRequest("stream_options is only allowed with stream=true", "stream_options")
    if body.stream and body.top_logprobs_wanted() is not None:
        raise BadRequest("logprobs are not streamed by flowopt serve; ask without stream=true", "logprobs")
    if body.token_limit == 0 and not getattr(body, "echo", False):
        raise BadRequest("max_tokens=0 generates nothing; with echo=true (completions) it scores the prompt",
                         "max_tokens")
    if isinstance(body, CompletionRequest) and body.echo and body.stream:
        raise BadRequest("echo is not streamed by flowopt serve; ask without stream=true", "echo")


def _generate(local: LocalLM, prompt_ids: list[int], rows: list[RowSettings], adapter: Any, n: int,
              cancel: threading.Event | None) -> list[Sample]:
    if not rows:  # max_tokens=0: the prompt only, as n empty completions
        return [Sample(prompt_ids=list(prompt_ids), completion_ids=[], text="", finish_reason="length")
                for _ in range(n)]
    return local.complete_many(prompt_ids, rows, adapter=adapter,
                               on_tokens=None if cancel is None else keep_going(cancel))


def _usage(prompt_tokens: int, samples: Sequence[Sample]) -> dict[str, int]:
    completion = sum(len(s.completion_ids) for s in samples)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def _temperature(local: LocalLM, body: SamplingRequest) -> float:
    return float(local.temperature if body.temperature is None else body.temperature)


def _chat_prompt(local: LocalLM, body: ChatRequest) -> list[int]:
    if body.tools:
        raise BadRequest("tools are not supported by local models", "tools")
    _check_request(body)
    return list(local.render([{"role": m.role, "content": m.text()} for m in body.messages]))


def chat_completion(local: LocalLM, body: ChatRequest, model_name: str, adapter: Any = ..., *,
                    cancel: threading.Event | None = None) -> dict[str, Any]:
    """Answer one ``/v1/chat/completions`` body (``adapter`` as in :meth:`LocalLM.complete_ids`); setting
    ``cancel`` ends its rows at their next decode step (finish_reason ``"cancelled"``)."""
    prompt_ids = _chat_prompt(local, body)
    samples = _generate(local, prompt_ids, _rows(local, body, len(prompt_ids)), adapter, body.n, cancel)
    top = body.top_logprobs_wanted()
    choices = []
    for i, s in enumerate(samples):
        logprobs = None if top is None else chat_logprobs(
            local, s, k=top, temperature=_temperature(local, body), as_ids=body.return_tokens_as_token_ids,
            adapter=adapter)
        choice = {"index": i, "message": {"role": "assistant", "content": s.text},
                  "logprobs": logprobs, "finish_reason": s.finish_reason}
        if body.return_token_ids:
            choice["token_ids"] = list(s.completion_ids)
        choices.append(choice)
    answer = {"id": new_id("chatcmpl"), "object": "chat.completion", "created": now(),
              "model": model_name, "choices": choices, "usage": _usage(len(prompt_ids), samples)}
    if body.return_token_ids:
        answer["prompt_token_ids"] = list(prompt_ids)
    return answer


def _prompts(local: LocalLM, body: CompletionRequest) -> list[tuple[str, list[int]]]:
    texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    _check_request(body, prompts=len(texts))
    return [(text, list(local.render(text))) for text in texts]


def text_completion(local: LocalLM, body: CompletionRequest, model_name: str, adapter: Any = ..., *,
                    cancel: threading.Event | None = None) -> dict[str, Any]:
    """Answer one ``/v1/completions`` body (raw text: no chat template, no transcript); ``cancel`` as in
    :func:`chat_completion`."""
    choices: list[dict[str, Any]] = []
    used: list[Sample] = []
    prompt_tokens = 0
    top = body.top_logprobs_wanted()
    for text, prompt_ids in _prompts(local, body):
        prompt_tokens += len(prompt_ids)
        samples = _generate(local, prompt_ids, _rows(local, body, len(prompt_ids)), adapter, body.n, cancel)
        used += samples
        for s in samples:
            logprobs = None if top is None else text_logprobs(
                local, s, k=top, temperature=_temperature(local, body), as_ids=body.return_tokens_as_token_ids,
                echo=body.echo, adapter=adapter)
            choice = {"index": len(choices), "text": (text if body.echo else "") + s.text, "logprobs": logprobs,
                      "finish_reason": s.finish_reason}
            if body.return_token_ids:  # vLLM puts both on the choice for completions
                choice.update(prompt_token_ids=list(prompt_ids), token_ids=list(s.completion_ids))
            choices.append(choice)
    return {"id": new_id("cmpl"), "object": "text_completion", "created": now(),
            "model": model_name, "choices": choices, "usage": _usage(prompt_tokens, used)}


def _stream(local: LocalLM, body: SamplingRequest, model_name: str, adapter: Any,
            prompts: list[list[int]]) -> StreamingResponse:
    """``stream=true``: the answer as server-sent events, chunk by chunk as tokens are decoded."""
    chat = isinstance(body, ChatRequest)
    jobs: list[StreamJob] = []
    for p, prompt_ids in enumerate(prompts):
        rows = _rows(local, body, len(prompt_ids))
        for row in rows:
            jobs.append(StreamJob(len(jobs), p, prompt_ids, row))
    ident, created = new_id("chatcmpl" if chat else "cmpl"), now()
    head = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model_name}
    extra = {"usage": None} if body.include_usage else {}

    def chunk(index: int, text: str, finish: str | None) -> dict[str, Any]:
        if chat:
            delta = {"content": text} if text or finish is None else {}
            return {**head, "choices": [{"index": index, "delta": delta, "logprobs": None,
                                         "finish_reason": finish}], **extra}
        return {**head, "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish}],
                **extra}

    def first(index: int) -> dict[str, Any]:
        return {**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}], **extra}

    def usage_chunk(usage: dict[str, int]) -> dict[str, Any]:
        return {**head, "choices": [], "usage": usage}

    events = stream_rows(local, jobs, adapter=adapter, chunk=chunk, first=first if chat else None,
                         usage_chunk=usage_chunk if body.include_usage else None)
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def create_app(local: LocalLM, *, model_name: str | None = None, loras: RuntimeLoras | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, recorder: RolloutRecorder | None = None) -> FastAPI:
    """The FastAPI application serving ``local`` under ``model_name`` (default: its name).

    Request bodies are pydantic models: a malformed or out-of-bounds body is a 400 in OpenAI's error
    shape before any generation starts, a body over ``max_body_bytes`` a 413. A request's ``model``
    must be the served name or a loaded adapter (else 404, as OpenAI and vLLM answer), so a typo never
    silently samples the base weights. ``loras`` enables the runtime adapter endpoints (off by
    default: they answer 404, as vLLM's do without runtime LoRA updating).

    Example:
        >>> from fastapi.testclient import TestClient  # doctest: +SKIP
        >>> TestClient(create_app(local, model_name="tiny")).get("/v1/models/tiny").json()["id"]  # doctest: +SKIP
        'tiny'
    """
    served = ServedModel(local, model_name or local.name, loras or RuntimeLoras(local, lora_root=None), recorder)
    routes = recorder.routes(served.loras) if recorder is not None else None
    app = FastAPI(title="flowopt serve", version="1", routes=routes)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    add_error_handlers(app)
    _add_sampling_routes(app, served)
    _add_lora_routes(app, served.loras)
    _add_model_routes(app, served)
    return app


class ServedModel:
    """What one server serves: the LocalLM under its name, the adapters loaded at run time, and the
    recorder of rollouts (or None); answers a sampling request with them.

    Example:
        >>> served = ServedModel(local, "tiny", RuntimeLoras(local, lora_root=None), None)  # doctest: +SKIP
        >>> [card["id"] for card in served.model_cards()]  # doctest: +SKIP
        ['tiny']
    """

    def __init__(self, local: LocalLM, name: str, loras: RuntimeLoras, recorder: RolloutRecorder | None) -> None:
        self.local, self.name, self.loras, self.recorder = local, name, loras, recorder

    def model_cards(self) -> list[dict[str, Any]]:
        data = [{"id": self.name, "object": "model", "created": 0, "owned_by": "flowopt"}]
        return data + [{"id": lora, "object": "model", "created": 0, "owned_by": "flowopt", "parent": self.name}
                       for lora in self.loras.loaded]

    def not_found(self, model: str) -> JSONResponse:
        return error_response(404, f"The model {model!r} does not exist: this server serves "
                                   f"{[c['id'] for c in self.model_cards()]}",
                              "NotFoundError", param="model", code="model_not_found")

    async def answer(self, handler: Any, body: SamplingRequest, prompts: Any, request: Request) -> Any:
        """Sample ``body`` with the weights its ``model`` names: streamed, or whole through ``handler``."""
        try:  # recording mode (flowopt.lm.serve_record): a request tagged with a rollout id is recorded
            body = (recording := Recording.start(self.recorder, request.headers, body)).body
        except RecordingRefused as exc:
            return error_response(exc.status, str(exc), "invalid_request_error")
        adapter = self.loras.adapter_for(body.model)
        if adapter is None and body.model not in (None, self.name):
            return self.not_found(body.model)
        pinned = ... if adapter is None else adapter
        served = adapter or self.name
        local = self.local
        try:
            if body.stream:
                return _stream(local, body, served, pinned, [ids for _, ids in prompts(local, body)])
            # Generation blocks; a worker thread per request lets concurrent requests meet in one batch. A
            # client that leaves cancels its rows (flowopt.lm.serve_lifecycle); nothing of it is recorded.
            result, left = await answer_while_connected(request, handler, local, body, served, pinned)
            return error_response(CLIENT_CLOSED, "client closed request", "cancelled") if left else JSONResponse(
                recording.finish(result))
        except (BadRequest, FlowoptError) as exc:
            return error_response(400, str(exc), "invalid_request_error", param=getattr(exc, "param", None))
        except Exception as exc:  # the server stays up; the client sees what went wrong
            logger.exception("generation failed")
            return error_response(500, f"{type(exc).__name__}: {exc}", "server_error")


def _add_sampling_routes(app: FastAPI, served: ServedModel) -> None:
    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Any:
        return await served.answer(chat_completion, body, lambda lm, b: [("", _chat_prompt(lm, b))], request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await served.answer(text_completion, body, _prompts, request)


def _add_lora_routes(app: FastAPI, loras: RuntimeLoras) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraRequest) -> Any:
        try:
            await run_in_threadpool(loras.load, body.lora_name, body.lora_path)
        except LoraRefused as exc:
            return lora_error(exc)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraRequest) -> Any:
        try:
            await run_in_threadpool(loras.unload, body.lora_name)
        except LoraRefused as exc:
            return lora_error(exc)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _add_model_routes(app: FastAPI, served: ServedModel) -> None:
    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": served.model_cards()}

    @app.get("/v1/models/{model:path}")
    def model(model: str) -> Any:
        card = next((c for c in served.model_cards() if c["id"] == model), None)
        return card if card is not None else served.not_found(model)

    @app.get("/health")
    def health() -> dict[str, Any]:
        local = served.local
        return {"status": "ok", "model": served.name, "adapter": local.active_adapter, "device": str(local.device),
                "loras": sorted(served.loras.loaded), "quantize": local.quantize,
                "decode_path": local.decode_stats.decode_path}


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
    parser.add_argument("--quantize", choices=("int8", "int4"), default=None,
                        help="CPU: decode steps of up to 16 rows (concurrent requests) through a quantized twin "
                             "of the model (flowopt.lm.quantize; faster, greedy outputs can change; off by default)")
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                        help="compile the decode step with torch.compile once per batch bucket (auto: on CUDA "
                             "only; on CPU each bucket and cache length compiles for about a minute first)")
    parser.add_argument("--enable-lora", action="store_true",
                        help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (as vLLM's); "
                             "needs --lora-root")
    parser.add_argument("--lora-root", help="the only folder adapters may be loaded from (with --enable-lora)")
    parser.add_argument("--max-loras", type=int, default=4, help="adapters loaded at once (default 4)")
    parser.add_argument("--record-rollouts", action="store_true",
                        help="record requests tagged with an X-Rollout-Id header as training transitions "
                             "(flowopt.lm.serve_record)")
    parser.add_argument("--shutdown-timeout", type=int, default=10,
                        help="seconds requests in flight get to finish after SIGTERM/Ctrl-C (default 10)")
    parser.add_argument("--keep-alive", type=int, default=SERVER_KEEPALIVE_S,
                        help=f"seconds an idle connection stays open (default {SERVER_KEEPALIVE_S}: longer than "
                             "clients keep theirs, so none reuses one the server is closing)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def cli_main(argv: Sequence[str] | None = None) -> int:
    """``flowopt serve MODEL [--adapter DIR] --port N [--host 127.0.0.1]``; returns the exit status (143
    after SIGTERM, 130 after Ctrl-C: :mod:`flowopt.lm.serve_lifecycle`)."""
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
    if options.keep_alive < 1:
        logger.error("--keep-alive must be >= 1 second, got %d", options.keep_alive)
        return 2
    if options.max_loras < 1:
        logger.error("--max-loras must be >= 1, got %d", options.max_loras)
        return 2
    try:
        local = LocalLM(options.model, adapter=options.adapter, device=options.device, dtype=options.dtype,
                        max_new_tokens=options.max_new_tokens, max_batch_size=options.max_batch_size,
                        compile={"auto": None, "on": True, "off": False}[options.compile],
                        quantize=options.quantize)
    except FlowoptError as exc:
        logger.error("%s", exc)
        return 2
    loras = RuntimeLoras(local, lora_root=options.lora_root if options.enable_lora else None,
                         max_loras=options.max_loras)
    app = create_app(local, model_name=options.name, loras=loras,
                     recorder=RolloutRecorder() if options.record_rollouts else None)
    logger.info("serving %r at http://%s:%d/v1", options.name or local.name, options.host, options.port)
    return serve(app, host=options.host, port=options.port, log_level=options.log_level,
                 shutdown_timeout=options.shutdown_timeout, keep_alive=options.keep_alive)


if __name__ == "__main__":
    sys.exit(cli_main())
