"""LocalLM's CUDA path on a randomly initialised Gemma-3-270M-shaped model (no weights needed).

Run on a GPU machine: python -m flowopt.benchmarks.perf.local_lm_cuda [--tokens 64] [--out STEM]
Writes benchmarks/results/local_lm_cuda.{json,md}. Checks: cuda is picked with bf16; greedy outputs of
8 concurrent callers (dynamic batching) against the same calls made one at a time; seeded sampling
reproduces; token_logprobs backward and LoRA disable work on the GPU; tokens/s at batch 1 vs 8
concurrent callers. On a machine without CUDA it runs the same checks on the CPU (that is what
``--smoke`` does in the test suite). It needs flowopt installed with its dependencies (DSPy included).
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flowopt.benchmarks.perf.harness import PerfParser, markdown_table, setup_logging, start_run

SMOKE = {"tokens": 4, "layers": 2}


def build_model(folder: Path, layers: int = 18) -> Path:
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
    layer_types = [("full_attention" if (i + 1) % 6 == 0 else "sliding_attention") for i in range(layers)]
    config = Gemma3TextConfig(vocab_size=tok.get_vocab_size(), hidden_size=640, intermediate_size=2048,
                              num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                              sliding_window=512, layer_types=layer_types, max_position_embeddings=4096,
                              initializer_range=0.05, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
                              bos_token_id=2)
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


def concurrent(fn: Callable[[Any], Any], args: list[Any]) -> list[Any]:
    results = {}
    barrier = threading.Barrier(len(args))

    def work(i: int) -> None:
        barrier.wait()
        results[i] = fn(args[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [results[i] for i in range(len(args))]


def _rows(report: dict[str, Any]) -> list[list[Any]]:
    """The results table: one row per check."""
    return [["device / dtype picked automatically", f"`{report['device']}` / `{report['dtype']}`"],
            ["rows in the last decode steps (8 concurrent callers at the end)", report["batch_sizes"]],
            ["greedy, 8 concurrent vs one at a time, fp32", f"{report['greedy_identical_fp32']} / 8 identical"],
            [f"greedy, 8 concurrent vs one at a time, {report['dtype']}",
             f"{report['greedy_identical_default_dtype']} / 8 identical"],
            ["seeded sampling, batched vs alone", f"{report['seeded_alone_vs_batched_identical']} / 4 identical"],
            ["`token_logprobs(grad=True)` backward into a fresh LoRA",
             f"{report['lora_grad_params']} LoRA tensors got gradients"],
            ["reference (`adapter_disabled`) vs generation-time log-probs",
             f"max abs diff {report['reference_vs_old_max_abs_diff']}"],
            ["tokens/s, batch 1 (sequential calls)", report["batch1_tokens_per_s"]],
            ["tokens/s, 8 concurrent callers", f"{report['concurrent8_tokens_per_s']} ({report['speedup_8_vs_1']}x)"]]


def main(argv: list[str] | None = None) -> int:
    parser = PerfParser("local_lm_cuda", __doc__, smoke=SMOKE)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=18, help="layers of the Gemma-shaped model")
    run = start_run(parser, argv)
    args = run.args
    import torch

    from flowopt.lm.local import LocalLM
    from flowopt.lm.sampling import RowSettings

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(Path(tmp) / "gemma-shaped", layers=args.layers)
        local = LocalLM(folder, max_new_tokens=args.tokens, batch_wait_ms=5)
        report.update(device=str(local.device), dtype=str(local.dtype).replace("torch.", ""))
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
        report["greedy_identical_default_dtype"] = sum(a.completion_ids == b.completion_ids
                                                       for a, b in zip(sequential, together))
        report["batch_sizes"] = list(local.decode_stats.recent)[-4:]
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
        old = torch.nn.utils.rnn.pad_sequence([torch.as_tensor(s.logprobs) for s in samples],
                                              batch_first=True).to(reference.device)
        # A fresh LoRA starts as the identity, so the reference must equal the generation-time scores.
        report["reference_vs_old_max_abs_diff"] = float((reference.float() - old).abs().max())
        local.close()

        fp32 = LocalLM(folder, dtype="float32", max_new_tokens=args.tokens, batch_wait_ms=5)
        seq32 = [fp32.complete_ids(p, greedy) for p in prompts]
        conc32 = concurrent(lambda p: fp32.complete_ids(p, greedy), prompts)
        report["greedy_identical_fp32"] = sum(a.completion_ids == b.completion_ids for a, b in zip(seq32, conc32))
        fp32.close()

    rows = _rows(report)
    body = [f"Model: Gemma 3 270M's shape ({args.layers} layers, width 640, 5:1 sliding/full attention) with "
            "random weights and a 2,048-token BPE vocabulary trained in the script; up to "
            f"{args.tokens} new tokens.", "", *markdown_table(["check", "result"], rows)]
    run.finish("LocalLM on CUDA: device pick, bf16, dynamic batching (random Gemma-3-270M-shaped model)", report, body)
    return 0


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(main())
