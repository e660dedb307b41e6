"""NATS JetStream, the second baseline of the pipe and latency workloads, cannot rot: its
processes at tiny size against a real nats-server. The server is built with `go install`
on first use (minutes, once); a machine without Go fails here saying so, never a skip."""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
from pathlib import Path

import pytest

from bench.common import Child
from bench.latency import run as latency
from bench.nats import server as nats_server
from bench.nats.clients import connected
from bench.nats.server import NatsServer, NatsServerError, run_coroutine
from bench.pipe import run as pipe

pytestmark = pytest.mark.timeout(900)  # the first test may build nats-server


@pytest.fixture
def server(nats_server: NatsServer) -> NatsServer:
    return nats_server


def applied(db: Path) -> list[int]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return [row[0] for row in conn.execute("SELECT seq FROM applied ORDER BY rowid")]


def position(db: Path) -> list[tuple[str, int]]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return conn.execute("SELECT stream, next FROM positions").fetchall()


def streams(server: NatsServer) -> list[str]:
    async def names() -> list[str]:
        async with connected(server.url) as client:
            return [info.config.name or "" for info in await client.jetstream().streams_info()]

    return run_coroutine(names())


def test_pipe(server: NatsServer, tmp_path: Path) -> None:
    before = streams(server)
    seconds = pipe.run_nats(server, tmp_path, 3000, 100)
    assert seconds > 0
    assert applied(tmp_path / "nats.db") == list(range(1, 3001))
    assert [next_seq for _, next_seq in position(tmp_path / "nats.db")] == [3001]
    assert streams(server) == before  # the run's stream (and its files) removed


def test_pipe_consumer_resumes_from_its_database(server: NatsServer, tmp_path: Path) -> None:
    """A consumer stopped half way and started again applies the rest, each record once:
    it starts from the sequence its database holds, whatever the server remembers."""
    url, db = server.url, tmp_path / "nats.db"
    with (
        server.stream("resume") as stream,
        Child("bench.pipe.nats", "producer", url, stream, 400, 10_000) as producer,
    ):
        producer.expect("READY")
        producer.send("GO")
        producer.expect("PRODUCED", timeout=60)
        for upto in (200, 400):  # 10 KB records: 100 a fetch, so the first stops at 200
            with Child("bench.pipe.nats", "consumer", url, stream, db, upto, 10_000, "normal") as c:
                c.expect("DONE", timeout=60)
            assert applied(db) == list(range(1, upto + 1))
        producer.send("STOP")
    assert position(db) == [(stream, 401)]


def test_pipe_full_durability(tmp_path: Path) -> None:
    with NatsServer(sync_always=True) as full:
        assert full.config["jetstream.sync_interval"].startswith("always")
        assert pipe.run_nats(full, tmp_path, 300, 100, "full") > 0
    assert applied(tmp_path / "nats.db") == list(range(1, 301))


def test_latency(server: NatsServer) -> None:
    p50, p99, p999, worst = latency.run_nats(server, 1000, 0.5)
    assert 0 < p50 <= p99 <= p999 <= worst


def test_server_config_is_what_the_server_reports(server: NatsServer) -> None:
    assert server.url.startswith("nats://127.0.0.1:")
    assert server.config["version"] == nats_server.VERSION.removeprefix("v")
    assert server.config["jetstream.storage"] == "file"
    assert server.config["jetstream.sync_interval"].startswith("every 120 s")


def test_missing_go_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NATS_SERVER", raising=False)
    monkeypatch.setattr(nats_server, "BIN", tmp_path)  # no binary built there
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(nats_server, "GO_FALLBACK", tmp_path / "no-go")
    with pytest.raises(NatsServerError, match="Go is not installed"):
        nats_server.ensure_binary()
