"""Group commit: concurrent ``run_in_transaction`` calls of one producer share a COMMIT.

A COMMIT costs far more than a short transaction's statements, above all with
``durability="full"``, where it waits for an fsync. Transactions that arrive while the
writer is busy queue up; the next time the writer is free, one hop to its thread runs
them all, in arrival order, inside one database transaction, each under its own
SAVEPOINT, and commits once:

- a member that raises rolls back to its savepoint alone; the others still commit;
- a member's seqs follow those of the members before it (as if they had committed one
  by one, in that order), and it sees their effects, as it would have serially;
- a member's call returns only once the group's COMMIT has returned; a COMMIT that
  fails (or an error that aborts the whole transaction, such as a full disk) fails
  every member, and none is acknowledged.

A lone transaction runs as before: no savepoint, one COMMIT.

Where it costs no one a wait, the group runs on the event loop's own thread: a short
transaction costs less than the hop to the writer's thread and back (two thread
wake-ups), most of all on a loaded machine. It does while groups take under 1 ms on
average (``sql.InlineBudget``) and no other connection holds the write lock (BEGIN
would wait for it), never with ``durability="full"``: there each COMMIT waits for an fsync, and
the next group gathers meanwhile. Other connections' commits are caught up before BEGIN
where they can be (``bench.tools.lock_hold``: the write lock is held for the group, not for
a catch-up and a hop).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from ..sql import InlineBudget, to_the_end
from .storage import BlockingWriter, EpochRow, LogRow, ThreadedWriter, TimeRow, WouldWait
from .transactions import BlockingTransaction
from .writing import Appending, OthersCommitted, Pending, Writing

T = TypeVar("T")


@dataclass(slots=True, eq=False)
class _Member:
    """One queued transaction: its function, and what became of it."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: asyncio.Future[Any]
    pending: Pending | None = None  # set once it ran and was released into the group
    result: Any = None
    error: BaseException | None = None
    taken: bool = field(default=False)  # in a group already: too late to withdraw


class GroupCommit:
    """The producer's queue of blocking transactions and the task that commits them."""

    def __init__(self, writing: Writing) -> None:
        self._writing = writing
        self._queue: list[_Member] = []
        self._loop: asyncio.AbstractEventLoop | None = None  # the producer's, once running
        self._committer: asyncio.Task[None] | None = None
        self.groups = 0  # COMMITs run for queued transactions
        self.members = 0  # transactions committed in them
        self.inline = 0  # groups run on the event loop's thread
        self._budget = InlineBudget()
        # Commits wait for an fsync: on the writer's thread, while the next group gathers.
        self._full = writing.durability == "full"

    async def run(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        """Queue ``fn(tx, *args)``; its result once its group has committed.

        Cancelled while queued, it is withdrawn and never runs; cancelled once taken, it
        runs to the end (its outcome must be known) and the cancel is re-raised after.
        """
        loop = self._loop
        if loop is None:  # asked once: each ask costs a system call (the pid's check)
            loop = self._loop = asyncio.get_running_loop()
        member = _Member(fn, args, loop.create_future())
        self._queue.append(member)
        if self._committer is None:
            # A task of its own: it runs once the tasks ready now have run, so those
            # that arrive with this one join its group (and the loop serves meanwhile,
            # even between back-to-back transactions committed on its own thread).
            self._committer = asyncio.create_task(self._commit_next())
        try:
            # Not shielded (a shield costs a future and a callback per call): a cancel
            # cancels the member's future, and the group resolves its replacement.
            return cast(T, await member.future)
        except asyncio.CancelledError:
            if not member.taken:
                self._queue.remove(member)
                raise
            if member.future.cancelled():  # by this cancel: its group has not ended
                member.future = loop.create_future()
            while not member.future.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([member.future])
            raise

    async def _commit_next(self) -> None:
        """Wait for the writer, then commit everything queued by then as one group."""
        writing = self._writing
        members: list[_Member] = []
        try:
            async with writing.holding():
                members, self._queue = self._queue, []
                self._committer = None  # later arrivals form the next group
                for member in members:
                    member.taken = True
                if members:
                    await self._commit(members)
        except BaseException as error:
            for member in members:
                if member.future.done():
                    continue
                if isinstance(error, asyncio.CancelledError):
                    member.future.cancel()
                else:
                    member.future.set_exception(error)
            if self._committer is None and self._queue:
                self._committer = asyncio.create_task(self._commit_next())
            if not isinstance(error, Exception):
                raise

    @property
    def _writer(self) -> ThreadedWriter:
        writer = self._writing.writer.threaded
        assert writer is not None  # transactions are grouped only where there is a thread
        return writer

    async def _commit(self, members: list[_Member]) -> None:
        writing = self._writing
        try:
            try:
                if not self._budget.fits or self._full:
                    raise WouldWait
                # Other connections' commits are caught up before the write lock is taken,
                # not holding it (the pragma is read on this thread: no hop); only those
                # that land between this look and BEGIN are caught up under the lock.
                seen = await writing.storage.version()
                if seen != writing.version:
                    await writing.catch_up(seen)
                self._run_inline(members, writing.version, wait=False)
            except WouldWait:  # on the writer's thread then, where BEGIN may wait
                await self._commit_on_thread(members, writing.version)
            except OthersCommitted as others:
                # Begun on the loop's thread, holding the write lock: catch up there (the
                # read runs inline) and run the group there too, with no hop meanwhile.
                await writing.catch_up(others.version)
                self._run_inline(members, None)
        except BaseException:
            await writing.writer.rollback()  # begun, then caught up or cancelled: not run
            raise
        for member in members:
            if member.error is not None:
                member.future.set_exception(member.error)
            else:
                member.future.set_result(member.result)

    def _run_inline(self, members: list[_Member], version: int | None, wait: bool = True) -> None:
        """The group on the event loop's thread (begun already if ``version`` is None)."""
        self._budget.note(_run_group(self._writer.inline, self._writing, members, version, wait))
        self.inline += 1
        self._committed(members)

    async def _commit_on_thread(self, members: list[_Member], version: int | None) -> None:
        writing = self._writing
        while True:
            try:
                # One hop: BEGIN, every member and COMMIT, unless another writer committed
                # since the producer last looked (it catches up first).
                with writing.waiting_to_begin():  # _run_group ends it, holding the lock
                    cost = await to_the_end(
                        self._writer.run_blocking(_run_group, writing, members, version),
                        lambda: self._committed(members),
                    )
                self._budget.note(cost)
                return
            except OthersCommitted as others:
                # Holding the write lock now: caught up, a short group runs here, not
                # after another hop (a COMMIT that waits for an fsync goes back there).
                await writing.catch_up(others.version)
                if self._budget.fits and not self._full:
                    self._run_inline(members, None)
                    return
                version = None

    def _committed(self, members: list[_Member]) -> None:
        """Hand the members' records to the log, as one transaction's: subscribers are
        woken once per group."""
        self.groups += 1
        committed = [member.pending for member in members if member.pending is not None]
        self.members += len(committed)
        if committed:
            group, *later = committed
            for pending in later:
                group.absorb(pending)
            self._writing.after_blocking_commit(group)


def _run_group(
    writer: BlockingWriter,
    writing: Writing,
    members: list[_Member],
    version: int | None,
    wait: bool = True,
) -> float:
    """BEGIN (unless ``version`` is None: begun already), each member in its savepoint,
    COMMIT; returns the seconds it took from BEGIN. Raises (after ROLLBACK) if the group failed
    whole; ``wait=False``: ``WouldWait`` if BEGIN would wait for another's write lock."""
    if version is not None:
        seen = writer.begin(wait)
        if seen is not None and seen != version:
            raise OthersCommitted(seen)
    writing.beginning = None  # holding the write lock: nobody else commits now
    started = time.perf_counter()  # waiting for the write lock is no cost of the group's
    alone = len(members) == 1
    carried: dict[str, Appending] = {}  # each stream as the members so far left it
    try:
        for member in members:
            pending = Pending(writing, carried)
            tx = BlockingTransaction(writing, writer, pending)
            if not alone:
                writer.savepoint()
            try:
                member.result = tx.run_member(member.fn, member.args)
            except BaseException as error:
                if alone:
                    raise
                member.error = error
                try:
                    writer.rollback_to_savepoint()
                except Exception:
                    # The error ended the whole transaction (a full disk, an I/O error),
                    # taking the members before it: the group fails as one.
                    raise error from None
            else:
                member.pending = pending
                carried.update(pending.streams)
            if not alone:
                writer.release_savepoint()
        _insert_buffered(writer, members)
        writer.commit()
    except BaseException:
        writer.rollback()
        raise
    return time.perf_counter() - started


def _insert_buffered(writer: BlockingWriter, members: list[_Member]) -> None:
    """The records the members that stayed left buffered: one insert for the group."""
    rows: list[LogRow] = []
    times: list[TimeRow] = []
    epochs: list[EpochRow] = []
    for member in members:
        if member.pending is not None:
            member_rows, member_times, member_epochs = member.pending.take_inserts(closing=True)
            rows += member_rows
            times += member_times
            epochs += member_epochs
    if rows or times or epochs:
        writer.insert(rows, times, epochs)
