"""The weights stages on 2 processes (gloo on CPU over 127.0.0.1, each process started with the environment
torchrun / accelerate launch set) train the same adapter as one process with the same global batch and
seed: max abs difference <= 1e-5 in float32. ``benchmarks/perf/weights_distributed.py`` runs the real
``accelerate launch`` command."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowopt.errors import ConfigError
from flowopt.optimizers.weights import GRPO, BootstrapFinetune
from flowopt.optimizers.weights.distributed import World
from flowopt.ports import free_port

WORKER = Path(__file__).parent / "ddp_worker.py"


def _worker():
    spec = importlib.util.spec_from_file_location("ddp_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _launch(kinds: list[str], out: Path, processes: int = 2) -> dict[str, dict]:
    """Start the worker ``processes`` times with the environment a launcher (torchrun, accelerate launch)
    gives each process: gloo over 127.0.0.1 on a free port."""
    port = free_port()
    workers = [subprocess.Popen([sys.executable, str(WORKER), *kinds, str(out)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
                                     "WORLD_SIZE": str(processes), "LOCAL_WORLD_SIZE": str(processes),
                                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
               for rank in range(processes)]
    try:
        logs = [w.communicate(timeout=240)[0] for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    assert [w.returncode for w in workers] == [0] * processes, "\n".join(log[-3000:] for log in logs)
    return {kind: json.loads((out / f"{kind}.json").read_text()) for kind in kinds}


def _adapter(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter" / "adapter_model.safetensors"))


def _max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_two_processes_train_the_adapters_one_process_trains(tmp_path):
    worker = _worker()
    one = {kind: worker.run(kind, tmp_path / "one", resume=False) for kind in ("sft", "grpo")}
    two = _launch(["sft", "grpo"], tmp_path / "two")
    for kind in ("sft", "grpo"):
        reference, distributed = _adapter(tmp_path / "one" / kind), _adapter(tmp_path / "two" / kind)
        assert two[kind]["processes"] == 2
        # The adapter moved from its start (B is initialised to zero), and the same way in both runs.
        assert max(float(v.abs().max()) for k, v in reference.items() if "lora_B" in k) > 1e-4
        assert _max_difference(reference, distributed) <= 1e-5, kind
    sft_one, sft_two = one["sft"]["info"], two["sft"]["info"]
    assert sft_two["pairs"] == sft_one["pairs"] == 9
    assert sft_two["loss_curve"] == pytest.approx(sft_one["loss_curve"], abs=1e-5)
    grpo_one, grpo_two = one["grpo"], two["grpo"]
    # 2 steps, then a resumed run that sampled only the third step's rollouts (on each rank).
    assert grpo_two["rollout_calls"] == [2, 3] and grpo_one["rollout_calls"] == [3]
    assert [p["step"] for p in grpo_two["info"]["reward_curve"]] == [1, 2, 3]
    for ours, theirs in zip(grpo_two["info"]["reward_curve"], grpo_one["info"]["reward_curve"]):
        # Rewards gathered across the ranks: the whole batch's numbers, as one process sees them.
        for key in ("mean_reward", "reward_std", "completion_tokens", "transitions", "loss", "kl", "grad_norm"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key
    assert grpo_two["info"]["processes"] == 2


@pytest.mark.slow
def test_a_launched_compile_writes_its_run_folder_once_and_resumes(tmp_path):
    compiled = _launch(["compile"], tmp_path)["compile"]
    # Rank 1 did not take rank 0's fresh manifest for a leftover run (it would have stopped with an error),
    # and on resume both skipped the finished stage (one running it alone would wait for the other forever).
    assert compiled["resumed"] == [False, True] and compiled["info"]["pairs"] == 8
    assert (tmp_path / "compile" / "run" / "program.json").is_file()


def test_world_shares_are_contiguous_and_cover_every_item():
    shares = [World(rank, 3).share(8) for rank in range(3)]
    assert [list(s) for s in shares] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert list(World(1, 2).share(1)) == []


def test_a_batch_that_does_not_split_over_the_processes_is_refused(monkeypatch, tiny_local, task):
    import dspy

    from flowopt.optimizers.weights import grpo, sft

    for stage_module in (grpo, sft):  # as if launched on 4 processes
        monkeypatch.setattr(stage_module, "current_world", lambda: World(0, 4))
    program = dspy.Predict("noise, cue -> word")
    program.lm = tiny_local.lm
    ctx = task.ctx(task.examples(4, seed=1), [])
    with pytest.raises(ConfigError, match=r"batch_size x group_size .* is 6, which does not split evenly over 4"):
        GRPO(batch_size=3, group_size=2).run(program, ctx)
    with pytest.raises(ConfigError, match=r"batch_size is 6, which does not split evenly over 4 processes"):
        BootstrapFinetune(labels="only", batch_size=6).run(program, ctx)
