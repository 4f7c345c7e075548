"""Shared fixtures: a tiny randomly initialised Gemma-3-architecture model with a tokenizer trained here.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on a few sentences in a fraction of a
second, the model is built from a config with a fixed seed and saved with ``save_pretrained``, so the
tests load it through the same code path as a real checkpoint folder.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# litellm fetches a model price list from GitHub when imported; tests stay offline.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

CORPUS = [
    "Question: What is two plus two?\nAnswer: four",
    "Given the fields `question`, produce the fields `answer`.",
    "Reasoning: Let's think step by step. The farmer has three cows and buys five more.",
    "The quick brown fox jumps over the lazy dog. A stitch in time saves nine.",
    "---\nSystem: You are helpful.\nUser: hello there\nAssistant: hi, how can I help?",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 42 100 and symbols [[ ## ]] $ % , . ; : ! ?",
]


def build_tiny_model(folder: Path, *, seed: int = 0) -> Path:
    """Save a tiny Gemma 3 text model and its tokenizer into ``folder`` (about 1 MB, under a second).

    Untied output embeddings: with tied ones a random model just repeats its last token.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<eos>", "<bos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                        pad_token="<pad>")
    config = Gemma3TextConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
        sliding_window=16, layer_types=["sliding_attention", "full_attention"], initializer_range=0.2,
        pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-gemma") / "tiny")


@pytest.fixture(scope="session")
def tiny_local(tiny_model_dir: Path):
    """One shared LocalLM over the tiny model; tests that attach adapters build their own.

    float32, because batched and sequential greedy outputs are compared token for token, and only
    float32 keeps them equal whatever the padding (bf16 rounding depends on the batch's shape).
    """
    from flowopt.lm import LocalLM

    local = LocalLM(tiny_model_dir, device="cpu", dtype="float32", max_new_tokens=12, batch_wait_ms=30)
    yield local
    local.close()


def _make_adapter(model_dir: Path, out: Path, seed: int) -> Path:
    """A LoRA with random (non-zero) B matrices, so it really changes the outputs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir))
    config = LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj", "down_proj"],
                        init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(str(out))
    return out


@pytest.fixture
def make_adapter():
    """``make_adapter(model_dir, out_dir, seed) -> out_dir``: save a random LoRA for the tiny model."""
    return _make_adapter


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared CPU OpenMP threads that get
    descheduled stall each other (several times slower); restored after each test."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@contextlib.contextmanager
def serve_in_thread(server: Any) -> Iterator[str]:
    """Run a ``uvicorn.Server`` in a thread of this process; yields its base URL, stops it on exit."""
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "uvicorn did not start within 30 s"
    try:
        yield f"http://127.0.0.1:{server.config.port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
