"""A weights stage that runs out of memory stops with the settings to lower, and resumes with them lowered.

A real allocation failure, no mocks: the worker process caps its own address space (RLIMIT_AS) when
training starts, so a micro-batch of 12 sequences of about 1,500 tokens cannot be allocated while a
micro-batch of one can. See ``oom_worker.py``. Slow suite: the default suite covers the same stops and
resumes in process, with a real allocator failure injected while a micro-batch above one trains
(``tests/optimizers/weights/test_weights_out_of_memory.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("oom_worker.py")


def _run_worker(tmp_path: Path, stage: str) -> dict:
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "DSPY_CACHEDIR": str(tmp_path / "dspy-cache")}
    if stage == "grpo":  # a fixed mmap threshold: glibc returns a freed large block to the system at once, so
        env["MALLOC_MMAP_THRESHOLD_"] = str(2**20)  # the address space when the cap lands holds no freed step 1
    done = subprocess.run([sys.executable, str(WORKER), str(tmp_path / "run"), str(tmp_path / "seen.json"), stage],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((tmp_path / "seen.json").read_text())


@pytest.mark.slow
def test_finetune_out_of_memory_names_the_settings_and_resumes_with_a_smaller_micro_batch(tmp_path):
    """Fast counterpart: test_finetune_out_of_memory_keeps_the_baseline_and_resumes_with_a_smaller_micro_batch."""
    seen = _run_worker(tmp_path, "finetune")
    error = seen["error"]
    assert error is not None, "the micro-batch of 12 fitted under the cap: the test's headroom is too large"
    assert error["message"].startswith("finetune ran out of memory")
    assert "micro_batch_size=12 -> 6" in error["message"] and "gradient_checkpointing=True" in error["message"]
    assert "batch_size (now 12)" in error["message"] and "max_length (now 2048)" in error["message"]
    assert error["settings"] == {"micro_batch_size": 12, "micro_batch_tokens": None, "gradient_checkpointing": False,
                                 "batch_size": 12, "max_length": 2048}
    assert seen["files_after_error"] == ["compile.json"]  # the baseline is kept; nothing half-written
    resumed = seen["resumed"]
    assert resumed["baseline_resumed"]  # the resumed run kept the baseline instead of scoring it again
    assert resumed["finetune"]["stop_reason"] == "done" and resumed["adapter_saved"]


@pytest.mark.slow
def test_grpo_out_of_memory_keeps_its_checkpoint_and_resumes_with_a_smaller_micro_batch(tmp_path):
    """GRPO's second step does not fit under the cap; the first step's checkpoint does, and the resumed run
    trains only step 2. Fast counterpart:
    test_grpo_out_of_memory_names_the_settings_keeps_its_checkpoint_and_resumes."""
    seen = _run_worker(tmp_path, "grpo")
    error = seen["error"]
    assert error is not None, "the micro-batch of 12 fitted under the cap: the test's headroom is too large"
    assert error["message"].startswith("grpo (step 2) ran out of memory")
    assert "the checkpoint after 1 steps is intact" in error["message"]
    assert "micro_batch_size=12 -> 6" in error["message"] and "gradient_checkpointing=True" in error["message"]
    assert "group_size (now 4)" in error["message"] and "batch_size (now 3)" in error["message"]
    assert error["settings"] == {"micro_batch_size": 12, "micro_batch_tokens": None, "gradient_checkpointing": False,
                                 "batch_size": 3, "group_size": 4, "max_new_tokens": 2}
    files = seen["files_after_error"]
    assert "compile.json" in files and "stages/00-grpo/checkpoint-1/learner.pt" in files
    assert "stages/00-grpo/checkpoint-1/adapter/adapter_model.safetensors" in files
    assert "stages/00-grpo/output.json" not in files and "report.json" not in files  # the stage is not finished
    resumed = seen["resumed"]
    assert resumed["updates"] == [12, 12, 1]  # step 1 trained once; the resumed run trained step 2 only
    assert resumed["baseline_resumed"] and resumed["grpo"]["stop_reason"] == "steps" and resumed["adapter_saved"]
    assert resumed["grpo"]["info"]["steps_done"] == 2
