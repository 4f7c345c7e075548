"""GRPO with rollouts sampled by an inference server: ``flowopt serve --enable-lora`` in its own process on
a free loopback port, the adapter pushed before every step, the server's ids and log-probs trained on."""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import dspy
import pytest

from flowopt.errors import ConfigError, LMError
from flowopt.lm import AutoAdapter
from flowopt.lm.serve_process import serve_subprocess
from flowopt.optimizers.weights import GRPO, InferenceServer, LoraSettings
from flowopt.ports import free_port

REPO = Path(__file__).resolve().parents[3]
LORA = LoraSettings(r=4, alpha=8)


@pytest.fixture(scope="module")
def word_model_dir(tmp_path_factory) -> Path:
    """The tiny word-level model of the cue -> word task, saved (the server loads it from the folder)."""
    from tests.optimizers.weights.conftest import save_word_model

    return save_word_model(tmp_path_factory.mktemp("word-model") / "tiny")


@pytest.fixture(scope="module")
def server(word_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-root")
    log = root.parent / "server.log"
    # The console command's entry point, one torch thread.
    with serve_subprocess(word_model_dir, "--dtype", "float32", "--enable-lora", "--lora-root", str(root),
                          "--max-loras", "2", "--log-level", "info", log=log,
                          entry=("-c", "import sys; from flowopt.benchmarks.cli import main; sys.exit(main())",
                                 "serve"),
                          env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, cwd=REPO) as base:
        yield base, root, log


def _grpo(word_model_dir, task, run_dir, option, steps=3):
    from flowopt.lm import LocalLM

    local = LocalLM(str(word_model_dir), name="tiny", device="cpu", dtype="float32", max_new_tokens=4,
                    progress=False)
    program = dspy.Predict(dspy.Signature("noise, cue -> word", "Answer."))
    program.lm = local.lm
    ctx = task.ctx(task.examples(16, seed=3), [], run_dir=run_dir)
    # A reward that differs between a random model's samples (the task's own is almost always 0 here),
    # so every step has advantages and moves the weights.
    ctx.metric = lambda example, prediction, trace=None: len(str(prediction.word)) / 10
    # beta > 0: every step makes an update (never skipped for equal rewards), so each reports its gap.
    stage = GRPO(steps=steps, batch_size=2, group_size=4, max_new_tokens=3, learning_rate=3e-2, beta=0.04,
                 lora=LORA, rollout_server=option, plot=False)
    try:
        with dspy.context(adapter=AutoAdapter()):
            stage.run(program, ctx)
    finally:
        local.close()
    return ctx.info


def test_grpo_samples_through_the_server_with_the_adapter_pushed_each_step(server, word_model_dir, task, tmp_path):
    base, root, log = server
    info = _grpo(word_model_dir, task, tmp_path / "run", InferenceServer(base, adapter_dir=root / "run"))
    curve = info["reward_curve"]
    names = info["served_adapters"]
    assert len(curve) == 3 and len(set(names)) == 3  # a fresh adapter name every step
    # The server loaded each, in order, and unloaded the one before (and the last at the end).
    events = re.findall(r"(loaded|unloaded) LoRA adapter '([^']+)'", log.read_text())
    mine = [e for e in events if e[1] in names]
    assert mine == [("loaded", names[0]), ("unloaded", names[0]), ("loaded", names[1]), ("unloaded", names[1]),
                    ("loaded", names[2]), ("unloaded", names[2])]
    assert sorted(p.name for p in (root / "run").iterdir()) == []  # pushed folders are cleaned up
    for point in curve:
        assert point["completion_tokens"] > 0 and point["transitions"] == 8 and not point["skipped"]
        assert point["grad_norm"] > 0  # the weights moved, so a stale adapter would show in the gap
        # Server and trainer both in float32: the server's log-probs are the training forward's within
        # rounding, which holds only if it sampled with the weights the learner had at that step.
        assert point["sampler_logprob_gap"] < 1e-4
        assert point["reward_std"] > 0 and -1.0 <= point["mean_reward"] <= 4.0
    assert info["adapter"] and Path(info["adapter"], "adapter_model.safetensors").is_file()


def test_a_stale_adapter_on_the_server_shows_in_the_gap(server, word_model_dir, task, tmp_path, monkeypatch):
    """The control for the test above: push only before the first step, and the server samples with old
    weights; the gap to the training forward then grows far past the bound the test above holds."""
    from flowopt.optimizers.weights.served import ServedRollouts

    base, root, _ = server
    original = ServedRollouts.push

    def first_only(self, step):
        return original(self, step) if self.current is None else self.current

    monkeypatch.setattr(ServedRollouts, "push", first_only)
    curve = _grpo(word_model_dir, task, tmp_path / "stale", InferenceServer(base, adapter_dir=root / "stale"),
                  steps=2)["reward_curve"]
    assert curve[0]["sampler_logprob_gap"] < 1e-4
    assert curve[1]["sampler_logprob_gap"] > 1e-2


def test_unreachable_server_stops_grpo_before_any_step(word_model_dir, task, tmp_path):
    option = InferenceServer(f"http://127.0.0.1:{free_port()}/v1", adapter_dir=tmp_path / "adapters")
    with pytest.raises(LMError, match="cannot reach the inference server") as err:
        _grpo(word_model_dir, task, tmp_path / "run", option)
    assert "flowopt serve MODEL --enable-lora --lora-root" in str(err.value)


def test_a_server_outside_whose_root_the_adapters_go_is_refused_clearly(server, word_model_dir, task, tmp_path):
    base, _, _ = server
    option = InferenceServer(base, adapter_dir=tmp_path / "not-under-the-root")
    with pytest.raises(LMError, match="refused /load_lora_adapter") as err:
        _grpo(word_model_dir, task, tmp_path / "run", option)
    assert "--lora-root" in str(err.value)


def test_rollout_server_option_is_checked():
    with pytest.raises(ConfigError, match="InferenceServer"):
        GRPO(rollout_server="http://127.0.0.1:8000/v1")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="adapter_dir"):
        InferenceServer("http://127.0.0.1:8000/v1", adapter_dir="")
    with pytest.raises(ConfigError, match=r"InferenceServer url must be an http\(s\)://HOST:PORT/v1 URL, got "
                                          r"'127.0.0.1:8000/v1' \(str\)\. Fix: pass url='http://127.0.0.1:8000/v1'"):
        InferenceServer("127.0.0.1:8000/v1", adapter_dir="adapters")
    with pytest.raises(ConfigError, match=r"api_key_env must be the name of an environment variable.*'VLLM_API_KEY'"):
        InferenceServer("http://127.0.0.1:8000/v1", adapter_dir="adapters", api_key_env="MY-KEY")
    with pytest.raises(ConfigError, match="timeout_s must be a number > 0"):
        InferenceServer("http://127.0.0.1:8000/v1", adapter_dir="adapters", timeout_s=0.0)
    assert InferenceServer("https://rollouts.example:443/v1", adapter_dir=Path("a"), api_key_env="VLLM_API_KEY")


def test_no_credentials_from_the_environment_unless_named(monkeypatch):
    from flowopt.errors import ConfigError
    from flowopt.optimizers.weights.served import InferenceServer

    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-for-this-server")
    server = InferenceServer("http://127.0.0.1:1/v1", adapter_dir="x").connect()
    assert "authorization" not in {k.lower() for k in server._http.headers}
    monkeypatch.setenv("ROLLOUT_KEY", "k1")
    named = InferenceServer("http://127.0.0.1:1/v1", adapter_dir="x", api_key_env="ROLLOUT_KEY").connect()
    assert named._http.headers["authorization"] == "Bearer k1"
    monkeypatch.delenv("ROLLOUT_KEY")
    with pytest.raises(ConfigError, match="ROLLOUT_KEY"):
        InferenceServer("http://127.0.0.1:1/v1", adapter_dir="x", api_key_env="ROLLOUT_KEY").connect()
    with pytest.raises(ConfigError, match="http"):
        InferenceServer("file:///etc/passwd", adapter_dir="x")
    assert os.environ["OPENAI_API_KEY"]  # untouched


@contextlib.contextmanager
def _fake_server(app) -> Iterator[str]:
    """An in-process uvicorn server on a free loopback port."""
    import threading

    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_a_server_that_returns_no_logprobs_stops_the_step_with_a_clear_error(word_model_dir, task, tmp_path):
    """Sampling fails inside the program's threads, where a program may catch its LM's errors: the step
    must still stop with the server's error, not count the rollouts as wrong answers."""
    from fastapi import FastAPI

    app = FastAPI()
    app.get("/v1/models")(lambda: {"data": [{"id": "tiny"}]})
    app.post("/v1/load_lora_adapter")(lambda: "Success")
    app.post("/v1/unload_lora_adapter")(lambda: "Success")
    app.post("/v1/completions")(lambda: {"choices": [{"text": "red", "finish_reason": "stop", "logprobs": None,
                                                      "token_ids": [4, 3]}]})
    with _fake_server(app) as base, pytest.raises(LMError, match="no log-probs for the sampled tokens"):
        _grpo(word_model_dir, task, tmp_path / "run", InferenceServer(base, adapter_dir=tmp_path / "adapters"))


def test_server_rollouts_are_refused_on_a_launched_compile(word_model_dir, task, tmp_path, monkeypatch):
    # N ranks would each push their own adapter to the one server: refused before any model work.
    from flowopt.optimizers.weights import grpo
    from flowopt.optimizers.weights.distributed import World

    monkeypatch.setattr(grpo, "current_world", lambda: World(rank=0, size=2))
    option = InferenceServer(f"http://127.0.0.1:{free_port()}/v1", adapter_dir=tmp_path / "adapters")
    with pytest.raises(ConfigError, match="launched on 2 processes") as err:
        _grpo(word_model_dir, task, tmp_path / "run", option)
    assert "launch one process" in str(err.value)
