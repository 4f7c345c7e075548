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
from flowopt.benchmarks.perf.harness import Goal, PerfParser, PerfRun, markdown_table, setup_logging, start_run

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


def _phase_medians(run: dict[str, Any], phase: str) -> str:
    values = [p[phase] for p in run.get("phase_s", []) if phase in p]
    return f"{statistics.median(values):.3f}" if values else "-"


def _cell(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


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
# Which TRL run each flowopt run is compared with: the one making the same memory/compute trade.
BASELINE = {"flowopt": "trl-nockpt", "stage": "trl-nockpt", "flowopt-ckpt": "trl"}
# The goal compares the runs that do TRL's work (prompts in, sampled completions scored by a reward
# function, one update). The stage does more: it runs a DSPy program for every rollout (formatting,
# parsing, traces), which TRL cannot do; its ratio is reported beside the goal, not as part of it.
GOAL_RUNS = ("flowopt", "flowopt-ckpt")
STEPS_RATIO_GOAL = 2.0  # issue 26: >= 2x TRL's steps/s in both memory trades, at <= 1.0x its peak GPU memory


# ----------------------------------------------------------------------------- report
def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    per_run = [statistics.median(r["step_s"]) for r in runs if r["step_s"]]
    step_s = statistics.median(per_run)
    tokens = [t for r in runs for t in r["completion_tokens"]]
    peaks = [r["peak_gib"] for r in runs if r.get("peak_gib") is not None]
    out = {"median_step_s": round(step_s, 4), "steps_per_s": round(1.0 / step_s, 3),
           "mean_completion_tokens_per_step": round(statistics.mean(tokens), 1) if tokens else None,
           "peak_gpu_gib": max(peaks) if peaks else None, "runs_median_step_s": [round(x, 4) for x in per_run]}
    for phase in ("rollout", "update"):
        values = [p[phase] for r in runs for p in r.get("phase_s", []) if phase in p]
        out[f"median_{phase}_s"] = round(statistics.median(values), 4) if values else None
        phase_peaks = [r["phase_peak_gib"][phase] for r in runs if phase in r.get("phase_peak_gib", {})]
        out[f"{phase}_peak_gpu_gib"] = max(phase_peaks) if phase_peaks else None
    if any("compile_s" in r for r in runs):
        out["compile_s_per_run"] = [r.get("compile_s") for r in runs]
        out["compiled_shapes"] = [r.get("compiled_shapes") for r in runs]
        out["eager_reason"] = next((r["eager_reason"] for r in runs if r.get("eager_reason")), None)
        out["compiled_graphs_per_run"] = [r.get("compiled_graphs") for r in runs]
        out["warmup_step_s_per_run"] = [r.get("warmup_step_s") for r in runs]
    return out


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
                        statistics.median(done["step_s"]), _phase_medians(done, "rollout"),
                        _phase_medians(done, "update"), done["peak_gib"], done.get("phase_peak_gib"),
                        done.get("compile_s", "-"), time.perf_counter() - started)
    results = {impl: summarise(r) for impl, r in runs.items()}
    write(run, results, trl_version)
    return 0


def write(run: PerfRun, results: dict[str, Any], trl_version: str | None) -> None:
    import torch

    args = run.args
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    ratios = {f"{impl} vs {base}": round(results[impl]["steps_per_s"] / results[base]["steps_per_s"], 3)
              for impl, base in BASELINE.items() if impl in results and base in results}
    payload = {"device": device, "runs": results, "flowopt_vs_trl": ratios}
    model = (f"tiny Llama (hidden {args.hidden}, {args.layers} layers)" if args.model == "tiny"
             else f"Gemma 3 270M shape ({args.gemma_layers} layers, vocab 262144, random weights)")
    names = {"flowopt": "flowopt (sampler + learner, token ids)",
             "flowopt-ckpt": "flowopt, gradient checkpointing",
             "stage": "flowopt GRPO stage (DSPy program)",
             "trl": f"TRL GRPOTrainer {trl_version} (defaults: gradient checkpointing)",
             "trl-nockpt": f"TRL GRPOTrainer {trl_version}, no gradient checkpointing"}
    rows = []
    for impl, r in results.items():
        base = BASELINE.get(impl)
        ratio = ratios.get(f"{impl} vs {base}")
        rows.append([names[impl], f"{r['median_step_s']:.3f}", ", ".join(f"{x:.3f}" for x in r["runs_median_step_s"]),
                     _cell(r["median_rollout_s"], ".3f"), _cell(r["median_update_s"], ".3f"),
                     f"{r['steps_per_s']:.2f}", "-" if ratio is None else f"{ratio:.2f}x {base}",
                     r["mean_completion_tokens_per_step"] or "-", _cell(r["peak_gpu_gib"], ".2f"),
                     f"{_cell(r['rollout_peak_gpu_gib'], '.2f')} / {_cell(r['update_peak_gpu_gib'], '.2f')}",
                     ", ".join(_cell(c, ".1f") for c in r.get("compile_s_per_run", [])) or "-"])
    compiled = COMPILE[args.compile]
    decode = ("compiled on CUDA, eager on CPU (LocalLM's default)" if compiled is None
              else "compiled" if compiled else "eager")
    body = [
        f"Device: {device}; torch threads {args.threads}. Model: {model}, "
        f"{'bf16' if args.device.startswith('cuda') else 'fp32'}; LoRA r={LORA['r']} all linear; "
        f"B={args.batch} prompts x G={args.group} completions, up to {args.completion} tokens, temperature 1, "
        f"beta={args.beta} (reference = adapter disabled), loss dapo, 1 optimizer step per generation. "
        f"{args.steps} timed steps after {args.warmup} warm-up steps, {args.repeats} interleaved rounds; "
        f"median step time. flowopt's decode step: {decode}; its training forward holds at most "
        f"{args.micro_batch_tokens or 'unbounded'} padded positions.", "",
        *markdown_table(["implementation", "median step (s)", "rounds' medians (s)", "rollout (s)", "update (s)",
                         "steps/s", "vs TRL (same trade)", "completion tokens/step", "peak GPU GiB",
                         "peak GiB rollout / update", "compile s (per run)"], rows, align="lrlrrrrrrrl"),
        "", "Each flowopt run is compared with the TRL run that makes the same memory/compute trade "
        "(gradient checkpointing on or off). Rollout: flowopt's sampling call; TRL's generation phase "
        "(`_generate_and_score_completions`: sampling, rewards and its reference log-prob pass). Update: the rest "
        "of the step (flowopt's includes its reference pass). Compile seconds are the decode step's torch.compile "
        "per shape, paid once per process and shape in the warm-up steps, which are not timed; peaks cover "
        "warm-up and timed steps.",
    ]
    stage = ratios.get(f"stage vs {BASELINE['stage']}")
    if stage is not None and "flowopt" in results:
        extra = results["stage"]["median_step_s"] - results["flowopt"]["median_step_s"]
        body += [f"The whole stage, which also runs the DSPy program for each of the {args.batch * args.group} "
                 f"rollouts, is {stage:.2f}x TRL's step: {extra * 1000:+.0f} ms a step over flowopt's own step "
                 "(DSPy formatting, parsing and trace recording, and the rollout threads)."]
    # The goal (issue 26): the runs doing TRL's work at >= 2x TRL's steps/s and at most TRL's peak GPU memory;
    # the stage's ratio is reported beside it.
    goals = []
    for key, value in ratios.items():
        impl, base = key.split(" vs ")
        if impl not in GOAL_RUNS:
            continue
        goals.append(Goal.at_least(f"steps/s ratio {key}", value, STEPS_RATIO_GOAL))
        ours, theirs = results[impl]["peak_gpu_gib"], results[base]["peak_gpu_gib"]
        if ours is not None and theirs:
            goals.append(Goal.at_most(f"peak GPU memory ratio {key}", round(ours / theirs, 3), 1.0))
    run.finish(f"GRPO step throughput: flowopt vs TRL GRPOTrainer ({args.device})", payload, body, goals=goals)


if __name__ == "__main__":
    setup_logging()
    logging.getLogger("flowopt").setLevel(logging.ERROR)  # the stage's per-step logs would bury the results
    warnings.filterwarnings("ignore")
    raise SystemExit(main())
