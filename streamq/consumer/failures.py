"""Poison records: what ``Consumer.apply`` does when the application's function raises.

``Consumer(on_failure=...)`` chooses: ``Stop`` (the default), ``Retry`` (the batch again,
with backoff), ``DeadLetter`` (park the record that fails alone in
``streamq_dead_letters``, in the transaction that moves the position past it). To find
that record, the batch is applied once more in halves, each under a savepoint, in one
transaction (``_Parts``). ``Policies`` runs a consumer's applies under its policy, and
re-applies parked records marked for retry: before a batch, and while none comes.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar, cast

import msgpack

from ..errors import RecordFailedError
from ..protocol import Record
from .batch import Batch
from .position_store import stored_record

if TYPE_CHECKING:
    from .turn import Turn

T = TypeVar("T")

logger = logging.getLogger("streamq.consumer")


@dataclass(frozen=True, slots=True)
class Stop:
    """``on_failure`` default: at a record whose apply fails, stop. Nothing of its batch
    commits (the batch is applied again after a restart) and ``apply`` raises the
    application's own exception, as it always did, with a note naming the consumer,
    producer, stream and seq (shown in its traceback)."""


@dataclass(frozen=True, slots=True)
class Retry:
    """``on_failure``: apply a failed batch again, up to ``times`` more times, waiting
    ``backoff`` seconds before the first retry, doubling up to ``max_backoff``. Then stop
    at the record that fails alone, with ``RecordFailedError`` naming it."""

    times: int = 5
    backoff: float = 0.05
    max_backoff: float = 5.0

    def __post_init__(self) -> None:
        if self.times < 0 or self.backoff < 0 or self.max_backoff < 0:
            raise ValueError(f"Retry takes no negative numbers: {self}")

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1, 2, ...)."""
        return float(min(self.backoff * 2 ** (retry - 1), self.max_backoff))


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """``on_failure``: after ``retry``, park each record that fails alone in the
    consumer's table ``streamq_dead_letters`` (with the error's traceback), in the
    transaction that applies the batch's other records and moves the position past it,
    and go on. ``streamq dead-letters list|retry DB`` shows them and has them re-applied."""

    retry: Retry = field(default_factory=lambda: Retry(times=0))


FailurePolicy = Stop | Retry | DeadLetter


class Policies:
    """One consumer's applies under its ``on_failure`` policy, through its ``Turn``
    (counted: ``retried``, ``parked``, ``reapplied``). ``failed(error)`` reports a failure
    of the consumer's own background work (re-applying records marked for retry), for its
    next batch to raise."""

    def __init__(
        self, turn: Turn, policy: FailurePolicy, failed: Callable[[BaseException], None]
    ) -> None:
        self._turn = turn
        self.policy = policy
        self._failed = failed
        self.retried = 0  # failed batches applied again (Retry)
        self.parked = 0  # records parked in streamq_dead_letters (DeadLetter), committed
        self.reapplied = 0  # parked records re-applied on request (``retry_dead_letters``)
        self._closed = False
        self._letters_due = 0.0  # when the consumer next looks for records marked for retry
        # The application's function for them: the last one given to ``apply`` or
        # ``retry_dead_letters``, with its arguments; None before the first.
        self._letters_fn: tuple[Callable[..., Any], tuple[Any, ...]] | None = None
        self._watching: asyncio.Task[None] | None = None  # looks for them while idle
        self._applying = 0  # ``apply`` calls under way (one waiting out a backoff included)

    async def apply(self, batch: Batch, fn: Callable[..., T], *args: Any) -> T:
        """``Consumer.apply``."""
        self._applying += 1
        try:
            if self._turn.store is not None:
                self._remember(fn, args)
                if time.monotonic() >= self._letters_due:
                    await self._retry_letters(fn, args)
            return await self._apply(batch, fn, *args)
        finally:
            self._applying -= 1

    async def _apply(self, batch: Batch, fn: Callable[..., T], *args: Any) -> T:
        retry = self._retry_policy()
        calls = _Calls(fn)
        tries = 0
        while True:
            try:
                async with self._turn.lock:
                    store = self._turn.check(batch)
                    return await store.apply(batch, calls, args, lambda: self._turn.applied(batch))
            except Exception as exc:
                if exc is not calls.error:
                    raise  # the database's, or streamq's: not the record's
                tries += 1
                if tries > retry.times:
                    failed = exc
                    break  # out of this handler: what the parts raise is not chained to it
                self.retried += 1
                delay = retry.delay(tries)
                logger.warning(
                    "consumer %r: applying seqs %d..%d of stream %r failed (%r); "
                    "retry %d of %d in %.3g s",
                    self._turn.name, batch.first_seq, batch.last_seq, self._turn.stream, exc,
                    tries, retry.times, delay,
                )  # fmt: skip
            await asyncio.sleep(delay)  # the lock is free meanwhile
        return await self._apply_in_parts(batch, fn, args, tries, failed)

    def _retry_policy(self) -> Retry:
        policy = self.policy
        if isinstance(policy, Retry):
            return policy
        return policy.retry if isinstance(policy, DeadLetter) else _NO_RETRY

    async def _apply_in_parts(
        self,
        batch: Batch,
        fn: Callable[..., T],
        args: tuple[Any, ...],
        tries: int,
        error: Exception,
    ) -> T:
        """The batch that failed ``tries`` times (last with ``error``), in halves down to
        the records that fail alone: parked with ``DeadLetter``, else the end."""
        park = isinstance(self.policy, DeadLetter)
        if not batch.records:
            raise error  # no record to blame: the function fails on an empty batch
        if len(batch) == 1 and not park:
            self._give_up(batch, _Failure(batch.records[0], error, tries))
        assert self._turn.store is not None
        parts = _Parts(fn, args, tries, error, self._turn.store.dead_letters.park if park else None)

        def committed() -> None:
            self._turn.applied(batch, len(parts.parked))
            self.parked += len(parts.parked)

        try:
            async with self._turn.lock:
                store = self._turn.check(batch)
                result = await store.apply(batch, parts, (), committed)
        except Exception as exc:
            if parts.stopped is None or exc is not parts.stopped.error:
                raise
            self._give_up(batch, parts.stopped)
        for failure in parts.parked:
            logger.warning(
                "consumer %r parked seq %d of stream %r from producer %s (%d failed tries): %r",
                self._turn.name, failure.record.seq, self._turn.stream, batch.producer_id,
                failure.attempts, failure.error,
            )  # fmt: skip
        return cast(T, result)

    def _give_up(self, batch: Batch, failure: _Failure) -> NoReturn:
        """Stop at ``failure``'s record: nothing of ``batch`` committed."""
        record, error = failure.record, failure.error
        where = (
            f"seq {record.seq} of stream {self._turn.stream!r} from producer {batch.producer_id} "
            f"at {self._turn.address}"
        )
        tries = "1 try" if failure.attempts == 1 else f"{failure.attempts} tries"
        rest = (
            f"nothing of its batch (seqs {batch.first_seq}..{batch.last_seq}) committed; the "
            f"consumer's position stays at {self._turn.position}"
        )
        if isinstance(self.policy, Stop):
            error.add_note(
                f"streamq: consumer {self._turn.name!r} stopped at {where}: applying it failed "
                f"({tries}); {rest}. on_failure=streamq.Retry(...) retries, "
                "streamq.DeadLetter() parks such records and goes on."
            )
            raise error
        raise RecordFailedError(
            f"consumer {self._turn.name!r} stopped at {where}: applying it failed {tries} "
            f"({self.policy}): {error!r}; {rest}",
            consumer=self._turn.name,
            producer_id=batch.producer_id,
            address=self._turn.address,
            stream=self._turn.stream,
            seq=record.seq,
            attempts=failure.attempts,
        ) from error

    async def retry_dead_letters(self, fn: Callable[..., Any], *args: Any) -> int:
        """``Consumer.retry_dead_letters``."""
        if self._turn.store is None:
            return 0
        self._remember(fn, args)
        return await self._retry_letters(fn, args)

    def _remember(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """Re-apply marked records with ``fn`` from now on, looking for them by itself too."""
        self._letters_fn = (fn, args)
        if (self._watching is None or self._watching.done()) and not self._closed:
            self._watching = asyncio.create_task(self._watch_letters())

    async def _watch_letters(self) -> None:
        """Look for records marked for retry while no batch comes (``apply`` looks only
        before one: on a quiet stream they would wait for the next record): once a second
        at most, counting ``apply``'s looks, and never during an ``apply``. A failure that
        is not a record's (the database's) ends the looking until the next ``apply``: it
        is logged and raised from the next batch the application asks for."""
        while True:
            wait = self._letters_due - time.monotonic()
            if wait > 0 or self._applying:
                await asyncio.sleep(wait if wait > 0 else _LETTERS_INTERVAL)
                continue
            assert self._letters_fn is not None
            fn, args = self._letters_fn
            try:
                await self._retry_letters(fn, args)
            except Exception as exc:
                logger.error(
                    "consumer %r: re-applying records marked for retry failed (%r); "
                    "raised from its next batch",
                    self._turn.name, exc,
                )  # fmt: skip
                self._failed(exc)
                return

    async def close(self) -> None:
        """Stop looking for records marked for retry (one being re-applied is finished)."""
        self._closed = True
        if self._watching is not None:
            self._watching.cancel()
            await asyncio.wait([self._watching])  # a cancel of close itself is not swallowed

    async def _retry_letters(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> int:
        """Re-apply the marked records with ``fn``, all under the transaction lock: no
        batch is applied meanwhile."""
        self._letters_due = time.monotonic() + _LETTERS_INTERVAL
        if self._turn.store is None or self._turn.producer_id is None:
            return 0
        async with self._turn.lock:
            return await self._reapply_marked(fn, args)

    async def _reapply_marked(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> int:
        """``_retry_letters``, the lock held."""
        turn = self._turn
        assert turn.store is not None and turn.producer_id is not None
        store, sql = turn.store, turn.store.dead_letters
        key = (turn.name, turn.producer_id, turn.stream)
        rows = await store.run_transaction(_fetch_all, sql.requested, key)
        applied = 0
        for seq, timestamp, record_key, value, headers in rows:
            record = stored_record(seq, timestamp, record_key, value, headers)
            letter = Batch(
                turn.stream, turn.producer_id, record.seq - 1, (record,), 0, turn.name,
                turn.address, turn.origin,
            )  # fmt: skip
            calls = _Calls(fn)
            try:
                taken = await store.run_transaction(
                    _reapply, sql.take, (*key, record.seq), calls, letter, args
                )
            except Exception as exc:
                if exc is not calls.error:
                    raise
                await store.run_transaction(
                    _execute, sql.failed_again, (_error_text(exc), *key, record.seq)
                )
                logger.warning(
                    "consumer %r: parked seq %d of stream %r failed again (%r): it stays parked",
                    turn.name, record.seq, turn.stream, exc,
                )  # fmt: skip
                continue
            if taken:
                applied += 1
                self.reapplied += 1
        return applied


# How often the consumer looks for parked records marked for retry, in seconds.
_LETTERS_INTERVAL = 1.0
_NO_RETRY = Retry(times=0)
# One savepoint at a time: each part is rolled back to it, or released, before the next.
_SAVEPOINT = "SAVEPOINT streamq_part"
_ROLLBACK_TO = "ROLLBACK TO SAVEPOINT streamq_part"
_RELEASE = "RELEASE SAVEPOINT streamq_part"


class _Calls:
    """``fn`` as ``apply`` runs it, remembering the exception it raised: that one is the
    record's failure; any other comes from the database or streamq."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.error: Exception | None = None

    def __call__(self, tx: Any, batch: Batch, *args: Any) -> Any:
        try:
            return self.fn(tx, batch, *args)
        except Exception as exc:
            self.error = exc
            raise


@dataclass(slots=True)
class _Failure:
    record: Record
    error: Exception
    attempts: int  # tries that held the record and failed


class _Parts:
    """A batch that failed, applied in halves down to the records that fail alone, each
    part under a savepoint, all in the transaction ``store.apply`` runs it in (on the
    database's thread). Parts go in seq order, so the others keep their order.

    ``park`` (the engine's INSERT): each record that fails alone is parked there and the
    rest goes on. None: the first stops it all (``stopped``, its exception raised, and
    the transaction rolls back).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        tries: int,
        error: Exception,
        park: str | None,
    ) -> None:
        self.fn, self.args, self.tries, self.error, self.park = fn, args, tries, error, park
        self.parked: list[_Failure] = []
        self.stopped: _Failure | None = None
        self.results: list[Any] = []

    def __call__(self, tx: Any, batch: Batch) -> Any:
        # (first, end, failed tries holding these records, the last one's error or None
        # if this part is still to be tried); the whole batch has failed already.
        todo: list[tuple[int, int, int, Exception | None]] = [
            (0, len(batch), self.tries, self.error)
        ]
        while todo:
            first, end, tries, error = todo.pop()
            if error is None:
                error = self._try(tx, _part(batch, first, end))
                if error is None:
                    continue
                tries += 1
            if end - first > 1:
                middle = (first + end) // 2
                todo += [(middle, end, tries, None), (first, middle, tries, None)]
                continue
            failure = _Failure(batch.records[first], error, tries)
            if self.park is None:
                self.stopped = failure
                raise error
            record = failure.record
            tx.execute(
                self.park,
                (
                    batch.consumer, batch.producer_id, batch.stream, record.seq, record.key,
                    record.value, msgpack.packb(record.headers, use_bin_type=True),
                    record.timestamp, _error_text(error), tries, int(time.time() * 1000),
                ),
            )  # fmt: skip
            self.parked.append(failure)
        return _combined(self.results)

    def _try(self, tx: Any, part: Batch) -> Exception | None:
        """Apply ``part`` under a savepoint: None if it did, else its exception (and the
        savepoint rolled back). A transaction the database ended meanwhile is not a
        record's failure: that error is raised."""
        outer = sys.exc_info()[1]  # one the caller is handling, if any: not this record's
        tx.execute(_SAVEPOINT)
        try:
            self.results.append(self.fn(tx, part, *self.args))
        except Exception as exc:
            tx.execute(_ROLLBACK_TO)
            tx.execute(_RELEASE)
            return _unchained(exc, outer)
        tx.execute(_RELEASE)
        return None


def _unchained(error: Exception, outer: BaseException | None) -> Exception:
    """``error`` cut loose from ``outer``, the exception being handled when the function
    was called: Python chains it as context, but it is another failure (the caller's),
    and a parked record's stored error must be its own."""
    link: BaseException | None = error
    seen: set[int] = set()
    while outer is not None and link is not None and id(link) not in seen:
        seen.add(id(link))
        if link.__context__ is outer:
            link.__context__ = None
            break
        link = link.__cause__ or link.__context__
    return error


def _part(batch: Batch, first: int, end: int) -> Batch:
    """Records ``first`` to ``end`` (exclusive) of ``batch`` as a batch of their own."""
    after = batch.records[first - 1].seq if first else batch.after
    records = batch.records[first:end]
    return Batch(
        batch.stream, batch.producer_id, after, records, batch.epoch, batch.consumer,
        batch.endpoint, batch.origin, fence=batch.fence,
    )  # fmt: skip


def _combined(results: list[Any]) -> Any:
    """The parts' results as one: added up if all numbers, all lists or all tuples."""
    if not results:
        return None
    for kind in ((int, float), list, tuple):
        if all(isinstance(r, kind) and not isinstance(r, bool) for r in results):
            total = results[0]
            for r in results[1:]:
                total = total + r
            return total
    return results[-1]


def _error_text(error: BaseException) -> str:
    return "".join(traceback.format_exception(error)).rstrip()


def _fetch_all(tx: Any, sql: str, params: tuple[Any, ...]) -> list[Any]:
    return list(tx.execute(sql, params).fetchall())


def _execute(tx: Any, sql: str, params: tuple[Any, ...]) -> None:
    tx.execute(sql, params)


def _reapply(
    tx: Any, take: str, params: tuple[Any, ...], calls: _Calls, letter: Batch, args: tuple[Any, ...]
) -> bool:
    """Delete the dead-letter row marked for retry and apply its record, in one
    transaction; False if the row is gone (another process re-applied it)."""
    if tx.execute(take, params).rowcount != 1:
        return False
    calls(tx, letter, *args)
    return True
