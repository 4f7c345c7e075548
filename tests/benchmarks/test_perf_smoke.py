"""Every perf script runs at its ``--smoke`` sizes and writes a results file of the harness's schema.

Slow (``-m slow``): most scripts load the embedded Gemma 3 270M. Each runs as a user runs it,
``python -m flowopt.benchmarks.perf.NAME --smoke --out STEM``, from a temporary folder, so none of them
rots. Scripts whose optional peer is missing (TRL, llama-cpp-python) are skipped with the reason.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from flowopt.benchmarks.perf.harness import read_results

PERF_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "perf"
# Imported by scripts, not run.
SHARED_MODULES = {"__init__", "lm_workload", "grpo_throughput_report", "structure_families", "structure_sim_world",
                  "structure_sim_report",
                  "search_tasks", "search_generalisation_methods", "search_generalisation_report"}


def _lm_throughput(r: dict[str, Any]) -> None:
    assert all(rate > 0 for rate in r["tokens_per_s"].values())
    # Greedy, same prompts and limit: the raw loop and LocalLM produce the same number of tokens.
    assert r["tokens_generated"]["raw"] == r["tokens_generated"]["local_batch1"]


def _parse_rate(r: dict[str, Any]) -> None:
    assert [(c["adapter"], c["module"]) for c in r["configs"]] == [
        ("ChatAdapter", "Predict"), ("ChatAdapter", "ChainOfThought"),
        ("CompletionAdapter", "Predict"), ("CompletionAdapter", "ChainOfThought")]
    assert all(c["questions"] == 1 and c["lm_calls"] >= 1 and 0 <= c["parsed"] <= 1 for c in r["configs"])


def _workflow_overhead(r: dict[str, Any]) -> None:
    assert set(r) == {"chain (3 nodes)", "two branches (4 nodes)"}
    assert all(v["ratio"] > 0 and v["hand_s"]["n"] == 1 for v in r.values())


def _compile_vs_dspy(r: dict[str, Any]) -> None:
    for side in ("dspy_bfrs", "flowopt", "flowopt_defaults"):
        assert 0.0 <= r[side]["val_score"] <= 1.0 and r[side]["lm_calls"] > 0
    assert r["dspy_bfrs"]["candidates"] == 2 + 3  # --candidates 2, plus zero-shot, labeled and unshuffled


def _search_generalisation(r: dict[str, Any]) -> None:
    methods = ["bfrs8", "flowopt8", "flowopt8_extra0", "flowopt8_extra0_anytime", "flowopt_at_bfrs8_calls",
               "mipro_stage", "gepa_stage"]
    assert list(r["summary"]) == methods and r["seeds"] == [0, 1]
    assert all(0.0 <= e["test_expected"] <= 1.0 and e["lm_calls"] > 0 for e in r["summary"].values())
    assert r["summary"]["bfrs8"]["calls_ratio"] == 1.0
    assert all(len(r["per_seed"][m]["lm_calls"]) == 2 for m in methods)
    # Each rule's tie-prune rate at the default level (10%) and at the stricter 5%, as shares of the orders.
    rates = r["tie_prune_rates"]
    assert set(rates) == {"15+15", "35+35"}
    assert all(set(by) == {"0.1", "0.05"} and all(0.0 <= v <= 1.0 for v in by.values())
               for rules in rates.values() for by in rules.values())


def _search_defaults(r: dict[str, Any]) -> None:
    # One seed a shape, every method on it, every comparison paired per shape and over all.
    assert list(r["summary"]) == ["demos_only", "needles", "instructions", "all"]
    methods = {"bfrs16", "mipro_light", "gepa_light", "flowopt_defaults", "bfrs8", "flowopt_bfrs8_candidates",
               "flowopt_bfrs8_candidates_finalists", "flowopt_at_mipro_calls", "flowopt_at_gepa_calls"}
    assert [(s["shape"], set(s["rows"])) for s in r["seeds"]] == [
        (shape, methods) for shape in ("demos_only", "needles", "instructions")]
    for seed in r["seeds"]:  # a budgeted row keeps to the calls of the peer it is measured against
        rows = seed["rows"]
        assert rows["flowopt_at_mipro_calls"]["lm_calls"] <= rows["mipro_light"]["lm_calls"]
        assert rows["flowopt_at_gepa_calls"]["lm_calls"] <= rows["gepa_light"]["lm_calls"]
        assert all(0.0 <= row["test"] <= 1.0 and row["lm_calls"] > 0 for row in rows.values())
        assert rows["flowopt_bfrs8_candidates"]["search"]["fresh_calls"] == 0  # finalists=0, the default
        assert rows["flowopt_bfrs8_candidates_finalists"]["search"]["fresh_calls"] >= 0
    pair = r["summary"]["all"]["pairs"]["flowopt_defaults vs bfrs16"]
    assert pair["n"] == 3 and pair["better"] + pair["equal"] + pair["worse"] == 3


def _search_pruning_replay(r: dict[str, Any]) -> None:
    # One seed a shape from each first seed: every rule raced on the same fully scored candidates.
    rules = r["summary"]["rules"]
    assert list(rules) == ["demos_only", "needles", "instructions", "all"]
    for by_rule in rules.values():
        assert "confidence (default)" in by_rule and len(by_rule) >= 5
        for row in by_rule.values():
            assert 0.0 < row["calls_ratio"] <= 1.0 and row["best_stopped"] == len(row["best_stopped_at"])
    assert rules["all"]["confidence (default)"]["n"] == 6 and rules["needles"]["stratified"]["n"] == 2


def _hotpotqa_sft_vs_trl(r: dict[str, Any]) -> None:
    assert r["pairs"] == 8 and set(r["test"]) == {"baseline", "flowopt", "trl"}
    assert all(row["n"] == 3 and 0.0 <= row["score"] <= 1.0 for row in r["test"].values())
    flowopt, trl = r["train"]["flowopt"], r["train"]["trl"]
    assert flowopt["pairs"] == trl["pairs"] == 8 and flowopt["steps"] == trl["steps"] == 1
    # LoRA's B starts at zero, so the first step's loss is the base model's on the same completion tokens:
    # equal on both sides when they train on the same data with the same loss (bf16 rounding apart).
    assert abs(flowopt["loss_curve"][0] - trl["loss_curve"][0]) < 0.05


def _cpu_bf16_paths(r: dict[str, Any]) -> None:
    for key in ("lora_train_forward_backward_s_float32", "lora_train_forward_backward_s_bfloat16",
                "lora_train_forward_backward_s_bfloat16_without_hook", "lm_head_strided_bf16_frozen_ms"):
        assert r[key] > 0, key
    assert set(r["decode_step_ms_float32"]) == {"1", "8"}


def _decode_profile(r: dict[str, Any]) -> None:
    for key in ("step_ms", "step_matvec_ms", "body_ms", "head_ms", "body_linears_ms", "body_sdpa_ms"):
        assert r[key] > 0, key
    assert r["kernels"]["mm"] > 0 or r["kernels"]["addmm"] > 0  # the body's linears were counted


def _gemma_weights_demo(r: dict[str, Any]) -> None:
    assert all(0.0 <= r[k] <= 1.0 for k in ("base_heldout", "sft_heldout", "grpo_heldout"))
    assert [p["step"] for p in r["grpo_curve"]] == [1]


def _grpo_throughput(r: dict[str, Any]) -> None:
    assert set(r["runs"]) == {"flowopt", "stage", "trl-nockpt"}
    assert all(run["median_step_s"] > 0 for run in r["runs"].values())
    assert set(r["flowopt_vs_trl"]) == {"flowopt vs trl-nockpt", "stage vs trl-nockpt"}
    for impl in ("flowopt", "trl-nockpt"):  # each step split into rollout and update (one timed step: they add up)
        run = r["runs"][impl]
        assert run["median_rollout_s"] > 0 and run["median_update_s"] > 0
        assert run["median_rollout_s"] + run["median_update_s"] == pytest.approx(run["median_step_s"], rel=1e-3)
    assert r["runs"]["flowopt"]["compile_s_per_run"] == [0.0]  # on CPU LocalLM decodes eagerly by default


def _runtime_ab(r: dict[str, Any]) -> None:
    # The smoke run is a self-A/B of grpo_throughput: one run a side, every statistic paired and summarised.
    assert r["measure"] == "grpo" and [run["side"] for run in r["runs"]] == ["before", "after"]
    for stat in ("flowopt_vs_trl", "stage_vs_trl"):
        entry = r["summary"][stat]
        assert entry["before"]["n"] == entry["after"]["n"] == 1 and entry["after"]["median"] > 0


def _grpo_server(r: dict[str, Any]) -> None:
    assert set(r["sides"]) == {"local", "server"} and r["server_vs_local_step_time"] > 0
    assert r["sides"]["server"]["adapters_pushed"] == 2  # one push per step: --steps 2, --repeats 1
    assert r["sides"]["server"]["max_sampler_logprob_gap"] < 1e-4  # float32: it sampled the trained weights


def _serve_streaming(r: dict[str, Any]) -> None:
    assert r["streamed_equals_whole"] and r["streamed_total_s"]["n"] == 1
    assert 0 < r["first_text_s"]["median"] <= r["streamed_total_s"]["median"]


def _llama_cpp_throughput(r: dict[str, Any]) -> None:
    assert all(rate > 0 for rate in r["tokens_per_s"].values())


def _local_lm_cuda(r: dict[str, Any]) -> None:
    assert r["greedy_identical_fp32"] == 8  # batching never changes greedy tokens in float32
    assert r["seeded_alone_vs_batched_identical"] == 4
    assert r["lora_grad_params"] > 0
    assert r["batch_sizes"][-1] > 1  # the 8 concurrent callers were batched


def _cuda_oom_check(r: dict[str, Any]) -> None:
    if r["device"] == "cpu":  # no CUDA here: the check is skipped by name and the compile ran on the CPU
        assert r["cuda_check"].startswith("CUDA is not available") and r["checks"] == {}
        assert r["cpu_run"] == {"baseline_resumed": False, "stop_reason": "done"}
    else:
        assert r["checks"] and all(r["checks"].values()), r["checks"]


def _decode_side_by_side(r: dict[str, Any]) -> None:
    assert set(r["rates"]) == {"1", "4"} and all(rate > 0 for c in r["rates"].values() for rate in c.values())
    # Greedy, same prompts and limit, both stop at EOS: LocalLM and generate produce the same number of tokens.
    assert all(t["local"] == t["generate"] for t in r["tokens"].values())
    assert r["local_decode_stats"]["steps"] > 0
    # The quantized twin decoded (its one-row steps), and its greedy tokens were compared with local's.
    assert r["local-int8_decode_stats"]["decode_path"] == "decode step on cpu: quantized int8 twin"
    assert r["greedy_agreement"]["prompts"] == 2 and 0 <= r["greedy_agreement"]["local-int8"]["identical"] <= 2


def _decode_step_rows(r: dict[str, Any]) -> None:
    assert set(r["ms_per_step"]) == {"1", "2"} and len(r["rounds"]) == 1
    assert all(ms > 0 for row in r["ms_per_step"].values() for ms in row.values())
    # the int8 twin was built and decoded; the exact decoder built none; int4 says why it could not
    # (the tiny model's vocabulary is not a multiple of 16)
    paths = r["decode_paths"]
    assert paths["exact"] is None and paths["int8"] == "decode step on cpu: quantized int8 twin"
    assert "exact weights, although quantize='int4' was asked" in paths["int4"]


def _quantized_task_score(r: dict[str, Any]) -> None:
    assert list(r["settings"]) == ["exact", "int8"] and r["n"] == 2
    assert all(len(row["scores"]) == 2 for row in r["settings"].values())
    # The quantized setting decoded through its twin, one row a step; the exact one through the model.
    assert r["settings"]["int8"]["decode"]["decode_path"] == "decode step on cpu: quantized int8 twin"
    assert r["settings"]["int8"]["decode"]["steps_by_rows"].keys() == {"1"}
    assert r["settings"]["exact"]["decode"]["decode_path"] is None  # no twin asked for, none built
    against = r["against_exact"]["int8"]
    assert against["change"]["n"] == 2 and against["moved"] == against["up"] + against["down"] <= 2


def _weights_distributed(r: dict[str, Any]) -> None:
    # Gold-label SFT on 2 processes trains the 1-process adapter.
    assert r["finetune"]["max_abs_difference"] <= 1e-5 and r["finetune"]["largest_lora_B"] > 0
    assert r["grpo"]["processes_1"] == 1 and r["grpo"]["processes_2"] == 2


def _shared_search(r: dict[str, Any]) -> None:
    assert [(run["workers"], run["killed"]) for run in r["runs"]] == [(1, False), (2, False)]
    for run in r["runs"]:  # every candidate scored exactly once, by the workers together; the same answer
        assert run["exit_codes"] == [0] * run["workers"] and sum(run["scored_here"]) == 6
        assert run["scored_twice"] == run["lost"] == 0 and run["same_program_as_one_worker"]
        assert run["baseline_lm_calls"] == [0] * run["workers"]  # the incumbent's scores, from the study


def _structure_search_sim(r: dict[str, Any]) -> None:
    deceptive = r["families"]["deceptive"]
    assert deceptive["max_evals"] == 25 and deceptive["optimum"] == 0.76
    summary = deceptive["summary"]
    for method in ("search", "random_walk", "hill_climb"):
        assert summary[method]["runs"] == 2 and summary[method]["median_evaluations"] <= 25
        assert 0.0 <= summary[method]["mean_returned_true"] <= 0.76
    assert [(row["method"], row["seed"]) for row in deceptive["runs"]] == [
        (m, s) for m in ("search", "random_walk", "hill_climb") for s in (0, 1)]


def _serve_load(r: dict[str, Any]) -> None:
    assert r["server_errors"] == 0 and r["transport_errors"] == 0  # no 500, no dropped connection
    assert r["answered_share"] == 1.0  # every well-formed, uncancelled request answered
    assert r["malformed_4xx"] == r["kinds"]["malformed"] > 0 and r["kinds"]["cancelled"] > 0
    assert r["rss_bytes"]["end"] > 0 and r["stream_first_chunk_s"]["p50"] is not None


def _gsm8k_calculator_agent(r: dict[str, Any]) -> None:
    assert set(r["untrained"]) == {"react", "cot"}
    assert set(r["seeds"]["0"]) == {"react-terminal", "react-intermediate", "cot-terminal"}
    for row in [*r["untrained"].values(), *r["seeds"]["0"].values()]:
        assert len(row["scores"]) == 3 and row["ci"][0] <= row["score"] <= row["ci"][1]
    intermediate = r["seeds"]["0"]["react-intermediate"]["curve"][0]
    assert intermediate["tool_calls"] >= 0 and "intermediate_reward" in intermediate


# script -> (modules it needs beyond flowopt's dependencies, checks of its results)
SCRIPTS: dict[str, tuple[tuple[str, ...], Callable[[dict[str, Any]], None]]] = {
    "workflow_overhead": ((), _workflow_overhead),
    "compile_vs_dspy": ((), _compile_vs_dspy),
    "search_generalisation": ((), _search_generalisation),
    "search_defaults": ((), _search_defaults),
    "search_pruning_replay": ((), _search_pruning_replay),
    "lm_throughput": ((), _lm_throughput),
    "decode_side_by_side": ((), _decode_side_by_side),
    "quantized_task_score": ((), _quantized_task_score),
    "decode_step_rows": ((), _decode_step_rows),
    "hotpotqa_sft_vs_trl": (("trl",), _hotpotqa_sft_vs_trl),
    "parse_rate": ((), _parse_rate),
    "cpu_bf16_paths": ((), _cpu_bf16_paths),
    "decode_profile": ((), _decode_profile),
    "gemma_weights_demo": ((), _gemma_weights_demo),
    "grpo_throughput": (("trl",), _grpo_throughput),
    "grpo_server": ((), _grpo_server),
    "serve_streaming": ((), _serve_streaming),
    "llama_cpp_throughput": (("llama_cpp",), _llama_cpp_throughput),
    "local_lm_cuda": ((), _local_lm_cuda),
    "cuda_oom_check": ((), _cuda_oom_check),
    "runtime_ab": (("trl",), _runtime_ab),
    "weights_distributed": ((), _weights_distributed),
    "shared_search": (("psycopg",), _shared_search),  # and PostgreSQL's initdb (CI installs it)
    "structure_search_sim": ((), _structure_search_sim),
    "serve_load": ((), _serve_load),
    "gsm8k_calculator_agent": ((), _gsm8k_calculator_agent),
}


def test_every_perf_script_has_a_smoke_case():
    scripts = {p.stem for p in PERF_DIR.glob("*.py")} - SHARED_MODULES
    assert scripts == set(SCRIPTS)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_script_runs_at_smoke_size(name: str, tmp_path: Path) -> None:
    needs, check = SCRIPTS[name]
    for module in needs:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{name} needs {module}, which is not installed")
    stem = tmp_path / "out" / name
    command = [sys.executable, "-m", f"flowopt.benchmarks.perf.{name}", "--smoke", "--out", str(stem)]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]

    payload = read_results(stem)  # checks the schema
    assert payload["script"] == name and payload["settings"]["smoke"] is True
    assert payload["command"] == f"python -m flowopt.benchmarks.perf.{name} --smoke --out {stem}"
    check(payload["results"])
    markdown = (stem.parent / f"{name}.md").read_text()
    assert markdown.startswith(f"# {payload['title']}\n") and payload["command"] in markdown
    assert "|---" in markdown  # the script's table
    for image in re.findall(r"!\[[^]]*\]\(([^)]+)\)", markdown):  # figures it links sit beside it
        assert (stem.parent / image).is_file(), image
    if name == "gemma_weights_demo":
        assert (stem.parent / f"{name}_reward_curve.png").is_file()
    if name == "search_generalisation":  # the per-seed rows, every candidate of the detailed runs
        seeds = json.loads((stem.parent / payload["results"]["seeds_file"]).read_text())["seeds"]
        lines = seeds[0]["rows"]["flowopt8_extra0"]["search"]["candidates"]
        assert len(lines) == 11 and any("pruned: " in line and "whole valset" in line for line in lines)
