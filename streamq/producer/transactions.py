"""A producer's transactions: seqs assigned at publish, rows inserted at commit.

``Transaction`` (awaited calls on the producer's writer: ``transaction``),
``BlockingTransaction`` (one function on the writer's thread: ``Producer.run_in_transaction``)
and ``SyncTransaction`` (a thread's own session: ``SyncProducer``, ``run_in_transaction``
on PostgreSQL). The first two share ``writing.Pending``: each stream appended to, as
found under its lock, and the rows awaiting their INSERT; ``Writing.after_commit``
hands what committed to the log.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Any, TypeVar, cast

from ..records import (
    CheckedRecord,
    Receipt,
    check_stream_name,
    checked_record,
    seq_range,
    values_only,
)
from ..sql import AsyncSQL, BlockingSQL, to_the_end
from .storage import BlockingWriter, Session, StreamSettings, UnnumberedWriter
from .writing import Pending, Writing

T = TypeVar("T")


class transaction:
    """One transaction on the writer: BEGIN (caught up), the caller's SQL and publishes,
    COMMIT; its records handed to the log once committed, and served (where seqs are
    given after the commit, once this serving producer has numbered them). A class, not a
    generator: the compiled path has no async generators."""

    __slots__ = ("_holding", "_tx", "_writing")

    def __init__(self, writing: Writing) -> None:
        self._writing = writing
        self._holding = writing.holding()
        self._tx: Transaction | None = None

    async def __aenter__(self) -> Transaction:
        await self._holding.__aenter__()
        try:
            await self._writing.begin()
        except BaseException:
            await self._holding.__aexit__(None, None, None)
            raise
        self._tx = Transaction(self._writing)
        return self._tx

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        writing, tx = self._writing, self._tx
        assert tx is not None
        try:
            if exc is None:
                try:
                    await tx._commit()
                except BaseException:
                    await self._failed(tx)
                    raise
                tx._closed = True
                if writing.after_commit(tx._pending):
                    await writing.catch_up(await writing.storage.version())
            else:
                await self._failed(tx)
        finally:
            await self._holding.__aexit__(None, None, None)
        if exc is None:
            await writing.served(tx.last_receipt)

    async def _failed(self, tx: Transaction) -> None:
        tx._closed = True
        if tx.committed:  # cancelled while COMMIT ran: it committed all the same
            self._writing.after_blocking_commit(tx._pending)
        else:
            await self._writing.writer.rollback()


async def create_stream(writing: Writing, name: str, settings: StreamSettings) -> None:
    """Make ``name`` exist with ``settings``, in a transaction of its own."""
    if writing.storage.features.numbered_after_commit:
        async with transaction(writing):  # it may have records already: caught up
            await writing.writer.create_stream(name, settings)
        await writing.check()
        return
    async with transaction(writing) as tx:
        await tx._stream_id(name, settings)


class Transaction(AsyncSQL):
    """One transaction on the producer's database.

    Use ``execute`` for the application's own SQL (its database's placeholders: ``?`` on
    SQLite, ``%s`` on PostgreSQL) and ``publish`` for records; both commit together or
    not at all. Valid only inside its ``async with``.
    """

    def __init__(self, writing: Writing) -> None:
        super().__init__(writing.writer)
        self._writing = writing
        self._pending = Pending(writing)
        # Where records are numbered after the commit (PostgreSQL), the writer that
        # publishes them unnumbered.
        self._unnumbered: UnnumberedWriter | None = None
        if writing.storage.features.numbered_after_commit:
            self._unnumbered = cast(UnnumberedWriter, writing.writer)
        self.last_receipt: Receipt | None = None  # of the last unnumbered publish
        self.committed = False  # set once COMMIT returned, even to a cancelled caller

    async def publish(
        self,
        stream: str,
        value: bytes,
        *,
        key: bytes | None = None,
        headers: Mapping[str, bytes] | None = None,
        timestamp: int | None = None,
    ) -> int | Receipt:
        """Append a record to ``stream``; returns its seq (SQLite), or a ``Receipt``
        where seqs are given after the commit (PostgreSQL). Visible to consumers at
        commit."""
        self._check_open()
        checked = checked_record(value, key, headers, timestamp)
        if self._unnumbered is not None:
            return await self._publish_unnumbered(stream, [checked])
        stream_id = await self._stream_id(stream)
        seq = self._pending.append(stream, stream_id, *checked)
        if self._pending.full:
            await self._flush()
        return seq

    async def _publish_unnumbered(self, stream: str, records: list[CheckedRecord]) -> Receipt:
        assert self._unnumbered is not None
        limit = self._writing.max_record_size
        receipt: Receipt = await self._unnumbered.append(check_stream_name(stream), records, limit)
        self.last_receipt = receipt
        return receipt

    async def publish_many(self, stream: str, values: Iterable[bytes]) -> range | Receipt:
        """Append one record per value (no key, no headers); returns their seqs (or a
        ``Receipt``, as ``publish``)."""
        self._check_open()
        if self._unnumbered is not None:
            return await self._publish_unnumbered(stream, values_only(values))
        stream_id = await self._stream_id(stream)
        first = self._pending.next_seq(stream)
        for _ in self._pending.append_many(stream, stream_id, values):
            await self._flush()
        return range(first, self._pending.next_seq(stream))

    async def _stream_id(self, stream: str, settings: StreamSettings | None = None) -> int:
        """The stream's id, taking its lock at its first append here, and creating it
        (with ``settings``) if it is new."""
        stream_id = self._pending.stream_id(stream)
        if stream_id is None:
            state = await self._writing.append_state(stream, settings)
            stream_id = self._pending.start(stream, state)
        return stream_id

    async def _flush(self, closing: bool = False) -> None:
        await self._writing.writer.insert(*self._pending.take_inserts(closing))

    async def _commit(self) -> None:
        # Heads need no write of their own (the last seq in the log); epoch rows are written
        # only by a transaction that starts a segment, and commit with its records.
        await self._flush(closing=True)
        writer = self._writing.writer
        if writer.commit_here():  # no task, no loop turn holding the lock
            self._mark_committed()
        else:
            await to_the_end(writer.commit(), self._mark_committed)

    def _mark_committed(self) -> None:
        self.committed = True


class BlockingTransaction(BlockingSQL):
    """A transaction run as one plain function on the writer's thread.

    ``await producer.run_in_transaction(fn)`` calls ``fn(tx)`` there, between
    BEGIN and COMMIT, so a transaction of many statements costs one thread hop
    instead of one per statement. The same calls as ``Transaction``, not awaited;
    ``execute`` returns the driver's plain cursor.
    """

    def __init__(self, writing: Writing, writer: BlockingWriter, pending: Pending) -> None:
        super().__init__(writer)
        self._writer = writer
        self._writing = writing
        self._pending = pending

    def publish(
        self,
        stream: str,
        value: bytes,
        *,
        key: bytes | None = None,
        headers: Mapping[str, bytes] | None = None,
        timestamp: int | None = None,
    ) -> int:
        """As ``Transaction.publish``."""
        self._check_open()
        checked = checked_record(value, key, headers, timestamp)
        stream_id = self._stream_id(stream)
        seq = self._pending.append(stream, stream_id, *checked)
        if self._pending.full:
            self._flush()
        return seq

    def publish_many(self, stream: str, values: Iterable[bytes]) -> range:
        """As ``Transaction.publish_many``."""
        self._check_open()
        stream_id = self._stream_id(stream)
        first = self._pending.next_seq(stream)
        for _ in self._pending.append_many(stream, stream_id, values):
            self._flush()
        return range(first, self._pending.next_seq(stream))

    def _stream_id(self, stream: str) -> int:
        stream_id = self._pending.stream_id(stream)
        if stream_id is None:
            stream_id = self._pending.continued(stream)
        if stream_id is None:
            state = self._writing.memory_state(stream)
            if state is None:
                settings = StreamSettings()
                created = self._writer.create_stream(check_stream_name(stream), settings)
                state = self._writing.created_state(created, settings)
            stream_id = self._pending.start(stream, state)
        return stream_id

    def _flush(self, closing: bool = False) -> None:
        self._writer.insert(*self._pending.take_inserts(closing))

    def run_member(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        """``fn(self, *args)``; the caller inserts the records it left buffered (those of
        a whole commit group at once) and commits."""
        try:
            return fn(self, *args)
        finally:
            self._closed = True


class SyncTransaction(BlockingSQL):
    """A transaction on a connection of a thread's own (``storage.Session``): a
    ``SyncProducer``'s, and ``run_in_transaction``'s on PostgreSQL. ``execute`` runs the
    application's SQL (the driver's plain cursor); ``publish`` appends as
    ``streamq.publish`` does. Both commit together.

    ``with`` it: BEGIN, the block, COMMIT (ROLLBACK if the block raises); then
    ``committed(tx)``, if given. A class, not a generator: this is every sync
    transaction's path, and a generator's context manager costs microseconds here."""

    _closed = True  # until the with block begins it: else it would run in autocommit

    def __init__(
        self,
        session: Session,
        max_record_size: int,
        committed: Callable[[SyncTransaction], None] | None = None,
    ) -> None:
        super().__init__(session)
        self._session = session
        self._max_record_size = max_record_size
        self._committed = committed
        self._begun = False
        self.last_receipt: Receipt | None = None  # of the last unnumbered publish

    def __enter__(self) -> SyncTransaction:
        if self._begun:
            raise RuntimeError("a SyncTransaction runs once: ask for a new one")
        self._begun = True
        self._session.begin()
        self._closed = False
        return self

    def _why_closed(self) -> str:
        if not self._begun:
            return "a transaction runs in a with block: with tx: ..."
        return super()._why_closed()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._closed = True
        if exc_type is not None:
            self._session.rollback()
            return
        try:
            self._session.commit()
        except BaseException:
            self._session.rollback()
            raise
        if self._committed is not None:
            self._committed(self)

    def publish(
        self,
        stream: str,
        value: bytes,
        *,
        key: bytes | None = None,
        headers: Mapping[str, bytes] | None = None,
        timestamp: int | None = None,
    ) -> int | Receipt:
        """Append a record to ``stream``; returns its seq, or a ``Receipt`` where seqs
        are given after the commit (PostgreSQL). Visible to consumers at commit."""
        self._check_open()
        checked = checked_record(value, key, headers, timestamp)
        published = self._append(stream, [checked])
        return published if isinstance(published, Receipt) else published[0]

    def publish_many(self, stream: str, values: Iterable[bytes]) -> range | Receipt:
        """Append one record per value (no key, no headers); returns their seqs (or a
        ``Receipt``, as ``publish``)."""
        self._check_open()
        published = self._append(stream, values_only(values))
        return published if isinstance(published, Receipt) else seq_range(published)

    def _append(self, stream: str, records: list[CheckedRecord]) -> list[int] | Receipt:
        name = check_stream_name(stream)
        published: list[int] | Receipt = self._session.append(name, records, self._max_record_size)
        if isinstance(published, Receipt):
            self.last_receipt = published
        return published
