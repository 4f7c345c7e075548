"""``flowopt serve``'s runtime LoRA endpoints (vLLM's contract), its log-probs and token ids, and the
client GRPO pushes adapters with (:class:`flowopt.lm.lora_client.LoraServer`), through the real app."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from flowopt.errors import LMError
from flowopt.lm.lora_client import LoraServer
from flowopt.lm.sampling import RowSettings
from flowopt.lm.serve import cli_main, create_app
from flowopt.lm.serve_lora import RuntimeLoras

MSG = [{"role": "user", "content": "Question: hello there?"}]


@pytest.fixture
def served(tiny_model_dir, tmp_path):
    """A LocalLM behind the app with runtime LoRA on, adapters allowed under ``root`` only."""
    from flowopt.lm import LocalLM

    local = LocalLM(tiny_model_dir, device="cpu", dtype="float32", max_new_tokens=8, batch_wait_ms=1)
    root = tmp_path / "root"
    root.mkdir()
    app = create_app(local, model_name="tiny", loras=RuntimeLoras(local, lora_root=root, max_loras=2))
    with TestClient(app) as client:
        yield client, local, root
    local.close()


def _load(client, name, path):
    return client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


def test_a_loaded_adapter_samples_with_its_weights_and_returns_ids_and_logprobs(served, tiny_model_dir,
                                                                                make_adapter):
    client, local, root = served
    make_adapter(tiny_model_dir, root / "a", seed=5)
    response = _load(client, "a", root / "a")
    assert response.status_code == 200 and "added" in response.text
    assert {"id": "a", "parent": "tiny"}.items() <= client.get("/v1/models").json()["data"][1].items()
    body = {"model": "a", "messages": MSG, "temperature": 0, "max_tokens": 6, "logprobs": True,
            "return_token_ids": True, "return_tokens_as_token_ids": True}
    answer = client.post("/v1/chat/completions", json=body).json()
    expected = local.generate([MSG], temperature=0.0, max_new_tokens=6, adapter="a")[0]
    base = local.generate([MSG], temperature=0.0, max_new_tokens=6, adapter=None)[0]
    assert expected.completion_ids != base.completion_ids  # the adapter matters, so it is what is checked
    choice = answer["choices"][0]
    assert answer["model"] == "a" and answer["prompt_token_ids"] == expected.prompt_ids
    assert choice["token_ids"] == expected.completion_ids
    entries = choice["logprobs"]["content"]
    assert [e["token"] for e in entries] == [f"token_id:{t}" for t in expected.completion_ids]
    assert [e["logprob"] for e in entries] == pytest.approx(expected.logprobs.tolist(), abs=1e-5)
    assert all(e["logprob"] <= 0 and e["top_logprobs"] == [] for e in entries)
    # The legacy completions shape: token_logprobs beside tokens.
    text = client.post("/v1/completions", json={"model": "a", "prompt": "hello there", "temperature": 0,
                                                "max_tokens": 4, "logprobs": 1, "return_token_ids": True}).json()
    one = local.generate(["hello there"], temperature=0.0, max_new_tokens=4, adapter="a")[0]
    choice = text["choices"][0]
    assert choice["token_ids"] == one.completion_ids and choice["prompt_token_ids"] == one.prompt_ids
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(one.logprobs.tolist(), abs=1e-5)
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200
    assert "a" not in local.adapters
    gone = client.post("/v1/chat/completions", json=body)
    assert gone.status_code == 404 and "does not exist" in gone.json()["error"]["message"]


def test_load_refuses_every_path_outside_the_lora_root(served, tiny_model_dir, make_adapter, tmp_path):
    client, local, root = served
    outside = make_adapter(tiny_model_dir, tmp_path / "outside", seed=1)
    (root / "link").symlink_to(outside, target_is_directory=True)
    for path in (outside, root / "link", root / ".." / "outside", "/etc"):
        response = _load(client, "x", path)
        assert response.status_code == 403, path
        assert "--lora-root" in response.json()["error"]["message"]
    missing = _load(client, "x", root / "nothing-here")
    assert missing.status_code == 400 and "adapter_config.json" in missing.json()["error"]["message"]
    assert local.adapters == [] and client.get("/health").json()["loras"] == []


def test_names_duplicates_the_cap_and_unknown_unloads_are_refused(served, tiny_model_dir, make_adapter):
    client, _, root = served
    for k in range(3):
        make_adapter(tiny_model_dir, root / f"a{k}", seed=k)
    assert _load(client, "a0", root / "a0").status_code == 200
    assert _load(client, "a0", root / "a1").status_code == 400  # the name is taken
    assert _load(client, "../evil", root / "a1").status_code == 400
    assert _load(client, "a1", root / "a1").status_code == 200
    over = _load(client, "a2", root / "a2")
    assert over.status_code == 400 and "--max-loras" in over.json()["error"]["message"]
    unknown = client.post("/v1/unload_lora_adapter", json={"lora_name": "never"})
    assert unknown.status_code == 404
    typo = client.post("/v1/chat/completions", json={"model": "a-typo", "messages": MSG, "max_tokens": 2})
    assert typo.status_code == 404  # never silently the base weights


def test_the_endpoints_are_refused_unless_the_operator_enables_lora(tiny_local, tiny_model_dir, make_adapter,
                                                                    tmp_path):
    adapter = make_adapter(tiny_model_dir, tmp_path / "a", seed=2)
    with TestClient(create_app(tiny_local, model_name="tiny")) as client:
        response = _load(client, "a", adapter)
        assert response.status_code == 404 and "--enable-lora" in response.json()["error"]["message"]
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 404
    assert tiny_local.adapters == []
    assert cli_main(["serve", str(tiny_model_dir), "--enable-lora"]) == 2  # no --lora-root
    assert cli_main(["serve", str(tiny_model_dir), "--lora-root", str(tmp_path)]) == 2  # no --enable-lora
    assert cli_main(["serve", str(tiny_model_dir), "--enable-lora", "--lora-root", str(tmp_path / "no")]) == 2


# --- the client ---------------------------------------------------------------------------------------

def _client(app: FastAPI) -> LoraServer:
    return LoraServer("http://testserver/v1", http=TestClient(app, base_url="http://testserver/v1"))


def test_client_loads_samples_and_unloads_through_the_server(served, tiny_model_dir, make_adapter):
    client, local, root = served
    server = _client(client.app)
    make_adapter(tiny_model_dir, root / "b", seed=7)
    assert server.models() == ["tiny"]
    server.load_adapter("b", str(root / "b"))
    for kind in ("messages", "prompt"):
        prompt = {"messages": MSG} if kind == "messages" else {"prompt": "hello there"}
        sample = server.sample("b", RowSettings(max_new_tokens=5, temperature=1.0, seed=3), **prompt)
        assert sample.prompt_ids == local.render(MSG if kind == "messages" else "hello there")
        with local.using_adapter("b"):  # the training forward's log-probs of what the server sampled
            rescored = local.token_logprobs([sample.prompt_ids], [sample.completion_ids])[0]
        assert sample.logprobs.tolist() == pytest.approx(rescored[:len(sample.completion_ids)].tolist(), abs=1e-4)
    server.unload_adapter("b")
    assert server.models() == ["tiny"]


def test_client_errors_name_what_the_server_lacks(tiny_local, tmp_path):
    plain = _client(create_app(tiny_local, model_name="tiny"))  # flowopt serve without --enable-lora
    with pytest.raises(LMError, match="no runtime LoRA endpoint") as err:
        plain.load_adapter("a", str(tmp_path))
    assert "--enable-lora" in str(err.value)
    bare = FastAPI()  # an OpenAI-compatible server without the routes (vLLM without runtime updating)

    @bare.post("/v1/completions")
    def completions() -> dict:
        return {"choices": [{"text": "hi", "finish_reason": "stop", "logprobs": None, "token_ids": [5, 6]}]}

    with pytest.raises(LMError, match=r"no runtime LoRA endpoint.*VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        _client(bare).load_adapter("a", str(tmp_path))
    with pytest.raises(LMError, match="no log-probs"):
        _client(bare).sample("a", RowSettings(max_new_tokens=2), prompt="hi")
    with pytest.raises(LMError, match="cannot reach the inference server"):
        LoraServer(f"http://127.0.0.1:{_closed_port()}/v1", timeout_s=5).models()


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens once the socket is closed
