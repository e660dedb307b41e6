"""Running a recipe for real: its processes, a concurrent HTTP client, a worker killer, and the
exactly-once check, shared by both recipes (tests/test_recipes.py).

Every wait is on a condition with a deadline; every process started here is in a process
group of its own, killed whole by ``Processes.close`` (gunicorn's workers included).
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import json
import os
import random
import re
import shlex
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import streamq

ROOT = Path(__file__).resolve().parents[2]
STREAM = "orders"


def wait_until(condition: Callable[[], object], timeout: float, what: str) -> None:
    """Poll ``condition`` until it is true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.01)


# --- processes ------------------------------------------------------------------------


class Process:
    """A process started for a test in a process group of its own, its output in a file."""

    def __init__(
        self, name: str, argv: Sequence[str], log: Path, env: dict[str, str], cwd: Path = ROOT
    ) -> None:
        self.name, self.log = name, log
        with log.open("wb") as out:
            self.popen = subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_line(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first match of ``pattern`` in the output; fails if the process exits first."""
        deadline = time.monotonic() + timeout
        while True:
            match = re.search(pattern, self.output())
            if match:
                return match
            assert self.popen.poll() is None, f"{self.name} exited:\n{self.output()}"
            assert time.monotonic() < deadline, f"{self.name}: no {pattern!r}:\n{self.output()}"
            time.sleep(0.01)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)  # the whole group: workers too
        self.popen.wait(timeout=10)


class Processes:
    """The processes of one recipe run, in ``cwd``: ``close`` kills every one, whatever
    happened."""

    def __init__(self, directory: Path, env: dict[str, str], cwd: Path = ROOT) -> None:
        self.directory, self.env, self.cwd = directory, env, cwd
        self.started: list[Process] = []

    def start(self, name: str, *argv: str, env: dict[str, str] | None = None) -> Process:
        """``argv`` running until ``close``; ``env``: variables set for this one."""
        log = self.directory / f"{name}.log"
        process = Process(name, argv, log, {**self.env, **(env or {})}, self.cwd)
        self.started.append(process)
        return process

    def run(
        self, name: str, *argv: str, timeout: float = 60, env: dict[str, str] | None = None
    ) -> None:
        """A setup step run to its end (a migration): it must succeed."""
        log = self.directory / f"{name}.log"
        with log.open("wb") as out:
            done = subprocess.run(
                argv,
                cwd=self.cwd,
                env={**self.env, **(env or {})},
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
        assert done.returncode == 0, f"{name} failed:\n{log.read_text(errors='replace')}"

    def kill(self, process: Process) -> None:
        """``kill -9`` one of them (its group), no longer expected alive."""
        process.kill()
        self.started.remove(process)

    def assert_alive(self) -> None:
        for process in self.started:
            assert process.popen.poll() is None, f"{process.name} died:\n{process.output()}"

    def close(self) -> None:
        for process in reversed(self.started):
            process.kill()


def recipe_env() -> dict[str, str]:
    """The environment of a deployed recipe: the project importable. Nothing else: what a
    step needs (``ORDERS_DB``, ``DJANGO_SETTINGS_MODULE``) is what the guide's steps set."""
    paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    inherited = {k: v for k, v in os.environ.items() if k not in SET_BY_STEPS}
    return dict(inherited, PYTHONPATH=os.pathsep.join(paths))


SET_BY_STEPS = ("ORDERS_DB", "DJANGO_SETTINGS_MODULE")  # not from the test's environment


def start_audit(processes: Processes, address: str, audit_db: Path, module: str) -> None:
    """The consumer ``module`` (``tests.recipes.audit``, or the Django one, whose database
    is Django's: ``ORDERS_DB`` is the audit database for that process)."""
    env = {"ORDERS_DB": str(audit_db)}
    processes.start("audit", sys.executable, "-m", module, address, str(audit_db), env=env)


# --- the guide's steps ----------------------------------------------------------------

GUIDE = ROOT / "docs" / "guides" / "services.md"
# The programs the guide runs, each run as its module under this interpreter (the same
# entry point as the command, without depending on PATH).
PROGRAMS = {
    "streamq": "streamq",
    "flask": "flask",
    "gunicorn": "gunicorn",
    "django-admin": "django",
}


def documented_steps(
    recipe: str, guide: Path = GUIDE, heading: str = "Deploying"
) -> list[list[str]]:
    """The commands of the guide's "Deploying" section (or ``heading``'s, in ``guide``) that
    deploy ``recipe`` ("Flask", "Django", "SQLAlchemy"), in the guide's order: those before
    any "# Name" comment of their block (every recipe's), and those under "# recipe ...".
    A command may go on over lines that end with a backslash, as in the shell."""
    section = guide_section(guide, heading)
    steps = []
    for block in re.findall(r"^```bash\n(.*?)^```$", section, re.MULTILINE | re.DOTALL):
        current = None
        for line in block.replace("\\\n", " ").splitlines():
            if line.startswith("#"):
                current = line.lstrip("# ").split()[0]
            elif (command := shlex.split(line, comments=True)) and current in (None, recipe):
                steps.append(command)
    assert steps, f"{guide}: no steps for {recipe} under {heading}"
    return steps


def guide_lines(heading: str, guide: Path = GUIDE) -> list[str]:
    """The shell lines of the ```bash blocks of the guide's ``## heading`` section, as
    written (comments and blank lines left out)."""
    return [line for block in guide_blocks(heading, guide) for line in block]


def guide_blocks(heading: str, guide: Path = GUIDE) -> list[list[str]]:
    """Each ```bash block of the guide's ``## heading`` section: its shell lines, as
    written (a line continued with a backslash joined; comments and blank lines left
    out)."""
    blocks = []
    section = guide_section(guide, heading)
    for block in re.findall(r"^```bash\n(.*?)^```$", section, re.MULTILINE | re.DOTALL):
        lines = block.replace("\\\n", " ").splitlines()
        blocks.append([line for line in lines if line.strip() and not line.startswith("#")])
    return blocks


def guide_section(guide: Path, heading: str) -> str:
    """The text of the guide's ``## heading`` section, up to the next ``## `` (or the end)."""
    text = guide.read_text(encoding="utf-8")
    section = text[text.index(f"\n## {heading}\n") + 1 :]
    end = section.find("\n## ")
    return section if end < 0 else section[:end]


def _as_run_here(command: Sequence[str], orders_db: Path) -> tuple[dict[str, str], list[str]]:
    """A documented command as the test runs it: its ``NAME=value`` prefixes as the
    environment, the program as its module, ``shop.db`` as ``orders_db``, and free
    loopback ports for ``--port 7400`` and ``--bind 127.0.0.1:8000``."""
    words = [str(orders_db) if word == "shop.db" else word for word in command]
    env = {}
    while "=" in words[0]:
        name, _, value = words.pop(0).partition("=")
        env[name] = str(orders_db) if value == "shop.db" else value
    program = words.pop(0)
    assert program in PROGRAMS, f"{GUIDE}: unknown program {program!r} in {shlex.join(command)}"
    for option, free in (("--port", "0"), ("--bind", "127.0.0.1:0")):
        if option in words:
            words[words.index(option) + 1] = free
    return env, [sys.executable, "-m", PROGRAMS[program], *words]


def deploy_as_documented(
    processes: Processes, recipe: str, orders_db: Path
) -> tuple[str, Gunicorn]:
    """Follow the guide's steps for ``recipe`` in its order, from the repository's root as
    the guide is: ``streamq serve`` (the sidecar) and ``gunicorn`` keep running, every other
    step must succeed. Returns the sidecar's address and gunicorn."""
    address, gunicorn = None, None
    for n, command in enumerate(documented_steps(recipe), 1):
        env, argv = _as_run_here(command, orders_db)
        name = f"step{n}-{command[len(env)]}"
        if argv[2:4] == ["streamq", "serve"]:
            sidecar = processes.start(name, *argv, env=env)
            served = sidecar.wait_for_line(r"serving producer \S+ \(epoch \d+\) on (\S+)", 20)
            address = served.group(1)
        elif argv[2] == "gunicorn":
            gunicorn = Gunicorn(processes, name, argv, env, orders_db)
        else:
            processes.run(name, *argv, env=env)
    assert address and gunicorn, f"{GUIDE}: {recipe}'s steps start no sidecar or no gunicorn"
    return address, gunicorn


# --- gunicorn -------------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
    return state, int(ppid)


def _open_files(pid: int) -> set[str]:
    """What a process's descriptors point to: paths, and ``socket:[inode]`` for sockets."""
    targets = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                targets.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return targets


WAL_WRITE_LOCK = 120  # the byte of the -shm file a SQLite writer locks (WALINDEX_LOCK_OFFSET)


def _write_lock_holder(database: str) -> int | None:
    """The pid holding the database's write lock (in a write transaction), from /proc/locks."""
    try:
        inode = os.stat(database + "-shm").st_ino
        locks = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    held = ["POSIX", "ADVISORY", "WRITE"]  # waiters' lines have "->" before: not these
    byte = [str(WAL_WRITE_LOCK)] * 2
    for line in locks:  # "1: POSIX  ADVISORY  WRITE 4242 fe:00:9978065 120 120"
        fields = line.split()
        if fields[1:4] == held and fields[6:8] == byte and fields[5].endswith(f":{inode}"):
            return int(fields[4])
    return None


@dataclass
class Kill:
    pid: int
    mid_request: bool  # it held a client's connection
    in_transaction: bool  # it held the database's write lock: between BEGIN and COMMIT


class Gunicorn:
    """A gunicorn master and its sync workers, found in /proc as the master's children."""

    def __init__(
        self,
        processes: Processes,
        name: str,
        argv: Sequence[str],
        env: dict[str, str],
        database: Path,
    ) -> None:
        """Start ``argv`` (gunicorn, ``--workers N``, bound to a free loopback port) and wait
        until its workers answer. ``--no-control-socket``: not the one control socket in the
        home directory that every gunicorn run shares by default."""
        workers = int(argv[list(argv).index("--workers") + 1])
        self.workers, self.database = workers, str(database)
        self.process = processes.start(name, *argv, "--no-control-socket", env=env)
        listening = r"Listening at: http://127\.0\.0\.1:(\d+)"
        self.port = int(self.process.wait_for_line(listening, 20).group(1))
        wait_until(lambda: len(self.worker_pids()) == workers, 20, f"{workers} workers")
        wait_until(self.healthy, 30, "GET /health answered 200")

    def worker_pids(self) -> list[int]:
        """The live workers (zombies excluded: a killed one not yet reaped by the master)."""
        master = self.process.pid
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                stat = _stat(int(entry))
                if stat is not None and stat[1] == master and stat[0] != "Z":
                    pids.append(int(entry))
        return pids

    def healthy(self) -> bool:
        assert self.process.popen.poll() is None, f"gunicorn exited:\n{self.process.output()}"
        with contextlib.suppress(OSError):
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
            try:
                conn.request("GET", "/health")
                return conn.getresponse().status == 200
            finally:
                conn.close()
        return False

    def _serving(self) -> list[Kill]:
        """Workers serving a request: holding a socket the master does not (a client's)."""
        master = _open_files(self.process.pid)
        writer = _write_lock_holder(self.database)
        return [
            Kill(pid, True, pid == writer)
            for pid in self.worker_pids()
            if any(f.startswith("socket:") for f in _open_files(pid) - master)
        ]

    def _in_transaction(self) -> list[Kill]:
        """The worker holding the write lock, if one does: looked up in well under a
        millisecond, as transactions are short."""
        writer = _write_lock_holder(self.database)
        stat = None if writer is None else _stat(writer)
        if writer is None or stat is None or stat[1] != self.process.pid:
            return []  # nobody, or the sidecar (its own commits), or gone
        return [Kill(writer, True, True)]

    def kill_worker(self, rng: random.Random, *, in_transaction: bool, timeout: float = 5) -> Kill:
        """``kill -9`` a worker serving a request (``in_transaction``: the one holding the
        write lock, between BEGIN and COMMIT), looked for up to ``timeout`` (then any worker),
        and wait until the master has replaced it."""
        find = self._in_transaction if in_transaction else self._serving
        deadline = time.monotonic() + timeout
        while not (victims := find()) and time.monotonic() < deadline:
            time.sleep(0.0005)
        kill = rng.choice(victims or [Kill(pid, False, False) for pid in self.worker_pids()])
        os.kill(kill.pid, signal.SIGKILL)
        wait_until(
            lambda: kill.pid not in (pids := self.worker_pids()) and len(pids) == self.workers,
            20,
            f"gunicorn to replace worker {kill.pid}",
        )
        return kill


# --- the client and the killer -------------------------------------------------------


def post_order(port: int, order_id: int) -> int | str:
    """POST one order: the HTTP status, or the name of the error that ended the request."""
    body = json.dumps({"id": order_id, "item": f"sku-{order_id % 17}"})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/orders", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException) as exc:
        return type(exc).__name__
    finally:
        conn.close()


@dataclass
class Load:
    """What the client saw: order id -> HTTP status or error name, and the workers killed."""

    outcomes: dict[int, int | str] = field(default_factory=dict)
    kills: list[Kill] = field(default_factory=list)

    def ids(self, *, status: int) -> set[int]:
        return {i for i, outcome in self.outcomes.items() if outcome == status}

    def failed(self) -> set[int]:
        return {i for i, outcome in self.outcomes.items() if isinstance(outcome, str)}


def send_orders(
    gunicorn: Gunicorn, orders: int, *, threads: int, kills: int, timeout: float, seed: int = 7
) -> Load:
    """POST orders 1..``orders`` from ``threads`` client threads while a killer thread
    ``kill -9``s a busy worker ``kills`` times, spread evenly over the run by progress."""
    load = Load()
    pending = iter(range(1, orders + 1))
    progress = threading.Condition()
    deadline = time.monotonic() + timeout
    errors: list[BaseException] = []

    def client() -> None:
        while time.monotonic() < deadline:
            with progress:
                order_id = next(pending, None)
            if order_id is None:
                return
            outcome = post_order(gunicorn.port, order_id)
            with progress:
                load.outcomes[order_id] = outcome
                progress.notify_all()

    def answered(count: int) -> Callable[[], bool]:
        return lambda: len(load.outcomes) >= count

    def killer() -> None:
        rng = random.Random(seed)
        try:
            for k in range(1, kills + 1):
                with progress:
                    left = max(0, deadline - time.monotonic())
                    if not progress.wait_for(answered(k * orders // (kills + 1)), left):
                        return  # the clients' deadline fails the test below
                # Every other kill aims inside a transaction, the others anywhere in a request.
                load.kills.append(gunicorn.kill_worker(rng, in_transaction=k % 2 == 1))
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=client) for _ in range(threads)]
    workers.append(threading.Thread(target=killer))
    for thread in workers:
        thread.start()
    joined_by = deadline + 35  # a request started at the deadline has its own 30 s timeout
    for thread in workers:
        thread.join(max(0, joined_by - time.monotonic()))
    assert not any(t.is_alive() for t in workers), "client or killer threads did not finish"
    if errors:
        raise errors[0]
    assert len(load.outcomes) == orders, f"only {len(load.outcomes)}/{orders} sent in {timeout} s"
    assert len(load.kills) == kills, f"only {len(load.kills)}/{kills} workers killed"
    return load


# --- the check ------------------------------------------------------------------------


def _rows(db: Path, sql: str) -> list[tuple[Any, ...]]:
    with contextlib.closing(sqlite3.connect(db, timeout=20)) as conn:
        return conn.execute(sql).fetchall()


@dataclass
class Figures:
    sent: int
    answered_201: int
    failed: int
    failed_committed: int
    retried_201: int
    retried_409: int
    committed: int
    consumed: int
    kills: int
    kills_mid_request: int
    kills_in_transaction: int

    def __str__(self) -> str:
        return (
            f"{self.sent} orders sent, {self.answered_201} answered 201; {self.kills} workers "
            f"killed ({self.kills_mid_request} mid-request, {self.kills_in_transaction} inside "
            f"its transaction), {self.failed} requests failed "
            f"({self.failed_committed} of them committed all the same); retried: "
            f"{self.retried_201} x 201, {self.retried_409} x 409; {self.committed} committed, "
            f"{self.consumed} consumed exactly once"
        )


def committed_orders(orders_db: Path) -> dict[int, str]:
    return {int(i): str(item) for i, item in _rows(orders_db, "SELECT id, item FROM orders")}


def retry_failed(gunicorn: Gunicorn, load: Load, committed: set[int]) -> tuple[int, int]:
    """Send each failed order again, as a client would: a committed one must get 409 (the
    primary key), the others 201; returns the two counts."""
    retried = {order_id: post_order(gunicorn.port, order_id) for order_id in sorted(load.failed())}
    expected = {i: 409 if i in committed else 201 for i in retried}
    assert retried == expected, "a retry's answer does not match whether the order committed"
    return sum(s == 201 for s in retried.values()), sum(s == 409 for s in retried.values())


def check_exactly_once(
    gunicorn: Gunicorn, orders_db: Path, audit_db: Path, address: str, load: Load
) -> Figures:
    """Every answered order committed, every committed order consumed exactly once, nothing
    else consumed; then the failed ones retried, and the same again for all of them."""
    sent = set(load.outcomes)
    outcomes = collections.Counter(load.outcomes.values())
    assert all(o == 201 for o in outcomes if not isinstance(o, str)), f"answers: {outcomes}"
    committed = committed_orders(orders_db)
    answered = load.ids(status=201)
    lost = answered - committed.keys()
    assert not lost, f"answered 201, not committed: {sorted(lost)}"
    assert committed.keys() <= sent
    failed = load.failed()
    assert committed.keys() - answered <= failed
    assert len(failed) <= len(load.kills), "more failed requests than workers killed"
    failed_committed = len(failed & committed.keys())
    wait_consumed(audit_db, address, committed)

    retried_201, retried_409 = retry_failed(gunicorn, load, set(committed))
    committed = committed_orders(orders_db)
    assert committed.keys() == sent, "after the retries, some orders are not committed"
    consumed = wait_consumed(audit_db, address, committed)
    return Figures(
        sent=len(sent),
        answered_201=len(answered),
        failed=len(failed),
        failed_committed=failed_committed,
        retried_201=retried_201,
        retried_409=retried_409,
        committed=len(committed),
        consumed=consumed,
        kills=len(load.kills),
        kills_mid_request=sum(kill.mid_request for kill in load.kills),
        kills_in_transaction=sum(kill.in_transaction for kill in load.kills),
    )


def served_head(address: str) -> int:
    """The head of the stream as the sidecar serves it (it learns of commits by inotify)."""
    with streamq.Client(address) as client:
        return client.head(STREAM).head


def wait_consumed(audit_db: Path, address: str, committed: dict[int, str]) -> int:
    """Wait until the sidecar serves the whole log and the audit consumer has applied it, then
    compare: the log's head == committed orders, seqs dense from 1 (none twice), each order
    applied once, as committed."""
    wait_until(
        lambda: served_head(address) >= len(committed),
        20,
        f"the sidecar to serve the {len(committed)} committed orders",
    )
    head = served_head(address)
    assert head == len(committed), f"log head {head} != {len(committed)} committed orders"
    position = "SELECT coalesce(max(seq), 0) FROM streamq_positions WHERE consumer = 'audit'"
    wait_until(
        lambda: audit_db.exists() and _applied(audit_db, position) >= head,
        20,
        f"the audit consumer to apply up to seq {head}",
    )
    applied = _rows(audit_db, "SELECT seq, order_id, item FROM audit ORDER BY seq")
    assert [seq for seq, _, _ in applied] == list(range(1, head + 1)), "seqs not dense or twice"
    consumed = sorted((order_id, item) for _, order_id, item in applied)
    assert consumed == sorted(committed.items()), "consumed orders differ from committed ones"
    return len(applied)


def _applied(audit_db: Path, sql: str) -> int:
    with contextlib.suppress(sqlite3.OperationalError):  # its tables may not exist yet
        return int(_rows(audit_db, sql)[0][0])
    return 0


@contextlib.contextmanager
def deployed(directory: Path, env: dict[str, str]) -> Iterator[Processes]:
    """Processes for one recipe run, all killed on the way out."""
    processes = Processes(directory, env)
    try:
        yield processes
    except BaseException:
        for process in processes.started:  # shown by pytest with the failure
            print(f"--- {process.name} (last lines) ---\n{process.output()[-3000:]}")
        raise
    finally:
        processes.close()
