"""A throwaway PostgreSQL server for the tests: ``initdb`` into a temporary directory,
``pg_ctl start`` on a free loopback port, removed afterwards.

PostgreSQL refuses to run as root, and CI runs as root: then every server program runs
as the ``postgres`` system user (``subprocess``'s ``user=``/``group=``), in a directory
it owns. As anyone else, they run as the current user. The server keeps ``fsync`` on, so
commits cost what they cost in production; it listens on 127.0.0.1 only (and a unix
socket in its directory), with trust authentication for one superuser.

For the failover and crash tests a server can also be copied into a streaming replica
(``replica``), stopped the way a crash stops it (``crash``: ``pg_ctl stop -m immediate``;
``kill``: SIGKILL to the postmaster), started again on the same directory and port
(``restart``) and promoted (``promote``). Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import reserved_port

from .waiting import wait_until

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


# What a start prints while the processes of a killed server are still exiting: they hold
# its shared memory, or (a zombie not yet reaped) its pid still answers.
_OLD_SERVER_EXITING = ("pre-existing shared memory block", "already exists")


class PostgresServer:
    """One server, in its own temporary directory; ``start`` then ``stop`` (which removes
    the directory, whatever happened)."""

    def __init__(
        self,
        bindir: Path | None = None,
        settings: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.bindir = bindir or find_bindir()
        self.settings = settings or {}
        self.env = env or {}  # for the server's programs (bench.tools.fsync_delay: LD_PRELOAD)
        self.base = Path(tempfile.mkdtemp(prefix="streamq-pg-"))
        self.data = self.base / "data"
        self.logfile = self.base / "server.log"
        self.port = 0
        self._port = contextlib.ExitStack()  # holds ``port`` from the first start to ``stop``
        self.running = False
        self.killed_pid = 0  # a postmaster ``kill`` ended, not started again since
        self._killed_shmid = ""  # its System V shared memory, which outlives it
        # A replica's primary_conninfo (from pg_basebackup -R), kept by ``_configure``.
        self._standby: dict[str, str] = {}
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
            env=dict(os.environ, LC_ALL="C", LANG="C", **self.env),
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
            # Not fsynced (seconds; minutes under a slowed flush): the tests crash servers,
            # never the machine, so what initdb wrote survives in the page cache anyway.
            "--no-sync",
        )
        # Replicas copy this server with pg_basebackup: a replication connection for the
        # superuser, on loopback (initdb's default file may allow it too; this says so).
        with (self.data / "pg_hba.conf").open("a") as hba:
            hba.write(f"host replication {SUPERUSER} 127.0.0.1/32 trust\n")
        self._start_on_a_reserved_port()

    def _start_on_a_reserved_port(self) -> None:
        """On a port held until ``stop`` (PostgreSQL binds with SO_REUSEADDR): no other
        process takes it before the first start or between a kill and a restart."""
        self.port = self._port.enter_context(reserved_port())
        self._configure()
        self._pg_ctl_start()

    def _pg_ctl_start(self) -> None:
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.logfile), "-w", "-t", "60", "start"
        )
        self.running = True
        self.killed_pid = 0

    def _configure(self) -> None:
        settings = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(self.port),
            "unix_socket_directories": f"'{self.base}'",
            "fsync": "on",  # commits cost what they cost in production
            "max_connections": "100",
            # Replication (the defaults, said here): WAL a replica can replay, senders for it.
            "wal_level": "replica",
            "max_wal_senders": "10",
            **self._standby,
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
                try:
                    self._run(
                        "pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop"
                    )
                    self.running = False
                except (RuntimeError, subprocess.TimeoutExpired):
                    # A server that will not stop must not outlive the tests.
                    with contextlib.suppress(OSError, ValueError, IndexError, TimeoutError):
                        self.kill()
                    raise
        finally:
            self._release_killed_memory()
            shutil.rmtree(self.base, ignore_errors=True)
            self._port.close()

    def create_database(self, name: str) -> str:
        """A new, empty database; its URL."""
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url(name)

    def drop_database(self, name: str, slots: bool = False) -> None:
        """Drop it, ending the sessions a failed test left open on it (and, with
        ``slots``, its logical replication slots first: they would keep it)."""
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.url(), autocommit=True) as conn:
            if slots:
                conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                    (name,),
                )

                def dropped() -> bool:
                    """Its inactive slots dropped; whether none is left (an active one's
                    session is ending)."""
                    listed = "FROM pg_replication_slots WHERE database = %s"
                    conn.execute(
                        f"SELECT pg_drop_replication_slot(slot_name) {listed} AND NOT active",
                        (name,),
                    )
                    return not conn.execute(f"SELECT {listed}", (name,)).fetchall()

                wait_until(dropped, f"the slots of {name} to go")
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )

    # --- replication, crashes, failover ------------------------------------------------

    def replica(self, settings: dict[str, str] | None = None) -> PostgresServer:
        """A streaming replica of this running server, started as a hot standby on its
        own port: ``pg_basebackup -R`` (standby.signal and primary_conninfo), replication
        asynchronous (this server has no synchronous_standby_names). The caller stops it."""
        replica = PostgresServer(self.bindir, settings)
        try:
            replica._run(
                "pg_basebackup",
                *("-h", "127.0.0.1", "-p", str(self.port), "-U", SUPERUSER),
                *("-D", str(replica.data), "-R", "-X", "stream"),
                # Checkpoint now: the default waits for a spread checkpoint (minutes).
                *("--checkpoint=fast", "--no-password"),
                # The copy is not fsynced (a second or so): the tests crash servers, never
                # the machine, so what is written survives in the page cache anyway.
                "--no-sync",
            )
            # -R appended primary_conninfo to the copied postgresql.auto.conf, which
            # _configure rewrites with the replica's own port: keep it.
            auto = (replica.data / "postgresql.auto.conf").read_text()
            for line in auto.splitlines():
                name, _, value = line.partition("=")
                if name.strip() in ("primary_conninfo", "primary_slot_name"):
                    replica._standby[name.strip()] = value.strip()
            if "primary_conninfo" not in replica._standby:
                raise RuntimeError(f"pg_basebackup -R wrote no primary_conninfo:\n{auto}")
            replica._start_on_a_reserved_port()
        except BaseException:
            replica.stop()
            raise
        return replica

    def wait_replayed(self, primary: PostgresServer, timeout: float = 30.0) -> None:
        """Wait until this replica has replayed the primary's WAL up to where it is now
        (``pg_current_wal_lsn()``): every commit the primary made before is visible here."""
        import psycopg

        with psycopg.connect(primary.url(), autocommit=True) as conn:
            row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        target: str = row[0]
        with psycopg.connect(self.url(), autocommit=True) as conn:

            def replayed() -> bool:
                done = conn.execute(
                    "SELECT coalesce(pg_last_wal_replay_lsn() >= %s::pg_lsn, false)", (target,)
                ).fetchone()
                return bool(done and done[0])

            wait_until(
                replayed, f"the replica on port {self.port} to replay up to {target}", timeout
            )

    def reconfigure(self, **settings: str) -> None:
        """Stop the server (fast), change ``settings`` and start it again, same directory
        and port: what an operator's ALTER SYSTEM and restart do."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")
        self.running = False
        self.settings.update(settings)
        self._configure()
        self._pg_ctl_start()

    def crash(self) -> None:
        """``pg_ctl stop -m immediate``: the postmaster ends every process at once, with no
        shutdown checkpoint; the next start runs crash recovery, as after kill -9."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "-t", "60", "stop")
        self.running = False

    def kill(self, timeout: float = 30.0) -> None:
        """SIGKILL the postmaster, as the OOM killer would: nothing is flushed or cleaned
        up, its children notice it is gone and exit on their own. Returns once it is
        dead; ``restart`` waits for the children."""
        lines = (self.data / "postmaster.pid").read_text().splitlines()
        pid = int(lines[0])
        self.running = False
        self.killed_pid = pid
        self._killed_shmid = lines[6].split()[1] if len(lines) > 6 else ""  # "key id"
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not _alive(pid), f"the postmaster (pid {pid}) to die", timeout)

    def restart(self, timeout: float = 60.0) -> None:
        """Start a stopped server again, same directory and port (a crashed one runs
        crash recovery first, a replica resumes as a standby). After ``kill``, a start is
        refused while the old server's processes still hold its shared memory: retried
        until they have exited."""
        deadline = time.monotonic() + timeout
        self._remove_stale_lock_files()
        while True:
            try:
                self._pg_ctl_start()
                return
            except RuntimeError as exc:
                exiting = self.killed_pid and any(m in str(exc) for m in _OLD_SERVER_EXITING)
                if not exiting or time.monotonic() > deadline:
                    raise
            time.sleep(0.05)

    def _remove_stale_lock_files(self) -> None:
        """A killed postmaster stays a zombie until init reaps it (some container inits
        take seconds), and while its pid answers signals PostgreSQL takes the pid in its
        lock files (``postmaster.pid``, the socket's ``.lock``) for a live server. It is
        dead: they go. Its children, if some still run, are caught by the shared memory
        check instead (``restart`` waits for them)."""
        if not self.killed_pid or _alive(self.killed_pid):
            return
        for lock in (self.data / "postmaster.pid", self.base / f".s.PGSQL.{self.port}.lock"):
            try:
                if int(lock.read_text().splitlines()[0]) == self.killed_pid:
                    lock.unlink()
            except (OSError, IndexError, ValueError):
                pass  # no such file: nothing to remove

    def promote(self) -> None:
        """``pg_ctl promote -w``: the standby ends recovery and takes writes; returns once
        it does."""
        self._run("pg_ctl", "-D", str(self.data), "-w", "-t", "60", "promote")

    def _release_killed_memory(self) -> None:
        """A killed server's System V shared memory outlives it (its next start would
        reuse it): mark it for removal, done once its last process has detached."""
        ipcrm = shutil.which("ipcrm")
        if self.killed_pid and self._killed_shmid and ipcrm and not self.running:
            subprocess.run(
                [ipcrm, "-m", self._killed_shmid], capture_output=True, timeout=30, check=False
            )


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie counts as dead (reaped here if it is our child,
    as it is when the tests run as pid 1 in a container)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass  # not ours: pg_ctl's postmaster belongs to init
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if sys.platform.startswith("linux"):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        return stat.rpartition(")")[2].split()[0] != "Z"
    return True
