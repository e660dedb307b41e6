"""The transfer workload's crash check (bench/transfer/run.py), small: streamq and Kafka + outbox
credit every transfer exactly once through kill -9 of every process; the naive dual write
loses the deposits of a producer killed between its commit and its produce; and the checker
itself sees lost, doubled and wrong credits.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from bench.kafka.broker import KafkaBroker
from bench.tools import transfer_profile, tx_cost
from bench.transfer import floor, handlers
from bench.transfer import run as transfer
from bench.transfer.common import (
    ACCOUNTS,
    CONSUMER_SCHEMA,
    OPENING_BALANCE,
    PRODUCER_SCHEMA,
)

from ..children import running_children

TRANSFERS = 1500
KILLS = 3
RATE = 750  # transfers/s: the kills land while transfers flow


def our_programs() -> list[int]:
    """Pids of this process's children still running a transfer program."""
    return [pid for pid, cmdline in running_children().items() if "bench.transfer." in cmdline]


def assert_exactly_once(result: dict[str, Any]) -> None:
    context = f"{result['system']} (seed {result['seed']}): {result}"
    assert result["kills_delivered"] == KILLS, context
    assert result["drained"], context
    assert result["transfers_checked"] == TRANSFERS, context
    assert result["lost"] == 0, context
    assert result["applied_twice"] == 0, context
    assert result["extra_credit_rows"] == 0, context
    assert result["phantom"] == 0, context
    assert result["money_difference"] == 0, context
    assert result["debited"] == result["credited"] > 0, context
    assert result["payments_books_ok"] and result["ledger_books_ok"], context
    assert result["published"] == TRANSFERS, context
    assert result["anomalies"] == 0, context


def landed(result: dict[str, Any], role: str) -> set[str]:
    return {event["how"] for event in result["kill_events"] if event["role"] == role}


@pytest.mark.timeout(600)
def test_crash_runs(tmp_path: Path, kafka_broker: KafkaBroker) -> None:
    try:
        streamq = transfer.crash_run(
            "streamq", None, tmp_path / "streamq", TRANSFERS, KILLS, RATE, seed=11
        )
        outbox = transfer.crash_run(
            "kafka-outbox", kafka_broker, tmp_path / "outbox", TRANSFERS, KILLS, RATE, seed=12
        )
        naive = transfer.crash_run(
            "kafka-naive", kafka_broker, tmp_path / "naive", TRANSFERS, KILLS, RATE, seed=13
        )
    finally:
        assert our_programs() == []

    assert_exactly_once(streamq)
    assert streamq["kills"] == {"producer": 2, "consumer": 1}

    assert_exactly_once(outbox)
    assert outbox["kills"] == {"producer": 1, "relay": 1, "consumer": 1}
    if "armed" in landed(outbox, "relay"):  # killed after delivery, before recording it
        assert outbox["redelivered"] > 0, outbox

    assert naive["kills_delivered"] == KILLS and naive["drained"], naive
    assert naive["applied_twice"] == 0, naive
    if "armed" in landed(naive, "producer"):  # killed between its commit and its produce
        assert naive["lost"] > 0, naive
        assert naive["money_difference"] == naive["lost_money"] > 0, naive


def test_checker_sees_lost_doubled_and_wrong_credits(tmp_path: Path) -> None:
    payments, ledger = tmp_path / "payments.db", tmp_path / "ledger.db"
    transfers = [(1, 0, 5, 100), (2, 1, 6, 200), (3, 2, 7, 300), (4, 3, 8, 400)]
    with contextlib.closing(sqlite3.connect(payments)) as conn, conn:
        for statement in PRODUCER_SCHEMA:
            conn.execute(statement)
        conn.executemany(
            "INSERT INTO accounts VALUES (?, ?)", [(i, OPENING_BALANCE) for i in range(ACCOUNTS)]
        )
        conn.executemany("INSERT INTO transfers VALUES (?, ?, ?, ?)", transfers)
        conn.executemany(
            "UPDATE accounts SET balance = balance - ? WHERE id = ?",
            [(amount, account) for _, account, _, amount in transfers],
        )
    # Transfer 2 credited twice, 3 never, 4 with a wrong amount, 9 never debited.
    credits = [(1, 100), (2, 200), (2, 200), (4, 40), (9, 5)]
    with contextlib.closing(sqlite3.connect(ledger)) as conn, conn:
        for statement in CONSUMER_SCHEMA:
            conn.execute(statement)
        conn.executemany("INSERT INTO balances VALUES (?, ?)", [(i, 0) for i in range(ACCOUNTS)])
        conn.executemany("INSERT INTO credits VALUES (?, ?)", credits)
        conn.execute("UPDATE balances SET balance = ? WHERE account = 0", (545,))

    result = transfer.check(payments, ledger)

    assert result["transfers_checked"] == 4
    assert result["lost"] == 1 and result["lost_money"] == 300
    assert result["applied_twice"] == 1 and result["extra_credit_rows"] == 1
    assert result["phantom"] == 1
    assert result["wrong_amount"] == 1
    assert result["debited"] == 1000 and result["credited"] == 545
    assert result["money_difference"] == 455
    assert result["payments_books_ok"] and result["ledger_books_ok"]
    assert result["published"] is None and result["redelivered"] is None
    assert result["anomalies"] > 0


def test_the_full_durability_case_runs_alone(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m bench.transfer.handlers``: the case ``run`` measures among the others,
    every transfer credited in each run, its table printed, its processes gone after."""
    handled, commits = transfer.measure_handlers(["streamq"], None, 640, 2)
    assert [(s.system, len(s.values)) for s in handled + commits] == [("streamq", 2)] * 2
    assert all(rate > 0 for s in handled + commits for rate in s.values)
    assert handlers.main(["--no-kafka", "--repeats", "1", "--transfers", "320"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "tr/s" in line]
    assert len(rows) == 2 and all("│ streamq │" in row and "│    1 │" in row for row in rows)
    assert our_programs() == []


def test_the_floor_credits_every_transfer_once(tmp_path: Path) -> None:
    """``python -m bench.transfer.floor``: the one-writer case's SQL with no framework. Its
    ledger credits each transfer the producer journaled, once, and the money adds up."""
    rate, producer_us, ledger_us = floor.floor_flow(tmp_path, 3000)
    assert rate > 0 and producer_us > 0 and ledger_us > 0
    with contextlib.closing(sqlite3.connect(tmp_path / "payments.db")) as payments:
        journal = payments.execute("SELECT transfer_id, amount FROM transfers").fetchall()
        (debited,) = payments.execute(
            f"SELECT {ACCOUNTS * OPENING_BALANCE} - sum(balance) FROM accounts"
        ).fetchone()
    with contextlib.closing(sqlite3.connect(tmp_path / "ledger.db")) as ledger:
        credits = ledger.execute("SELECT transfer_id, amount FROM credits").fetchall()
        (credited,) = ledger.execute("SELECT sum(balance) FROM balances").fetchone()
        (position,) = ledger.execute("SELECT seq FROM position").fetchone()
    assert len(journal) == 3000 and sorted(credits) == sorted(journal)
    assert debited == credited == sum(amount for _, amount in journal)
    assert position == 3000
    assert our_programs() == []


def test_the_floor_runs_beside_streamq(capsys: pytest.CaptureFixture[str]) -> None:
    assert floor.main(["--repeats", "1", "--transfers", "2000"]) == 0
    out = capsys.readouterr().out
    assert "│ floor   │" in out and "│ streamq │" in out and "100%" in out
    assert our_programs() == []


def test_the_floor_with_streamqs_sql(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--streamq-sql``: the floor again on streamq's tables and statements; its ledger
    still credits each transfer once, and the table shows both floors' CPU."""
    rate, producer_us, _ = floor.floor_flow(tmp_path, 3000, streamq_sql=True)
    assert rate > 0 and producer_us > 0
    with contextlib.closing(sqlite3.connect(tmp_path / "payments.db")) as payments:
        (rows, last) = payments.execute("SELECT count(*), max(pos) FROM log").fetchone()
        (indexed,) = payments.execute("SELECT count(*) FROM times").fetchone()
    with contextlib.closing(sqlite3.connect(tmp_path / "ledger.db")) as ledger:
        (position,) = ledger.execute("SELECT seq FROM position").fetchone()
    assert last == position == 3000 and rows >= 3000 // 50 and indexed >= 1
    assert (
        floor.main(["--repeats", "1", "--transfers", "2000", "--floor-only", "--streamq-sql"]) == 0
    )
    out = capsys.readouterr().out
    assert "streamq's" in out and "│ streamq │" not in out  # the column may wrap


def test_where_the_transfers_time_goes(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m bench.tools.transfer_profile``: the one-writer transfer under py-spy,
    each process's CPU, and the producer's event-loop thread split into parts that add up
    to all of it."""
    assert transfer_profile.main(["--transfers", "20000", "--rate", "500"]) == 0
    out = capsys.readouterr().out
    cpu = re.findall(r"^(producer|consumer) CPU: ([\d.]+) µs a transfer", out, re.M)
    assert [role for role, _ in cpu] == ["producer", "consumer"]
    assert all(float(us) > 0 for _, us in cpu)
    shares = [float(share) for share in re.findall(r"^ +([\d.]+)% ", out, re.M)]
    assert len(shares) >= 5 and abs(sum(shares) - 100) < 0.5
    assert "COMMIT  (the floor runs it too)" in out
    assert our_programs() == []


def test_what_streamq_adds_to_a_transaction(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m bench.tools.tx_cost``: each build and the floor in processes of their
    own, each part timed where it runs (so each ran: above zero), and streamq's time
    around the parts and beside the calls."""
    assert tx_cost.main(["--repeats", "1", "--transactions", "500", "--records", "4"]) == 0
    rows = {
        line.split()[0]: [float(n.replace(",", "")) for n in line.split()[1:10] if "x" not in n]
        for line in capsys.readouterr().out.splitlines()
        if line.split()[:1] in (["compiled"], ["pure"], ["floor"])
    }
    assert list(rows) == ["compiled", "pure", "floor"]
    # tx/s, CPU, BEGIN, publish, insert, COMMIT, hand-over (streamq's), around, elsewhere
    assert [len(row) for row in rows.values()] == [9, 9, 7]
    assert all(min(row[:6]) > 0 for row in rows.values())
    assert rows["pure"][6] > 0 and rows["pure"][7] > 0 and rows["floor"][6] == 0


def test_what_the_sync_paths_add_to_a_transaction(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m bench.tools.tx_cost --sync``: plain sqlite3, publish, SyncProducer and
    the statements of the last two alone, each in a process of its own, every part timed
    (so each ran: above zero), the CPU the parts' sum, each against plain sqlite3's."""
    assert tx_cost.main(["--sync", "--repeats", "1", "--transactions", "300"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {
        side: [float(n.rstrip("x").replace(",", "")) for n in line[len(side) :].split()]
        for line in out
        for side in tx_cost.SYNC_SIDES
        if line.startswith(side + " ")
    }
    assert list(rows) == list(tx_cost.SYNC_SIDES)
    for side, (per_second, begin, order, event, commit, cpu, _) in rows.items():
        assert min(per_second, begin, order, event, commit) > 0, side
        assert cpu == pytest.approx(begin + order + event + commit, abs=0.2), side
    assert rows["sqlite3"][-1] == 1.0


@pytest.mark.parametrize(
    ("frames", "part"),
    [
        (["Runner.run (x.py:1)"], transfer_profile.LOOP),
        (
            ["Runner.run (x.py:1)", "GroupCommit._commit (g.py:2)"],
            "group commit, transaction bookkeeping",
        ),
        (
            ["GroupCommit._commit (g.py:2)", "SQLiteBlockingWriter.commit (s.py:3)"],
            "COMMIT",
        ),
        (
            ["GroupCommit._commit (g.py:2)", "debits (/w/bench/transfer/common.py:87)"],
            transfer_profile.BENCHMARK,
        ),
        (["Server._push (s.py:9)", "StreamWriter.write (a.py:1)"], "the push and acknowledgements"),
        (["Runner.run (x.py:1)", "Future.done (f.py:1)"], "other"),
    ],
)
def test_profile_parts_are_told_by_their_frames(frames: list[str], part: str) -> None:
    assert transfer_profile.part_of(frames) == part
