"""Run untrusted, LM-written Python in a separate, locked-down process.

Layers of protection (each one is tested):

- a separate interpreter (``python -I``), never ``exec`` in the caller's process;
- a wall-clock timeout that kills the whole process group, plus an ``RLIMIT_CPU`` backstop;
- ``RLIMIT_AS`` (memory), ``RLIMIT_FSIZE`` (file size) and ``RLIMIT_NOFILE`` limits;
- a fresh temporary working directory, deleted afterwards, and an empty environment;
- no network: a new network namespace when the kernel allows an unprivileged one, and in every case
  a PEP 578 audit hook, installed before the code runs and impossible to remove from Python, that
  refuses sockets, subprocesses, ``ctypes`` and any write outside the working directory.

This is defence in depth for code written by an LM for a benchmark question, not a container: run
hostile code under an OS-level sandbox.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Runs inside the child before the user's code. Audit hooks cannot be removed once added.
_GUARD = r'''
import os, sys
_ROOT = os.path.realpath(os.getcwd())
_DENY = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
         "os.forkpty", "pty.", "ctypes.", "_ctypes.", "os.kill", "signal.", "resource.setrlimit",
         "sys.addaudithook", "sys.setprofile", "sys.settrace", "urllib.", "http.", "ftplib.",
         "smtplib.", "webbrowser.", "os.putenv", "os.unsetenv")
_PATH_EVENTS = {"os.remove": 0, "os.rename": 0, "os.replace": 0, "os.mkdir": 0, "os.rmdir": 0,
                "os.chmod": 0, "os.chown": 0, "os.symlink": 1, "os.link": 1, "os.truncate": 0,
                "os.utime": 0, "shutil.rmtree": 0, "shutil.copyfile": 1, "shutil.move": 1}

def _inside(path):
    if isinstance(path, int):
        return True
    try:
        real = os.path.realpath(os.fsdecode(path))
    except Exception:
        return False
    return real == _ROOT or real.startswith(_ROOT + os.sep)

def _guard(event, args):
    if event.startswith(_DENY) or event == "socket":
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = args
        writing = (mode is not None and any(c in mode for c in "wax+")) or (
            flags is not None and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND))
        if writing and not _inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the working directory is not allowed")
    elif event in _PATH_EVENTS:
        if not _inside(args[_PATH_EVENTS[event]]) or (event in ("os.rename", "os.replace")
                                                      and not _inside(args[1])):
            raise PermissionError(f"sandbox: {event} outside the working directory is not allowed")

# Import what the user code commonly needs before the hook closes the door on native loading.
import math, fractions, decimal, statistics, itertools, functools, collections, re, json, datetime  # noqa
sys.addaudithook(_guard)
_code = open("main.py", encoding="utf-8").read()
del sys.modules["os"].environ  # nothing secret is there, but there is nothing to read either
exec(compile(_code, "main.py", "exec"), {"__name__": "__main__"})
'''

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run produced. ``ok`` is True when it exited with status 0 in time."""

    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def _limit_child(memory_mb: int, cpu_s: int) -> None:  # runs in the child between fork and exec
    import ctypes
    import resource

    os.setsid()
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb * 2**20, memory_mb * 2**20))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 2**20, 16 * 2**20))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # A private network namespace has only a down loopback: no route anywhere. Unprivileged user
    # namespaces are off on some hosts; the audit hook still refuses sockets there.
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        libc.unshare(CLONE_NEWUSER | CLONE_NEWNET)


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512) -> SandboxResult:
    """Run ``code`` in a sandboxed child interpreter and capture its output.

    Example:
        >>> run_python("print(6 * 7)").stdout.strip()
        '42'
    """
    with tempfile.TemporaryDirectory(prefix="flowopt-sandbox-") as workdir:
        Path(workdir, "main.py").write_text(code, encoding="utf-8")
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _GUARD],
            cwd=workdir, env={"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir},
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=lambda: _limit_child(memory_mb, max(1, int(timeout_s) + 1)),
        )
        try:
            out, err = proc.communicate(timeout=timeout_s)
            return SandboxResult(out, err, proc.returncode, timed_out=False)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            return SandboxResult(out, err, None, timed_out=True)
