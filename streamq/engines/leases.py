"""A consumer group's rows in the consumer's database, written once for both engines.

``membership`` decides; this runs its decisions on a DB-API connection of the member's
own (blocking: ``group_consumer.GroupConsumer`` calls it on a thread, a few times a second). The
statements are written with ``?`` placeholders; each engine's subclass
(``engines/*/leases.py``) gives its connection, its clock, how a write transaction
begins, and the liveness lock that dies with the member's process.

Four tables: ``streamq_groups`` (one row per group: its split and the version of these
tables), ``streamq_members`` (one row per member, renewed while it runs),
``streamq_leases`` (one row per share: its holder and take counter) and
``streamq_floors`` (what earlier splits applied: ``resharing.Floors``, per producer).
``reshare`` moves a running group to another split (``resharing.plan_online``).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from typing import Any, ClassVar, NamedTuple

from ..consumer.resharing import Floors, OnlineMove, StoredPosition, plan_online
from ..errors import GroupSpecError
from ..groups.membership import LEASES_VERSION, Lease, Member, View

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS streamq_groups (
        name TEXT NOT NULL,
        stream TEXT NOT NULL,
        shares INTEGER NOT NULL,
        version INTEGER NOT NULL,      -- of these tables: a newer one is refused
        tokens BIGINT NOT NULL,        -- the last lease token given: each take's is new
        PRIMARY KEY (name, stream)
    )""",
    """CREATE TABLE IF NOT EXISTS streamq_members (
        name TEXT NOT NULL,
        stream TEXT NOT NULL,
        member BIGINT NOT NULL,        -- random, also the key of its liveness lock
        expires_at BIGINT NOT NULL,    -- ms since the Unix epoch, by the database's clock
        host TEXT,                     -- where its process runs (for people: streamq groups)
        pid BIGINT,                    -- its process id there
        PRIMARY KEY (name, stream, member)
    )""",
    """CREATE TABLE IF NOT EXISTS streamq_leases (
        name TEXT NOT NULL,
        stream TEXT NOT NULL,
        share INTEGER NOT NULL,
        member BIGINT,                 -- its holder (NULL: given back)
        token BIGINT NOT NULL,         -- new at every take (even across splits): the fence
        taken_at BIGINT,               -- ms since the Unix epoch: its holder's take
        PRIMARY KEY (name, stream, share)
    )""",
    """CREATE TABLE IF NOT EXISTS streamq_floors (
        name TEXT NOT NULL,
        stream TEXT NOT NULL,
        producer_id TEXT NOT NULL,
        floors TEXT NOT NULL,          -- JSON [[n, [seq of share 0, ...]], ...]: resharing
        PRIMARY KEY (name, stream, producer_id)
    )""",
)
_GROUP = "name = ? AND stream = ?"
# Columns added after the first release, added to tables made before them (by the first
# member to join; a streamq before them leaves them NULL): (table, column, type).
_ADDED = (
    ("streamq_leases", "taken_at", "BIGINT"),
    ("streamq_members", "host", "TEXT"),
    ("streamq_members", "pid", "BIGINT"),
)


class Inspection(NamedTuple):
    """A group's rows as an operator reads them (``LeaseTable.inspect``)."""

    view: View
    positions: list[tuple[Any, ...]]  # (consumer, producer id, seq, endpoint, updated_at)
    parked: dict[str, int]  # records parked, by share name
    taken: dict[int, int]  # when each held share was taken (ms, the database's clock)
    processes: dict[int, tuple[str | None, int | None]]  # member -> (host, pid)


class LeaseTable:
    """One member's connection to its group's rows. Not thread-safe: one call at a time."""

    NOW: ClassVar[str]  # the database's clock in ms since the Unix epoch, as SQL
    FOR_UPDATE: ClassVar[str] = ""  # appended to reads of rows a transaction then changes

    def __init__(self, db: str, name: str, stream: str) -> None:
        self.db = db
        self.name = name
        self.stream = stream
        self.where = db
        self.member = secrets.randbelow((1 << 62) - 1) + 1
        self._conn: Any = None

    # --- what each engine gives ------------------------------------------------

    def _connect(self) -> Any:
        """A DB-API connection in autocommit mode."""
        raise NotImplementedError

    def _begin(self) -> None:
        """Begin a transaction that writes (SQLite: takes the write lock at once)."""
        self._execute("BEGIN")

    def _hold_liveness(self) -> None:
        """Take this member's liveness lock, held until ``close`` or the process ends."""
        raise NotImplementedError

    def _alive(self, members: list[int]) -> set[int]:
        """Of ``members``, those whose liveness lock is held."""
        raise NotImplementedError

    def _release_liveness(self) -> None:
        raise NotImplementedError

    def _create_tables(self) -> None:
        for statement in SCHEMA:
            self._execute(statement)
        self._add_columns()

    def _add_columns(self) -> None:
        """The columns of ``_ADDED`` a table made before them lacks (until then a lease
        shows no age, a member no host or pid)."""
        for table, column, kind in _ADDED:
            if not self._has(table, column):
                try:
                    self._execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
                except Exception:
                    if not self._has(table, column):  # else another member added it meanwhile
                        raise

    def _has(self, table: str, column: str) -> bool:
        """Whether ``table`` has ``column`` (autocommit: a failed read leaves no transaction
        to roll back)."""
        try:
            self._execute(f"SELECT {column} FROM {table} WHERE 1 = 0").fetchall()
        except Exception:
            return False
        return True

    def _sql(self, sql: str) -> str:
        return sql

    # --- the rows ------------------------------------------------------------

    def _execute(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        cursor = self._conn.cursor()
        cursor.execute(self._sql(sql), params)
        return cursor

    def _one(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        return self._execute(sql, params).fetchone()

    def _transaction(self, body: Any) -> Any:
        self._begin()
        try:
            result = body()
        except BaseException:
            self._execute("ROLLBACK")
            raise
        self._execute("COMMIT")
        return result

    def join(self, shares: int | None, ttl_ms: int) -> int:
        """Become a member (tables made if missing); the group's split. ``shares`` must
        match the stored split, or make the group if there is none."""
        self._conn = self._connect()
        try:
            self._create_tables()
            self._hold_liveness()
        except BaseException:
            self.close()
            raise

        def body() -> int:
            if shares is not None:  # made by the first member, with its split
                self._execute(
                    "INSERT INTO streamq_groups (name, stream, shares, version, tokens) "
                    "VALUES (?, ?, ?, ?, 0) ON CONFLICT DO NOTHING",
                    (*self._key, shares, LEASES_VERSION),
                )
            row = self._one(f"SELECT shares, version FROM streamq_groups WHERE {_GROUP}", self._key)
            if row is None:
                raise GroupSpecError(
                    f"consumer group {self.name!r} on stream {self.stream!r} does not exist "
                    f"in {self.where}: give shares= to make it"
                )
            stored, version = int(row[0]), int(row[1])
            if version > LEASES_VERSION:
                raise GroupSpecError(
                    f"the group tables in {self.where} are version {version}, written by a "
                    f"newer streamq; this one reads up to version {LEASES_VERSION}: upgrade "
                    "streamq on this worker"
                )
            if shares is not None and shares != stored:
                raise GroupSpecError(
                    f"consumer group {self.name!r} on stream {self.stream!r} is split into "
                    f"{stored} shares in {self.where}, and this worker asks for {shares}: "
                    f"start it with shares={stored} (or none: the stored split), or change "
                    "the split with `streamq reshare`"
                )
            self._execute(
                "INSERT INTO streamq_members (name, stream, member, expires_at, host, pid) "
                f"VALUES (?, ?, ?, {self.NOW} + ?, ?, ?)",
                (*self._key, self.member, ttl_ms, socket.gethostname(), os.getpid()),
            )
            return stored

        try:
            return int(self._transaction(body))
        except BaseException:
            self.close()
            raise

    @property
    def _key(self) -> tuple[str, str]:
        return (self.name, self.stream)

    def renew(self, ttl_ms: int) -> bool:
        """Push this member's expiry ``ttl_ms`` ahead; False if its row is gone (the others
        saw it dead: it must leave and join again)."""
        cursor = self._execute(
            f"UPDATE streamq_members SET expires_at = {self.NOW} + ? WHERE {_GROUP} AND member = ?",
            (ttl_ms, *self._key, self.member),
        )
        return int(cursor.rowcount) == 1

    def view(self) -> View:
        """The group's rows now, with each member's liveness."""
        row = self._one(f"SELECT shares, {self.NOW} FROM streamq_groups WHERE {_GROUP}", self._key)
        if row is None:
            raise GroupSpecError(
                f"consumer group {self.name!r} on stream {self.stream!r} was removed from "
                f"{self.where}"
            )
        shares, now = int(row[0]), int(row[1])
        rows = self._execute(
            f"SELECT member, expires_at FROM streamq_members WHERE {_GROUP}", self._key
        ).fetchall()
        alive = self._alive([int(member) for member, _ in rows])
        members = tuple(Member(int(m), int(e), int(m) in alive) for m, e in rows)
        leases = tuple(
            Lease(int(share), None if member is None else int(member), int(token))
            for share, member, token in self._execute(
                f"SELECT share, member, token FROM streamq_leases WHERE {_GROUP}", self._key
            ).fetchall()
        )
        return View(shares, members, leases, now)

    def inspect(self) -> Inspection:
        """The group's rows as an operator reads them (``streamq groups``), changing
        nothing of theirs: its view, each member's liveness asked of its lock; the positions
        stored under its shares' names; how many records each share parked; when each held
        share was taken and where each member runs (tables older than those columns: none).
        Opens and closes a connection of its own."""
        self._conn = self._connect()
        try:
            self._hold_liveness()  # a lock of its own, to ask for the members' locks
            view = self.view()
            taken: dict[int, int] = {}
            if self._has("streamq_leases", "taken_at"):
                taken = {
                    int(share): int(at)
                    for share, at in self._execute(
                        f"SELECT share, taken_at FROM streamq_leases WHERE {_GROUP} "
                        "AND member IS NOT NULL AND taken_at IS NOT NULL",
                        self._key,
                    ).fetchall()
                }
            processes: dict[int, tuple[str | None, int | None]] = {}
            if self._has("streamq_members", "pid"):
                processes = {
                    int(member): (host, None if pid is None else int(pid))
                    for member, host, pid in self._execute(
                        f"SELECT member, host, pid FROM streamq_members WHERE {_GROUP}",
                        self._key,
                    ).fetchall()
                }
            prefix = (self.stream, f"{self.name}[", f"{self.name}[")
            positions = self._execute(
                "SELECT consumer, producer_id, seq, endpoint, updated_at FROM streamq_positions "
                "WHERE stream = ? AND substr(consumer, 1, length(?)) = ? "
                "ORDER BY consumer, producer_id",
                prefix,
            ).fetchall()
            parked = self._execute(
                "SELECT consumer, count(*) FROM streamq_dead_letters "
                "WHERE stream = ? AND substr(consumer, 1, length(?)) = ? GROUP BY consumer",
                prefix,
            ).fetchall()
        finally:
            self.close()
        parked_by = {str(c): int(n) for c, n in parked}
        return Inspection(view, [tuple(row) for row in positions], parked_by, taken, processes)

    def groups(self) -> list[tuple[str, str]]:
        """Every group in the database (name, stream), read only."""
        self._conn = self._connect()
        try:
            rows = self._execute("SELECT name, stream FROM streamq_groups ORDER BY 1, 2").fetchall()
        finally:
            self.close()
        return [(str(name), str(stream)) for name, stream in rows]

    def take(self, lease: Lease) -> int | None:
        """Take the free share ``lease`` as read; its new token, or None if the row moved
        since, its holder is alive after all, or this member itself is no longer one."""
        key = (*self._key, lease.share)

        def body() -> int | None:
            # The group's row first, as ``reshare`` locks it before the leases: one order.
            self._execute(
                f"UPDATE streamq_groups SET tokens = tokens + 1 WHERE {_GROUP}", self._key
            )
            me = self._one(
                f"SELECT 1 FROM streamq_members WHERE {_GROUP} AND member = ? "
                f"AND expires_at > {self.NOW}",
                (*self._key, self.member),
            )
            if me is None:
                return None
            row = self._one(
                f"SELECT member, token FROM streamq_leases WHERE {_GROUP} AND share = ?"
                + self.FOR_UPDATE,
                key,
            )
            if row is None:
                if lease.token != 0:
                    return None
                inserted = self._execute(
                    "INSERT INTO streamq_leases (name, stream, share, member, token) "
                    "VALUES (?, ?, ?, ?, 0) ON CONFLICT DO NOTHING",
                    (*key, self.member),
                )
                if inserted.rowcount != 1:
                    return None
            else:
                holder, token = row[0], int(row[1])
                if token != lease.token or holder != lease.member:
                    return None
                if holder is not None:
                    found = self._one(
                        f"SELECT expires_at, {self.NOW} FROM streamq_members "
                        f"WHERE {_GROUP} AND member = ?",
                        (*self._key, holder),
                    )
                    if found is not None:
                        member = Member(holder, int(found[0]), bool(self._alive([holder])))
                        if member.alive(int(found[1])):
                            return None
                    # Seen dead: its row goes, so it must join again to take anything.
                    self._execute(
                        f"DELETE FROM streamq_members WHERE {_GROUP} AND member = ?",
                        (*self._key, holder),
                    )
            # A token never given before, in this group: a fence of an earlier split's
            # lease on the same share number cannot match it.
            (new,) = self._one(f"SELECT tokens FROM streamq_groups WHERE {_GROUP}", self._key)
            self._execute(
                f"UPDATE streamq_leases SET member = ?, token = ?, taken_at = {self.NOW} "
                f"WHERE {_GROUP} AND share = ?",
                (self.member, new, *key),
            )
            return int(new)

        result = self._transaction(body)
        return None if result is None else int(result)

    def give_back(self, share: int, token: int) -> None:
        """Release a share this member holds under ``token`` (nothing if it moved)."""
        self._execute(
            f"UPDATE streamq_leases SET member = NULL WHERE {_GROUP} AND share = ? "
            "AND member = ? AND token = ?",
            (*self._key, share, self.member, token),
        )

    def leave(self) -> None:
        """Give back every share and remove this member's row; then ``close``."""
        try:
            if self._conn is not None:

                def body() -> None:
                    self._execute(
                        f"UPDATE streamq_leases SET member = NULL WHERE {_GROUP} AND member = ?",
                        (*self._key, self.member),
                    )
                    self._execute(
                        f"DELETE FROM streamq_members WHERE {_GROUP} AND member = ?",
                        (*self._key, self.member),
                    )

                self._transaction(body)
        finally:
            self.close()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        try:
            self._release_liveness()
        finally:
            if conn is not None:
                conn.close()

    def floors(self) -> dict[str, Floors]:
        """What earlier splits of the group applied, by producer id (``resharing``)."""
        rows = self._execute(
            f"SELECT producer_id, floors FROM streamq_floors WHERE {_GROUP}", self._key
        ).fetchall()
        return {str(producer): _floors(text) for producer, text in rows}

    def reshare(self, shares: int) -> list[OnlineMove] | None:
        """Move every group named ``name`` (each of its streams) to ``shares`` shares while
        it runs, in one transaction; None if there is no such group (``resharing``)."""
        if self._conn is None:
            self._conn = self._connect()
        try:
            return self._transaction(lambda: self._reshare(shares))  # type: ignore[no-any-return]
        finally:
            self.close()

    def _reshare(self, shares: int) -> list[OnlineMove] | None:
        groups = self._execute(
            "SELECT stream, shares, version FROM streamq_groups WHERE name = ?" + self.FOR_UPDATE,
            (self.name,),
        ).fetchall()
        if not groups:
            return None
        moves: list[OnlineMove] = []
        prefix = self.name + "["
        for stream, before, version in groups:
            if int(version) > LEASES_VERSION:
                raise GroupSpecError(
                    f"the group tables in {self.where} are version {version}, written by a "
                    f"newer streamq; this one reads up to version {LEASES_VERSION}"
                )
            key = (self.name, stream)
            # Every batch being applied under a lease ends first (PostgreSQL: it holds its
            # lease row), and none commits under the old split after this transaction.
            self._execute(f"SELECT share FROM streamq_leases WHERE {_GROUP}" + self.FOR_UPDATE, key)
            rows = self._execute(
                "SELECT consumer, producer_id, stream, seq, coalesce(epoch, 0), endpoint "
                "FROM streamq_positions WHERE stream = ? "
                "AND (consumer = ? OR substr(consumer, 1, ?) = ?)" + self.FOR_UPDATE,
                (stream, self.name, len(prefix), prefix),
            ).fetchall()
            stored = {
                (str(p), str(s)): _floors(text)
                for p, s, text in self._execute(
                    f"SELECT producer_id, stream, floors FROM streamq_floors WHERE {_GROUP}", key
                ).fetchall()
            }
            planned = plan_online(
                self.name, int(before), shares, [StoredPosition(*row) for row in rows], stored
            )
            now = int(time.time() * 1000)
            for move in planned:
                for name in move.old:
                    self._execute(
                        "DELETE FROM streamq_positions WHERE consumer = ? AND producer_id = ? "
                        "AND stream = ?",
                        (name, move.producer_id, move.stream),
                    )
                for name in move.new:
                    self._execute(
                        "INSERT INTO streamq_positions (consumer, producer_id, stream, seq, "
                        "epoch, endpoint, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (name, move.producer_id, move.stream, move.seq, move.epoch,
                         move.endpoint, now),
                    )  # fmt: skip
                self._execute(
                    f"DELETE FROM streamq_floors WHERE {_GROUP} AND producer_id = ?",
                    (*key, move.producer_id),
                )
                self._execute(
                    "INSERT INTO streamq_floors (name, stream, producer_id, floors) "
                    "VALUES (?, ?, ?, ?)",
                    (*key, move.producer_id, json.dumps(move.floors.splits)),
                )
            self._execute(f"UPDATE streamq_groups SET shares = ? WHERE {_GROUP}", (shares, *key))
            self._execute(f"DELETE FROM streamq_leases WHERE {_GROUP}", key)  # fences them all
            moves += planned
        return moves


def _floors(text: str) -> Floors:
    return Floors(tuple((int(n), tuple(int(s) for s in seqs)) for n, seqs in json.loads(text)))
