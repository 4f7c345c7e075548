"""Instruction options per predictor: the original, ones the user gives, and ones a proposer LM writes.

Example:
    >>> from flowopt.optimizers.search.instructions import ProposeInstruction
    >>> list(ProposeInstruction.output_fields)
    ['instruction']
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import dspy

from flowopt.compiler import StageContext
from flowopt.errors import BudgetExhausted

if TYPE_CHECKING:
    from flowopt.optimizers.search.space import SearchSpace
    from flowopt.optimizers.search.stage import RandomSearch


class ProposeInstruction(dspy.Signature):
    """Write a better instruction for a language model task. Keep the task the same; be specific about
    what a good output looks like, judging from the examples."""

    current_instruction: str = dspy.InputField()
    task_fields: str = dspy.InputField(desc="the task's input and output fields")
    examples: str = dspy.InputField(desc="a few worked examples")
    direction: str = dspy.InputField(desc="a direction to take the new instruction in")
    instruction: str = dspy.OutputField(desc="the new instruction, one paragraph")


# One direction per proposal (as MIPROv2's tips): proposals from one prompt would be alike, or the same.
DIRECTIONS = ("be specific about the output format", "be concise", "describe the task step by step",
              "write as an expert in the task would", "say which mistakes to avoid", "be creative",
              "say what the inputs mean", "ask for a careful, well-checked answer")
TASK_LM = "task"  # proposer_lm="task": the program's own LM writes the proposals


def instruction_candidates(stage: RandomSearch, program: dspy.Module, ctx: StageContext,
                            space: SearchSpace) -> dict[str, list[str]]:
    saved = ctx.load_checkpoint("instructions")
    out: dict[str, list[str]] = {}
    proposals = dict(saved or {})
    for name, predictor in program.named_predictors():
        options = [predictor.signature.instructions]
        extra = list((stage.instructions or {}).get(name, [])) + list((stage.instructions or {}).get("*", []))
        proposer = stage.proposer_lm
        if proposer == TASK_LM:
            proposer = predictor.lm or dspy.settings.lm
        # Proposals are read only by sampled candidates and extras: a search of seeded candidates alone pays none.
        wanted = stage.n_proposals and "instruction" in stage.kinds and stage.may_sample()
        if proposer is not None and wanted and name not in proposals:
            proposals[name] = _propose(stage, proposer, predictor, space.pools.get(name, []), ctx)
            ctx.save_checkpoint("instructions", proposals)
        for text in [*extra, *proposals.get(name, [])]:
            if isinstance(text, str) and text.strip() and text not in options:
                options.append(text)
        out[name] = options
    return out


def _propose(stage: RandomSearch, proposer: Any, predictor: Any, pool: list[dict[str, Any]],
             ctx: StageContext) -> list[str]:
    sig = predictor.signature
    fields = f"inputs: {', '.join(sig.input_fields)}; outputs: {', '.join(sig.output_fields)}"
    shown = "\n\n".join("\n".join(f"{k}: {v}" for k, v in d.items() if k != "augmented") for d in pool[:3])
    propose = dspy.Predict(ProposeInstruction)
    out: list[str] = []
    with dspy.context(lm=proposer):
        for i in range(stage.n_proposals):
            try:
                with ctx.budget.guard():
                    pred = propose(current_instruction=sig.instructions, task_fields=fields, examples=shown or "(none)",
                                   direction=DIRECTIONS[i % len(DIRECTIONS)],
                                   config={"rollout_id": i, "temperature": 1.0})
            except BudgetExhausted:
                break
            except Exception as err:  # a proposer that fails leaves the other candidates
                ctx.logger.warning("instruction proposal %d failed: %s", i, err)
                continue
            text = str(getattr(pred, "instruction", "") or "").strip()
            if text:
                out.append(text)
    return out
