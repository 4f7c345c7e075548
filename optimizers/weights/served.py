"""GRPO rollouts sampled by an inference server (vLLM, ``flowopt serve``) that loads LoRA adapters at run time.

Per step the trainer pushes the adapter it is training: save it under ``adapter_dir``, unload the one
pushed before, load the new folder under a fresh name (a server caches adapters by name), and the
program's LM calls go to the server with ``model=<that name>``. The server returns the sampled token
ids and their log-probs; the update itself runs here, and its old policy is the training forward
(:mod:`flowopt.optimizers.weights.learner`), so a sampler in another engine, dtype or kernel never
rescales the gradient; the sampler's log-probs are reported against it (``sampler_logprob_gap``). The
engine the program's calls go through is :class:`flowopt.lm.served_engine.ServerEngine`.

Prompts: chat students go through ``/v1/chat/completions``, base students (no chat template) through
``/v1/completions`` with flowopt's plain transcript. The server must render them into the ids the
student renders (same tokenizer and template), else the adapter would learn prompts inference never
sends: a mismatch is an error.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowopt.errors import ConfigError, LMError
from flowopt.lm.lora_client import LoraServer
from flowopt.lm.sampling import Sample
from flowopt.lm.served_engine import ServerEngine
from flowopt.optimizers.weights.policy import Policy
from flowopt.settings import above, check_stage, matches

logger = logging.getLogger(__name__)

#: The formats of :class:`InferenceServer`'s settings.
SERVER_SETTINGS = {
    "url": matches(r"^https?://[^\s/]+", meaning="an http(s)://HOST:PORT/v1 URL", sample="http://127.0.0.1:8000/v1"),
    "adapter_dir": matches(r"\S", meaning="a folder the server can load adapters from (flowopt serve: one inside "
                                         "its --lora-root)", sample="/srv/adapters/run1"),
    "api_key_env": matches(r"^[A-Za-z_][A-Za-z0-9_]*$", meaning="the name of an environment variable holding the "
                                                             "server's key", sample="VLLM_API_KEY"),
    "timeout_s": above(0.0),
}


@dataclass(frozen=True)
class InferenceServer:
    """Where GRPO samples its rollouts: an OpenAI-compatible server with runtime LoRA loading.

    ``url``: the server's base URL, ending in ``/v1``. ``adapter_dir``: a folder this process writes each
    step's adapter into and the server can read (flowopt serve: inside its ``--lora-root``);
    ``server_adapter_dir``: the same folder as the server sees it, when mounted elsewhere (a container).
    ``api_key_env``: the name of an environment variable holding the server's key, sent as a Bearer
    token; keys are never read from a workflow or checkpoint. The server must serve the student's base
    model (vLLM: ``vllm serve MODEL --enable-lora --max-lora-rank R``, with
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``).

    Example:
        >>> server = InferenceServer("http://127.0.0.1:8000/v1", adapter_dir="/srv/adapters/run1")
        >>> from flowopt.optimizers.weights import GRPO
        >>> stage = GRPO(steps=50, rollout_server=server)  # doctest: +SKIP
    """

    url: str
    adapter_dir: str | Path
    server_adapter_dir: str | None = None
    api_key_env: str | None = None
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        check_stage(self, SERVER_SETTINGS)

    def connect(self) -> LoraServer:
        api_key = None
        if self.api_key_env is not None:
            api_key = os.environ.get(self.api_key_env)
            if not api_key:
                raise ConfigError(f"environment variable {self.api_key_env} (the rollout server's key) is not set",
                                  fix=f"export {self.api_key_env}=... or pass api_key_env=None")
        return LoraServer(self.url, api_key=api_key, timeout_s=self.timeout_s)


class ServedRollouts:
    """A GRPO run's side of the server: pushes each step's adapter and makes the engine that samples with it.

    Example:
        >>> served = ServedRollouts(InferenceServer(url, adapter_dir=folder), policy, prefix="grpo")  # doctest: +SKIP
        >>> name = served.push(step=0)  # save, unload the previous, load under a fresh name  # doctest: +SKIP
    """

    def __init__(self, option: InferenceServer, policy: Policy, *, prefix: str) -> None:
        self.option, self.policy = option, policy
        self.prefix = re.sub(r"[^A-Za-z0-9._-]", "-", prefix)[:64] or "grpo"
        self.folder = Path(option.adapter_dir).expanduser()
        self.server = option.connect()
        self.current: str | None = None
        self.pushed: list[str] = []  # every name pushed, in order (reported)
        self.push_seconds: list[float] = []

    def start(self) -> None:
        """Check the server answers before the run starts, and create the adapter folder."""
        try:
            models = self.server.models()
        except LMError:
            self.server.close()
            raise
        logger.info("grpo: rollouts through %s (serving %s)", self.option.url, models)
        self.folder.mkdir(parents=True, exist_ok=True)

    def _server_path(self, folder: Path) -> str:
        if self.option.server_adapter_dir is None:
            return str(folder.resolve())
        return str(Path(self.option.server_adapter_dir) / folder.name)

    def push(self, step: int) -> str:
        """Make the server sample with the adapter's current weights; returns the name they are served as."""
        began = time.perf_counter()
        name = f"{self.prefix}-step{step}-{uuid.uuid4().hex[:8]}"
        folder = self.folder / name
        self.policy.save_adapter(folder)
        if self.current is not None:
            self._drop(self.current)
        self.server.load_adapter(name, self._server_path(folder))
        self.current = name
        self.pushed.append(name)
        self.push_seconds.append(round(time.perf_counter() - began, 4))
        return name

    def report(self) -> dict[str, Any]:
        """For the stage's report: the name each step's rollouts were sampled with, and each push's time."""
        return {"rollout_server": self.option.url, "served_adapters": list(self.pushed),
                "push_seconds": list(self.push_seconds)}

    def _drop(self, name: str) -> None:
        self.server.unload_adapter(name)
        shutil.rmtree(self.folder / name, ignore_errors=True)
        if self.current == name:
            self.current = None

    def engine(self, *, recorder: Callable[[Sample], None], temperature: float, max_new_tokens: int,
               seed: Callable[[], int | None]) -> ServerEngine:
        if self.current is None:
            raise RuntimeError("push() an adapter before sampling through the server")
        return ServerEngine(self.server, self.policy.local, self.current, recorder=recorder, temperature=temperature,
                            max_new_tokens=max_new_tokens, seed=seed)

    def close(self) -> None:
        """Unload the last pushed adapter and delete its folder; the trained adapter is saved by the stage."""
        try:
            if self.current is not None:
                self._drop(self.current)
        except LMError as exc:  # the run's result stands; a server that went away keeps its adapter
            logger.warning("grpo: could not unload %s from the rollout server: %s", self.current, exc)
        finally:
            self.server.close()
