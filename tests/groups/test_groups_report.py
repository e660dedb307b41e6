"""``streamq groups DB``: a consumer group as its rows in the consumer's database show it
(members, shares, holders, positions, how far behind, parked records), on either engine,
from the API and the command line, running and after its members stopped."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path
from urllib.request import urlopen

import streamq
from streamq.consumer.database import open_position_store
from streamq.engines.leases import SCHEMA
from streamq.groups.group_consumer import GroupConsumer
from streamq.groups.report import GroupReport, describe_groups
from tests.conftest import wait_for

KEYS = [f"account-{n}".encode() for n in range(24)]
STREAMQ = [sys.executable, "-m", "streamq"]


async def apply_until(db: str, head: int, members: list[GroupConsumer]) -> None:
    """Apply batches with ``members`` until every share of the group stands at ``head``
    and the shares are spread evenly: a member that took them all at first gives some back
    (frees them, then another takes them) after its records are applied, so being at
    ``head`` alone leaves the report racing that hand-over."""

    async def caught_up() -> bool:
        held = sorted(share for member in members for share in member.held)
        if held != [0, 1, 2, 3] or any(len(m.held) != 4 // len(members) for m in members):
            return False
        reports = await asyncio.to_thread(describe_groups, db, "billing", heads=False)
        rows = reports[0].rows if reports else []
        return len(rows) == 4 and all(r.applied == head for r in rows)

    async def run(member: GroupConsumer) -> None:
        async for batch in member:
            async with member.transaction(batch):
                pass

    tasks = [asyncio.create_task(run(member)) for member in members]
    try:
        async with asyncio.timeout(30):
            while not await caught_up():
                await asyncio.sleep(0.05)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``streamq ARGS`` piped, its tables as wide as their cells (pytest sets COLUMNS)."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    return subprocess.run(
        [*STREAMQ, *args], capture_output=True, text=True, timeout=60, check=False, env=env
    )


async def test_the_group_view_shows_members_shares_and_positions(
    producer_db: str, either_consumer_db: str
) -> None:
    async with streamq.Producer(producer_db, port=0, metrics_port=0) as producer:
        async with producer.transaction() as tx:
            for key in KEYS:
                await tx.publish("orders", b"x", key=key)
        options = {"db": either_consumer_db, "name": "billing", "shares": 4}
        async with (
            GroupConsumer(producer.address, "orders", **options) as first,
            GroupConsumer(producer.address, "orders", **options) as second,
        ):
            await apply_until(either_consumer_db, len(KEYS), [first, second])
            await wait_for(
                lambda: sum(lag.applied == len(KEYS) for lag in producer.consumer_lags()) == 4,
                what="the shares' reports",
            )
            await producer.publish("orders", b"late", key=KEYS[0])  # one share behind
            (report,) = await asyncio.to_thread(describe_groups, either_consumer_db)
            listed = await asyncio.to_thread(cli, "groups", either_consumer_db, "--json")
            # The producer's side: the group's positions, and their lags' sum.
            address = producer.address
            owed = await asyncio.to_thread(cli, "status", address, "--group", "billing", "--json")
            unknown = await asyncio.to_thread(cli, "status", address, "--group", "biling")
            url = f"http://{producer.metrics_address}/metrics"
            metrics = await asyncio.to_thread(lambda: urlopen(url).read().decode())
        (group,) = [json.loads(line) for line in listed.stdout.splitlines()]
    members = {first.member, second.member}
    assert (report.name, report.stream, report.shares) == ("billing", "orders", 4)
    assert {m.member for m in report.members} == members and all(m.alive for m in report.members)
    assert sorted(s for m in report.members for s in m.shares) == [0, 1, 2, 3]
    assert [r.share for r in report.rows] == [0, 1, 2, 3]
    assert all(r.holder in members and r.token > 0 for r in report.rows)
    assert all(r.held_ms is not None and 0 <= r.held_ms < 60_000 for r in report.rows)
    assert all(r.producer_id == producer.producer_id for r in report.rows)
    assert all(r.endpoint == producer.address and r.parked == 0 for r in report.rows)
    assert [r.head for r in report.rows] == [len(KEYS) + 1] * 4
    late = streamq.share_of(KEYS[0], 4)  # the share that owes the late record
    assert [r.behind for r in report.rows] == [int(i == late) for i in range(4)]
    assert all(r.exact for r in report.rows)  # counted by the producer, its keys' only
    assert owed.returncode == 0, owed.stderr
    assert json.loads(owed.stdout)["streams"] == {"orders": {"lag": 1, "exact": True}}
    assert 'streamq_group_lag{group="billing",stream="orders"} 1.0' in metrics
    assert unknown.returncode == 1 and unknown.stderr.count("\n") == 1
    assert "knows no consumer 'biling' and no share of it" in unknown.stderr
    # The command line says the same, as JSON.
    assert listed.returncode == 0, listed.stderr
    assert group["group"] == "billing" and group["shares"] == 4
    assert {m["member"] for m in group["members"]} == {f"{m:016x}" for m in members}
    assert [p["applied"] for p in group["positions"]] == [len(KEYS)] * 4
    assert all(isinstance(p["held_ms"], int) == bool(p["holder"]) for p in group["positions"])

    # Stopped: the members left (their shares free), the positions stay; no producer.
    (report,) = describe_groups(either_consumer_db)
    assert report.members == [] and all(r.holder is None for r in report.rows)
    assert all(r.held_ms is None for r in report.rows)  # free shares have no lease age
    assert [r.applied for r in report.rows] == [len(KEYS)] * 4
    assert all(r.head is None for r in report.rows) and report.unreachable
    table = cli("groups", either_consumer_db, "--no-heads")
    assert table.returncode == 0, table.stderr
    assert "group billing on stream 'orders': 4 shares, 0 of 0 member(s) alive" in table.stdout


def test_no_group_or_the_wrong_database_is_one_line(tmp_path: Path, producer_db: str) -> None:
    missing = cli("groups", str(tmp_path / "nosuch.db"))
    assert missing.returncode == 1 and "does not exist" in missing.stderr
    assert "Traceback" not in missing.stderr
    with streamq.SyncProducer(producer_db) as producer:
        producer.publish("orders", b"x")
    wrong = cli("groups", producer_db)  # the producer's database, not a consumer's
    assert wrong.returncode == 1 and "Traceback" not in wrong.stderr, wrong.stderr
    assert wrong.stderr.count("\n") == 1


async def test_group_tables_made_before_lease_ages_and_hosts_gain_them(
    producer_db: str, either_consumer_db: str
) -> None:
    """A group's tables from before ``taken_at``, ``host`` and ``pid``: read as they are
    (an older member's row shows no host), then the first member to join adds the columns
    (older members go on without them); a share taken then shows its lease's age, the
    member where it runs."""
    column = re.compile(r"^\s*(taken_at|host|pid) .*\n", re.MULTILINE)
    old = [column.sub("", statement) for statement in SCHEMA]
    assert all(not re.search(r"taken_at|host|pid ", statement) for statement in old)
    older_member = (
        "INSERT INTO streamq_groups VALUES ('billing', 'orders', 4, 1, 0)",
        "INSERT INTO streamq_members VALUES ('billing', 'orders', 7, 0)",
    )
    if either_consumer_db.startswith("postgresql"):
        import psycopg

        with psycopg.connect(either_consumer_db, autocommit=True) as conn:
            for statement in (*old, *older_member):
                conn.execute(statement)  # type: ignore[arg-type]
    else:
        with sqlite3.connect(either_consumer_db) as conn:
            for statement in (*old, *older_member):
                conn.execute(statement)
    store = open_position_store(either_consumer_db)  # the consumer's tables, as they were
    await store.open()
    await store.close()
    (before,) = await asyncio.to_thread(describe_groups, either_consumer_db, heads=False)
    assert [(m.member, m.host, m.pid, m.alive) for m in before.members] == [(7, None, None, False)]
    async with streamq.Producer(producer_db, port=0) as producer:
        await producer.publish("orders", b"x", key=KEYS[0])
        options = {"db": either_consumer_db, "name": "billing", "shares": 4}
        async with GroupConsumer(producer.address, "orders", **options) as member:
            await apply_until(either_consumer_db, 1, [member])
            (report,) = await asyncio.to_thread(describe_groups, either_consumer_db)
    assert all(r.held_ms is not None and r.held_ms >= 0 for r in report.rows)
    found = {m.member: (m.host, m.pid) for m in report.members}
    assert found == {7: (None, None), member.member: (socket.gethostname(), os.getpid())}


async def test_members_show_host_and_pid_and_a_dead_members_leases_expire(
    producer_db: str, either_consumer_db: str
) -> None:
    """Beside its opaque id, a member shows where it runs (host, pid). Killed, its leases
    show as expired, since its row expired, no longer as held for ever longer."""
    db = either_consumer_db
    async with streamq.Producer(producer_db, port=0) as producer:
        await producer.create_stream("orders")
        worker = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.group_worker", producer.address, db,
            "--shares", "2", "--lease-timeout", "1", stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            assert worker.stdout is not None
            async with asyncio.timeout(30):
                while not (await worker.stdout.readline()).startswith(b"HELD 0,1"):
                    pass
            (running,) = await asyncio.to_thread(describe_groups, db, heads=False)
        finally:
            worker.kill()
            await worker.wait()

        def report() -> GroupReport:
            (found,) = describe_groups(db, heads=False)
            return found

        async def expired() -> bool:
            rows = (await asyncio.to_thread(report)).rows
            return all(r.expired_ms is not None and r.expired_ms > 100 for r in rows)

        await wait_for(expired, what="the dead member's row to expire")
        first = await asyncio.to_thread(report)
        since = first.rows[0].expired_ms
        await wait_for(
            lambda: asyncio.to_thread(lambda: report().rows[0].expired_ms > since),
            what="the expiry to age",
        )
    (member,) = running.members
    assert (member.host, member.pid) == (socket.gethostname(), worker.pid)
    assert [(r.lease, r.held_ms is not None) for r in running.rows] == [("held", True)] * 2
    # Killed: expired since its row's expiry (its age grows), whoever the leases still name.
    (dead,) = first.members
    assert (dead.alive, dead.pid) == (False, worker.pid)
    assert all(r.lease == "expired" and r.held_ms is None for r in first.rows)
    assert all(r.holder == member.member for r in first.rows)
    table = cli("groups", db, "--no-heads")
    assert table.returncode == 0, table.stderr
    assert re.search(
        rf"│ {member.member:016x} │ \S+ +│ {worker.pid} │ no +│ expired \d+ s ago", table.stdout
    ), table.stdout
    assert len(re.findall(r"│ expired \d+ s ago", table.stdout)) == 3  # the member, 2 leases
    (listed,) = [
        json.loads(line) for line in cli("groups", db, "--json", "--no-heads").stdout.splitlines()
    ]
    assert [(m["host"], m["pid"]) for m in listed["members"]] == [
        (socket.gethostname(), worker.pid)
    ]
    assert [p["lease"] for p in listed["positions"]] == ["expired"] * 2
    assert all(p["held_ms"] is None and p["expired_ms"] > 0 for p in listed["positions"])
