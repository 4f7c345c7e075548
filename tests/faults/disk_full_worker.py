"""Subprocess for test_disk_full: a compile whose run folder lies on a small filesystem that fills up.

Usage: python disk_full_worker.py SMALL_FS ROOMY_DIR OUT_JSON FREE_BYTES [FREE_BYTES ...]

``SMALL_FS`` is an empty tmpfs mounted by the test (in a user namespace). The worker runs the compile
once in ``ROOMY_DIR`` (the reference); then, for each ``FREE_BYTES``, it fills ``SMALL_FS`` with a
ballast file until that much is left and runs the same compile there, which must fail with a
DiskFullError; it lists the files left in the run folder, deletes the ballast and resumes.
``OUT_JSON`` gets what it saw.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "compiler"))


def compile_task(run_dir: Path, *, resume: bool = False, latency_s: float = 0.0, model: str = "scripted/fault-task",
                 on_call: Callable[[int], None] | None = None) -> str:
    """The compile the fault tests run (demos, then a search), on a scripted LM; its canonical JSON.

    With ``$FLOWOPT_TEST_CALL_LOG`` set, every LM call appends a line there (the signal test's clock);
    ``on_call(n)`` is called at the n-th call this process makes to ``model`` (DSPy caches by model name)."""
    import dspy
    from fakes import exact, examples, reverse_answer

    import flowopt
    from flowopt.modules import Predict
    from flowopt.optimizers.search import RandomSearch
    from flowopt.testing import scripted_lm

    call_log = os.environ.get("FLOWOPT_TEST_CALL_LOG")
    calls = itertools.count(1)

    def answer(req):
        if call_log:
            with open(call_log, "a") as log:
                log.write("call\n")
        if on_call is not None:
            on_call(next(calls))
        q = req.inputs.get("question", "")
        cats = {str(d.get("question", "")).split(":")[0] for d in req.demos
                if str(d.get("answer", "")).startswith("#")}
        return {"answer": reverse_answer(q) if q.split(":")[0] in cats else q}

    lm = scripted_lm(answer, latency_s=latency_s, model=model)
    stages = [("demos", {"max_labeled_demos": 4}),
              RandomSearch(n_candidates=8, seeded=3, max_demos=3, pool_size=6, parallel=2, max_labeled_demos=4)]
    with dspy.context(lm=lm):
        out = flowopt.compile(flowopt.chain("question -> answer", Predict("question -> answer")),
                              examples(15, categories=True), exact, valset=examples(24, 100, categories=True),
                              stages=stages, seed=7, run_dir=run_dir, resume=resume, quiet=True, num_threads=2)
    return out.canonical_json()


def _files(run_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(run_dir)): p.stat().st_size for p in sorted(run_dir.rglob("*")) if p.is_file()}


def _broken_json(run_dir: Path) -> list[str]:
    broken = []
    for path in run_dir.rglob("*.json"):
        try:
            json.loads(path.read_text())
        except ValueError:
            broken.append(str(path.relative_to(run_dir)))
    return broken


def _fill_and_run(small: Path, free: int) -> dict:
    from flowopt.errors import DiskFullError

    seen: dict = {"free": free}
    ballast = small / "ballast"
    stat = os.statvfs(small)
    with open(ballast, "wb") as handle:
        handle.write(b"\0" * max(0, stat.f_bavail * stat.f_frsize - free))
    run_dir = small / f"run-{free}"
    try:
        seen["first"] = compile_task(run_dir)
    except DiskFullError as err:
        seen["error"] = {"type": type(err).__name__, "message": str(err), "path": err.path, "needed": err.needed}
    except Exception as err:  # reported to the test, which fails on it
        seen["error"] = {"type": type(err).__name__, "message": str(err)}
    seen["files_after_error"] = _files(run_dir)
    seen["broken_json"] = _broken_json(run_dir)
    seen["temp_files"] = [name for name in seen["files_after_error"] if Path(name).name.endswith(".tmp")]
    ballast.unlink()
    seen["resumed"] = compile_task(run_dir, resume=True)
    shutil.rmtree(run_dir)
    return seen


def main() -> None:
    small, roomy, out_path = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    reference = compile_task(roomy / "run")
    runs = [_fill_and_run(small, int(free)) for free in sys.argv[4:]]
    out_path.write_text(json.dumps({"reference": reference, "reference_files": _files(roomy / "run"),
                                    "runs": runs}))


if __name__ == "__main__":
    main()
