"""One GRPO update from a batch of scored transitions: passes, micro-batches, clipping, schedule.

Each transition (one LM call of a rollout) carries its rollout's advantage. Per pass over the batch the
gradient is accumulated over micro-batches, with each sequence weighted as the whole batch's
aggregation says (:func:`~flowopt.optimizers.weights.loss.sequence_weights`), so accumulation gives
exactly the gradient of the full batch; then one clipped optimizer step. Reference scores are fixed
before the first pass.

The old policy's log-probs are the first pass's training forward, detached (as TRL does), not the
sampler's: the sampler runs without gradients, in inference mode and possibly in bf16 with a KV cache,
and its log-probs differ from the training forward's (on Gemma 3 270M in bf16 by up to 0.14), which
would rescale every token's gradient on the first pass. The first-pass ratio is therefore exactly 1;
later passes compare with it. The gap between the two is reported (``sampler_logprob_gap``).

With several processes (``world``) each rank updates on its share of the rollouts: the weights use
the whole batch's token and rollout counts, the gradients are summed across ranks before clipping, and
the reported numbers are the whole batch's. A pass whose gradient norm is NaN or infinite takes no step
(:class:`~flowopt.optimizers.weights.optim.StepGuard`; ``nonfinite_grad`` in the stats and the curve).

Memory: a micro-batch holds at most ``micro_batch_size`` sequences and ``micro_batch_tokens`` padded
positions (the training forward keeps activations for each until its backward pass). A half-precision
model's micro-batch widths are padded to :data:`~flowopt.lm.packing.WIDTH_MULTIPLE`, as SFT's, and after an
update the freed activations' pages go back to the OS (:func:`~flowopt.lm.allocator.release_freed_memory`).
A model in bf16 or fp16 whose LoRA weights are float32 (PEFT's default) is trained under ``torch.autocast``
in the model's dtype, as TRL trains it with ``bf16=True``: PEFT would otherwise keep a float32 copy of the
input of every adapted layer for the backward pass (on Gemma 3 270M about a fifth of the activations); the optimizer
still steps float32 weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from flowopt.lm.allocator import release_freed_memory
from flowopt.lm.packing import WIDTH_MULTIPLE, PackedBatch, micro_batches, pack, padded_length
from flowopt.lm.scoring import completion_logprobs
from flowopt.optimizers.weights.distributed import SINGLE, World
from flowopt.optimizers.weights.loss import aggregate, sequence_weights, token_loss
from flowopt.optimizers.weights.optim import StepGuard, count_skipped_step, make_optimizer
from flowopt.optimizers.weights.policy import Policy

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def mixed_precision(model: Any) -> Iterator[None]:
    """``torch.autocast`` in the dtype of a half-precision ``model`` whose trainable (LoRA) weights are float32,
    with PEFT's cast of each adapter's input to float32 turned off (autocast picks the dtype instead, so
    the adapter's input is the base layer's own saved tensor, not a float32 copy); otherwise nothing.

    Example:
        >>> with mixed_precision(model): loss = completion_logprobs(model, batch).sum()  # doctest: +SKIP
    """
    import torch

    if not _half_precision_with_float32_adapter(model):
        yield
        return
    from peft.helpers import disable_input_dtype_casting

    first = next((model.get_base_model() if hasattr(model, "get_base_model") else model).parameters())
    with torch.autocast(first.device.type, dtype=first.dtype), disable_input_dtype_casting(model):
        yield


def _half_precision(model: Any) -> bool:
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return next(base.parameters()).dtype in (torch.bfloat16, torch.float16)


def _half_precision_with_float32_adapter(model: Any) -> bool:
    import torch

    if not _half_precision(model):
        return False
    return any(p.requires_grad and p.dtype == torch.float32 for p in model.parameters())


@dataclass
class ScoredTransition:
    """One LM call of a rollout with its rollout's advantage. ``sampler_logprobs`` are the sampler's
    (reported against the training forward, not used by the loss); ``rollout`` names the rollout the
    call belongs to (for ``aggregation="grpo"``; -1: a rollout of its own)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    sampler_logprobs: list[float]
    advantage: float
    rollout: int = -1


@dataclass
class UpdateStats:
    loss: float = 0.0
    clip_low: float = 0.0  # fraction of tokens clipped below (negative advantage)
    clip_high: float = 0.0  # fraction clipped above (positive advantage)
    kl: float = 0.0
    grad_norm: float = 0.0
    lr: float = 0.0
    transitions: int = 0
    tokens: int = 0
    sampler_logprob_gap: float = 0.0  # mean |sampler log-prob - training-forward log-prob| per token
    skipped: bool = False  # no step: nothing to learn in the batch
    nonfinite_grad: bool = False  # a pass's gradient norm was NaN/inf: that pass's step was skipped


@dataclass
class _Micro:
    batch: PackedBatch
    sampler: Any
    advantages: Any
    weights: Any
    old: Any = None  # the first pass's log-probs, detached
    ref: Any = None


@dataclass(frozen=True)
class LearnerSettings:
    """How :class:`GRPOLearner` updates (the ``GRPO`` stage's settings of the same names document each).

    ``learning_rate``, ``weight_decay``, ``lr_schedule`` and ``warmup_steps`` set the AdamW optimizer and
    its schedule; ``epsilon`` (and ``epsilon_high``) the ratio clip; ``beta`` the KL penalty against the
    reference (``reference_adapter``; ``None``: the base model); ``aggregation`` how token losses are
    averaged (``"dapo"``, ``"grpo"``...); ``passes`` optimizer steps per batch; ``micro_batch_size``
    sequences and ``micro_batch_tokens`` padded positions (``None``: no bound) per forward pass;
    ``max_grad_norm`` the clip of the gradient norm (``None``: none);
    ``temperature`` the sampling temperature the log-probs are taken at; ``gradient_checkpointing``
    trades compute for memory in the training forward.

    Example:
        >>> LearnerSettings(beta=0.04).passes
        1
    """

    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    aggregation: str = "dapo"
    passes: int = 1
    micro_batch_size: int = 8
    micro_batch_tokens: int | None = None
    max_grad_norm: float | None = 1.0
    temperature: float = 1.0
    gradient_checkpointing: bool = False
    reference_adapter: str | None = None


class GRPOLearner:
    """Optimizer state plus :meth:`update` (one call per rollout batch). Its settings are a
    :class:`LearnerSettings`, or any of its fields by name.

    Example:
        >>> learner = GRPOLearner(policy, total_steps=10)  # doctest: +SKIP
        >>> stats = learner.update([ScoredTransition([5, 6], [7, 3], [-1.2, -0.4], 0.8)])  # doctest: +SKIP
    """

    def __init__(self, policy: Policy, settings: LearnerSettings | None = None, *, total_steps: int,
                 world: World = SINGLE, **overrides: Any) -> None:
        s = settings or LearnerSettings()
        s = dataclasses.replace(s, **overrides) if overrides else s
        self.policy = policy
        self.world = world
        self.settings = s
        self.epsilon, self.epsilon_high, self.beta = s.epsilon, s.epsilon_high, s.beta
        self.aggregation, self.passes, self.micro = s.aggregation, s.passes, s.micro_batch_size
        self.micro_tokens = s.micro_batch_tokens
        self.max_grad_norm, self.temperature = s.max_grad_norm, s.temperature
        self.gradient_checkpointing = s.gradient_checkpointing
        self.reference_adapter = s.reference_adapter  # None: the base model (adapter disabled)
        self.params = policy.trainable_parameters()
        if self.gradient_checkpointing:
            # Switching checkpointing on and off leaves attributes on the model's layers that a compiled decode
            # step's guards check; settle them before the first rollout, so a step captured then still matches
            # after every update (instead of recompiling once, for seconds to a minute on a GPU).
            with policy.lock, policy.training(gradient_checkpointing=True):
                pass
        self.optimizer, self.scheduler = make_optimizer(
            self.params, lr=s.learning_rate, weight_decay=s.weight_decay,
            total_steps=total_steps * s.passes, warmup=s.warmup_steps, schedule=s.lr_schedule)  # type: ignore[arg-type]
        self.guard = StepGuard("grpo", world=world, settings={
            "learning_rate": s.learning_rate, "max_grad_norm": s.max_grad_norm,
            "gradient_checkpointing": s.gradient_checkpointing})

    def _micro_batches(self, items: Sequence[ScoredTransition], batch_tokens: int,
                       batch_rollouts: int) -> list[_Micro]:
        import torch

        device = self.policy.device
        rollouts = self._rollout_ids(items)
        weights = sequence_weights([len(t.completion_ids) for t in items], rollouts, self.aggregation,  # type: ignore[arg-type]
                                   batch_tokens=batch_tokens, batch_rollouts=batch_rollouts)
        # Similar lengths together: less padding in every forward pass. A half-precision model pads widths to a
        # multiple (the token budget counts them padded), so shapes repeat across updates: its CPU matmuls build
        # and cache oneDNN kernels per shape (flowopt.lm.packing.WIDTH_MULTIPLE). float32 keeps exact widths:
        # its matmuls cache nothing per shape, and the seeded float32 runs keep their recorded rounding.
        multiple = WIDTH_MULTIPLE if _half_precision(self.policy.model) else 1
        lengths = [padded_length(len(t.prompt_ids) + len(t.completion_ids), multiple) for t in items]
        micros = []
        for rows in micro_batches(lengths, max_rows=self.micro, max_tokens=self.micro_tokens):
            chunk = [items[i] for i in rows]
            batch = pack([t.prompt_ids for t in chunk], [t.completion_ids for t in chunk], self.policy.pad_id,
                         pad_to_multiple_of=multiple)
            sampler = torch.zeros(batch.completion_mask.shape, dtype=torch.float32)
            for row, t in enumerate(chunk):
                sampler[row, :len(t.sampler_logprobs)] = torch.as_tensor(t.sampler_logprobs, dtype=torch.float32)
            advantages = torch.tensor([t.advantage for t in chunk], dtype=torch.float32)
            micro_weights = torch.tensor([weights[i] for i in rows], dtype=torch.float32)
            micros.append(_Micro(batch.to(device), sampler.to(device), advantages.to(device), micro_weights.to(device)))
        return micros

    @staticmethod
    def _rollout_ids(items: Sequence[ScoredTransition]) -> list[int]:
        return [t.rollout if t.rollout >= 0 else -1 - i for i, t in enumerate(items)]

    def update(self, items: Sequence[ScoredTransition]) -> UpdateStats:
        """Run ``passes`` optimizer steps on ``items`` (this rank's share); skipped (no step) when there is
        nothing to learn in the whole batch. A pass whose gradient norm is not finite takes no step
        (``nonfinite_grad``); :class:`~flowopt.errors.NonFiniteGradientError` after ``NONFINITE_LIMIT`` such updates
        in a row."""
        import torch

        world = self.world
        items = [t for t in items if t.completion_ids]
        learnable = bool(items) and (self.beta != 0.0 or any(t.advantage != 0.0 for t in items))
        n_items, n_tokens, n_rollouts, n_learnable = world.sum_floats(
            [len(items), sum(len(t.completion_ids) for t in items), len(set(self._rollout_ids(items))), learnable])
        stats = UpdateStats(transitions=int(n_items), tokens=int(n_tokens), lr=float(self.scheduler.get_last_lr()[0]))
        if not n_learnable:
            # Every advantage is 0 and there is no KL term: the loss and its gradient are exactly 0.
            stats.skipped = True
            for _ in range(self.passes):
                count_skipped_step(self.scheduler)
            return stats
        update = self.scheduler.last_epoch // self.passes + 1  # this update's number (1-based), for the warning
        policy = self.policy
        micros = self._micro_batches(items, stats.tokens, int(n_rollouts))
        total_tokens = stats.tokens
        with policy.lock:
            model = policy.model
            if self.beta != 0.0:
                with torch.no_grad(), policy.reference(self.reference_adapter):
                    for m in micros:
                        m.ref = completion_logprobs(model, m.batch, self.temperature)
            with policy.training(gradient_checkpointing=self.gradient_checkpointing), mixed_precision(model):
                for _ in range(self.passes):
                    self.optimizer.zero_grad(set_to_none=True)
                    loss_sum = clip_low = clip_high = kl_sum = 0.0
                    for m in micros:
                        mask = m.batch.completion_mask
                        logps = completion_logprobs(model, m.batch, self.temperature)
                        if m.old is None:  # the first pass: the old policy is this very forward
                            m.old = logps.detach()
                            stats.sampler_logprob_gap += float(((m.old - m.sampler).abs() * mask).sum()) / total_tokens
                        tl = token_loss(logps, m.old, m.advantages, epsilon=self.epsilon, mask=mask,
                                        epsilon_high=self.epsilon_high, beta=self.beta, ref_logps=m.ref)
                        loss = aggregate(tl.loss, mask, weights=m.weights)
                        loss.backward()
                        loss_sum += float(loss.detach())
                        clip_low += float((tl.clipped_low * mask).sum())
                        clip_high += float((tl.clipped_high * mask).sum())
                        if tl.kl is not None:
                            kl_sum += float((tl.kl * mask).sum())
                    world.sum_gradients(self.params)
                    norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm or float("inf"))
                    if not self.guard.step(norm, self.optimizer, self.scheduler):
                        stats.nonfinite_grad = True
                    loss_sum, clip_low, clip_high, kl_sum = world.sum_floats([loss_sum, clip_low, clip_high, kl_sum])
                    stats.loss, stats.grad_norm = loss_sum, float(norm)
                    stats.clip_low, stats.clip_high = clip_low / total_tokens, clip_high / total_tokens
                    stats.kl = kl_sum / total_tokens
            self.optimizer.zero_grad(set_to_none=True)
            del micros
            # The update's activations are freed, but glibc keeps their pages unless asked; rollouts decode on
            # another thread's arena (flowopt.lm.allocator).
            release_freed_memory()
            policy.weights_changed()
        stats.sampler_logprob_gap = world.sum_floats([stats.sampler_logprob_gap])[0]
        self.guard.record(not stats.nonfinite_grad, f"update {update}")
        return stats

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
