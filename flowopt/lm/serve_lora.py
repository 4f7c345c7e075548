"""Runtime LoRA adapters of ``flowopt serve``: what ``/v1/load_lora_adapter`` may load, and the loaded set.

The same contract as vLLM's runtime LoRA endpoints (``POST /v1/load_lora_adapter`` with
``{"lora_name", "lora_path"}``, ``POST /v1/unload_lora_adapter`` with ``{"lora_name"}``; a request then
samples with an adapter by naming it as its ``model``), so a trainer that pushes adapters to vLLM
pushes them to ``flowopt serve`` unchanged. The server has no authentication, so loading is off unless
the operator turns it on, and then only folders under the operator's ``lora_root`` load: a client can
never make the server read an arbitrary path.
"""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from flowopt.errors import FlowoptError

if TYPE_CHECKING:
    from flowopt.lm.local import LocalLM

logger = logging.getLogger(__name__)

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


class LoraRefused(Exception):
    """A load or unload the server refuses; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class RuntimeLoras:
    """The adapters loaded through the endpoints, on top of ``local`` (at most ``max_loras`` at once).

    ``lora_root=None`` means runtime loading is off: every load and unload is refused with a 404, as
    vLLM answers when the endpoints are not enabled.

    Example:
        >>> loras = RuntimeLoras(local, lora_root="/srv/adapters", max_loras=4)  # doctest: +SKIP
        >>> loras.load("step-3", "/srv/adapters/run1/step-3")  # doctest: +SKIP
        >>> loras.adapter_for("step-3")  # doctest: +SKIP
        'step-3'
    """

    def __init__(self, local: LocalLM, *, lora_root: str | Path | None, max_loras: int = 4) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.local = local
        self.root = None if lora_root is None else Path(lora_root).expanduser().resolve()
        self.max_loras = max_loras
        self._names: dict[str, str] = {}  # lora name -> resolved folder
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.root is not None

    @property
    def loaded(self) -> dict[str, str]:
        """Runtime-loaded adapters: name -> folder."""
        with self._lock:
            return dict(self._names)

    def _allowed_folder(self, lora_path: str) -> Path:
        assert self.root is not None
        # resolve() follows symlinks, so a link inside the root that points outside it is refused too.
        folder = Path(lora_path).expanduser().resolve()
        if not folder.is_relative_to(self.root):
            raise LoraRefused(403, f"lora_path {lora_path!r} is outside the server's --lora-root; only adapters "
                                   f"under it can be loaded")
        if not (folder / "adapter_config.json").is_file():
            raise LoraRefused(400, f"no PEFT adapter at lora_path {lora_path!r} (adapter_config.json missing)")
        return folder

    def _refuse_if_off(self) -> None:
        if not self.enabled:
            raise LoraRefused(404, "runtime LoRA loading is off on this server: start it with "
                                   "`flowopt serve MODEL --enable-lora --lora-root DIR`")

    def load(self, name: str, lora_path: str) -> None:
        """Attach the adapter at ``lora_path`` (under the root) as ``name``; requests may then use it."""
        self._refuse_if_off()
        if not NAME_PATTERN.match(name):
            raise LoraRefused(400, "lora_name must be 1-128 characters of letters, digits, '.', '_', ':' or '-'")
        folder = self._allowed_folder(lora_path)
        with self._lock:
            if name in self._names or name in self.local.adapters:
                raise LoraRefused(400, f"a LoRA adapter named {name!r} is already loaded")
            if len(self._names) >= self.max_loras:
                raise LoraRefused(400, f"{len(self._names)} LoRA adapters are loaded, the server's --max-loras; "
                                       "unload one first")
            try:
                self.local.load_adapter(folder, name, activate=False)
            except FlowoptError as exc:
                raise LoraRefused(400, str(exc)) from exc
            self._names[name] = str(folder)
        logger.info("loaded LoRA adapter %r from %s", name, folder)

    def unload(self, name: str) -> None:
        """Detach a runtime-loaded adapter (an adapter given with ``--adapter`` at start-up stays)."""
        self._refuse_if_off()
        with self._lock:
            if name not in self._names:
                raise LoraRefused(404, f"no LoRA adapter named {name!r} was loaded through the API")
            self.local.unload_adapter(name)
            del self._names[name]
        logger.info("unloaded LoRA adapter %r", name)

    def adapter_for(self, model: str | None) -> str | None:
        """The runtime adapter a request's ``model`` names, or None (the served model's default weights)."""
        if model is None:
            return None
        with self._lock:
            return model if model in self._names else None
