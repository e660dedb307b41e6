"""What a consumer receives and applies: a ``Batch`` of records from one producer's stream."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, overload

from ..protocol import Record


class Fence(NamedTuple):
    """The lease a group member applies a share under (``streamq.membership``): the
    position's turn check refuses the batch once the lease's token has moved on."""

    group: str  # the consumer's name, without the share's ``[i/n]``
    share: int
    token: int


@dataclass(frozen=True, slots=True)
class Batch(Sequence[Record]):
    """Records pushed by a producer, in seq order, to be applied together.

    ``after`` is the seq this batch follows: the consumer's position before it, and
    ``last_seq`` its position after it. They enclose every record of the batch; with a
    filter ("Filters"), the seqs between them that are not records did not match, and a
    batch may hold no records at all: applying it moves the position all the same.
    ``epoch`` is the highest producer epoch that wrote any record up to its last (0 if
    unknown), stored with the position so a producer that lost and reused seqs is caught
    ("Epochs").
    """

    stream: str
    producer_id: str
    after: int
    records: tuple[Record, ...]
    epoch: int = 0
    consumer: str = ""  # the consumer's name: where ``streamq.save_position`` stores it
    endpoint: str = ""  # the producer's address, stored with the position
    origin: int = 0  # where the consumer started when no position was stored (start_seq - 1)
    through: int = 0  # the producer examined every seq up to this one (0: the last record's)
    fence: Fence | None = None  # applied under a group's lease: checked with the turn

    @property
    def first_seq(self) -> int:
        """The first record's seq (``after + 1`` if the batch holds none)."""
        return self.records[0].seq if self.records else self.after + 1

    @property
    def last_seq(self) -> int:
        """The position once the batch is applied."""
        return self.through or self.records[-1].seq

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    @overload
    def __getitem__(self, index: int) -> Record: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Record]: ...
    def __getitem__(self, index: int | slice) -> Record | Sequence[Record]:
        return self.records[index]
