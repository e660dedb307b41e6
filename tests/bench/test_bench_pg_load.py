"""The PostgreSQL load workload (bench/pg_load), tiny: its server really runs with the
slower flush (a synchronous commit takes the added time: without it, this machine's
flush takes well under that), every system's run is checked with 0 anomalies, the
results JSON and chart are complete, the systems are compared by delivered/s, and the
idle measurement reads the serving process and its sessions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.kafka.broker import KafkaBroker
from bench.pg_load import run as pg_load

from ..children import running_children

TINY = pg_load.Sizes(
    delays=(20_000,),
    writers=(2,),
    seconds=1.0,
    paced_writers=2,
    rate=100,
    paced_seconds=1.0,
    idle_seconds=1.0,
)


@pytest.mark.timeout(240)
def test_tiny_run_is_checked_and_saved(tmp_path: Path, kafka_broker: KafkaBroker) -> None:
    try:
        results = pg_load.run(kafka_broker, True, 1, sizes=TINY, folder=tmp_path, debezium=False)
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
        assert r["delay_us"] == 20_000 and r["flushes_per_commit"] > 0, r
        # Every system's, the outbox alone's too (its commits: nothing reads it). Not
        # compared with tx/s: that divides by the run's length, while the last transaction
        # may begin just before its end and be received (or return) after it.
        assert r["delivered_per_s"] > 0, r
        if r["system"] == "outbox":
            assert r["received"] is None and r["receipt_latency_us"] is None, r
        else:
            assert r["received"] == r["committed"], r
            assert 0 < r["receipt_latency_us"][0] <= r["receipt_latency_us"][1], r
    [row] = [row for row in saved["summary"] if not row["rate"]]
    assert row["tx_ratio_kafka"] > 0 and row["tx_ratio_outbox"] > 0
    for other in ("kafka", "outbox"):  # the comparison's ratios: of delivered/s
        delivered = row["streamq"]["delivered_per_s"] / row[other]["delivered_per_s"]
        assert row[f"delivered_ratio_{other}"] == pytest.approx(delivered, abs=1e-3)
    assert saved["commit_seconds"]["20000"] >= 0.02
    idle = saved["idle"]
    assert idle["sessions"] >= 3 and idle["serve_percent"] >= 0
    assert idle["open_serve_percent"] >= 0 and idle["open_sessions_percent"] >= 0


def test_debezium_without_a_broker_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``BENCH_DEBEZIUM=1`` with no Kafka broker (``--no-kafka``): one line saying why, before
    any server starts, and nothing saved."""
    monkeypatch.setenv("BENCH_DEBEZIUM", "1")
    with pytest.raises(SystemExit, match=r"^BENCH_DEBEZIUM=1: Debezium ships to Kafka, and this "):
        pg_load.run(None, True, 1, sizes=TINY, folder=tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(240)
def test_tiny_capture_run_is_checked_beside_streamqs_publish(tmp_path: Path) -> None:
    """The capture system: the outbox's changes captured by ``streamq serve --capture`` on a
    server with ``wal_level=logical``, every event received once, in each writer's order."""
    try:
        results = pg_load.run(
            None, True, 1, sizes=TINY, folder=tmp_path, systems=["streamq", "capture"]
        )
    finally:
        assert list(running_children().values()) == []
    assert results["server_settings"]["wal_level"] == "logical"
    assert (tmp_path / "pg_load_capture.png").stat().st_size > 0  # saved apart from pg_load
    assert not (tmp_path / "pg_load.json").exists()
    runs = results["runs"]
    assert {(r["system"], r["rate"]) for r in runs} == {
        (system, rate) for system in ("streamq", "capture") for rate in (0, 100)
    }
    for r in runs:
        assert r["committed"] > 0 and r["anomalies"] == 0 and r["received"] == r["committed"], r
        assert r["delivered_per_s"] > 0 and r["receipt_latency_us"][1] > 0, r
    with pytest.raises(SystemExit, match=r"^unknown systems \['kafkaa'\]"):
        pg_load.run(None, True, 1, sizes=TINY, folder=tmp_path, systems=["kafkaa"])


def test_tiny_backlog_run_drains_what_was_committed_while_the_reader_was_stopped(
    tmp_path: Path,
) -> None:
    """``--backlog``: the capture's server stopped (SIGSTOP) while the writers write, then
    let go; every event received once, and how fast they came from then on."""
    try:
        results = pg_load.run(
            None, True, 1, sizes=TINY, folder=tmp_path, systems=["capture"], backlog=True
        )
    finally:
        assert list(running_children().values()) == []
    assert results["backlog"] and (tmp_path / "pg_load_backlog.json").exists()
    (r,) = results["runs"]
    assert r["rate"] == 0 and r["backlog"] and r["receipt_latency_us"] is None
    assert r["committed"] > 0 and r["anomalies"] == 0 and r["received"] == r["committed"], r
    assert r["delivered_per_s"] > 0
