"""BootstrapFinetune: LoRA supervised fine-tuning of the student on the teacher's passing traces or gold labels.

The teacher (default: the program as it is, e.g. after demo and instruction search on a large hosted
LM) runs on the trainset; every predictor call of a run that passes the metric becomes a
(prompt, completion) pair (:mod:`.traces`); one LoRA adapter for all predictors is trained on the
student with the loss on completion tokens only; the adapter is saved under the stage's run folder
and every predictor of the returned program uses the student with it. With ``labels="only"`` the gold
labels are the teacher (:func:`.traces.label_pairs`); ``labels="mix"`` adds them to the passing traces.
Launched on N processes (``accelerate launch``), the teacher runs and every step's batch are split
across them and the gradients summed (:mod:`.distributed`).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import dspy

from flowopt.compiler import Stage, StageContext
from flowopt.errors import BudgetExhausted, ConfigError
from flowopt.lm.allocator import release_freed_memory
from flowopt.lm.packing import WIDTH_MULTIPLE, micro_batches, pack, padded_length
from flowopt.lm.scoring import completion_logprobs
from flowopt.optimizers.weights.common import adapter_name, finish, resolve_policy, rollout_adapter
from flowopt.optimizers.weights.distributed import SINGLE, World, agree_on_budget, current_world
from flowopt.optimizers.weights.memory import out_of_memory_errors
from flowopt.optimizers.weights.optim import SCHEDULES, StepGuard, make_optimizer
from flowopt.optimizers.weights.policy import LoraSettings, Policy
from flowopt.optimizers.weights.traces import TraceStats, label_pairs, teacher_pairs
from flowopt.settings import above, at_least, check_stage, one_of

logger = logging.getLogger(__name__)

#: Padded positions per training micro-batch: about 1.1 GB of activations on Gemma 3 270M (bf16 base, float32
#: LoRA); unbounded, the README's finetune peaked at 10 GB of RSS (benchmarks/results/main_command.md).
DEFAULT_MICRO_BATCH_TOKENS = 768


def sft_train(policy: Policy, pairs: Sequence[tuple[list[int], list[int]]], *, epochs: int = 3,
              learning_rate: float = 2e-4, batch_size: int = 8, micro_batch_size: int = 8,
              micro_batch_tokens: int | None = DEFAULT_MICRO_BATCH_TOKENS, lr_schedule: str = "linear",
              warmup_steps: int = 0, weight_decay: float = 0.0,
              max_grad_norm: float | None = 1.0, seed: int = 0, gradient_checkpointing: bool = False,
              world: World = SINGLE, on_step: Callable[[float], None] | None = None) -> list[float]:
    """Train the policy's active adapter on ``(prompt_ids, completion_ids)`` pairs; returns the loss per step.

    ``on_step(loss)`` is called after every optimizer step (the stage's progress bar).

    The loss is the mean negative log-likelihood over the batch's completion tokens (prompt and padding
    tokens masked out); micro-batches accumulate into one optimizer step per ``batch_size`` pairs.
    A step's pairs are sorted by length into micro-batches of at most ``micro_batch_size`` rows and
    ``micro_batch_tokens`` padded positions (:func:`~flowopt.lm.packing.micro_batches`; ``None``: no
    token bound): the forward keeps activations for every padded position until the backward pass
    (about 1.5 MB each on Gemma 3 270M in bf16 with a float32 LoRA), so the budget bounds a step's
    memory, and sorting wastes little compute on padding. The gradient is the whole batch's either way.
    Each micro-batch's width is padded to a multiple of :data:`WIDTH_MULTIPLE`, so its shapes repeat
    across steps (on CPU, oneDNN builds and caches matmul kernels per shape), and after every step the
    freed activations' pages go back to the OS (:func:`~flowopt.lm.allocator.release_freed_memory`).
    With several processes (``world``) every rank holds all pairs and draws the same order; each takes
    its share of every batch, divides by the whole batch's token count, and the gradients are summed.
    """
    import torch

    steps_per_epoch = (len(pairs) + batch_size - 1) // batch_size
    optimizer, scheduler = make_optimizer(policy.trainable_parameters(), lr=learning_rate, weight_decay=weight_decay,
                                          total_steps=epochs * steps_per_epoch, warmup=warmup_steps,
                                          schedule=lr_schedule)  # type: ignore[arg-type]
    rng = random.Random(seed)
    losses: list[float] = []
    guard = StepGuard("finetune", world=world, settings={  # a NaN/inf gradient norm: no step, the weights kept
        "learning_rate": learning_rate, "max_grad_norm": max_grad_norm,
        "gradient_checkpointing": gradient_checkpointing})
    model = policy.model
    with policy.lock, policy.training(gradient_checkpointing=gradient_checkpointing):
        try:
            for _ in range(epochs):
                order = list(range(len(pairs)))
                rng.shuffle(order)
                for start in range(0, len(order), batch_size):
                    batch = [pairs[i] for i in order[start:start + batch_size]]
                    total_tokens = sum(len(c) for _, c in batch)
                    mine = [batch[i] for i in world.share(len(batch))]
                    optimizer.zero_grad(set_to_none=True)
                    step_loss = 0.0
                    lengths = [padded_length(len(p) + len(c), WIDTH_MULTIPLE) for p, c in mine]
                    for rows in micro_batches(lengths, max_rows=micro_batch_size, max_tokens=micro_batch_tokens):
                        micro = [mine[i] for i in rows]
                        packed = pack([p for p, _ in micro], [c for _, c in micro], policy.pad_id,
                                      pad_to_multiple_of=WIDTH_MULTIPLE).to(policy.device)
                        logps = completion_logprobs(model, packed)
                        loss = -(logps * packed.completion_mask).sum() / total_tokens
                        loss.backward()
                        step_loss += float(loss.detach())
                    world.sum_gradients(policy.trainable_parameters())
                    step_loss = world.sum_floats([step_loss])[0]
                    norm = torch.nn.utils.clip_grad_norm_(policy.trainable_parameters(), max_grad_norm or float("inf"))
                    guard.record(guard.step(norm, optimizer, scheduler), f"step {len(losses) + 1}")
                    # The step's activations are freed, but glibc keeps their pages resident unless asked
                    # (flowopt.lm.allocator); the next step faults in what it needs, a small cost.
                    release_freed_memory()
                    losses.append(step_loss)
                    if on_step is not None:
                        on_step(step_loss)
        finally:
            optimizer.zero_grad(set_to_none=True)
            release_freed_memory()  # what a failed step allocated, too: scoring runs on another thread's arena
        policy.weights_changed()
    return losses


def token_pairs(policy: Policy, pairs: Sequence[Any], max_length: int) -> list[tuple[list[int], list[int]]]:
    """``(prompt_ids, completion_ids)`` of each :class:`~.traces.TracePair` as the student sees it, leaving out
    the pairs longer than ``max_length`` tokens in all (what :func:`sft_train` learns from)."""
    data = []
    for pair in pairs:
        prompt, completion = policy.render(pair.messages), policy.completion_ids(pair.completion)
        if len(prompt) + len(completion) <= max_length:
            data.append((prompt, completion))
    return data


@dataclass(frozen=True)
class BootstrapFinetune(Stage):
    """Distil the program into a LoRA on the student ``LocalLM`` from the teacher's passing traces.

    ``teacher``: ``None`` (the program as it is), a ``dspy.LM`` (the program on that LM) or a
    ``dspy.Module``. ``student``: ``None`` (the local model the program runs on, else the embedded
    Gemma 3 270M), a model name or folder, a ``LocalLM`` or its ``dspy.LM``. A run passes when
    ``metric >= metric_threshold`` (truthy when ``None``). ``labels``: ``None`` (teacher traces only),
    ``"only"`` (the gold labels are the teacher: answers, and a gold rationale such as GSM8K's
    ``solution`` for a ``reasoning`` field; no teacher call is made) or ``"mix"`` (labels and passing
    teacher traces together). ``exclude_demos`` (DSPy's option): train on prompts without the predictors'
    demos and return the program without them (the teacher still runs with its demos); a small student
    can learn the task from the weights better than from demos it must read at every call.

    Settings:
        student, teacher, labels, exclude_demos: above.
        epochs: passes over the training pairs.
        learning_rate, weight_decay: AdamW's.
        batch_size: pairs per optimizer step.
        micro_batch_size: pairs per forward pass (gradients accumulate over them).
        micro_batch_tokens: padded positions per forward pass (``None``: no bound); the step's memory.
        lr_schedule: ``"constant"``, ``"linear"`` or ``"cosine"`` decay over the steps.
        warmup_steps: steps of linear warm-up before the schedule.
        max_grad_norm: the gradient-norm clip (``None``: none).
        gradient_checkpointing: recompute activations in the backward pass (less memory, more compute).
        metric_threshold: the score a teacher trace must reach to be learned from (``None``: truthy).
        max_length: pairs longer than this many tokens (prompt and completion) are left out.
        lora: the adapter's shape (:class:`~flowopt.optimizers.weights.policy.LoraSettings`).
        adapter: the DSPy adapter prompts are rendered with (``None``: the configured one, else the
            student's own choice).

    Example:
        >>> import flowopt
        >>> from flowopt.optimizers.weights import BootstrapFinetune
        >>> stage = BootstrapFinetune(teacher=dspy.LM("openai/gpt-4o-mini"), epochs=3)
        >>> compiled = flowopt.compile(program, trainset, metric, stages=[stage])  # doctest: +SKIP
        >>> from_labels = BootstrapFinetune(labels="only", epochs=2)  # offline: no teacher needed
    """

    name: ClassVar[str] = "finetune"
    multi_process: ClassVar[bool] = True
    memory_settings: ClassVar[tuple[str, ...]] = ("micro_batch_size", "micro_batch_tokens", "gradient_checkpointing")

    student: Any = None
    teacher: Any = None
    epochs: int = 3
    learning_rate: float = 2e-4
    batch_size: int = 8
    micro_batch_size: int = 8
    micro_batch_tokens: int | None = DEFAULT_MICRO_BATCH_TOKENS
    lr_schedule: str = "linear"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    gradient_checkpointing: bool = False
    metric_threshold: float | None = None
    max_length: int = 2048
    lora: LoraSettings = field(default_factory=LoraSettings)
    adapter: Any = None
    labels: str | None = None
    exclude_demos: bool = False

    def __post_init__(self) -> None:
        check_stage(self, {
            "epochs": at_least(1), "learning_rate": above(0.0, 1.0), "batch_size": at_least(1),
            "micro_batch_size": at_least(1), "micro_batch_tokens": at_least(1), "lr_schedule": one_of(*SCHEDULES),
            "warmup_steps": at_least(0),
            "weight_decay": at_least(0.0), "max_grad_norm": above(0.0), "max_length": at_least(1),
            "labels": one_of("only", "mix"),
        })
        if self.teacher is not None and not isinstance(self.teacher, dspy.BaseLM | dspy.Module):
            raise ConfigError(f"teacher must be a dspy.LM or a dspy.Module, got {type(self.teacher).__name__}",
                              fix="pass teacher=dspy.LM('openai/gpt-4o-mini') or leave it None")

    def _teacher(self, program: dspy.Module) -> dspy.Module:
        if self.teacher is None:
            return program
        if isinstance(self.teacher, dspy.Module):
            return self.teacher
        from flowopt.optimizers.weights.rollout import with_lm

        return with_lm(program, self.teacher)

    def run(self, program: dspy.Module, ctx: StageContext) -> dspy.Module:
        if not ctx.trainset:
            raise ConfigError("BootstrapFinetune needs training examples, the trainset is empty",
                              fix="pass a non-empty trainset")
        world = current_world()
        world.check_divisible(self.batch_size, "BootstrapFinetune batch_size",
                              fix=f"pass a batch_size that is a multiple of the {world.size} processes")
        policy, _ = resolve_policy(self.student, program, self.lora)
        adapter = rollout_adapter(self.adapter, policy)
        started = time.monotonic()
        try:
            pairs = label_pairs(program, ctx.trainset, adapter, exclude_demos=self.exclude_demos) if self.labels else []
            n_labels = len(pairs)
            stats = TraceStats()
            if self.labels != "only":
                traced, stats = self._traces(program, ctx, adapter, world)
                pairs += traced
        except BudgetExhausted as err:
            ctx.record(stop_reason=f"budget: {err.limit}")
            return program
        trace_seconds = time.monotonic() - started
        data = token_pairs(policy, pairs, self.max_length)
        info: dict[str, Any] = {"label_pairs": n_labels, "teacher_runs": stats.runs, "teacher_passed": stats.passed,
                                "teacher_failed": stats.failed_runs, "pairs": len(data),
                                "pairs_too_long": len(pairs) - len(data)}
        if not data:
            ctx.record(stop_reason="no teacher trace passed the metric", **info)
            ctx.logger.warning("finetune: no teacher trace passed the metric; the program is unchanged")
            return program
        policy.start_adapter(adapter_name(self.name, ctx), seed=ctx.seed)
        t0 = time.monotonic()
        steps = self.epochs * ((len(data) + self.batch_size - 1) // self.batch_size)
        progress = ctx.progress(total=steps, desc="finetune") if hasattr(ctx, "progress") else None

        def on_step(loss: float) -> None:
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{loss:.4f}")

        try:
            with self._out_of_memory():
                losses = sft_train(policy, data, epochs=self.epochs, learning_rate=self.learning_rate,
                                   batch_size=self.batch_size, micro_batch_size=self.micro_batch_size,
                                   micro_batch_tokens=self.micro_batch_tokens,
                                   lr_schedule=self.lr_schedule, warmup_steps=self.warmup_steps,
                                   weight_decay=self.weight_decay, max_grad_norm=self.max_grad_norm, seed=ctx.seed,
                                   gradient_checkpointing=self.gradient_checkpointing, world=world,
                                   on_step=on_step)
        finally:
            if progress is not None:
                progress.close()
        ctx.logger.info("finetune: %d pairs, %d steps, loss %.4f -> %.4f", len(data), len(losses), losses[0],
                        losses[-1])
        if self.exclude_demos:
            for _, predictor in program.named_predictors():
                predictor.demos = []
        program, saved = finish(program, policy, ctx, self.name, world)
        info.update(saved, stop_reason="done", loss_curve=[round(x, 5) for x in losses],
                    trace_seconds=round(trace_seconds, 2), train_seconds=round(time.monotonic() - t0, 2))
        ctx.record(**info)
        return program

    def _out_of_memory(self) -> AbstractContextManager[None]:
        return out_of_memory_errors(
            "finetune",
            {"micro_batch_size": self.micro_batch_size, "micro_batch_tokens": self.micro_batch_tokens,
             "gradient_checkpointing": self.gradient_checkpointing},
            {"batch_size": self.batch_size, "max_length": self.max_length},
            resume_note="the stages before it are kept in the run folder; a resumed run trains finetune again")

    def _traces(self, program: dspy.Module, ctx: Any, adapter: Any, world: World) -> tuple[list[Any], TraceStats]:
        """The teacher's passing pairs; with several processes each runs a contiguous share of the trainset
        and the pairs are gathered in rank order (the order one process would produce)."""
        examples = [ctx.trainset[i] for i in world.share(len(ctx.trainset))]
        error: BudgetExhausted | None = None
        traced: list[Any] = []
        stats = TraceStats()
        try:
            with ctx.budget.guard():
                traced, stats = teacher_pairs(self._teacher(program), examples, ctx.metric, adapter,
                                              metric_threshold=self.metric_threshold,
                                              num_threads=getattr(ctx, "num_threads", 8),
                                              exclude_demos=self.exclude_demos)
        except BudgetExhausted as err:
            error = err
        agree_on_budget(world, error)
        if not world.distributed:
            return traced, stats
        shares = world.gather_objects((traced, stats))
        total = TraceStats()
        for _, part in shares:
            total.runs, total.passed = total.runs + part.runs, total.passed + part.passed
            total.failed_runs, total.pairs = total.failed_runs + part.failed_runs, total.pairs + part.pairs
        return [pair for share, _ in shares for pair in share], total
