"""What both weights stages share: picking the student, its DSPy adapter, seeding, saving the adapter."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import dspy

from flowopt.compiler import StageContext
from flowopt.lm.pinned import adapter_sha256
from flowopt.optimizers.weights.distributed import SINGLE, World
from flowopt.optimizers.weights.policy import LoraSettings, Policy
from flowopt.optimizers.weights.student import attach, find_local

logger = logging.getLogger(__name__)

DEFAULT_STUDENT = "gemma-3-270m"


def resolve_policy(student: Any, program: dspy.Module, lora: LoraSettings) -> tuple[Policy, str | None]:
    """The policy to train and the adapter to start from (the one the program already runs with).

    ``student=None`` trains the LocalLM the program already uses, else the embedded Gemma 3 270M.
    """
    local, adapter = find_local(program)
    if student is None:
        student = local if local is not None else DEFAULT_STUDENT
    policy = Policy.from_student(student, lora=lora)
    start = adapter if local is not None and local is policy.local else None  # continue an earlier stage
    return policy, start


def rollout_adapter(adapter: Any, policy: Policy) -> Any:
    """The DSPy adapter the student is trained with: the one given, else the one configured in DSPy
    (what the program will run with), else LocalLM's choice for this model (the completion adapter
    for base models). An adapter that picks per LM (``flowopt.lm.AutoAdapter``) is resolved for the
    student here, since rollouts reach the model through another ``dspy.LM``. Inference must use the
    same adapter, e.g. ``dspy.configure(adapter=AutoAdapter())``.
    """
    adapter = adapter if adapter is not None else dspy.settings.adapter
    if adapter is None:
        from flowopt.lm import adapter_for

        return adapter_for(policy.local.lm)
    pick = getattr(adapter, "pick", None)
    return pick(policy.local.lm) if callable(pick) else adapter


def torch_generator(policy: Policy, seed: int) -> Any:
    import torch

    device = policy.device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed & (2**63 - 1))
    return gen


def adapter_name(stage: str, ctx: StageContext) -> str:
    return (getattr(ctx, "stage_name", "") or stage).replace("/", "-")


def finish(program: dspy.Module, policy: Policy, ctx: StageContext, stage: str,
           world: World = SINGLE) -> tuple[dspy.Module, dict[str, Any]]:
    """Save the adapter (under the stage's run folder, else in a new ``flowopt-{stage}-*`` folder under
    ``tempfile.gettempdir()``) and bind it to the program. The temporary folder is not removed: the
    returned program loads its adapter from there (and records that path).

    With several processes rank 0 writes it (every rank holds the same weights) and the others wait,
    then record its folder as where their adapter is saved.
    """
    import tempfile

    if ctx.run_dir is not None:
        folder = Path(ctx.run_dir) / "adapter"
        # The compiler gives each stage <run>/stages/NN-name and writes <run>/program.json: record the
        # adapter relative to <run>, where the program's JSON lives.
        parent = Path(ctx.run_dir).parent
        run_root = parent.parent if parent.name == "stages" else parent
    else:
        folder = Path(world.broadcast(tempfile.mkdtemp(prefix=f"flowopt-{stage}-") if world.is_main else None))
        folder = folder / "adapter"
        run_root = None
    if world.is_main:
        folder, sha = policy.save_adapter(folder)
    world.barrier()
    if not world.is_main:
        sha = adapter_sha256(folder)
        policy.local.mark_saved(folder, policy.adapter)
    if policy.adapter is None:
        raise RuntimeError(f"{stage}: no adapter was trained, so there is none to attach")
    attach(program, policy.local, policy.adapter, adapter_dir=folder, sha256=sha, run_root=run_root)
    info = {"adapter": str(folder), "adapter_sha256": sha, "student": policy.local.name}
    logger.info("%s: adapter saved to %s (sha256 %s)", stage, folder, sha[:12])
    return program, info
