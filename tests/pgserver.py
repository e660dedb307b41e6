"""A throwaway PostgreSQL server for the tests: ``initdb`` into a temporary directory,
``pg_ctl start`` on a free loopback port, removed afterwards.

PostgreSQL refuses to run as root, and CI runs as root: then every server program runs
as the ``postgres`` system user (``subprocess``'s ``user=``/``group=``), in a directory
it owns. As anyone else, they run as the current user. The server keeps ``fsync`` on, so
commits cost what they cost in production; it listens on 127.0.0.1 only (and a unix
socket in its directory), with trust authentication for one superuser.
"""

from __future__ import annotations

import glob
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any

SUPERUSER = "streamq"
RUN_AS_WHEN_ROOT = "postgres"

INSTALL_HINT = (
    "the PostgreSQL server binaries (initdb, pg_ctl, postgres) are needed to run the "
    "PostgreSQL tests: install them (Debian/Ubuntu: 'apt-get install postgresql', "
    "Fedora: 'dnf install postgresql-server', macOS: 'brew install postgresql@15'), or set "
    "STREAMQ_PG_BIN to the directory that holds them"
)


class PostgresMissingError(RuntimeError):
    """No PostgreSQL server binaries on this machine: the message says how to get them."""


def find_bindir() -> Path:
    """Where initdb and pg_ctl are: ``$STREAMQ_PG_BIN``, else ``pg_config --bindir``, else
    the newest ``/usr/lib/postgresql/*/bin`` (Debian keeps the server off the PATH)."""
    explicit = os.environ.get("STREAMQ_PG_BIN")
    if explicit:
        if not _has_server(Path(explicit)):
            raise PostgresMissingError(f"STREAMQ_PG_BIN={explicit!r} has no initdb and pg_ctl")
        return Path(explicit)
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config:
        try:
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=30, check=True
            )
            candidates.append(Path(out.stdout.strip()))
        except (OSError, subprocess.SubprocessError):
            pass  # a broken pg_config: look further
    candidates += sorted(
        (Path(d) for d in glob.glob("/usr/lib/postgresql/*/bin")),
        key=lambda d: [int(n) for n in re.findall(r"\d+", d.parent.name)] or [0],
        reverse=True,
    )
    for candidate in candidates:
        if _has_server(candidate):
            return candidate
    raise PostgresMissingError(INSTALL_HINT)


def _has_server(bindir: Path) -> bool:
    return all(os.access(bindir / name, os.X_OK) for name in ("initdb", "pg_ctl", "postgres"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class PostgresServer:
    """One server, in its own temporary directory; ``start`` then ``stop`` (which removes
    the directory, whatever happened)."""

    def __init__(self, bindir: Path | None = None, settings: dict[str, str] | None = None) -> None:
        self.bindir = bindir or find_bindir()
        self.settings = settings or {}
        self.base = Path(tempfile.mkdtemp(prefix="streamq-pg-"))
        self.data = self.base / "data"
        self.logfile = self.base / "server.log"
        self.port = 0
        self.running = False
        # As root, the server programs run as the postgres user, in directories it owns.
        self._user: dict[str, Any] = {}
        if os.geteuid() == 0:
            account = pwd.getpwnam(RUN_AS_WHEN_ROOT)
            self._user = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
            os.chown(self.base, account.pw_uid, account.pw_gid)

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{dbname}"

    def _run(self, *args: str, timeout: float = 120) -> None:
        """A server program, as the server's user; its output in the error if it fails."""
        result = subprocess.run(
            [str(self.bindir / args[0]), *args[1:]],
            cwd=self.base,  # the postgres user may not be allowed into ours
            env=dict(os.environ, LC_ALL="C", LANG="C"),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            **self._user,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"{args[0]} failed ({result.returncode}): {result.stdout}{result.stderr}"
                f"{self.log_tail()}"
            )

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.logfile.read_text(errors="replace")
        except OSError:
            return ""
        return "\nserver log:\n" + "\n".join(text.splitlines()[-lines:])

    def start(self) -> None:
        self._run(
            "initdb",
            *("-D", str(self.data), "-U", SUPERUSER, "--auth=trust"),
            *("--encoding=UTF8", "--no-locale", "--no-instructions"),
        )
        # A free port can be taken by someone else before the server binds it: try again.
        for attempt in range(5):
            self.port = free_port()
            self._configure()
            try:
                self._run(
                    "pg_ctl",
                    *("-D", str(self.data), "-l", str(self.logfile), "-w", "-t", "60", "start"),
                )
            except RuntimeError:
                if attempt == 4 or "could not bind" not in self.log_tail(200):
                    raise
                continue
            self.running = True
            return

    def _configure(self) -> None:
        settings = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(self.port),
            "unix_socket_directories": f"'{self.base}'",
            "fsync": "on",  # commits cost what they cost in production
            "max_connections": "100",
            **self.settings,
        }
        # postgresql.auto.conf is read last: its values win over postgresql.conf's.
        auto = self.data / "postgresql.auto.conf"
        auto.write_text("".join(f"{name} = {value}\n" for name, value in settings.items()))
        if self._user:
            os.chown(auto, self._user["user"], self._user["group"])

    def stop(self) -> None:
        """Stop the server (fast: open sessions are ended) and remove its directory."""
        try:
            if self.running:
                self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")
                self.running = False
        finally:
            shutil.rmtree(self.base, ignore_errors=True)

    def create_database(self, name: str) -> str:
        """A new, empty database; its URL."""
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url(name)

    def drop_database(self, name: str) -> None:
        """Drop it, ending the sessions a failed test left open on it."""
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
