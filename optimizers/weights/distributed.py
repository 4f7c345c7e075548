"""The weights stages on N processes (``accelerate launch`` / ``torchrun``): data parallel over LoRA.

Every process holds the whole student and the same adapter. Work is split, the results combined:

- SFT: each optimizer step's global batch of pairs is dealt out across the ranks; the teacher's
  traces are collected on a contiguous share of the trainset per rank and gathered in rank order.
- GRPO: the step's ``batch_size x group_size`` rollouts (the same draw on every rank) are cut into
  contiguous shares, one per rank; rewards are gathered so every group is normalised over all of its
  members, wherever they ran.
- Every rank divides its loss by the *global* token / rollout counts and the LoRA gradients are summed
  across ranks (one all-reduce of the flattened gradients per optimizer step), which gives exactly the
  gradient of the whole batch; each rank then takes the same clipped AdamW step, so the adapters stay
  identical without broadcasting weights. (LoRA gradients are small, so one flat all-reduce costs
  little; DDP's bucketing would matter for full fine-tuning, which the weights stages do not do.)
- Rank 0 alone writes adapters and checkpoints; the others wait at a barrier and then read them.

The process group is set up by accelerate's ``PartialState`` from the launcher's environment (gloo on
CPU, NCCL on CUDA with one device per local rank). One process (no ``WORLD_SIZE`` > 1) uses
:data:`SINGLE`, whose collectives are no-ops.

Example:
    >>> world = current_world()  # one process here
    >>> (world.rank, world.size, world.is_main, world.share(6))
    (0, 1, True, range(0, 6))
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flowopt.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class World:
    """This process's place among the training processes (``rank`` of ``size``)."""

    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def share(self, n: int) -> range:
        """This rank's contiguous share of ``n`` items (the first ``n % size`` ranks get one more)."""
        base, extra = divmod(n, self.size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (1 if self.rank < extra else 0))

    def check_divisible(self, n: int, what: str, fix: str) -> None:
        """A :class:`ConfigError` unless ``n`` splits evenly over the processes."""
        if n % self.size:
            raise ConfigError(f"{what} is {n}, which does not split evenly over {self.size} processes", fix=fix)

    # ------------------------------------------------------------------ collectives
    def sum_gradients(self, params: Sequence[Any]) -> None:
        """Sum every parameter's ``.grad`` over the ranks, in place (a missing gradient counts as zero)."""
        if not self.distributed:
            return
        import torch
        import torch.distributed as dist

        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n

    def sum_floats(self, values: Sequence[float]) -> list[float]:
        """Element-wise sums of ``values`` over the ranks (float64, so counts stay exact)."""
        if not self.distributed:
            return [float(v) for v in values]
        import torch
        import torch.distributed as dist

        tensor = torch.tensor(list(values), dtype=torch.float64, device=self._device())
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor.tolist()

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any rank (agreeing on a stop avoids a hang)."""
        return self.sum_floats([1.0 if flag else 0.0])[0] > 0 if self.distributed else flag

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            from accelerate import PartialState

            PartialState().wait_for_everyone()

    def _device(self) -> Any:
        from accelerate import PartialState

        return PartialState().device  # NCCL reduces CUDA tensors, gloo CPU ones


SINGLE = World()


def current_world() -> World:
    """The launched processes this one belongs to (set up on first use), else :data:`SINGLE`.

    A launcher (``accelerate launch``, ``torchrun``) sets ``WORLD_SIZE``; with more than one process
    accelerate's ``PartialState`` joins the process group (gloo on CPU, NCCL with CUDA) and picks this
    rank's device.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return SINGLE
    import torch
    from accelerate import PartialState

    # accelerate treats CPU-only processes as one process each unless told they are CPU processes.
    state = PartialState(cpu=not torch.cuda.is_available() or os.environ.get("ACCELERATE_USE_CPU") == "true")
    if state.num_processes > 1 and state.device.type == "cuda":
        torch.cuda.set_device(state.device)  # a LocalLM on "cuda" loads onto this rank's own GPU
    return World(rank=state.process_index, size=state.num_processes)


def agree_on_budget(world: World, error: Any) -> None:
    """Raise ``BudgetExhausted`` on every rank when the budget ran out on any of them (``error``: this
    rank's, or ``None``); a rank that stopped alone would leave the others waiting in a collective."""
    from flowopt.errors import BudgetExhausted

    if not world.distributed:
        if error is not None:
            raise error
        return
    seen = [e for e in world.gather_objects(None if error is None else (error.limit, error.used, error.allowed))
            if e is not None]
    if seen:
        limit, used, allowed = seen[0]
        raise BudgetExhausted(limit, used=used, allowed=allowed)
