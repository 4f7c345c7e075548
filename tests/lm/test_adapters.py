"""PEFT LoRA adapters on a LocalLM: load, switch, disable (the GRPO reference), unload, save."""

from __future__ import annotations

import pytest
import torch

from flowopt.errors import ConfigError

PROMPTS = ["Question: what is 1 plus 1?\nAnswer:", "hello there", "The quick brown fox"]


@pytest.fixture
def local(tiny_model_dir):
    from flowopt.lm import LocalLM

    lm = LocalLM(tiny_model_dir, device="cpu", dtype="float32", max_new_tokens=10, batch_wait_ms=5)
    yield lm
    lm.close()


def _greedy(local):
    return [s.completion_ids for s in local.generate(PROMPTS, temperature=0.0, logprobs=False)]


def test_adapter_changes_outputs_and_disabling_restores_the_base(local, tiny_model_dir, tmp_path, make_adapter):
    base = _greedy(local)
    base_tag = local.lm.model
    name = local.load_adapter(make_adapter(tiny_model_dir, tmp_path / "a1", seed=1))
    assert name == "a1" and local.active_adapter == "a1" and local.adapters == ["a1"]
    adapted = _greedy(local)
    assert adapted != base
    assert local.lm.model != base_tag  # DSPy's cache cannot serve base results for the adapter
    with local.adapter_disabled():
        assert local.active_adapter is None
        assert _greedy(local) == base
        assert local.lm("hello there", cache=False)[0] == local.generate(["hello there"], logprobs=False)[0].text
        assert local.lm.model == base_tag
    assert _greedy(local) == adapted
    local.unload_adapter()
    assert local.adapters == [] and _greedy(local) == base and local.lm.model == base_tag


def test_switching_between_two_adapters(local, tiny_model_dir, tmp_path, make_adapter):
    a = local.load_adapter(make_adapter(tiny_model_dir, tmp_path / "a", seed=1))
    out_a = _greedy(local)
    b = local.load_adapter(make_adapter(tiny_model_dir, tmp_path / "b", seed=2))
    out_b = _greedy(local)
    assert local.active_adapter == b and out_a != out_b
    local.set_adapter(a)
    assert _greedy(local) == out_a
    local.unload_adapter(a)
    assert local.adapters == [b] and _greedy(local) == out_b


def test_reference_logprobs_equal_the_base_models(local, tiny_model_dir, tmp_path, make_adapter):
    prompt = [local.render(PROMPTS[0])]
    completion = [[40, 41, 42, 43]]
    base = local.token_logprobs(prompt, completion)
    local.load_adapter(make_adapter(tiny_model_dir, tmp_path / "a", seed=3))
    adapted = local.token_logprobs(prompt, completion)
    with local.adapter_disabled():
        reference = local.token_logprobs(prompt, completion)
    assert not torch.allclose(adapted, base)
    assert torch.allclose(reference, base, atol=1e-6)


def test_training_a_fresh_lora_and_saving_it(local, tmp_path):
    model = local.add_adapter("policy")
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and local.active_adapter == "policy"
    with pytest.raises(ConfigError, match="only in memory"):
        local.to_spec()
    # One optimisation step through token_logprobs(grad=True), as the GRPO stage does.
    samples = local.generate(PROMPTS[:2], n=2, temperature=1.0, seed=0, max_new_tokens=5)
    tag = local.lm.model
    optimizer = torch.optim.SGD(trainable, lr=1.0)
    new = local.token_logprobs([s.prompt_ids for s in samples], [s.completion_ids for s in samples], grad=True)
    (-new.sum()).backward()
    optimizer.step()
    local.mark_weights_changed()
    assert local.lm.model != tag
    after = local.token_logprobs([s.prompt_ids for s in samples], [s.completion_ids for s in samples])
    assert after.sum() > new.detach().sum()
    assert local.adapter_path() is None  # trained, not yet on disk
    saved = local.save_adapter(tmp_path / "saved")
    assert saved == tmp_path / "saved" and (saved / "adapter_config.json").is_file()
    assert local.adapter_path("policy") == saved.resolve()
    assert local.to_spec()["adapter"] == str(saved.resolve())
    # Saving again replaces the folder whole and leaves no temporary folders beside it.
    local.save_adapter(tmp_path / "saved")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved"]
    with pytest.raises(ConfigError, match="no adapter named"):
        local.adapter_path("missing")


def test_loading_a_missing_adapter_is_a_config_error(local, tmp_path):
    with pytest.raises(ConfigError, match=r"adapter_config\.json"):
        local.load_adapter(tmp_path)


def test_a_call_can_pin_its_weights_whatever_is_active(local, tiny_model_dir, tmp_path, make_adapter):
    from flowopt.lm import RowSettings

    prompt, row = local.render(PROMPTS[0]), RowSettings(max_new_tokens=8)
    base = local.complete_ids(prompt, row).completion_ids
    local.load_adapter(make_adapter(tiny_model_dir, tmp_path / "a", seed=1))
    adapted = local.complete_ids(prompt, row).completion_ids
    local.load_adapter(make_adapter(tiny_model_dir, tmp_path / "b", seed=2))  # now "b" is active
    assert local.complete_ids(prompt, row, adapter="a").completion_ids == adapted
    assert local.complete_ids(prompt, row, adapter=None).completion_ids == base
    assert local.active_adapter == "b"
    with pytest.raises(ConfigError, match="no adapter"):
        local.complete_ids(prompt, row, adapter="missing")


def test_unloading_the_last_adapter_leaves_the_base_weights_as_trainable_as_before(local, tiny_model_dir, tmp_path,
                                                                                   make_adapter):
    # PEFT freezes the base weights when an adapter goes on; taking the last one off must thaw them again, or a
    # later gradient through the base model (a user's own fine-tuning, token_logprobs with grad) silently has none.
    frozen = next(local.model.parameters())
    frozen.requires_grad_(False)  # a weight the user froze stays frozen
    trainable_before = {name for name, p in local.model.named_parameters() if p.requires_grad}
    assert trainable_before
    local.load_adapter(make_adapter(tiny_model_dir, tmp_path / "a", seed=1))
    local.add_adapter("fresh", activate=False)
    local.unload_adapter("a")
    local.unload_adapter("fresh")
    assert local.adapters == []
    assert {name for name, p in local.model.named_parameters() if p.requires_grad} == trainable_before
