"""The consumer: records pushed by a producer, applied exactly once into its own database.

A background task reads the socket into a bounded queue of batches; when the
queue is full it stops reading, the socket's buffers fill, and TCP makes the
producer wait. ``Consumer.transaction(batch)`` applies a batch in one transaction
that also stores the consumer's position (producer id, stream) -> last seq, so after
any crash the consumer resumes right after the last committed batch.

The consumer is a facade over parts of one job each: ``transport`` (connections),
``stores.PositionStore`` (its database, one class per engine: SQLite or PostgreSQL),
``failures.Policies`` (``on_failure``: what ``apply`` does when the application's
function raises) and ``batches.Batch`` (what it yields).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from .batches import Batch, Fence
from .errors import (
    ConnectionLostError,
    ConsumerPositionError,
    IdleTimeoutError,
    OffsetOutOfRangeError,
    OutOfOrderBatchError,
    ProducerChangedError,
    SeqsReusedError,
    ServerError,
    SharesChangedError,
    ShuttingDownError,
    StreamQError,
    TooManyConnectionsError,
    error_from_frame,
)
from .failures import DeadLetter, FailurePolicy, Policies, Retry, Stop
from .filters import Filter, share_name, shared_as
from .metrics import ConsumerCollector, MetricsEndpoint
from .protocol import (
    DEFAULT_MAX_FRAME_SIZE,
    Ack,
    ClientConnection,
    Error,
    Heartbeat,
    Message,
    Records,
    SeekTime,
    ServerHello,
    Subscribe,
    Subscribed,
    TimePosition,
)
from .resharing import Floors
from .security import ClientTLS
from .storage import Durability
from .stores import ConsumerTransaction, PositionStore, open_position_store
from .transport import (
    client_handshake,
    closed_by_producer,
    handshake,
    open_connection,
    parse_address,
    producer_errors,
    read_message,
)

if TYPE_CHECKING:
    from .producer import Producer

T = TypeVar("T")

logger = logging.getLogger("streamq.consumer")

# Without heartbeat_timeout=: the connection counts as lost after this many of the
# producer's announced heartbeat intervals of silence, and never sooner than the floor
# (timers slip on a busy machine); 30 s from a producer that announces none.
HEARTBEAT_MISSES = 6
MIN_HEARTBEAT_TIMEOUT = 2.0
DEFAULT_HEARTBEAT_TIMEOUT = 30.0


def heartbeat_timeout(given: float | None, interval_ms: int | None) -> float:
    """The silence after which a subscription is treated as lost ("Handshake",
    ``heartbeat_interval_ms``): the caller's own value if given, else a few of the
    producer's intervals, so a producer with slow heartbeats is not taken for dead."""
    if given is not None:
        return given
    if interval_ms is None:
        return DEFAULT_HEARTBEAT_TIMEOUT
    return max(HEARTBEAT_MISSES * interval_ms / 1000, MIN_HEARTBEAT_TIMEOUT)


def lost_seqs(position: int, head: int, rewritten_from: int) -> range | None:
    """The seqs up to ``position`` that the producer's log no longer holds ("Epochs"): those
    beyond its ``head``, and those from ``rewritten_from`` (if not 0) on; None if none."""
    first = rewritten_from or head + 1
    return range(first, position + 1) if 0 < first <= position else None


_Item = Batch | BaseException

# Failures a reconnect may cure; anything else stops the consumer with its error.
_TRANSIENT = (
    ConnectionLostError,
    ShuttingDownError,
    TooManyConnectionsError,
    IdleTimeoutError,
    OSError,
    TimeoutError,
)

# Reconnect backoff: the first retry after _FIRST_DELAY, doubling up to _MAX_DELAY. A
# connection that lived _STABLE_CONNECTION seconds resets it (the next reconnect is at once).
_FIRST_DELAY = 0.05
_MAX_DELAY = 2.0
_STABLE_CONNECTION = 1.0


class Consumer:
    """Subscribes to one stream of one producer and yields batches as they are pushed.

    With ``db`` and ``name``, positions persist in that database and
    ``transaction(batch)`` (or ``apply``) applies batches exactly once: ``db`` is a
    SQLite file, or a PostgreSQL database as a ``postgresql://user@host:port/dbname``
    URL (``pip install streamq[postgres]``). Without ``db``, the
    consumer starts at ``start_seq`` and keeps its position in memory only
    (for tools such as ``streamq tail``).

    ``start_time`` (milliseconds since the epoch) starts, instead of ``start_seq``, at
    the first record whose timestamp is at least that (the producer seeks its time
    index); like ``start_seq``, it applies only when no position is stored.

    ``durability="normal"`` (SQLite ``synchronous=NORMAL``) is safe for exactly-once here:
    a power loss can only roll back the consumer's last commits, effects and position
    together, and those records are fetched from the producer again. ``"full"`` makes
    every applied batch survive power loss as soon as it commits. On PostgreSQL,
    ``"normal"`` keeps the server's ``synchronous_commit`` and ``"full"`` sets it on.

    ``ack_interval``: the consumer tells the producer its durable position (an ``ACK``:
    lag, ``Producer.wait_applied``, retention) after each batch it applies, but at most
    once per this many seconds: a batch applied sooner after the last ``ACK`` is
    acknowledged when the interval is up, with the newest position then. Each ``ACK``
    wakes the producer; a consumer applying thousands of batches a second would
    otherwise cost it more than its pushes do. 0 acknowledges every batch at once.

    ``heartbeat_timeout``: reconnect after this many seconds without a byte from the
    producer. Left out, it is six of the heartbeat intervals the producer announces
    (at least 2 s), or 30 s with a producer that announces none.

    ``tls`` connects over TLS 1.3 (``ClientTLS``); ``token`` authenticates to a producer
    that requires tokens. A failed TLS handshake raises ``TLSError``, a refused token
    ``AuthenticationFailedError``, a stream outside the token's grants ``NotAuthorizedError``;
    none of them is retried.

    ``on_failure`` says what ``apply`` does when the application's function raises:
    ``Stop()`` (the default), ``Retry(times=5, backoff=0.05, max_backoff=5.0)`` or
    ``DeadLetter(retry=Retry(...))``; see ``apply``. ``retried``, ``parked`` and
    ``reapplied`` count what they did.

    ``filter=Filter(key_prefix=..., headers={...})`` asks the producer for the matching
    records only; the position still moves past the others, and batches may then be
    empty. ``share=(i, n)`` makes this consumer one of ``n`` workers that split the
    stream by key: it receives the records whose key is in share ``i`` (keyless records
    are share 0), in order per key, and stores its position as ``name[i/n]``. Starting
    with another ``n`` than the stored positions were applied with raises
    ``SharesChangedError``; ``streamq reshare`` changes ``n`` safely.

    A consumer name is bound to the producers it applied from (by producer id): one
    whose database holds positions for its ``name`` and stream from another producer, and
    none from the one it reached, raises ``ProducerChangedError``, at another address or
    at the same one (a replaced database), rather than mix two logs in one projection.
    ``allow_new_producer=True`` applies this producer's records too, from ``start_seq``.

    ``metrics_port`` serves Prometheus metrics of this consumer's own on ``metrics_host``
    (loopback by default; 0 picks a free port, ``metrics_address``), read from its live
    state at scrape time: applied seq, records and batches applied, parked, retried,
    reapplied, lag as it sees it, reconnects (``ConsumerCollector``).
    ``metrics=producer`` adds them to the endpoint of a ``Producer`` of the same process
    instead (one started with a ``metrics_port``); ``metrics=collector`` to a
    ``ConsumerCollector`` of the caller's.
    """

    def __init__(
        self,
        address: str,
        stream: str,
        *,
        db: str | None = None,
        name: str | None = None,
        start_seq: int = 1,
        start_time: int | None = None,
        queue_batches: int = 16,
        max_batch_records: int = 65536,
        reconnect: bool = True,
        reconnect_timeout: float | None = None,
        connect_timeout: float = 10.0,
        heartbeat_timeout: float | None = None,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        durability: Durability = "normal",
        tls: ClientTLS | None = None,
        token: str | None = None,
        on_failure: FailurePolicy | None = None,
        filter: Filter | None = None,
        share: tuple[int, int] | None = None,
        ack_interval: float = 0.005,
        allow_new_producer: bool = False,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        metrics: Producer | ConsumerCollector | None = None,
    ) -> None:
        self._metrics = MetricsEndpoint(metrics_port, metrics_host, metrics)
        if ack_interval < 0:
            raise ValueError(f"ack_interval must be 0 or more seconds, not {ack_interval!r}")
        if share is not None:
            if filter is not None and filter.share is not None:
                raise ValueError("give share= or a filter with a share, not both")
            base = filter or Filter()
            filter = Filter(base.key_prefix, base.headers, share)  # checks the share
        if on_failure is None:
            on_failure = Stop()
        if not isinstance(on_failure, Stop | Retry | DeadLetter):
            raise TypeError(
                "on_failure takes streamq.Stop(), streamq.Retry(...) or streamq.DeadLetter(...), "
                f"not {on_failure!r}"
            )
        if durability not in ("normal", "full"):
            raise ValueError(f"durability must be 'normal' or 'full', not {durability!r}")
        if db is not None and not name:
            raise ValueError("a consumer with a database needs a name= to store its position under")
        self.address = address
        self.stream = stream
        self.base_name = name or "anonymous"
        # One share of one is the whole stream: the consumer's own name, as ``reshare`` writes.
        split = None if filter is None else filter.share
        self.share = None if split is None or split[1] == 1 else split
        # Where positions are stored and reported: each share is a consumer of its own.
        self.name = self.base_name if self.share is None else share_name(name or "", self.share)
        self.filter = filter
        parse_address(address)  # a bad address fails here, not at the first connect
        self._store: PositionStore | None = None
        if db is not None:
            self._store = open_position_store(db, durability, connect_timeout=connect_timeout)
        self._start_seq = start_seq
        self._start_time = start_time
        self._queue: asyncio.Queue[_Item] = asyncio.Queue(maxsize=queue_batches)
        self._max_batch_records = max_batch_records
        self._reconnect = reconnect
        self._reconnect_timeout = reconnect_timeout
        self._connect_timeout = connect_timeout
        self._heartbeat_timeout_given = heartbeat_timeout
        # Until a producer announces its interval (and for one that does not): 30 s.
        self._heartbeat_timeout = (
            DEFAULT_HEARTBEAT_TIMEOUT if heartbeat_timeout is None else heartbeat_timeout
        )
        self._max_frame_size = max_frame_size
        self._durability = durability
        self._tls = tls
        self._ssl = None if tls is None else tls.context()
        self._token = token
        self._tx_lock = asyncio.Lock()  # one transaction at a time on the store's connection
        self._owns_store = True
        self._task: asyncio.Task[None] | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._conn: ClientConnection | None = None
        self._pending_error: BaseException | None = None
        self._closed = False
        self._ack_interval = ack_interval
        self._acked_at = -math.inf  # the event loop's time of the last ACK sent
        self._ack_timer: asyncio.TimerHandle | None = None  # an ACK due at the interval's end
        self._loop: asyncio.AbstractEventLoop | None = None  # once an ACK was sent
        self.producer_id: str | None = None
        self.epoch = 0
        self.head = 0  # the producer's head as last reported
        self.received = 0  # last seq read from the socket
        # The highest producer epoch that wrote any record up to ``received`` (0: unknown):
        # a producer that later holds a higher one there lost and re-used seqs ("Epochs").
        self.seen_epoch = 0
        self.applied = 0  # last seq committed (or delivered, without a database)
        self._origin = 0  # the configured start's position, when none was stored
        self.reconnects = 0
        self.on_failure: FailurePolicy = on_failure
        self.retried = 0  # failed batches applied again (Retry)
        self.parked = 0  # records parked in streamq_dead_letters (DeadLetter), committed
        self.reapplied = 0  # parked records re-applied on request (``retry_dead_letters``)
        self._policies = Policies(self)  # apply under on_failure
        self._allow_new_producer = allow_new_producer
        # Addresses of the other producers a ``FanInConsumer`` reads under the same name:
        # positions from the producers found there are expected, not another producer's.
        self._siblings: frozenset[str] = frozenset()
        self.records_applied = 0  # records committed in their batch, parked ones not counted
        self.batches_applied = 0  # batches committed through this consumer
        self._collector: ConsumerCollector | None = None  # the collector it reports to
        # A failure of the consumer's own background work (re-applying records marked for
        # retry), for the next ``__anext__`` to raise when batches were waiting already.
        self._failed: BaseException | None = None
        # The lease this consumer applies its share under, as a ``GroupConsumer``'s member.
        self.fence: Fence | None = None
        # Records applied under a group's earlier splits, by producer id (``resharing``).
        self.floors: dict[str, Floors] = {}
        self._skip: Floors | None = None  # this producer's, skipped as they arrive
        self._skip_through = 0  # no record after this seq is skipped

    def _share_store(self, store: PositionStore, lock: asyncio.Lock) -> None:
        """Apply into ``store``, opened by someone else (``FanInConsumer``), one transaction
        at a time by ``lock``."""
        self._store, self._tx_lock, self._owns_store = store, lock, False

    def _read_alongside(self, addresses: Iterable[str]) -> None:
        """Read as one of a ``FanInConsumer``'s producers, the others at ``addresses``."""
        self._siblings = frozenset(addresses) - {self.address}

    @property
    def _db(self) -> Any:
        """The store's asyncio connection, None without a database (tests, benchmarks)."""
        return None if self._store is None else self._store.connection

    @property
    def lag(self) -> int:
        """Records the producer has committed that this consumer has not yet applied, as of
        the producer's last message (records and heartbeats carry the head)."""
        return max(0, self.head - self.applied)

    async def fetch_lag(self) -> int:
        """The exact lag now: asks the producer for its head on a connection of its own
        (``lag`` may be stale while this consumer is behind and its socket is full)."""
        from .client import Client  # the blocking client builds on this module

        def head() -> int:
            with Client(
                self.address,
                timeout=self._connect_timeout,
                name=self.name,
                tls=self._tls,
                token=self._token,
            ) as client:
                return client.head(self.stream).head

        self.head = max(self.head, await asyncio.to_thread(head))
        return self.lag

    # --- lifecycle -----------------------------------------------------------

    @property
    def metrics_address(self) -> str:
        """``host:port`` of this consumer's own Prometheus endpoint (``/metrics``)."""
        return self._metrics.address

    async def start(self) -> None:
        """Open the database, connect and subscribe; raises if the producer refuses."""
        try:
            self._collector = self._metrics.open()
            if self._collector is not None:
                self._collector.add(self)
            if self._store is not None and self._owns_store:
                await self._store.open()
            # With a reconnect deadline, a producer that is down (restarting) is waited
            # for, as it would be after a lost connection; without one, fail at once.
            waits = self._reconnect and self._reconnect_timeout is not None
            reader, conn = await (self._connect_retrying() if waits else self._connect())
        except BaseException:
            await self.close()
            raise
        self._task = asyncio.create_task(self._run(reader, conn))

    async def close(self) -> None:
        """Stop receiving and close the connection and the database (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._policies.close()
        if self._ack_timer is not None:  # the last position, before the connection goes
            self._ack_now()
        self._drop_connection()
        if self._collector is not None:
            self._collector.remove(self)
        await self._metrics.close()
        if self._store is not None and self._owns_store:
            await self._store.close()

    async def __aenter__(self) -> Consumer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # --- receiving -----------------------------------------------------------

    def __aiter__(self) -> Consumer:
        return self

    async def __anext__(self) -> Batch:
        if self._closed:
            raise StopAsyncIteration
        if self._pending_error is not None:
            error, self._pending_error = self._pending_error, None
            raise error
        if self._failed is not None:
            error, self._failed = self._failed, None
            raise error
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        # Merge what else is already queued: fewer, larger transactions.
        records, epoch, last = item.records, item.epoch, item.last_seq
        while len(records) < self._max_batch_records and not self._queue.empty():
            more = self._queue.get_nowait()
            if isinstance(more, BaseException):
                self._pending_error = more
                break
            records += more.records
            epoch, last = more.epoch, more.last_seq
        if self._store is None:
            self.applied = last
        elif self.applied < item.after:
            await self._load_applied()  # batches applied through the application's connection
        return Batch(
            item.stream,
            item.producer_id,
            item.after,
            records,
            epoch,
            self.name,
            self.address,
            self._origin,
            last,
            self.fence,
        )

    async def _load_applied(self) -> None:
        """Learn the position ``streamq.save_position`` committed through the application's
        own connection (the consumer did not run that transaction), and acknowledge it."""
        assert self._store is not None and self.producer_id is not None
        if self._tx_lock.locked():
            return  # a transaction is under way: it moves the position itself
        async with self._tx_lock:  # free: taken at once, so no transaction starts meanwhile
            seq = await self._store.stored(self.name, self.producer_id, self.stream)
        if seq is not None and seq > self.applied:
            self.applied = seq
            self._ack()

    async def _read_message(self, conn: ClientConnection, reader: asyncio.StreamReader) -> Message:
        message = await read_message(conn, reader)
        if message is None:
            raise closed_by_producer(self.address, conn)
        if isinstance(message, Error):
            raise _server_error(message)
        return message

    async def _connect(self) -> tuple[asyncio.StreamReader, ClientConnection]:
        """Connect: the handshake, then the subscription and its position check."""
        reader, writer = await open_connection(
            self.address, self._tls, self._ssl, self._connect_timeout
        )
        conn = ClientConnection(self._max_frame_size)
        try:
            with producer_errors(self.address, "handshake with"):
                async with asyncio.timeout(self._connect_timeout):
                    hello = await self._handshake(conn, reader, writer)
                    start, subscribed = await self._subscribe(conn, reader, writer, hello)
        except BaseException:
            writer.close()
            raise
        self.producer_id, self.epoch, self.head = hello.producer_id, hello.epoch, subscribed.head
        self._skip = self.floors.get(hello.producer_id)
        self._skip_through = 0 if self._skip is None else self._skip.highest  # once, not a frame
        if start - 1 != self.received:
            self.seen_epoch = 0
        self.seen_epoch = max(self.seen_epoch, subscribed.after_epoch or 0)
        self.received = start - 1
        self._writer, self._conn = writer, conn
        if self._store is not None and self.applied > 0:
            self._ack_now()  # the producer learns where this consumer stands at once
        return reader, conn

    async def _handshake(
        self, conn: ClientConnection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> ServerHello:
        """CLIENT_HELLO and SERVER_HELLO (over TLS, the producer's first: one refusing this
        client's certificate closes at once), then AUTHENTICATED if a token was sent."""
        steps = client_handshake(self.address, f"consumer {self.name}", self._token, self._tls)

        async def receive() -> Message:
            return await self._read_message(conn, reader)

        hello, _ = await handshake(steps, lambda message: writer.write(conn.send(message)), receive)
        assert isinstance(hello, ServerHello)
        self._heartbeat_timeout = heartbeat_timeout(
            self._heartbeat_timeout_given, hello.heartbeat_interval_ms
        )
        return hello

    async def _subscribe(
        self,
        conn: ClientConnection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        hello: ServerHello,
    ) -> tuple[int, Subscribed]:
        """SUBSCRIBE from this consumer's position, and check that the producer still
        holds what it applied ("Epochs"); the first seq asked for, and SUBSCRIBED."""
        start = await self._start_position(hello.producer_id)
        if start is None:
            start = await self._configured_start(conn, reader, writer)
        seen = self.seen_epoch if start - 1 == self.received else 0
        writer.write(
            conn.send(
                Subscribe(self.stream, start, self.name, hello.producer_id, seen, self.filter)
            )
        )
        # The position to check: one this consumer had (stored or received), not a
        # configured start_seq, whose errors are the caller's.
        position = start - 1 if start - 1 == self.received and self.received else 0
        try:
            subscribed = await self._read_message(conn, reader)
        except OffsetOutOfRangeError as exc:
            details = exc.details
            head = details.get("head", start)
            lost = lost_seqs(position, head, details.get("rewritten_from", 0))
            if lost is not None:
                raise self._lost(lost, head) from exc
            raise
        assert isinstance(subscribed, Subscribed)
        rewritten = subscribed.rewritten_from if seen else 0
        lost = lost_seqs(max(position, start - 1), subscribed.head, rewritten or 0)
        if lost is not None:
            raise self._lost(lost, subscribed.head)
        return start, subscribed

    def _lost(self, lost: range, head: int) -> ConsumerPositionError:
        """The error for a producer whose log no longer holds the seqs ``lost`` that this
        consumer has: ``SeqsReusedError`` if it holds other records under some of them."""
        first, applied = lost[0], lost[-1]
        if first <= head:
            return SeqsReusedError(
                f"producer at {self.address} lost commits of stream {self.stream!r} and re-used "
                f"their seqs: consumer {self.name!r} already applied up to seq {applied}, but "
                f"the producer's log no longer holds seqs {first}..{applied} as it read them "
                f"(head {head}; other records now stand under seqs {first}..{min(head, applied)})."
                " A power loss rolled back commits that were not synced (durability='normal')."
                " Refusing to skip or re-apply records; reset this consumer's position to go on.",
                lost,
            )
        return ConsumerPositionError(
            f"producer at {self.address} has head {head} for stream {self.stream!r}, "
            f"but consumer {self.name!r} already applied up to seq {applied}: seqs "
            f"{first}..{applied} are no longer in the producer's log. The producer's database "
            "was restored from an older copy or lost commits. Refusing to skip or re-apply "
            "records; reset this consumer's position to go on.",
            lost,
        )

    async def _configured_start(
        self, conn: ClientConnection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> int:
        """``start_seq``, or the seq ``start_time`` leads to, asked on this connection."""
        start = self._start_seq
        if self._start_time is not None:
            writer.write(conn.send(SeekTime(self.stream, self._start_time)))
            position = await self._read_message(conn, reader)
            assert isinstance(position, TimePosition)
            start = position.seq
        self.applied = self._origin = start - 1
        return start

    async def _start_position(self, producer_id: str) -> int | None:
        """The first seq to ask for, after checking this is the expected producer;
        None when nothing was applied yet (the configured start applies)."""
        if self.producer_id is not None:
            if producer_id != self.producer_id:
                raise ProducerChangedError(
                    f"producer at {self.address} is now {producer_id}, "
                    f"but this consumer was reading from {self.producer_id}"
                )
            return self.received + 1
        if self._store is None:
            return None
        async with self._tx_lock:
            rows = await self._store.load(self.name, self.stream)
            splits = await self._store.shares_of(
                self.base_name, self.stream, producer_id, self.address
            )
        self._check_split(dict(splits))
        positions = {p: (seq, epoch, endpoint) for p, seq, epoch, endpoint in rows}
        if producer_id in positions:
            self.received, self.seen_epoch, _ = positions[producer_id]
            self.applied = self.received
            return self.received + 1
        others = [(p, seq, at) for p, (seq, _, at) in positions.items() if at not in self._siblings]
        if others and not self._allow_new_producer:
            raise self._not_bound(producer_id, sorted(others, key=lambda row: row[2]))
        return None

    def _not_bound(self, found: str, others: list[tuple[str, int, str]]) -> ProducerChangedError:
        """The error for a producer this consumer name has not applied from, when it has
        positions from ``others`` (producer id, seq, endpoint) on its stream."""
        applied = ", ".join(f"producer {p} (at {at}, up to seq {seq})" for p, seq, at in others)
        replaced = any(at == self.address for _, _, at in others)
        why = (
            "the producer's database was replaced"
            if replaced
            else "a consumer name is bound to the producers it applied from"
        )
        return ProducerChangedError(
            f"{self.address} serves producer {found}, but consumer {self.name!r} applied "
            f"stream {self.stream!r} from {applied}: {why}. Refusing to mix two logs into one "
            "projection; read the producer it applied from, give this one another name=, or "
            "pass allow_new_producer=True to apply this producer's records as well."
        )

    def _check_split(self, stored: dict[str, int]) -> None:
        """Refuse to start from positions applied under another split into shares: each
        counts only its own keys, so taking them for this split's would skip or re-apply."""
        others = {name: seq for name, seq in stored.items() if self._splits_differently(name)}
        if not others:
            return
        listed = ", ".join(f"{name} at seq {seq}" for name, seq in sorted(others.items()))
        asked = "unshared" if self.share is None else f"as share {self.share[0]} of {self.share[1]}"
        raise SharesChangedError(
            f"consumer {self.base_name!r} applied stream {self.stream!r} from {self.address} "
            f"split differently ({listed}), and this one asks for it {asked}: starting from "
            "those positions would skip or re-apply records. Keep the split, or change it with "
            "`streamq reshare` (docs/guides/filters-and-shares.md, Changing the number of shares).",
            others,
        )

    def _splits_differently(self, name: str) -> bool:
        """``name`` is this consumer's, stored under another split than this one's."""
        if name == self.name:
            return False
        if name == self.base_name:
            return True  # unshared, and this one is a share
        split = shared_as(self.base_name, name)
        return split is not None and (self.share is None or split[1] != self.share[1])

    async def _run(self, reader: asyncio.StreamReader, conn: ClientConnection) -> None:
        """Read batches into the queue; reconnect after transient failures.

        A connection lost soon after it was made (a link that resets every connection,
        say) is not retried at once: the wait before reconnecting doubles each time, as
        for failed connects, so a flapping link is not hammered with reconnects.
        """
        connected_at, flap_delay = time.monotonic(), 0.0
        while True:
            try:
                await self._pump(reader, conn)
            except _TRANSIENT as exc:
                self._drop_connection()
                if not self._reconnect:
                    await self._queue.put(_lost(exc, self.address))
                    return
                logger.warning("connection to %s lost (%s); reconnecting", self.address, exc)
                if time.monotonic() - connected_at >= _STABLE_CONNECTION:
                    flap_delay = 0.0
                else:
                    flap_delay = min(max(flap_delay * 2, _FIRST_DELAY), _MAX_DELAY)
                try:
                    reader, conn = await self._connect_retrying(flap_delay)
                except BaseException as error:
                    await self._queue.put(error)
                    return
                connected_at = time.monotonic()
                self.reconnects += 1
            except StreamQError as exc:
                self._drop_connection()
                await self._queue.put(exc)
                return

    async def _connect_retrying(
        self, delay: float = 0.0
    ) -> tuple[asyncio.StreamReader, ClientConnection]:
        """Connect, retrying transient failures with backoff until ``reconnect_timeout``.

        ``delay``: wait this long before the first attempt (0: try at once).
        """
        deadline = None
        if self._reconnect_timeout is not None:
            deadline = time.monotonic() + self._reconnect_timeout
        error: BaseException | None = None
        while True:
            if delay:
                if deadline is not None and time.monotonic() + delay > deadline:
                    raise ConnectionLostError(
                        f"no connection to {self.address} within {self._reconnect_timeout:g} s"
                    ) from error
                await asyncio.sleep(delay)
            try:
                return await self._connect()
            except _TRANSIENT as exc:
                error = exc
                delay = min(max(delay * 2, _FIRST_DELAY), _MAX_DELAY)

    async def _pump(self, reader: asyncio.StreamReader, conn: ClientConnection) -> None:
        """Receive the subscription's frames into the queue until the connection fails."""
        while True:
            try:
                message = await read_message(conn, reader, read_timeout=self._heartbeat_timeout)
            except TimeoutError:
                raise ConnectionLostError(
                    f"nothing from producer at {self.address} for {self._heartbeat_timeout:g} s"
                ) from None
            if message is None:
                raise ConnectionLostError(f"producer at {self.address} closed the connection")
            if isinstance(message, Records):
                if message.records or message.through is not None:
                    assert self.producer_id is not None
                    self.seen_epoch = max(self.seen_epoch, message.epoch or 0)
                    records, through = message.records, message.through or 0
                    skip = self._skip
                    if skip is not None and records and records[0].seq <= self._skip_through:
                        through = through or records[-1].seq
                        records = tuple(r for r in records if not skip.applied(r.key, r.seq))
                    batch = Batch(
                        self.stream,
                        self.producer_id,
                        self.received,
                        records,
                        self.seen_epoch,
                        through=through,
                    )
                    self.received = batch.last_seq
                    self.head = max(self.head, self.received)
                    await self._queue.put(batch)
            elif isinstance(message, Heartbeat):
                self.head = message.head
            elif isinstance(message, Error):
                raise _server_error(message)

    def _drop_connection(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._writer = self._conn = None

    # --- applying ------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def transaction(self, batch: Batch) -> AsyncIterator[ConsumerTransaction]:
        """Apply ``batch`` in one transaction that also stores its last seq as the position.

        The statements are the database's own: ``?`` placeholders on SQLite, ``%s`` on
        PostgreSQL. If the block raises, nothing commits and the batch can be applied again.
        ``on_failure`` does not apply here (streamq cannot run the block again): the
        exception is raised as it is. ``apply`` is the form with policies.
        """
        async with self._tx_lock:  # the turn is checked under the lock: one apply per batch
            store = self._check_turn(batch)
            async with store.transaction(batch, lambda: self._applied(batch)) as tx:
                yield tx

    async def apply(self, batch: Batch, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(tx, batch, *args)`` in one transaction that also stores the position.

        The blocking twin of ``transaction``: ``fn`` makes plain ``execute``/``executemany``
        calls, off the event loop (on SQLite on the database's own thread, so the whole
        batch costs one thread hop; on PostgreSQL on a worker thread with a blocking
        connection). ``fn`` must not touch the event loop; if it raises, nothing of that
        try commits, and ``on_failure`` decides:

        - retries (``Retry``, ``DeadLetter(retry=...)``): the whole batch again, each try
          its own transaction, after a backoff;
        - then the batch once more, in halves (each under a savepoint, in one transaction
          with the position), down to the records that fail alone. ``Stop`` and ``Retry``
          roll it all back and raise for the first of them (``Stop``: the application's
          exception, noted; ``Retry``: ``RecordFailedError``); ``DeadLetter`` parks them and
          commits the others with the position past the batch. If none fails alone, the
          batch commits. ``apply`` returns ``fn``'s result: after applying in parts, the
          parts' results added up if numbers, lists or tuples, else the last part's.

        Exceptions from the database itself (the turn, the COMMIT, a lost connection) are
        raised as they are: no policy applies. Records marked for retry (``streamq
        dead-letters retry``) are re-applied with the ``fn`` and ``args`` of the last call of
        this or ``retry_dead_letters``: before a batch, and while no batch comes by the
        consumer itself (a quiet stream); at most once a second either way.
        """
        return await self._policies.apply(batch, fn, *args)

    async def retry_dead_letters(self, fn: Callable[..., Any], *args: Any) -> int:
        """Re-apply, with ``fn`` as ``apply`` runs it, this consumer's parked records that
        were marked for retry (``streamq dead-letters retry``, ``mark_for_retry``); how
        many were applied. From the first call of this or ``apply``, the consumer calls it
        by itself at most once a second, with the last ``fn`` and ``args`` given to either
        (before a batch, or while none comes); a database error there is logged and
        raised from the next batch asked for (``async for``).

        Each record is a batch of its own (``after`` its seq - 1), in a transaction that
        deletes its dead-letter row: applied once, even if two processes try. One that
        fails again stays parked, its error and attempts updated, no longer marked.
        """
        return await self._policies.retry_dead_letters(fn, *args)

    def _check_turn(self, batch: Batch) -> PositionStore:
        """The store to apply into, if ``batch`` is the next one to apply (as this process
        knows it: the store checks again in the database, against other processes)."""
        if self._store is None:
            raise RuntimeError("this consumer has no database (db=None): nothing to apply into")
        if batch.consumer != self.name or batch.stream != self.stream:
            raise ValueError(
                f"batch of consumer {batch.consumer!r} on stream {batch.stream!r}: apply it "
                f"with the consumer that received it, not {self.name!r} on {self.stream!r}"
            )
        if batch.after != self.applied or batch.producer_id != self.producer_id:
            raise OutOfOrderBatchError(
                f"batch follows seq {batch.after}, but consumer {self.name!r} has applied up "
                f"to {self.applied}: apply every batch once, in the order received"
            )
        return self._store

    def _applied(self, batch: Batch, parked: int = 0) -> None:
        """``batch`` committed, ``parked`` of its records in the dead letters."""
        self.applied = batch.last_seq
        self.batches_applied += 1
        self.records_applied += len(batch.records) - parked
        self._ack()

    def _fail(self, error: BaseException) -> None:
        """Raise ``error`` from the next batch asked for: the failure of work the consumer
        did by itself, which no call of the application's saw. On a quiet stream, a wait
        for the next batch is woken with it."""
        if self._queue.empty():
            self._queue.put_nowait(error)
        elif self._failed is None:
            self._failed = error

    def _ack(self) -> None:
        """Tell the producer ``applied`` is durable (informational: status, lag): now, or
        once ``ack_interval`` has passed since the last ``ACK``."""
        if self._ack_timer is not None:
            return  # it sends the newest position
        loop = self._running_loop()
        due = self._acked_at + self._ack_interval
        if loop.time() >= due:
            self._ack_now()
        else:
            self._ack_timer = loop.call_at(due, self._ack_now)

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        """The consumer's event loop, asked once (each ask is a system call on 3.11)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def _ack_now(self) -> None:
        if self._ack_timer is not None:
            self._ack_timer.cancel()
            self._ack_timer = None
        self._acked_at = self._running_loop().time()
        if self._writer is not None and self._conn is not None:
            with contextlib.suppress(Exception):
                self._writer.write(self._conn.send(Ack(self.applied)))


def _server_error(message: Error) -> ServerError:
    return error_from_frame(message.code, message.message, message.details)


def _lost(exc: BaseException, address: str) -> ConnectionLostError:
    if isinstance(exc, ConnectionLostError):
        return exc
    lost = ConnectionLostError(f"connection to producer at {address} failed: {exc!r}")
    lost.__cause__ = exc
    return lost
