"""Retention: which old records a producer deletes, and whom that costs records.

Three rules, as in Kafka plus one: records older than ``ms`` go, and the oldest go
while a stream holds more than ``bytes`` (both caps, per producer or per stream);
and on a stream with registered consumers, records every one of them has applied go.
Nothing a registered consumer has not applied is deleted unless a cap forces it; then
the records it loses are counted here, and the consumer itself gets the gone-seqs
error (``OFFSET_OUT_OF_RANGE``) if it asks for them. Every step reads only what it
deletes or what was committed since the previous pass, never the whole stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .committed_log import Stream
from .consumer_positions import Position
from .storage import NO_LIMITS, Writer
from .transactions import Transaction, transaction
from .writing import Writing

logger = logging.getLogger("streamq.producer")


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """Caps on a stream's records: by age in milliseconds, by stored bytes. None: no cap."""

    ms: int | None = None
    bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("ms", "bytes"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 0):
                raise ValueError(f"retention {name} must be a non-negative int or None: {value!r}")


@dataclass(frozen=True, slots=True)
class Truncation:
    """What one retention pass deleted from one stream."""

    stream: str
    low: int  # the first seq still held
    deleted: int  # records deleted by this pass
    lost: dict[str, int]  # registered consumer -> records deleted before it applied them


@dataclass(frozen=True, slots=True)
class _Plan:
    before: int
    lost: dict[str, int]
    size_after: int | None


class Retention:
    """The policies of one producer, and the stream sizes it keeps track of."""

    def __init__(self, default: RetentionPolicy) -> None:
        self.default = default
        self.per_stream: dict[str, RetentionPolicy] = {}
        # Counts are kept while the stream's low and compaction point stay: a stream that
        # lost records retention did not delete (compaction, here or in another process)
        # is counted anew.
        # stream -> (low, compacted, head, bytes)
        self._sizes: dict[str, tuple[int, int, int, int]] = {}
        # (consumer, stream) -> (compacted, first seq, end, bytes) of what it has not applied
        self._held: dict[tuple[str, str], tuple[int, int, int, int]] = {}

    def policy(self, stream: str) -> RetentionPolicy:
        return self.per_stream.get(stream, self.default)

    async def _size(self, writer: Writer, stream: Stream) -> int:
        """Bytes held in ``[low, head]``: the last pass's count plus what came since."""
        cached = self._sizes.get(stream.name)
        if cached is not None and cached[:2] == (stream.low, stream.compacted):
            _, _, head, size = cached
            if head <= stream.head:
                return size + await writer.bytes_between(stream.id, head + 1, stream.head + 1)
        return await writer.bytes_between(stream.id, stream.low, stream.head + 1)

    async def plan(
        self, writer: Writer, stream: Stream, registered: list[Position], now_ms: int
    ) -> _Plan:
        """Where ``stream`` should start now, read inside the caller's transaction."""
        low, end = stream.low, stream.head + 1
        policy = self.policy(stream.name)
        forced = low  # what the caps delete, needed or not
        if policy.ms is not None:
            since = now_ms - policy.ms
            forced = max(forced, await writer.first_seq_since(stream.id, low, end, since))
        size = dropped_at = dropped = None
        if policy.bytes is not None:
            size = await self._size(writer, stream)
            if size > policy.bytes:
                dropped_at, dropped = await writer.seq_after_bytes(
                    stream.id, low, end, size - policy.bytes
                )
                forced = max(forced, dropped_at)
        before = forced
        if registered:  # keep until every registered consumer has applied
            before = max(before, min(min(p.applied for p in registered) + 1, end))
        lost = {
            p.consumer: forced - max(low, p.applied + 1)
            for p in registered
            if max(low, p.applied + 1) < forced
        }
        size_after = None
        if size is not None:
            if before == dropped_at and dropped is not None:
                size_after = size - dropped
            else:
                size_after = size - await writer.bytes_between(stream.id, low, before)
        return _Plan(before, lost, size_after)

    async def held(self, writer: Writer, stream: Stream, position: Position) -> int:
        """Bytes of ``stream``'s records that ``position``'s consumer has not applied.
        Counted once, then only what was committed since, while its position stays."""
        start, end = max(stream.low, position.applied + 1), stream.head + 1
        key = (position.consumer, position.stream)
        cached = self._held.get(key)
        if cached is not None and cached[:2] == (stream.compacted, start) and cached[2] <= end:
            held = cached[3] + await writer.bytes_between(stream.id, cached[2], end)
        else:
            held = await writer.bytes_between(stream.id, start, end)
        self._held[key] = (stream.compacted, start, end, held)
        return held

    def committed(self, stream: Stream, head: int, size_after: int | None) -> None:
        """The plan for ``stream`` was carried out at ``head``."""
        if size_after is None:
            self._sizes.pop(stream.name, None)
        else:
            self._sizes[stream.name] = (stream.low, stream.compacted, head, size_after)


class RetentionPasses:
    """A producer's retention passes: ``apply`` on request and every ``interval`` seconds.

    A pass, in one transaction: drop the registrations past their limits, delete from
    each stream what ``Retention`` plans, and save the consumers' reported positions.
    """

    def __init__(
        self,
        writing: Writing,
        retention: Retention,
        connected: Callable[[str, str], bool],
        interval: float,
    ) -> None:
        self._writing = writing
        self._retention = retention
        self._connected = connected  # (consumer, stream): it has a subscription open now
        self.interval = interval
        self.registrations_dropped = 0  # by their limits (register_consumer)

    async def apply(self) -> list[Truncation]:
        """``Producer.apply_retention``."""
        writing = self._writing
        positions, retention, writer = writing.positions, self._retention, writing.writer
        now = int(time.time() * 1000)
        unsaved, forgotten = positions.unsaved(), positions.forgotten()
        done: list[Truncation] = []
        capped = retention.default != RetentionPolicy() or retention.per_stream
        if not (capped or unsaved or forgotten or any(p.registered for p in positions.all())):
            return done  # nothing to delete, nothing to save: no transaction
        plans: list[tuple[Stream, int, int, Any]] = []  # stream, its low before, head, plan
        dropped: list[tuple[Position, str]] = []
        tx: Transaction | None = None
        try:
            async with transaction(writing) as tx:
                dropped = await self._drop_stale_registrations(now)
                for stream in list(writing.log.streams.values()):
                    registered = positions.registered(stream.name)
                    plan = await retention.plan(writer, stream, registered, now)
                    plans.append((stream, stream.low, stream.head, plan))
                    if plan.before > stream.low:
                        await writer.truncate(stream.id, plan.before)
                        stream.low = plan.before  # before COMMIT, as in truncate
                await writer.save_positions(unsaved, forgotten)
        except BaseException:
            if tx is None or not tx.committed:
                for stream, low, _, _ in plans:
                    stream.low = low
                for position, _ in dropped:
                    position.registered = True  # not dropped after all
            raise
        for position, reason in dropped:
            positions.unregister(position.consumer, position.stream)
            position.dropped = reason
            self.registrations_dropped += 1
            logger.warning(
                "dropped the registration of consumer %r on %r: %s; retention no longer "
                "keeps its records",
                position.consumer,
                position.stream,
                reason,
            )
        positions.mark_saved(unsaved, forgotten)
        for stream, low, head, plan in plans:
            deleted = max(0, plan.before - low)
            retention.committed(stream, head, plan.size_after)
            if deleted > 0:
                done.append(Truncation(stream.name, stream.low, deleted, plan.lost))
            for consumer, count in plan.lost.items():
                positions.lost(consumer, stream.name, count)
                logger.warning(
                    "retention deleted %d record(s) of %r before registered consumer %r "
                    "applied them (first held is now %d)",
                    count,
                    stream.name,
                    consumer,
                    stream.low,
                )
        return done

    async def _drop_stale_registrations(self, now_ms: int) -> list[tuple[Position, str]]:
        """In the pass's transaction: delete the registrations past their limits; each
        with why. They stop holding records back in this very pass."""
        writing = self._writing
        writer = writing.writer
        dropped = []
        for position in writing.positions.all():
            limits, stream = position.limits, writing.log.streams.get(position.stream)
            if not position.registered or limits == NO_LIMITS or stream is None:
                continue
            reason = ""
            away_ms = now_ms - position.updated_at * 1000
            if (
                limits.max_idle_ms is not None
                and away_ms > limits.max_idle_ms
                and not self._connected(position.consumer, position.stream)
            ):
                reason = (
                    f"not connected and silent for {away_ms / 1000:.0f} s, over its "
                    f"max_idle_ms={limits.max_idle_ms}"
                )
            elif limits.max_bytes is not None:
                held = await self._retention.held(writer, stream, position)
                if held > limits.max_bytes:
                    reason = (
                        f"{held} bytes of records it has not applied, over its "
                        f"max_bytes={limits.max_bytes}"
                    )
            if reason:
                await writer.unregister_consumer(position.consumer, position.stream)
                position.registered = False  # this pass plans without it
                dropped.append((position, reason))
        return dropped

    async def run(self) -> None:
        """A pass every ``interval`` seconds, for ever; a failed one is logged."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.apply()
            except Exception:
                logger.exception("retention pass failed; trying again next interval")
