"""``flowopt serve``'s errors: OpenAI's error shape, the request body limit, and the handlers that turn a
malformed body or an HTTP error into that shape.

Example:
    >>> error_response(404, "no such model", "NotFoundError", code="model_not_found").status_code
    404
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flowopt.lm.serve_schema import MAX_BODY_BYTES

if TYPE_CHECKING:
    from flowopt.lm.serve_lora import LoraRefused


def error_response(status: int, message: str, kind: str, *, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    """An error in OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``), the message clipped."""
    return JSONResponse(status_code=status, content={"error": {"message": message[:2000], "type": kind,
                                                                 "param": param, "code": code}})


def lora_error(exc: LoraRefused) -> JSONResponse:
    """A refused adapter load or unload, with the status and type vLLM gives it."""
    kinds = {403: "PermissionDenied", 404: "NotFoundError"}
    return error_response(exc.status, str(exc), kinds.get(exc.status, "invalid_request_error"))


def validation_message(exc: RequestValidationError) -> str:
    """The first few problems, each as 'where: what' (never the offending value, which may be huge)."""
    problems = []
    for problem in exc.errors()[:5]:
        where = ".".join(str(part) for part in problem.get("loc", ()) if part != "body")[:200]
        problems.append(f"{where or 'body'}: {str(problem.get('msg', 'invalid'))[:200]}")
    return "; ".join(problems) or "invalid request body"


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is a 413, whether its length is declared or not."""

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large()(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:  # FastAPI answers an HTTPException raised while reading with its status
                raise HTTPException(413, self._message())
            return message

        await self.app(scope, counted, send)

    def _message(self) -> str:
        return f"request body over {self.max_bytes} bytes; send less (prompts, messages and demos belong in KBs)"

    def _too_large(self) -> JSONResponse:
        return error_response(413, self._message(), "invalid_request_error")


def add_error_handlers(app: FastAPI) -> None:
    """Answer a body pydantic refuses, and any HTTP error FastAPI raises, in OpenAI's error shape."""

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, validation_message(exc), "invalid_request_error")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # FastAPI answers 400 "error parsing the body" for JSON it cannot read (e.g. nested too deep).
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error")
