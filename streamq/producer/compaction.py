"""What compaction removes, and how it is told: ``Compacted`` entries and their records.

Compaction keeps each key's latest record and deletes the older ones. Each deleted
record is reported with the record that superseded it (the next one of the same
key), to ``Producer(on_compacted=...)`` and, for streams created with
``notify_compacted=True``, as a record of the stream ``"<name>.compacted"``
written in the same transaction as the deletion. That record's value is a
MessagePack map (keys below), so another team decodes it without streamq's code.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from itertools import groupby, pairwise
from typing import Any

import msgpack

from ..protocol import Record, decode_record
from .committed_log import Stream
from .transactions import Transaction, transaction
from .writing import Writing

logger = logging.getLogger("streamq.producer")

NOTIFICATION_SUFFIX = ".compacted"
# Seqs compacted per transaction: bounds the records one compaction step holds in memory
# and how long it keeps the writer.
WINDOW = 100_000


@dataclass(frozen=True, slots=True)
class Compacted:
    """One record compaction removed (``old_*``) and the one that superseded it (``new_*``)."""

    stream: str
    key: bytes
    old_seq: int
    old_value: bytes
    new_seq: int
    new_value: bytes

    def to_value(self) -> bytes:
        """The value of its record in ``"<stream>.compacted"``: a MessagePack map."""
        packed: bytes = msgpack.packb(
            {
                "stream": self.stream,
                "key": self.key,
                "old_seq": self.old_seq,
                "old_value": self.old_value,
                "new_seq": self.new_seq,
                "new_value": self.new_value,
            },
            use_bin_type=True,
        )
        return packed

    @classmethod
    def from_record(cls, record: Record) -> Compacted:
        """Decode a record of a ``"<stream>.compacted"`` stream."""
        fields: dict[str, Any] = msgpack.unpackb(record.value, raw=False)
        return cls(
            fields["stream"],
            fields["key"],
            fields["old_seq"],
            fields["old_value"],
            fields["new_seq"],
            fields["new_value"],
        )


def superseded(stream: str, candidates: Iterable[tuple[int, bytes, bytes]]) -> list[Compacted]:
    """Every record but each key's latest, paired with the next record of its key.

    ``candidates`` are (seq, key, encoded record), grouped by key, in seq order
    within a key (``store.compaction_candidates``).
    """
    removed = []
    for key, group in groupby(candidates, key=lambda candidate: candidate[1]):
        records = [decode_record(encoded) for _, _, encoded in group]
        for old, new in pairwise(records):
            removed.append(Compacted(stream, key, old.seq, old.value, new.seq, new.value))
    removed.sort(key=lambda entry: entry.old_seq)
    return removed


# Told what compaction removed from a stream, once the deletion has committed.
OnCompacted = Callable[[str, list[Compacted]], Awaitable[None] | None]


class Compactor:
    """A producer's compaction: ``compact`` on request, and every ``interval`` seconds
    for the streams created with ``compact=True`` that have new records."""

    def __init__(self, writing: Writing, interval: float, on_compacted: OnCompacted | None) -> None:
        self._writing = writing
        self.interval = interval
        self._on_compacted = on_compacted

    async def compact(self, stream: str) -> list[Compacted]:
        """``Producer.compact``."""
        target = self._writing.log.stream(stream)
        if not target.settings.key_index:
            raise ValueError(
                f"stream {stream!r} has no key index; compaction needs one "
                "(create_stream(..., key_index=True))"
            )
        removed: list[Compacted] = []
        end = target.head
        while target.compacted < end:
            removed += await self._compact_window(target, WINDOW)
        return removed

    async def _compact_window(self, target: Stream, window: int) -> list[Compacted]:
        """Compact the next ``window`` seqs after the compaction point, in one transaction:
        it looks only at the keys written there (and their older records)."""
        writing = self._writing
        writer = writing.writer
        compacted = target.compacted
        tx: Transaction | None = None
        try:
            async with transaction(writing) as tx:
                through = min(target.head, target.compacted + window)
                candidates = await writer.compaction_candidates(
                    target.id, target.low, target.compacted, through
                )
                removed = superseded(target.name, candidates)
                await writer.delete_compacted(
                    target.id, [entry.old_seq for entry in removed], through
                )
                if target.settings.notify_compacted:
                    notifications = target.name + NOTIFICATION_SUFFIX
                    for entry in removed:
                        await tx.publish(notifications, entry.to_value(), key=entry.key)
                target.compacted = through  # before COMMIT, as truncate does with low
        except BaseException:
            if tx is None or not tx.committed:
                target.compacted = compacted
            raise
        finally:
            if tx is not None and tx.committed:
                # Its tail may hold removed records. (Retention counts its size anew:
                # its compaction point moved.)
                target.tail.reset(target.head + 1)
        if removed and self._on_compacted is not None:
            result = self._on_compacted(target.name, removed)
            if inspect.isawaitable(result):
                await result
        return removed

    async def run(self) -> None:
        """Compact, every ``interval``, the ``compact=True`` streams with new records."""
        while True:
            await asyncio.sleep(self.interval)
            for stream in list(self._writing.log.streams.values()):
                if stream.settings.compact and stream.head > stream.compacted:
                    try:
                        await self.compact(stream.name)
                    except Exception:
                        logger.exception("compacting stream %r failed", stream.name)
