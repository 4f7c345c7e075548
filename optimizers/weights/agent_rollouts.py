"""GRPO rollouts made by any agent: its LLM calls recorded by ``flowopt serve --record-rollouts``.

The agent is ordinary code (any framework; it never imports flowopt or DSPy) that talks to the server's
OpenAI-compatible API. For each episode GRPO calls ``agent(episode)`` with an :class:`AgentEpisode`: the
task (a training example), the server's URL, the model name to ask for and the headers that tag the
episode's requests with its rollout id. The agent runs, sends its LLM calls with those headers and ends
by reporting its reward (``POST {base_url}/rollouts/{rollout_id}/reward``). GRPO then reads the
recorded transitions (prompt ids, completion ids, log-probs under the pushed adapter) and the reward
from the server, and trains on them as on its own rollouts. Each step's adapter is pushed to the server
first (:class:`~flowopt.optimizers.weights.served.ServedRollouts`) and made the policy every recorded
request samples with, so the episodes are on-policy whatever model name the agent sends.

An episode whose agent raised, made no recorded call or reported no reward trains with reward
``-format_penalty`` on whatever calls it made (as a program's format failure does).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from flowopt.errors import LMError
from flowopt.lm.serve_record import ROLLOUT_HEADER
from flowopt.lm.server_http import server_client
from flowopt.optimizers.weights.rollout import Rollout, Transition
from flowopt.optimizers.weights.served import ServedRollouts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentEpisode:
    """One episode for the agent: ``example`` is the task; send every LLM call to ``base_url`` with
    ``model``, ``headers`` and ``temperature`` (GRPO's: its training forward assumes it), then report the
    reward to ``reward_url``.

    Example:
        >>> ep = AgentEpisode("grpo-s0-0-1", {"question": "2+2?"}, "http://127.0.0.1:8011/v1", "tiny", 1.0)
        >>> ep.headers, ep.reward_url
        ({'X-Rollout-Id': 'grpo-s0-0-1'}, 'http://127.0.0.1:8011/v1/rollouts/grpo-s0-0-1/reward')
    """

    rollout_id: str
    example: Any
    base_url: str
    model: str
    temperature: float

    @property
    def headers(self) -> dict[str, str]:
        return {ROLLOUT_HEADER: self.rollout_id}

    @property
    def reward_url(self) -> str:
        return f"{self.base_url.rstrip('/')}/rollouts/{self.rollout_id}/reward"


Agent = Callable[[AgentEpisode], Any]


class AgentRollouts:
    """A GRPO run's side of a recording server: runs the agent's episodes and reads back what they recorded.

    Example:
        >>> source = AgentRollouts(served, agent, format_penalty=1.0, temperature=1.0)  # doctest: +SKIP
        >>> rollouts = source.run(examples, group_size=4, step=0, pool=pool)  # doctest: +SKIP
    """

    def __init__(self, served: ServedRollouts, agent: Agent, *, format_penalty: float, temperature: float) -> None:
        option = served.option
        key = os.environ.get(option.api_key_env) if option.api_key_env else None  # checked by option.connect()
        self.served, self.agent, self.format_penalty, self.temperature = served, agent, format_penalty, temperature
        self.base_url = option.url.rstrip("/")
        self.http = server_client(self.base_url, api_key=key, timeout_s=option.timeout_s)

    def close(self) -> None:
        """Clear the server's policy (its adapter is unloaded next), so later requests sample as they ask."""
        try:
            self.set_policy(None)
        except LMError as exc:  # the run's result stands; a server that went away keeps its setting
            logger.warning("grpo: could not clear the recording server's policy: %s", exc)
        finally:
            self.http.close()

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        import httpx

        try:
            response = self.http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise LMError(f"the recording server at {self.base_url} failed {method} {path}: {exc}",
                          fix="check that flowopt serve is running with --record-rollouts") from exc
        if response.status_code == 404 and response.text.strip() in ('{"detail":"Not Found"}', "Not Found"):
            raise LMError(f"the server at {self.base_url} has no rollout recording ({method} {path}: 404)",
                          fix="start it as flowopt serve MODEL --enable-lora --lora-root DIR --record-rollouts")
        return response

    def set_policy(self, name: str | None) -> None:
        """Make every recorded request sample with the adapter loaded as ``name``."""
        response = self._call("PUT", "/rollouts/policy", {"lora_name": name})
        if response.status_code != 200:
            raise LMError(f"the recording server refused policy {name!r}: HTTP {response.status_code} "
                          f"{response.text[:300]}", fix="push the adapter (load_lora_adapter) before using it")

    def run(self, examples: Sequence[Any], group_size: int, step: int, pool: ThreadPoolExecutor) -> list[Rollout]:
        """Every example ``group_size`` times, all episodes at once; in order as :func:`.rollout.run_rollouts`."""
        model = self.served.current
        if model is None:
            raise RuntimeError("push() an adapter before running the agent's episodes")
        self.set_policy(model)
        tag = uuid.uuid4().hex[:8]
        episodes = [(i, j, AgentEpisode(f"{self.served.prefix}-s{step}-{tag}-{i}-{j}", example, self.base_url, model,
                                          self.temperature))
                    for i, example in enumerate(examples) for j in range(group_size)]
        futures = [pool.submit(self._episode, i, j, episode) for i, j, episode in episodes]
        return [future.result() for future in futures]

    def _episode(self, i: int, j: int, episode: AgentEpisode) -> Rollout:
        rollout = Rollout(i, j, episode.example)
        try:
            rollout.prediction = self.agent(episode)
        except Exception as err:  # the agent's failure is this episode's outcome, not the run's
            logger.warning("agent episode %s raised %s: %s", episode.rollout_id, type(err).__name__, err)
            rollout.error = f"the agent raised {type(err).__name__}: {err}"
        response = self._call("GET", f"/rollouts/{episode.rollout_id}")
        record: dict[str, Any] = response.json() if response.status_code == 200 else {"transitions": [], "reward": None}
        self._call("DELETE", f"/rollouts/{episode.rollout_id}")
        for t in record["transitions"]:
            if t.get("adapter") != episode.model:
                raise LMError(f"rollout {episode.rollout_id} was sampled with {t.get('adapter')!r}, not the pushed "
                              f"adapter {episode.model!r}", fix="let only this trainer set the server's policy")
            rollout.transitions.append(Transition(t["prompt_ids"], t["completion_ids"], t["logprobs"], "",
                                                  t.get("finish_reason") or "stop"))
        if rollout.error is None and not rollout.transitions:
            rollout.error = f"the agent sent no request with the header {ROLLOUT_HEADER}: {episode.rollout_id}"
        elif rollout.error is None and record.get("reward") is None:
            rollout.error = f"the agent reported no reward (POST {episode.reward_url})"
        if rollout.error is not None:
            rollout.reward, rollout.score = -self.format_penalty, None
        else:
            rollout.reward = rollout.score = float(record["reward"])
        return rollout
