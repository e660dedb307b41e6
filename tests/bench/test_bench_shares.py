"""The shares workload cannot rot: two worker processes over a real PostgreSQL database,
every seq applied once by its key's share, each key in order (``bench.shares.run.check``)."""

from __future__ import annotations

from pathlib import Path

import psycopg

from bench.common import Child
from bench.shares import run as shares
from tests.pgserver import PostgresServer


def test_two_shares_apply_every_record_once(tmp_path: Path, postgres: PostgresServer) -> None:
    with Child(shares.PROGRAMS, "producer", tmp_path / "p.db", 600, 50) as producer:
        (address,) = producer.expect("READY", timeout=120)
        figures = shares.run_once(postgres, address, 2, 600, "bench_shares")
    assert figures["rate"] > 0 and sum(figures["records_per_worker"]) == 600
    assert all(n > 100 for n in figures["records_per_worker"])  # both did their share
    with psycopg.connect(postgres.url("bench_shares")) as conn:
        workers = conn.execute("SELECT worker, count(*) FROM effects GROUP BY worker").fetchall()
    assert sorted(w for w, _ in workers) == [0, 1]
