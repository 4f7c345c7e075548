"""The trainable student: a ``flowopt.lm.LocalLM`` and the LoRA adapter a weights stage trains on it.

Both weights stages train a :class:`Policy`. The reference model for the KL term is the same network
with the adapter disabled (:meth:`Policy.reference`): no second copy in memory. Prompts are rendered
by the LocalLM, so training sees exactly the ids that inference sees.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowopt.errors import ConfigError
from flowopt.lm.pinned import adapter_sha256
from flowopt.settings import above, at_least, below, check_stage

logger = logging.getLogger(__name__)

Messages = Sequence[Mapping[str, str]]


@dataclass(frozen=True)
class LoraSettings:
    """LoRA shape: ``r`` the adapter's rank, ``alpha`` its scale (the update is scaled by ``alpha / r``),
    ``dropout`` on the adapter's input (in [0, 1)), ``target_modules`` the layers adapted
    (``"all-linear"``: every linear layer except the output head; or a tuple of module names).

    Example:
        >>> LoraSettings(r=16, alpha=32).r
        16
    """

    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: str | tuple[str, ...] = "all-linear"

    def __post_init__(self) -> None:
        check_stage(self, {"r": at_least(1), "alpha": above(0), "dropout": below(1.0, 0.0)})

    def peft_config(self) -> Any:
        from peft import LoraConfig

        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=targets,
                          task_type="CAUSAL_LM", bias="none")


class Policy:
    """The student being trained: a ``LocalLM`` plus the LoRA adapter a stage trains on it.

    All forward passes, sampling and adapter changes hold ``local.lock``, so DSPy calls from other
    threads never see an adapter half-switched. :meth:`start_adapter` attaches a fresh adapter (or a copy
    of an earlier stage's, so GRPO continues from BootstrapFinetune while the earlier adapter stays
    as it was), selects it for the training forward and makes it the only trainable parameters. It is
    not made the LocalLM's default: programs that call ``local.lm`` (the caller's input program) keep
    their weights; the trained program is pinned to the adapter instead (:mod:`flowopt.lm.pinned`).

    Example:
        >>> from flowopt.lm import LocalLM
        >>> from flowopt.optimizers.weights.tiny import tiny_causal_lm
        >>> local = LocalLM.from_model(*tiny_causal_lm(["red", "blue"]), name="tiny")
        >>> policy = Policy(local, lora=LoraSettings(r=4, alpha=8))
        >>> policy.start_adapter("sft-demo")
        >>> ids = policy.render([{"role": "user", "content": "cue : red word :"}])
        >>> policy.completion_ids("red")[-1] == policy.eos_ids[0]
        True
    """

    def __init__(self, local: Any, *, lora: LoraSettings | None = None) -> None:
        self.local = local
        self.lora = lora or LoraSettings()
        self.adapter: str | None = None

    @classmethod
    def from_student(cls, student: Any, *, lora: LoraSettings | None = None) -> Policy:
        """``student``: a ``LocalLM``, its ``dspy.LM`` (``local.lm``), or a model name / folder for ``LocalLM``."""
        from flowopt.lm import LocalLM, local_of

        if isinstance(student, Policy):
            return student
        if isinstance(student, LocalLM):
            return cls(student, lora=lora)
        local = local_of(student)
        if local is not None:
            return cls(local, lora=lora)
        if isinstance(student, str | Path):
            from flowopt.lm import shared_local_lm

            name = str(student)
            spec = {"model": f"local/{Path(name).name}", "source": name} if Path(name).exists() else {
                "model": name if name.startswith("local/") else f"local/{name}"}
            return cls(shared_local_lm(spec), lora=lora)
        raise ConfigError(f"cannot train {student!r}: the student must be a local model",
                          fix="pass student='gemma-3-270m', a LocalLM, or LocalLM(...).lm")

    # ------------------------------------------------------------------ model and ids
    @property
    def model(self) -> Any:
        return self.local.model

    @property
    def tokenizer(self) -> Any:
        return self.local.tokenizer

    @property
    def lock(self) -> Any:
        return self.local.lock

    @property
    def device(self) -> Any:
        return next(self.model.parameters()).device

    @property
    def eos_ids(self) -> list[int]:
        return self.local.eos_ids

    @property
    def pad_id(self) -> int:
        return self.local.pad_id

    def render(self, messages: Messages) -> list[int]:
        """Prompt ids for chat ``messages``, exactly as the LocalLM builds them for generation."""
        return list(self.local.render([dict(m) for m in messages]))

    def completion_ids(self, text: str) -> list[int]:
        """Ids of a completion as the model should emit it: the text, then EOS."""
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return ids + self.eos_ids[:1]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # ------------------------------------------------------------------ adapter
    def start_adapter(self, name: str, *, init_from: str | None = None, seed: int = 0) -> None:
        """Attach and activate a trainable adapter ``name``; ``init_from`` copies an attached adapter.

        A fresh adapter's random initialisation is drawn from ``seed``, so runs repeat.
        """
        import torch
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        with self.lock, torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if name in self.local.adapters:
                self.local.unload_adapter(name)  # a restarted stage starts over (resume reloads weights)
            if init_from is not None:
                config = copy.deepcopy(self.model.peft_config[init_from])
                config.inference_mode = False
                self.local.add_adapter(name, config, activate=False)
                state = get_peft_model_state_dict(self.model, adapter_name=init_from)
                set_peft_model_state_dict(self.model, state, adapter_name=name)
            else:
                self.local.add_adapter(name, self.lora.peft_config(), activate=False)
            self.local.select_adapter(name)  # the training forward's weights, the only trainable ones
            self.adapter = name

    @contextlib.contextmanager
    def training(self, *, gradient_checkpointing: bool = False) -> Iterator[Any]:
        """Train mode for the block (LoRA dropout on); optionally recompute activations in the backward
        pass instead of keeping them (less memory, about a third more compute), as TRL does by default."""
        model = self.model
        base = self.local.base_model
        if gradient_checkpointing:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        try:
            yield model
        finally:
            model.eval()
            if gradient_checkpointing:
                base.gradient_checkpointing_disable()
                # transformers leaves the embeddings' input-require-grads hook of the enable in place under
                # a PEFT wrapper, so one more hook would pile up per update, and each new count makes a
                # compiled decode step recompile (its guards check the hooks).
                base.disable_input_require_grads()

    def trainable_parameters(self) -> list[Any]:
        return [p for p in self.model.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def reference(self, adapter: str | None = None) -> Iterator[Any]:
        """The reference model for KL scores: the base model (adapter disabled), or with ``adapter`` the
        policy a stage started from (e.g. GRPO after BootstrapFinetune keeps close to the fine-tuned
        model, not to the base one). Either way no second copy of the weights is made."""
        with self.local.using_adapter(adapter):  # re-selects the trained adapter (and its trainability) after
            yield self.model

    def weights_changed(self) -> None:
        """After an optimizer step: DSPy's cache must not answer with the old weights' results."""
        self.local.mark_weights_changed(self.adapter)

    def adapter_state(self) -> dict[str, Any]:
        from peft import get_peft_model_state_dict

        if self.adapter is None:
            raise RuntimeError("adapter_state() needs a started adapter: call start_adapter() first")
        state = get_peft_model_state_dict(self.model, adapter_name=self.adapter)
        return {k: v.detach().cpu().clone() for k, v in state.items()}

    def load_adapter_state(self, state: Mapping[str, Any]) -> None:
        from peft import set_peft_model_state_dict

        with self.lock:
            set_peft_model_state_dict(self.model, dict(state), adapter_name=self.adapter)
            self.weights_changed()

    def save_adapter(self, path: str | Path) -> tuple[Path, str]:
        """Save the adapter as a PEFT folder at ``path`` (atomically); returns the folder and its sha256.

        The LocalLM then names that folder in its spec (the workflow's LM entry).
        """
        target = self.local.save_adapter(path, self.adapter)
        return target, adapter_sha256(target)

    def load_adapter_file(self, path: str | Path) -> None:
        """Load adapter weights saved by :meth:`save_adapter` into the current adapter (for resume)."""
        from safetensors.torch import load_file

        weights = Path(path) / "adapter_model.safetensors"
        if not weights.is_file():
            raise ConfigError(f"no adapter weights at {weights}", fix="point at a folder written by save_adapter")
        self.load_adapter_state(load_file(str(weights)))
