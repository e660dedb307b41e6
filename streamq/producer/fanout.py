"""Serving the head: one read and one frame per round for every subscriber caught up.

A subscriber behind the head reads the log and frames for itself (``Server._push``).
Once it reaches its stream's fan-out position it is handed to the stream's ``Fanout``
and costs a buffer append per round from then on: a round reads what was committed
since the last one once, frames it once per kind of subscriber (filter, epochs), and
writes the same bytes to each, as the NATS server appends one message to each
subscriber's outbound buffer (``client.go``). A subscriber whose transport buffer passes
the high-water mark is handed back: it drains, then catches up on its own, so a slow
consumer costs the others nothing and holds at most its buffer and one round.

Rounds: with nothing being served, a commit's round starts at the loop's next turn, and
the commits of that turn share it; while rounds follow each other, the next waits three
times as long as the last one kept the loop busy (``spacing``; a read from the database
is another thread's time, and the loop's clock counts in milliseconds, so the round's
own work is timed), at most ``MAX_GAP``: serving takes at most about a quarter of the
loop, and commits that come faster than it serves share a round and its frames, so
that each consumer, too, gets fewer and fuller frames (with 100 consumers at 1,000
commits/s, a ratio of 1 left their process behind: p99 0.46 s against 0.07 s with 3, in
quick runs; timing the round's own work rather than the loop's clock around it: p50
8.3-8.8 to 5.6-7.8 ms embedded, 13.8-15.4 to 11.4-12.5 ms with ``streamq serve``). A
fan-out asks for other writers' commits only once it has sent everything
(``_count_wait``): the commit watcher's looks follow its rounds.
"""

from __future__ import annotations

import asyncio
import fcntl
import sys
import termios
import time
from dataclasses import dataclass, field
from typing import Any

from ..filters import Filter, share_name
from ..protocol import records_frame
from .committed_log import Log, Packed, Stream
from .spacing import Spacing

# See the docstring: the most a round waits after the last one (``spacing``).
MAX_GAP = 0.02
# A round's records, in frames of the server's limits: at most this many, so that the loop
# turns between rounds (the rest comes in the next round, at once). A subscriber is handed
# back after the write that takes its buffer past the high-water mark, so none holds more
# than that mark and one frame.
ROUND_FRAMES = 4


@dataclass(eq=False)
class Subscription:
    """One connected consumer: what the status report shows of it, and where it stands."""

    consumer: str
    stream: str
    peer: str
    sent: int  # last seq written to the socket (with a filter: the last frame's ``through``)
    acked: int  # last seq the consumer reported as applied and committed
    # asyncio's; uvloop's transports are not its subclasses, with the same methods.
    transport: asyncio.WriteTransport | None = None
    since: float = field(default_factory=time.time)
    principal: str | None = None  # the consumer its token named, when the producer checks tokens
    filter: Filter | None = None  # "Filters": what it asked for
    epochs: bool = False  # its frames carry their epoch ("Epochs")
    examined: int = 0  # the last seq looked at: sent, or with a filter, matching or not
    sent_at: float = 0.0  # the loop's time of its last frame
    # Which subscribers get the same frames as this one: same filter, same epochs.
    frames: tuple[str, bool] = field(init=False)
    # While the fan-out serves it: woken when it hands it back (``Fanout``).
    _handed_back: asyncio.Future[BaseException | None] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.examined = self.sent
        self.frames = ("" if self.filter is None else self.filter.describe(), self.epochs)

    @property
    def reporter(self) -> str:
        """Whose position its ACKs move: with tokens, the consumer the token proved, never a
        name the peer chose (it could move a registered consumer's position and retention).
        Each share of a consumer has a position of its own."""
        if self.principal is None:
            return self.consumer
        share = None if self.filter is None else self.filter.share
        if share is None or share[1] == 1:  # one share of one: the whole stream, as Consumer
            return self.principal
        return share_name(self.principal, share)

    @property
    def split(self) -> tuple[str, int] | None:
        """The consumer whose position it reports, and into how many shares it is split
        (1: unshared): ``billing[1/4]`` is ``("billing", 4)``. None for a share reported
        under a name not of the form ``name[i/n]`` (a client of its own)."""
        share = None if self.filter is None else self.filter.share
        reporter = self.reporter
        if share is None or share[1] == 1:
            return reporter, 1
        suffix = f"[{share[0]}/{share[1]}]"
        return (reporter[: -len(suffix)], share[1]) if reporter.endswith(suffix) else None

    @property
    def narrowed(self) -> bool:
        """Its filter has a key prefix or headers: the producer does not count what it
        passes, so its lag is head - applied, an upper bound."""
        f = self.filter
        return f is not None and (f.key_prefix is not None or bool(f.headers))

    def reports_for(self, consumer: str) -> bool:
        """It reports for ``consumer``, split or not."""
        split = self.split
        return split is not None and split[0] == consumer

    @property
    def buffered(self) -> int:
        """Bytes written for this consumer and not yet taken by the kernel."""
        return 0 if self.transport is None else self.transport.get_write_buffer_size()

    @property
    def queued(self) -> int:
        """Bytes the kernel holds for this consumer, sent or not, not yet acknowledged by its
        TCP (Linux's ``SIOCOUTQ``; 0 where it cannot be asked): what a stopped consumer holds
        beyond ``buffered``."""
        sock = None if self.transport is None else self.transport.get_extra_info("socket")
        if sock is None or not hasattr(termios, "TIOCOUTQ"):
            return 0
        try:
            answer = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
        except OSError:
            return 0
        return int.from_bytes(answer, sys.byteorder, signed=True)

    def describe(self) -> dict[str, Any]:
        return {
            "consumer": self.consumer,
            "stream": self.stream,
            "peer": self.peer,
            "sent": self.sent,
            "acked": self.acked,
            "buffered": self.buffered,
            "queued": self.queued,
            "connected_at": int(self.since * 1000),
            "principal": self.principal,
            "filter": None if self.filter is None else self.filter.describe(),
        }


@dataclass
class Traffic:
    """Records sent from one stream and the bytes of their RECORDS frames, counted per frame."""

    records: int = 0
    bytes: int = 0


class Fanout:
    """A stream's subscribers at its fan-out position, served a round at a time.

    ``position``: every record up to it was written to every subscriber held here; a
    subscriber reading for itself reads no further than it, then joins (``follow``).
    """

    def __init__(
        self,
        log: Log,
        stream: Stream,
        traffic: Traffic,
        *,
        max_records: int,
        max_bytes: int,
        high_water: int,
    ) -> None:
        self.log, self.stream, self.traffic = log, stream, traffic
        self.max_records, self.max_bytes, self.high_water = max_records, max_bytes, high_water
        self.position = stream.head
        self.following: dict[Subscription, None] = {}  # ordered: served in joining order
        self.rounds = 0  # reads served to every subscriber held
        self.framed = 0  # frames built for them: one per kind of subscriber in each round
        self._due: asyncio.Future[None] | None = None  # set by a commit while the task waits
        self._waiting = False  # counted in the log's waits (``_count_wait``)
        self._task: asyncio.Task[None] | None = None
        stream.listeners.append(self._committed)

    def close(self) -> None:
        self.stream.listeners.remove(self._committed)
        if self._task is not None:
            self._task.cancel()
        for sub in list(self.following):
            self._hand_back(sub, None)

    async def follow(self, sub: Subscription, timeout: float) -> bool:
        """Serve ``sub`` from here until it is handed back (True: it must drain and read
        for itself; the error of a round that failed is raised) or ``timeout`` passes (False:
        time for its heartbeat or filter progress; it stays). ``sub`` has examined every
        seq up to ``position`` at least: beyond it if it came while a round was due."""
        waiter = sub._handed_back
        if waiter is None:
            assert sub.examined >= self.position, (sub.examined, self.position)
            waiter = sub._handed_back = asyncio.get_running_loop().create_future()
            self.following[sub] = None
            if self._due is not None:  # nothing left to send: it waits for a commit now
                self._count_wait(True)
            if self._task is None:
                self._task = asyncio.create_task(self._serve())
        try:
            async with asyncio.timeout(timeout):
                error = await asyncio.shield(waiter)
        except TimeoutError:
            return False
        if error is not None:
            raise error
        return True

    def leave(self, sub: Subscription) -> None:
        """``sub``'s connection ends."""
        if sub in self.following:
            self._hand_back(sub, None)

    def _hand_back(self, sub: Subscription, error: BaseException | None) -> None:
        del self.following[sub]
        if not self.following:
            self._count_wait(False)
        waiter, sub._handed_back = sub._handed_back, None
        if waiter is not None and not waiter.done():
            waiter.set_result(error)

    def _committed(self) -> None:
        if not self.following:
            self.position = self.stream.head  # nobody to serve: nothing to do
        elif self._due is not None and not self._due.done():
            self._due.set_result(None)

    def _count_wait(self, waiting: bool) -> None:
        """Count the fan-out as one wait for a commit (``committed_log.Waits``) while it has
        subscribers and has sent them everything: not during a round, nor in the pause
        after one. The commit watcher looks for other writers' commits while a wait is
        counted; a round takes what was committed by the look before it, so looks made
        during a round or its pause would only move the head again before it is read."""
        if waiting != self._waiting:
            self._waiting = waiting
            waits = self.stream.waits
            if waits is not None:
                if waiting:
                    waits.begin()
                else:
                    waits.end()

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        stream = self.stream
        spacing = Spacing(0.0, MAX_GAP)
        while True:
            pause = spacing.pause(loop.time())
            if pause > 0:
                await asyncio.sleep(pause)
            if stream.head <= self.position:
                self._due = loop.create_future()
                self._count_wait(bool(self.following))
                try:
                    await self._due
                finally:
                    self._due = None
                    self._count_wait(False)
            try:
                busy = await self._round(loop)
            except Exception as exc:  # retention took the records, say: each one says so
                busy = 0.0
                for sub in list(self.following):
                    self._hand_back(sub, exc)
            spacing.done(busy, loop.time())

    async def _round(self, loop: asyncio.AbstractEventLoop) -> float:
        """Up to ``ROUND_FRAMES`` frames' worth of what was committed beyond ``position``,
        read once, framed once per kind of subscriber, written to each; returns the seconds
        the loop spent on it, reads from the database not counted (another thread's)."""
        stream = self.stream
        busy = 0.0
        for _ in range(ROUND_FRAMES):
            seq = self.position + 1
            if seq > stream.head or not self.following:
                break
            end = min(seq + self.max_records, stream.epochs.segment_end(seq))
            packed, last = await self.log.read(stream, seq, end, self.max_records, self.max_bytes)
            if last < seq:
                break
            started = time.perf_counter()
            self.rounds += 1
            self._write(packed, seq, last, loop.time())
            self.position = max(self.position, last)
            busy += time.perf_counter() - started
        if not self.following:
            self.position = stream.head
        return busy

    def _write(self, packed: Packed, seq: int, last: int, now: float) -> None:
        """Records ``seq..last`` to every subscriber held: a frame per kind, built once."""
        epoch = self.stream.epochs.epoch_of(last)
        frames: dict[tuple[str, bool], tuple[bytes, int]] = {}
        traffic = self.traffic
        high_water = self.high_water
        for sub in list(self.following):
            if sub.examined == seq - 1:
                key = sub.frames
                found = frames.get(key)
                if found is None:
                    found = frames[key] = _frame(sub, packed, last, epoch)
                    self.framed += 1
            elif sub.examined < last:  # it came while this round was due: it reads the rest
                self._hand_back(sub, None)
                continue
            else:
                continue
            sub.examined = last
            frame, count = found
            if not count:
                continue  # nothing for this filter: its progress goes when due
            transport = sub.transport
            if transport is None or transport.is_closing():
                self._hand_back(sub, None)  # its connection ends: its task sees to it
                continue
            transport.write(frame)
            sub.sent, sub.sent_at = last, now
            traffic.records += count
            traffic.bytes += len(frame)
            if transport.get_write_buffer_size() > high_water:
                self._hand_back(sub, None)


def _frame(sub: Subscription, packed: Packed, last: int, epoch: int) -> tuple[bytes, int]:
    """``sub``'s frame of ``packed`` (records up to ``last``) and its number of records;
    no frame for a filter that matches none of them."""
    wanted = sub.filter
    if wanted is not None:
        packed = Packed.of(wanted.select(packed.records()))
        if not packed.count:
            return b"", 0
    through = None if wanted is None else last
    frame = records_frame(packed.parts, epoch if sub.epochs else None, through, packed.count)
    return frame, packed.count
