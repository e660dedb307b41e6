"""What each consumer has durably applied, as its producer knows it.

Consumers report their position on the connection they already have (``ACK`` on a
subscription, ``REPORT_POSITION`` from Spark queries); the server feeds every report
here. From these positions come lag (head - applied), ``Producer.wait_applied`` (a
future per waiter, resolved by the report that reaches its seq: no polling) and
retention that keeps what a registered consumer still needs, up to its registration's
limits. Pure bookkeeping: no sockets, no SQL; the producer loads and saves registrations
through its storage.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from .storage import NO_LIMITS, Limits

if TYPE_CHECKING:
    from .log import Stream

Key = tuple[str, str]  # (consumer name, stream name)
MAX_UNREGISTERED = 1024  # positions of unregistered consumers kept, the most recent


@dataclass(eq=False, slots=True)
class Position:
    """One consumer's durable position on one stream."""

    consumer: str
    stream: str
    applied: int = 0  # every seq up to this one is applied and committed by the consumer
    updated_at: float = 0.0  # when it was last reported (Unix seconds; 0: never)
    registered: bool = False  # retention keeps what it has not applied
    saved: int = 0  # the applied seq last written to the producer's database
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


class Positions:
    """Every known consumer position of one producer, and who waits for them."""

    def __init__(self) -> None:
        self._positions: dict[Key, Position] = {}
        # Waiters apart from positions: waiting for a name never heard of invents no consumer.
        self._waiters: dict[Key, list[tuple[int, asyncio.Future[int]]]] = {}

    def get(self, consumer: str, stream: str) -> Position | None:
        return self._positions.get((consumer, stream))

    def _entry(self, consumer: str, stream: str) -> Position:
        """The position, moved last: the dict's order is how recently each was touched."""
        key = (consumer, stream)
        position = self._positions.pop(key, None)
        self._positions[key] = position = position or Position(consumer, stream)
        if len(self._positions) > MAX_UNREGISTERED:
            self._forget_oldest_unregistered()
        return position

    def _forget_oldest_unregistered(self) -> None:
        """Names come from peers: unique names must not grow memory. Registered consumers
        and names someone waits for are kept; of the rest, the least recently reported go."""
        unregistered = [k for k, p in self._positions.items() if not p.registered]
        for key in unregistered[: max(0, len(unregistered) - MAX_UNREGISTERED)]:
            if key not in self._waiters:
                del self._positions[key]

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
        waiters = self._waiters.get((consumer, stream))
        if waiters:
            for target, future in waiters:
                if target <= seq and not future.done():
                    future.set_result(seq)
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
        return position

    def unregister(self, consumer: str, stream: str) -> None:
        position = self._positions.get((consumer, stream))
        if position is not None:
            position.registered = False
            position.saved = 0

    def lost(self, consumer: str, stream: str, count: int) -> None:
        self._entry(consumer, stream).lost += count

    def unsaved(self) -> list[tuple[str, str, int]]:
        """Registered consumers' positions reported since they were last saved."""
        return [
            (p.consumer, p.stream, p.applied)
            for p in self.all()
            if p.registered and p.applied > p.saved
        ]

    def mark_saved(self, saved: list[tuple[str, str, int]]) -> None:
        for consumer, stream, applied in saved:
            position = self._entry(consumer, stream)
            position.saved = max(position.saved, applied)

    def lags(self, streams: Mapping[str, Stream]) -> list[ConsumerLag]:
        """Every position with the lag behind its stream's head (0 for an unknown stream)."""
        result = []
        for p in self.all():
            stream = streams.get(p.stream)
            head = stream.head if stream is not None else 0
            result.append(
                ConsumerLag(
                    p.consumer,
                    p.stream,
                    p.applied,
                    head,
                    max(0, head - p.applied),
                    p.registered,
                    p.lost,
                    p.updated_at,
                    p.limits.max_idle_ms,
                    p.limits.max_bytes,
                    p.dropped,
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
