"""What the sandbox escape tests share: running hostile code, starting a process inside without an audit
event, and finding or killing host processes by a marker in their command line."""

from __future__ import annotations

import contextlib
import os
import signal
import textwrap
from pathlib import Path

from flowopt.modules.sandbox import run_python

REPO = Path(__file__).resolve().parents[2]
# Starts a process from inside the sandbox without touching subprocess/os.fork (no audit event).
SPAWN = """
import multiprocessing.util, os, sys
def spawn(argv):
    argv = [os.fsencode(a) for a in argv]
    return multiprocessing.util.spawnv_passfds(argv[0], argv, (1, 2))
"""


def run(code: str, **kwargs):
    kwargs.setdefault("timeout_s", 5.0)
    return run_python(textwrap.dedent(code), **kwargs)


def alive_with(marker: str) -> list[int]:
    """Host processes whose command line holds ``marker``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                pass
    return [p for p in pids if p != os.getpid()]


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


