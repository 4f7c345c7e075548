"""The recording mode of ``flowopt serve`` in process: /v1/completions requests tagged with a rollout id are
recorded with their ids and log-probs, untagged ones and servers without the mode record nothing."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from flowopt.lm.serve import create_app
from flowopt.lm.serve_record import MAX_TRANSITIONS, RolloutRecorder


@pytest.fixture(scope="module")
def local():
    from flowopt.lm.local import LocalLM
    from flowopt.optimizers.weights.tiny import tiny_causal_lm

    model, tokenizer = tiny_causal_lm(["red", "blue"], seed=0)
    lm = LocalLM.from_model(model, tokenizer, name="tiny", max_new_tokens=2)
    yield lm
    lm.close()


def test_a_tagged_completion_is_recorded_as_the_client_sees_it(local):
    recorder = RolloutRecorder()
    client = TestClient(create_app(local, recorder=recorder))
    asked = client.post("/v1/completions", headers={"X-Rollout-Id": "c1"},
                        json={"prompt": ["cue : red", "cue : blue"], "max_tokens": 2, "logprobs": 0,
                              "return_token_ids": True}).json()
    plain = client.post("/v1/completions", headers={"X-Rollout-Id": "c1"}, json={"prompt": "cue : red"}).json()
    client.post("/v1/completions", json={"prompt": "cue : red"})  # untagged
    record = client.get("/v1/rollouts/c1").json()
    assert len(record["transitions"]) == 3  # two prompts, then one
    for step, choice in zip(record["transitions"], asked["choices"]):
        assert step["prompt_ids"] == choice["prompt_token_ids"] and step["completion_ids"] == choice["token_ids"]
        assert step["logprobs"] == pytest.approx(choice["logprobs"]["token_logprobs"])
    assert "token_ids" not in plain["choices"][0] and plain["choices"][0]["logprobs"] is None


def test_limits_and_a_server_without_the_mode(local):
    recorder = RolloutRecorder()
    client = TestClient(create_app(local, recorder=recorder))
    body = {"prompt": "cue : red", "max_tokens": 1}
    asked = type("Asked", (), {"return_token_ids": False, "top_logprobs_wanted": lambda self: None})()
    for _ in range(MAX_TRANSITIONS):
        recorder.record("full", asked, {"model": "tiny", "choices": [{"logprobs": None}]})
    over = client.post("/v1/completions", headers={"X-Rollout-Id": "full"}, json=body)
    assert over.status_code == 409 and str(MAX_TRANSITIONS) in over.json()["error"]["message"]
    nan = client.post("/v1/rollouts/full/reward", content='{"reward": NaN}',
                      headers={"content-type": "application/json"})
    assert nan.status_code == 400
    without = TestClient(create_app(local))
    assert without.post("/v1/completions", headers={"X-Rollout-Id": "c2"}, json=body).status_code == 200
    assert without.get("/v1/rollouts/c2").status_code == 404
