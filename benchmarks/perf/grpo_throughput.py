"""GRPO step throughput: flowopt against TRL's GRPOTrainer on the same model, batch, group size and lengths.

Three implementations do the same work per step: B prompts x G sampled completions (temperature 1, up to
``--completion`` tokens, stop at EOS), one reward per completion (first word equals the target), group
advantages, one optimizer step of the clipped surrogate with the k3 KL to the adapter-disabled model
(``--beta``), LoRA r=16 on all linear layers, AdamW, ``loss_type="dapo"``:

- ``flowopt``: flowopt's sampler and GRPO learner on token ids (the same inputs TRL gets);
- ``stage``:   the whole flowopt GRPO stage: a DSPy program (``dspy.Predict`` with the completion adapter)
               run B x G times through DSPy, every LM call recorded as a transition, then the same update;
- ``trl``:     ``trl.GRPOTrainer`` (TRL is a development dependency of this script only).

Each implementation starts from the same randomly initialised weights; warm-up steps are not timed;
implementations are interleaved over ``--repeats`` rounds and the median is reported.

Run (CPU):  python -m flowopt.benchmarks.perf.grpo_throughput
Run (GPU):  python -m flowopt.benchmarks.perf.grpo_throughput --model gemma-shaped --device cuda --batch 8 --group 8 \
                --completion 64 --out benchmarks/results/grpo_throughput_gpu
Writes benchmarks/results/grpo_throughput.{json,md} (``--out STEM``). Goal (issue 26): flowopt's steps/s >= 2x
TRL's in both memory trades (gradient checkpointing off and on), at <= 1.0x TRL's peak GPU memory. Each run
records its step split into rollout and update, each phase's peak GPU memory, and (flowopt) the decode
step's compile seconds; flowopt's rollouts use LocalLM's default runtime (``--compile auto``: compiled on CUDA).
The task is :mod:`flowopt.benchmarks.cue_word`. It needs flowopt installed with its dependencies (DSPy
included, on a GPU machine too), and TRL (``pip install -e ".[bench]"``) for the ``trl`` runs.
"""

from __future__ import annotations

import argparse
import copy
import functools
import logging
import random
import statistics
import tempfile
import time
import warnings
from typing import Any

from flowopt.benchmarks import cue_word
from flowopt.benchmarks.perf.grpo_throughput_report import phase_median_text, summarise, write
from flowopt.benchmarks.perf.harness import PerfParser, setup_logging, start_run

logger = logging.getLogger(__name__)
SMOKE = {"batch": 2, "group": 2, "completion": 4, "steps": 1, "warmup": 1, "repeats": 1,
         "impls": "flowopt,stage,trl-nockpt"}
# The prompt's labels, so the prompt is whole words for the word-level tokenizer.
LABELS = ["Noise:", "Cue:", "Word:", "---", "Answer."]
LORA = {"r": 16, "alpha": 32}
LEARNING_RATE = 1e-5
COMPILE = {"auto": None, "on": True, "off": False}
# flowopt's training forward holds at most this many padded positions (64 rows of ~73 tokens: 3 micro-batches):
# its activations (~36 KiB a token and layer for the Gemma shape in bf16, counted on CPU) then stay well under
# TRL's, which scores all B x G rows in one forward.
DEFAULT_MICRO_BATCH_TOKENS = 2048


# ----------------------------------------------------------------------------- shared setup
def build_model(args: argparse.Namespace) -> tuple[Any, Any]:
    """Fresh weights, identical for every call (seeded)."""
    import torch

    from flowopt.optimizers.weights.tiny import tiny_causal_lm

    words = [*cue_word.COLORS, *cue_word.ANIMALS, *cue_word.NOISE, *LABELS]
    if args.model == "tiny":
        model, tokenizer = tiny_causal_lm(words, hidden_size=args.hidden, layers=args.layers, seed=0)
    else:  # Gemma 3 270M's shape with random weights: the real work of a 270M step, no download
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        tokenizer = copy.deepcopy(_gemma_shaped_tokenizer(tuple(words)))  # each run may change its own
        config = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=640, intermediate_size=2048,
                                  num_hidden_layers=args.gemma_layers, num_attention_heads=4, num_key_value_heads=1,
                                  head_dim=256,
                                  max_position_embeddings=32768, sliding_window=512,
                                  pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id)
        torch.manual_seed(0)
        with torch.device(args.device):
            model = Gemma3ForCausalLM(config)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = model.to(device=args.device, dtype=dtype).eval()
    tokenizer.padding_side = "left"
    return model, tokenizer


@functools.cache
def _gemma_shaped_tokenizer(words: tuple[str, ...]) -> Any:
    """A word-level tokenizer of Gemma 3's vocabulary size (262,144), built once per process (seconds)."""
    from flowopt.optimizers.weights.tiny import word_tokenizer

    vocab = 262144
    filler = [f"w{i}" for i in range(vocab)]
    return word_tokenizer([*words, *filler[: vocab - len(words) - 20]])


def examples(n: int) -> list[dict[str, str]]:
    """``n`` cue -> word examples (seed 0) as plain dicts, the form TRL's dataset takes."""
    return [{"noise": ex.noise, "cue": ex.cue, "target": ex.word} for ex in cue_word.make_examples(n, seed=0)]


def prompt_text(example: dict[str, str]) -> str:
    """The prompt exactly as the completion adapter writes it for the DSPy program of the ``stage`` run
    (checked against the adapter at the start of every run)."""
    return f"Answer.\n\n---\n\nNoise: {example['noise']}\nCue: {example['cue']}\nWord:"


def check_prompt_text() -> None:
    import dspy

    from flowopt.lm import CompletionAdapter

    example = examples(1)[0]
    signature = dspy.Signature("noise, cue -> word", "Answer.")
    written = CompletionAdapter().format(signature, [], {"noise": example["noise"], "cue": example["cue"]})
    if written[0]["content"] != prompt_text(example):
        raise RuntimeError(f"the completion adapter's prompt changed: {written[0]['content']!r}; update prompt_text")


def reward(completion: str, target: str) -> float:
    return float(cue_word.first_word(completion) == target)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _peak_reset(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device: str) -> float | None:
    if device.startswith("cuda"):
        import torch

        return round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return None


# ----------------------------------------------------------------------------- flowopt, token level
class PhaseClock:
    """Seconds and peak device memory of each phase of a step (``rollout``, ``update``), synchronised on CUDA.

    A step's peak is the largest of its phases' peaks (the peak counter is reset as each phase starts), so
    the peaks say which phase holds the most memory.
    """

    def __init__(self, device: str) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}
        self.peaks: dict[str, float] = {}
        self.started = 0.0

    def start(self) -> None:
        _sync(self.device)
        _peak_reset(self.device)
        self.started = time.perf_counter()

    def stop(self, phase: str) -> None:
        _sync(self.device)
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - self.started
        peak = _peak_gib(self.device)
        if peak is not None:
            self.peaks[phase] = max(self.peaks.get(phase, 0.0), peak)

    def take(self) -> dict[str, float]:
        seconds, self.seconds = self.seconds, {}
        return seconds


def run_flowopt(args: argparse.Namespace, checkpointing: bool = False) -> dict[str, Any]:
    import torch

    from flowopt.lm.local import LocalLM
    from flowopt.lm.sampling import RowSettings
    from flowopt.optimizers.weights.advantages import group_advantages
    from flowopt.optimizers.weights.learner import GRPOLearner, ScoredTransition
    from flowopt.optimizers.weights.policy import LoraSettings, Policy

    model, tokenizer = build_model(args)
    # The runtime as a user gets it: compile=None compiles the decode step on CUDA, not on CPU.
    local = LocalLM.from_model(model, tokenizer, name="bench", compile=COMPILE[args.compile])
    policy = Policy(local, lora=LoraSettings(**LORA))
    policy.start_adapter("bench", seed=0)
    total = args.warmup + args.steps
    learner = GRPOLearner(policy, total_steps=total, learning_rate=LEARNING_RATE, beta=args.beta, aggregation="dapo",
                          micro_batch_size=args.batch * args.group, micro_batch_tokens=args.micro_batch_tokens or None,
                          temperature=1.0, gradient_checkpointing=checkpointing)
    data = examples(args.batch * total)
    gen = torch.Generator(device=policy.device).manual_seed(0)
    times, tokens, phases, warmup = [], [], [], []
    graphs = _compiled_graphs()
    clock = PhaseClock(args.device)
    for step in range(total):
        clock.start()
        batch = data[step * args.batch:(step + 1) * args.batch]
        prompts = [policy.render([{"role": "user", "content": prompt_text(ex)}]) for ex in batch]
        rows = [p for p in prompts for _ in range(args.group)]
        settings = [RowSettings(max_new_tokens=args.completion, temperature=1.0, logprobs=True)] * len(rows)
        out = local.sample_ids(rows, settings, adapter=policy.adapter, generator=gen)
        clock.stop("rollout")
        clock.start()
        rewards = torch.tensor([reward(policy.decode(o.completion_ids), batch[i // args.group]["target"])
                                for i, o in enumerate(out)])
        advantages = group_advantages(rewards.view(args.batch, args.group)).flatten().tolist()
        learner.update([ScoredTransition(rows[i], o.completion_ids, o.logprobs.tolist(), advantages[i])
                        for i, o in enumerate(out)])
        clock.stop("update")
        seconds = clock.take()
        if step >= args.warmup:
            times.append(sum(seconds.values()))
            phases.append(seconds)
            tokens.append(sum(len(o.completion_ids) for o in out))
        else:
            warmup.append(round(sum(seconds.values()), 3))
    stats = local.decode_stats.summary()
    local.close()
    return {"step_s": times, "phase_s": phases, "completion_tokens": tokens, "peak_gib": _max_peak(clock.peaks),
            "phase_peak_gib": clock.peaks, "compile_s": round(sum(stats["compile_seconds"].values()), 2),
            "compiled_shapes": stats["compile_seconds"], "eager_reason": stats["eager_reason"],
            # every graph torch.compile made in this run (recompiles too), and the untimed steps that paid for them
            "compiled_graphs": _compiled_graphs() - graphs, "warmup_step_s": warmup}


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _max_peak(peaks: dict[str, float]) -> float | None:
    return max(peaks.values()) if peaks else None


# ----------------------------------------------------------------------------- flowopt, whole stage
def run_stage(args: argparse.Namespace) -> dict[str, Any]:
    import dspy

    from flowopt.compiler.budget import BudgetTracker
    from flowopt.compiler.context import StageContext
    from flowopt.lm import CompletionAdapter
    from flowopt.lm.local import LocalLM
    from flowopt.optimizers.weights import GRPO, LoraSettings

    model, tokenizer = build_model(args)
    local = LocalLM.from_model(model, tokenizer, name="bench", max_new_tokens=args.completion,
                               compile=COMPILE[args.compile])
    program = dspy.Predict(dspy.Signature("noise, cue -> word", "Answer."))
    program.lm = local.lm
    trainset = cue_word.make_examples(64, seed=0)

    ctx = StageContext(trainset=trainset, valset=[], metric=cue_word.metric, budget=BudgetTracker(), seed=0,
                       rng=random.Random(0), run_dir=None, stage_name="grpo")
    stage = GRPO(steps=args.warmup + args.steps, batch_size=args.batch, group_size=args.group,
                 max_new_tokens=args.completion, learning_rate=LEARNING_RATE, beta=args.beta, aggregation="dapo",
                 micro_batch_size=args.batch * args.group, micro_batch_tokens=args.micro_batch_tokens or None,
                 lora=LoraSettings(**LORA), plot=False,
                 checkpoint_every=0, adapter=CompletionAdapter(continue_missing=False))
    _sync(args.device)
    _peak_reset(args.device)
    stage.run(program, ctx)
    curve = ctx.info["reward_curve"][args.warmup:]
    local.close()
    return {"step_s": [p["step_s"] for p in curve], "completion_tokens": [p["completion_tokens"] for p in curve],
            "peak_gib": _peak_gib(args.device)}


# ----------------------------------------------------------------------------- TRL
def run_trl(args: argparse.Namespace, checkpointing: bool = True) -> dict[str, Any]:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model, tokenizer = build_model(args)
    total = args.warmup + args.steps
    data = examples(args.batch * total)
    dataset = Dataset.from_list([{"prompt": prompt_text(ex), "target": ex["target"]} for ex in data])

    def reward_fn(completions: list[str], target: list[str], **_: Any) -> list[float | None]:
        return [reward(c, t) for c, t in zip(completions, target)]

    times: list[float] = []
    tokens: list[float] = []
    phases: list[dict[str, float]] = []
    clock = PhaseClock(args.device)

    warmup, rows = args.warmup, args.batch * args.group

    class Timer(TrainerCallback):
        """A step's time, split at the end of TRL's generation phase (timed by ``timed_generation``)."""

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            clock.start()

        def on_step_end(self, args: Any, state: Any, control: Any, **k: Any) -> None:
            clock.stop("update")
            seconds = clock.take()
            if state.global_step > warmup:
                times.append(sum(seconds.values()))
                phases.append(seconds)

        def on_log(self, args: Any, state: Any, control: Any, **k: Any) -> None:
            logs = k.get("logs")
            if logs and "completions/mean_length" in logs and state.global_step > warmup:
                tokens.append(logs["completions/mean_length"] * rows)

    cuda = args.device.startswith("cuda")
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"), per_device_train_batch_size=args.batch * args.group,
        gradient_accumulation_steps=1, num_generations=args.group, max_completion_length=args.completion,
        max_steps=total, learning_rate=LEARNING_RATE, lr_scheduler_type="constant", beta=args.beta,
        loss_type="dapo", scale_rewards="group", temperature=1.0, num_iterations=1, logging_steps=1,
        save_strategy="no", report_to="none", use_cpu=not cuda, bf16=cuda, seed=0, shuffle_dataset=False,
        disable_tqdm=True, dataloader_num_workers=0, gradient_checkpointing=checkpointing)
    peft_config = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0, target_modules="all-linear",
                             task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft_config, callbacks=[Timer()])
    generate = trainer._generate_and_score_completions

    def timed_generation(*a: Any, **k: Any) -> Any:
        # TRL's generation phase: sampling, rewards, and its reference (and old-policy) log-prob passes.
        out = generate(*a, **k)
        clock.stop("rollout")
        clock.start()
        return out

    trainer._generate_and_score_completions = timed_generation  # type: ignore[method-assign]
    trainer.train()
    return {"step_s": times, "phase_s": phases, "completion_tokens": tokens, "peak_gib": _max_peak(clock.peaks),
            "phase_peak_gib": clock.peaks}


RUNNERS = {
    "flowopt": run_flowopt,
    "flowopt-ckpt": lambda args: run_flowopt(args, checkpointing=True),
    "stage": run_stage,
    "trl": run_trl,  # TRL's defaults, gradient checkpointing on
    "trl-nockpt": lambda args: run_trl(args, checkpointing=False),
}
def main(argv: list[str] | None = None) -> int:
    parser = PerfParser("grpo_throughput", __doc__, smoke=SMOKE)
    parser.add_argument("--model", choices=["tiny", "gemma-shaped"], default="tiny")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--gemma-layers", type=int, default=18, help="layers of the gemma-shaped model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (both sides)")
    parser.add_argument("--batch", type=int, default=4, help="prompts per step (B)")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--completion", type=int, default=16, help="max completion tokens")
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--compile", choices=sorted(COMPILE), default="auto",
                        help="flowopt's decode step: auto = LocalLM's default (compiled on CUDA, eager on CPU)")
    parser.add_argument("--micro-batch-tokens", type=int, default=DEFAULT_MICRO_BATCH_TOKENS,
                        help="flowopt's padded positions per training forward (0: no bound; rows: B x G)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--impls", default="flowopt,flowopt-ckpt,stage,trl,trl-nockpt")
    run = start_run(parser, argv)
    args = run.args
    impls = [i for i in args.impls.split(",") if i]
    unknown = [i for i in impls if i not in RUNNERS]
    if unknown:
        parser.error(f"--impls names unknown implementations {unknown}; choose from {sorted(RUNNERS)}")

    import torch

    torch.set_num_threads(args.threads)
    check_prompt_text()
    trl_version = None
    if any(i.startswith("trl") for i in impls):
        try:
            import trl
        except ImportError:
            parser.error("TRL is not installed (pip install -e \".[bench]\"), or leave the trl runs out of --impls")
        trl_version = trl.__version__
    runs: dict[str, list[dict[str, Any]]] = {i: [] for i in impls}
    for repeat in range(args.repeats):  # interleaved rounds
        for impl in impls:
            started = time.perf_counter()
            runs[impl].append(RUNNERS[impl](args))
            done = runs[impl][-1]
            # Each run's figures in the log as it ends: a run cut short by a time limit still tells them.
            logger.info("round %d/%d %s: median step %.3fs (rollout %s s, update %s s), peak GPU %s GiB "
                        "(rollout / update %s), compile %s s (%.0fs total)", repeat + 1, args.repeats, impl,
                        statistics.median(done["step_s"]), phase_median_text(done, "rollout"),
                        phase_median_text(done, "update"), done["peak_gib"], done.get("phase_peak_gib"),
                        done.get("compile_s", "-"), time.perf_counter() - started)
    results = {impl: summarise(r) for impl, r in runs.items()}
    write(run, results, trl_version, lora_rank=LORA["r"], compiled=COMPILE[args.compile])
    return 0


if __name__ == "__main__":
    setup_logging()
    logging.getLogger("flowopt").setLevel(logging.ERROR)  # the stage's per-step logs would bury the results
    warnings.filterwarnings("ignore")
    raise SystemExit(main())
