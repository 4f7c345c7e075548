"""How ``flowopt serve`` ends work early: a client that leaves, and SIGTERM or Ctrl-C to the server.

A non-streamed request runs its rows in a worker thread; :func:`answer_while_connected` watches the
connection meanwhile and, when the client disconnects (or the server cancels the request at shutdown),
sets the request's cancel event, which the rows' ``on_tokens`` callback reads at every decode step, so
they leave the batch and free their slots at the next step (streams cancel the same way, from
:func:`flowopt.lm.serve_stream.stream_rows`).

:class:`GracefulServer` is uvicorn's server with the exit a scheduler expects: on the first SIGTERM or
SIGINT it stops accepting connections, gives the requests in flight ``shutdown_timeout`` seconds to
finish, then cancels the rest (their rows end at the next decode step), and :func:`serve` returns the
shell's ``128 + signal`` (143 for SIGTERM, 130 for SIGINT), as ``flowopt bench`` does on an interrupted
compile. A second Ctrl-C stops at once.

Example:
    >>> import threading
    >>> keep_going(threading.Event())(0, [5])
    True
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import uvicorn
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from flowopt.lm.server_http import SERVER_KEEPALIVE_S

logger = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's status for "client closed request": logged, never seen by the client


def keep_going(cancel: threading.Event) -> Callable[[int, list[int]], bool]:
    """The ``on_tokens(index, ids)`` callback of :meth:`LocalLM.complete_many` that stops on ``cancel``."""
    return lambda index, ids: not cancel.is_set()


async def answer_while_connected(request: Request, call: Callable[..., Any], *args: Any) -> tuple[Any, bool]:
    """Run ``call(*args, cancel=event)`` in a worker thread; ``event`` is set when the client disconnects
    or this coroutine is cancelled (server shutdown). Returns the result and whether the client left."""
    cancel = threading.Event()
    work = asyncio.ensure_future(run_in_threadpool(call, *args, cancel=cancel))
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            cancel.set()  # the rows end at their next decode step; wait for them to leave the batch
            logger.info("client left %s mid-generation: its rows are cancelled", request.url.path)
        return await work, cancel.is_set()
    finally:
        cancel.set()  # cancelled at shutdown (or failed): end the rows, nobody will read them
        gone.cancel()


async def _disconnect(request: Request) -> None:
    """Return when the client disconnects (the body was read already: the server sends nothing else until
    the response is complete; Starlette's StreamingResponse listens the same way)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class GracefulServer(uvicorn.Server):
    """uvicorn's server that remembers the first stop signal instead of re-raising it after shutdown.

    Example:
        >>> GracefulServer(uvicorn.Config(app=None)).exit_status
        0
    """

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.stop_signal: int | None = None

    @property
    def exit_status(self) -> int:
        """0 after a normal stop; ``128 + signal`` after SIGTERM or SIGINT."""
        return 0 if self.stop_signal is None else 128 + self.stop_signal

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():  # Python installs handlers there only
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.stop_signal is None:
            self.stop_signal = sig
            logger.warning("%s received: no new connections; requests in flight get %s s to finish, then are "
                           "cancelled. Ctrl-C again stops at once.", signal.Signals(sig).name,
                           self.config.timeout_graceful_shutdown)
        super().handle_exit(sig, frame)


def serve(app: Any, *, host: str, port: int, log_level: str, shutdown_timeout: int,
          keep_alive: int = SERVER_KEEPALIVE_S) -> int:
    """Serve ``app`` until a stop signal; returns the exit status (see :class:`GracefulServer`).

    An idle connection stays open ``keep_alive`` seconds, longer than clients keep theirs, so a client
    never reuses one just as the server closes it (:mod:`flowopt.lm.server_http`)."""
    server = GracefulServer(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=shutdown_timeout,
                                           timeout_keep_alive=keep_alive))
    server.run()
    if server.stop_signal is not None:
        logger.info("stopped by %s", signal.Signals(server.stop_signal).name)
    return server.exit_status
