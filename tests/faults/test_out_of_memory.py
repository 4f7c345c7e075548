"""A weights stage that runs out of memory stops with the settings to lower, and resumes with them lowered.

A real allocation failure, no mocks: the worker process caps its own address space (RLIMIT_AS) when
training starts, so a micro-batch of 12 sequences of about 1,500 tokens cannot be allocated while a
micro-batch of one can. See ``oom_worker.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("oom_worker.py")


def test_finetune_out_of_memory_names_the_settings_and_resumes_with_a_smaller_micro_batch(tmp_path):
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "DSPY_CACHEDIR": str(tmp_path / "dspy-cache")}
    done = subprocess.run([sys.executable, str(WORKER), str(tmp_path / "run"), str(tmp_path / "seen.json")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    seen = json.loads((tmp_path / "seen.json").read_text())
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
