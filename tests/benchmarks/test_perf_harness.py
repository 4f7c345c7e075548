"""The perf harness: --out/--smoke parsing, interleaved timing, the machine record and the results files."""

from __future__ import annotations

import json
import re
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
