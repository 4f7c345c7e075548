"""The rollout engine that samples on an inference server: the twin of :class:`flowopt.lm.engine.LocalEngine`.

GRPO with a rollout server (vLLM, ``flowopt serve``) sends its program's LM calls here: each call is
sampled by the server with the adapter pushed for the current step (``model=<its name>``), and comes back
with its token ids and log-probs, which must match the ids the student renders itself.

Example:
    >>> engine = ServerEngine(server, local, "grpo-step3-1a2b3c4d", recorder=samples.append,  # doctest: +SKIP
    ...                       temperature=1.0, max_new_tokens=64, seed=lambda: None)
    >>> lm = dspy.LM("local/student", engine=engine)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dspy.clients.engines.base import validate_request
from dspy.lm15 import Request, Response, UnsupportedFeatureError

from flowopt.errors import LMError
from flowopt.lm.engine import request_messages, row_settings, sample_response
from flowopt.lm.lora_client import LoraServer
from flowopt.lm.sampling import Sample

if TYPE_CHECKING:
    from flowopt.lm.local import LocalLM


class ServerEngine:
    """DSPy 3.4 engine whose every call is sampled by the server with the pushed adapter.

    Mirrors :class:`flowopt.lm.engine.LocalEngine` (``temperature`` overrides each request's,
    ``max_new_tokens`` caps it, ``recorder`` sees every sample); ``seed`` gives each call its seed.
    Server failures are also kept in :attr:`errors`, since a program may catch its LM's exceptions and
    a failed server must stop the step, not pass for a wrong answer.
    """

    def __init__(self, server: LoraServer, local: LocalLM, model: str, *, recorder: Callable[[Sample], None],
                 temperature: float, max_new_tokens: int, seed: Callable[[], int | None]) -> None:
        self.server, self.local, self.model = server, local, model
        self.recorder, self.temperature, self.max_new_tokens, self.seed = recorder, temperature, max_new_tokens, seed
        self.errors: list[BaseException] = []

    def complete(self, request: Request) -> Response:
        validate_request(request)
        if request.tools:
            raise UnsupportedFeatureError("local students do not call tools natively", provider="local")
        messages = request_messages(request)
        settings = row_settings(self.local, request.config, temperature=self.temperature,
                                max_new_tokens=self.max_new_tokens, logprobs=True)
        settings = dataclasses.replace(settings, seed=self.seed())
        expected = self.local.render(messages)
        try:
            if self.local.chat:
                sample = self.server.sample(self.model, settings, messages=messages)
            else:
                sample = self.server.sample(self.model, settings, prompt=self.local.render_text(messages))
            if not sample.prompt_ids:  # the server does not return prompt ids: they are the student's
                sample.prompt_ids = list(expected)
            elif sample.prompt_ids != list(expected):
                raise LMError(f"the inference server rendered a prompt into {len(sample.prompt_ids)} token ids that "
                              f"differ from the student's {len(expected)}: its tokenizer or chat template is not "
                              "the student's", fix="serve the student's base model folder (and, for a model "
                                                   "without a chat template, a template that sends the text as is)")
        except LMError as exc:
            self.errors.append(exc)
            raise
        self.recorder(sample)
        return sample_response(self.local, request, sample)

    def close(self) -> None:
        """Nothing to release here: the caller (GRPO's ``ServedRollouts``) owns the connection."""

    def __deepcopy__(self, memo: dict[int, Any]) -> ServerEngine:
        return self
