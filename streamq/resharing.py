"""Changing how many shares a consumer's stream is split into, safely.

Each share's position counts only its own keys, so positions taken under one split mean
nothing under another, except when every share of the old split stands at the same seq:
then every record up to that seq is applied, whatever its key, and none after it. So
``streamq reshare`` moves a consumer to a new split only from there, in one transaction
on the consumer's database: the old split's rows are deleted and the new split's rows
written at that seq. Workers still running with the old split find their row gone and
stop (``OutOfOrderBatchError``); workers of the new split start where the old ones
stopped. This module plans the change from the stored rows; each engine runs its SQL.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import NamedTuple

from .errors import StreamQError
from .filters import MAX_SHARES, share_name, shared_as


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


def names_for(consumer: str, shares: int) -> tuple[str, ...]:
    """The position names of a split into ``shares`` (1: the consumer's own name)."""
    if shares == 1:
        return (consumer,)
    return tuple(share_name(consumer, (i, shares)) for i in range(shares))


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
