"""``Programmer``: the LM writes a Python program, which runs in the sandbox; its output is the answer."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import dspy

from flowopt.errors import ConfigError, SandboxError
from flowopt.modules.derived_signatures import extend
from flowopt.modules.sandbox import run_python
from flowopt.operator import Operator
from flowopt.registry import register_operator
from flowopt.settings import above, between, check_settings, one_of
from flowopt.signature import FieldSpec, SignatureSpec

logger = logging.getLogger(__name__)

ON_FAILURE = ("raise", "empty")


@register_operator
class Programmer(Operator):
    """Solve by writing code: the program's last printed line becomes the node's single output.

    The code runs in :func:`flowopt.modules.sandbox.run_python`: bubblewrap namespaces and a seccomp
    filter (no network, no new processes, no host files but a read-only interpreter, an empty
    environment), with time, memory and output limits. If that boundary cannot be built on this
    machine, :class:`~flowopt.errors.SandboxError` is raised whatever ``on_failure`` says: the code
    never runs unisolated. A failed run is shown to the LM, which gets up to
    ``max_attempts`` tries. If every try fails, ``on_failure="raise"`` raises
    :class:`~flowopt.errors.SandboxError` and ``on_failure="empty"`` outputs ``""`` (useful as one
    branch of an ensemble, where a selector ignores empty candidates).

    Example:
        >>> from flowopt.modules import Programmer
        >>> Programmer("question -> answer", timeout_s=2.0).config()
        {'timeout_s': 2.0, 'memory_mb': 512, 'max_attempts': 2, 'on_failure': 'raise'}
    """

    op_name = "Programmer"

    def __init__(self, signature: str | type[dspy.Signature] | SignatureSpec = "question -> answer",
                 instructions: str | None = None, *, timeout_s: float = 5.0, memory_mb: int = 512,
                 max_attempts: int = 2, on_failure: str = "raise") -> None:
        """``instructions``: the task description given to the LM (default: the signature's own).
        ``timeout_s``: the sandboxed run's time limit, in (0, 120] seconds;
        ``memory_mb``: its memory limit (32..16384 MiB); ``max_attempts``: code-writing tries (1..5), each
        shown the previous error; ``on_failure``: ``"raise"`` or ``"empty"`` (an empty answer)."""
        check_settings("Programmer", {"timeout_s": timeout_s, "memory_mb": memory_mb, "max_attempts": max_attempts,
                                      "on_failure": on_failure}, hints=Programmer.__init__,
                       bounds={"timeout_s": above(0, 120), "memory_mb": between(32, 16384),
                               "max_attempts": between(1, 5), "on_failure": one_of(*ON_FAILURE)})
        super().__init__(signature, instructions)
        if len(self._spec.outputs) != 1 or self._spec.outputs[0].type not in ("str", "Any"):
            raise ConfigError("Programmer needs exactly one output field of type str",
                              fix='use a signature like "question -> answer"')
        self.timeout_s, self.memory_mb = float(timeout_s), int(memory_mb)
        self.max_attempts, self.on_failure = max_attempts, on_failure
        self.write_code = dspy.ChainOfThought(extend(
            self._spec,
            instructions=self._spec.instructions or (
                "Write a complete Python 3 program that computes the answer and prints only the final "
                "answer on its last line. Use only the standard library. If previous_error is not empty, "
                "fix the problem it describes."),
            inputs=(FieldSpec("previous_error", "str"),),
            outputs=(FieldSpec("code", "str"),),
        ).to_dspy())

    def config(self) -> dict[str, Any]:
        return {"timeout_s": self.timeout_s, "memory_mb": self.memory_mb,
                "max_attempts": self.max_attempts, "on_failure": self.on_failure}

    def forward(self, **inputs: Any) -> dspy.Prediction:
        error, code = "", ""
        for attempt in range(self.max_attempts):
            code = _strip_fences(self.write_code(**inputs, previous_error=error).code)
            result = run_python(code, timeout_s=self.timeout_s, memory_mb=self.memory_mb)
            answer, error = self._outcome(code, result, attempt)
            if answer is not None:
                return answer
        return self._failed(code, error)

    async def aforward(self, **inputs: Any) -> dspy.Prediction:
        error, code = "", ""
        for attempt in range(self.max_attempts):
            code = _strip_fences((await self.write_code.acall(**inputs, previous_error=error)).code)
            # The sandbox is a subprocess: wait for it in a thread, not on the event loop.
            result = await asyncio.to_thread(run_python, code, timeout_s=self.timeout_s, memory_mb=self.memory_mb)
            answer, error = self._outcome(code, result, attempt)
            if answer is not None:
                return answer
        return self._failed(code, error)

    def _outcome(self, code: str, result: Any, attempt: int) -> tuple[dspy.Prediction | None, str]:
        """``(prediction, "")`` when the run printed an answer, else ``(None, what went wrong)``."""
        lines = [line for line in result.stdout.strip().splitlines() if line.strip()]
        if result.ok and lines:
            return dspy.Prediction(**{self._spec.outputs[0].name: lines[-1].strip()}, code=code), ""
        error = ("timed out" if result.timed_out else result.stderr.strip()[-800:]) or "printed nothing"
        logger.debug("Programmer attempt %d failed: %s", attempt + 1, error)
        return None, error

    def _failed(self, code: str, error: str) -> dspy.Prediction:
        output = self._spec.outputs[0].name
        if self.on_failure == "empty":
            return dspy.Prediction(**{output: ""}, code=code, error=error)
        raise SandboxError(f"Programmer: no attempt of {self.max_attempts} ran successfully; last error: {error}",
                           fix="raise max_attempts/timeout_s, or use on_failure='empty' inside an ensemble")


def _strip_fences(code: str) -> str:
    text = str(code).strip()
    if text.startswith("```"):
        text = text.split("\n", 1)[1] if "\n" in text else ""
        text = text.rsplit("```", 1)[0]
    return text
