"""Server-sent-event streaming for ``flowopt serve`` (``stream=true``), in the chunk shapes the ``openai``
client and litellm read: ``chat.completion.chunk`` deltas and ``text_completion`` pieces, a last chunk
per choice with its ``finish_reason``, with ``stream_options.include_usage`` a final chunk holding the
token counts, then ``data: [DONE]``.

Each completion runs through :meth:`LocalLM.complete_ids` with an ``on_tokens`` hook, so its tokens
reach the client as they are decoded, and rows of concurrent requests still share the batcher. Text
that could still be the start of a stop string is held back until it is known not to be one, so a
streamed answer never shows text the final answer cuts. A client that disconnects cancels its rows.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool

if TYPE_CHECKING:
    from flowopt.lm.local import LocalLM
    from flowopt.lm.sampling import RowSettings, Sample


class HeldBackText:
    """The text of a growing token sequence that is safe to send: cut at a stop string, without a
    trailing stop-string prefix or an unfinished UTF-8 character.

    Example:
        >>> class Chars:
        ...     def decode(self, ids, skip_special_tokens=True):
        ...         return "".join(chr(i) for i in ids)
        >>> held = HeldBackText(Chars(), stops=("##",))
        >>> held.push([ord("a"), ord("#")]), held.push([ord("b")]), held.push([ord("#"), ord("#")])
        ('a', '#b', '')
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str]) -> None:
        self.tokenizer, self.stops = tokenizer, tuple(s for s in stops if s)
        self.ids: list[int] = []
        self.sent = 0

    def push(self, ids: Sequence[int]) -> str:
        self.ids += ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cuts = [c for c in (text.find(s) for s in self.stops) if c >= 0]
        if cuts:
            text = text[:min(cuts)]
        safe = len(text.rstrip("\ufffd"))  # a multi-byte character split across tokens decodes as U+FFFD
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    safe = min(safe, len(text) - k)
                    break
        return self._send(text, safe)

    def finish(self, final_text: str) -> str:
        """The rest of the answer, once the row is done (``final_text`` is the authoritative text)."""
        return self._send(final_text, len(final_text))

    def _send(self, text: str, upto: int) -> str:
        piece = text[self.sent:upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return piece


@dataclass
class StreamJob:
    """One streamed completion: its choice index, the index of its prompt in the request, and settings."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    row: RowSettings
    held: HeldBackText = field(init=False)


def sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


async def stream_rows(local: LocalLM, jobs: Sequence[StreamJob], *, adapter: Any,
                      chunk: Callable[[int, str, str | None], dict[str, Any]],
                      first: Callable[[int], dict[str, Any]] | None = None,
                      usage_chunk: Callable[[dict[str, int]], dict[str, Any]] | None = None
                      ) -> AsyncIterator[bytes]:
    """SSE bytes for ``jobs`` run concurrently: ``chunk(index, text, finish_reason)`` shapes each event,
    ``first(index)`` an opening event per choice (the chat role), ``usage_chunk(usage)`` (when given) the
    event with the token counts, sent after every choice finished."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[tuple[str, int, Any]] = asyncio.Queue()
    cancelled = threading.Event()

    def hook(index: int) -> Callable[[list[int]], bool]:
        def on_tokens(ids: list[int]) -> bool:
            if cancelled.is_set():  # the client left: end the row, and send nothing to a loop that may be gone
                return False
            loop.call_soon_threadsafe(events.put_nowait, ("tokens", index, ids))
            return True
        return on_tokens

    async def run(job: StreamJob) -> None:
        try:
            result = await run_in_threadpool(local.complete_ids, job.prompt_ids, job.row, adapter=adapter,
                                             on_tokens=hook(job.index))
            events.put_nowait(("done", job.index, result))
        except Exception as exc:  # reported in the stream: the status line was already sent
            events.put_nowait(("error", job.index, exc))

    by_index = {job.index: job for job in jobs}
    for job in jobs:
        job.held = HeldBackText(local.tokenizer, job.row.stop)
        if first is not None:
            yield sse(first(job.index))
    tasks = [asyncio.ensure_future(run(job)) for job in jobs]
    finished: list[Sample] = []
    try:
        while len(finished) < len(jobs):
            kind, index, payload = await events.get()
            job = by_index[index]
            if kind == "tokens":
                if piece := job.held.push(payload):
                    yield sse(chunk(index, piece, None))
            elif kind == "error":
                yield sse({"error": {"message": f"{type(payload).__name__}: {payload}"[:2000],
                                     "type": "server_error"}})
                return
            else:
                finished.append(payload)
                if piece := job.held.finish(payload.text):
                    yield sse(chunk(index, piece, None))
                yield sse(chunk(index, "", payload.finish_reason))
        if usage_chunk is not None:
            yield sse(usage_chunk(stream_usage(jobs, finished)))
        yield sse("[DONE]")
    finally:
        cancelled.set()  # a client gone mid-stream ends its rows at the next step
        for task in tasks:
            task.cancel()


def stream_usage(jobs: Sequence[StreamJob], samples: Sequence[Sample]) -> dict[str, int]:
    """Token counts of a streamed request: each prompt once, however many choices it has (as the
    non-streamed answer counts)."""
    prompt_tokens = sum({j.prompt_index: len(j.prompt_ids) for j in jobs}.values())
    completion = sum(len(s.completion_ids) for s in samples)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
