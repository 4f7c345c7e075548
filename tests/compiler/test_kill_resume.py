"""Kill a compile with SIGKILL in the middle of the search, resume it, compare with an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = Path(__file__).with_name("kill_worker.py")


def _start(tmp: Path, tag: str, cache: Path, *, resume: bool = False) -> tuple[subprocess.Popen, Path, Path]:
    log, out = tmp / f"{tag}.calls", tmp / f"{tag}.json"
    env = {**os.environ, "DSPY_CACHEDIR": str(cache)}
    args = [sys.executable, str(WORKER), str(tmp / f"run-{tag.split('-')[0]}"), str(log), str(out)]
    proc = subprocess.Popen([*args, *(["--resume"] if resume else [])], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return proc, log, out


def _calls(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


def test_kill_in_search_then_resume_equals_uninterrupted_and_pays_nothing_twice(tmp_path):
    # Reference: one uninterrupted run with its own empty DSPy cache.
    proc, ref_log, ref_out = _start(tmp_path, "ref", Path(tempfile.mkdtemp(dir=tmp_path)))
    assert proc.wait(timeout=120) == 0, proc.stdout.read().decode()
    ref = json.loads(ref_out.read_text())
    ref_calls = _calls(ref_log)
    before_search = sum(r["lm_calls"] for r in ref["report"]["stages"] if r["name"] != "search")
    kill_at = before_search + (len(ref_calls) - before_search) // 2
    assert len(ref_calls) - before_search > 20  # the search does real work, so the kill lands inside it

    cache = Path(tempfile.mkdtemp(dir=tmp_path))
    proc, killed_log, _ = _start(tmp_path, "job-killed", cache)
    deadline = time.monotonic() + 120
    while len(_calls(killed_log)) < kill_at and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    killed = _calls(killed_log)
    assert before_search <= len(killed) < len(ref_calls)
    assert (tmp_path / "run-job" / "stages" / "01-search" / "search.journal").exists()

    proc, resumed_log, resumed_out = _start(tmp_path, "job-resumed", cache, resume=True)
    assert proc.wait(timeout=120) == 0, proc.stdout.read().decode()
    resumed = json.loads(resumed_out.read_text())
    resumed_calls = _calls(resumed_log)

    assert resumed["program"] == ref["program"]  # the same final program as the uninterrupted run
    assert not set(killed) & set(resumed_calls)  # nothing paid before the kill is paid again
    assert len(killed) + len(resumed_calls) == len(ref_calls)
    rows = {r["name"]: r for r in resumed["report"]["stages"]}
    assert rows["baseline"]["resumed"] and rows["demos"]["resumed"]
    assert rows["search"]["candidates_tried"] == ref["report"]["stages"][2]["candidates_tried"]
