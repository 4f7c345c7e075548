"""The GRPO stage: reinforcement learning of the student's LoRA on whole-program rollouts.

Per step: draw ``batch_size`` training examples, run the program ``group_size`` times on each at
``temperature`` (every LM call recorded as a transition), reward each rollout, turn the rewards into
group-relative advantages, give each rollout's advantage to every one of its transitions, and make
``passes`` clipped-surrogate updates. Intermediate rewards (``tool_rewards``, and ``node_rewards`` with
``node_reward_credit="transition"``) are added, times ``intermediate_weight``, to the advantage of the
one transition that earned each (:func:`~.rewards.transition_rewards`). Checkpoints (adapter,
optimizer, reward curve) go to the stage's run folder every ``checkpoint_every`` steps; ``resume=True``
continues from the last one. With
``rollout_server`` the rollouts are sampled by an inference server instead, the adapter pushed to it
before every step (:mod:`flowopt.optimizers.weights.served`).

Launched on N processes (``accelerate launch``), every rank draws the same examples, samples its
contiguous share of the ``batch_size x group_size`` rollouts, and the rewards are gathered so each
group's advantages use all of its members; the update sums the gradients across ranks and rank 0
writes the checkpoints and the adapter (:mod:`.distributed`).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import dspy

from flowopt.compiler import Stage, StageContext
from flowopt.errors import BudgetExhausted, ConfigError
from flowopt.optimizers.weights.advantages import SCALINGS, Scaling, group_advantages
from flowopt.optimizers.weights.agent_rollouts import Agent, AgentRollouts
from flowopt.optimizers.weights.common import adapter_name, finish, resolve_policy, rollout_adapter, torch_generator
from flowopt.optimizers.weights.distributed import World, agree_on_budget, current_world
from flowopt.optimizers.weights.learner import GRPOLearner, ScoredTransition
from flowopt.optimizers.weights.loss import AGGREGATIONS
from flowopt.optimizers.weights.memory import out_of_memory_errors
from flowopt.optimizers.weights.optim import SCHEDULES
from flowopt.optimizers.weights.policy import LoraSettings, Policy
from flowopt.optimizers.weights.rewards import CREDITS, NodeReward, score_rollout, transition_rewards
from flowopt.optimizers.weights.rollout import Rollout, run_rollouts
from flowopt.optimizers.weights.served import InferenceServer, ServedRollouts
from flowopt.settings import above, at_least, check_stage, one_of
from flowopt.tools import TOOL_STATUSES

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GRPO(Stage):
    """GRPO on the student ``LocalLM`` (LoRA), with transition-level credit over whole programs.

    ``student=None`` trains the local model the program already runs on (continuing an earlier
    weights stage's adapter), else the embedded Gemma 3 270M. ``scaling``: advantage divisor
    ("group", "batch" or "none"); ``aggregation``: "grpo" (mean over each rollout's tokens, all its LM
    calls together, then over rollouts: every rollout weighs the same) or "dapo" (token mean);
    ``beta`` > 0 adds the k3 KL to the reference: the adapter the program already ran with (e.g. from
    BootstrapFinetune), else the base model (adapter disabled). ``gradient_checkpointing`` trades about a
    third more compute for much less activation memory (TRL's default; off here). ``rollout_server``
    (an :class:`~flowopt.optimizers.weights.served.InferenceServer`): sample rollouts on vLLM or
    ``flowopt serve`` with the adapter pushed there each step; the update stays here.
    ``tool_rewards`` (``{"ok": 0.1, "error": -0.1}``: a reward per tool call by its status) and
    ``node_reward_credit="transition"`` (each node reward to the LM call that earned it, not into the
    rollout's reward) make intermediate rewards: a transition's advantage is its rollout's plus
    ``intermediate_weight`` times its own. Off by default (GRPO's loss as before). ``agent`` (with a
    ``rollout_server`` started with ``--record-rollouts``): the rollouts are episodes of any agent
    whose LLM calls the server records, rewarded by the agent (:mod:`.agent_rollouts`); ``program`` is
    then only what the adapter is attached to.

    Settings:
        student: the local model to train (``None``: the one the program runs on, else the embedded Gemma).
        steps: optimizer steps (each one batch of rollouts).
        batch_size: trainset examples per step.
        group_size: rollouts per example (at least 2: advantages compare them).
        temperature: the rollouts' sampling temperature (the log-probs are taken at it too).
        max_new_tokens: the longest completion of one LM call in a rollout.
        learning_rate, weight_decay: AdamW's.
        lr_schedule: ``"constant"``, ``"linear"`` or ``"cosine"`` decay over the steps.
        warmup_steps: steps of linear warm-up before the schedule.
        epsilon: the ratio clip (``1 - epsilon``, ``1 + epsilon``).
        epsilon_high: a higher upper clip (DAPO's clip-higher; ``None``: ``epsilon``).
        beta: the weight of the k3 KL to the reference (0: none).
        scaling: the advantage's divisor: the group's, the batch's standard deviation, or none.
        aggregation: how token losses are averaged (above).
        passes: optimizer steps on each batch of rollouts.
        micro_batch_size: sequences per forward pass (gradients accumulate over them).
        micro_batch_tokens: padded positions per forward pass (``None``: no bound); the update's activation memory.
        max_grad_norm: the gradient-norm clip (``None``: none).
        gradient_checkpointing: recompute activations in the backward pass (less memory, more compute).
        node_rewards: per-node reward functions added to the metric (node id -> ``NodeReward``).
        format_penalty: the reward taken off a rollout whose LM output could not be parsed.
        lora: the adapter's shape (:class:`~flowopt.optimizers.weights.policy.LoraSettings`).
        adapter: the DSPy adapter rollouts are rendered with (``None``: the configured one, else the
            student's own choice).
        checkpoint_every: save the adapter and optimizer state every this many steps (0: never).
        plot: draw the reward curve (``reward_curve.png`` in the stage folder).
        rollout_server: sample rollouts on an :class:`InferenceServer` instead of in this process.

    Example:
        >>> import flowopt
        >>> from flowopt.optimizers.weights import GRPO
        >>> stage = GRPO(steps=50, batch_size=4, group_size=8, temperature=1.0, beta=0.04)
        >>> compiled = flowopt.compile(program, trainset, metric, stages=[stage])  # doctest: +SKIP
        >>> compiled.report.stages[-1].info["reward_curve"][:2]  # doctest: +SKIP
    """

    name: ClassVar[str] = "grpo"
    multi_process: ClassVar[bool] = True
    memory_settings: ClassVar[tuple[str, ...]] = ("micro_batch_size", "micro_batch_tokens", "gradient_checkpointing")

    student: Any = None
    steps: int = 20
    batch_size: int = 4
    group_size: int = 4
    temperature: float = 1.0
    max_new_tokens: int = 128
    learning_rate: float = 5e-5
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    scaling: Scaling = "group"
    aggregation: str = "dapo"
    passes: int = 1
    micro_batch_size: int = 8
    micro_batch_tokens: int | None = None
    max_grad_norm: float | None = 1.0
    gradient_checkpointing: bool = False
    node_rewards: Mapping[str, NodeReward] | None = None
    format_penalty: float = 1.0
    tool_rewards: Mapping[str, float] | None = None
    node_reward_credit: str = "rollout"
    intermediate_weight: float = 1.0
    lora: LoraSettings = field(default_factory=LoraSettings)
    adapter: Any = None
    checkpoint_every: int = 5
    plot: bool = True
    rollout_server: InferenceServer | None = None
    agent: Agent | None = None

    def __post_init__(self) -> None:
        check_stage(self, {
            "steps": at_least(1), "batch_size": at_least(1), "group_size": at_least(2),  # 2 rollouts to compare
            "temperature": above(0.0, 2.0), "max_new_tokens": at_least(1), "learning_rate": above(0.0, 1.0),
            "lr_schedule": one_of(*SCHEDULES), "warmup_steps": at_least(0), "weight_decay": at_least(0.0),
            "epsilon": above(0.0, 1.0), "epsilon_high": above(0.0, 1.0), "beta": at_least(0.0),
            "scaling": one_of(*SCALINGS), "aggregation": one_of(*AGGREGATIONS), "passes": at_least(1),
            "micro_batch_size": at_least(1), "micro_batch_tokens": at_least(1), "max_grad_norm": above(0.0),
            "format_penalty": at_least(0.0),
            "checkpoint_every": at_least(0), "node_reward_credit": one_of(*CREDITS),
            "intermediate_weight": at_least(0.0),
        })
        unknown = sorted(set(self.tool_rewards or ()) - set(TOOL_STATUSES))
        if unknown:
            raise ConfigError(f"GRPO tool_rewards names unknown tool-call statuses {unknown}",
                              fix=f"use statuses from {list(TOOL_STATUSES)}, e.g. "
                                  "tool_rewards={'ok': 0.1, 'error': -0.1}")
        if self.agent is not None and self.rollout_server is None:
            raise ConfigError("GRPO(agent=...) trains on the agent's LLM calls recorded by a server, but no "
                              "rollout_server is set", fix="pass rollout_server=InferenceServer(URL, adapter_dir=...) "
                                                           "of a flowopt serve started with --record-rollouts")
        if self.rollout_server is not None and not isinstance(self.rollout_server, InferenceServer):
            raise ConfigError(f"rollout_server must be an InferenceServer, got {type(self.rollout_server).__name__}",
                              fix="pass rollout_server=InferenceServer('http://127.0.0.1:8000/v1', adapter_dir=...)")

    # ------------------------------------------------------------------ the stage
    def run(self, program: dspy.Module, ctx: StageContext) -> dspy.Module:
        if not ctx.trainset:
            raise ConfigError("GRPO needs training examples, the trainset is empty", fix="pass a non-empty trainset")
        world = current_world()
        world.check_divisible(self.batch_size * self.group_size, "GRPO's batch_size x group_size (rollouts a step)",
                              fix=f"pick batch_size and group_size whose product is a multiple of the {world.size} "
                                  "processes")
        if self.rollout_server is not None and world.distributed:
            # One server holds one pushed adapter per step; N ranks pushing their own copies would race.
            raise ConfigError("GRPO(rollout_server=...) runs in one process, but this compile was launched on "
                              f"{world.size} processes",
                              fix="launch one process when sampling on an inference server, or drop rollout_server")
        policy, start_from = resolve_policy(self.student, program, self.lora)
        name = adapter_name(self.name, ctx)
        init_from = start_from if start_from != name else None
        policy.start_adapter(name, init_from=init_from, seed=ctx.seed)
        learner = GRPOLearner(
            policy, total_steps=self.steps, learning_rate=self.learning_rate, weight_decay=self.weight_decay,
            lr_schedule=self.lr_schedule, warmup_steps=self.warmup_steps, epsilon=self.epsilon,
            epsilon_high=self.epsilon_high, beta=self.beta, aggregation=self.aggregation, passes=self.passes,
            micro_batch_size=self.micro_batch_size, micro_batch_tokens=self.micro_batch_tokens,
            max_grad_norm=self.max_grad_norm, temperature=self.temperature,
            gradient_checkpointing=self.gradient_checkpointing,
            # KL to the policy the stage starts from: after BootstrapFinetune that is the fine-tuned adapter
            # (a KL to the base model would pull the student back from what it learned).
            reference_adapter=init_from, world=world)
        curve: list[dict[str, Any]] = []
        first = self._resume(ctx, policy, learner, curve)
        adapter = rollout_adapter(self.adapter, policy)
        stop_reason = "steps"
        started = time.monotonic()
        progress = ctx.progress(total=self.steps, desc="grpo") if hasattr(ctx, "progress") else None
        if progress is not None:
            progress.update(first)
        served = ServedRollouts(self.rollout_server, policy, prefix=name) if self.rollout_server else None
        if served is not None:
            served.start()
        agents = None if served is None or self.agent is None else AgentRollouts(
            served, self.agent, format_penalty=self.format_penalty, temperature=self.temperature)
        # One set of rollout threads for the whole run (B x G of them wait together in every step).
        pool = ThreadPoolExecutor(max_workers=len(world.share(self.batch_size * self.group_size)),
                                  thread_name_prefix="flowopt-rollout")
        try:
            for step in range(first, self.steps):
                with self._out_of_memory(step):
                    point = self._step(step, program, ctx, policy, learner, adapter, pool, world, served, agents)
                curve.append(point)
                ctx.logger.info("grpo step %d/%d: reward %.3f (+/- %.3f), loss %.4f, failures %d",
                                step + 1, self.steps, point["mean_reward"], point["reward_std"], point["loss"],
                                point["format_failures"])
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(reward=f"{point['mean_reward']:.3f}")
                if self.checkpoint_every and (step + 1) % self.checkpoint_every == 0 and step + 1 < self.steps:
                    self._checkpoint(ctx, policy, learner, curve, step + 1, world)
        except BudgetExhausted as err:
            stop_reason = f"budget: {err.limit}"
            ctx.logger.info("grpo: budget exhausted after %d steps (%s)", len(curve), err.limit)
        finally:
            pool.shutdown(wait=True)
            if agents is not None:
                agents.close()
            if served is not None:
                served.close()
            if progress is not None:
                progress.close()
        if ctx.run_dir is not None and curve:  # before finish(), whose barrier makes it visible to every rank
            self._checkpoint(ctx, policy, learner, curve, len(curve), world)
        program, info = finish(program, policy, ctx, self.name, world)
        info.update(stop_reason=stop_reason, steps_done=len(curve), reward_curve=curve,
                    train_seconds=round(time.monotonic() - started, 2), processes=world.size)
        if served is not None:
            info.update(served.report())
        if self.plot and ctx.run_dir is not None and curve and world.is_main:
            from flowopt.optimizers.weights.plot import plot_reward_curve

            info["reward_plot"] = str(plot_reward_curve(curve, Path(ctx.run_dir) / "reward_curve.png"))
        ctx.record(**info)
        return program

    def _step(self, step: int, program: dspy.Module, ctx: StageContext, policy: Policy, learner: GRPOLearner,
              adapter: Any, pool: ThreadPoolExecutor, world: World,
              served: ServedRollouts | None = None, agents: AgentRollouts | None = None) -> dict[str, Any]:
        import torch

        t0 = time.monotonic()
        # Each step's draw depends only on (seed, step), so a resumed run repeats the one it continues
        # and every rank draws the same examples.
        rng = random.Random(f"{ctx.seed}:grpo:{step}")
        examples = [ctx.trainset[i] for i in _draw(rng, len(ctx.trainset), self.batch_size)]
        seed = rng.getrandbits(63)
        served_seed = rng.getrandbits(63)  # the server's sampling seed for this step
        if served is not None:
            served.push(step)  # the server samples this step's rollouts with the weights as they are now
        error: BudgetExhausted | None = None
        rollouts: list[Rollout] = []
        mine: list[tuple[float, float | None, bool]] = []
        own: list[list[float]] | None = None
        try:
            ctx.budget.check()
            with ctx.budget.guard():  # a metric may call an LM too
                if agents is not None:  # the agent's episodes, rewarded by the agent
                    rollouts = agents.run(examples, self.group_size, step, pool)
                else:
                    rollouts = self._rollouts(program, examples, policy, adapter, pool, world, seed,
                                              served=served, served_seed=served_seed)
                    by_rollout = None if self.node_reward_credit == "transition" else self.node_rewards
                    for r in rollouts:
                        score_rollout(r, ctx.metric, node_rewards=by_rollout, format_penalty=self.format_penalty)
                mine = [(r.reward, r.score, r.error is not None) for r in rollouts]
                own = self._own_rewards(rollouts)
        except BudgetExhausted as err:
            error = err
        agree_on_budget(world, error)  # every rank stops together
        t1 = time.monotonic()
        every = [row for share in world.gather_objects(mine) for row in share]  # the whole batch, in order
        rewards = torch.tensor([reward for reward, _, _ in every])
        advantages = group_advantages(rewards.view(len(examples), self.group_size), self.scaling).flatten()
        share = world.share(len(every))
        items = scored_transitions(rollouts, advantages[share.start:share.stop].tolist(), own,
                                   weight=self.intermediate_weight)
        stats = learner.update(items)
        t2 = time.monotonic()
        scores = [score for _, score, _ in every if score is not None]
        point = {"step": step + 1, "mean_reward": float(rewards.mean()), "reward_std": float(rewards.std()),
                 "mean_score": sum(scores) / len(scores) if scores else 0.0,
                 "format_failures": sum(failed for _, _, failed in every),
                 "rollout_s": round(t1 - t0, 3), "update_s": round(t2 - t1, 3), "step_s": round(t2 - t0, 3),
                 "completion_tokens": stats.tokens,
                 "tool_calls": sum(len(r.tool_calls) for r in rollouts)}
        if own is not None:  # this process's rollouts: the mean of each one's summed intermediate rewards
            point["intermediate_reward"] = sum(map(sum, own)) / max(1, len(own))
        point.update({k: v for k, v in dataclasses.asdict(stats).items()})
        return point

    def _rollouts(self, program: dspy.Module, examples: list[Any], policy: Policy, adapter: Any,
                  pool: ThreadPoolExecutor, world: World, seed: int, served: ServedRollouts | None = None,
                  served_seed: int = 0) -> list[Rollout]:
        """This rank's rollouts: all ``len(examples) x group_size`` on one process, else its contiguous
        share of them (each run once), sampled from a stream of its own."""
        options = {"temperature": self.temperature, "max_new_tokens": self.max_new_tokens, "adapter": adapter,
                   "pool": pool}
        if not world.distributed:
            return run_rollouts(program, examples, self.group_size, policy,
                                generator=torch_generator(policy, seed), served=served, seed=served_seed, **options)
        share = world.share(len(examples) * self.group_size)
        mine = [examples[k // self.group_size] for k in share]
        # A stream per rank: the same draws everywhere would give a group's members on two ranks equal samples.
        rank_seed = random.Random(f"{seed}:rank:{world.rank}").getrandbits(63)
        return run_rollouts(program, mine, 1, policy, generator=torch_generator(policy, rank_seed), **options)

    def _own_rewards(self, rollouts: list[Rollout]) -> list[list[float]] | None:
        """Each rollout's per-transition rewards, or ``None`` when no intermediate reward is set."""
        nodes = self.node_rewards if self.node_reward_credit == "transition" else None
        if not self.tool_rewards and not nodes:
            return None
        return [transition_rewards(r, tool_rewards=self.tool_rewards, node_rewards=nodes) for r in rollouts]

    def _out_of_memory(self, step: int) -> AbstractContextManager[None]:
        done = step - step % self.checkpoint_every if self.checkpoint_every else 0
        saved = (f"the checkpoint after {done} steps is intact and a resumed run continues from it" if done
                 else "no step was checkpointed yet, so a resumed run starts GRPO over")
        return out_of_memory_errors(
            f"grpo (step {step + 1})",
            {"micro_batch_size": self.micro_batch_size, "micro_batch_tokens": self.micro_batch_tokens,
             "gradient_checkpointing": self.gradient_checkpointing},
            {"batch_size": self.batch_size, "group_size": self.group_size, "max_new_tokens": self.max_new_tokens},
            resume_note=saved)

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint(self, ctx: StageContext, policy: Policy, learner: GRPOLearner, curve: list[dict[str, Any]],
                    step: int, world: World) -> None:
        """Rank 0 writes the checkpoint (every rank holds the same adapter and optimizer state)."""
        if ctx.run_dir is None or not world.is_main:
            return
        import io
        import shutil

        import torch

        from flowopt.io import atomic_write_bytes

        folder = Path(ctx.run_dir) / f"checkpoint-{step}"
        policy.save_adapter(folder / "adapter")
        buffer = io.BytesIO()
        torch.save(learner.state_dict(), buffer)
        atomic_write_bytes(folder / "learner.pt", buffer.getvalue())
        # The JSON pointer is written last: a crash before it leaves the previous checkpoint in force.
        ctx.save_checkpoint("grpo", {"step": step, "folder": folder.name, "reward_curve": curve})
        for old in Path(ctx.run_dir).glob("checkpoint-*"):
            if old.name != folder.name:
                shutil.rmtree(old, ignore_errors=True)

    def _resume(self, ctx: StageContext, policy: Policy, learner: GRPOLearner, curve: list[dict[str, Any]]) -> int:
        state = ctx.load_checkpoint("grpo")
        if not state or ctx.run_dir is None:
            return 0
        import torch

        folder = Path(ctx.run_dir) / str(state["folder"])
        if not (folder / "learner.pt").is_file():
            ctx.logger.warning("grpo: checkpoint folder %s is missing, starting over", folder)
            return 0
        policy.load_adapter_file(folder / "adapter")
        learner.load_state_dict(torch.load(folder / "learner.pt", weights_only=True))
        curve.extend(state.get("reward_curve", []))
        step = int(state["step"])
        ctx.logger.info("grpo: resumed at step %d", step)
        return min(step, self.steps)


def _draw(rng: random.Random, n: int, k: int) -> list[int]:
    """``k`` distinct indices when possible, with replacement only for a trainset smaller than ``k``."""
    if n >= k:
        return rng.sample(range(n), k)
    return [rng.randrange(n) for _ in range(k)]


def scored_transitions(rollouts: list[Rollout], advantages: list[float], own: list[list[float]] | None = None,
                       *, weight: float = 1.0) -> list[ScoredTransition]:
    """Every LM call of every rollout with its rollout's advantage, plus ``weight`` times its own reward
    (``own[i][j]``: transition j of rollout i) when intermediate rewards are set.

    Example:
        >>> from flowopt.optimizers.weights.rollout import Rollout, Transition
        >>> r = Rollout(0, 0, None, transitions=[Transition([1], [2], [-0.1], "", "stop")] * 2)
        >>> [t.advantage for t in scored_transitions([r], [0.5], [[0.2, 0.0]], weight=0.5)]
        [0.6, 0.5]
    """
    items = []
    for index, (rollout, advantage) in enumerate(zip(rollouts, advantages)):
        for j, t in enumerate(rollout.transitions):  # every LM call of the rollout shares its advantage
            value = float(advantage) + (weight * own[index][j] if own is not None else 0.0)
            items.append(ScoredTransition(t.prompt_ids, t.completion_ids, t.logprobs, value, rollout=index))
    return items
