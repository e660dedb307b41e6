"""The benchmark harness cannot rot: bench-quick's pipe workload, both systems, small."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import pytest

from bench.kafka.broker import KafkaBroker
from bench.pipe import run as pipe

COUNT = 3000


def applied(db: Path, column: str) -> list[int]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return [row[0] for row in conn.execute(f"SELECT {column} FROM applied ORDER BY rowid")]


def test_streamq_pipe(tmp_path: Path) -> None:
    seconds = pipe.run_streamq(tmp_path, COUNT, 100)
    assert seconds > 0
    assert applied(tmp_path / "consumer.db", "seq") == list(range(1, COUNT + 1))


@pytest.mark.timeout(300)
def test_kafka_pipe(tmp_path: Path) -> None:
    with KafkaBroker() as broker:
        seconds = pipe.run_kafka(broker, tmp_path, COUNT, 100)
    assert seconds > 0
    assert applied(tmp_path / "kafka.db", "off") == list(range(COUNT))
    with contextlib.closing(sqlite3.connect(tmp_path / "kafka.db")) as conn:
        assert conn.execute("SELECT next FROM offsets").fetchall() == [(COUNT,)]
