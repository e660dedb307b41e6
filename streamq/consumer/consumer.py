"""The consumer: records pushed by a producer, applied exactly once into its own database.

``Consumer.transaction(batch)`` applies a batch in one transaction that also stores the
consumer's position (producer id, stream) -> last seq, so after any crash the consumer
resumes right after the last committed batch.

The consumer is a facade over parts of one job each: ``subscription.Subscription`` (the
connection: handshake, subscription, the bounded queue of pushed batches, reconnects,
acknowledgements), ``turn.Turn`` (whose turn it is to apply, one transaction at a time),
``position_store.PositionStore`` (its database, one class per engine: SQLite or PostgreSQL),
``kept_store.KeptStore`` (that database waited for while it cannot be used),
``failures.Policies`` (``on_failure``: what ``apply`` does when the application's
function raises), ``settings.ConsumerSettings`` (its options) and ``batch.Batch`` (what
it yields). What is its own: where it starts with a producer it has not read yet (its
stored position, checked to be this producer's and this split's, or the configured start).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from types import TracebackType
from typing import Any, TypeVar, Unpack

from ..errors import NewConsumerNameError, ProducerChangedError, SharesChangedError
from ..filters import share_name, shared_as, split_share_name
from ..metrics import ConsumerCollector, MetricsEndpoint
from ..wire.client import Client
from ..wire.transport import parse_address
from .batch import Batch
from .database import ConsumerTransaction, PositionStore, open_position_store
from .failures import FailurePolicy, Policies
from .kept_store import KeptStore
from .settings import ConsumerOptions, ConsumerSettings
from .subscription import Received, Resume, Subscription, heartbeat_timeout
from .turn import Turn

__all__ = ["Consumer", "ConsumerSettings", "heartbeat_timeout"]

T = TypeVar("T")
logger = logging.getLogger("streamq.consumer")
# Seconds between looks, while a batch handed out is not known to be applied, for its
# position saved through the application's own connection (``_next_item``).
SAVED_POLL = 0.5


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

    ``max_batch_records``: a consumer that is behind merges the frames queued
    (``queue_batches``) into one batch of up to this many records (65536): fewer commits,
    but its position moves only as each commits (with a statement per record, seconds).

    ``ack_interval``: the consumer tells the producer its durable position (an ``ACK``:
    lag, ``Producer.wait_applied``, retention) after each batch it applies, but at most
    once per this many seconds: a batch applied sooner after the last ``ACK`` is
    acknowledged when the interval is up, with the newest position then. Each ``ACK``
    wakes the producer; a consumer applying thousands of batches a second would
    otherwise cost it more than its pushes do. 0 acknowledges every batch at once.

    ``heartbeat_timeout``: reconnect after this many seconds without a byte from the
    producer. Left out, it is six of the heartbeat intervals the producer announces
    (at least 2 s), or 30 s with a producer that announces none.

    ``db_reconnect_timeout``: while its own database cannot be used (a PostgreSQL server
    restarting, a connection lost; on SQLite, another connection holding the write lock
    past the busy timeout), the consumer waits for it with backoff, connecting again,
    for at most this many seconds (60 by default; None: for ever), and goes on from the
    position stored there; past it, ``DatabaseUnavailableError``, one line naming the
    database. ``apply`` runs its function again; a COMMIT the lost connection left in
    doubt is resolved by reading the stored position again, never by applying twice.
    ``transaction``'s block cannot be run again: a connection lost in it is raised, noted
    (nothing committed; apply the batch again). ``start`` does not wait: a database it
    cannot open fails at once.

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
    A name with no position for the stream, on a database where other names applied it
    (a misspelt name, most often), raises ``NewConsumerNameError`` unless ``start_seq``
    or ``start_time`` says where it starts.

    ``metrics_port`` serves Prometheus metrics of this consumer's own on ``metrics_host``
    (loopback by default; 0 picks a free port, ``metrics_address``), read from its live
    state at scrape time: applied seq, records and batches applied, parked, retried,
    reapplied, lag as it sees it, reconnects (``ConsumerCollector``).
    ``metrics=producer`` adds them to the endpoint of a ``Producer`` of the same process
    instead (one started with a ``metrics_port``); ``metrics=collector`` to a
    ``ConsumerCollector`` of the caller's.

    The keyword options can also be given as one ``settings=ConsumerSettings(...)``;
    keywords given beside it replace its fields.
    """

    def __init__(
        self,
        address: str,
        stream: str,
        *,
        db: str | None = None,
        name: str | None = None,
        settings: ConsumerSettings | None = None,
        **options: Unpack[ConsumerOptions],
    ) -> None:
        settings = ConsumerSettings(**options) if settings is None else replace(settings, **options)
        self.settings = settings
        self._metrics = MetricsEndpoint(
            settings.metrics_port, settings.metrics_host, settings.metrics
        )
        if db is not None and not name:
            raise ValueError("a consumer with a database needs a name= to store its position under")
        parse_address(address)  # a bad address fails here, not at the first connect
        self.address, self.stream = address, stream
        self.base_name = name or "anonymous"
        self.filter = settings.subscribed
        # One share of one is the whole stream: the consumer's own name, as ``reshare`` writes.
        split = None if self.filter is None else self.filter.share
        self.share = None if split is None or split[1] == 1 else split
        # Where positions are stored and reported: each share is a consumer of its own.
        self.name = self.base_name if self.share is None else share_name(name or "", self.share)
        # The database it opened itself (``db``), and closes; a fan-in's or a group's
        # consumers apply into their owner's instead (``apply_into``).
        self._store: PositionStore | None = None
        if db is not None:
            self._store = open_position_store(
                db, settings.durability, connect_timeout=settings.connect_timeout
            )
        self.subscription = Subscription(
            address, stream, self.name, settings, self._resume, self._durable
        )
        # Kept up: its calls made again while the database cannot be used (``kept_store``).
        kept = None
        if self._store is not None:
            kept = KeptStore(self._store, settings.db_reconnect_timeout)
        self.turn = Turn(self.name, stream, address, kept, self.subscription.acknowledge)
        self._policies = Policies(self.turn, settings.policy, self.subscription.fail)
        # Addresses of the other producers a ``FanInConsumer`` reads under the same name:
        # positions from the producers found there are expected, not another producer's.
        self.siblings: frozenset[str] = frozenset()
        self._collector: ConsumerCollector | None = None  # the collector it reports to
        self._handed = 0  # last seq of the last batch handed to the application
        self._closed = False

    def apply_into(self, store: PositionStore, lock: asyncio.Lock) -> None:
        """Apply into ``store``, opened by someone else (a ``FanInConsumer``, a
        ``GroupConsumer``), one transaction at a time with the others by ``lock``; kept up
        as a store of its own (``db_reconnect_timeout``)."""
        self.turn.share(KeptStore(store, self.settings.db_reconnect_timeout), lock)

    # --- what it has done, as metrics and the application read it ------------

    @property
    def applied(self) -> int:
        """Last seq committed (or delivered, without a database)."""
        return self.turn.position

    @property
    def producer_id(self) -> str | None:
        """The producer's id, once connected."""
        return self.subscription.producer_id

    @property
    def epoch(self) -> int:
        """The producer's epoch, as its SERVER_HELLO said."""
        return self.subscription.epoch

    @property
    def head(self) -> int:
        """The producer's head, as last reported."""
        return self.subscription.head

    @property
    def received(self) -> int:
        """Last seq read from the socket."""
        return self.subscription.received

    @property
    def seen_epoch(self) -> int:
        """The highest producer epoch that wrote any record up to ``received`` (0: unknown)."""
        return self.subscription.seen_epoch

    @property
    def reconnects(self) -> int:
        """Connections to the producer made again."""
        return self.subscription.reconnects

    @property
    def on_failure(self) -> FailurePolicy:
        """What ``apply`` does when the application's function raises."""
        return self._policies.policy

    @property
    def retried(self) -> int:
        """Failed batches applied again (``Retry``)."""
        return self._policies.retried

    @property
    def parked(self) -> int:
        """Records parked in ``streamq_dead_letters`` (``DeadLetter``), committed."""
        return self._policies.parked

    @property
    def reapplied(self) -> int:
        """Parked records re-applied on request (``retry_dead_letters``)."""
        return self._policies.reapplied

    @property
    def records_applied(self) -> int:
        """Records committed in their batch, parked ones not counted."""
        return self.turn.records

    @property
    def batches_applied(self) -> int:
        """Batches committed through this consumer."""
        return self.turn.batches

    @property
    def _db(self) -> Any:
        """The store's asyncio connection, None without a database (tests, benchmarks)."""
        return None if self.turn.store is None else self.turn.store.connection

    @property
    def lag(self) -> int:
        """Records the producer has committed that this consumer has not yet applied, as of
        the producer's last message (records and heartbeats carry the head)."""
        return max(0, self.head - self.applied)

    async def fetch_lag(self) -> int:
        """The exact lag now: asks the producer for its head on a connection of its own
        (``lag`` may be stale while this consumer is behind and its socket is full)."""
        settings = self.settings

        def head() -> int:
            with Client(
                self.address,
                timeout=settings.connect_timeout,
                name=self.name,
                tls=settings.tls,
                token=settings.token,
            ) as client:
                return client.head(self.stream).head

        subscription = self.subscription
        subscription.head = max(subscription.head, await asyncio.to_thread(head))
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
            if self._store is not None:
                await self._store.open()
            await self.subscription.open()
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Stop receiving and close the connection and the database (idempotent)."""
        if self._closed:
            return
        self._closed = True
        await self._policies.close()
        await self.subscription.close()
        if self._collector is not None:
            self._collector.remove(self)
        await self._metrics.close()
        if self._store is not None:
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
        turn = self.turn
        if turn.store is not None and turn.position < self._handed:
            await turn.catch_up()  # the last batch, applied through the application's connection?
        item = await self._next_item()
        if turn.store is None:
            turn.position = item.last_seq
        elif turn.position < item.after:
            await turn.catch_up()  # batches applied through the application's connection
        self._handed = item.last_seq
        return Batch(
            self.subscription.stream,
            item.producer_id,
            item.after,
            item.records,
            item.epoch,
            self.name,
            self.address,
            turn.origin,
            item.last_seq,
            turn.fence,
        )

    async def _next_item(self) -> Received:
        """The subscription's next batch. Meanwhile, while the last batch handed out is
        not known to be applied, look every ``SAVED_POLL`` seconds whether the application
        committed it through its own connection (``save_position``: the consumer ran no
        transaction to tell it), and acknowledge it: the producer's lag and
        ``wait_applied`` see it then, not at the next batch (none, if the stream is idle)."""
        if self.turn.store is None or self.turn.position >= self._handed:
            return await self.subscription.next(self.settings.max_batch_records)
        done = asyncio.Event()
        watcher = asyncio.create_task(self._watch_saved(done))
        try:
            return await self.subscription.next(self.settings.max_batch_records)
        finally:
            done.set()
            await watcher  # a look under way ends first: never cancelled inside a query

    async def _watch_saved(self, done: asyncio.Event) -> None:
        turn = self.turn
        while turn.position < self._handed and not done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), SAVED_POLL)
            if done.is_set():
                return
            try:
                await turn.catch_up()
            except Exception as exc:  # the database's error reaches the next transaction
                logger.warning("consumer %r: reading its position failed: %r", self.name, exc)
                return

    def _durable(self) -> int:
        """The position to acknowledge to the producer: 0 without a database."""
        return 0 if self.turn.store is None else self.turn.position

    # --- where it starts -----------------------------------------------------

    async def _resume(self, producer_id: str, seek: Callable[[int], Awaitable[int]]) -> Resume:
        """Where to start with the producer ``producer_id``, reached for the first time: after
        the position stored for it, checked to be this name's producer and this split's; else
        the configured start (``start_seq``, or the first seq at ``start_time``)."""
        turn, settings = self.turn, self.settings
        stored = await self._stored_position(producer_id)
        turn.producer_id = producer_id
        if stored is not None:
            turn.position, epoch = stored
            return Resume(turn.position, stored=True, epoch=epoch)
        start = settings.first_seq
        if settings.start_time is not None:
            start = await seek(settings.start_time)
        turn.position = turn.origin = start - 1
        return Resume(start - 1)

    async def _stored_position(self, producer_id: str) -> tuple[int, int] | None:
        """(seq, epoch) of the position stored for ``producer_id``; None when there is none
        (or no database), once the positions of another split or producer are refused."""
        store = self.turn.store
        if store is None:
            return None
        async with self.turn.lock:
            rows = await store.load(self.name, self.stream)
            names = await store.names_on(self.stream, producer_id, self.address)
        own = {name for name, _, _ in names if self._is_own(name)}
        self._check_split({name: seq for name, _, seq in names if name in own})
        positions = {p: (seq, epoch, endpoint) for p, seq, epoch, endpoint in rows}
        if producer_id in positions:
            seq, epoch, _ = positions[producer_id]
            return seq, epoch
        others = [(p, seq, at) for p, (seq, _, at) in positions.items() if at not in self.siblings]
        if others and not self.settings.allow_new_producer:
            raise self._not_bound(producer_id, sorted(others, key=lambda row: row[2]))
        strangers = {name: seq for name, p, seq in names if p == producer_id and name not in own}
        if strangers and not self.settings.start_given:
            raise self._new_name(strangers)
        return None

    def _is_own(self, name: str) -> bool:
        """``name`` is this consumer's: its base name, one of its shares, a group's member."""
        return name == self.base_name or name.startswith(self.base_name + "[")

    def _new_name(self, strangers: dict[str, int]) -> NewConsumerNameError:
        """The error for a name new to this producer's stream, where others applied it,
        each named as the application gives it: a group's (or a split consumer's) name,
        not its shares' position names (``workers``, not ``workers[0/4]``)."""
        given: dict[str, tuple[int, int]] = {}  # each name's split (1: none), highest seq
        for stored, seq in strangers.items():
            name, (_, split) = split_share_name(stored) or (stored, (0, 1))
            was = given.get(name, (1, 0))
            given[name] = max(was[0], split), max(was[1], seq)
        found = ", ".join(
            f"{name!r} ({f'{split} shares, ' if split > 1 else ''}up to seq {seq})"
            for name, (split, seq) in sorted(given.items())
        )
        name, (_, seq) = max(given.items(), key=lambda item: item[1][1])
        return NewConsumerNameError(
            f"consumer {self.base_name!r} has no position for stream {self.stream!r} of the "
            f"producer at {self.address}, and this database holds {found}: a misspelt name "
            f"would apply the stream again from seq 1. Give the name it applied under "
            f"({name!r}), or say where a new consumer starts: start_seq=1 for the whole "
            f"stream, start_seq={seq + 1} from where {name!r} is.",
            strangers,
        )

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

    # --- applying ------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def transaction(self, batch: Batch) -> AsyncIterator[ConsumerTransaction]:
        """Apply ``batch`` in one transaction that also stores its last seq as the position.

        The statements are the database's own: ``?`` placeholders on SQLite, ``%s`` on
        PostgreSQL. If the block raises, nothing commits and the batch can be applied again.
        ``on_failure`` does not apply here (streamq cannot run the block again): the
        exception is raised as it is. ``apply`` is the form with policies.
        """
        turn = self.turn
        async with turn.lock:  # the turn is checked under the lock: one apply per batch
            store = turn.check(batch)
            async with store.transaction(batch, lambda: turn.applied(batch)) as tx:
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
