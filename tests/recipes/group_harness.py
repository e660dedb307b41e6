"""Running a consumer group's deployment recipe for real (tests/groups/test_group_recipes.py): the
guide's steps (docs/guides/groups.md, "Deploying a group"), the fleet of worker processes
under their master (supervisord, gunicorn), a steady publisher, the group as its lease
rows and liveness locks say, and the exactly-once check.

Every wait is on a condition with a deadline. The processes are ``harness.Processes``'
(each in a process group of its own); supervisord's workers are in process groups of
their own too, so ``Fleet.close`` stops them through supervisord, and kills any left.
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import json
import os
import random
import re
import shlex
import signal
import sqlite3
import struct
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import streamq

from . import harness
from .billing import STREAM

GUIDE = harness.ROOT / "docs" / "guides" / "groups.md"
HEADING = "Deploying a group"
SHARES = 8  # the split the recipes' workers ask for (--shares 8, billing_app.SHARES)
ADDRESS = "127.0.0.1:7400"  # the sidecar's address in the guide
# The guide's programs, each run as its module under this interpreter (as harness.PROGRAMS).
PROGRAMS = {
    "streamq": "streamq",
    "gunicorn": "gunicorn",
    "supervisord": "supervisor.supervisord",
    "supervisorctl": "supervisor.supervisorctl",
}
FILES = ("shop.db", "billing.db", "billing.conf", "gunicorn.pid")  # made in the run's folder


def steps(recipe: str) -> list[list[str]]:
    """The guide's commands for ``recipe`` ("supervisord", "gunicorn"), in its order."""
    return harness.documented_steps(recipe, GUIDE, HEADING)


def supervisor_conf() -> str:
    """The guide's ``billing.conf`` (its one ``ini`` block)."""
    section = harness.guide_section(GUIDE, HEADING)
    [conf] = re.findall(r"^```ini\n(.*?)^```$", section, re.MULTILINE | re.DOTALL)
    return str(conf)


# --- the deployment ---------------------------------------------------------------------


class Deployment:
    """The guide's steps, run in a temporary folder: its file names there, the sidecar's
    real address for ``127.0.0.1:7400``, a free port for ``--port`` and ``--bind``."""

    def __init__(self, processes: harness.Processes, directory: Path) -> None:
        self.processes, self.directory = processes, directory
        self.address = ADDRESS  # until the sidecar says which port it has
        self.count = 0
        # The virtualenv's programs first, as once it is activated: supervisord runs the
        # worker as `python -m ...`.
        bindir = str(Path(sys.executable).parent)
        processes.env["PATH"] = os.pathsep.join([bindir, processes.env.get("PATH", "")])

    def path(self, name: str) -> Path:
        return self.directory / name

    def _word(self, word: str) -> str:
        if word in FILES:
            return str(self.path(word))
        return word.replace(ADDRESS, self.address)

    def as_run_here(self, command: Sequence[str]) -> tuple[str, dict[str, str], list[str]]:
        """(program, environment, argv) of a documented command."""
        words = [self._word(word) for word in command]
        env = {}
        while "=" in words[0]:
            name, _, value = words.pop(0).partition("=")
            env[name] = self._word(value)
        program = words.pop(0)
        assert program in PROGRAMS, f"{GUIDE}: unknown program {program!r} in {command}"
        for option, free in (("--port", "0"), ("--bind", "127.0.0.1:0")):
            if option in words:
                words[words.index(option) + 1] = free
        return program, env, [sys.executable, "-m", PROGRAMS[program], *words]

    def run(self, command: Sequence[str]) -> None:
        """A step run to its end, which must succeed (``kill`` lines by the shell)."""
        self.count += 1
        name = f"step{self.count}-{command[0]}"
        if command[0] == "kill":  # kill -TTIN $(cat gunicorn.pid): the shell's
            line = " ".join(command)
            for file in FILES:
                line = line.replace(file, shlex.quote(str(self.path(file))))
            self.processes.run(name, "bash", "-c", line)
            return
        _, env, argv = self.as_run_here(command)
        self.processes.run(name, *argv, env=env)

    def start(self, command: Sequence[str]) -> harness.Process:
        """A step that keeps running (the sidecar, supervisord, gunicorn)."""
        self.count += 1
        program, env, argv = self.as_run_here(command)
        if program == "gunicorn":
            argv.append("--no-control-socket")  # not the home directory's, shared by all runs
        process = self.processes.start(f"step{self.count}-{program}", *argv, env=env)
        if argv[2:4] == ["streamq", "serve"]:
            served = process.wait_for_line(r"serving producer \S+ \(epoch \d+\) on (\S+)", 20)
            self.address = served.group(1)
        return process

    def write_conf(self, numprocs: int | None = None) -> int:
        """The guide's ``billing.conf`` in the folder (``numprocs`` changed, if given), the
        sidecar's address in its command; the number of workers it runs."""
        conf = supervisor_conf().replace(ADDRESS, self.address)
        if numprocs is not None:
            conf, changed = re.subn(r"^numprocs = \d+", f"numprocs = {numprocs}", conf, flags=re.M)
            assert changed == 1, f"{GUIDE}: billing.conf has no 'numprocs = N' line"
        self.path("billing.conf").write_text(conf)
        return int(re.search(r"^numprocs = (\d+)", conf, re.M).group(1))  # type: ignore[union-attr]


# --- the group as its rows say ----------------------------------------------------------

_FLOCK = "hhqqi4x"  # struct flock on Linux, as streamq.engines.sqlite.leases


def holdings(db: Path) -> dict[int, list[int]]:
    """Each live member's shares (members with none included), from the lease rows and the
    members' liveness locks (a byte of ``DB-streamq-members`` each, held while it lives)."""
    with contextlib.suppress(sqlite3.OperationalError, FileNotFoundError):
        with contextlib.closing(
            sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=20)
        ) as conn:
            members = [m for (m,) in conn.execute("SELECT member FROM streamq_members")]
            leases = conn.execute("SELECT share, member FROM streamq_leases").fetchall()
        fd = os.open(f"{db}-streamq-members", os.O_RDWR)
        try:
            held: dict[int, list[int]] = {m: [] for m in members if _locked(fd, m)}
        finally:
            os.close(fd)
        for share, member in sorted(leases):
            if member in held:
                held[member].append(share)
        return held
    return {}  # not made yet


def _locked(fd: int, member: int) -> bool:
    """Whether ``member``'s liveness lock is held (F_OFD_GETLK: what would conflict)."""
    found = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, 0, member, 1, 0))
    kind: int = struct.unpack(_FLOCK, found)[0]
    return kind != fcntl.F_UNLCK


def balanced(db: Path, members: int) -> bool:
    """``members`` live members, holding every share between them, evenly."""
    held = holdings(db)
    shares = sorted(share for part in held.values() for share in part)
    each = SHARES // members
    return (
        len(held) == members
        and shares == list(range(SHARES))
        and all(each <= len(part) <= each + 1 for part in held.values())
    )


# --- the fleet ---------------------------------------------------------------------------


@dataclass
class Kill:
    pid: int
    in_transaction: bool  # it held the group database's write lock (applying, or a lease)


@dataclass
class Fleet:
    """A master (supervisord, gunicorn's arbiter) and its worker processes, each a member of
    the group in ``db``; ``workers``: how many the master runs now."""

    master: harness.Process
    db: Path
    workers: int
    kills: list[Kill] = field(default_factory=list)

    def worker_pids(self) -> list[int]:
        """The live workers: the master's children (zombies excluded)."""
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                stat = harness._stat(int(entry))
                if stat is not None and stat[1] == self.master.pid and stat[0] != "Z":
                    pids.append(int(entry))
        return pids

    def settle(self, workers: int, what: str) -> None:
        """Wait until the master runs ``workers`` workers and they hold the shares evenly."""
        self.workers = workers
        deadline = time.monotonic() + 30
        while not (len(self.worker_pids()) == workers and balanced(self.db, workers)):
            assert self.master.popen.poll() is None, f"{self.master.name} exited"
            assert time.monotonic() < deadline, (
                f"{what}: after 30 s, {len(self.worker_pids())} workers, not {workers}, or "
                f"not holding the {SHARES} shares evenly: {holdings(self.db)}"
            )
            time.sleep(0.01)

    def kill_worker(self, rng: random.Random, *, in_transaction: bool) -> Kill:
        """``kill -9`` a worker (``in_transaction``: the one holding the write lock, looked
        for up to 5 s), and wait until the master has replaced it and the group settled."""
        victim = None
        deadline = time.monotonic() + 5
        while in_transaction and victim is None and time.monotonic() < deadline:
            writer = harness._write_lock_holder(str(self.db))
            stat = None if writer is None else harness._stat(writer)
            if stat is not None and stat[1] == self.master.pid:
                victim = writer
            else:
                time.sleep(0.0005)  # transactions are short: look again at once
        kill = Kill(victim, True) if victim else Kill(rng.choice(self.worker_pids()), False)
        os.kill(kill.pid, signal.SIGKILL)
        self.kills.append(kill)
        harness.wait_until(
            lambda: kill.pid not in self.worker_pids(), 10, f"worker {kill.pid} to be reaped"
        )
        self.settle(self.workers, f"after kill -9 of worker {kill.pid}")
        return kill

    def stop(self, timeout: float = 40) -> None:
        """SIGTERM the master, which stops its workers (each leaves the group), and wait."""
        self.master.popen.send_signal(signal.SIGTERM)
        self.master.popen.wait(timeout)

    def close(self) -> None:
        """Kill whatever is left: the master, and workers in process groups of their own."""
        left = self.worker_pids()
        self.master.kill()
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def health(port: int) -> tuple[int, dict[str, Any]]:
    """GET /health of a gunicorn worker: its status and JSON."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/health")
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


# --- the producer -------------------------------------------------------------------------

KEYS = [f"account-{n}" for n in range(40)]


class Publisher:
    """Publishes records into the producer's database at a steady rate, ``per`` in each
    transaction, ``rate`` transactions a second, in a thread (as the producer's own service
    would, through its connection), until stopped or ``most`` are published: ``expected``
    maps each seq to its key and number."""

    def __init__(self, db: Path, most: int, *, per: int = 10, rate: float = 20) -> None:
        self.db, self.most, self.per, self.rate = db, most, per, rate
        self.expected: dict[int, tuple[str, int]] = {}
        self.progress = threading.Condition()
        self.error: BaseException | None = None
        self._seen = 0  # published at the last ``more``
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._publish, name="publisher", daemon=True)

    def start(self) -> Publisher:
        self._thread.start()
        return self

    def _publish(self) -> None:
        try:
            with contextlib.closing(
                sqlite3.connect(self.db, timeout=20, isolation_level=None)
            ) as c:
                started = time.monotonic()
                for tick, first in enumerate(range(0, self.most, self.per)):
                    # The pace, not a wait for anything; stop() ends it at once.
                    if self._stopping.wait(started + tick / self.rate - time.monotonic()):
                        return
                    numbers = range(first, min(first + self.per, self.most))
                    c.execute("BEGIN IMMEDIATE")
                    seqs = [self._one(c, n) for n in numbers]
                    c.execute("COMMIT")
                    with self.progress:
                        self.expected.update(
                            zip(seqs, [(KEYS[n % len(KEYS)], n) for n in numbers], strict=True)
                        )
                        self.progress.notify_all()
        except BaseException as exc:
            self.error = exc
            with self.progress:
                self.progress.notify_all()

    @staticmethod
    def _one(conn: sqlite3.Connection, n: int) -> int:
        key = KEYS[n % len(KEYS)]
        seq = streamq.publish(conn, STREAM, json.dumps({"n": n}).encode(), key=key.encode())
        assert isinstance(seq, int)
        return seq

    def more(self, records: int, timeout: float = 30) -> None:
        """Wait until ``records`` more have been published since the last call: the
        fleet applies them meanwhile, whatever happened to it just before."""
        self._seen += records
        with self.progress:
            done = self.progress.wait_for(
                lambda: self.error or len(self.expected) >= self._seen, timeout
            )
        assert self.error is None, f"publishing failed: {self.error!r}"
        assert done, (
            f"{len(self.expected)} records published, not {self._seen} (at most {self.most})"
        )

    def stop(self) -> None:
        self.close()
        assert not self._thread.is_alive(), "the publisher did not stop"
        assert self.error is None, f"publishing failed: {self.error!r}"

    def close(self) -> None:
        """Stop publishing (whatever happened: the test may have failed)."""
        self._stopping.set()
        if self._thread.ident is not None:
            self._thread.join(30)


# --- the check --------------------------------------------------------------------------


@dataclass
class Figures:
    records: int
    kills: int
    kills_in_transaction: int
    appliers: int  # distinct worker processes that applied records
    takes: int  # lease takes: shares that moved (starts, deaths, rebalancing)

    def __str__(self) -> str:
        return (
            f"{self.records} records applied exactly once, each key in seq order, by "
            f"{self.appliers} worker processes; {self.kills} workers killed with -9 "
            f"({self.kills_in_transaction} inside a write transaction); {self.takes} lease takes"
        )


def _rows(db: Path, sql: str) -> list[tuple[Any, ...]]:
    with contextlib.closing(sqlite3.connect(db, timeout=20)) as conn:
        return conn.execute(sql).fetchall()


def applied(db: Path) -> int:
    with contextlib.suppress(sqlite3.OperationalError):  # no credits table yet
        return int(_rows(db, "SELECT count(DISTINCT seq) FROM credits")[0][0])
    return 0


def wait_applied(fleet: Fleet, address: str, expected: dict[int, tuple[str, int]]) -> None:
    """Wait until the sidecar serves every record and the group has applied each one."""
    harness.wait_until(
        lambda: harness.served_head(address) >= len(expected), 20, "the sidecar to serve all"
    )
    harness.wait_until(
        lambda: applied(fleet.db) >= len(expected),
        30,
        f"the group to apply {len(expected)} records (applied {applied(fleet.db)})",
    )


def check_exactly_once(fleet: Fleet, expected: dict[int, tuple[str, int]]) -> Figures:
    """With the fleet stopped: every record applied once, as published, and each key's
    records applied in seq order (the rows' order is the order they committed in)."""
    rows = _rows(fleet.db, "SELECT seq, key, n, pid FROM credits ORDER BY rowid")
    seqs = sorted(seq for seq, _, _, _ in rows)
    assert seqs == sorted(expected), (
        f"{len(rows)} rows for {len(expected)} records: "
        f"{len(seqs) - len(set(seqs))} applied twice, {len(set(expected) - set(seqs))} never"
    )
    assert {seq: (key, n) for seq, key, n, _ in rows} == expected, (
        "applied rows differ from the records published"
    )
    by_key: dict[str, list[int]] = {}
    for seq, key, _, _ in rows:
        by_key.setdefault(key, []).append(seq)
    unordered = [key for key, order in by_key.items() if order != sorted(order)]
    assert not unordered, f"keys applied out of seq order: {unordered}"
    [(tokens,)] = _rows(fleet.db, "SELECT tokens FROM streamq_groups")
    return Figures(
        records=len(rows),
        kills=len(fleet.kills),
        kills_in_transaction=sum(kill.in_transaction for kill in fleet.kills),
        appliers=len({pid for _, _, _, pid in rows}),
        takes=int(tokens),
    )


def documented(commands: Sequence[Sequence[str]], *words: str) -> list[str]:
    """The one documented command that has all of ``words``."""
    found = [list(c) for c in commands if all(word in c for word in words)]
    assert len(found) == 1, (
        f"{GUIDE}: {len(found)} steps with {words}: {[shlex.join(c) for c in commands]}"
    )
    return found[0]
