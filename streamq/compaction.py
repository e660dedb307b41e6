"""What compaction removes, and how it is told: ``Compacted`` entries and their records.

Compaction keeps each key's latest record and deletes the older ones. Each deleted
record is reported with the record that superseded it (the next one of the same
key), to ``Producer(on_compacted=...)`` and, for streams created with
``notify_compacted=True``, as a record of the stream ``"<name>.compacted"``
written in the same transaction as the deletion. That record's value is a
MessagePack map (keys below), so another team decodes it without streamq's code.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import groupby, pairwise
from typing import Any

import msgpack

from .protocol import Record, decode_record

NOTIFICATION_SUFFIX = ".compacted"


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
