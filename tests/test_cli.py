"""The ``streamq`` command line, run as real processes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import streamq
from streamq import cli

from .waiting import wait_until

STREAMQ = [sys.executable, "-m", "streamq"]


def wait_for_head(address: str, stream: str, head: int, timeout: float = 10.0) -> None:
    """Wait until the serving process has noticed commits made by another process."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with streamq.Client(address) as client:  # an error closes the connection
                if client.head(stream).head >= head:
                    return
        except streamq.UnknownStreamError:
            pass
        assert time.monotonic() < deadline, f"{stream} never reached {head} at {address}"
        time.sleep(0.02)


def run(
    *args: str, timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*STREAMQ, *args], capture_output=True, text=True, timeout=timeout, check=False, env=env
    )


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """``streamq serve`` on a free port: (database path, address)."""
    db = str(tmp_path / "orders.db")
    process = subprocess.Popen(
        [*STREAMQ, "serve", db, "--init", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        first = process.stdout.readline()  # blocks until serving, or EOF if it died
        assert first.startswith("serving producer"), first + process.stderr.read()
        yield db, first.rsplit(" on ", 1)[1].strip()
    finally:
        process.terminate()
        process.communicate(timeout=30)  # also closes the pipes
    assert process.returncode == 0


def test_publish_tail_status(served: tuple[str, str]) -> None:
    db, address = served
    published = run(
        "publish", db, "orders", "one", "two", "three", "--key", "k1", "--header", "t=x"
    )
    assert published.returncode == 0, published.stderr
    assert "published 3 record(s) to 'orders': seq 1..3" in published.stdout
    wait_for_head(address, "orders", 3)

    tail = run("tail", address, "orders", "--from", "2", "--count", "2", "--json")
    assert tail.returncode == 0, tail.stderr
    records = [json.loads(line) for line in tail.stdout.splitlines()]
    assert [(r["seq"], r["key"], r["value"], r["headers"]) for r in records] == [
        (2, "k1", "two", {"t": "x"}),
        (3, "k1", "three", {"t": "x"}),
    ]

    status = run("status", address, "--json")
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["streams"] == [
        {
            "stream": "orders",
            "head": 3,
            "low": 1,
            "key_index": False,
            "compact": False,
            "compacted": 0,
            "retention_ms": None,
            "retention_bytes": None,
        }
    ]
    table = run("status", address)
    assert "orders" in table.stdout and "consumers" in table.stdout

    # Piped (not a terminal), tables are as wide as they are: no cell cut to 80 columns
    # (unless COLUMNS says how wide; pytest sets it for its children).
    long_name = "billing-service-of-the-eu-west-region-replica[12/16]"
    added = run("consumers", "add", db, long_name, "orders")
    assert added.returncode == 0, added.stderr
    piped = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    status_shown = run("status", address, env=piped).stdout
    listed = run("consumers", "list", db, env=piped).stdout
    assert address in status_shown
    for shown in (status_shown, listed):
        assert long_name in shown and "…" not in shown, shown


def test_a_reader_gone_ends_a_command_quietly(served: tuple[str, str]) -> None:
    """``streamq status --json | head``: once whoever reads its output is gone, a command
    exits as Unix tools do, with nothing on stderr and the status of SIGPIPE (141)."""
    db, address = served
    assert run("publish", db, "orders", "a", "b").returncode == 0
    assert run("consumers", "add", db, "billing", "orders").returncode == 0
    wait_for_head(address, "orders", 2)
    commands = [
        ("status", address, "--json"),
        ("status", address),  # a table
        ("tail", address, "orders", "--from", "1"),  # in the event loop, following
        ("consumers", "list", db, "--json"),
    ]
    for command in commands:
        read, write = os.pipe()
        os.close(read)  # gone before the first line: no race with the command's output
        try:
            done = subprocess.run(
                [*STREAMQ, *command], stdout=write, stderr=subprocess.PIPE, text=True, timeout=60
            )
        finally:
            os.close(write)
        assert (done.returncode, done.stderr) == (128 + signal.SIGPIPE, ""), command


def test_tail_prints_only_what_its_filter_matches(served: tuple[str, str]) -> None:
    db, address = served
    for key, kind in (
        ("order-1", "paid"),
        ("user-1", "paid"),
        ("order-2", "new"),
        ("order-3", "paid"),
    ):
        published = run(
            "publish", db, "orders", f"{key} {kind}", "--key", key, "--header", f"type={kind}"
        )
        assert published.returncode == 0, published.stderr
    wait_for_head(address, "orders", 4)
    tail = run(
        "tail", address, "orders", "--from", "1", "--count", "2", "--json",
        "--key-prefix", "order-", "--header", "type=paid",
    )  # fmt: skip
    assert tail.returncode == 0, tail.stderr
    records = [json.loads(line) for line in tail.stdout.splitlines()]
    assert [(r["seq"], r["value"]) for r in records] == [(1, "order-1 paid"), (4, "order-3 paid")]
    bad = run("tail", address, "orders", "--header", "type")
    assert bad.returncode == 2 and "expected NAME=VALUE" in bad.stderr


def test_tail_follows_new_commits(served: tuple[str, str]) -> None:
    db, address = served
    assert run("publish", db, "orders", "old").returncode == 0
    wait_for_head(address, "orders", 1)
    tail = subprocess.Popen(
        [*STREAMQ, "tail", address, "orders", "--count", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Published by another process into the served database: the server notices.
        deadline_runs = 0
        while tail.poll() is None and deadline_runs < 50:
            assert run("publish", db, "orders", "new").returncode == 0
            deadline_runs += 1
            try:
                tail.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                continue
    finally:
        tail.kill()
        out, err = tail.communicate(timeout=30)
    assert tail.returncode == 0, err
    seq, _, value = out.strip().split("\t")
    assert int(seq) >= 2 and value == "new"


def test_errors_are_reported_not_raised(tmp_path: Path) -> None:
    missing = run("serve", str(tmp_path / "missing.db"))
    assert missing.returncode != 0
    assert "does not exist (`streamq init" in missing.stderr and "(or --init)" in missing.stderr
    unreachable = run("status", "127.0.0.1:1")
    assert unreachable.returncode == 1
    assert "cannot connect to producer at 127.0.0.1:1" in unreachable.stderr
    helped = run("--help")
    for command in ("serve", "publish", "tail", "status", "demo"):
        assert command in helped.stdout


def test_demo_moves_money_exactly_once(tmp_path: Path) -> None:
    demo = run("demo", "--seconds", "3", "--kills", "2", "--dir", str(tmp_path), timeout=120)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert demo.stdout.count("ok ") == 4
    assert "FAIL" not in demo.stdout


def test_client_tls_options_are_checked_in_cli_terms() -> None:
    """A key without a certificate is refused naming the flags, before connecting."""
    with pytest.raises(SystemExit, match="streamq status: --tls-key needs --tls-cert"):
        cli.main(["status", "127.0.0.1:1", "--tls-key", "client.key"])


# --- wrong targets: one line naming what was asked and what was found ----------------------


def refused(done: subprocess.CompletedProcess[str], returncode: int = 1) -> str:
    """The one line a refused command printed: no traceback, nothing on stdout."""
    assert done.returncode == returncode, done.stdout + done.stderr
    assert done.stdout == "" and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    return done.stderr


def table_names(path: Path) -> list[str]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    return sorted(name for (name,) in rows)


def test_commands_refuse_a_database_they_would_create(tmp_path: Path) -> None:
    """Only ``init`` and ``serve --init`` make a producer database: the other commands
    (``serve`` without ``--init`` too) neither create a missing file nor add the log
    tables to the wrong database, which would then be served while the real one waits."""
    missing = tmp_path / "nosuch.db"
    for args in (
        ("publish", str(missing), "orders", "x"),
        ("consumers", "list", str(missing)),
        ("consumers", "add", str(missing), "billing", "orders"),
    ):
        line = refused(run(*args))
        assert f"{missing} does not exist (`streamq init {missing}` creates" in line
    line = refused(run("serve", str(missing)))
    assert f"does not exist (`streamq init {missing}` (or --init) creates" in line
    for args in (
        ("dead-letters", "list", str(missing)),
        ("reshare", str(missing), "c", "--shares", "2"),
    ):
        assert "does not exist (a consumer's database is made by" in refused(run(*args))
    assert not missing.exists()

    app = tmp_path / "app.db"  # the application's own database, never initialised
    with contextlib.closing(sqlite3.connect(app)) as conn:
        conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY)")
    for args in (
        ("publish", str(app), "orders", "x"),
        ("consumers", "list", str(app)),
        ("history", str(app), "orders", "k"),
        ("serve", str(app), "--port", "0"),
    ):
        line = refused(run(*args))
        assert f"SQLite database '{app}' has no streamq log tables: give the producer's" in line
    assert "create them there with `streamq init DB` (or serve --init)" in line
    assert table_names(app) == ["orders"]

    assert run("init", str(missing), "--stream", "orders").returncode == 0  # init creates
    published = run("publish", str(missing), "orders", "x")
    assert published.returncode == 0, published.stderr


async def test_a_consumer_database_is_not_taken_for_a_producer_one(tmp_path: Path) -> None:
    producer_db, ledger = str(tmp_path / "orders.db"), str(tmp_path / "ledger.db")
    async with streamq.Producer(producer_db) as producer:
        await producer.publish("orders", b"x")
        consumer = streamq.Consumer(producer.address, "orders", db=ledger, name="c")
        async with consumer, consumer.transaction(await anext(consumer)):
            pass  # the position stored: the consumer's tables are there
    for args in (("publish", ledger, "orders", "y"), ("consumers", "list", ledger)):
        line = refused(run(*args))  # the producer is closed: nothing to serve meanwhile
        assert "has no streamq log tables (it is a consumer's database)" in line
    assert "streamq_streams" not in table_names(Path(ledger))


def test_dead_letters_and_reshare_refuse_the_producer_database(tmp_path: Path) -> None:
    """Given the producer's database, "parked records (0)" would be an answer from the
    wrong one."""
    db = str(tmp_path / "bank.db")
    assert run("init", db, "--stream", "orders").returncode == 0
    for args in (
        ("dead-letters", "list", db),
        ("dead-letters", "list", db, "--json"),
        ("dead-letters", "retry", db),
        ("reshare", db, "billing", "--shares", "2"),
    ):
        line = refused(run(*args))
        assert f"SQLite database '{db}' has no consumer tables (streamq_positions): it is " in line
        assert "a producer's database" in line
    with pytest.raises(streamq.SchemaMissingError, match="a producer's database"):
        streamq.list_dead_letters(db)
    plain = tmp_path / "plain.db"
    sqlite3.connect(plain).close()
    line = refused(run("dead-letters", "list", str(plain)))
    assert "no consumer tables (streamq_positions): no Consumer(db=...) has opened it" in line


def test_postgresql_databases_are_told_apart_too(pg_url: str) -> None:
    line = refused(run("consumers", "list", pg_url))
    assert f"PostgreSQL database {pg_url} has no streamq log tables" in line
    assert run("init", pg_url, "--stream", "orders").returncode == 0
    listed = run("consumers", "list", pg_url, "--json")
    assert listed.returncode == 0 and listed.stdout == "", listed.stderr
    line = refused(run("dead-letters", "list", pg_url))
    assert f"PostgreSQL database {pg_url} has no consumer tables" in line
    assert "a producer's database" in line


def test_unsupported_database_urls_are_one_line(tmp_path: Path) -> None:
    url = "mysql://shop:secret@db.example/shop"
    for args in (
        ("publish", url, "orders", "x"),
        ("serve", url),
        ("init", url),
        ("consumers", "list", url),
        ("dead-letters", "list", url),
    ):
        line = refused(run(*args))
        assert f"streamq {args[0]}: cannot open a mysql:// database" in line
        assert "SQLite file's path" in line and "postgresql://" in line
        assert "secret" not in line


def test_addresses_are_checked_in_one_line(tmp_path: Path) -> None:
    """Commands that ask a running producer say what they got instead of HOST:PORT."""
    db = str(tmp_path / "shop.db")
    assert run("init", db).returncode == 0
    for template in (("status", "{}"), ("tail", "{}", "o"), ("tail", "{}", "o", "--from", "1")):
        name = template[0]

        def ask(address: str, template: tuple[str, ...] = template) -> str:
            return refused(run(*(arg.format(address) for arg in template)))

        assert f"streamq {name}: address must be HOST:PORT, not '127.0.0.1'" in ask("127.0.0.1")
        assert f"{db} is a database; {name} asks a running producer: give its HOST:PORT" in ask(db)
        assert "postgresql://h/db is a database" in ask("postgresql://h/db")
        assert "not a URL: 'http://127.0.0.1:7411' (drop 'http://')" in ask("http://127.0.0.1:7411")
        # 99999 would wrap around to port 34463, someone else's.
        assert "port must be 1 to 65535, not 99999" in ask("127.0.0.1:99999")
    line = refused(run("history", "http://127.0.0.1:7411", "orders", "k"))
    assert (
        "neither a database file nor HOST:PORT (a producer's address goes without http://)" in line
    )
    with pytest.raises(ValueError, match="drop 'http://'"):
        streamq.Client("http://127.0.0.1:7411")


def test_serve_names_the_address_it_cannot_listen_on(tmp_path: Path) -> None:
    """A host that does not resolve, or a port another process holds: one line naming
    the address asked for."""
    db = str(tmp_path / "shop.db")
    line = refused(run("serve", db, "--init", "--host", "nosuchhost.invalid", "--port", "0"))
    assert "cannot listen on nosuchhost.invalid:0" in line
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = refused(run("serve", db, "--host", "127.0.0.1", "--port", str(port)))
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in line


def test_malformed_arguments_are_one_line(tmp_path: Path) -> None:
    """Numbers out of range and bad names are refused before anything runs, in one line
    naming the argument (exit 2, as argparse's own errors)."""
    db = str(tmp_path / "shop.db")
    assert run("init", db, "--stream", "orders").returncode == 0
    for prog, args, expected in (
        (
            "tail",
            ("127.0.0.1:1", "o", "--count", "0"),
            "argument --count: must be 1 or more, not '0'",
        ),
        ("tail", ("127.0.0.1:1", "o", "--from", "-3"), "argument --from: must be 1 or more"),
        ("history", (db, "orders", "k", "--from", "0"), "argument --from: must be 1 or more"),
        ("serve", (db, "--port", "99999"), "argument --port: must be 0 to 65535, not '99999'"),
        ("serve", (db, "--metrics-port", "x"), "argument --metrics-port: must be 0 to 65535"),
        ("serve", (db, "--host", "0.0.0.0:7400"), "argument --host: give the host alone and the"),
        ("serve", (db, "--retention-ms", "-1"), "argument --retention-ms: must be 0 or more"),
        ("consumers add", (db, "c", "o", "--max-bytes", "0"), "argument --max-bytes: must be 1"),
        ("dead-letters retry", (db, "--seq", "0"), "argument --seq: must be 1 or more"),
        ("publish", (db, "", "x"), "argument stream: stream name must have 1 to 255 characters"),
        ("init", (db, "--stream", "s" * 256), "argument --stream: stream name must have 1 to 255"),
        ("demo", ("--seconds", "-1"), "argument --seconds: must be a number of seconds above 0"),
        ("publish", (db,), "the following arguments are required: stream"),
    ):
        line = refused(run(*prog.split(), *args), returncode=2)
        assert line.startswith(f"streamq {prog}: {expected}"), line
        assert line.endswith(f"(see streamq {prog} --help)\n"), line


def test_publish_with_nothing_to_publish_says_so(tmp_path: Path) -> None:
    db = str(tmp_path / "shop.db")
    assert run("init", db, "--stream", "orders").returncode == 0
    empty = subprocess.run(
        [*STREAMQ, "publish", db, "orders"], input="", capture_output=True, text=True, timeout=60
    )
    assert "nothing to publish: no VALUES given, stdin was empty" in refused(empty)


def test_registering_on_a_stream_not_there_yet_says_so(tmp_path: Path) -> None:
    """Allowed (retention keeps the stream from its first record), but a misspelt name
    would be kept for ever unnoticed."""
    db = str(tmp_path / "shop.db")
    assert run("init", db, "--stream", "orders").returncode == 0
    known = run("consumers", "add", db, "billing", "orders")
    assert known.stdout == "registered 'billing' on 'orders'\n", known.stderr
    typo = run("consumers", "add", db, "billing", "ordrs")
    assert typo.stdout == "registered 'billing' on 'ordrs' (no such stream yet)\n", typo.stderr


def test_names_and_token_secrets_are_checked(tmp_path: Path) -> None:
    """An empty consumer name, or a token made with a secret no producer accepts, would
    be a traceback, or a token refused later with no word of why."""
    db = str(tmp_path / "shop.db")
    assert run("init", db, "--stream", "orders").returncode == 0
    for prog, args, expected in (
        ("consumers add", (db, "", "orders"), "argument consumer: a consumer's name cannot be"),
        ("reshare", (db, "", "--shares", "2"), "argument consumer: a consumer's name cannot be"),
        ("token", ("",), "argument consumer: a consumer's name cannot be empty"),
        ("token", ("a:b",), "argument consumer: a token's consumer name has no ':'"),
    ):
        line = refused(run(*prog.split(), *args), returncode=2)
        assert line.startswith(f"streamq {prog}: {expected}"), line
    short = tmp_path / "secret"
    short.write_text("too-short\n")
    line = refused(run("token", "billing", "--secret-file", str(short)))
    assert f"the secret in {short} has 9 bytes; producers refuse secrets under 16" in line


@pytest.mark.parametrize(
    ("server", "path"),
    [
        ("pg_url", r"through table streamq_pending: wal_level is 'replica', the WAL path needs"),
        ("capture_url", r"through the WAL \(slot streamq_\w+_publish, from [0-9A-F]+/[0-9A-F]+\)"),
    ],
)
def test_serve_logs_the_publishing_path_it_chose(
    request: pytest.FixtureRequest, tmp_path: Path, server: str, path: str
) -> None:
    """A PostgreSQL producer's publishing path, chosen as it starts, is said once in the
    log of ``streamq serve`` (docs/guides/postgresql.md, 'Two publishing paths')."""
    url = request.getfixturevalue(server)  # wal_level replica, or logical
    log = tmp_path / "serve.log"
    said = re.compile(rf"INFO streamq\.postgres: publishing on .* {path}")
    with (
        log.open("w") as stderr,
        subprocess.Popen(
            [*STREAMQ, "serve", url, "--init", "--port", "0"],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        ) as process,
    ):
        try:
            wait_until(lambda: bool(said.search(log.read_text())), "the publishing path", 60)
        finally:
            process.terminate()
            process.wait(30)
    assert len(said.findall(log.read_text())) == 1, log.read_text()
    assert "Traceback" not in log.read_text(), log.read_text()
