"""What both systems' group members share: the keys, the records' values, the table of
applied records in the one SQLite consumer database, and the checks read from it."""

from __future__ import annotations

import contextlib
import sqlite3
from collections import Counter
from collections.abc import Iterator
from typing import Any

from ..common import Reporting
from ..latency import DUE, record_value

STREAM = "events"  # streamq's stream; Kafka's topic is named per run
GROUP = "appliers"  # the group's name: streamq's consumer name, Kafka's group.id
KEYS = 1000
SHARES = 4  # streamq's split, Kafka's partitions: one per member, no standby

# One row per record applied, in commit order (n). ``part``: the share (streamq) or the
# partition (Kafka) it came from; ``published_at``: the record's due time on the
# producer's schedule; ``applied_at``: time.time() in the applying transaction.
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS applied (n INTEGER PRIMARY KEY, seq INTEGER NOT NULL, "
    "key BLOB NOT NULL, part INTEGER NOT NULL, pid INTEGER NOT NULL, "
    "published_at REAL NOT NULL, applied_at REAL NOT NULL)",
    "CREATE INDEX IF NOT EXISTS applied_by_time ON applied (applied_at)",
    # Kafka's positions, stored with the effects: {partition: next offset}.
    "CREATE TABLE IF NOT EXISTS offsets (part INTEGER PRIMARY KEY, next INTEGER NOT NULL)",
)
INSERT = (
    "INSERT INTO applied (seq, key, part, pid, published_at, applied_at) VALUES (?, ?, ?, ?, ?, ?)"
)


def key_of(n: int) -> bytes:
    """Record n's key: the keys in turn, each once a second at 1,000 records/s."""
    return b"key-%d" % (n % KEYS)


def value_of(n: int, due: float) -> bytes:
    return record_value(due, n)


def due_of(value: bytes) -> float:
    due: float = DUE.unpack_from(value)[0]
    return due


def number_of(value: bytes) -> int:
    """The record's number on the producer's schedule (Kafka's seq: streamq's is the log's)."""
    number: int = DUE.unpack_from(value)[1]
    return number


def create(db: str) -> None:
    """A fresh consumer database in WAL mode, with the table both systems apply into."""
    with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        for statement in SCHEMA:
            conn.execute(statement)


@contextlib.contextmanager
def reading(db: str) -> Iterator[sqlite3.Connection]:
    """A connection of the driver's, reading while the members write (WAL)."""
    with contextlib.closing(sqlite3.connect(db, isolation_level=None, timeout=30)) as conn:
        yield conn


def first_applied_after(
    conn: sqlite3.Connection, after: float, parts: list[int], not_by: int
) -> float | None:
    """The earliest applied_at after ``after`` of a record of ``parts`` applied by a
    process other than ``not_by`` (None: none yet)."""
    marks = ", ".join("?" * len(parts))
    (at,) = conn.execute(
        f"SELECT min(applied_at) FROM applied WHERE applied_at > ? AND part IN ({marks}) "
        "AND pid != ?",
        (after, *parts, not_by),
    ).fetchone()
    return None if at is None else float(at)


def applied_count(conn: sqlite3.Connection) -> int:
    (count,) = conn.execute("SELECT count(DISTINCT seq) FROM applied").fetchone()
    return int(count)


def check(conn: sqlite3.Connection, head: int) -> dict[str, Any]:
    """Records 1..head each applied once, each key's in seq order: what exactly-once in
    key order means, counted from the table."""
    times: Counter[int] = Counter()
    last: dict[bytes, int] = {}
    out_of_order = 0
    for seq, key in conn.execute("SELECT seq, key FROM applied ORDER BY n"):
        times[seq] += 1
        if last.get(key, 0) > seq:
            out_of_order += 1
        last[key] = max(seq, last.get(key, 0))
    return {
        "records": head,
        "rows": sum(times.values()),
        "duplicates": sum(count - 1 for count in times.values() if count > 1),
        "lost": sum(1 for seq in range(1, head + 1) if seq not in times),
        "unknown": sum(1 for seq in times if not 1 <= seq <= head),
        "out_of_order": out_of_order,
    }


def passed(checks: dict[str, Any]) -> bool:
    return not (
        checks["duplicates"] or checks["lost"] or checks["unknown"] or checks["out_of_order"]
    )


# --- the driver's view of the members ---------------------------------------------------

WAIT = 120.0  # s, the bound on every wait of a run


def held(member: Reporting) -> list[int]:
    """The shares (partitions) a member last said it holds (its ``HELD`` line)."""
    fields = member.last("HELD")
    return [int(s) for s in fields[0].split(",")] if fields else []


def balanced(members: list[Reporting], shares: int) -> bool:
    """Every share held once, by live members holding as many as each other, give or take
    one."""
    live = [held(m) for m in members if m.alive]
    counts = [len(h) for h in live]
    return sorted(s for h in live for s in h) == list(range(shares)) and (
        max(counts) - min(counts) <= 1
    )
