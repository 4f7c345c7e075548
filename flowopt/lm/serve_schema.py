"""The request bodies ``flowopt serve`` accepts (OpenAI's names and meanings, with bounds), and what it
does with every field it does not implement.

A field that would change the answer and is not implemented is refused with a 400 naming it (never
silently ignored): :data:`REFUSED` lists each with the value that means "off", which is accepted.
Fields that do not change the answer are ignored, as OpenAI and vLLM clients expect: :data:`IGNORED`
(``user``, ``metadata``, ``store``, ...), and any field neither API defines, which is logged once per
request (vLLM does the same).
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

logger = logging.getLogger(__name__)

# Caps per request: a client cannot make one request hold the model for long or the server's memory.
MAX_BODY_BYTES = 8 * 2**20  # a larger body is a 413 before it is read
MAX_PROMPTS = 32  # prompts in one /v1/completions request
MAX_ROWS = 64  # completions in one request: n x prompts
MAX_MESSAGES = 256
MAX_TEXT_CHARS = 200_000  # one prompt, message or text part
MAX_TOKENS = 4096  # max_tokens / max_completion_tokens
MAX_STOPS = 8
MAX_TOP_LOGPROBS = 20

_Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
_Finite = Annotated[float, Field(allow_inf_nan=False)]
_Tokens = Annotated[int, Field(ge=0, le=MAX_TOKENS, strict=True)]

# Field -> the values that mean "off" (accepted); any other value is a 400 naming the field.
REFUSED: dict[str, tuple[Any, ...]] = {
    "response_format": (None, {"type": "text"}),  # no JSON-constrained decoding
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "min_p": (None, 0, 0.0),
    "min_tokens": (None, 0),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "prediction": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "structured_outputs": (None,),
    "ignore_eos": (None, False),
    "use_beam_search": (None, False),
    "prompt_logprobs": (None,),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
}
# Fields that do not change the answer: accepted and ignored.
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls", "safety_identifier",
                     "prompt_cache_key", "request_id", "priority"})


class BadRequest(Exception):
    """A client error, answered as HTTP 400 in OpenAI's error shape (``param`` names the field)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class _Request(BaseModel):
    # Fields a local model has no use for are dropped unread (see IGNORED), so a deeply nested unknown
    # field costs nothing.
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


class StreamOptions(_Request):
    """``stream_options``: ``include_usage`` adds a last chunk with the token counts."""

    include_usage: bool = False


class SamplingRequest(_Request):
    """The decoding settings both endpoints share (OpenAI's names and meanings), with bounds."""

    model: Annotated[str, Field(max_length=256)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_ROWS, strict=True)] = 1
    max_tokens: _Tokens | None = None
    max_completion_tokens: _Tokens | None = None
    temperature: Annotated[_Finite, Field(ge=0, le=2)] | None = None
    top_p: Annotated[_Finite, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=100_000, strict=True)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64, strict=True)] | None = None
    stop: Annotated[str, Field(max_length=256)] | Annotated[
        list[Annotated[str, Field(max_length=256)]], Field(max_length=MAX_STOPS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # vLLM: prompt_token_ids and each choice's token_ids in the response
    return_tokens_as_token_ids: bool = False  # vLLM: log-prob tokens written as "token_id:N"

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, off in REFUSED.items():
            if name in data and not any(data[name] == value for value in off):
                raise ValueError(f"{name} is not supported by flowopt serve (it would change the answer and is "
                                 f"not implemented); leave it out")
        unknown = sorted(k for k in data if isinstance(k, str) and k not in cls.model_fields and k not in IGNORED
                         and k not in REFUSED)
        if unknown:
            logger.warning("ignored request fields %s (not part of the API flowopt serve implements)", unknown[:10])
        return data

    @property
    def token_limit(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's newer name) or ``max_tokens``; None when neither is given."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def top_logprobs_wanted(self) -> int | None:
        """None: no log-probs; else how many alternatives per token (0: the sampled token's only)."""
        return None


class ChatRequest(SamplingRequest):
    """A ``/v1/chat/completions`` body."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    tools: Annotated[list[dict[str, Any]], Field(max_length=0)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS, strict=True)] | None = None

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingRequest):
    """A ``/v1/completions`` body: one prompt or a list of them; ``echo`` returns the prompt (and its
    log-probs with ``logprobs``) before the completion; ``max_tokens=0`` with ``echo`` scores a prompt."""

    prompt: _Text | Annotated[list[_Text], Field(min_length=1, max_length=MAX_PROMPTS)]
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS, strict=True)] | None = None
    echo: bool = False

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs


class LoadLoraRequest(_Request):
    """A ``/v1/load_lora_adapter`` body (vLLM's shape)."""

    lora_name: Annotated[str, Field(min_length=1, max_length=128)]
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]


class UnloadLoraRequest(_Request):
    """A ``/v1/unload_lora_adapter`` body (vLLM's shape)."""

    lora_name: Annotated[str, Field(min_length=1, max_length=128)]
