"""The ``streamq`` command line, run as real processes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import streamq
from streamq import cli

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


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*STREAMQ, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """``streamq serve`` on a free port: (database path, address)."""
    db = str(tmp_path / "orders.db")
    process = subprocess.Popen(
        [*STREAMQ, "serve", db, "--create", "--port", "0"],
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
        }
    ]
    table = run("status", address)
    assert "orders" in table.stdout and "consumers" in table.stdout


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
    assert "does not exist (use --create" in missing.stderr
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
