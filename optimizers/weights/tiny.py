"""A tiny, randomly initialised causal LM and word-level tokenizer, built offline in a second.

For tests, benchmarks and examples of the weights stages: nothing is downloaded. Words are whole
tokens, so a task such as "emit the word the cue names" is learnable in a few dozen steps on a CPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

SPECIAL_TOKENS = ("<pad>", "<unk>", "<bos>", "<eos>")
BASE_WORDS = ("cue", "word", ":", "answer", "question", "the", "is", "a", ".", ",")


def word_tokenizer(words: Iterable[str]) -> Any:
    """A ``PreTrainedTokenizerFast`` over whole words (whitespace-split), with pad/unk/bos/eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for token in (*SPECIAL_TOKENS, *BASE_WORDS, *words):
        vocab.setdefault(token, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with single spaces
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>",
                                   eos_token="<eos>")


def tiny_causal_lm(words: Iterable[str], *, hidden_size: int = 64, layers: int = 2, heads: int = 4,
                   init_range: float = 0.1, seed: int = 0) -> tuple[Any, Any]:
    """``(model, tokenizer)``: a Llama-shaped model with ``hidden_size`` and ``layers``, random weights.

    Example:
        >>> model, tokenizer = tiny_causal_lm(["red", "blue"])
        >>> tokenizer.decode(tokenizer("cue : red")["input_ids"], skip_special_tokens=True)
        'cue : red'
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = word_tokenizer(words)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=2048, tie_word_embeddings=True, initializer_range=init_range,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.eval()
    return model, tokenizer

