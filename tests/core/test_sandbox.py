"""The Programmer sandbox: timeout, no network, no writes outside its temp dir, memory limit."""

import socket
import threading
import time

from flowopt.modules.sandbox import run_python


def test_runs_code_and_captures_output():
    result = run_python("import math\nprint(math.factorial(5))")
    assert result.ok and result.stdout.strip() == "120"


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
    assert "not allowed" in result.stderr
    assert accepted == []


def test_cannot_write_outside_its_temp_dir(tmp_path):
    target = tmp_path / "escape.txt"
    for code in (f"open({str(target)!r}, 'w').write('x')",
                 f"import os\nfd = os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
                 f"import shutil\nopen('a.txt', 'w').write('x')\nshutil.copyfile('a.txt', {str(target)!r})",
                 f"import os\nos.rename('.', {str(target)!r})"):
        result = run_python(code)
        assert not result.ok, code
        assert "not allowed" in result.stderr, result.stderr
    assert not target.exists()
    inside = run_python("open('notes.txt', 'w').write('ok')\nprint(open('notes.txt').read())")
    assert inside.ok and inside.stdout.strip() == "ok"


def test_cannot_start_processes_or_load_native_code():
    for code in ("import os\nos.system('true')", "import subprocess\nsubprocess.run(['true'])",
                 "import ctypes\nctypes.CDLL(None)"):
        result = run_python(code)
        assert not result.ok and "not allowed" in result.stderr, code


def test_memory_limit():
    result = run_python("block = bytearray(1024 * 1024 * 1024)\nprint('allocated')", memory_mb=256)
    assert not result.ok and "MemoryError" in result.stderr
