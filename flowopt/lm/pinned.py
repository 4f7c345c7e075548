"""A ``dspy.LM`` bound to one LoRA adapter of a ``LocalLM``, whatever adapter is active model-wide.

Several adapters live on one LocalLM: after BootstrapFinetune, GRPO attaches and trains its own on
the same LocalLM, while the caller's program keeps using the LocalLM's default weights; if the
compiler then keeps the fine-tuned program (GRPO did not beat it), that program must still run, and be
saved, with the fine-tuned adapter. So each weights stage hands its program an :class:`AdapterLM`: its
calls run with its adapter (LocalLM batches calls per adapter state, so they never mix with others),
its cache key names the adapter's weights, and its workflow-IR entry names the adapter's folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flowopt.errors import ConfigError
from flowopt.lm.engine import LocalDSPyLM, LocalEngine


class PinnedEngine(LocalEngine):
    """``LocalEngine`` whose calls always use ``adapter`` (``LocalLM.complete_ids(adapter=...)``)."""

    def __init__(self, local: Any, adapter: str) -> None:
        super().__init__(local, adapter=adapter)

    def dump_state(self) -> dict[str, Any]:
        spec = self.local.to_spec()
        path = self.local.adapter_path(self.adapter)
        spec["adapter"] = None if path is None else str(path)
        return spec

    def __deepcopy__(self, memo: dict[int, Any]) -> PinnedEngine:
        return self


class AdapterLM(LocalDSPyLM):
    """The student LM of a trained program: ``local`` with adapter ``adapter`` (saved at ``path``).

    A :class:`~flowopt.lm.engine.LocalDSPyLM` whose calls are pinned to the adapter, whose cache tag
    names the adapter's weights (its SHA-256) and whose spec names the adapter's folder.

    Example:
        >>> lm = AdapterLM(local, "finetune", path="run/stages/00-finetune/adapter", sha256="ab12...")  # doctest: +SKIP
        >>> lm.to_spec()["adapter"]  # doctest: +SKIP
        '/abs/run/stages/00-finetune/adapter'
    """

    def __init__(self, local: Any, adapter: str, *, path: str | Path, sha256: str, **kwargs: Any) -> None:
        self.adapter = adapter
        self.adapter_path = str(Path(path).resolve())
        self.sha256 = sha256
        kwargs.setdefault("temperature", local.temperature)
        kwargs.setdefault("max_tokens", local.max_new_tokens)
        super().__init__(local, engine=PinnedEngine(local, adapter), **kwargs)

    def cache_tag(self) -> str:
        # DSPy's cache keys on the model string: name the adapter's weights, not the adapter's name.
        return f"@{self.sha256[:12]}"

    def weights_spec(self) -> dict[str, Any]:
        """The LocalLM's spec with this adapter's folder."""
        local = self._local
        if local.source is None:
            raise ConfigError(f"LocalLM {local.name!r} wraps an in-memory model and cannot be described",
                              fix="save it with save_pretrained(folder) and train LocalLM(folder)")
        try:
            spec = dict(local.to_spec())
        except ConfigError:  # the default adapter exists only in memory: describe the base alone
            spec = {"model": f"local/{local.name}", "source": local.source, "chat": local.chat,
                    "max_new_tokens": local.max_new_tokens, "temperature": local.temperature}
        spec["adapter"] = self.adapter_path
        return spec
