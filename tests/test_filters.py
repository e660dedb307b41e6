"""Server-side filters and per-key shares over real sockets, with producer and consumer
databases of either engine: a consumer receives only what its filter matches, its
position still moves past the rest (lag, ``wait_applied`` and retention see it), range
reads filter the same way, and ``n`` shares split a stream by key, each record to exactly
one share, in order per key, with a refusal when ``n`` changes under stored positions.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import subprocess
import sys
import zlib
from collections import defaultdict
from typing import Any

import pytest

from streamq import (
    Batch,
    Client,
    Consumer,
    Filter,
    Producer,
    ServerSettings,
    SharesChangedError,
    share_of,
)
from streamq.errors import NewConsumerNameError, OutOfOrderBatchError
from streamq.filters import FilterError
from tests.conftest import wait_for

FAST = ServerSettings(progress_interval=0.05)
KINDS = (b"created", b"paid", b"shipped")


def key_of(n: int) -> bytes | None:
    """Keys of two entity kinds, and every seventh record keyless."""
    if n % 7 == 0:
        return None
    return b"order-%d" % (n % 50) if n % 2 else b"user-%d" % (n % 30)


async def publish(producer: Producer, first: int, count: int, per_tx: int = 25) -> None:
    for start in range(first, first + count, per_tx):
        async with producer.transaction() as tx:
            for n in range(start, min(first + count, start + per_tx)):
                kind = KINDS[n % 3]
                await tx.publish("s", b"%d" % n, key=key_of(n), headers={"type": kind})


def status_of(address: str) -> dict[str, Any]:
    with Client(address) as client:
        return client.status()


def wanted(n: int, flt: Filter) -> bool:
    return flt.matches(key_of(n), {"type": KINDS[n % 3]})


def test_filter_matching_and_its_limits() -> None:
    assert share_of(None, 8) == 0
    assert share_of(b"abc", 7) == zlib.crc32(b"abc") % 7 == 0x352441C2 % 7
    flt = Filter(key_prefix=b"order-", headers={"type": b"paid"})
    assert flt.matches(b"order-1", {"type": b"paid", "x": b"y"})
    assert not flt.matches(b"order-1", {"type": b"created"})
    assert not flt.matches(b"user-1", {"type": b"paid"})
    assert not flt.matches(None, {"type": b"paid"})  # a prefix never matches no key
    assert Filter(share=(0, 1)).everything and not Filter(share=(0, 2)).everything
    assert Filter.from_wire(flt.to_wire()) == flt
    for bad in ((2, 2), (0, 0), (-1, 3), (0, 70000)):
        with pytest.raises(FilterError, match="share must be"):
            Filter(share=bad)
    with pytest.raises(FilterError, match="at most 1024"):
        Filter(key_prefix=b"x" * 1025)
    with pytest.raises(FilterError, match="unknown filter fields: typ"):
        Filter.from_wire({"typ": b"paid"})
    with pytest.raises(ValueError, match="not both"):
        Consumer("127.0.0.1:1", "s", filter=Filter(share=(0, 2)), share=(1, 2))


async def test_filtered_subscription_gets_only_matches_and_its_position_moves(
    either_producer_db: str, consumer_db: str
) -> None:
    flt = Filter(key_prefix=b"order-", headers={"type": b"paid"})
    applied: list[int] = []

    def record(tx: Any, batch: Batch) -> int:
        applied.extend(r.seq for r in batch)
        return len(batch)

    async with Producer(either_producer_db, settings=FAST) as producer:
        await publish(producer, 1, 600)
        async with Consumer(
            producer.address, "s", db=consumer_db, name="paid", filter=flt
        ) as consumer:
            await wait_for(lambda: consumer.received == 600, what="progress through the head")
            while consumer.applied < 600:
                await consumer.apply(await anext(consumer), record)
            assert applied == [n for n in range(1, 601) if wanted(n, flt)]
            assert 0 < len(applied) < 100  # the producer sent a sixth of a half, no more
            # The producer knows the position, past the records it skipped.
            assert await producer.wait_applied("paid", "s", 600, timeout=10) == 600
            (lag,) = [p for p in producer.consumer_lags() if p.consumer == "paid"]
            assert lag.lag == 0
            status = await asyncio.to_thread(status_of, producer.address)
            assert status["sent"]["s"]["records"] == len(applied)
            (subscription,) = status["consumers"]
            assert subscription["filter"] == "key_prefix=b'order-' type=b'paid'"

            # Records that do not match at all still move the position (a progress frame).
            async with producer.transaction() as tx:
                await tx.publish("s", b"x", key=b"user-1", headers={"type": b"paid"})
            batch = await anext(consumer)
            assert (len(batch), batch.after, batch.last_seq) == (0, 600, 601)
            assert await consumer.apply(batch, record) == 0
        assert applied[-1] < 601
        # Restarted, it resumes from its stored position: nothing again, the rest once.
        await publish(producer, 602, 300)
        async with Consumer(
            producer.address, "s", db=consumer_db, name="paid", filter=flt
        ) as consumer:
            while consumer.applied < 901:
                await consumer.apply(await anext(consumer), record)
    assert applied == [n for n in range(1, 902) if n != 601 and wanted(n, flt)]


async def test_filtered_ranges(either_producer_db: str) -> None:
    async with Producer(either_producer_db, settings=FAST) as producer:
        await publish(producer, 1, 500)
        await asyncio.to_thread(read_filtered_ranges, producer.address)


def read_filtered_ranges(address: str) -> None:
    flt = Filter(headers={"type": b"shipped"})
    with Client(address) as client:
        read = client.read_range("s", 100, 400, filter=flt)
        seqs = [r.seq for batch in read for r in batch]
        assert seqs == [n for n in range(100, 400) if wanted(n, flt)]
        frames = client.read_range_frames("s", 1, 501, seen_epoch=0, filter=flt, columnar=False)
        assert [row[0] for frame in frames for row in frame.rows] == [
            n for n in range(1, 501) if wanted(n, flt)
        ]
        everything = client.read_range("s", 1, 501, filter=Filter())
        assert sum(map(len, everything)) == 500


async def test_shares_split_the_stream_by_key(either_producer_db: str, consumer_db: str) -> None:
    """Four shares: every record to exactly one, keyless ones to share 0, in seq order
    within each share (so per key), and each share's position stored under its name."""
    got: dict[int, list[tuple[int, bytes | None]]] = defaultdict(list)
    async with Producer(either_producer_db, settings=FAST) as producer:
        await publish(producer, 1, 700)
        async with contextlib.AsyncExitStack() as stack:
            workers = [
                await stack.enter_async_context(
                    Consumer(producer.address, "s", db=consumer_db, name="billing", share=(i, 4))
                )
                for i in range(4)
            ]
            for i, worker in enumerate(workers):
                assert worker.name == f"billing[{i}/4]"
                while worker.applied < 700:
                    batch = await anext(worker)
                    got[i] += [(r.seq, r.key) for r in batch]
                    async with worker.transaction(batch):
                        pass
            for i in range(4):
                await producer.wait_applied(f"billing[{i}/4]", "s", 700, timeout=10)
    seqs = sorted(seq for share in got.values() for seq, _ in share)
    assert seqs == list(range(1, 701))  # each record once, to one share
    for i, share in got.items():
        assert [seq for seq, _ in share] == sorted(seq for seq, _ in share)
        assert all(share_of(key, 4) == i for _, key in share)
        assert 100 < len(share) < 250  # keys spread over the shares
    assert all(key is not None for i in (1, 2, 3) for _, key in got[i])
    with contextlib.closing(sqlite3.connect(consumer_db)) as conn:
        stored = dict(conn.execute("SELECT consumer, seq FROM streamq_positions").fetchall())
    assert stored == {f"billing[{i}/4]": 700 for i in range(4)}


async def test_changing_the_number_of_shares_is_refused(producer_db: str, consumer_db: str) -> None:
    async with Producer(producer_db, settings=FAST) as producer:
        await publish(producer, 1, 100)
        for i in range(2):
            async with Consumer(
                producer.address, "s", db=consumer_db, name="billing", share=(i, 2)
            ) as worker:
                while worker.applied < 100:
                    async with worker.transaction(await anext(worker)):
                        pass
        for asked in ({"share": (0, 3)}, {}):
            with pytest.raises(SharesChangedError) as info:
                async with Consumer(producer.address, "s", db=consumer_db, name="billing", **asked):
                    pass
            assert info.value.stored == {"billing[0/2]": 100, "billing[1/2]": 100}
            assert "would skip or re-apply records" in str(info.value)
        # Another consumer's names are not this one's shares: new names, started on purpose.
        for name, options in (("billing[x]", {}), ("bill", {"share": (0, 5)})):
            with pytest.raises(NewConsumerNameError):
                async with Consumer(producer.address, "s", db=consumer_db, name=name, **options):
                    pass
            async with Consumer(
                producer.address, "s", db=consumer_db, name=name, start_seq=1, **options
            ):
                pass


async def test_reshare_moves_a_split_where_all_shares_stand_at_one_seq(
    either_producer_db: str, pg_url: str
) -> None:
    """``streamq reshare`` (a real process) on a PostgreSQL consumer database: refused while
    the shares stand at different seqs, then 2 -> 3 shares at the head, after which the
    three new workers apply exactly the records after it, and an old worker stops."""
    got: list[int] = []

    async def run(share: tuple[int, int], until: int) -> Consumer:
        worker = Consumer(producer.address, "s", db=pg_url, name="billing", share=share)
        await worker.start()
        while worker.applied < until:
            batch = await anext(worker)
            got.extend(r.seq for r in batch)
            async with worker.transaction(batch):
                pass
        return worker

    async with Producer(either_producer_db, settings=FAST) as producer:
        await publish(producer, 1, 200)
        await (await run((0, 2), 200)).close()
        await publish(producer, 201, 50)
        old = await run((1, 2), 250)  # still running when the split changes
        refused = await reshare_cli(pg_url, "billing", "3")
        assert refused.returncode == 1
        assert "the shares stand at different seqs (billing[0/2] at 200, billing[1/2] at 250)" in (
            refused.stderr
        )
        await (await run((0, 2), 250)).close()
        done = await reshare_cli(pg_url, "billing", "3")
        assert done.returncode == 0, done.stderr
        assert (
            "billing[0/2], billing[1/2] -> billing[0/3], billing[1/3], billing[2/3] at seq 250"
            in (done.stdout)
        )
        await publish(producer, 251, 100)
        with pytest.raises(OutOfOrderBatchError):  # its row is gone: it stops
            async with old.transaction(await anext(old)):
                pass
        await old.close()
        for i in range(3):
            await (await run((i, 3), 350)).close()
    assert sorted(got) == list(range(1, 351))  # each record applied once, none skipped


async def reshare_cli(db: str, consumer: str, shares: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "streamq", "reshare", db, consumer, "--shares", shares]
    return await asyncio.to_thread(
        subprocess.run, command, capture_output=True, text=True, timeout=60, check=False
    )
