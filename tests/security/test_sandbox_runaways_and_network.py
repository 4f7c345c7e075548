"""The escape suite, part two: runaway children (survivors, pipe holders, floods, fork bombs) and the
network (TCP, UDP, Unix and abstract sockets to the host). Part one is ``test_sandbox_escapes.py``.

As there, each case runs hostile code through :func:`run_python` and checks the *host* afterwards.
"""

from __future__ import annotations

import contextlib
import resource
import socket
import threading
import time
import uuid

import pytest

from tests.security.sandbox_helpers import SPAWN, alive_with, kill_all, run

# --- 4. runaway children --------------------------------------------------------------------------

def test_setsid_grandchild_does_not_survive_the_timeout():
    marker = f"flowopt-survivor-{uuid.uuid4().hex}"
    try:
        run(SPAWN + f"""
try:
    spawn([sys.executable, '-c', 'import os, time; os.close(1); os.close(2); os.setsid(); time.sleep(20)  # {marker}'])
except Exception as exc:
    print(type(exc).__name__)
import time; time.sleep(30)
""", timeout_s=1.5)
        time.sleep(0.5)
        assert alive_with(marker) == []
    finally:
        kill_all(alive_with(marker))


def test_a_grandchild_holding_the_pipe_does_not_delay_the_return():
    marker = f"flowopt-holder-{uuid.uuid4().hex}"
    try:
        start = time.monotonic()
        result = run(SPAWN + f"""
try:
    spawn([sys.executable, '-c', 'import os, time; os.setsid(); time.sleep(12)  # {marker}'])
except Exception as exc:
    print(type(exc).__name__)
import time; time.sleep(30)
""", timeout_s=2)
        elapsed = time.monotonic() - start
        assert result.timed_out
        assert elapsed < 5.0, elapsed
    finally:
        kill_all(alive_with(marker))


def test_closing_the_pipes_does_not_escape_the_timeout():
    start = time.monotonic()
    result = run("import os\nos.close(1)\nos.close(2)\nwhile True:\n    pass", timeout_s=1.5)
    assert result.timed_out and time.monotonic() - start < 4.5


def test_stdout_flood_is_capped_and_returns_promptly():
    before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    result = run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", timeout_s=3)
    elapsed = time.monotonic() - start
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kb) / 1024
    assert not result.ok
    assert len(result.stdout) <= 2 * 2**20, len(result.stdout)
    assert elapsed < 6.0, elapsed
    assert grown_mb < 200, grown_mb


def test_invalid_utf8_output_never_raises_in_the_parent():
    result = run("import sys\nsys.stdout.buffer.write(b'\\xff\\xfe ok\\n')\nsys.stderr.buffer.write(b'\\xc3(')")
    assert result.ok and "ok" in result.stdout and "\ufffd" in result.stdout


def test_invalid_utf8_through_programmer_with_on_failure_empty():
    import dspy

    from flowopt.modules import Programmer
    from flowopt.testing import scripted_lm

    code = "import sys\nsys.stdout.buffer.write(b'\\xff\\n')\nsys.stderr.buffer.write(b'\\xfe')\nsys.exit(1)"
    dspy.configure(lm=scripted_lm(lambda r: {"reasoning": "r", "code": code}, cache=False))
    out = Programmer("question -> answer", max_attempts=1, on_failure="empty")(question="q")
    assert out.answer == ""


def test_fork_bomb_is_contained():
    marker = f"flowopt-bomb-{uuid.uuid4().hex}"
    try:
        start = time.monotonic()
        result = run(SPAWN + f"""
import os
started = 0
for _ in range(40):
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        started += 1
    except Exception:
        pass
    try:
        spawn(['/bin/sh', '-c', 'sleep 4; : {marker}'] if os.path.exists('/bin/sh')
              else [sys.executable, '-c', 'import time; time.sleep(4)  # {marker}'])
        started += 1
    except Exception:
        pass
print('started', started)
""", timeout_s=5)
        assert time.monotonic() - start < 8
        started = int(result.stdout.split()[-1]) if "started" in result.stdout else 0
        assert started < 8, result.stdout
        assert alive_with(marker) == []
    finally:
        kill_all(alive_with(marker))


# --- 5. the network -------------------------------------------------------------------------------

def _accepting(server: socket.socket) -> list:
    accepted: list = []

    def loop() -> None:
        with contextlib.suppress(OSError):
            accepted.append(server.accept())

    threading.Thread(target=loop, daemon=True).start()
    return accepted


def test_tcp_to_a_host_port_connects_nowhere():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        accepted = _accepting(server)
        result = run(f"""
            import socket
            socket.create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=2)
            print('connected')
        """)
        time.sleep(0.2)
    assert "connected" not in result.stdout and accepted == []


def test_udp_to_a_host_port_sends_nothing():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as server:
        server.bind(("127.0.0.1", 0))
        server.settimeout(0.5)
        run(f"import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', "
            f"('127.0.0.1', {server.getsockname()[1]}))")
        with pytest.raises(TimeoutError):
            server.recvfrom(16)


@pytest.mark.parametrize("where", ["file-system", "abstract"])
def test_a_unix_socket_on_the_host_is_unreachable(where, tmp_path):
    address = str(tmp_path / "host.sock") if where == "file-system" else f"\0flowopt-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(address)
        server.listen(1)
        accepted = _accepting(server)
        result = run(f"import socket\nsocket.socket(socket.AF_UNIX).connect({address!r})\nprint('connected')")
        time.sleep(0.2)
    assert "connected" not in result.stdout and accepted == []
