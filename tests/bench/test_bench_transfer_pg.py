"""The transfer workload on PostgreSQL (bench/transfer_pg/run.py), tiny: streamq and Kafka +
outbox (a real broker), with 2 concurrent writers, each run credited exactly once
and the result JSON complete; the relay never skips an outbox row that commits after a
higher id; and the checker sees lost and doubled credits in PostgreSQL databases, and
streamq's log (numbered after the commit) against the journal by content.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg
import pytest

import streamq
from bench.kafka.broker import KafkaBroker
from bench.transfer.common import STREAM, Transfer, payloads
from bench.transfer_pg import run as transfer_pg
from bench.transfer_pg.common import JOURNAL, setup_ledger, setup_payments
from bench.transfer_pg.kafka import PostgresOutbox
from streamq.engines.postgres.numbering import number_all

from ..children import running_children
from ..pgserver import PostgresServer

TINY = transfer_pg.Sizes(writers=(2,), transfers=400, rate=400, seconds=0.5, warm_up=100)


def our_children() -> list[str]:
    return list(running_children().values())


@pytest.mark.timeout(120)
def test_tiny_run_exactly_once_and_results(tmp_path: Path, kafka_broker: KafkaBroker) -> None:
    """The whole workload, as ``python -m bench`` runs it (its own server, which stamps
    commit times), at a tiny size."""
    try:
        results = transfer_pg.run(kafka_broker, True, 1, seed=7, sizes=TINY, folder=tmp_path)
    finally:
        assert our_children() == []
    saved = json.loads((tmp_path / "transfer_pg.json").read_text())
    assert (tmp_path / "transfer_pg.png").stat().st_size > 0
    assert saved["workload"] == "transfer_pg"
    assert saved["sizes"] == json.loads(json.dumps(results["sizes"]))
    runs: list[dict[str, Any]] = saved["runs"]
    cases = {(r["system"], r["writers"], r["rate"]) for r in runs}
    assert cases == {(s, w, r) for s in ("streamq", "kafka") for w in (2,) for r in (0, 400)}
    for r in runs:
        check, context = r["check"], f"{r['system']} x {r['writers']}: {r}"
        expected = TINY.transfers if r["rate"] == 0 else int(TINY.rate * TINY.seconds)
        assert r["transfers"] == check["transfers_checked"] == expected, context
        assert check["published"] == expected, context
        assert check["credited_transfers"] == expected, context
        assert check["lost"] == check["extra_credit_rows"] == check["phantom"] == 0, context
        assert check["money_difference"] == 0 and check["debited"] > 0, context
        assert check["payments_books_ok"] and check["ledger_books_ok"], context
        assert check["anomalies"] == 0, context
        if r["system"] == "streamq":  # the log by content: each deposit once, none left
            assert check["log_dense"] and check["log_matches_journal"], context
            assert check["unnumbered"] == 0, context
        else:
            assert "log_dense" not in check, context
        assert r["seconds"] > 0 and r["producer_seconds"] > 0, context
        assert r["latency"][4] == expected and r["commit_latency"][4] == expected, context
        assert r["commit_to_credit"][4] == expected, context  # every transfer, from COMMIT
    warm_ups = saved["warm_up_runs"]
    assert [(r["system"], r["writers"]) for r in warm_ups] == [("streamq", 2), ("kafka", 2)]
    assert all(r["check"]["anomalies"] == 0 and r["transfers"] == 100 for r in warm_ups)
    assert saved["anomalies"] == 0
    series = {(s["system"], s["case"]) for s in saved["series"]}
    for system in ("streamq", "kafka"):
        for case in ("2 writers", "2 writers, committed"):
            assert (system, case) in series
        for pct in ("p50", "p99"):
            assert (system, f"2 writers, 400/s {pct}") in series
            assert (system, f"2 writers, 400/s, from COMMIT {pct}") in series
    assert saved["postgres"]["fsync"] == "on"
    assert saved["postgres"]["track_commit_timestamp"] == "on"


def test_relay_waits_for_rows_that_commit_late(pg_url: str) -> None:
    """Two writers: the first takes id 1 and commits after the second committed id 2. A
    relay reading ``id > last`` would send 2 and move past 1 for good; this one sends
    neither until the first commits, then both."""
    setup_payments(pg_url, "outbox")
    insert = "INSERT INTO outbox (payload) VALUES (%s)"
    relay = PostgresOutbox(pg_url)
    with psycopg.connect(pg_url) as first, psycopg.connect(pg_url) as second:
        first.execute(insert, (b"one",))
        second.execute(insert, (b"two",))
        second.commit()
        assert relay.fetch(10) == []
        snapshot = relay.version()
        first.commit()
        assert relay.version() != snapshot  # what the relay polls: it wakes now
        rows = relay.fetch(10)
        assert [payload for _, payload in rows] == [b"one", b"two"]
        relay.record(rows[-1][0])
        assert relay.fetch(10) == []
        with first.transaction():  # a rollback leaves a gap in the ids, never a wait
            first.execute(insert, (b"rolled back",))
            raise psycopg.Rollback
        first.execute(insert, (b"three",))
        first.commit()
        assert [payload for _, payload in relay.fetch(10)] == [b"three"]
    relay.close()
    restarted = PostgresOutbox(pg_url)  # from the recorded position
    assert [payload for _, payload in restarted.fetch(10)] == [b"three"]
    restarted.close()


def test_relay_saves_its_position_without_waiting_for_a_flush(pg_url: str) -> None:
    """The relay's session commits as ``streamq serve``'s numbering rounds do, with
    ``synchronous_commit=off``, where the writers' sessions keep the server's ``on``."""
    setup_payments(pg_url, "outbox")
    relay = PostgresOutbox(pg_url)
    try:
        assert relay.conn.execute("SHOW synchronous_commit").fetchone() == ("off",)
        relay.record(("1", 1))
        assert relay.conn.execute("SELECT last_id FROM relay_state").fetchone() == (1,)
    finally:
        relay.close()
    with psycopg.connect(pg_url) as writer:
        assert writer.execute("SHOW synchronous_commit").fetchone() == ("on",)


def test_checker_matches_the_log_with_the_journal(pg_url: str) -> None:
    """streamq's log by content: a journalled transfer's deposit numbered or still pending
    (committed, with no serving process to number it) is there, once; a deposit twice, one
    with another amount, or one of no transfer is not the journal."""
    setup_payments(pg_url, "streamq")
    transfers = [Transfer(1, 0, 5, 100), Transfer(2, 1, 6, 200), Transfer(3, 2, 7, 300)]
    with psycopg.connect(pg_url, autocommit=True) as conn:

        def publish(*deposits: Transfer) -> None:
            with conn.transaction():
                receipt = streamq.publish_many(conn, STREAM, payloads(list(deposits), None))
                assert isinstance(receipt, streamq.Receipt)  # numbered after the commit

        with conn.transaction():
            conn.execute(JOURNAL, tuple(map(list, zip(*transfers, strict=True))))
        publish(*transfers[:2])
        assert number_all(conn) == 2
        publish(transfers[2])  # committed, not numbered
        checked = transfer_pg.check_log(conn)
        assert checked == {
            "published": 3,
            "log_dense": True,
            "log_matches_journal": True,
            "unnumbered": 1,
        }
        assert number_all(conn) == 1
        assert transfer_pg.check_log(conn)["unnumbered"] == 0
        for wrong in (transfers[1], Transfer(3, 2, 7, 301), Transfer(4, 0, 5, 1)):
            with conn.transaction():
                publish(wrong)
                checked = transfer_pg.check_log(conn)
                assert checked["published"] == 4 and checked["unnumbered"] == 1, checked
                assert not checked["log_matches_journal"], (wrong, checked)
                raise psycopg.Rollback


def test_checker_sees_lost_and_doubled_credits(postgres: PostgresServer) -> None:
    payments = postgres.create_database("check_payments")
    ledger = postgres.create_database("check_ledger")
    try:
        setup_payments(payments, "outbox")
        setup_ledger(ledger, kafka=True)
        transfers = [(1, 0, 5, 100), (2, 1, 6, 200), (3, 2, 7, 300)]
        with psycopg.connect(payments) as conn:
            for t in transfers:
                conn.execute("INSERT INTO transfers VALUES (%s, %s, %s, %s)", t)
                conn.execute(
                    "UPDATE accounts SET balance = balance - %s WHERE id = %s", (t[3], t[1])
                )
                conn.execute("INSERT INTO outbox (payload) VALUES ('x')")
        with psycopg.connect(ledger) as conn:  # 2 credited twice, 3 never
            for transfer_id, amount in [(1, 100), (2, 200), (2, 200)]:
                conn.execute("INSERT INTO credits VALUES (%s, %s)", (transfer_id, amount))
                conn.execute("INSERT INTO received VALUES (%s, 0, 0)", (transfer_id,))
            conn.execute("UPDATE balances SET balance = 500 WHERE account = 0")
        result = transfer_pg.check_pg(payments, ledger)
    finally:
        postgres.drop_database("check_payments")
        postgres.drop_database("check_ledger")
    assert result["transfers_checked"] == 3 and result["published"] == 3
    assert result["lost"] == 1 and result["lost_money"] == 300
    assert result["extra_credit_rows"] == 1 and result["redelivered"] == 1
    assert result["money_difference"] == 100
    assert result["payments_books_ok"] and result["ledger_books_ok"]
    assert result["anomalies"] > 0
