"""``flowopt serve --record-rollouts``: any agent's LLM calls, recorded as training transitions.

An agent (any framework, any language) sends its ordinary OpenAI-style requests with a header
``X-Rollout-Id: <id>``. Each such request is answered as usual and recorded under that id as
transitions: the prompt's token ids, each completion's token ids and their log-probs under the adapter
that sampled them. The agent then closes the rollout with ``POST /v1/rollouts/{id}/reward``
``{"reward": 0.7}``. A trainer reads a rollout with ``GET /v1/rollouts/{id}`` and forgets it with
``DELETE /v1/rollouts/{id}``; ``PUT /v1/rollouts/policy`` ``{"lora_name": NAME}`` makes every recorded
request sample with that loaded adapter (the one being trained) whatever ``model`` it names, so the agent
needs no change when the trainer pushes new weights. Requests without the header are not recorded.

Bounds: at most :data:`MAX_OPEN_ROLLOUTS` rollouts held and :data:`MAX_TRANSITIONS` transitions each;
a request for a closed rollout is refused (409), so an episode's record is final once rewarded.

Example:
    >>> from openai import OpenAI  # doctest: +SKIP
    >>> client = OpenAI(base_url="http://127.0.0.1:8011/v1", api_key="x")  # doctest: +SKIP
    >>> client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "2+2?"}],
    ...                                extra_headers={"X-Rollout-Id": "ep-1"})  # doctest: +SKIP
    >>> httpx.post("http://127.0.0.1:8011/v1/rollouts/ep-1/reward", json={"reward": 1.0})  # doctest: +SKIP
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from fastapi import APIRouter
    from starlette.routing import BaseRoute

    from flowopt.lm.serve_lora import RuntimeLoras

ROLLOUT_HEADER = "X-Rollout-Id"
ROLLOUT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
MAX_OPEN_ROLLOUTS = 4096
MAX_TRANSITIONS = 256


class RecordingRefused(Exception):
    """A recorded request or rollout call the server refuses; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class RecordedRollout:
    """The transitions recorded under one rollout id, and its reward once the agent reported it."""

    transitions: list[dict[str, Any]] = field(default_factory=list)
    reward: float | None = None

    @property
    def closed(self) -> bool:
        return self.reward is not None

    def to_json(self) -> dict[str, Any]:
        return {"transitions": self.transitions, "reward": self.reward, "closed": self.closed}


class RewardBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: float = Field(allow_inf_nan=False)


class PolicyBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str | None = Field(default=None, max_length=128)


class RolloutRecorder:
    """The rollouts being recorded, and the adapter recorded requests sample with.

    Example:
        >>> recorder = RolloutRecorder()
        >>> recorder.close("ep-1", 1.0)
        Traceback (most recent call last):
        ...
        flowopt.lm.serve_record.RecordingRefused: no request was recorded under rollout id 'ep-1'
    """

    def __init__(self) -> None:
        self.policy: str | None = None
        self._rollouts: dict[str, RecordedRollout] = {}
        self._lock = threading.Lock()

    # -- requests ------------------------------------------------------------------------------------------

    @staticmethod
    def rollout_id(headers: Any) -> str | None:
        """The request's rollout id (``None``: not recorded); a malformed one is refused."""
        value = headers.get(ROLLOUT_HEADER)
        if value is None:
            return None
        if not ROLLOUT_ID.match(value):
            raise RecordingRefused(400, f"{ROLLOUT_HEADER} must be 1-128 letters, digits or . _ : -, "
                                        f"got {value[:40]!r}")
        return str(value)

    def prepare(self, rollout_id: str, body: Any) -> Any:
        """A copy of the request that returns what a transition needs (token ids, log-probs) and samples
        with the policy adapter when one is set."""
        with self._lock:
            record = self._rollouts.get(rollout_id)
            if record is not None and record.closed:
                raise RecordingRefused(409, f"rollout {rollout_id!r} already has its reward; start a new rollout id")
            if record is None and len(self._rollouts) >= MAX_OPEN_ROLLOUTS:
                raise RecordingRefused(429, f"{MAX_OPEN_ROLLOUTS} rollouts are held; the trainer must collect some")
            if record is not None and len(record.transitions) >= MAX_TRANSITIONS:
                raise RecordingRefused(409, f"rollout {rollout_id!r} has {MAX_TRANSITIONS} transitions, the most one "
                                            "may record")
        changes: dict[str, Any] = {"return_token_ids": True}
        changes["logprobs"] = True if "messages" in type(body).model_fields else (body.logprobs or 0)
        if self.policy is not None:
            changes["model"] = self.policy
        return body.model_copy(update=changes)

    def record(self, rollout_id: str, asked: Any, answer: dict[str, Any]) -> dict[str, Any]:
        """File the answer's completions under ``rollout_id``; return the answer as the client asked for it."""
        adapter = answer.get("model")
        steps = []
        for choice in answer["choices"]:
            prompt_ids = choice.get("prompt_token_ids") or answer.get("prompt_token_ids") or []
            logprobs = choice.get("logprobs") or {}
            values = ([e["logprob"] for e in logprobs.get("content") or []] if "content" in logprobs
                      else list(logprobs.get("token_logprobs") or []))
            steps.append({"prompt_ids": list(prompt_ids), "completion_ids": list(choice.get("token_ids") or []),
                          "logprobs": [float(v) for v in values], "finish_reason": choice.get("finish_reason"),
                          "adapter": adapter})
        with self._lock:
            self._rollouts.setdefault(rollout_id, RecordedRollout()).transitions.extend(steps)
        return _as_asked(asked, answer)

    # -- the rollout API -----------------------------------------------------------------------------------

    def close(self, rollout_id: str, reward: float) -> None:
        if not math.isfinite(reward):
            raise RecordingRefused(400, "reward must be a finite number")
        with self._lock:
            record = self._rollouts.get(rollout_id)
            if record is None:
                raise RecordingRefused(404, f"no request was recorded under rollout id {rollout_id!r}")
            if record.closed:
                raise RecordingRefused(409, f"rollout {rollout_id!r} already has reward {record.reward}")
            record.reward = float(reward)

    def get(self, rollout_id: str) -> dict[str, Any]:
        with self._lock:
            record = self._rollouts.get(rollout_id)
            if record is None:
                raise RecordingRefused(404, f"no request was recorded under rollout id {rollout_id!r}")
            return record.to_json()

    def forget(self, rollout_id: str) -> None:
        with self._lock:
            self._rollouts.pop(rollout_id, None)

    def routes(self, loras: RuntimeLoras) -> list[BaseRoute]:
        """The ``/v1/rollouts`` endpoints, for :func:`flowopt.lm.serve.create_app` to serve."""
        return list(self.router(loras).routes)

    def router(self, loras: RuntimeLoras) -> APIRouter:
        """The ``/v1/rollouts`` endpoints as a FastAPI router (``loras``: what ``policy`` may name)."""
        from fastapi import APIRouter
        from fastapi.responses import JSONResponse

        router = APIRouter()

        def refused(exc: RecordingRefused) -> JSONResponse:
            return JSONResponse(status_code=exc.status, content={"error": {"message": str(exc),
                                                                           "type": "invalid_request_error"}})

        @router.post("/v1/rollouts/{rollout_id}/reward")
        def reward(rollout_id: str, body: RewardBody) -> Any:
            try:
                self.close(rollout_id, body.reward)
            except RecordingRefused as exc:
                return refused(exc)
            return {"rollout_id": rollout_id, "reward": body.reward}

        @router.get("/v1/rollouts/{rollout_id}")
        def read(rollout_id: str) -> Any:
            try:
                return self.get(rollout_id)
            except RecordingRefused as exc:
                return refused(exc)

        @router.delete("/v1/rollouts/{rollout_id}")
        def delete(rollout_id: str) -> Any:
            self.forget(rollout_id)
            return {"rollout_id": rollout_id, "deleted": True}

        @router.put("/v1/rollouts/policy")
        def policy(body: PolicyBody) -> Any:
            if body.lora_name is not None and loras.adapter_for(body.lora_name) is None:
                return refused(RecordingRefused(404, f"no loaded adapter {body.lora_name!r}; load it with "
                                                     "/v1/load_lora_adapter first"))
            self.policy = body.lora_name
            return {"policy": self.policy}

        return router


@dataclass
class Recording:
    """One request's side of the recording mode: the body to serve, and what to record once answered.

    Example:
        >>> Recording.start(None, {}, body).body is body  # no recorder: served as sent  # doctest: +SKIP
    """

    body: Any
    asked: Any = None
    recorder: RolloutRecorder | None = None
    rollout_id: str | None = None

    @classmethod
    def start(cls, recorder: RolloutRecorder | None, headers: Any, body: Any) -> Recording:
        """The request as it is (not recorded), or prepared for recording; raises :class:`RecordingRefused`."""
        rollout = recorder.rollout_id(headers) if recorder is not None else None
        if recorder is None or rollout is None:
            return cls(body)
        if body.stream or getattr(body, "echo", False):
            raise RecordingRefused(400, "a recorded request must not stream or echo its prompt; send "
                                        "stream=false and echo=false")
        return cls(recorder.prepare(rollout, body), body, recorder, rollout)

    def finish(self, answer: dict[str, Any]) -> dict[str, Any]:
        """Record the answer (when recording) and return it as the client asked for it."""
        if self.recorder is None or self.rollout_id is None:
            return answer
        return self.recorder.record(self.rollout_id, self.asked, answer)


def _as_asked(asked: Any, answer: dict[str, Any]) -> dict[str, Any]:
    """Drop the token ids and log-probs the client did not ask for (recording asked for them)."""
    if not asked.return_token_ids:
        answer.pop("prompt_token_ids", None)
        for choice in answer["choices"]:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
    if asked.top_logprobs_wanted() is None:
        for choice in answer["choices"]:
            choice["logprobs"] = None
    return answer
