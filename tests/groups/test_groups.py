"""Consumer groups (streamq.groups): members divide a stream's shares
through leases in the consumer's database, take over the shares of members that die,
and a batch applied under a lease that moved on is refused in its transaction."""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import signal
import sqlite3
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import psycopg
import pytest

import streamq
from streamq.consumer.database import reshare
from streamq.groups.group_consumer import GroupConsumer
from streamq.groups.report import describe_groups
from tests.conftest import wait_for
from tests.faultproxy import FaultProxy, Stall

KEYS = [f"account-{n}".encode() for n in range(40)]


@pytest.fixture(params=["sqlite", "postgresql"])
def group_db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The group's consumer database, of either engine, with the ``credits`` table."""
    if request.param == "sqlite":
        db = str(tmp_path / "consumer.db")
        with contextlib.closing(sqlite3.connect(db)) as conn:
            conn.execute(_CREDITS)
            conn.commit()
        return db
    url: str = request.getfixturevalue("pg_url")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            _CREDITS.replace("INTEGER PRIMARY KEY", "serial PRIMARY KEY").replace("BLOB", "bytea")
        )
    return url


_CREDITS = "CREATE TABLE credits (n INTEGER PRIMARY KEY, seq INTEGER UNIQUE, key BLOB, pid INTEGER)"


def _sql(db: str, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
    """Run one statement on the group's database (either engine); its rows."""
    if db.startswith("postgresql://"):
        with psycopg.connect(db, autocommit=True) as conn:
            cursor = conn.execute(sql.replace("?", "%s"), params)
            return cursor.fetchall() if cursor.description else []
    with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as conn:
        return conn.execute(sql, params).fetchall()


def _credits(db: str) -> list[tuple[int, bytes, int]]:
    return [
        (seq, bytes(key), pid)
        for seq, key, pid in _sql(db, "SELECT seq, key, pid FROM credits ORDER BY n")
    ]


def _positions(db: str) -> int:
    """How many positions of group ``billing``'s shares are stored."""
    return len(
        _sql(db, "SELECT 1 FROM streamq_positions WHERE substr(consumer, 1, 8) = 'billing['")
    )


def _assert_once_in_key_order(rows: list[tuple[int, bytes, int]], head: int) -> None:
    """Every seq up to ``head`` applied once, and each key's records in seq order."""
    assert sorted(seq for seq, _, _ in rows) == list(range(1, head + 1))
    by_key: dict[bytes, list[int]] = {}
    for seq, key, _ in rows:
        by_key.setdefault(key, []).append(seq)
    assert all(seqs == sorted(seqs) for seqs in by_key.values())


def credit(tx: streamq.BlockingSQL, batch: streamq.Batch, member: int) -> None:
    insert = "INSERT INTO credits (seq, key, pid) VALUES (?, ?, ?)"
    if type(tx).__name__ == "PostgresSQL":
        insert = insert.replace("?", "%s")
    tx.executemany(insert, [(r.seq, r.key, member % 1000) for r in batch])


async def _run_member(group: GroupConsumer) -> None:
    """Apply every batch handed out until cancelled; lost leases are the new holder's."""
    async for batch in group:
        with contextlib.suppress(streamq.LeaseLostError):
            await group.apply(batch, credit, group.member)


async def test_members_divide_the_shares_and_apply_every_record_once(
    producer_db: str, group_db: str
) -> None:
    consumer_db = group_db
    async with streamq.Producer(producer_db, port=0) as producer:
        async with producer.transaction() as tx:
            for key in KEYS * 5:
                await tx.publish("orders", b"x", key=key)
        head = producer.head("orders")
        options: dict[str, Any] = {"db": consumer_db, "name": "billing", "shares": 4}
        async with (
            GroupConsumer(producer.address, "orders", **options) as first,
            GroupConsumer(producer.address, "orders", **options) as second,
        ):
            tasks = [asyncio.create_task(_run_member(g)) for g in (first, second)]
            try:
                await wait_for(lambda: len(_credits(consumer_db)) == head, what="all applied")
                await wait_for(lambda: len(first.held) == len(second.held) == 2, what="2 each")
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            assert sorted(first.held + second.held) == [0, 1, 2, 3]
    _assert_once_in_key_order(_credits(consumer_db), head)


class _Worker:
    """A ``tests.group_worker`` process and the shares it last reported holding."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.held: list[int] = []
        self.joined = False
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def start(cls, address: str, db: str, *extra: str) -> _Worker:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.group_worker", address, db, *extra,
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        return cls(process)

    async def _read(self) -> None:
        assert self.process.stdout is not None
        async for line in self.process.stdout:
            word, _, rest = line.decode().strip().partition(" ")
            if word == "JOINED":
                self.joined = True
            elif word == "HELD":
                self.held = [int(s) for s in rest.split(",") if s]

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        await self.process.wait()
        await self._reader


async def _publish(producer: streamq.Producer, stop: asyncio.Event, rng: random.Random) -> None:
    """Transactions of 10 records, about 2,000 records a second, until ``stop`` (at most
    60,000 records)."""
    for _ in range(6000):
        if stop.is_set():
            return
        async with producer.transaction() as tx:
            for _ in range(10):
                await tx.publish("orders", b"x", key=rng.choice(KEYS))
        await asyncio.sleep(0.005)


async def test_killed_members_shares_are_taken_over_and_applied_once_in_key_order(
    producer_db: str, group_db: str
) -> None:
    """Members killed wherever they are, inside a transaction, during a takeover (a second
    member killed before the first one's shares are taken) and during a reshare."""
    consumer_db = group_db
    rng = random.Random(7)
    stop = asyncio.Event()
    split = 4
    async with streamq.Producer(producer_db, port=0) as producer:
        address = producer.address
        publishing = asyncio.create_task(_publish(producer, stop, rng))
        workers = [await _Worker.start(address, consumer_db, "--shares", "4") for _ in range(3)]

        def every_share_held_once() -> bool:
            held = sorted(s for w in workers if w.alive for s in w.held)
            return held == list(range(split))

        async def kill_a_holder() -> None:
            """One holding shares, if any does now (none may, as a split changes)."""
            alive = [w for w in workers if w.alive]
            await rng.choice([w for w in alive if w.held] or alive).kill()

        try:
            for round in range(6):
                await wait_for(every_share_held_once, timeout=30, what="every share held once")
                if round in (2, 4):  # a reshare, and a member killed as the others move
                    # A reshare needs a stored position of every share (one just taken
                    # over may not have committed yet).
                    await wait_for(
                        lambda: _positions(consumer_db) == split,  # noqa: B023
                        timeout=30, what="a position of every share",
                    )  # fmt: skip
                    split = {2: 6, 4: 3}[round]
                    reshare(consumer_db, "billing", split)
                await kill_a_holder()  # from outside, wherever it is
                if round == 3:  # and another before the first one's shares are taken
                    await kill_a_holder()
                if round % 2 == 0:  # and one that kills itself inside its 3rd transaction
                    dying = await _Worker.start(address, consumer_db, "--die-in-apply", "3")
                    workers.append(dying)
                    await wait_for(lambda: not dying.alive, timeout=30, what="it to die")  # noqa: B023
                    assert dying.process.returncode == -signal.SIGKILL
                workers.append(await _Worker.start(address, consumer_db))  # the stored split
                if round == 3:
                    workers.append(await _Worker.start(address, consumer_db))
            await wait_for(every_share_held_once, timeout=30, what="every share held once")
            stop.set()
            await publishing
            head = producer.head("orders")
            await wait_for(lambda: len(_credits(consumer_db)) == head, timeout=60, what="all")
        finally:
            stop.set()
            await publishing
            for worker in workers:
                await worker.kill()
    rows = _credits(consumer_db)
    _assert_once_in_key_order(rows, head)
    assert len({pid for _, _, pid in rows}) >= 6  # applied by many members in turn


async def _published(producer: streamq.Producer, count: int) -> int:
    async with producer.transaction() as tx:
        for n in range(count):
            await tx.publish("orders", b"x", key=KEYS[n % len(KEYS)])
    return producer.head("orders")


async def test_a_batch_under_a_lease_taken_since_is_refused_in_its_transaction(
    producer_db: str, group_db: str
) -> None:
    async with streamq.Producer(producer_db, port=0) as producer:
        head = await _published(producer, 100)
        # A stalled member: it looks at the group only every 10 s.
        stalled = GroupConsumer(
            producer.address, "orders", db=group_db, name="billing", shares=1,
            poll_interval=10, lease_timeout=60,
        )  # fmt: skip
        async with stalled:
            await wait_for(lambda: stalled.held == [0], what="the stalled member to hold it")
            batch = await anext(stalled)
            # Its lease expires (as if it had not renewed), and another member takes over.
            _sql(
                group_db, "UPDATE streamq_members SET expires_at = 0 WHERE member = ?",
                (stalled.member,),
            )  # fmt: skip
            async with GroupConsumer(
                producer.address, "orders", db=group_db, name="billing", poll_interval=0.05
            ) as other:
                await wait_for(lambda: other.held == [0], what="the other to take the share")
                with pytest.raises(streamq.LeaseLostError, match="no longer holds share 0"):
                    await stalled.apply(batch, credit, stalled.member)
                assert _credits(group_db) == []  # nothing of that transaction committed
                assert stalled.held == []  # it dropped the share
                task = asyncio.create_task(_run_member(other))
                try:
                    await wait_for(lambda: len(_credits(group_db)) == head, what="all applied")
                finally:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
    assert [seq for seq, _, _ in _credits(group_db)] == list(range(1, head + 1))
    assert {pid for _, _, pid in _credits(group_db)} == {other.member % 1000}


async def test_standbys_take_over_the_shares_of_a_member_that_leaves(
    producer_db: str, consumer_db: str
) -> None:
    async with streamq.Producer(producer_db, port=0) as producer:
        await _published(producer, 1)
        options: dict[str, Any] = {"db": consumer_db, "name": "billing", "poll_interval": 0.05}
        members = [GroupConsumer(producer.address, "orders", shares=2, **options) for _ in range(3)]
        async with contextlib.AsyncExitStack() as stack:
            for member in members:
                await stack.enter_async_context(member)
            await wait_for(
                lambda: sorted(len(m.held) for m in members) == [0, 1, 1], what="1, 1 and 0"
            )
            (standby,) = [m for m in members if not m.held]
            leaving = next(m for m in members if m.held)
            share = leaving.held
            await leaving.close()
            await wait_for(lambda: standby.held == share, what="the standby to take over")


async def test_a_member_asking_for_another_split_is_refused_naming_both(
    producer_db: str, consumer_db: str
) -> None:
    async with streamq.Producer(producer_db, port=0) as producer:
        address = producer.address
        async with GroupConsumer(address, "orders", db=consumer_db, name="billing", shares=4):
            with pytest.raises(streamq.GroupSpecError) as info:
                async with GroupConsumer(
                    address, "orders", db=consumer_db, name="billing", shares=3
                ):
                    pass
            assert "split into 4 shares" in str(info.value)
            assert "asks for 3" in str(info.value)
            async with GroupConsumer(address, "orders", db=consumer_db, name="billing") as same:
                assert same.shares == 4  # none asked: the stored split
        with pytest.raises(streamq.GroupSpecError, match=r"does not exist.*give shares="):
            await GroupConsumer(address, "orders", db=consumer_db, name="other").start()


async def test_group_tables_of_a_newer_version_are_refused(
    producer_db: str, consumer_db: str
) -> None:
    async with streamq.Producer(producer_db, port=0) as producer:
        address = producer.address
        async with GroupConsumer(address, "orders", db=consumer_db, name="billing", shares=2):
            pass
        _sql(consumer_db, "UPDATE streamq_groups SET version = 99")
        with pytest.raises(streamq.GroupSpecError, match="version 99, written by a newer"):
            await GroupConsumer(address, "orders", db=consumer_db, name="billing").start()


async def test_a_wrong_stream_is_raised_from_the_iteration(
    producer_db: str, consumer_db: str
) -> None:
    async with streamq.Producer(producer_db, port=0) as producer:
        await _published(producer, 1)
        async with GroupConsumer(
            producer.address, "nosuch", db=consumer_db, name="billing", shares=2
        ) as group:
            with pytest.raises(streamq.UnknownStreamError, match="nosuch"):
                await asyncio.wait_for(anext(group), 10)
            await wait_for(lambda: group.held == [], what="its shares given back")
            assert group.takes <= 2  # one try of each share: it stopped taking them


async def test_resharing_a_running_group_applies_every_record_once_in_key_order(
    producer_db: str, group_db: str
) -> None:
    rng = random.Random(11)
    stop = asyncio.Event()
    async with streamq.Producer(producer_db, port=0) as producer:
        publishing = asyncio.create_task(_publish(producer, stop, rng))
        options: dict[str, Any] = {"db": group_db, "name": "billing", "poll_interval": 0.05}
        members = [GroupConsumer(producer.address, "orders", shares=4, **options)]
        members += [GroupConsumer(producer.address, "orders", **options) for _ in range(2)]
        async with contextlib.AsyncExitStack() as stack:
            for member in members:
                await stack.enter_async_context(member)
            tasks = [asyncio.create_task(_run_member(m)) for m in members]
            try:
                before = 4
                for shares in (8, 3, 5):
                    # Every share has stored a position, and the shares stand apart.
                    await wait_for(
                        lambda: _positions(group_db) == before  # noqa: B023
                        and len(_credits(group_db)) > producer.head("orders") // 2 + 200,
                        timeout=30, what="every share to have applied something",
                    )  # fmt: skip
                    before = shares
                    moves = reshare(group_db, "billing", shares)
                    assert [len(m.new) for m in moves] == [shares]
                    await wait_for(
                        lambda: sorted(s for m in members for s in m.held) == list(range(shares)),  # noqa: B023
                        timeout=30, what=f"the {shares} new shares held",
                    )  # fmt: skip
                stop.set()
                await publishing
                head = producer.head("orders")
                await wait_for(lambda: len(_credits(group_db)) >= head, timeout=60, what="all")
            finally:
                stop.set()
                await publishing
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
    rows = _credits(group_db)
    _assert_once_in_key_order(rows, head)


async def test_a_member_serves_its_shares_and_membership_as_metrics(
    producer_db: str, consumer_db: str
) -> None:
    async with streamq.Producer(producer_db, port=0) as producer:
        head = await _published(producer, 40)
        _sql(consumer_db, _CREDITS)
        async with GroupConsumer(
            producer.address, "orders", db=consumer_db, name="billing", shares=2, metrics_port=0
        ) as group:
            task = asyncio.create_task(_run_member(group))
            try:
                await wait_for(lambda: len(_credits(consumer_db)) == head, what="all applied")
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            url = f"http://{group.metrics_address}/metrics"
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(url).read().decode())
            (report,) = await asyncio.to_thread(describe_groups, consumer_db, heads=False)
    member = f'group="billing",member="{group.member}",stream="orders"'
    assert f"streamq_group_shares{{{member}}} 2.0" in text
    # Each share's lease: when it was taken, as streamq groups shows its age.
    held = rf'group="billing",member="{group.member}",share="(\d)",stream="orders"'
    taken = dict(re.findall(rf"streamq_group_share_taken_seconds\{{{held}\}} (\S+)", text))
    assert sorted(taken) == ["0", "1"]
    for row in report.rows:
        assert row.held_ms is not None
        assert abs(float(taken[str(row.share)]) - (time.time() - row.held_ms / 1000)) < 30
    assert f"streamq_group_shares_held{{{member}}} 2.0" in text
    assert f"streamq_group_takes_total{{{member}}} 2.0" in text
    applied = re.findall(
        r'streamq_consumer_records_applied_total\{[^}]*consumer="billing\[(\d)/2\]"[^}]*\} (\S+)',
        text,
    )
    assert sorted(share for share, _ in applied) == ["0", "1"]
    assert sum(float(count) for _, count in applied) == head


async def test_a_member_cut_off_from_its_database_stops_applying_and_says_why(
    producer_db: str, pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = urllib.parse.urlsplit(pg_url)
    assert url.hostname is not None and url.port is not None
    _sql(
        pg_url,
        _CREDITS.replace("INTEGER PRIMARY KEY", "serial PRIMARY KEY").replace("BLOB", "bytea"),
    )
    async with (
        streamq.Producer(producer_db, port=0) as producer,
        FaultProxy(url.hostname, url.port) as proxy,
    ):
        head = await _published(producer, 50)
        through_proxy = url._replace(netloc=f"{url.username}@{proxy.address}").geturl()
        options: dict[str, Any] = {"name": "billing", "lease_timeout": 1.0, "poll_interval": 0.05}
        cut = GroupConsumer(producer.address, "orders", db=through_proxy, shares=1, **options)
        async with cut:
            await wait_for(lambda: cut.held == [0], what="the member to hold the share")
            async with GroupConsumer(producer.address, "orders", db=pg_url, **options) as other:
                proxy.toxic = Stall()  # every byte to and from the database held
                await wait_for(lambda: cut.held == [], what="the cut-off member to stop")
                assert "the consumer database has not answered for" in caplog.text
                await wait_for(lambda: other.held == [0], what="the other to take over")
                task = asyncio.create_task(_run_member(other))
                try:
                    await wait_for(lambda: len(_credits(pg_url)) == head, what="all applied")
                finally:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                proxy.toxic = None  # reachable again: it joins again, as a standby
                await wait_for(lambda: cut.takes == 1 and not cut._stalled, what="rejoined")
    assert [seq for seq, _, _ in _credits(pg_url)] == list(range(1, head + 1))
