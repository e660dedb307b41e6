"""A consumer group: any number of worker processes sharing a stream's shares, with leases.

Each worker runs the same code: ``async with GroupConsumer(address, stream, db=...,
name=..., shares=n)`` and iterate, applying each batch. The worker is a member of the
group in the consumer's own database (``membership`` decides, ``engines.leases`` stores);
for each share it holds it runs one ``Consumer(share=(i, n))`` (the producer sends it
only that share's keys), all applying into one database connection, one transaction at
a time. A background task renews the member's row, takes the shares of members that
died or stalled, and gives shares back to members that joined, a few times a second.

A share moves between members only through the database: a member that takes it reads
its position after the take, and a batch applied under a lease that has moved on is
refused inside its transaction (``LeaseLostError``), so every record is applied once,
in key order, across kills, pauses and rebalances.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar

from ..consumer.batch import Batch, Fence
from ..consumer.consumer import Consumer
from ..consumer.database import ConsumerTransaction, open_position_store
from ..consumer.kept_store import Outage
from ..consumer.resharing import Floors
from ..consumer.settings import DB_RECONNECT_TIMEOUT
from ..consumer.subscription import FIRST_DELAY, MAX_DELAY, TRANSIENT
from ..engines import for_target
from ..errors import DatabaseUnavailableError, GroupSpecError, LeaseLostError, SharesChangedError
from ..metrics import ConsumerCollector, MetricsEndpoint
from ..sql import Durability
from .membership import Lease, plan, taken_from

T = TypeVar("T")

logger = logging.getLogger("streamq.group")


def _executor() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix="streamq-group")


@dataclass(eq=False, slots=True)
class _Held:
    """A share this member holds: its lease's token and the consumer reading it."""

    share: int
    split: int  # the group's number of shares when it was taken
    token: int
    consumer: Consumer
    handed: int = 0  # the last seq of the last batch handed to the application
    draining: bool = False  # being given back: no more batches handed out
    starting: asyncio.Task[None] | None = None
    taken_at: float = field(default_factory=time.time)  # Unix time


class GroupConsumer:
    """One worker of a consumer group: ``GroupConsumer(address, "orders", db="billing.db",
    name="billing", shares=8)``, run by as many processes as you like.

    ``shares`` is the group's split (``crc32(key) mod shares``, as ``Consumer(share=)``);
    the first member stores it, and a member asking for another is refused
    (``GroupSpecError``); ``None`` takes the stored one. Live members divide the shares
    evenly; members beyond ``shares`` wait as standbys. A member killed is seen dead at the
    others' next look (every ``poll_interval`` seconds: its process's lock is gone); one
    that stops renewing its lease (paused, cut off from the database) loses its shares
    after ``lease_timeout`` seconds, and stops applying them by itself by then.

    Iterate for batches, from whichever share has one, and apply each with ``apply`` or
    ``transaction``, as with a ``Consumer``. Applying a batch of a share this member no
    longer holds raises ``LeaseLostError`` (nothing commits; the new holder applies it):
    catch it and go on. Other keyword arguments (``on_failure``, ``reconnect_timeout``,
    ``db_reconnect_timeout``, ``filter``, ``metrics``, ...) go to each share's ``Consumer``;
    ``db_reconnect_timeout`` also bounds how long the member goes on without reaching the
    group's rows (the database restarting): past it, ``DatabaseUnavailableError``.
    ``metrics_port`` serves, on one endpoint (``metrics_address``), every share's
    consumer metrics and the member's own: ``streamq_group_shares``,
    ``streamq_group_shares_held``, ``streamq_group_takes_total`` and
    ``streamq_group_losses_total``, labelled by group, stream and member id.
    """

    def __init__(
        self,
        address: str,
        stream: str,
        *,
        db: str,
        name: str,
        shares: int | None = None,
        lease_timeout: float = 10.0,
        poll_interval: float = 0.2,
        durability: Durability = "normal",
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        **options: Any,
    ) -> None:
        if not name:
            raise ValueError("a consumer group needs a name= to store its positions under")
        if shares is not None and not 1 <= shares <= 1 << 16:
            raise ValueError(f"shares must be between 1 and 65536, not {shares!r}")
        if not 4 * poll_interval <= lease_timeout:
            raise ValueError(
                f"lease_timeout ({lease_timeout!r} s) must be at least 4 poll intervals "
                f"({poll_interval!r} s)"
            )
        if "share" in options:
            raise ValueError("a group member's shares are given by the group: no share=")
        self._metrics = MetricsEndpoint(metrics_port, metrics_host, options.get("metrics"))
        if self._metrics.collector is not None:  # every share's consumer reports there
            options["metrics"] = self._metrics.collector
        self._collector: ConsumerCollector | None = None  # the one the member reports to
        self.address = address
        self.stream = stream
        self.name = name
        self.shares = shares  # the group's split, once joined
        self.lease_timeout = lease_timeout
        self.poll_interval = poll_interval
        self._durability = durability
        self._options = options
        given = options.get("settings")
        default = DB_RECONNECT_TIMEOUT if given is None else given.db_reconnect_timeout
        self._db_reconnect_timeout: float | None = options.get("db_reconnect_timeout", default)
        self._outage: Outage | None = None  # the database unusable since, for the group's rows
        self._store = open_position_store(db, durability)
        self._leases = for_target(db).open_leases(db, name, stream)
        self._tx_lock = asyncio.Lock()  # one transaction at a time on the shared connection
        self._held: dict[int, _Held] = {}
        self._changed = asyncio.Event()  # the held shares changed: look again
        self._changed_wait: asyncio.Task[Any] | None = None  # __anext__'s, for it
        self._progress = asyncio.Event()  # a batch was applied: a share being given back
        self._next: dict[Consumer, asyncio.Task[Batch]] = {}
        self._turn = 0
        self._errors: list[BaseException] = []
        self._task: asyncio.Task[None] | None = None
        self._table_lock = asyncio.Lock()  # the lease table is one connection
        self._executor = _executor()  # its thread
        self._renewed_at = 0.0  # the loop's time when the member's row was last renewed
        self._stalled = False  # renewals failing for lease_timeout: shares dropped
        self._closed = False
        self._floors: dict[str, Floors] = {}  # as read at the last take
        self.takes = 0  # shares taken (at start, after a death, on rebalance)
        self.losses = 0  # shares lost to another member (this one was seen stalled)

    @property
    def metrics_address(self) -> str:
        """``host:port`` of this member's own Prometheus endpoint (``metrics_port=``)."""
        return self._metrics.address

    @property
    def member(self) -> int:
        """This worker's member id in the group's tables."""
        return self._leases.member

    @property
    def taken_at(self) -> dict[int, float]:
        """When each share held was taken (Unix time): its lease's age."""
        return {share: held.taken_at for share, held in self._held.items()}

    @property
    def held(self) -> list[int]:
        """The shares this worker holds now."""
        return sorted(self._held)

    # --- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        """Open the database and join the group; shares are taken in the background."""
        try:
            self._collector = self._metrics.open()
            await self._store.open()
            await self._join()
        except BaseException:
            await self.close()
            raise
        if self._collector is not None:
            self._collector.add_group(self)
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        """Stop applying, give every share back (the others take them at once) and close."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])  # a cancel of close itself is not swallowed
        if self._changed_wait is not None:
            self._changed_wait.cancel()
        for task in self._next.values():
            task.cancel()
        await asyncio.gather(*self._next.values(), return_exceptions=True)
        self._next.clear()
        for held in self._held.values():
            if held.starting is not None:
                held.starting.cancel()
        await asyncio.gather(
            *(h.starting for h in self._held.values() if h.starting), return_exceptions=True
        )
        await self._applies_ended()
        await asyncio.gather(*(held.consumer.close() for held in self._held.values()))
        self._held.clear()
        try:
            await self._table("leave")
        except Exception as exc:  # the rows expire; the liveness lock went with the connection
            logger.warning("group %r: leaving failed (%r)", self.name, exc)
        if self._collector is not None:
            self._collector.remove_group(self)
        await self._metrics.close()
        self._executor.shutdown(wait=False)
        await self._store.close()

    async def __aenter__(self) -> GroupConsumer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # --- membership ----------------------------------------------------------

    async def _table(self, method: str, *args: Any) -> Any:
        """Call the lease table's ``method`` on its thread, one call at a time; a cancel
        waits for it. A call that takes longer than ``lease_timeout`` (a database cut off)
        is left to its thread with its connection, never used again: ``TimeoutError``."""
        async with self._table_lock:
            loop = asyncio.get_running_loop()
            call = loop.run_in_executor(self._executor, getattr(self._leases, method), *args)
            abandoned = False
            try:
                # asyncio.timeout, not wait_for: on 3.11 wait_for drops a cancel that arrives
                # as the call ends (CPython gh-86296), and close() would wait for ever.
                async with asyncio.timeout(self.lease_timeout):
                    return await asyncio.shield(call)
            except TimeoutError:
                abandoned = True
                self._abandon()
                raise TimeoutError(
                    f"the consumer database did not answer for {self.lease_timeout:g} s "
                    f"(lease_timeout): {self._leases.where}"
                ) from None
            finally:
                if not abandoned and not call.done():
                    with contextlib.suppress(BaseException):
                        await asyncio.wait([call])

    def _abandon(self) -> None:
        """Leave the lease table's hung call to its thread; the next call, on a new
        connection, joins again."""
        self._executor.submit(self._leases.close)  # once the hung call returns, if ever
        self._executor.shutdown(wait=False)
        self._executor = _executor()
        self._leases = for_target(self._leases.db).open_leases(
            self._leases.db, self.name, self.stream
        )
        self._stalled = True

    @property
    def _ttl_ms(self) -> int:
        return int(self.lease_timeout * 1000)

    async def _join(self) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        self.shares = await self._table("join", self.shares, self._ttl_ms)
        self._renewed_at = started

    async def _run(self) -> None:
        """Renew, look and act, every ``poll_interval``, until closed."""
        loop = asyncio.get_running_loop()
        while not self._closed:
            try:
                if self._stalled:
                    await self._rejoin()
                await self._step(loop)
                if self._outage is not None:
                    self._outage.ended()
                    self._outage = None
            except GroupSpecError as exc:
                await self._stop_all(lost=True)
                self._fail(exc)
                return
            except Exception as exc:
                try:
                    self._unusable(exc)
                except DatabaseUnavailableError as error:
                    await self._stop_all(lost=True)
                    self._fail(error)
                    return
                silent = loop.time() - self._renewed_at
                if silent >= self.lease_timeout and self._held:
                    logger.error(
                        "group %r: the consumer database has not answered for %.1f s (%r): "
                        "stopped applying shares %s, which the other members take over",
                        self.name, silent, exc, self.held,
                    )  # fmt: skip
                    self._stalled = True  # its row has expired: join again, as a new member
                    await self._stop_all(lost=True)
                else:
                    logger.warning("group %r: membership step failed (%r)", self.name, exc)
            await asyncio.sleep(self.poll_interval)

    def _unusable(self, error: Exception) -> None:
        """Count a failed step against ``db_reconnect_timeout`` if the database could not
        be used (a lost connection, a lock, a call that did not answer): past it,
        ``DatabaseUnavailableError``, as a share's consumer ends."""
        if not (isinstance(error, TimeoutError) or self._store.unavailable(error)):
            return
        if self._outage is None:
            self._outage = Outage(self._store.where, self._db_reconnect_timeout, error)
        self._outage.check(error)

    async def _step(self, loop: asyncio.AbstractEventLoop) -> None:
        started = loop.time()
        if started - self._renewed_at >= self.lease_timeout / 4:
            if not await self._table("renew", self._ttl_ms):
                logger.warning("group %r: this member was seen dead; joining again", self.name)
                await self._stop_all(lost=True)
                self._stalled = True
                return
            self._renewed_at = started
        if loop.time() - self._renewed_at >= self.lease_timeout and self._held:
            raise TimeoutError("renewing the member's row took longer than lease_timeout")
        view = await self._table("view")
        if view.shares != self.shares:  # resharing: every lease of the old split is gone
            logger.info("group %r: split into %d shares now", self.name, view.shares)
            await self._stop_all(lost=True)
            self.shares = view.shares
        tokens = {share: held.token for share, held in self._held.items()}
        for share in taken_from(view, self.member, tokens):
            logger.warning("group %r: share %d was taken over by another member", self.name, share)
            self.losses += 1
            if (held := self._held.get(share)) is not None:
                await self._stop(held, lost=True)
        for lease in view.held_by(self.member):
            if lease.share not in self._held:  # its consumer failed to start: let it go
                await self._table("give_back", lease.share, lease.token)
                return  # look again, with the lease free
        decided = plan(view, self.member)
        for share in decided.give_back:
            if (held := self._held.get(share)) is not None:
                await self._give_back(held)
        for lease in decided.take:
            await self._take(lease)

    async def _rejoin(self) -> None:
        """Join again as a new member (the old one's row and leases are gone or going)."""
        await self._table("close")
        self._leases = for_target(self._leases.db).open_leases(
            self._leases.db, self.name, self.stream
        )
        await self._join()
        self._stalled = False
        logger.info("group %r: joined again as member %d", self.name, self.member)

    async def _take(self, lease: Lease) -> None:
        if self._errors:
            return  # a share's consumer failed: this member stops taking shares
        token = await self._table("take", lease)
        if token is None:
            return  # another member was quicker, or the holder is alive after all
        self._floors = await self._table("floors")  # read after the take
        assert self.shares is not None
        held = _Held(lease.share, self.shares, token, self._consumer(lease.share, self.shares))
        self._held[lease.share] = held
        self.takes += 1
        # Apart from this task: a producer being waited for must not hold up renewals.
        held.starting = asyncio.create_task(self._start_share(held))

    def _consumer(self, share: int, split: int) -> Consumer:
        consumer = Consumer(
            self.address,
            self.stream,
            name=self.name,
            share=(share, split),
            durability=self._durability,
            **self._options,
        )
        consumer.apply_into(self._store, self._tx_lock)
        consumer.subscription.floors = self._floors
        return consumer

    async def _start_share(self, held: _Held) -> None:
        """Start the share's consumer, which reads its position (after the take): again
        with backoff while the producer cannot be reached (restarting, say); any other
        failure is raised from the iteration, and this member takes no more shares."""
        delay = FIRST_DELAY
        while True:
            held.consumer.turn.fence = Fence(self.name, held.share, held.token)
            try:
                await held.consumer.start()
                break
            except TRANSIENT as exc:
                logger.warning(
                    "group %r: share %d cannot reach the producer at %s (%r); again in %.2g s",
                    self.name, held.share, self.address, exc, delay,
                )  # fmt: skip
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_DELAY)
                held.consumer = self._consumer(held.share, held.split)
            except SharesChangedError as exc:
                held.starting = None
                if await self._resplit(held):
                    return  # taken under the split a reshare just replaced: dropped
                self._fail(exc)  # positions of a split this group never had
                await self._give_back(held)
                return
            except Exception as exc:
                held.starting = None
                self._fail(exc)
                await self._give_back(held)
                return
        held.starting = None
        self._changed.set()

    async def _resplit(self, held: _Held) -> bool:
        """Whether the group's split is no longer the one ``held`` was taken under (a
        reshare committed meanwhile); then the share is dropped, its lease gone."""
        view = await self._table("view")
        if view.shares == held.split:
            return False
        await self._stop(held, lost=True)
        return True

    async def _give_back(self, held: _Held) -> None:
        """Stop reading ``held``'s share, let a batch handed out of it be applied (for at
        most a lease timeout), and release its lease."""
        await self._stop(held, lost=False)
        await self._table("give_back", held.share, held.token)

    async def _stop(self, held: _Held, *, lost: bool) -> None:
        """Stop applying ``held`` (by the object: a share of the same number taken under
        a newer split is another)."""
        if held.draining or self._held.get(held.share) is not held:
            return
        held.draining = True
        task = self._next.pop(held.consumer, None)
        if task is not None:
            task.cancel()  # a batch read but not handed out: the next holder reads it again
        if held.starting is not None:
            held.starting.cancel()
            await asyncio.wait([held.starting])  # a cancel of this caller is not swallowed
        if not lost:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.lease_timeout):
                    while held.consumer.applied < held.handed:
                        self._progress.clear()
                        await self._progress.wait()
        del self._held[held.share]
        if not lost:  # an apply under way ends first; a lost share's is fenced anyway
            await self._applies_ended()
        await held.consumer.close()
        self._changed.set()

    async def _applies_ended(self) -> None:
        """Wait for an apply under way to end, for at most a lease timeout (one waiting on
        a database cut off may never end; its share is fenced then)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.lease_timeout):
                async with self._tx_lock:
                    pass

    async def _stop_all(self, *, lost: bool) -> None:
        for held in list(self._held.values()):
            await self._stop(held, lost=lost)

    def _fail(self, error: BaseException) -> None:
        """Raise ``error`` from the iteration (a share's consumer could not start, say)."""
        self._errors.append(error)
        self._changed.set()

    # --- receiving -----------------------------------------------------------

    def __aiter__(self) -> GroupConsumer:
        return self

    async def __anext__(self) -> Batch:
        """The next batch from whichever held share has one; waits while none is held."""
        while True:
            if self._errors:
                raise self._errors.pop(0)
            if self._closed:
                raise StopAsyncIteration
            # One waiter for changes, until one comes (not a task per batch): made before
            # the held shares are looked at, so a change after that look wakes the wait.
            changed = self._changed_wait
            if changed is None or changed.done():
                self._changed.clear()
                changed = self._changed_wait = asyncio.ensure_future(self._changed.wait())
            held = [item for item in self._held.values() if not (item.draining or item.starting)]
            for item in held:
                if item.consumer not in self._next:
                    self._next[item.consumer] = asyncio.ensure_future(item.consumer.__anext__())
            # Cancelling this wait leaves the reads running: no batch is dropped.
            done, _ = await asyncio.wait(
                [*self._next.values(), changed], return_when=asyncio.FIRST_COMPLETED
            )
            count = len(held)
            for i in range(count):
                item = held[(self._turn + i) % count]
                task = self._next.get(item.consumer)
                if task is None or task not in done or self._held.get(item.share) is not item:
                    continue
                self._turn = (self._turn + i + 1) % count
                del self._next[item.consumer]
                try:
                    batch = task.result()  # a share's consumer's error is raised here
                except StopAsyncIteration:
                    break  # closed as the share was dropped: look again
                except SharesChangedError:
                    # Reconnected after a reshare committed, and before this member saw it.
                    if await self._resplit(item):
                        break
                    raise
                item.handed = batch.last_seq
                return batch

    # --- applying ------------------------------------------------------------

    def _holder(self, batch: Batch) -> _Held:
        fence = batch.fence
        if fence is None or fence.group != self.name:
            raise ValueError(
                f"batch of consumer {batch.consumer!r}: apply it with the group member "
                "that received it"
            )
        held = self._held.get(fence.share)
        if held is None or held.token != fence.token:
            raise LeaseLostError(
                f"consumer group {self.name!r}: this worker no longer holds share "
                f"{fence.share} of stream {self.stream!r} (given back or taken over since the "
                "batch was received); the batch is not applied here: the share's holder "
                "applies it"
            )
        return held

    async def apply(self, batch: Batch, fn: Callable[..., T], *args: Any) -> T:
        """``Consumer.apply`` on the share ``batch`` came from, under its lease."""
        async with self._applying(batch) as consumer:
            return await consumer.apply(batch, fn, *args)

    @contextlib.asynccontextmanager
    async def transaction(self, batch: Batch) -> AsyncIterator[ConsumerTransaction]:
        """``Consumer.transaction`` on the share ``batch`` came from, under its lease."""
        async with self._applying(batch) as consumer, consumer.transaction(batch) as tx:
            yield tx

    @contextlib.asynccontextmanager
    async def _applying(self, batch: Batch) -> AsyncIterator[Consumer]:
        """The consumer of ``batch``'s share, to apply it with: a lease found lost on the
        way drops the share; a share being given back learns that its batch ended."""
        held = self._holder(batch)
        try:
            yield held.consumer
        except LeaseLostError:
            self.losses += 1
            await self._stop(held, lost=True)
            raise
        finally:
            self._progress.set()

    @property
    def lag(self) -> int:
        """Records of the held shares' keys not yet applied here, as last reported."""
        return sum(held.consumer.lag for held in self._held.values())
