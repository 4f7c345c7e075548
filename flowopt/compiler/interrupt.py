"""SIGTERM and Ctrl-C during a compile: stop at the next safe point, keep the checkpoints, resume later.

Schedulers (Slurm, Kubernetes, systemd) send SIGTERM and wait a grace period before SIGKILL; a user
presses Ctrl-C. Either way the work paid for so far must survive. While :func:`stop_on_signals` is active
(``compile()`` holds it on the main thread), the first SIGINT or SIGTERM only asks the run to stop: the
budget tracker then refuses the next LM call as if a limit had been reached (``"interrupted"``), so each
stage stops where it would stop on an exhausted budget, with its checkpoints written; ``compile()`` then
records nothing of the interrupted stage as finished and raises :class:`~flowopt.errors.Interrupted`,
whose ``exit_code`` is the shell's ``128 + signal`` (130 for SIGINT, 143 for SIGTERM). A second signal
stops at once, as it would without flowopt.

Example:
    >>> with stop_on_signals(lambda name: None) as request:
    ...     request.signal is None
    True
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass
class StopRequest:
    """Which signal asked the run to stop (``"SIGINT"``, ``"SIGTERM"``), or ``None``."""

    signal: str | None = None
    number: int = 0


@contextlib.contextmanager
def stop_on_signals(on_stop: Callable[[str], None]) -> Iterator[StopRequest]:
    """Within the block, the first SIGINT/SIGTERM calls ``on_stop(name)`` instead of stopping the process.

    Outside the main thread (where Python cannot install handlers) nothing is installed. The handlers
    in force before the block are restored after it, and after the first signal, so that a second one
    behaves as it would without flowopt (Ctrl-C raises ``KeyboardInterrupt``, SIGTERM ends the process).
    """
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous: dict[int, Any] = {sig: signal.getsignal(sig) for sig in SIGNALS}

    def handle(number: int, frame: FrameType | None) -> None:
        name = signal.Signals(number).name
        request.signal, request.number = name, number
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        logger.warning("%s received: stopping at the next safe point (checkpoints are kept; resume continues "
                       "the run). Send it again to stop at once.", name)
        on_stop(name)

    for wanted in SIGNALS:
        signal.signal(wanted, handle)
    try:
        yield request
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
