"""The notebooks run top to bottom, offline, and are stored executed, with small outputs and no errors."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
# Notebooks that load the real Gemma 3 270M (conversion, then CPU inference and training): minutes, not
# seconds, so they run under -m slow, on the smallest slice that still compiles and plots.
REAL_MODEL = {"04_real_benchmark": {"FLOWOPT_NB_TEST": "3", "FLOWOPT_NB_TRAIN": "4"}}
RUNS = [pytest.param(p, marks=pytest.mark.slow) if p.stem in REAL_MODEL else p for p in NOTEBOOKS]


def test_notebooks_exist():
    assert [p.name for p in NOTEBOOKS][:1] == ["01_quickstart.ipynb"]


MAX_BYTES = 300_000  # a few small plots and tables: a reader sees them on GitHub without running anything


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_executed_with_small_outputs(path):
    nb = nbformat.read(path, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(cell.execution_count is not None for cell in code), f"{path.name} is stored unexecuted"
    counts = [cell.execution_count for cell in code]
    assert counts == sorted(counts), f"{path.name} was run out of order"
    assert not [o for cell in code for o in cell.outputs if o.output_type == "error"], f"{path.name} stores an error"
    assert any(cell.outputs for cell in code), f"{path.name} stores no output"
    assert path.stat().st_size < MAX_BYTES, f"{path.name} is {path.stat().st_size} bytes"


@pytest.mark.parametrize("path", RUNS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    for name, value in REAL_MODEL.get(path.stem, {}).items():
        monkeypatch.setenv(name, value)  # the kernel inherits the environment
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=900 if path.stem in REAL_MODEL else 300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert errors == []
