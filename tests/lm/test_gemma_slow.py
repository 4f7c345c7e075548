"""The real embedded Gemma 3 270M (converted once into the flowopt cache): a ChainOfThought end to end."""

from __future__ import annotations

import dspy
import pytest


@pytest.mark.slow
def test_gemma_chain_of_thought_gives_parseable_output():
    from flowopt.lm import CompletionAdapter, LocalLM, adapter_for, gemma

    local = LocalLM("gemma-3-270m", max_new_tokens=64)
    assert gemma.verify_gemma(deep=True)
    assert local.is_base and local.lm.model == "local/gemma-3-270m"
    adapter = adapter_for(local.lm)
    assert isinstance(adapter, CompletionAdapter)
    with dspy.context(lm=local.lm, adapter=adapter):
        result = dspy.ChainOfThought("question -> answer")(
            question="Tom has 3 apples and buys 5 more. How many apples does Tom have now?")
    assert result.reasoning.strip() and result.answer.strip()
    assert local.lm.history[-1]["usage"]["completion_tokens"] > 0
    local.close()


@pytest.mark.slow
def test_the_packaged_gguf_tokenizer_passes_the_probe(tmp_path):
    """The probe's ids are what this transformers makes of the packaged GGUF (the conversion's own check)."""
    from transformers import AutoTokenizer

    from flowopt.lm import gemma

    gguf = gemma.assemble_gguf(tmp_path / "model.gguf", progress=False)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=gguf.name, local_files_only=True)
    gemma.check_tokenizer(tokenizer, tmp_path)
    assert tokenizer.decode(list(gemma.TOKENIZER_PROBE[1]), skip_special_tokens=True) == gemma.TOKENIZER_PROBE[0]
