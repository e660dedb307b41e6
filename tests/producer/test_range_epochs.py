"""Range reads with epochs (docs/protocol.md, "Epochs"): real producers on loopback and real
SQLite files; a lost suffix of commits is made as in tests/producer/test_epochs.py (a consistent
copy taken when the power "goes out"; tests/spark/test_spark_power_loss.py builds one from WAL
frames)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from streamq import Client, OffsetOutOfRangeError, SeqsReusedError, ServerSettings, SyncProducer
from streamq.protocol import RecordColumns, RecordRows
from streamq.wire.client import RangeRead, Vouch

from .test_epochs import image_at, restore


def epoch(producer: SyncProducer) -> int:
    """The epoch the producer took when it started (SERVER_HELLO.epoch when it serves)."""
    return producer._producer.epoch


def frames(reader: RangeRead[Any]) -> list[tuple[list[int], int | None]]:
    """(seqs, epoch) of each frame of a range answer, read to its end: records, or a
    columnar reader's frames (``read_range_frames``)."""
    found = []
    for batch in reader:
        if isinstance(batch, RecordColumns):
            seqs = [batch.columns.seq(i) for i in range(batch.columns.length)]
        elif isinstance(batch, RecordRows):
            seqs = [row[0] for row in batch.rows]
        else:
            seqs = [record.seq for record in batch]
        found.append((seqs, reader.epoch))
    return found


def test_frames_carry_their_epoch_and_never_span_two(tmp_path: Path) -> None:
    db = str(tmp_path / "p.db")
    epochs = []
    for values in ([b"1", b"2", b"3"], [b"4", b"5"]):  # two writers, one after the other
        with SyncProducer(db, serve=False) as writer, writer.transaction() as tx:
            tx.publish_many("orders", values)
            epochs.append(epoch(writer))
    with SyncProducer(db) as producer:
        producer.publish("orders", b"6")
        producer.publish("orders", b"7")
        e1, e2, e3 = *epochs, epoch(producer)
        with Client(producer.address) as client:
            reader = client.read_range_frames("orders", 2, 8, seen_epoch=e1)
            assert frames(reader) == [([2, 3], e1), ([4, 5], e2), ([6, 7], e3)]
            assert (reader.after_epoch, reader.rewritten_from) == (e1, 0)
            # 0: epochs without a position to vouch for.
            reader = client.read_range("orders", 4, 7, seen_epoch=0)
            assert frames(reader) == [([4, 5], e2), ([6], e3)]
            assert (reader.after_epoch, reader.rewritten_from) == (e1, 0)
            # Without seen_epoch, the range is as it always was: one frame, no epochs.
            reader = client.read_range("orders", 2, 8)
            assert frames(reader) == [([2, 3, 4, 5, 6, 7], None)]
            assert (reader.after_epoch, reader.rewritten_from) == (None, None)
            # An empty range vouches for the seq before it.
            assert client.vouch("orders", 7, e3) == Vouch(e3, 0)
            assert client.vouch("orders", 5, e2) == Vouch(e2, 0)
            assert client.vouch("orders", 0) == Vouch(0, 0)
            # Read up to 5 under epochs up to e1 only: 4..5 are not what was read.
            assert client.vouch("orders", 5, e1) == Vouch(e2, 4)
            assert list(client.read_range("orders", 8, 8, seen_epoch=e3)) == []


def test_split_frames_of_a_range_keep_their_epoch(tmp_path: Path) -> None:
    db = str(tmp_path / "p.db")
    with SyncProducer(db, serve=False) as writer, writer.transaction() as tx:
        tx.publish_many("orders", [b"x"] * 5)
        e1 = epoch(writer)
    settings = ServerSettings(max_batch_records=2)
    with SyncProducer(db, settings=settings) as producer, Client(producer.address) as client:
        producer.publish("orders", b"y")
        reader = client.read_range_frames("orders", 1, 7, seen_epoch=0, columnar=False)
        e2 = epoch(producer)
        assert frames(reader) == [([1, 2], e1), ([3, 4], e1), ([5], e1), ([6], e2)]


def test_seqs_reused_after_lost_commits_are_refused(tmp_path: Path) -> None:
    db, image = str(tmp_path / "p.db"), str(tmp_path / "image.db")
    with SyncProducer(db, durability="normal") as producer:
        with producer.transaction() as tx:
            tx.publish_many("orders", [b"kept"] * 3)
        image_at(db, image)  # the power goes out here: seqs 4.. are not synced
        with producer.transaction() as tx:
            tx.publish_many("orders", [b"lost"] * 3)
        with Client(producer.address) as client:
            reader = client.read_range("orders", 1, 7, seen_epoch=0)
            assert [epoch for _, epoch in frames(reader)] == [epoch(producer)]
            seen = epoch(producer)  # what a reader of seqs 1..6 remembers
    restore(image, db)
    with SyncProducer(db) as restarted, Client(restarted.address) as client:
        assert restarted.head("orders") == 3
        with restarted.transaction() as tx:
            tx.publish_many("orders", [b"new"] * 7)  # seqs 4..10: 4..6 re-used
        later = epoch(restarted)
        assert client.vouch("orders", 3, seen) == Vouch(seen, 0)  # 1..3 are intact
        assert client.vouch("orders", 6, seen) == Vouch(later, 4)
        reader = client.read_range_frames("orders", 7, 11, seen_epoch=seen)
        with pytest.raises(SeqsReusedError, match=r"seqs 4\.\.6") as info:
            next(reader)  # no records come: the reader's position is gone
        assert info.value.lost == range(4, 7)
        assert (reader.after_epoch, reader.rewritten_from) == (later, 4)
        assert list(reader) == []
        # The connection goes on: the next range, from what is intact, reads the new log.
        reader = client.read_range("orders", 4, 11, seen_epoch=seen)
        assert frames(reader) == [([4, 5, 6, 7, 8, 9, 10], later)]
        assert [r.value for batch in client.read_range("orders", 4, 5) for r in batch] == [b"new"]


def test_a_position_beyond_the_head_names_the_rewritten_seqs(tmp_path: Path) -> None:
    db, image = str(tmp_path / "p.db"), str(tmp_path / "image.db")
    with SyncProducer(db, durability="normal") as producer:
        producer.publish("orders", b"kept")
        image_at(db, image)
        with producer.transaction() as tx:
            tx.publish_many("orders", [b"lost"] * 5)  # seqs 2..6
        seen = epoch(producer)
    restore(image, db)
    with SyncProducer(db) as restarted:
        with restarted.transaction() as tx:
            tx.publish_many("orders", [b"new"] * 2)  # seqs 2..3, under a new epoch
        with Client(restarted.address) as client, pytest.raises(OffsetOutOfRangeError) as info:
            list(client.read_range("orders", 7, 7, seen_epoch=seen))
        details = info.value.details
        assert (details["head"], details["rewritten_from"]) == (3, 2)
        with Client(restarted.address) as client, pytest.raises(OffsetOutOfRangeError) as info:
            client.vouch("orders", 6, seen)
        assert info.value.details["rewritten_from"] == 2
        with Client(restarted.address) as client, pytest.raises(OffsetOutOfRangeError) as info:
            list(client.read_range("orders", 7, 7))  # without epochs: no rewritten_from
        assert "rewritten_from" not in info.value.details
