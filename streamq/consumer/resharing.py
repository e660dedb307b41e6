"""Changing how many shares a consumer's stream is split into, safely: offline for
workers started with ``Consumer(share=)``, online for a consumer group.

Each share's position counts only its own keys, so positions taken under one split mean
nothing under another, except when every share of the old split stands at the same seq:
then every record up to that seq is applied, whatever its key, and none after it. So
``streamq reshare`` moves a consumer to a new split only from there, in one transaction
on the consumer's database: the old split's rows are deleted and the new split's rows
written at that seq. Workers still running with the old split find their row gone and
stop (``OutOfOrderBatchError``); workers of the new split start where the old ones
stopped. This module plans the change from the stored rows; each engine runs its SQL.

**Online, for a group** (``GroupConsumer``), the shares need not stand at one seq. Share
``i`` of the old split at position ``P[i]`` has applied, of each key ``k`` in it, every
record up to ``P[i]`` and none after. So under the new split each key's records resume
after its own *floor*, ``P[share_of(k, n)]``: the new shares start at ``min(P)`` (every
record up to it is applied, whatever its key), and each skips the records of key ``k``
at or below ``k``'s floor (``Floors``). The floors are stored with the new positions
and members apply them as they read; they stop mattering once every new share is past
the highest of them. A second change before that keeps them: a record is applied if its
seq is at or below its floor under any of the splits listed. The change is one
transaction (positions, floors, the group's split, its leases deleted, which fences
every batch still being applied under the old split), and the members, seeing the
split change at their next look, take the new shares: no pause beyond that.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import NamedTuple

from ..errors import StreamQError
from ..filters import MAX_SHARES, names_for, share_of, shared_as


class ReshareRefusedError(StreamQError):
    """The stored positions do not allow a safe change of split (see the message)."""


class StoredPosition(NamedTuple):
    consumer: str
    producer_id: str
    stream: str
    seq: int
    epoch: int
    endpoint: str


class Move(NamedTuple):
    """One (producer, stream) of the consumer: the rows to delete and those to write."""

    producer_id: str
    stream: str
    seq: int
    epoch: int  # the highest of the old rows'
    endpoint: str
    old: tuple[str, ...]
    new: tuple[str, ...]


def split_of(consumer: str, names: Iterable[str]) -> int | None:
    """How many shares ``names`` are the complete split of, None if they are not one."""
    found = set(names)
    counts = {1} | {share[1] for name in found if (share := shared_as(consumer, name))}
    for count in counts:
        if found == set(names_for(consumer, count)):
            return count
    return None


def plan(consumer: str, shares: int, rows: Iterable[StoredPosition]) -> list[Move]:
    """The moves to a split into ``shares`` for every (producer, stream) with stored
    positions of ``consumer``; raises ``ReshareRefusedError`` saying why it is not safe."""
    if not 1 <= shares <= MAX_SHARES:
        raise ReshareRefusedError(f"shares must be between 1 and {MAX_SHARES}, not {shares}")
    groups: dict[tuple[str, str], list[StoredPosition]] = defaultdict(list)
    for row in rows:
        if row.consumer == consumer or shared_as(consumer, row.consumer) is not None:
            groups[row.producer_id, row.stream].append(row)
    if not groups:
        raise ReshareRefusedError(f"no stored positions of consumer {consumer!r}")
    moves = []
    for (producer_id, stream), found in sorted(groups.items()):
        seqs = {row.consumer: row.seq for row in found}
        where = f"stream {stream!r} from producer {producer_id}"
        count = split_of(consumer, seqs)
        if count is None:
            raise ReshareRefusedError(
                f"{where}: positions {sorted(seqs)} are not one complete split of consumer "
                f"{consumer!r} (a share that never committed has no position): run every "
                "share until each has applied something, then reshare"
            )
        if len(set(seqs.values())) > 1:
            listed = ", ".join(f"{name} at {seq}" for name, seq in sorted(seqs.items()))
            raise ReshareRefusedError(
                f"{where}: the shares stand at different seqs ({listed}). Only at one seq "
                "for all is every record before it applied and none after it: let every "
                "share catch up with the head while the stream is quiet (filtered "
                "subscriptions move to the head when nothing matches), stop them, and "
                "reshare again"
            )
        (seq,) = set(seqs.values())
        epoch = max(row.epoch for row in found)
        old, new = tuple(sorted(seqs)), names_for(consumer, shares)
        moves.append(Move(producer_id, stream, seq, epoch, found[0].endpoint, old, new))
    return moves


Split = tuple[int, tuple[int, ...]]  # (n, the seq each of its n shares had applied up to)


class Floors(NamedTuple):
    """Records already applied under earlier splits of a group (the module docstring)."""

    splits: tuple[Split, ...]

    @property
    def highest(self) -> int:
        """No record above this seq was applied under an earlier split."""
        return max((max(seqs) for _, seqs in self.splits), default=0)

    def applied(self, key: bytes | None, seq: int) -> bool:
        """The record of ``key`` at ``seq`` was applied under an earlier split."""
        return any(seq <= seqs[share_of(key, n)] for n, seqs in self.splits)

    def then(self, split: Split) -> Floors:
        """These floors and ``split``'s, without the earlier splits that ``split`` makes
        redundant (every floor of theirs at or below its lowest seq)."""
        lowest = min(split[1])
        kept = tuple(s for s in self.splits if max(s[1]) > lowest)
        return Floors((*kept, split))


class OnlineMove(NamedTuple):
    """One (producer, stream) of a group moved to another split while it runs."""

    producer_id: str
    stream: str
    seq: int  # where the new shares start: the lowest of the old shares' positions
    epoch: int
    endpoint: str
    old: tuple[str, ...]
    new: tuple[str, ...]
    floors: Floors


def plan_online(
    consumer: str,
    before: int,
    shares: int,
    rows: Iterable[StoredPosition],
    floors: dict[tuple[str, str], Floors],
) -> list[OnlineMove]:
    """The moves of group ``consumer`` from ``before`` shares to ``shares``, whatever
    seqs its shares stand at; ``floors``: those stored, by (producer id, stream)."""
    if not 1 <= shares <= MAX_SHARES:
        raise ReshareRefusedError(f"shares must be between 1 and {MAX_SHARES}, not {shares}")
    if shares == before:
        raise ReshareRefusedError(f"consumer group {consumer!r} is split into {shares} already")
    old = names_for(consumer, before)
    groups: dict[tuple[str, str], dict[str, StoredPosition]] = defaultdict(dict)
    for row in rows:
        if row.consumer in old:
            groups[row.producer_id, row.stream][row.consumer] = row
    moves = []
    for (producer_id, stream), found in sorted(groups.items()):
        missing = [name for name in old if name not in found]
        if missing:
            raise ReshareRefusedError(
                f"stream {stream!r} from producer {producer_id}: shares {missing} of consumer "
                f"group {consumer!r} have no position yet (a share that never committed has "
                "none): let the group run until every share has applied something (a quiet "
                "share stores its position as the stream moves on), then reshare"
            )
        seqs = tuple(found[name].seq for name in old)
        now = floors.get((producer_id, stream), Floors(())).then((before, seqs))
        epoch = max(row.epoch for row in found.values())
        endpoint = found[old[0]].endpoint
        new = names_for(consumer, shares)
        moves.append(OnlineMove(producer_id, stream, min(seqs), epoch, endpoint, old, new, now))
    return moves
