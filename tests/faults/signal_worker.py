"""Subprocess for test_signals: the fault task's compile, exiting as a command-line tool would.

Usage: python signal_worker.py RUN_DIR OUT_JSON [--resume]

On :class:`~flowopt.errors.Interrupted` it prints the error and exits with the error's ``exit_code``
(what ``flowopt bench`` does); otherwise it writes the compiled program's canonical JSON to ``OUT_JSON``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def main() -> int:
    from disk_full_worker import compile_task

    from flowopt.errors import Interrupted

    run_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    try:
        program = compile_task(run_dir, resume="--resume" in sys.argv, latency_s=0.02)
    except Interrupted as err:
        print(f"Interrupted: {err}", file=sys.stderr)
        return err.exit_code
    out.write_text(program)
    return 0


if __name__ == "__main__":
    sys.exit(main())
