"""The perf harness: --out/--smoke parsing, interleaved timing, the machine record and the results files."""

from __future__ import annotations

import ast
import json
import logging
import re
import shlex
import subprocess
import sys
import textwrap

import dspy
import pytest

from flowopt.benchmarks.perf.harness import (
    SCHEMA,
    Goal,
    PerfParser,
    interleaved,
    machine_record,
    markdown_table,
    read_results,
    spread,
    start_run,
    timed,
)
from flowopt.benchmarks.perf.harness.cli import NOISY_LOGGERS
from flowopt.benchmarks.perf.harness.machine import REPO_ROOT, package_versions
from flowopt.errors import DataError


def _parser() -> PerfParser:
    parser = PerfParser("toy_bench", "A toy benchmark.\n\nMore text.", smoke={"repeats": 1, "size": 3})
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--size", type=int, default=100)
    return parser


def test_smoke_switches_defaults_and_explicit_options_win():
    parser = _parser()
    assert (parser.parse_args([]).repeats, parser.parse_args([]).size) == (4, 100)
    smoke = parser.parse_args(["--smoke"])
    assert (smoke.repeats, smoke.size, smoke.smoke) == (1, 3, True)
    assert parser.parse_args(["--smoke", "--size", "7"]).size == 7
    assert parser.parse_args([]).size == 100  # the smoke sizes did not stick to the parser


def test_smoke_sizes_must_name_options():
    parser = PerfParser("toy_bench", None, smoke={"repeatz": 1})
    parser.add_argument("--repeats", type=int, default=4)
    with pytest.raises(ValueError, match="repeatz"):
        parser.parse_args([])


def test_out_is_a_file_stem(tmp_path, capsys):
    assert _parser().parse_args(["--out", str(tmp_path / "x")]).out == tmp_path / "x"
    with pytest.raises(SystemExit) as folder:
        _parser().parse_args(["--out", str(tmp_path)])
    assert folder.value.code == 2
    assert f"pass {tmp_path / 'toy_bench'}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parser().parse_args(["--out", str(tmp_path / "x.json")])
    assert "file stem" in capsys.readouterr().err


def test_interleaved_alternates_the_cases_and_drops_warmup_rounds():
    calls: list[str] = []

    def case(name: str):
        def run() -> int:
            calls.append(name)
            return len(calls)
        return run

    runs = interleaved({"a": case("a"), "b": case("b")}, repeats=2, warmup=1)
    assert calls == ["a", "b", "a", "b", "a", "b"]
    assert runs == {"a": [3, 5], "b": [4, 6]}
    assert timed(lambda: 42)[0] == 42
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3, "values": [3.0, 1.0, 2.0]}
    with pytest.raises(ValueError):
        interleaved({"a": case("a")}, repeats=0)


def test_markdown_table_aligns_columns_and_checks_row_length():
    assert markdown_table(["a", "b"], [[1, "x"]], align="rl") == ["| a | b |", "|---:|---|", "| 1 | x |"]
    with pytest.raises(ValueError, match="2 cells"):
        markdown_table(["a", "b"], [[1]])


def test_machine_record_fields():
    record = machine_record()
    assert record["cpu_count"] >= 1 and 1 <= record["cpus_usable"] <= record["cpu_count"]
    assert record["memory_gib"] > 0 and record["cpu_model"]
    assert record["versions"]["dspy"] == dspy.__version__
    assert package_versions(("flowopt-no-such-distribution",)) == {"flowopt-no-such-distribution": None}
    if (REPO_ROOT / ".git").exists():
        assert re.fullmatch(r"[0-9a-f]{40}", record["git"]["commit"])


def test_a_run_writes_schema_json_and_markdown(tmp_path):
    stem = tmp_path / "sub" / "toy"
    run = start_run(_parser(), ["--smoke", "--out", str(stem)])
    assert stem.parent.is_dir()  # made at the start, not after the measuring
    runs = interleaved({"ours": lambda: 1.0, "peer": lambda: 2.0}, run.args.repeats)
    rows = [[name, values[0]] for name, values in runs.items()]
    payload = run.finish("Toy: ours vs peer", {"seconds": runs}, markdown_table(["side", "s"], rows, align="lr"),
                         goals=[Goal.at_most("ratio ours / peer", 0.5, 1.0), Goal.at_least("speed-up", 2.0, 4.0)])

    on_disk = read_results(stem)
    assert on_disk == json.loads(json.dumps(payload))
    assert on_disk["schema"] == SCHEMA and on_disk["script"] == "toy_bench"
    assert on_disk["command"] == f"python -m flowopt.benchmarks.perf.toy_bench --smoke --out {stem}"
    assert on_disk["settings"] == {"out": str(stem), "smoke": True, "repeats": 1, "size": 3}
    assert len(on_disk["load_average"]["before"]) == len(on_disk["load_average"]["after"]) == 3
    assert [g["met"] for g in on_disk["goals"]] == [True, False]
    assert on_disk["results"] == {"seconds": {"ours": [1.0], "peer": [2.0]}}

    markdown = (tmp_path / "sub" / "toy.md").read_text()
    assert markdown.startswith("# Toy: ours vs peer\n")
    assert f"Command: `python -m flowopt.benchmarks.perf.toy_bench --smoke --out {stem}`" in markdown
    assert f"{on_disk['machine']['cpu_count']} CPUs" in markdown and "Load average" in markdown
    assert "**Smoke run**" in markdown
    assert "| ours | 1.0 |\n| peer | 2.0 |" in markdown
    assert "| ratio ours / peer | 0.5 | <= 1 | met |" in markdown
    assert "| speed-up | 2.0 | >= 4 | **NOT met** |" in markdown


def test_read_results_names_what_is_wrong(tmp_path):
    legacy = tmp_path / "legacy.json"
    legacy.write_text(json.dumps({"command": "python benchmarks/perf/x.py", "results": {}}))
    with pytest.raises(DataError, match="schema None"):
        read_results(legacy)
    run = start_run(_parser(), ["--out", str(tmp_path / "ok")])
    payload = run.finish("t", {"x": 1}, [])
    payload["machine"].pop("git")
    (tmp_path / "bad.json").write_text(json.dumps(payload))
    with pytest.raises(DataError, match="git"):
        read_results(tmp_path / "bad")


def test_the_module_docstring_example_runs(tmp_path):
    from flowopt.benchmarks.perf import harness

    code = textwrap.dedent(harness.__doc__.split("::\n")[1].split("\nExtra outputs")[0])
    namespace = {"__name__": "example", "ours": lambda n: sum(range(n)), "peer": lambda n: sum(range(2 * n))}
    exec(code, namespace)
    assert namespace["main"](["--smoke", "--out", str(tmp_path / "my_bench")]) == 0
    payload = read_results(tmp_path / "my_bench")
    assert payload["settings"]["size"] == 10 and payload["results"]["seconds"]["ours"]["n"] == 1
    assert payload["goals"][0]["name"] == "time ratio ours / peer"


def _grpo_shaped_result_command() -> str:
    """A shell command that writes a one-round grpo_throughput-shaped result to the {out} stem."""
    code = ("import json, sys; json.dump({'results': {'runs': {'flowopt': {'runs_median_step_s': [0.1]}, "
            "'trl-nockpt': {'runs_median_step_s': [0.12]}}}}, open(sys.argv[1] + '.json', 'w'))")
    return "{python} -c " + shlex.quote(code) + " {out}"


def test_a_script_main_called_in_process_leaves_logging_as_it_was(tmp_path):
    from flowopt.benchmarks.perf import runtime_ab

    root = logging.getLogger()
    loggers = [logging.getLogger(name) for name in (*NOISY_LOGGERS, "flowopt")]
    saved = root.level, list(root.handlers), [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.NOTSET)
    try:
        command = _grpo_shaped_result_command()
        assert runtime_ab.main(["--measure", "grpo", "--alternations", "1", "--resamples", "100", "--before",
                                command, "--after", command, "--out", str(tmp_path / "ab")]) == 0
        assert [lg.level for lg in loggers] == [logging.NOTSET] * len(loggers)
        assert (root.level, list(root.handlers)) == saved[:2]
    finally:
        for lg, level in zip(loggers, saved[2]):
            lg.setLevel(level)


def test_perf_scripts_set_up_logging_only_at_their_entry_point():
    perf = REPO_ROOT / "benchmarks" / "perf"
    scripts = [p for p in perf.glob("*.py") if "setup_logging" in p.read_text()]
    assert len(scripts) >= 10
    for path in scripts:
        tree = ast.parse(path.read_text())
        main_guard = [node for node in tree.body if isinstance(node, ast.If)
                      and ast.unparse(node.test) in ('__name__ == "__main__"', "__name__ == '__main__'")]
        at_entry = {id(n) for guard in main_guard for n in ast.walk(guard)}
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "setup_logging"]
        assert calls, f"{path.name} imports setup_logging but never calls it"
        assert all(id(c) in at_entry for c in calls), f"{path.name} calls setup_logging outside its __main__ block"


def test_setup_logging_in_a_script_process_quiets_libraries_and_shows_progress(tmp_path):
    command = _grpo_shaped_result_command()
    done = subprocess.run([sys.executable, "-m", "flowopt.benchmarks.perf.runtime_ab", "--measure", "grpo",
                           "--alternations", "1", "--resamples", "100", "--before", command, "--after", command,
                           "--out", str(tmp_path / "ab")], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "run 0 (before" in done.stderr and "wrote " in done.stderr  # the script's INFO progress is shown
    probe = ("import logging; from flowopt.benchmarks.perf.harness import setup_logging; setup_logging(); "
             "print(logging.getLogger().level, logging.getLogger('dspy').level, logging.getLogger('litellm').level)")
    levels = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120).stdout.split()
    assert levels == [str(logging.INFO), str(logging.ERROR), str(logging.ERROR)]


def test_the_commit_is_the_one_at_the_start_of_the_run(tmp_path, monkeypatch):
    """A run that writes its own outputs into the checkout must not report it 'with uncommitted changes'."""
    from flowopt.benchmarks.perf.harness import machine

    monkeypatch.setattr(machine, "git_commit", lambda: {"commit": "a" * 40, "dirty": False})
    run = start_run(_parser(), ["--smoke", "--out", str(tmp_path / "toy")])
    monkeypatch.setattr(machine, "git_commit", lambda: {"commit": "a" * 40, "dirty": True})  # outputs written
    payload = run.finish("Toy", {}, [])
    assert payload["machine"]["git"] == {"commit": "a" * 40, "dirty": False}
    assert "uncommitted" not in (tmp_path / "toy.md").read_text()
