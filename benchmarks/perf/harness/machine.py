"""The machine record written beside every timing: CPU, memory, library versions, git commit, load.

Versions are read from the installed distributions' metadata, so recording them imports nothing heavy;
torch's thread count and GPU are recorded only when the script has imported torch itself.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[3]
# Distributions whose versions decide a timing; missing ones are recorded as None.
PACKAGES = ("flowopt", "torch", "transformers", "peft", "dspy", "litellm", "optuna", "numpy", "trl",
            "llama-cpp-python")


def load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages, rounded to 2 decimals."""
    return [round(x, 2) for x in os.getloadavg()]


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else what ``platform`` knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gib() -> float | None:
    """Physical memory in GiB, or None where the OS does not say."""
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_commit(root: Path = REPO_ROOT) -> dict[str, Any] | None:
    """``{"commit": sha, "dirty": bool}`` of the checkout the scripts run from; None outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


def torch_record() -> dict[str, Any]:
    """torch's threads and GPU, when the script imported torch (never imports it here)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    record: dict[str, Any] = {"torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        record["gpu"] = torch.cuda.get_device_name()
    return record


_READ_NOW: Any = object()


def machine_record(git: Any = _READ_NOW) -> dict[str, Any]:
    """What the machine was: the fields every results file carries under ``machine``; ``git``: the
    checkout's state as read earlier (:func:`git_commit`), else it is read now.

    Example:
        >>> record = machine_record()
        >>> sorted(record)[:3]
        ['cpu_count', 'cpu_model', 'cpus_usable']
    """
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "cpus_usable": usable,
            "memory_gib": memory_gib(), "platform": platform.platform(), "python": platform.python_version(),
            "versions": package_versions(), "git": git_commit() if git is _READ_NOW else git, **torch_record()}


def describe_machine(record: dict[str, Any]) -> str:
    """One markdown line for a results file: CPU, memory, Python, the installed versions, the commit."""
    versions = ", ".join(f"{name} {version}" for name, version in record["versions"].items()
                         if version is not None and name != "flowopt")
    parts = [f"{record['cpu_model']}, {record['cpu_count']} CPUs ({record['cpus_usable']} usable), "
             f"{record['memory_gib']} GiB", record["platform"], f"Python {record['python']}"]
    if "torch_threads" in record:
        parts.append(f"{record['torch_threads']} torch thread(s)")
    if "gpu" in record:
        parts.append(f"GPU {record['gpu']}")
    parts.append(versions)
    git = record.get("git")
    if git:
        parts.append(f"commit {git['commit'][:10]}{' (with uncommitted changes)' if git['dirty'] else ''}")
    return "; ".join(parts)
