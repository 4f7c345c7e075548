"""SIGTERM and Ctrl-C (SIGINT) during a compile: a safe stop, a distinct exit status, and a resume equal to
the uninterrupted run.

In this process (the default suite): the scripted LM itself sends a real signal to the main thread at its
n-th call, so it lands inside ``compile()``. In a worker process (``signal_worker.py``, slow suite: the
same stop path, plus a process's exit status and start-up): the test sends the signal once the worker has
made a given number of LM calls (the call log is the clock). Both compile demos then a search, check the
run folder, then resume and compare with an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from flowopt.errors import Interrupted

WORKER = Path(__file__).with_name("signal_worker.py")


def _run(tmp: Path, tag: str, run_dir: Path, *, resume: bool = False, signal_at: tuple[int, int] | None = None):
    """Run the worker; its exit status, output, compiled program (or None) and real LM calls. Runs on one
    ``run_dir`` share one DSPy cache, as a rerun on the same machine does."""
    calls, out = tmp / f"{tag}.calls", tmp / f"{tag}.json"
    env = {**os.environ, "FLOWOPT_TEST_CALL_LOG": str(calls), "DSPY_CACHEDIR": str(run_dir.parent / "dspy-cache")}
    proc = subprocess.Popen([sys.executable, str(WORKER), str(run_dir), str(out), *(["--resume"] if resume else [])],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if signal_at is not None:
        number, after_calls = signal_at
        deadline = time.monotonic() + 180
        while (len(calls.read_text().splitlines()) if calls.exists() else 0) < after_calls:
            assert proc.poll() is None, f"the run ended before call {after_calls}: {proc.communicate()[0][-2000:]}"
            assert time.monotonic() < deadline, "no LM calls"
            time.sleep(0.01)
        proc.send_signal(number)
    output = proc.communicate(timeout=300)[0]
    made = len(calls.read_text().splitlines()) if calls.exists() else 0
    return proc.returncode, output, (out.read_text() if out.exists() else None), made


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[str, int]:
    tmp = tmp_path_factory.mktemp("reference")
    code, output, program, calls = _run(tmp, "reference", tmp / "run")
    assert code == 0, output[-3000:]
    return program, calls


# The task's baseline makes 24 LM calls, the demos stage about 15, the search the rest.
CASES = [(signal.SIGTERM, 60, "search"), (signal.SIGINT, 5, "baseline")]


@pytest.mark.parametrize(("number", "at_call", "where"), CASES)
def test_a_signal_in_process_stops_at_a_safe_point_and_resume_equals_the_uninterrupted_run(tmp_path, number,
                                                                                          at_call, where):
    from tests.faults.disk_full_worker import compile_task

    model = f"scripted/fault-{uuid.uuid4().hex[:8]}"  # DSPy's disk cache is shared by the test session
    calls = {"stopped": 0, "resumed": 0, "reference": 0}

    def counted(run: str, signal_at: int = 0):
        def on_call(n: int) -> None:
            calls[run] = n
            if n == signal_at:  # a real signal, to the thread Python runs handlers on
                signal.pthread_kill(threading.main_thread().ident, number)
        return on_call

    run_dir, name, before = tmp_path / "run", signal.Signals(number).name, signal.getsignal(number)
    with pytest.raises(Interrupted) as caught:
        compile_task(run_dir, latency_s=0.005, model=model, on_call=counted("stopped", at_call))
    assert caught.value.signal == name and caught.value.exit_code == 128 + number  # 143 / 130
    assert f"compile stopped by {name} at a safe point" in str(caught.value) and "resume" in str(caught.value)
    assert signal.getsignal(number) is before  # a signal after compile() behaves as without flowopt
    for path in run_dir.rglob("*.json"):  # every file left is whole
        json.loads(path.read_text())
    demos_done = (run_dir / "stages" / "00-demos" / "output.json").exists()
    assert demos_done == (where == "search")  # the demos stage finished before a signal in the search only
    assert not (run_dir / "stages" / "01-search" / "output.json").exists()  # the search is not marked finished
    resumed = compile_task(run_dir, resume=True, latency_s=0.005, model=model, on_call=counted("resumed"))
    reference = compile_task(tmp_path / "reference", latency_s=0.005, model=f"{model}-reference",
                             on_call=counted("reference"))
    assert resumed == reference  # canonical JSON of the resumed run = the uninterrupted run's
    assert calls["stopped"] + calls["resumed"] - calls["reference"] <= 2  # at most the calls in flight (2 threads)


@pytest.mark.slow
@pytest.mark.parametrize(("number", "after_calls", "where"), CASES)
def test_a_signal_stops_at_a_safe_point_and_resume_equals_the_uninterrupted_run(reference, tmp_path, number,
                                                                               after_calls, where):
    """In a worker process. Fast counterpart:
    test_a_signal_in_process_stops_at_a_safe_point_and_resume_equals_the_uninterrupted_run."""
    run_dir = tmp_path / "run"
    code, output, program, stopped_calls = _run(tmp_path, "stopped", run_dir, signal_at=(number, after_calls))
    name = signal.Signals(number).name
    assert code == 128 + number, output[-3000:]  # 143 for SIGTERM, 130 for SIGINT: distinct from errors (1, 2)
    assert program is None and f"compile stopped by {name} at a safe point" in output
    assert "--resume" in output and "Traceback" not in output
    for path in run_dir.rglob("*.json"):  # every file left is whole
        json.loads(path.read_text())
    if where == "search":
        assert (run_dir / "stages" / "00-demos" / "output.json").exists()  # finished before the signal
        assert not (run_dir / "stages" / "01-search" / "output.json").exists()  # not marked finished
    code, output, program, resumed_calls = _run(tmp_path, "resumed", run_dir, resume=True)
    assert code == 0, output[-3000:]
    reference_program, reference_calls = reference
    assert program == reference_program  # canonical JSON of the resumed run = the uninterrupted run's
    # Calls paid twice: at most those in flight when the signal came (the worker runs 2 threads). The
    # difference can be negative: two threads asking one request at once both miss DSPy's cache, and how
    # often that happens differs from run to run.
    repeated = stopped_calls + resumed_calls - reference_calls
    print(f"{name} in the {where}: {stopped_calls} + {resumed_calls} calls against {reference_calls}")
    assert repeated <= 2
