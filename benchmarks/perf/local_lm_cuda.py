"""LocalLM's CUDA path on a randomly initialised Gemma-3-270M-shaped model (no weights needed).

Run on a GPU machine: python3 benchmarks/perf/local_lm_cuda.py [--out DIR]
Checks: cuda is picked with bf16; greedy outputs of 8 concurrent callers (dynamic batching) against
the same calls made one at a time; seeded sampling reproduces; token_logprobs backward and LoRA
disable work on the GPU; tokens/s at batch 1 vs 8 concurrent callers. Prints JSON.

Only torch, transformers, peft and tokenizers are needed: the GPU image has no DSPy, so flowopt's
package __init__ files (which import DSPy) are bypassed and the torch-side modules imported directly.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _import_local_lm():
    # Register bare package objects so importing flowopt.lm.local skips the DSPy-importing __init__s.
    for name, folder in (("flowopt", ROOT / "flowopt"), ("flowopt.lm", ROOT / "flowopt" / "lm")):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [str(folder)]
            sys.modules[name] = module
    from flowopt.lm.local import LocalLM
    from flowopt.lm.sampling import RowSettings

    return LocalLM, RowSettings


def build_model(folder: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, PreTrainedTokenizerFast

    corpus = [f"Question {i}: what is {i} plus {i * 3}? Answer: {i * 4}. The quick brown fox {i}." for i in range(500)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=2048, special_tokens=["<pad>", "<eos>", "<bos>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    # Gemma 3 270M's shape (18 layers, 640 wide, 5:1 sliding/full attention) with a small vocabulary.
    layer_types = [("full_attention" if (i + 1) % 6 == 0 else "sliding_attention") for i in range(18)]
    config = Gemma3TextConfig(vocab_size=tok.get_vocab_size(), hidden_size=640, intermediate_size=2048,
                              num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                              sliding_window=512, layer_types=layer_types, max_position_embeddings=4096,
                              initializer_range=0.05, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
                              bos_token_id=2)
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


def concurrent(fn, args):
    results = {}
    barrier = threading.Barrier(len(args))

    def work(i):
        barrier.wait()
        results[i] = fn(args[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [results[i] for i in range(len(args))]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    import torch

    LocalLM, RowSettings = _import_local_lm()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    report: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available()
                    else None}
    folder = build_model(Path(tempfile.mkdtemp()) / "gemma-shaped")
    local = LocalLM(folder, max_new_tokens=args.tokens, batch_wait_ms=5)
    report.update(device=str(local.device), dtype=str(local.dtype))
    prompts = [local.render(f"Question {i}: what is {i} plus {2 * i}? Answer:") for i in range(8)]
    greedy = RowSettings(max_new_tokens=args.tokens)
    local.complete_ids(prompts[0], greedy)  # warm-up (CUDA context, kernels)
    sync()

    began = time.perf_counter()
    sequential = [local.complete_ids(p, greedy) for p in prompts]
    sync()
    seq_s = time.perf_counter() - began
    began = time.perf_counter()
    together = concurrent(lambda p: local.complete_ids(p, greedy), prompts)
    sync()
    conc_s = time.perf_counter() - began
    seq_tokens = sum(len(s.completion_ids) for s in sequential)
    conc_tokens = sum(len(s.completion_ids) for s in together)
    report["greedy_identical_bf16"] = sum(a.completion_ids == b.completion_ids for a, b in zip(sequential, together))
    report["batch_sizes"] = local._batcher.batch_sizes[-4:]
    report["batch1_tokens_per_s"] = round(seq_tokens / seq_s, 1)
    report["concurrent8_tokens_per_s"] = round(conc_tokens / conc_s, 1)
    report["speedup_8_vs_1"] = round((conc_tokens / conc_s) / (seq_tokens / seq_s), 2)

    sampled = [RowSettings(max_new_tokens=16, temperature=1.0, seed=i) for i in range(4)]
    first = concurrent(lambda i: local.complete_ids(prompts[i], sampled[i]), list(range(4)))
    again = [local.complete_ids(prompts[i], sampled[i]) for i in range(4)]
    report["seeded_alone_vs_batched_identical"] = sum(a.completion_ids == b.completion_ids
                                                      for a, b in zip(first, again))

    samples = local.generate([prompts[0], prompts[1]], n=2, temperature=1.0, seed=0, max_new_tokens=16)
    model = local.add_adapter("policy")
    new = local.token_logprobs([s.prompt_ids for s in samples], [s.completion_ids for s in samples], grad=True)
    new.sum().backward()
    report["lora_grad_params"] = sum(p.grad is not None for p in model.parameters() if p.requires_grad)
    with local.adapter_disabled():
        reference = local.token_logprobs([s.prompt_ids for s in samples], [s.completion_ids for s in samples])
    old = torch.nn.utils.rnn.pad_sequence([s.logprobs for s in samples], batch_first=True).to(reference.device)
    # A fresh LoRA starts as the identity, so the reference must equal the generation-time scores.
    report["reference_vs_old_max_abs_diff"] = float((reference.float() - old).abs().max())

    fp32 = LocalLM(folder, dtype="float32", max_new_tokens=args.tokens, batch_wait_ms=5)
    seq32 = [fp32.complete_ids(p, greedy) for p in prompts]
    conc32 = concurrent(lambda p: fp32.complete_ids(p, greedy), prompts)
    report["greedy_identical_fp32"] = sum(a.completion_ids == b.completion_ids for a, b in zip(seq32, conc32))
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "local_lm_cuda.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
