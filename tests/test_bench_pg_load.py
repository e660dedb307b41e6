"""The PostgreSQL load workload (bench/pg_load), tiny: its server really runs with the
slower flush (the preloaded library is mapped, and a flush takes the added time), every
system's run is checked with 0 anomalies, the results JSON and chart are complete, and
the idle measurement reads the serving process and its sessions."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psycopg
import pytest

from bench.kafka.broker import KafkaBroker
from bench.pg_load import run as pg_load
from bench.tools.fsync_delay import build, server_env

from .children import running_children
from .pgserver import PostgresServer

TINY = pg_load.Sizes(
    delays=(2000,), writers=(2,), seconds=1.0, paced_writers=2, rate=100, paced_seconds=1.0
)


def test_the_delay_library_slows_each_flush() -> None:
    """A server started with it maps the library, and a synchronous commit takes at least
    the added 20 ms (without it, this machine's flush takes well under that)."""
    server = PostgresServer(env=server_env(20_000))
    server.start()
    try:
        postmaster = int((server.data / "postmaster.pid").read_text().split()[0])
        assert str(build()) in Path(f"/proc/{postmaster}/maps").read_text()
        with psycopg.connect(server.url()) as conn:
            conn.execute("CREATE TABLE t (n integer)")
            conn.commit()
            started = time.monotonic()
            for n in range(3):
                conn.execute("INSERT INTO t VALUES (%s)", (n,))
                conn.commit()
            assert (time.monotonic() - started) / 3 >= 0.02
    finally:
        server.stop()


@pytest.mark.timeout(240)
def test_tiny_run_is_checked_and_saved(tmp_path: Path) -> None:
    try:
        with KafkaBroker() as broker:
            results = pg_load.run(broker, True, 1, sizes=TINY, folder=tmp_path)
    finally:
        assert list(running_children().values()) == []
    saved = json.loads((tmp_path / "pg_load.json").read_text())
    assert (tmp_path / "pg_load.png").stat().st_size > 0
    assert saved["workload"] == "pg_load"
    assert saved["sizes"] == json.loads(json.dumps(results["sizes"]))
    cases = {(r["system"], r["writers"], r["rate"]) for r in saved["runs"]}
    assert cases == {
        ("streamq", 2, 0),
        ("kafka", 2, 0),
        ("outbox", 2, 0),
        ("streamq", 2, 100),
        ("kafka", 2, 100),
    }
    for r in saved["runs"]:
        assert r["committed"] > 0 and r["anomalies"] == 0, r
        assert r["delay_us"] == 2000 and r["flushes_per_commit"] > 0, r
        if r["system"] == "outbox":
            assert r["received"] is None and r["receipt_latency_us"] is None, r
        else:
            assert r["received"] == r["committed"], r
            assert 0 < r["receipt_latency_us"][0] <= r["receipt_latency_us"][1], r
    [row] = [row for row in saved["summary"] if not row["rate"]]
    assert row["tx_ratio_kafka"] > 0 and row["tx_ratio_outbox"] > 0
    idle = saved["idle"]
    assert idle["sessions"] >= 3 and idle["serve_percent"] >= 0
