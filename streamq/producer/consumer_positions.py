"""What each consumer has durably applied, as its producer knows it.

Consumers report their position on the connection they already have (``ACK`` on a
subscription, ``REPORT_POSITION`` from Spark queries); the server feeds every report
here. From these positions come lag (head - applied), ``Producer.wait_applied`` (a
future per waiter, resolved by the report that reaches its seq: no polling) and
retention that keeps what a registered consumer still needs, up to its registration's
limits. Pure bookkeeping: no sockets, no SQL; the producer loads and saves registrations
and every reported position through its storage (at most about once a second), so a
consumer that is down when the producer restarts still shows, with its lag, until it is
forgotten: removed (``Producer.forget_consumer``), not heard of for
``ServerSettings.position_expiry``, or under a split into shares it left (``resplit``).

A share of a split (a position named ``billing[2/6]``) owes only its keys' records: its
lag counts those, from the records held in memory (``share_lags``), where they are all
there and at most ``SHARE_LAG_LIMIT``; beyond, it is head - applied, an upper bound, and
``ConsumerLag.exact`` says so. So it does for a consumer whose filter has a key prefix or
headers (the producer does not count what they pass), and for one not subscribed now
(``Connected``): it may have committed more since its last report (a consumer killed
between its commit and its ACK), so its figures are as of that report.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from ..filters import share_of, shared_as
from ..protocol import record_key
from .storage import NO_LIMITS, ConsumerRow, KnownPosition, Limits

if TYPE_CHECKING:
    from .committed_log import Stream

Key = tuple[str, str]  # (consumer name, stream name)
MAX_UNREGISTERED = 1024  # positions of unregistered consumers kept (and stored), the most recent


@dataclass(eq=False, slots=True)
class Position:
    """One consumer's durable position on one stream."""

    consumer: str
    stream: str
    applied: int = 0  # every seq up to this one is applied and committed by the consumer
    updated_at: float = 0.0  # when it was last reported (Unix seconds; 0: never)
    registered: bool = False  # retention keeps what it has not applied
    saved: int = 0  # the applied seq last written to the producer's database
    saved_at_ms: int = 0  # the updated_at last written there (milliseconds)
    stored: bool = False  # a row of the producer's database holds it
    lost: int = 0  # records retention deleted before this consumer applied them
    limits: Limits = NO_LIMITS  # when its registration is dropped
    dropped: str = ""  # why a limit dropped its registration, if one did


class ConsumerLag(NamedTuple):
    """A consumer's position on a stream and how far behind the head it is."""

    consumer: str
    stream: str
    applied: int
    head: int
    lag: int  # head - applied: records committed and not yet applied by this consumer
    registered: bool
    lost: int  # records retention deleted before this consumer applied them
    updated_at: float  # when it last reported (Unix seconds; 0: never)
    max_idle_ms: int | None  # its registration's limits (None: none)
    max_bytes: int | None
    dropped: str  # why a limit dropped its registration ("": none did)
    # False: ``lag`` is an upper bound: head - applied, more than a share or a filtered
    # consumer owes (``share_lags``), or as of its last report (not ``connected``).
    exact: bool = True
    # Subscribed now: ``applied`` is current (an ACK follows each commit). False:
    # ``applied`` and ``lag`` are as of its last report (``updated_at``).
    connected: bool = False


# Records a share's lag is counted over at most, one pass per stream and split each time
# lags are read: beyond, head - applied stands in (``ConsumerLag.exact`` False).
SHARE_LAG_LIMIT = 10_000


@dataclass(frozen=True, slots=True)
class Connected:
    """The consumers subscribed now (consumer, stream), as lag reads them: their positions
    are current. ``narrowed``: those of them whose filter has a key prefix or headers,
    whose records the producer does not count (their lag is head - applied)."""

    keys: frozenset[Key] = frozenset()
    narrowed: frozenset[Key] = frozenset()


NOBODY = Connected()


def split_of(name: str) -> tuple[int, int] | None:
    """(index, count) if ``name`` is a share's position name (``billing[2/6]``)."""
    base, bracket, _ = name.rpartition("[")
    return shared_as(base, name) if bracket else None


def share_lags(positions: Sequence[Position], streams: Mapping[str, Stream]) -> dict[Key, int]:
    """The exact lag of each share among ``positions`` whose records after its position
    are all held in memory, at most ``SHARE_LAG_LIMIT``: how many of them are its keys'
    (the records the producer sends it)."""
    asked: dict[tuple[str, int], list[tuple[Key, int, int]]] = {}
    for p in positions:
        split, stream = split_of(p.consumer), streams.get(p.stream)
        if split is None or stream is None or not 0 < stream.head - p.applied <= SHARE_LAG_LIMIT:
            continue
        ask = ((p.consumer, p.stream), split[0], p.applied)
        asked.setdefault((p.stream, split[1]), []).append(ask)
    lags: dict[Key, int] = {}
    for (name, count), shares in asked.items():
        stream = streams[name]
        start = min(applied for _, _, applied in shares) + 1
        held = stream.tail.get(start, stream.head + 1, SHARE_LAG_LIMIT, 1 << 62)
        if held is None or len(held) != stream.head + 1 - start:
            continue  # some are on disk only: not counted here
        owner = [share_of(record_key(record), count) for record in held]
        for key, index, applied in shares:
            lags[key] = owner[applied + 1 - start :].count(index)
    return lags


class Positions:
    """Every known consumer position of one producer, and who waits for them."""

    def __init__(self) -> None:
        self._positions: dict[Key, Position] = {}
        # Waiters apart from positions: waiting for a name never heard of invents no consumer.
        self._waiters: dict[Key, list[tuple[int, asyncio.Future[int]]]] = {}
        # Stored positions forgotten here, their rows to delete at the next save.
        self._forgotten: set[Key] = set()

    def get(self, consumer: str, stream: str) -> Position | None:
        return self._positions.get((consumer, stream))

    def _entry(self, consumer: str, stream: str) -> Position:
        """The position, moved last: the dict's order is how recently each was touched."""
        key = (consumer, stream)
        position = self._positions.pop(key, None)
        if position is None:
            position = Position(consumer, stream)
            self._forgotten.discard(key)  # known again: its row is saved, not deleted
        self._positions[key] = position
        if len(self._positions) > MAX_UNREGISTERED:
            self._forget_oldest_unregistered()
        return position

    def _forget_oldest_unregistered(self) -> None:
        """Names come from peers: unique names must not grow memory, nor the database.
        Registered consumers and names someone waits for are kept; of the rest, the least
        recently reported go."""
        unregistered = [k for k, p in self._positions.items() if not p.registered]
        for key in unregistered[: max(0, len(unregistered) - MAX_UNREGISTERED)]:
            if key not in self._waiters:
                self.forget(*key)

    def forget(self, consumer: str, stream: str) -> Position | None:
        """Stop knowing the position (its row, if stored, is deleted at the next save
        unless it reports again first); the position forgotten, if there was one."""
        position = self._positions.pop((consumer, stream), None)
        if position is not None and position.stored:
            self._forgotten.add((consumer, stream))
        return position

    def other_splits(self, consumer: str, stream: str, shares: int) -> list[Position]:
        """Positions of ``consumer`` on ``stream`` under another split into shares than
        ``shares`` (1: unshared, the plain name): ``billing[0/3]`` when it now reads as
        ``billing[i/2]`` or as ``billing``; ``billing`` when it reads as shares."""
        found = []
        for p in self.all():
            if p.stream != stream or not p.consumer.startswith(consumer):
                continue
            share = (0, 1) if p.consumer == consumer else shared_as(consumer, p.consumer)
            if share is not None and share[1] != shares:
                found.append(p)
        return found

    def expire(self, before: float, keep: Callable[[Position], bool]) -> list[Position]:
        """Forget the unregistered positions last reported before ``before`` (Unix time),
        but those ``keep`` keeps (a consumer still connected) and those someone waits for."""
        expired = [
            p
            for p in self.all()
            if not p.registered
            and p.updated_at < before
            and (p.consumer, p.stream) not in self._waiters
            and not keep(p)
        ]
        for p in expired:
            self.forget(p.consumer, p.stream)
        return expired

    def all(self) -> list[Position]:
        """A snapshot, safe to iterate while reports arrive (e.g. from a metrics thread)."""
        return list(self._positions.values())

    def registered(self, stream: str) -> list[Position]:
        return [p for p in self.all() if p.registered and p.stream == stream]

    def report(self, consumer: str, stream: str, seq: int) -> None:
        """``consumer`` has applied ``stream`` up to ``seq``; positions only move forward."""
        position = self._entry(consumer, stream)
        position.updated_at = time.time()
        if seq <= position.applied:
            return
        position.applied = seq
        self._resolve(position)

    def _resolve(self, position: Position) -> None:
        """Wake those waiting for a seq ``position`` has reached."""
        waiters = self._waiters.get((position.consumer, position.stream))
        if waiters:
            for target, future in waiters:
                if target <= position.applied and not future.done():
                    future.set_result(position.applied)
            waiters[:] = [w for w in waiters if not w[1].done()]

    def register(
        self,
        consumer: str,
        stream: str,
        applied: int = 0,
        limits: Limits = NO_LIMITS,
        seen_at: float = 0.0,
    ) -> Position:
        """Make retention keep what ``consumer`` has not applied; ``applied`` as stored,
        ``seen_at`` when it was last heard of (its limits' idle time counts from then)."""
        position = self._entry(consumer, stream)
        position.registered = True
        position.applied = max(position.applied, applied)
        position.saved = max(position.saved, applied)
        position.limits = limits
        position.dropped = ""
        position.updated_at = max(position.updated_at, seen_at)
        position.saved_at_ms = max(position.saved_at_ms, int(seen_at * 1000))
        position.stored = True
        self._resolve(position)
        return position

    def known(self, consumer: str, stream: str, applied: int, seen_at: float) -> None:
        """A position stored unregistered (``seen_at``: when it was reported); one being
        deleted stays forgotten, a known one moves forward only."""
        key = (consumer, stream)
        if key in self._forgotten:
            return
        position = self._positions.get(key) or self._entry(consumer, stream)
        position.applied = max(position.applied, applied)
        position.saved = max(position.saved, applied)
        position.updated_at = max(position.updated_at, seen_at)
        position.saved_at_ms = max(position.saved_at_ms, int(seen_at * 1000))
        position.stored = True
        self._resolve(position)

    def unstored(self, consumer: str, stream: str) -> None:
        """Its row is gone (another process forgot it): forgotten here too, unless it
        reported since it was saved; then it is saved again, as a new row."""
        position = self._positions.get((consumer, stream))
        if position is None:
            return
        if _unsaved(position):
            position.stored, position.saved, position.saved_at_ms = False, 0, 0
        else:
            del self._positions[(consumer, stream)]

    def unregister(self, consumer: str, stream: str) -> None:
        """As ``Writer.unregister_consumer``: a consumer that applied nothing has no row left."""
        position = self._positions.get((consumer, stream))
        if position is not None:
            position.registered = False
            if position.applied == 0:
                position.stored, position.saved, position.saved_at_ms = False, 0, 0

    def lost(self, consumer: str, stream: str, count: int) -> None:
        self._entry(consumer, stream).lost += count

    def apply_rows(self, rows: list[ConsumerRow]) -> None:
        """Registrations and known positions as stored, which other processes may change
        (the CLI): a row gone is a registration removed, or a position forgotten."""
        stored = {(row.consumer, row.stream): row for row in rows}
        for position in self.all():
            key = (position.consumer, position.stream)
            row = stored.get(key)
            if position.registered and (row is None or not row.registered):
                self.unregister(*key)
            if row is None and position.stored:
                self.unstored(*key)
        for row in rows:
            seen_at = row.updated_at_ms / 1000
            if row.registered:
                self.register(row.consumer, row.stream, row.applied, row.limits, seen_at)
            else:
                self.known(row.consumer, row.stream, row.applied, seen_at)

    def unsaved(self) -> list[KnownPosition]:
        """Positions reported since they were last saved: registered consumers', and
        those of unregistered ones that applied something."""
        return [
            KnownPosition(p.consumer, p.stream, p.applied, int(p.updated_at * 1000))
            for p in self.all()
            if _unsaved(p)
        ]

    def forgotten(self) -> list[Key]:
        """Stored positions forgotten since the last save: their rows to delete."""
        return sorted(self._forgotten)

    def mark_saved(self, saved: Sequence[KnownPosition], deleted: Sequence[Key] = ()) -> None:
        for consumer, stream, applied, updated_at_ms in saved:
            position = self._positions.get((consumer, stream))
            if position is not None:
                position.saved = max(position.saved, applied)
                position.saved_at_ms = max(position.saved_at_ms, updated_at_ms)
                position.stored = True
        self._forgotten.difference_update(deleted)

    def lags(self, streams: Mapping[str, Stream], now: Connected = NOBODY) -> list[ConsumerLag]:
        """Every position with the lag behind its stream's head (0 for an unknown stream):
        the records after it, or for a share, those of its keys (``share_lags``); exact
        only where it is 0, or counted for a consumer connected ``now``."""
        positions = self.all()
        counted = share_lags(positions, streams)
        result = []
        for p in positions:
            key = (p.consumer, p.stream)
            stream = streams.get(p.stream)
            head = stream.head if stream is not None else 0
            lag = counted.get(key, max(0, head - p.applied))
            connected = key in now.keys
            whole = key in counted or split_of(p.consumer) is None
            exact = not lag or (connected and whole and key not in now.narrowed)
            result.append(
                ConsumerLag(
                    p.consumer,
                    p.stream,
                    p.applied,
                    head,
                    lag,
                    p.registered,
                    p.lost,
                    p.updated_at,
                    p.limits.max_idle_ms,
                    p.limits.max_bytes,
                    p.dropped,
                    exact,
                    connected,
                )
            )
        return result

    async def wait(self, consumer: str, stream: str, seq: int) -> int:
        """Wait until ``consumer`` reports ``stream`` applied up to ``seq``; its position."""
        key = (consumer, stream)
        position = self._positions.get(key)
        applied = 0 if position is None else position.applied
        if applied >= seq:
            return applied
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(key, []).append((seq, future))
        try:
            return await future
        finally:  # resolved, cancelled or timed out: no longer a waiter
            waiters = [w for w in self._waiters.get(key, ()) if w[1] is not future]
            if waiters:
                self._waiters[key] = waiters
            else:
                self._waiters.pop(key, None)

    def waiting(self) -> int:
        """How many waits are pending (for tests and status)."""
        return sum(map(len, self._waiters.values()))


def _unsaved(p: Position) -> bool:
    """Reported since it was last saved, and worth a row: registered, or applied something."""
    if not (p.registered or p.applied > 0):
        return False
    return not p.stored or p.applied > p.saved or int(p.updated_at * 1000) > p.saved_at_ms
