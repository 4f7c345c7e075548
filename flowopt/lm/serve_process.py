"""Run ``flowopt serve`` in a child process on a free loopback port, and wait until it answers.

Tests and benchmarks that talk to the server over HTTP start it this way, so each of them does not
grow its own copy of the start-up, readiness poll and shutdown.

Example:
    >>> from flowopt.lm.serve_process import serve_subprocess
    >>> serve_subprocess.__name__
    'serve_subprocess'
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from flowopt.errors import LMError
from flowopt.ports import free_port

MODULE = ("-m", "flowopt.lm.serve")  # the interpreter arguments that start the server


@dataclass(frozen=True)
class ServedProcess:
    """A running ``flowopt serve``: its base URL (``http://127.0.0.1:PORT/v1``) and its process."""

    base: str
    process: subprocess.Popen


@contextlib.contextmanager
def serve_subprocess(model: Path | str, *options: str, log: Path, entry: Sequence[str] = MODULE,
                     env: Mapping[str, str] | None = None, cwd: Path | None = None,
                     start_timeout_s: float = 180.0) -> Iterator[str]:
    """Serve ``model`` with ``options`` on 127.0.0.1 and yield the base URL (``http://127.0.0.1:PORT/v1``).

    The server's output goes to ``log``; one that exits or does not answer ``/v1/models`` within
    ``start_timeout_s`` raises :class:`~flowopt.errors.LMError` quoting the log. The server is stopped
    on exit. ``env`` adds variables to this process's environment (e.g. ``OMP_NUM_THREADS``).
    """
    with serve_process(model, *options, log=log, entry=entry, env=env, cwd=cwd,
                       start_timeout_s=start_timeout_s) as served:
        yield served.base


@contextlib.contextmanager
def serve_process(model: Path | str, *options: str, log: Path, entry: Sequence[str] = MODULE,
                  env: Mapping[str, str] | None = None, cwd: Path | None = None,
                  start_timeout_s: float = 180.0) -> Iterator[ServedProcess]:
    """As :func:`serve_subprocess`, yielding the process too (to signal it); stopped on exit if still running."""
    import httpx

    port = free_port()
    command = [sys.executable, *entry, str(model), "--port", str(port), *options]
    with log.open("w") as handle:
        proc = subprocess.Popen(command, cwd=cwd, env={**os.environ, **(env or {})}, stdout=handle,
                                stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                httpx.get(f"{base}/models", timeout=5).raise_for_status()
                break
            except httpx.HTTPError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise LMError(f"flowopt serve did not start on port {port}:\n{log.read_text()[-3000:]}",
                                  fix="read the server's log above; check the model folder and the options") from None
                time.sleep(0.3)
        yield ServedProcess(base, proc)
    finally:
        if proc.poll() is None:
            proc.terminate()  # SIGTERM: the server finishes what is in flight (flowopt.lm.serve_lifecycle)
        proc.wait(timeout=30)
