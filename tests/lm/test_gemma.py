"""The embedded Gemma 3 270M cache: location, completeness checks, one conversion under concurrency."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flowopt.errors import LMError
from flowopt.lm import gemma

REPO = Path(__file__).resolve().parents[2]


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FLOWOPT_CACHE_DIR", str(tmp_path / "c"))
    assert gemma.cache_root() == tmp_path / "c"
    assert gemma.gemma_dir() == tmp_path / "c" / "models" / "gemma-3-270m"
    monkeypatch.delenv("FLOWOPT_CACHE_DIR")
    assert gemma.cache_root() == Path.home() / ".cache" / "flowopt"


def _write_fake(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"x" * 10)
    manifest = {"format": gemma._FORMAT, "files": {"model.safetensors": {"size": 10, "sha256": "0" * 64}}}
    (folder / gemma.MANIFEST).write_text(json.dumps(manifest))


def test_partial_or_stale_folders_are_not_used(tmp_path):
    folder = tmp_path / "g"
    assert gemma.read_manifest(folder) is None
    _write_fake(folder)
    assert gemma.read_manifest(folder) is not None
    (folder / "model.safetensors").write_bytes(b"x" * 9)  # truncated file
    assert gemma.read_manifest(folder) is None
    (folder / "model.safetensors").write_bytes(b"x" * 10)
    assert not gemma.verify_gemma(folder, deep=True)  # the digest does not match
    manifest = json.loads((folder / gemma.MANIFEST).read_text())
    (folder / gemma.MANIFEST).write_text(json.dumps({**manifest, "format": -1}))
    assert gemma.read_manifest(folder) is None


def test_two_processes_starting_at_once_convert_once(tmp_path):
    """The file lock serialises conversion; the second process finds the finished folder."""
    script = textwrap.dedent(f"""
        import json, time
        from pathlib import Path
        from flowopt.lm import gemma

        def fake_convert(folder, progress):
            with open({str(tmp_path / "conversions.log")!r}, "a") as log:
                log.write("converted\\n")
            time.sleep(1.0)
            work = folder.parent / ".tmp"
            work.mkdir()
            (work / "model.safetensors").write_bytes(b"x" * 10)
            files = {{"model.safetensors": {{"size": 10, "sha256": "0" * 64}}}}
            (work / gemma.MANIFEST).write_text(json.dumps({{"format": gemma._FORMAT, "files": files}}))
            work.rename(folder)

        gemma._convert = fake_convert
        print(gemma.ensure_gemma(Path({str(tmp_path)!r}), progress=False))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outputs[0] == outputs[1] == str(tmp_path / "models" / "gemma-3-270m")
    assert (tmp_path / "conversions.log").read_text().count("converted") == 1


class _Tokenizer:
    def __init__(self, ids):
        self.ids = list(ids)

    def __call__(self, text):
        return {"input_ids": self.ids}


def test_the_tokenizer_probe_accepts_gemmas_ids_and_names_the_fix_otherwise(tmp_path):
    expected = gemma.TOKENIZER_PROBE[1]
    gemma.check_tokenizer(_Tokenizer(expected), tmp_path)
    for wrong in (expected[1:], (18125, 536, 503, 535, 5629)):  # no <bos> (transformers 5.18-5.22); lost merges (5.17)
        with pytest.raises(LMError) as err:
            gemma.check_tokenizer(_Tokenizer(wrong), tmp_path)
        assert "converted wrongly" in str(err.value) and "transformers>=5.23" in err.value.fix
        assert str(tmp_path) in err.value.fix


def test_a_wrong_tokenizer_stops_the_conversion_before_anything_is_cached(tmp_path, monkeypatch):
    import transformers

    def fake_assemble(target, progress=True):
        target.write_bytes(b"gguf")
        return target

    monkeypatch.setattr(gemma, "assemble_gguf", fake_assemble)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        classmethod(lambda cls, *a, **k: _Tokenizer(gemma.TOKENIZER_PROBE[1][1:])))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        classmethod(lambda cls, *a, **k: pytest.fail("the model must not be dequantized")))
    folder = gemma.gemma_dir(tmp_path)
    with pytest.raises(LMError, match="converted wrongly"):
        gemma.ensure_gemma(tmp_path, progress=False)
    assert not folder.exists() and [p.name for p in folder.parent.iterdir()] == ["gemma-3-270m.lock"]
