"""The Spark source's epochs ("Epochs" in docs/protocol.md), without Spark: the driver's
offsets and checks and the executors' range reads, as plain functions against real
producers that lost commits (a consistent copy taken when the power "goes out", as in
tests/producer/test_epochs.py; tests/spark/test_spark_power_loss.py runs a real query on a
WAL image)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pytest
from pyspark.sql.streaming.datasource import ReadAllAvailable

from bench.common import reserved_port
from spark_source import planning
from spark_source.datasource import (
    StreamQPartition,
    StreamQStreamReader,
    StreamQTask,
    _Settings,
    read_partition,
)
from spark_source.planning import BatchEpochs, Connect, Position, Range, StreamQSourceError
from streamq import SyncProducer

from ..producer.test_epochs import image_at, restore


@dataclass
class Lost:
    """A producer that served seqs 1..20 under ``before``, lost 11..20 in a power loss, and
    restarted (``after``) to write ``head - 10`` other records from seq 11 on."""

    producer: SyncProducer
    before: int
    after: int
    head: int

    @property
    def pid(self) -> str:
        return self.producer.producer_id

    @property
    def address(self) -> str:
        return self.producer.address


def lose_commits(tmp_path: Path, rewritten: int) -> Iterator[Lost]:
    db, image = str(tmp_path / "p.db"), str(tmp_path / "image.db")
    with reserved_port() as port:  # the producer's, before and after the loss
        with SyncProducer(db, durability="normal", port=port) as producer:
            with producer.transaction() as tx:
                tx.publish_many("orders", [b"kept %d" % n for n in range(1, 11)])
            image_at(db, image)  # the power goes out here: seqs 11.. are not synced
            with producer.transaction() as tx:
                tx.publish_many("orders", [b"lost %d" % n for n in range(11, 21)])
            before = producer._producer.epoch
        restore(image, db)
        with SyncProducer(db, port=port) as restarted:
            with restarted.transaction() as tx:
                tx.publish_many("orders", [b"new %d" % n for n in range(11, 11 + rewritten)])
            yield Lost(restarted, before, restarted._producer.epoch, 10 + rewritten)


@pytest.fixture
def reused(tmp_path: Path) -> Iterator[Lost]:
    """Seqs 11..20 re-used, and the log goes on to 25."""
    yield from lose_commits(tmp_path, 15)


@pytest.fixture
def behind(tmp_path: Path) -> Iterator[Lost]:
    """Seqs 11..13 re-used; the head (13) is below what the query read (20)."""
    yield from lose_commits(tmp_path, 3)


def reader(lost: Lost, **options: str) -> StreamQStreamReader:
    return StreamQStreamReader(
        _Settings({"endpoints": lost.address, "stream": "orders", **options})
    )


def values(batches: Iterator[pa.RecordBatch]) -> list[tuple[int, bytes]]:
    table = pa.Table.from_batches(list(batches))
    seqs, found = table.column("seq").to_pylist(), table.column("value").to_pylist()
    return list(zip(seqs, found, strict=True))


def partition(
    lost: Lost, start: int, end: int, epochs: BatchEpochs | None, fail: bool = True
) -> StreamQPartition:
    rng = Range(lost.pid, lost.address, start, end)
    return StreamQPartition(rng, "orders", fail, Connect(10), epochs=epochs)


def test_offsets_carry_epochs_beside_the_seqs() -> None:
    offset = planning.join_offset({"b": 7, "a": 3}, {"b": 2, "a": 1, "gone": 9})
    assert offset == {"a": 3, "b": 7, "epochs": {"a": 1, "b": 2}}
    assert list(offset) == ["a", "b", "epochs"]  # Spark compares offsets as JSON text
    assert planning.split_offset(offset) == ({"a": 3, "b": 7}, {"a": 1, "b": 2})
    # An offset an older version wrote: seqs only, no epochs; written back the same.
    assert planning.split_offset({"a": 3}) == ({"a": 3}, {})
    assert planning.join_offset({"a": 3}, {}) == {"a": 3}
    with pytest.raises(StreamQSourceError, match="not a streamq offset"):
        planning.split_offset({"a": "3"})
    # startingOffsets copied from a query's offset keeps its epochs.
    spec = '{"a": 3, "b": -1, "epochs": {"a": 1, "b": 2}}'
    assert planning.given_epochs(spec) == {"a": 1}
    assert planning.resolve(spec, {"a": STATE_A, "b": STATE_B}, "startingOffsets") == {
        "a": 3,
        "b": 11,
    }


STATE_A = planning.ProducerState("a", "h:1", head=100, low=1)
STATE_B = planning.ProducerState("b", "h:2", head=10, low=5)


def test_producers_vouch_for_the_query_position(reused: Lost) -> None:
    def state(seq: int, epoch: int | None) -> planning.ProducerState:
        states = planning.discover(
            [reused.address], "orders", Connect(10), {reused.pid: Position(seq, epoch)}
        )
        return states[reused.pid]

    intact = state(11, reused.before)  # read up to 10: kept
    assert (intact.head, intact.epoch, intact.lost) == (25, reused.after, None)
    assert state(21, reused.before).lost == range(11, 21)  # read up to 20: 11..20 re-used
    assert state(21, reused.after).lost is None  # read under the new epoch: intact
    assert state(21, None).lost is None  # an offset without epoch cannot tell
    assert state(26, reused.before).lost == range(11, 26)  # at the head: one question
    assert (state(26, reused.after).lost, state(26, reused.after).epoch) == (None, reused.after)
    assert state(30, reused.before).lost == range(11, 30)
    assert state(30, None).lost == range(26, 30)  # beyond the head, at least
    batch = planning.discover([reused.address], "orders", Connect(10))[reused.pid]
    assert (batch.epoch, batch.lost) == (None, None)  # a batch read asks for no epochs


def test_a_streaming_query_fails_on_reused_seqs_or_goes_back(
    reused: Lost, caplog: pytest.LogCaptureFixture
) -> None:
    start = {reused.pid: 21, "epochs": {reused.pid: reused.before}}
    with pytest.raises(
        StreamQSourceError,
        match=(
            rf"producer {reused.pid} at {reused.address} lost commits of stream 'orders' and "
            r"re-used their seqs: the query already read up to seq 20, but the producer's log "
            r"no longer holds seqs 11\.\.20 as the query read them \(head 25; other records "
            r"now stand under seqs 11\.\.20\).* set failOnDataLoss=false to go on from seq 11"
        ),
    ):
        reader(reused).latestOffset(start, ReadAllAvailable())

    lenient = reader(reused, failOnDataLoss="false")
    with caplog.at_level(logging.WARNING, logger="spark_source"):
        back = lenient.latestOffset(start, ReadAllAvailable())
    assert back == {reused.pid: 11, "epochs": {reused.pid: reused.after}}
    assert "failOnDataLoss=false: going on from seq 11" in caplog.text
    assert lenient.partitions(start, back) == []  # this batch reads nothing of it
    end = lenient.latestOffset(back, ReadAllAvailable())
    assert end == {reused.pid: 26, "epochs": {reused.pid: reused.after}}
    [task] = lenient.partitions(back, end)
    assert isinstance(task, StreamQTask)
    [part] = task.parts
    assert part.epochs == BatchEpochs(11, reused.after, reused.after)
    assert values(read_partition(part))[0] == (11, b"new 11")
    # Nothing new: the very same offset, so Spark runs no batch.
    assert lenient.latestOffset(end, ReadAllAvailable()) == end


def test_a_producer_behind_the_query_fails_it_or_sends_it_back(
    behind: Lost, caplog: pytest.LogCaptureFixture
) -> None:
    start = {behind.pid: 21, "epochs": {behind.pid: behind.before}}
    with pytest.raises(StreamQSourceError, match=r"no longer holds seqs 11\.\.20 .*\(head 13;"):
        reader(behind).latestOffset(start, ReadAllAvailable())
    legacy = {behind.pid: 21}  # no epoch: the head check alone
    with pytest.raises(
        StreamQSourceError,
        match=r"has head 13 for stream 'orders', but the query already read up to seq 20: "
        r"seqs 14\.\.20 are no longer in the producer's log",
    ):
        reader(behind).latestOffset(legacy, ReadAllAvailable())
    with caplog.at_level(logging.WARNING, logger="spark_source"):
        back = reader(behind, failOnDataLoss="false").latestOffset(legacy, ReadAllAvailable())
    assert back == {behind.pid: 14, "epochs": {behind.pid: behind.after}}
    assert "going on from seq 14" in caplog.text


def test_executors_check_the_epochs_of_what_they_read(
    reused: Lost, caplog: pytest.LogCaptureFixture
) -> None:
    # The query read up to 20 under the old epoch (a batch replayed after a restart).
    replayed = BatchEpochs(21, reused.before, reused.before)
    with pytest.raises(StreamQSourceError, match=r"no longer holds seqs 11\.\.20 as the query"):
        list(read_partition(partition(reused, 21, 26, replayed)))
    with caplog.at_level(logging.WARNING, logger="spark_source"):
        read = values(read_partition(partition(reused, 21, 26, replayed, fail=False)))
    assert read == [(n, b"new %d" % n) for n in range(21, 26)]
    assert "failOnDataLoss=false: read seqs 21..25 as the producer holds them now" in caplog.text
    # Planned before the loss (up to 10 read; 11..20 to read, all under the old epoch):
    # the producer vouches for 1..10, but the frames it sends were written after.
    planned = BatchEpochs(11, reused.before, reused.before)
    with pytest.raises(
        StreamQSourceError,
        match=rf"seqs 11\.\.20, which this micro-batch reads, were written "
        rf"again \(by epoch {reused.after}\) after it was planned",
    ):
        list(read_partition(partition(reused, 11, 21, planned)))
    middle = partition(reused, 16, 21, planned)  # a later partition of the same batch
    with pytest.raises(StreamQSourceError, match=r"seqs 16\.\.20, which this micro-batch"):
        list(read_partition(middle))
    # As planned under the new epoch: read without a word.
    fine = BatchEpochs(11, reused.before, reused.after)
    assert len(values(read_partition(partition(reused, 11, 26, fine)))) == 15
    # Without epochs (a batch read, or an older offset), as before.
    assert len(values(read_partition(partition(reused, 11, 26, None)))) == 15


def test_executors_behind_a_producer_that_lost_commits(
    behind: Lost, caplog: pytest.LogCaptureFixture
) -> None:
    planned = BatchEpochs(11, behind.before, behind.before)
    with pytest.raises(StreamQSourceError, match=r"head is now 13 and it no longer holds seqs 14"):
        list(read_partition(partition(behind, 11, 21, planned)))
    with caplog.at_level(logging.WARNING, logger="spark_source"):
        read = values(read_partition(partition(behind, 11, 21, planned, fail=False)))
    assert read == [(11, b"new 11"), (12, b"new 12"), (13, b"new 13")]
    assert "read only what it holds up to its head (13)" in caplog.text
