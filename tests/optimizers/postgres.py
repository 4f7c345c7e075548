"""A throwaway PostgreSQL cluster for tests: ``initdb`` + ``pg_ctl`` in a temp folder, on 127.0.0.1.

The cluster listens on a free port of 127.0.0.1 only (other test processes run servers too), trusts
local connections, and is stopped and deleted afterwards. ``initdb`` refuses to run as root, so as
root the cluster belongs to ``nobody``. Without PostgreSQL (or psycopg) the tests that need it are
skipped, except under ``CI=true``, where that is a failure: CI installs it (see ``.ci/run``).

Example:
    >>> with PostgresCluster.start() as pg:  # doctest: +SKIP
    ...     url = pg.create_database("demo")  # postgresql+psycopg://flowopt@127.0.0.1:PORT/demo
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from flowopt.ports import free_port

USER = "flowopt"


def postgres_bin_dir() -> Path | None:
    """The folder holding ``initdb`` and ``pg_ctl``: on PATH, else Debian's ``/usr/lib/postgresql/*/bin``."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(found).resolve().parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(versions[-1]).parent if versions else None


def missing_reason() -> str | None:
    """Why the PostgreSQL tests cannot run here, or ``None``."""
    if postgres_bin_dir() is None:
        return "PostgreSQL's initdb/pg_ctl not found (apt-get install postgresql; .ci/run does this)"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "the psycopg driver is not installed (pip install -e '.[postgres]')"
    return None


def require_postgres() -> None:
    """Skip the calling test without PostgreSQL, or fail under ``CI=true`` (CI must run these tests)."""
    reason = missing_reason()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true but {reason}")
    pytest.skip(reason)


class PostgresCluster:
    """A running throwaway cluster; ``stop()`` (or leaving the ``with`` block) shuts it down and deletes it."""

    def __init__(self, root: Path, bindir: Path, port: int, as_user: list[str]) -> None:
        self.root, self.bindir, self.port, self._as_user = root, bindir, port, as_user

    @classmethod
    def start(cls) -> PostgresCluster:
        bindir = postgres_bin_dir()
        if bindir is None:
            raise RuntimeError(missing_reason())
        root = Path(tempfile.mkdtemp(prefix="flowopt-pg-"))
        as_user: list[str] = []
        if os.geteuid() == 0:  # initdb refuses root: the cluster belongs to nobody
            shutil.chown(root, user="nobody")
            as_user = ["runuser", "-u", "nobody", "--"]
        data = root / "data"
        subprocess.run([*as_user, str(bindir / "initdb"), "-D", str(data), "-U", USER, "--auth=trust",
                        "--no-sync", "-E", "UTF8"], check=True, capture_output=True, timeout=120)
        last_error = ""
        for _ in range(5):  # the free port may be taken between the probe and the bind: try another
            cluster = cls(root, bindir, free_port(), as_user)
            options = (f"-c listen_addresses=127.0.0.1 -c port={cluster.port} -c unix_socket_directories={root} "
                       "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
            done = subprocess.run([*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-l", str(root / "log"),
                                   "-o", options, "-w", "-t", "60", "start"], capture_output=True, text=True,
                                  timeout=90)
            if done.returncode == 0:
                return cluster
            last_error = done.stdout + done.stderr + (root / "log").read_text(errors="replace")[-2000:]
        shutil.rmtree(root, ignore_errors=True)
        raise RuntimeError(f"could not start PostgreSQL: {last_error}")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://{USER}@127.0.0.1:{self.port}/{database}"

    def create_database(self, prefix: str = "t") -> str:
        """A new empty database; returns its SQLAlchemy URL."""
        import psycopg

        name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user={USER} dbname=postgres", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def restart(self) -> None:
        """``pg_ctl restart -m fast``: every connection is cut and the server is down for a moment."""
        # -l: the restarted server writes to the log file, not to pipes this call would wait on.
        subprocess.run([*self._as_user, str(self.bindir / "pg_ctl"), "-D", str(self.root / "data"), "-l",
                        str(self.root / "log"), "-m", "fast", "-w", "-t", "60", "restart"], check=True,
                       capture_output=True, timeout=90)

    def terminate_backends(self, application_name_like: str) -> int:
        """``pg_terminate_backend`` for every connection whose application_name matches; how many."""
        import psycopg

        with psycopg.connect(f"host=127.0.0.1 port={self.port} user={USER} dbname=postgres", autocommit=True) as conn:
            rows = conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name LIKE %s",
                                (application_name_like,)).fetchall()
        return len(rows)

    def stop(self) -> None:
        subprocess.run([*self._as_user, str(self.bindir / "pg_ctl"), "-D", str(self.root / "data"), "-m", "immediate",
                        "-w", "-t", "30", "stop"], capture_output=True, timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PostgresCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[PostgresCluster]:
    """One cluster per test session (per xdist worker); tests take their own database from it."""
    require_postgres()
    with PostgresCluster.start() as cluster:
        yield cluster


@pytest.fixture
def postgres_url(postgres_cluster: PostgresCluster) -> str:
    """The URL of a fresh, empty database on the session's cluster."""
    return postgres_cluster.create_database()
