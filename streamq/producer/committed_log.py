"""The committed log as its readers see it: heads, recent records, wake-ups.

The producer calls ``Log.committed`` after each COMMIT; subscribers and range
requests call ``Log.read`` and ``Log.wait``. Recently committed records stay in
memory (``TailBuffer``), so consumers that keep up are served without touching
the database; anyone further behind reads from it through the storage's small pool
of read-only connections (``storage.Reader``).
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..errors import OffsetOutOfRangeError, UnknownStreamError
from ..protocol import StreamInfo, numbered_records, record_key, split_records
from .storage import Run, Storage, StreamRow, StreamSettings


def take(records: Sequence[bytes], max_records: int, max_bytes: int) -> Sequence[bytes]:
    """The longest prefix within both limits, never less than one record."""
    if len(records) > max_records:
        records = records[:max_records]
    total = 0
    for i, record in enumerate(records):
        total += len(record)
        if total > max_bytes:
            return records[: max(i, 1)]
    return records


@dataclass(frozen=True, slots=True)
class Packed:
    """``count`` records' encodings in ``parts``, each part one record or several back to
    back, as the log holds them: a RECORDS frame joins the parts as they are, with no
    step per record (``protocol.records_frame``'s ``count``)."""

    parts: Sequence[bytes]
    count: int

    @classmethod
    def of(cls, records: Sequence[bytes]) -> Packed:
        """Records one by one: a part each."""
        return cls(records, len(records))

    def records(self) -> Sequence[bytes]:
        """One encoding per record (for what looks at each one: filters)."""
        if len(self.parts) == self.count:
            return self.parts
        return split_records(b"".join(self.parts), self.count)


NOTHING = Packed((), 0)


def take_runs(runs: Sequence[Run], max_records: int, max_bytes: int) -> tuple[Packed, int]:
    """``take`` for runs (not empty): whole runs while both limits allow, then the records
    of the next one that still fit, never less than one record; and the last seq taken."""
    parts: list[bytes] = []
    count = size = 0
    last = runs[0][0] - 1
    for first, n, data in runs:
        if count + n <= max_records and size + len(data) <= max_bytes:
            parts.append(data)
            count, size, last = count + n, size + len(data), first + n - 1
            continue
        for i, record in enumerate(split_records(data, n)):
            if count and (count == max_records or size + len(record) > max_bytes):
                break
            parts.append(record)
            count, size, last = count + 1, size + len(record), first + i
        break
    return Packed(parts, count), last


# What holding one record in memory costs beyond its bytes: the bytes object's header
# and its list slot. Counted so that ``tail_bytes`` bounds real memory.
RECORD_OVERHEAD = 48


def memory_cost(records: Sequence[bytes]) -> int:
    return sum(map(len, records)) + RECORD_OVERHEAD * len(records)


class TailBuffer:
    """A stream's most recently committed records, encoded, bounded in memory.

    It holds a contiguous run of seqs ending at the head; anything older is
    evicted first. Evicted records are still in SQLite. Evicting moves a start
    index; the list drops its dead front only once that is half of it, so a commit
    costs its own records, not a shift of everything held.
    """

    def __init__(self, max_bytes: int, next_seq: int) -> None:
        self.max_bytes = max_bytes
        self._records: list[bytes] = []
        self._dead = 0  # evicted records still at the front of ``_records``
        self._first_seq = next_seq  # of ``_records[_dead]``
        self._nbytes = 0

    @property
    def first_seq(self) -> int:
        return self._first_seq

    def reset(self, next_seq: int) -> None:
        """Forget everything: the next append starts at ``next_seq``."""
        self._records = []
        self._dead = 0
        self._first_seq = next_seq
        self._nbytes = 0

    def append(self, first_seq: int, records: Sequence[bytes]) -> None:
        if first_seq != self._first_seq + len(self._records) - self._dead:
            self.reset(first_seq)
        self._records.extend(records)
        self._nbytes += memory_cost(records)
        if self._nbytes > self.max_bytes:
            held, dead = self._records, self._dead
            while self._nbytes > self.max_bytes:
                self._nbytes -= len(held[dead]) + RECORD_OVERHEAD
                dead += 1
            self._first_seq += dead - self._dead
            if dead > len(held) // 2:
                del held[:dead]
                dead = 0
            self._dead = dead

    def get(self, seq: int, end: int, max_records: int, max_bytes: int) -> Sequence[bytes] | None:
        """Records from ``seq`` (up to ``end``, exclusive), or None if not held here."""
        i = seq - self._first_seq
        if i < 0 or i >= len(self._records) - self._dead:
            return None
        count = min(max_records, end - seq)
        i += self._dead
        return take(self._records[i : i + count], count, max_bytes)


class Epochs:
    """Which producer instance (epoch) appended which seqs of a stream: the rows of
    ``streamq_epochs`` ("Epochs" in docs/protocol.md). Epoch 0 means unknown: records
    written before epochs were recorded."""

    def __init__(self) -> None:
        self._firsts: list[int] = []
        self._epochs: list[int] = []

    def add(self, first_seq: int, epoch: int) -> None:
        """Seqs from ``first_seq`` on were appended by ``epoch``. Rows come in seq order,
        but for another process's, learnt after this producer's own (PostgreSQL)."""
        if not self._firsts or first_seq > self._firsts[-1]:
            self._firsts.append(first_seq)
            self._epochs.append(epoch)
            return
        i = bisect.bisect_left(self._firsts, first_seq)
        if self._firsts[i] != first_seq:
            self._firsts.insert(i, first_seq)
            self._epochs.insert(i, epoch)

    @property
    def last_epoch(self) -> int | None:
        """The epoch of the last segment; None before any."""
        return self._epochs[-1] if self._epochs else None

    @property
    def last_first_seq(self) -> int:
        return self._firsts[-1] if self._firsts else 0

    def epoch_of(self, seq: int) -> int:
        """The epoch that appended ``seq``; 0 if unknown."""
        i = bisect.bisect_right(self._firsts, seq) - 1
        return self._epochs[i] if i >= 0 else 0

    def segment_end(self, seq: int) -> int:
        """The first seq after ``seq`` appended by another epoch than ``seq`` (or a huge seq)."""
        i = bisect.bisect_right(self._firsts, seq)
        return self._firsts[i] if i < len(self._firsts) else 1 << 63

    def vouch(self, position: int, head: int, seen_epoch: int) -> tuple[int, int]:
        """SUBSCRIBED's (after_epoch, rewritten_from) for a client that read up to
        ``position`` records written by epochs up to ``seen_epoch`` (0: unknown).

        A power loss removes a suffix of the log, and every producer started after it has a
        higher epoch than any started before it, so than any epoch that wrote what the
        client read. The segments written by higher epochs than ``seen_epoch``, ending with
        the one holding ``position`` (or the head, if lower), are therefore the seqs
        written again after the loss: the client's records there are gone.
        """
        after_epoch = self.epoch_of(position) if 0 < position <= head else 0
        if not position or not seen_epoch:
            return after_epoch, 0
        i = bisect.bisect_right(self._firsts, min(position, head)) - 1
        if i < 0 or self._epochs[i] <= seen_epoch:
            return after_epoch, 0
        while i > 0 and self._epochs[i - 1] > seen_epoch:
            i -= 1
        return after_epoch, self._firsts[i]


@dataclass(eq=False)
class Stream:
    """A stream's committed state, shared by the producer and its readers."""

    id: int
    name: str
    head: int
    low: int
    tail: TailBuffer
    settings: StreamSettings = field(default_factory=StreamSettings)
    max_ts: int | None = None  # largest timestamp committed so far (the time index's top)
    compacted: int = 0  # compaction ran up to this seq: seqs from low to it may be absent
    epochs: Epochs = field(default_factory=Epochs)
    # The waits for the next commit: futures, True once it came, False when time is up (a
    # dict: ordered, and a wait leaves it in O(1)).
    _waiters: dict[asyncio.Future[bool], None] = field(default_factory=dict)
    _loop: asyncio.AbstractEventLoop | None = None  # asked once: each ask is a system call
    waits: Waits | None = None  # its log's count of waits (``Log.add``)
    # Called after each commit, with the waits woken: its fan-out (``fanout.Fanout``).
    listeners: list[Callable[[], None]] = field(default_factory=list)

    def info(self) -> StreamInfo:
        """Its head and low, as the protocol answers them (STREAM_INFO)."""
        return StreamInfo(self.name, self.head, self.low)

    def notify(self) -> None:
        """Wake everyone waiting for a commit."""
        waiters, self._waiters = self._waiters, {}
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(True)
        for listener in self.listeners:
            listener()

    async def wait_beyond(self, seq: int, timeout: float) -> bool:
        """Wait until head > ``seq``; False if ``timeout`` passed first.

        A future and a timer per wait: this runs once per commit for every subscriber
        that is caught up, and an ``asyncio.Event`` under ``asyncio.timeout`` cost several
        times as much."""
        if self.head > seq:
            return True
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        waits = self.waits
        if waits is not None:
            waits.begin()
        try:
            while self.head <= seq:
                waiter: asyncio.Future[bool] = loop.create_future()
                self._waiters[waiter] = None
                timer = loop.call_at(deadline, _time_up, waiter)
                try:
                    if not await waiter:
                        return self.head > seq
                finally:
                    timer.cancel()
                    self._waiters.pop(waiter, None)
            return True
        finally:
            if waits is not None:
                waits.end()

    def on_beyond(self, seq: int, timeout: float, callback: Callable[[], None]) -> Beyond:
        """Call ``callback`` once head > ``seq`` or ``timeout`` has passed (not now: the
        caller checks the head first), with no task of its own: what a WATCH_HEAD waits
        with, so that hundreds of watching connections cost a future and a timer each."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return Beyond(self, loop, seq, loop.time() + timeout, callback)


class Beyond:
    """``Stream.on_beyond``'s wait; ``cancel`` ends it without calling anything."""

    __slots__ = ("_callback", "_loop", "_seq", "_stream", "_timer", "_waiter")

    def __init__(
        self,
        stream: Stream,
        loop: asyncio.AbstractEventLoop,
        seq: int,
        deadline: float,
        callback: Callable[[], None],
    ) -> None:
        self._stream, self._loop, self._seq, self._callback = stream, loop, seq, callback
        self._waiter: asyncio.Future[bool] | None = None
        self._timer = loop.call_at(deadline, self._done)
        if stream.waits is not None:
            stream.waits.begin()
        self._wait()

    def _wait(self) -> None:
        self._waiter = waiter = self._loop.create_future()
        self._stream._waiters[waiter] = None
        waiter.add_done_callback(self._woken)

    def _woken(self, waiter: asyncio.Future[bool]) -> None:
        if waiter is not self._waiter:
            return  # cancelled
        if self._stream.head <= self._seq:
            self._wait()  # a wake that did not reach the seq
        else:
            self._done()

    def _done(self) -> None:
        if self._waiter is not None:
            self.cancel()
            self._callback()

    def cancel(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is None:
            return
        self._timer.cancel()
        self._stream._waiters.pop(waiter, None)
        waiter.cancel()
        if self._stream.waits is not None:
            self._stream.waits.end()


class Waits:
    """How many waits for a commit are under way, over every stream of a log: read by
    the watcher (``commit_watcher.IDLE_CHECK``) and by a ``SyncProducer``'s threads, which wake
    the loop after a commit only if someone waits (an int: read safely from any thread)."""

    __slots__ = ("_began", "count")

    def __init__(self) -> None:
        self.count = 0
        self._began: asyncio.Future[None] | None = None

    def begin(self) -> None:
        self.count += 1
        if self._began is not None:
            _settle(self._began)

    def end(self) -> None:
        self.count -= 1

    async def until_one_begins(self, timeout: float) -> None:
        """Return once a wait begins, or ``timeout`` seconds from now."""
        loop = asyncio.get_running_loop()
        began = self._began = loop.create_future()
        timer = loop.call_later(timeout, _settle, began)
        try:
            await began
        finally:
            timer.cancel()
            self._began = None


def _time_up(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Log:
    """In-memory view of every stream, and reads served from memory or the database."""

    def __init__(self, storage: Storage, *, tail_bytes: int) -> None:
        self.storage = storage  # its readers serve what the tail no longer holds
        self.tail_bytes = tail_bytes
        self.streams: dict[str, Stream] = {}
        # Recent records' mean size: how many rows one SQLite read should fetch to fill
        # a frame without reading far more than it can send.
        self._avg_record_size = 1024
        self.waits = Waits()  # for a commit of any stream

    def add(self, row: StreamRow) -> Stream:
        stream = Stream(
            row.id,
            row.name,
            row.head,
            row.low,
            TailBuffer(self.tail_bytes, row.head + 1),
            row.settings,
            row.max_ts,
            row.compacted,
        )
        stream.waits = self.waits
        self.streams[row.name] = stream
        return stream

    def stream(self, name: str) -> Stream:
        try:
            return self.streams[name]
        except KeyError:
            raise UnknownStreamError(
                f"unknown stream {name!r}; this producer has "
                f"{sorted(self.streams) or 'no streams yet'}",
                {"stream": name},
            ) from None

    def committed(self, stream: Stream, head: int, records: Sequence[bytes] | None) -> None:
        """Records up to ``head`` were committed; ``records`` are the newest of them,
        or None if there were too many to keep in memory."""
        stream.head = head
        if records is None:
            stream.tail.reset(head + 1)
        elif records:
            stream.tail.append(head - len(records) + 1, records)
            sample = records[-16:]
            self._note_sizes(sum(map(len, sample)), len(sample))
        stream.notify()

    def _note_sizes(self, nbytes: int, count: int) -> None:
        """Records of ``nbytes`` in all were committed or read: the average record size
        that sizes reads from the database follows them."""
        self._avg_record_size = max(1, (self._avg_record_size + nbytes // count) // 2)

    def check_available(self, stream: Stream, seq: int) -> None:
        """Raise if records from ``seq`` on can no longer be read."""
        if seq < stream.low:
            gone = f"seq {seq}" if seq == stream.low - 1 else f"seqs {seq}..{stream.low - 1}"
            raise OffsetOutOfRangeError(
                f"stream {stream.name!r}: {gone} no longer held (retention); "
                f"first available is {stream.low}, head is {stream.head}",
                {"stream": stream.name, "requested": seq, "low": stream.low, "head": stream.head},
            )

    async def read(
        self, stream: Stream, seq: int, end: int, max_records: int, max_bytes: int
    ) -> tuple[Packed, int]:
        """Encoded records with ``seq <= s < min(end, head + 1)``, and the last seq read.

        Returns no records once caught up with the head, or, with a last seq at or
        beyond ``seq``, when compaction removed every record of ``[seq, end)``. Records
        read from the database come as stored: a part per row (``Packed``).
        """
        self.check_available(stream, seq)
        end = min(end, stream.head + 1)
        if seq >= end:
            return NOTHING, seq - 1
        records = stream.tail.get(seq, end, max_records, max_bytes)
        if records is not None:
            return Packed.of(records), seq + len(records) - 1
        limit = max(1, min(max_records, max_bytes // max(1, self._avg_record_size)))
        async with self.storage.reader() as reader:
            runs = await reader.read_runs(stream.id, seq, end, limit)
            first = runs[0][0] if runs else end
            low, compacted = stream.low, stream.compacted
            if first != seq and first - 1 > compacted:
                # Another process may have compacted (or truncated) before this one's watch
                # noticed: the database says which.
                low, compacted = await reader.low_and_compacted(stream.id)
        # Retention raises ``low`` before it commits (Producer.truncate): seqs it deleted
        # while this read ran are reported as lost, never taken for a compaction gap.
        self.check_available(stream, seq)
        if seq < low or (first != seq and first - 1 > compacted):  # deleted after the check
            raise OffsetOutOfRangeError(
                f"stream {stream.name!r}: seqs from {seq} were deleted while being read",
                {"stream": stream.name, "requested": seq, "low": low, "head": stream.head},
            )
        if not runs:  # compaction removed all of [seq, end)
            return NOTHING, end - 1
        packed, last = take_runs(runs, max_records, max_bytes)
        self._note_sizes(sum(map(len, packed.parts)), packed.count)
        return packed, last

    async def history(
        self, stream: Stream, key: bytes, seq: int, end: int, max_records: int, max_bytes: int
    ) -> tuple[Sequence[bytes], int]:
        """Encoded records of ``key`` with ``seq <= s < end`` (records still held), at most
        one frame's worth, and the seq to continue from (``end`` once done).

        Streams with ``key_index`` seek in the index; others are scanned (the same
        answer, at the cost of reading every record of the range).
        """
        seq = max(seq, stream.low)
        if seq >= end:
            return (), end
        async with self.storage.reader() as reader:
            if stream.settings.key_index:
                rows = await reader.read_key_records(stream.id, key, seq, end, max_records)
                scanned_to = rows[-1][0] if len(rows) == max_records else end - 1
            else:
                limit = max(1, max_bytes // max(1, self._avg_record_size))
                runs = await reader.read_runs(stream.id, seq, end, limit)
                rows = [pair for run in runs for pair in numbered_records(*run)]
                scanned_to = rows[-1][0] if len(rows) >= limit else end - 1
                rows = [(s, record) for s, record in rows if record_key(record) == key]
        records = take([record for _, record in rows], max_records, max_bytes)
        if len(records) < len(rows):
            return records, rows[len(records)][0]
        return records, scanned_to + 1

    async def full_history(self, stream: Stream, key: bytes, start: int = 1) -> list[bytes]:
        """Every encoded record of ``key`` held from ``start`` up to the head."""
        seq, end = start, stream.head + 1
        found: list[bytes] = []
        while seq < end:
            records, seq = await self.history(stream, key, seq, end, 8192, 1 << 20)
            found += records
        return found

    async def seek_time(self, stream: Stream, timestamp: int) -> int:
        """The first seq held whose timestamp is >= ``timestamp``; ``head + 1`` if none."""
        async with self.storage.reader() as reader:
            seq = await reader.seek_time(stream.id, timestamp)
        if seq is None:
            return stream.head + 1
        return min(max(seq, stream.low), stream.head + 1)
